"""``dpar``: Dynamic Partial All-Reduce (DPAR thesis).

Synchronous training in which workers detected as slow leave the all-reduce (the boundary protocol
is in ``partial_group.py``). A SLOW worker keeps doing local steps on its own shard so its speed is
still measured; a STRUCK_OUT one passes over its batches without computing and is never re-admitted.
Decisions (``policies/dpar.py``: median compute per window against the group's, an explicit
keep/exclude cost model, hysteresis, ``min_active``) are taken at boundaries by every rank from the
same gathered numbers.

Merge rule: when an excluded rank is re-admitted, and before anything reads the model (a validation, a
checkpoint, an epoch end, the end of training) while a rank is excluded, the old group's leader
broadcasts parameters, buffers and optimizer state to everyone (``policies/dpar.merges``; at a mere
window end nothing reads an excluded rank's copy, and a rank leaving the group holds the group's model
already). Excluded workers' local updates are thereby discarded (DPAR's definition; a re-admission
logs how many local steps were dropped), and validation, checkpoints and the model handed back are the
group's model. Batches an excluded rank passes over to catch up are
omitted data, as in DPAR; samples of discarded local steps are not counted in ``train_samples``.

``reshard=True`` (off by default; none of the published systems does it): at each epoch start the
training set is sharded over the ACTIVE workers only, so excluded workers' data is not omitted from
that epoch on. The cost: an epoch has world/active times as many steps (same per-step throughput,
longer epochs), the data loaders are rebuilt every epoch, and the epoch in which a worker is excluded
still omits the rest of its shard. An excluded worker keeps measuring its speed on a copy of an active
worker's shard (its local updates are discarded anyway).
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_straggler.config import DparConfig as D
from lightning_straggler.policies.dpar import ACTIVE, DparMembership, DparThresholds
from lightning_straggler.strategies.partial_group import (LOCAL_STEPS, MEDIAN_COMPUTE, MODEL_READ, SAMPLES,
                                                          PartialGroupStrategy)


class DparStrategy(PartialGroupStrategy):
    """Dynamic Partial All-Reduce (``strategy="dpar"``): a worker detected as slow leaves the all-reduce
    (joined, it adds zeros), keeps stepping alone so its speed is still measured, and is re-admitted with
    the group's model when it recovers, or struck out for good (see the module docstring).

    A worker is excluded when its median compute per step over a window is at least ``slow_ratio`` x the
    group's and keeping it costs more than excluding it: keep = active workers x (its step time - the
    group's); exclude = the group's step time x (1 + ``data_penalty``).

    Args:
        window_steps: optimizer steps between decision boundaries (>= 1).
        react_steps: while nobody is excluded, decide at once when a worker has been ``slow_ratio`` x the
            median for this many steps in a row, instead of at the window's end (>= 0, 0 = off; default 3).
        slow_ratio: exclusion threshold, > 1 (default 1.5).
        strikeout_ratio: struck out for good when at least this slow (>= ``slow_ratio``) ...
        strikeout_windows: ... for this many consecutive windows.
        readmit_ratio: re-admitted when back under this, in [1, ``slow_ratio``) ...
        readmit_windows: ... for this many consecutive windows.
        min_active: never fewer active workers (0 = half, rounded up).
        data_penalty: cost of omitting a worker's data shard, as a fraction of a worker-step (>= 0).
        scale_lr: scale the learning rate with the number of active workers.
        reshard: from the next epoch the active workers take over excluded workers' shards (no data
            omitted; epochs get world/active times as many steps).
        **kwargs: :class:`HorovodStrategy`'s arguments.
    """

    strategy_name = "dpar"

    # defaults: the config schema's (one source for Trainer(strategy=DparStrategy()), Hydra and the simulator)
    def __init__(self, window_steps: int = D.window_steps, react_steps: int = D.react_steps, slow_ratio: float = D.slow_ratio,
                 strikeout_ratio: float = D.strikeout_ratio, strikeout_windows: int = D.strikeout_windows,
                 readmit_ratio: float = D.readmit_ratio, readmit_windows: int = D.readmit_windows,
                 min_active: int = D.min_active, data_penalty: float = D.data_penalty, scale_lr: bool = D.scale_lr,
                 reshard: bool = D.reshard, **kwargs: Any) -> None:
        super().__init__(window_steps=window_steps, react_steps=react_steps, **kwargs)
        self.scale_lr, self.reshard = scale_lr, reshard
        self.thresholds = DparThresholds(slow_ratio=slow_ratio, strikeout_ratio=strikeout_ratio,
                                         strikeout_windows=strikeout_windows, readmit_ratio=readmit_ratio,
                                         readmit_windows=readmit_windows, min_active=min_active,
                                         data_penalty=data_penalty)
        self.membership: Optional[DparMembership] = None  # made at set-up, when the world size is known
        self.discarded_samples = 0  # this rank's samples whose updates were thrown away

    @property
    def states(self) -> List[str]:
        return self.membership.states if self.membership else [ACTIVE] * self.world_size

    @property
    @override
    def slow_ratio(self) -> float:
        return self.thresholds.slow_ratio

    @override
    def group(self) -> Tuple[int, ...]:
        return self.membership.group() if self.membership else tuple(range(self.world_size))

    @override
    def computes_outside_group(self, rank: int) -> bool:
        return self.membership.computes_outside_group(rank) if self.membership else True

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        self.membership = DparMembership(self.world_size, self.thresholds, self.comm.join_is_fixed())
        self.note_group_floor(self.membership.configured_floor, self.membership.thresholds.min_active)
        if self.reshard:
            # the shards follow the membership, so the training loader is rebuilt at every epoch start
            trainer.reload_dataloaders_every_n_epochs = 1

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if not (self.reshard and trainer.training and isinstance(dataloader, DataLoader)):
            return super().process_dataloader(dataloader)
        group = self.group()
        if len(group) == self.world_size:
            return super().process_dataloader(dataloader)  # Lightning's DistributedSampler over every worker
        original = dataloader.sampler
        if not isinstance(original, DistributedSampler):
            raise RuntimeError("dpar reshard=True needs Lightning's DistributedSampler on the training loader "
                               f"(use_distributed_sampler=True), found {type(original).__name__}")
        me = self.global_rank
        # excluded ranks read an active rank's shard: they only measure their speed, updates are discarded
        shard = group.index(me) if me in group else me % len(group)
        sampler = DistributedSampler(dataloader.dataset, num_replicas=len(group), rank=shard,
                                     shuffle=original.shuffle, seed=original.seed, drop_last=original.drop_last)
        resharded = DataLoader(dataloader.dataset, batch_size=dataloader.batch_size, sampler=sampler,
                               drop_last=dataloader.drop_last, collate_fn=dataloader.collate_fn,
                               num_workers=dataloader.num_workers, pin_memory=dataloader.pin_memory)
        self.record_event("reshard", step=self.position, epoch=trainer.current_epoch, active=list(group),
                          batches_per_epoch=len(resharded), batches_per_epoch_all_workers=len(dataloader),
                          note=f"{len(group)} active workers take over the shards of excluded ranks "
                               f"{[r for r in range(self.world_size) if r not in group]}")
        return super().process_dataloader(resharded)  # (a mid-epoch resume passes over used batches)

    @override
    def on_boundary(self, rows: List[List[float]], old_group: Tuple[int, ...], position: int) -> None:
        times = [None if r[MEDIAN_COMPUTE] != r[MEDIAN_COMPUTE] else r[MEDIAN_COMPUTE] for r in rows]  # NaN -> None
        decision = self.membership.decide(times)
        if self.global_rank not in old_group:
            self.discarded_samples += int(rows[self.global_rank][SAMPLES])  # never reach the group's model
        for t in decision.transitions:
            details = self.membership.transition_event(t, decision.group_time)
            if t.to_state == ACTIVE:
                details["discarded_local_steps"] = int(rows[t.rank][LOCAL_STEPS])
                details["note"] = "re-admitted with the group's parameters and optimizer state; local updates discarded"
            self.record_event("transition", step=position, **details)
        new_group = self.group()
        if self.membership.merges(old_group, new_group, model_read=rows[old_group[0]][MODEL_READ] > 0.5):
            self.broadcast_training_state(root=old_group[0])  # everyone continues from the group's model
        if self.scale_lr and len(new_group) != len(old_group):
            for optimizer in self.optimizers:
                for param_group in optimizer.param_groups:
                    param_group["lr"] *= len(new_group) / len(old_group)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if len(self.group()) < self.world_size:
            # the run ends with a rank outside: the model handed back is the group's on every rank also when
            # training stopped between boundaries (the last step's boundary broadcast it already otherwise)
            self.broadcast_training_state(root=self.group()[0])
        mine = torch.tensor([float(self.discarded_samples)], dtype=torch.float64)
        total = int(self.comm.allreduce(mine, op="sum", tag="discarded").item())
        if self.global_rank == 0:
            self.run_report["discarded_samples"] = total

    # --- exact resume (HorovodStrategy hooks) ----------------------------------------------------
    @override
    def strategy_state(self) -> dict:
        state = super().strategy_state()
        state["dpar"] = {"memory": self.membership.to_dict() if self.membership else None,
                         "discarded_samples": self.discarded_samples}
        return state

    @override
    def load_strategy_state(self, state: dict) -> None:
        super().load_strategy_state(state)
        saved = state["dpar"]
        if saved["memory"] is not None:
            self.membership.restore(saved["memory"])
        self.discarded_samples = int(saved["discarded_samples"])
