"""Quick MLX CUDA checks of ops the engine relies on (printed, never fatal)."""

import mlx.core as mx

logits = mx.random.normal((1, 256)).astype(mx.float32)
for name, fn in {
    "argpartition+take_along_axis+argsort": lambda: mx.take_along_axis(
        top := mx.argpartition(-logits, kth=17, axis=-1)[:, :18],
        mx.argsort(-mx.take_along_axis(logits, top, axis=-1), axis=-1), axis=-1).tolist(),
    "argsort[:, :n]": lambda: mx.argsort(-logits, axis=-1)[:, :18].tolist(),
}.items():
    try:
        print("gpu_check", name, "ok", fn()[0][:4])
    except Exception as exc:  # noqa: BLE001
        print("gpu_check", name, "FAILED", type(exc).__name__, exc)
