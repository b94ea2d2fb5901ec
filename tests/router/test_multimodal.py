"""Images in chat prompts, the router's side (router.multimodal), through the real FastAPI app and
OpenAIServing over a scripted engine: a tiny LLaVA's own tokenizer, chat template and CLIP image
processor, real PNG images. What reaches the engine (the expanded prompt and its MultiModalFeatures)
and what is refused (400s), as vLLM's OpenAI server does."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from starlette.testclient import TestClient

from engine_core.multimodal import TensorData, feature_identifier
from engine_core.outputs import EngineCoreRequest
from router.app import create_app
from router.engine_client import EngineClient
from router.metrics import RouterMetrics
from router.multimodal import MediaConnector, expand_image_tokens, load_image_processor
from router.routing import RoundRobinPolicy
from router.serving import OpenAIServing, ServingSettings

from .test_request_fields import CHAT_TOKENIZER, ScriptedEngine, _events
from .test_request_fields import _app as _text_app

TOKENS_PER_IMAGE = 16  # (the tiny LLaVA's 32x32 image in 8x8 patches)


def served(directory):
    """What the router's tests serve of a model directory: it, its tokenizer, its image processor and
    its vision facts (as its engines state them)."""
    from transformers import AutoTokenizer

    from gpu_worker.config import ModelConfig

    vision = ModelConfig.from_pretrained(directory).vision
    return directory, AutoTokenizer.from_pretrained(directory), load_image_processor(directory), vision


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """The tiny LLaVA's directory, tokenizer, image processor and vision facts (as its engines state them)."""
    from tests.tiny_model import build_tiny_llava

    model = served(build_tiny_llava(tmp_path_factory.mktemp("tiny-llava")))
    assert model[3] is not None and model[3].tokens_per_image == TOKENS_PER_IMAGE
    return model


def _app(llava, max_model_len: int = 512, processor=True, policy=None, **settings) -> tuple[
        TestClient, ScriptedEngine, OpenAIServing]:
    _, tokenizer, image_processor, vision = llava
    answer = tokenizer.encode(" a cat", add_special_tokens=False)
    client = EngineClient([object()], client_index=1)
    engine = client._slots[0].channel = ScriptedEngine(client, lambda _: answer)
    settings = {"image_token_id": vision.image_token_id, "image_geometry": vision.geometry, **settings}
    serving = OpenAIServing(ServingSettings(served_model_name="llava", max_model_len=max_model_len, **settings),
                            client, tokenizer, policy or RoundRobinPolicy(),
                            image_processor=image_processor if processor else None)
    return TestClient(create_app(serving)), engine, serving


def _image(seed: int = 0, size: tuple[int, int] = (48, 40), mode: str = "RGB") -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(pixels, mode)


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(image)).decode()


def _part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _chat(http: TestClient, content, **body):
    return http.post("/v1/chat/completions", json={"model": "llava", "messages": [{"role": "user", "content": content}],
                                                   "max_tokens": 3, **body})


def _expected_pixels(llava, image: Image.Image) -> np.ndarray:
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(llava[0])(images=[image.convert("RGB")],
                                                        return_tensors="np")["pixel_values"][0]


def _error(r) -> str:
    assert r.status_code == 400, r.text
    return r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_an_image_reaches_every_choice_as_its_placeholders_and_the_processors_pixels(llava, stream):
    http, engine, _ = _app(llava)
    _, tokenizer, _, vision = llava
    image = _image()
    r = _chat(http, [{"type": "text", "text": "What is this?"}, _part(_data_url(image))], n=2, temperature=1.0,
              stream=stream, stream_options={"include_usage": True} if stream else None)
    assert r.status_code == 200, r.text
    # The template got OpenAI's parts ({"type": "image"} where the image was): one image token,
    # expanded to the image's placeholders.
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image"}]}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    at = ids.index(vision.image_token_id)
    expected = ids[:at] + [vision.image_token_id] * TOKENS_PER_IMAGE + ids[at + 1:]
    assert len(engine.requests) == 2
    for request in engine.requests:
        assert request.prompt_token_ids == expected
        [feature] = request.mm_features
        assert (feature.modality, feature.offset, feature.length) == ("image", at, TOKENS_PER_IMAGE)
        pixels = feature.pixel_values.to_tensor().numpy()
        np.testing.assert_array_equal(pixels, _expected_pixels(llava, image))
        # (the digest of its pixels, the model and its size: LLaVA-NeXT packs an image's rows by its size)
        assert feature.identifier == feature_identifier("image", TensorData.from_array(pixels),
                                                        extra=f"llava|{(image.height, image.width)}")
    usage = _events(r.text)[-1]["usage"] if stream else r.json()["usage"]
    assert usage["prompt_tokens"] == len(expected)  # (the placeholders count)


