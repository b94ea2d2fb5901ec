"""Incremental detokenisation and stop-string matching for one generated sequence.

Text is released only when it is stable: a token window whose decode ends in U+FFFD (a multi-byte
character split across tokens) is held back until the next token completes it, and text that could
still turn out to be the start of a stop string is held back until it cannot. At the end, the text
released over the whole stream equals the decode of the tokens as they read after the prompt (minus
a matched stop string): for byte-level vocabularies, the full decode of the generated tokens; for
SentencePiece ones, that with the leading space a decode from the start would strip. (A tokenizer
whose decode cleans up spaces, decoded here window by window, may differ from its full decode
where a window's edge falls next to such a space.)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Protocol

try:  # DecodeStream with a prefill (ids=) needs a recent tokenizers; older ones use the windowed path
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover
    DecodeStream = None

# Prompt-side context kept in the decode window, so leading-space rules see a real predecessor.
_CONTEXT_TOKENS = 5

Decode = Callable[[list[int], bool], str]


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def rust_backend(tokenizer: Any) -> Any | None:
    """The Rust ``tokenizers.Tokenizer`` behind a transformers tokenizer, when transformers would add
    nothing on top of its decode (no clean-up of spaces); else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend
    return None


def fast_decoder(tokenizer: Any) -> Decode:
    """``decode(ids, skip_special_tokens)`` straight from the Rust backend when there is one: the
    transformers wrapper costs several times the decode itself."""
    backend = rust_backend(tokenizer)
    if backend is not None:
        backend_decode = backend.decode
        return lambda ids, skip: backend_decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def decode_after(tokenizer: Tokenizer, context_ids: list[int], token_ids: list[int],
                 skip_special_tokens: bool = True) -> str:
    """The text of ``token_ids`` as it reads after ``context_ids`` (the prompt), in one decode: what
    the incremental detokenizer's stream adds up to. A decode of the ids alone differs at the start
    where a tokenizer strips the leading space of a text's first token (SentencePiece)."""
    context = list(context_ids[-_CONTEXT_TOKENS:])
    if context:
        before = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
        text = tokenizer.decode(context + list(token_ids), skip_special_tokens=skip_special_tokens)
        if text.startswith(before):
            return text[len(before):]
    return tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


SENTENCEPIECE_SPACE = "\u2581"


def token_text(tokenizer: Any, decode: Decode, token_id: int) -> str:
    """One token's text as logprobs name it: its decode, with the leading spaces its SentencePiece
    piece ("\u2581Paris") marks and a lone decode strips (so a choice's tokens join to its text and
    text offsets stay true, as vLLM restores them)."""
    text = decode([token_id], False)
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and piece.startswith(SENTENCEPIECE_SPACE):
        marked = len(piece) - len(piece.lstrip(SENTENCEPIECE_SPACE))
        missing = marked - (len(text) - len(text.lstrip(" ")))
        if missing > 0:
            return " " * missing + text
    return text


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level vocabulary alphabet: the character standing for each byte, read back."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: Any, token_id: int, text: str) -> bytes:
    """A token's own bytes (logprobs' ``bytes``, OpenAI's way to put back a character split across
    tokens): ``text``'s UTF-8, except for a token that holds part of a character, whose text is
    U+FFFD: then the bytes its vocabulary piece stands for (a byte-level piece, or a byte-fallback
    <0xNN>)."""
    if "\ufffd" not in text:
        return text.encode()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        if match := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        if piece and all(ch in BYTE_LEVEL_ALPHABET for ch in piece):
            return bytes(BYTE_LEVEL_ALPHABET[ch] for ch in piece)
    return text.encode()


