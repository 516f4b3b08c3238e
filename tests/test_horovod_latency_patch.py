"""scripts/patches/horovod-0.28.1-latency.patch, over real Horovod workers (Gloo on loopback).

With a coordination cycle of 300 ms, stock Horovod lets a collective wait for the next cycle of the rank
that enqueues last (150 ms on average); the patched loop coordinates it as soon as that rank enqueues it.
A rank that waits a long time for a late peer sleeps (no ``yield`` spin, and its background loop, which
no longer sleeps out its cycle while tensors wait, waits inside the coordination round, not in a busy loop)."""
from __future__ import annotations

import statistics

import pytest

CYCLE_MS = 300.0
LATE_S = 0.4  # rank 1 enqueues this long after rank 0
ROUNDS = 5


def _late_peer(rank: int, size: int, port: int, results) -> None:
    import os
    import time

    from lightning_straggler.launcher import horovod_worker_env

    os.environ.update(horovod_worker_env(rank, size, port, 120, cycle_time_ms=CYCLE_MS))
    os.environ.pop("HOROVOD_LS_STOCK_CYCLE", None)
    import horovod.torch as hvd
    import torch

    from lightning_straggler.comm.horovod import HorovodCollectives

    comm = HorovodCollectives()
    comm.init(dynamic_groups=False)
    try:
        comm.allreduce(torch.zeros(1), tag="lineup")
        late_waits, early_cpu = [], []
        for i in range(ROUNDS):
            # a different offset into the late rank's cycle every round
            if rank == 1:
                time.sleep(LATE_S + 0.05 * i)
            wall, cpu = time.perf_counter(), time.process_time()
            comm.allreduce_grouped_([torch.full((1000,), float(rank + 1))], op="sum", tag="late")
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            (late_waits if rank == 1 else early_cpu).append(wall if rank == 1 else cpu / wall)
        results.put((rank, late_waits or early_cpu))
    finally:
        hvd.shutdown()


@pytest.mark.exclusive  # bounds a wake-up latency (60 ms): not beside another file's workers
def test_a_collective_completes_when_the_last_rank_enqueues_and_the_early_rank_sleeps_meanwhile():
    from benchmarks.local_workers import run_workers

    got = run_workers(_late_peer, 2, (), 120, "latency patch, 2 ranks")
    late_waits, early_cpu_share = got[1], got[0]
    # stock: up to a 300 ms cycle after rank 1's enqueue (median over rounds about 150 ms)
    assert statistics.median(late_waits) < 0.06, late_waits
    # the early rank waited about 0.4 s each round: asleep, its background loop too (a spin: about 1.0)
    assert statistics.median(early_cpu_share) < 0.3, early_cpu_share
