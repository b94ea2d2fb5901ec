"""InternVL's image encoder (InternViT tower + pixel shuffle + projector) against transformers'
InternVLModel.get_image_features on tiny random models, several tiles in one batch, loaded through
our weight loader from every checkpoint layout; LayerNorm and RMSNorm towers, q/k norms and
attention biases on and off, two shuffle scales; inner feature layers; half precision; refusals."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.internvl_vision import (
    InternVisionTower,
    InternVLProjector,
    internvl_vision_tensors,
    pixel_shuffle,
)
from gpu_worker.vision_config import InternVLVisionConfig, internvl_vision_config_from_dict
from gpu_worker.weights import iter_safetensors, load_weights
from tests.gpu_worker.utils import assert_same_parameters

TEXT = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300, "rms_norm_eps": 1e-6}
# Three layers of two 16-wide heads, 14-pixel patches. "300m": InternViT-300M's kind (LayerNorms, no
# q/k norms, no attention biases), 56-pixel tiles: 4x4 patches, 2x2 tokens after the 0.5 shuffle.
# "6b": InternViT-6B's kind (RMSNorms, q/k norms, biased q/k/v), 112-pixel tiles: 8x8 patches, 16 tokens.
# "mixed": LayerNorms with q/k norms, a 0.25 shuffle (4x4 squares of 8x8 patches: 4 tokens 16 wide),
# other activations, to see that they are read.
VISIONS = {
    "300m": ({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
              "image_size": 56, "patch_size": 14, "norm_type": "layer_norm", "use_qk_norm": False,
              "attention_bias": False}, {}),
    "6b": ({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
            "image_size": 112, "patch_size": 14, "norm_type": "rms_norm", "use_qk_norm": True,
            "attention_bias": True}, {}),
    "mixed": ({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
               "image_size": 112, "patch_size": 14, "norm_type": "layer_norm", "use_qk_norm": True,
               "attention_bias": False, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-5},
              {"downsample_ratio": 0.25, "projector_hidden_act": "silu"}),
}
# (patches per side, pixel-shuffle scale, tokens per tile)
GRIDS = {"300m": (4, 2, 4), "6b": (8, 2, 16), "mixed": (8, 4, 4)}
TILES = 3


def _hf_model(variant: str, seed: int = 0) -> transformers.InternVLForConditionalGeneration:
    vision, top = VISIONS[variant]
    config = transformers.InternVLConfig(text_config=TEXT, vision_config=vision, image_token_id=10, **top)
    config.architectures = ["InternVLForConditionalGeneration"]
    model = transformers.InternVLForConditionalGeneration._from_config(config, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith(("lambda_1", "lambda_2")):
                param.copy_(0.8 * noise)  # layer scales, far from their 0.1 init (and of both signs)
            elif name.endswith(("cls_token", "position_embeddings")):
                param.copy_(0.5 * noise)
            elif "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.3 * noise)  # norm scales, far from their init
            elif param.dim() == 1:
                param.copy_(0.1 * noise)  # biases
            else:
                param.copy_(noise / param[0].numel() ** 0.5)
    return model.eval()


def _config(hf: transformers.PreTrainedModel, layer: int | None = None) -> InternVLVisionConfig:
    cfg = {**hf.config.to_dict(), "architectures": ["InternVLForConditionalGeneration"]}
    if layer is not None:
        cfg["vision_feature_layer"] = layer
    return internvl_vision_config_from_dict(cfg, text_hidden_size=cfg["text_config"]["hidden_size"])


class _ImageEncoder(nn.Module):
    """Our tower and projector under the names an InternVL model holds them, with the checkpoint
    renaming a top-level model gives the loader."""

    def __init__(self, vc: InternVLVisionConfig) -> None:
        super().__init__()
        self.vc = vc
        self.vision_tower = InternVisionTower(vc)
        self.multi_modal_projector = InternVLProjector(vc)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        # (The language model's tensors are another module's: only the vision side comes here.)
        for name, tensor in internvl_vision_tensors(weights, self.vc.num_layers_used):
            if name.startswith(("vision_tower.", "multi_modal_projector.")):
                yield name, tensor

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(pixel_values))


def _ours(vc: InternVLVisionConfig, weights: Iterable[tuple[str, WeightLike]]) -> _ImageEncoder:
    ours = _ImageEncoder(vc)
    with torch.no_grad():
        load_weights(ours, weights)
    return ours.eval()


@pytest.fixture(scope="module", params=list(VISIONS))
def saved(request, tmp_path_factory) -> tuple[str, transformers.PreTrainedModel, Path]:
    hf = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path


def _tiles(hf: transformers.PreTrainedModel, seed: int = 1) -> torch.Tensor:
    size = hf.config.vision_config.image_size[0]
    return torch.randn(TILES, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _reference(hf: transformers.PreTrainedModel, tiles: torch.Tensor, layer: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' tower features (the selected hidden states, class token included) and tokens."""
    with torch.no_grad():
        # (output_hidden_states: transformers 5.25 captures none for vision_feature_layer 0 otherwise.)
        out = hf.model.get_image_features(pixel_values=tiles, vision_feature_layer=layer, output_hidden_states=True)
    features = out.last_hidden_state if layer == -1 else out.hidden_states[layer]
    return features, out.pooler_output


