"""vLLM's ``GET /tokenizer_info`` (--enable-tokenizer-info-endpoint): how the served tokenizer is
configured, for clients that tokenize on their own side."""

from __future__ import annotations

import math
from typing import Any

_DROPPED = object()


def describe_tokenizer(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's init arguments as JSON (special tokens as their text; file paths, which point
    into the replica's private copy of the tokenizer, and values that are not data left out), its
    class, and the chat template the server renders with (the --chat-template in force, else the
    tokenizer's own)."""
    config = {}
    for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items():
        if key.endswith("_file") or key == "name_or_path":
            continue
        value = _as_json(value)
        if value is not _DROPPED:
            config[key] = value
    config["tokenizer_class"] = type(tokenizer).__name__
    if getattr(tokenizer, "chat_template", None):
        config["chat_template"] = tokenizer.chat_template
    return config


def _as_json(value: Any) -> Any:
    """``value`` as JSON data, or _DROPPED (an object such as a tokenizers.Tokenizer)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        items = {str(k): _as_json(v) for k, v in value.items()}
        return {k: v for k, v in items.items() if v is not _DROPPED}
    if isinstance(value, list | tuple | set):
        return [v for v in map(_as_json, value) if v is not _DROPPED]
    content = getattr(value, "content", None)  # (an AddedToken: its text)
    return content if isinstance(content, str) else _DROPPED
