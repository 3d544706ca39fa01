"""Calibrated routing: a seeded model of how trained MoE routers pick experts.

- `model`: the generative model (popularity skew, universal experts, domain shifts,
  context drift, self-excitation, one-off picks, an emulated gate-ahead predictor)
- `families`: model shapes, the published statistics and the parameters fitted to them
- `stats`: the statistics, defined as the published measurements define them
- `workload`: requests -> routing traces for `moestream replay --workload` and benchmarks

Independent of qpack and MLX (numpy only).
"""