def test_images_of_several_messages_come_in_order_and_equal_images_share_their_digest(llava):
    http, engine, _ = _app(llava)
    vision = llava[3]
    a, b = _data_url(_image(1)), _data_url(_image(2))
    r = http.post("/v1/chat/completions", json={"model": "llava", "max_tokens": 2, "messages": [
        {"role": "user", "content": [_part(a), {"type": "text", "text": "and"}, _part(b)]},
        {"role": "assistant", "content": "two images"},
        {"role": "user", "content": [{"type": "text", "text": "again"}, _part(a)]}]})
    assert r.status_code == 200, r.text
    [request] = engine.requests
    features = request.mm_features
    assert [f.offset for f in features] == [i for i, t in enumerate(request.prompt_token_ids)
                                            if t == vision.image_token_id][::TOKENS_PER_IMAGE]
    assert features[0].identifier == features[2].identifier != features[1].identifier


def test_a_transparent_image_is_taken_over_white_and_rgb(llava):
    from router.multimodal import decode_image

    rgba = _image(3, mode="RGBA")
    decoded = decode_image(_png(rgba))
    assert decoded.mode == "RGB" and decoded.size == rgba.size
    alpha = np.asarray(rgba)[..., 3:] / 255.0
    expected = np.asarray(rgba)[..., :3] * alpha + 255 * (1 - alpha)
    assert np.abs(np.asarray(decoded).astype(float) - expected).max() <= 1


def test_the_image_is_decoded_and_processed_off_the_event_loop(llava):
    http, _, serving = _app(llava)
    threads = []
    processor = serving.images.image_processor

    def recording(*args, **kwargs):
        threads.append(threading.current_thread())
        return processor(*args, **kwargs)

    serving.images.image_processor = recording
    loop_threads = []
    serving.images.media = _RecordingMedia(loop_threads)
    assert _chat(http, [_part(_data_url(_image()))]).status_code == 200
    assert threads and loop_threads and threads[0] is not loop_threads[0]


class _RecordingMedia(MediaConnector):
    """Notes the thread its fetch runs in (the event loop's)."""

    def __init__(self, threads: list) -> None:
        super().__init__()
        object.__setattr__(self, "threads", threads)

    async def fetch_bytes(self, url: str) -> bytes:
        self.threads.append(threading.current_thread())
        return await super().fetch_bytes(url)


class _ImageServer:
    """A local HTTP server: /cat.png is a PNG, /slow.png answers after 2 s, /big.png is large, others 404."""

    def __init__(self, png: bytes) -> None:
        served = {"/cat.png": png, "/big.png": png + b"\0" * 4096}
        self.hits: list[str] = []
        hits = self.hits

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                hits.append(self.path)
                if self.path == "/slow.png":
                    import time
                    time.sleep(2)
                if self.path == "/moved.png":  # (a redirect to the PNG)
                    self.send_response(302)
                    self.send_header("Location", "/cat.png")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = served.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def handle(self):
                with contextlib.suppress(ConnectionError):  # (a client that read enough and left)
                    super().handle()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_an_http_image_is_fetched_within_its_timeout_and_size(llava):
    image = _image(4)
    server = _ImageServer(_png(image))
    try:
        http, engine, serving = _app(llava)
        assert _chat(http, [_part(f"{server.url}/cat.png")]).status_code == 200
        np.testing.assert_array_equal(engine.requests[0].mm_features[0].pixel_values.to_tensor().numpy(),
                                      _expected_pixels(llava, image))
        assert "HTTP 404" in _error(_chat(http, [_part(f"{server.url}/dog.png")]))
        serving.images.media = MediaConnector(fetch_timeout_s=0.3)
        assert "no answer within 0.3 s" in _error(_chat(http, [_part(f"{server.url}/slow.png")]))
        serving.images.media = MediaConnector(max_bytes=len(_png(image)) + 100)
        assert "more than the" in _error(_chat(http, [_part(f"{server.url}/big.png")]))
        assert len(engine.requests) == 1  # (nothing refused reached the engine)
        # A redirect is followed; with --allowed-media-domains only those hosts are fetched, without redirects.
        serving.images.media = MediaConnector()
        assert _chat(http, [_part(f"{server.url}/moved.png")]).status_code == 200
        serving.images.media = MediaConnector(allowed_media_domains=("images.example.com",))
        hits = len(server.hits)
        assert "'127.0.0.1' is not one of the --allowed-media-domains" in _error(
            _chat(http, [_part(f"{server.url}/cat.png")]))
        assert len(server.hits) == hits  # (not even asked)
        serving.images.media = MediaConnector(allowed_media_domains=("127.0.0.1",))
        assert _chat(http, [_part(f"{server.url}/cat.png")]).status_code == 200
        assert "HTTP 302 (a redirect is not followed" in _error(_chat(http, [_part(f"{server.url}/moved.png")]))
    finally:
        server.close()


