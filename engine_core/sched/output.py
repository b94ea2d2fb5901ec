"""What one scheduling pass hands to the workers (engine -> worker boundary)."""

from __future__ import annotations

import msgspec

from engine_core.multimodal import MultiModalFeature
from engine_core.outputs import LoRARequest
from engine_core.prompt_embeds import PromptEmbeds
from engine_core.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True):
    """A request the workers have not seen (or must replace in full): sent whole."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    # Tokens already in the KV cache (prefix hit) before this pass.
    num_computed_tokens: int
    # The tail of prompt_token_ids that are outputs (penalties count them). The scheduler folds a
    # continued streaming session's earlier outputs into its prompt, so it sends none.
    output_token_ids: list[int] = msgspec.field(default_factory=list)
    # The request's own EOS id: masked (with stop ids) while it is short of min_tokens.
    eos_token_id: int | None = None
    # The LoRA adapter the workers apply to this request's tokens (None: the base model).
    lora_request: LoRARequest | None = None
    # A prompt given as embeddings: the rows the model takes in place of its placeholder tokens.
    prompt_embeds: PromptEmbeds | None = None
    # A prompt's images: their placeholders' positions and encoder inputs.
    mm_features: list[MultiModalFeature] | None = None
    # Under the hybrid KV cache manager: the request's blocks in each KV cache group after group 0's
    # (``block_ids``), at the same positions (a windowed group's released ones read 0); else empty.
    group_block_ids: list[list[int]] = msgspec.field(default_factory=list)


class CachedRequestData(msgspec.Struct, array_like=True):
    """Requests the workers already know, as diffs. All lists are aligned with ``req_ids``."""

    req_ids: list[str] = msgspec.field(default_factory=list)
    resumed_from_preemption: list[bool] = msgspec.field(default_factory=list)
    # Running requests: exactly the tokens scheduled this pass (a decode's last sampled token, or
    # the next prefill chunk). Resumed requests: all their token ids, since the workers dropped them.
    new_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    # Blocks appended to the request this pass (for resumed requests: the whole table); None if none.
    new_block_ids: list[list[int] | None] = msgspec.field(default_factory=list)
    num_computed_tokens: list[int] = msgspec.field(default_factory=list)
    # For resumed requests: how many of new_token_ids are outputs (penalties need them).
    num_output_tokens: list[int] = msgspec.field(default_factory=list)
    # Under the hybrid KV cache manager, per request as new_block_ids: each further group's blocks
    # (NewRequestData.group_block_ids); empty without it.
    new_group_block_ids: list[list[list[int]] | None] = msgspec.field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


class GrammarBitmask(msgspec.Struct, array_like=True):
    """What the grammars of structured-output requests allow at each position the pass samples.
    Request ``request_ids[i]`` has ``num_rows[i]`` consecutive rows (vLLM's layout): 1 + its
    scheduled draft tokens, row 0 for the token after its last known one, row j for the token after
    its draft j. A row is ``num_words`` int32 (native byte order), bit t % 32 of word t // 32 set =
    token t allowed (xgrammar's layout)."""

    request_ids: list[str]
    num_words: int
    bitmask: bytes
    num_rows: list[int]


class SchedulerOutput(msgspec.Struct, array_like=True):
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens this pass processes for it; the join between schedule() and update_from_output().
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests finished (or aborted) since the previous pass: workers drop their state.
    finished_req_ids: set[str]
    # Requests preempted in this pass only: workers drop their state, blocks are already freed.
    preempted_req_ids: set[str]
    # What the grammars of the scheduled structured-output requests allow next (set by the engine
    # after schedule(); rows of requests that do not sample this pass go unused).
    grammar_bitmask: GrammarBitmask | None = None
    # req_id -> the draft tokens (speculative decoding) scheduled after its last known token; the
    # pass computes them with it and keeps those the target model agrees with.
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # KV offloading (engine_core/core/kv_offload.py): copies the workers make before the pass's
    # forward, stores first: (device block, host slot) saved, then (host slot, device block) loaded.
    kv_offload_stores: list[tuple[int, int]] = msgspec.field(default_factory=list)
    kv_offload_loads: list[tuple[int, int]] = msgspec.field(default_factory=list)
    # req_id -> indexes (into its mm_features) of the images the workers encode in this pass, before
    # the forward; their rows stay cached by identifier until named in free_encoder_mm_hashes.
    scheduled_encoder_inputs: dict[str, list[int]] = msgspec.field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = msgspec.field(default_factory=list)
    # Recurrent layers' states kept for the prefix cache (engine_core/core/recurrent_state_cache.py):
    # restores (req_id -> slot) copy a slot into the request's state row before the forward; saves
    # (req_id -> [(position, slot)], positions ascending, each past the request's start in this pass and
    # at most its end) copy its state after its first ``position`` tokens into the slot, where the
    # recurrent layers' scan passes it.
    recurrent_state_restores: dict[str, int] = msgspec.field(default_factory=dict)
    recurrent_state_saves: dict[str, list[tuple[int, int]]] = msgspec.field(default_factory=dict)

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData(), {}, 0, set(), set())
