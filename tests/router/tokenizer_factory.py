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
