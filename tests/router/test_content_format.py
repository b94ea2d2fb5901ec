"""--chat-template-content-format: how a template wants message content, read from the template."""

from __future__ import annotations

import pytest

from router.content_format import effective_template, template_content, template_content_format

PARTS = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]


@pytest.mark.parametrize(("template", "expected"), [
    ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% endfor %}", "string"),
    ("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    # Through a variable, and through a filter.
    ("{% for m in messages %}{% set parts = m['content'] %}{% for p in parts %}{{ p.text }}{% endfor %}"
     "{% endfor %}", "openai"),
    ("{% for m in messages %}{% for p in m['content'] | selectattr('type', 'equalto', 'text') %}{{ p.text }}"
     "{% endfor %}{% endfor %}", "openai"),
    # Llama 4's and Gemma 3's kind: text, or a loop over the parts (vLLM's auto also gives them parts).
    ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
     "{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}{% endfor %}", "openai"),
    # Loops over the messages or the tools are not loops over content.
    ("{% for t in tools %}{{ t }}{% endfor %}{% for m in messages[1:] %}{{ m.content }}{% endfor %}", "string"),
    ("{% for m in messages %}{{ m['content'] }", "string"),  # (unreadable here: text)
])
def test_auto_detects_a_template_that_loops_over_a_messages_content(template, expected):
    assert template_content_format(template) == expected


def test_content_in_each_format():
    assert template_content(PARTS, "string") == "Hi\nthere"
    assert template_content("Hi", "string") == "Hi" and template_content(None, "string") == ""
    assert template_content(PARTS, "openai") == PARTS
    assert template_content("Hi", "openai") == [{"type": "text", "text": "Hi"}]
    assert template_content(None, "openai") == []


def test_a_tokenizers_named_templates_pick_tool_use_with_tools():
    named = {"default": "D", "tool_use": "T"}
    assert effective_template(named, tools=True) == "T" and effective_template(named, tools=False) == "D"
    assert effective_template({"default": "D"}, tools=True) == "D" and effective_template("S", tools=True) == "S"
