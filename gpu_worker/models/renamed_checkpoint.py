"""Checkpoints that name their tensors otherwise than ours (Phi's ``dense``, GPT-NeoX's ``gpt_neox.*``,
GPT-2's ``transformer.h.*``, OPT's ``decoder.*``, Falcon's ``self_attention``) and may hold q, k and v
in one tensor of their own layout: read as ours, the fused tensor split into q_proj, k_proj and
v_proj rows. A LoRA adapter's modules are renamed alike, and its B on the fused projection reordered
as the weight's rows (our qkv_proj holds all q rows, then k's, then v's)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from gpu_worker.config import ModelConfig
from gpu_worker.layers.weight_utils import WeightLike, materialize


def rename_parts(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """A checkpoint's name with each of its parts in ``renames`` (theirs, ours) renamed, in order."""
    for theirs, ours in renames:
        name = name.replace(theirs, ours)
    return name


def rename_first(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """A checkpoint's name with the first of ``renames`` (theirs, ours) it holds renamed (the others not
    tried: a rename's result may hold a later pair's part)."""
    for theirs, ours in renames:
        if theirs in name:
            return name.replace(theirs, ours)
    return name


def joined_parts(weights: Iterable[tuple[str, WeightLike]], joined: dict[str, tuple[str, ...]],
                 skipped: tuple[str, ...] = ()) -> Iterator[tuple[str, WeightLike]]:
    """The checkpoint with each layer's tensors named by ``joined``'s parts (ours -> the name endings of
    the tensors whose rows it holds, in order: OLMo Hybrid's and Kimi-Linear's q, k and v projections
    and convolutions) yielded as one tensor under ours once all of them have come; the others, and
    those named from ``skipped`` (other pipeline stages' layers: not read), as they stand."""
    waiting: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        found = None if skipped and name.startswith(skipped) else next(
            ((ours, part) for ours, parts in joined.items() for part in parts if name.endswith(part)), None)
        if found is None:
            yield name, tensor
            continue
        ours, part = found
        layer = name[: -len(part)]
        parts = waiting.setdefault((layer, ours), {})
        parts[part] = materialize(tensor)
        if len(parts) == len(joined[ours]):
            del waiting[(layer, ours)]
            yield layer + ours, torch.cat([parts[p] for p in joined[ours]])
    if waiting:
        raise KeyError(f"the checkpoint gives only some of the tensors joined as {sorted(waiting)}")


# A decoder layer's ``self_attn`` tensors, with or without the causal LM's "model." before "layers.".
_SELF_ATTN_OF_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.")


def recurrent_mixer_name(name: str, config: ModelConfig) -> str:
    """A checkpoint's name with a recurrent layer's ``self_attn`` (Kimi-Linear's and MiniMax's name both
    mixers so) made its recurrent mixer's, ``mamba``, as the other hybrids name it; any other as it
    stands."""
    found = _SELF_ATTN_OF_LAYER.search(name)
    layer = -1 if found is None else int(found.group(1))
    if not 0 <= layer < config.num_hidden_layers or not config.layer_is_mamba(layer):
        return name
    return name[: found.start(1)] + f"{layer}.mamba." + name[found.end():]


def per_head_qkv(fused: torch.Tensor, heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Rows of [heads, (q, k, v), head_dim] (a weight, a bias or a LoRA B: GPT-NeoX's query_key_value)
    as q's, k's and v's."""
    per_head = fused.view(heads, 3, head_dim, *fused.shape[1:])
    return tuple(per_head[:, i].reshape(heads * head_dim, *fused.shape[1:]) for i in range(3))


def grouped_qkv(fused: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Rows of [kv heads, (the group's queries, its k, its v), head_dim] (Falcon-40B's query_key_value,
    InternLM2's wqkv) as q's, k's and v's."""
    grouped = fused.view(kv_heads, heads // kv_heads + 2, head_dim, *fused.shape[1:])
    return (grouped[:, :-2].reshape(heads * head_dim, *fused.shape[1:]),
            grouped[:, -2].reshape(kv_heads * head_dim, *fused.shape[1:]),
            grouped[:, -1].reshape(kv_heads * head_dim, *fused.shape[1:]))


class RenamedCheckpoint:
    """Mixed into a causal LM before its base class. ``renames``: (theirs, ours) parts, applied in
    order; ``skipped``: suffixes of tensors not read (older checkpoints' causal-mask buffers);
    ``fused``: the fused q/k/v projection's name part once renamed ("" for none), split by
    ``fused_qkv_parts``; ``transposed``: suffixes of weights stored [in, out] (GPT-2's Conv1D)."""

    renames: tuple[tuple[str, str], ...] = ()
    skipped: tuple[str, ...] = ()
    fused = ""
    transposed: tuple[str, ...] = ()
    config: ModelConfig

    def ours(self, name: str) -> str:
        return rename_parts(name, self.renames)

    def fused_qkv_parts(self, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The fused projection's rows (weight, bias or LoRA B) as q's, k's and v's: each head's
        together unless a family says otherwise."""
        return per_head_qkv(fused, self.config.num_attention_heads, self.config.head_dim)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        renamed = self._renamed(weights)
        after = getattr(super(), "checkpoint_tensors", None)  # (the base's own reading: RoPE pairs)
        return after(renamed) if after is not None else renamed

    def _renamed(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:
            if name.endswith(self.skipped):
                continue
            name = self.ours(name)
            if self.transposed and name.endswith(self.transposed):
                tensor = materialize(tensor).t()
            if not self.fused or self.fused not in name:
                yield name, tensor
                continue
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), self.fused_qkv_parts(materialize(tensor)),
                                  strict=True):
                yield name.replace(self.fused, f".self_attn.{part}."), rows

    def lora_module_name(self, module: str) -> str:
        """An adapter's module as ours (the fused projection: our qkv_proj)."""
        name = self.ours(f"{module}.")
        name = (name.replace(self.fused, ".self_attn.qkv_proj.") if self.fused else name)[:-1]
        after = getattr(super(), "lora_module_name", None)
        return after(name) if after is not None else name

    def lora_b_rows(self, module: str, b: torch.Tensor) -> torch.Tensor:
        """An adapter's B, its rows in the order the base weight's were loaded in."""
        if self.fused and module.endswith(".self_attn.qkv_proj"):
            return torch.cat(self.fused_qkv_parts(b))
        after = getattr(super(), "lora_b_rows", None)
        return after(module, b) if after is not None else b
