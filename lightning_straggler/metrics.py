"""torchmetrics over Horovod: torchmetrics syncs through torch.distributed, which Horovod does not
initialise. ``horovod_sync_kwargs()`` gives a metric Horovod's all-gather instead, e.g.
``Accuracy(task="multiclass", num_classes=10, **horovod_sync_kwargs())``."""
from __future__ import annotations

import itertools
from typing import Any, Dict, List

import torch

_counter = itertools.count()


def _available() -> bool:
    try:
        import horovod.torch as hvd
    except ImportError:
        return False
    return hvd.is_initialized() and hvd.size() > 1


def _gather_all(tensor: torch.Tensor, group: Any = None) -> List[torch.Tensor]:
    import horovod.torch as hvd

    # Named explicitly: automatic Horovod names drift apart once ranks run different group traffic.
    # Every rank computes its metrics the same number of times, so this counter agrees.
    name = f"metric.{next(_counter)}"
    tensor = tensor.contiguous()
    shapes = hvd.allgather(torch.tensor([list(tensor.shape) or [1]], dtype=torch.int64), name=name + ".shape")
    flat = hvd.allgather(tensor.reshape(-1), name=name + ".data")
    out, offset = [], 0
    for shape in shapes.tolist():
        n = int(torch.tensor(shape).prod()) if tensor.dim() else 1
        out.append(flat[offset:offset + n].reshape(tensor.shape if tensor.dim() == 0 else shape))
        offset += n
    return out


def horovod_sync_kwargs() -> Dict[str, Any]:
    return {"dist_sync_fn": _gather_all, "distributed_available_fn": _available}