class IncrementalDetokenizer:
    """With a Rust backend, each token goes through the backend's own ``DecodeStream`` (one call per
    token, the same prefix/read-offset windowing done in Rust); otherwise two windowed decodes per
    token here. Should the stream ever refuse a token, this sequence continues windowed from the
    first token whose text was not released yet."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int] | None = None,
                 skip_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False, use_decode_stream: bool = True,
                 min_tokens: int = 0, marker_ids: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        # Where in output_text each of these tokens' text begins (gpt-oss's harmony markers: a parser
        # tells them from the same characters written with ordinary tokens).
        self.marker_ids = marker_ids
        self.marker_offsets: list[int] = []
        self._marker_texts: dict[int, str] = {}
        self._decode = fast_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._tokens: list[int] = context
        self._num_context = len(context)
        # The decode window is tokens[prefix_offset:]; text of tokens[prefix_offset:read_offset] is settled.
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_text = ""
        self._released = 0
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        # Stop strings count only once more than min_tokens tokens exist (as the engine treats stop ids),
        # and only in text that arrives from then on.
        self.min_tokens = min_tokens
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.stop_reason: str | None = None
        self._min_text_end = 0  # where the text of the first min_tokens tokens ends
        self._backend = rust_backend(tokenizer) if use_decode_stream and DecodeStream is not None else None
        self._stream = None
        if self._backend is not None:
            try:
                self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
            except TypeError:  # a tokenizers without prefilled streams: the windowed path
                self._backend = None

    @property
    def token_ids(self) -> list[int]:
        return self._tokens[self._num_context:]

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Feed sampled tokens; returns newly releasable text (possibly empty)."""
        for token_id in new_token_ids:
            if self.stop_reason is not None:
                break
            self._tokens.append(token_id)
            if self._stream is not None:
                self._stream_step(token_id)
            else:
                self._decode_step()
            if token_id in self.marker_ids:
                self._mark(token_id)
        return self._release(final=self.stop_reason is not None)

    def _mark(self, token_id: int) -> None:
        """A marker token was just decoded: its text ends the output (unless a stop string cut it)."""
        text = self._marker_texts.get(token_id)
        if text is None:
            text = self._marker_texts[token_id] = self._decode([token_id], self.skip_special_tokens)
        if text and self.output_text.endswith(text):
            self.marker_offsets.append(len(self.output_text) - len(text))

    def finish(self) -> str:
        """The sequence ended: release everything left, with the text of any tokens still held back
        (an incomplete character at the very end reads as U+FFFD, as in a full decode)."""
        if self.stop_reason is None and self._read_offset < len(self._tokens):
            # Decoded in a window after the settled text, as every other token was: a decode of the
            # generated tokens alone would differ at its start (SentencePiece strips a leading space).
            decode, skip = self._decode, self.skip_special_tokens
            start = self._prefix_offset if self._stream is None else max(0, self._read_offset - _CONTEXT_TOKENS)
            settled = decode(self._tokens[start:self._read_offset], skip)
            text = decode(self._tokens[start:], skip)
            if not text.startswith(settled):
                # Byte-fallback tokens decode as one run: complete characters before the broken one
                # would turn to U+FFFD with it. The held-back tokens alone are the broken character.
                settled, text = "", decode(self._tokens[self._read_offset:], skip)
            self._read_offset = len(self._tokens)
            self.output_text += text[len(settled):]  # (not searched for stop strings: the request has ended)
        return self._release(final=True)

    def _stream_step(self, token_id: int) -> None:
        try:
            piece = self._stream.step(self._backend, token_id)  # type: ignore[union-attr]
        except Exception:
            # Continue windowed from the first token not released yet (read_offset is kept below).
            self._stream = None
            self._prefix_offset = max(0, self._read_offset - _CONTEXT_TOKENS)
            self._decode_step()
            return
        if piece:  # None: an incomplete character, held back in the stream
            self._read_offset = len(self._tokens)
            self._append(piece)

    def _decode_step(self) -> None:
        decode, skip = self._decode, self.skip_special_tokens
        prefix_text = decode(self._tokens[self._prefix_offset:self._read_offset], skip)
        new_text = decode(self._tokens[self._prefix_offset:], skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return  # incomplete character (or nothing visible yet): wait for more tokens
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self._append(new_text[len(prefix_text):])

    def _append(self, delta: str) -> None:
        start = len(self.output_text)
        self.output_text += delta
        if self.stop and len(self._tokens) - self._num_context > self.min_tokens:
            self._check_stop(max(start, self._min_text_end))
        elif self.stop:
            self._min_text_end = len(self.output_text)

    def _check_stop(self, new_text_start: int) -> None:
        # A stop string may straddle the previous text: search from (longest stop - 1) chars back,
        # but not into the text of the first min_tokens tokens.
        search_from = max(self._min_text_end, new_text_start - self._holdback)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.output_text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.output_text = self.output_text[:i + len(s)] if self.include_stop_str_in_output \
                else self.output_text[:i]
            self.stop_reason = s

    def _release(self, final: bool) -> str:
        end = len(self.output_text) if final else max(self._released, len(self.output_text) - self._holdback)
        out = self.output_text[self._released:end]
        self._released = end
        return out
