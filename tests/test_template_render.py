"""Chat templates rendered as transformers renders them (pipeline/template_render.py): the
parts of its `apply_chat_template` that Hub templates rely on."""

from __future__ import annotations

from pipeline.template_render import render

USER = {"role": "user", "content": "a"}


def test_the_generation_tag_renders_its_body() -> None:
    """transformers' `{% generation %}` (assistant-token masks) compiles and passes through."""
    template = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
                "[{{ m.content }}]{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}")
    assert render(template, [USER, {"role": "assistant", "content": "b"}]) == "a[b]"


def test_a_messages_none_valued_keys_are_dropped_as_transformers_drops_them() -> None:
    template = ("{% for m in messages %}{{ 'tool_calls' in m }} {{ m.content is defined }}"
                "{% if 'tool_calls' in m %}{% for c in m.tool_calls %}x{% endfor %}{% endif %};{% endfor %}")
    calls = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [{"role": "assistant", "content": None, "tool_calls": None},
                {"role": "assistant", "content": None, "tool_calls": calls}]
    assert render(template, messages) == "False False;True Falsex;"
    assert messages[0] == {"role": "assistant", "content": None, "tool_calls": None}  # not edited


def test_variables_may_take_any_name_the_call_does_not() -> None:
    """chat_template_kwargs named like the render call's own parameters reach the template."""
    assert render("{{ template }}|{{ messages | length }}", [USER], template="t") == "t|1"
    assert "TemplateReference" not in render("{{ messages[0].content }}", [USER], self="s")

