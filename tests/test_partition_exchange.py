"""``Collectives.allreduce_in_partition_``: every rank averages with its own group of one partition, in one
world all-to-all (dssync ``exchange="alltoall"``). In one process (comm/fake.py) and over real Horovod. And
``allreduce_direct_`` (``exchange="direct"``): the same on torch.distributed Gloo groups beside Horovod."""
from __future__ import annotations

import random

import pytest
import torch

from lightning_straggler.comm.fake import FakeWorld


def _random_partition(size: int, rng: random.Random) -> list:
    ranks = list(range(size))
    rng.shuffle(ranks)
    groups, i = [], 0
    while i < size:
        k = min(rng.choice([1, 2, 2, 3]), size - i)
        groups.append(tuple(sorted(ranks[i:i + k])))
        i += k
    return groups


def _tensors(rank: int, step: int) -> list:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(3, 4, generator=g), torch.randn(5, generator=g),
            torch.randn(2, generator=g, dtype=torch.float64)]


@pytest.mark.parametrize("size", [4, 8])
def test_each_rank_gets_its_groups_mean_the_same_bits_on_every_member_over_random_partitions(size):
    rng = random.Random(size)
    partitions = [_random_partition(size, rng) for _ in range(6)]

    def body(comm):
        out = []
        for step, partition in enumerate(partitions):
            group = next(g for g in partition if comm.rank in g)
            tensors = _tensors(comm.rank, step)
            assert comm.allreduce_in_partition_(tensors, group, op="mean", tag="params") == []
            out.append(tensors)
        return out

    results = FakeWorld(size).run(body)
    for step, partition in enumerate(partitions):
        for group in partition:
            want = [sum(_tensors(r, step)[i] for r in group) / len(group) for i in range(3)]
            for r in group:
                for got, w in zip(results[r][step], want):
                    assert torch.allclose(got, w, atol=1e-6)
                    assert got.dtype == w.dtype
                for got, first in zip(results[r][step], results[group[0]][step]):
                    assert torch.equal(got, first)  # members add in rank order: the same bits


def test_non_finite_parts_are_named_by_every_member_and_only_in_their_group():
    partition = [(0, 2), (1, 3)]

    def body(comm):
        group = next(g for g in partition if comm.rank in g)
        t = [torch.ones(4)]
        if comm.rank == 2:
            t[0][1] = float("nan")
        return comm.allreduce_in_partition_(t, group, tag="grads", find_nonfinite=True), bool(torch.isfinite(t[0]).all())

    out = FakeWorld(4).run(body)
    assert [o[0] for o in out] == [[2], [], [2], []]
    assert [o[1] for o in out] == [False, True, False, True]


def test_ranks_that_disagree_on_the_partition_are_told_so():
    wrong = {0: (0, 1), 1: (1, 2), 2: (1, 2), 3: (3,)}  # rank 0 thinks it is with 1; 1 thinks it is with 2

    def body(comm):
        comm.allreduce_in_partition_([torch.ones(2)], wrong[comm.rank], tag="params")

    with pytest.raises(Exception, match="disagree on the partition"):
        FakeWorld(4).run(body)


def test_bad_arguments_are_refused_before_any_exchange():
    def body(comm):
        with pytest.raises(ValueError, match="not in"):
            comm.allreduce_in_partition_([torch.ones(1)], ((comm.rank + 1) % 2,), tag="x")
        with pytest.raises(ValueError, match="use mean or sum"):
            comm.allreduce_in_partition_([torch.ones(1)], (comm.rank,), op="max", tag="x")
        return True

    assert FakeWorld(2).run(body) == [True, True]


def _horovod_without_sets(rank: int, size: int, port: int):
    """A worker's HorovodCollectives, initialised as dssync's alltoall and direct exchanges run: no process set."""
    import os

    from lightning_straggler.launcher import horovod_worker_env

    os.environ.update(horovod_worker_env(rank, size, port, 120))
    from lightning_straggler.comm.horovod import HorovodCollectives

    torch.set_num_threads(1)
    comm = HorovodCollectives()
    comm.init(dynamic_groups=False)
    return comm


