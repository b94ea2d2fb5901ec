"""TII's Falcon-H1 (Falcon-H1-0.5B / 1.5B / 1.5B-Deep / 3B / 7B / 34B, Falcon-H1R): a parallel hybrid.
Every layer runs grouped-query attention and a Mamba-2 mixer side by side on the same normed input
and adds their outputs to the residual, then a SwiGLU MLP; Bamba's tensor names.

Falcon-H1 was trained with muP multipliers on its projections' inputs and outputs: the attention's
input (attention_in_multiplier), its keys (key_multiplier) and output (attention_out_multiplier), the
mixer's input (ssm_in_multiplier), each part of its in_proj output (ssm_multipliers: z, x, B, C, dt)
and its output (ssm_out_multiplier), the MLP's gate and output (mlp_multipliers). Each scales a
linear map's input or output, so it is folded into that map's weights (and biases) as the checkpoint
is read; the embedding and LM-head multipliers are ModelConfig's embedding_multiplier and
logits_scaling. Its mixer may leave out the gated norm (mamba_rms_norm: y * silu(z) goes to out_proj)
or norm y before the gate (mamba_norm_before_gate).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.weight_utils import WeightLike, materialize
from gpu_worker.models.llama import BambaForCausalLM, LlamaDecoderLayer, LlamaModel


class FalconH1DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.self_attn = self.attention_class(config, layer, self.norm_class)  # (beside the mixer)

    def _mix(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.mamba.forward(rope, hidden, meta) + self.self_attn.forward(rope, hidden, meta)


class FalconH1Model(LlamaModel):
    layer_class = FalconH1DecoderLayer


class FalconH1ForCausalLM(BambaForCausalLM):
    model_class = FalconH1Model

    def _multipliers(self) -> dict[str, tuple[float | torch.Tensor, float | torch.Tensor]]:
        """Per projection (our names): (its weight's scale, its bias's): a float, or a scale per
        output row (in_proj's z, x, B, C and dt rows)."""
        raw, m = self.config.raw, self.config.mamba
        attn_in, key = float(raw.get("attention_in_multiplier", 1.0)), float(raw.get("key_multiplier", 1.0))
        attn_out = float(raw.get("attention_out_multiplier", 1.0))
        ssm_in, ssm_out = float(raw.get("ssm_in_multiplier", 1.0)), float(raw.get("ssm_out_multiplier", 1.0))
        gate, down = (float(v) for v in raw.get("mlp_multipliers") or (1.0, 1.0))
        z, x, b, c, dt = (float(v) for v in raw.get("ssm_multipliers") or (1.0,) * 5)
        bc = m.num_groups * m.state_size
        rows = torch.cat([torch.full((count,), scale) for count, scale in (
            (m.intermediate_size, z), (m.intermediate_size, x), (bc, b), (bc, c), (m.num_heads, dt))])
        return {".self_attn.q_proj.": (attn_in, 1.0), ".self_attn.k_proj.": (attn_in * key, key),
                ".self_attn.v_proj.": (attn_in, 1.0), ".self_attn.o_proj.": (attn_out, attn_out),
                ".mamba.in_proj.": (rows * ssm_in, rows), ".mamba.out_proj.": (ssm_out, ssm_out),
                ".mlp.gate_proj.": (gate, gate), ".mlp.down_proj.": (down, down)}

    def lora_b_rows(self, module: str, b: torch.Tensor) -> torch.Tensor:
        """A LoRA adapter's B for ``module`` scaled as the base weight's rows were at load (the
        multipliers scale a projection's outputs, or its inputs, the same for its low-rank update)."""
        for part, (weight_scale, _) in self._multipliers().items():
            if part in f"{module}.":
                if isinstance(weight_scale, torch.Tensor):
                    return b * weight_scale.to(b.device, b.dtype)[:, None]
                return b * weight_scale
        return b

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        multipliers = self._multipliers()
        skipped = self.pp_missing_prefixes  # (other pipeline stages' layers: not read, so not scaled)
        for name, tensor in super().checkpoint_tensors(weights):
            if skipped and name.startswith(skipped):
                yield name, tensor
                continue
            for part, (weight_scale, bias_scale) in multipliers.items():
                if part in name:
                    scale = weight_scale if name.endswith(".weight") else bias_scale
                    if isinstance(scale, torch.Tensor) or scale != 1.0:
                        loaded = materialize(tensor)
                        if isinstance(scale, torch.Tensor):  # (one per output row)
                            scale = scale.to(loaded.device).view(-1, *([1] * (loaded.dim() - 1)))
                        tensor = (loaded.float() * scale).to(loaded.dtype)
                    break
            yield name, tensor
