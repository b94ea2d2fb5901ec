"""Images in chat prompts (vLLM's multimodal input), the router's side: a conversation's
``image_url`` parts loaded (``data:`` URLs, ``http(s)://`` URLs, ``file://`` under
--allowed-local-media-path), decoded and run through the model's own image processor into the
vision encoder's input, and each image token of the rendered prompt expanded to the
``tokens_per_image`` placeholders whose embeddings the engine replaces with the encoder's rows
(``engine_core.multimodal.MultiModalFeature``).

Decoding and resizing run in threads (``asyncio.to_thread``): the replica's event loop serves every
other stream meanwhile. Refusals are ``ValueError``s; the serving layer answers them with a 400.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import importlib.util
import io
import logging
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from engine_core.multimodal import (
    ImageGeometry,
    MultiModalFeature,
    TensorData,
    check_features,
    feature_identifier,
    with_article,
)
from engine_core.tokenizer_files import IMAGE_PROCESSOR_FILE, read_image_processor_config
from router.image_tiles import TiledImage, TiledImageTokens
from router.video import DEFAULT_SAMPLING, ProcessedVideo, VideoSampling, decode_video, process_video

if TYPE_CHECKING:
    from PIL import Image

logger = logging.getLogger(__name__)

# vLLM's modalities (--limit-mm-per-prompt's keys), and its default limit of each per prompt (v1's).
MODALITIES = ("image", "video", "audio")
DEFAULT_LIMIT_PER_PROMPT = 999
# vLLM's VLLM_IMAGE_FETCH_TIMEOUT: seconds an http(s) image may take to arrive.
IMAGE_FETCH_TIMEOUT_S = float(os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT", "5"))
# The most bytes one image may have (encoded), however it comes (OpenAI's limit per image).
MAX_IMAGE_BYTES = 20 * 1024 * 1024
# The most one side of an image may exceed the other (Qwen2-VL's processor's limit).
MAX_ASPECT_RATIO = 200
# vLLM's VLLM_VIDEO_FETCH_TIMEOUT, and the most bytes one video may have.
VIDEO_FETCH_TIMEOUT_S = float(os.environ.get("VLLM_VIDEO_FETCH_TIMEOUT", "30"))
MAX_VIDEO_BYTES = 256 * 1024 * 1024
# vLLM's --mm-processor-cache-gb default: GiB of processed images a router replica keeps.
DEFAULT_PROCESSOR_CACHE_GB = 4.0


def _short(url: str) -> str:
    return url if len(url) <= 80 else url[:77] + "..."


@dataclass(frozen=True)
class MediaConnector:
    """Loads an image's (or a video's: ``for_videos``) bytes from its URL (vLLM's MediaConnector): a
    base64 ``data:`` URL, an ``http(s)://`` URL (fetched within ``fetch_timeout_s``), or a ``file://``
    URL under ``allowed_local_media_path`` (none without it); at most ``max_bytes`` each."""

    allowed_local_media_path: str = ""
    fetch_timeout_s: float = IMAGE_FETCH_TIMEOUT_S
    max_bytes: int = MAX_IMAGE_BYTES
    # vLLM's --allowed-media-domains: the hosts http(s) images may come from (exact names; empty:
    # any). With a list, redirects are not followed (one could lead elsewhere).
    allowed_media_domains: tuple[str, ...] = ()
    # What it loads ("image", "video"): its messages name it.
    kind: str = "image"

    def for_videos(self) -> MediaConnector:
        """The same sources for videos: larger files, more time to fetch them (vLLM's
        VLLM_VIDEO_FETCH_TIMEOUT)."""
        return dataclasses.replace(self, kind="video", max_bytes=MAX_VIDEO_BYTES, fetch_timeout_s=VIDEO_FETCH_TIMEOUT_S)

    async def fetch_bytes(self, url: str) -> bytes:
        scheme = urlparse(url).scheme.lower() if ":" in url else ""
        if scheme == "data":
            return await asyncio.to_thread(self._data_url, url)
        if scheme in ("http", "https"):
            return await self._http(url)
        if scheme == "file":
            return await asyncio.to_thread(self._local_file, url)
        raise ValueError(f"{self.kind} URL {_short(url)!r}: give a data:{self.kind}/...;base64 URL, an http(s):// "
                         "URL or a file:// URL")

    def _data_url(self, url: str) -> bytes:
        header, comma, data = url.partition(",")
        if not comma or not header.endswith(";base64"):
            raise ValueError(f"{self.kind} URL {_short(url)!r}: only base64 data URLs are supported "
                             "(data:image/png;base64,...)")
        if len(data) * 3 // 4 > self.max_bytes:
            raise ValueError(f"{with_article(self.kind)} of {len(data) * 3 // 4} bytes is larger than the "
                             f"{self.max_bytes} allowed")
        try:
            return base64.b64decode(data)
        except ValueError as e:
            raise ValueError(f"{self.kind} data URL {_short(url)!r} is not base64: {e}") from None

    async def _http(self, url: str) -> bytes:
        import aiohttp

        host = (urlparse(url).hostname or "").lower()
        if self.allowed_media_domains and host not in self.allowed_media_domains:
            raise ValueError(f"{self.kind} URL {_short(url)!r}: the domain {host!r} is not one of the "
                             "--allowed-media-domains")
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.fetch_timeout_s)) as session, \
                    session.get(url, allow_redirects=not self.allowed_media_domains) as response:
                if 300 <= response.status < 400 and self.allowed_media_domains:
                    raise ValueError(f"cannot fetch {self.kind} {_short(url)!r}: HTTP {response.status} (a redirect is "
                                     "not followed with --allowed-media-domains)")
                if response.status >= 400:
                    raise ValueError(f"cannot fetch {self.kind} {_short(url)!r}: HTTP {response.status}")
                if (response.content_length or 0) > self.max_bytes:
                    raise ValueError(f"{self.kind} {_short(url)!r} has {response.content_length} bytes, more than the "
                                     f"{self.max_bytes} allowed")
                data = bytearray()
                async for chunk in response.content.iter_chunked(1 << 16):
                    data += chunk
                    if len(data) > self.max_bytes:
                        raise ValueError(f"{self.kind} {_short(url)!r} has more than the {self.max_bytes} bytes "
                                         "allowed")
                return bytes(data)
        except TimeoutError:
            raise ValueError(f"cannot fetch {self.kind} {_short(url)!r}: no answer within {self.fetch_timeout_s:g} s "
                             f"(VLLM_{self.kind.upper()}_FETCH_TIMEOUT)") from None
        except aiohttp.ClientError as e:
            raise ValueError(f"cannot fetch {self.kind} {_short(url)!r}: {e}") from None

    def _local_file(self, url: str) -> bytes:
        if not self.allowed_local_media_path:
            raise ValueError("Cannot load local files without `--allowed-local-media-path`.")
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{self.kind} URL {_short(url)!r}: a file:// URL names a file of this machine "
                             "(file:///path)")
        path = Path(unquote(parsed.path)).resolve()
        allowed = Path(self.allowed_local_media_path).resolve()
        if not path.is_relative_to(allowed):
            raise ValueError(f"The file path {unquote(parsed.path)} must be a subpath of "
                             f"`--allowed-local-media-path` {self.allowed_local_media_path}.")
        try:
            if path.stat().st_size > self.max_bytes:
                raise ValueError(f"{self.kind} file {unquote(parsed.path)} is larger than the {self.max_bytes} bytes "
                                 "allowed")
            return path.read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read {self.kind} file {unquote(parsed.path)}: {e.strerror or e}") from None


def decode_image(data: bytes) -> Image.Image:
    """An image file's pixels as RGB (a transparent image over white, as vLLM converts it)."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
        check_image_size(image.width, image.height)
        image.load()
    except (OSError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(f"cannot decode the image: {e}") from None
    return as_rgb(image)


def image_size_of(data: bytes) -> tuple[int, int]:
    """An image file's (height, width), read from its header (the pixels are not decoded)."""
    from PIL import Image

    try:
        width, height = Image.open(io.BytesIO(data)).size
    except (OSError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(f"cannot decode the image: {e}") from None
    check_image_size(width, height)
    return height, width


def check_image_size(width: int, height: int) -> None:
    """ValueError for an image too large, or too narrow, to process."""
    from PIL import Image

    if width * height > (Image.MAX_IMAGE_PIXELS or float("inf")):
        raise ValueError(f"an image of {width}x{height} pixels is larger than the {Image.MAX_IMAGE_PIXELS} pixels "
                         "allowed")
    if max(width, height) > MAX_ASPECT_RATIO * max(1, min(width, height)):
        # (Resized to the processor's shortest edge, a 4000x1 image of 97 bytes would be 1.3 million
        # pixels wide: gigabytes before its centre is cropped.)
        raise ValueError(f"an image of {width}x{height} pixels is too narrow: its sides may differ at most "
                         f"{MAX_ASPECT_RATIO} times")


def as_rgb(image: Image.Image) -> Image.Image:
    """An image's pixels as RGB (a transparent image over white, as vLLM converts it)."""
    from PIL import Image

    if image.mode == "RGBA":
        rgb = Image.new("RGB", image.size, (255, 255, 255))
        rgb.paste(image, mask=image.getchannel("A"))
        return rgb
    return image.convert("RGB")


def load_image_processor(directory: str | os.PathLike[str]) -> Any | None:
    """The model's image processor (transformers' AutoImageProcessor) from its
    ``preprocessor_config.json`` (or nested in ``processor_config.json``) in ``directory``; None
    where there is none."""
    if read_image_processor_config(directory) is None:
        return None
    import transformers
    from transformers import AutoImageProcessor

    kwargs: dict[str, Any] = {}
    if int(transformers.__version__.split(".")[0]) >= 5 and importlib.util.find_spec("torchvision") is None:
        kwargs["backend"] = "pil"  # (what transformers falls back to without torchvision, without its warning)
    return AutoImageProcessor.from_pretrained(str(directory), **kwargs)


def image_placeholder(tokenizer: Any, image_token_id: int, geometry: ImageGeometry) -> str:
    """The text that stands for an image in a message given to a template as text (vLLM's
    placeholder strings): the image token; Qwen2-VL's within its vision start and end tokens;
    Gemma 3's begin-of-image token (image_prompt_text expands it)."""
    token = tokenizer.convert_ids_to_tokens(image_token_id) or ""
    replacement = image_prompt_text(tokenizer, image_token_id, geometry)
    if replacement is not None:
        return replacement[0]
    return _within_vision_tokens(tokenizer, token) if geometry.native else token


def video_placeholder(tokenizer: Any, video_token_id: int | None) -> str:
    """The text that stands for a video in a message given to a template as text: Qwen2-VL's video
    token within its vision start and end tokens ("" for a model that takes no videos)."""
    if video_token_id is None:
        return ""
    return _within_vision_tokens(tokenizer, tokenizer.convert_ids_to_tokens(video_token_id) or "")


@dataclass(frozen=True)
class TimedVideoTokens:
    """Qwen3-VL's videos in a prompt (its processor's replace_video_token, at the token level as vLLM
    updates it): the video token (within its vision start and end tokens, where the template wrote
    them) becomes, for each temporal patch, its time as text ("<1.5 seconds>", tokenized alone), the
    vision start token, its placeholders, the vision end token."""

    tokenizer: Any
    video_token_id: int
    start_id: int
    end_id: int
    _times: dict[str, list[int]] = field(default_factory=dict, compare=False)

    def unwrapped(self, prompt_ids: list[int]) -> list[int]:
        """The prompt with each video token's vision start and end tokens around it dropped (each
        temporal patch gets its own)."""
        out: list[int] = []
        i = 0
        while i < len(prompt_ids):
            if prompt_ids[i:i + 3] == [self.start_id, self.video_token_id, self.end_id]:
                out.append(self.video_token_id)
                i += 3
            else:
                out.append(prompt_ids[i])
                i += 1
        return out

    def run(self, video: ProcessedVideo) -> tuple[list[int], list[int]]:
        """A video's tokens, and where each temporal patch's placeholders start within them."""
        ids: list[int] = []
        starts = []
        for seconds, part in zip(video.timestamps, video.parts, strict=True):
            text = f"<{seconds:.1f} seconds>"
            if text not in self._times:
                self._times[text] = list(self.tokenizer.encode(text, add_special_tokens=False))
            ids += self._times[text] + [self.start_id]
            starts.append(len(ids))
            ids += [self.video_token_id] * part.num_tokens + [self.end_id]
        return ids, starts


def timed_video_tokens(tokenizer: Any, video_token_id: int | None, geometry: ImageGeometry | None
                       ) -> TimedVideoTokens | None:
    """Qwen3-VL's video prompt text (``ImageGeometry.video_frame_pairs``); None for other models, and
    for a tokenizer without Qwen's vision start and end tokens (its videos are then refused)."""
    if video_token_id is None or geometry is None or not geometry.video_frame_pairs:
        return None
    vocabulary = tokenizer.get_vocab()
    if "<|vision_start|>" not in vocabulary or "<|vision_end|>" not in vocabulary:
        return None
    return TimedVideoTokens(tokenizer, video_token_id, vocabulary["<|vision_start|>"], vocabulary["<|vision_end|>"])


def _within_vision_tokens(tokenizer: Any, token: str) -> str:
    """Qwen2-VL's placeholder text: ``token`` within its vision start and end tokens, where the
    vocabulary has them."""
    vocabulary = tokenizer.get_vocab()
    if "<|vision_start|>" in vocabulary and "<|vision_end|>" in vocabulary:
        return f"<|vision_start|>{token}<|vision_end|>"
    return token


def image_prompt_text(tokenizer: Any, image_token_id: int, geometry: ImageGeometry) -> tuple[str, str] | None:
    """Gemma 3 (the model whose image tokens attend both ways): its template writes an image as its
    begin-of-image token, which its processor replaces, in the text, by the image's whole sequence:
    two newlines, that token, the image tokens, the end-of-image token, two newlines (here with one
    image token, expanded to the image's count like any model's). InternVL (tiled images): its
    template writes the image token, which its processor puts between <img> and </img>. (the text,
    its replacement); None for other models."""
    if geometry.tiled:
        token = tokenizer.convert_ids_to_tokens(image_token_id)
        begin = getattr(tokenizer, "start_image_token", None) or "<img>"
        end = getattr(tokenizer, "end_image_token", None) or "</img>"
        return token, f"{begin}{token}{end}"
    if not geometry.bidirectional:
        return None
    begin = getattr(tokenizer, "boi_token", None) or "<start_of_image>"
    end = getattr(tokenizer, "eoi_token", None) or "<end_of_image>"
    return begin, f"\n\n{begin}{tokenizer.convert_ids_to_tokens(image_token_id)}{end}\n\n"


def expand_image_tokens(prompt_ids: list[int], image_token_id: int, runs: list[list[int]],
                        placeholder: str = "") -> tuple[list[int], list[int]]:
    """The prompt with each image token replaced by its image's run of placeholder ids (``runs``, in
    prompt order), and where each run starts. ValueError unless the prompt has exactly one image
    token per image."""
    ids, offsets = expand_media_tokens(prompt_ids, {image_token_id: ("image", runs, placeholder)})
    return ids, offsets[image_token_id]


def expand_media_tokens(prompt_ids: list[int], media: dict[int, tuple[str, list[list[int]], str]]
                        ) -> tuple[list[int], dict[int, list[int]]]:
    """The prompt with each media token (an image's, a video's) replaced by its item's run of
    placeholder ids: ``media`` maps each token to (its modality, its items' runs in prompt order, its
    text); and, per token, where each run starts. ValueError unless the prompt has exactly one token
    per item."""
    for token, (modality, runs, placeholder) in media.items():
        count = sum(1 for t in prompt_ids if t == token)
        if count != len(runs):
            text = f" {placeholder!r}" if placeholder else ""
            raise ValueError(f"the prompt has {count} {modality} token(s){text} for {len(runs)} {modality}(s): the "
                             f"chat template must write one per {modality} (a text that holds the token, or a "
                             f"template that leaves out some messages' {modality}s, breaks the count)")
    pending = {token: iter(runs) for token, (_, runs, _) in media.items()}
    out: list[int] = []
    offsets: dict[int, list[int]] = {token: [] for token in media}
    for t in prompt_ids:
        if t in pending:
            offsets[t].append(len(out))
            out += next(pending[t])
        else:
            out.append(t)
    return out, offsets


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the vision encoder takes it ([C, H, W]), and its digest."""

    identifier: str
    pixel_values: TensorData
    # The image's own (height, width), and its placeholders' count for the model.
    image_size: tuple[int, int]
    num_tokens: int

    @property
    def size_bytes(self) -> int:
        return len(self.pixel_values.data)


class ProcessedImageCache:
    """vLLM's multi-modal processor cache (--mm-processor-cache-gb): processed images by a digest of
    their encoded bytes, least recently used evicted past ``capacity_bytes`` (of pixel values), so an
    image sent again (every turn of a conversation resends its images) is neither decoded nor
    resized again. Counts lookups and hits (vLLM's mm_cache_queries / mm_cache_hits)."""

    def __init__(self, capacity_bytes: int, on_lookup: Callable[[bool], None] | None = None) -> None:
        """``on_lookup(hit)``: told of each lookup (the router's metrics)."""
        self.capacity_bytes = capacity_bytes
        self.on_lookup = on_lookup
        self.size_bytes = 0
        self.entries: OrderedDict[bytes, ProcessedImage] = OrderedDict()
        self.queries = 0
        self.hits = 0

    @staticmethod
    def key(data: bytes) -> bytes:
        return hashlib.blake2b(data, digest_size=16).digest()

    def get(self, key: bytes) -> ProcessedImage | None:
        self.queries += 1
        image = self.entries.get(key)
        if image is not None:
            self.hits += 1
            self.entries.move_to_end(key)
        if self.on_lookup is not None:
            self.on_lookup(image is not None)
        return image

    def put(self, key: bytes, image: ProcessedImage) -> None:
        size = image.size_bytes
        if size > self.capacity_bytes or key in self.entries:
            return
        self.entries[key] = image
        self.size_bytes += size
        while self.size_bytes > self.capacity_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.size_bytes -= evicted.size_bytes


async def _all_loaded(loads: Iterable[Awaitable[Any]]) -> list[Any]:
    """Every load's result, all awaited at once; the first failure raised once all have ended."""
    loaded = await asyncio.gather(*loads, return_exceptions=True)
    error = next((e for e in loaded if isinstance(e, BaseException)), None)
    if error is not None:
        raise error
    return loaded


def _set_size(image_processor: Any, key: str, value: dict[str, int]) -> None:
    """Set an image processor's size-like setting (``size``, ``patch_size``) to ``value``: as a dict, or
    as the processor's own size class where it holds one (a config may give a patch_size as a number)."""
    current = getattr(image_processor, key, None)
    setattr(image_processor, key, value if current is None or isinstance(current, dict | int)
            else type(current)(**value))


class MultiModalProcessor:
    """A vision-language model's images, as the router prepares them: the placeholder token (and its
    text, for templates given text), how many stand for an image, the image processor, and the
    limit of images per prompt (vLLM's --limit-mm-per-prompt)."""

    def __init__(self, image_token_id: int, geometry: ImageGeometry, image_processor: Any | None, model_id: str,
                 placeholder: str, media: MediaConnector | None = None,
                 max_images: int = DEFAULT_LIMIT_PER_PROMPT, cache_bytes: int = 0,
                 on_cache_lookup: Callable[[bool], None] | None = None,
                 prompt_replacement: tuple[str, str] | None = None, video_token_id: int | None = None,
                 video_placeholder: str = "", max_videos: int = DEFAULT_LIMIT_PER_PROMPT,
                 video_sampling: VideoSampling = DEFAULT_SAMPLING, timed_videos: TimedVideoTokens | None = None,
                 tiled_images: TiledImageTokens | None = None) -> None:
        self.image_token_id = image_token_id
        # (Idefics3: each image cut into tiles written with their rows and columns: router.image_tiles.)
        self.tiled_images = tiled_images
        # Videos (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: geometry.takes_videos): their token and its text; None: none.
        # (Qwen3-VL's videos only with their timed text: timed_video_tokens.)
        takes_videos = geometry.takes_videos and (timed_videos is not None or not geometry.video_frame_pairs)
        self.video_token_id = video_token_id if takes_videos else None
        self.video_placeholder = video_placeholder
        # (Qwen3-VL: each temporal patch's time written before it: timed_video_tokens.)
        self.timed_videos = timed_videos
        self.max_videos = max_videos
        self.video_sampling = video_sampling  # (--media-io-kwargs)
        # How many placeholders an image is (LLaVA: a fixed count; LLaVA-NeXT: by its size).
        self.geometry = geometry
        self.image_processor = image_processor
        self.model_id = model_id  # (in each image's digest: equal pixels under another model differ)
        self.placeholder = placeholder
        # (Gemma 3: what its template writes for an image, and the sequence its processor makes of it:
        # image_prompt_text.)
        self.prompt_replacement = prompt_replacement
        self.media = media or MediaConnector()
        self.max_images = max_images
        if image_processor is not None and geometry.grid_pinpoints:
            # The model's pinpoints (config.json) decide how its rows are unpacked: the processor tiles
            # by them, whatever its own config lists (a processor config overriding them would tile
            # other grids than the model reads, without an error).
            ours = [list(p) for p in geometry.grid_pinpoints]
            if [list(p) for p in getattr(image_processor, "image_grid_pinpoints", None) or ()] != ours:
                logger.warning("%s: the image processor's image_grid_pinpoints differ from config.json's; the "
                               "model's are used", model_id)
                image_processor.image_grid_pinpoints = ours
        if image_processor is not None and getattr(image_processor, "do_pan_and_scan", None):
            # (Gemma 3's pan-and-scan crops are not served: each image is its one whole picture.)
            logger.warning("%s: the image processor's do_pan_and_scan is not served; images are taken whole",
                           model_id)
            image_processor.do_pan_and_scan = False
        if image_processor is not None and geometry.pixtral:
            # Pixtral: the engines' longest side and token side (Mistral 3's two patches: its processor
            # passes the merged side as the image processor's patch_size at each call).
            side = geometry.patch_size * geometry.spatial_merge
            _set_size(image_processor, "size", {"longest_edge": geometry.longest_edge})
            _set_size(image_processor, "patch_size", {"height": side, "width": side})
        if image_processor is not None and geometry.tiled:
            # InternVL: tiles by the engines' counts (its processor asks for them at every call).
            image_processor.crop_to_patches = True
            image_processor.min_patches, image_processor.max_patches = geometry.min_tiles, geometry.max_tiles
            _set_size(image_processor, "size", {"height": geometry.image_size, "width": geometry.image_size})
        if image_processor is not None and geometry.tile_resize:
            # Idefics3: the engines' resize before tiling (--mm-processor-kwargs), over the processor's.
            _set_size(image_processor, "size", {"longest_edge": geometry.tile_resize})
        if image_processor is not None and geometry.native:
            # Qwen2-VL: the engines' pixel range (their processor config, or --mm-processor-kwargs)
            # decides each image's grid: the processor resizes into it.
            _set_size(image_processor, "size", {"shortest_edge": geometry.min_pixels,
                                                "longest_edge": geometry.max_pixels})
            for key in ("min_pixels", "max_pixels"):  # (transformers 4's processors read these first)
                if getattr(image_processor, key, None) is not None:
                    setattr(image_processor, key, getattr(geometry, key))
        # (None: --mm-processor-cache-gb 0, every image processed as it comes.)
        self.cache = ProcessedImageCache(cache_bytes, on_cache_lookup) if cache_bytes > 0 else None

    def prompt_text(self, text: str) -> str:
        """A rendered prompt with images, as the model's processor writes it before tokenizing
        (Gemma 3: each begin-of-image token made the image's whole sequence; others: as it is)."""
        if self.prompt_replacement is None:
            return text
        return text.replace(*self.prompt_replacement)

    def check_count(self, num_images: int, modality: str = "image") -> None:
        """ValueError for more images (or videos) than a prompt may hold, or any for a model that
        cannot take them."""
        if num_images and modality == "video" and self.video_token_id is None:
            raise ValueError(f"the model {self.model_id!r} takes no videos")
        most = self.max_videos if modality == "video" else self.max_images
        if num_images > most:
            raise ValueError(f"At most {most} {modality}(s) may be provided in one prompt (--limit-mm-per-prompt).")
        if num_images and self.image_processor is None:
            raise ValueError(f"the model {self.model_id!r} has no image processor ({IMAGE_PROCESSOR_FILE}): "
                             f"it cannot take {modality}s")

    @property
    def counts_by_size(self) -> bool:
        """Whether an image's token count depends on its size (known once it is loaded)."""
        return self.geometry.counts_by_size or self.tiled_images is not None

    def image_runs(self, sizes: Sequence[tuple[int, int] | None]) -> tuple[list[list[int]], list[list[int]]]:
        """Each image's run of tokens by its (height, width) (None: the fewest it may take), and where
        its encoder inputs' placeholders start within it (Idefics3: each tile's; others: the run's)."""
        geometry, token, tiled = self.geometry, self.image_token_id, self.tiled_images
        if tiled is not None:
            made = [tiled.run(tiled.grid(*size) if size is not None else (0, 0)) for size in sizes]
            return [ids for ids, _ in made], [starts for _, starts in made]
        runs = [geometry.placeholder_ids(token, *size) if size is not None
                else geometry.placeholder_ids(token, 1, 1) if geometry.pixtral else [token] * geometry.min_tokens
                for size in sizes]
        return runs, [[0] for _ in sizes]

    def process_video(self, data: bytes) -> ProcessedVideo:
        """(CPU work: run in a thread.) A video file as the vision encoder takes it (router.video)."""
        video = decode_video(data, self.geometry, self.video_sampling)
        processor = self.image_processor
        return process_video(video, self.geometry, processor.image_mean, processor.image_std, self.model_id)

    async def load_video(self, url: str) -> ProcessedVideo:
        data = await self.media.for_videos().fetch_bytes(url)
        if self.cache is None:
            return await asyncio.to_thread(self.process_video, data)
        # (up to 256 MiB to digest; the same bytes sampled otherwise are another video)
        key = b"video" + await asyncio.to_thread(ProcessedImageCache.key, data)
        video = self.cache.get(key)
        if video is None:
            video = await asyncio.to_thread(self.process_video, data)
            self.cache.put(key, video)  # type: ignore[arg-type]
        return video  # type: ignore[return-value]

    async def load_videos(self, urls: list[str]) -> list[ProcessedVideo]:
        """The videos at ``urls``, all loaded at once (the first failure raised)."""
        return await _all_loaded(map(self.load_video, urls))

    def expand_media(self, prompt_ids: list[int], image_sizes: list[tuple[int, int]], videos: list[ProcessedVideo]
                     ) -> tuple[list[int], list[int], list[int]]:
        """The prompt with each image token expanded to its image's placeholders (by ``image_sizes``)
        and each video token to its video's (Qwen3-VL's: its timed temporal patches): (ids, the images'
        offsets, the offsets of the videos' parts, ``ProcessedVideo.parts``)."""
        image_runs, image_starts = self.image_runs(image_sizes)
        media = {self.image_token_id: ("image", image_runs, self.placeholder)}
        starts: list[list[int]] = [[0] for _ in videos]
        if videos:
            assert self.video_token_id is not None
            runs = [[self.video_token_id] * v.num_tokens for v in videos]
            if self.timed_videos is not None:
                prompt_ids = self.timed_videos.unwrapped(prompt_ids)
                runs, starts = (list(x) for x in zip(*map(self.timed_videos.run, videos), strict=True))
            media[self.video_token_id] = ("video", runs, self.video_placeholder)
        ids, offsets = expand_media_tokens(prompt_ids, media)
        video_offsets = [offset + start for offset, parts in zip(offsets.get(self.video_token_id, []), starts,
                                                                 strict=True) for start in parts]
        image_offsets = [offset + start for offset, parts in zip(offsets[self.image_token_id], image_starts,
                                                                 strict=True) for start in parts]
        return ids, image_offsets, video_offsets

    def expand(self, prompt_ids: list[int], num_images: int,
               sizes: list[tuple[int, int]] | None = None) -> tuple[list[int], list[int]]:
        """``sizes``: each image's (height, width); when None, each image at the geometry's fixed
        count or, for an image counted by its size, the fewest tokens it may take. The offsets are
        each encoder input's (Idefics3: each tile's)."""
        runs, starts = self.image_runs(sizes if sizes is not None else [None] * num_images)
        ids, offsets = expand_image_tokens(prompt_ids, self.image_token_id, runs, self.placeholder)
        return ids, [offset + start for offset, parts in zip(offsets, starts, strict=True) for start in parts]

    def process(self, data: bytes) -> ProcessedImage | TiledImage:
        """(CPU work: run in a thread.)"""
        return self.process_image(decode_image(data))

    def process_image(self, image: Image.Image) -> ProcessedImage | TiledImage:
        """A decoded image (RGB) as the vision encoder takes it, and its digest (Idefics3's: its tiles)."""
        # ([C, H, W]; LLaVA-NeXT's: [tiles, C, H, W]; Qwen2-VL's, the batch's patches: [patches, C x T x P x P];
        # Pixtral's [C, H, W] of the image's resized size)
        size = (image.height, image.width)
        if self.tiled_images is not None:
            return self._tiled(image)
        expected = self.geometry.input_shape(*size)  # (first: its refusals say what is wrong with the image)
        processed = self.image_processor(images=[image], return_tensors="np")["pixel_values"]
        processed = processed if self.geometry.native or self.geometry.tiled else processed[0]
        if tuple(processed.shape) != expected:  # (a processor config the model's does not match)
            raise ValueError(f"the image processor made pixel values of shape {list(processed.shape)} for a "
                             f"{size[1]}x{size[0]} image, the model takes {list(expected)}: its "
                             f"preprocessor_config.json does not match its config.json")
        pixel_values = TensorData.from_array(processed)
        return ProcessedImage(feature_identifier("image", pixel_values, extra=f"{self.model_id}|{size}"), pixel_values,
                              size, self.geometry.num_tokens(*size))

    def _tiled(self, image: Image.Image) -> TiledImage:
        """Idefics3's image: its tiles (and the whole image as one), each an encoder input."""
        assert self.tiled_images is not None
        size = (image.height, image.width)
        out = self.image_processor(images=[image], return_tensors="np", return_row_col_info=True)
        grid = (int(out["rows"][0][0]), int(out["cols"][0][0]))
        tiles = out["pixel_values"][0]
        expected = self.tiled_images.grid(*size)
        if grid != expected or len(tiles) != grid[0] * grid[1] + 1 \
                or tuple(tiles.shape[1:]) != self.geometry.input_shape(*size):
            raise ValueError(f"the image processor cut a {size[1]}x{size[0]} image into {len(tiles)} tiles of "
                             f"{list(tiles.shape[1:])} ({grid[0]}x{grid[1]}), the model takes {expected[0]}x"
                             f"{expected[1]} and the whole image of {list(self.geometry.input_shape(*size))}")
        processed = []
        for tile in tiles:
            data = TensorData.from_array(tile)
            processed.append(ProcessedImage(feature_identifier("image", data, extra=self.model_id), data, size,
                                            self.geometry.base_tokens))
        return TiledImage(tuple(processed), grid, size)

    async def load(self, url: str) -> ProcessedImage | TiledImage:
        data = await self.media.fetch_bytes(url)
        if self.cache is None:
            return await asyncio.to_thread(self.process, data)
        key = ProcessedImageCache.key(data)
        image = self.cache.get(key)
        if image is None:
            image = await asyncio.to_thread(self.process, data)
            self.cache.put(key, image)
        return image

    async def image_sizes(self, urls: list[str]) -> list[tuple[int, int]]:
        """Each image's (height, width), from its header alone (nothing decoded or processed)."""
        datas = await asyncio.gather(*map(self.media.fetch_bytes, urls))
        return [image_size_of(data) for data in datas]

    async def load_all(self, urls: list[str]) -> list[ProcessedImage | TiledImage]:
        """The images at ``urls``, all loaded at once (the first failure raised)."""
        return await _all_loaded(map(self.load, urls))

    def features(self, images: Sequence[ProcessedImage | TiledImage], prompt_ids: list[int],
                 offsets: list[int], videos: Sequence[ProcessedVideo] = (),
                 video_offsets: Sequence[int] = ()) -> list[MultiModalFeature]:
        """Each image (and video: each of its parts, ``ProcessedVideo.parts``) over its placeholders,
        from its offset in the (expanded) prompt, in prompt order."""
        inputs = [tile for image in images for tile in (image.tiles if isinstance(image, TiledImage) else [image])]
        sized = self.geometry.counts_by_size  # (an Idefics3 tile is a fixed-size image to the engine)
        features = [MultiModalFeature("image", image.identifier, offset, image.num_tokens, image.pixel_values,
                                      image.image_size if sized else None)
                    for image, offset in zip(inputs, offsets, strict=True)]
        parts = [(video, part) for video in videos for part in video.parts]
        features += [MultiModalFeature("video", part.identifier, offset, part.num_tokens, part.pixel_values,
                                       video.frame_size, part.num_frames, part.second_per_grid)
                     for (video, part), offset in zip(parts, video_offsets, strict=True)]
        features.sort(key=lambda f: f.offset)
        check_features(features, prompt_ids, self.image_token_id, self.geometry, self.video_token_id)
        return features
