"""Synthetic checkpoints: layouts, loading in mlx-lm, determinism, equality with mlx_lm.convert."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from qpack.synth.checkpoint import synthesize
from qpack.synth.init_weights import WeightSource, f32_to_bf16_bits
from qpack.synth.presets import get_preset
from qpack.synth.st_write import TensorEntry, write_safetensors

FAMILIES = ("qwen3_next", "qwen3_5_moe")


def load_all(path: Path) -> dict[str, mx.array]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    weights: dict[str, mx.array] = {}
    for shard in sorted(set(index["weight_map"].values())):
        weights.update(mx.load(str(path / shard)))
    assert set(weights) == set(index["weight_map"])
    return weights


def forward(path: Path) -> mx.array:
    from mlx_lm.utils import load_model

    model, _ = load_model(path)  # strict: every parameter must be in the checkpoint
    return model(mx.array([[4791, 11, 1879, 0, 220, 643]]))  # under every tiny vocabulary


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bits", [None, 4, 8])
def test_mlx_lm_loads_and_logits_are_sane(synth_checkpoint, family, bits):
    logits = forward(synth_checkpoint(family, bits=bits)).astype(mx.float32)
    assert logits.shape == (1, 6, get_preset(family, "tiny").vocab_size)
    assert bool(mx.isfinite(logits).all())
    assert 0.3 < float(logits.std()) < 10.0
    # Different positions predict different tokens: the model is not degenerate.
    assert len(set(mx.argmax(logits[0], axis=-1).tolist())) > 1


def test_qwen3_next_hub_layout(synth_checkpoint):
    path = synth_checkpoint("qwen3_next")
    d = get_preset("qwen3_next", "tiny")
    w = load_all(path)
    assert len(set(json.loads((path / "model.safetensors.index.json").read_text())
                   ["weight_map"].values())) >= 2
    conv = w["model.layers.0.linear_attn.conv1d.weight"]
    assert conv.shape == (d.conv_dim, 1, d.linear_conv_kernel_dim)
    assert w["model.layers.0.linear_attn.in_proj_qkvz.weight"].shape == (
        2 * d.key_dim + 2 * d.value_dim, d.hidden_size)
    assert w["model.layers.0.linear_attn.in_proj_ba.weight"].shape == (
        2 * d.linear_num_value_heads, d.hidden_size)
    assert w["model.layers.3.self_attn.q_proj.weight"].shape == (
        2 * d.num_attention_heads * d.head_dim, d.hidden_size)
    assert "model.layers.3.linear_attn.A_log" not in w
    assert "model.layers.0.self_attn.q_proj.weight" not in w
    for e in range(d.num_experts):
        assert w[f"model.layers.2.mlp.experts.{e}.down_proj.weight"].shape == (
            d.hidden_size, d.moe_intermediate_size)
    # Zero-centred norms are stored as offsets; the gated DeltaNet norm is stored as is.
    assert abs(float(w["model.layers.1.input_layernorm.weight"].mean())) < 0.05
    assert abs(float(w["model.layers.1.linear_attn.norm.weight"].mean()) - 1.0) < 0.05
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_next"
    assert config["rope_theta"] == 10_000_000 and config["partial_rotary_factor"] == 0.25


def test_qwen3_5_hub_layout_and_per_expert_agree(synth_checkpoint):
    d = get_preset("qwen3_5_moe", "tiny")
    hub = load_all(synth_checkpoint("qwen3_5_moe"))
    per = load_all(synth_checkpoint("qwen3_5_moe", layout="per-expert"))
    p = "model.language_model.layers.1."
    gate_up = hub[p + "mlp.experts.gate_up_proj"]
    down = hub[p + "mlp.experts.down_proj"]
    i, h = d.moe_intermediate_size, d.hidden_size
    assert gate_up.shape == (d.num_experts, 2 * i, h) and down.shape == (d.num_experts, h, i)
    assert hub[p + "linear_attn.A_log"].dtype == mx.float32
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
        assert f"{p}linear_attn.{name}.weight" in hub
    for e in (0, 7, d.num_experts - 1):
        q = f"model.layers.1.mlp.experts.{e}."
        assert mx.array_equal(per[q + "gate_proj.weight"], gate_up[e, :i])
        assert mx.array_equal(per[q + "up_proj.weight"], gate_up[e, i:])
        assert mx.array_equal(per[q + "down_proj.weight"], down[e])
    # Everything but the experts is the same tensor under the other prefix.
    assert mx.array_equal(per["model.embed_tokens.weight"],
                          hub["model.language_model.embed_tokens.weight"])
    assert mx.array_equal(per["lm_head.weight"], hub["lm_head.weight"])


def test_configs_parse_in_transformers(synth_checkpoint):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(synth_checkpoint("qwen3_5_moe"))
    assert cfg.model_type == "qwen3_5_moe" and cfg.text_config.num_experts == 16
    assert cfg.text_config.layer_types[3] == "full_attention"
    cfg = AutoConfig.from_pretrained(synth_checkpoint("qwen3_5_moe", layout="per-expert"))
    assert cfg.model_type == "qwen3_5_moe_text" and cfg.num_experts_per_tok == 4
    cfg = AutoConfig.from_pretrained(synth_checkpoint("qwen3_next"))
    assert cfg.model_type == "qwen3_next" and cfg.linear_num_value_heads == 4


@pytest.mark.parametrize("family", FAMILIES)
def test_mlx_quantized_equals_mlx_lm_convert(synth_checkpoint, tmp_path, family):
    from mlx_lm.convert import convert

    source = synth_checkpoint(family, dtype="bfloat16")
    converted = tmp_path / "converted"
    convert(str(source), str(converted), quantize=True, q_group_size=64, q_bits=4)
    ours = synth_checkpoint(family, dtype="bfloat16", bits=4)
    a, b = load_all(ours), load_all(converted)
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert mx.array_equal(a[name], b[name]), name
    qa = json.loads((ours / "config.json").read_text())["quantization"]
    qb = json.loads((converted / "config.json").read_text())["quantization"]
    assert qa == qb


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    def digest(path: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(path.iterdir())}

    kw = dict(dtype="bfloat16", tokenizer=False, progress=False)
    a = digest(synthesize(tmp_path / "a", "qwen3_next", "tiny", seed=3, **kw))
    b = digest(synthesize(tmp_path / "b", "qwen3_next", "tiny", seed=3, **kw))
    c = digest(synthesize(tmp_path / "c", "qwen3_next", "tiny", seed=4, **kw))
    assert a == b
    shards = [n for n in a if n.endswith(".safetensors")]
    assert all(a[n] != c[n] for n in shards)


def test_max_layers_writes_a_smaller_valid_model(tmp_path):
    out = synthesize(tmp_path / "m", "qwen3_5_moe", "tiny", max_layers=2, dtype="float32",
                     tokenizer=False, progress=False)
    config = json.loads((out / "config.json").read_text())["text_config"]
    assert config["num_hidden_layers"] == 2 and len(config["layer_types"]) == 2
    names = set(load_all(out))
    assert not any(".layers.2." in n for n in names)
    assert "model.language_model.layers.1.mlp.experts.gate_up_proj" in names


def test_router_usage_is_skewed_but_not_degenerate():
    d = get_preset("qwen3_next", "demo")
    src = WeightSource(0, d.num_experts, d.hidden_size)
    x = np.random.default_rng(1).standard_normal((4096, d.hidden_size)).astype(np.float32)
    counts = []
    for layer in range(3):
        logits = x @ src.router(layer).T
        top = np.argpartition(logits, -d.num_experts_per_tok, axis=1)[:, -d.num_experts_per_tok:]
        counts.append(np.bincount(top.ravel(), minlength=d.num_experts) / len(x))
    for share in counts:
        assert share.max() < 0.5  # no expert takes every token
        assert (share > 0).mean() > 0.9  # nearly every expert gets used
        assert share.std() / share.mean() > 0.5  # but use is far from uniform
    # Adjacent layers' routers are correlated (through a permutation), far layers less so.
    r0, r1 = src.router(0), src.router(1)
    best = np.abs(np.corrcoef(r1, r0)[: d.num_experts, d.num_experts :]).max(axis=1)
    assert np.median(best) > 0.3


def test_bf16_rounding_is_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5e-3, 3.0e38], dtype=np.float32)
    bits = f32_to_bf16_bits(x)
    back = (bits.astype(np.uint32) << 16).view(np.float32)
    ref = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
    assert np.array_equal(back, ref)


def test_writer_refuses_wrong_chunk_sizes(tmp_path):
    bad = TensorEntry("x", "F32", (4,), lambda: [np.zeros(3, np.float32)])
    with pytest.raises(ValueError, match="'x'.*produced 12 bytes, expected 16"):
        write_safetensors(tmp_path / "a.safetensors", [bad])


def test_bad_preset_and_family_are_named():
    with pytest.raises(ValueError, match="'huge'"):
        get_preset("qwen3_next", "huge")
    with pytest.raises(ValueError, match="belongs to family 'qwen3_5_moe'"):
        get_preset("qwen3_next", "qwen3.6-35b-a3b")
    assert get_preset(None, "qwen3-next-80b-a3b").num_experts == 512
    assert math.prod((get_preset(None, "qwen3.6-35b-a3b").vocab_size,)) == 248320


def test_cli_writes_and_names_bad_input(tmp_path, capsys):
    import argparse

    from pipeline.cli import synth as synth_cli

    parser = argparse.ArgumentParser(prog="moestream")
    synth_cli.register(parser.add_subparsers(dest="command", required=True))

    def run(*argv: str) -> int:
        args = parser.parse_args(["synth", *argv])
        return args.func(args)

    assert run("--preset", "tiny", "-o", str(tmp_path / "x")) == 2
    assert "needs a family" in capsys.readouterr().err
    assert run("--family", "qwen3_next", "--preset", "qwen3.6-35b-a3b", "-o", str(tmp_path)) == 2
    assert "belongs to family 'qwen3_5_moe'" in capsys.readouterr().err
    out = tmp_path / "q"
    assert run("--family", "qwen3_5_moe", "--preset", "tiny", "-o", str(out), "--bits", "8",
               "--shard-mb", "4", "--no-progress") == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 8
    assert config["quantization"]["language_model.model.layers.0.mlp.gate"] == {
        "group_size": 64, "bits": 8}
    assert (out / "chat_template.jinja").exists() and (out / "tokenizer.json").exists()
