"""A batch-norm + Adam model and an AWAR strategy that checks every merge (importable by spawned workers)."""
from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_straggler.strategies.awar import AwarStrategy


class BatchNormAdamNet(pl.LightningModule):
    """An MLP with batch norm (float running stats + an integer batch counter), trained with Adam."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(40, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def _float_buffers(module) -> torch.Tensor:
    return torch.cat([b.detach().reshape(-1) for b in module.buffers() if b.is_floating_point()])


def _int_buffers(module) -> torch.Tensor:
    return torch.cat([b.detach().reshape(-1).double() for b in module.buffers() if not b.is_floating_point()])


def _optimizer_tensors(optimizer) -> torch.Tensor:
    """Adam's moments and step counts, flattened in a fixed order."""
    parts = []
    for index in sorted(optimizer.state_dict()["state"]):
        state = optimizer.state_dict()["state"][index]
        parts += [torch.as_tensor(state[k]).detach().reshape(-1).double() for k in sorted(state)]
    return torch.cat(parts)


class CheckedMergeAwar(AwarStrategy):
    """Before each merge, gathers every rank's float buffers and the leader's integer buffers and optimizer
    state; after it, records on rank 0 the largest deviation (over all ranks) from the documented rule:
    float buffers = the weighted average, integer buffers and optimizer state = the leader's."""

    def weighted_average(self, weights, leader):
        module, optimizer = self.lightning_module, self.optimizers[0]
        floats = self.comm.allgather(_float_buffers(module)[None], tag="check.floats")  # (world, n)
        leader_ints = self.comm.broadcast_(_int_buffers(module).clone(), root=leader, tag="check.ints")
        leader_moments = self.comm.broadcast_(_optimizer_tensors(optimizer).clone(), root=leader, tag="check.moments")
        moments_spread = (_optimizer_tensors(optimizer) - leader_moments).abs().max()  # > 0: the test can fail
        super().weighted_average(weights, leader)
        expected = sum(w * floats[i] for i, w in enumerate(weights))
        errors = torch.stack([
            (_float_buffers(module) - expected).abs().max(),
            (_int_buffers(module) - leader_ints).abs().max(),
            (_optimizer_tensors(optimizer) - leader_moments).abs().max(),
            moments_spread,
        ]).double()
        worst = self.comm.allreduce(errors, op="max", tag="check.errors")
        if self.global_rank == 0:
            self.run_report.setdefault("merge_checks", []).append(worst.tolist())
