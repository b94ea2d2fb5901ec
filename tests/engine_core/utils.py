"""Factories for scheduler tests (in the spirit of vLLM's tests/v1/core/utils.py)."""

from __future__ import annotations

import itertools

from engine_core.config import CacheConfig, LoRAConfig, SchedulerConfig
from engine_core.outputs import ModelRunnerOutput
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_core.sched.output import SchedulerOutput
from engine_core.sched.scheduler import Scheduler

EOS_TOKEN_ID = 50000
_ids = itertools.count()


def create_scheduler(max_num_seqs: int = 16, max_num_batched_tokens: int = 8192,
                     max_num_scheduled_tokens: int | None = None, max_model_len: int | None = None,
                     enable_chunked_prefill: bool = True, long_prefill_token_threshold: int = 0,
                     max_num_partial_prefills: int = 1, max_long_partial_prefills: int = 1,
                     policy: str = "fcfs", block_size: int = 16, num_blocks: int = 10000,
                     enable_prefix_caching: bool = True, log_stats: bool = True,
                     include_finished_set: bool = False, num_spec_tokens: int = 0,
                     max_loras: int = 0, sliding_window: int | None = None,
                     long_rope_after: int | None = None, num_offload_blocks: int = 0,
                     max_tokens_per_mm_item: int = 0, num_recurrent_state_slots: int = 0) -> Scheduler:
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_num_scheduled_tokens=max_num_scheduled_tokens,
        max_model_len=max_model_len if max_model_len is not None else max(max_num_batched_tokens, 8192),
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        max_num_partial_prefills=max_num_partial_prefills,
        max_long_partial_prefills=max_long_partial_prefills, policy=policy)
    cache_config = CacheConfig(block_size=block_size, num_blocks=num_blocks,
                               enable_prefix_caching=enable_prefix_caching, sliding_window=sliding_window,
                               long_rope_after=long_rope_after, num_offload_blocks=num_offload_blocks,
                               num_recurrent_state_slots=num_recurrent_state_slots)
    return Scheduler(scheduler_config, cache_config, log_stats=log_stats,
                     include_finished_set=include_finished_set, num_spec_tokens=num_spec_tokens,
                     lora_config=LoRAConfig(max_loras=max_loras) if max_loras else None,
                     max_tokens_per_mm_item=max_tokens_per_mm_item)


def create_requests(num_requests: int, num_tokens: int = 10, max_tokens: int = 16,
                    prefix: list[int] | None = None, same_prompt: bool = False, **kwargs) -> list[Request]:
    requests = []
    prefix = prefix or []
    for i in range(num_requests):
        n = next(_ids)
        body = [(j + (0 if same_prompt else 1000 * (n + 1))) % 40000 for j in range(num_tokens - len(prefix))]
        sampling_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in SamplingParams.__dataclass_fields__}
        params = SamplingParams(max_tokens=max_tokens, **sampling_kwargs)
        requests.append(Request(request_id=f"req-{n}-{i}", prompt_token_ids=prefix + body, sampling_params=params,
                                eos_token_id=EOS_TOKEN_ID, **kwargs))
        kwargs = dict(kwargs)
    return requests


def fake_model_output(scheduler: Scheduler, scheduler_output: SchedulerOutput, token_id: int = 7,
                      tokens: dict[str, int] | None = None) -> ModelRunnerOutput:
    """One token for each request whose prefill completes this pass; [] for a mid-prefill chunk."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        done = request is not None and request.num_computed_tokens >= request.num_tokens
        sampled.append([tokens.get(req_id, token_id) if tokens else token_id] if done else [])
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=sampled)


def step(scheduler: Scheduler, token_id: int = 7, tokens: dict[str, int] | None = None):
    scheduler_output = scheduler.schedule()
    outputs = scheduler.update_from_output(scheduler_output,
                                           fake_model_output(scheduler, scheduler_output, token_id, tokens))
    return scheduler_output, outputs
