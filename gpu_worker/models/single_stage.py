"""What the causal LMs with a decoder stack of their own share when that stack is never split into
pipeline stages (the models with recurrent layers: Nemotron-H, Zamba2): the decoder
(``model_class``), its LM head (tied to the embedding where the config says), the logits."""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.embedding import ParallelLMHead


class SingleStageCausalLM(nn.Module):
    model_class: type[nn.Module]

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config)
        self.pp_missing_prefixes: tuple[str, ...] = ()
        self.lm_head = None if config.embedding_only else ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.score = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return self.model.forward(input_ids, positions, meta, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens.forward(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.lm_head is None:
            raise RuntimeError("this model is served for embeddings only: it has no LM head")
        return self.lm_head(hidden)
