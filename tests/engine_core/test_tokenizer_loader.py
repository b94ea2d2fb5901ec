"""A model directory whose tokenizer is Mistral's tekken.json alone (Ministral 3's, Mistral Small's
releases) loads as a tokenizer everywhere the cluster loads one: its control tokens at their ids,
<s> before a completion's text, the chat template of its file; the router replicas get it from
the engines' files; a directory with tokenizer.json loads that instead."""

from __future__ import annotations

import json
import shutil

import pytest

from engine_core.tokenizer_files import read_tokenizer_files, write_tokenizer_files
from engine_core.tokenizer_loader import load_tokenizer
from tests.tiny_model import TEKKEN_SPECIALS, build_tiny_mistral3

TEXT = "Hello world, Ünïcödé 東京 😀 what is the capital of France?\n  def main():"


@pytest.fixture(scope="module")
def tekken_model(tmp_path_factory):
    return build_tiny_mistral3(tmp_path_factory.mktemp("tekken"), ministral3=True, tekken=True)


def test_a_tekken_only_directory_loads_mistrals_tokenizer(tekken_model):
    tokenizer = load_tokenizer(tekken_model)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.convert_tokens_to_ids(list(TEKKEN_SPECIALS)) == list(range(len(TEKKEN_SPECIALS)))
    ids = tokenizer(TEXT)["input_ids"]
    # (Text runs after the 32 control ranks; the bytes of UTF-8 characters decode back whole.)
    assert ids[0] == 1 and all(i >= 32 for i in ids[1:]) and len(ids) < len(TEXT.encode())
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert tokenizer(TEXT, add_special_tokens=False)["input_ids"] == ids[1:]
    # The chat template is the directory's file; the control tokens it writes are single tokens.
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)["input_ids"]
    assert chat[:2] == [1, 3] and chat[-1] == 4
    assert tokenizer.decode([1, 3, *ids[1:3], 10, 12, 13, 4, 2], skip_special_tokens=True) == \
        tokenizer.decode(ids[1:3])


def test_the_router_loads_it_from_the_engines_files(tekken_model, tmp_path):
    files = read_tokenizer_files(str(tekken_model))
    assert "tekken.json" in files and "chat_template.jinja" in files
    write_tokenizer_files(tmp_path, files)
    replica, engine = load_tokenizer(tmp_path), load_tokenizer(tekken_model)
    assert replica(TEXT)["input_ids"] == engine(TEXT)["input_ids"]
    assert replica.chat_template == engine.chat_template


def test_a_directory_with_tokenizer_json_loads_that(tekken_model, tmp_path):
    from tests.tiny_model import build_tokenizer

    both = tmp_path / "both"
    shutil.copytree(tekken_model, both, ignore=shutil.ignore_patterns("*.safetensors"))
    build_tokenizer().save_pretrained(both)
    assert load_tokenizer(both).bos_token == "<|endoftext|>"


def test_the_tokenizer_checks_accept_a_tekken_only_directory(tekken_model):
    from gpu_worker.model_resolver import check_tokenizer_dir, resolve_tokenizer

    size = json.loads((tekken_model / "tekken.json").read_text())["config"]["default_vocab_size"]
    assert check_tokenizer_dir(str(tekken_model)) == tekken_model.resolve()
    path, tokenizer = resolve_tokenizer(str(tekken_model), vocab_size=size)
    assert path == tekken_model.resolve() and len(tokenizer) == size
    with pytest.raises(ValueError, match="not this model's tokenizer"):
        resolve_tokenizer(str(tekken_model), vocab_size=size - 1)
