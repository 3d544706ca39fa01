"""The trio actors of one engine and what they own.

Layers point one way: `qpack` (the container format) <- `actors` <- `pipeline`.
Nothing here imports `pipeline`: what an actor needs from the model is a Protocol
(`actors/forward.py`) that the pipeline implements.

- `mlx_worker`, `device_staging`: the one MLX thread, the readers' staging threads
- `pool/`: the expert pool (slot storage, slot table, eviction policies, driver)
- `prefetch/`: prefetch strategies and their scoring
- `routing_model/`: a seeded routing model fitted to published routing statistics
- `reader`, `router`, `compute`, `sampler`: the actors
- `sampling_params`, `text_stream`, `routing_trace`, `timeline`: their data and tracing
"""

from qpack.log_default import log_to_stderr_by_default

log_to_stderr_by_default()
