"""BigScience's BLOOM (BloomForCausalLM: bloom-560m to bloom-176b, bloomz, and their fine-tunes):
ALiBi in place of RoPE (layers.attention), a LayerNorm over the embeddings before the first layer
(``word_embeddings_layernorm``: ModelConfig.embedding_norm), LayerNorms before attention and MLP,
biases everywhere, q/k/v fused per head in ``query_key_value`` (each head's q, k and v rows
together, as GPT-NeoX's: split at load), an ungated tanh-gelu MLP (dense_h_to_4h, dense_4h_to_h), the
head tied to the embedding. Its checkpoints' names, with ``transformer.`` before them or not (as
bigscience saved bloom-560m), are read as ours.
"""

from __future__ import annotations

from gpu_worker.layers.layernorm import LayerNorm
from gpu_worker.models.classic import GPTNeoXMLP
from gpu_worker.models.gpt2 import GPTCheckpoint
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

# BLOOM's top-level modules -> ours (after an optional "transformer." prefix).
_TOP_LEVEL = (("word_embeddings_layernorm.", "model.embed_norm."), ("word_embeddings.", "model.embed_tokens."),
              ("ln_f.", "model.norm."), ("h.", "model.layers."))


class BloomDecoderLayer(LlamaDecoderLayer):
    norm_class = LayerNorm
    mlp_class = GPTNeoXMLP  # (dense_h_to_4h, dense_4h_to_h)


class BloomModel(LlamaModel):
    layer_class = BloomDecoderLayer


class BloomForCausalLM(GPTCheckpoint, LlamaForCausalLM):
    """BLOOM's names, read as the GPT family's are (``transformer.`` before them or not)."""

    model_class = BloomModel
    skipped = ()
    top_level = _TOP_LEVEL
    renames = ((".self_attention.dense.", ".self_attn.o_proj."), (".self_attention.", ".self_attn."))
    fused = ".self_attn.query_key_value."
