import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.detokenizer import IncrementalDetokenizer, fast_decoder

from .tokenizer_factory import CORPUS, byte_level_tokenizer, sentencepiece_style_tokenizer

TEXTS = ["Hello 😀 world", "東京は日本の首都です。", "naïve café 🚀🚀", "新しい文字 🎉 ß",
         "def main():\n    return 42\n"]


def stream(detok: IncrementalDetokenizer, token_ids: list[int], chunk: int = 1) -> list[str]:
    pieces = [detok.add_tokens(token_ids[i:i + chunk]) for i in range(0, len(token_ids), chunk)]
    pieces.append(detok.finish())
    return pieces


@pytest.mark.parametrize("use_stream", [True, False], ids=["decode_stream", "windowed"])
def test_stream_concatenates_to_the_full_decode_and_never_emits_broken_utf8(use_stream):
    tok = byte_level_tokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        pieces = stream(IncrementalDetokenizer(tok, use_decode_stream=use_stream), ids)
        assert "".join(pieces) == tok.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)
    # The unseen text really splits characters across tokens.
    assert any("\ufffd" in tok.decode([t]) for t in tok.encode(TEXTS[3]))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 399), min_size=1, max_size=40), st.integers(1, 4), st.booleans())
def test_random_token_streams_concatenate_to_the_full_decode(ids, chunk, use_stream):
    tok = byte_level_tokenizer()
    prompt = tok.encode("Paris is")
    pieces = stream(IncrementalDetokenizer(tok, prompt_token_ids=prompt, use_decode_stream=use_stream), ids, chunk)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


def _text_after(tok, prompt: list[int], ids: list[int]) -> str:
    """The generated tokens' text as it reads after the prompt."""
    prompt_text, full = tok.decode(prompt), tok.decode(prompt + ids, skip_special_tokens=True)
    assert full.startswith(prompt_text)
    return full[len(prompt_text):]


def _byte_tokens(tok, char: str) -> list[int]:
    return tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in char.encode()])


# Pieces of SentencePiece-style generations: vocabulary tokens (specials too), or characters outside
# the vocabulary, which arrive as <0xNN> byte tokens.
_SP_PIECES = st.one_of(st.integers(0, 299), st.sampled_from(["ü", "ñ", "ß", "中", "🎉"]))


@settings(max_examples=80, deadline=None)
@given(st.lists(_SP_PIECES, min_size=1, max_size=30), st.integers(1, 4), st.booleans(),
       st.sampled_from([[], ["zzzz"], ["\n\n", "###"]]))
def test_sentencepiece_streams_read_as_after_the_prompt_whatever_the_stop_strings(pieces, chunk, use_stream, stop):
    """A decode from the start strips the first token's space; the stream keeps it, as it reads after
    the prompt. With stop strings that never match, the held-back tail is released unchanged."""
    tok = sentencepiece_style_tokenizer()
    ids = [i for p in pieces for i in ([p] if isinstance(p, int) else _byte_tokens(tok, p))]
    prompt = tok.encode("Paris is", add_special_tokens=False)
    text = _text_after(tok, prompt, ids)
    if any(s in text for s in stop):
        return
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt, stop=stop, use_decode_stream=use_stream)
    assert "".join(stream(detok, ids, chunk)) == text


@pytest.mark.parametrize("use_stream", [True, False], ids=["decode_stream", "windowed"])
@pytest.mark.parametrize("stop", [[], ["zzzz"]])
def test_a_generation_cut_inside_a_character_ends_with_one_replacement_per_byte_left(use_stream, stop):
    """Cut by max_tokens inside a character: the characters before it stay, whether or not their
    bytes came as byte tokens too (a decode of the whole byte run would turn them to U+FFFD)."""
    tok = sentencepiece_style_tokenizer()
    prompt = tok.encode("Paris is", add_special_tokens=False)
    for words in ["ü🎉", "café 🎉", "go 🎉"]:
        ids = tok.encode(words, add_special_tokens=False)
        for cut in (1, 2, 3):
            detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt, stop=stop, use_decode_stream=use_stream)
            assert "".join(stream(detok, ids[:-cut])) == " " + words[:-1] + "\ufffd" * (4 - cut), (words, cut)


@pytest.mark.parametrize("use_stream", [True, False], ids=["decode_stream", "windowed"])
def test_sentencepiece_text_keeps_its_first_space_and_its_last_characters(use_stream):
    tok = sentencepiece_style_tokenizer()
    prompt = tok.encode("Paris is", add_special_tokens=False)
    for words in ["the capital of France", "naïve café 😀", "ü"]:
        ids = tok.encode(words, add_special_tokens=False)
        for stop in ([], ["!!"], ["zzzz"]):
            detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt, stop=stop, use_decode_stream=use_stream)
            pieces = stream(detok, ids)
            assert "".join(pieces) == " " + words, (words, stop)
            assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("use_stream", [True, False], ids=["decode_stream", "windowed"])
def test_stop_string_is_excluded_and_ends_the_stream(use_stream):
    tok = byte_level_tokenizer()
    ids = tok.encode("Paris is the capital of France. Berlin is")
    detok = IncrementalDetokenizer(tok, stop=["France"], use_decode_stream=use_stream)
    text = "".join(stream(detok, ids))
    assert text == "Paris is the capital of " and detok.stop_reason == "France"


