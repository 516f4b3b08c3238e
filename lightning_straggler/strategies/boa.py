"""``boa``: Batch-Orchestrating Algorithm for clusters of mixed speed (BOA thesis).

Every rank gets its own local batch size b_i so that all finish a step together. Compute time per
step (before any collective, from the strategy's recorder) is gathered every ``window_steps`` steps;
rank 0 fits a linear time model t_i(b) = a_i + c_i * b per rank (``policies/boa.py``), solves for the
integer batch sizes that minimise the slowest predicted time, and broadcasts the new allocation when
its predicted gain exceeds ``rebalance_gain``. (Rank 0 decides and broadcasts instead of every rank
solving on its own: one tiny broadcast per window buys immunity to floating-point differences between
machines.) The allocation takes effect at a step no rank's data loader has drawn yet.

Data: the strategy's ``process_dataloader`` hook replaces the training loader's sampler with a batch
sampler over one shared seeded permutation per epoch (``policies/boa_schedule.py``): every sample
once per epoch whatever the allocation. Gradients: each rank's mean gradient is scaled by b_i / B and
summed over ranks, which is the gradient of the global batch's mean loss; the learning rate is unchanged.
``accumulate_grad_batches`` must be 1 (a step is one batch): anything else fails at set-up.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence

import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, Sampler
from typing_extensions import override

from lightning_straggler.config import BoaConfig as B
from lightning_straggler.policies import boa as boa_policy
from lightning_straggler.policies.boa_schedule import AllocationSchedule, epoch_permutation, rank_slice
from lightning_straggler.profiling import StepRecord
from lightning_straggler.strategies.horovod_base import HorovodStrategy


class GlobalBatchSampler(Sampler[List[int]]):
    """Yields this rank's slice of each global batch; knows the step of every batch it yields."""

    def __init__(self, num_samples: int, rank: int, schedule: AllocationSchedule, seed: int = 0) -> None:
        self.num_samples, self.rank, self.schedule, self.seed = num_samples, rank, schedule, seed
        self.epoch = 0
        self.next_step = 0  # global step of the next batch to yield (ahead of training when the loader prefetches)
        self.placeholders = 0
        self.skip = 0  # batches of the next epoch already trained on before a resume

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def sampler(self) -> "GlobalBatchSampler":
        # Lightning calls set_epoch on ``loader.batch_sampler.sampler`` only: without this every epoch
        # would reuse epoch 0's permutation
        return self

    def __len__(self) -> int:
        return self.num_samples // self.schedule.global_batch

    def __iter__(self) -> Iterator[List[int]]:
        perm = epoch_permutation(self.num_samples, self.seed, self.epoch)
        skip, self.skip = self.skip, 0
        for k in range(skip, len(self)):
            indices, placeholder = rank_slice(perm, k, self.schedule.at(self.next_step), self.rank)
            self.placeholders += placeholder
            self.next_step += 1
            yield indices