def test_the_config_reads_the_saved_numbers(saved):
    variant, hf, _ = saved
    vc = _config(hf)
    vision, top = VISIONS[variant]
    side, _, tokens = GRIDS[variant]
    assert (vc.hidden_size, vc.intermediate_size, vc.num_attention_heads, vc.head_dim) == (32, 64, 2, 16)
    assert (vc.image_size, vc.patch_size, vc.num_channels) == (side * 14, 14, 3)
    assert (vc.norm_type, vc.use_qk_norm, vc.attention_bias) == \
        (vision["norm_type"], vision["use_qk_norm"], vision["attention_bias"])
    assert (vc.hidden_act, vc.layer_norm_eps) == (vision.get("hidden_act", "gelu"), vision.get("layer_norm_eps", 1e-6))
    assert (vc.downsample_ratio, vc.projector_act) == (top.get("downsample_ratio", 0.5),
                                                       top.get("projector_hidden_act", "gelu"))
    assert (vc.num_layers_used, vc.text_hidden_size, vc.tokens_per_tile, vc.select_strategy) == \
        (3, 64, tokens, "default")
    assert [_config(hf, layer).num_layers_used for layer in (-2, -4, 0, 1, 3)] == [2, 0, 0, 1, 3]


@pytest.mark.parametrize("layer", [-1, -2, 1, 0])
def test_float32_equals_transformers_features_and_tokens(saved, layer):
    variant, hf, path = saved
    vc = _config(hf, layer)
    ours = _ours(vc, iter_safetensors(path))  # the saved files, read lazily; later layers dropped
    assert len(ours.vision_tower.encoder.layer) == vc.num_layers_used
    tiles = _tiles(hf)
    expected_features, expected_tokens = _reference(hf, tiles, layer)
    side, _, tokens_per_tile = GRIDS[variant]
    with torch.no_grad():
        features = ours.vision_tower(tiles)
        tokens = ours.multi_modal_projector(features)
    assert features.shape == (TILES, 1 + side * side, 32) and features.dtype == torch.float32
    torch.testing.assert_close(features, expected_features, atol=1e-5, rtol=0)
    assert tokens.shape == (TILES, tokens_per_tile, 64) and tokens.dtype == torch.float32
    torch.testing.assert_close(tokens, expected_tokens, atol=1e-5, rtol=0)
    assert tokens.abs().max() > 0.2  # (random weights that really move the numbers)
    # Tiles are independent: one alone, or the batch in another order, gives the same tokens.
    with torch.no_grad():
        torch.testing.assert_close(ours(tiles[1:2]), tokens[1:2], atol=1e-5, rtol=0)
        torch.testing.assert_close(ours(tiles.flip(0)), tokens.flip(0), atol=1e-5, rtol=0)


