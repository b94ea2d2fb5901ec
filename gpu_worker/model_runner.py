"""ModelRunner: SchedulerOutput in, ModelRunnerOutput out, one flat batch per step.

Per step: fold the scheduler's diffs into the per-request state, lay every scheduled token out in
one flat batch (decodes first, then prefill chunks, each starting at its num_computed_tokens), run
the model once, compute logits only for requests whose known tokens are all in the cache after this
step, and sample one token for each of those. A request with draft tokens (speculative decoding)
has them laid out after its last token and gets logits at each; the rejection sampler keeps the
drafts the model agrees with, plus one token of its own. All per-token arrays are built with numpy.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Collection, Iterable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine_core.multimodal import MultiModalFeature
from engine_core.outputs import LogprobsEntry, ModelRunnerOutput
from engine_core.sampling_params import SamplingParams
from engine_core.sched.output import GrammarBitmask, SchedulerOutput
from engine_core.sleep_mode import check_sleep, wake_up_tags
from gpu_worker import distributed
from gpu_worker.attn_metadata import AttentionMetadata, Window, build_attention_metadata, compute_slot_mapping
from gpu_worker.config import ModelConfig
from gpu_worker.cpu_kernels import cpu_kernels_available
from gpu_worker.distributed import get_tp_rank
from gpu_worker.draft_model import DraftModel, PassInputs
from gpu_worker.encoder_metadata import EncoderMetadata
from gpu_worker.hidden_state_drafter import HiddenStateDrafter
from gpu_worker.kv_cache import FP8_DTYPES, allocate_kv_cache, allocate_layer_kv_caches, copy_kv_blocks
from gpu_worker.kv_cache_groups import KVCacheGrouping
from gpu_worker.layers.attention import PagedAttention
from gpu_worker.layers.mamba import MambaMixer2, MambaState, mamba_step_metadata
from gpu_worker.layers.rotary import longrope_rows
from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.logits_processor_batch import LogitsProcessorBatch
from gpu_worker.lora.layers import LORA_BASE
from gpu_worker.lora.manager import LoRAManager
from gpu_worker.models import build_model
from gpu_worker.models.llama import LlamaModel
from gpu_worker.models.mtp import mtp_config
from gpu_worker.mrope import mrope_positions, pass_positions
from gpu_worker.pooler_config import DENSE_ACTIVATIONS, PER_TOKEN_POOLING, DenseProjection, load_dense_weights
from gpu_worker.quantized_checkpoint import dequantized_weights
from gpu_worker.rejection_sampler import rejection_sample, rejection_sample_with_logits
from gpu_worker.request_state import RequestState, RequestStateAtDraft, RequestStates, reads_earlier_tokens
from gpu_worker.sampler import Sampler, SamplerOutput, SamplingMetadata, grammar_masked, token_logprobs
from gpu_worker.weights import iter_checkpoint, load_weights, read_by


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = np.full((len(rows), width), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out).to(device)

# An HF model directory, or (hf_name, tensor) pairs (e.g. from a converter).
WeightSource = str | Path | Iterable[tuple[str, WeightLike]]


class ModelRunner:
    def __init__(self, model_config: ModelConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, num_spec_tokens: int = 0,
                 max_lora_rank: int | None = None, max_resident_loras: int | None = None,
                 kv_cache_dtype: torch.dtype | None = None, max_cpu_loras: int | None = None,
                 max_logprobs: int = 20, logits_processors: LogitsProcessorBatch | None = None,
                 logprobs_mode: str = "raw_logprobs",
                 mamba_state_dtypes: tuple[torch.dtype, torch.dtype] | None = None,
                 num_recurrent_state_slots: int = 0, kv_cache_grouping: KVCacheGrouping | None = None) -> None:
        self.config = model_config
        # The hybrid KV cache manager: the attention layers keep their caches in these KV cache groups
        # (gpu_worker/kv_cache_groups.py; the loaded layers are checked against them).
        self.kv_cache_grouping = kv_cache_grouping
        self.device = torch.device(device)
        self.dtype = dtype
        # The KV cache's storage dtype (None: the model's); fp8 halves (bf16) or quarters (fp32) it.
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.max_model_len = max_model_len or model_config.max_context_len
        if self.max_model_len > model_config.max_context_len:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's context length "
                             f"({model_config.max_context_len})")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # The most logprobs a row may ask for (-1: the vocabulary): the memory profile ranks that many.
        self.max_logprobs = max_logprobs
        # Speculative decoding: a request may have this many draft tokens, each with its own logits row.
        self.num_spec_tokens = num_spec_tokens
        # Queries of up to this many tokens attend as decodes, a row per token, where the decode
        # kernel reads the cache in place (_decode_requests): a pass verifying drafts.
        self.decode_query_max = 1 + num_spec_tokens
        self.model: nn.Module | None = None
        self.attention_windows: frozenset[Window | None] = frozenset({None})
        self.rope_short_offset: int | None = None
        self.rope_original_len: int | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # The caches a block id is a page of (each layer's, or under the KV cache groups their shared
        # tensors, once each): what KV offloading copies.
        self.block_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # The recurrent mixers (Mamba, Mamba-2, Gated DeltaNet, short convolutions) and their states, a
        # row per held request (by its row of the block table), allocated beside the KV cache: the
        # conv and recurrent states' dtypes (None: the model's and fp32; --mamba-cache-dtype and
        # --mamba-ssm-cache-dtype).
        self.mamba_state_dtypes = mamba_state_dtypes or (dtype, torch.float32)
        self.mamba_mixers: list[MambaMixer2] = []
        self.mamba_states: list[MambaState] = []
        # The states the prefix cache keeps at block ends (--mamba-cache-mode align), in slots the
        # scheduler names (engine_core/core/recurrent_state_cache.py): one MambaState of that many rows
        # per mixer, beside the live ones; with speculative decoding num_spec_tokens more slots a live
        # row after those (_draft_state_slot: a request's states before each draft a pass verifies).
        self.num_recurrent_state_slots = num_recurrent_state_slots
        self.kept_states: list[MambaState] = []
        self.block_size = 0
        self.num_blocks = 0
        self.decode_in_place = False
        self.requests = RequestStates(model_config.eos_token_ids, self.device, self.dtype)
        # (--logprobs-mode: what the sampled tokens' logprobs are; prompt logprobs are always raw.)
        self.sampler = Sampler(logprobs_mode)
        # Custom logits processors (--logits-processors); None: the engine runs none.
        self.logits_processors = logits_processors
        # Speculative decoding's draft model, MTP layer or EAGLE head (methods draft_model, mtp,
        # eagle / eagle3; set by load_draft_model, load_mtp_drafter, load_eagle_drafter), and the last
        # pass's inputs, which it follows.
        self.drafter: DraftModel | None = None
        self._pass_inputs: PassInputs | None = None
        # KV offloading: the host-memory tier's blocks (each layer's K and V, as the cache's).
        self.num_offload_blocks = 0
        self.offload_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # LoRA (None: off): the projections are wrapped once the weights are loaded.
        self.max_lora_rank = max_lora_rank
        # Adapters on the device at once (None: all that are loaded); the rest wait in host memory.
        self.max_resident_loras = max_resident_loras
        # Adapters in host memory at once (None: all that are loaded); others are read again when needed.
        self.max_cpu_loras = max_cpu_loras
        self.lora: LoRAManager | None = None
        # An encoder's prompts attended in padded batches (None: on CUDA; the CPU attends one after another).
        self.encoder_batches_padded: bool | None = None
        # sentence-transformers Dense projections of pooled embeddings: (weight, bias, activation), fp32.
        self.dense: list[tuple[torch.Tensor, torch.Tensor | None, str]] = []
        # Sleep mode: what is released now ("weights", "kv_cache"), and how the weights were (1: moved
        # to host memory, 2: discarded).
        self.asleep: set[str] = set()
        self.sleep_level = 0
        # A vision-language model's encoder outputs by image identifier ([tokens_per_image, hidden]
        # each): made when the scheduler names an image, dropped when it says (vLLM's encoder cache).
        self.encoder_cache: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ setup

    def load_dense(self, model_dir: str | Path, projections: tuple[DenseProjection, ...]) -> None:
        """The embedding's sentence-transformers Dense projections, applied after the pooling."""
        self.dense = []
        for projection in projections:
            weight, bias = load_dense_weights(model_dir, projection)
            self.dense.append((weight.to(self.device, torch.float32),
                               None if bias is None else bias.to(self.device, torch.float32), projection.activation))

    def load_model(self, weights: WeightSource) -> None:
        """``weights``: an HF model directory, or (hf_name, tensor) pairs (e.g. from a converter)."""
        self.model = model = self._loaded_model(weights)
        # (Their states are bound with the KV cache, and profiled on throwaway ones.)
        self.mamba_mixers = model.mamba_layers() if hasattr(model, "mamba_layers") else []
        # The sliding windows the layers attend with (None: full attention): one metadata each per step.
        self.attention_windows = frozenset(layer.sliding_window for layer in model.attention_layers())
        if self.kv_cache_grouping is not None:
            self._check_kv_cache_grouping(model.attention_layers())
        # LongRoPE: where the short factors' rotary rows start, and the length above which they stop.
        rotary = getattr(model.model, "rotary_emb", None)  # (an encoder's positions are embedded)
        if rotary is not None:
            self.rope_short_offset, self.rope_original_len = rotary.short_offset, rotary.original_max_position
        if self.max_lora_rank is not None and self.config.encoder_only:
            raise ValueError(f"LoRA adapters are not served on encoder models ({self.config.architecture}); "
                             "drop --enable-lora")
        if self.max_lora_rank is not None:
            self.lora = LoRAManager(model, self.max_lora_rank, self.device, self.dtype, self.max_resident_loras,
                                    self.max_cpu_loras)

    def load_draft_model(self, config: ModelConfig, weights: WeightSource, num_speculative_tokens: int) -> None:
        """Speculative decoding's draft model (gpu_worker/draft_model.py), on this runner's device,
        dtype and KV cache dtype; ValueError when it cannot propose for this model."""
        if self.model is None:
            raise RuntimeError("load_model() must come before load_draft_model()")
        if self.config.mrope_section is not None and self.config.vision is not None:
            # (Without its vision side, in text-only mode, every position's three axes are equal: plain
            # RoPE, which a draft model's positions follow.)
            raise ValueError("a draft model cannot propose for a model with M-RoPE positions (Qwen2-VL, Qwen3-VL) "
                             "taking images or videos: use n-gram speculative decoding, or serve it text-only "
                             "(--limit-mm-per-prompt '{\"image\": 0, \"video\": 0}')")
        if config.max_context_len < self.max_model_len:
            raise ValueError(f"the draft model's context ({config.max_context_len} tokens) is shorter than "
                             f"max_model_len ({self.max_model_len}): lower --max-model-len or choose another draft")
        runner = ModelRunner(config, self.device, self.dtype, self.max_model_len, self.max_num_seqs,
                             self.max_num_batched_tokens, kv_cache_dtype=self.kv_cache_dtype)
        runner.decode_query_max = self.decode_query_max  # (it repeats the target's passes)
        drafter = DraftModel(runner, num_speculative_tokens, self.max_model_len, self.config.eos_token_ids)
        drafter.check_pairs_with(self, loaded=False)
        runner.load_model(weights)
        drafter.check_pairs_with(self, loaded=True)
        drafter.weights = weights  # (read again on waking from sleep level 2)
        self.drafter = drafter

    def load_mtp_drafter(self, weights: WeightSource, num_speculative_tokens: int) -> None:
        """Speculative decoding's drafter of method mtp (gpu_worker/models/mtp.py, run by
        gpu_worker/hidden_state_drafter.py): the model's own
        multi-token-prediction layer, read from its checkpoint (``weights``), on this runner's device,
        dtype and KV cache dtype, with the model's embedding and LM head; ValueError when the model
        has none."""
        if self.model is None:
            raise RuntimeError("load_model() must come before load_mtp_drafter()")
        runner = ModelRunner(mtp_config(self.config), self.device, self.dtype, self.max_model_len, self.max_num_seqs,
                             self.max_num_batched_tokens, kv_cache_dtype=self.kv_cache_dtype)
        runner.decode_query_max = self.decode_query_max  # (it follows the target's passes)
        runner.load_model(weights)
        runner.model.share_with(self.model)
        # (On waking from sleep level 2 its layer is read again from the target's weights.)
        self.drafter = HiddenStateDrafter(runner, num_speculative_tokens, self.max_model_len,
                                          self.config.eos_token_ids)

    def load_eagle_drafter(self, config: ModelConfig, weights: WeightSource, num_speculative_tokens: int) -> None:
        """Speculative decoding's EAGLE or EAGLE-3 head (methods eagle, eagle3: ``config`` as
        gpu_worker.eagle_config.eagle_head_config reads it, ``weights`` its checkpoint), on this
        runner's device, dtype and KV cache dtype, with the model's embedding (and LM head);
        ValueError when it cannot propose for this model."""
        if self.model is None:
            raise RuntimeError("load_model() must come before load_eagle_drafter()")
        if config.eagle is None:
            raise ValueError(f"{config.architecture} is not an EAGLE head's config")
        if self.config.vision is not None:
            raise ValueError("an EAGLE head proposes for a text decoder here; serve the vision-language model "
                             "text-only (--limit-mm-per-prompt '{\"image\": 0, \"video\": 0}') or use n-gram "
                             "speculative decoding")
        if config.max_context_len < self.max_model_len:  # (a YaRN head's reach is its own)
            raise ValueError(f"the EAGLE head's positions reach {config.max_context_len} tokens, short of "
                             f"max_model_len ({self.max_model_len}): lower --max-model-len")
        stack = None
        if config.eagle.aux_layer_ids:
            stack = getattr(self.model, "model", None)
            if not isinstance(stack, LlamaModel):
                raise ValueError(f"an EAGLE-3 head reads the target's inner hidden states, which "
                                 f"{self.config.architecture} does not give here: use method eagle, draft_model "
                                 "or ngram")
        runner = ModelRunner(config, self.device, self.dtype, self.max_model_len, self.max_num_seqs,
                             self.max_num_batched_tokens, kv_cache_dtype=self.kv_cache_dtype)
        runner.decode_query_max = self.decode_query_max  # (it follows the target's passes)
        drafter = HiddenStateDrafter(runner, num_speculative_tokens, self.max_model_len, self.config.eos_token_ids)
        runner.load_model(weights)
        drafter.check_pairs_with(self, loaded=True)
        runner.model.share_with(self.model)
        drafter.weights = weights  # (read again on waking from sleep level 2)
        if stack is not None:  # (only once it loaded: until then the target keeps no inner states)
            drafter.target_stack = stack
            stack.aux_layer_ids = config.eagle.aux_layer_ids
        self.drafter = drafter

    def _config_to_build(self) -> ModelConfig:
        """The model's config, its positions cut to max_model_len where that leaves everything but the
        rotary tables' length as it is (a decoder's plain, linear, llama3 or proportional RoPE, whose
        frequencies do not depend on it; not an encoder's position embeddings, nor a vision model's
        positions): the
        tables then hold the positions served, not all the model's (Llama 4 Scout's 10M would take
        gigabytes). Nor GPT-2's learned positions: its table is the checkpoint's."""
        config = self.config
        scaling = (config.rope_scaling or {}).get("rope_type", "default")
        if (config.encoder_only or config.vision is not None or config.learned_positions
                or scaling not in ("default", "linear", "llama3", "proportional")
                or self.max_model_len >= config.max_context_len):
            return config
        # (A linear scaling stretches the positions by its factor; Gemma 3 states its stretched length.)
        factor = (float(config.rope_scaling["factor"])
                  if scaling == "linear" and config.architecture != "Gemma3ForCausalLM" else 1.0)
        cut = dataclasses.replace(config, max_position_embeddings=math.ceil(self.max_model_len / factor))
        return cut if cut.max_context_len >= self.max_model_len else config

    def _loaded_model(self, weights: WeightSource) -> nn.Module:
        """A new model with the checkpoint's weights, in eval mode."""
        with torch.device(self.device), _default_dtype(self.dtype):
            model = build_model(self._config_to_build())
        source = read_by(model, iter_checkpoint(weights) if isinstance(weights, (str, Path)) else weights)
        if self.config.quantization is not None:  # (quantized weights: the model's dtype from here on)
            source = dequantized_weights(source, self.config.quantization, self.config.quantization_config,
                                         self.config.fp8_weight_block)
        if isinstance(weights, (str, Path)) and hasattr(model, "extra_checkpoint_tensors"):
            source = itertools.chain(source, model.extra_checkpoint_tensors(weights))
        with torch.no_grad():
            load_weights(model, source, zero_biases_optional=self.config.quantization in ("gptq", "awq"))
        return model.eval()

    # ------------------------------------------------------------------ sleep mode

    def sleep(self, level: int) -> None:
        """vLLM's sleep: the KV cache is released (its contents are lost: the engine holds no request
        and has emptied its prefix cache), and the weights are moved to host memory (level 1; on the
        CPU they stay where they are) or discarded (level 2: read from the checkpoint again on
        wake-up). Asleep at level 1, level 2 discards the host copy."""
        check_sleep(level)
        if self.model is None:
            raise RuntimeError("load_model() has not been called")
        if self.lora is not None:
            self.lora.release_device_copies()
        self.encoder_cache.clear()  # (the scheduler forgets them too: EngineCore.sleep)
        if "kv_cache" not in self.asleep:
            for layer in self.model.attention_layers():
                layer.kv_cache = None
            self.kv_caches = self.block_caches = []
            for mixer in self.mamba_mixers:
                mixer.state = None
            self.mamba_states = []
            self.kept_states = []
            self.asleep.add("kv_cache")
        if "weights" not in self.asleep or level > self.sleep_level:
            for param in self.model.parameters():
                if level == 2:
                    param.data = torch.empty(0, dtype=param.dtype, device=self.device)
                elif self.device.type != "cpu":
                    param.data = torch.empty_like(param.data, device="cpu", pin_memory=True).copy_(param.data)
            self.asleep.add("weights")
            self.sleep_level = level
        if self.drafter is not None:  # (speculative decoding's draft model: its weights and cache too)
            self.drafter.runner.sleep(level)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, tags: Iterable[str], weights: Callable[[], WeightSource]) -> None:
        """Restore what ``tags`` name ("weights", "kv_cache"): weights moved back to the device, or
        read again from ``weights()`` (level 2); an empty KV cache of the size it had."""
        tags = wake_up_tags(tags)
        model = self.model
        assert model is not None
        if "weights" in tags and "weights" in self.asleep:
            if self.sleep_level == 2:
                self._take_weights_of(self._loaded_model(weights()))
            elif self.device.type != "cpu":
                for param in model.parameters():
                    param.data = param.data.to(self.device, non_blocking=True)
                torch.cuda.synchronize(self.device)
            self.asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            self._allocate_kv_cache(self.num_blocks, self.block_size)
            self.asleep.discard("kv_cache")
        if not self.asleep:
            self.sleep_level = 0
        if self.drafter is not None:
            drafter = self.drafter
            drafter.runner.wake_up(tags, weights if drafter.weights is None else lambda: drafter.weights)

    def _take_weights_of(self, fresh: nn.Module) -> None:
        """Give the sleeping model's parameters the storage of ``fresh``'s (the same model, loaded
        again; an adapter-wrapped projection holds its own one level down, under LORA_BASE)."""
        loaded = dict(fresh.named_parameters(remove_duplicate=False))
        wrapped = self.lora.layers if self.lora is not None else {}
        for name, param in self.model.named_parameters(remove_duplicate=False):  # type: ignore[union-attr]
            path, base, rest = name.partition(f".{LORA_BASE}.")
            param.data = loaded[f"{path}.{rest}" if base and path in wrapped else name].data

    def initialize_kv_cache(self, num_blocks: int, block_size: int, num_offload_blocks: int | None = None) -> None:
        """The paged KV cache of ``num_blocks`` blocks, and KV offloading's host-memory tier of
        ``num_offload_blocks`` (None: as before), the draft model's beside them."""
        self._allocate_kv_cache(num_blocks, block_size, num_offload_blocks)
        if self.drafter is not None:  # (on the same block ids, and the same host slots)
            self.drafter.initialize_kv_cache(num_blocks, block_size, num_offload_blocks)

    def _check_kv_cache_grouping(self, layers: list[nn.Module]) -> None:
        """Refuse layers that are not what the KV cache groups were planned from (the model's config: the
        engine's scheduler keeps blocks for those groups; a pipeline stage's layers, its share of them)."""
        assert self.kv_cache_grouping is not None
        if (self.kv_cache_grouping.layer_windows() != [layer.sliding_window for layer in layers]
                or not all(isinstance(layer, PagedAttention) for layer in layers)
                or len({(layer.num_kv_heads, layer.head_dim) for layer in layers}) > 1):
            raise ValueError(f"{self.config.architecture}: the hybrid KV cache manager needs paged attention layers of "
                             "one shape mixing full attention and one window as the config lists them: serve it with "
                             "--disable-hybrid-kv-cache-manager")

    def _allocate_kv_cache(self, num_blocks: int, block_size: int, num_offload_blocks: int | None = None) -> None:
        """This model's own cache and host tier (``initialize_kv_cache``; on waking up, as before)."""
        if self.model is None:
            raise RuntimeError("load_model() must come before initialize_kv_cache()")
        layers = self.model.attention_layers()
        grouping = self.kv_cache_grouping
        if num_offload_blocks is not None and num_offload_blocks != self.num_offload_blocks:
            self.num_offload_blocks = num_offload_blocks
            # (Page-locked beside a CUDA cache: the device reads and writes it directly. Under the KV cache
            # groups a slot is a page of each shared tensor, any group's block.)
            host, pinned = torch.device("cpu"), self.device.type == "cuda"
            self.offload_caches = [] if not layers or not num_offload_blocks else allocate_layer_kv_caches(
                layers, num_offload_blocks, block_size, self.kv_cache_dtype, host, pinned) if grouping is None \
                else allocate_kv_cache(grouping.group_size, num_offload_blocks, block_size, layers[0].num_kv_heads,
                                       layers[0].head_dim, self.kv_cache_dtype, host, pinned)
        # (An encoder attends within the pass: it has no layer to give a cache to, and the blocks
        # only count its tokens for the scheduler.)
        if grouping is not None:
            # (Group g's layer j keeps its cache in shared tensor j: a block id is a page of each.)
            self.block_caches = allocate_kv_cache(grouping.group_size, num_blocks, block_size, layers[0].num_kv_heads,
                                                  layers[0].head_dim, self.kv_cache_dtype, self.device)
            for group, indexes in enumerate(grouping.layers):
                for j, i in enumerate(indexes):
                    layers[i].kv_cache, layers[i].kv_group = self.block_caches[j], group
            self.kv_caches = [layer.kv_cache for layer in layers]
        else:
            self.kv_caches = allocate_layer_kv_caches(layers, num_blocks, block_size, self.kv_cache_dtype,
                                                      self.device)
            self.block_caches = self.kv_caches
            for layer, cache in zip(layers, self.kv_caches, strict=True):
                layer.kv_cache = cache
        self._bind_mamba_states(self.max_num_seqs)
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Decodes read the paged cache in place where the CPU kernel applies (an fp32 model on the CPU,
        # with an fp32 or fp8 cache); elsewhere (CUDA, bf16) they gather their blocks and use SDPA.
        self.decode_in_place = (self.device.type == "cpu" and self.dtype == torch.float32
                                and self.kv_cache_dtype in (torch.float32, *FP8_DTYPES)
                                and cpu_kernels_available())

    @torch.inference_mode()
    def profile_run(self, block_size: int) -> None:
        """One forward at the largest batch the scheduler may send, plus logits and sampling for
        max_num_seqs rows, on a throwaway cache: its peak memory is what the KV cache must leave free."""
        if self.model is None:
            raise RuntimeError("load_model() must come before profile_run()")
        num_tokens = min(self.max_num_batched_tokens, self.max_num_seqs * self.max_model_len)
        lens = [self.max_model_len] * (num_tokens // self.max_model_len)
        if num_tokens % self.max_model_len:
            lens.append(num_tokens % self.max_model_len)
        blocks_per_req = [-(-n // block_size) for n in lens]
        layers = self.model.attention_layers()
        caches = allocate_layer_kv_caches(layers, sum(blocks_per_req), block_size, self.kv_cache_dtype, self.device)
        saved = [layer.kv_cache for layer in layers]
        mixers = self.mamba_mixers
        saved_states = [mixer.state for mixer in mixers]
        try:
            for layer, cache in zip(layers, caches, strict=True):
                layer.kv_cache = cache
            for mixer in mixers:  # (a state row per request of the pass, thrown away with the caches)
                mixer.state = self._new_mamba_state(mixer, len(lens))
            table = np.zeros((len(lens), max(blocks_per_req)), dtype=np.int64)
            first = np.cumsum([0, *blocks_per_req[:-1]])
            for i, nb in enumerate(blocks_per_req):
                table[i, :nb] = np.arange(first[i], first[i] + nb)
            qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            req_index = np.repeat(np.arange(len(lens)), lens)
            positions = np.arange(num_tokens) - qsl[req_index]
            slots = compute_slot_mapping(table, req_index, positions, block_size)
            padded = self.encoder_batches_padded
            meta = (EncoderMetadata.build(qsl, self.device, padded) if self.config.encoder_only else
                    self.attention_metadata(table, np.array(blocks_per_req), qsl, np.zeros(len(lens), np.int64),
                                            0, slots, block_size, decode_in_place=False,
                                            # (each KV cache group's metadata, as a pass builds them; the
                                            # throwaway caches are a layer's own, so one table serves all)
                                            group_tables=[(table, slots)] * (len(self.kv_cache_grouping.windows) - 1)
                                            if self.kv_cache_grouping is not None else None))
            if mixers:
                meta.mamba = mamba_step_metadata(np.arange(len(lens)), qsl, self.device)
            input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
            if self.lora is not None:  # (every row under a full-rank adapter where adapters go to the device)
                self.lora.set_profile_batch()
            intermediate = None if distributed.is_first_stage() else tuple(  # (what the previous stage sends)
                torch.zeros(num_tokens, self.config.hidden_size, dtype=self.dtype, device=self.device)
                for _ in range(2))
            vision = self.config.vision
            encoder_cache = None
            if vision is not None:  # (a pass's images: as many as the encoder budget, the batch's tokens, allows)
                geometry = vision.geometry
                # (The most tiles a pass may encode: as many images as the fewest tokens one may be fit
                # in the encoder budget, each of the most tiles; the budget is in tokens, and a thin
                # image is many tiles for few tokens.)
                size = max(geometry.grid_pinpoints or [(1, 1)], key=lambda hw: geometry.num_tiles(*hw))
                images = max(1, num_tokens // geometry.base_tokens)
                if geometry.native or geometry.pixtral or geometry.tiled:  # (the largest images)
                    size = geometry.largest_image
                    images = max(1, num_tokens // geometry.num_tokens(*size))
                self.model.embed_images([torch.zeros(geometry.input_shape(*size), dtype=self.dtype, device=self.device)
                                         ] * images, [size] * images)
                # The encoder cache's rows (the scheduler's cache size), held through the forward.
                # (Qwen3-VL's rows carry its DeepStack features too: image_row_width.)
                encoder_cache = torch.empty(max(self.max_num_batched_tokens, vision.tokens_per_image),
                                            getattr(self.model, "image_row_width", self.config.hidden_size),
                                            dtype=self.dtype, device=self.device)
            hidden = self.model(input_ids, torch.from_numpy(positions).to(self.device), meta, None, intermediate)
            if mixers:
                self._profile_recurrent_decodes(mixers, block_size)
            if not distributed.is_last_stage():  # (a stage before the last has no head)
                hidden = None
            rows = min(self.max_num_seqs * (1 + self.num_spec_tokens), num_tokens)
            # (An embedding-only model has no head: the forward is its peak.)
            logits = (None if self.config.embedding_only or hidden is None
                      else self.model.compute_logits(hidden[:rows]))
            if logits is not None:
                n = logits.shape[0]
                md = SamplingMetadata(
                    temperature=torch.ones(n, device=self.device), all_greedy=False, all_random=True,
                    top_k=torch.full((n,), 50, device=self.device), top_p=torch.full((n,), 0.9, device=self.device),
                    max_num_logprobs=self.max_logprobs if self.max_logprobs >= 0 else logits.shape[-1])
                self.sampler(logits, md)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            del encoder_cache
        finally:
            for layer, cache in zip(layers, saved, strict=True):
                layer.kv_cache = cache
            for mixer, state in zip(mixers, saved_states, strict=True):
                mixer.state = state
            # (The full-rank adapter stays held through the draft's profile: in serving, the adapters on
            # the device are there while it drafts.)
            profiled_adapters = self.lora.batch.groups if self.lora is not None else []
            if self.lora is not None:
                self.lora.batch.set_groups([])
            del caches
        if self.drafter is not None:  # (the draft's passes come after the target's, on a cache of their own)
            self.drafter.runner.profile_run(block_size)
        del profiled_adapters
        stack = getattr(self.model, "model", None)
        if getattr(stack, "aux_hidden_states", None):  # (kept for an EAGLE-3 head, as a pass's are: not past here)
            stack.aux_hidden_states = []

    # ------------------------------------------------------------------ one step

    def copy_offloaded_blocks(self, so: SchedulerOutput) -> None:
        """KV offloading's copies for this pass, before its forward: evicted blocks saved to the host
        tier, then saved blocks loaded into the blocks the scheduler gave them (the draft's too)."""
        stores, loads = so.kv_offload_stores, so.kv_offload_loads
        runners = [self] if self.drafter is None else [self, self.drafter.runner]
        for runner in runners:
            if stores:
                copy_kv_blocks(runner.block_caches, runner.offload_caches, [b for b, _ in stores],
                               [s for _, s in stores])
            if loads:
                copy_kv_blocks(runner.offload_caches, runner.block_caches, [s for s, _ in loads],
                               [b for _, b in loads])

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.requests.update(so)
        if self.requests.rejected_drafts:  # (before anything reads their rows)
            self._roll_back_rejected_drafts()
        if so.kv_offload_stores or so.kv_offload_loads:
            self.copy_offloaded_blocks(so)
        for identifier in so.free_encoder_mm_hashes:
            self.encoder_cache.pop(identifier, None)
        if so.scheduled_encoder_inputs:
            self._encode_images(so.scheduled_encoder_inputs)
        spec = so.scheduled_spec_decode_tokens
        for req_id, draft in spec.items():
            # Computed after the request's last token; the ones the target model rejects are dropped.
            state = self.requests[req_id]
            state.token_ids.extend(draft)
            state.num_draft_tokens = len(draft)
            if self.mamba_mixers:  # (recurrent states to put back where drafts are not kept)
                end = state.num_computed_tokens + so.num_scheduled_tokens[req_id]
                state.verified_drafts = (end - len(draft), end)
        if not so.total_num_scheduled_tokens:
            return ModelRunnerOutput([], {}, [], None)
        if self.model is None or not self.block_size:
            raise RuntimeError("the model and KV cache must be initialised before execute_model()")

        # Decodes (one token) first: attention handles them as one padded batch.
        if self.lora is None:  # (then the short queries the decode kernel takes too: _decode_requests)
            short = self.decode_query_max
            order = sorted(so.num_scheduled_tokens,
                           key=lambda r: (so.num_scheduled_tokens[r] != 1, so.num_scheduled_tokens[r] > short))
        else:  # and each adapter's decodes (and prefills) side by side: its rows are at most two slices
            order = sorted(so.num_scheduled_tokens, key=lambda r: (so.num_scheduled_tokens[r] != 1,
                                                                   self.requests[r].lora_int_id))
        states = [self.requests[r] for r in order]
        num_sched = np.fromiter((so.num_scheduled_tokens[r] for r in order), dtype=np.int64, count=len(order))
        num_decodes = int(np.count_nonzero(num_sched == 1))
        # (index, first position) of requests whose prompt logprobs this step's chunk extends.
        prompt_lp_chunks = [(i, s.num_computed_tokens) for i, s in enumerate(states) if s.wants_prompt_logprobs]
        num_drafts = (np.fromiter((len(spec.get(r, ())) for r in order), dtype=np.int64, count=len(order))
                      if spec else None)
        kept_within, kept_at_end = self._kept_state_positions(so.recurrent_state_saves, so.num_scheduled_tokens)
        if spec and self.mamba_mixers:
            self._keep_states_after_drafts(spec, so.num_scheduled_tokens, kept_within)
        self.copy_kept_states(so.recurrent_state_restores, restore=True)
        hidden, sample_rows, last_rows = self._forward(states, num_sched, num_decodes, kept_within, spec)
        self.copy_kept_states(kept_at_end, restore=False)
        if hidden is None:  # (a pipeline stage before the last: its hidden states went on to the next)
            return ModelRunnerOutput([], {}, [], None)
        pooler_output = None
        if self.requests.embedding_ids:
            # (Only TP rank 0's output is read; the others only keep their states in step.)
            pools = get_tp_rank() == 0
            if pools:
                self._pool_chunks(hidden, states, num_sched)
            embed_rows = [i for i in sample_rows if states[i].sampling_params.embed]
            if embed_rows:
                pooler_output = (self._embeddings(hidden, [(states[i], int(last_rows[i])) for i in embed_rows])
                                 if pools else {})
                sample_rows = [i for i in sample_rows if not states[i].sampling_params.embed]
        logits_idx = self._logits_rows(last_rows, sample_rows, num_drafts)
        prompt_logprobs = (self._prompt_logprobs(hidden, states, num_sched, prompt_lp_chunks)
                           if prompt_lp_chunks else None)

        sampled: list[list[int]] = [[] for _ in order]
        logprobs: list[LogprobsEntry | None] | None = None
        if sample_rows and num_drafts is not None:
            logprobs = self._verify_drafts(so, hidden.index_select(0, logits_idx), states, sample_rows,
                                           num_drafts, sampled)
        elif sample_rows:
            in_order = True
            if self.logits_processors is not None:
                # Rows in the processors' index order (the same on every rank: the logits are gathered).
                batch_order = self.logits_processors.arrange([states[i] for i in sample_rows])
                in_order = batch_order == list(range(len(batch_order)))
                if not in_order:
                    sample_rows = [sample_rows[j] for j in batch_order]
                    logits_idx = logits_idx[torch.tensor(batch_order, device=logits_idx.device)]
            # A decode-only step samples every token: no row selection needed.
            rows = (hidden if in_order and len(sample_rows) == hidden.shape[0]
                    else hidden.index_select(0, logits_idx))
            logits = self.model.compute_logits(rows)
            if logits is not None:  # TP rank 0 only
                sample_states = [states[i] for i in sample_rows]
                md = self._sampling_metadata(sample_states, logits.shape[1])
                md.logits_processors = self.logits_processors
                if so.grammar_bitmask is not None:
                    md.grammar_bitmask = self._grammar_rows(so.grammar_bitmask, sample_states)
                out = self.sampler(logits, md)
                token_ids = out.sampled_token_ids.tolist()
                for i, state, tok in zip(sample_rows, sample_states, token_ids, strict=True):
                    sampled[i] = [tok]
                    # Remembered so penalties see it before the scheduler resends it.
                    state.token_ids.append(tok)
                logprobs = self._logprobs_entries(out, sample_rows, sample_states, len(order))
        draft_token_ids = None
        if self.drafter is not None and self._pass_inputs is not None:
            # (Freed before the drafter's passes, their peak adds to nothing: the hidden states too,
            # unless the drafter reads them.)
            target_hidden = hidden if self.drafter.reads_hidden_states else None
            hidden = logits = rows = None
            inputs, self._pass_inputs = self._pass_inputs, None
            draft_token_ids = self.drafter.after_pass(inputs, target_hidden, states, sample_rows,
                                                      self.requests.block_table) or None
        return ModelRunnerOutput(req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)},
                                 sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                 pooler_output=pooler_output, draft_token_ids=draft_token_ids)

    def _logits_rows(self, last_rows: np.ndarray, sample_rows: list[int], num_drafts: np.ndarray | None
                     ) -> torch.Tensor:
        """The hidden-state rows the sampled requests' logits come from: each one's last row, and
        with drafts also the rows of its drafts before it."""
        last = last_rows[sample_rows]
        if num_drafts is None or not sample_rows:
            return torch.from_numpy(last).to(self.device)
        return torch.from_numpy(np.concatenate(
            [np.arange(row - d, row + 1) for row, d in zip(last, num_drafts[sample_rows], strict=True)]
        ).astype(np.int64)).to(self.device)

    def _pool_chunks(self, hidden: torch.Tensor, states: list[RequestState], num_sched: np.ndarray) -> None:
        """MEAN, CLS, ALL and STEP pooling read more than a prompt's last token: add this step's
        chunk of each such request to its running sum (MEAN), keep its first token's hidden state
        (CLS), or keep its chunk's rows (ALL; STEP: those at the step tag). Their prompts are
        computed whole, never read from the prefix cache (skip_reading_prefix_cache)."""
        start = 0
        for state, count in zip(states, num_sched.tolist(), strict=True):
            params = state.sampling_params
            pooling = params.embed_pooling if params.embed else "LAST"
            if pooling == "MEAN":
                chunk = hidden[start: start + count].float().sum(0)
                state.pooled = chunk if state.pooled is None else state.pooled.add_(chunk)
            elif pooling == "CLS" and state.num_computed_tokens == count:  # (_forward moved it past the chunk)
                state.pooled = hidden[start].to(torch.float32, copy=True)  # (not a view pinning the step's states)
            elif pooling in PER_TOKEN_POOLING:
                rows = hidden[start: start + count]
                kept = self._kept_positions(state, count)
                if kept is not None:
                    rows = rows.index_select(0, torch.from_numpy(kept).to(rows.device)) if len(kept) else None
                if rows is not None:
                    state.pooled_rows.append(self._token_rows(rows, params, view=kept is None))
            start += count

    def _kept_positions(self, state: RequestState, count: int) -> np.ndarray | None:
        """Which rows of this step's chunk of a per-token request are kept (None: all of them): STEP's
        at its step tag; BGE-M3's without the prompt's leading BOS (and, for lexical weights, its
        closing EOS), as FlagEmbedding reads them."""
        params = state.sampling_params
        if params.embed_step_tag_id is None and (params.pooling_task is None or not self.config.m3_heads):
            return None
        first = state.num_computed_tokens - count  # (_forward moved it past the chunk)
        chunk_ids = np.asarray(state.token_ids[first: first + count])
        if params.embed_step_tag_id is not None:
            return np.flatnonzero(chunk_ids == params.embed_step_tag_id)
        keep = np.ones(count, dtype=bool)
        if first == 0 and chunk_ids[0] == self.config.raw.get("bos_token_id"):
            keep[0] = False
        last = state.num_prompt_tokens - 1 - first
        if (params.pooling_task == "token_classify" and last < count
                and chunk_ids[last] == self.config.raw.get("eos_token_id")):
            keep[last] = False
        return None if keep.all() else np.flatnonzero(keep)

    def _token_rows(self, rows: torch.Tensor, params: SamplingParams, view: bool = True) -> torch.Tensor:
        """ALL / STEP rows, cut to the request's returned_token_ids when given: each token's class
        logits (a classifier's fp32 head over its final state), BGE-M3's head for the request's
        pooling task, or embedding (projected by the Dense modules in fp32; kept in the model's
        dtype without them, made fp32 when the prompt ends). A copy where ``rows`` is a ``view`` of
        the step's hidden states: they are not held until the prompt ends."""
        columns = params.embed_returned_token_ids
        if params.pooling_task in self.config.head_tasks:
            values = self.model.token_head(params.pooling_task, rows)
        elif self.config.labels:
            values = self.model.classify(rows, per_token=True).float()
        elif self.dense:
            values = rows.float()
            for weight, bias, activation in self.dense:
                values = DENSE_ACTIVATIONS[activation](torch.nn.functional.linear(values, weight, bias))
        else:
            values = rows
        values = values if columns is None else values[:, columns]
        return values.clone() if view and values is rows else values

    def _embeddings(self, hidden: torch.Tensor, wanted: list[tuple[RequestState, int]]) -> dict[str, list[float]]:
        """Each finished prompt's embedding (every TP rank holds the hidden states whole): its last
        token's final hidden state (LAST pooling), or what _pool_chunks gathered (MEAN: the sum over
        the prompt, divided here; CLS: the first token's; ALL / STEP: the rows, flattened); a
        classifier's class logits from it instead. Cut to its dimensions and L2-normalised (each row)
        as the request asks (on the CPU, after one copy of the rows); projected first by the
        checkpoint's Dense modules, where it has any."""
        out = {}
        pooled_once = []
        for state, row in wanted:
            if state.sampling_params.embed_pooling in PER_TOKEN_POOLING:
                out[state.req_id] = self._finished_rows(state)
            else:
                pooled_once.append((state, row))
        if not pooled_once:
            return out
        rows = hidden.index_select(0, torch.tensor([row for _, row in pooled_once], device=hidden.device)).float()
        pooled = torch.stack([row if state.pooled is None else
                              state.pooled / state.num_prompt_tokens if state.sampling_params.embed_pooling == "MEAN"
                              else state.pooled for (state, _), row in zip(pooled_once, rows, strict=True)])
        if self.config.labels:
            pooled = self.model.classify(pooled).float()  # (the head casts to its own dtype)
        for weight, bias, activation in self.dense:
            pooled = DENSE_ACTIVATIONS[activation](torch.nn.functional.linear(pooled, weight, bias))
        for (state, _), row in zip(pooled_once, pooled.cpu(), strict=True):
            params = state.sampling_params
            if params.embed_dimensions is not None:
                row = row[: params.embed_dimensions]
            if params.embed_normalize:
                row = torch.nn.functional.normalize(row, dim=0)
            out[state.req_id] = row.tolist()
        return out

    @staticmethod
    def _finished_rows(state: RequestState) -> list[float]:
        """A per-token pooled output: its rows (none when no token was kept), cut and normalised
        row by row as the request asks, flattened."""
        if not state.pooled_rows:
            return []
        rows = torch.cat(state.pooled_rows).float().cpu()
        state.pooled_rows.clear()
        params = state.sampling_params
        if params.embed_dimensions is not None:
            rows = rows[:, : params.embed_dimensions]
        if params.embed_normalize:
            rows = torch.nn.functional.normalize(rows, dim=1)
        return rows.flatten().tolist()

    def _prompt_logprobs(self, hidden: torch.Tensor, states: list[RequestState], num_sched: np.ndarray,
                         chunks: list[tuple[int, int]]) -> dict[str, LogprobsEntry] | None:
        """Score each prompt token of these chunks given the tokens before it (the hidden state of
        position p predicts token p + 1); a request's entries go out once its prefill is complete."""
        row_starts = np.concatenate(([0], np.cumsum(num_sched)[:-1]))
        rows: list[int] = []
        targets: list[int] = []
        spans: list[tuple[RequestState, int]] = []  # (request, number of its rows)
        for i, start in chunks:
            state = states[i]
            # The last prompt position predicts the first output, which is sampled, not scored here.
            end = min(start + int(num_sched[i]), state.num_prompt_tokens - 1)
            count = max(0, end - start)
            rows.extend(range(int(row_starts[i]), int(row_starts[i]) + count))
            targets.extend(state.token_ids[start + 1:end + 1])
            spans.append((state, count))
        values = top_values = top_tokens = ranks = None
        wanted = [state.sampling_params.prompt_logprobs or 0 for state, count in spans for _ in range(count)]
        # In slices of as many rows as a pass samples (what the memory profile measured): a long
        # prompt's rows at once, each with a vocabulary of logits (and of alternatives, for -1), could
        # need more memory than the KV cache left free.
        step = max(1, self.max_num_seqs * (1 + self.num_spec_tokens))
        for at in range(0, len(rows), step):
            index = torch.tensor(rows[at:at + step], device=hidden.device)
            # (Every TP rank runs each slice's head, a collective; only rank 0 gets the logits, the
            # others keep their request states in step.)
            logits = self.model.compute_logits(hidden.index_select(0, index))
            if logits is None:
                continue
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            target_lp = logprobs.gather(1, torch.tensor(targets[at:at + step], device=logprobs.device).unsqueeze(1)
                                        ).squeeze(1)
            k = min(max(wanted[at:at + step]), logprobs.shape[-1])
            top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
            part_ids, part_lp = _top_rows(top_ids, top_lp, wanted[at:at + step])
            if values is None:
                values, ranks, top_tokens, top_values = [], [], [], []
            values += target_lp.tolist()
            ranks += (logprobs >= target_lp.unsqueeze(1)).sum(dim=1).tolist()  # (ties as vLLM ranks them)
            top_tokens += part_ids if part_ids is not None else [[] for _ in range(len(index))]
            top_values += part_lp if part_lp is not None else [[] for _ in range(len(index))]
        done: dict[str, LogprobsEntry] = {}
        row = 0
        for state, count in spans:
            n = state.sampling_params.prompt_logprobs or 0
            for j in range(row, row + count) if values is not None else ():
                state.prompt_logprobs.append(values[j])
                state.prompt_ranks.append(ranks[j])
                state.prompt_top_logprobs.append(list(zip(top_tokens[j][:n], top_values[j][:n], strict=True))
                                                 if n else [])
            row += count
            if state.num_computed_tokens >= state.num_prompt_tokens:  # (set by _forward) the prefill is done
                done[state.req_id] = LogprobsEntry(state.prompt_logprobs, state.prompt_top_logprobs,
                                                   state.prompt_ranks)
                state.prompt_logprobs, state.prompt_top_logprobs, state.prompt_ranks = [], [], []
                state.prompt_logprobs_sent = True
        return done if done and (values is not None or not rows) else None

    def _verify_drafts(self, so: SchedulerOutput, rows: torch.Tensor, states: list[RequestState],
                       sample_rows: list[int], num_drafts: np.ndarray, sampled: list[list[int]]
                       ) -> list[LogprobsEntry | None] | None:
        """A pass with draft tokens: ``rows`` holds the hidden states of each sampled request's last
        token and its drafts. Keeps the drafts the target model accepts (see rejection_sampler.py),
        fills ``sampled`` and returns the logprobs entries."""
        logits = self.model.compute_logits(rows)
        if logits is None:  # TP ranks other than 0: the next pass's diffs say what was kept
            return None
        sample_states = [states[i] for i in sample_rows]
        counts = [1 + int(num_drafts[i]) for i in sample_rows]
        # Each request's settings on each of its rows; a request with penalties or bad words as of
        # each row's position (row j, after draft j, sees the drafts up to j only).
        row_states = [s if j == c - 1 or not reads_earlier_tokens(s.sampling_params)
                      else RequestStateAtDraft(s, len(s.token_ids) - (c - 1 - j))
                      for s, c in zip(sample_states, counts, strict=True) for j in range(c)]
        md = self._sampling_metadata(row_states, logits.shape[1])
        if so.grammar_bitmask is not None:  # (a grammar's row j: its mask after draft j, as vLLM's)
            md.grammar_bitmask = self._grammar_rows(so.grammar_bitmask, row_states)
        drafts = [s.token_ids[len(s.token_ids) - c + 1:] for s, c in zip(sample_states, counts, strict=True)]
        wants_processed = md.max_num_logprobs is not None and self.sampler.processed_mode
        if wants_processed:
            tokens, processed = rejection_sample_with_logits(logits, md, drafts)
        else:
            tokens = rejection_sample(logits, md, drafts)
        first_rows = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist()
        for i, state, draft, toks in zip(sample_rows, sample_states, drafts, tokens, strict=True):
            sampled[i] = toks
            # The drafts computed but rejected are not in the cache: the next pass recomputes from here.
            num_rejected = len(draft) - (len(toks) - 1)
            state.num_computed_tokens -= num_rejected
            del state.token_ids[len(state.token_ids) - len(draft):]
            state.token_ids.extend(toks)
            state.num_draft_tokens = 0
        if md.max_num_logprobs is None:
            return None
        # Logprobs at the row each output token was drawn from, for the requests that want them, in
        # one pass over all their tokens: of the model's raw distribution, or (processed modes) of the
        # processed logits the target distribution came from, as the sampler reports them.
        wanted = [j for j, s in enumerate(sample_states) if s.sampling_params.logprobs is not None]
        rows_idx = [first_rows[j] + t for j in wanted for t in range(len(tokens[j]))]
        device = logits.device
        selected = torch.tensor(rows_idx, device=device)
        if wants_processed:
            rows = processed[selected]
        else:  # (a grammar's rows as they were sampled, masked; the whole batch copied only when there is one)
            rows = (grammar_masked(logits.float(), md)[selected] if md.grammar_bitmask is not None
                    else logits[selected].float())
        mode = self.sampler.logprobs_mode
        out = token_logprobs(rows if mode.endswith("logits") else rows.log_softmax(dim=-1),
                             torch.tensor([t for j in wanted for t in tokens[j]], device=device),
                             md.max_num_logprobs)
        values, ranks = out.sampled_logprobs.tolist(), out.sampled_ranks.tolist()
        top_ids, top_lp = _top_rows(out.top_token_ids, out.top_logprobs,
                                    [sample_states[j].sampling_params.logprobs for j in wanted for _ in tokens[j]])
        entries: list[LogprobsEntry | None] = [None] * len(states)
        at = 0
        for j in wanted:
            n, end = sample_states[j].sampling_params.logprobs, at + len(tokens[j])
            top = [list(zip(top_ids[r][:n], top_lp[r][:n], strict=True)) if n and top_ids is not None else []
                   for r in range(at, end)]
            entries[sample_rows[j]] = LogprobsEntry(values[at:end], top, ranks[at:end])
            at = end
        return entries

    def _forward(self, states: list[RequestState], num_sched: np.ndarray, num_decodes: int,
                 kept_within: dict[str, list[tuple[int, int]]] | None = None,
                 verifying: Collection[str] = ()) -> tuple[torch.Tensor | None, list[int], np.ndarray]:
        """Run the model over this pass's tokens: every row's final hidden state, the indexes of the
        requests whose chunk reaches the end of what they know (they sample, or are embedded), and
        each request's last row. Under pipeline parallelism this stage's layers run on what the
        previous stage sent, and a stage before the last sends its output on and returns no hidden
        states. ``kept_within``: recurrent states kept part-way through a request's chunk
        (_kept_state_positions, _keep_states_after_drafts); ``verifying``: the requests verifying
        drafts (their recurrent layers take them a token at a time)."""
        if self.config.encoder_only:
            return self._forward_encoder(states, num_sched)
        block_size = self.block_size
        num_reqs = len(states)
        starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=num_reqs)
        ends = starts + num_sched
        num_blocks = np.fromiter((s.num_blocks for s in states), dtype=np.int64, count=num_reqs)
        if (ends > num_blocks * block_size).any():
            i = int(np.argmax(ends > num_blocks * block_size))
            raise ValueError(f"request {states[i].req_id!r} has {int(num_blocks[i])} blocks for {int(ends[i])} tokens")
        if int(ends.max()) > self.max_model_len:
            raise ValueError(f"a request reaches {int(ends.max())} tokens, beyond max_model_len {self.max_model_len}")
        rows = np.fromiter((s.table_row for s in states), dtype=np.int64, count=num_reqs)
        block_table = self.requests.block_table.gather(rows, int(num_blocks.max()))

        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_sched, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        req_index = np.repeat(np.arange(num_reqs), num_sched)
        positions = starts[req_index] + np.arange(num_tokens) - query_start_loc[req_index]
        if num_decodes == num_reqs:
            input_ids = np.fromiter((s.token_ids[p] for s, p in zip(states, starts.tolist(), strict=True)),
                                    dtype=np.int64, count=num_reqs)
        else:
            input_ids = np.fromiter(
                (t for s, a, b in zip(states, starts.tolist(), ends.tolist(), strict=True) for t in s.token_ids[a:b]),
                dtype=np.int64, count=num_tokens)
        slot_mapping = compute_slot_mapping(block_table, req_index, positions, block_size)
        # (The hybrid KV cache manager's further groups: each its own blocks at the same positions; none
        # for a group with no layers on this pipeline stage.)
        held = self.kv_cache_grouping.layers[1:] if self.kv_cache_grouping is not None else ()
        group_tables: list[tuple[np.ndarray, np.ndarray] | None] = []
        for layers, group_table in zip(held, self.requests.group_tables, strict=False):
            table = group_table.gather(rows, block_table.shape[1]) if layers else None
            group_tables.append(None if table is None else
                                (table, compute_slot_mapping(table, req_index, positions, block_size)))
        meta = self.attention_metadata(block_table, num_blocks, query_start_loc, starts, num_decodes, slot_mapping,
                                        block_size, self.decode_in_place,
                                        self._bidirectional_images(states, starts, ends), group_tables)
        if self.lora is not None:
            self.lora.set_batch([s.lora_int_id for s in states], query_start_loc)
        if self.mamba_mixers:
            within = ({i: kept_within[s.req_id] for i, s in enumerate(states) if s.req_id in kept_within}
                      if kept_within else None)
            stepped = {i for i, s in enumerate(states) if s.req_id in verifying} if verifying else ()
            meta.mamba = self.mamba_step(rows, starts, query_start_loc, within, stepped)

        # A request samples once its chunk reaches the end of everything it knows (prompt done).
        total_known = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=num_reqs)
        sample_rows = np.flatnonzero(ends >= total_known).tolist()
        for s, end in zip(states, ends.tolist(), strict=True):
            s.num_computed_tokens = end

        input_ids_t = torch.from_numpy(input_ids).to(self.device)
        if self.drafter is not None:  # (the draft model repeats this pass)
            self._pass_inputs = PassInputs(input_ids_t, torch.from_numpy(positions).to(self.device), block_table,
                                           num_blocks, query_start_loc, starts, num_decodes, slot_mapping)
        if self.rope_short_offset is not None:  # LongRoPE: short or long rotary rows, per token
            prompt_lens = np.fromiter((s.num_prompt_tokens for s in states), dtype=np.int64, count=num_reqs)
            positions = longrope_rows(positions, prompt_lens[req_index], self.rope_short_offset,
                                      self.rope_original_len)
        if self.config.mrope_section is not None:  # Qwen2-VL: images' (time, height, width) positions
            positions = self._mrope_positions(states, positions, starts, ends, query_start_loc)
        hidden = self._run_model(input_ids_t, torch.from_numpy(positions).to(self.device), meta, states, starts, ends,
                                 query_start_loc)
        return hidden, sample_rows, query_start_loc[1:] - 1

    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   states: list[RequestState], starts: np.ndarray, ends: np.ndarray, query_start_loc: np.ndarray
                   ) -> torch.Tensor | None:
        """This worker's part of a pass: the first pipeline stage (the only one, without pipeline
        parallelism) embeds the tokens, the others start from the (hidden, residual) the previous
        stage sent; all but the last send theirs on and return None."""
        assert self.model is not None
        intermediate = None
        inputs_embeds = deepstack = None
        if distributed.is_first_stage():
            inputs_embeds, deepstack = self._inputs_embeds(input_ids, states, starts, ends, query_start_loc)
        else:
            shape = (input_ids.shape[0], self.config.hidden_size)
            hidden, residual = distributed.recv_from_previous_stage(shape, self.dtype, self.device, 2)
            intermediate = (hidden, residual)
        if deepstack is None:
            out = self.model(input_ids, positions, meta, inputs_embeds, intermediate)
        else:
            out = self.model(input_ids, positions, meta, inputs_embeds, intermediate, deepstack)
        if distributed.is_last_stage():
            return out
        distributed.send_to_next_stage(list(out))
        return None

    def _mrope_positions(self, states: list[RequestState], positions: np.ndarray, starts: np.ndarray,
                         ends: np.ndarray, query_start_loc: np.ndarray) -> np.ndarray:
        """The pass's M-RoPE positions: the requests with images take their prompt's table (made at
        their first pass) and shift the positions past it; the others' stay as they are."""
        tables = []
        for i, s in enumerate(states):
            if not s.mm_features:
                continue
            if s.mrope is None:
                s.mrope = mrope_positions(s.num_prompt_tokens, s.mm_features, self.config.vision.geometry)
            tables.append((int(query_start_loc[i]), int(starts[i]), int(ends[i]), *s.mrope))
        return pass_positions(positions, tables) if tables else positions

    def _encode_images(self, scheduled: dict[str, list[int]]) -> None:
        """Run the vision encoder on the images the scheduler named (one batch), caching each one's
        rows by identifier; an image already cached (the same one in another prompt) is not rerun."""
        todo: dict[str, MultiModalFeature] = {}
        for req_id, indexes in scheduled.items():
            features = self.requests[req_id].mm_features or []
            for index in indexes:
                feature = features[index]
                if feature.identifier not in self.encoder_cache:
                    todo.setdefault(feature.identifier, feature)
        if not todo:
            return
        assert self.model is not None
        # (A video's size is its (frames, height, width): Qwen2-VL's towers take videos.)
        rows = self.model.embed_images([f.pixel_values.to_tensor().to(self.device, non_blocking=True)
                                        for f in todo.values()],
                                       [(f.num_frames, *f.image_size) if f.modality == "video" and f.image_size
                                        else f.image_size for f in todo.values()])
        for identifier, image_rows in zip(todo, rows, strict=True):
            # (A copy of its own: a view would keep the whole pass's batch alive after the others go.)
            self.encoder_cache[identifier] = image_rows.clone()

    def _inputs_embeds(self, input_ids: torch.Tensor, states: list[RequestState], starts: np.ndarray,
                       ends: np.ndarray, query_start_loc: np.ndarray
                       ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """The pass's input rows when a request's chunk covers prompt embeddings or image placeholders:
        the embedding table's rows of every token, with the requests' own rows (or their images'
        encoder rows) written over their placeholders' (None when no chunk does: the model looks its
        tokens up itself). And Qwen3-VL's DeepStack rows for the image tokens: (their rows in the
        pass, [layers, rows, hidden]); the encoder's rows carry them after the embedding's width."""
        spans = []
        for i, s in enumerate(states):
            start, end = int(starts[i]), int(ends[i])
            if s.prompt_embeds is not None and start < len(s.prompt_embeds):
                spans.append((int(query_start_loc[i]), s.prompt_embeds[start:min(end, len(s.prompt_embeds))]))
            for feature in s.mm_features or ():
                if feature.offset >= end or feature.end <= start:
                    continue
                rows = self.encoder_cache.get(feature.identifier)
                if rows is None:
                    raise RuntimeError(f"request {s.req_id!r}: the image at {feature.offset} was not encoded "
                                       f"before its placeholders ran (the scheduler must schedule it)")
                first, last = max(start, feature.offset), min(end, feature.end)
                spans.append((int(query_start_loc[i]) + first - start,
                              rows[first - feature.offset:last - feature.offset]))
        if not spans:
            return None, None
        assert self.model is not None
        embeds = self.model.embed_input_ids(input_ids)
        width = embeds.shape[1]
        deep_rows, deep_values = [], []
        for row, rows in spans:
            rows = rows.to(self.device, non_blocking=True)
            embeds[row:row + len(rows)] = rows[:, :width]
            if rows.shape[1] > width:  # (DeepStack: [rows, layers x hidden] after the embedding)
                deep_rows.append(torch.arange(row, row + len(rows), device=self.device))
                deep_values.append(rows[:, width:].unflatten(1, (-1, width)))
        if not deep_rows:
            return embeds, None
        return embeds, (torch.cat(deep_rows), torch.cat(deep_values).transpose(0, 1))

    def _forward_encoder(self, states: list[RequestState], num_sched: np.ndarray
                         ) -> tuple[torch.Tensor, list[int], np.ndarray]:
        """An encoder's pass (as _forward): each prompt runs whole from position 0, as the engine
        schedules an encoder's requests (no chunked prefill, no prefix cache); its blocks are not read."""
        for state, count in zip(states, num_sched.tolist(), strict=True):
            if state.num_computed_tokens or count != state.num_tokens:
                raise ValueError(f"request {state.req_id!r}: an encoder runs a prompt whole in one pass, but "
                                 f"{count} of its {state.num_tokens} tokens were scheduled from position "
                                 f"{state.num_computed_tokens} (chunked prefill and prefix caching must be off)")
        num_reqs = len(states)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_sched, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        if int(num_sched.max()) > self.max_model_len:
            raise ValueError(f"a prompt of {int(num_sched.max())} tokens is beyond max_model_len {self.max_model_len}")
        req_index = np.repeat(np.arange(num_reqs), num_sched)
        positions = np.arange(num_tokens) - query_start_loc[req_index]
        input_ids = np.fromiter((t for s in states for t in s.token_ids), dtype=np.int64, count=num_tokens)
        token_types = None
        type_starts = [s.sampling_params.compressed_token_type_ids for s in states]
        if any(start is not None for start in type_starts):
            # Type 1 from each pair's second text on (None: all type 0).
            first_of_type_1 = np.array([num_tokens if t is None else t for t in type_starts], dtype=np.int64)
            token_types = torch.from_numpy((positions >= first_of_type_1[req_index]).astype(np.int64)).to(self.device)
        for state in states:
            state.num_computed_tokens = state.num_tokens
        inputs = (torch.from_numpy(input_ids).to(self.device), torch.from_numpy(positions).to(self.device),
                  EncoderMetadata.build(query_start_loc, self.device, self.encoder_batches_padded))
        # (Token types only reach a model that takes them: the engine refuses them for the others.)
        hidden = self.model(*inputs) if token_types is None else self.model(*inputs, token_types)
        return hidden, list(range(num_reqs)), query_start_loc[1:] - 1

    def _profile_recurrent_decodes(self, mixers: list[nn.Module], block_size: int) -> None:
        """A pass of max_num_seqs decodes through a model with recurrent layers: each layer gathers
        their states (one copy of max_num_seqs rows), which a long prefill does not show. They all
        read one state row (the states' own memory is counted apart: Worker.mamba_state_bytes)."""
        n = self.max_num_seqs
        for mixer in mixers:
            mixer.state = self._new_mamba_state(mixer, 1)
        qsl = np.arange(n + 1, dtype=np.int64)
        zeros = np.zeros(n, dtype=np.int64)
        meta = self.attention_metadata(np.zeros((n, 1), dtype=np.int64), np.ones(n, dtype=np.int64), qsl, zeros, n,
                                       zeros, block_size, decode_in_place=False)
        meta.mamba = mamba_step_metadata(zeros, qsl, self.device)
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        if distributed.is_first_stage():
            self.model(ids, ids, meta)
        else:  # (a later pipeline stage starts from what the one before sends)
            self.model(ids, ids, meta, intermediate=tuple(
                torch.zeros(n, self.config.hidden_size, dtype=self.dtype, device=self.device) for _ in range(2)))

    def _new_mamba_state(self, mixer: nn.Module, rows: int) -> MambaState:
        conv_dtype, ssm_dtype = self.mamba_state_dtypes
        return MambaState.allocate(mixer.config, rows, conv_dtype, self.device, ssm_dtype)

    def _bind_mamba_states(self, rows: int) -> None:
        """Zeroed recurrent states of ``rows`` request rows for every mixer (none without mixers)."""
        self.mamba_states = [self._new_mamba_state(mixer, rows) for mixer in self.mamba_mixers]
        for mixer, state in zip(self.mamba_mixers, self.mamba_states, strict=True):
            mixer.state = state
        slots = self.num_recurrent_state_slots + rows * self.num_spec_tokens
        self.kept_states = [self._new_mamba_state(mixer, slots) for mixer in self.mamba_mixers] if slots else []
        for live, kept in zip(self.mamba_states, self.kept_states, strict=bool(slots)):
            live.kept = kept  # (the mixers copy states kept part-way through a chunk into these)

    def mamba_step(self, rows: np.ndarray, starts: np.ndarray, query_start_loc: np.ndarray,
                   kept_within: dict[int, list[tuple[int, int]]] | None = None, token_by_token: Collection[int] = ()):
        """The pass's recurrent-layer metadata; the state rows of requests starting at token 0 (new, or
        recomputed after preemption) zeroed first. A request's row is its row of the block table,
        which stays its own while it is held (more rows than max_num_seqs: the states grow).
        ``kept_within``: request index -> states kept part-way through its chunk; ``token_by_token``:
        the requests verifying drafts (mamba_step_metadata)."""
        self._grow_mamba_states(int(rows.max()) + 1)
        fresh = rows[starts == 0]
        if len(fresh):
            index = torch.from_numpy(np.ascontiguousarray(fresh, dtype=np.int64)).to(self.device)
            for state in self.mamba_states:
                state.zero_rows(index)
        return mamba_step_metadata(rows, query_start_loc, self.device, kept_within, token_by_token)

    def _grow_mamba_states(self, needed: int) -> None:
        capacity = self.mamba_states[0].ssm.shape[0]
        if needed > capacity:
            more = [(state, needed - capacity) for state in self.mamba_states]
            if self.num_spec_tokens:  # (and the new rows' slots after drafts, at the kept slots' end)
                more += [(kept, (needed - capacity) * self.num_spec_tokens) for kept in self.kept_states]
            for state, rows in more:
                state.conv = torch.cat((state.conv, state.conv.new_zeros((rows, *state.conv.shape[1:]))))
                state.ssm = torch.cat((state.ssm, state.ssm.new_zeros((rows, *state.ssm.shape[1:]))))

    def _draft_state_slot(self, row: int, accepted: int) -> int:
        """The kept-state slot holding the state of live row ``row`` after its pass's certain tokens and
        ``accepted`` of its drafts (0 <= accepted < num_spec_tokens; all of them: the live row itself)."""
        return self.num_recurrent_state_slots + row * self.num_spec_tokens + accepted

    def _keep_states_after_drafts(self, drafts: dict[str, list[int]], num_scheduled_tokens: dict[str, int],
                                  kept_within: dict[str, list[tuple[int, int]]]) -> None:
        """Speculative decoding on recurrent layers: a request's state before each of its drafts is
        kept (added to ``kept_within``, req_id -> [(tokens into the chunk, slot)]; its recurrent layers
        take the pass's tokens one at a time, mamba_step_metadata), so that a pass rejecting drafts puts
        the request back to the state after the ones it accepted (_roll_back_rejected_drafts)."""
        for req_id, draft in drafts.items():
            if not draft:
                continue
            certain = num_scheduled_tokens[req_id] - len(draft)  # (the tokens before the drafts)
            row = self.requests[req_id].table_row
            kept = kept_within.get(req_id, [])
            kept += [(certain + j, self._draft_state_slot(row, j)) for j in range(len(draft))]
            kept_within[req_id] = sorted(kept)

    def _roll_back_rejected_drafts(self) -> None:
        """Requests whose last verifying pass computed tokens the scheduler did not keep
        (RequestStates.rejected_drafts: table row -> drafts kept; every rank learns it alike, from the
        next pass's scheduled tokens): each one's recurrent states put back to those after the drafts
        kept."""
        rejected, self.requests.rejected_drafts = self.requests.rejected_drafts, {}
        rows = torch.tensor(list(rejected), dtype=torch.int64, device=self.device)
        slots = torch.tensor([self._draft_state_slot(row, n) for row, n in rejected.items()], dtype=torch.int64,
                             device=self.device)
        self._copy_kept(rows, slots, into_rows=True)

    def _kept_state_positions(self, saves: dict[str, list[tuple[int, int]]], num_scheduled_tokens: dict[str, int]
                              ) -> tuple[dict[str, list[tuple[int, int]]], dict[str, int]]:
        """The prefix cache's recurrent-state saves (SchedulerOutput.recurrent_state_saves: req_id ->
        [(position, slot)]) as this pass makes them: those inside a request's chunk (req_id -> [(tokens
        into the chunk, slot)]: the mixers copy them out where their scan passes them) and those at its
        end (req_id -> slot: copied after the forward)."""
        within: dict[str, list[tuple[int, int]]] = {}
        at_end: dict[str, int] = {}
        if not saves or not self.mamba_mixers:  # (a pipeline stage of attention layers alone keeps none)
            return within, at_end
        if not self.num_recurrent_state_slots:  # (the scheduler and the workers count the same slots)
            raise RuntimeError(f"the scheduler asks for {len(saves)} requests' recurrent states kept, and this "
                               "worker keeps no recurrent states")
        for req_id, kept in saves.items():
            start = self.requests[req_id].num_computed_tokens
            end = start + num_scheduled_tokens[req_id]
            for position, slot in kept:
                if position == end:
                    at_end[req_id] = slot
                elif start < position < end:
                    within.setdefault(req_id, []).append((position - start, slot))
                else:
                    raise ValueError(f"request {req_id!r}: a recurrent state kept at {position}, outside this "
                                     f"pass's tokens {start} to {end}")
        return within, at_end

    def copy_kept_states(self, copies: dict[str, int], restore: bool) -> None:
        """The prefix cache's recurrent-state copies, req_id -> slot: each request's row from its slot
        (``restore``: SchedulerOutput.recurrent_state_restores, before the pass's forward), or into it
        (the saves at the end of its chunk, after the forward: _kept_state_positions)."""
        if not copies or not self.mamba_mixers:  # (a pipeline stage of attention layers alone keeps none)
            return
        if not self.num_recurrent_state_slots:  # (the scheduler and the workers count the same slots)
            raise RuntimeError(f"the scheduler asks for {len(copies)} recurrent-state copies, and this worker keeps "
                               "no recurrent states")
        rows = torch.tensor([self.requests[r].table_row for r in copies], dtype=torch.int64)
        slots = torch.tensor(list(copies.values()), dtype=torch.int64)
        if restore:
            self._grow_mamba_states(int(rows.max()) + 1)
        self._copy_kept(rows.to(self.device), slots.to(self.device), into_rows=restore)

    def _copy_kept(self, rows: torch.Tensor, slots: torch.Tensor, into_rows: bool) -> None:
        """Every mixer's convolution and recurrent states of live ``rows`` from the kept ``slots``
        (``into_rows``), or into them."""
        for live, kept in zip(self.mamba_states, self.kept_states, strict=True):
            if into_rows:
                live.conv.index_copy_(0, rows, kept.conv.index_select(0, slots))
                live.ssm.index_copy_(0, rows, kept.ssm.index_select(0, slots))
            else:
                kept.conv.index_copy_(0, slots, live.conv.index_select(0, rows))
                kept.ssm.index_copy_(0, slots, live.ssm.index_select(0, rows))

    def cacheless_num_blocks(self, block_size: int) -> int:
        """An encoder's KV blocks cost no memory (it keeps no cache): enough for the scheduler to
        count a full pass of prompts, and one at the longest length."""
        per_pass = -(-self.max_num_batched_tokens // block_size) + self.max_num_seqs
        return max(per_pass, -(-self.max_model_len // block_size))

    def attention_metadata(self, block_table: np.ndarray, num_blocks: np.ndarray, query_start_loc: np.ndarray,
                            starts: np.ndarray, num_decodes: int, slot_mapping: np.ndarray, block_size: int,
                            decode_in_place: bool, bidirectional: dict[int, list[tuple[int, int]]] | None = None,
                            group_tables: list[tuple[np.ndarray, np.ndarray] | None] | None = None
                            ) -> AttentionMetadata:
        """This step's metadata for the model's layers: full attention, a sliding window, or (Qwen2's
        upper layers) both, the windowed one hung on the full one. ``bidirectional``: Gemma 3's
        images' position ranges, by request index (see build_attention_metadata). ``group_tables``:
        under the hybrid KV cache manager, each further group's (block table, slot mapping): each
        group's metadata then reads its own blocks (AttentionMetadata.groups; None for a group whose
        table is None, with no layers on this pipeline stage)."""
        # (The layers' one window besides full attention: a sliding one, or Llama 4's chunks.)
        windows = self.attention_windows
        window = next((w for w in windows if w is not None), None)
        if decode_in_place:
            num_decodes = self._decode_requests(query_start_loc, num_decodes, bidirectional)
        grouping = self.kv_cache_grouping
        meta = build_attention_metadata(block_table, num_blocks, query_start_loc, starts, num_decodes, slot_mapping,
                                        block_size, self.device, decode_in_place,
                                        window=None if None in windows else window, bidirectional=bidirectional)
        if group_tables and grouping is not None:
            # (Groups of one window share its masks: a group's own are only its blocks and slots.)
            by_window: dict[Window | None, AttentionMetadata] = {None: meta}
            meta.groups = [meta]
            for entry, group_window in zip(group_tables, grouping.windows[1:], strict=True):
                if entry is None:
                    meta.groups.append(None)
                    continue
                table, slots = entry
                group_meta = build_attention_metadata(table, num_blocks, query_start_loc, starts, num_decodes, slots,
                                                      block_size, self.device, decode_in_place, window=group_window,
                                                      bidirectional=bidirectional, like=by_window.get(group_window))
                by_window.setdefault(group_window, group_meta)
                meta.groups.append(group_meta)
        elif None in windows and window in windows:
            meta.windowed = build_attention_metadata(block_table, num_blocks, query_start_loc, starts, num_decodes,
                                                     meta.slot_mapping, block_size, self.device, decode_in_place,
                                                     window=window, bidirectional=bidirectional)
        return meta

    def _decode_requests(self, query_start_loc: np.ndarray, num_decodes: int,
                         bidirectional: dict[int, list[tuple[int, int]]] | None) -> int:
        """How many requests attend as decodes where the kernel reads the cache in place: the
        ``num_decodes`` one-token ones first, then the short queries after them (a pass verifying up
        to num_spec_tokens drafts, or a drafter following it), each of whose tokens attends as a
        decode of its own position: one kernel call for them all rather than a prefill each."""
        query_lens = np.diff(query_start_loc)
        n = num_decodes
        while (n < len(query_lens) and query_lens[n] <= self.decode_query_max
               and (bidirectional is None or n not in bidirectional)):
            n += 1
        return n

    def _bidirectional_images(self, states: list[RequestState], starts: np.ndarray, ends: np.ndarray
                              ) -> dict[int, list[tuple[int, int]]] | None:
        """Gemma 3: the images each request's chunk reaches, as position ranges whose tokens see each
        other both ways (None for other models, or when no chunk reaches an image)."""
        vision = self.config.vision
        if vision is None or not vision.geometry.bidirectional:
            return None
        ranges = {}
        for i, s in enumerate(states):
            spans = [(f.offset, f.end) for f in s.mm_features or () if f.offset < ends[i] and f.end > starts[i]]
            if spans:
                ranges[i] = spans
        return ranges or None

    # ------------------------------------------------------------------ sampling inputs and outputs

    def _sampling_metadata(self, states: list[RequestState], vocab_size: int) -> SamplingMetadata:
        device = self.device
        params = [s.sampling_params for s in states]
        temps = [p.temperature for p in params]
        all_greedy = all(t == 0.0 for t in temps)
        md = SamplingMetadata(temperature=torch.tensor(temps, dtype=torch.float32, device=device),
                              all_greedy=all_greedy, all_random=all(t > 0.0 for t in temps))
        if not all_greedy:
            # (A greedy row's top-k, top-p and min-p are off, as vLLM's SamplingParams sets them: they
            # change nothing it samples, only its processed logprobs, which are then vLLM's.)
            top_k = [p.top_k if t > 0.0 else 0 for p, t in zip(params, temps, strict=True)]
            top_p = [p.top_p if t > 0.0 else 1.0 for p, t in zip(params, temps, strict=True)]
            min_p = [p.min_p if t > 0.0 else 0.0 for p, t in zip(params, temps, strict=True)]
            if any(k > 0 for k in top_k):
                md.top_k = torch.tensor(top_k, dtype=torch.int64, device=device)
            if any(p < 1.0 for p in top_p):
                md.top_p = torch.tensor(top_p, dtype=torch.float32, device=device)
            if any(p > 0.0 for p in min_p):
                md.min_p = torch.tensor(min_p, dtype=torch.float32, device=device)
            gens = {i: s.generator for i, s in enumerate(states) if s.generator is not None and temps[i] > 0}
            md.generators = gens or None
        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        use_freq = any(p.frequency_penalty != 0.0 for p in params)
        use_pres = any(p.presence_penalty != 0.0 for p in params)
        if use_rep or use_freq or use_pres:
            md.output_token_ids = _padded([s.output_token_ids for s in states], vocab_size, device)
            if use_rep:
                md.repetition_penalties = torch.tensor([p.repetition_penalty for p in params], device=device)
                # (A prompt given as embeddings has no tokens to penalise: its ids are placeholders.)
                md.prompt_token_ids = _padded([s.token_ids[: s.num_prompt_tokens] if s.prompt_embeds is None else []
                                               for s in states], vocab_size, device)
            if use_freq:
                md.frequency_penalties = torch.tensor([p.frequency_penalty for p in params], device=device)
            if use_pres:
                md.presence_penalties = torch.tensor([p.presence_penalty for p in params], device=device)
        rows: list[int] = []
        cols: list[int] = []
        for i, s in enumerate(states):
            p = s.sampling_params
            short_of_min = s.min_tokens_stop_ids and s.num_output_tokens < p.min_tokens
            if not short_of_min and not p.bad_words_token_ids:
                continue  # (most requests: nothing to ban)
            banned = list(s.min_tokens_stop_ids) if short_of_min else []
            if p.bad_words_token_ids:
                banned += bad_word_completions(p.bad_words_token_ids, s.token_ids, s.num_output_tokens)
            banned = [t for t in banned if t < vocab_size]
            rows.extend([i] * len(banned))
            cols.extend(banned)
        if rows:
            md.banned_tokens = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        allowed_rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
        if allowed_rows:
            md.allowed_token_ids = (torch.tensor(allowed_rows, device=device),
                                    torch.stack([self._allowed_mask(states[i], vocab_size) for i in allowed_rows]))
        bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
        if bias_rows:
            pairs = [self._logit_bias_tensors(states[i], vocab_size) for i in bias_rows]
            md.logit_bias = (torch.cat([torch.full_like(ids, i) for i, (ids, _) in zip(bias_rows, pairs, strict=True)]),
                             torch.cat([ids for ids, _ in pairs]), torch.cat([values for _, values in pairs]))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        if wanted:
            md.max_num_logprobs = max(wanted)
            if len(wanted) < len(params):  # ranks cost a pass over the vocabulary: only for these rows
                md.logprob_rows = torch.tensor([i for i, p in enumerate(params) if p.logprobs is not None],
                                               device=device)
        return md

    def _allowed_mask(self, state: RequestState, vocab_size: int) -> torch.Tensor:
        if state.allowed_mask is None:
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[[t for t in state.sampling_params.allowed_token_ids if t < vocab_size]] = True
            state.allowed_mask = mask.to(self.device)
        return state.allowed_mask

    def _logit_bias_tensors(self, state: RequestState, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if state.logit_bias_tensors is None:
            items = [(t, b) for t, b in state.sampling_params.logit_bias.items() if t < vocab_size]
            state.logit_bias_tensors = (torch.tensor([t for t, _ in items], dtype=torch.int64, device=self.device),
                                        torch.tensor([b for _, b in items], dtype=torch.float32, device=self.device))
        return state.logit_bias_tensors

    def _grammar_rows(self, grammar: GrammarBitmask, row_states: list[RequestState]
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The bitmask rows of the structured requests sampled this step, with their logits rows.
        ``row_states``: each logits row's request, a request's rows in order (one, or 1 + its
        drafts when drafts are verified): its j-th row takes its grammar's row j, the mask as of
        that position."""
        first: dict[str, tuple[int, int]] = {}  # req_id -> (its first bitmask row, its number of rows)
        at = 0
        for req_id, n in zip(grammar.request_ids, grammar.num_rows, strict=True):
            first[req_id] = (at, n)
            at += n
        seen: dict[str, int] = {}
        pairs = []
        for row, s in enumerate(row_states):
            entry = first.get(s.req_id)
            if entry is None:
                continue
            j = seen.get(s.req_id, 0)
            seen[s.req_id] = j + 1
            if j >= entry[1]:
                raise ValueError(f"request {s.req_id!r} samples more rows than its grammar has masks ({entry[1]})")
            pairs.append((row, entry[0] + j))
        if not pairs:
            return None
        rows, picks = zip(*pairs, strict=True)
        words = np.frombuffer(grammar.bitmask, dtype=np.int32).reshape(at, grammar.num_words)
        bitmask = torch.from_numpy(words[list(picks)])
        return torch.tensor(rows, device=self.device), bitmask.to(self.device)

    @staticmethod
    def _logprobs_entries(out: SamplerOutput, sample_rows: list[int], states: list[RequestState],
                          num_reqs: int) -> list[LogprobsEntry | None] | None:
        if out.sampled_logprobs is None:
            return None
        entries: list[LogprobsEntry | None] = [None] * num_reqs
        sampled_lp = out.sampled_logprobs.tolist()
        top_ids, top_lp = _top_rows(out.top_token_ids, out.top_logprobs, [s.sampling_params.logprobs for s in states])
        ranks = out.sampled_ranks.tolist() if out.sampled_ranks is not None else None
        for j, (row, state) in enumerate(zip(sample_rows, states, strict=True)):
            n = state.sampling_params.logprobs
            if n is None:
                continue
            top = list(zip(top_ids[j][:n], top_lp[j][:n], strict=True)) if n and top_ids is not None else []
            entries[row] = LogprobsEntry(sampled_logprobs=[sampled_lp[j]], top_logprobs=[top],
                                         ranks=[ranks[j]] if ranks is not None else None)
        return entries


# Up to this many alternatives per row, a pass's best-token tensors become Python lists whole (one
# call); beyond it (a request asked for the vocabulary) each row is cut to what its request asked for
# first, so the others' rows are not turned into Python objects.
_WHOLE_TOLIST_MAX_K = 64


def _top_rows(top_ids: torch.Tensor | None, top_lp: torch.Tensor | None, wanted: list[int | None]
              ) -> tuple[list[list[int]] | None, list[list[float]] | None]:
    """Each row's best tokens and their logprobs as lists, at least ``wanted[j]`` of them (rows that
    want none: empty)."""
    if top_ids is None or top_lp is None:
        return None, None
    if top_ids.shape[-1] <= _WHOLE_TOLIST_MAX_K:
        return top_ids.tolist(), top_lp.tolist()
    ids: list[list[int]] = []
    lps: list[list[float]] = []
    for j, n in enumerate(wanted):
        ids.append(top_ids[j, :n].tolist() if n else [])
        lps.append(top_lp[j, :n].tolist() if n else [])
    return ids, lps


def bad_word_completions(bad_words: list[list[int]], token_ids: list[int], num_output_tokens: int) -> list[int]:
    """The tokens that would complete a bad word now: a one-token word always; a longer one when
    the output (``token_ids``' last ``num_output_tokens``) ends with all of its tokens but the last
    (vLLM's rule: the prompt does not count)."""
    banned = []
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or (len(prefix) <= num_output_tokens and token_ids[-len(prefix):] == prefix):
            banned.append(word[-1])
    return banned
