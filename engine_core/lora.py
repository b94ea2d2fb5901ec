"""LoRA adapters: how ``--lora-modules`` names them, and the ids they get.

A request names its adapter with ``LoRARequest`` (in ``engine_core.outputs``, with the other types
that cross the router -> engine boundary): a name, an integer id and a checkpoint directory. Ids are
assigned where adapters are registered: static adapters (``--lora-modules``) get 1, 2, ... in the
order given, the same in every router replica and engine, so no coordination is needed.
"""

from __future__ import annotations

import msgspec

from engine_core.outputs import LoRARequest


class LoRANotLoadedError(LookupError):
    """A request names an adapter the engine does not hold (never loaded, or unloaded since)."""


class LoRAModule(msgspec.Struct, frozen=True, array_like=True):
    """One ``--lora-modules`` entry: an adapter served under ``name`` from the directory ``path``;
    ``base_model_name`` (vLLM's JSON key, optional) names the served model it belongs to."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """``name=path`` or vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            data = msgspec.json.decode(text)
        except msgspec.DecodeError as e:
            raise ValueError(f"--lora-modules: not valid JSON: {text!r} ({e})") from None
        if not isinstance(data, dict) or not data.get("name") or not data.get("path"):
            raise ValueError(f"--lora-modules: JSON entries need 'name' and 'path', got {text!r}")
        if unknown := sorted(set(data) - {"name", "path", "base_model_name"}):
            # (vLLM refuses them too: a misspelt base_model_name would be dropped without a word.)
            raise ValueError(f"--lora-modules: unknown keys {unknown} in {text!r} (name, path, base_model_name)")
        base = data.get("base_model_name")
        return LoRAModule(str(data["name"]), str(data["path"]), None if base is None else str(base))
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules: expected name=path, got {text!r}")
    return LoRAModule(name.strip(), path.strip())


def static_lora_requests(modules: tuple[LoRAModule, ...] | list[LoRAModule]) -> list[LoRARequest]:
    """The requests for ``--lora-modules``: ids 1, 2, ... in order (names must be unique)."""
    seen: set[str] = set()
    out = []
    for i, module in enumerate(modules, start=1):
        if module.name in seen:
            raise ValueError(f"--lora-modules: the name {module.name!r} is given twice")
        seen.add(module.name)
        out.append(LoRARequest(module.name, i, module.path))
    return out
