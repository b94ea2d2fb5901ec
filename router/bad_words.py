"""vLLM's ``bad_words``: words turned into the token sequences the engine must not complete."""

from __future__ import annotations

from typing import Any


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each word as it would be tokenised at the start of the text, and, when that is a different
    token sequence of the same length, as it would be after a space (in the middle of a sentence),
    the way vLLM tokenises them. Raises ValueError for a word with no text."""
    sequences: list[list[int]] = []
    for word in words:
        text = word.lstrip()
        if not text:
            raise ValueError("bad_words must not contain empty or whitespace-only words")
        alone = list(tokenizer.encode(text, add_special_tokens=False))
        sequences.append(alone)
        spaced = list(tokenizer.encode(" " + text, add_special_tokens=False))
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return sequences
