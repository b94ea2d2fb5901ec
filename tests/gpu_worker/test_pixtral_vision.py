"""Pixtral's image encoder (vision tower + Pixtral-12B's LLaVA projector or Mistral 3's) against
transformers' get_image_features on tiny random models, with images of different sizes in one batch
(padded as PixtralImageProcessor pads them), loaded through our weight loader from every checkpoint
layout; inner feature layers; half precision; refusals."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.pixtral_vision import PixtralProjector, PixtralVisionTower, pixtral_vision_tensors
from gpu_worker.vision_config import PixtralVisionConfig, pixtral_vision_config_from_dict
from gpu_worker.weights import iter_safetensors, load_weights
from tests.gpu_worker.utils import assert_same_parameters

TEXT = {"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 300,
        "rms_norm_eps": 1e-5}
# Three blocks of two 16-wide heads (4-wide quarters for the 2-D rotary), 4-pixel patches.
# SiLU as in the published configs (transformers' default is GELU); a rotary base other than the
# default 10000, to see that it is read.
VISION = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
          "num_attention_heads": 2, "image_size": 64, "patch_size": 4, "hidden_act": "silu",
          "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0}}
TOKEN_IDS = {"[IMG_BREAK]": 12, "[IMG_END]": 13}
# Resized (height, width) in pixels, as the processor's image_sizes: different shapes in one batch, two of
# them with one patch count (6 x 4 and 4 x 6 patches), in an order that is not sorted by size. Mistral 3's
# are whole 2 x 2 squares of patches (8 pixels); Pixtral-12B's only whole patches.
SIZES = {"mistral3": [(24, 16), (8, 32), (16, 24)], "llava": [(20, 12), (8, 28), (12, 20)]}


def _hf_model(arch: str, seed: int = 0) -> transformers.PreTrainedModel:
    if arch == "mistral3":
        config = transformers.Mistral3Config(text_config=TEXT, vision_config=VISION, spatial_merge_size=2,
                                             image_token_index=10, vision_feature_layer=-1)
        cls = transformers.Mistral3ForConditionalGeneration
    else:  # Pixtral-12B: a LLaVA whose tower is Pixtral's, every patch's features ("full"), biased projector
        config = transformers.LlavaConfig(text_config=TEXT, vision_config=VISION, image_token_index=10,
                                          vision_feature_layer=-1, vision_feature_select_strategy="full")
        cls = transformers.LlavaForConditionalGeneration
    config.architectures = [cls.__name__]  # (as config.json has it; save_pretrained would set it too)
    model = cls._from_config(config, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.3 * noise)  # RMSNorm scales, far from their init
            elif param.dim() == 1:
                param.copy_(0.1 * noise)  # biases
            else:
                param.copy_(noise / param[0].numel() ** 0.5)
    return model.eval()


def _config(hf: transformers.PreTrainedModel, layer: int | None = None) -> PixtralVisionConfig:
    cfg = hf.config.to_dict()
    if layer is not None:
        cfg["vision_feature_layer"] = layer
    text = cfg["text_config"]
    return pixtral_vision_config_from_dict(cfg, text_hidden_size=text["hidden_size"],
                                           text_rms_norm_eps=text["rms_norm_eps"], token_ids=TOKEN_IDS)


class _ImageEncoder(nn.Module):
    """Our tower and projector under the names a Pixtral model holds them, with the checkpoint
    renaming a top-level model gives the loader."""

    def __init__(self, vc: PixtralVisionConfig) -> None:
        super().__init__()
        self.vc = vc
        self.vision_tower = PixtralVisionTower(vc)
        self.multi_modal_projector = PixtralProjector(vc)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        # (The language model's tensors are another module's: only the vision side comes here.)
        for name, tensor in pixtral_vision_tensors(weights, self.vc.num_layers_used):
            if name.startswith(("vision_tower.", "multi_modal_projector.")):
                yield name, tensor

    def forward(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        p = self.vc.patch_size
        grids = [(image.shape[1] // p, image.shape[2] // p) for image in images]
        return self.multi_modal_projector(self.vision_tower(images), grids)


def _ours(vc: PixtralVisionConfig, weights: Iterable[tuple[str, WeightLike]]) -> _ImageEncoder:
    ours = _ImageEncoder(vc)
    with torch.no_grad():
        load_weights(ours, weights)
    return ours.eval()


@pytest.fixture(scope="module", params=["mistral3", "llava"])
def saved(request, tmp_path_factory) -> tuple[str, transformers.PreTrainedModel, Path]:
    hf = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path


def _images(arch: str, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(3, height, width, generator=gen) for height, width in SIZES[arch]]


def _padded(images: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The images as PixtralImageProcessor batches them: zero-padded below and to the right to the
    largest height and width, with image_sizes [images, 2] their (height, width) in pixels."""
    height = max(image.shape[1] for image in images)
    width = max(image.shape[2] for image in images)
    pixels = torch.zeros(len(images), 3, height, width, dtype=dtype)
    for i, image in enumerate(images):
        pixels[i, :, :image.shape[1], :image.shape[2]] = image
    return pixels, torch.tensor([tuple(image.shape[1:]) for image in images])


