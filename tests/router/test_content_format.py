"""--chat-template-content-format: how a template wants message content, read from the template."""

from __future__ import annotations

import pytest

from router.content_format import effective_template, template_content, template_content_format

PARTS = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]


@pytest.mark.parametrize(("template", "expected"), [
    ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% endfor %}", "string"),
    ("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    # Filtered, tested or sliced; through a variable set from the messages (or a slice of them).
    ("{% for m in messages %}{% for p in m['content'] | selectattr('type', 'equalto', 'text') %}{{ p.text }}"
     "{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for p in m['content'][1:] %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% set loop_messages = messages[1:] %}{% for message in loop_messages %}"
     "{% for item in message['content'] if item['type'] == 'text' %}{{ item['text'] }}{% endfor %}{% endfor %}",
     "openai"),
    # Llama 4's and Gemma 3's kind: text, or a loop over the parts (vLLM's auto gives them parts).
    ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
     "{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}{% endfor %}", "openai"),
    # transformers' {% generation %} tag (templates of assistant-only-loss fine-tunes) parses.
    ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{% for p in m['content'] %}"
     "{{ p.text }}{% endfor %}{% endgeneration %}{% endif %}{% endfor %}", "openai"),
    # Not a message's content: the first message's alone (a system block), another object's, a
    # variable set from a message's content (vLLM does not follow those either), the tools.
    ("{% for p in messages[0]['content'] %}{{ p }}{% endfor %}{% for m in messages %}{{ '[INST]' + m['content'] }}"
     "{% endfor %}", "string"),
    ("{% for m in messages %}{% for call in m.tool_calls or [] %}{% for x in call.content %}{{ x }}{% endfor %}"
     "{% endfor %}{{ m.content }}{% endfor %}", "string"),
    ("{% for m in messages %}{% set c = m.content | trim %}{% for ch in c %}{{ ch }}{% endfor %}{% endfor %}",
     "string"),
    ("{% for t in tools %}{{ t }}{% endfor %}{% for m in messages[1:] %}{{ m.content }}{% endfor %}", "string"),
    ("{% for m in messages %}{{ m['content'] }", "string"),  # (unreadable: text)
])
def test_auto_detects_a_template_that_loops_over_a_messages_content(template, expected):
    assert template_content_format(template) == expected


def test_content_in_each_format():
    assert template_content(PARTS, "string") == "Hi\nthere"
    assert template_content(["Hi", {"type": "text", "text": ""}, {"type": "refusal", "refusal": "no"}],
                            "string") == "Hi\nno"  # (bare strings are text parts; empty parts left out)
    assert template_content("Hi", "string") == "Hi" and template_content(None, "string") == ""
    assert template_content(PARTS, "openai") == PARTS
    assert template_content("Hi", "openai") == [{"type": "text", "text": "Hi"}]
    assert template_content(None, "openai") == []


def test_the_template_a_render_uses():
    named = {"default": "D", "tool_use": "T", "rag": "R"}
    assert effective_template(None, named, tools=True) == "T" and effective_template(None, named, tools=False) == "D"
    assert effective_template(None, {"default": "D"}, tools=True) == "D"
    assert effective_template(None, "S", tools=True) == "S"
    # A request's (or --chat-template's) own: by name among the tokenizer's, or the text itself.
    assert effective_template("rag", named, tools=False) == "R"
    assert effective_template("{{ x }}", named, tools=False) == "{{ x }}"
