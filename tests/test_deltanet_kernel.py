"""The CUDA Gated DeltaNet kernel's place in mlx-lm's recurrence (pipeline/models/deltanet_kernel.py).

The kernel itself needs a CUDA GPU: its differences from mlx-lm's ops path, its time and
memory are measured there (`benchmarks/deltanet_kernel_check.py`, docs/results.md). Here:
installing it reroutes mlx-lm's ops path, which off CUDA must stay mlx-lm's bit for bit,
masks and grouped heads included, and a model built by the engine takes it."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import gated_delta

from pipeline.models import deltanet_kernel


def _inputs(b: int, t: int, hk: int, hv: int, d: int) -> list[mx.array]:
    mx.random.seed(7)
    q, k = (mx.random.normal((b, t, hk, d)) * 0.1 for _ in range(2))
    v = mx.random.normal((b, t, hv, d))
    a, beta_logits = mx.random.normal((b, t, hv)), mx.random.normal((b, t, hv))
    return [q, k, v, a, beta_logits, mx.random.normal((hv,)), mx.zeros((hv,)), mx.random.normal((b, hv, d, d)) * 0.1]


@pytest.mark.parametrize("masked", [False, True])
def test_installed_off_cuda_the_recurrence_is_mlx_lms_bit_for_bit(masked: bool) -> None:
    deltanet_kernel.install()
    deltanet_kernel.install()  # idempotent: the original is kept once, not wrapped twice
    original = deltanet_kernel._original
    assert gated_delta.gated_delta_ops is deltanet_kernel.ops and original is not deltanet_kernel.ops
    assert original is not None and not deltanet_kernel.enabled()  # this CPU: mlx-lm's ops
    q, k, v, a, b, a_log, dt_bias, state = _inputs(2, 5, 2, 4, 32)  # two value heads a key head
    mask = mx.array([[False, True, True, True, True], [True] * 5]) if masked else None
    y, s = gated_delta.gated_delta_update(q, k, v, a, b, a_log, dt_bias, state, mask)
    beta, g = mx.sigmoid(b), gated_delta.compute_g(a_log, a, dt_bias)
    y0, s0 = original(q, k, v, g, beta, state, mask)
    assert mx.array_equal(y, y0).item() and mx.array_equal(s, s0).item()
    # The padded step left its row's state as it was: the mask reached the ops.
    if masked:
        _, unpadded = original(q, k, v, g, beta, state, None)
        assert not mx.array_equal(s[0], unpadded[0]).item() and mx.array_equal(s[1], unpadded[1]).item()


def test_where_it_applies_the_ops_path_is_the_kernel_and_bad_shapes_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    deltanet_kernel.install()
    q, k, v, a, b, a_log, dt_bias, state = _inputs(1, 3, 2, 4, 32)
    g, beta = gated_delta.compute_g(a_log, a, dt_bias), mx.sigmoid(b)
    calls: list[tuple[int, ...]] = []

    def kernel(*args: mx.array) -> tuple[mx.array, mx.array]:
        calls.append(tuple(args[0].shape))
        return args[2], args[5]

    monkeypatch.setattr(deltanet_kernel, "applies", lambda k, g: True)
    monkeypatch.setattr(deltanet_kernel, "recurrence", kernel)
    y, s = gated_delta.gated_delta_ops(q, k, v, g, beta, state)
    assert calls == [(1, 3, 2, 32)] and y is v and s is state
    gated_delta.gated_delta_ops(q, k, v, g, beta, None)  # no state yet: mlx-lm's ops make it
    assert len(calls) == 1
    monkeypatch.undo()
    with pytest.raises(ValueError, match="gated delta kernel: shapes"):
        deltanet_kernel.recurrence(q, k, v, g, beta, state[:, :3])  # a head short


def test_the_kernel_applies_to_scalar_gates_and_warp_multiples_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    k, scalar, vector = mx.zeros((1, 2, 2, 128)), mx.zeros((1, 2, 4)), mx.zeros((1, 2, 4, 128))
    monkeypatch.setattr(deltanet_kernel, "enabled", lambda: True)
    assert deltanet_kernel.applies(k, scalar)
    assert not deltanet_kernel.applies(k, vector)  # vector gates: mlx-lm's ops
    assert not deltanet_kernel.applies(mx.zeros((1, 2, 2, 48)), scalar)  # not a warp's multiple
    assert not deltanet_kernel.applies(mx.zeros((1, 2, 2, 288)), scalar)  # past a lane's registers
    monkeypatch.setattr(deltanet_kernel, "enabled", lambda: False)
    assert not deltanet_kernel.applies(k, scalar)


@pytest.mark.parametrize("value", ["0", "off", "False", " no "])
def test_the_switch_turns_it_off_whatever_the_device(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)  # as on a CUDA machine
    monkeypatch.setenv(deltanet_kernel.ENV, "1")
    assert deltanet_kernel.enabled()
    monkeypatch.setenv(deltanet_kernel.ENV, value)
    assert not deltanet_kernel.enabled()


def test_an_engine_model_is_built_with_it_installed(tiny_bench: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing rerouted (mlx-lm as imported), the engine builds its model, and everything
    after (the bench's resident reference, built in the same process, too) takes it."""
    from pipeline.models.dense import build_model
    from qpack.reader import Container

    deltanet_kernel.install()
    original = deltanet_kernel._original
    monkeypatch.setattr(gated_delta, "gated_delta_ops", original)  # as mlx-lm defines it
    monkeypatch.setattr(deltanet_kernel, "_original", None)
    build_model(Container.open(tiny_bench).config)
    assert gated_delta.gated_delta_ops is deltanet_kernel.ops and deltanet_kernel._original is original


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the kernel runs on MLX's CUDA backend")
def test_on_cuda_the_kernel_is_mlx_lms_ops_within_float32_rounding() -> None:
    """On a GPU machine (`pytest tests/test_deltanet_kernel.py`): the 35B's DeltaNet heads,
    one row (the unmasked kernel: decode and a prompt) and two (the masked one, a row
    padded), and a value width that is not a multiple of a block's rows, against mlx-lm's
    ops (the same float32 arithmetic; only the order of the Dk sums differs)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from deltanet_kernel_check import differences, inputs, padding

    deltanet_kernel.install()
    original = deltanet_kernel._original
    assert original is not None
    mx.random.seed(3)
    for b, t, dv in ((1, 1, 128), (1, 16, 128), (2, 1, 128), (2, 64, 128), (1, 9, 66), (2, 9, 66)):
        q, k, v, g, beta, state = inputs(b, t, 16, 32, 128, dv, mx.bfloat16)
        mask = padding(b, t)
        y0, s0 = original(q, k, v, g, beta, state, mask)
        y1, s1 = deltanet_kernel.recurrence(q, k, v, g, beta, state, mask)
        dy, ds, y_scale = differences(y0, s0, y1, s1, mask)
        assert dy <= 2 ** -8 * y_scale and ds <= 1e-5  # y within one bf16 rounding
