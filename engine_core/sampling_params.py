"""Per-request sampling parameters (the engine's copy; the router maps OpenAI fields onto it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

_MIN_TEMPERATURE = 1e-2


def _check(condition: bool, name: str, allowed: str, value: object) -> None:
    if not condition:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def logprobs_count(kind: str, asked: int | None, vocab_size: int, max_logprobs: int) -> int | None:
    """How many logprobs a request's ``logprobs`` or ``prompt_logprobs`` (``kind``: "sample" or
    "prompt") means: -1 is the whole vocabulary, as vLLM reads it. ValueError, in vLLM's words, when
    that is more than --max-logprobs allows (the router, the engines and the offline LLM ask this)."""
    wanted = vocab_size if asked == -1 else asked
    if wanted is not None and wanted > max_logprobs:
        raise ValueError(f"Requested {kind} logprobs of {wanted}, which is greater than max allowed: {max_logprobs} "
                         "(--max-logprobs)")
    return wanted


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    # Logprobs of the prompt's tokens (each given the tokens before it), with this many top
    # alternatives; sent with the request's first output. Such a request skips the prefix cache,
    # since cached positions are never computed.
    prompt_logprobs: int | None = None
    # e.g. {"json": schema}, {"regex": "..."}, {"choice": [...]}: the request waits for its grammar.
    structured_output: dict[str, Any] | None = None
    # With structured_output: the grammar constrains only the tokens after the output first ends
    # with this sequence (a reasoning model's end of thinking, e.g. "</think>"): it thinks freely.
    structured_output_after: list[int] | None = None
    # With structured_output_after: the wait is the answer's choice. Its first token may be this one
    # (a reasoning model opening its thinking: "<think>"), and then the grammar waits for the
    # sequence; any other first token is held to the grammar from the start (an answer that does
    # not think is constrained all along).
    structured_output_may_open: int | None = None
    # With structured_output_after: once that sequence is seen, the grammar waits further for this
    # token (harmony: after "<|channel|>final" a header may name a format, "<|constrain|>json", before
    # its "<|message|>").
    structured_output_then: int | None = None
    # OpenAI's logit_bias: added to the token's logit before sampling (clamped to [-100, 100], as vLLM).
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: only these may be sampled.
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words, as token id sequences (the router tokenises the words): the last token of a
    # sequence is banned whenever the output so far ends with the ones before it.
    bad_words_token_ids: list[list[int]] | None = None
    # An embedding instead of tokens (/v1/embeddings): the final hidden state of the prompt's last
    # token (after the model's last norm: "last" pooling, as decoder embedding models such as
    # Qwen3-Embedding and e5-mistral are read), its first ``embed_dimensions`` values when set
    # (Matryoshka models), L2-normalised when ``embed_normalize``. The request ends with its prefill.
    embed: bool = False
    embed_normalize: bool = True
    embed_dimensions: int | None = None
    # How the embedding pools the prompt's final hidden states (gpu_worker.pooler_config): "LAST",
    # "MEAN" or "CLS"; "ALL" and "STEP" give one row per prompt token (STEP: per position holding
    # ``embed_step_tag_id``, every position when None), each cut to the columns
    # ``embed_returned_token_ids`` (all when None), rows flattened. The router and LLM set the model's.
    embed_pooling: str = "LAST"
    embed_step_tag_id: int | None = None
    embed_returned_token_ids: list[int] | None = None
    # vLLM's PoolingParams.task where the model pools a task with a head of its own (BGE-M3's
    # "token_classify": lexical weights, "token_embed": ColBERT vectors); None otherwise.
    pooling_task: str | None = None
    # An encoder's token types as vLLM compresses them: the first prompt position of type 1 (the
    # second text of a pair, for cross-encoders whose tokenizer returns token_type_ids); None: every
    # token is of type 0.
    compressed_token_type_ids: int | None = None
    # vLLM's extra_args (the HTTP API's vllm_xargs): arguments for the engine's custom logits
    # processors (engine_core.logits_processor), which read them; the engine itself does not.
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))  # (each once, in order)
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", ">= 1", self.max_tokens)
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", f"between 0 and max_tokens ({self.max_tokens})", self.min_tokens)
        _check(math.isfinite(self.temperature) and self.temperature >= 0.0, "temperature", "finite and >= 0",
               self.temperature)
        # As vLLM: any temperature above 0 and below 0.01 is raised to 0.01 (dividing logits by less
        # overflows them to inf, and the sample turns into token 0); only 0 itself is greedy.
        if 0.0 < self.temperature < _MIN_TEMPERATURE:
            self.temperature = _MIN_TEMPERATURE
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", ">= -1 (0 or -1 disables)", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]", self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        _check(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0, "repetition_penalty",
               "finite and > 0", self.repetition_penalty)
        # (-1: every token of the vocabulary, as vLLM; the engine's max_logprobs bounds both.)
        _check(self.logprobs is None or (type(self.logprobs) is int and self.logprobs >= -1),
               "logprobs", "None, -1 (all) or >= 0", self.logprobs)
        _check(self.prompt_logprobs is None or (type(self.prompt_logprobs) is int and self.prompt_logprobs >= -1),
               "prompt_logprobs", "None, -1 (all) or >= 0", self.prompt_logprobs)
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "a list of non-negative token ids", self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict)
                   and all(isinstance(t, int) and t >= 0 and isinstance(b, int | float) and math.isfinite(b)
                           for t, b in self.logit_bias.items()),
                   "logit_bias", "a mapping of non-negative token ids to finite numbers", self.logit_bias)
            self.logit_bias = {t: min(100.0, max(-100.0, float(b))) for t, b in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None:
            _check(isinstance(self.allowed_token_ids, list) and len(self.allowed_token_ids) > 0
                   and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids),
                   "allowed_token_ids", "a non-empty list of non-negative token ids", self.allowed_token_ids)
        if self.bad_words_token_ids is not None:
            _check(isinstance(self.bad_words_token_ids, list)
                   and all(isinstance(w, list) and w and all(isinstance(t, int) and t >= 0 for t in w)
                           for w in self.bad_words_token_ids),
                   "bad_words_token_ids", "a list of non-empty token id lists", self.bad_words_token_ids)
            self.bad_words_token_ids = self.bad_words_token_ids or None
        if self.structured_output is not None:
            # A finished grammar allows only EOS: neither may forbid it.
            _check(not self.ignore_eos and self.min_tokens == 0, "structured_output",
                   "used without ignore_eos and min_tokens", self.structured_output)
        if self.embed:
            _check(self.max_tokens == 1 and self.logprobs is None and self.prompt_logprobs is None
                   and self.structured_output is None, "embed",
                   "used with max_tokens 1 and without logprobs, prompt_logprobs or structured_output", self.embed)
        _check(self.embed_pooling in ("LAST", "MEAN", "CLS", "ALL", "STEP"), "embed_pooling",
               "one of LAST, MEAN, CLS, ALL, STEP", self.embed_pooling)
        _check((self.embed_step_tag_id is None and self.embed_returned_token_ids is None)
               or self.embed_pooling == "STEP", "embed_step_tag_id",
               "set (with embed_returned_token_ids) for STEP pooling only", self.embed_step_tag_id)
        _check(self.pooling_task is None or (self.embed and self.pooling_task in ("token_embed", "token_classify")),
               "pooling_task", "None, or token_embed / token_classify on an embedding request", self.pooling_task)
        _check(self.embed_step_tag_id is None
               or (type(self.embed_step_tag_id) is int and self.embed_step_tag_id >= 0),
               "embed_step_tag_id", "None or a token id", self.embed_step_tag_id)
        _check(self.embed_returned_token_ids is None
               or (isinstance(self.embed_returned_token_ids, list) and len(self.embed_returned_token_ids) > 0
                   and all(type(t) is int and t >= 0 for t in self.embed_returned_token_ids)),
               "embed_returned_token_ids", "None or a non-empty list of ints >= 0", self.embed_returned_token_ids)
        _check(self.compressed_token_type_ids is None
               or (self.embed and isinstance(self.compressed_token_type_ids, int)
                   and self.compressed_token_type_ids >= 0),
               "compressed_token_type_ids", "None, or an int >= 0 on an embedding request",
               self.compressed_token_type_ids)
        _check(self.embed_dimensions is None or (isinstance(self.embed_dimensions, int) and self.embed_dimensions >= 1),
               "embed_dimensions", "None or >= 1", self.embed_dimensions)
        _check(self.extra_args is None
               or (isinstance(self.extra_args, dict) and all(isinstance(k, str) for k in self.extra_args)),
               "extra_args", "None or a mapping with string keys", self.extra_args)
        if self.structured_output_after is not None:
            _check(self.structured_output is not None and isinstance(self.structured_output_after, list)
                   and len(self.structured_output_after) > 0
                   and all(isinstance(t, int) and t >= 0 for t in self.structured_output_after),
                   "structured_output_after", "a non-empty list of token ids, with structured_output",
                   self.structured_output_after)
        _check(self.structured_output_may_open is None
               or (self.structured_output_after is not None and isinstance(self.structured_output_may_open, int)
                   and self.structured_output_may_open >= 0),
               "structured_output_may_open", "None, or a token id with structured_output_after",
               self.structured_output_may_open)
        _check(self.structured_output_then is None
               or (self.structured_output_after is not None and isinstance(self.structured_output_then, int)
                   and self.structured_output_then >= 0 and self.structured_output_may_open is None),
               "structured_output_then", "None, or a token id with structured_output_after (without may_open)",
               self.structured_output_then)

    @property
    def stop_token_set(self) -> frozenset[int]:
        """``stop_token_ids`` as a set, made once: the engine asks it at every step of the request (a
        list of thousands would cost that step milliseconds)."""
        found = self.__dict__.get("_stop_token_set")
        if found is None or len(found) != len(self.stop_token_ids):
            found = self.__dict__["_stop_token_set"] = frozenset(self.stop_token_ids)
        return found

    def token_ids_in_use(self) -> list[int]:
        """Every token id these parameters name (to check against a vocabulary)."""
        ids = list(self.stop_token_ids)
        ids += self.logit_bias or ()
        ids += self.allowed_token_ids or ()
        ids += self.structured_output_after or ()
        ids += [] if self.structured_output_may_open is None else [self.structured_output_may_open]
        ids += [] if self.structured_output_then is None else [self.structured_output_then]
        for word in self.bad_words_token_ids or ():
            ids += word
        return ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Whether every prompt position must be computed, so prefix-cache hits are not used (they
        still fill the cache): prompt logprobs score each one, MEAN, ALL and STEP pooling read their
        hidden states (CLS the first one's)."""
        return self.prompt_logprobs is not None or (self.embed and self.embed_pooling != "LAST")
