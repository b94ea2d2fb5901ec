"""LLaVA (images in prompts): our engine's greedy tokens equal transformers' LlavaForConditionalGeneration
on tiny random checkpoints, through chunked prefill across an image, two images in a prompt, the
prefix cache and the encoder cache; the config and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from cluster.config import ClusterConfig, EngineSpec
from engine_core.engine_core import EngineCore, RequestRefusedError
from engine_core.multimodal import MultiModalFeature, TensorData, feature_identifier
from engine_core.outputs import EngineCoreRequest
from engine_core.sampling_params import SamplingParams
from engine_core.sched.output import SchedulerOutput
from gpu_worker.config import ModelConfig
from gpu_worker.executor import create_executor
from gpu_worker.vision_config import vision_config_from_dict
from tests.tiny_model import build_tiny_llama, build_tiny_llava, build_tiny_llava_next

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def hf(llava_dir):
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    return (LlavaForConditionalGeneration.from_pretrained(llava_dir).eval(),
            AutoImageProcessor.from_pretrained(llava_dir))


def picture(seed: int, size: tuple[int, int] = (40, 50)):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(*size, 3) * 255).astype("uint8"))


def prompt(hf, text_ids: list[list[int]], images: list) -> tuple[list[int], list[MultiModalFeature], torch.Tensor]:
    """Text pieces with an image between each two: token ids (placeholders expanded), features and
    the processor's pixel values."""
    model, processor = hf
    pixels = processor(images=images, return_tensors="pt")["pixel_values"] if images else None
    token = model.config.image_token_id
    n = 16 if model.config.vision_feature_select_strategy == "default" else 17
    ids: list[int] = []
    features = []
    for i, piece in enumerate(text_ids):
        ids += piece
        if i < len(images):
            data = TensorData.from_array(pixels[i])
            features.append(MultiModalFeature("image", feature_identifier("image", data), len(ids), n, data))
            ids += [token] * n
    return ids, features, pixels


def reference(hf, ids: list[int], pixels: torch.Tensor | None) -> list[int]:
    model, _ = hf
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=MAX_TOKENS,
                             do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def make_engine(model_dir: Path, **spec) -> EngineCore:
    config = ClusterConfig(model=str(model_dir), defaults=EngineSpec(num_gpu_blocks=256, **spec)).engine_configs()[0]
    return EngineCore(config, create_executor(config))


