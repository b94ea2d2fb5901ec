"""A vision-language checkpoint's image side, as its config.json states it (LLaVA: a CLIP vision
tower, a two-layer projector into the language model's width, and an image placeholder token)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import msgspec

from engine_core.multimodal import ImageGeometry

# Vision-language architectures whose images we encode -> how their language model is named by its
# text_config's model_type (the decoder is ours: the Llama block).
LLAVA_ARCHITECTURES = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration")
TEXT_DECODER_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                              "ministral3": "Ministral3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# transformers' LlavaNextConfig default image_grid_pinpoints.
_NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
# transformers' CLIPVisionConfig defaults (a config.json lists only what differs).
_CLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                  "num_channels": 3, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu",
                  "layer_norm_eps": 1e-5}


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float
    # Encoder layers run: the features are the hidden states after this many (LLaVA's
    # vision_feature_layer -2 of 24 layers: 23); the later layers and the post-norm are not built.
    num_layers_used: int
    # "default": the patches' features (the class token dropped); "full": the class token's too.
    select_strategy: str
    projector_act: str
    projector_bias: bool
    # The prompt token an image's rows replace (``geometry.num_tokens`` of them per image).
    image_token_id: int
    # LLaVA-NeXT ("anyres"): the resolutions an image is fitted into and cut into tower-sized tiles,
    # its features then unpadded, each row ended by the learnt ``image_newline``; () for LLaVA.
    grid_pinpoints: tuple[tuple[int, int], ...] = ()

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """One tile's pixel values as the tower takes them: (channels, height, width)."""
        return (self.num_channels, self.image_size, self.image_size)

    @property
    def geometry(self) -> ImageGeometry:
        return ImageGeometry(self.image_size, self.patch_size, self.num_channels, self.select_strategy == "full",
                             self.grid_pinpoints)

    @property
    def tokens_per_image(self) -> int:
        """The most tokens one image may take (LLaVA's every image's count)."""
        return self.geometry.max_tokens


def text_architecture(cfg: dict[str, Any]) -> str:
    """The decoder class of a LLaVA checkpoint's language model."""
    model_type = (cfg.get("text_config") or {}).get("model_type", "llama")
    if model_type not in TEXT_DECODER_BY_MODEL_TYPE:
        raise ValueError(f"a LLaVA checkpoint's language model must be one of "
                         f"{tuple(TEXT_DECODER_BY_MODEL_TYPE)} (text_config.model_type), got {model_type!r}")
    return TEXT_DECODER_BY_MODEL_TYPE[model_type]


def with_full_text_config(cfg: dict[str, Any], decoders: dict[str, str] | None = None) -> dict[str, Any]:
    """``cfg`` with its text_config completed by transformers' defaults for its model type: llava-hf
    checkpoints list only what differs from them (llava-1.5-7b's names five keys, no width or depth).
    ``decoders``: the language models served (a model type's decoder class; LLaVA's when None)."""
    from transformers import AutoConfig

    text = dict(cfg.get("text_config") or {})
    if decoders is None:
        text_architecture(cfg)  # (refuses a language model we do not serve, before transformers reads it)
    elif text.get("model_type", "llama") not in decoders:
        raise ValueError(f"the checkpoint's language model must be one of {tuple(decoders)} "
                         f"(text_config.model_type), got {text.get('model_type')!r}")
    given = {k: v for k, v in text.items() if k != "model_type"}
    full = AutoConfig.for_model(text.get("model_type", "llama"), **given).to_dict()
    return {**cfg, "text_config": {**full, **text}}


def vision_config_from_dict(cfg: dict[str, Any]) -> VisionConfig:
    """LLaVA's vision side from its config.json (transformers' LlavaConfig names and defaults)."""
    vision = {**_CLIP_DEFAULTS, **(cfg.get("vision_config") or {})}
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ValueError(f"the vision tower must be CLIP's (vision_config.model_type 'clip_vision_model'), "
                         f"got {vision['model_type']!r}")
    num_layers = int(vision["num_hidden_layers"])
    layer = cfg.get("vision_feature_layer", -2)
    if not isinstance(layer, int) or not -num_layers - 1 <= layer <= num_layers:
        raise ValueError(f"vision_feature_layer must be one layer's index (-{num_layers + 1}..{num_layers}), "
                         f"got {layer!r}")
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full', got {strategy!r}")
    token = cfg.get("image_token_index", cfg.get("image_token_id", 32000))
    if int(vision["image_size"]) % int(vision["patch_size"]):
        raise ValueError(f"image_size {vision['image_size']} is not a multiple of patch_size {vision['patch_size']}")
    pinpoints: tuple[tuple[int, int], ...] = ()
    if cfg["architectures"][0] == "LlavaNextForConditionalGeneration":
        # (transformers' LlavaNextConfig default, where a config lists none)
        pinpoints = tuple((int(h), int(w)) for h, w in cfg.get("image_grid_pinpoints") or _NEXT_PINPOINTS)
        side = int(vision["image_size"])
        if not pinpoints or any(h % side or w % side for h, w in pinpoints):
            raise ValueError(f"image_grid_pinpoints must list resolutions that are multiples of the tower's image_size "
                             f"{side}, got {cfg.get('image_grid_pinpoints')!r}")
        if strategy != "default":
            raise ValueError("LLaVA-NeXT's vision_feature_select_strategy must be 'default' (its tiles' features "
                             "have no class token)")
    return VisionConfig(
        hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
        num_attention_heads=int(vision["num_attention_heads"]), num_channels=int(vision["num_channels"]),
        image_size=int(vision["image_size"]), patch_size=int(vision["patch_size"]),
        hidden_act=str(vision["hidden_act"]), layer_norm_eps=float(vision["layer_norm_eps"]),
        # (Hidden states are indexed as transformers returns them: 0 is the embeddings' output.)
        num_layers_used=layer if layer >= 0 else num_layers + 1 + layer,
        select_strategy=strategy, projector_act=str(cfg.get("projector_hidden_act", "gelu")),
        projector_bias=bool(cfg.get("multimodal_projector_bias", True)), image_token_id=int(token),
        grid_pinpoints=pinpoints)


