"""Is Horovod's ``join()`` safe with k ranks joined? A probe with real Horovod workers (Gloo on loopback).

    .venv/bin/python -m benchmarks.join_safety [--world-size 8] [--joined 2] [--cycles 8] [--steps 10]

For each cycle, ``--joined`` ranks (a seeded choice per cycle) call ``hvd.join()`` from a helper thread
while the others run ``--steps`` sum-all-reduces of an MLP's gradient tensors (the group step of
dpar/awar) and then join themselves, which releases everyone; every sum is checked. Prints one line:
ok (every cycle finished, every sum right) or the workers' exit codes (an abort is -6).

Found with it on Horovod 0.28.1 (Gloo, CPU): 8 ranks with 2 or 3 joined abort within the first cycle
("free(): invalid next size (fast)" / "free(): invalid pointer", heap corruption; also with
HOROVOD_FUSION_THRESHOLD=0, HOROVOD_CACHE_CAPACITY=0, one flat tensor, or rank 0 never joined); 8 ranks
with 1 joined and 4 ranks with up to 3 joined ran clean. Hence ``lightning_straggler.policies.group_floor``.
"""
from __future__ import annotations

import argparse
import os
import random
import threading
import time

SHAPES = [(32, 40), (32,), (10, 32), (10,)]


def _worker(rank: int, size: int, port: int, joined_per_cycle: int, cycles: int, steps: int, results) -> None:
    from lightning_straggler.launcher import horovod_worker_env

    os.environ.update(horovod_worker_env(rank, size, port, 120))
    import horovod.torch as hvd
    import torch

    torch.set_num_threads(1)
    hvd.init()
    wrong = 0
    try:
        for cycle in range(cycles):
            joined = set(random.Random(cycle).sample(range(size), joined_per_cycle))
            if rank in joined:
                thread = threading.Thread(target=hvd.join)
                thread.start()
                while thread.is_alive():
                    time.sleep(0.001)
                continue
            expected = float(sum(r + 1 for r in range(size) if r not in joined))
            for _ in range(steps):
                grads = [torch.full(s, float(rank + 1)) for s in SHAPES]
                hvd.grouped_allreduce_(grads, op=hvd.Sum, name="grads.among.all")
                wrong += any(float(g.flatten()[0]) != expected for g in grads)
            hvd.join()
        results.put((rank, wrong))
    finally:
        hvd.shutdown()


def main(argv: list[str] | None = None) -> bool:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.join_safety", description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--joined", type=int, default=2, help="ranks joined at once (default 2)")
    ap.add_argument("--cycles", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="all-reduces per cycle (default 10)")
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args(argv)
    if not 2 <= a.world_size or not 0 <= a.joined < a.world_size:
        ap.error("need --world-size >= 2 and 0 <= --joined < --world-size")
    from benchmarks.local_workers import run_workers

    what = f"N={a.world_size}, {a.joined} joined, {a.cycles} cycles x {a.steps} all-reduces"
    try:
        got = run_workers(_worker, a.world_size, (a.joined, a.cycles, a.steps), a.timeout, what)
    except RuntimeError as error:
        print(f"[join_safety] {what}: FAILED: {error}")
        return False
    wrong = sum(got.values())
    print(f"[join_safety] {what}: {'ok' if not wrong else f'{wrong} wrong sums'}")
    return not wrong


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
