"""The model's default sampling parameters (vLLM's --generation-config and --override-generation-config).

Model creators put the sampling they recommend in ``generation_config.json`` (Llama 3 Instruct:
temperature 0.6, top_p 0.9; Qwen: top_k 20, top_p 0.8, repetition_penalty 1.05, ...). As vLLM does
by default, a request that leaves one of these parameters unset gets the model's value instead of
the neutral one (temperature 1, top_p 1, no top_k, ...), and the file's ``max_new_tokens`` caps
``max_tokens``. The source:

* ``"auto"`` (the default): the model's own ``generation_config.json``;
* ``"vllm"``: none, every parameter keeps its neutral default;
* a folder: the ``generation_config.json`` in it.

``override_generation_config`` sets values over the source's (with ``"vllm"`` too). Only the six
parameters below are taken, as in vLLM; a file without them gives no defaults. Values are checked
here, when the engine starts, so a bad file is refused once, naming itself, instead of failing
every request that would have used it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from engine_core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json's names; max_new_tokens becomes max_tokens.
GENERATION_DEFAULT_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
GENERATION_CONFIG_FILE = "generation_config.json"


def model_sampling_defaults(model_dir: str | Path, generation_config: str = "auto",
                            override: dict[str, Any] | None = None) -> dict[str, float | int]:
    """The sampling parameters a request gets for those it leaves unset: a dict of (some of)
    temperature, top_p, top_k, min_p, repetition_penalty and max_tokens; empty for none."""
    if generation_config == "vllm":
        source, values = "--generation-config vllm", {}
    else:
        folder = Path(model_dir) if generation_config == "auto" else Path(generation_config)
        if generation_config != "auto" and not folder.is_dir():
            raise ValueError(f"generation_config {generation_config!r} must be 'auto', 'vllm' or a folder holding "
                             f"{GENERATION_CONFIG_FILE}, and it is not a folder")
        path = folder / GENERATION_CONFIG_FILE
        source = str(path)
        values = _read_json_object(path) if path.is_file() else {}
    found = {key: values[key] for key in GENERATION_DEFAULT_KEYS if values.get(key) is not None}
    if override:
        ignored = sorted(set(override) - set(GENERATION_DEFAULT_KEYS))
        if ignored:
            logger.warning("override_generation_config: %s ignored (only %s are request defaults)",
                           ", ".join(ignored), ", ".join(GENERATION_DEFAULT_KEYS))
        found |= {key: value for key, value in override.items() if key in GENERATION_DEFAULT_KEYS and value is not None}
        source += " with override_generation_config"
    defaults = {("max_tokens" if key == "max_new_tokens" else key): value for key, value in found.items()}
    check_sampling_defaults(defaults, source)
    return defaults


def check_sampling_defaults(defaults: dict[str, Any], source: str) -> None:
    """Each default must be a value a request could send (the engine's own checks, and types)."""
    for key, value in defaults.items():
        integral = key in ("top_k", "max_tokens")
        if isinstance(value, bool) or not isinstance(value, int | float) or (integral and not isinstance(value, int)):
            raise ValueError(f"{source}: {key} must be {'an integer' if integral else 'a number'}, got {value!r}")
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data
