"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (native-resolution images, M-RoPE positions; Qwen3-VL's
interleaved and its DeepStack rows): our engine's prompt logprobs and greedy tokens equal
transformers' on tiny random checkpoints, whole and in chunks across images, beside text-only
requests, through the prefix cache, with a LoRA adapter; the geometry against transformers'
processor; the config and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_core.engine_core import RequestRefusedError
from engine_core.multimodal import MultiModalFeature, TensorData, feature_identifier
from engine_core.outputs import EngineCoreRequest
from engine_core.sampling_params import SamplingParams
from gpu_worker.config import ModelConfig
from gpu_worker.mrope import mrope_positions
from gpu_worker.vision_config import QwenVisionConfig
from tests.gpu_worker.test_llava import make_engine, picture
from tests.tiny_model import build_tiny_qwen2_vl, build_tiny_qwen3_vl

MAX_TOKENS = 6


def _built(kind: str, directory: Path):
    """(model dir, transformers' model, its image processor) of a tiny Qwen2-VL, Qwen2.5-VL or Qwen3-VL."""
    from transformers import (
        AutoImageProcessor,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeForConditionalGeneration,
    )

    if kind == "qwen3_vl":
        model_dir, model_class = build_tiny_qwen3_vl(directory), Qwen3VLForConditionalGeneration
    elif kind == "qwen3_vl_moe":
        model_dir, model_class = build_tiny_qwen3_vl(directory, moe=True), Qwen3VLMoeForConditionalGeneration
    else:
        windowed = kind == "qwen2_5_vl"
        model_dir = build_tiny_qwen2_vl(directory, windowed=windowed)
        model_class = Qwen2_5_VLForConditionalGeneration if windowed else Qwen2VLForConditionalGeneration
    return model_dir, model_class.from_pretrained(model_dir).eval(), AutoImageProcessor.from_pretrained(model_dir)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(request, tmp_path_factory):
    """Qwen2-VL and Qwen2.5-VL (28-pixel merged patches)."""
    return _built(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def any_qwen(request, tmp_path_factory):
    """Each native-resolution family: Qwen3-VL too (interleaved M-RoPE, DeepStack rows), and its MoE
    checkpoints (routed experts stored stacked)."""
    return _built(request.param, tmp_path_factory.mktemp(request.param))


def prompt(qwen, text_ids: list[list[int]], images: list):
    """Text pieces with an image between each two (each within vision start/end tokens): token ids
    (placeholders expanded), features, and transformers' inputs (pixel values, grids)."""
    _, model, processor = qwen
    config = model.config
    ids: list[int] = []
    features = []
    pixels = grids = None
    if images:
        out = processor(images=images, return_tensors="pt")
        pixels, grids = out["pixel_values"], out["image_grid_thw"]
    first = 0
    for i, piece in enumerate(text_ids):
        ids += piece
        if i < len(images):
            t, h, w = grids[i].tolist()
            data = TensorData.from_array(pixels[first:first + t * h * w])
            first += t * h * w
            ids.append(config.vision_start_token_id)
            features.append(MultiModalFeature("image", feature_identifier("image", data), len(ids), t * h * w // 4,
                                              data, (images[i].height, images[i].width)))
            ids += [config.image_token_id] * (t * h * w // 4) + [config.vision_end_token_id]
    return ids, features, (pixels, grids)


def reference(qwen, ids: list[int], inputs) -> tuple[list[float], list[int]]:
    """transformers' logprob of each prompt token after the first, and its greedy tokens."""
    _, model, _ = qwen
    pixels, grids = inputs
    # (transformers 5 places the images' M-RoPE positions only where told which tokens are images.)
    is_image = (torch.tensor([ids]) == model.config.image_token_id).int()
    kwargs = {} if pixels is None else {"pixel_values": pixels, "image_grid_thw": grids, "mm_token_type_ids": is_image}
    return hf_logprobs_and_tokens(model, ids, **kwargs)


def hf_logprobs_and_tokens(model, ids: list[int], **inputs) -> tuple[list[float], list[int]]:
    """transformers' ``model``'s logprob of each prompt token after the first, and its MAX_TOKENS
    greedy tokens, for the prompt ``ids`` with ``inputs`` (its images)."""
    tensor = torch.tensor([ids])
    mask = torch.ones_like(tensor)
    with torch.no_grad():
        logits = model(input_ids=tensor, attention_mask=mask, **inputs).logits[0].float()
        prompt_logprobs = torch.log_softmax(logits, -1)[:-1].gather(1, tensor[0, 1:, None])[:, 0]
        out = model.generate(input_ids=tensor, attention_mask=mask, max_new_tokens=MAX_TOKENS, do_sample=False,
                             **inputs)
    return prompt_logprobs.tolist(), out[0, len(ids):].tolist()


def run(engine, requests: dict, cached: dict[str, int] | None = None) -> dict[str, tuple[list[float], list[int]]]:
    """Each request's prompt logprobs and greedy tokens (only the tokens when ``cached`` is given:
    a request asking for prompt logprobs does not read the prefix cache)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=0 if cached is None else None)
    for req_id, (ids, features) in requests.items():
        engine.add_request(EngineCoreRequest(request_id=req_id, prompt_token_ids=ids, sampling_params=params,
                                             mm_features=features or None))
    got: dict[str, tuple[list[float], list[int]]] = {r: ([], []) for r in requests}
    while engine.has_work():
        for eco in engine.step().values():
            for out in eco.outputs:
                if out.new_prompt_logprobs is not None:
                    got[out.request_id][0].extend(out.new_prompt_logprobs.sampled_logprobs)
                got[out.request_id][1].extend(out.new_token_ids)
                if cached is not None and out.num_cached_tokens:
                    cached[out.request_id] = out.num_cached_tokens
    return got


def assert_equal(got: tuple[list[float], list[int]], want: tuple[list[float], list[int]]) -> None:
    np.testing.assert_allclose(got[0], want[0], atol=2e-4)
    assert got[1] == want[1]


def test_two_images_equal_transformers_whole_and_in_chunks_across_the_images(any_qwen):
    model_dir = any_qwen[0]
    # Images of other shapes: their grids are 4x6 and 6x4 patches (6 tokens each), 8x8 (16).
    ids, features, inputs = prompt(any_qwen, [[74, 75], [223, 263, 84], [71]],
                                   [picture(0), picture(1, (90, 60))])
    want = reference(any_qwen, ids, inputs)
    assert_equal(run(make_engine(model_dir), {"a": (ids, features)})["a"], want)
    # 5-token passes: each image's placeholders run over several chunks (its rows encoded once).
    engine = make_engine(model_dir, max_num_batched_tokens=5)
    assert_equal(run(engine, {"a": (ids, features)})["a"], want)
    assert engine.stats().num_images_encoded == 2


def test_an_image_prompt_beside_text_prompts_in_one_batch(any_qwen):
    """Text-only requests keep their plain positions while an image request's take the table (and
    its decode steps the shift), in the same passes."""
    model_dir = any_qwen[0]
    image_ids, image_features, inputs = prompt(any_qwen, [[90, 91], [92]], [picture(2, (120, 100))])
    text_ids = [5, 9, 11, 200, 31]
    want = {"image": reference(any_qwen, image_ids, inputs), "text": reference(any_qwen, text_ids, (None, None))}
    got = run(make_engine(model_dir, max_num_batched_tokens=16), {"image": (image_ids, image_features),
                                                                  "text": (text_ids, [])})
    for req_id in want:
        assert_equal(got[req_id], want[req_id])


def test_the_same_image_again_hits_the_prefix_cache_and_answers_the_same(any_qwen):
    model_dir = any_qwen[0]
    engine = make_engine(model_dir, block_size=4)
    ids, features, inputs = prompt(any_qwen, [[74, 75, 223], [263, 84, 71, 90]], [picture(3)])
    want = reference(any_qwen, ids, inputs)
    cached: dict[str, int] = {}
    assert run(engine, {"first": (ids, features)}, cached)["first"][1] == want[1] and not cached
    assert run(engine, {"again": (ids, features)}, cached)["again"][1] == want[1]
    assert cached["again"] == len(ids) - len(ids) % 4 - (len(ids) % 4 == 0) * 4


def test_positions_equal_transformers_rope_index(any_qwen):
    model_dir, model, _ = any_qwen
    geometry = ModelConfig.from_pretrained(model_dir).vision.geometry
    ids, features, (_, grids) = prompt(any_qwen, [[74], [75, 76], [77, 78, 79]],
                                       [picture(4, (40, 200)), picture(5, (200, 40))])
    tensor_ids = torch.tensor([ids])
    want, want_delta = model.model.get_rope_index(tensor_ids, (tensor_ids == model.config.image_token_id).int(), grids)
    positions, delta = mrope_positions(len(ids), features, geometry)
    assert (positions == want[:, 0].numpy()).all() and delta == int(want_delta)


def test_the_geometry_counts_and_shapes_images_as_transformers_processor_does(qwen):
    model_dir, _, processor = qwen
    geometry = ModelConfig.from_pretrained(model_dir).vision.geometry
    rng = np.random.RandomState(0)
    for height, width in [(1, 1), (28, 28), (40, 50), (13, 900), (900, 13), (300, 301), (14, 2800), (60, 12000),
                          *rng.randint(1, 400, (20, 2))]:
        out = processor(images=[picture(0, (int(height), int(width)))], return_tensors="np")
        assert geometry.patch_grid(height, width) == tuple(out["image_grid_thw"][0])
        assert geometry.input_shape(height, width) == out["pixel_values"].shape
        assert geometry.num_tokens(height, width) <= geometry.max_tokens
    # (At most max_pixels, 16 tokens, but a 200:1 image's short side is rounded up to 28 pixels.)
    assert geometry.max_tokens == geometry.num_tokens(60, 12000) == 56


@pytest.mark.parametrize("min_pixels, max_pixels", [(128 * 784, 128 * 784), (512 * 784, 512 * 784),
                                                    (3136, 12845056), (3136, 3136)])
def test_the_largest_image_bound_holds_when_small_images_are_scaled_up(min_pixels, max_pixels):
    """An image scaled up to min_pixels has each side rounded up: more than max_pixels / 784 tokens
    (128 x 784 pixels: a 1x127 image takes 256 tokens, not 160). The scheduler's encoder budget and
    cache are this bound: an image over it would never be scheduled."""
    from engine_core.multimodal import ImageGeometry

    geometry = ImageGeometry(28, 14, 3, merge_size=2, min_pixels=min_pixels, max_pixels=max_pixels)
    sizes = [(h, w) for h in range(1, 300) for w in (1, 2, 3, 7, 27, 29, 57, 127, 250)]
    sizes += [tuple(hw) for hw in np.random.RandomState(1).randint(1, 5000, (3000, 2))]
    most = max(geometry.num_tokens(h, w) for h, w in sizes if max(h, w) / min(h, w) <= 200)
    assert most <= geometry.max_tokens
    if min_pixels == 128 * 784:
        assert geometry.num_tokens(1, 127) == most == 256


def test_config_reads_the_processor_pixel_range_and_both_layouts(qwen, tmp_path):
    model_dir = qwen[0]
    config = ModelConfig.from_pretrained(model_dir)
    assert isinstance(config.vision, QwenVisionConfig) and config.mrope_section == (2, 3, 3)
    assert (config.vision.min_pixels, config.vision.max_pixels) == (56 * 56, 28 * 28 * 16)
    assert config.architecture == "Qwen2ForCausalLM" and config.vision.tokens_per_image == 56
    # The released checkpoints' flat layout: the language model's keys at the top level, "mrope" rope_scaling.
    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg.pop("text_config")
    flat = {**cfg, **{k: v for k, v in text.items() if k != "rope_parameters"}, "rope_theta": 10000.0,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    flat_config = ModelConfig.from_dict(flat)
    assert flat_config.mrope_section == (2, 3, 3) and flat_config.rope_scaling in (None, {"rope_type": "default"})
    assert (flat_config.hidden_size, flat_config.num_hidden_layers) == (64, 2)
    # A processor of the released checkpoints' kind (min/max_pixels at its top level).
    processor = json.loads((model_dir / "preprocessor_config.json").read_text())
    for key in ("size",):
        processor.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(flat))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**processor, "min_pixels": 784,
                                                                   "max_pixels": 28 * 28 * 64}))
    assert ModelConfig.from_pretrained(tmp_path).vision.max_pixels == 28 * 28 * 64
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**processor, "patch_size": 16}))
    with pytest.raises(ValueError, match="patch_size 16 is not the vision tower's 14"):
        ModelConfig.from_pretrained(tmp_path)
    llama = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 1, "num_attention_heads": 4, "rope_scaling": {"type": "mrope",
                                                                                "mrope_section": [2, 3, 3]}}
    with pytest.raises(ValueError, match="M-RoPE"):
        ModelConfig.from_dict(llama)


def test_yarn_beside_m_rope_equals_transformers(tmp_path):
    """Qwen2.5-VL's long-context setting: YaRN scales the frequencies M-RoPE splits among the axes."""
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    model_dir = build_tiny_qwen2_vl(tmp_path, windowed=True, rope_scaling=yarn)
    config = ModelConfig.from_pretrained(model_dir)
    assert config.rope_scaling["rope_type"] == "yarn" and config.mrope_section == (2, 3, 3)
    qwen = (model_dir, Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).eval(),
            AutoImageProcessor.from_pretrained(model_dir))
    ids, features, inputs = prompt(qwen, [[74, 75], [223, 263]], [picture(8, (60, 90))])
    assert_equal(run(make_engine(model_dir), {"a": (ids, features)})["a"], reference(qwen, ids, inputs))


