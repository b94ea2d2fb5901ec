"""What a layer's weight loader accepts: a torch.Tensor, or a lazy checkpoint slice.

A lazy slice (see ``gpu_worker.weights.LazyTensor``, and a quantized checkpoint's
``gpu_worker.quantized_checkpoint.ScaledWeight``) reads only the rows a TP rank asks for, so a rank
never materialises tensors it does not own (packed layers are the exception: a compressed-tensors
int4 layer, a GPTQ or AWQ layer is dequantized whole on each rank). Each offers ``shape`` and ``narrow``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class WeightLike(Protocol):
    @property
    def shape(self) -> torch.Size: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...


def materialize(weight: WeightLike) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return weight
    return weight.narrow(0, 0, weight.shape[0])


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# A quantized checkpoint's stored dtypes (safetensors' names) and its activation and KV-cache scales,
# which a dequantized model does not need.
QUANTIZED_DTYPES = {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int8: "I8"}
_ACTIVATION_SCALE_PREFIXES = ("input_", "output_")
_ACTIVATION_SCALES = ("activation_scale", "k_scale", "v_scale", "q_scale", "kv_scale", "k_zero_point",
                      "v_zero_point")


def stored_dtype(tensor: WeightLike) -> str:
    """A quantized checkpoint tensor's dtype in safetensors' names ("F8_E4M3", "I8", ...), without
    reading it ("" for the others a torch tensor may hold)."""
    if isinstance(tensor, torch.Tensor):
        return QUANTIZED_DTYPES.get(tensor.dtype, "")
    get_dtype = getattr(getattr(tensor, "_slice", None), "get_dtype", None)
    return get_dtype() if get_dtype is not None else ""


def read_whole(tensor: WeightLike) -> torch.Tensor:
    """The whole tensor (a scale may be 0-d, which ``materialize`` cannot narrow)."""
    if isinstance(tensor, torch.Tensor):
        return tensor
    return tensor._slice[...] if len(tensor.shape) == 0 else materialize(tensor)  # type: ignore[attr-defined]


def is_activation_scale(param: str) -> bool:
    """Whether a checkpoint parameter name (the part after the module's) is an activation or
    KV-cache quantization scale."""
    return param.startswith(_ACTIVATION_SCALE_PREFIXES) or param.endswith(_ACTIVATION_SCALES)


def copy_into(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch loading {name or 'weight'}: parameter {tuple(param.shape)}, "
                         f"checkpoint {tuple(loaded.shape)}")
    if (loaded.dtype in _FP8 or not loaded.dtype.is_floating_point) and param.dtype.is_floating_point \
            and param.dtype not in _FP8:
        # (Cast alone, quantized values would load as wrong weights without a word: their scale is
        # what a quantized checkpoint's quantization_config makes the loader apply.)
        raise ValueError(f"the checkpoint holds quantized ({loaded.dtype}) values without their scale for "
                         f"{name or 'a weight'}: its config.json lacks the quantization_config that says how they "
                         "are scaled")
    param.data.copy_(loaded)


def load_sharded(param: torch.Tensor, loaded: WeightLike, dim: int, rank: int) -> None:
    """Copy this rank's equal slice of ``loaded`` along ``dim`` into ``param``."""
    size = param.shape[dim]
    copy_into(param, loaded.narrow(dim, rank * size, size))


def gate_and_up(name: str, tensor: WeightLike, fused: str = ".gate_up_proj.", gate: str = ".gate_proj.",
                up: str = ".up_proj.") -> Iterator[tuple[str, WeightLike]]:
    """A checkpoint's fused gate-and-up tensor (the gate's rows, then up's: Phi-3's, GLM-4's, Granite's
    shared MLP, Zamba2's) as its two halves, ``fused`` in its name made ``gate`` and ``up``."""
    half = tensor.shape[0] // 2
    yield name.replace(fused, gate), tensor.narrow(0, 0, half)
    yield name.replace(fused, up), tensor.narrow(0, half, half)


def renamed_by_prefix(weights: Iterable[tuple[str, WeightLike]], prefixes: tuple[tuple[str, str], ...],
                      keep: Callable[[str], bool]) -> Iterator[tuple[str, WeightLike]]:
    """``weights`` with the names that start with one of ``prefixes``' first members (tried in order)
    given its second instead, and dropped where ``keep(new name)`` is false; the others unchanged."""
    for name, tensor in weights:
        for theirs, ours in prefixes:
            if name.startswith(theirs):
                name = ours + name[len(theirs):]
                if keep(name):
                    yield name, tensor
                break
        else:
            yield name, tensor


# Where vision-language checkpoints laid out as LLaVA's (LLaVA, Gemma 3, Pixtral, InternVL) keep the
# language model -> our decoder's names (transformers 4's layout, then transformers 5's), and the
# prefixes of their vision side (tower and projector).
LANGUAGE_MODEL_PREFIXES: tuple[tuple[str, str], ...] = (
    ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."), ("model.language_model.", "model."),
    ("model.text_model.", "model."))  # (the last: Idefics3's)
VISION_SIDE_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                        "model.multi_modal_projector.")

# Where LLaVA-style checkpoints keep the vision side (Pixtral's, InternVL's): without a prefix as
# transformers 4 and 5 save them, under "model." as transformers 5 holds them -> our module names.
TOWER_AND_PROJECTOR_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.vision_tower.", "vision_tower."), ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."))


def tower_and_projector_tensors(weights: Iterable[tuple[str, WeightLike]], layers: str, num_layers_used: int,
                                unused: tuple[str, ...] = ()) -> Iterator[tuple[str, WeightLike]]:
    """``weights`` with the vision tower's and projector's tensors renamed to ``vision_tower.*`` and
    ``multi_modal_projector.*``, the tower's layers (named ``layers``N. after renaming) from
    ``num_layers_used`` on dropped (past the feature layer: never run), and those starting with one
    of ``unused``; every other tensor (the language model's) unchanged."""
    def keep(name: str) -> bool:
        if name.startswith(layers):
            return int(name[len(layers):].split(".", 1)[0]) < num_layers_used
        return not name.startswith(unused)

    return renamed_by_prefix(weights, TOWER_AND_PROJECTOR_PREFIXES, keep)
