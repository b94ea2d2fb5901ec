"""Gemma 3 with images (Gemma3ForConditionalGeneration): our engine's prompt logprobs and greedy
tokens equal transformers' on a tiny random checkpoint, an image's tokens attending to each other
both ways (in windowed layers too), whole and in passes that keep each image whole, beside a text
request, through the prefix cache; the config, the refusals, and the prompt text the router makes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_core.engine_core import RequestRefusedError
from engine_core.multimodal import MultiModalFeature, TensorData, feature_identifier
from engine_core.outputs import EngineCoreRequest
from engine_core.sampling_params import SamplingParams
from gpu_worker.config import ModelConfig
from tests.gpu_worker.test_llava import make_engine, picture
from tests.gpu_worker.test_qwen2_vl import MAX_TOKENS, assert_equal, hf_logprobs_and_tokens, run
from tests.tiny_model import build_tiny_gemma3_vl

TOKENS = 16  # (an image's 8x8 patches pooled to 4x4)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration

    model_dir = build_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3-vl"))
    return model_dir, Gemma3ForConditionalGeneration.from_pretrained(model_dir).eval(), \
        AutoImageProcessor.from_pretrained(model_dir)


def prompt(gemma, text_ids: list[list[int]], images: list):
    """Text pieces with an image between each two (within its begin and end tokens): token ids,
    features, and transformers' pixel values."""
    _, model, processor = gemma
    config = model.config
    pixels = processor(images=images, return_tensors="pt")["pixel_values"] if images else None
    ids: list[int] = [2]
    features = []
    for i, piece in enumerate(text_ids):
        ids += piece
        if i < len(images):
            ids.append(config.boi_token_index)
            data = TensorData.from_array(pixels[i])
            features.append(MultiModalFeature("image", feature_identifier("image", data), len(ids), TOKENS, data))
            ids += [config.image_token_index] * TOKENS + [config.eoi_token_index]
    return ids, features, pixels


def reference(gemma, ids: list[int], pixels) -> tuple[list[float], list[int]]:
    """transformers' logprob of each prompt token after the first, and its greedy tokens (its image
    tokens marked as such: they attend to each other both ways)."""
    _, model, _ = gemma
    kwargs = {} if pixels is None else {
        "pixel_values": pixels, "token_type_ids": (torch.tensor([ids]) == model.config.image_token_index).long()}
    return hf_logprobs_and_tokens(model, ids, **kwargs)


def test_two_images_equal_transformers_whole_and_with_each_image_in_one_pass(gemma):
    model_dir, model, _ = gemma
    ids, features, pixels = prompt(gemma, [[74, 75], [263, 84], [71]], [picture(0), picture(1, (90, 60))])
    want = reference(gemma, ids, pixels)
    with torch.no_grad():  # (the images' tokens seeing each other both ways matters to the answer)
        tensor = torch.tensor([ids])
        causal = model(input_ids=tensor, attention_mask=torch.ones_like(tensor), pixel_values=pixels).logits[0]
    assert (torch.log_softmax(causal.float(), -1)[:-1].gather(1, tensor[0, 1:, None])[:, 0]
            - torch.tensor(want[0])).abs().max() > 0.05
    assert_equal(run(make_engine(model_dir), {"a": (ids, features)})["a"], want)
    # 18-token passes: a chunk stops before an image rather than end inside it (the images are at
    # 4..20 and 24..40: chunks of 4, 18 and 18 tokens, then the rest).
    engine = make_engine(model_dir, max_num_batched_tokens=18)
    assert engine.scheduler.whole_images
    assert_equal(run(engine, {"a": (ids, features)})["a"], want)


def test_an_image_prompt_beside_a_text_prompt(gemma):
    model_dir = gemma[0]
    image_ids, image_features, pixels = prompt(gemma, [[90], [92, 93]], [picture(2)])
    text_ids = [2, 5, 9, 11, 200, 31]
    want = {"image": reference(gemma, image_ids, pixels), "text": reference(gemma, text_ids, None)}
    got = run(make_engine(model_dir, max_num_batched_tokens=32), {"image": (image_ids, image_features),
                                                                  "text": (text_ids, [])})
    for req_id in want:
        assert_equal(got[req_id], want[req_id])


