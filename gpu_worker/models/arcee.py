"""Arcee's AFM (ArceeForCausalLM: AFM-4.5B): the Llama block with an ungated MLP of relu(x)^2
(``up_proj``, ``down_proj``), Nemotron-H's MLP."""

from __future__ import annotations

from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, UngatedMLP


class ArceeDecoderLayer(LlamaDecoderLayer):
    mlp_class = UngatedMLP


class ArceeModel(LlamaModel):
    layer_class = ArceeDecoderLayer


class ArceeForCausalLM(LlamaForCausalLM):
    model_class = ArceeModel
