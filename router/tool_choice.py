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
    one_call = [{"type": "object",
                 "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                "parameters": tool_parameters(t)},
                 "required": ["name", "parameters"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_call}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return {"json": schema}
