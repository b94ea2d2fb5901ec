"""Gemma 3's image encoder (SigLIP tower + multimodal projector) against transformers'
Gemma3ForConditionalGeneration.get_image_features on a tiny random model, loaded through our weight
loader from every checkpoint layout; half precision; refusals."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.gemma3_vision import Gemma3Projector, SiglipVisionTower, gemma3_vision_tensors
from gpu_worker.vision_config import Gemma3VisionConfig, gemma3_vision_config_from_dict
from gpu_worker.weights import iter_safetensors, load_weights
from tests.gpu_worker.utils import assert_same_parameters

TEXT = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 300}
# An 8 x 8 patch grid pooled 2 x 2 into 16 tokens. Published Gemma 3 configs turn SigLIP's pooling head off.
VISION = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 2, "image_size": 64, "patch_size": 8, "vision_use_head": False}


def _hf_model(use_head: bool = False, seed: int = 0) -> transformers.Gemma3ForConditionalGeneration:
    config = transformers.Gemma3Config(text_config=TEXT, vision_config={**VISION, "vision_use_head": use_head},
                                       mm_tokens_per_image=16, image_token_index=299, boi_token_index=297,
                                       eoi_token_index=298)
    model = transformers.Gemma3ForConditionalGeneration._from_config(config, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.3 * noise)  # norm scales (LayerNorm's and Gemma's 1 + w), far from their init
            elif param.dim() == 1:
                param.copy_(0.1 * noise)  # biases
            elif "position_embedding" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / param[0].numel() ** 0.5)
    return model.eval()


class _ImageEncoder(nn.Module):
    """Our tower and projector under the names a Gemma 3 model holds them, with the fused q/k/v
    mapping and checkpoint renaming a top-level model gives the loader."""

    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}

    def __init__(self, vc: Gemma3VisionConfig) -> None:
        super().__init__()
        self.vision_tower = SiglipVisionTower(vc)
        self.multi_modal_projector = Gemma3Projector(vc)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        # (The language model's tensors are another module's: only the vision side comes here.)
        for name, tensor in gemma3_vision_tensors(weights):
            if name.startswith(("vision_tower.", "multi_modal_projector.")):
                yield name, tensor

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(pixel_values))


def _ours(vc: Gemma3VisionConfig, weights: Iterable[tuple[str, WeightLike]]) -> _ImageEncoder:
    ours = _ImageEncoder(vc)
    with torch.no_grad():
        load_weights(ours, weights)
    return ours.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[transformers.Gemma3ForConditionalGeneration, Path, Gemma3VisionConfig]:
    hf = _hf_model()
    path = tmp_path_factory.mktemp("gemma3")
    hf.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    vc = gemma3_vision_config_from_dict(config, text_hidden_size=config["text_config"]["hidden_size"])
    return hf, path, vc


@pytest.fixture(scope="module")
def ours(saved) -> _ImageEncoder:
    _, path, vc = saved
    return _ours(vc, iter_safetensors(path))  # the saved files, q/k/v read lazily into the fused shards


def _pixels(images: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(images, 3, 64, 64, generator=torch.Generator().manual_seed(seed))


def _reference(hf: transformers.Gemma3ForConditionalGeneration, pixels: torch.Tensor):
    with torch.no_grad():
        return hf.model.get_image_features(pixels)


def test_the_config_reads_the_saved_numbers(saved):
    _, _, vc = saved
    assert (vc.hidden_size, vc.intermediate_size, vc.num_hidden_layers, vc.num_attention_heads) == (32, 64, 2, 2)
    assert (vc.image_size, vc.patch_size, vc.patches_side, vc.tokens_side) == (64, 8, 8, 4)
    assert (vc.mm_tokens_per_image, vc.text_hidden_size, vc.hidden_act) == (16, 64, "gelu_pytorch_tanh")


def test_float32_equals_transformers_tower_and_projected_rows(saved, ours):
    hf, _, _ = saved
    pixels = _pixels()
    expected = _reference(hf, pixels)
    with torch.no_grad():
        features = ours.vision_tower(pixels)
        rows = ours.multi_modal_projector(features)
    # get_image_features: the tower's last_hidden_state (post_layernorm applied), projected into pooler_output.
    torch.testing.assert_close(features, expected.last_hidden_state, atol=1e-5, rtol=0)
    assert rows.shape == (2, 16, 64) and rows.dtype == torch.float32
    torch.testing.assert_close(rows, expected.pooler_output, atol=1e-5, rtol=0)
    assert rows.abs().max() > 0.5  # (random weights that really move the numbers)
    # Images are independent: one alone gives the same rows.
    with torch.no_grad():
        torch.testing.assert_close(ours(pixels[1:]), rows[1:], atol=1e-5, rtol=0)


LAYOUTS = {
    "transformers 5 in memory": lambda name: name,
    "published (transformers 4)": lambda name: name.replace("model.vision_tower.", "vision_tower.vision_model.")
    .replace("model.multi_modal_projector.", "multi_modal_projector."),
    "transformers 4.5x saved": lambda name: name.replace("model.vision_tower.", "model.vision_tower.vision_model."),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_checkpoint_layout_loads_the_same_tensors(saved, ours, layout):
    hf, _, vc = saved
    rename = LAYOUTS[layout]
    other = _ours(vc, ((rename(name), tensor) for name, tensor in hf.state_dict().items()))
    assert_same_parameters(ours, other)


@pytest.mark.parametrize("use_head", [False, True])
def test_every_vision_tensor_has_a_destination_and_every_parameter_a_source(saved, use_head):
    _, _, vc = saved
    hf = _hf_model(use_head=use_head, seed=2)
    names = [name for name in hf.state_dict() if name.startswith(("model.vision_tower.", "model.multi_modal_"))]
    assert any(".head." in name for name in names) == use_head
    mapped = {name for name, _ in gemma3_vision_tensors((name, None) for name in names)}
    assert all(".head." not in name for name in mapped)  # SigLIP's pooling head: Gemma 3 discards its output
    fused = {".q_proj.": ".qkv_proj.", ".k_proj.": ".qkv_proj.", ".v_proj.": ".qkv_proj."}
    destinations = set()
    for name in mapped:
        for theirs, ours_part in fused.items():
            name = name.replace(theirs, ours_part)
        destinations.add(name)
    encoder = _ImageEncoder(vc)
    assert destinations == {name for name, _ in encoder.named_parameters()}
    # The loader agrees: nothing left over either way (it raises otherwise), and the result matches.
    encoder = _ours(vc, hf.state_dict().items())
    pixels = _pixels(seed=3)
    with torch.no_grad():
        torch.testing.assert_close(encoder(pixels), _reference(hf, pixels).pooler_output, atol=1e-5, rtol=0)


def test_the_language_models_tensors_pass_through_unrenamed():
    names = ["model.language_model.layers.0.self_attn.q_proj.weight", "lm_head.weight",
             "language_model.model.embed_tokens.weight", "vision_tower.vision_model.embeddings.position_ids"]
    assert [name for name, _ in gemma3_vision_tensors((name, None) for name in names)] == names[:3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_in_the_parameters_dtype_and_stays_close(saved, ours, dtype):
    hf, _, _ = saved
    pixels = _pixels()
    reference = _reference(hf, pixels).pooler_output
    half = copy.deepcopy(ours).to(dtype)
    with torch.no_grad():
        rows = half(pixels)  # float32 pixels: cast by the tower
    assert rows.dtype == dtype and rows.shape == reference.shape
    scale = reference.abs().max()
    assert (rows.float() - reference).abs().max() < 0.02 * scale  # (bf16 measured 0.7%, fp16 0.1%)
    # And transformers' own run in that dtype, to a rounding step or so (equal here on CPU).
    with torch.no_grad():
        theirs = copy.deepcopy(hf).to(dtype).model.get_image_features(pixels.to(dtype)).pooler_output
    assert (rows.float() - theirs.float()).abs().max() < 0.01 * scale


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_the_cpu_reference(saved, ours, dtype):
    hf, _, _ = saved
    pixels = _pixels()
    reference = _reference(hf, pixels).pooler_output
    on_gpu = copy.deepcopy(ours).to("cuda", dtype)
    with torch.no_grad():
        rows = on_gpu(pixels)  # CPU pixels: moved by the tower
    assert rows.device.type == "cuda" and rows.dtype == dtype
    tolerance = 1e-3 if dtype == torch.float32 else 0.05  # (TF32 matmuls where enabled)
    assert (rows.float().cpu() - reference).abs().max() < tolerance * reference.abs().max()


def test_refuses_images_and_grids_it_cannot_take(saved, ours):
    _, _, vc = saved
    with pytest.raises(ValueError, match="64x64"):
        ours.vision_tower(torch.zeros(1, 3, 56, 56))
    with pytest.raises(ValueError, match="64 patches"):
        ours.multi_modal_projector(torch.zeros(1, 49, 32))
    uneven = Gemma3VisionConfig(**{**{f: getattr(vc, f) for f in vc.__dataclass_fields__}, "mm_tokens_per_image": 9})
    with pytest.raises(ValueError, match="pool evenly"):
        Gemma3Projector(uneven)
