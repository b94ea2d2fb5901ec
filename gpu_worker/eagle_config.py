"""What an EAGLE or EAGLE-3 draft head is (speculative decoding's methods ``eagle`` and ``eagle3``),
read from its directory: its config.json (a Llama decoder's, one layer deep) and its checkpoint's
tensor names, checked against the target model it proposes for.

An EAGLE head is a small decoder trained on a target model's hidden states: at position p it takes
the token after p and a feature of the target at p, and predicts the token after next.

- **EAGLE** (EAGLE-1, and its HASS variant): the feature is the target's last hidden state (after
  its final norm); ``fc`` projects [token embedding, feature] back to the hidden width, and the
  head's decoder layers (the first without its input norm) run over that; their output goes
  through the target's LM head as it is.
- **EAGLE-3**: the feature is three of the target's inner hidden states side by side (the inputs of
  its layers ``eagle_aux_hidden_state_layer_ids``, by default 2, L/2 and L-3 of L), projected by
  ``fc``; its one layer attends over [normed embedding, normed feature] (queries, keys and values
  from twice the hidden width), and its output, normed, goes through a head of its own over a
  smaller draft vocabulary whose ids map to the target's (``d2t``: the offset of each).

Both take the target's token embedding (the checkpoint's copy, where there is one, is not read).
EAGLE-3 heads saved by the speculators library (a ``transformer_layer_config`` in their config) are
read as the EAGLE authors' (_from_speculators_format).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine_core.config import EAGLE3_ARCHITECTURES

if TYPE_CHECKING:
    from gpu_worker.config import ModelConfig

EAGLE_METHODS = ("eagle", "eagle3")
# The head model classes (gpu_worker/models/eagle.py), by method.
EAGLE_ARCHITECTURES = {"eagle": "EagleLlamaForCausalLM", "eagle3": "Eagle3LlamaForCausalLM"}


@dataclass(frozen=True)
class EagleHead:
    """An EAGLE head's own settings, beside its layer's geometry (the ModelConfig holding it)."""

    method: str
    # The target's width (the feature's, and the embedding's the head takes).
    target_hidden_size: int
    # EAGLE-3: the target's layers whose inputs make the feature, side by side in the layers' order
    # (none: its last hidden state is the feature, as for EAGLE: use_aux_hidden_state false).
    aux_layer_ids: tuple[int, ...] = ()
    # EAGLE: a bias on fc; the first layer's input norm kept (the EAGLE authors' heads drop it);
    # HASS's norms of the embedding and the feature before fc (add_para_norm).
    fc_bias: bool = False
    first_input_norm: bool = False
    para_norms: bool = False
    # EAGLE-3: its head's vocabulary (d2t maps each id to the target's: maps_ids), and whether it has
    # a head at all (without one, the target's, over the whole vocabulary); the feature normed before
    # it becomes the residual (norm_before_residual) or after.
    draft_vocab_size: int = 0
    own_lm_head: bool = True
    maps_ids: bool = False
    norm_before_residual: bool = False


def checkpoint_tensor_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """A head checkpoint's tensors' shapes by name, without a leading ``model.`` (the loader reads
    both spellings), from safetensors or an older pytorch_model.bin."""
    from gpu_worker.weights import iter_checkpoint

    return {name.removeprefix("model."): tuple(tensor.shape) for name, tensor in iter_checkpoint(model_dir)}


def eagle_head_config(model_dir: str | Path, method: str, target: ModelConfig) -> ModelConfig:
    """The ModelConfig of the EAGLE (``method`` eagle) or EAGLE-3 head in ``model_dir`` proposing
    for ``target``; ValueError where the two do not fit together."""
    from gpu_worker.config import ModelConfig

    if method not in EAGLE_METHODS:
        raise ValueError(f"speculative method {method!r} is not an EAGLE method ({', '.join(EAGLE_METHODS)})")
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"an EAGLE head is a directory holding its config.json and weights; {model_dir} is not one")
    cfg = json.loads((model_dir / "config.json").read_text())
    if "speculators_model_type" in cfg:
        cfg = _from_speculators_format(model_dir, cfg)
    named = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    if (named in EAGLE3_ARCHITECTURES) != (method == "eagle3"):
        other = "eagle3" if named in EAGLE3_ARCHITECTURES else "eagle"
        raise ValueError(f"{model_dir} is an {other.upper().replace('EAGLE3', 'EAGLE-3')} head ({named}): serve it "
                         f"with speculative method {other!r}, not {method!r}")
    if cfg.get("model_type", "llama") != "llama":
        raise ValueError(f"an EAGLE head is a Llama decoder layer; {model_dir} is a {cfg.get('model_type')!r} model")
    shapes = checkpoint_tensor_shapes(model_dir)
    layer_prefix = "layers.0." if method == "eagle" or any(n.startswith("layers.0.") for n in shapes) else "midlayer."
    # (An EAGLE-3 head may read the target's last hidden state alone, without fc: use_aux_hidden_state false.)
    reads_aux = method == "eagle3" and (cfg.get("eagle_config") or {}).get("use_aux_hidden_state", True)
    needs_fc = method == "eagle" or reads_aux
    if (needs_fc and "fc.weight" not in shapes) or not any(name.startswith(layer_prefix) for name in shapes):
        raise ValueError(f"{model_dir} holds no EAGLE head (its checkpoint has no {'fc.weight beside ' * needs_fc}"
                         f"{layer_prefix}*): give an EAGLE head's directory, or the model to method draft_model")
    layer = ModelConfig.from_dict({**cfg, "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False})
    if layer.hidden_size != target.hidden_size:
        raise ValueError(f"the EAGLE head's width ({layer.hidden_size}) is not the target's ({target.hidden_size}): "
                         "it takes the target's token embedding, so it was trained for another model")
    if layer.vocab_size != target.vocab_size:
        raise ValueError(f"the EAGLE head's vocabulary ({layer.vocab_size} tokens) is not the target's "
                         f"({target.vocab_size}): it was trained for another model")
    num_target_layers = target.num_hidden_layers
    if method == "eagle":
        head = EagleHead("eagle", target.hidden_size, fc_bias="fc.bias" in shapes,
                         first_input_norm="layers.0.input_layernorm.weight" in shapes,
                         para_norms=bool(cfg.get("add_para_norm", False)))
    else:
        if layer.num_hidden_layers != 1:
            raise ValueError(f"an EAGLE-3 head of {layer.num_hidden_layers} layers is not served (one layer only)")
        # (The EAGLE authors' configs name them under eagle_config; the speculators library's at the top.)
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids is None:
            ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        ids = (2, num_target_layers // 2, num_target_layers - 3) if ids is None else tuple(int(i) for i in ids)
        if reads_aux and (not ids or any(not 0 <= i < num_target_layers for i in ids)):
            raise ValueError(f"the EAGLE-3 head reads the inputs of the target's layers {list(ids)}; the target has "
                             f"{num_target_layers} (eagle_config.eagle_aux_hidden_state_layer_ids)")
        # (Taken in the layers' order, each once, as vLLM's decoder keeps them.)
        ids = tuple(sorted(set(ids))) if reads_aux else ()
        width = int(cfg.get("target_hidden_size") or target.hidden_size)
        if width != target.hidden_size:
            raise ValueError(f"the EAGLE-3 head was trained on hidden states {width} wide; the target's are "
                             f"{target.hidden_size}")
        if reads_aux and shapes["fc.weight"][-1] != len(ids) * width:
            raise ValueError(f"the EAGLE-3 head's fc reads {shapes['fc.weight'][-1]} features, not the "
                             f"{len(ids)} x {width} of the target's layers {list(ids)} it names")
        draft_vocab = int(cfg.get("draft_vocab_size") or layer.vocab_size)
        if draft_vocab > target.vocab_size:
            raise ValueError(f"the EAGLE-3 head's draft vocabulary ({draft_vocab} tokens) is larger than the "
                             f"target's ({target.vocab_size})")
        own_head = "lm_head.weight" in shapes
        if not own_head and draft_vocab != target.vocab_size:
            raise ValueError(f"the EAGLE-3 head names a draft vocabulary of {draft_vocab} tokens but holds no "
                             "lm_head")
        if draft_vocab < target.vocab_size and "d2t" not in shapes:
            raise ValueError(f"the EAGLE-3 head's vocabulary ({draft_vocab} tokens) is smaller than the target's, "
                             "and its checkpoint holds no d2t mapping its ids to the target's")
        head = EagleHead("eagle3", width, aux_layer_ids=ids, draft_vocab_size=draft_vocab, own_lm_head=own_head,
                         maps_ids="d2t" in shapes,
                         norm_before_residual=bool(cfg.get("norm_before_residual", False)))
    # (Its positions are the target's: its rotary table reaches the target's context.)
    return dataclasses.replace(layer, architecture=EAGLE_ARCHITECTURES[method],
                               max_position_embeddings=max(layer.max_position_embeddings, target.max_context_len),
                               eos_token_ids=target.eos_token_ids, eagle=head)


def _from_speculators_format(model_dir: Path, cfg: dict) -> dict:
    """The config of an EAGLE-3 head saved by the speculators library (RedHat's ``*.eagle3``
    checkpoints: a ``transformer_layer_config`` beside the head's settings, tensors named as the
    EAGLE authors' but ``layers.0.`` for ``midlayer.``), as the EAGLE authors write one: vLLM
    reads it so (its norm_before_residual true unless it says otherwise)."""
    kind = cfg["speculators_model_type"]
    layer = cfg.get("transformer_layer_config")
    if kind != "eagle3" or not isinstance(layer, dict):
        raise ValueError(f"{model_dir} is a checkpoint in the speculators library's format of type {kind!r}: only "
                         "its EAGLE-3 heads (speculators_model_type eagle3, with a transformer_layer_config) are read")
    out = {**layer, "architectures": ["Eagle3LlamaForCausalLM"],
           "draft_vocab_size": cfg.get("draft_vocab_size") or layer.get("vocab_size"),
           "norm_before_residual": cfg.get("norm_before_residual", True)}
    for key in ("target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if cfg.get(key) is not None:
            out[key] = cfg[key]
    return out
