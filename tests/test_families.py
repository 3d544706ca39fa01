"""The family registry: every family is one module per layer, found by its name, and an
unsupported model_type is refused with one line naming the supported ones."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from pipeline.models.families import ForwardFamily, forward_family
from qpack import families
from qpack.families import UnsupportedModel, canonical, family
from qpack.source import open_source
from qpack.spec import QpackError
from qpack.synth.presets import get_preset

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", families.names())
def test_each_family_has_its_modules_and_presets(name):
    fam = family(name)
    assert fam.name == name
    assert (ROOT / "qpack" / "families" / f"{name}.py").is_file()
    assert isinstance(forward_family(name), ForwardFamily)
    assert "tiny" in fam.presets
    for preset in (*fam.presets, *fam.full_size):
        get_preset(name, preset).check()
    for alias in fam.aliases:
        assert canonical(alias) == name and forward_family(alias) is forward_family(name)


def test_an_unsupported_model_type_is_one_line_naming_the_supported(tmp_path):
    with pytest.raises(UnsupportedModel) as info:
        family("llama")
    assert str(info.value).count("\n") == 0
    assert all(name in str(info.value) for name in families.names())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(QpackError, match="model_type 'llama' is not supported; supported: qwen3_next"):
        open_source(tmp_path)


def _string_constants(path: Path) -> set[str]:
    """String literals of a module, docstrings and other bare expressions left out."""
    tree = ast.parse(path.read_text())
    bare = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    return {n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in bare}


def test_no_product_module_outside_the_family_modules_names_a_family():
    """One fact in one place: adding a family touches its modules and the registry line."""
    allowed = ("qpack/families/", "pipeline/models/families/",
               "qpack/synth/wild.py")  # layouts found in the wild, each derived from one family
    found = []
    for top in ("qpack", "actors", "pipeline"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(allowed):
                found += [f"{rel}: {s}" for s in _string_constants(path) & set(families.names())]
    assert found == []


@pytest.mark.parametrize("name", families.names())
def test_each_template_writes_tool_calls_in_its_declared_style(name):
    """`tool_call_style` is what each chat variant's template renders (transformers' Jinja setup)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    fam = family(name)
    markers = {"json": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
              "xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>",
              "kv": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>",
              "sep": '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>',
              "harmony": ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                          '{"city": "Paris"}<|call|>'),
               "kimi": '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}]
    for variant in fam.variants:
        text = _compile_jinja_template(fam.chat_template(variant)).render(
            messages=messages, tools=tools, add_generation_prompt=False)
        assert markers[fam.tool_call_style(variant)] in text, (variant, text)
