"""Callbacks that break real workers on purpose (importable by the workers)."""
from __future__ import annotations

import os
import signal

import torch
from lightning.pytorch import Callback

from tests.helpers import launching_pid, peer_workers


class _AtStep(Callback):
    """Acts on ``rank`` after optimizer step ``step`` (1-based global step), only in a job of ``world``
    workers, so that a restarted, smaller job is left alone."""

    def __init__(self, rank: int, step: int, world: int) -> None:
        self.rank, self.step, self.world = rank, step, world

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and trainer.world_size == self.world and trainer.global_rank == self.rank:
            self.act(trainer)

    def act(self, trainer) -> None:
        raise NotImplementedError


class KillRank(_AtStep):
    def act(self, trainer) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


class RaiseOnRank(_AtStep):
    def act(self, trainer) -> None:
        raise ValueError(f"boom on purpose at step {self.step}")


class StallRank(_AtStep):
    """Joins a collective nobody else joins: the others wait in the next gradient all-reduce."""

    def act(self, trainer) -> None:
        trainer.strategy.comm.allreduce(torch.ones(1), tag="stall_probe")


def _inet_addresses(pid: int):
    import psutil

    addrs = []
    for c in psutil.Process(pid).net_connections(kind="inet"):
        addrs.append(c.laddr.ip)
        if c.raddr:
            addrs.append(c.raddr.ip)
    return addrs


class SocketAddresses(Callback):
    """At the second batch: every local and remote address of this worker's sockets (Gloo's pair
    connections included) and of the launching process (the rendezvous server) must be loopback."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx != 1:
            return
        addrs = _inet_addresses(os.getpid()) + _inet_addresses(launching_pid())
        bad = [a for a in addrs if not (a.startswith("127.") or a == "::1")]
        strategy = trainer.strategy
        trainer.callback_metrics["sockets_total"] = strategy.reduce(torch.tensor(float(len(addrs))), reduce_op="sum")
        trainer.callback_metrics["sockets_not_loopback"] = strategy.reduce(torch.tensor(float(len(bad))), reduce_op="sum")


class RaiseAfterPeersFail(_AtStep):
    """Provokes the blame race: shuts Horovod down first (so the peers fail with "Horovod has been shut
    down"), waits until the peers have exited, then raises its own error, which thus reaches the launcher
    after their consequences. It waits at most ``wait_s``, well inside the launcher's grace period after
    the first failure (launcher._GRACE_S): raised any later, the launcher would already have stopped it."""

    wait_s = 3.0

    def act(self, trainer) -> None:
        import time

        import psutil

        peers = peer_workers()
        trainer.strategy.comm.shutdown()
        psutil.wait_procs(peers, timeout=self.wait_s)
        time.sleep(0.2)
        raise ValueError(f"own error on purpose at step {self.step}, after the peers failed")


class SleepOnRank(_AtStep):
    """Sleeps in its own code (outside any collective) far longer than the launcher's grace period."""

    def act(self, trainer) -> None:
        import time

        time.sleep(120.0)


class FreezeRank(_AtStep):
    """Stops its own process (SIGSTOP): alive, but it never reaches the next collective."""

    def act(self, trainer) -> None:
        os.kill(os.getpid(), signal.SIGSTOP)
