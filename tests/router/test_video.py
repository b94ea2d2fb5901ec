"""Videos in chat prompts (Qwen2-VL, Qwen2.5-VL): the frames sampled as transformers samples them,
their patches in the processor's layout, the request the engine gets (a video's placeholders
within Qwen's vision tokens beside an image's, its frames, its timing), /tokenize, and refusals."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from router.multimodal import load_image_processor
from router.video import decode_video, process_video, sample_frame_indices, video_frame_limit, video_patches

from .test_multimodal import _app, _chat, _data_url, _error, _image, _part


def mp4(num_frames: int, fps: int = 4, size: tuple[int, int] = (120, 60), seed: int = 0) -> bytes:
    """A small MPEG-4 video of ``size`` (width, height): random blocks of colour moving frame by frame."""
    import av

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (size[1] // 8, size[0] // 8, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(np.roll(base, 8 * i, axis=1).copy(), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def video_part(data: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}}


@pytest.mark.parametrize(("total", "fps", "want"), [
    (10, 4.0, [0, 2, 5, 7]),  # (2.5 s at 2 a second: 5, rounded down to pairs)
    (300, 30.0, [15 * i for i in range(20)]),  # (10 s: 20 frames)
    (6, 30.0, [0, 1, 3, 4]),  # (0.2 s: at least 4)
    (3, 30.0, [0, 1]),  # (fewer than 4: the video's own count, in whole pairs)
    (1, 30.0, [0]),  # (one frame: taken, and repeated into its pair later)
    (294, 30.0, [0, 16, 32, 49, 65, 81, 98, 114, 130, 147, 163, 179, 196, 212, 228, 245, 261, 277]),  # (float32 steps)
])
def test_frames_are_sampled_as_transformers_samples_them(total, fps, want):
    assert sample_frame_indices(total, fps) == want
    assert sample_frame_indices(300, 30.0, num_frames=6) == [0, 50, 100, 150, 200, 250]


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    """A tiny Qwen2.5-VL taking videos (frames of 56x56 to 56x112 pixels)."""
    from transformers import AutoTokenizer

    from gpu_worker.config import ModelConfig
    from tests.tiny_model import build_tiny_qwen2_vl

    directory = build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), windowed=True)
    vision = ModelConfig.from_pretrained(directory).vision
    return directory, AutoTokenizer.from_pretrained(directory), load_image_processor(directory), vision


def test_a_videos_patches_are_its_frames_in_the_processors_layout(qwen2_vl):
    """Each patch's values are channels x frames x rows x columns: a pair of equal frames gives the
    image processor's patches of that frame (which repeats an image as its pair); a pair of two
    frames gives each frame's values in its own slot."""
    _, _, processor, vision = qwen2_vl
    geometry = vision.geometry
    first, second = _image(1, (112, 56)), _image(2, (112, 56))  # (56x112 fits both pixel ranges as it is)
    image_patches = processor(images=[first], return_tensors="np")["pixel_values"]
    same = video_patches([first, first], geometry, processor.image_mean, processor.image_std)
    np.testing.assert_allclose(same, image_patches, atol=1e-5)
    pair = video_patches([first, second], geometry, processor.image_mean, processor.image_std)
    second_patches = processor(images=[second], return_tensors="np")["pixel_values"]
    slots = pair.reshape(len(pair), 3, 2, 14 * 14)
    np.testing.assert_allclose(slots[:, :, 0], image_patches.reshape(len(pair), 3, 2, -1)[:, :, 0], atol=1e-5)
    np.testing.assert_allclose(slots[:, :, 1], second_patches.reshape(len(pair), 3, 2, -1)[:, :, 1], atol=1e-5)
    # Three frames: the last repeated to fill the second pair.
    odd = video_patches([first, second, first], geometry, processor.image_mean, processor.image_std)
    assert odd.shape == (2 * len(pair), 3 * 2 * 14 * 14)
    np.testing.assert_allclose(odd[len(pair):], same, atol=1e-5)


def test_a_video_reaches_the_engine_beside_an_image_in_prompt_order(qwen2_vl):
    http, engine, _ = _app(qwen2_vl, video_token_id=qwen2_vl[3].video_token_id)
    vision, tokenizer = qwen2_vl[3], qwen2_vl[1]
    data = mp4(10)  # (2.5 s at 4 a second: 4 frames sampled, 120x60 resized to 56x112: 2 pairs of 8 tokens)
    content = [_part(_data_url(_image(3))), {"type": "text", "text": "then"}, video_part(data),
               {"type": "text", "text": "what moves?"}]
    r = _chat(http, content)
    assert r.status_code == 200, r.text
    [request] = engine.requests
    image, video = request.mm_features
    assert (image.modality, video.modality) == ("image", "video") and image.offset < video.offset
    decoded = decode_video(data)
    assert (video.length, video.num_frames, video.image_size) == (16, 4, (60, 120))
    assert video.second_per_grid == pytest.approx(2 / decoded.sampled_fps) == pytest.approx(1.25)
    processor = qwen2_vl[2]
    want = video_patches(decoded.frames, vision.geometry, processor.image_mean, processor.image_std)
    np.testing.assert_array_equal(np.frombuffer(video.pixel_values.data, np.float32).reshape(want.shape), want)
    ids = request.prompt_token_ids
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    assert ids[video.offset - 1] == start and ids[video.end] == end
    assert ids[video.offset:video.end] == [vision.video_token_id] * 16
    tokens = http.post("/tokenize", json={"model": "llava", "messages": [{"role": "user", "content": content}]})
    assert tokens.json()["tokens"] == ids


