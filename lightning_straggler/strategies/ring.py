"""``ring``: synchronous gradient all-reduce over every worker, each step (the baseline).

One fused Horovod all-reduce (average) of all gradients per optimizer step, so the update equals
single-process training on the concatenation of the workers' batches.
"""
from __future__ import annotations

from typing import Sequence

from torch.optim import Optimizer
from typing_extensions import override

from lightning_straggler.strategies.horovod_base import HorovodStrategy


class RingStrategy(HorovodStrategy):
    """Synchronous gradient all-reduce over every worker at every step (``strategy="ring"``).

    Takes only :class:`~lightning_straggler.strategies.horovod_base.HorovodStrategy`'s arguments. Every step
    waits for the slowest worker: the baseline the other strategies are measured against.
    """

    strategy_name = "ring"
    uses_subgroups = False

    @override
    def synchronize_gradients(self, optimizer: Optimizer) -> None:
        self.comm.allreduce_grouped_(self.gradients_of(optimizer), op="mean", tag="grads")

    @override
    def gradient_sync_group(self) -> Sequence[int]:
        return tuple(range(self.world_size))