def test_file_urls_are_read_only_under_the_allowed_local_media_path(llava, tmp_path):
    image = _image(5)
    media = tmp_path / "media"
    media.mkdir()
    (media / "cat one.png").write_bytes(_png(image))
    (tmp_path / "secret.png").write_bytes(_png(image))
    url = (media / "cat one.png").as_uri()
    http, engine, _ = _app(llava)
    assert "without `--allowed-local-media-path`" in _error(_chat(http, [_part(url)]))
    http, engine, _ = _app(llava, allowed_local_media_path=str(media))
    assert _chat(http, [_part(url)]).status_code == 200
    np.testing.assert_array_equal(engine.requests[0].mm_features[0].pixel_values.to_tensor().numpy(),
                                  _expected_pixels(llava, image))
    for outside in ((tmp_path / "secret.png").as_uri(), f"file://{media}/../secret.png"):
        assert "must be a subpath of `--allowed-local-media-path`" in _error(_chat(http, [_part(outside)]))
    assert "cannot read image file" in _error(_chat(http, [_part((media / "none.png").as_uri())]))
    assert len(engine.requests) == 1


@pytest.mark.parametrize(("url", "message"), [
    ("data:image/png;base64,aGVsbG8=", "cannot decode the image"),
    ("data:image/png,rawbytes", "only base64 data URLs"),
    ("data:image/png;base64,!!!", "cannot decode the image"),
    ("ftp://example.com/cat.png", "give a data:image/...;base64 URL"),
    ("cat.png", "give a data:image/...;base64 URL"),
    # (97 bytes that a CLIP processor would blow up to gigabytes: refused before it runs)
    (_data_url(Image.new("RGB", (4000, 1))), "too narrow"),
])
def test_an_image_that_cannot_be_read_is_a_400(llava, url, message):
    http, engine, _ = _app(llava)
    r = _chat(http, [_part(url)])
    assert message in _error(r) and r.json()["error"]["param"] == "messages"
    assert not engine.requests


def test_the_image_count_must_match_the_image_tokens_the_template_writes(llava):
    http, engine, _ = _app(llava)
    # A text holding the image token, beside an image: two tokens for one image.
    message = _error(_chat(http, [{"type": "text", "text": "look: <image>"}, _part(_data_url(_image()))]))
    assert "2 image token(s) '<image>' for 1 image(s)" in message
    # A template that writes no image: none for one.
    http, engine, _ = _app(llava, trust_request_chat_template=True)
    r = _chat(http, [{"type": "text", "text": "hi"}, _part(_data_url(_image()))],
              chat_template="{% for m in messages %}{{ m['role'] }}{% endfor %}")
    assert "0 image token(s) '<image>' for 1 image(s)" in _error(r)
    assert not engine.requests


def test_a_template_given_text_gets_the_placeholders_before_the_text_as_vllm_writes_them(llava):
    http, engine, _ = _app(llava, chat_template_content_format="string", trust_request_chat_template=True)
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    r = _chat(http, [{"type": "text", "text": "what"}, _part(_data_url(_image())), _part(_data_url(_image(1)))],
              chat_template=template)
    assert r.status_code == 200, r.text
    tokenizer, vision = llava[1], llava[3]
    ids = engine.requests[0].prompt_token_ids
    assert ids.count(vision.image_token_id) == 2 * TOKENS_PER_IMAGE
    text = tokenizer.decode([t for t in ids if t != vision.image_token_id])
    assert text == "[\n\nwhat]"  # ("<image>\n<image>\nwhat", the image tokens taken out)
    # A text that holds the placeholder already keeps it where it is (vLLM's rule).
    r = _chat(http, [{"type": "text", "text": "<image> what"}, _part(_data_url(_image()))], chat_template=template)
    assert r.status_code == 200, r.text
    assert tokenizer.decode(engine.requests[1].prompt_token_ids[1 + TOKENS_PER_IMAGE:]) == " what]"