@pytest.mark.parametrize("scale", [2, 4])
def test_the_pixel_shuffle_is_transformers(scale):
    """Token (i, j) is the square of patches (s*i + dy, s*j + dx) concatenated dy-major, tokens row by
    row: checked against transformers' own pixel_shuffle and against that description."""
    side, width = 8, 5
    gen = torch.Generator().manual_seed(3)
    patches = torch.randn(2, side * side, width, generator=gen)
    ours = pixel_shuffle(patches, side, scale)
    theirs = transformers.InternVLModel.pixel_shuffle(None, patches.reshape(2, side, side, width), 1 / scale)
    torch.testing.assert_close(ours, theirs.reshape(2, -1, theirs.shape[-1]), atol=0, rtol=0)
    grid = patches.view(2, side, side, width)
    squares = side // scale
    for i in range(squares):
        for j in range(squares):
            square = torch.cat([grid[:, scale * i + dy, scale * j + dx] for dy in range(scale) for dx in range(scale)],
                               dim=-1)
            torch.testing.assert_close(ours[:, i * squares + j], square, atol=0, rtol=0)


# transformers 5 holds the model under "model."; what it saves (and the published InternVL3 / 3.5 "-hf"
# checkpoints) has vision_tower.*, multi_modal_projector.* and language_model.model.* at the top.
LAYOUTS = {
    "transformers 5 in memory": lambda name: name,
    "saved": lambda name: name.replace("model.vision_tower.", "vision_tower.")
    .replace("model.multi_modal_projector.", "multi_modal_projector.")
    .replace("model.language_model.", "language_model.model."),
}


def test_transformers_saves_the_published_layout(saved):
    _, hf, path = saved
    names = {name for name, _ in iter_safetensors(path)}
    assert names == {LAYOUTS["saved"](name) for name in hf.state_dict() if name != "lm_head.weight"}  # (tied)
    assert "vision_tower.encoder.layer.2.lambda_2" in names
    assert "multi_modal_projector.layer_norm.weight" in names
    assert "language_model.model.embed_tokens.weight" in names


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_checkpoint_layout_loads_the_same_tensors(saved, layout):
    _, hf, path = saved
    vc = _config(hf, -2)
    from_files = _ours(vc, iter_safetensors(path))
    rename = LAYOUTS[layout]
    other = _ours(vc, ((rename(name), tensor) for name, tensor in hf.state_dict().items()))
    assert_same_parameters(from_files, other)


@pytest.mark.parametrize("layer", [-1, -2])
def test_every_vision_tensor_has_a_destination_and_every_parameter_a_source(saved, layer):
    _, hf, _ = saved
    vc = _config(hf, layer)
    names = [name for name in hf.state_dict() if name.startswith(("model.vision_tower.", "model.multi_modal_"))]
    mapped = {name for name, _ in internvl_vision_tensors(((name, None) for name in names), vc.num_layers_used)}
    ours = {name: param for name, param in _ImageEncoder(vc).named_parameters()}
    assert set(ours) == mapped
    theirs = hf.state_dict()
    for name, param in ours.items():
        assert param.shape == theirs[f"model.{name}"].shape, name
    # The last layer (layer.2) is loaded only when its output is the feature layer.
    assert any(".layer.2." in name for name in names)
    assert any(".layer.2." in name for name in mapped) == (layer == -1)


def test_the_language_models_tensors_pass_through_unrenamed():
    names = ["model.language_model.layers.0.self_attn.q_proj.weight", "lm_head.weight",
             "language_model.model.layers.5.mlp.up_proj.weight", "language_model.lm_head.weight",
             "vision_tower.encoder.layer.1.attention.q_proj.weight",
             "model.vision_tower.encoder.layer.0.lambda_1", "vision_tower.embeddings.mask_token",
             "model.multi_modal_projector.linear_2.bias"]
    assert [name for name, _ in internvl_vision_tensors(((name, None) for name in names), 1)] == \
        names[:4] + ["vision_tower.encoder.layer.0.lambda_1", "multi_modal_projector.linear_2.bias"]


