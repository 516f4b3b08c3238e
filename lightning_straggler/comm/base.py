"""The collective interface the strategies are written against."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional, Sequence, Tuple

import torch

# A group is the sorted tuple of the global ranks taking part; ``None`` means every rank.
Group = Optional[Tuple[int, ...]]


def normalize_group(ranks: Optional[Sequence[int]], world_size: int) -> Tuple[int, ...]:
    """Sorted, de-duplicated rank tuple; ``None`` is the whole world. Rejects ranks outside the world."""
    if ranks is None:
        return tuple(range(world_size))
    group = tuple(sorted({int(r) for r in ranks}))
    if not group:
        raise ValueError("a communication group needs at least one rank")
    if group[0] < 0 or group[-1] >= world_size:
        raise ValueError(f"group {group} has ranks outside 0..{world_size - 1}")
    return group


class Collectives(ABC):
    """Blocking and asynchronous collectives over the world or a group of ranks.

    Every call carries a ``tag``; the implementation turns it into a name that is identical on every
    member of the group (tag, group and a per-(tag, group) sequence number), so members that do
    different amounts of other traffic still match their collectives.
    """

    @abstractmethod
    def init(self, dynamic_groups: bool = True, static_groups: Sequence[Sequence[int]] = ()) -> None:
        """Join the job; ``dynamic_groups=False`` when only whole-world collectives and the
        ``static_groups`` registered here will be used."""

    @property
    @abstractmethod
    def initialized(self) -> bool: ...

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def local_rank(self) -> int: ...

    @property
    @abstractmethod
    def size(self) -> int: ...

    @abstractmethod
    def allreduce(self, tensor: torch.Tensor, op: str = "mean", group: Group = None, tag: str = "allreduce") -> torch.Tensor: ...

    @abstractmethod
    def allreduce_grouped_(self, tensors: Sequence[torch.Tensor], op: str = "mean", group: Group = None, tag: str = "grads") -> None:
        """In-place all-reduce of several tensors as one fused operation."""

    @abstractmethod
    def allgather(self, tensor: torch.Tensor, group: Group = None, tag: str = "allgather") -> torch.Tensor:
        """Concatenate along dim 0 (first dimensions may differ between ranks)."""

    @abstractmethod
    def broadcast_(self, tensor: torch.Tensor, root: int, group: Group = None, tag: str = "broadcast") -> torch.Tensor: ...

    @abstractmethod
    def broadcast_object(self, obj: Any, root: int = 0, group: Group = None, tag: str = "object") -> Any: ...

    @abstractmethod
    def broadcast_async(self, tensor: torch.Tensor, root: int, group: Group = None, tag: str = "signal") -> Any:
        """Post an in-place broadcast; returns a handle for :meth:`poll` / :meth:`wait`."""

    @abstractmethod
    def poll(self, handle: Any) -> bool: ...

    @abstractmethod
    def wait(self, handle: Any) -> torch.Tensor: ...

    @abstractmethod
    def barrier(self, group: Group = None) -> None: ...

    @abstractmethod
    def ensure_groups(self, groups: Sequence[Sequence[int]]) -> None:
        """Create the process sets for ``groups`` that do not exist yet.

        A collective over ALL ranks: every rank must call it with the same list at the same point.
        """

    @abstractmethod
    def shutdown(self) -> None: ...
