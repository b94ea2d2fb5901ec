"""Idefics3's (SmolVLM's) images: each cut into tiles as transformers' processor cuts them (its grid
by the image's size alone, for the prompt before an image is decoded), the prompt transformers'
processor writes (each tile's row and column, the whole image last), each tile a feature of its own
reaching the engine; /tokenize; the offline LLM against transformers' answer."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from router.image_tiles import tile_grid
from router.multimodal import load_image_processor

from .test_multimodal import _app, _chat, _data_url, _image, _part, served


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    """A tiny Idefics3 (images resized to 128 pixels on their longest side, 64-pixel tiles)."""
    from tests.tiny_model import build_tiny_idefics3

    return served(build_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3")))


def _processor(idefics3):
    from transformers import Idefics3Processor

    _, tokenizer, image_processor, vision = idefics3
    return Idefics3Processor(image_processor, tokenizer, image_seq_len=vision.tokens_per_tile)


@pytest.mark.parametrize(("longest_edge", "tile"), [(128, 64), (2048, 512), (1456, 364)])
def test_the_grid_by_size_is_the_processors(longest_edge, tile):
    """SmolVLM's (2048 / 512), Idefics3-8B's (1456 / 364) and the tiny model's settings, over random
    sizes: the (rows, columns) transformers' processor cuts, and its count of tiles."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    processor = Idefics3ImageProcessorPil(size={"longest_edge": longest_edge}, max_image_size={"longest_edge": tile})
    rng = np.random.default_rng(longest_edge)
    for _ in range(40):
        height, width = int(rng.integers(1, 1500)), int(rng.integers(1, 1500))
        if max(height, width) > 200 * min(height, width):
            continue
        out = processor(images=[Image.new("RGB", (width, height))], return_row_col_info=True, return_tensors="np")
        grid = tile_grid(height, width, longest_edge, tile)
        assert grid == (out["rows"][0][0], out["cols"][0][0]), (height, width)
        assert out["pixel_values"].shape[1] == (grid[0] * grid[1] + 1 if grid != (0, 0) else 1)
    assert tile_grid(300, 200, longest_edge, tile, split=False) == (0, 0)


def test_a_chat_image_reaches_the_engine_as_its_tiles_in_the_processors_prompt(idefics3):
    """The prompt equals the one transformers' processor makes from the rendered chat (the tiles'
    rows and columns, each run of 4 image tokens, the whole image last); each tile a feature over its
    run with the processor's pixels; two images in prompt order; /tokenize counts the same."""
    import torch

    http, engine, _ = _app(idefics3)
    _, tokenizer, _, vision = idefics3
    first, second = _image(1, (100, 60)), _image(2, (200, 20))  # (2x2 tiles and the whole; 1x2 and the whole)
    content = [_part(_data_url(first)), {"type": "text", "text": "and"}, _part(_data_url(second)),
               {"type": "text", "text": "which?"}]
    r = _chat(http, content)
    assert r.status_code == 200, r.text
    [request] = engine.requests
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                         {"type": "text", "text": "which?"}]}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    want = _processor(idefics3)(text=[text], images=[[first, second]], return_tensors="pt")
    assert request.prompt_token_ids == want["input_ids"][0].tolist()
    features = request.mm_features
    assert [f.length for f in features] == [4] * 8 and all(f.image_size is None for f in features)
    tiles = want["pixel_values"][0]
    for feature, tile in zip(features, tiles, strict=True):
        got = torch.from_numpy(np.frombuffer(feature.pixel_values.data, np.float32).reshape(feature.pixel_values.shape))
        torch.testing.assert_close(got, tile)
        assert request.prompt_token_ids[feature.offset - 1] != vision.image_token_id
    assert len({f.identifier for f in features}) == 8
    tokens = http.post("/tokenize", json={"model": "llava", "messages": [{"role": "user", "content": content}]})
    assert tokens.json()["tokens"] == request.prompt_token_ids


def test_the_offline_llm_answers_as_transformers_with_tiled_images(idefics3):
    import torch
    from transformers import Idefics3ForConditionalGeneration

    from cluster import LLM, SamplingParams

    model_dir, tokenizer, _, _ = idefics3
    image = _image(5, (90, 70))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                         {"type": "text", "text": "What is it?"}]}]
    with LLM(model=str(model_dir), num_gpu_blocks=64, max_model_len=512) as llm:
        [out] = llm.chat(chat, params, use_tqdm=False)
        [given] = llm.generate({"prompt": "User:<image>What is it?", "multi_modal_data": {"image": image}}, params,
                               use_tqdm=False)
    model = Idefics3ForConditionalGeneration.from_pretrained(model_dir).eval()
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is it?"}]}], add_generation_prompt=True, tokenize=False)
    for result, text in ((out, rendered), (given, "User:<image>What is it?")):
        ids = torch.tensor([result.prompt_token_ids])
        inputs = _processor(idefics3)(text=[text], images=[[image]], return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == result.prompt_token_ids
        with torch.no_grad():
            want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                  do_sample=False, pixel_values=inputs["pixel_values"],
                                  pixel_attention_mask=inputs["pixel_attention_mask"])[0, ids.shape[1]:].tolist()
        assert result.outputs[0].token_ids == want


def test_mm_processor_kwargs_size_sets_the_side_images_are_resized_to(idefics3):
    """vLLM's --mm-processor-kwargs '{"size": {"longest_edge": N}}' for Idefics3: images resized to N
    on their longest side before their tiles are cut (here one tile: the whole image alone), as its
    processor with that size; other keys are refused."""
    from msgspec.structs import replace

    from gpu_worker.config import ModelConfig

    directory, tokenizer, _, vision = idefics3
    configured = ModelConfig.from_pretrained(directory, mm_processor_kwargs={"size": {"longest_edge": 64}}).vision
    assert configured.geometry == replace(vision.geometry, tile_resize=64)
    image = _image(1, (100, 60))
    http, engine, _ = _app((directory, tokenizer, load_image_processor(directory), configured))
    assert _chat(http, [_part(_data_url(image)), {"type": "text", "text": "what?"}]).status_code == 200
    [request] = engine.requests
    assert len(request.mm_features) == 1
    from transformers import Idefics3Processor

    processor = Idefics3Processor(load_image_processor(directory), tokenizer, image_seq_len=4)
    processor.image_processor.size = {"longest_edge": 64}
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert request.prompt_token_ids == processor(text=[text], images=[[image]])["input_ids"][0]
    for kwargs in ({"max_image_size": {"longest_edge": 32}}, {"size": {"shortest_edge": 32}},
                   {"size": {"longest_edge": 0}}):
        with pytest.raises(ValueError, match=r"only size \{'longest_edge': N\}"):
            ModelConfig.from_pretrained(directory, mm_processor_kwargs=kwargs)
