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
    PoolingParams,
    PoolingRequestOutput,
    RequestOutput,
    SamplingParams,
    ScoringOutput,
    ScoringRequestOutput,
)
from engine_core.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorContext,
    MoveDirectionality,
)
from engine_core.outputs import LoRARequest

__all__ = ["LLM", "AdapterLogitsProcessor", "BatchUpdate", "BeamSearchOutput", "BeamSearchParams",
           "BeamSearchSequence", "ClassificationOutput", "ClassificationRequestOutput", "CompletionOutput",
           "EmbeddingOutput", "EmbeddingRequestOutput", "LoRARequest", "LogitsProcessor", "LogitsProcessorContext",
           "Logprob", "MoveDirectionality", "PoolingOutput", "PoolingParams", "PoolingRequestOutput", "RequestOutput",
           "SamplingParams", "ScoringOutput", "ScoringRequestOutput"]