# Qwen2-VL and Qwen2.5-VL: a native-resolution vision tower (an image keeps its aspect, resized to a
# multiple of 28 pixels within a pixel range; 14-pixel patches, 2x2 of them merged into one token)
# in front of a Qwen2 decoder whose rotary positions are three-dimensional (M-RoPE).
QWEN_VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
# transformers' Qwen2VLImageProcessor defaults: the resized image's pixel range.
QWEN_VL_MIN_PIXELS = 56 * 56
QWEN_VL_MAX_PIXELS = 28 * 28 * 1280
# transformers' Qwen2VLVideoProcessor defaults: each frame's pixel range.
QWEN_VL_VIDEO_MIN_PIXELS = 128 * 28 * 28
QWEN_VL_VIDEO_MAX_PIXELS = 768 * 28 * 28


@dataclass(frozen=True)
class FrameSampling:
    """How a video processor samples a video's frames: ``fps`` a second, ``min_frames`` to
    ``max_frames`` (its config's keys; transformers' Qwen2-VL and Qwen3-VL defaults)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768


def frame_sampling_from(video_processor: dict[str, Any] | None) -> FrameSampling:
    """A video processor config's frame sampling (its fps, min_frames and max_frames)."""
    config = video_processor or {}
    default = FrameSampling()
    sampling = FrameSampling(float(config.get("fps") or default.fps),
                             int(config.get("min_frames") or default.min_frames),
                             int(config.get("max_frames") or default.max_frames))
    if not (0 < sampling.fps < float("inf") and 1 <= sampling.min_frames <= sampling.max_frames):
        raise ValueError(f"the video processor's fps ({sampling.fps}) must be > 0 and its min_frames "
                         f"({sampling.min_frames}) at least 1 and at most its max_frames ({sampling.max_frames})")
    return sampling


def with_videos(geometry: ImageGeometry, min_pixels: int, max_pixels: int, frames: FrameSampling,
                **more: Any) -> ImageGeometry:
    """``geometry`` taking videos: their pixel range and frame sampling (and ``more`` of its fields)."""
    return msgspec.structs.replace(geometry, video_min_pixels=min_pixels, video_max_pixels=max_pixels,
                                   video_fps=frames.fps, video_min_frames=frames.min_frames,
                                   video_max_frames=frames.max_frames, **more)


