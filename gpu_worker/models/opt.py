"""Meta's OPT (OPTForCausalLM: opt-125m to opt-66b, and fine-tunes of them): learned positions (the
table's first two rows never read: position p is row p + 2) added to the token embeddings, LayerNorms
before attention and MLP, biases on every projection (enable_bias), an ungated relu MLP (fc1, fc2),
the head tied to the embedding. The checkpoints' ``decoder`` (under ``model.`` or not) and its layers'
names (self_attn_layer_norm, final_layer_norm, out_proj, fc1 and fc2 beside them) are read as ours.

opt-350m's layout is not served (its norms after each sublayer, do_layer_norm_before false, and its
embeddings narrower than its layers, word_embed_proj_dim): ModelConfig refuses it. BioGPT and XGLM are
OPT's layers with scaled token embeddings (and XGLM's sinusoidal positions).
"""

from __future__ import annotations

from gpu_worker.layers.layernorm import LayerNorm
from gpu_worker.models.classic import PhiMLP
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from gpu_worker.models.renamed_checkpoint import RenamedCheckpoint, rename_parts


class OPTDecoderLayer(LlamaDecoderLayer):
    norm_class = LayerNorm
    mlp_class = PhiMLP  # (fc1, fc2)


class OPTModel(LlamaModel):
    layer_class = OPTDecoderLayer


class OPTForCausalLM(RenamedCheckpoint, LlamaForCausalLM):
    model_class = OPTModel
    renames = (("model.final_layer_norm.", "model.norm."), (".self_attn_layer_norm.", ".input_layernorm."),
               (".final_layer_norm.", ".post_attention_layernorm."), (".self_attn.out_proj.", ".self_attn.o_proj."),
               (".fc1.", ".mlp.fc1."), (".fc2.", ".mlp.fc2."))

    def ours(self, name: str) -> str:
        for prefix in ("model.decoder.", "decoder."):
            if name.startswith(prefix):
                name = "model." + name[len(prefix):]
                break
        return rename_parts(name, self.renames)


class BioGptForCausalLM(OPTForCausalLM):
    """Microsoft's BioGPT (BioGptForCausalLM: biogpt, BioGPT-Large, BioGPT-Large-PubMedQA): OPT's layers (GELU)
    with its token embeddings times sqrt(hidden_size) (scale_embedding) before the learned positions are
    added; its ``biogpt.`` names, ``layer_norm`` (the final norm) and ``output_projection`` (the head)
    read as ours."""

    renames = (("model.layer_norm.", "model.norm."), *OPTForCausalLM.renames)

    def ours(self, name: str) -> str:
        if name.startswith("biogpt."):
            name = "model." + name[len("biogpt."):]
        elif name.startswith("output_projection."):
            name = "lm_head." + name[len("output_projection."):]
        return rename_parts(name, self.renames)


class XGLMForCausalLM(BioGptForCausalLM):
    """Meta's XGLM (XGLMForCausalLM: xglm-564M .. 7.5B): BioGPT's arrangement with fairseq's fixed sinusoidal
    positions (ModelConfig.sinusoidal_positions, nothing read for them: an older save's copy of the table,
    ``embed_positions.weights``, and fairseq's ``_float_tensor`` are skipped); its names under ``model.``."""

    skipped = ("embed_positions.weights", "_float_tensor")
