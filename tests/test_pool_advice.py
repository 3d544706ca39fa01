"""`moestream info`'s pool advice: a quick replay of calibrated routing shaped like the container."""

from __future__ import annotations

from pipeline.pool_advice import pool_advice

# Qwen3.6-35B-A3B dims (256 experts, top-8, 1.69 MiB experts at 4 bits), 10 MoE layers:
# the bench container of the H200 runs of docs/results.md.
SHAPE = (10, 256, 8, 1_769_472)


def test_advice_for_the_35b_bench_container_follows_calibrated_reuse() -> None:
    # No wall-clock bound here (a loaded machine made one flaky): `info`'s cost is fixed
    # by the replay's size (REPLAY_LAYERS x 2 requests x TOKENS), not by the container.
    a = pool_advice(*SHAPE)
    assert a.family == "qwen3.6-35b" and a.eviction == "reuse"
    sizes = [r.pool_mb for r in a.rows]
    assert sizes == sorted(sizes) and len(sizes) >= 5
    gib = [r for r in a.rows if r.one_gib]
    assert [r.slots_per_layer for r in gib] == [1024 * 2**20 // (SHAPE[3] * SHAPE[0])]
    for r in a.rows:
        # trained-like routing reuses experts: far above random routing's ~share, and
        # the emulated gate only adds hits
        assert r.hit_no_prefetch > r.share + 0.2 and r.hit_default >= r.hit_no_prefetch
    assert a.rows[-1].hit_default > a.rows[0].hit_default + 0.2
    # the size advised for a hit rate lies between the rows around it
    for key, target in (("50%", 0.5), ("70%", 0.7), ("80%", 0.8)):
        mb = a.pool_mb_for_hits[key]
        below = [r.pool_mb for r in a.rows if r.hit_default < target]
        above = [r.pool_mb for r in a.rows if r.hit_default >= target]
        if not above:
            assert mb is None
        else:
            assert min(above) >= mb and (not below or mb > max(below))