class NativeImageSide:
    """What a native-resolution tower's config (Qwen2-VL's, Qwen3-VL's) tells of its images: their
    geometry, from its patch and merge sizes and the processor's pixel range."""

    patch_size: int
    spatial_merge_size: int
    in_channels: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int

    @property
    def geometry(self) -> ImageGeometry:
        return ImageGeometry(self.patch_size * self.spatial_merge_size, self.patch_size, self.in_channels,
                             merge_size=self.spatial_merge_size, temporal_patch_size=self.temporal_patch_size,
                             min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    @property
    def tokens_per_image(self) -> int:
        """The most tokens one image may take."""
        return self.geometry.max_tokens


@dataclass(frozen=True)
class QwenVisionConfig(NativeImageSide):
    """A Qwen2-VL / Qwen2.5-VL vision tower (config.json's vision_config, transformers' names where
    they have one) and the image side of the model around it."""

    # Qwen2.5-VL's tower: RMSNorms, a gated MLP, attention within windows except in
    # ``fullatt_block_indexes``; Qwen2-VL's: LayerNorms, a two-layer MLP, every block full attention.
    windowed: bool
    depth: int
    # The tower's width (Qwen2-VL's ``embed_dim``, Qwen2.5-VL's ``hidden_size``) and its MLP's.
    hidden_size: int
    intermediate_size: int
    num_heads: int
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    # The merger's output width: the language model's (Qwen2-VL's vision ``hidden_size``, Qwen2.5-VL's
    # ``out_hidden_size``).
    out_hidden_size: int
    # Qwen2.5-VL: a window's side in pixels, and the blocks that attend over the whole image.
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    # The prompt token an image's rows replace.
    image_token_id: int
    # The resized image's pixel range (preprocessor_config.json's, transformers' defaults otherwise).
    min_pixels: int = QWEN_VL_MIN_PIXELS
    max_pixels: int = QWEN_VL_MAX_PIXELS
    # Videos: the prompt token a video's rows replace; each frame's pixel range (the video
    # processor's config, transformers' Qwen2VLVideoProcessor defaults otherwise); Qwen2.5-VL's
    # M-RoPE time positions per second (its vision_config's tokens_per_second; 0 for Qwen2-VL, whose
    # temporal patches count one by one).
    video_token_id: int = 151656
    video_min_pixels: int = QWEN_VL_VIDEO_MIN_PIXELS
    video_max_pixels: int = QWEN_VL_VIDEO_MAX_PIXELS
    tokens_per_second: float = 0.0
    video_frames: FrameSampling = FrameSampling()

    @property
    def geometry(self) -> ImageGeometry:
        return with_videos(super().geometry, self.video_min_pixels, self.video_max_pixels, self.video_frames,
                           tokens_per_second=self.tokens_per_second)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_input_size(self) -> int:
        """One patch's pixel values as the processor flattens them: channels x frames x side x side."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


def qwen_vision_config_from_dict(cfg: dict[str, Any], processor: dict[str, Any] | None = None,
                                 video_processor: dict[str, Any] | None = None) -> QwenVisionConfig:
    """Qwen2-VL's or Qwen2.5-VL's vision side from its config.json, preprocessor_config.json (the
    resized images' pixel range) and video processor config (the frames'); transformers' defaults
    without them."""
    windowed = cfg["architectures"][0] == "Qwen2_5_VLForConditionalGeneration"
    vision = dict(cfg.get("vision_config") or {})
    processor = processor or {}
    min_pixels, max_pixels = _pixel_range(processor, QWEN_VL_MIN_PIXELS, QWEN_VL_MAX_PIXELS)
    if windowed:  # (transformers' Qwen2_5_VLVisionConfig defaults)
        width = int(vision.get("hidden_size", 3584))
        mlp, out = int(vision.get("intermediate_size", 3420)), int(vision.get("out_hidden_size", 3584))
        act = str(vision.get("hidden_act", "silu"))
    else:  # (Qwen2VLVisionConfig's)
        width = int(vision.get("embed_dim", 1280))
        mlp, out = width * int(vision.get("mlp_ratio", 4)), int(vision.get("hidden_size", 3584))
        act = str(vision.get("hidden_act", "quick_gelu"))
    vc = QwenVisionConfig(
        windowed=windowed, depth=int(vision.get("depth", 32)), hidden_size=width, intermediate_size=mlp,
        num_heads=int(vision.get("num_heads", 16)), hidden_act=act,
        in_channels=int(vision.get("in_channels", vision.get("in_chans", 3))),
        patch_size=int(vision.get("patch_size", vision.get("spatial_patch_size", 14))),
        temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
        spatial_merge_size=int(vision.get("spatial_merge_size", 2)), out_hidden_size=out,
        window_size=int(vision.get("window_size", 112)) if windowed else 0,
        fullatt_block_indexes=tuple(int(i) for i in vision.get("fullatt_block_indexes", (7, 15, 23, 31)))
        if windowed else (),
        image_token_id=int(cfg.get("image_token_id", 151655)), min_pixels=min_pixels, max_pixels=max_pixels,
        video_token_id=int(cfg.get("video_token_id", 151656)),
        # (transformers' Qwen2_5_VLVisionConfig default where the config gives none; the releases give 2)
        tokens_per_second=float(vision.get("tokens_per_second", 4)) if windowed else 0.0)
    video_min, video_max = _pixel_range(video_processor or {}, QWEN_VL_VIDEO_MIN_PIXELS, QWEN_VL_VIDEO_MAX_PIXELS)
    vc = dataclasses.replace(vc, video_min_pixels=video_min, video_max_pixels=video_max,
                             video_frames=frame_sampling_from(video_processor))
    _check_processor(processor, vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size)
    if vc.hidden_size % vc.num_heads or vc.head_dim % 4:
        raise ValueError(f"the vision tower's width {vc.hidden_size} must split into {vc.num_heads} heads whose "
                         "width is a multiple of 4 (its 2-D rotary embedding)")
    return vc


def _pixel_range(processor: dict[str, Any], default_min: int, default_max: int) -> tuple[int, int]:
    """A Qwen-VL image processor config's (min_pixels, max_pixels): its own keys, or its size's edges."""
    size = processor.get("size") if isinstance(processor.get("size"), dict) else {}
    min_pixels = int(processor.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
                     or default_min)
    max_pixels = int(processor.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
                     or default_max)
    if not 0 < min_pixels <= max_pixels:
        raise ValueError(f"the image processor's min_pixels ({min_pixels}) must be positive and at most its "
                         f"max_pixels ({max_pixels})")
    return min_pixels, max_pixels


def _check_processor(processor: dict[str, Any], patch_size: int, merge_size: int, temporal_patch_size: int) -> None:
    for key, ours in (("patch_size", patch_size), ("merge_size", merge_size),
                      ("temporal_patch_size", temporal_patch_size)):
        if processor.get(key) is not None and int(processor[key]) != ours:
            raise ValueError(f"preprocessor_config.json's {key} {processor[key]} is not the vision tower's {ours}")


def qwen3_vision_config_from_dict(cfg: dict[str, Any], processor: dict[str, Any] | None = None,
                                  video_processor: dict[str, Any] | None = None) -> Qwen3VisionConfig:
    """Qwen3-VL's vision side from its config.json, preprocessor_config.json and video processor
    config (a whole video's pixel range)."""
    processor = processor or {}
    vc = Qwen3VisionConfig.from_hf(dict(cfg.get("vision_config") or {}))
    min_pixels, max_pixels = _pixel_range(processor, QWEN3_VL_MIN_PIXELS, QWEN3_VL_MAX_PIXELS)
    video_min, video_max = _pixel_range(video_processor or {}, QWEN3_VL_VIDEO_MIN_PIXELS, QWEN3_VL_VIDEO_MAX_PIXELS)
    _check_processor(processor, vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size)
    _check_processor(video_processor or {}, vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size)
    return dataclasses.replace(vc, image_token_id=int(cfg.get("image_token_id", 151655)), min_pixels=min_pixels,
                               max_pixels=max_pixels, video_token_id=int(cfg.get("video_token_id", 151656)),
                               video_min_pixels=video_min, video_max_pixels=video_max,
                               video_frames=frame_sampling_from(video_processor))


def native_vision_config(cfg: dict[str, Any], processor: dict[str, Any] | None = None,
                         video_processor: dict[str, Any] | None = None) -> QwenVisionConfig | Qwen3VisionConfig:
    """A native-resolution model's (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) vision side."""
    if cfg["architectures"][0] in QWEN3_VL_ARCHITECTURES:
        return qwen3_vision_config_from_dict(cfg, processor, video_processor)
    return qwen_vision_config_from_dict(cfg, processor, video_processor)


def qwen_vl_text_config(cfg: dict[str, Any], decoder: str = "Qwen2ForCausalLM") -> dict[str, Any]:
    """A Qwen-VL config's language model as a ``decoder`` config: its text_config (transformers 5's
    layout), or the top level's keys (the released Qwen2-VL checkpoints': everything but vision_config)."""
    text = dict(cfg.get("text_config") or {k: v for k, v in cfg.items() if k != "vision_config"})
    for key in ("eos_token_id", "torch_dtype", "dtype", "tie_word_embeddings"):
        if cfg.get(key) is not None:
            text.setdefault(key, cfg[key])
    if cfg.get("tie_word_embeddings") is not None:  # (transformers ties the head by the top level's)
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    text["architectures"] = [decoder]
    return text


def mrope_section(cfg: dict[str, Any]) -> tuple[int, ...] | None:
    """M-RoPE's split of the rotary frequencies among (time, height, width) positions, from a
    config's rope_scaling (or transformers 5's rope_parameters); None where there is none."""
    for key in ("rope_parameters", "rope_scaling"):
        value = cfg.get(key)
        if isinstance(value, dict) and value.get("mrope_section"):
            return tuple(int(v) for v in value["mrope_section"])
    return None


# Qwen3-VL: Qwen2-VL's native-resolution images (16-pixel patches, 2x2 merged) before a Qwen3 decoder
# with interleaved M-RoPE, and DeepStack: rows from the tower's inner blocks added to the image
# tokens' hidden states after the decoder's first layers.
QWEN3_VL_ARCHITECTURES = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
# transformers' Qwen3VLMoeTextConfig defaults for the routed experts (its router always renormalises).
QWEN3_VL_MOE_TEXT_DEFAULTS = {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                              "norm_topk_prob": True}
# transformers' Qwen3-VL processor defaults (its size's shortest and longest edge, in pixels).
QWEN3_VL_MIN_PIXELS = 65536
QWEN3_VL_MAX_PIXELS = 16777216
# transformers' Qwen3VLVideoProcessor defaults: the pixel range of all a video's frames together.
QWEN3_VL_VIDEO_MIN_PIXELS = 128 * 32 * 32
QWEN3_VL_VIDEO_MAX_PIXELS = 768 * 32 * 32
# transformers' Qwen3VLVisionConfig defaults (a config.json may list only what differs from them).
_HF_DEFAULTS: dict[str, Any] = {
    "depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304,
    "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "out_hidden_size": 3584, "num_position_embeddings": 2304, "deepstack_visual_indexes": (8, 16, 24)}
# The names transformers' config also accepts for two of them (its attribute_map).
_HF_ALIASES = {"depth": "num_hidden_layers", "num_heads": "num_attention_heads"}
_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class Qwen3VisionConfig(NativeImageSide):
    """A Qwen3-VL vision tower (config.json's ``vision_config``, transformers' names)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    # The mergers' output width: the language model's.
    out_hidden_size: int
    # The learned position grid's size (a square: sqrt of it per side).
    num_position_embeddings: int
    # The blocks (0-based) after which a DeepStack merger taps the hidden states, in increasing order.
    deepstack_visual_indexes: tuple[int, ...]
    # The vision rotary embedding's base (``rope_parameters.rope_theta``).
    rope_theta: float = _DEFAULT_ROPE_THETA
    # The model's image side around the tower: the prompt token an image's rows replace, and the
    # resized image's pixel range (preprocessor_config.json's, --mm-processor-kwargs over it).
    image_token_id: int = 151655
    min_pixels: int = QWEN3_VL_MIN_PIXELS
    max_pixels: int = QWEN3_VL_MAX_PIXELS
    # Videos: the prompt token a video's rows replace, and the pixel range of all its frames together
    # (the video processor's config; transformers' Qwen3VLVideoProcessor defaults otherwise).
    video_token_id: int = 151656
    video_min_pixels: int = QWEN3_VL_VIDEO_MIN_PIXELS
    video_max_pixels: int = QWEN3_VL_VIDEO_MAX_PIXELS
    video_frames: FrameSampling = FrameSampling()

    @property
    def geometry(self) -> ImageGeometry:
        return with_videos(super().geometry, self.video_min_pixels, self.video_max_pixels, self.video_frames,
                           video_frame_pairs=True)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_input_size(self) -> int:
        """One patch's pixel values as the processor flattens them: channels x frames x side x side."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def position_grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_hf(cls, vision_cfg: dict[str, Any]) -> Qwen3VisionConfig:
        """From a config.json's ``vision_config``, transformers' defaults filling what it leaves out."""
        values: dict[str, Any] = {}
        for name, default in _HF_DEFAULTS.items():
            alias = _HF_ALIASES.get(name)
            if vision_cfg.get(name) is not None:
                values[name] = vision_cfg[name]
            elif alias is not None and vision_cfg.get(alias) is not None:
                values[name] = vision_cfg[alias]
            else:
                values[name] = default
        for name in ("patch_size", "temporal_patch_size"):
            if not isinstance(values[name], int):
                raise ValueError(f"Qwen3-VL's vision_config.{name} must be one integer, got {values[name]!r}")
        rope = vision_cfg.get("rope_parameters") or {}
        theta = rope.get("rope_theta") or vision_cfg.get("rope_theta") or _DEFAULT_ROPE_THETA
        ints = {name: int(value) for name, value in values.items()
                if name not in ("hidden_act", "deepstack_visual_indexes")}
        return cls(**ints, hidden_act=str(values["hidden_act"]),
                   deepstack_visual_indexes=tuple(int(i) for i in values["deepstack_visual_indexes"]),
                   rope_theta=float(theta))




# Gemma 3 (4B, 12B, 27B): a SigLIP vision tower whose patches are average-pooled to 256 tokens,
# normed and projected (Gemma3MultiModalProjector) into the Gemma 3 decoder; an image's tokens attend
# to each other both ways.
GEMMA3_VL_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
# transformers' SiglipVisionConfig defaults (a config.json lists what differs; Gemma 3's lists its tower).
_SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                    "num_channels": 3, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                    "layer_norm_eps": 1e-6}


@dataclass(frozen=True)
class SiglipTowerConfig:
    """A SigLIP-like vision tower (Gemma 3's, Idefics3's): config.json's vision_config, transformers'
    names (``image_size``: its square input's side, a tile's for Idefics3)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float

    @property
    def patches_side(self) -> int:
        return self.image_size // self.patch_size


def siglip_tower_fields(vision: dict[str, Any]) -> dict[str, Any]:
    """A vision_config's (defaults merged in) SigLIP tower fields, as ``SiglipTowerConfig`` names them."""
    return {"hidden_size": int(vision["hidden_size"]), "intermediate_size": int(vision["intermediate_size"]),
            "num_hidden_layers": int(vision["num_hidden_layers"]),
            "num_attention_heads": int(vision["num_attention_heads"]), "num_channels": int(vision["num_channels"]),
            "image_size": int(vision["image_size"]), "patch_size": int(vision["patch_size"]),
            "hidden_act": str(vision["hidden_act"]), "layer_norm_eps": float(vision["layer_norm_eps"])}


@dataclass(frozen=True)
class Gemma3VisionConfig(SiglipTowerConfig):
    """Gemma 3's vision side (a SigLIP tower, and the projector's pooling), transformers' names."""

    # Tokens per image: the tower's (image_size / patch_size)^2 patches average-pooled to this many.
    mm_tokens_per_image: int
    # The language model's width (the projector's output).
    text_hidden_size: int
    # The prompt token an image's rows replace; the tokens around each image's run of them.
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int

    @property
    def tokens_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)

    @property
    def geometry(self) -> ImageGeometry:
        return ImageGeometry(self.image_size, self.patch_size, self.num_channels,
                             pooled_tokens=self.mm_tokens_per_image, bidirectional=True)

    @property
    def tokens_per_image(self) -> int:
        return self.mm_tokens_per_image


def gemma3_vision_config_from_dict(cfg: dict[str, Any], text_hidden_size: int) -> Gemma3VisionConfig:
    """Gemma 3's vision side from its config.json (transformers' Gemma3Config names and defaults)."""
    vision = {**_SIGLIP_DEFAULTS, **(cfg.get("vision_config") or {})}
    if vision.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ValueError(f"Gemma 3's vision tower must be SigLIP's (vision_config.model_type "
                         f"'siglip_vision_model'), got {vision['model_type']!r}")
    vc = Gemma3VisionConfig(
        **siglip_tower_fields(vision), mm_tokens_per_image=int(cfg.get("mm_tokens_per_image") or 256),
        text_hidden_size=text_hidden_size,
        image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 262144))),
        boi_token_id=int(cfg.get("boi_token_index", cfg.get("boi_token_id", 255999))),
        eoi_token_id=int(cfg.get("eoi_token_index", cfg.get("eoi_token_id", 256000))))
    if vc.image_size % vc.patch_size or vc.tokens_side ** 2 != vc.mm_tokens_per_image \
            or vc.patches_side % vc.tokens_side:
        raise ValueError(f"Gemma 3's {vc.patches_side}x{vc.patches_side} patches must pool evenly into "
                         f"mm_tokens_per_image {vc.mm_tokens_per_image} (a square whose side divides it)")
    return vc


