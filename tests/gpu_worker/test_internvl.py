"""InternVL (InternVLForConditionalGeneration): our engine's prompt logprobs and greedy tokens equal
transformers' on a tiny random checkpoint, with images cut into different numbers of tiles (a
thumbnail beside more than one), whole and chunked across an image's tiles, beside a text request,
through the prefix cache; the geometry against transformers' image processor; the released config;
the router's prompt text."""

from __future__ import annotations

import pytest
import torch

from engine_core.multimodal import MultiModalFeature, TensorData, feature_identifier
from gpu_worker.config import ModelConfig
from tests.gpu_worker.test_llava import make_engine, picture
from tests.gpu_worker.test_qwen2_vl import assert_equal, hf_logprobs_and_tokens, run
from tests.tiny_model import build_tiny_internvl

TOKENS_PER_TILE = 4  # (56-pixel tiles of 14-pixel patches, 4x4 pixel-shuffled to 2x2)

# OpenGVLab/InternVL3-2B-hf's config.json (its vision side and the text config's shape), as released.
INTERNVL3_2B = {
    "architectures": ["InternVLForConditionalGeneration"], "downsample_ratio": 0.5, "image_seq_length": 256,
    "image_token_id": 151667, "model_type": "internvl", "projector_hidden_act": "gelu",
    "text_config": {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
                    "num_hidden_layers": 28, "num_key_value_heads": 2, "vocab_size": 151674, "rope_theta": 1000000.0,
                    "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "tie_word_embeddings": False},
    "vision_config": {"model_type": "internvl_vision", "hidden_size": 1024, "intermediate_size": 4096,
                      "num_attention_heads": 16, "num_hidden_layers": 24, "image_size": [448, 448],
                      "patch_size": [14, 14], "norm_type": "layer_norm", "layer_norm_eps": 1e-06,
                      "use_qk_norm": False, "attention_bias": True, "layer_scale_init_value": 0.1},
    "vision_feature_layer": -1, "vision_feature_select_strategy": "default"}


@pytest.fixture(scope="module")
def internvl(tmp_path_factory):
    """(model dir, transformers' model, its image processor as InternVLProcessor runs it: tiled)."""
    from transformers import AutoImageProcessor, InternVLForConditionalGeneration

    model_dir = build_tiny_internvl(tmp_path_factory.mktemp("internvl"))
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    processor.crop_to_patches = True
    return model_dir, InternVLForConditionalGeneration.from_pretrained(model_dir).eval(), processor


def _token(model_dir, text: str) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids(text)


def prompt(internvl, text_ids: list[list[int]], images: list):
    """Text pieces with an image between each two (<img>, its tiles' tokens, </img>, as
    InternVLProcessor writes them): token ids, features, and transformers' pixel values."""
    model_dir, model, processor = internvl
    begin, end = _token(model_dir, "<img>"), _token(model_dir, "</img>")
    ids: list[int] = [1]
    features, pixels = [], []
    for i, piece in enumerate(text_ids):
        ids += piece
        if i < len(images):
            tiles = torch.as_tensor(processor(images=[images[i]], return_tensors="pt")["pixel_values"])
            pixels.append(tiles)
            data = TensorData.from_array(tiles)
            count = TOKENS_PER_TILE * tiles.shape[0]
            ids.append(begin)
            features.append(MultiModalFeature("image", feature_identifier("image", data), len(ids), count, data,
                                              (images[i].height, images[i].width)))
            ids += [model.config.image_token_id] * count + [end]
    return ids, features, torch.cat(pixels) if pixels else None


def reference(internvl, ids: list[int], pixels) -> tuple[list[float], list[int]]:
    return hf_logprobs_and_tokens(internvl[1], ids, **({} if pixels is None else {"pixel_values": pixels}))


def test_images_of_several_tilings_equal_transformers_whole_and_in_chunks(internvl):
    model_dir = internvl[0]
    # 40x50: one tile; 60x150: a 2x1 grid... each image's tiles by its aspect (a thumbnail beside more than one).
    images = [picture(0), picture(1, (60, 150)), picture(2, (120, 40))]
    ids, features, pixels = prompt(internvl, [[74, 75], [223, 263, 84], [71], [90]], images)
    assert sorted(f.length for f in features) != [TOKENS_PER_TILE] * 3  # (the images' tilings differ)
    want = reference(internvl, ids, pixels)
    assert_equal(run(make_engine(model_dir), {"a": (ids, features)})["a"], want)
    # 5-token passes: an image's tiles' rows run over several chunks.
    assert_equal(run(make_engine(model_dir, max_num_batched_tokens=5), {"a": (ids, features)})["a"], want)


def test_an_image_prompt_beside_a_text_prompt_and_through_the_prefix_cache(internvl):
    model_dir = internvl[0]
    image_ids, image_features, pixels = prompt(internvl, [[90, 91, 94, 95], [92, 93, 97, 98, 99, 100]],
                                               [picture(3, (70, 150))])
    text_ids = [1, 5, 9, 11, 200, 31]
    want = {"image": reference(internvl, image_ids, pixels), "text": reference(internvl, text_ids, None)}
    engine = make_engine(model_dir, max_num_batched_tokens=32, block_size=8)
    got = run(engine, {"image": (image_ids, image_features), "text": (text_ids, [])})
    for req_id in want:
        assert_equal(got[req_id], want[req_id])
    cached: dict[str, int] = {}
    assert run(engine, {"first": (image_ids, image_features)}, cached)["first"][1] == want["image"][1]
    assert run(engine, {"again": (image_ids, image_features)}, cached)["again"][1] == want["image"][1]
    assert cached["again"] == 8 * ((len(image_ids) - 1) // 8) > image_features[0].offset


def test_the_geometry_is_the_processors(internvl):
    model_dir, _, processor = internvl
    geometry = ModelConfig.from_pretrained(model_dir).vision.geometry
    assert (geometry.min_tiles, geometry.max_tiles, geometry.base_tokens) == (1, 6, TOKENS_PER_TILE)
    for height, width in ((1, 1), (40, 50), (56, 56), (56, 112), (100, 30), (30, 300), (300, 30), (57, 110),
                          (200, 199), (10, 1000), (112, 56), (168, 112)):
        tiles = processor(images=[picture(0, (height, width))], return_tensors="np")["pixel_values"]
        assert geometry.input_shape(height, width) == tiles.shape
        assert geometry.num_tokens(height, width) == TOKENS_PER_TILE * tiles.shape[0] <= geometry.max_tokens
    assert geometry.max_tokens == geometry.num_tokens(*geometry.largest_image) == TOKENS_PER_TILE * 7
    assert geometry.min_tokens == TOKENS_PER_TILE


def test_the_router_writes_each_image_between_its_begin_and_end_tokens(internvl):
    from transformers import AutoTokenizer

    from router.multimodal import image_placeholder, image_prompt_text

    model_dir, model, _ = internvl
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    geometry = ModelConfig.from_pretrained(model_dir).vision.geometry
    token = model.config.image_token_id
    assert image_prompt_text(tokenizer, token, geometry) == ("<IMG_CONTEXT>", "<img><IMG_CONTEXT></img>")
    assert image_placeholder(tokenizer, token, geometry) == "<IMG_CONTEXT>"


def test_the_config_of_internvl3_2b_reads_its_vision_side():
    config = ModelConfig.from_dict(INTERNVL3_2B)
    vision = config.vision
    assert config.architecture == "Qwen2ForCausalLM" and config.hidden_size == 1536
    assert (vision.image_size, vision.patch_size, vision.tokens_per_tile, vision.num_layers_used) == (448, 14, 256, 24)
    assert vision.attention_bias and vision.norm_type == "layer_norm" and vision.image_token_id == 151667
    geometry = vision.geometry
    assert geometry.max_tokens == 256 * 13 and geometry.num_tokens(448, 448) == 256
    assert geometry.input_shape(448, 896) == (3, 3, 448, 448)  # (a 2x1 grid and its thumbnail)
    with pytest.raises(ValueError, match="language model must be one of"):
        ModelConfig.from_dict({**INTERNVL3_2B, "text_config": {**INTERNVL3_2B["text_config"],
                                                               "model_type": "internlm3"}})


def test_mm_processor_kwargs_set_the_tiling(internvl):
    """--mm-processor-kwargs '{"max_patches": 2}' (vLLM passes it to InternVL's processor): the engines
    count and the router tiles by it; other keys are refused."""
    from transformers import AutoImageProcessor

    from router.multimodal import MultiModalProcessor, load_image_processor

    model_dir = internvl[0]
    vision = ModelConfig.from_pretrained(model_dir, mm_processor_kwargs={"max_patches": 2}).vision
    assert (vision.min_tiles, vision.max_tiles, vision.geometry.max_tokens) == (1, 2, 3 * TOKENS_PER_TILE)
    images = MultiModalProcessor(vision.image_token_id, vision.geometry, load_image_processor(model_dir),
                                 str(model_dir), "<IMG_CONTEXT>")
    wide = picture(4, (40, 300))
    reference_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    want = reference_processor(images=[wide], crop_to_patches=True, max_patches=2, return_tensors="np")
    processed = images.process_image(wide)
    assert processed.pixel_values.shape == want["pixel_values"].shape == (3, 3, 56, 56)
    with pytest.raises(ValueError, match="only \\['min_patches', 'max_patches'\\]"):
        ModelConfig.from_pretrained(model_dir, mm_processor_kwargs={"max_pixels": 100})
