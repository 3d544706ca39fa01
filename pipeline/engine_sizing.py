"""How big the pool is and how a prompt is cut: the numbers an engine is opened with."""

from __future__ import annotations

import structlog

from actors.pool.banks import Banks, plan_banks, slot_limit
from actors.pool.layout import PoolLayout
from actors.run_ahead import RunAheadMode
from pipeline.config.schema import PipelineConfig
from pipeline.memory_budget import PoolBudgetError

log = structlog.get_logger("moestream.engine")


class PoolTooSmall(ValueError):
    pass


def smallest_workable_slots(num_experts: int, top_k: int, prefill_chunk: int) -> int:
    """A prefill chunk's layer may touch chunk * top_k distinct experts, all pinned at once.

    `prefill_chunk` 0 (follow the pool) needs only one token's experts.
    """
    return min(num_experts, max(prefill_chunk, 1) * top_k)


def prefill_chunk_for(config_chunk: int, max_tokens: int, slots: int, num_experts: int,
                      top_k: int) -> int:
    """Prompt tokens per prefill forward: the config's, or the most the pool allows.

    Each chunk reads every expert its tokens need once per layer, so fewer, larger
    chunks read the disk fewer times: with room for a whole layer's experts, one chunk
    of up to `max_tokens` (one pass of the disk per prompt); else slots // top_k tokens,
    whose experts are guaranteed to fit pinned at once.
    """
    if config_chunk:
        return config_chunk
    if slots >= num_experts:
        return max_tokens
    return max(1, min(max_tokens, slots // top_k))


def num_slots(config: PipelineConfig, slot_nbytes: int, dense_bytes: int, processes: int) -> int:
    """Pool slots: the config's, else sized from available memory (`default_slots`);
    `dense_bytes` is this process's dense core, `processes` how many share the machine."""
    if config.pool.slots is not None:
        return config.pool.slots
    if config.pool.budget_mb is not None:
        return config.pool.budget_mb * 2**20 // slot_nbytes
    import psutil

    return default_slots(psutil.virtual_memory().available, dense_bytes, slot_nbytes, processes)


def default_slots(available: int, dense_bytes: int, slot_nbytes: int, processes: int = 1) -> int:
    """Neither slots nor budget given: half of the memory left once the dense core is
    loaded, keeping 1 GiB aside for the rest of the process (capped at every expert by
    the caller). Ranks of a distributed job on one machine split it: each sees the same
    available memory, and each taking half would leave none."""
    left = available // max(processes, 1) - dense_bytes - 2**30
    return max(1, left // 2 // slot_nbytes)


def run_ahead_mode(setting: RunAheadMode, slots: int, moe_layers: int, top_k: int) -> RunAheadMode:
    """`compute.run_ahead` for a pool of `slots`: "auto" runs a token ahead only where it
    can hit, every MoE layer's top-k resident at once (a smaller pool misses every time,
    and each try holds a snapshot of the model's state: 64 MiB of DeltaNet state at the
    35B's dimensions); "on" (tests force misses with it) and "off" as set."""
    if setting == "auto" and slots < moe_layers * top_k:
        return "off"
    return setting


def decode_ahead(setting: str, gpu: bool) -> bool:
    """`compute.decode_ahead` on this machine (`gpu`: the MLX thread's device is not the
    CPU, as the open found it): "auto" queues a second step on GPUs only."""
    return setting == "on" or (setting == "auto" and gpu)


def pass_cap(setting: int | str, top_k: int) -> int | None:
    """`prefetch.pass_max_per_layer`: the experts a verify pass predicts for a layer, or
    None for its whole union. "auto" is one and a half top-k (12 on the 35B): in three
    rounds each on one H100 (session 40), a cold k = 2 pass on the 35B's calibrated
    routing read 284-286 MB a token cut to 12, 302-316 cut to 16, 305-312 whole, at the
    same speed within the lease's spread (x plain 1.37, 1.37, 1.34; docs/results.md)."""
    if setting == "off":
        return None
    return -(-3 * top_k // 2) if setting == "auto" else int(setting)


def head_slots(configured: int | None, slots: int, moe_layers: int, num_experts: int,
               top_k: int) -> int:
    """The MTP head's pool (actors/pool/head_pool.py): `pool.mtp_slots`, else the share of
    its experts that the model's pool holds of the model's (a pool of every expert holds
    every one of the head's too), at least one position's top-k, at most its experts."""
    # The model's pool holds slots / moe_layers of a layer's experts on average: so many.
    share = configured if configured is not None else -(-slots // max(moe_layers, 1))
    return max(top_k, min(share, num_experts))


def carve_head_pool(slots: int, need: int, slot_nbytes: int, head_bytes: int,
                    budget_mb: float | None = None) -> int:
    """The model's slots once the head's pool (`head_bytes`) is taken from the bytes the
    pool was given; never below the smallest workable pool, which under a memory budget
    (`budget_mb`) must then fit beside the head's (else refused, in one line)."""
    carved = slots - -(-head_bytes // slot_nbytes)
    if carved < need and budget_mb is not None:
        raise PoolBudgetError(
            f"memory budget of {budget_mb:,.0f} MiB is too small: its expert pool "
            f"({slots * slot_nbytes / 2**20:,.1f} MiB) cannot hold the MTP head's pool "
            f"({head_bytes / 2**20:,.1f} MiB: pool.mtp_slots) beside the smallest workable pool "
            f"({need} slots, {need * slot_nbytes / 2**20:,.1f} MiB); raise --memory-mb or lower "
            "pool.mtp_slots")
    return max(need, carved)


def bank_limit(config: PipelineConfig, layout: PoolLayout) -> int:
    """Most slots in one bank: the config's, within what the kernels index right."""
    safe = slot_limit(layout)
    return min(config.pool.bank_slots or safe, safe)


def pool_banks(config: PipelineConfig, layout: PoolLayout, slots: int, layers: list[int],
               need: int) -> Banks | None:
    """The pool's banks (actors/pool/banks.py), each able to pin what one layer needs."""
    limit = bank_limit(config, layout)
    banks = plan_banks(slots, layers, limit)
    if banks is not None:
        if banks.smallest < need:
            raise PoolTooSmall(f"pool.bank_slots: a bank of {banks.smallest} slots cannot hold "
                               f"the {need} one layer needs; raise it or leave it 0")
        log.info("engine.pool_banks", banks=len(banks), slots=[len(r) for r in banks.ranges],
                 limit=limit)
    return banks
