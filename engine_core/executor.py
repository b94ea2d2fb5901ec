"""The executor contract: how an EngineCore reaches its model workers.

Implementations live with the workers (gpu_worker/executor.py) and are handed to the engine as a
factory, so engine_core never imports gpu_worker.
"""

from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from engine_core.config import EngineConfig, SchedulerConfig
from engine_core.core.kv_cache_utils import AttentionWindow
from engine_core.multimodal import ImageGeometry
from engine_core.outputs import LoRARequest, ModelRunnerOutput
from engine_core.sched.output import SchedulerOutput


def engine_uses_gpu(config: EngineConfig) -> bool:
    """Where an engine's workers are placed: "auto" means CUDA when the Ray cluster has GPUs."""
    if config.device != "auto":
        return config.device == "cuda"
    import ray

    return ray.cluster_resources().get("GPU", 0) >= 1


# vLLM's pooling tasks a /pooling request (or LLM.encode) may ask for.
POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify")


@dataclass(frozen=True)
class PoolingInfo:
    """What a model serves besides (or instead of) tokens: the router's pooling endpoints and the
    offline LLM read it from the engines."""

    # False for an embedding-only model (no LM head, --runner pooling): generation is refused.
    generates: bool = True
    # How embeddings are pooled ("LAST", "MEAN", "CLS"; "ALL" and "STEP" per token), and whether they
    # are L2-normalised by default.
    pooling_type: str = "LAST"
    normalize: bool = True
    # Why its embeddings cannot be served as its checkpoint declares them ("" when they can): a
    # generating model whose sentence-transformers files ask for what is not served.
    unavailable: str = ""
    # A sequence classifier's class names (its "embeddings" are class logits); () otherwise; what
    # turns them into /classify's probabilities ("softmax", "sigmoid" or "none"), and a one-output
    # cross-encoder's logit into a /score score ("sigmoid" or "none").
    labels: tuple[str, ...] = ()
    classifier_activation: str = "softmax"
    cross_encoder_activation: str = "sigmoid"
    # Whether its inputs take token types (BERT's two: a cross-encoder pair's second text is type 1).
    token_types: bool = False
    # STEP pooling's settings (gpu_worker.pooler_config): the positions kept (those of this token;
    # None: all), and the columns of each row kept (None: all).
    step_tag_id: int | None = None
    returned_token_ids: tuple[int, ...] | None = None
    # The values in one pooled row (a class logit each, or the embedding's; STEP: the columns kept).
    row_size: int = 0
    # The pooling tasks an embedding model answers with per-token heads of its own (BGE-M3's:
    # token_classify, each token's lexical weight; token_embed, its ColBERT vector), and the one a
    # request asks for (for_task sets it).
    token_heads: tuple[str, ...] = ()
    task: str | None = None
    # A late-interaction (ColBERT) model: each text embeds as one vector a token (token_embed), and a
    # pair scores by MaxSim rather than cosine similarity.
    late_interaction: bool = False
    # Whether its embeddings were trained to be cut short (Matryoshka), and the lengths it was
    # trained at (() : any), as vLLM reads them from the config (is_matryoshka, matryoshka_dimensions).
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    # A sentence-transformers checkpoint's named prompts ((name, prefix) pairs: Cohere's input_type
    # picks one), and whether it lowercases its texts (do_lower_case), as vLLM reads them.
    prompts: tuple[tuple[str, str], ...] = ()
    do_lower_case: bool = False
    # An LLM served as a reranker (classifier_from_token) reads a scored pair as one text, the two
    # joined, as vLLM tokenizes it (its use_pad_token false); a cross-encoder reads it through the
    # tokenizer's pair template (BERT's [SEP]s).
    joins_pair_text: bool = False

    def dimensions_problem(self, dimensions: int | None, model: str, hidden_size: int) -> str:
        """Why a request's ``dimensions`` cannot be served ("" when it can), as vLLM refuses it: a
        model not trained for shorter embeddings would answer poor ones. (Bounded by each row's
        width when pooling every token, else by the model's embedding size, ``hidden_size``.)"""
        embedding_size = self.row_size if self.per_token and self.row_size else hidden_size
        if dimensions is None:
            return ""
        if not self.matryoshka:
            return (f"Model {model!r} does not support matryoshka representation: changing output dimensions "
                    "would give poor embeddings (a model trained for it says so with is_matryoshka or "
                    "matryoshka_dimensions in its config; --hf-overrides can set them)")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            return (f"Model {model!r} only supports the matryoshka dimensions {list(self.matryoshka_dimensions)}: "
                    "other output dimensions would give poor embeddings")
        if embedding_size and dimensions > embedding_size:
            return f"dimensions ({dimensions}) is larger than the model's embeddings ({embedding_size} values)"
        return ""

    @property
    def per_token(self) -> bool:
        """Whether a prompt's pooled output is one row per token (ALL: a token classifier such as an
        NER tagger, a reward model) or per step separator (STEP: a process reward model), rows of
        ``row_size`` values one after another, rather than one row."""
        return self.pooling_type in ("ALL", "STEP")

    def for_task(self, task: str | None) -> PoolingInfo:
        """How a request for vLLM's pooling ``task`` pools on this model (None: as the model pools):
        "embed" / "classify" one row per prompt, "token_embed" / "token_classify" one per token (the
        model's own ALL / STEP pooling, else ALL). ValueError for a task the model does not serve."""
        if task is None:
            return self
        if task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {task!r}")
        if task in self.token_heads:  # (its own head: one lexical weight, through a relu, or a vector a token)
            return replace(self, pooling_type="ALL", task=task, step_tag_id=None, returned_token_ids=None,
                           row_size=1 if task == "token_classify" else self.row_size,
                           normalize=self.normalize and task == "token_embed", classifier_activation="relu")
        classifies = task.endswith("classify")
        if classifies != bool(self.labels):
            kind = ("a classifier: classify or token_classify" if self.labels
                    else "an embedding model: embed or token_embed")
            raise ValueError(f"task {task!r}: the model is {kind}")
        if task.startswith("token_"):
            return self if self.per_token else replace(self, pooling_type="ALL")
        if self.per_token:
            raise ValueError(f"task {task!r}: the model pools every token ({self.pooling_type} pooling): ask for "
                             f"token_{task}")
        return self

    @property
    def classifies(self) -> bool:
        """Whether its pooled values are class logits (or a head's, as BGE-M3's lexical weights),
        turned into scores by classifier_activation, rather than embeddings."""
        return bool(self.labels) or self.task == "token_classify"

    def params_fields(self) -> dict[str, Any]:
        """The SamplingParams fields that pool a prompt as this model pools."""
        return {"embed_pooling": self.pooling_type, "embed_step_tag_id": self.step_tag_id,
                "embed_returned_token_ids": list(self.returned_token_ids) if self.returned_token_ids else None,
                "pooling_task": self.task}


