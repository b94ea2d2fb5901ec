"""The scheduler's contract, as the engine core uses it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from engine_core.outputs import EngineCoreOutputs, ModelRunnerOutput, SchedulerStats
from engine_core.request import Request, RequestStatus
from engine_core.sched.output import SchedulerOutput


class SchedulerInterface(ABC):
    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Enter a request (create), or continue a live streaming-input session with the same id.

        Never allocates KV blocks and never fails for capacity: every capacity decision is in
        ``schedule``.
        """

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """First half of a pass: spend one token budget on running requests, then admissions."""

    @abstractmethod
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> dict[int, EngineCoreOutputs]:
        """Second half: fold sampled tokens into requests, stop and remove finished ones, and fan the
        outputs out by ``client_index``."""

    @abstractmethod
    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish (e.g. abort) requests wherever they are queued, freeing their KV blocks."""

    @abstractmethod
    def get_num_unfinished_requests(self) -> int: ...

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    @abstractmethod
    def make_stats(self) -> SchedulerStats | None: ...
