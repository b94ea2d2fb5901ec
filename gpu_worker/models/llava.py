"""LLaVA: a CLIP vision tower and a two-layer projector in front of a Llama-family decoder.

An image (the image processor's ``pixel_values``, [channels, size, size]) becomes
``tokens_per_image`` rows in the language model's width; the prompt holds as many image tokens,
whose embeddings the model runner replaces by those rows. The tower and the projector are whole on
every tensor-parallel rank (they are small next to the decoder), and run only on what the engine
schedules (``embed_images``); the decoder is the text architecture's, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.config import ModelConfig
from gpu_worker.layers.weight_utils import (
    LANGUAGE_MODEL_PREFIXES,
    VISION_SIDE_PREFIXES,
    WeightLike,
    copy_into,
    materialize,
    renamed_by_prefix,
)
from gpu_worker.vision_config import VisionConfig

_ACTIVATIONS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu,
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu}


def _activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(_ACTIVATIONS)}, got {name!r}")
    return _ACTIVATIONS[name]


class _FusedQKV(nn.Linear):
    """q, k and v projections in one matmul; the checkpoint's q_proj/k_proj/v_proj load as shards."""

    def __init__(self, width: int) -> None:
        super().__init__(width, 3 * width, bias=True)
        self.width = width
        for param in (self.weight, self.bias):
            param.weight_loader = self._load_shard  # type: ignore[attr-defined]
            param.expected_shards = {"q", "k", "v"}  # type: ignore[attr-defined]

    def _load_shard(self, param: nn.Parameter, loaded: WeightLike, shard_id: int | str | None) -> None:
        index = "qkv".index(str(shard_id))
        copy_into(param.data.narrow(0, index * self.width, self.width), materialize(loaded))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, vc: VisionConfig) -> None:
        super().__init__()
        self.num_heads = vc.num_attention_heads
        self.layer_norm1 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = _FusedQKV(vc.hidden_size)
        self.self_attn.out_proj = nn.Linear(vc.hidden_size, vc.hidden_size)
        self.layer_norm2 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(vc.hidden_size, vc.intermediate_size)
        self.mlp.fc2 = nn.Linear(vc.intermediate_size, vc.hidden_size)
        self.act = _activation(vc.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.self_attn.qkv_proj(self.layer_norm1(x)).split(width, dim=-1)
        heads = [t.view(batch, length, self.num_heads, -1).transpose(1, 2) for t in (q, k, v)]
        attended = F.scaled_dot_product_attention(*heads)  # every patch sees every other
        x = x + self.self_attn.out_proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class CLIPVisionTower(nn.Module):
    """transformers' CLIPVisionModel up to the feature layer (parameter names as its checkpoint's,
    without the ``vision_model.`` level that llava-hf checkpoints have and transformers 5 drops)."""

    def __init__(self, vc: VisionConfig) -> None:
        super().__init__()
        embeddings = self.embeddings = nn.Module()
        embeddings.patch_embedding = nn.Conv2d(vc.num_channels, vc.hidden_size, kernel_size=vc.patch_size,
                                               stride=vc.patch_size, bias=False)
        embeddings.class_embedding = nn.Parameter(torch.empty(vc.hidden_size))
        embeddings.position_embedding = nn.Embedding(vc.num_patches + 1, vc.hidden_size)
        self.pre_layrnorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(CLIPEncoderLayer(vc) for _ in range(vc.num_layers_used))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, channels, size, size] -> the feature layer's hidden states [images, 1 + patches, width]."""
        embeddings = self.embeddings
        patches = embeddings.patch_embedding(pixel_values.to(embeddings.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        cls = embeddings.class_embedding.expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1) + embeddings.position_embedding.weight
        x = self.pre_layrnorm(x)
        for layer in self.encoder.layers:
            x = layer(x)
        return x


class LlavaProjector(nn.Module):
    def __init__(self, vc: VisionConfig, text_width: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vc.hidden_size, text_width, bias=vc.projector_bias)
        self.linear_2 = nn.Linear(text_width, text_width, bias=vc.projector_bias)
        self.act = _activation(vc.projector_act)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaMixin(nn.Module):
    """Adds LLaVA's image side to a decoder class (see ``llava_class``)."""

    # Checkpoint prefixes -> ours: the language model's tensors as the decoder names them (transformers'
    # legacy layout, which llava-hf checkpoints use, then 4.52's), the vision side as it is.
    _PREFIXES = (*LANGUAGE_MODEL_PREFIXES, ("vision_tower.vision_model.", "vision_tower."),
                 ("model.vision_tower.vision_model.", "vision_tower."), ("model.vision_tower.", "vision_tower."),
                 ("model.multi_modal_projector.", "multi_modal_projector."), ("model.image_newline", "image_newline"))

    # What a LoRA adapter's module names are renamed by (PEFT names them as the checkpoint's model has
    # them), and the parts whose modules it skips, as vLLM, with a warning (gpu_worker.lora.manager).
    _LANGUAGE_MODEL_PREFIXES = LANGUAGE_MODEL_PREFIXES
    _VISION_PREFIXES = VISION_SIDE_PREFIXES

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert config.vision is not None
        self.vision_tower = CLIPVisionTower(config.vision)
        self.multi_modal_projector = LlavaProjector(config.vision, config.hidden_size)
        # LLaVA-NeXT: the row that ends each row of an image's grid features.
        self.image_newline = (nn.Parameter(torch.empty(config.hidden_size)) if config.vision.grid_pinpoints
                              else None)

    def embed_images(self, pixel_values: list[torch.Tensor],
                     image_sizes: list[tuple[int, int] | None]) -> list[torch.Tensor]:
        """Each image's rows ([its tokens, hidden]) that stand for its placeholder tokens, from its
        pixel values ([channels, size, size], or LLaVA-NeXT's [tiles, channels, size, size]) and its
        own (height, width). Every tile of the batch goes through the tower at once."""
        vc = self.config.vision
        tiles = [p if p.dim() == 4 else p.unsqueeze(0) for p in pixel_values]
        features = self.vision_tower(torch.cat(tiles))
        if vc.select_strategy == "default":
            features = features[:, 1:]
        rows = self.multi_modal_projector(features).to(self.model_dtype())
        per_image = rows.split([t.shape[0] for t in tiles])
        if self.image_newline is None:
            return [r[0] for r in per_image]
        return [self._pack_tiles(r, size) for r, size in zip(per_image, image_sizes, strict=True)]

    def _pack_tiles(self, rows: torch.Tensor, size: tuple[int, int] | None) -> torch.Tensor:
        """LLaVA-NeXT's order of one image's rows: the whole-image tile's, then the grid tiles'
        features as one picture (row by row), cut to the image's own aspect, each row ended by
        image_newline ([tiles, patches, hidden] -> [tokens, hidden])."""
        assert size is not None
        geometry = self.config.vision.geometry
        side = geometry.tiles_side
        pin_height, pin_width = geometry.best_resolution(*size)
        grid_rows, grid_columns = pin_height // geometry.image_size, pin_width // geometry.image_size
        grid = rows[1:].view(grid_rows, grid_columns, side, side, -1)
        picture = grid.permute(0, 2, 1, 3, 4).reshape(grid_rows * side, grid_columns * side, -1)
        kept_rows, kept_columns = geometry.grid_features(*size)
        top, left = (picture.shape[0] - kept_rows) // 2, (picture.shape[1] - kept_columns) // 2
        picture = picture[top:top + kept_rows, left:left + kept_columns]
        newline = self.image_newline.to(picture.dtype).expand(kept_rows, 1, -1)
        return torch.cat([rows[0], torch.cat([picture, newline], dim=1).reshape(-1, picture.shape[-1])])

    def model_dtype(self) -> torch.dtype:
        return next(self.model.layers.parameters()).dtype

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        used = self.config.vision.num_layers_used
        for name, tensor in weights:
            for theirs, ours in self._PREFIXES:
                if name.startswith(theirs):
                    name = ours + name[len(theirs):]
                    break
            if name.startswith("vision_tower."):
                if ".post_layernorm." in name or "position_ids" in name:
                    continue  # (the pooled output's norm: LLaVA reads an inner layer)
                if ".encoder.layers." in name and int(name.split(".encoder.layers.")[1].split(".")[0]) >= used:
                    continue  # (past the feature layer: never run)
            yield name, tensor


class TowerProjectorMixin(nn.Module):
    """What the models whose checkpoints are laid out as LLaVA's share (Pixtral's, InternVL's): the
    language model's tensors read under LLaVA's prefixes, the vision side's renamed by the class's
    ``tower_tensors`` (weights, layers used), and the decoder's dtype for the image rows."""

    _LANGUAGE_MODEL_PREFIXES = LlavaMixin._LANGUAGE_MODEL_PREFIXES
    _VISION_PREFIXES = LlavaMixin._VISION_PREFIXES
    tower_tensors: Callable[[Iterable[tuple[str, WeightLike]], int], Iterator[tuple[str, WeightLike]]]

    def model_dtype(self) -> torch.dtype:
        return next(self.model.layers.parameters()).dtype

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """The checkpoint's tensors under our names: the vision side's renamed first, the language
        model's as the text decoder reads them."""
        tower = type(self).tower_tensors
        return renamed_by_prefix(tower(weights, self.config.vision.num_layers_used),
                                 self._LANGUAGE_MODEL_PREFIXES, lambda name: True)


def llava_class(decoder: type[nn.Module]) -> type[nn.Module]:
    """The LLaVA model over ``decoder`` (LlamaForCausalLM, MistralForCausalLM, ...)."""
    return type(f"Llava{decoder.__name__}", (LlavaMixin, decoder), {})
