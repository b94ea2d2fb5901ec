"""vLLM's text-only mode (--limit-mm-per-prompt '{"image": 0}'): a vision-language checkpoint's
language model served alone, its vision tower and projector neither built nor loaded; text prompts
answered as the whole model answers them (prompt logprobs and greedy tokens), for every family of
checkpoint we serve; images refused saying why."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from cluster.config import ClusterConfig, EngineSpec
from engine_core.engine_core import EngineCore, RequestRefusedError
from engine_core.multimodal import MultiModalFeature, TensorData, feature_identifier
from engine_core.outputs import EngineCoreRequest
from engine_core.sampling_params import SamplingParams
from gpu_worker.config import ModelConfig
from gpu_worker.executor import create_executor
from tests.gpu_worker.test_llava import make_engine
from tests.gpu_worker.test_qwen2_vl import run
from tests.tiny_model import (
    build_tiny_gemma3_vl,
    build_tiny_internvl,
    build_tiny_llava,
    build_tiny_llava_next,
    build_tiny_mistral3,
    build_tiny_qwen2_vl,
    build_tiny_qwen3_vl,
)

BUILDERS = {"llava": build_tiny_llava, "llava_next": build_tiny_llava_next,
            "qwen2_5_vl": lambda path: build_tiny_qwen2_vl(path, windowed=True),
            "qwen3_vl_moe": lambda path: build_tiny_qwen3_vl(path, moe=True),
            "gemma3": build_tiny_gemma3_vl, "mistral3": build_tiny_mistral3,
            "pixtral": lambda path: build_tiny_mistral3(path, llava=True), "internvl": build_tiny_internvl,
            "ministral3": lambda path: build_tiny_mistral3(path, ministral3=True)}
# (Past Ministral 3's tiny pretrained length of 16: its queries' scale shows.)
PROMPT = [2, 5, 9, 11, 200, 31, 7, 90, 91, 23, 44, 57, 61, 88, 102, 150, 17, 19, 33, 120]


def text_only_engine(model_dir, limit: dict | None = None, **spec) -> EngineCore:
    """(Videos refused too: Qwen2-VL keeps its tower for them otherwise.)"""
    config = ClusterConfig(model=str(model_dir), limit_mm_per_prompt=limit or {"image": 0, "video": 0},
                           defaults=EngineSpec(num_gpu_blocks=256, **spec)).engine_configs()[0]
    assert config.language_model_only
    return EngineCore(config, create_executor(config))


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_the_language_model_alone_answers_text_as_the_whole_model(family, tmp_path):
    model_dir = BUILDERS[family](tmp_path / family)
    engine = text_only_engine(model_dir)
    names = [name for name, _ in engine.executor.worker.runner.model.named_parameters()]
    assert names and not any(name.startswith(("vision_tower.", "multi_modal_projector.", "visual.", "image_newline"))
                             for name in names)
    assert engine.model_info.image_token_id is None and engine.model_info.image_geometry is None
    got = run(engine, {"t": (PROMPT, [])})["t"]
    want = run(make_engine(model_dir), {"t": (PROMPT, [])})["t"]
    assert got[1] == want[1]
    np.testing.assert_allclose(got[0], want[0], atol=1e-5)
    # An image (as the whole model would take it) is refused, saying why.
    vision = ModelConfig.from_pretrained(model_dir).vision
    data = TensorData.from_array(np.zeros(vision.geometry.input_shape(40, 50), np.float32))
    run_ids = vision.geometry.placeholder_ids(vision.image_token_id, 40, 50)
    image = MultiModalFeature("image", feature_identifier("image", data), 1, len(run_ids), data, (40, 50))
    with pytest.raises(RequestRefusedError, match=r"limit-mm-per-prompt .* allows none"):
        engine.add_request(EngineCoreRequest(request_id="i", prompt_token_ids=[2, *run_ids, 5],
                                             sampling_params=SamplingParams(), mm_features=[image]))


def test_qwen3_vl_moe_text_only_reads_the_released_stacked_experts_transposed(tmp_path):
    saved = build_tiny_qwen3_vl(tmp_path / "saved", moe=True)
    released = tmp_path / "released"
    shutil.copytree(saved, released)
    tensors = load_file(saved / "model.safetensors")
    experts = [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    save_file({name: t.transpose(1, 2).contiguous() if name in experts else t for name, t in tensors.items()},
              released / "model.safetensors", metadata={"format": "pt"})
    got = [run(text_only_engine(directory), {"t": (PROMPT, [])})["t"] for directory in (saved, released)]
    assert got[0][1] == got[1][1]
    np.testing.assert_allclose(got[0][0], got[1][0], atol=1e-6)


def test_the_engines_of_a_model_with_no_images_load_its_language_model_alone(tmp_path):
    model_dir = str(tmp_path)
    config = ClusterConfig(model=model_dir, limit_mm_per_prompt={"image": 0}, models=[
        {"model": model_dir, "served_model_name": "with-images", "limit_mm_per_prompt": {"image": 2}},
        {"model": model_dir, "served_model_name": "text-only", "limit_mm_per_prompt": {"image": 0}}])
    assert [c.language_model_only for c in config.engine_configs()] == [True, False, True]
    assert not ClusterConfig(model=model_dir).engine_configs()[0].language_model_only


def test_qwen2_5_vl_with_no_images_keeps_its_tower_for_videos(tmp_path):
    """vLLM's text-only mode needs every modality's limit at 0: with images alone refused, Qwen2.5-VL
    loads its tower for videos, which answer as the whole model's; images are refused."""
    import msgspec
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    from tests.gpu_worker.test_llava import picture
    from tests.gpu_worker.test_qwen2_vl import video_prompt

    model_dir = build_tiny_qwen2_vl(tmp_path / "qwen2.5-vl", windowed=True)
    qwen = (model_dir, Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).eval(),
            AutoImageProcessor.from_pretrained(model_dir))
    ids, features, _ = video_prompt(qwen, [picture(20 + i, (60, 120)) for i in range(4)], 1.0)
    image, video = features
    # (The video alone: the image's run and its vision tokens taken out.)
    video_ids = ids[:image.offset - 1] + ids[image.end + 1:]
    video = msgspec.structs.replace(video, offset=video.offset - image.length - 2)
    engine = text_only_engine(model_dir, {"image": 0})
    assert any(name.startswith("visual.") for name, _ in engine.executor.worker.runner.model.named_parameters())
    got = run(engine, {"v": (video_ids, [video])})["v"]
    want = run(make_engine(model_dir), {"v": (video_ids, [video])})["v"]
    assert got[1] == want[1]
    np.testing.assert_allclose(got[0], want[0], atol=1e-5)
    with pytest.raises(RequestRefusedError, match=r"takes no images: --limit-mm-per-prompt"):
        engine.add_request(EngineCoreRequest(request_id="i", prompt_token_ids=ids, sampling_params=SamplingParams(),
                                             mm_features=features))