def test_mm_processor_kwargs_set_the_pixel_range_everywhere(qwen, tmp_path):
    """vLLM's --mm-processor-kwargs: Qwen2-VL's min/max pixels over the processor config's, in the
    engine's geometry (counts, checks, budgets) and, through it, the router's processor."""
    from router.multimodal import MultiModalProcessor, load_image_processor

    model_dir = qwen[0]
    config = ModelConfig.from_pretrained(model_dir, mm_processor_kwargs={"max_pixels": 28 * 28 * 64})
    geometry = config.vision.geometry
    assert (geometry.min_pixels, geometry.max_pixels) == (56 * 56, 28 * 28 * 64)
    assert geometry.num_tokens(300, 200) == 54 > ModelConfig.from_pretrained(model_dir).vision.geometry.num_tokens(
        300, 200)
    router = MultiModalProcessor(config.vision.image_token_id, geometry, load_image_processor(model_dir), "q", "")
    image = router.process_image(picture(9, (300, 200)))
    assert image.num_tokens == 54 and image.pixel_values.shape == (216, 1176)
    # (transformers' size form, as Qwen3-VL's model card sets it; explicit min/max_pixels win over it)
    sized = ModelConfig.from_pretrained(model_dir, mm_processor_kwargs={"size": {"longest_edge": 28 * 28 * 64}})
    assert sized.vision.geometry == geometry
    both = {"size": {"longest_edge": 1}, "max_pixels": 28 * 28 * 64}
    assert ModelConfig.from_pretrained(model_dir, mm_processor_kwargs=both).vision.geometry == geometry
    for kwargs, match in (({"num_crops": 4}, r"\['num_crops'\] cannot be served for Qwen2.*VLForConditionalGeneration"),
                          ({"size": {"height": 4}}, "only shortest_edge and longest_edge"),
                          ({"min_pixels": 10 ** 6}, "min_pixels .* at most its max_pixels")):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_pretrained(model_dir, mm_processor_kwargs=kwargs)
    from tests.tiny_model import build_tiny_llama

    with pytest.raises(ValueError, match="it sets nothing of this model's"):
        ModelConfig.from_pretrained(build_tiny_llama(tmp_path / "text"), mm_processor_kwargs={"max_pixels": 1})
    # An engine with them answers as transformers does with the processor so set.
    engine = make_engine(model_dir, mm_processor_kwargs={"max_pixels": 28 * 28 * 64})
    ids, features, inputs = prompt((model_dir, qwen[1], _processor_with(qwen[2], 28 * 28 * 64)), [[74], [75]],
                                   [picture(9, (300, 200))])
    assert features[0].length == 54
    assert_equal(run(engine, {"a": (ids, features)})["a"], reference(qwen, ids, inputs))