# Idefics3 (SmolVLM 256M / 500M / 2.2B, Idefics3-8B; SmolVLM2's images): a SigLIP-like tower over
# square tiles whose patch grid is pixel-shuffled (scale_factor x scale_factor patches a token) and
# projected into a Llama decoder. Its processor cuts an image into tiles beside the whole image shrunk
# to one tile, and writes each tile in the prompt as <fake_token_around_image><row_R_col_C> (or
# <global-img>) and its run of <image> tokens: each tile is an encoder input of its own
# (ImageGeometry.tile_prompts).
IDEFICS3_ARCHITECTURES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
# transformers' Idefics3VisionConfig defaults.
_IDEFICS3_VISION_DEFAULTS = {"hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12,
                             "num_attention_heads": 16, "num_channels": 3, "image_size": 224, "patch_size": 32,
                             "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}


@dataclass(frozen=True)
class Idefics3VisionConfig(SiglipTowerConfig):
    """Idefics3's vision side (its tower over tiles of ``image_size``, its scale_factor), transformers'
    names."""

    # The pixel shuffle's side: scale_factor x scale_factor patches make one token.
    scale_factor: int
    # The language model's width (the connector's output), and the prompt token a tile's rows replace.
    text_hidden_size: int
    image_token_id: int
    # --mm-processor-kwargs '{"size": {"longest_edge": N}}': the side an image is resized to before the
    # router cuts its tiles, over its processor's (0: the processor's own).
    tile_resize: int = 0

    @property
    def tokens_per_tile(self) -> int:
        return (self.patches_side // self.scale_factor) ** 2

    @property
    def geometry(self) -> ImageGeometry:
        return ImageGeometry(self.image_size, self.patch_size, self.num_channels, pooled_tokens=self.tokens_per_tile,
                             tile_prompts=True, tile_resize=self.tile_resize)

    @property
    def tokens_per_image(self) -> int:
        """The most tokens one encoder input (a tile) takes."""
        return self.tokens_per_tile


def idefics3_vision_config_from_dict(cfg: dict[str, Any], text_hidden_size: int) -> Idefics3VisionConfig:
    """Idefics3's vision side from its config.json (transformers' Idefics3Config names and defaults)."""
    vision = {**_IDEFICS3_VISION_DEFAULTS, **(cfg.get("vision_config") or {})}
    vc = Idefics3VisionConfig(
        **siglip_tower_fields(vision), scale_factor=int(cfg.get("scale_factor") or 2),
        text_hidden_size=text_hidden_size, image_token_id=int(cfg.get("image_token_id", 128257)))
    if vc.patches_side < 1 or vc.patches_side % vc.scale_factor:
        # (A tile's side need not be whole patches: SmolVLM 2.2B's 384 pixels are 27 14-pixel patches.)
        raise ValueError(f"Idefics3's {vc.patches_side} patches a tile side must be whole "
                         f"{vc.scale_factor}x{vc.scale_factor} squares (its pixel shuffle)")
    return vc


# Pixtral's tower (Pixtral-12B as LlavaForConditionalGeneration; Mistral Small 3.1 / 3.2 as
# Mistral3ForConditionalGeneration): an image keeps its aspect, shrunk to fit ``longest_edge`` and
# cut into patches (each side rounded up to a whole token); 2-D rotary attention within each image;
# Mistral 3 merges 2x2 patches into one token. Each row of an image's tokens ends with [IMG_BREAK],
# its last with [IMG_END].
PIXTRAL_ARCHITECTURES = ("Mistral3ForConditionalGeneration",)
# transformers' PixtralVisionConfig defaults, and the ones Mistral3Config gives its vision_config.
_PIXTRAL_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
    "num_channels": 3, "image_size": 1024, "patch_size": 16, "hidden_act": "gelu"}
_MISTRAL3_VISION_DEFAULTS: dict[str, Any] = {**_PIXTRAL_DEFAULTS, "patch_size": 14, "image_size": 1540}
_PIXTRAL_ROPE_THETA = 10000.0
# The row-break and end tokens' ids in Mistral's vocabulary (Pixtral-12B's, Mistral Small 3.1's);
# the model's own tokenizer's, where it has one (ModelConfig.from_pretrained).
PIXTRAL_TOKEN_IDS = {"[IMG_BREAK]": 12, "[IMG_END]": 13}


@dataclass(frozen=True)
class PixtralVisionConfig:
    """A Pixtral vision tower (config.json's ``vision_config``, transformers' names) and the image
    side of the model around it (Pixtral-12B's LLaVA projector, or Mistral 3's: an RMSNorm and a
    2x2 patch merger before it)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_channels: int
    patch_size: int
    hidden_act: str
    # The tower's blocks run: its features are the hidden states after this many (vision_feature_layer).
    num_layers_used: int
    # The 2-D rotary embedding's base.
    rope_theta: float
    # Patches per token side: 1 (Pixtral-12B: one token a patch), 2 (Mistral 3: merged 2x2).
    spatial_merge_size: int
    # Mistral 3's projector: RMSNorm (of this eps) and the patch merger before the two linears.
    patch_merger: bool
    projector_norm_eps: float
    projector_act: str
    projector_bias: bool
    # The language model's width (the projector's output).
    text_hidden_size: int
    # An image's longest side once resized (the processor's size["longest_edge"]).
    longest_edge: int
    # The prompt tokens of an image: [IMG] for each token, [IMG_BREAK] after each row but the last,
    # [IMG_END] after the last.
    image_token_id: int
    image_break_token_id: int
    image_end_token_id: int

    def __post_init__(self) -> None:
        if self.longest_edge < self.patch_size * self.spatial_merge_size:
            raise ValueError(f"the image processor's longest_edge {self.longest_edge} is less than one token's "
                             f"{self.patch_size * self.spatial_merge_size} pixels")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def geometry(self) -> ImageGeometry:
        return ImageGeometry(self.longest_edge, self.patch_size, self.num_channels, longest_edge=self.longest_edge,
                             spatial_merge=self.spatial_merge_size,
                             row_break_token_id=self.image_break_token_id,
                             image_end_token_id=self.image_end_token_id)

    @property
    def tokens_per_image(self) -> int:
        return self.geometry.max_tokens


def is_pixtral(cfg: dict[str, Any]) -> bool:
    """Whether a config is a Pixtral-tower model: Mistral 3, or a LLaVA whose tower is Pixtral's."""
    arch = (cfg.get("architectures") or [None])[0]
    vision_type = (cfg.get("vision_config") or {}).get("model_type")
    return arch in PIXTRAL_ARCHITECTURES or (arch in LLAVA_ARCHITECTURES and vision_type == "pixtral")


def pixtral_vision_config_from_dict(cfg: dict[str, Any], text_hidden_size: int, text_rms_norm_eps: float,
                                    token_ids: dict[str, int] | None = None,
                                    processor: dict[str, Any] | None = None) -> PixtralVisionConfig:
    """Pixtral-12B's or Mistral 3's vision side from its config.json, the ids of its image tokens
    (``token_ids``: the tokenizer's [IMG_BREAK] and [IMG_END]; Mistral's vocabulary's when None) and
    preprocessor_config.json (the resized images' longest side; the tower's image_size without one)."""
    token_ids = PIXTRAL_TOKEN_IDS if token_ids is None else token_ids
    mistral3 = cfg["architectures"][0] in PIXTRAL_ARCHITECTURES
    # (Mistral3Config's vision defaults stand in for a vision_config it lacks; one it has is completed
    # by PixtralVisionConfig's, as transformers reads them)
    given = cfg.get("vision_config")
    vision = {**_PIXTRAL_DEFAULTS, **given} if given else {**(_MISTRAL3_VISION_DEFAULTS if mistral3
                                                               else _PIXTRAL_DEFAULTS)}
    if vision.get("model_type", "pixtral") != "pixtral":
        raise ValueError(f"the vision tower must be Pixtral's (vision_config.model_type 'pixtral'), "
                         f"got {vision['model_type']!r}")
    for name in ("patch_size", "image_size"):
        if not isinstance(vision[name], int):
            raise ValueError(f"Pixtral's vision_config.{name} must be one integer, got {vision[name]!r}")
    num_layers = int(vision["num_hidden_layers"])
    # (Mistral3Config's defaults, or LlavaConfig's where a LLaVA config leaves them out)
    layer = cfg.get("vision_feature_layer", -1 if mistral3 else -2)
    if not isinstance(layer, int) or not -num_layers - 1 <= layer <= num_layers:
        raise ValueError(f"vision_feature_layer must be one layer's index (-{num_layers + 1}..{num_layers}), "
                         f"got {layer!r}")
    if not mistral3 and cfg.get("vision_feature_select_strategy", "default") != "full":
        raise ValueError("Pixtral's vision_feature_select_strategy must be 'full' (its tower has no class token)")
    rope = vision.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"Pixtral's tower takes axial rotary positions, not rope_type {rope['rope_type']!r}")
    processor = processor or {}
    size = processor.get("size") if isinstance(processor.get("size"), dict) else {}
    missing = [name for name in PIXTRAL_TOKEN_IDS if name not in token_ids]
    if missing:
        raise ValueError(f"the tokenizer has no {' or '.join(missing)} token: Pixtral's images need them")
    vc = PixtralVisionConfig(
        hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
        num_attention_heads=int(vision["num_attention_heads"]), num_channels=int(vision["num_channels"]),
        patch_size=int(vision["patch_size"]), hidden_act=str(vision["hidden_act"]),
        num_layers_used=layer if layer >= 0 else num_layers + 1 + layer,
        rope_theta=float(rope.get("rope_theta") or vision.get("rope_theta") or _PIXTRAL_ROPE_THETA),
        spatial_merge_size=int(cfg.get("spatial_merge_size", 2)) if mistral3 else 1, patch_merger=mistral3,
        projector_norm_eps=text_rms_norm_eps, projector_act=str(cfg.get("projector_hidden_act", "gelu")),
        projector_bias=bool(cfg.get("multimodal_projector_bias", not mistral3)), text_hidden_size=text_hidden_size,
        longest_edge=int(size.get("longest_edge") or vision["image_size"]),
        image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 10 if mistral3 else 32000))),
        image_break_token_id=token_ids["[IMG_BREAK]"], image_end_token_id=token_ids["[IMG_END]"])
    if vc.hidden_size % vc.num_attention_heads or vc.head_dim % 4:
        raise ValueError(f"the vision tower's width {vc.hidden_size} must split into {vc.num_attention_heads} heads "
                         "whose width is a multiple of 4 (its 2-D rotary embedding)")
    return vc


