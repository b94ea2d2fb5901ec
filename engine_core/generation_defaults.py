"""The model's default sampling parameters (vLLM's --generation-config and --override-generation-config).

Model creators put the sampling they recommend in ``generation_config.json`` (Llama 3 Instruct:
temperature 0.6, top_p 0.9; Qwen: top_k 20, top_p 0.8, repetition_penalty 1.05, ...). As vLLM does
by default, a request that leaves one of these parameters unset gets the model's value instead of
the neutral one (temperature 1, top_p 1, no top_k, ...), and the file's ``max_new_tokens`` caps
``max_tokens``. The source:

* ``"auto"`` (the default): the model's own ``generation_config.json``;
* ``"vllm"``: none, every parameter keeps its neutral default;
* a folder: the ``generation_config.json`` in it.

``override_generation_config`` sets values over the source's (with ``"vllm"`` too); a null there
removes the source's value (``{"max_new_tokens": null}`` drops its cap), as in vLLM. Only the six
parameters below are taken, as in vLLM; a file without them gives no defaults. Values are checked
here, when the engine starts: one no request could send is dropped with a warning when it comes from
the model's own file (vLLM would start, and fail the requests that used it), and refused, naming
its source, when the user chose it (a folder or an override).
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


def check_generation_flags(generation_config: str, override: dict[str, Any] | None) -> None:
    """What ``model_sampling_defaults`` would refuse of the flags themselves (a folder that is not
    one, a chosen file or override value no request could send), without the model: the CLI checks
    them before it starts anything. (The model's own file, "auto", is the engines' to read.)"""
    model_sampling_defaults("", "vllm" if generation_config == "auto" else generation_config, override)


def model_sampling_defaults(model_dir: str | Path, generation_config: str = "auto",
                            override: dict[str, Any] | None = None) -> dict[str, float | int]:
    """The sampling parameters a request gets for those it leaves unset: a dict of (some of)
    temperature, top_p, top_k, min_p, repetition_penalty and max_tokens; empty for none."""
    values: dict[str, Any] = {}
    if generation_config != "vllm":
        folder = Path(model_dir) if generation_config == "auto" else Path(generation_config).expanduser()
        if generation_config != "auto" and not folder.is_dir():
            raise ValueError(f"generation_config {generation_config!r} must be 'auto', 'vllm' or a folder holding "
                             f"{GENERATION_CONFIG_FILE}, and it is not a folder")
        path = folder / GENERATION_CONFIG_FILE
        if path.is_file():
            values = _read_json_object(path)
        elif generation_config != "auto":
            logger.warning("generation_config %r holds no %s: no default sampling parameters", generation_config,
                           GENERATION_CONFIG_FILE)
        found = _usable(values, str(path), strict=generation_config != "auto")
    else:
        found = {}
    if override:
        ignored = sorted(set(override) - set(GENERATION_DEFAULT_KEYS))
        if ignored:
            logger.warning("override_generation_config: %s ignored (only %s are request defaults)",
                           ", ".join(ignored), ", ".join(GENERATION_DEFAULT_KEYS))
        found = {**found, **_usable(override, "override_generation_config", strict=True)}
        found = {key: value for key, value in found.items() if override.get(key, value) is not None}
    return {("max_tokens" if key == "max_new_tokens" else key): value for key, value in found.items()}


def _usable(values: dict[str, Any], source: str, strict: bool) -> dict[str, Any]:
    """The sampling defaults among ``values`` (nulls are unset), each one a request could send: a bad
    one is refused naming ``source`` when ``strict``, else dropped with a warning."""
    usable = {}
    for key in GENERATION_DEFAULT_KEYS:
        value = values.get(key)
        if value is None:
            continue
        problem = sampling_default_problem(key, value)
        if problem is None:
            usable[key] = value
        elif strict:
            raise ValueError(f"{source}: {problem}")
        else:
            logger.warning("%s: %s; left out of the default sampling parameters", source, problem)
    return usable


def sampling_default_problem(key: str, value: Any) -> str | None:
    """Why ``value`` cannot be the default of ``key`` (generation_config.json's name), or None."""
    integral = key in ("top_k", "max_new_tokens")
    if isinstance(value, bool) or not isinstance(value, int | float) or (integral and not isinstance(value, int)):
        return f"{key} must be {'an integer' if integral else 'a number'}, got {value!r}"
    try:
        SamplingParams(**{"max_tokens" if key == "max_new_tokens" else key: value})
    except ValueError as e:
        return str(e).replace("max_tokens", key, 1) if key == "max_new_tokens" else str(e)
    return None


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data
