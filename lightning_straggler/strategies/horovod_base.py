"""The Horovod strategy every algorithm builds on.

It owns the collectives (``self.comm``), the per-step timing recorder (``self.recorder``) and the
decision log (``self.events``); it implements Lightning's reduce/all_gather/broadcast/barrier with
Horovod (a ``group`` is a Horovod process set given by its ranks) and starts its own workers when
the script was run with plain ``python``. Subclasses decide how gradients or parameters are
synchronised in :meth:`synchronize_gradients` and :meth:`after_optimizer_step`.
"""
from __future__ import annotations

import io
import os
import random
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.data import BatchSampler, DataLoader, Sampler
from typing_extensions import override

from lightning_straggler import cluster_env
from lightning_straggler.comm import Collectives, HorovodCollectives
from lightning_straggler.config import (NONFINITE_POLICIES, RANK_STATES, TrainerConfig, check_cycle_time,
                                        check_stall_timeout)
from lightning_straggler.launcher import HorovodLauncher, attached_to_horovod
from lightning_straggler.profiling import StepRecorder, batch_size_of  # noqa: F401  (batch_size_of: re-exported)

# Key of this project's part of a Lightning checkpoint.
CHECKPOINT_KEY = "lightning_straggler"


def rank_state_path(checkpoint_path: Any, rank: int) -> str:
    """Where rank ``rank`` writes its own state beside a checkpoint (``rank_states="files"``)."""
    return f"{checkpoint_path}.rank{rank}"


class NonFiniteError(RuntimeError):
    """A rank produced a non-finite loss or gradient (``nonfinite="error"``). The message names the rank."""


def _all_finite(tensors: Sequence[Tensor]) -> bool:
    # one reduction per tensor: NaN and inf survive a sum (inf + -inf is NaN)
    return not tensors or bool(torch.isfinite(torch.stack([t.detach().sum() for t in tensors])).all())


def _finite_loss(loss: Any) -> bool:
    return not isinstance(loss, Tensor) or bool(torch.isfinite(loss.detach()).all())


class SkipFirstBatches(Sampler[List[int]]):
    """A batch sampler that passes over the first ``skip`` batches of its next epoch: a run resumed in
    the middle of an epoch continues with the batches the interrupted run had not trained on yet
    (Lightning restarts a plain DataLoader's epoch from its first batch)."""

    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler, self.skip = batch_sampler, int(skip)
        # Lightning sets the epoch on ``loader.batch_sampler.sampler`` (the DistributedSampler)
        self.sampler = getattr(batch_sampler, "sampler", None)

    def __len__(self) -> int:
        return len(self.batch_sampler)  # the epoch's length: Lightning counts the skipped batches as done

    def __iter__(self):
        skip, self.skip = self.skip, 0  # only the epoch the run resumed in
        for i, batch in enumerate(self.batch_sampler):
            if i >= skip:
                yield batch


_REDUCE_OPS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min", "product": "product"}


def _op_name(reduce_op: Any) -> str:
    if reduce_op is None:
        return "mean"
    name = getattr(reduce_op, "name", None) or str(reduce_op)
    name = name.split(".")[-1].lower()
    if name not in _REDUCE_OPS:
        raise ValueError(f"reduce_op {reduce_op!r} is not supported; use one of {', '.join(_REDUCE_OPS)}")
    return _REDUCE_OPS[name]


def _group_ranks(group: Any) -> Optional[Sequence[int]]:
    """``None`` (world), a sequence of ranks, or a Horovod ``ProcessSet``."""
    if group is None or isinstance(group, (list, tuple)):
        return group
    ranks = getattr(group, "ranks", None)
    if ranks is not None:
        return list(ranks)
    raise TypeError(f"group must be None, a list of ranks or a Horovod ProcessSet, not {type(group).__name__}")


