"""The join-based partial group (``Collectives.allreduce_among_`` / ``allgather_among`` and the strategy's
collectives between boundaries), in one process: a fake world whose other ranks either contribute a
known tensor (group members) or zeros (joined ranks), as Horovod's join does."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import pytest
import torch

from lightning_straggler.comm.base import Collectives


class JoinedWorld(Collectives):
    """Rank ``rank`` of a world of ``size``; ``others[name](r)`` is what rank r adds to the all-reduce
    named ``name`` (zeros for ranks outside ``members``: they have joined). Records every call."""

    def __init__(self, rank: int, size: int, members: Sequence[int], value_of) -> None:
        self._rank, self._size, self.members, self.value_of = rank, size, tuple(members), value_of
        self.calls: List[Dict[str, Any]] = []

    def _contribution(self, r: int, mine: torch.Tensor, name: str) -> torch.Tensor:
        if r == self._rank:
            return mine
        if r not in self.members:
            return torch.zeros_like(mine)  # joined
        return self.value_of(r, name, mine)

    def allreduce(self, tensor, op="mean", group=None, tag="allreduce"):
        self.calls.append({"kind": "allreduce", "op": op, "tag": tag, "group": group})
        total = sum(self._contribution(r, tensor, tag) for r in range(self._size))
        return total / self._size if op == "mean" else total

    def allreduce_grouped_(self, tensors, op="mean", group=None, tag="grads"):
        self.calls.append({"kind": "grouped", "op": op, "tag": tag, "group": group})
        for i, t in enumerate(tensors):
            total = sum(self._contribution(r, t.clone(), f"{tag}[{i}]") for r in range(self._size))
            t.copy_(total / self._size if op == "mean" else total)

    # --- unused here ---
    def init(self, dynamic_groups=True, static_groups=()): ...
    initialized = property(lambda self: True)
    rank = property(lambda self: self._rank)
    local_rank = property(lambda self: self._rank)
    size = property(lambda self: self._size)
    def allgather(self, tensor, group=None, tag="allgather"): raise AssertionError("no all-gather with joined ranks")
    def broadcast_(self, tensor, root, group=None, tag="broadcast"): raise AssertionError
    def broadcast_object(self, obj, root=0, group=None, tag="object"): raise AssertionError
    def barrier(self, group=None): raise AssertionError
    def ensure_groups(self, groups): raise AssertionError("no process sets")
    def shutdown(self): ...


def grads_of(r: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(r)
    return [torch.randn(7, 3, generator=g), torch.randn(5, generator=g)]


def test_allreduce_among_a_subgroup_is_the_members_mean_over_the_world_ring():
    members = (0, 1, 3)  # rank 2 has joined
    comm = JoinedWorld(1, 4, members, lambda r, name, mine: grads_of(r)[int(name[-2])])
    mine = grads_of(1)
    comm.allreduce_among_(mine, members, op="mean", tag="grads")
    for i, t in enumerate(mine):
        expected = sum(grads_of(r)[i] for r in members) / 3
        assert torch.allclose(t, expected, atol=1e-6)
    # one fused sum over the world's ring, under one stable name; no process set, no extra collective
    assert comm.calls == [{"kind": "grouped", "op": "sum", "tag": "grads.among", "group": None}]


def test_allreduce_among_everyone_is_the_ring_all_reduce_itself():
    comm = JoinedWorld(0, 4, range(4), lambda r, name, mine: grads_of(r)[int(name[-2])])
    mine = grads_of(0)
    comm.allreduce_among_(mine, range(4), op="mean", tag="grads")
    assert comm.calls == [{"kind": "grouped", "op": "mean", "tag": "grads", "group": None}]  # ring's call
    assert torch.allclose(mine[0], sum(grads_of(r)[0] for r in range(4)) / 4, atol=1e-6)


def test_allreduce_among_rejects_ops_that_zeros_would_corrupt():
    comm = JoinedWorld(0, 4, (0, 1), lambda r, name, mine: mine)
    with pytest.raises(ValueError, match="max"):
        comm.allreduce_among_([torch.ones(2)], (0, 1), op="max")


def test_allgather_among_returns_the_members_rows_in_order():
    members = (0, 2, 3)  # rank 1 has joined
    value = {0: torch.tensor([1.0, -5.0]), 2: torch.tensor([3.0, 4.0]), 3: torch.tensor([-2.0, 0.5])}

    def slot_of(r, name, mine):  # rank r's world-sized slot tensor: its own row filled, zeros elsewhere
        slots = torch.zeros_like(mine)
        slots[r] = value[r]
        return slots

    comm = JoinedWorld(2, 4, members, slot_of)
    rows = comm.allgather_among(value[2], members, tag="reduce")
    assert torch.equal(rows, torch.stack([value[0], value[2], value[3]]))
    assert rows.max(dim=0).values.tolist() == [3.0, 4.0]  # a max that zeros from rank 1 would have hidden
    assert comm.calls == [{"kind": "allreduce", "op": "sum", "tag": "reduce.among", "group": None}]


def test_stock_horovod_allows_one_rank_out_above_4_ranks_the_fixed_build_any():
    from lightning_straggler.policies.dpar import DparThresholds
    from lightning_straggler.policies.group_floor import join_safe_floor, max_outside
    from lightning_straggler.sim.awar import AwarPolicy
    from lightning_straggler.sim.dpar import DparPolicy
    from lightning_straggler.policies.awar import AwarThresholds

    assert [max_outside(n, join_fixed=False) for n in (1, 2, 4, 5, 8, 1024)] == [0, 1, 3, 1, 1, 1]
    assert [max_outside(n, join_fixed=True) for n in (1, 2, 4, 5, 8, 1024)] == [0, 1, 3, 4, 7, 1023]
    assert join_safe_floor(4, 2, False) == 2 and join_safe_floor(8, 4, False) == 7 and join_safe_floor(8, 8, False) == 8
    assert join_safe_floor(8, 4, True) == 4 and join_safe_floor(8, 1, True) == 1
    # the simulator takes the same floor as DparStrategy / AwarStrategy.setup, the fixed build by default
    assert DparPolicy(8, thresholds=DparThresholds(min_active=2), join_fixed=False).thresholds.min_active == 7
    assert DparPolicy(8, thresholds=DparThresholds(min_active=2)).thresholds.min_active == 2
    assert DparPolicy(4, thresholds=DparThresholds(min_active=2), join_fixed=False).thresholds.min_active == 2
    assert AwarPolicy(8, thresholds=AwarThresholds(min_group=2), join_fixed=False).thresholds.min_group == 7
    assert AwarPolicy(8, thresholds=AwarThresholds(min_group=2)).thresholds.min_group == 2


def test_the_installed_horovod_is_the_patched_build():
    """scripts/setup.sh builds Horovod with scripts/patches/ and labels it; the strategies read the label."""
    import hashlib
    import importlib.metadata
    import pathlib

    from lightning_straggler.comm.horovod import HorovodCollectives, horovod_has_join_fix

    patches = sorted(pathlib.Path(__file__).parent.parent.glob("scripts/patches/horovod-0.28.1-*.patch"))
    assert patches, "no Horovod patches in scripts/patches"
    label = "ls" + hashlib.sha1(b"".join(p.read_bytes() for p in patches)).hexdigest()[:8]
    assert importlib.metadata.version("horovod") == f"0.28.1+{label}"
    assert horovod_has_join_fix() and HorovodCollectives().join_is_fixed()