# InternVL 3 / 3.5 in transformers' layout (InternVLForConditionalGeneration, the "-hf" checkpoints):
# an InternViT tower over 448-pixel tiles (an image cut into up to max_patches tiles by its aspect,
# with a thumbnail beside them), each tile's patches pixel-shuffled 2x2 into 256 tokens and projected
# into a Qwen2 / Qwen3 / Llama decoder. The processor writes an image as <img>, its tokens, </img>.
INTERNVL_ARCHITECTURES = ("InternVLForConditionalGeneration",)
# transformers' InternVLVisionConfig defaults (InternViT-300M's).
_INTERNVL_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
    "attention_bias": False, "use_qk_norm": False, "hidden_act": "gelu", "norm_type": "layer_norm",
    "layer_norm_eps": 1e-6, "image_size": 448, "patch_size": 14, "num_channels": 3,
    "use_absolute_position_embeddings": True}
# The decoders an InternVL checkpoint's language model may be (its text_config.model_type).
INTERNVL_TEXT_DECODERS = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


@dataclass(frozen=True)
class InternVLVisionConfig:
    """An InternVL model's vision side: its InternViT tower (config.json's vision_config,
    transformers' names), the pixel shuffle and projector, and the tiling of its images (the image
    processor's min/max_patches)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    attention_bias: bool
    use_qk_norm: bool
    hidden_act: str
    norm_type: str  # "layer_norm" (InternViT-300M) or "rms_norm" (InternViT-6B)
    layer_norm_eps: float
    image_size: int
    patch_size: int
    num_channels: int
    # The tower's layers run: its features are the hidden states after this many (vision_feature_layer).
    num_layers_used: int
    # "default": the patches' features (the class token dropped); "full": the class token's too (refused).
    select_strategy: str
    # The pixel shuffle's scale: 0.5 makes each 2x2 patches one token of four times the width.
    downsample_ratio: float
    projector_act: str
    text_hidden_size: int
    # The prompt token an image's rows replace (<IMG_CONTEXT>; the router writes <img> and </img>
    # around an image's run of them).
    image_token_id: int
    # An image is cut into min_tiles..max_tiles tiles (a thumbnail beside more than one); 1: one tile.
    min_tiles: int = 1
    max_tiles: int = 12

    def __post_init__(self) -> None:
        side, scale = self.image_size // self.patch_size, 1 / self.downsample_ratio
        if self.image_size % self.patch_size or scale != round(scale) or side % round(scale):
            raise ValueError(f"InternVL's {side}x{side} patches must pixel-shuffle evenly by downsample_ratio "
                             f"{self.downsample_ratio}")
        if not 1 <= self.min_tiles <= self.max_tiles:
            raise ValueError(f"the image processor's min_patches {self.min_tiles} must be at least 1 and at most "
                             f"its max_patches {self.max_tiles}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def tokens_per_tile(self) -> int:
        return int((self.image_size // self.patch_size * self.downsample_ratio) ** 2)

    @property
    def geometry(self) -> ImageGeometry:
        return ImageGeometry(self.image_size, self.patch_size, self.num_channels, pooled_tokens=self.tokens_per_tile,
                             min_tiles=self.min_tiles, max_tiles=self.max_tiles)

    @property
    def tokens_per_image(self) -> int:
        return self.geometry.max_tokens


def internvl_text_architecture(cfg: dict[str, Any]) -> str:
    model_type = (cfg.get("text_config") or {}).get("model_type", "qwen2")
    if model_type not in INTERNVL_TEXT_DECODERS:
        raise ValueError(f"an InternVL checkpoint's language model must be one of {tuple(INTERNVL_TEXT_DECODERS)} "
                         f"(text_config.model_type), got {model_type!r}")
    return INTERNVL_TEXT_DECODERS[model_type]


def internvl_vision_config_from_dict(cfg: dict[str, Any], text_hidden_size: int,
                                     processor: dict[str, Any] | None = None) -> InternVLVisionConfig:
    """InternVL's vision side from its config.json and its image processor's config (the tiling)."""
    vision = {**_INTERNVL_VISION_DEFAULTS, **(cfg.get("vision_config") or {})}
    if vision.get("model_type", "internvl_vision") != "internvl_vision":
        raise ValueError(f"InternVL's vision tower must be InternViT (vision_config.model_type 'internvl_vision'), "
                         f"got {vision['model_type']!r}")
    for name in ("image_size", "patch_size"):
        value = vision[name]
        if isinstance(value, list | tuple):
            if len(set(value)) != 1:
                raise ValueError(f"InternVL's vision_config.{name} must be square, got {value!r}")
            vision[name] = value[0]
    if vision["norm_type"] not in ("layer_norm", "rms_norm"):
        raise ValueError(f"InternVL's vision_config.norm_type must be layer_norm or rms_norm, "
                         f"got {vision['norm_type']!r}")
    if not vision["use_absolute_position_embeddings"] or not vision.get("use_mean_pooling", True):
        raise ValueError("InternVL's tower is served with its absolute position embeddings and without a final "
                         "norm (use_absolute_position_embeddings true, use_mean_pooling true)")
    num_layers = int(vision["num_hidden_layers"])
    layer = cfg.get("vision_feature_layer", -1)
    if not isinstance(layer, int) or not -num_layers - 1 <= layer <= num_layers:
        raise ValueError(f"vision_feature_layer must be one layer's index (-{num_layers + 1}..{num_layers}), "
                         f"got {layer!r}")
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy != "default":
        raise ValueError(f"InternVL's vision_feature_select_strategy must be 'default', got {strategy!r}")
    # (InternVLProcessor asks its image processor for tiles at every call, whatever its crop_to_patches)
    processor = processor or {}
    max_tiles = int(processor.get("max_patches", 12))
    return InternVLVisionConfig(
        hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
        num_attention_heads=int(vision["num_attention_heads"]), attention_bias=bool(vision["attention_bias"]),
        use_qk_norm=bool(vision["use_qk_norm"]), hidden_act=str(vision["hidden_act"]),
        norm_type=str(vision["norm_type"]), layer_norm_eps=float(vision["layer_norm_eps"]),
        image_size=int(vision["image_size"]), patch_size=int(vision["patch_size"]),
        num_channels=int(vision["num_channels"]), num_layers_used=layer if layer >= 0 else num_layers + 1 + layer,
        select_strategy=strategy, downsample_ratio=float(cfg.get("downsample_ratio", 0.5)),
        projector_act=str(cfg.get("projector_hidden_act", "gelu")), text_hidden_size=text_hidden_size,
        image_token_id=int(cfg.get("image_token_id", cfg.get("image_token_index", 151667))),
        min_tiles=int(processor.get("min_patches", 1)), max_tiles=max_tiles)