def _processor_with(processor, max_pixels: int):
    import copy

    processor = copy.deepcopy(processor)
    processor.size = type(processor.size)(shortest_edge=56 * 56, longest_edge=max_pixels)
    return processor


def test_a_lora_adapter_on_the_language_model_answers_as_peft_does_with_images(any_qwen, tmp_path):
    """PEFT names a Qwen2-VL adapter's modules as transformers 5's model has them
    (model.language_model.layers...); the engine applies them to its decoder, images and all."""
    from peft import LoraConfig, get_peft_model

    from cluster.config import ClusterConfig, EngineSpec
    from engine_core.engine_core import EngineCore
    from engine_core.outputs import LoRARequest
    from gpu_worker.executor import create_executor

    model_dir, base, _ = any_qwen
    torch.manual_seed(3)
    adapted = get_peft_model(type(base).from_pretrained(model_dir).eval(), LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, lora_dropout=0.0,
        target_modules=r".*language_model.*\.(q_proj|v_proj|o_proj)"))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.2)
    adapted.eval().save_pretrained(tmp_path / "adapter")
    ids, features, inputs = prompt(any_qwen, [[74, 75], [263, 84]], [picture(10)])
    want = reference((model_dir, adapted, None), ids, inputs)
    assert want[1] != reference(any_qwen, ids, inputs)[1]  # (the adapter changes the answer)
    config = ClusterConfig(model=str(model_dir), enable_lora=True, max_lora_rank=8,
                           defaults=EngineSpec(num_gpu_blocks=256)).engine_configs()[0]
    engine = EngineCore(config, create_executor(config))
    lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    engine.add_lora(lora)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=ids, sampling_params=params,
                                         mm_features=features, lora_request=lora))
    got: list[int] = []
    while engine.has_work():
        for eco in engine.step().values():
            for o in eco.outputs:
                got += o.new_token_ids
    assert got == want[1]


