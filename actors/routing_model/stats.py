"""Statistics of routing traces, defined as the published measurements define them.

All take `ids` = int [tokens, layers, top_k] (one request's routing, router order) and
return one value per layer unless said otherwise; callers average over layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def stack_distances(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """LRU stack distance of every access, per layer: float [tokens * top_k, layers].

    Distance = distinct experts of that layer used since this expert's last use (inf on a
    first use). A per-layer LRU cache of C entries hits exactly when distance < C, so one
    pass gives the whole hit curve.
    """
    T, L, k = ids.shape
    last = np.full((L, num_experts), -1, dtype=np.int64)
    rows = np.arange(L)
    out = np.empty((T * k, L))
    clock = 0
    for t in range(T):
        for j in range(k):
            e = ids[t, :, j]
            prev = last[rows, e]
            dist = (last > prev[:, None]).sum(axis=1).astype(float)
            dist[prev < 0] = np.inf
            out[t * k + j] = dist
            last[rows, e] = clock
            clock += 1
    return out


def lru_hit_curve(ids: np.ndarray, num_experts: int, budgets: Sequence[int]) -> list[float]:
    """Hit rate of a per-layer LRU cache of C entries for each C, cold start, all layers."""
    d = stack_distances(ids, num_experts)
    return [float((d < c).mean()) for c in budgets]


def consecutive_overlap(ids: np.ndarray) -> np.ndarray:
    """Share of a token's experts that the previous token also used, per layer."""
    T, L, k = ids.shape
    if T < 2:
        return np.zeros(L)
    same = (ids[1:, :, :, None] == ids[:-1, :, None, :]).any(axis=3).sum(axis=2)
    return same.mean(axis=0) / k


def counts(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Activations per (layer, expert): int [layers, experts]."""
    T, L, k = ids.shape
    out = np.zeros((L, num_experts), dtype=np.int64)
    np.add.at(out, (np.broadcast_to(np.arange(L)[None, :, None], ids.shape), ids), 1)
    return out


def touched(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Distinct experts used, per layer."""
    return (counts(ids, num_experts) > 0).sum(axis=1)


def window_coverage(ids: np.ndarray, num_experts: int, window: int = 30) -> np.ndarray:
    """Share of a layer's experts used within `window` consecutive tokens (mean of windows)."""
    T = ids.shape[0]
    starts = range(0, max(1, T - window + 1), window)
    return np.mean([touched(ids[s : s + window], num_experts) for s in starts], axis=0) / num_experts


def top_share(ids: np.ndarray, num_experts: int, n: int = 64) -> np.ndarray:
    """Share of activations taken by each layer's `n` most used experts."""
    c = np.sort(counts(ids, num_experts), axis=1)[:, ::-1]
    return c[:, :n].sum(axis=1) / c.sum(axis=1)


def hot_sets(ids: np.ndarray, num_experts: int, n: int = 64) -> list[set[int]]:
    """Each layer's `n` most used experts (ties to the lower id)."""
    c = counts(ids, num_experts)
    return [set(np.argsort(-row, kind="stable")[:n].tolist()) for row in c]


def hot_set_jaccard(a: np.ndarray, b: np.ndarray, num_experts: int, n: int = 64) -> np.ndarray:
    """Jaccard index of two workloads' per-layer hot sets (e.g. two prompt domains)."""
    return np.array(
        [len(x & y) / len(x | y) for x, y in zip(hot_sets(a, num_experts, n),
                                                 hot_sets(b, num_experts, n), strict=True)]
    )


def universal_share(domains: Sequence[np.ndarray], num_experts: int, n: int = 128) -> np.ndarray:
    """Share of a layer's experts in every domain's hot set (top `n`), per layer."""
    per = [hot_sets(ids, num_experts, n) for ids in domains]
    return np.array([len(set.intersection(*sets)) for sets in zip(*per, strict=True)]) / num_experts
