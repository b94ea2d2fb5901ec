"""Idefics3 (SmolVLM's architecture): our engine's prompt logprobs and greedy tokens equal
transformers' on a tiny random checkpoint, each tile of an image an encoder input of its own (the
prompt transformers' processor writes: each tile's row and column between them), whole and in chunks
across the tiles, beside text-only requests, through the prefix cache; the tower's position buckets
and the pixel shuffle; text-only mode."""

from __future__ import annotations

import pytest
import torch

from engine_core.multimodal import MultiModalFeature, TensorData, feature_identifier
from tests.gpu_worker.test_llava import make_engine, picture
from tests.gpu_worker.test_qwen2_vl import assert_equal, hf_logprobs_and_tokens, run
from tests.tiny_model import build_tiny_idefics3

PROMPT = "<|im_start|>User:<image>What is in it?<end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module", params=["idefics3", "smolvlm", "uneven"])
def idefics3(request, tmp_path_factory):
    """(model dir, transformers' model, its processor) of a tiny Idefics3 (SmolVLM v1's class), of
    SmolVLM2's class of the same model, and of one whose tile side is not whole patches (SmolVLM
    2.2B's 384 pixels in 14-pixel patches: here 60 in 14, 4 patches a side)."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Idefics3Processor

    from router.multimodal import load_image_processor

    shape = {"tile": 60, "patch": 14, "longest_edge": 120} if request.param == "uneven" else {}
    model_dir = build_tiny_idefics3(tmp_path_factory.mktemp(request.param), smolvlm=request.param == "smolvlm",
                                    **shape)
    processor = Idefics3Processor(load_image_processor(model_dir), AutoTokenizer.from_pretrained(model_dir),
                                  image_seq_len=4)
    return model_dir, AutoModelForImageTextToText.from_pretrained(model_dir).eval(), processor


def tile_prompt(idefics3, images: list, text: str = PROMPT):
    """transformers' processor's prompt for ``text`` with ``images``: token ids, each tile a feature
    over its run of <image> tokens, and transformers' inputs."""
    _, model, processor = idefics3
    out = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    token = model.config.image_token_id
    starts = [i for i, t in enumerate(ids) if t == token and (i == 0 or ids[i - 1] != token)]
    features = []
    if images:
        tiles = out["pixel_values"][0]
        assert len(starts) == len(tiles) and bool(out["pixel_attention_mask"].all())
        for start, tile in zip(starts, tiles, strict=True):
            assert ids[start:start + 4] == [token] * 4 and ids[start + 4] != token
            data = TensorData.from_array(tile)
            features.append(MultiModalFeature("image", feature_identifier("image", data), start, 4, data))
    inputs = {k: v for k, v in out.items() if k in ("pixel_values", "pixel_attention_mask")}
    return ids, features, inputs


def test_an_image_in_tiles_equals_transformers_whole_and_in_chunks(idefics3):
    """An image cut into 2x2 tiles and the whole image (5 encoder inputs of 4 tokens, each after its
    <fake_token_around_image><row_R_col_C>), then a wide one into 1x2 and the whole; in 3-token passes
    across the tiles too."""
    model_dir, model, _ = idefics3
    for image, tiles in ((picture(0, (60, 100)), 5), (picture(1, (20, 200)), 3)):
        ids, features, inputs = tile_prompt(idefics3, [image])
        assert len(features) == tiles
        want = hf_logprobs_and_tokens(model, ids, **inputs)
        assert_equal(run(make_engine(model_dir), {"a": (ids, features)})["a"], want)
        engine = make_engine(model_dir, max_num_batched_tokens=3)
        assert_equal(run(engine, {"a": (ids, features)})["a"], want)
        assert engine.stats().num_images_encoded == tiles


def test_two_images_beside_a_text_prompt_and_from_the_prefix_cache(idefics3):
    model_dir, model, _ = idefics3
    text = "<|im_start|>User:<image>and<image>which?<end_of_utterance>\nAssistant:"
    ids, features, inputs = tile_prompt(idefics3, [picture(2, (100, 60)), picture(3, (50, 50))], text)
    text_ids, _, _ = tile_prompt(idefics3, [], "<|im_start|>User: hello there<end_of_utterance>\nAssistant:")
    want = {"images": hf_logprobs_and_tokens(model, ids, **inputs), "text": hf_logprobs_and_tokens(model, text_ids)}
    engine = make_engine(model_dir, max_num_batched_tokens=16, block_size=4)
    got = run(engine, {"images": (ids, features), "text": (text_ids, [])})
    for name in want:
        assert_equal(got[name], want[name])
    cached: dict[str, int] = {}
    assert run(engine, {"again": (ids, features)}, cached)["again"][1] == want["images"][1]
    assert cached["again"] > len(ids) // 2


@pytest.mark.parametrize("side", [24, 25, 26, 29, 32])
def test_the_towers_positions_are_transformers_buckets(side):
    """A full tile's patch positions as transformers buckets them (float32 steps put some patches of
    25 and 29 a side in the bucket before their own), in float32 whatever the model's dtype."""
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

    from gpu_worker.model_runner import _default_dtype
    from gpu_worker.models.idefics3 import tile_position_ids

    embeddings = Idefics3VisionEmbeddings(Idefics3VisionConfig(image_size=side * 2, patch_size=2, hidden_size=8))
    seen = []
    embeddings.position_embedding.register_forward_hook(lambda _m, args, _out: seen.append(args[0]))
    embeddings(torch.zeros(1, 3, side * 2, side * 2), torch.ones(1, side, side, dtype=torch.bool))
    assert torch.equal(tile_position_ids(side), seen[0][0])
    assert (side in (25, 29)) == (not torch.equal(tile_position_ids(side), torch.arange(side * side)))
    for dtype in (torch.float16, torch.bfloat16):  # (as the model is built and run in it)
        with _default_dtype(dtype):
            assert torch.equal(tile_position_ids(side), seen[0][0])


def test_the_language_model_alone_when_images_are_refused(idefics3):
    from tests.gpu_worker.test_language_model_only import text_only_engine

    model_dir, model, _ = idefics3
    ids, _, _ = tile_prompt(idefics3, [], "<|im_start|>User: hello there<end_of_utterance>\nAssistant:")
    engine = text_only_engine(model_dir)
    names = [name for name, _ in engine.executor.worker.runner.model.named_parameters()]
    assert names and not any(name.startswith(("vision_model.", "connector.")) for name in names)
    assert_equal(run(engine, {"t": (ids, [])})["t"], hf_logprobs_and_tokens(model, ids))