@pytest.mark.parametrize("use_stream", [True, False], ids=["decode_stream", "windowed"])
def test_stop_string_included_when_asked(use_stream):
    tok = byte_level_tokenizer()
    ids = tok.encode("Paris is the capital of France. Berlin is")
    detok = IncrementalDetokenizer(tok, stop=["capital", "Berlin"], include_stop_str_in_output=True,
                                   use_decode_stream=use_stream)
    assert "".join(stream(detok, ids)) == "Paris is the capital" and detok.stop_reason == "capital"


@pytest.mark.parametrize("use_stream", [True, False], ids=["decode_stream", "windowed"])
def test_text_that_might_start_a_stop_string_is_held_back_until_it_cannot(use_stream):
    tok = byte_level_tokenizer()
    detok = IncrementalDetokenizer(tok, stop=["lazy dog!"], use_decode_stream=use_stream)
    released = ""
    for t in tok.encode("the quick brown fox jumps over the lazy dog."):
        released += detok.add_tokens([t])
        assert len(detok.output_text) - len(released) <= len("lazy dog!") - 1
    released += detok.finish()
    assert released == "the quick brown fox jumps over the lazy dog." and detok.stop_reason is None


@pytest.mark.parametrize("use_stream", [True, False], ids=["decode_stream", "windowed"])
def test_stop_string_spanning_tokens_is_found(use_stream):
    tok = byte_level_tokenizer()
    rng = random.Random(0)
    for line in CORPUS[:4]:
        cut = rng.randrange(5, len(line) - 5)
        stop = line[cut:cut + 4]
        first = line.find(stop)
        detok = IncrementalDetokenizer(tok, stop=[stop], use_decode_stream=use_stream)
        assert "".join(stream(detok, tok.encode(line))) == line[:first]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 399), max_size=30), st.booleans())
def test_fast_decoder_equals_the_tokenizers_decode(ids, skip):
    tok = byte_level_tokenizer()
    assert fast_decoder(tok)(ids, skip) == tok.decode(ids, skip_special_tokens=skip)


def test_a_stream_that_refuses_a_token_continues_windowed():
    class Refusing:
        def step(self, tokenizer, token_id):
            raise RuntimeError("Invalid prefix encountered")

    tok = byte_level_tokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        for cut in range(len(ids)):
            detok = IncrementalDetokenizer(tok, prompt_token_ids=tok.encode("Paris is"))
            assert detok._stream is not None
            pieces = [detok.add_tokens([t]) for t in ids[:cut]]
            detok._stream = Refusing()
            pieces += [detok.add_tokens([t]) for t in ids[cut:]] + [detok.finish()]
            assert "".join(pieces) == text and detok._stream is None
            assert all("\ufffd" not in p for p in pieces)


def test_fast_decoder_defers_to_transformers_when_it_cleans_up_spaces():
    tok = byte_level_tokenizer()
    ids = tok.encode("Hello world , the fox .")
    try:
        tok.clean_up_tokenization_spaces = True
        assert fast_decoder(tok)(ids, True) == tok.decode(ids, skip_special_tokens=True)
    finally:
        tok.clean_up_tokenization_spaces = False


@pytest.mark.parametrize("make", [sentencepiece_style_tokenizer, byte_level_tokenizer])
def test_decode_after_the_prompt_equals_what_the_stream_adds_up_to(make):
    from router.detokenizer import decode_after

    tok = make()
    for prompt_text, words in (("Paris is", "the capital of France"), ("Hello", " naïve café 😀"), ("", "Hello world")):
        prompt = tok.encode(prompt_text, add_special_tokens=False)
        ids = tok.encode(words, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
        assert decode_after(tok, prompt, ids) == "".join(stream(detok, ids)), (prompt_text, words)


@pytest.mark.parametrize("make", [sentencepiece_style_tokenizer, byte_level_tokenizer])
def test_token_texts_join_to_the_text_the_stream_gives(make):
    """Logprobs name tokens by token_text: a SentencePiece token's leading space ("▁Paris"), which a
    lone decode strips, is kept, so the names join to the choice's text (and text offsets hold)."""
    from router.detokenizer import decode_after, token_text

    tok = make()
    decode = fast_decoder(tok)
    for prompt_text, words in (("Paris is", "the capital of France"), ("The fox", " jumps over the dog"),
                               ("Hello", "world")):
        prompt = tok.encode(prompt_text, add_special_tokens=False)
        ids = tok.encode(words, add_special_tokens=False)
        names = [token_text(tok, decode, i) for i in ids]
        assert "".join(names) == decode_after(tok, prompt, ids), (prompt_text, words, names)
    if make is sentencepiece_style_tokenizer:
        lone = tok.convert_tokens_to_ids("▁")
        assert (decode([lone], False), token_text(tok, decode, lone)) == ("", " ")


@pytest.mark.parametrize("make", [sentencepiece_style_tokenizer, byte_level_tokenizer])
def test_token_bytes_put_back_characters_split_across_tokens(make):
    """Logprobs' bytes (OpenAI's way to rebuild a character whose bytes several tokens hold): a
    token that decodes to U+FFFD gives the bytes its piece stands for (byte-level or <0xNN>)."""
    from router.detokenizer import token_bytes, token_text

    tok = make()
    decode = fast_decoder(tok)
    for text in ("東京は日本の首都です。", "naïve café 🚀", "plain words", "Ω ж € ✓"):
        ids = tok.encode(text, add_special_tokens=False)
        joined = b"".join(token_bytes(tok, i, token_text(tok, decode, i)) for i in ids)
        assert joined.decode().strip() == text, (text, joined)
    assert any("\ufffd" in decode([i], False) for i in tok.encode("東京 € ✓", add_special_tokens=False))
