"""How a chat template wants a message's content (vLLM's --chat-template-content-format).

"string": the text (a message's text parts joined by newlines). "openai": the list of parts
(``[{"type": "text", "text": ...}]``), for templates that loop over a message's content. "auto"
(the default) reads the template: one that loops over a message's ``content`` (directly, or
through a variable set from it) gets the parts, any other the text.
"""

from __future__ import annotations

import functools
from typing import Any

import jinja2
from jinja2 import nodes

CONTENT_FORMATS = ("auto", "string", "openai")


@functools.lru_cache(maxsize=64)
def template_content_format(template: str) -> str:
    """"openai" when the template loops over a message's content, else "string"."""
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"  # (a template jinja2 cannot read here will fail, or not, on the text)
    content_names = {assign.target.name for assign in tree.find_all(nodes.Assign)
                     if isinstance(assign.target, nodes.Name) and _reads_content(assign.node)}
    for loop in tree.find_all(nodes.For):
        iterated = _unfiltered(loop.iter)
        if _reads_content(iterated) or (isinstance(iterated, nodes.Name) and iterated.name in content_names):
            return "openai"
    return "string"


def _unfiltered(node: nodes.Node) -> nodes.Node:
    while isinstance(node, nodes.Filter) and node.node is not None:  # content | selectattr(...), ...
        node = node.node
    return node


def _reads_content(node: nodes.Node) -> bool:
    node = _unfiltered(node)
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return isinstance(node, nodes.Getattr) and node.attr == "content"


def effective_template(template: str | dict[str, str] | None, tools: bool) -> str | None:
    """The template text a render uses: a tokenizer's named templates pick "tool_use" when tools are
    given (as transformers does), else "default"."""
    if isinstance(template, dict):
        return template.get("tool_use") if tools and "tool_use" in template else template.get("default")
    return template


def template_content(content: str | list[dict[str, Any]] | None, content_format: str) -> Any:
    """A message's content in the template's format (text parts only: others are refused earlier)."""
    if content_format == "openai":
        if content is None:
            return []
        if isinstance(content, str):
            return [{"type": "text", "text": content}]
        return [{"type": "text", "text": part.get("text", "")} for part in content]
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(part.get("text", "") for part in content)  # (as vLLM joins text parts)