@dataclass(frozen=True)
class ModelInfo:
    """What the engine and the router need to know about the loaded model."""

    served_model_name: str
    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    # The size of the model's hidden states (an embedding's values); 0 where unknown.
    hidden_size: int = 0
    # The width of the model's input embeddings (a prompt given as embeddings has rows this wide).
    input_embedding_size: int = 0
    # The sliding window when every layer attends through it (the KV cache releases blocks behind
    # it); None when any layer attends fully.
    sliding_window: int | None = None
    # LongRoPE models: the pretrained length above which a prompt uses the long rotary factors.
    long_rope_after: int | None = None
    # A vision-language model: the prompt token its images' rows replace, and how many rows (tokens)
    # one image is (0: it takes no images).
    image_token_id: int | None = None
    # How many tokens (at most: max_tokens) and what pixel values an image is.
    image_geometry: ImageGeometry | None = None
    # A model that takes videos too (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: image_geometry.takes_videos): the prompt
    # token a video's rows replace.
    video_token_id: int | None = None
    # The rotary positions the model has (its table's rows; 0: unknown): a video's time positions
    # may place a prompt's tokens past their plain positions (M-RoPE), which must stay within them.
    max_positions: int = 0
    # An encoder (BERT family): its prompts attend both ways, so each runs whole in one pass and none
    # may start from the prefix cache (the engine turns chunked prefill and prefix caching off).
    encoder_only: bool = False
    # A model with Mamba-2 layers (Granite 4.0-H, Nemotron-H): each request carries a recurrent state that only
    # its own tokens, computed in order, build, so no prompt may start from the prefix cache (the
    # engine turns prefix caching off).
    mamba: bool = False
    # A model whose layers' inputs come from the prompt's token ids as well as their embeddings (Gemma
    # 3n's and Gemma 4's per-layer inputs): prompts given as embeddings are refused.
    inputs_need_token_ids: bool = False
    # A model whose layers keep KV caches of different shapes (Gemma 4's full layers): its blocks are
    # not handed to another engine (prefill/decode disaggregation moves one tensor of every layer's).
    kv_cache_shapes_differ: bool = False
    # A model mixing full-attention and windowed layers, under the hybrid KV cache manager: each KV cache
    # group's window (CacheConfig.kv_cache_groups; group 0 attends fully); empty: one group.
    kv_cache_groups: tuple[AttentionWindow | None, ...] = ()
    # Whether it generates, and how it pools embeddings and classes.
    pooling: PoolingInfo = field(default_factory=PoolingInfo)
    # What the workers run: the model's dtype (float32, bfloat16, ...) and the device type (once
    # they are loaded: "auto" resolves on the workers' own machine).
    dtype: str = "float32"
    device: str = "cpu"
    # The sampling parameters a request gets for those it leaves unset (--generation-config):
    # temperature, top_p, top_k, min_p, repetition_penalty, max_tokens (a cap); empty for none.
    default_sampling_params: dict[str, float | int] = field(default_factory=dict)
    # The most logprobs a request may ask for per token (--max-logprobs; -1 there: the vocabulary).
    max_logprobs: int = 20
    # Where the tokenizer's files are (--tokenizer); "": the model's directory.
    tokenizer_dir: str = ""
    extra: dict[str, str] = field(default_factory=dict)


