"""Custom logits processors: vLLM v1's interface (``--logits-processors``, ``vllm_xargs``).

A logits processor is a class the engine loads at start (by name, as a class object, or from the
``llm_cluster.logits_processors`` entry-point group) and calls at every step on the batch's logits,
one row per request that samples a token. It keeps per-request state keyed by the request's row
(its index in the batch); ``update_state`` tells it, before each step, which requests joined, left
or moved (a ``BatchUpdate``), and ``apply`` rewrites the rows it cares about. A request turns a
processor on through ``SamplingParams.extra_args`` (the HTTP API's ``vllm_xargs``); the class
method ``validate_params`` refuses bad arguments when the request arrives (HTTP 400).

The methods, their order and ``BatchUpdate``'s fields are vLLM's
(``vllm.v1.sample.logits_processor``), so a processor written for vLLM ports by changing its imports.
One difference: the first constructor argument is a ``LogitsProcessorContext`` (the few engine
settings a processor may size itself by) instead of vLLM's ``VllmConfig``.

The batch (gpu_worker.logits_processor_batch) holds the requests that sample in a step: one that
is not sampled in a step (not scheduled, preempted, finished) leaves it, and joins again as added.
Processors run on TP rank 0, which samples. They do not run for embedding requests, nor on
engines that pool only or decode speculatively: processors named for those are refused at start,
and those of entry points are left out, as in vLLM.

This module holds the interface only (no torch: tensors are the worker's business).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from functools import partial
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

    from engine_core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Installed packages offer processors under this entry-point group; every one found is loaded.
LOGITS_PROCESSORS_GROUP = "llm_cluster.logits_processors"


class MoveDirectionality(Enum):
    # The request at the first index now sits at the second (the first is left empty).
    UNIDIRECTIONAL = auto()
    # The requests at the two indices trade places.
    SWAP = auto()


# A removed request's index.
RemovedRequest = int
# (index, params, prompt token ids, output token ids): the output ids are a list the engine keeps up
# to date (before each step's update_state it holds every token generated so far), so a processor
# may keep it and read the newest tokens at each step, as vLLM's.
AddedRequest = tuple[int, "SamplingParams", list[int] | None, list[int]]
# (from index, to index, directionality).
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the last step. Apply in this order: removed, added, moved (an
    added or moved request may take an index another request left)."""

    batch_size: int  # requests in the batch now (the logits' rows)
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


@dataclass(frozen=True)
class LogitsProcessorContext:
    """What a processor's constructor is told of its engine (vLLM passes its VllmConfig here)."""

    model: str  # the model's directory
    vocab_size: int  # the logits' columns
    max_num_seqs: int  # the most rows a batch has
    max_num_batched_tokens: int
    max_model_len: int


class LogitsProcessor(ABC):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError when a request's parameters (its ``extra_args``, mostly) are not
        acceptable to this processor: the request is refused with that message (HTTP 400)."""
        return None

    @abstractmethod
    def __init__(self, context: LogitsProcessorContext, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The batch's logits, [batch_size, vocab] float32, row i being the request at index i:
        return them changed (changing them in place is allowed)."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when the processor never changes which token has the largest logit: it is then
        applied only to batches with a random (temperature > 0) row, after the temperature."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before each step's ``apply``; ``batch_update`` is None when the batch did not
        change (the requests' output views still grew by a token each)."""
        raise NotImplementedError


State = TypeVar("State")


def process_dict_updates(entries: dict[int, State], batch_update: BatchUpdate | None,
                         new_state: Callable[[SamplingParams, Sequence[int] | None, Sequence[int]], State | None]
                         ) -> bool:
    """Keep a processor's ``{index: per-request state}`` in step with a batch update: a removed
    index is dropped, an added request gets ``new_state(params, prompt ids, output ids)`` (None:
    the processor leaves it alone), a moved one takes its state along. True when anything changed."""
    if batch_update is None:
        return False
    changed = False
    for index in batch_update.removed:
        changed |= entries.pop(index, None) is not None
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            entries[index] = state
            changed = True
        else:
            changed |= entries.pop(index, None) is not None
    for a, b, direction in batch_update.moved:
        at_a, at_b = entries.pop(a, None), entries.pop(b, None)
        if at_a is not None:
            entries[b] = at_a
            changed = True
        if at_b is not None:
            changed = True
            if direction is MoveDirectionality.SWAP:
                entries[a] = at_b
    return changed


