"""How an embedding is pooled from a prompt's final hidden states (vLLM's PoolerConfig).

* ``LAST``: the last prompt token's hidden state (decoder embedding models: e5-mistral, gte-Qwen2,
  Qwen3-Embedding, bge-multilingual-gemma2);
* ``MEAN``: the mean over every prompt token's;
* ``CLS``: the first token's.
``normalize``: L2-normalise by default (a request's ``normalize`` overrides it).

A checkpoint trained with sentence-transformers says how it pools: ``modules.json`` names a Pooling
module whose ``config.json`` sets one ``pooling_mode_*``, and a Normalize module where it
normalises. That is read as vLLM reads it; ``--pooler-config`` (a JSON object with
``pooling_type`` and/or ``normalize``) overrides it. Without either: LAST (CLS for an encoder),
normalised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' Pooling modes -> ours (the first one a config enables).
_SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                                "pooling_mode_cls_token": "CLS"}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")


def _sentence_transformers_pooler(model_dir: Path, need_type: bool) -> dict[str, Any]:
    """The pooling a sentence-transformers checkpoint declares ({} when it is not one); its pooling
    type only when ``need_type`` (else the caller has one)."""
    modules_file = model_dir / "modules.json"
    if not modules_file.exists():
        return {}
    modules = json.loads(modules_file.read_text())
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    others = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
    if others:
        # (A Dense projection, for one, changes the embedding's size and meaning: skipping it would
        # answer wrong vectors without a word.)
        raise ValueError(f"{modules_file} lists {', '.join(others)} modules, which are not served (only the "
                         "Transformer, its Pooling and Normalize are)")
    found: dict[str, Any] = {"normalize": "Normalize" in kinds}
    pooling = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None or not need_type:
        return found
    settings_file = model_dir / str(pooling.get("path", "")) / "config.json"
    if not settings_file.exists():
        return found
    settings = json.loads(settings_file.read_text())
    unsupported = [mode for mode in _UNSUPPORTED_MODES if settings.get(mode)]
    enabled = [mode for mode in _SENTENCE_TRANSFORMERS_MODES if settings.get(mode)]
    if len(enabled) > 1:  # (sentence-transformers concatenates the poolings)
        unsupported.append(" and ".join(enabled) + " together")
    if unsupported or settings.get("include_prompt") is False:
        what = ", ".join(unsupported) or "include_prompt: false"
        raise ValueError(f"{settings_file} asks for {what}, which is not served (LAST, MEAN or CLS pooling over "
                         "the whole prompt are); set --pooler-config to pool another way")
    for mode, pooling_type in _SENTENCE_TRANSFORMERS_MODES.items():
        if settings.get(mode):
            found["pooling_type"] = pooling_type
            break
    return found


# Where sentence-transformers keeps its Transformer module's settings, by model family (as vLLM reads them).
_SENTENCE_TRANSFORMERS_CONFIGS = ("sentence_bert_config.json", "sentence_roberta_config.json",
                                  "sentence_distilbert_config.json", "sentence_camembert_config.json",
                                  "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
                                  "sentence_xlnet_config.json")


def sentence_transformers_max_seq_length(model_dir: str | Path) -> int | None:
    """The longest input a sentence-transformers checkpoint was trained to embed (its
    ``max_seq_length``: 256 for all-MiniLM-L6-v2, 512 for bge), None where it does not say."""
    for name in _SENTENCE_TRANSFORMERS_CONFIGS:
        path = Path(model_dir) / name
        if path.exists():
            value = json.loads(path.read_text()).get("max_seq_length")
            return int(value) if isinstance(value, int) and value > 0 else None
    return None


def resolve_pooler_config(model_dir: str | Path, override: dict[str, Any] | None = None,
                          default_type: str = "LAST") -> PoolerConfig:
    """The model's pooling: ``override`` (--pooler-config) over its sentence-transformers files over
    ``default_type`` (LAST for decoders, CLS for encoders) + normalise."""
    override = dict(override or {})
    unknown = set(override) - {"pooling_type", "normalize"}
    if unknown:
        raise ValueError(f"pooler_config takes pooling_type and normalize, not {sorted(unknown)}")
    if "pooling_type" in override:
        override["pooling_type"] = str(override["pooling_type"]).upper()
    if "normalize" in override and not isinstance(override["normalize"], bool):
        raise ValueError(f"pooler_config normalize must be true or false, got {override['normalize']!r}")
    declared = ({} if {"pooling_type", "normalize"} <= set(override)
                else _sentence_transformers_pooler(Path(model_dir), "pooling_type" not in override))
    return PoolerConfig(**{"pooling_type": default_type, **declared, **override})
