"""Qwen2-VL's and Qwen2.5-VL's vision towers against transformers' on tiny random models."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from gpu_worker.models.qwen2_vl_vision import QwenVisionTower
from gpu_worker.vision_config import QwenVisionConfig

# Grids (t, h, w) in patches. With Qwen2.5's 56-pixel windows (2 x 2 merged squares), (1, 8, 12)
# splits into whole windows only, (1, 6, 4), (1, 6, 10) and (2, 6, 6) into windows cut short at the
# bottom / right edge, (1, 2, 2) is a single square; (2, 6, 6) has two frames.
GRIDS = [(1, 8, 12), (1, 6, 4), (1, 2, 2), (1, 6, 10), (2, 6, 6)]
PATCH_INPUT = 3 * 2 * 14 * 14


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("weight") and ("norm" in name or "ln_q" in name):
                param.copy_(1 + 0.3 * noise)  # norm scales, far from all ones
            elif param.dim() == 1:
                param.copy_(0.1 * noise)  # biases
            else:
                param.copy_(noise / param[0].numel() ** 0.5)


def _hf_qwen2_vl() -> tuple[torch.nn.Module, QwenVisionConfig]:
    cfg = Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=40, mlp_ratio=2, num_heads=2,
                              in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    model = Qwen2VisionTransformerPretrainedModel._from_config(cfg, attn_implementation="sdpa")
    vc = QwenVisionConfig(windowed=False, depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                          hidden_act=cfg.hidden_act, in_channels=3, patch_size=14, temporal_patch_size=2,
                          spatial_merge_size=2, out_hidden_size=40, window_size=0, fullatt_block_indexes=(),
                          image_token_id=0)
    return model, vc


def _hf_qwen2_5_vl() -> tuple[torch.nn.Module, QwenVisionConfig]:
    cfg = Qwen2_5_VLVisionConfig(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, hidden_act="silu",
                                 in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                                 window_size=56, out_hidden_size=40, fullatt_block_indexes=[1])
    model = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg, attn_implementation="sdpa")
    vc = QwenVisionConfig(windowed=True, depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                          hidden_act="silu", in_channels=3, patch_size=14, temporal_patch_size=2,
                          spatial_merge_size=2, out_hidden_size=40, window_size=56, fullatt_block_indexes=(1,),
                          image_token_id=0)
    return model, vc


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def towers(request) -> tuple[torch.nn.Module, QwenVisionTower]:
    hf, vc = _hf_qwen2_vl() if request.param == "qwen2_vl" else _hf_qwen2_5_vl()
    _randomize(hf, seed=0)
    ours = QwenVisionTower(vc)
    ours_params = dict(ours.named_parameters())
    with torch.no_grad():
        for name, tensor in hf.state_dict().items():
            ours_params[name].data.copy_(tensor)  # as the loader does: by name
    return hf.eval(), ours.eval()


def _pixels(grids: list[tuple[int, int, int]], seed: int = 1) -> torch.Tensor:
    patches = sum(t * h * w for t, h, w in grids)
    return torch.randn(patches, PATCH_INPUT, generator=torch.Generator().manual_seed(seed))


def _hf_merged(hf: torch.nn.Module, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
    # transformers 5 returns BaseModelOutputWithPooling: last_hidden_state is the blocks' output (in
    # window order for 2.5), pooler_output the merger's rows in the images' order.
    with torch.no_grad():
        return hf(pixels, grid_thw=torch.tensor(grids)).pooler_output


def test_parameter_names_equal_transformers(towers):
    hf, ours = towers
    assert set(ours.state_dict()) == set(hf.state_dict())
    for name, tensor in hf.state_dict().items():
        assert ours.state_dict()[name].shape == tensor.shape, name


def test_images_of_different_sizes_equal_transformers(towers):
    hf, ours = towers
    pixels = _pixels(GRIDS)
    want = _hf_merged(hf, pixels, GRIDS)
    with torch.no_grad():
        got = ours(pixels, GRIDS)
    assert got.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, 40)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_an_image_alone_gives_the_rows_it_gets_in_a_batch(towers):
    _, ours = towers
    pixels = _pixels(GRIDS)
    with torch.no_grad():
        batched = ours(pixels, GRIDS)
        patch_start = row_start = 0
        for t, h, w in GRIDS:
            alone = ours(pixels[patch_start:patch_start + t * h * w], [(t, h, w)])
            torch.testing.assert_close(alone, batched[row_start:row_start + t * h * w // 4], atol=1e-5, rtol=1e-5)
            patch_start += t * h * w
            row_start += t * h * w // 4


_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_dtype_on_each_device_is_close_to_transformers_float32(towers, dtype, device):
    hf, ours = towers
    grids = GRIDS
    pixels = _pixels(grids)
    want = _hf_merged(hf, pixels, grids)
    other = QwenVisionTower(ours.vc).to(device=device, dtype=dtype)
    other.load_state_dict(ours.state_dict())
    with torch.no_grad():
        # float32 pixel values on the CPU are moved to the parameters' device and dtype
        got = other(pixels, grids).cpu()
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # (TF32 matmuls where CUDA uses them)
        return
    assert torch.isfinite(got).all()
    scale = want.abs().max()
    assert (got.float() - want).abs().max() < 0.05 * scale


def test_refuses_pixel_values_that_do_not_match_the_grids(towers):
    _, ours = towers
    with pytest.raises(ValueError, match="pixel_values"):
        ours(_pixels([(1, 4, 4)]), [(1, 4, 6)])
    assert ours(torch.empty(0, PATCH_INPUT), []).shape == (0, 40)