def test_the_engine_refuses_images_it_cannot_take(qwen):
    model_dir = qwen[0]
    ids, features, _ = prompt(qwen, [[74], [75]], [picture(6)])
    # With whole images per pass, an image over the pass's tokens could never run.
    whole = make_engine(model_dir, max_num_batched_tokens=4, disable_chunked_mm_input=True)
    with pytest.raises(RequestRefusedError, match="an image of 6 tokens does not fit a pass of 4 tokens"):
        whole.add_request(EngineCoreRequest(request_id="w", prompt_token_ids=ids, sampling_params=SamplingParams(),
                                            mm_features=features))
    engine = make_engine(model_dir)
    params = SamplingParams(max_tokens=2)
    feature = features[0]
    for bad, match in (
            (MultiModalFeature("image", "x", feature.offset, feature.length, feature.pixel_values, None), "its size"),
            (MultiModalFeature("image", "x", feature.offset, feature.length, feature.pixel_values, (10, 4000)),
             "at most 200x"),
            (MultiModalFeature("image", "x", feature.offset, feature.length, feature.pixel_values, (200, 200)),
             "as 16 tokens"),
            (MultiModalFeature("image", "x", feature.offset, feature.length,
                               TensorData.from_array(torch.zeros(feature.length * 4, 3)), (40, 50)),
             r"as \[24, 1176\]")):
        with pytest.raises(RequestRefusedError, match=match):
            engine.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=ids, sampling_params=params,
                                                 mm_features=[bad]))


