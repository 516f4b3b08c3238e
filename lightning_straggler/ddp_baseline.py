"""``ddp``: Lightning's own ``DDPStrategy`` over torch.distributed (Gloo on CPU), the baseline users would pick.

Not a Horovod strategy: it is Lightning's ``DDPStrategy`` with only what the main job needs to compare it
fairly with the others, and nothing that changes how DDP trains:

* launch: under ``torchrun`` (one process per worker, any number of nodes) it attaches the way
  Lightning's DDP does (``TorchElasticEnvironment``; Gloo on the interface ``GLOO_SOCKET_IFNAME`` names, or
  Gloo's own choice); otherwise ``ddp_spawn``-style (Lightning's multiprocessing launcher) from the plain python process,
  started as the project's own launcher starts its workers (Python's fork server where it exists, else
  ``spawn``; the training is the same, see README Launching for what else differs). Lightning's ``popen`` (subprocess-script)
  launcher re-runs the command line once per rank, which neither ``train(cfg)`` from code (tests,
  benchmarks) nor a Hydra multirun survive. Threads per worker: Lightning's launcher sets
  ``cores // workers`` (``OMP_NUM_THREADS`` unless set), as ours does. Gloo binds to loopback.
* the same straggler injection and emulated device time: a DDP communication hook (registered on CPU
  too; Lightning registers hooks on CUDA only) runs the :class:`StragglerInjector`'s delay when the
  step's first gradient bucket is ready, i.e. after backward's compute and before the gradient
  all-reduce starts, the place the injector sleeps in for the Horovod strategies.
* the same per-rank step records for :class:`WorkerProfiler`: ``compute_s`` is batch start until the first
  gradient bucket is ready (injected delay included); ``comm_s`` is from there until the optimizer step
  is done (the all-reduce, waiting for slower ranks, and with several buckets whatever backward compute
  DDP overlaps with it). With one bucket (the models here are far under DDP's 1 MB first bucket) there is
  no overlap and the split means what it means for ``ring``; with more, compute is under- and comm
  over-counted by the overlapped part (``summary.json``: ``profiling``).
* ``model_averaging_period`` > 0: post-local SGD (PyTorch's ``PostLocalSGDState`` and
  ``post_localSGD_hook``, Lightning's ``model_averaging_period``): gradients all-reduced for
  ``warmup_steps`` steps, then every worker steps on its own gradients and the parameters are averaged
  every ``model_averaging_period`` steps.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch.optim import Optimizer

from lightning_straggler.config import NONFINITE_POLICIES, DDPConfig, TrainerConfig, check_stall_timeout
from lightning_straggler.launcher import (WORKER_START_METHOD, ResultsThroughFile, enter_worker, prepare_worker_start,
                                          private_module_copies, start_workers)
from lightning_straggler.profiling import StepRecorder



class TorchCollectives:
    """The part of :class:`lightning_straggler.comm.Collectives` the callbacks use, over torch.distributed."""

    @property
    def initialized(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.initialized else 0

    @property
    def size(self) -> int:
        return dist.get_world_size() if self.initialized else 1

    def allgather(self, tensor: torch.Tensor, tag: Optional[str] = None) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 in rank order (first dims may differ)."""
        if not self.initialized or self.size == 1:
            return tensor
        n = torch.tensor([tensor.shape[0]], dtype=torch.int64)
        sizes = [torch.zeros_like(n) for _ in range(self.size)]
        dist.all_gather(sizes, n)
        sizes_ = [int(s) for s in sizes]
        longest = max(sizes_)
        padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype)
        padded[: tensor.shape[0]] = tensor
        parts = [torch.zeros_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded)
        return torch.cat([p[:k] for p, k in zip(parts, sizes_)])


