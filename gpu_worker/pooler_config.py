"""How an embedding is pooled from a prompt's final hidden states (vLLM's PoolerConfig).

* ``LAST``: the last prompt token's hidden state (decoder embedding models: e5-mistral, gte-Qwen2,
  Qwen3-Embedding, bge-multilingual-gemma2);
* ``MEAN``: the mean over every prompt token's;
* ``CLS``: the first token's;
* ``ALL``: every prompt token's, one row each (vLLM's token_embed / token_classify: token classifiers
  such as NER taggers, reward models scoring each token);
* ``STEP``: the rows of the prompt tokens equal to ``step_tag_id`` (every token's when it is unset),
  each cut to the columns ``returned_token_ids`` names (all when unset): process reward models,
  whose step separator token carries each reasoning step's score.
``normalize``: L2-normalise by default (a request's ``normalize`` overrides it; each row of ALL / STEP).

A checkpoint trained with sentence-transformers says how it pools: ``modules.json`` names a Pooling
module whose ``config.json`` sets one ``pooling_mode_*``, Dense modules that project the pooled
state (LaBSE), and a Normalize module where it normalises. That is read as vLLM reads it;
``--pooler-config`` (a JSON object with ``pooling_type`` and/or ``normalize``) overrides the pooling
and normalisation. Without either: LAST (CLS for an encoder),
normalised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL", "STEP")
# The pooling types whose output is one row per (selected) prompt token.
PER_TOKEN_POOLING = ("ALL", "STEP")
# What --pooler-config may set.
POOLER_CONFIG_KEYS = ("pooling_type", "normalize", "step_tag_id", "returned_token_ids")
# sentence-transformers' Pooling modes -> ours (the first one a config enables).
_SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                                "pooling_mode_cls_token": "CLS"}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")


# sentence-transformers Dense activations applied (torch.nn class names; Tanh is its default).
DENSE_ACTIVATIONS = {"Identity": lambda x: x, "Tanh": torch.tanh, "ReLU": torch.relu, "Sigmoid": torch.sigmoid,
                     "GELU": torch.nn.functional.gelu}


@dataclass(frozen=True)
class DenseProjection:
    """A sentence-transformers Dense module after the pooling (LaBSE's, for one):
    activation(W x + b), its weights in ``path`` (relative to the model's directory)."""

    path: str
    in_features: int
    out_features: int
    bias: bool
    activation: str


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True
    # Projections applied to the pooled state, in order, before normalising.
    dense: tuple[DenseProjection, ...] = ()
    # STEP pooling: the token whose positions are kept (None: every position), and the columns of
    # each kept row returned (None: all of them; e.g. a causal LM's "+" / "-" logits).
    step_tag_id: int | None = None
    returned_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")
        if (self.step_tag_id is not None or self.returned_token_ids is not None) and self.pooling_type != "STEP":
            raise ValueError(f"pooler_config step_tag_id and returned_token_ids are read by STEP pooling, not "
                             f"{self.pooling_type}")
        if self.step_tag_id is not None and (isinstance(self.step_tag_id, bool) or not isinstance(self.step_tag_id, int)
                                             or self.step_tag_id < 0):
            raise ValueError(f"pooler_config step_tag_id must be a token id (an int >= 0), got {self.step_tag_id!r}")
        if self.returned_token_ids is not None and (
                not self.returned_token_ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.returned_token_ids)):
            raise ValueError(f"pooler_config returned_token_ids must be a non-empty list of ints >= 0, got "
                             f"{list(self.returned_token_ids)!r}")

    def embedding_size(self, hidden_size: int) -> int:
        """The size of the embeddings: the last projection's output, else the hidden size."""
        return self.dense[-1].out_features if self.dense else hidden_size


def _dense_projection(model_dir: Path, module: dict[str, Any], in_features: int) -> DenseProjection:
    """A Dense module's settings, checked against the size it is fed."""
    path = str(module.get("path", ""))
    settings = json.loads((model_dir / path / "config.json").read_text())
    activation = str(settings.get("activation_function") or "torch.nn.modules.activation.Tanh").rsplit(".", 1)[-1]
    if activation not in DENSE_ACTIVATIONS:
        raise ValueError(f"{model_dir / path}: the Dense activation {activation!r} is not served "
                         f"({', '.join(DENSE_ACTIVATIONS)} are)")
    dense = DenseProjection(path=path, in_features=int(settings["in_features"]),
                            out_features=int(settings["out_features"]), bias=bool(settings.get("bias", True)),
                            activation=activation)
    if dense.in_features != in_features:
        raise ValueError(f"{model_dir / path}: the Dense module takes {dense.in_features} values, the pooled "
                         f"embedding before it has {in_features}")
    return dense


def load_dense_weights(model_dir: str | Path, dense: DenseProjection) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A Dense module's (weight [out, in], bias) from its model.safetensors (or older pytorch_model.bin)."""
    directory = Path(model_dir) / dense.path
    if (directory / "model.safetensors").exists():
        from safetensors.torch import load_file

        tensors = load_file(str(directory / "model.safetensors"))
    else:
        tensors = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    weight = tensors["linear.weight"]
    if tuple(weight.shape) != (dense.out_features, dense.in_features):
        raise ValueError(f"{directory}: linear.weight is {tuple(weight.shape)}, its config says "
                         f"{(dense.out_features, dense.in_features)}")
    return weight, tensors.get("linear.bias") if dense.bias else None


def _sentence_transformers_pooler(model_dir: Path, need_type: bool, hidden_size: int,
                                  overridden: bool = False, per_token: bool = False) -> dict[str, Any]:
    """The pooling a sentence-transformers checkpoint declares ({} when it is not one): its Dense
    projections and normalisation, and its pooling type when ``need_type`` (else the caller has one).
    ``overridden``: --pooler-config sets both pooling and normalisation, so modules we do not run are
    the user's call (only the Dense projections are read). ``per_token``: the model pools every
    token (a PyLate ColBERT), so Dense modules without a Pooling project each token."""
    modules_file = model_dir / "modules.json"
    if not modules_file.exists():
        return {}
    modules = json.loads(modules_file.read_text())
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    others = sorted(set(kinds) - {"Transformer", "Pooling", "Dense", "Normalize"})
    if others and not overridden:
        # (Any other module changes the embedding's size or meaning: skipping it would answer wrong
        # vectors without a word.)
        raise ValueError(f"{modules_file} lists {', '.join(others)} modules, which are not served (only the "
                         "Transformer, its Pooling, Dense projections and Normalize are)")
    dense: list[DenseProjection] = []
    for kind, module in zip(kinds, modules, strict=True):
        if kind == "Dense":
            if ("Pooling" in kinds and kinds.index("Pooling") > kinds.index("Dense")) or (
                    "Pooling" not in kinds and not per_token):
                raise ValueError(f"{modules_file}: a Dense module before the Pooling is not served (a PyLate "
                                 "ColBERT on ModernBERT: serve it with --hf-overrides '{\"architectures\": "
                                 "[\"ColBERTModernBertModel\"]}')")
            dense.append(_dense_projection(model_dir, module, dense[-1].out_features if dense else hidden_size))
    found: dict[str, Any] = {"normalize": "Normalize" in kinds, "dense": tuple(dense)}
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


def _transformer_module_settings(model_dir: str | Path) -> dict[str, Any]:
    """The settings of a sentence-transformers checkpoint's Transformer module ({} where it has none)."""
    for name in _SENTENCE_TRANSFORMERS_CONFIGS:
        path = Path(model_dir) / name
        if path.exists():
            return json.loads(path.read_text())
    return {}


def sentence_transformers_max_seq_length(model_dir: str | Path) -> int | None:
    """The longest input a sentence-transformers checkpoint was trained to embed (its
    ``max_seq_length``: 256 for all-MiniLM-L6-v2, 512 for bge), None where it does not say."""
    value = _transformer_module_settings(model_dir).get("max_seq_length")
    return int(value) if isinstance(value, int) and value > 0 else None


def sentence_transformers_text_settings(model_dir: str | Path) -> tuple[tuple[tuple[str, str], ...], bool]:
    """How a sentence-transformers checkpoint wants its texts: its named ``prompts`` (prefixes by
    input kind, from config_sentence_transformers.json: nomic-embed's "search_query: ", e5's
    "query: "), and whether its Transformer module lowercases them (``do_lower_case``)."""
    prompts: tuple[tuple[str, str], ...] = ()
    path = Path(model_dir) / "config_sentence_transformers.json"
    if path.exists():
        found = json.loads(path.read_text()).get("prompts")
        if isinstance(found, dict):
            prompts = tuple((str(k), v) for k, v in found.items() if isinstance(v, str))
    return prompts, _transformer_module_settings(model_dir).get("do_lower_case") is True


def resolve_pooler_config(model_dir: str | Path, override: dict[str, Any] | None = None,
                          default_type: str = "LAST", hidden_size: int = 0,
                          default_step_tag_id: int | None = None, read_files_pooling: bool = True) -> PoolerConfig:
    """The model's pooling: ``override`` (--pooler-config) over its sentence-transformers files over
    ``default_type`` (LAST for decoders, CLS for encoders, ALL / STEP for token classifiers and
    reward models) + normalise; the files' Dense projections (the first fed ``hidden_size`` values)
    whatever the override says. STEP pooling keeps ``default_step_tag_id``'s positions (a process
    reward model's step separator) unless the override names another. ``read_files_pooling`` false:
    the files' pooling mode is not read (a token classifier's head classifies every token, whatever
    sentence-transformers pooled)."""
    override = dict(override or {})
    unknown = set(override) - set(POOLER_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"pooler_config takes {', '.join(POOLER_CONFIG_KEYS)}, not {sorted(unknown)}")
    returned = override.get("returned_token_ids")
    if returned is not None:
        if not isinstance(returned, list | tuple):
            raise ValueError(f"pooler_config returned_token_ids must be a list of token ids, got {returned!r}")
        override["returned_token_ids"] = tuple(returned)
    if "pooling_type" in override:
        override["pooling_type"] = str(override["pooling_type"]).upper()
    if "normalize" in override and not isinstance(override["normalize"], bool):
        raise ValueError(f"pooler_config normalize must be true or false, got {override['normalize']!r}")
    per_token = str(override.get("pooling_type", default_type)) in PER_TOKEN_POOLING
    declared = _sentence_transformers_pooler(Path(model_dir), read_files_pooling and "pooling_type" not in override,
                                             hidden_size, overridden={"pooling_type", "normalize"} <= set(override),
                                             per_token=per_token)
    settings = {"pooling_type": default_type, **declared, **override}
    if settings["pooling_type"] == "STEP" and default_step_tag_id is not None:
        settings.setdefault("step_tag_id", default_step_tag_id)
    return PoolerConfig(**settings)
