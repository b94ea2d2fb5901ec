"""How a chat template wants a message's content (vLLM's --chat-template-content-format).

"string": the text (a message's text parts joined by newlines). "openai": the list of parts
(``[{"type": "text", "text": ...}]``), for templates that loop over a message's content. "auto"
(the default) reads the template as vLLM does: it is "openai" when it loops over the ``content``
of a message, that is of a loop variable over ``messages`` (or over a variable set from it, such
as ``loop_messages = messages[1:]``), and "string" otherwise.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from typing import Any

from jinja2 import nodes

logger = logging.getLogger(__name__)

CONTENT_FORMATS = ("auto", "string", "openai")
# The kinds of content part whose text a message's content is made of (OpenAI's chat and Responses).
TEXT_PART_TYPES = ("text", "input_text", "output_text", "refusal")
# OpenAI's image part, ``{"type": "image_url", "image_url": {"url": ...}}`` (vision-language models:
# router.multimodal); a template sees ``{"type": "image"}`` in its place, as vLLM gives it.
IMAGE_PART_TYPE = "image_url"
# vLLM's video part, ``{"type": "video_url", "video_url": {"url": ...}}`` (Qwen2-VL, Qwen2.5-VL); a
# template sees ``{"type": "video"}``.
VIDEO_PART_TYPE = "video_url"


@functools.lru_cache(maxsize=64)
def template_content_format(template: str) -> str:
    """"openai" when the template loops over a message's content, else "string"."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        # (transformers' own environment: its extensions, such as {% generation %}, parse.)
        tree = _compile_jinja_template(template).environment.parse(template)
    except Exception as e:  # (a template that cannot be read gets the text)
        logger.warning("cannot read the chat template to tell how it wants message content (%s): giving it text", e)
        return "string"
    message_names = set(_loop_targets(tree, _derived_names(tree, "messages")))
    return "openai" if any(True for _ in _loop_targets(tree, message_names, "content")) else "string"


def _derived_names(tree: nodes.Template, name: str) -> set[str]:
    """``name`` and every variable set from it, or from its items or a slice of it, transitively."""
    names, frontier = {name}, [name]
    while frontier:
        source = frontier.pop()
        for assign in tree.find_all(nodes.Assign):
            if isinstance(assign.target, nodes.Name) and _reads(assign.node, source) \
                    and assign.target.name not in names:
                names.add(assign.target.name)
                frontier.append(assign.target.name)
    return names


def _loop_targets(tree: nodes.Template, names: set[str], key: str | None = None) -> Iterator[str]:
    """The variables of loops over one of ``names`` (or over its ``key``, when given)."""
    for loop in tree.find_all(nodes.For):
        if isinstance(loop.target, nodes.Name) and any(_reads(loop.iter, name, key) for name in names):
            yield loop.target.name


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` is ``name`` (or its ``key``: ``name['key']``, ``name.key``), maybe filtered,
    tested or sliced."""
    while (isinstance(node, nodes.Filter | nodes.Test) and node.node is not None) or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
        node = node.node
    if key is None:
        return isinstance(node, nodes.Name) and node.name == name
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == key and _reads(node.node, name)
    return isinstance(node, nodes.Getattr) and node.attr == key and _reads(node.node, name)


def effective_template(template: str | None, tokenizer_template: str | dict[str, str] | None,
                       tools: bool) -> str | None:
    """The template text a render uses: the given one (or, by name, one of the tokenizer's named
    templates), else the tokenizer's; of a tokenizer's named templates, "tool_use" when tools are
    given (as transformers picks), else "default"."""
    named = tokenizer_template if isinstance(tokenizer_template, dict) else {}
    if template is not None:
        return named.get(template, template)
    if isinstance(tokenizer_template, dict):
        return named.get("tool_use") if tools and "tool_use" in named else named.get("default")
    return tokenizer_template


def resolve_content_format(setting: str, template: str | None, tokenizer_template: str | dict[str, str] | None,
                           tools: bool) -> str:
    """The format a render gives content in: the setting's, or with "auto" the one the template
    reads (the given template, by name among the tokenizer's or as text, else the tokenizer's)."""
    if setting != "auto":
        return setting
    text = effective_template(template, tokenizer_template, tools)
    return template_content_format(text) if text else "string"


def part_text(part: Any) -> str:
    """A content part's text (a bare string counts as a text part, as vLLM reads it)."""
    if isinstance(part, str):
        return part
    return part.get("text") or part.get("refusal") or ""


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == IMAGE_PART_TYPE


def is_video_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == VIDEO_PART_TYPE


def is_media_part(part: Any) -> bool:
    """An image's or a video's part (not text)."""
    return is_image_part(part) or is_video_part(part)


def image_part_url(part: dict[str, Any]) -> str:
    """An image part's URL (its shape checked by the protocol model)."""
    return part[IMAGE_PART_TYPE]["url"]


def template_content(content: str | list[Any] | None, content_format: str, image_placeholder: str | None = None,
                     video_placeholder: str | None = None) -> Any:
    """A message's content in the template's format (its text, image and video parts: others are
    refused earlier). Images are ``{"type": "image"}`` parts where they were (videos ``{"type":
    "video"}``); as text, one ``image_placeholder`` per image (those the text holds already count),
    then one ``video_placeholder`` per video, before the text, joined by newlines, as vLLM writes them
    (no placeholder: they are left out, for a text model's echo)."""
    if content_format == "openai":
        if content is None:
            return []
        if isinstance(content, str):
            return [{"type": "text", "text": content}]
        return [{"type": "image"} if is_image_part(part) else {"type": "video"} if is_video_part(part)
                else {"type": "text", "text": part_text(part)} for part in content]
    if content is None or isinstance(content, str):
        return content or ""
    # (As vLLM joins them, empty ones left out.)
    text = "\n".join(text for text in (part_text(p) for p in content if not is_media_part(p)) if text)
    placeholders = []
    for is_kind, placeholder in ((is_image_part, image_placeholder), (is_video_part, video_placeholder)):
        count = sum(map(is_kind, content))
        if count and placeholder:
            placeholders += [placeholder] * max(count - text.count(placeholder), 0)
    return "\n".join([*placeholders, text]) if placeholders else text
