"""The MTP head: kept by `pack` (8-bit when the rest is quantized), optional, and computing
what the reference implementations compute (vLLM's / SGLang's Qwen3-Next MTP module);
its routed experts streamed through a pool of their own, with the resident head's bits.

The reference here is written from the source checkpoint's own tensors (HF names,
zero-centred norms, per-expert weights) with plain MLX ops around mlx-lm's decoder
layer, independently of the packer's conversion and of `MtpHead`. The resident head is
that of a container as packed before the experts were streamed (`legacy_container`).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from helpers_forward import tiny_pair
from helpers_mtp import _source_mtp, head_experts, legacy_container
from mlx_lm.models.cache import KVCache

from actors.mlx_worker import MlxWorker
from pipeline.models.dense import load_dense
from pipeline.models.mtp import load_mtp
from pipeline.models.mtp_drafter import MtpDrafter
from pipeline.models.text_parts import text_parts
from qpack import spec
from qpack.mtp import MTP_FILE, SWITCH
from qpack.reader import Container, verify_container


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


def _parts(qpack: Path):
    with Container.open(qpack) as c:
        return text_parts(load_dense(c.config, c.dense_path))


def _inputs(parts, tokens: list[int], seed: int = 0) -> tuple[mx.array, mx.array]:
    hidden = mx.random.normal((1, len(tokens), parts.args.hidden_size), key=mx.random.key(seed))
    embeds = parts.embed_tokens(mx.array([tokens])).astype(mx.float32)
    mx.eval(embeds, hidden)  # made on this thread: the MLX thread then only reads them
    return embeds, hidden


async def _streamed(experts, head, embeds, hidden, cache) -> mx.array:
    out = await experts.forward(head, embeds, hidden, cache, MlxWorker.shared().run)
    return await MlxWorker.shared().run(lambda: mx.eval(out) or out)


async def test_pack_streams_the_heads_experts_and_it_computes_the_reference_forward(
        synth_checkpoint, packed, tmp_path):
    src, qpack = tiny_pair(synth_checkpoint, packed, "qwen3_next")  # fp32, kept float
    with Container.open(qpack) as c:
        m = c.manifest
        assert m.mtp_layers == 1 and m.mtp_experts is not None
        assert m.mtp_experts.index == m.num_layers and m.mtp_experts.file == spec.MTP_EXPERTS_FILE
        assert m.mtp_experts.format.bits is None  # a float container's head stays float
        assert c.moe_layers == [e.index for e in m.layers]  # the head is no layer of the model
    assert not [n for n in mx.load(str(qpack / MTP_FILE)) if n.startswith(SWITCH)]
    assert verify_container(qpack).ok  # its blobs' crc32s and sha256 as a layer's
    parts = _parts(qpack)
    legacy = legacy_container(src, qpack, tmp_path / "legacy.qpack")
    resident = load_mtp(legacy, parts)
    head = load_mtp(qpack, parts, streamed=True)
    w = _source_mtp(src)
    eps = parts.args.rms_norm_eps
    layer = _reference_layer(parts, w)
    tokens = [5, 17, 4242, 9]
    embeds, hidden = _inputs(parts, tokens)
    x = mx.concatenate([_rms(embeds, w["mtp.pre_fc_norm_embedding.weight"], eps),
                        _rms(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)], axis=-1)
    x = x @ w["mtp.fc.weight"].T
    want = _rms(layer(x, mask="causal", cache=KVCache()), w["mtp.norm.weight"], eps)
    cache = KVCache()
    got = resident(embeds, hidden, cache)
    assert cache.offset == 4
    assert mx.abs(got - want).max().item() <= 1e-5
    # Shared lm_head: the head's logits are the model's head on its output.
    assert parts.head(got).shape[-1] == parts.args.vocab_size
    top_k, experts = parts.args.num_experts_per_tok, parts.args.num_experts
    for slots in (top_k, experts):  # one position's experts (rounds), and all of them
        async with head_experts(qpack, parts, slots) as streamed:
            cache = KVCache()
            out = await _streamed(streamed, head, embeds, hidden, cache)
            assert cache.offset == 4
            assert mx.array_equal(out, got).item(), slots
            assert streamed.pool.snapshot().misses > 0
    # A draft reads the last position alone: every position's attention fills the cache,
    # the last one's experts alone are read and computed (streamed = resident, bit for bit).
    cache = KVCache()
    last = resident(embeds, hidden, cache, last_only=True)
    assert cache.offset == 4 and last.shape == (1, 1, got.shape[-1])
    assert mx.allclose(last, got[:, -1:], atol=1e-6).item()
    async with head_experts(qpack, parts, top_k) as streamed:
        cache = KVCache()
        out = await MlxWorker.shared().run(
            lambda o: mx.eval(o) or o,
            await streamed.forward(head, embeds, hidden, cache, MlxWorker.shared().run, last_only=True))
        assert cache.offset == 4 and mx.array_equal(out, last).item()
        assert streamed.pool.snapshot().misses <= top_k  # one position's experts, read once


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
async def test_a_quantized_container_keeps_the_head_at_8_bits_streams_as_the_resident_head(
        synth_checkpoint, packed, family, tmp_path):
    src = synth_checkpoint(family, dtype="bfloat16")
    four = packed(src, bits=4)
    with Container.open(four) as c:
        m = c.manifest
        assert m.mtp_layers == 1 and m.mtp_experts is not None
        fmt = m.mtp_experts.format
        assert (fmt.bits, fmt.group_size, fmt.mode) == (8, 64, "affine")  # the layers' are 4-bit
        assert m.layers[0].format.bits == 4
    weights = mx.load(str(four / MTP_FILE))
    assert not [n for n in weights if n.startswith(SWITCH)]
    parts = _parts(four)
    h = parts.args.hidden_size
    for name in ("fc", "layer.self_attn.q_proj", "layer.mlp.gate"):
        in_dim = weights[f"{name}.scales"].shape[-1] * 64
        assert weights[f"{name}.weight"].shape[-1] * 32 // in_dim == 8, name
    assert weights["fc.scales"].shape[-1] * 64 == 2 * h
    head = load_mtp(four, parts, streamed=True)  # loads strictly, without the experts
    # A container packed before (experts in mtp.safetensors, stacked) still opens and
    # loads; per-expert blobs are the stacked quantization's bytes: the same bits.
    legacy = legacy_container(src, four, tmp_path / "legacy.qpack")
    with Container.open(legacy, verify="full") as c:
        assert c.manifest.mtp_layers == 1 and c.manifest.mtp_experts is None
    resident = load_mtp(legacy, parts)
    embeds, hidden = _inputs(parts, [3, 1000, 70, 5, 9, 11])
    want = resident(embeds, hidden, KVCache())
    mx.eval(want)
    async with head_experts(four, parts, parts.args.num_experts_per_tok) as streamed:
        got = await _streamed(streamed, head, embeds, hidden, KVCache())
    assert mx.array_equal(got, want).item()
    # mlx_lm.convert's output has no head: such a container is valid without one.
    _src, mlx4 = tiny_pair(synth_checkpoint, packed, family, 4)
    with Container.open(mlx4) as c:
        assert c.manifest.mtp_layers == 0 and c.manifest.mtp_experts is None
    assert not (mlx4 / MTP_FILE).exists()


async def test_drafts_with_streamed_experts_equal_the_resident_heads_at_every_pool_size(
        synth_checkpoint, packed, tmp_path):
    """Catch-up over a prompt, drafts fed back, a cut-back pass: the same drafts, bit for
    bit, whether the experts are resident or streamed through a pool that evicts them
    between forwards."""
    src, qpack = tiny_pair(synth_checkpoint, packed, "qwen3_next")
    parts = _parts(qpack)
    resident = load_mtp(legacy_container(src, qpack, tmp_path / "legacy.qpack"), parts)
    head = load_mtp(qpack, parts, streamed=True)
    run = MlxWorker.shared().run
    prompt = [4791, 11, 1879, 0, 151, 3000, 77, 1234]
    want = await _drafts(MtpDrafter(resident, parts, prompt, mx.float32), parts, run)
    assert want and all(want)
    top_k, experts = parts.args.num_experts_per_tok, parts.args.num_experts
    for slots in (top_k, 2 * top_k, experts):
        async with head_experts(qpack, parts, slots) as streamed:
            drafter = MtpDrafter(head, parts, prompt, mx.float32, streamed)
            assert await _drafts(drafter, parts, run) == want, slots
            counts = streamed.pool.snapshot()
            assert counts.misses > 0 and (counts.evictions > 0) == (slots < experts), slots


async def _drafts(drafter: MtpDrafter, parts, run) -> list[list[int]]:
    """Drafts after a prompt, after a kept pass, after a pass cut back to one token."""
    h = parts.args.hidden_size
    out = []

    def feed(start: int, n: int, seed: int) -> None:
        drafter.sink(start + n, mx.random.normal((1, n, h), key=mx.random.key(seed)))

    await run(feed, 0, len(drafter.tokens), 1)
    out.append(await drafter.draft(3, run))
    drafter.extend([out[-1][0], 77])  # one draft kept, then the model's own token
    n = len(drafter.tokens)
    await run(feed, n - 3, 2, 2)  # the pass's positions whose tokens are known
    out.append(await drafter.draft(2, run))
    drafter.extend([5])
    await run(feed, n - 1, 1, 3)
    out.append(await drafter.draft(1, run))
    return out


def test_a_manifest_whose_head_experts_lie_is_refused_in_one_line(synth_checkpoint, packed, tmp_path):
    import json
    import shutil

    from qpack.spec import QpackError

    _src, qpack = tiny_pair(synth_checkpoint, packed, "qwen3_next")
    for name, change in (("index", lambda h: h.update(index=2)),
                         ("stride", lambda h: h.update(stride=h["stride"] * 2)),
                         ("checksums", lambda h: h.update(checksums=h["checksums"][:-1]))):
        copy = tmp_path / f"{name}.qpack"
        shutil.copytree(qpack, copy)
        raw = json.loads((copy / spec.MANIFEST).read_text())
        change(raw["mtp_experts"])
        (copy / spec.MANIFEST).write_text(json.dumps(raw))
        with pytest.raises(QpackError, match="mtp_experts") as info:
            Container.open(copy)
        assert "\n" not in str(info.value), name


async def test_a_long_catch_up_goes_through_the_head_in_pieces_and_predicts_as_one_forward(
        synth_checkpoint, packed, tmp_path):
    """A catch-up over 47 positions (pieces of 32, 8, 4, 2 and 1: a few shapes, each
    compiled once on CUDA) leaves the head's KV cache and its first draft's logits as one
    forward over all 47 does."""
    src, qpack = tiny_pair(synth_checkpoint, packed, "qwen3_next")
    parts = _parts(qpack)
    head = load_mtp(legacy_container(src, qpack, tmp_path / "legacy.qpack"), parts)
    tokens = [(7 * i + 3) % parts.args.vocab_size for i in range(48)]
    embeds, hidden = _inputs(parts, tokens[1:])

    def run() -> tuple[float, float]:
        drafter = MtpDrafter(head, parts, tokens, mx.float32)
        drafter.sink(len(tokens) - 1, hidden)
        inputs = drafter._catch_up()
        assert inputs is not None and inputs[0].shape[1] == 1  # the last piece: one position
        got = head(*inputs, drafter.cache, last_only=True)
        cache = KVCache()
        want = head(embeds, parts.norm(hidden), cache, last_only=True)
        keys = mx.abs(drafter.cache.state[0] - cache.state[0]).max().item()
        return keys, mx.abs(got - want).max().item()

    keys, out = await MlxWorker.shared().run(run)
    assert keys < 1e-5 and out < 1e-4, (keys, out)