def end_process_group() -> None:
    """Destroy this worker's torch.distributed group, if any. Lightning does so at exit only for NCCL; a
    Gloo group left to interpreter finalization can end a finished worker with SIGABRT now and then (its
    C++ worker threads still hold tensors whose release needs the GIL; pytorch/pytorch#179291). Local to
    the rank for Gloo (not a collective)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class _DDPLauncher(ResultsThroughFile, _MultiProcessingLauncher):
    """Lightning's spawn launcher; also hands rank 0's run report back (through a file, as ours does: the
    pipe Lightning uses blocks on payloads over 64 KiB), binds Gloo to loopback, and ends the job with a
    :class:`WorkerFailure` naming the rank when a worker fails or ``trainer.job_timeout_s`` runs out."""

    def launch(self, function: Callable, *args: Any, trainer=None, **kwargs: Any) -> Any:
        import torch.multiprocessing as mp
        from lightning.pytorch.strategies.launchers.multiprocessing import _check_missing_main_guard, _GlobalStateSnapshot
        from lightning.pytorch.trainer.states import TrainerFn

        from lightning_straggler.launcher import WorkerFailure

        _check_missing_main_guard()
        os.environ["MASTER_PORT"] = str(self._strategy.cluster_environment.main_port)
        self._launch_env = prepare_worker_start(self._start_method)
        context = mp.get_context(self._start_method)
        return_queue = context.SimpleQueue()
        process_args = [trainer, function, args, kwargs, return_queue, _GlobalStateSnapshot.capture()]
        procs = start_workers(self, process_args)
        self.procs = procs.processes
        limit = float(getattr(self._strategy, "job_timeout_s", 0.0) or 0.0)
        deadline = getattr(self._strategy, "job_deadline", None) or (time.monotonic() + limit)
        try:
            while not procs.join(timeout=1.0):
                if limit > 0 and time.monotonic() > deadline:
                    for p in procs.processes:
                        if p.is_alive():
                            p.kill()
                    raise WorkerFailure(f"the job ran over trainer.job_timeout_s={limit:g} s; all "
                                        f"{len(procs.processes)} workers were stopped", "timeout", None, "job timeout", [])
        except mp.ProcessRaisedException as e:
            raise WorkerFailure(f"worker rank {e.error_index} (of {len(procs.processes)}) raised; the other workers "
                                f"were stopped\n-- rank {e.error_index} traceback:\n{e}", "raised", e.error_index,
                                "raised", [e.error_index]) from None
        except mp.ProcessExitedException as e:
            raise WorkerFailure(f"worker rank {e.error_index} (of {len(procs.processes)}) exited with code "
                                f"{e.exit_code}; the other workers were stopped", "died", e.error_index,
                                f"exited with code {e.exit_code}", [e.error_index]) from None
        worker_output = return_queue.get()
        if trainer is None:
            return worker_output
        self._already_fit |= trainer.state.fn == TrainerFn.FITTING
        self._recover_results_in_main_process(worker_output, trainer)
        return worker_output.trainer_results

    def _wrapping_function(self, process_idx: int, trainer, function: Callable, args: Any, kwargs: Any,
                           *rest: Any) -> None:
        enter_worker(self._launch_env)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback only
        args, kwargs = private_module_copies(self._start_method, self._strategy, args, kwargs)
        super()._wrapping_function(process_idx, trainer, function, args, kwargs, *rest)
        end_process_group()


class DDPBaselineStrategy(DDPStrategy):
    """Lightning's DDP (spawned, Gloo on CPU) with the recorder, run report and straggler hook of the main job."""

    strategy_name = "ddp"

    def __init__(self, stall_timeout_s: float = TrainerConfig.stall_timeout_s, nonfinite: str = TrainerConfig.nonfinite,
                 model_averaging_period: int = DDPConfig.model_averaging_period,
                 warmup_steps: int = DDPConfig.warmup_steps, **kwargs: Any) -> None:
        check_stall_timeout(stall_timeout_s)
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE_POLICIES)} (got {nonfinite!r})")
        if model_averaging_period < 0 or warmup_steps < 0:
            raise ValueError("model_averaging_period and warmup_steps must be >= 0")
        self.averaging_period = int(model_averaging_period)
        self.warmup_steps = int(warmup_steps)
        # a collective that some ranks never join fails after this long (torch.distributed's own time-out)
        super().__init__(start_method=WORKER_START_METHOD, timeout=timedelta(seconds=stall_timeout_s),
                         model_averaging_period=self.averaging_period or None, **kwargs)
        self.stall_timeout_s = float(stall_timeout_s)
        self.nonfinite = nonfinite
        self.nonfinite_skips = 0
        self.comm = TorchCollectives()
        self.recorder = StepRecorder()
        self.events: List[Dict[str, Any]] = []
        self.run_report: Dict[str, Any] = {}
        self.steps_done = 0
        self.buckets_per_step = 0  # gradient buckets DDP reduced in the last step
        self._pre_sync: List[Callable[[], None]] = []
        self._bucket_seen = False
        self.attached = False  # started by torchrun: this process is one worker (set in _configure_launcher)

    # --- launch and set-up ----------------------------------------------------------------------
    def _configure_launcher(self) -> None:
        from lightning.fabric.plugins.environments import TorchElasticEnvironment

        # torchrun only (Lightning picks TorchElasticEnvironment for it): elsewhere, SLURM included, the
        # baseline spawns its workers as before. Decided here, in the launching process.
        self.attached = isinstance(self.cluster_environment, TorchElasticEnvironment)
        self._launcher = None if self.attached else _DDPLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        super().setup_environment()  # init_process_group (Gloo on CPU)
        self.recorder = StepRecorder(rank=self.global_rank)

    def register_pre_sync(self, fn: Callable[[], None]) -> None:
        """``fn()`` runs once per step when the first gradient bucket is ready, before any all-reduce."""
        self._pre_sync.append(fn)

    def configure_ddp(self) -> None:
        if self.averaging_period:
            import torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook as post_localSGD

            # one-rank subgroups: after the warm-up every worker steps alone (PyTorch's default subgroup is
            # per machine by CUDA device count, which on CPU is none)
            own, _ = dist.new_subgroups(group_size=1)
            self._ddp_comm_state = post_localSGD.PostLocalSGDState(process_group=None, subgroup=own,
                                                                   start_localSGD_iter=self.warmup_steps)
            self._ddp_comm_hook = post_localSGD.post_localSGD_hook
        super().configure_ddp()

    def _register_ddp_hooks(self) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        inner = self._ddp_comm_hook or default_hooks.allreduce_hook
        state = self._ddp_comm_state

        def hook(hook_state, bucket):
            self.buckets_per_step += 1
            if not self._bucket_seen:
                self._bucket_seen = True
                for fn in self._pre_sync:
                    fn()
                self.recorder.mark_compute_end()
            return inner(hook_state, bucket)

        self.model.register_comm_hook(state, hook)

    # --- the step -------------------------------------------------------------------------------
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        from lightning_straggler.profiling import batch_size_of

        self.recorder.begin_batch(batch_size_of(batch))
        self._bucket_seen = False
        self.buckets_per_step = 0
        super().on_train_batch_start(batch, batch_idx)

    def profile_clock(self) -> int:
        return self.steps_done

    def profile_gather_due(self, last_gather_step: int, every: int) -> bool:
        return self.steps_done - last_gather_step >= every  # DDP ranks move in lock-step

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        def timed_closure() -> Any:
            result = closure()  # forward + backward; DDP's all-reduce runs inside backward
            if not self._bucket_seen:  # no bucket reduced (e.g. no_sync): all of it was compute
                self.recorder.mark_compute_end()
            self._check_finite(optimizer, result)
            return result

        output = super().optimizer_step(optimizer, timed_closure, model, **kwargs)  # + model averaging
        end = time.perf_counter()
        compute_end = self.recorder._compute_end  # set in the hook (or after the closure)
        self.recorder.add_comm(max(0.0, end - compute_end) if compute_end is not None else 0.0)
        self.recorder.end_step(self.steps_done, group_leader=0)
        self.steps_done += 1
        return output

    def _check_finite(self, optimizer: Optimizer, loss: Any) -> None:
        """Gradients are already averaged over all ranks here, so every rank sees the same verdict; the
        rank that produced a non-finite value cannot be told apart any more."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not grads or bool(torch.isfinite(torch.stack([g.detach().sum() for g in grads])).all()):
            return
        if self.nonfinite == "skip":
            for g in optimizer.param_groups:
                for p in g["params"]:
                    p.grad = None
            self.nonfinite_skips += 1
            self.events.append({"kind": "nonfinite_skipped", "step": self.steps_done})
            return
        from lightning_straggler.strategies.horovod_base import NonFiniteError

        raise NonFiniteError(f"non-finite gradients at step {self.steps_done} (ddp: averaged over all ranks before "
                             "this check, so the rank is not known); training stopped before the update reached "
                             "the model. Set trainer.nonfinite=skip to skip such steps")

    def teardown(self) -> None:
        if self.global_rank == 0:
            self.run_report["events"] = list(self.events)
            self.run_report.setdefault("profiling", {
                "launch": ("torchrun (attached: Lightning's TorchElasticEnvironment), Gloo on CPU" if self.attached
                           else f"{self._start_method} (Lightning's multiprocessing launcher), Gloo on CPU"),
                "model_averaging_period": self.averaging_period, "warmup_steps": self.warmup_steps,
                "gradient_buckets_per_step": self.buckets_per_step,
                "profiling": ("compute_s: batch start until DDP's first gradient bucket is ready (injected delay "
                              "included); comm_s / wait_s: from there until the optimizer step is done (all-reduce, "
                              "waiting for slower ranks, model averaging" +
                              (", and the backward compute DDP overlaps with the all-reduce of earlier buckets)"
                               if self.buckets_per_step > 1 else "; one bucket per step, so no backward overlaps it)")),
            })
        super().teardown()
        if self.attached:  # (spawned workers end theirs in _DDPLauncher._wrapping_function)
            end_process_group()

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state["recorder"] = StepRecorder()
        state["_pre_sync"] = []
        return state
