"""`mlx.launch -n N --backend ring` for one host, without the launcher's busy loops.

mlx.launch (MLX 0.32) pumps each rank's output in a thread whose `select` also waits for
the rank's stdin to be writable, which it always is: one thread per rank spins a core for
the whole run. Fine on a workstation; on a 2-core VM it halves what the ranks measure.
This is `moestream launch` (pipeline/distributed/launch.py: a ring hostfile on free
loopback ports, MLX_HOSTFILE and MLX_RANK per rank, the same command for every rank,
SIGTERM/SIGINT forwarded, the others stopped when a rank fails) for any command:

    python benchmarks/local_launch.py -n 2 [--gpu-per-rank] -- python benchmarks/distributed_bench.py ...

`--gpu-per-rank` gives rank r CUDA_VISIBLE_DEVICES=r. Exit status: the first failing
rank's, else 0.
"""

from __future__ import annotations

import argparse
import sys

from pipeline.distributed.launch import exec_spawn, launch
from pipeline.logging_setup import configure_logging


def _one_gpu_each(command: list[str], env: dict[str, str]) -> int:
    return exec_spawn(command, {**env, "CUDA_VISIBLE_DEVICES": env["MLX_RANK"]})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, required=True, help="ranks")
    p.add_argument("--gpu-per-rank", action="store_true")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    configure_logging("warning")  # a failing rank, on stderr; the ranks' stdout stays theirs
    return launch(args.n, command, kill_after_s=30.0,
                  spawn=_one_gpu_each if args.gpu_per_rank else exec_spawn)


if __name__ == "__main__":
    sys.exit(main())