def test_more_images_than_the_limit_are_refused_before_any_is_fetched(llava):
    server = _ImageServer(_png(_image()))
    try:
        http, engine, _ = _app(llava, limit_mm_per_prompt={"image": 1})
        r = _chat(http, [_part(f"{server.url}/cat.png"), _part(f"{server.url}/cat.png")])
        assert "At most 1 image(s) may be provided in one prompt" in _error(r)
        assert not server.hits and not engine.requests
        assert _chat(http, [_part(f"{server.url}/cat.png")]).status_code == 200
    finally:
        server.close()
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        ServingSettings(served_model_name="x", max_model_len=8, limit_mm_per_prompt={"images": 1})


def test_the_placeholders_count_against_the_context_length(llava):
    tokenizer = llava[1]
    content = [{"type": "text", "text": "What is this?"}]
    text_only = len(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False), add_special_tokens=False))
    # The prompt with its one image token fits; with the image's placeholders it does not (the
    # image is not fetched).
    server = _ImageServer(_png(_image()))
    try:
        http, engine, _ = _app(llava, max_model_len=text_only + 8)
        message = _error(_chat(http, [*content, _part(f"{server.url}/cat.png")], max_tokens=None))
        assert f"the prompt has {text_only + 1 + TOKENS_PER_IMAGE}" in message
        assert not engine.requests and not server.hits
    finally:
        server.close()


def test_a_text_model_refuses_images_naming_itself():
    http, engine = _text_app(tokenizer=CHAT_TOKENIZER)
    body = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                       _part("data:image/png;base64,AAAA")]}]}
    for path in ("/v1/chat/completions", "/tokenize"):
        r = http.post(path, json=body)
        assert "model 'tiny' does not take images" in _error(r) and r.json()["error"]["param"] == "messages"
    r = http.post("/v1/responses", json={"model": "tiny", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]})
    assert "does not take images" in _error(r) and r.json()["error"]["param"] == "input"
    assert not engine.requests


@pytest.mark.parametrize(("part", "why"), [
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "'input_audio' is not supported"),
    ({"type": "video_url", "video_url": {"url": "http://x/v.mp4"}}, "does not take videos"),  # (LLaVA's)
    ({"type": "video_url", "video_url": "http://x/v.mp4"}, "a video_url part must be"),
    ({"type": "image_embeds", "image_embeds": "AAAA"}, "'image_embeds' is not supported"),
    ({"type": "image_url", "image_url": "http://x/y.png"}, "an image_url part must be")])
def test_other_media_parts_are_refused_naming_their_type(llava, part, why):
    http, engine, _ = _app(llava)
    assert why in _error(_chat(http, [{"type": "text", "text": "hi"}, part]))
    assert not engine.requests


@pytest.mark.parametrize(("field", "value"), [("use_beam_search", True), ("truncate_prompt_tokens", 20)])
def test_images_with_beam_search_or_prompt_truncation_are_refused(llava, field, value):
    http, engine, _ = _app(llava)
    r = _chat(http, [_part(_data_url(_image()))], **{field: value})
    assert f"{field} is not supported with images" in _error(r) and r.json()["error"]["param"] == field
    assert not engine.requests


def test_a_model_without_an_image_processor_refuses_images(llava):
    http, engine, _ = _app(llava, processor=False)
    assert "has no image processor (preprocessor_config.json)" in _error(_chat(http, [_part(_data_url(_image()))]))
    assert not engine.requests
    assert _chat(http, "just text").status_code == 200 and not engine.requests[0].mm_features


def test_tokenize_expands_the_image_tokens_as_chat_sends_them(llava):
    http, engine, _ = _app(llava)
    messages = [{"role": "user", "content": [_part(_data_url(_image())), {"type": "text", "text": "hi"}]}]
    r = http.post("/tokenize", json={"model": "llava", "messages": messages})
    assert r.status_code == 200, r.text
    assert _chat(http, messages[0]["content"]).status_code == 200
    assert r.json()["tokens"] == engine.requests[0].prompt_token_ids