def test_bfloat16_runs_in_the_parameters_dtype_and_stays_close(saved):
    _, hf, path = saved
    vc = _config(hf)
    tiles = _tiles(hf)
    _, reference = _reference(hf, tiles, -1)
    half = _ours(vc, iter_safetensors(path)).to(torch.bfloat16)
    with torch.no_grad():
        tokens = half(tiles)  # float32 pixels: cast by the tower
    assert tokens.dtype == torch.bfloat16
    scale = reference.abs().max()
    worst = (tokens.float() - reference).abs().max()
    # transformers' own bfloat16 run strays as far from float32 (3 layers and a projector of bfloat16
    # roundings: measured 0.8% of the largest value for both on every variant); on CPU the two half runs
    # even agree bit for bit (the same operations in the same order), which a GPU need not repeat.
    _, theirs_half = _reference(copy.deepcopy(hf).to(torch.bfloat16), tiles.bfloat16(), -1)
    theirs_worst = (theirs_half.float() - reference).abs().max()
    between = (tokens.float() - theirs_half.float()).abs().max()
    assert worst < 0.05 * scale and worst < 1.5 * theirs_worst, (worst, theirs_worst, scale)
    assert between < 0.03 * scale, (between, scale)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_the_cpu_reference(saved, dtype):
    _, hf, path = saved
    tiles = _tiles(hf)
    _, reference = _reference(hf, tiles, -1)
    on_gpu = _ours(_config(hf), iter_safetensors(path)).to("cuda", dtype)
    with torch.no_grad():
        tokens = on_gpu(tiles)  # CPU pixels: moved by the tower
    assert tokens.device.type == "cuda" and tokens.dtype == dtype
    tolerance = 1e-3 if dtype == torch.float32 else 0.05  # (TF32 matmuls where enabled)
    assert (tokens.float().cpu() - reference).abs().max() < tolerance * reference.abs().max()


def test_no_tiles_give_no_tokens(saved):
    variant, hf, _ = saved
    ours = _ImageEncoder(_config(hf))
    side, _, tokens = GRIDS[variant]
    size = side * 14
    with torch.no_grad():
        features = ours.vision_tower(torch.zeros(0, 3, size, size))
        assert features.shape == (0, 1 + side * side, 32)
        assert ours.multi_modal_projector(features).shape == (0, tokens, 64)


def test_refuses_tiles_and_features_it_cannot_take(saved):
    variant, hf, _ = saved
    ours = _ImageEncoder(_config(hf))
    side, _, _ = GRIDS[variant]
    size = side * 14
    with pytest.raises(ValueError, match=rf"\[tiles, 3, {size}, {size}\]"):
        ours.vision_tower(torch.zeros(1, 3, size, size + 14))
    with pytest.raises(ValueError, match=rf"\[tiles, 3, {size}, {size}\]"):
        ours.vision_tower(torch.zeros(3, size, size))
    with pytest.raises(ValueError, match="class token"):
        ours.multi_modal_projector(torch.zeros(1, side * side, 32))  # (the class token already dropped)
    with pytest.raises(ValueError, match="class token"):
        ours.multi_modal_projector(torch.zeros(1 + side * side, 32))


def test_a_final_tower_norm_is_not_silently_skipped(saved):
    """A tower saved with use_mean_pooling false has a final LayerNorm that transformers applies to the
    last layer's features; our config has no field for it, so such a checkpoint must not load."""
    _, hf, path = saved
    vc = _config(hf)
    extra = [("vision_tower.layernorm.weight", torch.ones(32)), ("vision_tower.layernorm.bias", torch.zeros(32))]
    with pytest.raises(KeyError, match=r"vision_tower\.layernorm"):
        _ours(vc, [*iter_safetensors(path), *extra])


def test_a_ratio_that_is_not_one_over_a_whole_number_is_refused(saved):
    _, hf, _ = saved
    # (0.4 on 10x10 patches would be 4 tokens a side, but no whole square of patches makes a token.)
    with pytest.raises(ValueError, match="pixel-shuffle evenly"):
        dataclasses.replace(_config(hf), image_size=140, downsample_ratio=0.4)


def test_the_config_refuses_other_towers_and_strategies(saved):
    _, hf, _ = saved
    cfg = hf.config.to_dict()
    with pytest.raises(ValueError, match="InternViT"):
        internvl_vision_config_from_dict({**cfg, "vision_config": {**cfg["vision_config"], "model_type": "siglip"}}, 64)
    with pytest.raises(ValueError, match="'default'"):
        internvl_vision_config_from_dict({**cfg, "vision_feature_select_strategy": "full"}, 64)
    with pytest.raises(ValueError, match="vision_feature_layer"):
        internvl_vision_config_from_dict({**cfg, "vision_feature_layer": [-1, -2]}, 64)
    with pytest.raises(ValueError, match="norm_type"):
        internvl_vision_config_from_dict({**cfg, "vision_config": {**cfg["vision_config"], "norm_type": "batch"}}, 64)
