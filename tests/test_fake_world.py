"""The in-process fake world (lightning_straggler/comm/fake.py): Horovod's matching and join rules in one
process, so protocols can be driven through many schedules without processes. Checked against closed
forms, and against the Collectives helpers (allreduce_among_, allgather_among) that dpar and awar use."""
from __future__ import annotations

import random
import time

import pytest
import torch

from lightning_straggler.comm.fake import FakeDeadlock, FakeWorld


def test_world_collectives_give_the_closed_forms_on_every_rank():
    def fn(comm):
        r = comm.rank
        mean = comm.allreduce(torch.tensor([float(r), 2.0 * r]), op="mean")
        total = comm.allreduce(torch.tensor([float(r)]), op="sum")
        top = comm.allreduce(torch.tensor([float(r)]), op="max")
        grads = [torch.full((2, 2), float(r)), torch.tensor([1.0])]
        comm.allreduce_grouped_(grads, op="mean")
        gathered = comm.allgather(torch.full((r + 1, 2), float(r)))  # first dimensions differ
        t = torch.tensor([float(r)])
        comm.broadcast_(t, root=2)
        obj = comm.broadcast_object({"from": r}, root=1)
        comm.barrier()
        return mean, total, top, grads, gathered, t, obj

    out = FakeWorld(4).run(fn)
    for mean, total, top, grads, gathered, t, obj in out:
        assert mean.tolist() == [1.5, 3.0] and total.item() == 6.0 and top.item() == 3.0
        assert torch.equal(grads[0], torch.full((2, 2), 1.5)) and grads[1].item() == 1.0
        assert gathered.shape == (1 + 2 + 3 + 4, 2) and gathered[:, 0].tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
        assert t.item() == 2.0 and obj == {"from": 1}


def test_a_group_collective_involves_only_its_members():
    def fn(comm):
        if comm.rank in (1, 3):
            return comm.allreduce(torch.tensor([float(comm.rank)]), op="sum", group=(1, 3)).item()
        return comm.allreduce(torch.tensor([10.0 * comm.rank]), op="sum", group=(0, 2)).item()

    assert FakeWorld(4).run(fn) == [20.0, 4.0, 20.0, 4.0]


def test_joined_ranks_add_zeros_and_join_returns_the_last_to_join_everywhere():
    """As Horovod's join: rank 3 joins without waiting and keeps computing; 0-2 run summed
    all-reduces among themselves (allreduce_among_, allgather_among); everyone's join then releases all."""
    def fn(comm):
        r = comm.rank
        if r == 3:
            handle = comm.join_async()
            local = sum(i * i for i in range(10_000))  # its main thread goes on with its own work
            last = comm.join_wait(handle)
            return last, local
        sums = []
        for step in range(5):
            g = [torch.full((3,), float(r + step))]
            comm.allreduce_among_(g, members=(0, 1, 2), op="mean")
            sums.append(g[0][0].item())
        stats = comm.allgather_among(torch.tensor([float(r), 7.0]), members=(0, 1, 2))
        while len(comm.world._joined) < r + 1:  # rank 3 has joined; then 0, 1, 2 in turn: rank 2 is last
            time.sleep(0.001)
        return comm.join(), sums, stats.tolist()

    out = FakeWorld(4).run(fn)
    assert out[3][0] == 2 and all(o[0] == 2 for o in out[:3])
    for _, sums, stats in out[:3]:
        assert sums == [1.0 + s for s in range(5)]  # mean of r + step over the 3 members
        assert stats == [[0.0, 7.0], [1.0, 7.0], [2.0, 7.0]]


def test_only_world_sums_run_while_a_rank_is_joined():
    def fn(comm):
        if comm.rank == 1:
            return comm.join()
        while not comm.world._joined:  # until rank 1 has joined
            time.sleep(0.001)
        comm.allgather(torch.zeros(1))

    with pytest.raises(RuntimeError, match="allgather .* while ranks \\[1\\] are joined"):
        FakeWorld(2, timeout_s=10).run(fn)


def test_a_collective_one_rank_never_calls_is_a_deadlock_naming_every_rank():
    def fn(comm):
        comm.allreduce(torch.ones(1), tag="grads")
        if comm.rank != 2:
            comm.allreduce(torch.ones(1), tag="grads")  # rank 2 does one fewer: the others wait forever

    with pytest.raises(FakeDeadlock) as e:
        FakeWorld(3, timeout_s=20).run(fn)
    msg = str(e.value)
    assert "rank 0 waits in 'grads.all'" in msg and "rank 2 has finished" in msg


def test_different_names_on_different_ranks_deadlock_instead_of_matching():
    def fn(comm):
        comm.allreduce(torch.ones(1), tag="a" if comm.rank == 0 else "b")

    with pytest.raises(FakeDeadlock, match="rank 0 waits in 'a.all'; rank 1 waits in 'b.all'"):
        FakeWorld(2, timeout_s=20).run(fn)


def test_an_error_on_a_rank_is_raised_naming_the_rank():
    def fn(comm):
        if comm.rank == 1:
            raise ValueError("boom")
        return comm.rank

    with pytest.raises(RuntimeError, match="rank 1 of the fake world failed: ValueError\\('boom'\\)"):
        FakeWorld(3, timeout_s=20).run(fn)


@pytest.mark.parametrize("seed", range(20))
def test_randomised_membership_schedules_finish_with_the_members_means(seed):
    """A dpar/awar-like protocol through a random schedule: per window some ranks leave (join from a
    helper thread and compute alone), the rest average among themselves each step, and everyone meets at
    the window's end with one join. Every schedule finishes and every sum is the members' mean."""
    world, windows, steps = 5, 6, 4
    rng = random.Random(seed)
    pauses = [[random.Random(seed * 100 + r).random() * 0.002 for _ in range(windows)] for r in range(world)]
    schedule = [sorted(rng.sample(range(world), rng.randint(1, world))) for _ in range(windows)]

    def fn(comm):
        r, seen = comm.rank, []
        for w, members in enumerate(schedule):
            if r not in members:
                handle = comm.join_async()
                time.sleep(pauses[r][w])  # its own work, a random length
                comm.join_wait(handle)
                continue
            for s in range(steps):
                g = [torch.tensor([float(r * 100 + w * 10 + s)])]
                comm.allreduce_among_(g, members=members, op="mean")
                seen.append(g[0].item())
            if len(members) < world:
                comm.join()  # the boundary: meet the ranks outside
        return seen

    out = FakeWorld(world, timeout_s=60).run(fn)
    for r in range(world):
        want = [sum(m * 100 + w * 10 + s for m in members) / len(members)
                for w, members in enumerate(schedule) if r in members for s in range(steps)]
        assert out[r] == pytest.approx(want)