class Executor(ABC):
    """Runs ``SchedulerOutput`` on the engine's workers and returns rank 0's ``ModelRunnerOutput``."""

    @abstractmethod
    def model_info(self) -> ModelInfo: ...

    def scheduler_config(self) -> SchedulerConfig | None:
        """The scheduler flags as the executor sized its workers' passes for them (the budget derived
        for the model's context length, an encoder's whole prompts); None: the engine's own."""
        return None

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks that fit: an explicit setting, or what the memory budget allows."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> int:
        """Allocate ``num_blocks`` KV blocks on every worker, and the host-memory tier of KV
        offloading when the config asks for it: its size in blocks (0 when off)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    # How many passes may be in flight at once (vLLM's max_concurrent_batches): more than one where
    # the workers are a pipeline, so each stage works on a pass while the next stage runs the one
    # before it.
    max_concurrent_batches: int = 1

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> concurrent.futures.Future[ModelRunnerOutput]:
        """Start a pass; its output once done. (Default: run it now.)"""
        future: concurrent.futures.Future[ModelRunnerOutput] = concurrent.futures.Future()
        try:
            future.set_result(self.execute_model(scheduler_output))
        except Exception as e:
            future.set_exception(e)
        return future

    @abstractmethod
    def check_health(self) -> None:
        """Raise if any worker is gone."""

    def add_lora(self, lora: LoRARequest) -> bool:
        """Load an adapter on every worker (raises ValueError for one the model cannot serve);
        False when it was already loaded. Restarted workers get the loaded adapters back."""
        raise RuntimeError(f"{type(self).__name__} does not serve LoRA adapters")

    def remove_lora(self, lora_int_id: int) -> bool:
        raise RuntimeError(f"{type(self).__name__} does not serve LoRA adapters")

    def sleep(self, level: int) -> None:
        """Sleep mode, on every worker: release the KV cache, and move the weights to host memory
        (level 1) or discard them (level 2). The engine holds no request and no cached prefix."""
        raise RuntimeError(f"{type(self).__name__} has no sleep mode")

    def wake_up(self, tags: list[str]) -> None:
        """Restore what ``tags`` name ("weights", "kv_cache") on every worker."""
        raise RuntimeError(f"{type(self).__name__} has no sleep mode")

    def read_kv_blocks(self, block_ids: list[int]) -> list[Any]:
        """Each rank's KV in ``block_ids`` (its worker's ``read_kv_blocks``), rank 0 first: what
        another engine reads of a prompt computed here (prefill/decode disaggregation)."""
        raise RuntimeError(f"{type(self).__name__} cannot read KV blocks")

    def write_kv_blocks(self, block_ids: list[int], payload: list[Any]) -> None:
        """Write ``read_kv_blocks``' answer from another engine into ``block_ids``, rank by rank."""
        raise RuntimeError(f"{type(self).__name__} cannot write KV blocks")

    def restart(self) -> None:
        """Bring a failed worker group back (same config, fresh KV cache). Default: not supported."""
        raise RuntimeError(f"{type(self).__name__} cannot restart its workers")

    @abstractmethod
    def shutdown(self) -> None: ...


ExecutorFactory = Callable[[EngineConfig], Executor]
