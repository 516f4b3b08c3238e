"""HorovodCollectives' join over real Horovod workers (Gloo on loopback): the join that dpar's and awar's
outside ranks start without waiting (no helper thread, polled between their own steps)."""
from __future__ import annotations

import threading
import time

import pytest

pytestmark = pytest.mark.multiprocess


def _outside_rank_joins_while_computing(rank: int, size: int, port: int, results) -> None:
    import os

    from lightning_straggler.launcher import horovod_worker_env

    os.environ.update(horovod_worker_env(rank, size, port, 120))
    import horovod.torch as hvd
    import torch

    from lightning_straggler.comm.horovod import HorovodCollectives

    torch.set_num_threads(1)
    comm = HorovodCollectives()
    comm.init(dynamic_groups=False)
    try:
        if rank == size - 1:
            threads = threading.active_count()
            handle = comm.join_async()
            started_threads = threading.active_count()
            products, a = 0, torch.randn(64, 64)
            while not comm.join_done(handle):  # its main thread goes on computing while joined
                a = torch.tanh(a @ a)
                products += 1
            last = comm.join_wait(handle)
            after = comm.allreduce(torch.tensor([1.0]), op="sum", tag="after").item()
            results.put((rank, {"last": last, "products": products, "threads": (threads, started_threads),
                                "after": after}))
            return
        members = tuple(range(size - 1))
        sums = []
        for step in range(5):
            g = [torch.full((1000,), float(rank + 1))]
            comm.allreduce_among_(g, members, op="sum", tag="grads")
            sums.append(g[0].unique().tolist())
        time.sleep(0.3)  # the outside rank computes on meanwhile
        last = comm.join()
        after = comm.allreduce(torch.tensor([1.0]), op="sum", tag="after").item()
        results.put((rank, {"last": last, "sums": sums, "after": after}))
    finally:
        hvd.shutdown()


@pytest.mark.parametrize("size", [4, 8])
def test_a_polled_join_adds_zeros_lets_the_rank_compute_and_returns_the_last_rank_to_join(size):
    from benchmarks.local_workers import run_workers

    got = run_workers(_outside_rank_joins_while_computing, size, (), 180, f"join test N={size}")
    group_sum = float(sum(r + 1 for r in range(size - 1)))
    lasts = {got[r]["last"] for r in range(size)}
    assert len(lasts) == 1 and lasts.pop() in range(size - 1)  # the same everywhere: a group rank joined last
    for r in range(size - 1):
        assert got[r]["sums"] == [[group_sum]] * 5  # the joined rank added zeros to every step
    assert all(got[r]["after"] == size for r in range(size))  # everyone released: the world all-reduces again
    outside = got[size - 1]
    assert outside["products"] > 0
    assert outside["threads"][1] == outside["threads"][0]  # no helper thread waits for the join