def test_the_responses_api_takes_input_image_parts(llava):
    http, engine, _ = _app(llava)
    image = _image(6)
    r = http.post("/v1/responses", json={"model": "llava", "max_output_tokens": 3, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                     {"type": "input_image", "image_url": _data_url(image)}]}]})
    assert r.status_code == 200, r.text
    [feature] = engine.requests[0].mm_features
    np.testing.assert_array_equal(feature.pixel_values.to_tensor().numpy(), _expected_pixels(llava, image))
    r = http.post("/v1/responses", json={"model": "llava", "input": [
        {"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]})
    assert "file_id is not supported" in _error(r)


def test_anthropics_messages_take_image_blocks(llava):
    http, engine, _ = _app(llava)
    image = _image(7)
    data = base64.b64encode(_png(image)).decode()
    r = http.post("/v1/messages", json={"model": "llava", "max_tokens": 3, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                     {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": data}}]}]})
    assert r.status_code == 200, r.text
    [feature] = engine.requests[0].mm_features
    np.testing.assert_array_equal(feature.pixel_values.to_tensor().numpy(), _expected_pixels(llava, image))
    # (the image after the text, as sent: its placeholders come after the text's tokens)
    assert feature.offset > engine.requests[0].prompt_token_ids.index(llava[1].encode("What")[0])
    # count_tokens counts each image as its placeholders, as the request sends them (and limits them).
    counted = http.post("/v1/messages/count_tokens", json={"model": "llava", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                     {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": data}}]}]})
    assert counted.json() == {"input_tokens": len(engine.requests[0].prompt_token_ids)}
    # (With no image allowed, the engines serve the language model alone and state no image token.)
    _, _, limited = _app(llava, limit_mm_per_prompt={"image": 0}, image_token_id=None, image_geometry=None)
    over = TestClient(create_app(limited)).post("/v1/messages/count_tokens", json={"model": "llava", "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": data}}]}]})
    assert over.status_code == 400 and "At most 0 image" in over.text and "--limit-mm-per-prompt" in over.text
    r = http.post("/v1/messages", json={"model": "llava", "max_tokens": 3, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "text/plain",
                                                                  "data": data}}]}]})
    assert r.status_code == 400 and "image type" in r.text


def test_expand_image_tokens_gives_each_image_its_run_of_placeholders():
    ids, offsets = expand_image_tokens([1, 9, 2, 3, 9, 4], image_token_id=9, runs=[[9] * 3] * 2)
    assert ids == [1, 9, 9, 9, 2, 3, 9, 9, 9, 4] and offsets == [1, 6]
    with pytest.raises(ValueError, match="1 image token"):
        expand_image_tokens([1, 9, 2], 9, [[9] * 3] * 2)
    ids, offsets = expand_image_tokens([9, 2, 9], image_token_id=9, runs=[[9, 9], [9, 7, 9, 8]])
    assert ids == [9, 9, 2, 9, 7, 9, 8] and offsets == [0, 3]


def test_the_engines_send_the_image_processor_and_state_the_vision_facts(llava, tmp_path):
    from engine_core.engine_actor import EngineDescription
    from engine_core.executor import ModelInfo
    from engine_core.tokenizer_files import read_tokenizer_files, write_tokenizer_files
    from router.deployment import RouterConfig, serving_settings

    directory, tokenizer, _, vision = llava
    own = read_tokenizer_files(str(directory))
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    other = read_tokenizer_files(str(directory), str(tokenizer_dir))
    for files in (own, other):  # (the model's image processor, whichever tokenizer)
        assert files["preprocessor_config.json"] == (Path(directory) / "preprocessor_config.json").read_bytes()
    write_tokenizer_files(tmp_path / "copy", own)
    assert load_image_processor(tmp_path / "copy").to_dict() == llava[2].to_dict()
    assert load_image_processor(tmp_path) is None
    info = ModelInfo(served_model_name="llava", model_dir=str(directory), max_model_len=64, vocab_size=400,
                     image_token_id=vision.image_token_id, image_geometry=vision.geometry)
    description = EngineDescription(model_info=info, scheduler_config={"max_model_len": 64, "policy": "fcfs"},
                                    block_size=16, num_blocks=8, engine_index=0)
    settings = serving_settings(RouterConfig(engine_actor_names=["e0"], namespace="ns",
                                             limit_mm_per_prompt={"image": 3}, allowed_local_media_path="/media"),
                                [description])
    assert (settings.image_token_id, settings.image_geometry) == (vision.image_token_id, vision.geometry)
    assert settings.image_geometry.num_tokens(100, 7) == TOKENS_PER_IMAGE
    assert (settings.limit_mm_per_prompt, settings.allowed_local_media_path) == ({"image": 3}, "/media")


