"""The Horovod strategy every algorithm builds on.

It owns the collectives (``self.comm``), the per-step timing recorder (``self.recorder``) and the
decision log (``self.events``); it implements Lightning's reduce/all_gather/broadcast/barrier with
Horovod (a ``group`` is a Horovod process set given by its ranks) and starts its own workers when
the script was run with plain ``python``. Subclasses decide how gradients or parameters are
synchronised in :meth:`synchronize_gradients` and :meth:`after_optimizer_step`.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_straggler.comm import Collectives, HorovodCollectives
from lightning_straggler.launcher import HorovodLauncher, attached_to_horovod
from lightning_straggler.profiling import StepRecorder

_REDUCE_OPS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min", "product": "product"}


def batch_size_of(batch: Any) -> int:
    """Number of samples in a batch: the first dimension of its first tensor."""
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            n = batch_size_of(item)
            if n:
                return n
    return 0


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
    """Data-parallel training over Horovod process sets (Gloo on CPU, NCCL on GPU where built)."""

    strategy_name = "horovod"
    # Whether the algorithm creates process sets for subgroups while running.
    uses_subgroups = True

    def __init__(
        self,
        accelerator=None,
        parallel_devices: Optional[List[torch.device]] = None,
        checkpoint_io=None,
        precision_plugin=None,
        stall_timeout_s: float = 300.0,
        comm: Optional[Collectives] = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        if stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be > 0 seconds (got {stall_timeout_s})")
        self.stall_timeout_s = float(stall_timeout_s)
        self.comm: Collectives = comm or HorovodCollectives()
        self.recorder = StepRecorder()
        self.events: List[Dict[str, Any]] = []
        # Filled on rank 0 by the strategy and the callbacks; handed back to the launching process.
        self.run_report: Dict[str, Any] = {}
        self.steps_done = 0  # optimizer steps this rank has taken

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
        self._launcher = None if attached_to_horovod() else HorovodLauncher(self, self.stall_timeout_s)

    @override
    def setup_environment(self) -> None:
        self.comm.init(dynamic_groups=self.uses_subgroups)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank
        if attached_to_horovod() and "OMP_NUM_THREADS" not in os.environ:
            # every process would otherwise take all cores (4.6x slower on 2 cores, DESIGN.md)
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
        self.recorder.begin_batch(batch_size_of(batch))
        super().on_train_batch_start(batch, batch_idx)

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

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.skip_this_batch():
            # Lightning refuses None from training_step in distributed runs; a constant loss has no
            # path to the parameters, so their gradients stay None and the optimizer leaves them alone.
            return torch.zeros((), device=self.root_device, requires_grad=True)
        return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        if self.skip_this_batch():
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
            self.synchronize_gradients(optimizer)
            self.recorder.add_comm(time.perf_counter() - started)
            return result

        output = super().optimizer_step(optimizer, closure_then_synchronize, model, **kwargs)
        started = time.perf_counter()
        self.after_optimizer_step(optimizer)
        self.recorder.add_comm(time.perf_counter() - started)
        self.recorder.end_step(self.steps_done, group_leader=self.current_group_leader())
        self.steps_done += 1
        return output

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

    def record_event(self, kind: str, **details: Any) -> Dict[str, Any]:
        """A decision or membership change: kept for ``summary.json`` and told to the log (rank 0)."""
        event = {"kind": kind, "step": self.steps_done, **details}
        self.events.append(event)
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in event.items()
                          if k not in ("kind", "models", "schedule"))
        rank_zero_info(f"[{self.strategy_name}] {kind}: {shown}")
        return event

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
        gathered = self.comm.allgather(tensor.unsqueeze(0), group=ranks, tag="all_gather")
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
