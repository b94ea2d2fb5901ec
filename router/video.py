"""Videos in chat prompts (vLLM's ``video_url`` parts), the router's side, for the models whose
towers take them (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: ``ImageGeometry.takes_videos``).

A video file is decoded (PyAV), its frames sampled as transformers' Qwen2VLVideoProcessor samples
them (2 a second, at least 4 and at most 768, an even count, evenly spaced), fewer where the video
would be more tokens than the model's largest image (what a pass's encoder budget holds: the
engines profile that many patches); each frame resized into the video pixel range (as the image
processor resizes an image: PIL bicubic), rescaled and normalised with the image processor's mean and
std, and the frames cut into the tower's patches: pairs of frames (``temporal_patch_size``) make a
temporal patch, its patches listed in the processor's order (temporal patch by temporal patch, each
2x2 square of patches consecutive), each patch's values as channels x frames x rows x columns. The
seconds a temporal patch spans (``second_per_grid``: temporal_patch_size over the sampled frame
rate) time Qwen2.5-VL's M-RoPE positions.

Qwen3-VL's (``ImageGeometry.video_frame_pairs``) as its Qwen3VLVideoProcessor makes them: frames
sampled at 2 a second (4..768, evenly spread over the whole video, ``qwen3_frame_indices``), all of
them resized together into the video pixel range (``ImageGeometry.video_frame_size``), each temporal
patch then a feature of its own, its time (the middle of its frames' source times,
``pair_timestamps``) written as text before it in the prompt (router.multimodal.TimedVideoTokens).
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine_core.multimodal import ImageGeometry, TensorData, feature_identifier

if TYPE_CHECKING:
    from PIL import Image

# transformers' Qwen2VLVideoProcessor defaults: frames sampled per second, and the fewest and most.
VIDEO_FPS = 2.0
# The frame rate Qwen3-VL's processors take for a video that states none (its samples and its times).
QWEN3_UNKNOWN_FPS = 24.0
MIN_FRAMES = 4
MAX_FRAMES = 768
# The most frames a video may hold (decoded one by one, only the sampled ones kept: about 9 hours at
# 30 a second).
MAX_SOURCE_FRAMES = 1_000_000


@dataclass(frozen=True)
class VideoSampling:
    """How a video's frames are sampled (vLLM's --media-io-kwargs '{"video": {...}}'): ``fps`` a
    second (None: the model's video processor's rate; within its min and max frames), or
    ``num_frames`` evenly spaced."""

    fps: float | None = None
    num_frames: int | None = None


DEFAULT_SAMPLING = VideoSampling()


def video_sampling_from(media_io_kwargs: dict[str, Any] | None) -> VideoSampling:
    """vLLM's --media-io-kwargs as the video sampling it sets; ValueError for what is not served
    (another modality's settings, other keys, both a count and a rate)."""
    kwargs = dict(media_io_kwargs or {})
    others = sorted(set(kwargs) - {"video"})
    if others:
        raise ValueError(f"media_io_kwargs: only video's are served ({{'video': {{'num_frames': N}}}} or "
                         f"{{'video': {{'fps': F}}}}), not {others}")
    video = kwargs.get("video") or {}
    if not isinstance(video, dict) or set(video) - {"num_frames", "fps"}:
        raise ValueError(f"media_io_kwargs['video'] takes num_frames or fps, got {video!r}")
    if "num_frames" in video and "fps" in video:
        raise ValueError("media_io_kwargs['video']: num_frames and fps are exclusive (a count, or a rate)")
    num_frames, fps = video.get("num_frames"), video.get("fps")
    if num_frames is not None and (isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1):
        raise ValueError(f"media_io_kwargs['video']['num_frames'] must be an integer >= 1, got {num_frames!r}")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps < float("inf")):
        raise ValueError(f"media_io_kwargs['video']['fps'] must be a number > 0, got {fps!r}")
    return VideoSampling(None if fps is None else float(fps), num_frames)


@dataclass(frozen=True)
class DecodedVideo:
    """A video's sampled frames (RGB; already resized where the decoder knew the model's geometry),
    its frame count, its frame rate, its frames' own (height, width), and each kept frame's index in
    the video (none given: 0, 1, ...)."""

    frames: list[Image.Image]
    total_frames: int
    fps: float
    frame_size: tuple[int, int]
    indices: tuple[int, ...] = ()

    @property
    def frame_indices(self) -> list[int]:
        return list(self.indices) if self.indices else list(range(len(self.frames)))

    @property
    def sampled_fps(self) -> float:
        """The sampled frames' rate (transformers' VideoMetadata.sampled_fps)."""
        return len(self.frames) / self.total_frames * self.fps


