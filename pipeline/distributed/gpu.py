"""One GPU per rank on a host with several (`distributed.gpu_per_rank`).

mlx.launch gives every rank the same environment, and MLX's CUDA backend uses the first
visible GPU; so rank r of a one-host job is shown only GPU r, which must happen before
MLX loads (this module imports nothing heavy; the CLI calls it before the engine).
"""

from __future__ import annotations

import os

import structlog

log = structlog.get_logger("moestream.distributed")


def pin_gpu_per_rank() -> None:
    rank = os.environ.get("MLX_RANK")
    if rank is None:
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = rank
    log.info("distributed.gpu", rank=int(rank), cuda_visible_devices=rank)
