"""Videos in chat prompts (Qwen2-VL, Qwen2.5-VL): the frames sampled as transformers samples them,
their patches in the processor's layout, the request the engine gets (a video's placeholders
within Qwen's vision tokens beside an image's, its frames, its timing), /tokenize, and refusals."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from router.video import decode_video, process_video, sample_frame_indices, video_frame_limit, video_patches

from .test_multimodal import _app, _chat, _data_url, _error, _image, _part, served


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
    from tests.tiny_model import build_tiny_qwen2_vl

    return served(build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), windowed=True))


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


# -- Qwen3-VL: frames resized together, each temporal patch timed in the prompt -----------------------


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    """A tiny Qwen3-VL taking videos (all of a video's frames together: 4096..24576 pixels)."""
    from tests.tiny_model import build_tiny_qwen3_vl

    return served(build_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny-qwen3-vl")))


@pytest.mark.parametrize(("total", "fps"), [(10, 4.0), (300, 30.0), (6, 30.0), (3, 30.0), (1, 30.0), (294, 29.97),
                                            (1000, 25.0), (20000, 24.0), (7, 0.0)])
def test_qwen3_frames_are_sampled_as_transformers_samples_them(total, fps):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    from router.video import qwen3_frame_indices

    theirs = Qwen3VLVideoProcessor()
    want = theirs.sample_frames(VideoMetadata(total_num_frames=total, fps=fps or None)).tolist()
    assert qwen3_frame_indices(total, fps) == want
    if total >= 6:
        assert qwen3_frame_indices(total, fps, num_frames=6) == theirs.sample_frames(
            VideoMetadata(total_num_frames=total, fps=fps or None), num_frames=6).tolist()


def test_qwen3_frames_are_resized_together_as_transformers_resizes_them(qwen3_vl):
    """All a video's frames within the video pixel range together (transformers' smart_resize for
    Qwen3-VL's videos, with its rounding of the frame count to pairs); where a pair of frames would be
    more tokens than a pass may encode, fewer pixels a frame."""
    from msgspec.structs import replace
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    geometry = qwen3_vl[3].geometry
    wide = replace(geometry, video_max_pixels=32 * 32 * 60)  # (at most 30 tokens a frame: under max_tokens)
    rng = np.random.default_rng(0)
    for _ in range(300):
        frames, height, width = int(rng.integers(2, 40)), int(rng.integers(8, 900)), int(rng.integers(8, 900))
        if max(height, width) / min(height, width) > 200:
            continue
        for g in (geometry, wide):
            assert g.video_frame_size(frames, height, width) == smart_resize(
                frames, height, width, 2, 32, g.video_min_pixels, g.video_max_pixels), (frames, height, width)
    # (A range allowing 2 frames of 100 tokens each; the encoder's budget, the largest image's, is less.)
    roomy = replace(geometry, video_max_pixels=2 * 32 * 32 * 100)
    assert smart_resize(2, 320, 320, 2, 32, roomy.video_min_pixels, roomy.video_max_pixels) == (320, 320)
    height, width = roomy.video_frame_size(2, 320, 320)
    assert 0.8 * roomy.max_tokens <= height * width // 32 ** 2 <= roomy.max_tokens < 100


def test_qwen3_video_text_and_patches_equal_transformers_processor(qwen3_vl):
    """The prompt a video makes (each temporal patch's time, the middle of its frames', as
    transformers' Qwen3VLProcessor writes it, then its placeholders within vision start and end), and
    its patches in transformers' layout (Qwen3VLVideoProcessor.patchify)."""
    from functools import partial
    from types import SimpleNamespace

    import torch
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    from router.multimodal import MultiModalProcessor, timed_video_tokens
    from router.video import DecodedVideo, pair_timestamps, process_video

    _, tokenizer, image_processor, vision = qwen3_vl
    geometry = vision.geometry
    video_processor = Qwen3VLVideoProcessor(size={"shortest_edge": geometry.video_min_pixels,
                                                  "longest_edge": geometry.video_max_pixels})
    # (Qwen3VLProcessor cannot be built without torchvision: its methods run on what they read.)
    theirs = SimpleNamespace(video_processor=video_processor, vision_start_token="<|vision_start|>",
                             vision_end_token="<|vision_end|>", video_token="<|video_pad|>",
                             _calculate_timestamps=partial(Qwen3VLProcessor._calculate_timestamps, None))
    frames = [_image(40 + i, (120, 60)) for i in range(5)]
    indices, fps = [0, 7, 15, 22, 29], 29.97
    assert pair_timestamps(indices, fps) == theirs._calculate_timestamps(indices, fps, 2)
    video = process_video(DecodedVideo(frames, 30, fps, (60, 120), tuple(indices)), geometry,
                          image_processor.image_mean, image_processor.image_std, "m")
    grid = torch.tensor([[3, video.frame_size[0] // 16, video.frame_size[1] // 16]])
    metadata = VideoMetadata(total_num_frames=30, fps=fps, frames_indices=indices)
    text = Qwen3VLProcessor.replace_video_token(theirs, {"video_grid_thw": grid, "video_metadata": [metadata]}, 0)
    media = MultiModalProcessor(vision.image_token_id, geometry, image_processor, "m", "",
                                video_token_id=vision.video_token_id,
                                timed_videos=timed_video_tokens(tokenizer, vision.video_token_id, geometry))
    prompt = tokenizer.encode("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>what?",
                              add_special_tokens=False)
    ids, _, offsets = media.expand_media(prompt, [], [video])
    assert "<0.1 seconds>" in text and "<1.0 seconds>" in text
    assert ids == tokenizer.encode(f"<|im_start|>user\n{text}what?", add_special_tokens=False)
    assert [ids[o - 1] for o in offsets] == [tokenizer.convert_tokens_to_ids("<|vision_start|>")] * 3
    # (The patches: the frames resized as ours, normalised, then cut by transformers.)
    height, width = video.frame_size
    mean, std = (np.asarray(v, np.float32) for v in (image_processor.image_mean, image_processor.image_std))
    pixels = np.stack([(np.asarray(f.resize((width, height), Image.Resampling.BICUBIC), np.float32) / 255
                        - mean) / std for f in frames]).transpose(0, 3, 1, 2)
    patches, *_ = video_processor.patchify(torch.from_numpy(pixels)[None], 16, 2, 2)
    np.testing.assert_allclose(video.pixel_values.to_tensor().numpy(), patches[0].numpy(), atol=1e-5)


def test_a_qwen3_video_reaches_the_engine_as_its_timed_temporal_patches(qwen3_vl):
    """Through the chat endpoint: each temporal patch a feature (a pair of frames, at the frames'
    resized size, over its own placeholders), the times between them; /tokenize counts the same;
    --media-io-kwargs' count of frames sets them."""
    http, engine, _ = _app(qwen3_vl, video_token_id=qwen3_vl[3].video_token_id)
    tokenizer, vision = qwen3_vl[1], qwen3_vl[3]
    data = mp4(10)  # (2.5 s at 4 a second: frames 0, 2, 4, 7, 9 -> 3 pairs; 120x60 resized to 96x32)
    content = [_part(_data_url(_image(3, (64, 64)))), video_part(data), {"type": "text", "text": "what moves?"}]
    r = _chat(http, content)
    assert r.status_code == 200, r.text
    [request] = engine.requests
    image, *pairs = request.mm_features
    assert image.modality == "image" and [p.modality for p in pairs] == ["video"] * 3
    assert [(p.length, p.num_frames, p.image_size) for p in pairs] == [(3, 2, (32, 96))] * 3
    ids = request.prompt_token_ids
    text = tokenizer.decode(ids[image.end:])
    assert text.startswith("<|vision_end|><0.2 seconds><|vision_start|><|video_pad|>")  # (frames 0 and 2: 0.25 s)
    assert "<|vision_end|><2.2 seconds><|vision_start|>" in text
    assert all(ids[p.offset:p.end] == [vision.video_token_id] * 3 for p in pairs)
    tokens = http.post("/tokenize", json={"model": "llava", "messages": [{"role": "user", "content": content}]})
    assert tokens.json()["tokens"] == ids
    counted, counting, _ = _app(qwen3_vl, video_token_id=vision.video_token_id,
                                media_io_kwargs={"video": {"num_frames": 8}})
    assert _chat(counted, [video_part(data)]).status_code == 200
    assert len(counting.requests[0].mm_features) == 4  # (8 frames of the 10: 4 pairs)


def test_a_qwen3_videos_frame_pairs_are_shrunk_to_what_a_pass_may_encode(qwen3_vl):
    """Where the video range would make a pair of frames more tokens than the largest image (what a
    pass may encode), its frames are made smaller to fit: whatever the frame count (an odd count of
    pairs rounds down in transformers' resize) and where the range's least is above it."""
    from msgspec.structs import replace

    from router.video import DecodedVideo, process_video

    _, _, processor, vision = qwen3_vl
    budget = vision.geometry.max_tokens
    roomy = replace(vision.geometry, video_max_pixels=32 * 32 * 40 * budget)
    least = 2 * 32 * 32 * 2 * budget
    tight = replace(vision.geometry, video_min_pixels=least, video_max_pixels=least)
    for geometry, count in [(roomy, n) for n in range(2, 10)] + [(tight, 2)]:
        frames = [_image(i, (640, 384)) for i in range(count)]
        video = process_video(DecodedVideo(frames, count, 2.0, (384, 640)), geometry, processor.image_mean,
                              processor.image_std, "m")
        per_pair = {part.num_tokens for part in video.parts}
        assert len(per_pair) == 1 and 0.5 * budget < per_pair.pop() <= budget, count


def test_a_qwen3_tokenizer_without_vision_tokens_refuses_videos(qwen3_vl):
    """Without Qwen's vision start and end tokens no timed video text can be written: videos are
    refused (images are still taken)."""
    from router.multimodal import MultiModalProcessor, timed_video_tokens
    from tests.tiny_model import build_tokenizer

    _, _, processor, vision = qwen3_vl
    assert timed_video_tokens(build_tokenizer(), vision.video_token_id, vision.geometry) is None
    media = MultiModalProcessor(vision.image_token_id, vision.geometry, processor, "m", "",
                                video_token_id=vision.video_token_id, timed_videos=None)
    with pytest.raises(ValueError, match="takes no videos"):
        media.check_count(1, "video")
    media.check_count(1, "image")


def test_a_video_stored_turned_is_decoded_upright():
    """A phone's upright video is stored sideways with a display matrix turning it a quarter: its
    frames are turned upright (as vLLM's OpenCV loader does), and its size is the upright one, before
    the model's resize too."""
    import av

    stored = np.zeros((32, 64, 3), np.uint8)
    stored[:, :8] = 255  # (its left side white: upright, after a quarter turn counterclockwise, its bottom)
    for degrees, white_rows in ((90, slice(-8, None)), (-90, slice(None, 8))):
        out = io.BytesIO()
        with av.open(out, "w", format="mp4") as container:
            stream = container.add_stream("mpeg4", rate=4)
            stream.width, stream.height, stream.pix_fmt = 64, 32, "yuv420p"
            stream.set_display_rotation(degrees)
            for _ in range(4):
                for packet in stream.encode(av.VideoFrame.from_ndarray(stored, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        video = decode_video(out.getvalue())
        assert video.frame_size == (64, 32) and video.frames[0].size == (32, 64)
        pixels = np.asarray(video.frames[0]).mean(axis=(1, 2))
        assert pixels[white_rows].min() > 200 and np.delete(pixels, np.arange(64)[white_rows]).max() < 60


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_the_video_processor_configs_rate_and_frame_bounds_sample_the_frames(family, request, tmp_path):
    """A video processor config's fps, min_frames and max_frames (transformers reads them as its
    sampling defaults) sample the frames; --media-io-kwargs' rate is over the config's."""
    import json
    import shutil

    from gpu_worker.config import ModelConfig
    from router.video import VideoSampling

    directory = shutil.copytree(request.getfixturevalue(family)[0], tmp_path / family)
    config_path = directory / "video_preprocessor_config.json"
    config = json.loads(config_path.read_text())
    data = mp4(80, fps=8)  # (10 s)
    default = len(decode_video(data, ModelConfig.from_pretrained(directory).vision.geometry).frames)
    config_path.write_text(json.dumps({**config, "fps": 1, "min_frames": 2, "max_frames": 6}))
    geometry = ModelConfig.from_pretrained(directory).vision.geometry
    assert (geometry.video_fps, geometry.video_min_frames, geometry.video_max_frames) == (1.0, 2, 6)
    assert len(decode_video(data, geometry).frames) == 6 < default  # (10 a second at most 6)
    assert len(decode_video(data, geometry, VideoSampling(fps=0.4)).frames) == 4  # (4 frames, whole pairs)
    config_path.write_text(json.dumps({**config, "min_frames": 9, "max_frames": 8}))
    with pytest.raises(ValueError, match="min_frames"):
        ModelConfig.from_pretrained(directory)
