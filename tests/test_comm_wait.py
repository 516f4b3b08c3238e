"""How comm/horovod.py waits for a Horovod operation (one process, a stand-in for Horovod's poll and
synchronize): with this project's Horovod build it sleeps in ``horovod_torch_wait_handle`` slices until
the operation is done; on a stock build it polls with sleeps that double up to POLL_MAX_S instead of
entering Horovod's spinning wait. Either way it calls synchronize only once the operation is done, and
returns its result."""
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


@pytest.fixture
def stock_build(monkeypatch):
    monkeypatch.setattr(comm_horovod, "_sleeping_wait", lambda: None)


def test_with_the_patched_build_it_sleeps_in_slices_until_done_then_synchronizes_once(monkeypatch):
    slices, sleeps = [], []
    hvd = StandInHorovod(done_after_polls=3)

    def wait_handle(handle, timeout_s):  # stand-in for horovod_torch_wait_handle: done on the 4th slice
        slices.append((handle, timeout_s))
        return hvd.poll(handle)

    monkeypatch.setattr(comm_horovod, "_sleeping_wait", lambda: wait_handle)
    monkeypatch.setattr(comm_horovod.time, "sleep", sleeps.append)
    assert comm_horovod._wait(hvd, 5) == "result of 5"
    assert slices == [(5, comm_horovod.WAIT_SLICE_S)] * 4 and hvd.synchronized == [5]
    assert sleeps == []  # no polling sleeps: the handle's own wait wakes at completion


def test_the_installed_build_offers_the_sleeping_wait():
    """scripts/setup.sh applies scripts/patches/horovod-0.28.1-latency.patch, which adds it."""
    pytest.importorskip("horovod.torch")
    comm_horovod._sleeping_wait.cache_clear()
    assert comm_horovod._sleeping_wait() is not None


def test_waits_by_sleeping_with_doubling_delays_up_to_the_cap_then_synchronizes_once(monkeypatch, stock_build):
    sleeps = []
    monkeypatch.setattr(comm_horovod.time, "sleep", sleeps.append)
    hvd = StandInHorovod(done_after_polls=8)
    assert comm_horovod._wait(hvd, 7) == "result of 7"
    assert hvd.synchronized == [7] and hvd.polls == 9
    first, cap = comm_horovod.POLL_FIRST_S, comm_horovod.POLL_MAX_S
    assert sleeps == [min(first * 2 ** k, cap) for k in range(8)]
    assert sleeps[-1] == cap == pytest.approx(5e-4)  # the most a finished operation waits to be noticed


def test_an_operation_already_done_is_not_slept_on(monkeypatch, stock_build):
    sleeps = []
    monkeypatch.setattr(comm_horovod.time, "sleep", sleeps.append)
    hvd = StandInHorovod(done_after_polls=0)
    assert comm_horovod._wait(hvd, 1) == "result of 1" and sleeps == []


def test_only_tensors_that_carry_gradients_go_through_horovods_autograd_calls():
    assert comm_horovod._differentiable(torch.ones(2, requires_grad=True))
    assert not comm_horovod._differentiable(torch.ones(2))
    with torch.no_grad():
        assert not comm_horovod._differentiable(torch.ones(2, requires_grad=True))
