"""Loading a model's tokenizer from its directory, the one way every part of the cluster does (the
engines' structured outputs, the router replicas, the workers' token lookups, the offline ``LLM``).

A Hugging Face tokenizer (``tokenizer.json`` and its companions) loads as transformers loads it. A
directory with Mistral's ``tekken.json`` and no ``tokenizer.json`` (Mistral's own releases: Ministral
3, Mistral Small 3.x, Pixtral) loads through transformers' own tekken conversion: the same byte-level
BPE, its control tokens ([INST], [IMG], ...) as special tokens, <s> and </s> as BOS and EOS (<s>
added before a prompt's text where special tokens are added), and the chat template of the
directory's ``chat_template.jinja`` (or ``chat_template.json``) where it has one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

TEKKEN_FILE = "tekken.json"


def load_tokenizer(directory: str | os.PathLike[str]) -> Any:
    """The tokenizer of a model (or ``--tokenizer``) directory."""
    path = Path(directory)
    if (path / TEKKEN_FILE).is_file() and not (path / "tokenizer.json").is_file():
        # (deferred: importing transformers costs seconds)
        from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

        tokenizer = convert_tekken_tokenizer(os.fspath(path / TEKKEN_FILE))
        # (A prompt's text starts with <s> where the special tokens are added, as Mistral's tokenizers
        # and the tokenizer.json of their transformers releases add it.)
        tokenizer.add_bos_token = True
        tokenizer.update_post_processor()
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.fspath(path))
