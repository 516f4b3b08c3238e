"""torchmetrics over Horovod.

torchmetrics synchronises a metric's states in ``compute()`` only when its ``distributed_available_fn``
says so (by default: torch.distributed is initialised, which Horovod never does), through its
``dist_sync_fn`` (by default torch.distributed's all-gather). Every :class:`HorovodStrategy` points
both at its own named collectives when it sets up, before every training, validation and test run and
after the first step of each (:func:`attach_horovod_sync`), so metrics in a ``LightningModule``
synchronise with no change to user code.

* :class:`HorovodGather` (``dist_sync_fn``) gathers one state tensor from every rank of the group
  through the strategy's :class:`~lightning_straggler.comm.Collectives` (tags ``metric_header`` and
  ``metric_state``): first every rank's dtype and shape, then the flattened data, so ranks may hold
  different numbers of elements (cat-state metrics such as AUROC), even a different number of
  dimensions (torchmetrics' empty placeholder of a rank that saw no data).
* :class:`HorovodAvailable` (``distributed_available_fn``) answers what the strategy's
  :meth:`~lightning_straggler.strategies.horovod_base.HorovodStrategy.metric_sync_allowed` says: Horovod
  is running with more than one rank and, while training, the ranks run their steps in lock-step
  (``dpar`` and ``awar`` do not: their metrics stay local while training, synchronised at validation
  and test).

Metrics given their own ``dist_sync_fn`` or ``distributed_available_fn`` are left alone, and so is
``sync_on_compute=False`` (torchmetrics then never asks). ``process_group`` may be a list of ranks or a
Horovod ``ProcessSet`` (one the strategy has registered).

``horovod_sync_kwargs()`` is for metrics used outside such a strategy (e.g. a plain Horovod script):
``Accuracy(task="multiclass", num_classes=10, **horovod_sync_kwargs())``.
"""
from __future__ import annotations

import logging
import sys
import weakref
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor

log = logging.getLogger(__name__)

# dtype codes sent in the header (Horovod needs the same dtype on every rank to gather)
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
           torch.int16, torch.int32, torch.int64, torch.bool)
# sent as a dtype Horovod's Gloo path handles, exactly
_CARRIERS = {torch.bool: torch.uint8, torch.bfloat16: torch.float32}

_default: Dict[str, Any] = {}


def _default_comm():
    """Collectives over Horovod's world for metrics without a strategy (``horovod_sync_kwargs``)."""
    from lightning_straggler.comm import HorovodCollectives

    if "comm" not in _default:
        _default["comm"] = HorovodCollectives()
    comm = _default["comm"]
    if not _default.get("ready") and comm.initialized:
        comm.init(dynamic_groups=False)  # Horovod is already running: this registers its world
        _default["ready"] = True
    return comm


def _group_ranks(group: Any) -> Optional[List[int]]:
    if group is None or isinstance(group, (list, tuple)):
        return None if group is None else [int(r) for r in group]
    ranks = getattr(group, "ranks", None)  # a Horovod ProcessSet
    if ranks is not None:
        return list(ranks)
    raise TypeError(f"a metric's process_group must be None, a list of ranks or a Horovod ProcessSet under Horovod, "
                    f"not {type(group).__name__}")


class _StrategyHandle:
    """Holds the strategy weakly: metrics must not keep it (and its trainer) alive, copy or pickle it.
    A copied metric shares the handle; a pickled one falls back to Horovod's world (no strategy)."""

    def __init__(self, strategy: Any = None) -> None:
        self._strategy = weakref.ref(strategy) if strategy is not None else None

    @property
    def strategy(self) -> Any:
        return self._strategy() if self._strategy is not None else None

    def comm(self):
        strategy = self.strategy
        return strategy.comm if strategy is not None else _default_comm()

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_StrategyHandle":
        return self

    def __getstate__(self) -> Dict[str, Any]:
        return {"_strategy": None}


