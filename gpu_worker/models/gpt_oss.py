"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): the Llama-family decoder of ``llama.py`` with

* q/k/v and o biases, and a learnt attention sink per query head (``PagedAttention``'s ``sinks``);
* a 128-token sliding window on every other layer (``layer_types``) and YaRN RoPE;
* routed experts in every layer: a router with a bias, experts with biases on both projections and a
  clamped SwiGLU (``FusedMoE``'s ``swigluoai``).

What is GPT-OSS's own is the checkpoint layout, turned into ours here: the router is ``mlp.router``
(ours ``mlp.gate``), the sinks ``self_attn.sinks``, and the experts are stacked per layer with each
matrix stored [experts, in, out] and the gate and up columns interleaved (gate at the even columns).
The released checkpoints store the experts in MXFP4 (``gpu_worker.mxfp4_checkpoint`` dequantizes them
into this same layout first).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from gpu_worker.layers.weight_utils import WeightLike, materialize
from gpu_worker.models.llama import LlamaForCausalLM


def _gate_then_up(interleaved: torch.Tensor) -> torch.Tensor:
    """[..., 2n] with gate at the even and up at the odd indices -> [..., 2n] gate, then up."""
    return torch.cat((interleaved[..., 0::2], interleaved[..., 1::2]), dim=-1)


class GptOssForCausalLM(LlamaForCausalLM):
    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """GPT-OSS's names and expert layout -> the stacked experts FusedMoE loads: gate_up
        [experts, 2 x width, hidden] (gate rows, then up), down [experts, hidden, width]."""
        others = self.pp_missing_prefixes  # (other pipeline stages' layers: not read, so not converted)
        for name, tensor in weights:
            if others and name.startswith(others):
                yield name, tensor
            elif name.endswith(".self_attn.sinks"):
                yield name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), tensor
            elif ".mlp.router." in name:
                yield name.replace(".mlp.router.", ".mlp.gate."), tensor
            elif name.endswith(".mlp.experts.gate_up_proj"):
                yield name, _gate_then_up(materialize(tensor)).transpose(1, 2)
            elif name.endswith(".mlp.experts.gate_up_proj_bias"):
                yield name, _gate_then_up(materialize(tensor))
            elif name.endswith(".mlp.experts.down_proj"):
                yield name, materialize(tensor).transpose(1, 2)
            else:
                yield name, tensor

    @staticmethod
    def lora_module_name(module: str) -> str:
        """An adapter's router (GPT-OSS's ``mlp.router``) is our ``mlp.gate``."""
        return f"{module}.".replace(".mlp.router.", ".mlp.gate.")[:-1]

    @staticmethod
    def lora_b_rows(module: str, b: torch.Tensor) -> torch.Tensor:
        """An adapter's B on the experts' stacked gate_up_proj ([experts, 2 x width, R]), its rows (gate
        and up interleaved, as the weight's columns are) gate, then up, as the weight was loaded."""
        if module.endswith(".mlp.experts.gate_up_proj"):
            return torch.cat((b[:, 0::2], b[:, 1::2]), dim=1)
        return b
