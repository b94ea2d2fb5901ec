"""The output constraint a chat request's ``tool_choice`` asks of the engine (structured output, in
the engine's form): a named function's ``parameters`` schema, or for ``"required"`` a JSON array of
``{"name", "parameters"}`` calls to the given tools."""

from __future__ import annotations

from typing import Any


def tool_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema; a function without one (or with ``{}``) takes an object, as in
    vLLM (an empty schema would let any JSON value through as the arguments)."""
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}}


def tool_choice_constraint(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any],
                           parallel_tool_calls: bool) -> dict[str, Any] | None:
    """The structured-output spec (engine form) a tool choice needs, or None (``none``, ``auto``)."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        tool = next(t for t in tools if t["function"]["name"] == name)
        return {"json": tool_parameters(tool)}
    if tool_choice != "required":
        return None
    # A tool's "$ref": "#/$defs/X" points at its own schema's root; nested in the array below, the
    # root is the array's, so every tool's definitions move there (as vLLM moves them).
    definitions: dict[str, dict[str, Any]] = {}
    one_call = []
    for t in tools:
        params = dict(tool_parameters(t))
        for key in _DEFINITION_KEYS:
            for name, schema in (params.pop(key, None) or {}).items():
                if definitions.setdefault(key, {}).setdefault(name, schema) != schema:
                    raise ValueError(f"tools define {key} {name!r} differently; under tool_choice \"required\" "
                                     "every tool's definitions share one namespace")
        one_call.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                        "parameters": params},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_call}, **definitions}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return {"json": schema}


# Where JSON Schema keeps the definitions "$ref" points at (2019-09 on, and draft 7 before it).
_DEFINITION_KEYS = ("$defs", "definitions")