def test_a_prefix_hit_ending_inside_an_image_computes_the_rest_of_it_in_one_chunk(gemma):
    """The cached blocks of an image's first tokens were computed seeing the whole image (the same
    image: the same rows); the rest of it runs in one chunk, seeing each other and those."""
    model_dir = gemma[0]
    ids, features, _ = prompt(gemma, [[74, 75, 223], [263, 84, 71, 90]], [picture(3)])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    engine = make_engine(model_dir, block_size=16, max_num_batched_tokens=40)  # (a hit of 16: the image is 5..21)
    outs = {}
    for req_id in ("first", "again"):
        engine.add_request(EngineCoreRequest(request_id=req_id, prompt_token_ids=ids, sampling_params=params,
                                             mm_features=features))
        got, cached = [], 0
        while engine.has_work():
            for eco in engine.step().values():
                for o in eco.outputs:
                    got += o.new_logprobs.top_logprobs
                    cached = o.num_cached_tokens or cached
        outs[req_id] = (got, cached)
    assert outs["first"][1] == 0 and features[0].offset < outs["again"][1] < features[0].end
    for a, b in zip(outs["first"][0], outs["again"][0], strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        np.testing.assert_allclose([lp for _, lp in a], [lp for _, lp in b], atol=1e-5)


def test_an_image_no_pass_can_hold_whole_is_refused(gemma):
    model_dir = gemma[0]
    ids, features, _ = prompt(gemma, [[74], [75]], [picture(4)])
    for spec in ({"max_num_batched_tokens": 12}, {"long_prefill_token_threshold": 8}):
        engine = make_engine(model_dir, **spec)
        with pytest.raises(RequestRefusedError, match="image tokens attend to each other"):
            engine.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=ids,
                                                 sampling_params=SamplingParams(), mm_features=features))


def test_the_config_of_gemma3_4b_reads_its_vision_side():
    from tests.gpu_worker.test_models import GEMMA3_4B_IT

    config = ModelConfig.from_dict(GEMMA3_4B_IT)
    vision = config.vision
    assert config.architecture == "Gemma3ForCausalLM" and vision.text_hidden_size == 2560
    assert (vision.patches_side, vision.tokens_side, vision.tokens_per_image) == (64, 16, 256)
    assert (vision.image_token_id, vision.boi_token_id, vision.eoi_token_id) == (262144, 255999, 256000)
    geometry = vision.geometry
    assert geometry.bidirectional and geometry.num_tokens(10, 4000) == geometry.max_tokens == 256
    assert geometry.input_shape(10, 10) == (3, 896, 896)
    with pytest.raises(ValueError, match="pool evenly"):
        ModelConfig.from_dict({**GEMMA3_4B_IT, "mm_tokens_per_image": 200})


def test_the_router_writes_each_image_as_gemmas_processor_does(gemma):
    """Its template writes <start_of_image> per image; the processor makes it two newlines, the
    begin token, the image tokens, the end token, two newlines, before tokenizing (so newlines
    next to it merge as the tokenizer merges them)."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from router.app import create_app
    from router.engine_client import EngineClient
    from router.multimodal import load_image_processor
    from router.routing import RoundRobinPolicy
    from router.serving import OpenAIServing, ServingSettings
    from tests.router.test_multimodal import _data_url, _image, _part
    from tests.router.test_request_fields import ScriptedEngine

    model_dir = gemma[0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vision = ModelConfig.from_pretrained(model_dir).vision
    image_processor = load_image_processor(model_dir)
    image_processor.do_pan_and_scan = True  # (not served: turned off, each image taken whole)
    client = EngineClient([object()], client_index=1)
    answer = tokenizer.encode(" a", add_special_tokens=False)
    engine = client._slots[0].channel = ScriptedEngine(client, lambda _: answer)
    serving = OpenAIServing(ServingSettings(served_model_name="g", max_model_len=512,
                                            image_token_id=vision.image_token_id, image_geometry=vision.geometry),
                            client, tokenizer, RoundRobinPolicy(), image_processor=image_processor)
    assert image_processor.do_pan_and_scan is False
    http = TestClient(create_app(serving))
    r = http.post("/v1/chat/completions", json={"model": "g", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Look:\n"}, _part(_data_url(_image(5)))]}]})
    assert r.status_code == 200, r.text
    [request] = engine.requests
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "Look:\n"}, {"type": "image"}]}], add_generation_prompt=True, tokenize=False)
    text = rendered.replace("<start_of_image>", "\n\n<start_of_image>" + "<image_soft_token>" * TOKENS
                            + "<end_of_image>\n\n")
    assert request.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    [feature] = request.mm_features
    assert feature.length == TOKENS and tuple(feature.pixel_values.shape) == (3, 64, 64)