class HorovodGather(_StrategyHandle):
    """torchmetrics ``dist_sync_fn``: ``fn(tensor, group=None)`` -> one tensor per rank of the group, in
    rank order (this rank's own entry is the input itself, so autograd flows through it)."""

    def __call__(self, result: Tensor, group: Any = None) -> List[Tensor]:
        # Lightning validates and tests under torch.inference_mode; Horovod resizes an all-gather's
        # output in its own thread, outside it, which inference tensors refuse: gather normal tensors.
        with torch.inference_mode(False):
            return self._gather(result, group)

    def _gather(self, result: Tensor, group: Any) -> List[Tensor]:
        comm = self.comm()
        ranks = _group_ranks(group)
        members = sorted(set(ranks)) if ranks is not None else list(range(comm.size))
        if result.dtype not in _DTYPES:
            raise TypeError(f"metric states of dtype {result.dtype} cannot be gathered over Horovod")
        header = torch.tensor([_DTYPES.index(result.dtype), result.dim(), *result.shape], dtype=torch.int64)
        flat_headers = comm.allgather(header, group=ranks, tag="metric_header").tolist()
        dtypes, shapes, i = [], [], 0
        while i < len(flat_headers):  # rank after rank: [dtype code, ndim, *shape]
            ndim = int(flat_headers[i + 1])
            dtypes.append(_DTYPES[int(flat_headers[i])])
            shapes.append(tuple(int(d) for d in flat_headers[i + 2:i + 2 + ndim]))
            i += 2 + ndim
        numels = [int(torch.Size(s).numel()) for s in shapes]
        # One dtype for the data: that of the ranks holding data (an empty placeholder's may differ).
        common = None
        for dtype, n in zip(dtypes, numels):
            if n or not any(numels):
                common = dtype if common is None else torch.promote_types(common, dtype)
        carrier = _CARRIERS.get(common, common)
        flat = result.detach().reshape(-1).to(common).to(carrier).clone()
        data = comm.allgather(flat, group=ranks, tag="metric_state")
        out, offset = [], 0
        for shape, n in zip(shapes, numels):
            out.append(data[offset:offset + n].to(common).reshape(shape))
            offset += n
        me = members.index(comm.rank)
        if result.dtype == common:
            out[me] = result
        return out


class HorovodAvailable(_StrategyHandle):
    """torchmetrics ``distributed_available_fn``: whether to synchronise now (same answer on every rank)."""

    def __call__(self) -> bool:
        strategy = self.strategy
        if strategy is not None:
            return bool(strategy.metric_sync_allowed())
        comm = _default_comm()
        return comm.initialized and comm.size > 1


def _is_ours(fn: Any) -> bool:
    return isinstance(fn, (HorovodGather, HorovodAvailable)) or fn in (_gather_all, _available)


def attach_horovod_sync(module: torch.nn.Module, strategy: Any) -> int:
    """Point every torchmetrics ``Metric`` under ``module`` at ``strategy``'s collectives (idempotent).
    Returns the number of metrics that synchronise through the strategy."""
    try:
        from torchmetrics import Metric
        from torchmetrics.metric import jit_distributed_available
    except ImportError:
        return 0
    attached = 0
    for name, metric in module.named_modules():
        if not isinstance(metric, Metric):
            continue
        sync_fn, available_fn = metric.dist_sync_fn, metric.distributed_available_fn
        if (sync_fn is not None and not _is_ours(sync_fn)) or (
                available_fn not in (None, jit_distributed_available) and not _is_ours(available_fn)):
            if not getattr(metric, "_ls_left_alone", False):
                metric._ls_left_alone = True
                log.info("metric %s has its own dist_sync_fn / distributed_available_fn: left as it is",
                         name or type(metric).__name__)
            continue
        if not (isinstance(sync_fn, HorovodGather) and sync_fn.strategy is strategy):
            metric.dist_sync_fn = HorovodGather(strategy)
        if not (isinstance(available_fn, HorovodAvailable) and available_fn.strategy is strategy):
            metric.distributed_available_fn = HorovodAvailable(strategy)
        attached += 1
    return attached


def _horovod_running() -> bool:
    if "horovod.torch" not in sys.modules:
        return False  # never imported in this process (e.g. a ddp worker): it cannot be running
    try:
        comm = _default_comm()
        return comm.initialized and comm.size > 1
    except Exception:  # noqa: BLE001  (a Horovod build without its torch extension)
        return False


# Without Horovod (e.g. the same LightningModule under Lightning's own ``ddp``) these fall back to
# torchmetrics' defaults over torch.distributed: a metric built with horovod_sync_kwargs() still syncs.
def _gather_all(tensor: Tensor, group: Any = None) -> List[Tensor]:
    if _horovod_running():
        return HorovodGather()(tensor, group=group)
    from torchmetrics.utilities.distributed import gather_all_tensors

    return gather_all_tensors(tensor, group=group)


def _available() -> bool:
    if _horovod_running():
        return HorovodAvailable()()
    from torchmetrics.metric import jit_distributed_available

    return bool(jit_distributed_available())


def horovod_sync_kwargs() -> Dict[str, Any]:
    """Keyword arguments that make a torchmetrics metric synchronise over Horovod's world without a
    strategy (and over torch.distributed, as torchmetrics does by default, where Horovod is not running).
    Inside a Trainer with one of this project's strategies nothing needs to be passed."""
    return {"dist_sync_fn": _gather_all, "distributed_available_fn": _available}


__all__ = ["HorovodAvailable", "HorovodGather", "attach_horovod_sync", "horovod_sync_kwargs"]
