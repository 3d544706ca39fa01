"""The MTP head: kept by `pack` (8-bit when the rest is quantized), optional, and computing
what the reference implementations compute (vLLM's / SGLang's Qwen3-Next MTP module).

The reference here is written from the source checkpoint's own tensors (HF names,
zero-centred norms, per-expert weights) with plain MLX ops around mlx-lm's decoder
layer, independently of the packer's conversion and of `MtpHead`.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from helpers_forward import tiny_pair
from mlx_lm.models.cache import KVCache

from pipeline.models.dense import load_dense
from pipeline.models.mtp import load_mtp
from pipeline.models.text_parts import text_parts
from qpack.mtp import MTP_FILE
from qpack.reader import Container


def _source(src: Path) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for shard in sorted(src.glob("*.safetensors")):
        out.update({k: v for k, v in mx.load(str(shard)).items() if k.startswith("mtp.")})
    return out


def _rms(x: mx.array, w: mx.array, eps: float) -> mx.array:
    """Qwen3-Next's zero-centred RMSNorm: x / rms(x) * (1 + w)."""
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def _reference_layer(parts, weights: dict[str, mx.array]) -> nn.Module:
    args = parts.args
    fa = next(i for i, layer in enumerate(parts.layers) if not layer.is_linear)
    layer = type(parts.layers[fa])(args, fa)
    p = "mtp.layers.0."
    own = {}
    for name, arr in weights.items():
        if not name.startswith(p) or ".experts." in name:
            continue
        rel = name[len(p):]
        own[rel] = arr + 1.0 if arr.ndim == 1 and rel.endswith("norm.weight") else arr
    for proj in ("gate_proj", "up_proj", "down_proj"):
        own[f"mlp.switch_mlp.{proj}.weight"] = mx.stack(
            [weights[f"{p}mlp.experts.{e}.{proj}.weight"] for e in range(args.num_experts)])
    layer.load_weights(list(own.items()), strict=True)
    return layer


def test_pack_keeps_the_mtp_head_and_it_computes_the_reference_forward(synth_checkpoint, packed):
    src, qpack = tiny_pair(synth_checkpoint, packed, "qwen3_next")  # fp32, kept float
    with Container.open(qpack) as c:
        assert c.manifest.mtp_layers == 1
        parts = text_parts(load_dense(c.config, c.dense_path))
    head = load_mtp(qpack, parts)
    w = _source(src)
    eps = parts.args.rms_norm_eps
    layer = _reference_layer(parts, w)
    tokens = mx.array([[5, 17, 4242, 9]])
    hidden = mx.random.normal((1, 4, parts.args.hidden_size), key=mx.random.key(0))
    embeds = parts.embed_tokens(tokens)
    x = mx.concatenate([_rms(embeds, w["mtp.pre_fc_norm_embedding.weight"], eps),
                        _rms(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)], axis=-1)
    x = x @ w["mtp.fc.weight"].T
    want = _rms(layer(x, mask="causal", cache=KVCache()), w["mtp.norm.weight"], eps)
    cache = KVCache()
    got = head(embeds, hidden, cache)
    assert cache.offset == 4
    assert mx.abs(got - want).max().item() <= 1e-5
    # Shared lm_head: the head's logits are the model's head on its output.
    assert parts.head(got).shape[-1] == parts.args.vocab_size


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_a_quantized_container_keeps_the_head_at_8_bits_and_mlx_sources_have_none(
        synth_checkpoint, packed, family):
    four = packed(synth_checkpoint(family, dtype="bfloat16"), bits=4)
    with Container.open(four) as c:
        assert c.manifest.mtp_layers == 1
        parts = text_parts(load_dense(c.config, c.dense_path))
    weights = mx.load(str(four / MTP_FILE))
    h = parts.args.hidden_size
    for name in ("fc", "layer.self_attn.q_proj", "layer.mlp.switch_mlp.down_proj", "layer.mlp.gate"):
        in_dim = weights[f"{name}.scales"].shape[-1] * 64
        assert weights[f"{name}.weight"].shape[-1] * 32 // in_dim == 8, name
    assert weights["fc.scales"].shape[-1] * 64 == 2 * h
    load_mtp(four, parts)  # loads strictly
    # mlx_lm.convert's output has no head: such a container is valid without one.
    _src, mlx4 = tiny_pair(synth_checkpoint, packed, family, 4)
    with Container.open(mlx4) as c:
        assert c.manifest.mtp_layers == 0
    assert not (mlx4 / MTP_FILE).exists()