class BoaStrategy(HorovodStrategy):
    """Batch orchestration for workers of different speed (``strategy="boa"``): per-worker local batch sizes
    from fitted time models so that all finish each step together; gradients weighted by local batch size,
    so a step equals a single-process step on the global batch (see the module docstring).

    Args:
        global_batch: samples per optimizer step over all workers, kept fixed (0 = workers x the loader's
            batch size).
        min_local_batch: smallest local batch a worker gets (>= 1).
        max_local_batch: memory cap per worker (0 = none); a global batch that cannot fit is an error.
        window_steps: steps between measurement gathers and re-planning (0 = keep the initial split).
        rebalance_gain: re-plan only when the predicted step time drops by more than this fraction
            (default 0.05 = 5%).
        tune_workers: leave out workers that cost more time than they add (they idle; logged).
        history_windows: windows of measurements the time models are fitted on (>= 1).
        initial_batch_sizes: the first allocation, one size per worker summing to ``global_batch``
            (default: the global batch split evenly).
        seed: seed of the shared per-epoch permutation of the training set.
        **kwargs: :class:`HorovodStrategy`'s arguments.
    """

    strategy_name = "boa"
    uses_subgroups = False

    # defaults: the config schema's (one source for Trainer(strategy=BoaStrategy()), Hydra and the simulator)
    def __init__(self, global_batch: int = B.global_batch, min_local_batch: int = B.min_local_batch,
                 max_local_batch: int = B.max_local_batch, window_steps: int = B.window_steps,
                 rebalance_gain: float = B.rebalance_gain, tune_workers: bool = B.tune_workers,
                 history_windows: int = B.history_windows, initial_batch_sizes: Optional[Sequence[int]] = None,
                 seed: int = B.seed, **kwargs) -> None:
        super().__init__(**kwargs)
        for name, value, low in (("global_batch", global_batch, 0), ("min_local_batch", min_local_batch, 1),
                                 ("max_local_batch", max_local_batch, 0), ("window_steps", window_steps, 0),
                                 ("history_windows", history_windows, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low} (got {value!r})")
        if max_local_batch and max_local_batch < min_local_batch:
            raise ValueError(f"max_local_batch must be 0 (no cap) or >= min_local_batch ({min_local_batch}) "
                             f"(got {max_local_batch})")
        if rebalance_gain < 0:
            raise ValueError(f"rebalance_gain must be >= 0 (got {rebalance_gain})")
        self.global_batch, self.min_local_batch, self.max_local_batch = global_batch, min_local_batch, max_local_batch
        self.window_steps, self.rebalance_gain, self.tune_workers = window_steps, rebalance_gain, tune_workers
        self.history_windows, self.initial_batch_sizes, self.seed = history_windows, initial_batch_sizes, seed
        self.schedule: Optional[AllocationSchedule] = None
        self.sampler: Optional[GlobalBatchSampler] = None
        self._points: List[List[tuple]] = []  # per window: (rank, batch size, compute seconds)
        self._window_start = 0  # index of the first recorder record not yet used for a decision

    @override
    def setup(self, trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING and trainer.accumulate_grad_batches != 1:
            # before any collective, on every rank alike
            raise ValueError(f"boa does not support accumulate_grad_batches={trainer.accumulate_grad_batches}: "
                             "a step is one batch per worker, sized by boa (raise the global batch instead: "
                             "BoaStrategy(global_batch=...))")
        super().setup(trainer)

    # --- data ---------------------------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if not (isinstance(dataloader, DataLoader) and trainer.training):
            return dataloader  # validation / test loaders keep Lightning's DistributedSampler
        if self.schedule is None:
            self.schedule = AllocationSchedule(boa_policy.initial_allocation(
                self.world_size, dataloader.batch_size or 1, self.global_batch, self.min_local_batch,
                self.max_local_batch, self.initial_batch_sizes))
            self.record_event("allocation", batch_sizes=list(self.schedule.at(0)), reason="initial",
                              global_batch=self.schedule.global_batch)
        self.sampler = GlobalBatchSampler(len(dataloader.dataset), self.global_rank, self.schedule, self.seed)
        self._resume_sampler()
        return DataLoader(dataloader.dataset, batch_sampler=self.sampler, collate_fn=dataloader.collate_fn,
                          num_workers=dataloader.num_workers, pin_memory=dataloader.pin_memory)

    # --- the step -----------------------------------------------------------------------------
    @override
    def synchronize_gradients(self, optimizer: Optimizer) -> None:
        self.comm.allreduce_grouped_(self.weighted_gradients(optimizer), op="sum", tag="grads")

    def weighted_gradients(self, optimizer: Optimizer) -> List[torch.Tensor]:
        """This rank's gradients scaled by its share b_i / B of the step's global batch (summed over ranks:
        the global batch's mean-loss gradient)."""
        assert self.schedule is not None, f"{self.strategy_name} needs its training data loader (process_dataloader was not called)"
        grads = self.gradients_of(optimizer)
        weight = self.schedule.weight(self.global_rank, self.steps_done)
        for g in grads:
            g.mul_(weight)
        return grads

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        if self.window_steps and (self.steps_done + 1) % self.window_steps == 0:
            self._rebalance()

    def _rebalance(self) -> None:
        assert self.schedule is not None and self.sampler is not None
        window = self.recorder.records[self._window_start:]  # this step's record is not closed yet
        self._window_start = len(self.recorder.records)
        mine = [(float(self.global_rank), float(r.samples), r.compute_s) for r in window]
        rows = torch.tensor(mine + [(float(self.global_rank), -1.0, float(self.sampler.next_step))],
                            dtype=torch.float64)
        every = self.comm.allgather(rows, tag="boa_profile").tolist()
        decision = None
        if self.global_rank == 0:
            self._points.append([tuple(r) for r in every if r[1] >= 0])
            self._points = self._points[-self.history_windows:]
            first_free_step = int(max(r[2] for r in every if r[1] < 0))
            decision = self._decide(first_free_step)
        decision = self.comm.broadcast_object(decision, root=0, tag="boa_plan")
        if decision is not None:
            self.schedule.change(decision["from_step"], decision["batch_sizes"])
            self.record_event("rebalance", **decision)

    def _decide(self, from_step: int) -> Optional[dict]:
        """Rank 0: the policy's re-planning on each rank's records of the recent windows."""
        points: List[List[tuple]] = [[] for _ in range(self.world_size)]
        for window in self._points:
            for rank, b, t in window:
                points[int(rank)].append((b, t))
        return self.plan_from(points, from_step)

    def plan_from(self, points: Sequence[Sequence[tuple]], from_step: int) -> Optional[dict]:
        """Rank 0: ``policies/boa.rebalance_decision`` on ``points[i]`` = rank i's (batch size, compute seconds)
        records, as the event and broadcast payload (None: keep the allocation)."""
        decision = boa_policy.rebalance_decision(
            points, list(self.schedule.at(from_step)), self.schedule.global_batch, self.min_local_batch,
            self.max_local_batch, self.tune_workers, self._allreduce_cost_s(), self.rebalance_gain)
        if decision is None:
            return None
        models = [{"intercept_s": m.intercept_s, "per_sample_s": m.per_sample_s} for m in decision.pop("models")]
        return {"from_step": from_step, **decision, "models": models}

    def _allreduce_cost_s(self) -> float:
        # rank 0's fastest recent all-reduce: the transfer alone, without waiting for stragglers
        comm = [r.comm_s for r in self.recorder.records[-self.window_steps:]]
        return min(comm) if comm else 0.0

    @override
    def gradient_sync_group(self) -> Sequence[int]:
        return tuple(range(self.world_size))  # weighted gradients are summed over every rank

    # --- exact resume -------------------------------------------------------------------------
    @override
    def strategy_state(self) -> dict:
        state = super().strategy_state()
        state["boa"] = {
            "schedule": self.schedule.state() if self.schedule else None,
            "points": [list(w) for w in self._points],  # rank 0's measurement history (the time models' data)
            "window": [r.as_row() for r in self.recorder.records[self._window_start:]],  # the open window
            "placeholders": self.sampler.placeholders if self.sampler else 0,
        }
        return state

    @override
    def load_strategy_state(self, state: dict) -> None:
        super().load_strategy_state(state)
        saved = state["boa"]
        self._points = [[tuple(p) for p in w] for w in saved["points"]]
        self.recorder.records = [StepRecord.from_row(r) for r in saved["window"]]
        self.recorder.take_unsent()  # measured before the checkpoint: the profiler does not report them again
        self._window_start = 0

    def _resume_sampler(self) -> None:
        """On resume, before the sampler yields anything: the saved allocations, and the batches of the
        epoch the interrupted run had trained on are passed over."""
        state = self._resumed_state()
        if self.sampler is None:
            return
        if state is not None:  # (None: not resuming, or from a checkpoint of another number of workers)
            saved = state["boa"]
            if saved["schedule"] is not None:
                schedule = AllocationSchedule(saved["schedule"]["sizes"][0])
                for start, sizes in zip(saved["schedule"]["from"][1:], saved["schedule"]["sizes"][1:]):
                    schedule.change(start, sizes)
                self.schedule = self.sampler.schedule = schedule
            self.sampler.next_step = int(state["steps_done"])
            self.sampler.placeholders = int(saved["placeholders"])
        else:  # 0, or the step of a checkpoint whose algorithm state is not used (see load_checkpoint)
            self.sampler.next_step = self.steps_done
        skip = self.resume_skip_batches(len(self.sampler))
        self.sampler.skip = skip if skip < len(self.sampler) else 0

    @override
    def on_train_end(self) -> None:
        # Placeholder batches of excluded ranks trained nothing: the summary does not count them.
        mine = torch.tensor([float(self.sampler.placeholders if self.sampler else 0)], dtype=torch.float64)
        total = int(self.comm.allreduce(mine, op="sum", tag="boa_placeholders").item())
        if self.global_rank == 0:
            self.run_report["discarded_samples"] = total
        super().on_train_end()