@dataclass(frozen=True)
class VideoPart:
    """What one video feature of the engine gets: Qwen2-VL's whole video, or one of Qwen3-VL's
    temporal patches."""

    identifier: str
    pixel_values: TensorData
    num_tokens: int
    num_frames: int
    second_per_grid: float


@dataclass(frozen=True)
class ProcessedVideo:
    """One video as the vision encoder takes it: its digest, its frames' (height, width) (Qwen3-VL's:
    as resized), its sampled frames, the seconds a temporal patch spans, and its ``parts``, the
    engine's features of it: the whole video ([patches, channels x frames x patch x patch]); Qwen3-VL's,
    each temporal patch, whose time (seconds into the video) is in ``timestamps``."""

    identifier: str
    frame_size: tuple[int, int]
    num_frames: int
    second_per_grid: float
    parts: tuple[VideoPart, ...]
    timestamps: tuple[float, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(part.num_tokens for part in self.parts)

    @property
    def size_bytes(self) -> int:
        return sum(len(part.pixel_values.data) for part in self.parts)

    @property
    def pixel_values(self) -> TensorData:
        """All its patches in one tensor (the engine gets them as ``parts``; a copy where there are several)."""
        if len(self.parts) == 1:
            return self.parts[0].pixel_values
        first = self.parts[0].pixel_values
        return TensorData(first.dtype, (sum(p.pixel_values.shape[0] for p in self.parts), *first.shape[1:]),
                          b"".join(p.pixel_values.data for p in self.parts))


def sample_frame_indices(total_frames: int, video_fps: float, temporal_patch_size: int = 2,
                         fps: float = VIDEO_FPS, min_frames: int = MIN_FRAMES, max_frames: int = MAX_FRAMES,
                         num_frames: int | None = None) -> list[int]:
    """The frames to keep (transformers' Qwen2VLVideoProcessor.sample_frames, its float32 spacing
    too): ``fps`` a second, within [min_frames, max_frames] and the video's own count, rounded down to
    whole temporal patches (all of a video shorter than one); or ``num_frames`` evenly spaced."""
    import torch

    if total_frames < 1:
        raise ValueError("the video has no frames")
    if num_frames is None:
        most = math.floor(min(max_frames, total_frames) / temporal_patch_size) * temporal_patch_size
        wanted = total_frames / video_fps * fps if video_fps > 0 else total_frames
        num_frames = math.floor(min(max(wanted, min_frames), most, total_frames)
                                / temporal_patch_size) * temporal_patch_size
    num_frames = min(num_frames, total_frames)
    if num_frames < 1:  # (a video shorter than one temporal patch: every frame, the last repeated later)
        return list(range(total_frames))
    return torch.arange(0, total_frames, total_frames / num_frames).int().tolist()


def qwen3_frame_indices(total_frames: int, video_fps: float, fps: float = VIDEO_FPS, min_frames: int = MIN_FRAMES,
                        max_frames: int = MAX_FRAMES, num_frames: int | None = None) -> list[int]:
    """Qwen3-VL's frames to keep (transformers' Qwen3VLVideoProcessor.sample_frames): ``fps`` a second
    (a video of unknown rate taken at 24), within [min_frames, max_frames] and the video's own count;
    or ``num_frames`` (at most the video's count); evenly spread from its first frame to its last."""
    if total_frames < 1:
        raise ValueError("the video has no frames")
    if num_frames is None:
        num_frames = int(total_frames / (video_fps if video_fps > 0 else QWEN3_UNKNOWN_FPS) * fps)
        num_frames = min(max(num_frames, min_frames), max_frames, total_frames)
    num_frames = max(1, min(num_frames, total_frames))
    return np.linspace(0, total_frames - 1, num_frames).round().astype(int).tolist()


def pair_timestamps(indices: list[int], video_fps: float, temporal_patch_size: int = 2) -> list[float]:
    """Qwen3-VL: each temporal patch's time in seconds, the middle of its first and last frames' (the
    last frame repeated to fill the last patch; transformers' Qwen3VLProcessor._calculate_timestamps)."""
    indices = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch_size)
    seconds = [index / video_fps for index in indices]
    return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
            for i in range(0, len(seconds), temporal_patch_size)]


