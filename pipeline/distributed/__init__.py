"""Pipeline parallelism over mlx.distributed: each rank runs a slice of the layers.

Rank 0 embeds, runs its layers, samples and serves; rank r+1 continues from rank r's
residual stream; the last rank computes the logits and sends them to rank 0. Each rank
has its own expert pool, readers and prefetcher for its own layers, so the job's pool is
the sum of the ranks' pools. Files: plan (who runs which layers), wire (what crosses),
link (the thread that talks to mlx.distributed), stage (a rank's part, rank 0's
boundary), model (the streamed model of a slice), worker (the later ranks' loop),
prefixes (the prefix cache's entries on every rank), job
(one rank's life: join, run, finish), launcher_watch (a rank stops when its launcher is
gone), launch (`moestream launch`: local ranks under a service manager), active (the
stage open_engine uses), probe (free memory and disk speed for a weighted split), errors.
"""
