"""``dssync``: Divide-and-Shuffle Synchronization (Wang et al. 2020).

Each step a rank averages only with the members of its group in the schedule's partition for that
step (``policies/dssync.py``: butterfly or seeded random partitions, the same on every rank without
negotiation). ``sync="params"`` averages parameters after the local optimizer step (the paper's
reference code); ``sync="grads"`` averages gradients before it.

How a step's groups exchange (``exchange``):
- ``"sets"`` (default): each group all-reduces on its own Horovod process set, created for every group
  the schedule can use at set-up (adding one is a collective over all ranks). A straggler holds up only
  its own group. Horovod coordinates every set a rank belongs to on every cycle, on one background
  thread (per-rank work that grows with the number of sets).
- ``"aligned"``: the same process sets, every rank first taking part in a one-value world all-reduce
  (``comm.align``) so that every group's all-reduce is coordinated in the same Horovod cycle. Horovod
  runs every set's coordination and transfers on one background thread per rank, and every cycle
  coordinates the world too: under ``"sets"`` a rank whose group is still transferring holds up the
  others' coordination, so groups that start a cycle apart run one after another (measured over shaped
  links: README, "Over shaped links"). Every step then waits for the slowest rank (as ``ring`` does).
- ``"direct"``: each group all-reduces on a torch Gloo process group of its own (``comm.allreduce_direct_``;
  built by its members through a store on rank 0, torch.distributed's world group never started: README,
  "Clusters"), not through
  Horovod: no coordination thread shared with the other groups, so the groups of a step run at once and a
  straggler holds up only its own group. Horovod still does everything else (global averages, checkpoints,
  metrics).
- ``"alltoall"``: one world all-to-all per step (``comm.allreduce_in_partition_``) in which each rank sends
  its tensors to the other members of its group only: what an all-reduce within a pair moves, no process
  set. Being a world operation, every step waits for the slowest rank (as ``ring`` does).

A global average over every worker makes one consensus model: every ``global_every_steps`` steps (0 =
off), at the end of every epoch (``global_at_epoch_end``), before every validation, and at the end of
training, so validation, checkpoints and the model handed back by ``fit`` are the consensus model.
Parameters and floating-point buffers (e.g. batch-norm statistics) are averaged; optimizer state
(momentum, Adam moments) stays local to each rank.
"""
from __future__ import annotations

from typing import List, Optional

from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_straggler.config import DSSYNC_EXCHANGES as EXCHANGES
from lightning_straggler.config import DSSYNC_SYNC_MODES as SYNC_MODES
from lightning_straggler.config import DSSyncConfig as C
from lightning_straggler.launcher import backstop_timeout_s
from lightning_straggler.policies.dssync import KINDS, DSSyncSchedule
from lightning_straggler.strategies.horovod_base import HorovodStrategy


