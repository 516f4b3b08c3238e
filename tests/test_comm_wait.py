"""How comm/horovod.py waits for a Horovod operation (one process, a stand-in for Horovod's poll and
synchronize): it polls with sleeps that double up to POLL_MAX_S instead of entering Horovod's spinning
wait, calls synchronize only once the operation is done, and returns its result."""
from __future__ import annotations

import pytest
import torch

from lightning_straggler.comm import horovod as comm_horovod


class StandInHorovod:
    def __init__(self, done_after_polls: int) -> None:
        self.polls, self.done_after = 0, done_after_polls
        self.synchronized = []

    def poll(self, handle) -> bool:
        self.polls += 1
        return self.polls > self.done_after

    def synchronize(self, handle):
        assert self.polls > self.done_after, "synchronize before the operation was done: Horovod would spin"
        self.synchronized.append(handle)
        return f"result of {handle}"


def test_waits_by_sleeping_with_doubling_delays_up_to_the_cap_then_synchronizes_once(monkeypatch):
    sleeps = []
    monkeypatch.setattr(comm_horovod.time, "sleep", sleeps.append)
    hvd = StandInHorovod(done_after_polls=8)
    assert comm_horovod._wait(hvd, 7) == "result of 7"
    assert hvd.synchronized == [7] and hvd.polls == 9
    first, cap = comm_horovod.POLL_FIRST_S, comm_horovod.POLL_MAX_S
    assert sleeps == [min(first * 2 ** k, cap) for k in range(8)]
    assert sleeps[-1] == cap == pytest.approx(5e-4)  # the most a finished operation waits to be noticed


def test_an_operation_already_done_is_not_slept_on(monkeypatch):
    sleeps = []
    monkeypatch.setattr(comm_horovod.time, "sleep", sleeps.append)
    hvd = StandInHorovod(done_after_polls=0)
    assert comm_horovod._wait(hvd, 1) == "result of 1" and sleeps == []


def test_only_tensors_that_carry_gradients_go_through_horovods_autograd_calls():
    assert comm_horovod._differentiable(torch.ones(2, requires_grad=True))
    assert not comm_horovod._differentiable(torch.ones(2))
    with torch.no_grad():
        assert not comm_horovod._differentiable(torch.ones(2, requires_grad=True))