def evenly(items: list, count: int) -> list:
    """``count`` of ``items``, evenly spaced (all of them where there are no more)."""
    if len(items) <= count:
        return list(items)
    return [items[i * len(items) // count] for i in range(count)]


def decode_video(data: bytes, geometry: ImageGeometry | None = None,
                 sampling: VideoSampling = DEFAULT_SAMPLING) -> DecodedVideo:
    """A video file's frames as ``sampling`` samples them (``sample_frame_indices``; Qwen3-VL's:
    ``qwen3_frame_indices``), decoded with PyAV. Given the model's ``geometry``: a frame too large is
    refused before any is decoded, the frames are capped as ``process_video`` caps them
    (``video_frame_limit``; not Qwen3-VL's, whose pairs are encoded one by one), and each kept frame is
    resized at once (``ImageGeometry.video_frame_size``), so memory holds only what the encoder takes.
    A frame stored turned (its display matrix: a phone's upright video) is turned upright, as vLLM's
    OpenCV loader turns it (transformers' PyAV loader does not); its size is then the upright one.
    ValueError for what is not a video PyAV can read."""
    import av
    from PIL import Image

    from router.multimodal import check_image_size

    temporal_patch_size = geometry.temporal_patch_size if geometry is not None else 2
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise ValueError("the file has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else 0.0
            height, width = stream.codec_context.height, stream.codec_context.width
            if height < 1 or width < 1:
                raise ValueError("the video stream states no frame size")
            check_image_size(width, height)
            total = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        if total > MAX_SOURCE_FRAMES:
            raise ValueError(f"a video of {total} frames has more than the {MAX_SOURCE_FRAMES} allowed")
        # (the model's video processor's rate and bounds; transformers' defaults without a model)
        frames_from = {"fps": sampling.fps or (geometry.video_fps if geometry is not None else VIDEO_FPS),
                       "min_frames": geometry.video_min_frames if geometry is not None else MIN_FRAMES,
                       "max_frames": geometry.video_max_frames if geometry is not None else MAX_FRAMES,
                       "num_frames": sampling.num_frames}
        if geometry is not None and geometry.video_frame_pairs:
            keep = qwen3_frame_indices(total, fps, **frames_from)
        else:
            keep = sample_frame_indices(total, fps, temporal_patch_size, **frames_from)
            if geometry is not None:
                keep = evenly(keep, video_frame_limit(geometry, height, width))
        # (the limit and the resize are the same for a frame turned a quarter: its sides swap)
        wanted, frames, kept = set(keep), [], []
        target, stored = None, (height, width)
        with av.open(io.BytesIO(data)) as container:
            for index, frame in enumerate(container.decode(container.streams.video[0])):
                if index in wanted:
                    image = frame.to_image()
                    if (image.height, image.width) != stored:
                        raise ValueError("a video's frames must all be of one size")
                    image = upright(image, frame.rotation)
                    if not frames:  # (the video's size as shown)
                        height, width = image.height, image.width
                        if geometry is not None:
                            new_height, new_width = geometry.video_frame_size(len(keep), height, width)
                            target = (new_width, new_height)
                    if (image.height, image.width) != (height, width):
                        raise ValueError("a video's frames must all be turned alike")
                    frames.append(image if target is None else image.resize(target, Image.Resampling.BICUBIC))
                    kept.append(index)
                if len(frames) == len(wanted):
                    break
    except av.FFmpegError as e:
        raise ValueError(f"cannot decode the video: {e}") from None
    if not frames:
        raise ValueError("cannot decode the video: no frame could be read")
    unknown = QWEN3_UNKNOWN_FPS if geometry is not None and geometry.video_frame_pairs else VIDEO_FPS
    return DecodedVideo(frames, max(total, len(frames)), fps or unknown, (height, width), tuple(kept))


def upright(image: Image.Image, rotation: int) -> Image.Image:
    """A decoded frame as its display matrix shows it: turned ``rotation`` degrees counterclockwise
    (PyAV's VideoFrame.rotation; quarter turns only, a flip or another angle kept as stored)."""
    from PIL import Image

    turn = {90: Image.Transpose.ROTATE_90, 180: Image.Transpose.ROTATE_180,
            270: Image.Transpose.ROTATE_270}.get(rotation % 360)
    return image if turn is None else image.transpose(turn)


def video_frame_limit(geometry: ImageGeometry, height: int, width: int) -> int:
    """The most frames of this size a video may keep: as many temporal patches as the model's largest
    image has tokens (the encoder budget every pass holds), at least one."""
    _, rows, columns = geometry.video_patch_grid(geometry.temporal_patch_size, height, width)
    per_patch = max(1, rows * columns // geometry.merge_size ** 2)
    return max(1, geometry.max_tokens // per_patch) * geometry.temporal_patch_size


def video_target_size(frames: list[Image.Image], geometry: ImageGeometry,
                      frame_size: tuple[int, int] | None = None) -> tuple[int, int]:
    """The (height, width) the frames (their own size ``frame_size``) are resized to: the size the
    decoder resized them to already (for Qwen3-VL, by the frames it meant to decode), else the
    model's for them (``ImageGeometry.video_frame_size``)."""
    height, width = frame_size or (frames[0].height, frames[0].width)
    if (frames[0].height, frames[0].width) != (height, width):
        return frames[0].height, frames[0].width
    return geometry.video_frame_size(len(frames), height, width)


def video_patches(frames: list[Image.Image], geometry: ImageGeometry, mean: Any, std: Any,
                  frame_size: tuple[int, int] | None = None) -> np.ndarray:
    """The frames (of one size: ``frame_size``, their own where not given; they may be resized to
    the model's size already) as the tower's patches: [temporal patches x rows x columns, channels x
    temporal_patch_size x patch x patch], float32 (the last frame repeated to fill the last temporal
    patch)."""
    from PIL import Image

    if len({frame.size for frame in frames}) > 1:
        raise ValueError("a video's frames must all be of one size")
    new_height, new_width = video_target_size(frames, geometry, frame_size)
    mean = np.asarray(mean, dtype=np.float32).reshape(-1, 1, 1)
    std = np.asarray(std, dtype=np.float32).reshape(-1, 1, 1)
    pixels = []
    for frame in frames:
        resized = frame.convert("RGB").resize((new_width, new_height), Image.Resampling.BICUBIC)
        array = np.asarray(resized, dtype=np.float32).transpose(2, 0, 1) / 255.0
        pixels.append((array - mean) / std)
    tp, patch, merge = geometry.temporal_patch_size, geometry.patch_size, geometry.merge_size
    pixels += [pixels[-1]] * (-len(pixels) % tp)
    video = np.stack(pixels)  # [frames, C, H, W]
    grid_t, channels = len(pixels) // tp, video.shape[1]
    grid_h, grid_w = new_height // patch, new_width // patch
    patches = video.reshape(grid_t, tp, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    # (t, h-blocks, w-blocks, merge rows, merge columns, C, frames, patch rows, patch columns)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(patches.reshape(grid_t * grid_h * grid_w, channels * tp * patch * patch))


def process_video(video: DecodedVideo, geometry: ImageGeometry, mean: Any, std: Any, model_id: str) -> ProcessedVideo:
    """A decoded video as the vision encoder takes it (fewer frames, evenly spaced, where it would be
    more tokens than a pass may encode; Qwen3-VL's: in temporal patches, each timed), and its digest."""
    if geometry.video_frame_pairs:
        return _process_timed_video(video, geometry, mean, std, model_id)
    height, width = video.frame_size
    frames = evenly(video.frames, video_frame_limit(geometry, height, width))
    sampled_fps = len(frames) / video.total_frames * video.fps
    pixel_values = TensorData.from_array(video_patches(frames, geometry, mean, std, video.frame_size))
    second_per_grid = geometry.temporal_patch_size / sampled_fps
    identifier = feature_identifier("video", pixel_values, extra=f"{model_id}|{height}x{width}|{second_per_grid}")
    whole = VideoPart(identifier, pixel_values, geometry.video_num_tokens(len(frames), height, width), len(frames),
                      second_per_grid)
    return ProcessedVideo(identifier, (height, width), len(frames), second_per_grid, (whole,))


def _process_timed_video(video: DecodedVideo, geometry: ImageGeometry, mean: Any, std: Any,
                         model_id: str) -> ProcessedVideo:
    """Qwen3-VL's video: every sampled frame, resized together (``ImageGeometry.video_frame_size``),
    its temporal patches each with its time and digest."""
    frames, pair = video.frames, geometry.temporal_patch_size
    new_height, new_width = video_target_size(frames, geometry, video.frame_size)
    patches = video_patches(frames, geometry, mean, std, video.frame_size)
    count = -(-len(frames) // pair)
    rows = patches.shape[0] // count
    tokens = rows // geometry.merge_size ** 2
    if tokens > geometry.max_tokens:  # (a frame pair is one encoder input: a pass's budget holds the largest image)
        raise ValueError(f"a video's pair of frames of {new_width}x{new_height} pixels is {tokens} tokens, more "
                         f"than a pass may encode ({geometry.max_tokens})")
    extra = f"{model_id}|{new_height}x{new_width}"
    values = [TensorData.from_array(patches[i * rows:(i + 1) * rows]) for i in range(count)]
    del patches
    parts = tuple(VideoPart(feature_identifier("video", data, extra=extra), data, tokens, pair, 0.0) for data in values)
    timestamps = tuple(pair_timestamps(video.frame_indices[:len(frames)], video.fps, pair))
    identifier = hashlib.blake2b(f"{extra}|{timestamps}|{[p.identifier for p in parts]}".encode(),
                                 digest_size=16).hexdigest()
    return ProcessedVideo(identifier, (new_height, new_width), len(frames), pair / video.sampled_fps, parts,
                          timestamps)