def test_a_long_video_keeps_as_many_frames_as_the_largest_image_has_tokens(qwen2_vl):
    """Capped before decoding (the model's geometry known): only the frames the encoder takes are
    decoded, each resized at once; capped after (frames given): the same frames, the same patches."""
    _, _, processor, vision = qwen2_vl
    geometry = vision.geometry
    data = mp4(200, fps=10)
    decoded = decode_video(data)  # (20 s: 40 frames sampled)
    assert len(decoded.frames) == 40 and decoded.frame_size == (60, 120)
    limit = video_frame_limit(geometry, 60, 120)
    video = process_video(decoded, geometry, processor.image_mean, processor.image_std, "m")
    assert video.num_frames == limit < 40 and video.num_tokens <= geometry.max_tokens
    # (Fewer frames, over the same 20 s: each pair spans more time.)
    assert video.second_per_grid == pytest.approx(2 / (limit / 200 * 10))
    early = decode_video(data, geometry)
    assert len(early.frames) == limit and {f.size for f in early.frames} == {(112, 56)}
    again = process_video(early, geometry, processor.image_mean, processor.image_std, "m")
    assert again.identifier == video.identifier and again.second_per_grid == video.second_per_grid


def test_media_io_kwargs_set_how_frames_are_sampled(qwen2_vl):
    """vLLM's --media-io-kwargs: a count of frames evenly spaced, or a rate; the same bytes sampled
    otherwise are another video (another digest, another timing)."""
    video_token = qwen2_vl[3].video_token_id
    data = mp4(40, fps=10)  # (4 s: 8 frames at the default 2 a second)
    got = {}
    for name, kwargs in (("default", {}), ("count", {"video": {"num_frames": 2}}), ("rate", {"video": {"fps": 1}})):
        http, engine, _ = _app(qwen2_vl, video_token_id=video_token, media_io_kwargs=kwargs)
        assert _chat(http, [video_part(data)]).status_code == 200
        got[name] = engine.requests[0].mm_features[0]
    assert [got[n].num_frames for n in ("default", "count", "rate")] == [8, 2, 4]
    assert got["count"].second_per_grid == pytest.approx(2 / (2 / 40 * 10))  # (2 s a pair)
    assert len({f.identifier for f in got.values()}) == 3


def test_a_template_given_text_gets_qwens_video_placeholder(qwen2_vl):
    http, engine, _ = _app(qwen2_vl, video_token_id=qwen2_vl[3].video_token_id, chat_template_content_format="string",
                           trust_request_chat_template=True)
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    r = _chat(http, [{"type": "text", "text": "what"}, video_part(mp4(4))], chat_template=template)
    assert r.status_code == 200, r.text
    ids = engine.requests[0].prompt_token_ids
    tokenizer, vision = qwen2_vl[1], qwen2_vl[3]
    assert tokenizer.decode([t for t in ids if t != vision.video_token_id]) == "[<|vision_start|><|vision_end|>\nwhat]"


def test_videos_refused(qwen2_vl):
    video_token = qwen2_vl[3].video_token_id
    http, engine, _ = _app(qwen2_vl, video_token_id=video_token)
    assert "cannot decode the video" in _error(_chat(http, [video_part(b"not a video")]))
    too_many, _, _ = _app(qwen2_vl, video_token_id=video_token, limit_mm_per_prompt={"video": 1})
    assert "At most 1 video(s)" in _error(_chat(too_many, [video_part(mp4(4)), video_part(mp4(4, seed=1))]))
    none, _, _ = _app(qwen2_vl, video_token_id=video_token, limit_mm_per_prompt={"video": 0})
    assert "At most 0 video(s)" in _error(_chat(none, [video_part(mp4(4))]))
    images_only, _, _ = _app(qwen2_vl)  # (a model whose engines state no video token)
    assert "does not take videos" in _error(_chat(images_only, [video_part(mp4(4))]))
    small, _, _ = _app(qwen2_vl, max_model_len=24, video_token_id=video_token)
    assert "maximum context length" in _error(_chat(small, [video_part(mp4(10))]))
    assert not engine.requests


def test_a_frame_too_large_is_refused_before_any_is_decoded(qwen2_vl, monkeypatch):
    import PIL.Image

    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 120 * 60 - 1)
    with pytest.raises(ValueError, match="larger than the"):
        decode_video(mp4(4), qwen2_vl[3].geometry)


def test_decode_video_refuses_what_is_not_a_video():
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="PNG")
    with pytest.raises(ValueError, match=r"cannot decode the video|no video stream"):
        decode_video(b"\x00" * 100)
    frames = decode_video(buffer.getvalue())  # (a still image is a one-frame video to FFmpeg)
    assert len(frames.frames) == 1
