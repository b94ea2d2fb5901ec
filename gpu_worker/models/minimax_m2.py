"""MiniMax-M2 and M2.1 (MiniMaxM2ForCausalLM, 230B with 10B active): the Llama block (norms before
each sublayer) with the queries and keys normed over their whole projections before a RoPE over the
first half of each head (OLMoE's attention: gpu_worker/models/olmo2.py), and routed experts in every
layer chosen by sigmoid scores through a correction bias, the top k's weights renormalised
(SparseMoeBlock, with an fp32 router as vLLM keeps it). The checkpoint names the experts as Mixtral's
(``block_sparse_moe``, w1 / w3 / w2) with the bias beside the router; its multi-token-prediction
layers (numbered after the decoder's) are not read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.llama import SkipsMtpLayers
from gpu_worker.models.olmo2 import OlmoeForCausalLM


class MiniMaxM2ForCausalLM(SkipsMtpLayers, OlmoeForCausalLM):
    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:
            # (As released, and as transformers 5 names the bias.)
            for theirs in (".block_sparse_moe.e_score_correction_bias", ".mlp.e_score_correction_bias"):
                name = name.replace(theirs, ".mlp.gate.e_score_correction_bias")
            yield name.replace(".block_sparse_moe.", ".mlp."), tensor
