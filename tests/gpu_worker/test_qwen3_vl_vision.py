"""Qwen3-VL's vision tower (merged rows and DeepStack features) against transformers' on a tiny random model."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

from gpu_worker.models.qwen3_vl_vision import Qwen3VisionConfig, Qwen3VisionTower

# Grids (t, h, w) in patches. A 4 x 4 learned position grid is resampled to each of them (so
# positions really are interpolated, and (1, 2, 2) shrinks it); (2, 6, 6) has two frames.
GRIDS = [(1, 8, 12), (1, 6, 4), (1, 2, 2)]
VIDEO_GRIDS = [(2, 6, 6), (1, 4, 10)]
TINY = {"depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "out_hidden_size": 40, "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 2]}
PATCH_INPUT = 3 * 2 * 16 * 16

# Qwen/Qwen3-VL-8B-Instruct's config.json vision_config.
QWEN3_VL_8B_VISION = {"deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
                      "hidden_size": 1152, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304,
                      "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304,
                      "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("weight") and "norm" in name:
                param.copy_(1 + 0.3 * noise)  # norm scales, far from all ones
            elif param.dim() == 1:
                param.copy_(0.1 * noise)  # biases
            elif name == "pos_embed.weight":
                param.copy_(noise)
            else:
                param.copy_(noise / param[0].numel() ** 0.5)


@pytest.fixture(scope="module")
def towers() -> tuple[Qwen3VLVisionModel, Qwen3VisionTower]:
    hf = Qwen3VLVisionModel._from_config(Qwen3VLVisionConfig(**TINY), attn_implementation="sdpa")
    _randomize(hf, seed=0)
    ours = Qwen3VisionTower(Qwen3VisionConfig.from_hf(TINY))
    ours_params = dict(ours.named_parameters())
    with torch.no_grad():
        for name, tensor in hf.state_dict().items():
            ours_params[name].data.copy_(tensor)  # as the loader does: by name
    return hf.eval(), ours.eval()


def _pixels(grids: list[tuple[int, int, int]], seed: int = 1) -> torch.Tensor:
    patches = sum(t * h * w for t, h, w in grids)
    return torch.randn(patches, PATCH_INPUT, generator=torch.Generator().manual_seed(seed))


def _hf_outputs(hf: Qwen3VLVisionModel, pixels: torch.Tensor,
                grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    # transformers returns BaseModelOutputWithDeepstackFeatures: pooler_output is the merger's rows,
    # deepstack_features the DeepStack mergers' (last_hidden_state: the blocks' unmerged output).
    with torch.no_grad():
        out = hf(pixels, grid_thw=torch.tensor(grids))
    return out.pooler_output, list(out.deepstack_features)


def _ours(ours: Qwen3VisionTower, pixels: torch.Tensor,
          grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    with torch.no_grad():
        return ours(pixels, grids)


def test_state_dict_names_match_transformers(towers) -> None:
    hf, ours = towers
    assert set(ours.state_dict()) == set(hf.state_dict())
    assert not list(ours.buffers())
    for name, tensor in hf.state_dict().items():
        assert ours.state_dict()[name].shape == tensor.shape, name


@pytest.mark.parametrize("grids", [GRIDS, VIDEO_GRIDS], ids=["images", "video"])
def test_matches_transformers(towers, grids) -> None:
    hf, ours = towers
    pixels = _pixels(grids)
    want_merged, want_deepstack = _hf_outputs(hf, pixels, grids)
    merged, deepstack = _ours(ours, pixels, grids)
    rows = sum(t * h * w for t, h, w in grids) // 4
    assert merged.shape == (rows, 40)
    torch.testing.assert_close(merged, want_merged, atol=1e-5, rtol=1e-5)
    assert len(deepstack) == len(want_deepstack) == 2
    for got, want in zip(deepstack, want_deepstack):
        assert got.shape == (rows, 40)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The DeepStack rows are not the final merger's (a mix-up would still have the right shapes).
    assert not torch.allclose(deepstack[0], deepstack[1]) and not torch.allclose(deepstack[1], merged)


def test_image_alone_equals_batched(towers) -> None:
    _, ours = towers
    pixels = _pixels(GRIDS)
    merged, deepstack = _ours(ours, pixels, GRIDS)
    start, row = 0, 0
    for t, h, w in GRIDS:
        patches, rows = t * h * w, t * h * w // 4
        alone, alone_deepstack = _ours(ours, pixels[start:start + patches], [(t, h, w)])
        torch.testing.assert_close(alone, merged[row:row + rows], atol=1e-5, rtol=1e-5)
        for got, batched in zip(alone_deepstack, deepstack):
            torch.testing.assert_close(got, batched[row:row + rows], atol=1e-5, rtol=1e-5)
        start, row = start + patches, row + rows


DEVICES_DTYPES = [("cpu", torch.bfloat16), ("cpu", torch.float16)] + [
    pytest.param("cuda", dtype, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))
    for dtype in (torch.float32, torch.bfloat16, torch.float16)]


@pytest.mark.parametrize(("device", "dtype"), DEVICES_DTYPES)
def test_other_devices_and_dtypes_close(towers, device, dtype) -> None:
    _, ours = towers
    pixels = _pixels(GRIDS)
    want_merged, want_deepstack = _ours(ours, pixels, GRIDS)
    other = Qwen3VisionTower(ours.vc).to(device=device, dtype=dtype)
    other.load_state_dict(ours.state_dict())
    merged, deepstack = _ours(other, pixels, GRIDS)  # float32 CPU pixels, moved and cast by the tower
    assert merged.dtype == dtype and all(d.dtype == dtype and d.device == merged.device for d in deepstack)
    # (Measured on CPU, relative to the largest value: float16 ~1e-3, bfloat16 ~1e-2.)
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    for got, want in zip([merged, *deepstack], [want_merged, *want_deepstack]):
        err = (got.float().cpu() - want).abs().max() / want.abs().max()
        assert err < tolerance, float(err)


def test_rejects_bad_inputs(towers) -> None:
    _, ours = towers
    with pytest.raises(ValueError, match="pixel_values"):
        ours(_pixels(GRIDS)[:-1], GRIDS)
    with pytest.raises(ValueError, match="multiples"):
        ours(_pixels([(1, 3, 4)]), [(1, 3, 4)])
    merged, deepstack = ours(torch.empty(0, PATCH_INPUT), [])
    assert merged.shape == (0, 40) and [d.shape for d in deepstack] == [(0, 40), (0, 40)]
    with pytest.raises(ValueError, match="deepstack_visual_indexes"):
        Qwen3VisionTower(Qwen3VisionConfig.from_hf({**TINY, "deepstack_visual_indexes": [2, 0]}))


def test_config_from_hf() -> None:
    vc = Qwen3VisionConfig.from_hf(QWEN3_VL_8B_VISION)
    assert vc == Qwen3VisionConfig(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                                   hidden_act="gelu_pytorch_tanh", in_channels=3, patch_size=16,
                                   temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=4096,
                                   num_position_embeddings=2304, deepstack_visual_indexes=(8, 16, 24),
                                   rope_theta=10000.0)
    assert vc.head_dim == 72 and vc.patch_input_size == 1536 and vc.position_grid_side == 48
    # What config.json leaves out comes from transformers' Qwen3VLVisionConfig defaults.
    defaults = Qwen3VLVisionConfig()
    vc = Qwen3VisionConfig.from_hf({})
    for field in ("depth", "hidden_size", "intermediate_size", "num_heads", "hidden_act", "in_channels",
                  "patch_size", "temporal_patch_size", "spatial_merge_size", "out_hidden_size",
                  "num_position_embeddings"):
        assert getattr(vc, field) == getattr(defaults, field), field
    assert vc.deepstack_visual_indexes == tuple(defaults.deepstack_visual_indexes)
    assert vc.rope_theta == defaults.rope_parameters["rope_theta"]
