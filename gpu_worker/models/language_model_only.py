"""A vision-language checkpoint's language model served alone (vLLM's text-only mode, asked by
``--limit-mm-per-prompt '{"image": 0}'``): the decoder class of its language model reads the
checkpoint's language-model tensors under their prefix and skips the vision tower's and projector's,
which are neither built nor loaded (their memory goes to the KV cache)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import nn

from gpu_worker.layers.weight_utils import (
    LANGUAGE_MODEL_PREFIXES,
    VISION_SIDE_PREFIXES,
    WeightLike,
    renamed_by_prefix,
)
from gpu_worker.models.qwen3_vl import stacked_experts_as_ours

# (LANGUAGE_MODEL_PREFIXES also hold Qwen2-VL's / Qwen3-VL's in transformers 5's layout; the released
# Qwen2-VL checkpoints name it as a text model does.) The vision sides: LLaVA-style towers and
# projectors, Qwen-VL's towers, LLaVA-NeXT's newline row, Idefics3's tower and connector.
VISION_PREFIXES = (*VISION_SIDE_PREFIXES, "visual.", "model.visual.", "image_newline", "model.image_newline",
                   "model.vision_model.", "model.connector.", "vision_model.")  # (the last: Llama 4's)


class LanguageModelOnlyMixin(nn.Module):
    """Adds the reading of a vision-language checkpoint to a decoder class (``language_model_class``)."""

    # (What a LoRA adapter's module names are renamed by, and the parts whose modules it skips.)
    _LANGUAGE_MODEL_PREFIXES = LANGUAGE_MODEL_PREFIXES
    _VISION_PREFIXES = VISION_PREFIXES

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        text = ((name, tensor) for name, tensor in weights if not name.startswith(VISION_PREFIXES))
        renamed = renamed_by_prefix(text, LANGUAGE_MODEL_PREFIXES, lambda name: True)
        decoder = getattr(super(), "checkpoint_tensors", None)
        renamed = decoder(renamed) if decoder is not None else renamed
        if self.config.language_model_of == "Qwen3VLMoeForConditionalGeneration":
            return stacked_experts_as_ours(renamed, self.config)
        return renamed


def language_model_class(decoder: type[nn.Module]) -> type[nn.Module]:
    """``decoder`` (the language model's class) reading its vision-language checkpoint."""
    return type(f"LanguageModelOnly{decoder.__name__}", (LanguageModelOnlyMixin, decoder), {})
