"""`mlx.launch -n N --backend ring` for one host, without the launcher's busy loops.

mlx.launch (MLX 0.32) pumps each rank's output in a thread whose `select` also waits for
the rank's stdin to be writable, which it always is: one thread per rank spins a core for
the whole run. Fine on a workstation; on a 2-core VM it halves what the ranks measure.
This does what mlx.launch does for local ranks (a ring hostfile on free loopback ports,
MLX_HOSTFILE and MLX_RANK per rank, the same command for every rank), with plain waits:

    python benchmarks/local_launch.py -n 2 [--gpu-per-rank] -- python benchmarks/distributed_bench.py ...

`--gpu-per-rank` gives rank r CUDA_VISIBLE_DEVICES=r. When a rank fails the others are
terminated (as mlx.launch does). Exit status: the first nonzero rank's, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, required=True, help="ranks")
    p.add_argument("--gpu-per-rank", action="store_true")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([[f"127.0.0.1:{port}"] for port in free_ports(args.n)], f)
    procs = []
    for rank in range(args.n):
        env = {**os.environ, "MLX_HOSTFILE": f.name, "MLX_RANK": str(rank)}
        if args.gpu_per_rank:
            env["CUDA_VISIBLE_DEVICES"] = str(rank)
        procs.append(subprocess.Popen(command, env=env))
    # Ctrl-C reaches the ranks too (one process group): they decide how to stop; wait.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    status = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed:
                status = failed[0]
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        os.unlink(f.name)
    return status or next((p.returncode for p in procs if p.returncode), 0)


if __name__ == "__main__":
    sys.exit(main())