class HorovodStrategy(ParallelStrategy):
    """Data-parallel training over Horovod process sets (Gloo on CPU, NCCL on GPU where built).

    The base of every strategy here; the launcher starts ``devices`` local workers (loopback only), or the
    strategy attaches to workers started by ``horovodrun`` or SLURM's ``srun``.

    Args:
        accelerator, parallel_devices, checkpoint_io, precision_plugin: as for Lightning's own strategies
            (the Trainer fills them in).
        stall_timeout_s: seconds a collective may wait for a rank before the job ends naming every rank's
            collective (a frozen rank is named, killed and, with ``restart_on_failure``, left out). In
            [2, 86400]; default 300 (``trainer.stall_timeout_s``).
        comm: the collectives the strategy speaks to (default: :class:`HorovodCollectives`); tests pass
            another implementation.
        nonfinite: what a NaN/inf loss or gradient on any rank does: ``"error"`` stops training naming the
            rank(s) and step; ``"skip"`` skips that optimizer step and logs an event (``trainer.nonfinite``).
        horovod_cycle_time_ms: how often Horovod's background thread coordinates with the other ranks, in
            milliseconds, for the workers this strategy starts (``HOROVOD_CYCLE_TIME``); ``None`` (default)
            leaves Horovod's own (1 ms) or the environment's. Longer cycles cost idle ranks less CPU and add up
            to a cycle of latency to each collective (``trainer.horovod_cycle_time_ms``; in [0.1, 1000]).
        rank_states: where a checkpoint keeps each rank's own state (its model and optimizer state while they
            differ between ranks: dssync, awar): ``"gathered"`` (default: all-gathered and written into the
            checkpoint by rank 0, one self-contained file) or ``"files"`` (each rank writes
            ``<checkpoint>.rank<r>`` beside it itself, no network; resuming needs those files: a shared file
            system, or copy them along). ``trainer.rank_states``."""

    strategy_name = "horovod"
    # Whether the algorithm creates process sets for subgroups while running.
    uses_subgroups = True
    # Whether every rank runs every training step in step with the others, so that a collective
    # from training code (a torchmetrics compute at a train epoch end) meets every rank. ``None``:
    # inferred; algorithms whose ranks drift apart override ``profile_gather_due`` (see there).
    lockstep_training: Optional[bool] = None

    def __init__(
        self,
        accelerator=None,
        parallel_devices: Optional[List[torch.device]] = None,
        checkpoint_io=None,
        precision_plugin=None,
        stall_timeout_s: float = TrainerConfig.stall_timeout_s,
        comm: Optional[Collectives] = None,
        nonfinite: str = TrainerConfig.nonfinite,
        horovod_cycle_time_ms: Optional[float] = TrainerConfig.horovod_cycle_time_ms,
        rank_states: str = TrainerConfig.rank_states,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        check_stall_timeout(stall_timeout_s)
        self.stall_timeout_s = float(stall_timeout_s)
        check_cycle_time(horovod_cycle_time_ms)
        self.horovod_cycle_time_ms = None if horovod_cycle_time_ms is None else float(horovod_cycle_time_ms)
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE_POLICIES)} (got {nonfinite!r})")
        self.nonfinite = nonfinite
        if rank_states not in RANK_STATES:
            raise ValueError(f"rank_states must be one of {', '.join(RANK_STATES)} (got {rank_states!r})")
        self.rank_states = rank_states
        self._resume_path: Optional[str] = None  # the checkpoint being resumed (its rank files lie beside it)
        self.nonfinite_skips = 0  # steps skipped for non-finite gradients (nonfinite="skip")
        self._resume: Optional[Dict[str, Any]] = None  # this project's part of the checkpoint being resumed
        # where in its epoch a checkpoint written by another number of workers stopped (see resume_skip_batches)
        self._resized_position: Optional[Dict[str, Any]] = None
        self.comm: Collectives = comm or HorovodCollectives()
        self.recorder = StepRecorder()
        self.events: List[Dict[str, Any]] = []
        # Filled on rank 0 by the strategy and the callbacks; handed back to the launching process.
        self.run_report: Dict[str, Any] = {}
        self.steps_done = 0  # optimizer steps this rank has taken
        # perf_counter() when this batch's own work began, after the strategy's work at its start (the
        # straggler injector stretches only what comes after)
        self.batch_compute_started = 0.0
        self._last_saved_state: Optional[Tuple[Tensor, Tensor, Optional[Tensor]]] = None
        self._metrics_walk_due = False  # walk the module's torchmetrics again after the next step

    # --- topology ---------------------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        # Lightning reads this for strategies outside its own DDP family: it makes Lightning insert a
        # DistributedSampler and reduce ``self.log(..., sync_dist=True)``.
        return True

    @property
    @override
    def global_rank(self) -> int:
        if self.comm.initialized:
            return self.comm.rank
        return int(os.environ.get("HOROVOD_RANK", 0))

    @property
    @override
    def local_rank(self) -> int:
        if self.comm.initialized:
            return self.comm.local_rank
        return int(os.environ.get("HOROVOD_LOCAL_RANK", 0))

    @property
    @override
    def node_rank(self) -> int:
        return int(os.environ.get("HOROVOD_CROSS_RANK", 0))

    @property
    @override
    def world_size(self) -> int:
        if self.comm.initialized:
            return self.comm.size
        if attached_to_horovod():
            return int(os.environ["HOROVOD_SIZE"])
        return self.num_processes

    @property
    def num_processes(self) -> int:
        """Worker processes on this host (``devices``)."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        return devices[self.local_rank % len(devices)]

    @property
    @override
    def distributed_sampler_kwargs(self) -> Dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def _configure_launcher(self) -> None:
        if not self.comm.needs_launcher:  # an in-process world (comm/fake.py, tests): every rank already runs
            self._launcher = None
            return
        if not attached_to_horovod():
            # a task of a multi-task srun step becomes one worker (sets Horovod's variables; task 0 hosts
            # the rendezvous); anything else is left as it is
            cluster_env.attach(self.stall_timeout_s, cycle_time_ms=self.horovod_cycle_time_ms)
        self._launcher = None if attached_to_horovod() else HorovodLauncher(self, self.stall_timeout_s)

    @override
    def setup_environment(self) -> None:
        self.comm.init(dynamic_groups=self.uses_subgroups)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank
        if attached_to_horovod() and "OMP_NUM_THREADS" not in os.environ:
            # every process would otherwise take all cores (measured 4.6x slower with 4 workers on 2 cores)
            local = int(os.environ.get("HOROVOD_LOCAL_SIZE", 1))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        self.recorder = StepRecorder(rank=self.global_rank)
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        super().setup_environment()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.broadcast_training_state(root=0)
        self.attach_metric_sync()

    def broadcast_training_state(self, root: int = 0, group: Optional[Sequence[int]] = None) -> None:
        """Parameters, buffers and optimizer state from ``root`` to every rank of ``group``."""
        module = self.lightning_module
        assert module is not None
        for name, tensor in module.state_dict().items():
            self.comm.broadcast_(tensor, root=root, group=group, tag=f"state.{name}")
        for i, optimizer in enumerate(self.optimizers):
            state = self.comm.broadcast_object(optimizer.state_dict(), root=root, group=group, tag=f"optimizer{i}")
            if self.global_rank != root:
                optimizer.load_state_dict(state)

    # --- the step ---------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._last_saved_state = None  # (see _gather_strategy_state)
        self.recorder.begin_batch(batch_size_of(batch))
        super().on_train_batch_start(batch, batch_idx)
        # (subclasses call this last: a boundary's collectives at the batch start come before it)
        self.batch_compute_started = time.perf_counter()

    def profile_clock(self) -> int:
        """A step count that every rank agrees on at profile gathers (see :meth:`profile_gather_due`)."""
        return self.steps_done

    def profile_gather_due(self, last_gather_step: int, every: int) -> bool:
        """Whether the profiler may run its all-gather now. It is a collective over every rank, so it
        must come at a point every rank reaches at the same count: for lock-step algorithms, every
        ``every`` steps; algorithms whose ranks drift apart override this."""
        return self.steps_done - last_gather_step >= every

    def skip_this_batch(self) -> bool:
        """True when this rank must pass over the current batch without computing (and without
        synchronising), e.g. an excluded or struck-out worker catching up with its group."""
        return False

    def synchronizes_skipped_batch(self) -> bool:
        """Whether a batch passed over still goes through :meth:`synchronize_gradients` (with zero
        gradients of its own) and the optimizer: adaptive's rank cut from a step takes the group's update."""
        return False

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.skip_this_batch():
            # Lightning refuses None from training_step in distributed runs; a constant loss has no
            # path to the parameters, so their gradients stay None and the optimizer leaves them alone.
            return torch.zeros((), device=self.root_device, requires_grad=True)
        output = super().training_step(*args, **kwargs)
        self._walk_metrics_if_due()
        return output

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        if self.skip_this_batch() and not self.synchronizes_skipped_batch():
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
            self.recorder.discard_step()
            self.after_optimizer_step(optimizer)
            self.steps_done += 1
            return output

        def closure_then_synchronize() -> Any:
            result = closure()  # forward + backward (+ injected straggler delay)
            if self.root_device.type == "cuda":
                torch.cuda.synchronize(self.root_device)  # kernels are asynchronous: time them to completion
            self.recorder.mark_compute_end()
            started = time.perf_counter()
            mine_bad = not (_all_finite(self._own_grads(optimizer)) and _finite_loss(result))
            self.synchronize_gradients(optimizer)
            self._check_finite(optimizer, mine_bad, result)
            self.recorder.add_comm(time.perf_counter() - started)
            return result

        output = super().optimizer_step(optimizer, closure_then_synchronize, model, **kwargs)
        started = time.perf_counter()
        self.after_optimizer_step(optimizer)
        self.recorder.add_comm(time.perf_counter() - started)
        self.recorder.end_step(self.steps_done, group_leader=self.current_group_leader())
        self.steps_done += 1
        return output

    def current_step_compute_s(self) -> float:
        """This rank's compute time of the step in flight, as its step record will hold it (what dpar, awar
        and adaptive send with the gradients)."""
        return self.recorder.compute_of_current_step()

    def synchronize_gradients(self, optimizer: Optimizer) -> None:
        """Exchange gradients before the optimizer update (inside the closure, before clipping)."""

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        """Exchange parameters after the update (parameter-averaging algorithms)."""

    def current_group_leader(self) -> int:
        """Smallest rank of the group this rank synchronised with in the step just taken."""
        return 0

    @staticmethod
    def gradients_of(optimizer: Optimizer) -> List[Tensor]:
        """Every trainable parameter's gradient, zeros where backward produced none, so that all ranks
        exchange the same list of tensors whatever their batch did."""
        grads = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        return grads

    @staticmethod
    def drop_gradients(optimizer: Optimizer) -> None:
        """No update this step: the optimizer passes over parameters without a gradient (a zero gradient
        would still move momentum)."""
        for param_group in optimizer.param_groups:
            for p in param_group["params"]:
                p.grad = None

    def record_event(self, kind: str, **details: Any) -> Dict[str, Any]:
        """A decision or membership change: kept for ``summary.json`` and told to the log (rank 0)."""
        event = {"kind": kind, "step": self.steps_done, **details}
        self.events.append(event)
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in event.items()
                          if k not in ("kind", "models", "schedule"))
        rank_zero_info(f"[{self.strategy_name}] {kind}: {shown}")
        return event

    # --- non-finite losses and gradients ----------------------------------------------------------
    def gradient_sync_group(self) -> Optional[Sequence[int]]:
        """Ranks whose gradients were averaged (or summed) together in the step just synchronised, or
        ``None`` when this rank's gradients stayed its own (a local step). Algorithms that all-reduce
        gradients override this; a wrong answer here would make the culprit search hang."""
        return None

    def gather_in_sync_group(self, tensor: Tensor, members: Tuple[int, ...], tag: str) -> Tensor:
        """All-gather (dim 0) among the ranks of :meth:`gradient_sync_group`, from inside a step."""
        return self.comm.allgather(tensor, group=None if len(members) == self.world_size else members, tag=tag)

    def nonfinite_ranks_in_sync_group(self, mine_bad: bool, members: Tuple[int, ...]) -> List[int]:
        """The members that contributed a non-finite loss or gradient to a non-finite exchange (every member
        calls this, only then): their per-rank flags, all-gathered among them."""
        mine = torch.tensor([[float(self.global_rank), float(mine_bad)]], dtype=torch.float64)
        flags = self.gather_in_sync_group(mine, members, tag="nonfinite_flags").reshape(-1, 2)
        return sorted(int(r) for r, bad in flags.tolist() if bad)

    @staticmethod
    def _own_grads(optimizer: Optimizer) -> List[Tensor]:
        return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]

    def _check_finite(self, optimizer: Optimizer, mine_bad: bool, loss: Any) -> None:
        """After the gradient exchange. An average (or sum) is non-finite on every member iff some member
        contributed a non-finite value, so every member takes the same branch and only then do they all
        enter one named all-gather of per-rank flags to find the culprit: nothing extra on normal steps."""
        group = self.gradient_sync_group()
        if group is None or len(group) < 2:
            if not mine_bad:
                return
            culprits, members = [self.global_rank], [self.global_rank]
        else:
            if _all_finite(self._own_grads(optimizer)):
                return
            members = sorted(group)
            culprits = self.nonfinite_ranks_in_sync_group(mine_bad, tuple(members))
        step = self.steps_done
        loss_value = float(loss.detach().float().mean()) if isinstance(loss, Tensor) and mine_bad else None
        if self.nonfinite == "skip":
            self.drop_gradients(optimizer)
            self.nonfinite_skips += 1
            self.record_event("nonfinite_skipped", step=step, ranks=culprits, group=members,
                              note="optimizer step skipped on these ranks (trainer.nonfinite=skip)")
            return
        who = (f"rank {culprits[0]}" if len(culprits) == 1 else f"ranks {culprits}") if culprits else \
            f"none of ranks {members} alone (their gradients overflowed when summed)"
        mine = f" (this rank's loss: {loss_value})" if loss_value is not None else ""
        raise NonFiniteError(f"non-finite loss or gradients from {who} at step {step} ({self.strategy_name}, "
                             f"seen by ranks {members}){mine}; training stopped before the update reached "
                             "the model. Set trainer.nonfinite=skip (strategy nonfinite='skip') to skip such steps")

    # --- exact resume -----------------------------------------------------------------------------
    def model_diverges(self) -> bool:
        """Whether ranks may hold different parameters or optimizer state right now; then every rank's
        own model and optimizer state go into the checkpoint (Lightning saves rank 0's only)."""
        return False

    def strategy_state(self) -> Dict[str, Any]:
        """What this rank decides with, for the checkpoint. Subclasses add theirs (call super)."""
        trainer = self.lightning_module.trainer
        state: Dict[str, Any] = {
            "steps_done": self.steps_done,
            "events": list(self.events),
            "nonfinite_skips": self.nonfinite_skips,
            # batches of the current epoch already trained on: a resume passes over them
            "epoch": trainer.current_epoch,
            "epoch_batches": trainer.fit_loop.epoch_loop.batch_progress.current.processed,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        }
        if self.model_diverges():
            state["model"] = self.lightning_module.state_dict()
            state["optimizers"] = [o.state_dict() for o in self.optimizers]
        return state

    def load_strategy_state(self, state: Dict[str, Any]) -> None:
        """Inverse of :meth:`strategy_state`, at the start of training (after Lightning restored rank 0's
        model, optimizer and loops). Subclasses restore theirs (call super)."""
        self.steps_done = int(state["steps_done"])
        self.events = list(state["events"])
        self.nonfinite_skips = int(state.get("nonfinite_skips", 0))
        rng = state.get("rng")
        if rng:
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
        if "model" in state:
            self.lightning_module.load_state_dict(state["model"])
            for optimizer, saved in zip(self.optimizers, state["optimizers"]):
                optimizer.load_state_dict(saved)

    def _gather_strategy_state(self) -> Optional[Dict[str, Any]]:
        """Every rank's :meth:`strategy_state` on rank 0 (two named all-gathers that every rank reaches:
        Lightning calls ``save_checkpoint`` on all ranks). Serialized to uint8 tensors so the checkpoint
        still loads with ``torch.load(weights_only=True)``."""
        buffer = io.BytesIO()
        torch.save(self.strategy_state(), buffer)
        blob = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        # Lightning often saves twice in a row (a checkpoint, then last.ckpt): when no rank's state changed
        # since the last save (one value all-reduced), rank 0 reuses what it gathered then. dssync's and
        # awar's states hold every rank's model: gathering them again over slow links took seconds.
        last = self._last_saved_state
        changed = float(last is None or not torch.equal(last[0], blob))
        if self.comm.allreduce(torch.tensor([changed]), op="max", tag="resume_state_changed").item() == 0:
            sizes, blobs = last[1], last[2]
        else:
            sizes = self.comm.allgather(torch.tensor([blob.numel()], dtype=torch.int64), tag="resume_state_size")
            blobs = self.comm.allgather(blob, tag="resume_state")
        # kept until the next batch starts (rank 0: every rank's state; the others: their own)
        self._last_saved_state = (blob, sizes, blobs if self.global_rank == 0 else None)
        if self.global_rank != 0:
            return None
        return {**self._checkpoint_header(), "ranks": [b.clone() for b in torch.split(blobs, sizes.tolist())]}

    def _checkpoint_header(self) -> Dict[str, Any]:
        trainer = self.lightning_module.trainer
        per_epoch = trainer.num_training_batches
        position = {"epoch": trainer.current_epoch,
                    "batches": trainer.fit_loop.epoch_loop.batch_progress.current.processed,
                    "per_epoch": int(per_epoch) if per_epoch != float("inf") else None}
        return {"world_size": self.world_size, "algorithm": self.strategy_name, "position": position}

    def _write_rank_state_file(self, filepath: Any) -> Optional[Dict[str, Any]]:
        """``rank_states="files"``: this rank's :meth:`strategy_state` into ``<checkpoint>.rank<r>``, written by
        the rank itself (no network), then one all-reduce that every rank reaches, so rank 0 writes the
        checkpoint naming the files only once all of them are written."""
        from fsspec.implementations.local import LocalFileSystem
        from lightning.fabric.utilities.cloud_io import get_filesystem

        from lightning_straggler.checkpoint_io import save_atomically

        # one token per save, in the checkpoint and in each of its rank files: a file left by another save
        # under the same name (last.ckpt.rank2 of an earlier step) is refused on resume, never mixed in
        # and rank 0's checkpoint path: every rank names its file after the checkpoint rank 0 writes
        token, filepath = self.comm.broadcast_object((uuid.uuid4().hex, str(filepath)) if self.global_rank == 0
                                                     else None, root=0, tag="rank_state_token")
        path = rank_state_path(filepath, self.global_rank)
        content = {"save_token": token, "state": self.strategy_state()}
        fs = get_filesystem(path)
        if isinstance(fs, LocalFileSystem):
            save_atomically(content, path)
        else:
            with fs.open(path, "wb") as f:
                torch.save(content, f)
        self.comm.allreduce(torch.ones(1), op="sum", tag="rank_state_files_written")
        if self.global_rank != 0:
            return None
        return {**self._checkpoint_header(), "save_token": token,
                "rank_files": [os.path.basename(rank_state_path(filepath, r)) for r in range(self.world_size)]}

    @override
    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if self.comm.initialized and self.lightning_module is not None and self.lightning_module._trainer is not None:
            if self.rank_states == "files":
                state = self._write_rank_state_file(filepath)
            else:
                state = self._gather_strategy_state()
            if state is not None:
                checkpoint[CHECKPOINT_KEY] = state
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)  # rank 0: the checkpoint
        if self.rank_states != "files":
            return
        # Lightning's ModelCheckpoint removes on every rank: each rank its own file
        from lightning.fabric.utilities.cloud_io import get_filesystem

        path = rank_state_path(filepath, self.global_rank)
        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._resume_path = str(checkpoint_path)
        self._resume = checkpoint.get(CHECKPOINT_KEY)
        if self._resume is not None and self._resume.get("world_size") != self.world_size:
            rank_zero_info(f"[{self.strategy_name}] checkpoint was written by {self._resume.get('world_size')} workers, "
                           f"this run has {self.world_size}: model, optimizer and loop state are restored, the "
                           f"algorithm's state (membership, time models, allocations, counters) starts afresh")
            self._resized_position = self._resume.get("position")
            self._resume = None
        elif self._resume is not None and self._resume.get("algorithm") != self.strategy_name:
            rank_zero_info(f"[{self.strategy_name}] checkpoint was written by {self._resume.get('algorithm')!r}: "
                           f"the algorithm's state starts afresh")
            self._resized_position = self._resume.get("position")  # the same world: the same batch goes on
            self._resume = None
        if self._resume is None:
            self.start_algorithm_at(int(checkpoint.get("global_step", 0)))
        return checkpoint

    def start_algorithm_at(self, step: int) -> None:
        """A resume whose algorithm state is not used (written by another number of workers or another
        algorithm, or without it): the algorithm starts afresh, but at the checkpoint's step, so its step
        numbers (events, windows, the profiler's records, boa's sampler) go on from there as they do in a
        full resume. Subclasses set their own counters (call super)."""
        self.steps_done = step

    def _resumed_state(self) -> Optional[Dict[str, Any]]:
        """This rank's saved state while a resume is pending (decoded once)."""
        if self._resume is None:
            return None
        if "mine" not in self._resume:
            if "rank_files" in self._resume:  # written with rank_states="files": this rank's lies beside it
                self._resume["mine"] = self._read_rank_state_file(self._resume["rank_files"][self.global_rank])
            else:
                blob = self._resume["ranks"][self.global_rank]
                self._resume["mine"] = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=False)
        return self._resume["mine"]

    def _read_rank_state_file(self, name: str) -> Dict[str, Any]:
        from lightning.fabric.utilities.cloud_io import get_filesystem

        path = os.path.join(os.path.dirname(self._resume_path or ""), name)
        fs = get_filesystem(path)
        if not fs.exists(path):
            raise FileNotFoundError(
                f"rank {self.global_rank}'s state for checkpoint {self._resume_path} is missing: {path}. The "
                f"checkpoint was saved with trainer.rank_states=files (each rank wrote <checkpoint>.rank<r> beside "
                f"it); resume where every rank sees those files (a shared file system), or copy them along")
        with fs.open(path, "rb") as f:
            content = torch.load(f, weights_only=False)
        if content.get("save_token") != self._resume.get("save_token"):
            raise RuntimeError(f"rank {self.global_rank}'s state file {path} belongs to another save than checkpoint "
                               f"{self._resume_path} (written by a later or earlier save under the same name); "
                               f"resume from the checkpoint its files were written with")
        return content["state"]

    def resume_skip_batches(self, batches_per_epoch: int) -> int:
        """Batches of the resumed epoch the interrupted run had already trained on (0 when not resuming),
        for a training loader of ``batches_per_epoch`` batches per rank."""
        state = self._resumed_state()
        trainer = self.lightning_module.trainer
        if state is not None:
            return int(state["epoch_batches"]) if state["epoch"] == trainer.current_epoch else 0
        return self._rescale_resized_position(batches_per_epoch)

    def _rescale_resized_position(self, batches_per_epoch: int) -> int:
        """A restart with fewer workers has more batches per epoch than the checkpoint's run: Lightning's
        restored batch counter still counts the old, shorter epoch, so a checkpoint from an epoch's last
        batch would end the next epoch that many batches early. The epoch's done fraction is kept instead:
        the counter is moved to the same fraction of the new epoch (its end stays its end) and that many
        batches are passed over. Which samples they are differs (the shards are cut for the new world)."""
        trainer = self.lightning_module.trainer
        # only once Lightning has restored the loops (a loader built earlier, e.g. for
        # estimated_stepping_batches in configure_optimizers, would see fresh counters)
        if not (trainer.state.fn == TrainerFn.FITTING and trainer.fit_loop.restarting):
            return 0
        position, self._resized_position = self._resized_position, None
        if not position or not position.get("per_epoch") or position["epoch"] != trainer.current_epoch:
            return 0
        # the epoch as Lightning will count it: limit_train_batches applies to the new loader too
        batches_per_epoch = int(_parse_num_batches(RunningStage.TRAINING, batches_per_epoch, trainer.limit_train_batches))
        progress = trainer.fit_loop.epoch_loop.batch_progress
        if progress.is_last_batch:
            batches = batches_per_epoch
        else:  # mid-epoch stays mid-epoch (at least one batch in, if it was)
            batches = min(round(position["batches"] / position["per_epoch"] * batches_per_epoch), batches_per_epoch - 1)
            batches = max(batches, min(1, position["batches"]))
        shift = batches - progress.current.processed
        for tracker in (progress.current, progress.total):
            for name in ("ready", "started", "processed", "completed"):
                setattr(tracker, name, getattr(tracker, name) + shift)
        rank_zero_info(f"[{self.strategy_name}] the checkpoint stopped after batch {position['batches']} of "
                       f"{position['per_epoch']} of epoch {position['epoch']}; with {self.world_size} workers an "
                       f"epoch has {batches_per_epoch} batches: the run goes on after batch {batches}")
        return batches

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or not isinstance(dataloader, DataLoader):
            return dataloader
        if self._resume is None and self._resized_position is None:
            return dataloader  # not resuming (and a loader without a length stays as it is)
        skip = self.resume_skip_batches(len(dataloader))
        if not 0 < skip < len(dataloader) or not isinstance(dataloader.batch_sampler, BatchSampler):
            return dataloader  # saved at an epoch's end (or not resuming): Lightning starts the next epoch
        return DataLoader(dataloader.dataset, batch_sampler=SkipFirstBatches(dataloader.batch_sampler, skip),
                          num_workers=dataloader.num_workers, collate_fn=dataloader.collate_fn,
                          pin_memory=dataloader.pin_memory, timeout=dataloader.timeout,
                          worker_init_fn=dataloader.worker_init_fn, generator=dataloader.generator,
                          persistent_workers=dataloader.persistent_workers)

    @override
    def on_train_start(self) -> None:
        state = self._resumed_state()
        if state is not None:
            self.load_strategy_state(state)
            rank_zero_info(f"[{self.strategy_name}] resumed the algorithm's state at step {self.steps_done}")
        self._resume = self._resized_position = None
        self.attach_metric_sync()
        super().on_train_start()

    # --- torchmetrics ----------------------------------------------------------------------------
    def trains_in_lockstep(self) -> bool:
        if self.lockstep_training is not None:
            return self.lockstep_training
        return type(self).profile_gather_due is HorovodStrategy.profile_gather_due

    def metric_sync_allowed(self) -> bool:
        """Whether torchmetrics metrics synchronise now (asked by every metric's compute; the same
        answer on every rank): always at validation, test and sanity check; while training only when
        the ranks train in lock-step (not ``dpar`` / ``awar``: there a metric computed in training
        code is this rank's own)."""
        if not self.comm.initialized or self.comm.size < 2:
            return False
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)
        return not (trainer is not None and trainer.training and not self.trains_in_lockstep())

    def attach_metric_sync(self) -> int:
        """Make every torchmetrics ``Metric`` in the LightningModule synchronise over this strategy's
        collectives (``lightning_straggler.metrics``). Runs at set-up, at every training, validation and
        test start and after the first step of each, for metrics created late."""
        from lightning_straggler.metrics import attach_horovod_sync

        self._metrics_walk_due = True
        return attach_horovod_sync(self.lightning_module, self) if self.lightning_module is not None else 0

    def _walk_metrics_if_due(self) -> None:
        if self._metrics_walk_due:
            self.attach_metric_sync()
            self._metrics_walk_due = False

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().validation_step(*args, **kwargs)
        self._walk_metrics_if_due()
        return output

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().test_step(*args, **kwargs)
        self._walk_metrics_if_due()
        return output

    @override
    def on_validation_start(self) -> None:
        trainer = self.lightning_module.trainer
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self.broadcast_buffers(root=0)
        self.attach_metric_sync()
        super().on_validation_start()

    def broadcast_buffers(self, root: int = 0) -> None:
        """Rank ``root``'s buffers (batch-norm running statistics) on every rank before a validation in
        fit, as DDP does (its forward broadcasts rank 0's buffers): every rank then validates the model
        that is checkpointed and handed back, not its own running statistics. One broadcast per dtype."""
        buffers = [b for b in self.lightning_module.buffers()]
        for dtype in sorted({b.dtype for b in buffers}, key=str):
            same = [b for b in buffers if b.dtype == dtype]
            flat = torch.cat([b.detach().reshape(-1) for b in same])
            self.comm.broadcast_(flat, root=root, tag=f"eval_buffers.{str(dtype).split('.')[-1]}")
            for b, part in zip(same, torch.split(flat, [b.numel() for b in same])):
                b.data.copy_(part.view_as(b))

    @override
    def on_test_start(self) -> None:
        self.attach_metric_sync()
        super().on_test_start()

    # --- Lightning's collectives ------------------------------------------------------------------
    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        if not isinstance(tensor, Tensor) or not self.comm.initialized:
            return tensor
        op = _op_name(reduce_op)
        if op == "mean" and not tensor.is_floating_point():
            tensor = tensor.float()
        return self.comm.allreduce(tensor, op=op, group=_group_ranks(group), tag="reduce")

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        if not self.comm.initialized:
            return tensor.unsqueeze(0)
        ranks = _group_ranks(group)
        n = len(ranks) if ranks is not None else self.world_size
        # under torch.inference_mode (validation, test, predict) Horovod's thread cannot resize an
        # inference tensor: gather a normal one
        with torch.inference_mode(False):
            source = tensor.unsqueeze(0).clone() if tensor.is_inference() else tensor.unsqueeze(0)
            gathered = self.comm.allgather(source, group=ranks, tag="all_gather")
        return gathered.view(n, *tensor.shape)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self.comm.initialized:
            return obj
        return self.comm.broadcast_object(obj, root=src, tag="broadcast")

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if self.comm.initialized:
            self.comm.barrier()

    @override
    def teardown(self) -> None:
        if self.global_rank == 0:
            self.run_report["events"] = list(self.events)
        super().teardown()

    def __getstate__(self) -> Dict[str, Any]:
        # Spawned workers get a fresh recorder and event log.
        state = self.__dict__.copy()
        state["recorder"] = StepRecorder()
        return state