def test_qwen3_vl_with_no_images_keeps_its_tower_for_videos(tmp_path):
    """The same for Qwen3-VL: its tower kept for videos (each temporal patch a feature), which answer
    as the whole model's; images refused."""
    from transformers import AutoImageProcessor, Qwen3VLForConditionalGeneration

    from tests.gpu_worker.test_llava import picture
    from tests.gpu_worker.test_qwen2_vl import qwen3_video_prompt

    model_dir = build_tiny_qwen3_vl(tmp_path / "qwen3-vl")
    qwen3 = (model_dir, Qwen3VLForConditionalGeneration.from_pretrained(model_dir).eval(),
             AutoImageProcessor.from_pretrained(model_dir))
    frames = [picture(20 + i, (60, 120)) for i in range(4)]
    ids, features, _ = qwen3_video_prompt(qwen3, frames, [0, 1, 2, 3], 2.0, with_image=False)
    engine = text_only_engine(model_dir, {"image": 0})
    assert any(name.startswith("visual.") for name, _ in engine.executor.worker.runner.model.named_parameters())
    got = run(engine, {"v": (ids, features)})["v"]
    want = run(make_engine(model_dir), {"v": (ids, features)})["v"]
    assert got[1] == want[1]
    np.testing.assert_allclose(got[0], want[0], atol=1e-5)
    image_ids, image_features, _ = qwen3_video_prompt(qwen3, frames, [0, 1, 2, 3], 2.0)
    with pytest.raises(RequestRefusedError, match=r"takes no images: --limit-mm-per-prompt"):
        engine.add_request(EngineCoreRequest(request_id="i", prompt_token_ids=image_ids,
                                             sampling_params=SamplingParams(), mm_features=image_features))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl_moe"])
def test_a_text_only_qwen_vl_takes_a_draft_model_its_images_do_not(family, tmp_path):
    """Text-only, a Qwen-VL model's M-RoPE positions are plain RoPE's: a draft model proposes for it
    (itself as the draft: every draft accepted, the answers plain decoding's). Taking images or videos,
    a draft model is refused (its positions would not follow the images')."""
    from cluster import LLM, SamplingParams

    model_dir = BUILDERS[family](tmp_path / family)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[5:]}]
    common = dict(model=str(model_dir), num_gpu_blocks=64, limit_mm_per_prompt={"image": 0, "video": 0})
    draft = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3}
    with LLM(**common) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(**common, speculative_config=draft) as llm:
        drafted = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.get_stats()[0]
    assert drafted == plain
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    with pytest.raises(ValueError, match=r"M-RoPE positions .* taking images or videos"):
        LLM(model=str(model_dir), num_gpu_blocks=64, speculative_config=draft)
