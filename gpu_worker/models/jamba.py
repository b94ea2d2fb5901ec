"""AI21's Jamba (Jamba-v0.1, Jamba-1.5 / 1.6 / 1.7 Mini and Large, Jamba-Reasoning-3B): a hybrid
decoder whose layers are Mamba-1 mixers (gpu_worker.layers.mamba1; dt, B and C RMS-normed with their
own weights) but every attn_layer_period-th one, which attends without positions; every
expert_layer_period-th layer's MLP is routed experts (the softmax's top k, not renormalised).
Bamba's tensor names (``feed_forward``, ``pre_ff_layernorm``, ``final_layernorm``), the router's
``router``."""

from __future__ import annotations

from gpu_worker.layers.mamba1 import MambaMixer
from gpu_worker.models.llama import BambaForCausalLM, LlamaDecoderLayer, LlamaModel


class JambaDecoderLayer(LlamaDecoderLayer):
    recurrent_class = MambaMixer


class JambaModel(LlamaModel):
    layer_class = JambaDecoderLayer


class JambaForCausalLM(BambaForCausalLM):
    model_class = JambaModel

    def lora_module_name(self, name: str) -> str:
        """A checkpoint's (or an adapter's) name as ours: Bamba's, and the router our gate (Bamba's
        checkpoint_tensors reads every tensor's name through it)."""
        return f"{super().lora_module_name(name)}.".replace(".mlp.router.", ".mlp.gate.")[:-1]