# A per-request function of the older (vLLM v0) kind: (output ids, logits row) -> logits row, or
# (prompt ids, output ids, logits row) -> logits row.
RequestLogitsProcessor = Callable[..., "torch.Tensor"]


class AdapterLogitsProcessor(LogitsProcessor):
    """Runs a per-request function on each row of the requests that have one: subclass it, define
    ``new_req_logits_processor(params)`` (the request's function, or None) and
    ``is_argmax_invariant``. One call per row, so slower than a batched processor."""

    def __init__(self, context: LogitsProcessorContext, device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        raise NotImplementedError

    def _new_state(self, params: SamplingParams, prompt_ids: Sequence[int] | None, output_ids: Sequence[int]
                   ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        fn = self.new_req_logits_processor(params)
        if fn is None:
            return None
        if len(inspect.signature(fn).parameters) == 3:
            return partial(fn, prompt_ids, output_ids)
        return partial(fn, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, fn in self.req_info.items():
            logits[index] = fn(logits[index])
        return logits


LogitsProcessorSpec = str | type[LogitsProcessor]


def _import_class(name: str) -> Any:
    """``package.module:Class`` (``Outer.Inner`` after the colon) or ``package.module.Class``."""
    module_name, sep, qualname = name.partition(":")
    if not sep:
        module_name, _, qualname = name.rpartition(".")
    if not module_name or not qualname:
        raise ValueError(f"logits processor {name!r} is not a qualified class name (package.module:Class)")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception as e:  # (a module may fail to import in any way)
        raise ValueError(f"logits processor {name!r} cannot be loaded: {type(e).__name__}: {e}") from e
    return obj


def load_logits_processors(specs: Iterable[LogitsProcessorSpec], with_entry_points: bool = True
                           ) -> tuple[type[LogitsProcessor], ...]:
    """The processor classes to run: those of the installed packages' entry points, then ``specs``
    (class objects, or qualified names), each once. ValueError naming the one that is not a
    LogitsProcessor subclass or cannot be loaded."""
    found: list[tuple[str, Any]] = []
    if with_entry_points:
        for point in entry_points(group=LOGITS_PROCESSORS_GROUP):
            try:
                found.append((f"entry point {point.name!r} ({point.value})", point.load()))
            except Exception as e:
                raise ValueError(f"logits processor entry point {point.name!r} ({point.value}) cannot be "
                                 f"loaded: {e}") from e
    for spec in specs:
        found.append((repr(spec), _import_class(spec) if isinstance(spec, str) else spec))
    classes: list[type[LogitsProcessor]] = []
    for where, cls in found:
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ValueError(f"logits processor {where} is not a subclass of "
                             f"engine_core.logits_processor.LogitsProcessor")
        if inspect.isabstract(cls):
            raise ValueError(f"logits processor {where} is abstract: it leaves "
                             f"{', '.join(sorted(cls.__abstractmethods__))} undefined")
        if cls not in classes:
            classes.append(cls)
    if classes:
        logger.info("logits processors: %s", ", ".join(f"{c.__module__}.{c.__qualname__}" for c in classes))
    return tuple(classes)


def validate_request_params(classes: Sequence[type[LogitsProcessor]], params: SamplingParams) -> None:
    """Each processor's ``validate_params`` on a request's parameters: ValueError when one refuses
    them (any exception it raises counts as a refusal, named by its type when it is not a ValueError)."""
    for cls in classes:
        try:
            cls.validate_params(params)
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"{cls.__qualname__}.validate_params: {type(e).__name__}: {e}") from e