def _pairs_over_horovod(rank: int, size: int, port: int, steps: int, results) -> None:
    import horovod.torch as hvd

    from lightning_straggler.policies.dssync import DSSyncSchedule

    comm = _horovod_without_sets(rank, size, port)
    try:
        schedule = DSSyncSchedule(size, 2, "random", 4, seed=3)
        out = []
        for step in range(steps):
            tensors = _tensors(rank, step)
            bad = comm.allreduce_in_partition_(tensors, schedule.group_of(rank, step), tag="params")
            out.append(([t.tolist() for t in tensors], bad))
        results.put((rank, out))
    finally:
        hvd.shutdown()


@pytest.mark.multiprocess
@pytest.mark.parametrize("size", [4, 8])
def test_over_horovod_every_rank_gets_its_pairs_mean_without_process_sets(size):
    from benchmarks.local_workers import run_workers
    from lightning_straggler.policies.dssync import DSSyncSchedule

    steps = 6
    got = run_workers(_pairs_over_horovod, size, (steps,), 180, f"partition exchange N={size}")
    schedule = DSSyncSchedule(size, 2, "random", 4, seed=3)
    for step in range(steps):
        for group in schedule.partition(step):
            want = [sum(_tensors(r, step)[i] for r in group) / len(group) for i in range(3)]
            for r in group:
                tensors, bad = got[r][step]
                assert bad == []
                for t, w in zip(tensors, want):
                    assert torch.allclose(torch.tensor(t, dtype=w.dtype), w, atol=1e-6)
                assert tensors == got[group[0]][step][0]  # the same bits on both members


# --- exchange="direct": torch.distributed Gloo groups beside Horovod -------------------------------------

def _direct_pairs_over_horovod(rank: int, size: int, port: int, steps: int, slow_rank: int, results) -> None:
    import time

    from lightning_straggler.policies.dssync import DSSyncSchedule

    comm = _horovod_without_sets(rank, size, port)
    try:
        schedule = DSSyncSchedule(size, 2, "random", 4, seed=3)
        comm.ensure_direct_groups(schedule.all_groups())
        with pytest.raises(RuntimeError, match="no direct group for ranks"):
            comm.allreduce_direct_([torch.ones(1)], [r for r in range(size) if r != rank][:3])
        out = []
        for step in range(steps):
            tensors = _tensors(rank, step)
            if rank == slow_rank and step == steps - 1:
                time.sleep(4.0)  # its group waits for it; no other group should
            start = time.time()
            comm.allreduce_direct_(tensors, schedule.group_of(rank, step), tag="params")
            out.append(([t.tolist() for t in tensors], start, time.time()))
        comm.allreduce(torch.zeros(1), tag="done")  # nobody shuts down while others still exchange
        results.put((rank, out))
    finally:
        comm.shutdown()


@pytest.mark.multiprocess
@pytest.mark.parametrize("size", [4, 8])
def test_direct_groups_give_every_rank_its_pairs_mean_and_no_other_group_waits_for_a_straggler(size):
    from benchmarks.local_workers import run_workers
    from lightning_straggler.policies.dssync import DSSyncSchedule

    steps, slow = 6, 1
    got = run_workers(_direct_pairs_over_horovod, size, (steps, slow), 180, f"direct exchange N={size}")
    schedule = DSSyncSchedule(size, 2, "random", 4, seed=3)
    for step in range(steps):
        for group in schedule.partition(step):
            want = [sum(_tensors(r, step)[i] for r in group) / len(group) for i in range(3)]
            for r in group:
                tensors = got[r][step][0]
                for t, w in zip(tensors, want):
                    assert torch.allclose(torch.tensor(t, dtype=w.dtype), w, atol=1e-6)
                assert tensors == got[group[0]][step][0]  # the same bits on both members
    last = steps - 1
    slow_group = schedule.group_of(slow, last)
    slow_start = got[slow][last][1]
    for r in range(size):
        end = got[r][last][2]
        if r in slow_group:  # waited for the straggler's 4 s
            assert end >= slow_start
        else:  # done before the straggler even began its exchange
            assert end < slow_start, f"rank {r} (group {schedule.group_of(r, last)}) waited for rank {slow}"