class DSSyncStrategy(HorovodStrategy):
    """Divide-and-Shuffle Synchronization (``strategy="dssync"``): each step every worker averages only
    within its small group; groups change every step so information still mixes (see the module docstring).

    Args:
        group_size: workers per group, 1..N (a world size it does not divide gets some larger groups).
            Default 2.
        schedule: ``"butterfly"`` (everyone mixed in ceil(log_g N) steps) or ``"random"`` (seeded partitions).
        num_partitions: random schedule only: partitions in its cycle (default 4); must stay ``None`` for
            butterfly.
        seed: the random schedule's seed (every rank draws the same partitions).
        sync: ``"params"`` averages parameters after the local step (the paper's code) or ``"grads"``
            averages gradients before it.
        global_every_steps: also average over all workers every N optimizer steps (0 = off).
        global_at_epoch_end: average over all workers at every epoch end (always before validation and
            at the end of training, so validation and checkpoints see one consensus model).
        exchange: ``"sets"`` (a Horovod process set per group: a straggler holds up only its group),
            ``"direct"`` (a torch.distributed Gloo group per group, outside Horovod's coordination: groups run
            at once and a straggler holds up only its group),
            ``"aligned"`` (the same sets, every group starting in the same Horovod cycle after a one-value
            world all-reduce: every step waits for the slowest rank) or ``"alltoall"`` (one world all-to-all
            per step, each rank sending to its group only: no process sets, every step waits for the slowest
            rank). See the module docstring.
        **kwargs: :class:`HorovodStrategy`'s arguments.
    """

    strategy_name = "dssync"
    uses_subgroups = True  # Horovod process sets: exchange="sets" or "aligned" only (set per instance)

    # defaults: the config schema's (one source for Trainer(strategy=DSSyncStrategy()), Hydra and the simulator)
    def __init__(self, group_size: int = C.group_size, schedule: str = C.schedule,
                 num_partitions: Optional[int] = C.num_partitions, seed: int = C.seed, sync: str = C.sync,
                 global_every_steps: int = C.global_every_steps, global_at_epoch_end: bool = C.global_at_epoch_end,
                 exchange: str = C.exchange, **kwargs) -> None:
        super().__init__(**kwargs)
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an integer >= 1 (got {group_size!r})")
        if schedule not in KINDS:
            raise ValueError(f"schedule must be one of {', '.join(KINDS)} (got {schedule!r})")
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {', '.join(SYNC_MODES)} (got {sync!r})")
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)} (got {exchange!r})")
        if global_every_steps < 0:
            raise ValueError(f"global_every_steps must be >= 0 (0 = off) (got {global_every_steps})")
        self.group_size, self.schedule_kind, self.num_partitions, self.seed = group_size, schedule, num_partitions, seed
        self.sync, self.global_every_steps, self.global_at_epoch_end = sync, global_every_steps, global_at_epoch_end
        self.exchange = exchange
        self.uses_subgroups = exchange in ("sets", "aligned")
        self.schedule: Optional[DSSyncSchedule] = None
        self._group = (0,)
        self._nonfinite_senders: List[int] = []  # members whose gradients made the last exchange non-finite
        self._consensus = True  # every rank holds the same parameters (true after the set-up broadcast)

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        # group_size > world_size (e.g. a small local run) means one group of everyone
        size = min(self.group_size, self.world_size)
        self.schedule = DSSyncSchedule(self.world_size, size, self.schedule_kind, self.num_partitions, self.seed)
        if self.uses_subgroups:
            self.comm.ensure_groups(self.schedule.all_groups())  # all ranks, same list, once
        elif self.exchange == "direct":  # its operations time out where Horovod's own would
            self.comm.ensure_direct_groups(self.schedule.all_groups(), timeout_s=backstop_timeout_s(self.stall_timeout_s))
        if not self.events:
            self.record_event("schedule", schedule=self.schedule.describe(), sync=self.sync,
                              global_every_steps=self.global_every_steps,
                              global_at_epoch_end=self.global_at_epoch_end)

    def _step_group(self) -> tuple:
        assert self.schedule is not None
        return self.schedule.group_of(self.global_rank, self.steps_done)

    @override
    def current_group_leader(self) -> int:
        return self._group[0]

    def _average_in_group(self, tensors: List[Tensor], tag: str, find_nonfinite: bool = False) -> None:
        """Average ``tensors`` within this step's group, by the configured exchange."""
        assert self.schedule is not None
        # aligned / alltoall: a world operation, so every rank takes part when any group of the partition
        # (the same on every rank) exchanges, also a rank alone in its group
        if self.exchange == "direct":  # only the group's members take part
            if len(self._group) > 1:
                self.comm.allreduce_direct_(tensors, self._group, op="mean", tag=tag)
            return
        partition = self.schedule.partition(self.steps_done)
        anyone_exchanges = max(len(g) for g in partition) > 1
        if self.uses_subgroups:
            # one group of everyone is a world all-reduce already: nothing to align
            if self.exchange == "aligned" and anyone_exchanges and len(partition) > 1:
                self.comm.align(tag=f"{tag}.align")
            if len(self._group) > 1:
                self.comm.allreduce_grouped_(tensors, op="mean", group=self._group, tag=tag)
            return
        if anyone_exchanges:
            self._nonfinite_senders = self.comm.allreduce_in_partition_(tensors, self._group, op="mean", tag=tag,
                                                                        find_nonfinite=find_nonfinite)

    @override
    def synchronize_gradients(self, optimizer: Optimizer) -> None:
        self._group = self._step_group()
        self._nonfinite_senders = []
        if self.sync == "grads":
            self._average_in_group(self.gradients_of(optimizer), tag="grads", find_nonfinite=True)

    @override
    def nonfinite_ranks_in_sync_group(self, mine_bad: bool, members: tuple) -> list:
        if self.exchange == "direct":  # no process set for the group: its members sum one flag per rank
            import torch

            flags = torch.zeros(self.world_size, dtype=torch.float64)
            flags[self.global_rank] = float(mine_bad)
            self.comm.allreduce_direct_([flags], members, op="sum", tag="nonfinite_flags")
            return [int(r) for r in torch.nonzero(flags).flatten().tolist()]
        if self.uses_subgroups:
            return super().nonfinite_ranks_in_sync_group(mine_bad, members)
        # the all-to-all handed every member each member's gradients: no collective to find whose were not
        # finite (a collective here could not be matched: other groups' ranks do not come). Unlike "sets", a
        # member whose loss alone was non-finite (its gradients finite) is named by itself only
        return sorted(set(self._nonfinite_senders) | ({self.global_rank} if mine_bad else set()))

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        if self.sync == "params":
            self._average_in_group(self._model_tensors(), tag="params")
        self._consensus = len(self._group) == self.world_size
        step = self.steps_done + 1  # steps_done counts this step only after this hook
        if self.global_every_steps and step % self.global_every_steps == 0:
            self.global_average(reason=f"every {self.global_every_steps} steps", step=step)
        elif self.global_at_epoch_end and self._last_batch_of_epoch():
            self.global_average(reason="epoch end", step=step)

    def _last_batch_of_epoch(self) -> bool:
        # Equal on every rank: DistributedSampler gives every rank the same number of batches.
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return bool(trainer is not None and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)

    def _model_tensors(self) -> List[Tensor]:
        module = self.lightning_module
        tensors = [p.data for p in module.parameters()]
        tensors += [b.data for b in module.buffers() if b.is_floating_point()]
        return tensors

    def global_average(self, reason: str, step: Optional[int] = None) -> None:
        """Average parameters and floating buffers over every rank (a collective over all ranks)."""
        if self._consensus:
            return
        self.comm.allreduce_grouped_(self._model_tensors(), op="mean", tag="global_params")
        self._consensus = True
        self.record_event("global_average", reason=reason, step=self.steps_done if step is None else step)

    @override
    def gradient_sync_group(self) -> Optional[tuple]:
        # params mode exchanges no gradients: each rank checks its own before its local step
        return self._group if self.sync == "grads" and len(self._group) > 1 else None

    @override
    def model_diverges(self) -> bool:
        # optimizer state (momentum) is always each rank's own; parameters too between global averages
        return self.world_size > 1

    @override
    def strategy_state(self) -> dict:
        state = super().strategy_state()
        state["dssync"] = {"consensus": self._consensus, "group": list(self._group)}
        return state

    @override
    def load_strategy_state(self, state: dict) -> None:
        super().load_strategy_state(state)
        self._consensus = bool(state["dssync"]["consensus"])
        self._group = tuple(state["dssync"]["group"])

    @override
    def on_validation_start(self) -> None:
        trainer = self.lightning_module.trainer
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self.global_average(reason="before validation")
        super().on_validation_start()

    @override
    def on_train_end(self) -> None:
        self.global_average(reason="end of training")
        super().on_train_end()
