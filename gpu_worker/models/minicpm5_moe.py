"""OpenBMB's MiniCPM5-MoE (MiniCPM5MoeForCausalLM: MiniCPM5-15B-A2.5B): Llama's layers with a gated
attention (q_proj gives each head its queries and then its output gate, as Qwen3-Next's, without
q/k norms, RoPE over whole heads) and DeepSeek-V3's routed experts (sigmoid scores through the
correction bias, in an fp32 router, renormalised and scaled) beside an ungated shared expert, in
the layers ``mlp_layer_types`` calls sparse (a dense MLP in the others: the first, by default)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from gpu_worker.models.qwen3_next import Qwen3NextAttention


class OutputGatedAttention(Qwen3NextAttention):
    """Qwen3-Next's gated attention without its q/k norms."""

    qk_normed = False


class MiniCPM5MoeDecoderLayer(LlamaDecoderLayer):
    attention_class = OutputGatedAttention  # type: ignore[assignment]


class MiniCPM5MoeModel(LlamaModel):
    layer_class = MiniCPM5MoeDecoderLayer


class MiniCPM5MoeForCausalLM(LlamaForCausalLM):
    model_class = MiniCPM5MoeModel

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """(transformers' own name for the query-and-gate projection, q_gate_proj, read as the
        released checkpoints' q_proj)"""
        for name, tensor in weights:
            yield name.replace(".self_attn.q_gate_proj.", ".self_attn.q_proj."), tensor

    def lora_module_name(self, module: str) -> str:
        """An adapter's modules as PEFT names them on transformers' model (its q_gate_proj: our q_proj)."""
        return module.replace(".self_attn.q_gate_proj", ".self_attn.q_proj")
