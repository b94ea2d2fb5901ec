"""The files a router replica loads the model's tokenizer from, as its engines send them (a replica
on another node has no copy of the model). Plain file reading: no tokenizer library here.

* The model's own tokenizer: the tokenizer files of its directory, and its ``config.json`` and
  ``generation_config.json`` (transformers reads the tokenizer's class from the first when
  ``tokenizer_config.json`` names none).
* ``--tokenizer DIR``: every file of that directory (and its ``additional_chat_templates/``), not one
  of the model's mixed in, so the replica loads what the engine loaded; weights and files over
  ``MAX_FILE_BYTES`` (a tokenizer's are far smaller) are left out.
* Either way, a vision-language model's image processor config (``preprocessor_config.json``, or
  nested in ``processor_config.json`` as transformers 5 saves it) from the model's directory: the
  router turns images into the encoder's input with it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from engine_core.tokenizer_loader import TEKKEN_FILE

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
                   "added_tokens.json", "spiece.model", "sentencepiece.bpe.model", TEKKEN_FILE)
MODEL_FILES = ("config.json", "generation_config.json")
# The model's image processor (vision-language models), whatever the tokenizer's directory.
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
# (transformers 5 saves a processor's parts in one file, the image processor's under "image_processor")
PROCESSOR_FILE = "processor_config.json"
# (A video processor's own file, where it is not nested in processor_config.json.)
VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"
PROCESSOR_FILES = (IMAGE_PROCESSOR_FILE, PROCESSOR_FILE)
TEMPLATES_DIR = "additional_chat_templates"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")
MAX_FILE_BYTES = 64 * 1024 * 1024


def read_tokenizer_files(model_dir: str, tokenizer_dir: str = "") -> dict[str, bytes]:
    """Name (relative to the directory) → contents, of the files that make the tokenizer (and the
    model's image processor)."""
    processor = _read(model_dir, list(PROCESSOR_FILES)) if model_dir else {}
    if not tokenizer_dir:
        return _read(model_dir, [*TOKENIZER_FILES, *MODEL_FILES]) | processor
    root = Path(tokenizer_dir)
    names = [p.name for p in root.iterdir() if p.is_file()]
    templates = root / TEMPLATES_DIR
    if templates.is_dir():
        names += [f"{TEMPLATES_DIR}/{p.name}" for p in templates.iterdir() if p.is_file()]
    # (The image processor's files are the model's alone, as the engines read them.)
    return _read(tokenizer_dir, [name for name in sorted(names) if not name.endswith(WEIGHT_SUFFIXES)
                                 and name not in PROCESSOR_FILES
                                 and (root / name).stat().st_size <= MAX_FILE_BYTES]) | processor


def write_tokenizer_files(directory: str | os.PathLike[str], files: dict[str, bytes]) -> None:
    """Put the files an engine sent into ``directory`` (to load the tokenizer from)."""
    for name, data in files.items():
        target = Path(directory) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def _read(directory: str, names: list[str]) -> dict[str, bytes]:
    files = {}
    for name in names:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                files[name] = f.read()
    return files


def read_image_processor_config(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A model directory's image processor config, as transformers finds it: nested in
    processor_config.json, else preprocessor_config.json; None where neither holds one."""
    return _processor_config(directory, "image_processor", IMAGE_PROCESSOR_FILE)


def read_video_processor_config(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A model directory's video processor config (Qwen2-VL's frames' pixel range), as transformers
    finds it: nested in processor_config.json, else video_preprocessor_config.json, else the image
    processor's preprocessor_config.json (the released Qwen2-VL / Qwen2.5-VL checkpoints' only one);
    None where none holds one."""
    return (_processor_config(directory, "video_processor", VIDEO_PROCESSOR_FILE)
            or _processor_config(directory, "image_processor", IMAGE_PROCESSOR_FILE))


def _processor_config(directory: str | os.PathLike[str], key: str, file: str) -> dict[str, Any] | None:
    nested = Path(directory) / PROCESSOR_FILE
    if nested.is_file():
        processor = json.loads(nested.read_text())
        if isinstance(processor, dict) and isinstance(processor.get(key), dict):
            return processor[key]
    plain = Path(directory) / file
    config = json.loads(plain.read_text()) if plain.is_file() else None
    return config if isinstance(config, dict) else None
