"""How much memory the pool may have: an explicit size checked, or a total budget split.

With `memory.budget_mb` (`--memory-mb`) the pool is what is left of one total budget once
the measured parts and the reserves are subtracted (`plan_memory`; docs/memory.md).
Without it, an explicit pool is checked against the machine:

The pool is allocated once, at its full budget. A budget over what the machine has left
was accepted before and the kernel's OOM killer ended the process later, silently; a
message with the numbers now says so up front. The default pool already sizes itself
from available memory (`engine_sizing.num_slots`), so only explicit sizes are checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import msgspec
import psutil
import structlog

from pipeline.config.schema import MemoryConfig
from pipeline.memory_facts import MemoryPlan

if TYPE_CHECKING:
    import trio

    from pipeline.config.schema import PipelineConfig
    from pipeline.engine_core import EngineCore
    from pipeline.memory_facts import OpenMarks

log = structlog.get_logger("moestream.memory")

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
        from actors.cuda_driver import gpu_memory_bytes

        total = gpu_memory_bytes()
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


# -- one total budget (`memory.budget_mb`, `--memory-mb`) ---------------------------------


def staging_buffers(readers: int) -> int:
    """The reader's staging buffers for `readers` disk threads: enough for installs to come
    in batches while reads continue (the engine passes this count to the reader)."""
    return max(4 * readers, 16)


AUTO_SHARE = 0.8  # of the memory available at open, for `budget_mb = "auto"`


def resolved(mem: MemoryConfig) -> MemoryConfig:
    """`mem` with a budget of "auto" made a number: what this process holds now plus
    AUTO_SHARE of the memory available (the rest left to the machine's other work)."""
    if mem.budget_mb != "auto":
        return mem
    from pipeline.resident_map import current_rss_mb

    available = psutil.virtual_memory().available / 2**20
    return msgspec.structs.replace(mem, budget_mb=max(1, int(current_rss_mb() + AUTO_SHARE * available)))


def applied_budget(config: PipelineConfig) -> int | Literal["auto"] | None:
    """memory.budget_mb as an engine applies it (None: no budget).

    Unset, it is "auto" where nothing else sizes the pool and the pool lives in host
    memory: a user who gives no sizes gets a process held to what the machine has. A
    [pool] size is an experiment the budget must not move (`--pool-mb` wins, as before);
    a discrete GPU's pool is in device memory, which a host budget does not describe; the
    ranks of a distributed job on one host would each claim the same free memory."""
    budget = config.memory.budget_mb
    if budget == "off":
        return None
    if budget is not None:
        return budget
    if config.pool.budget_mb is not None or config.pool.slots is not None or config.distributed.enabled:
        return None
    import mlx.core as mx

    return None if mx.cuda.is_available() else "auto"


def plan_memory(mem: MemoryConfig, *, process_bytes: int, dense_bytes: int, slot_nbytes: int,
                stride: int, readers: int, need_slots: int, max_slots: int,
                pool_bytes: int | None = None, default: bool = False) -> MemoryPlan:
    """Size the pool from the budget (or check an explicit `pool_bytes` against it).

    Raises PoolBudgetError, one line with every number, when the rest cannot hold the
    smallest workable pool (`need_slots`); `default`: the budget is the unset one's
    "auto", and the line says how to set another."""
    mem = resolved(mem)
    assert isinstance(mem.budget_mb, int)
    budget = mem.budget_mb * 2**20
    state = (mem.state_mb * 2**20) if mem.state_mb else budget // 8
    staging = staging_buffers(readers) * stride
    temporaries = mem.temporaries_mb * 2**20
    rest = budget - process_bytes - dense_bytes - state - staging - temporaries
    parts = (f"the process with its tokenizer ({_mib(process_bytes)}), the dense core "
             f"({_mib(dense_bytes)}), model state ({_mib(state)}: memory.state_mb), staging "
             f"({_mib(staging)}) and temporaries ({_mib(temporaries)}: memory.temporaries_mb) "
             f"leave {_mib(max(rest, 0))}")
    if pool_bytes is not None:
        if pool_bytes > rest:
            raise PoolBudgetError(
                f"expert pool of {_mib(pool_bytes)} does not fit a memory budget of "
                f"{_mib(budget)}: {parts}; lower --pool-mb or raise --memory-mb")
        slots = min(pool_bytes // slot_nbytes, max_slots)  # more would hold no expert
    else:
        slots = min(max(rest, 0) // slot_nbytes, max_slots)
    if slots < need_slots:
        enough = _enough_mb(mem, budget - rest - state, need_slots * slot_nbytes)
        if default:
            raise PoolBudgetError(
                f"the default memory budget of {_mib(budget)} (what the process holds plus "
                f"{AUTO_SHARE:.0%} of the memory available) is too small: {parts}, and the "
                f"smallest workable expert pool is {_mib(need_slots * slot_nbytes)} ({need_slots} "
                f"slots); free memory, or give --memory-mb {enough} (memory.budget_mb) or "
                "--pool-mb, or --memory-mb off for no budget")
        raise PoolBudgetError(
            f"memory budget of {_mib(budget)} is too small: {parts}, and the smallest workable "
            f"expert pool is {_mib(need_slots * slot_nbytes)} ({need_slots} slots); raise "
            f"--memory-mb (memory.budget_mb) to at least {enough} or lower memory.state_mb")
    return MemoryPlan(
        budget_mb=budget / 2**20, process_mb=process_bytes / 2**20, dense_mb=dense_bytes / 2**20,
        state_mb=state / 2**20, staging_mb=staging / 2**20, temporaries_mb=temporaries / 2**20,
        pool_mb=slots * slot_nbytes / 2**20, slots=slots)


def _enough_mb(mem: MemoryConfig, fixed: int, pool: int) -> int:
    """The smallest budget (MiB) whose rest holds `pool` bytes beside the `fixed` parts; the
    state reserve, an eighth of the budget unless memory.state_mb says, grows with it."""
    def fits(mb: int) -> bool:
        b = mb * 2**20
        return b - fixed - (mem.state_mb * 2**20 if mem.state_mb else b // 8) >= pool

    mb = -(-(fixed + pool) // 2**20)
    while not fits(mb):
        mb += 1 + (mb - 1) // 64  # within ~1.6 % of the first that fits, in a few steps
    while mb > 1 and fits(mb - 1):
        mb -= 1
    return mb


CPU_CACHE_BYTES = 8 * 2**20  # MLX's buffer cache on the CPU backend without a budget


def apply_cache_limit(mem: MemoryConfig, budget: bool) -> None:
    """MLX keeps freed buffers for reuse up to its cache limit (by default, its whole
    memory limit): resident memory the budget never granted. With a budget a quarter of
    the temporaries' share keeps reuse for the decode graphs' small buffers. Without one
    the CPU backend keeps 8 MiB (a buffer missed there is one mmap away: glibc's
    threshold, pipeline/memory_malloc.py): the cache held 32 MiB at the 35B's peak, and
    VmHWM fell 2,533 -> 2,469 MiB with 8 (2026-12-02); GPUs keep MLX's default, where
    allocations cost more."""
    import mlx.core as mx

    if budget:
        mx.set_cache_limit(mem.temporaries_mb * 2**20 // 4)
    elif mx.default_device() == mx.cpu:
        mx.set_cache_limit(CPU_CACHE_BYTES)


def engine_plan(config: PipelineConfig, *, dense_bytes: int, slot_nbytes: int, stride: int,
                readers: int, need_slots: int, max_slots: int) -> MemoryPlan | None:
    """The plan for an engine being opened (None without a budget: `applied_budget`);
    measured after the tokenizer loaded and before the dense core does."""
    from pipeline.resident_map import current_rss_mb

    budget = applied_budget(config)
    if budget is None:
        return None
    pool = config.pool
    explicit = (pool.budget_mb * 2**20 if pool.budget_mb is not None
                else pool.slots * slot_nbytes if pool.slots is not None else None)
    plan = plan_memory(msgspec.structs.replace(config.memory, budget_mb=budget),
                       process_bytes=int(current_rss_mb() * 2**20), dense_bytes=dense_bytes,
                       slot_nbytes=slot_nbytes, stride=stride, readers=readers,
                       need_slots=need_slots, max_slots=max_slots, pool_bytes=explicit,
                       default=config.memory.budget_mb is None)
    log.debug("memory.plan", default=config.memory.budget_mb is None, line=plan.line())
    return plan


def check_state_fits(plan: MemoryPlan | None, state_bytes: Callable[[int], int]) -> None:
    """Refuse (before the engine starts) a budget whose sequences' half of the state
    reserve (`attach_memory`) cannot hold even one token's state: every request would fail."""
    if plan is None:
        return
    state, one = int(plan.state_mb * 2**20) // 2, state_bytes(1)
    if one > state:
        raise PoolBudgetError(
            f"memory budget of {_mib(int(plan.budget_mb * 2**20))} is too small: half its model "
            f"state reserve ({_mib(state)}: memory.state_mb) cannot hold one sequence's state "
            f"({_mib(one)}); raise memory.state_mb or --memory-mb")


def context_within(state_bytes: Callable[[int], int], state: int, limit: int) -> int:
    """The most tokens (up to `limit`) one sequence may hold with its state in `state` bytes."""
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if state_bytes(mid) <= state:
            lo = mid
        else:
            hi = mid - 1
    return lo


def attach_memory(core: EngineCore, nursery: trio.Nursery, plan: MemoryPlan | None,
                  marks: OpenMarks, need_slots: int) -> None:
    """Hold the open engine to its memory: prefill mixers in slices sized from the
    temporaries' share; with a plan, the batch's state and the prefix cache's copies within
    half of the state reserve each (the first half also caps one request's context);
    MLX's buffer cache within the temporaries' share (8 MiB on the CPU without a plan); with
    memory.adapt, the pool following the machine's memory pressure."""
    from pipeline.memory_pressure import PoolAdapter
    from pipeline.prefill_slices import slice_tokens, tokens_within

    mem = core.config.memory
    core.memory_plan, core.memory_marks = plan, marks
    share, model = mem.temporaries_mb * 2**20, core.model
    chunk = model.chunk_bytes(core.facts.prefill_chunk)  # the longest chunk's own arrays
    model.slice_tokens = slice_tokens(model.parts.layers, share,
                                      core.config.compute.prefill_max_tokens, chunk)
    model.moe_slice_tokens = tokens_within(model.moe_token_bytes(), share, chunk)
    if plan is not None:
        # Half the state reserve for the sequences decoding, half for the prefix cache's
        # copies (1 GiB by default otherwise: outside any budget).
        state = int(plan.state_mb * 2**20) // 2
        core.compute_task.budget = state
        core.prefix_cache.max_bytes = state
        limit = context_within(core.model.state_bytes, state, core.facts.context_limit)
        core.facts = msgspec.structs.replace(core.facts, context_limit=limit)
    apply_cache_limit(mem, budget=plan is not None)
    if mem.adapt:
        nursery.start_soon(PoolAdapter(core, need_slots).run)
