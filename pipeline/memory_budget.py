"""Does an explicitly sized expert pool fit in memory? Refuse it at open when it cannot.

The pool is allocated once, at its full budget. A budget over what the machine has left
was accepted before and the kernel's OOM killer ended the process later, silently; a
message with the numbers now says so up front. The default pool already sizes itself
from available memory (`engine_sizing.num_slots`), so only explicit sizes are checked.
"""

from __future__ import annotations

import psutil

# Kept aside for the rest of the process (Python, MLX, tokenizer, KV cache, staging).
RESERVE_BYTES = 512 * 2**20


class PoolBudgetError(ValueError):
    """An explicit pool budget larger than the memory there is for it."""


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def pool_memory_room(dense_bytes: int) -> tuple[int, str]:
    """Bytes a pool may take, and where they come from (host RAM, or the GPU's memory)."""
    import mlx.core as mx

    if mx.cuda.is_available():  # a discrete GPU: the pool lives in device memory
        info = mx.device_info()
        total = int(info.get("memory_size") or info.get("total_memory") or 0)
        if total:
            return total - dense_bytes - RESERVE_BYTES, f"the GPU's {_mib(total)}"
    available = psutil.virtual_memory().available
    return available - dense_bytes - RESERVE_BYTES, f"{_mib(available)} of available memory"


def check_pool_fits(pool_bytes: int, dense_bytes: int, explicit: bool) -> None:
    """Raise PoolBudgetError when an explicit pool (budget_mb or slots) cannot fit."""
    if not explicit:
        return
    room, where = pool_memory_room(dense_bytes)
    if pool_bytes > room:
        raise PoolBudgetError(
            f"expert pool of {_mib(pool_bytes)} does not fit: {where}, less the dense core "
            f"({_mib(dense_bytes)}) and {_mib(RESERVE_BYTES)} for the rest of the process, leaves "
            f"{_mib(max(room, 0))}; lower pool.budget_mb (--pool-mb) or pool.slots, or leave both "
            "unset to size the pool from available memory")


def batch_budget(batch_memory_mb: int, dense_bytes: int) -> int:
    """Bytes the decode batch's model state may take (`compute.batch_memory_mb`; 0: a
    quarter of the memory left now, the pool allocated, but at least 256 MiB)."""
    if batch_memory_mb:
        return batch_memory_mb * 2**20
    room, _ = pool_memory_room(dense_bytes)
    return max(room // 4, 256 * 2**20)
