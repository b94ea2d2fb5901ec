"""Load HF-named weights into our models, each TP rank reading only its shard.

Two entry points:
* ``iter_safetensors(model_dir)`` yields ``(hf_name, LazyTensor)`` from ``*.safetensors`` (sharded
  checkpoints through ``model.safetensors.index.json``); a ``LazyTensor`` reads only the rows or
  columns a rank asks for. ``iter_checkpoint`` also reads older ``pytorch_model.bin`` files.
* ``load_weights(model, weights)`` takes any iterable of ``(hf_name, tensor)`` pairs, so a converter
  producing HF-named ``torch.Tensor`` objects (e.g. from GGUF) reuses the same sharding logic.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from gpu_worker.layers.fused_moe import ALL_EXPERTS, DOWN, GATE, UP
from gpu_worker.layers.weight_utils import WeightLike, copy_into, materialize

# Checkpoint entries that are not parameters of ours (recomputed buffers in old checkpoints).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LazyTensor:
    """One tensor of an open safetensors file, read on ``narrow`` (only the requested slice)."""

    __slots__ = ("_slice", "shape")

    def __init__(self, tensor_slice: object) -> None:
        self._slice = tensor_slice
        self.shape = torch.Size(tensor_slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, WeightLike]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                lazy = LazyTensor(f.get_slice(name))
                # (A scalar, which has no rows to narrow to: read whole. Apertus's xIELU beta and eps.)
                yield name, lazy if lazy.shape else f.get_tensor(name)


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, WeightLike]]:
    """A checkpoint's tensors: its safetensors files (lazily), or where it has none its older
    PyTorch files (``pytorch_model.bin``, or the shards its index names: memory-mapped, read as
    plain tensors only, never as pickled code), as the EAGLE authors' heads are saved."""
    model_dir = Path(model_dir)
    if any(model_dir.glob("*.safetensors")):
        yield from iter_safetensors(model_dir)
        return
    index = model_dir / "pytorch_model.bin.index.json"
    if index.exists():
        files = sorted({model_dir / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(model_dir.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model.bin files in {model_dir}")
    for path in files:
        yield from torch.load(path, map_location="cpu", weights_only=True, mmap=True).items()


# One expert's projection in a checkpoint (Qwen-MoE's names, and Mixtral's w1/w3/w2), stored in our
# stacked FusedMoE parameters: (parameter, projection shard).
_EXPERT_TENSOR = re.compile(r"^(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<proj>\w+)\.weight$")
EXPERT_PROJECTIONS = {"gate_proj": ("w13_weight", GATE), "w1": ("w13_weight", GATE),
                       "up_proj": ("w13_weight", UP), "w3": ("w13_weight", UP),
                       "down_proj": ("w2_weight", DOWN), "w2": ("w2_weight", DOWN)}
# Or every expert of a layer in one tensor, as transformers 5 holds them (no ".weight" suffix), and
# GPT-OSS's experts' biases.
_STACKED_EXPERTS = re.compile(r"^(?P<experts>.+\.experts)\.(?P<proj>gate_up_proj|up_proj|down_proj)(?P<bias>_bias)?$")
# (up_proj alone: ungated experts, Nemotron-H's.)
STACKED_EXPERT_PROJECTIONS = {"gate_up_proj": ("w13", GATE), "up_proj": ("w13", UP), "down_proj": ("w2", DOWN)}


def _expert_parameter(hf_name: str, params: dict[str, nn.Parameter]) -> tuple[str, tuple[int, int]] | None:
    """(our stacked parameter, (expert or ALL_EXPERTS, projection)) for a routed expert's tensor,
    else None."""
    match = _EXPERT_TENSOR.match(hf_name)
    if match is not None and match["proj"] in EXPERT_PROJECTIONS:
        suffix, projection = EXPERT_PROJECTIONS[match["proj"]]
        expert = int(match["index"])
    elif (match := _STACKED_EXPERTS.match(hf_name)) is not None:
        stack, projection = STACKED_EXPERT_PROJECTIONS[match["proj"]]
        suffix = f"{stack}_bias" if match["bias"] else f"{stack}_weight"
        expert = ALL_EXPERTS
    else:
        return None
    name = f"{match['experts']}.{suffix}"
    return (name, (expert, projection)) if name in params else None


def _score_from_head_rows(head: WeightLike, token_ids: tuple[int, ...], num_outputs: int) -> torch.Tensor:
    """A classifier head from LM-head rows, as vLLM builds one from classifier_from_token: the rows
    of the tokens named, or for two tokens and one output (from_2_way_softmax) the second's row
    minus the first's (in fp32)."""
    rows = torch.cat([materialize(head.narrow(0, token_id, 1)).float() for token_id in token_ids])
    return (rows[1] - rows[0]).unsqueeze(0) if num_outputs == 1 and len(token_ids) == 2 else rows


def _default_loader(param: nn.Parameter, loaded: WeightLike, shard_id: int | str | None = None) -> None:
    copy_into(param, materialize(loaded))


def load_weights(model: nn.Module, weights: Iterable[tuple[str, WeightLike]],
                 zero_biases_optional: bool = False) -> None:
    """Copy every checkpoint tensor into its (possibly fused, possibly sharded) parameter.

    Raises if the checkpoint has a tensor we cannot place, or leaves a parameter unloaded;
    ``zero_biases_optional`` (GPTQ / AWQ checkpoints, whose old quantizers wrote an all-zero bias
    for every layer): such a bias without a parameter is skipped. A parameter marked
    ``optional_in_checkpoint`` (A.X-K1's correction biases) keeps its initial value where absent.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules_mapping", {})
    if hasattr(model, "checkpoint_tensors"):  # a model whose checkpoint stores some shards fused (Phi-3)
        weights = model.checkpoint_tensors(weights)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    # An embedding-only model has no head: a head its checkpoint carries is not read.
    headless = getattr(model, "lm_head", True) is None
    # Under pipeline parallelism: the checkpoint names of the layers (and embedding, norm, head) that
    # other stages hold.
    pp_missing: tuple[str, ...] = getattr(model, "pp_missing_prefixes", ())
    # Checkpoints saved from transformers' bare decoder name its tensors without "model." (a head
    # keeps its name, loaded or not).
    top_level = {name.split(".", 1)[0] for name in params} | {"lm_head"}
    # A causal LM served as a classifier (classifier_from_token): its score head is made of rows of
    # the LM head (the embedding, when tied) that the checkpoint holds.
    token_ids = getattr(getattr(model, "config", None), "classifier_token_ids", ())
    head_rows_from = "model.embed_tokens.weight" if tied else "lm_head.weight"
    # A fused parameter counts as loaded only once every one of its shards has arrived.
    expected_shards: dict[str, set[int | str]] = {}
    for ours, shard in packed.values():
        expected_shards.setdefault(ours, set()).add(shard)
    loaded: dict[str, set[int | str | tuple[int, int] | None]] = {}
    for hf_name, tensor in weights:
        if hf_name.endswith(_IGNORED_SUFFIXES):
            continue
        checkpoint_name = hf_name
        if hf_name.split(".", 1)[0] not in top_level and "model" in top_level:
            hf_name = f"model.{hf_name}"
        if token_ids and hf_name == head_rows_from:
            score = params["score.weight"]
            score.copy_(_score_from_head_rows(tensor, token_ids, score.shape[0]))
            loaded["score.weight"] = {None}
        if (tied and hf_name == "lm_head.weight") or (headless and hf_name.startswith("lm_head.")):
            # Some tied checkpoints still store the head; it is the embedding we already load.
            continue
        name, shard_id = hf_name, None
        expert = _expert_parameter(hf_name, params) if ".experts." in hf_name else None
        if expert is not None:
            name, shard_id = expert
        elif hf_name not in params:  # (a parameter of the checkpoint's own name is not a shard: Qwen2.5-VL's tower)
            for hf_part, (ours, shard) in packed.items():
                if f".{hf_part}." in hf_name:
                    name, shard_id = hf_name.replace(f".{hf_part}.", f".{ours}."), shard
                    break
        param = params.get(name)
        if param is None and hf_name.startswith(pp_missing):
            continue  # (another pipeline stage's)
        if param is None and zero_biases_optional and hf_name.endswith(".bias") \
                and not bool(torch.count_nonzero(materialize(tensor))):
            continue
        if param is None:
            raise KeyError(f"checkpoint tensor {checkpoint_name!r} has no matching parameter in "
                           f"{type(model).__name__}")
        getattr(param, "weight_loader", _default_loader)(param, tensor, shard_id)
        if isinstance(shard_id, tuple) and shard_id[0] == ALL_EXPERTS:
            loaded.setdefault(name, set()).update(param.expected_shards)  # the whole stack at once
        else:
            loaded.setdefault(name, set()).add(shard_id)
    if tied and not headless:
        loaded["lm_head.weight"] = {None}
    missing = []
    for name in params:
        if getattr(params[name], "optional_in_checkpoint", False) and name not in loaded:
            continue  # (a parameter a checkpoint may leave out: it keeps its initial value)
        module_name = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        want = getattr(params[name], "expected_shards", None) or expected_shards.get(module_name, {None})
        if not want <= loaded.get(name, set()):
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint did not provide: {missing}")


def read_by(model: nn.Module, weights: Iterable[tuple[str, WeightLike]]) -> Iterable[tuple[str, WeightLike]]:
    """The checkpoint's tensors ``model`` reads: those its ``reads_checkpoint_tensor`` keeps, where
    it has one (applied before any dequantization: GPTQ / AWQ unpack every tensor they are given)."""
    reads = getattr(model, "reads_checkpoint_tensor", None)
    return weights if reads is None else ((name, tensor) for name, tensor in weights if reads(name))


def load_safetensors(model: nn.Module, model_dir: str | Path) -> None:
    with torch.no_grad():
        load_weights(model, read_by(model, iter_checkpoint(model_dir)))