def test_qwen3_vl_moe_reads_the_released_checkpoints_stacked_experts_transposed(tmp_path):
    """The released Qwen3-VL MoE checkpoints (saved by transformers 4) store each layer's experts
    [experts, in, out]; transformers 5 saves [experts, out, in]: both load to the same model."""
    import shutil

    from safetensors.torch import load_file, save_file

    saved = build_tiny_qwen3_vl(tmp_path / "saved", moe=True)
    released = tmp_path / "released"
    shutil.copytree(saved, released)
    tensors = load_file(saved / "model.safetensors")
    experts = [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert experts
    save_file({name: t.transpose(1, 2).contiguous() if name in experts else t for name, t in tensors.items()},
              released / "model.safetensors", metadata={"format": "pt"})
    prompt_ids = [2, 5, 9, 11, 200, 31, 7]
    got = [run(make_engine(directory), {"t": (prompt_ids, [])})["t"] for directory in (saved, released)]
    assert got[0][1] == got[1][1]
    np.testing.assert_allclose(got[0][0], got[1][0], atol=1e-6)


def video_prompt(qwen, frames: list, second_per_grid: float):
    """An image and then a video (each within vision start/end tokens), text around them: token ids,
    features, and transformers' keyword inputs for them (the video's patches made by the router's
    video_patches, fed to both)."""
    from router.video import video_patches

    model_dir, model, processor = qwen
    config = model.config
    geometry = ModelConfig.from_pretrained(model_dir).vision.geometry
    ids, features, (pixels, grids) = prompt(qwen, [[74, 75], [223, 263]], [picture(0)])
    patches = video_patches(frames, geometry, processor.image_mean, processor.image_std)
    grid = geometry.video_patch_grid(len(frames), frames[0].height, frames[0].width)
    data = TensorData.from_array(patches)
    ids.append(config.vision_start_token_id)
    tokens = grid[0] * grid[1] * grid[2] // 4
    features.append(MultiModalFeature("video", feature_identifier("video", data), len(ids), tokens, data,
                                      (frames[0].height, frames[0].width), len(frames), second_per_grid))
    ids += [config.video_token_id] * tokens + [config.vision_end_token_id, 90, 91]
    kinds = torch.tensor([ids])
    token_types = (kinds == config.image_token_id).int() + 2 * (kinds == config.video_token_id).int()
    kwargs = {"pixel_values": pixels, "image_grid_thw": grids, "pixel_values_videos": torch.from_numpy(patches),
              "video_grid_thw": torch.tensor([grid]), "mm_token_type_ids": token_types}
    if config.model_type == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = torch.tensor([second_per_grid])
    return ids, features, kwargs


def test_a_video_beside_an_image_equals_transformers_whole_and_in_chunks(qwen):
    """A video's frames in pairs (3 frames: the last repeated), each pair a temporal patch whose rows
    attend within their frame pair; Qwen2.5-VL's M-RoPE times its temporal patches by
    second_per_grid (1.25 s: time positions 0 and 2). Whole, in 5-token chunks across the video, and
    with its rows from the encoder cache."""
    model_dir, model, _ = qwen
    frames = [picture(20 + i, (60, 120)) for i in range(3)]  # (resized to 56x112: 4x8 patches, 8 tokens each)
    ids, features, kwargs = video_prompt(qwen, frames, 1.25)
    assert features[1].length == 16 and tuple(features[1].pixel_values.shape) == (64, 3 * 2 * 14 * 14)
    want = hf_logprobs_and_tokens(model, ids, **kwargs)
    assert_equal(run(make_engine(model_dir), {"a": (ids, features)})["a"], want)
    engine = make_engine(model_dir, max_num_batched_tokens=5)
    assert_equal(run(engine, {"a": (ids, features)})["a"], want)
    assert engine.stats().num_images_encoded == 2
    cached: dict[str, int] = {}
    assert run(engine, {"again": (ids, features)}, cached)["again"][1] == want[1]
    # (The same frames taken at another rate time the video otherwise: another video, under Qwen2.5-VL.)
    if model.config.model_type == "qwen2_5_vl":
        slower_ids, slower, slower_kwargs = video_prompt(qwen, frames, 0.5)
        assert slower[1].identifier == features[1].identifier  # (the pixels are equal: the digest is the router's)
        assert hf_logprobs_and_tokens(model, slower_ids, **slower_kwargs)[0] != want[0]


def test_video_positions_count_on_from_the_last_time_position():
    """Text after a video whose temporal patches span more positions than its rows and columns goes on
    from one past its last time position (vLLM's rule, and the original Qwen2-VL code's; transformers
    5 counts on from its rows and columns alone)."""
    from msgspec.structs import replace

    geometry = replace(QwenVisionConfig(
        windowed=True, depth=1, hidden_size=32, intermediate_size=64, num_heads=2, hidden_act="silu", in_channels=3,
        patch_size=14, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, window_size=56,
        fullatt_block_indexes=(0,), image_token_id=5).geometry, video_min_pixels=784, video_max_pixels=784,
                       tokens_per_second=2.0)
    data = TensorData.from_array(np.zeros((3 * 4, 3 * 2 * 14 * 14), np.float32))
    video = MultiModalFeature("video", "v", 2, 3, data, (28, 28), num_frames=6, second_per_grid=1.25)
    positions, delta = mrope_positions(7, [video], geometry)
    # (time 0, 2.5 -> 2, 5; one merged patch a frame pair; the text after from 5 + 1 on)
    assert positions.tolist() == [[0, 1, 2, 4, 7, 8, 9], [0, 1, 2, 2, 2, 8, 9], [0, 1, 2, 2, 2, 8, 9]]
    assert delta == 10 - 7


def test_a_videos_timing_must_keep_every_position_within_the_model(qwen, tmp_path):
    """A video's seconds per frame pair (its container's frame rate) set its time positions: one whose
    positions would run past the rotary table, or that is no number, is refused at admission (it
    would fail the pass it ran in); '{"video": 0}' refuses videos in the engine too. Without a video
    processor config the frames take the image processor's pixel range, as transformers reads it."""
    import shutil

    import msgspec

    from cluster.config import ClusterConfig, EngineSpec
    from engine_core.engine_core import EngineCore
    from gpu_worker.executor import create_executor

    model_dir, model, _ = qwen
    frames = [picture(20 + i, (60, 120)) for i in range(4)]
    ids, features, _ = video_prompt(qwen, frames, 1.0)
    engine = make_engine(model_dir)
    for timing, why in ((1e6, "past the model's 1024 positions"), (float("nan"), "must be a number"),
                        (-1.0, "must be a number")):
        if model.config.model_type != "qwen2_5_vl" and timing == 1e6:
            continue  # (Qwen2-VL's time positions are the pairs' indexes, whatever the timing)
        late = [features[0], msgspec.structs.replace(features[1], second_per_grid=timing)]
        with pytest.raises(RequestRefusedError, match=why):
            engine.add_request(EngineCoreRequest(request_id=f"t{timing}", prompt_token_ids=ids,
                                                 sampling_params=SamplingParams(), mm_features=late))
    config = ClusterConfig(model=str(model_dir), limit_mm_per_prompt={"video": 0},
                           defaults=EngineSpec(num_gpu_blocks=64)).engine_configs()[0]
    no_videos = EngineCore(config, create_executor(config))
    with pytest.raises(RequestRefusedError, match="takes no videos"):
        no_videos.add_request(EngineCoreRequest(request_id="v", prompt_token_ids=ids, sampling_params=SamplingParams(),
                                                mm_features=features))
    bare = tmp_path / "no-video-config"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("video_preprocessor_config.json"))
    geometry = ModelConfig.from_pretrained(bare).vision.geometry
    assert (geometry.video_min_pixels, geometry.video_max_pixels) == (geometry.min_pixels, geometry.max_pixels)