def run(engine: EngineCore, requests: dict[str, tuple[list[int], list[MultiModalFeature]]],
        cached: dict[str, int] | None = None) -> dict[str, list[int]]:
    """Greedy tokens per request (and, into ``cached``, the prompt tokens each found in the prefix cache)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for req_id, (ids, features) in requests.items():
        engine.add_request(EngineCoreRequest(request_id=req_id, prompt_token_ids=ids, sampling_params=params,
                                             mm_features=features))
    got: dict[str, list[int]] = {r: [] for r in requests}
    while engine.has_work():
        for eco in engine.step().values():
            for out in eco.outputs:
                got[out.request_id] += out.new_token_ids
                if cached is not None and out.num_cached_tokens:
                    cached[out.request_id] = out.num_cached_tokens
    return got


def test_one_image_equals_transformers_whole_and_in_chunks_across_the_image(llava_dir, hf):
    ids, features, pixels = prompt(hf, [[74, 75, 223], [263, 84, 71]], [picture(0)])
    want = reference(hf, ids, pixels)
    assert run(make_engine(llava_dir), {"a": (ids, features)}) == {"a": want}
    # 5-token passes: the image's 16 placeholders run over four chunks (its rows encoded once).
    engine = make_engine(llava_dir, max_num_batched_tokens=5)
    assert engine.scheduler.max_num_encoder_input_tokens == 16
    assert run(engine, {"a": (ids, features)}) == {"a": want}


def test_two_images_in_a_prompt_and_two_prompts_at_once(llava_dir, hf):
    two, two_features, two_pixels = prompt(hf, [[74], [223, 263], [84, 71]], [picture(1), picture(2, (64, 32))])
    one, one_features, one_pixels = prompt(hf, [[75, 75], [90]], [picture(3)])
    want = {"two": reference(hf, two, two_pixels), "one": reference(hf, one, one_pixels)}
    assert run(make_engine(llava_dir, max_num_batched_tokens=24), {"two": (two, two_features),
                                                                   "one": (one, one_features)}) == want


def test_same_tokens_other_image_misses_the_prefix_cache_and_the_same_image_hits_it(llava_dir, hf):
    engine = make_engine(llava_dir, block_size=4)
    ids, features, pixels = prompt(hf, [[74, 75, 223, 263, 84, 71], [90, 91]], [picture(4)])
    other_ids, other_features, other_pixels = prompt(hf, [[74, 75, 223, 263, 84, 71], [90, 91]], [picture(5)])
    assert ids == other_ids and features[0].identifier != other_features[0].identifier
    assert run(engine, {"first": (ids, features)}) == {"first": reference(hf, ids, pixels)}
    # Equal token ids, another image: it must not run on the first image's KV (only the block
    # before the image is shared).
    cached: dict[str, int] = {}
    want_other = reference(hf, other_ids, other_pixels)
    assert run(engine, {"other": (other_ids, other_features)}, cached) == {"other": want_other}
    assert cached == {"other": 4}
    # The same image again: its blocks are found (and its answer is the first one's).
    assert run(engine, {"again": (ids, features)}, cached) == {"again": reference(hf, ids, pixels)}
    assert len(ids) == 24 and cached["again"] == 20  # (the block of its last token is computed)
    # Two images encoded; the third prompt's prefix hit ends inside its image (at 20 of 6..21): the
    # rest of the image's rows came from the encoder cache.
    assert (engine.stats().num_images_encoded, engine.stats().num_images_found_encoded) == (2, 1)


def test_full_strategy_and_the_last_layer(tmp_path):
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    model_dir = build_tiny_llava(tmp_path, seed=3, select_strategy="full", feature_layer=-1)
    hf = (LlavaForConditionalGeneration.from_pretrained(model_dir).eval(),
          AutoImageProcessor.from_pretrained(model_dir))
    config = ModelConfig.from_pretrained(model_dir)
    assert config.vision.tokens_per_image == 17 and config.vision.num_layers_used == 3
    ids, features, pixels = prompt(hf, [[74, 75], [263]], [picture(6)])
    assert run(make_engine(model_dir), {"a": (ids, features)}) == {"a": reference(hf, ids, pixels)}


def test_the_engine_refuses_images_it_cannot_take(llava_dir, tmp_path, hf):
    ids, features, _ = prompt(hf, [[74], [75]], [picture(7)])
    engine = make_engine(llava_dir)
    params = SamplingParams(max_tokens=2)
    wrong_length = [MultiModalFeature("image", "x", 1, 4, features[0].pixel_values)]
    with pytest.raises(RequestRefusedError, match="this image as 16 tokens"):
        engine.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=ids, sampling_params=params,
                                             mm_features=wrong_length))
    shifted = [MultiModalFeature("image", "x", 0, 16, features[0].pixel_values)]
    with pytest.raises(RequestRefusedError, match="not all the model's placeholder"):
        engine.add_request(EngineCoreRequest(request_id="b", prompt_token_ids=ids, sampling_params=params,
                                             mm_features=shifted))
    misshapen = [MultiModalFeature("image", "x", 1, 16, TensorData.from_array(torch.zeros(3, 16, 16)))]
    with pytest.raises(RequestRefusedError, match=r"as \[3, 32, 32\]"):
        engine.add_request(EngineCoreRequest(request_id="d", prompt_token_ids=ids, sampling_params=params,
                                             mm_features=misshapen))
    empty = SchedulerOutput.make_empty()
    empty.free_encoder_mm_hashes = ["x"]
    assert EngineCore._has_worker_work(empty)  # (an eviction alone still reaches the workers)
    text_engine = make_engine(build_tiny_llama(tmp_path / "text"))
    with pytest.raises(RequestRefusedError, match="takes no images"):
        text_engine.add_request(EngineCoreRequest(request_id="c", prompt_token_ids=ids, sampling_params=params,
                                                  mm_features=features))


def test_vision_config_reads_transformers_names_and_refuses_what_it_does_not_run(llava_dir):
    cfg = json.loads((llava_dir / "config.json").read_text())
    vision = vision_config_from_dict(cfg)
    assert (vision.image_token_id, vision.num_patches, vision.tokens_per_image) == (cfg["image_token_index"], 16, 16)
    assert vision.num_layers_used == 2  # (-2 of 3 layers: the hidden states after the second)
    mistral = ModelConfig.from_dict({**cfg, "text_config": {**cfg["text_config"], "model_type": "mistral"}})
    assert mistral.architecture == "MistralForCausalLM" and mistral.vision is not None
    for bad, match in (({"vision_feature_layer": [-2, -1]}, "one layer"),
                       ({"vision_feature_select_strategy": "pad"}, "'default' or 'full'"),
                       ({"vision_config": {**cfg["vision_config"], "model_type": "siglip_vision_model"}}, "CLIP"),
                       ({"text_config": {**cfg["text_config"], "model_type": "phi3"}}, "language model")):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_dict({**cfg, **bad})


def test_a_published_llava_config_that_lists_only_what_differs_is_completed_by_transformers_defaults():
    """llava-hf/llava-1.5-7b-hf's config.json: its text_config names five keys (the rest are
    LlamaConfig's defaults), its vision_config the CLIP ViT-L/14-336 tower's."""
    cfg = {"architectures": ["LlavaForConditionalGeneration"], "image_token_index": 32000, "model_type": "llava",
           "pad_token_id": 32001, "projector_hidden_act": "gelu", "tie_word_embeddings": False,
           "torch_dtype": "float16", "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
           "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
                           "model_type": "llama", "rms_norm_eps": 1e-05, "torch_dtype": "float16",
                           "vocab_size": 32064},
           "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                             "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                             "patch_size": 14, "projection_dim": 768, "vocab_size": 32000}}
    config = ModelConfig.from_dict(cfg)
    assert (config.architecture, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.vocab_size, config.max_position_embeddings) \
        == ("LlamaForCausalLM", 4096, 32, 32, 32, 11008, 32064, 4096)
    assert config.rms_norm_eps == 1e-5 and config.rope_theta == 10000.0 and config.dtype == torch.float16
    vision = config.vision
    assert (vision.tokens_per_image, vision.num_layers_used, vision.image_token_id, vision.hidden_act) == (
        576, 23, 32000, "quick_gelu")


def test_a_reset_and_sleep_drop_the_encoded_images_everywhere(llava_dir, hf):
    """A prefix-cache reset evicts the images nobody holds and the workers drop their rows with the
    next pass; sleep forgets them on both sides; an image asked again after either is encoded
    again, and the answers stay transformers'."""
    engine = make_engine(llava_dir, enable_sleep_mode=True)
    runner = engine.executor.worker.runner
    ids, features, pixels = prompt(hf, [[74, 75], [263]], [picture(8)])
    other_ids, other_features, other_pixels = prompt(hf, [[90], [91]], [picture(9)])
    want, want_other = reference(hf, ids, pixels), reference(hf, other_ids, other_pixels)
    assert run(engine, {"a": (ids, features)}) == {"a": want}
    assert set(runner.encoder_cache) == {features[0].identifier}
    assert engine.reset_prefix_cache()
    assert run(engine, {"b": (other_ids, other_features)}) == {"b": want_other}
    assert set(runner.encoder_cache) == {other_features[0].identifier}  # (a's rows dropped with b's first pass)
    assert engine.reset_prefix_cache()
    engine.sleep(1)
    assert runner.encoder_cache == {} and engine.scheduler.encoder_cache_manager.cached == {}
    engine.wake_up()
    assert run(engine, {"c": (other_ids, other_features)}) == {"c": want_other}
    assert set(runner.encoder_cache) == {other_features[0].identifier}


