"""vLLM's ``GET /tokenizer_info`` (--enable-tokenizer-info-endpoint): how the served tokenizer is
configured, for clients that tokenize on their own side."""

from __future__ import annotations

from typing import Any

# Paths into the replica's private copy of the tokenizer files: meaningless to a client.
_LOCAL_PATHS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


def describe_tokenizer(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's init arguments as JSON (special tokens as their text), its class, and the chat
    template the server renders with (the --chat-template in force, else the tokenizer's own)."""
    config = {key: _as_json(value) for key, value in getattr(tokenizer, "init_kwargs", {}).items()
              if key not in _LOCAL_PATHS}
    config["tokenizer_class"] = type(tokenizer).__name__
    if getattr(tokenizer, "chat_template", None):
        config["chat_template"] = tokenizer.chat_template
    return config


def _as_json(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): _as_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_as_json(v) for v in value]
    if hasattr(value, "content"):  # (an AddedToken: its text)
        return value.content
    return str(value)