def test_images_and_videos_are_checked_against_their_own_placeholder_tokens():
    from engine_core.multimodal import check_features

    data = TensorData.from_array(np.zeros((1, 1), np.float32))
    video = MultiModalFeature("video", "v", 1, 2, data, (28, 28), 2, 1.0)
    image = MultiModalFeature("image", "i", 4, 2, data, (28, 28))
    check_features([video, image], [0, 7, 7, 0, 5, 5, 0], 5, None, 7)
    with pytest.raises(ValueError, match=r"image placeholders at 4\.\.6 are not all the model's placeholder token 5"):
        check_features([video, image], [0, 7, 7, 0, 7, 7, 0], 5, None, 7)
    with pytest.raises(ValueError, match=r"video placeholders at 1\.\.3 are not all the model's placeholder token 7"):
        check_features([video, image], [0, 5, 5, 0, 5, 5, 0], 5, None, 7)
    with pytest.raises(ValueError, match="a model that takes videos"):
        check_features([video], [0, 7, 7], 5)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3-VL (its video pixel range: 4096..24576 pixels for all of a video's frames together)."""
    return _built("qwen3_vl", tmp_path_factory.mktemp("qwen3_vl_videos"))


def qwen3_video_prompt(qwen3, frames: list, indices: list[int], fps: float, with_image: bool = True):
    """An image (unless not ``with_image``) and then a video, text around them, the video as the router
    makes it (its temporal patches, each after its time as text, each a feature): token ids,
    features, and transformers' keyword inputs (the video whole: one grid of all its temporal patches)."""
    from msgspec.structs import replace
    from transformers import AutoTokenizer

    from router.multimodal import MultiModalProcessor, timed_video_tokens
    from router.video import DecodedVideo, process_video

    model_dir, model, processor = qwen3
    config = model.config
    geometry = ModelConfig.from_pretrained(model_dir).vision.geometry
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids, features, (pixels, grids) = prompt(qwen3, [[74, 75], [223, 263]], [picture(0)] if with_image else [])
    size = (frames[0].height, frames[0].width)
    video = process_video(DecodedVideo(frames, indices[-1] + 1, fps, size, tuple(indices)), geometry,
                          processor.image_mean, processor.image_std, str(model_dir))
    media = MultiModalProcessor(config.image_token_id, geometry, processor, str(model_dir), "",
                                video_token_id=config.video_token_id,
                                timed_videos=timed_video_tokens(tokenizer, config.video_token_id, geometry))
    wrapped = [config.vision_start_token_id, config.video_token_id, config.vision_end_token_id, 90, 91]
    video_ids, _, offsets = media.expand_media(wrapped, [], [video])
    features += [replace(f, offset=f.offset + len(ids)) for f in media.features([], video_ids, [], [video], offsets)]
    ids += video_ids
    kinds = torch.tensor([ids])
    token_types = (kinds == config.image_token_id).int() + 2 * (kinds == config.video_token_id).int()
    height, width = video.frame_size
    grid = [len(video.timestamps), height // 16, width // 16]
    patches = video.pixel_values.to_tensor()
    kwargs = {"pixel_values": pixels, "image_grid_thw": grids, "pixel_values_videos": patches,
              "video_grid_thw": torch.tensor([grid]), "mm_token_type_ids": token_types}
    return ids, features, {k: v for k, v in kwargs.items() if v is not None}


def test_a_qwen3_vl_video_equals_transformers_whole_and_in_chunks(qwen3):
    """Qwen3-VL's video: 5 frames (the last repeated into the third pair) resized together to 32x96,
    each temporal patch a feature of 3 tokens after its time ("<0.4 seconds>"...): the engine encodes
    the pairs one by one where transformers encodes the video at once (attention within each pair
    there too), and their M-RoPE positions are an image's each. Whole, in 2-token chunks across the
    pairs and their times, and from the encoder cache."""
    model_dir, model, _ = qwen3
    frames = [picture(30 + i, (60, 120)) for i in range(5)]
    ids, features, kwargs = qwen3_video_prompt(qwen3, frames, [0, 3, 6, 9, 12], 4.0)
    videos = [f for f in features if f.modality == "video"]
    assert [(f.length, f.num_frames, f.image_size) for f in videos] == [(3, 2, (32, 96))] * 3
    assert len({f.identifier for f in videos}) == 3
    want = hf_logprobs_and_tokens(model, ids, **kwargs)
    assert_equal(run(make_engine(model_dir), {"a": (ids, features)})["a"], want)
    engine = make_engine(model_dir, max_num_batched_tokens=2)
    assert_equal(run(engine, {"a": (ids, features)})["a"], want)
    assert engine.stats().num_images_encoded == 4
    cached: dict[str, int] = {}
    assert run(engine, {"again": (ids, features)}, cached)["again"][1] == want[1]
    # (The same frames at other times: other text between the pairs, another answer.)
    later_ids, later, later_kwargs = qwen3_video_prompt(qwen3, frames, [0, 30, 60, 90, 120], 4.0)
    assert [f.identifier for f in later] == [f.identifier for f in features] and later_ids != ids
    assert_equal(run(make_engine(model_dir), {"b": (later_ids, later)})["b"],
                 hf_logprobs_and_tokens(model, later_ids, **later_kwargs))


def test_the_engine_takes_qwen3_vl_videos_only_as_their_temporal_patches(qwen3):
    """A Qwen3-VL video feature is one temporal patch, its frames' resized size given: more frames, or a
    size no resize makes, is refused at admission."""
    from msgspec.structs import replace

    model_dir = qwen3[0]
    frames = [picture(30 + i, (60, 120)) for i in range(4)]
    ids, features, _ = qwen3_video_prompt(qwen3, frames, [0, 1, 2, 3], 4.0)
    engine = make_engine(model_dir)
    video = next(i for i, f in enumerate(features) if f.modality == "video")
    for bad, why in ((replace(features[video], num_frames=4), "temporal patches, each of at most 2 frames"),
                     (replace(features[video], image_size=(40, 96)), "whole multiples of 32 pixels")):
        with pytest.raises(RequestRefusedError, match=why):
            engine.add_request(EngineCoreRequest(request_id=why, prompt_token_ids=ids, sampling_params=SamplingParams(),
                                                 mm_features=[*features[:video], bad, *features[video + 1:]]))
