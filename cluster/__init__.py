"""Cluster: configuration, Ray placement of engines, the Serve application, the CLI and the offline LLM API."""

from cluster.llm import (
    LLM,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    SamplingParams,
    ScoringOutput,
    ScoringRequestOutput,
)
from engine_core.outputs import LoRARequest

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "ClassificationOutput",
           "ClassificationRequestOutput", "CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
           "LoRARequest", "Logprob", "PoolingOutput", "PoolingRequestOutput", "RequestOutput", "SamplingParams",
           "ScoringOutput", "ScoringRequestOutput"]
