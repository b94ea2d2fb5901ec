"""A vision-language checkpoint's image side, as its config.json states it (LLaVA: a CLIP vision
tower, a two-layer projector into the language model's width, and an image placeholder token)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine_core.multimodal import ImageGeometry

# Vision-language architectures whose images we encode -> how their language model is named by its
# text_config's model_type (the decoder is ours: the Llama block).
LLAVA_ARCHITECTURES = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration")
TEXT_DECODER_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                              "qwen2": "Qwen2ForCausalLM"}
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


def with_full_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with its text_config completed by transformers' defaults for its model type: llava-hf
    checkpoints list only what differs from them (llava-1.5-7b's names five keys, no width or depth)."""
    from transformers import AutoConfig

    text = dict(cfg.get("text_config") or {})
    text_architecture(cfg)  # (refuses a language model we do not serve, before transformers reads it)
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