def test_the_engine_request_with_images_crosses_the_channel(llava):
    """(ScriptedEngine encodes every message as the real channel does; the features decode whole.)"""
    import msgspec

    http, engine, _ = _app(llava)
    assert _chat(http, [_part(_data_url(_image()))]).status_code == 200
    request = engine.requests[0]
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert again.mm_features == request.mm_features
    assert json.loads(json.dumps(again.prompt_token_ids)) == request.prompt_token_ids


def test_pooling_requests_refuse_images(llava):
    from engine_core.executor import PoolingInfo

    http, engine, _ = _app(llava, pooling=PoolingInfo(generates=False))
    r = http.post("/v1/embeddings", json={"model": "llava", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, _part(_data_url(_image()))]}]})
    assert "images are taken by chat completions, the Responses API and /tokenize only" in _error(r)
    assert not engine.requests


def test_template_content_puts_images_where_vllm_puts_them():
    from router.content_format import template_content

    content = [{"type": "text", "text": "a"}, _part("x"), {"type": "text", "text": "b"}, _part("y")]
    assert template_content(content, "openai", "<image>") == [
        {"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}, {"type": "image"}]
    assert template_content(content, "string", "<image>") == "<image>\n<image>\na\nb"
    assert template_content([_part("x")], "string", "<image>") == "<image>\n"  # (vLLM's join)
    assert template_content([{"type": "text", "text": "<image> a"}, _part("x"), _part("y")], "string",
                            "<image>") == "<image>\n<image> a"  # (one of the two is in the text already)
    assert template_content(content, "string") == "a\nb"  # (no placeholder: the text alone, as echoed)


def test_the_routing_policy_sees_the_images_that_key_the_prompts_blocks(llava):
    seen = []

    class Recording(RoundRobinPolicy):
        def choose(self, ctx):
            seen.append(ctx.mm_features)
            return super().choose(ctx)

    http, engine, _ = _app(llava, policy=Recording())
    assert _chat(http, [_part(_data_url(_image()))]).status_code == 200
    assert _chat(http, "text").status_code == 200
    assert seen == [engine.requests[0].mm_features, None] and seen[0]


def test_an_image_sent_again_is_not_processed_again_and_the_cache_is_counted(llava):
    """vLLM's processor cache (--mm-processor-cache-gb): the second turn of a conversation resends
    its image; the replica finds it processed, and counts the lookups and hits in its metrics."""
    _, _, image_processor, _ = llava
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return image_processor(*args, **kwargs)

    metrics = RouterMetrics("llava", "r0")
    http, engine, serving = _app(llava, mm_processor_cache_gb=1.0)
    serving.images.image_processor = counting
    serving.images.cache.on_lookup = metrics.record_mm_cache_lookup
    a, b = _data_url(_image(1)), _data_url(_image(2))
    first = [{"role": "user", "content": [_part(a), {"type": "text", "text": "what is it?"}]}]
    second = [*first, {"role": "assistant", "content": "a cat"},
              {"role": "user", "content": [_part(b), {"type": "text", "text": "and this?"}]}]
    for conversation in (first, second):
        r = http.post("/v1/chat/completions", json={"model": "llava", "messages": conversation, "max_tokens": 2})
        assert r.status_code == 200, r.text
    assert len(calls) == 2  # (a once, b once)
    assert engine.requests[0].mm_features[0] == engine.requests[1].mm_features[0]
    assert (serving.images.cache.queries, serving.images.cache.hits) == (3, 1)
    text = metrics.render().decode()
    assert 'vllm:mm_cache_queries_total{model_name="llava",replica="r0"} 3.0' in text
    assert 'vllm:mm_cache_hits_total{model_name="llava",replica="r0"} 1.0' in text
    # --mm-processor-cache-gb 0: nothing kept.
    _, _, uncached = _app(llava, mm_processor_cache_gb=0.0)
    assert uncached.images.cache is None


def test_the_processed_image_cache_evicts_the_least_recently_used_past_its_bytes():
    from router.multimodal import ProcessedImage, ProcessedImageCache

    def processed(n: int) -> ProcessedImage:
        return ProcessedImage(str(n), TensorData("float32", (n,), b"\0" * 4 * n), (1, 1), 1)

    cache = ProcessedImageCache(capacity_bytes=40)
    cache.put(b"a", processed(4))
    cache.put(b"b", processed(4))
    assert cache.get(b"a") is not None  # (a is now the most recently used)
    cache.put(b"c", processed(4))  # 48 bytes > 40: b goes
    assert cache.get(b"b") is None and cache.get(b"a") is not None and cache.get(b"c") is not None
    assert cache.size_bytes == 32
    cache.put(b"huge", processed(11))  # (larger than the whole cache: not kept, nothing evicted)
    assert cache.get(b"huge") is None and cache.size_bytes == 32
    assert (cache.queries, cache.hits) == (5, 3)


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory):
    """A tiny LLaVA-NeXT: an image's placeholders (and tiles) depend on its size."""
    from tests.tiny_model import build_tiny_llava_next

    return served(build_tiny_llava_next(tmp_path_factory.mktemp("tiny-llava-next")))


def test_an_image_counted_by_its_size_gets_its_own_placeholders_and_tiles(llava_next):
    http, engine, _ = _app(llava_next)
    vision = llava_next[3]
    geometry = vision.geometry
    wide, square = _image(8, (90, 20)), _image(9, (64, 64))  # ((width, height): 20 high, 90 wide)
    r = _chat(http, [_part(_data_url(wide)), {"type": "text", "text": "and"}, _part(_data_url(square))])
    assert r.status_code == 200, r.text
    [request] = engine.requests
    first, second = request.mm_features
    assert (first.length, second.length) == (geometry.num_tokens(20, 90), geometry.num_tokens(64, 64)) == (42, 88)
    assert (first.image_size, second.image_size) == ((20, 90), (64, 64))
    assert first.pixel_values.shape == (4, 3, 32, 32) and second.pixel_values.shape == (5, 3, 32, 32)
    assert request.prompt_token_ids.count(vision.image_token_id) == 42 + 88
    assert r.json()["usage"]["prompt_tokens"] == len(request.prompt_token_ids)
    # /tokenize counts as chat sends (loading the images: their sizes set their counts).
    tokens = http.post("/tokenize", json={"model": "llava", "messages": [
        {"role": "user", "content": [_part(_data_url(wide)), {"type": "text", "text": "and"},
                                     _part(_data_url(square))]}]}).json()["tokens"]
    assert len(tokens) == len(request.prompt_token_ids)
    # The context must hold the placeholders the sizes give: known only once the images are loaded.
    http_short, short_engine, _ = _app(llava_next, max_model_len=60)
    message = _error(_chat(http_short, [_part(_data_url(square))]))
    assert "maximum context length is 60" in message and not short_engine.requests


def test_the_models_pinpoints_tile_the_image_whatever_the_processor_config_lists(llava_next, tmp_path, caplog):
    """A processor config listing other pinpoints (or the same in another order) would tile other
    grids than the model unpacks, without an error: the model's are used, with a warning; a
    processor whose tiles are not the tower's size makes each image a 400."""
    import logging
    import shutil

    directory, _, _, vision = llava_next
    other = tmp_path / "other"
    shutil.copytree(directory, other)
    config_path = other / "preprocessor_config.json"
    processor_config = json.loads(config_path.read_text())
    processor_config["image_grid_pinpoints"] = list(reversed(processor_config["image_grid_pinpoints"])) + [[96, 96]]
    config_path.write_text(json.dumps(processor_config))
    with caplog.at_level(logging.WARNING, logger="router.multimodal"):
        http, engine, serving = _app((other, llava_next[1], load_image_processor(other), vision))
    assert "image_grid_pinpoints differ" in caplog.text
    assert serving.images.image_processor.image_grid_pinpoints == [list(p) for p in vision.grid_pinpoints]
    square = _image(10, (90, 90))  # (the extra 96x96 pinpoint would make it 10 tiles)
    assert _chat(http, [_part(_data_url(square))]).status_code == 200
    assert engine.requests[0].mm_features[0].pixel_values.shape == vision.geometry.input_shape(90, 90)
    processor_config["crop_size"] = {"height": 16, "width": 16}
    config_path.write_text(json.dumps(processor_config))
    http, engine, _ = _app((other, llava_next[1], load_image_processor(other), vision))
    assert "does not match its config.json" in _error(_chat(http, [_part(_data_url(square))]))
    assert not engine.requests


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    """A tiny Qwen2-VL: an image is resized to its own grid of patches, 4 to a token."""
    from tests.tiny_model import build_tiny_qwen2_vl

    return served(build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl")))


def test_a_native_resolution_image_gets_its_grids_placeholders_and_the_processors_patches(qwen2_vl):
    http, engine, _ = _app(qwen2_vl)
    vision = qwen2_vl[3]
    wide, square = _image(10, (90, 20)), _image(11, (64, 64))  # ((width, height))
    r = _chat(http, [_part(_data_url(wide)), {"type": "text", "text": "and"}, _part(_data_url(square))])
    assert r.status_code == 200, r.text
    [request] = engine.requests
    first, second = request.mm_features
    # 20x90 -> 28x140 pixels (2x10 patches, 5 tokens); 64x64 -> 56x56 (4x4 patches, 4 tokens).
    assert (first.length, second.length) == (5, 4) and (first.image_size, second.image_size) == ((20, 90), (64, 64))
    want = _expected_qwen_patches(qwen2_vl, wide)
    assert first.pixel_values.shape == want.shape == (20, 1176)
    np.testing.assert_array_equal(np.frombuffer(first.pixel_values.data, np.float32).reshape(want.shape), want)
    ids = request.prompt_token_ids
    # Each image inside Qwen's vision tokens, as its template writes them.
    tokenizer = qwen2_vl[1]
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    assert ids[first.offset - 1] == start and ids[first.end] == end and ids[second.end] == end
    assert ids.count(vision.image_token_id) == 9
    tokens = http.post("/tokenize", json={"model": "llava", "messages": [
        {"role": "user", "content": [_part(_data_url(wide)), {"type": "text", "text": "and"},
                                     _part(_data_url(square))]}]}).json()["tokens"]
    assert tokens == ids


def _expected_qwen_patches(qwen2_vl, image: Image.Image) -> np.ndarray:
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(qwen2_vl[0])(images=[image.convert("RGB")],
                                                           return_tensors="np")["pixel_values"]


def test_a_template_given_text_gets_qwens_placeholder_with_its_vision_tokens(qwen2_vl):
    """vLLM's placeholder string for Qwen2-VL: the image token within the vision start and end tokens."""
    http, engine, _ = _app(qwen2_vl, chat_template_content_format="string", trust_request_chat_template=True)
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    r = _chat(http, [{"type": "text", "text": "what"}, _part(_data_url(_image()))], chat_template=template)
    assert r.status_code == 200, r.text
    tokenizer, vision = qwen2_vl[1], qwen2_vl[3]
    ids = engine.requests[0].prompt_token_ids
    text = tokenizer.decode([t for t in ids if t != vision.image_token_id])
    assert text == "[<|vision_start|><|vision_end|>\nwhat]"


def test_a_qwen3_vl_image_gets_its_16_pixel_patches_and_its_grids_placeholders(tmp_path):
    from transformers import AutoTokenizer

    from gpu_worker.config import ModelConfig
    from tests.tiny_model import build_tiny_qwen3_vl

    directory = build_tiny_qwen3_vl(tmp_path / "qwen3-vl")
    vision = ModelConfig.from_pretrained(directory).vision
    model = (directory, AutoTokenizer.from_pretrained(directory), load_image_processor(directory), vision)
    http, engine, _ = _app(model)
    image = _image(12, (90, 40))  # (90 wide, 40 high: 64x96 pixels once resized, 4x6 patches, 6 tokens)
    r = _chat(http, [_part(_data_url(image)), {"type": "text", "text": "what"}])
    assert r.status_code == 200, r.text
    [feature] = engine.requests[0].mm_features
    want = _expected_qwen_patches(model, image)
    assert feature.length == vision.geometry.num_tokens(40, 90) == 6 and want.shape == (24, 1536)
    np.testing.assert_array_equal(np.frombuffer(feature.pixel_values.data, np.float32).reshape(want.shape), want)
