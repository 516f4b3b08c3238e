"""Callbacks and helpers used by the multi-process tests (importable by spawned workers)."""
from __future__ import annotations

import os

import psutil
import torch
from lightning.pytorch import Callback

from lightning_straggler.strategies.awar import AwarStrategy


def flat_params(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


class NoWorldProcessGroup(Callback):
    """Fails the run if torch.distributed's default group exists while training: Lightning then broadcasts
    on it at every batch (a world sync each step) and torchmetrics syncs over it."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        assert not torch.distributed.is_initialized(), "torch.distributed's default process group was started"


class RankSpread(Callback):
    """Max |param - rank 0's param| over all ranks, reported in callback_metrics at the end of fit
    (after the strategy's own end-of-training work)."""

    def on_fit_end(self, trainer, pl_module):
        gathered = trainer.strategy.all_gather(flat_params(pl_module))
        spread = (gathered - gathered[0]).abs().max()
        trainer.callback_metrics["rank_param_spread"] = spread.detach().clone()
        trainer.callback_metrics["gathered_ranks"] = torch.tensor(float(gathered.shape[0]))


def _forked_by_server(parent) -> bool:
    return "multiprocessing.forkserver" in " ".join(parent.cmdline())


def launching_pid() -> int:
    """Seen from a worker: the launching process (its parent, or the fork server's parent when the worker
    was forked from Python's fork server)."""
    parent = psutil.Process(os.getppid())
    return parent.ppid() if _forked_by_server(parent) else parent.pid


def peer_workers():
    """Seen from a worker: the other workers of its job (psutil processes)."""
    parent = psutil.Process(os.getppid())
    forked = _forked_by_server(parent)
    return [p for p in parent.children()
            if p.pid != os.getpid() and (forked or "spawn_main" in " ".join(p.cmdline()))]


def _listeners(pid: int):
    proc = psutil.Process(pid)
    return [c.laddr for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


class ListeningSockets(Callback):
    """During training, count listening sockets of this worker and of the launching process."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx != 1:
            return
        addrs = _listeners(os.getpid()) + _listeners(launching_pid())
        bad = [a for a in addrs if not (a.ip.startswith("127.") or a.ip == "::1")]
        total = trainer.strategy.reduce(torch.tensor(float(len(addrs))), reduce_op="sum")
        nonloop = trainer.strategy.reduce(torch.tensor(float(len(bad))), reduce_op="sum")
        trainer.callback_metrics["listeners_total"] = total
        trainer.callback_metrics["listeners_not_loopback"] = nonloop


class Snapshots(Callback):
    """Every rank's flattened parameters after the given optimizer steps (0-based), as
    callback_metrics["params_after_step{k}"] with shape (world, n)."""

    def __init__(self, steps):
        self.steps = set(steps)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        done = trainer.strategy.steps_done - 1
        if done in self.steps:
            trainer.callback_metrics[f"params_after_step{done}"] = trainer.strategy.all_gather(flat_params(pl_module)).clone()


class ClosedFormAwar(AwarStrategy):
    """Gathers every rank's parameters and the weights before each average and checks the result
    against sum_i w_i theta_i computed here; the largest error goes to the run report (rank 0)."""

    def weighted_average(self, weights, leader):
        before = self.all_gather(flat_params(self.lightning_module))  # (world, n)
        expected = sum(w * before[i] for i, w in enumerate(weights))
        super().weighted_average(weights, leader)
        error = (flat_params(self.lightning_module) - expected).abs().max().item()
        if self.global_rank == 0:
            self.run_report.setdefault("average_errors", []).append(error)
            self.run_report.setdefault("average_weights", []).append(list(weights))


class CheckpointHoldsGroupModel(Callback):
    """At every checkpoint Lightning writes (rank 0's ``state_dict``), compares it with the parameters of
    the synchronous group's leader, gathered from every rank (checkpoints come at boundaries, where
    every rank is lined up). Reports the largest difference over all saves and the number of saves made
    while rank 0 itself was outside the group (so that the comparison is not vacuous)."""

    def __init__(self):
        self.errors, self.saves_with_rank0_outside, self.saves = [], 0, 0

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        strategy = trainer.strategy
        group = strategy.group()
        gathered = strategy.all_gather(flat_params(pl_module))  # (world, n)
        saved = torch.cat([checkpoint["state_dict"][name].detach().reshape(-1) for name, _ in pl_module.named_parameters()])
        self.errors.append((saved - gathered[group[0]]).abs().max().item())
        self.saves += 1
        self.saves_with_rank0_outside += int(0 not in group)

    def on_fit_end(self, trainer, pl_module):
        trainer.callback_metrics["checkpoint_vs_group_error"] = torch.tensor(max(self.errors, default=float("nan")))
        trainer.callback_metrics["saves_with_rank0_outside"] = torch.tensor(float(self.saves_with_rank0_outside))
        trainer.callback_metrics["saves"] = torch.tensor(float(self.saves))


class EnvironmentProbe(Callback):
    """Each named environment variable as a worker sees it at the first batch, as a number in
    callback_metrics["env_<name>"] (rank 0's; -1 when unset). Values must be numbers."""

    def __init__(self, *names):
        self.names = names

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            for name in self.names:
                trainer.callback_metrics[f"env_{name}"] = torch.tensor(float(os.environ.get(name, -1)))