def _reference(hf: transformers.PreTrainedModel, images: list[torch.Tensor], layer: int,
               dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """transformers' tower features (the selected hidden states, split per image) and projected rows
    for the padded batch of the images."""
    pixels, sizes = _padded(images, dtype)
    with torch.no_grad():
        # (output_hidden_states: transformers 5.25 captures none for vision_feature_layer 0 otherwise.)
        out = hf.model.get_image_features(pixel_values=pixels, image_sizes=sizes, vision_feature_layer=layer,
                                          output_hidden_states=True)
    patch = hf.config.vision_config.patch_size
    features = out.hidden_states[layer].squeeze(0).split([(h // patch) * (w // patch) for h, w in sizes.tolist()])
    return list(features), list(out.pooler_output)


def test_the_config_reads_the_saved_numbers(saved):
    arch, hf, _ = saved
    vc = _config(hf)
    assert (vc.hidden_size, vc.intermediate_size, vc.num_attention_heads, vc.head_dim) == (32, 64, 2, 16)
    assert (vc.patch_size, vc.num_channels, vc.hidden_act, vc.rope_theta) == (4, 3, "silu", 100.0)
    assert (vc.num_layers_used, vc.text_hidden_size, vc.projector_act) == (3, 64, "gelu")
    assert (vc.image_break_token_id, vc.image_end_token_id) == (12, 13)
    if arch == "mistral3":
        assert (vc.patch_merger, vc.spatial_merge_size, vc.projector_bias) == (True, 2, False)
        assert vc.projector_norm_eps == 1e-5  # (the text model's rms_norm_eps)
    else:
        assert (vc.patch_merger, vc.spatial_merge_size, vc.projector_bias) == (False, 1, True)
    assert [_config(hf, layer).num_layers_used for layer in (-2, -4, 0, 1, 3)] == [2, 0, 0, 1, 3]


@pytest.mark.parametrize("layer", [-1, -2, 1, 0])
def test_float32_equals_transformers_features_and_rows(saved, layer):
    arch, hf, path = saved
    vc = _config(hf, layer)
    ours = _ours(vc, iter_safetensors(path))  # the saved files, read lazily; later blocks dropped
    assert len(ours.vision_tower.transformer.layers) == vc.num_layers_used
    images = _images(arch)
    expected_features, expected_rows = _reference(hf, images, layer)
    with torch.no_grad():
        features = ours.vision_tower(images)
        rows = ours.multi_modal_projector(features, [(h // 4, w // 4) for h, w in SIZES[arch]])
    merge = 2 if arch == "mistral3" else 1
    for i, (height, width) in enumerate(SIZES[arch]):
        assert features[i].shape == (height // 4 * width // 4, 32) and features[i].dtype == torch.float32
        torch.testing.assert_close(features[i], expected_features[i], atol=1e-5, rtol=0)
        assert rows[i].shape == (height // (4 * merge) * width // (4 * merge), 64)
        torch.testing.assert_close(rows[i], expected_rows[i], atol=1e-5, rtol=0)
    assert max(r.abs().max() for r in rows) > 0.2  # (random weights that really move the numbers)
    # Images are independent: one alone, or in another order, gives the same rows; and each image may
    # be a view of the padded batch (its top-left corner).
    pixels, sizes = _padded(images)
    with torch.no_grad():
        corners = ours([pixels[i, :, :h, :w] for i, (h, w) in enumerate(sizes.tolist())])
        for mine, theirs in zip(corners, rows, strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
        torch.testing.assert_close(ours(images[1:2])[0], rows[1], atol=1e-5, rtol=0)
        for mine, theirs in zip(ours(images[::-1]), rows[::-1], strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


def test_the_rows_follow_the_patch_grid_row_by_row(saved):
    """The projector's tokens are the merged squares row by row: features laid out by hand as a 2 x 3
    grid of tokens (each a merge x merge square of patches), mirrored left to right, give the same
    tokens mirrored. (On the projector alone: the tower mixes the patches of an image.)"""
    arch, hf, _ = saved
    ours = _ours(_config(hf), hf.state_dict().items())
    merge = 2 if arch == "mistral3" else 1
    gen = torch.Generator().manual_seed(5)
    tiles = torch.randn(2, 3, merge, merge, 32, generator=gen)  # [token rows, token columns, m, m, width]
    grid = tiles.permute(0, 2, 1, 3, 4).reshape(2 * merge * 3 * merge, 32)  # patches row by row
    flipped = tiles.flip(1).permute(0, 2, 1, 3, 4).reshape(2 * merge * 3 * merge, 32)
    with torch.no_grad():
        rows, = ours.multi_modal_projector([grid], [(2 * merge, 3 * merge)])
        flipped_rows, = ours.multi_modal_projector([flipped], [(2 * merge, 3 * merge)])
    assert rows.shape == (6, 64)
    torch.testing.assert_close(flipped_rows.view(2, 3, 64), rows.view(2, 3, 64).flip(1), atol=1e-5, rtol=0)


# transformers 5 holds the model under "model."; what it saves (and what transformers 4 saved, and the
# published Pixtral-12B and Mistral Small 3.1 / 3.2 checkpoints) has vision_tower.*, multi_modal_projector.*
# and language_model.model.* at the top.
LAYOUTS = {
    "transformers 5 in memory": lambda name: name,
    "saved": lambda name: name.replace("model.vision_tower.", "vision_tower.")
    .replace("model.multi_modal_projector.", "multi_modal_projector.")
    .replace("model.language_model.", "language_model.model."),
}


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
    mapped = {name for name, _ in pixtral_vision_tensors(((name, None) for name in names), vc.num_layers_used)}
    assert {name for name, _ in _ImageEncoder(vc).named_parameters()} == mapped
    # The last block (layers.2) is loaded only when its output is the feature layer.
    assert any(".layers.2." in name for name in names)
    assert any(".layers.2." in name for name in mapped) == (layer == -1)


def test_the_language_models_tensors_pass_through_unrenamed():
    names = ["model.language_model.layers.0.self_attn.q_proj.weight", "lm_head.weight",
             "language_model.model.layers.5.mlp.up_proj.weight", "language_model.lm_head.weight",
             "vision_tower.transformer.layers.1.attention.q_proj.weight",
             "model.vision_tower.transformer.layers.0.ffn_norm.weight",
             "vision_tower.patch_positional_embedding.inv_freq"]
    assert [name for name, _ in pixtral_vision_tensors(((name, None) for name in names), 1)] == \
        names[:4] + ["vision_tower.transformer.layers.0.ffn_norm.weight"]


def test_bfloat16_runs_in_the_parameters_dtype_and_stays_close(saved):
    arch, hf, path = saved
    vc = _config(hf)
    images = _images(arch)
    _, reference = _reference(hf, images, -1)
    half = _ours(vc, iter_safetensors(path)).to(torch.bfloat16)
    with torch.no_grad():
        rows = half(images)  # float32 pixels: cast by the tower
    scale = max(r.abs().max() for r in reference)
    worst = max((mine.float() - theirs).abs().max() for mine, theirs in zip(rows, reference, strict=True))
    assert all(r.dtype == torch.bfloat16 for r in rows)
    # transformers' own bfloat16 run strays as far from float32 (3 blocks and a projector of bfloat16
    # roundings: measured 2.7% of the largest value for ours, 2.9% for theirs on Mistral 3; 2.1% and
    # 2.5% on Pixtral-12B); the two half runs agree more closely with each other (1.8%, 1.4%).
    _, theirs_half = _reference(copy.deepcopy(hf).to(torch.bfloat16), images, -1, dtype=torch.bfloat16)
    theirs_worst = max((theirs.float() - ref).abs().max() for theirs, ref in zip(theirs_half, reference, strict=True))
    between = max((mine.float() - theirs.float()).abs().max() for mine, theirs in zip(rows, theirs_half, strict=True))
    assert worst < 0.05 * scale and worst < 1.5 * theirs_worst, (worst, theirs_worst, scale)
    assert between < 0.03 * scale, (between, scale)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_the_cpu_reference(saved, dtype):
    arch, hf, path = saved
    images = _images(arch)
    _, reference = _reference(hf, images, -1)
    on_gpu = _ours(_config(hf), iter_safetensors(path)).to("cuda", dtype)
    with torch.no_grad():
        rows = on_gpu(images)  # CPU pixels: moved by the tower
    scale = max(r.abs().max() for r in reference)
    tolerance = 1e-3 if dtype == torch.float32 else 0.05  # (TF32 matmuls where enabled)
    for mine, theirs in zip(rows, reference, strict=True):
        assert mine.device.type == "cuda" and mine.dtype == dtype
        assert (mine.float().cpu() - theirs).abs().max() < tolerance * scale


def test_no_images_give_no_rows(saved):
    _, hf, _ = saved
    ours = _ImageEncoder(_config(hf))
    assert ours.vision_tower([]) == [] and ours.multi_modal_projector([], []) == []


def test_refuses_images_and_grids_it_cannot_take(saved):
    arch, hf, _ = saved
    ours = _ImageEncoder(_config(hf))
    with pytest.raises(ValueError, match="multiples of patch_size 4"):
        ours.vision_tower([torch.zeros(3, 8, 8), torch.zeros(3, 8, 10)])
    with pytest.raises(ValueError, match=r"\[3, H, W\]"):
        ours.vision_tower([torch.zeros(1, 3, 8, 8)])
    with pytest.raises(ValueError, match="rows \\* columns"):
        ours.multi_modal_projector([torch.zeros(12, 32)], [(2, 4)])
    with pytest.raises(ValueError, match="grids"):
        ours.multi_modal_projector([torch.zeros(8, 32)], [])
    if arch == "mistral3":
        with pytest.raises(ValueError, match="spatial_merge_size 2"):
            ours.multi_modal_projector([torch.zeros(12, 32)], [(3, 4)])


def test_the_config_refuses_other_towers_and_missing_tokens(saved):
    _, hf, _ = saved
    cfg = hf.config.to_dict()
    args = {"text_hidden_size": 64, "text_rms_norm_eps": 1e-5}
    clip = {**cfg, "vision_config": {**cfg["vision_config"], "model_type": "clip_vision_model"}}
    with pytest.raises(ValueError, match="Pixtral's"):
        pixtral_vision_config_from_dict(clip, token_ids=TOKEN_IDS, **args)
    with pytest.raises(ValueError, match=r"\[IMG_END\]"):
        pixtral_vision_config_from_dict(cfg, token_ids={"[IMG_BREAK]": 12}, **args)
    with pytest.raises(ValueError, match="vision_feature_layer"):
        pixtral_vision_config_from_dict({**cfg, "vision_feature_layer": [-1, -2]}, token_ids=TOKEN_IDS, **args)