def test_a_lora_adapter_on_the_language_model_answers_as_peft_does_with_images(llava_dir, hf, tmp_path):
    """PEFT names a LLaVA adapter's modules as the checkpoint's model has them
    (model.language_model.layers...); the engine applies them to its decoder, images and all."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlavaForConditionalGeneration

    from engine_core.outputs import LoRARequest

    base = LlavaForConditionalGeneration.from_pretrained(llava_dir).eval()
    torch.manual_seed(3)
    adapted = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, lora_dropout=0.0,
                                              target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)"))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.2)
    adapted.eval().save_pretrained(tmp_path / "adapter")
    ids, features, pixels = prompt(hf, [[74, 75], [263, 84]], [picture(10)])
    with torch.no_grad():
        out = adapted.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=MAX_TOKENS,
                               do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    want = out[0, len(ids):].tolist()
    assert want != reference(hf, ids, pixels)  # (the adapter changes the answer)
    config = ClusterConfig(model=str(llava_dir), enable_lora=True, max_lora_rank=8,
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
    assert got == want


# -- LLaVA-NeXT ("anyres": tiles by the image's size) ---------------------------------------------

SIZES = ((40, 50), (20, 90), (64, 64), (90, 20), (33, 100), (7, 7))


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory) -> Path:
    return build_tiny_llava_next(tmp_path_factory.mktemp("llava-next"))


def test_the_geometry_counts_tiles_and_tokens_as_transformers_does(next_dir):
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    geometry = ModelConfig.from_pretrained(next_dir).vision.geometry
    pinpoints = [list(p) for p in geometry.grid_pinpoints]
    processor = LlavaNextProcessorFor(next_dir)
    for height in range(5, 130, 7):
        for width in range(5, 130, 11):
            assert geometry.num_tiles(height, width) == image_size_to_num_patches((height, width), pinpoints, 32)
            # (LlavaNextProcessor counts an image's placeholders so; with the "default" strategy one less)
            assert geometry.num_tokens(height, width) == processor._get_number_of_features(height, width, 32, 32) - 1
    # (the most: a 64x64 image, 2x2 tiles of 4x4 features, 8 rows ended by a newline, the whole image's 16)
    assert geometry.max_tokens == max(geometry.num_tokens(h, w) for h, w in geometry.grid_pinpoints) == 16 + 8 * 8 + 8


def test_a_llava_next_config_without_pinpoints_takes_transformers_default(next_dir):
    cfg = json.loads((next_dir / "config.json").read_text())
    del cfg["image_grid_pinpoints"]
    cfg["vision_config"] = {**cfg["vision_config"], "image_size": 336, "patch_size": 14}
    geometry = ModelConfig.from_dict(cfg).vision.geometry
    assert geometry.grid_pinpoints == ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
    assert geometry.max_tokens == 2928  # (llava-v1.6's most: 672x672, 2x2 tiles)


def LlavaNextProcessorFor(model_dir: Path):  # (transformers' processor, built from the dir's parts)
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaNextProcessor

    return LlavaNextProcessor(image_processor=AutoImageProcessor.from_pretrained(model_dir),
                              tokenizer=AutoTokenizer.from_pretrained(model_dir), patch_size=8,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1)


def test_llava_next_equals_transformers_at_every_shape_whole_and_in_chunks(next_dir):
    from transformers import AutoImageProcessor, LlavaNextForConditionalGeneration

    model = LlavaNextForConditionalGeneration.from_pretrained(next_dir).eval()
    processor = AutoImageProcessor.from_pretrained(next_dir)
    geometry = ModelConfig.from_pretrained(next_dir).vision.geometry
    token = model.config.image_token_id
    requests, want = {}, {}
    for k, size in enumerate(SIZES):
        out = processor(images=[picture(20 + k, size)], return_tensors="pt")
        n = geometry.num_tokens(*size)
        ids = [74 + k, 75] + [token] * n + [263, 84]
        with torch.no_grad():
            generated = model.generate(input_ids=torch.tensor([ids]), pixel_values=out["pixel_values"],
                                       image_sizes=out["image_sizes"], max_new_tokens=MAX_TOKENS, do_sample=False,
                                       attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        want[f"r{k}"] = generated[0, len(ids):].tolist()
        data = TensorData.from_array(out["pixel_values"][0])
        assert data.shape == geometry.input_shape(*size)
        requests[f"r{k}"] = (ids, [MultiModalFeature("image", feature_identifier("image", data, str(size)), 2, n,
                                                     data, image_size=size)])
    assert len({tuple(w) for w in want.values()}) > 2  # (the images and their sizes matter to the answers)
    assert run(make_engine(next_dir), requests) == want
    engine = make_engine(next_dir, max_num_batched_tokens=8)  # (images split over passes, several per pass)
    assert engine.scheduler.max_num_encoder_input_tokens == geometry.max_tokens
    assert run(engine, requests) == want
    # An image's count and its tiles are checked against its size.
    ids, [feature] = requests["r0"]
    wrong = msgspec.structs.replace(feature, image_size=(64, 64))
    with pytest.raises(RequestRefusedError, match="this image as 88 tokens"):
        engine.add_request(EngineCoreRequest(request_id="x", prompt_token_ids=ids, sampling_params=SamplingParams(),
                                             mm_features=[wrong]))


def test_n_gram_drafts_over_a_prompt_with_an_image_keep_the_answer(llava_dir, hf):
    """Speculative decoding (n-gram drafts; the placeholders are ids like any other to the drafter):
    the tokens are the ones without drafts, and drafts were verified."""
    ids, features, pixels = prompt(hf, [[74, 75, 74, 75], [74, 75]], [picture(12)])
    engine = make_engine(llava_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                        "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    assert run(engine, {"a": (ids, features)}) == {"a": reference(hf, ids, pixels)}
    assert engine.stats().spec_decode_num_drafts > 0
