"""A small byte-level BPE tokenizer trained in-process (no hub): multi-byte characters split
across tokens, as with real GPT-2-style vocabularies."""

from __future__ import annotations

from functools import lru_cache

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Ünïcödé tëxt, naïve café, 東京は日本の首都です。 😀🚀 emoji and more words.",
    "def main():\n    return 42\n",
] * 20


@lru_cache(maxsize=1)
def byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@lru_cache(maxsize=1)
def sentencepiece_style_tokenizer():
    """Llama-2-style: words carry a leading "▁" (a space), bytes of characters outside the small
    vocabulary fall back to <0xNN> tokens, and the decoder strips the space a text starts with, so
    a token reads differently at the start of a decode than after other tokens."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60)
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


@lru_cache(maxsize=1)
def bos_adding_tokenizer():
    """The Llama-2-style tokenizer whose encode puts "<s>" first (its special tokens), with a chat
    template that writes "<s>" itself, as Llama's do."""
    from tokenizers import processors

    tokenizer = sentencepiece_style_tokenizer.__wrapped__()
    bos = tokenizer.convert_tokens_to_ids("<s>")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    tokenizer.chat_template = "<s>{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    return tokenizer
