"""Cluster: configuration, Ray placement of engines, the Serve application, the CLI and the offline LLM API."""

from cluster.llm import (
    LLM,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
    SamplingParams,
)
from engine_core.outputs import LoRARequest

__all__ = ["LLM", "CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "LoRARequest", "Logprob",
           "RequestOutput", "SamplingParams"]
