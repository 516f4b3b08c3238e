"""The collective interface the strategies are written against."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch

# A group is the sorted tuple of the global ranks taking part; ``None`` means every rank.
Group = Optional[Tuple[int, ...]]


def flat_per_dtype(tensors: Sequence[torch.Tensor]) -> Iterator[Tuple[List[torch.Tensor], torch.Tensor]]:
    """For each dtype among ``tensors`` (usually one): those tensors and their values in one flat tensor."""
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        same = [t for t in tensors if t.dtype == dtype]
        yield same, torch.cat([t.detach().reshape(-1) for t in same])


def unflatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` (the inverse of one flat_per_dtype item)."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


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

    #: whether the strategy must start worker processes for it (False: every rank already runs, e.g. the
    #: in-process world of comm/fake.py, where each rank is a thread)
    needs_launcher = True

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

    # --- a group without process sets: the other ranks have joined ----------------------------------
    # A rank that has joined takes part in every all-reduce the others run with zeros, until every rank
    # has joined; so ranks that have not joined all-reduce among themselves over the world's ring, with
    # no process set to create and no collective of their own (Horovod's ``join``).

    def join_is_fixed(self) -> bool:
        """Whether several ranks may be joined at once (Horovod built with this project's join patch);
        else more than one joined rank above 4 ranks corrupts memory (``policies.group_floor``)."""
        return False

    def join(self) -> int:
        """Join and block until every rank has joined; returns the rank that joined last (same everywhere)."""
        raise NotImplementedError(f"{type(self).__name__} has no join(): dpar and awar need it")

    def join_async(self) -> Any:
        """Join without waiting, so this rank's main thread keeps computing; a handle for
        :meth:`join_done` / :meth:`join_wait`. The rank must run no collective of its own until then."""
        raise NotImplementedError(f"{type(self).__name__} has no join(): dpar and awar need it")

    def join_done(self, handle: Any) -> bool:
        raise NotImplementedError

    def join_wait(self, handle: Any) -> int:
        raise NotImplementedError

    def allreduce_among_(self, tensors: Sequence[torch.Tensor], members: Sequence[int], op: str = "mean",
                         tag: str = "grads") -> None:
        """In-place all-reduce of ``tensors`` over ``members`` while every other rank has joined (or will
        join): a sum over the world (the others add zeros), divided by the members' count for a mean.
        With every rank a member it is exactly :meth:`allreduce_grouped_` over the world."""
        if len(members) == self.size:
            self.allreduce_grouped_(tensors, op=op, tag=tag)
            return
        if op not in ("mean", "avg", "sum"):
            raise ValueError(f"reduce op {op!r} over a group of joined ranks: use mean or sum")
        self.allreduce_grouped_(tensors, op="sum", tag=f"{tag}.among")
        if op != "sum":
            for t in tensors:
                t.div_(len(members))

    def allgather_among(self, tensor: torch.Tensor, members: Sequence[int], tag: str = "allgather") -> torch.Tensor:
        """Each member's ``tensor`` stacked in member order (shape (len(members), *tensor.shape)) while every
        other rank has joined: every rank fills its own slot of a world-sized zero tensor and they are
        summed (an all-gather is not possible with joined ranks; a sum is)."""
        slots = tensor.new_zeros((self.size, *tensor.shape))
        slots[self.rank] = tensor
        total = self.allreduce(slots, op="sum", tag=f"{tag}.among")
        return total[list(members)]

    # --- groups of one partition at once, without process sets (dssync) ------------------------------
    def alltoall(self, tensor: torch.Tensor, splits: Sequence[int], tag: str = "alltoall") -> Tuple[torch.Tensor, list]:
        """World all-to-all along dim 0: ``splits[r]`` rows of ``tensor`` (in rank order) go to rank r. Returns
        the rows received, in the senders' rank order, and how many came from each rank."""
        raise NotImplementedError(f"{type(self).__name__} has no all-to-all: dssync's group exchange needs it")

    def allreduce_in_partition_(self, tensors: Sequence[torch.Tensor], group: Sequence[int], op: str = "mean",
                                tag: str = "partition", find_nonfinite: bool = False) -> List[int]:
        """In-place mean (or sum) of ``tensors`` over ``group``, where every rank calls this at the same point
        with its own group of one partition of the world (disjoint groups covering every rank; a group of one
        rank keeps its tensors). One world all-to-all in which a rank sends its tensors to the other members
        of its group only: (g - 1) x their bytes per rank, as a ring all-reduce within a pair, and no process
        set (Horovod coordinates every process set a rank belongs to on every cycle, on one thread, so
        concurrent pairs on process sets can wait for each other; dssync's ``exchange="aligned"`` avoids
        that with the sets, and measured faster than this all-to-all: README, "Over shaped links").
        Members add in rank order: every member of
        a group ends with the same bits. With ``find_nonfinite``, returns the members whose tensors held a
        non-finite value when the result does (every member has every member's part: no collective to find
        them); else, and when the result is finite, []. Horovod counts the parts in int32: at most 2^31 - 1
        elements per dtype."""
        members = normalize_group(group, self.size)
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} averages within group {members}, which it is not in")
        if op not in ("mean", "avg", "sum"):
            raise ValueError(f"reduce op {op!r} within a partition's groups: use mean or sum")
        nonfinite: set = set()
        for same, flat in flat_per_dtype(tensors):  # one exchange per dtype (usually one)
            n = flat.numel()
            others = [r for r in members if r != self.rank]
            splits = [n if r in others else 0 for r in range(self.size)]
            # the input is cut into consecutive slices, one per destination: a copy of flat for each other member
            send = flat if len(others) <= 1 else flat.repeat(len(others))
            received, counts = self.alltoall(send, splits, tag=f"{tag}.{str(flat.dtype).replace('torch.', '')}")
            senders = [r for r, c in enumerate(counts) if c]
            if senders != others or any(counts[r] != n for r in senders):
                raise RuntimeError(f"rank {self.rank}: group {members} got {n}-element parts from ranks "
                                   f"{[(r, counts[r]) for r in senders]}: the ranks disagree on the partition")
            parts = dict(zip(others, received.split(n))) if others else {}
            parts[self.rank] = flat
            total = None
            for r in members:
                total = parts[r].clone() if total is None else total.add_(parts[r])
            if find_nonfinite and total.is_floating_point() and not bool(torch.isfinite(total).all()):
                nonfinite.update(r for r in members if not bool(torch.isfinite(parts[r]).all()))
            if op != "sum":
                total.div_(len(members))
            unflatten_into(same, total)
        return sorted(nonfinite)

    # --- groups on connections of their own (dssync exchange="direct") -------------------------------
    def ensure_direct_groups(self, groups: Sequence[Sequence[int]], timeout_s: float = 600.0) -> None:
        """Create a group with connections of its own for each of ``groups`` that has none yet. A collective
        over ALL ranks (the same list, at the same point on every rank), as :meth:`ensure_groups`. An operation
        on them raises after waiting ``timeout_s`` for a peer."""
        raise NotImplementedError(f"{type(self).__name__} has no direct groups: dssync's exchange=direct needs them")

    def allreduce_direct_(self, tensors: Sequence[torch.Tensor], group: Sequence[int], op: str = "mean",
                          tag: str = "direct") -> None:
        """In-place mean (or sum) of ``tensors`` over ``group`` (created by :meth:`ensure_direct_groups`) on
        the group's own connections: only its members take part, and no other group's operation can delay
        it (over Horovod, process-set operations share one coordination thread per rank; README, "Over
        shaped links")."""
        raise NotImplementedError(f"{type(self).__name__} has no direct groups: dssync's exchange=direct needs them")

    # --- asynchronous all-reduce: adaptive's step deadline hands a step in from a helper thread --------
    last_collective_end: float = 0.0  # time.monotonic() when this rank's last blocking collective ended

    def allreduce_grouped_async_(self, tensors: Sequence[torch.Tensor], op: str = "sum", tag: str = "grads") -> Any:
        """Start an in-place world all-reduce of ``tensors`` (one fused operation, the same name as
        :meth:`allreduce_grouped_` with ``tag``); a handle for :meth:`done` / :meth:`finish`. Safe to call from
        a thread other than the main one."""
        raise NotImplementedError(f"{type(self).__name__} has no asynchronous all-reduce: adaptive's deadline needs it")

    def done(self, handle: Any) -> bool:
        raise NotImplementedError

    def finish(self, handle: Any, tag: str = "grads", watched: bool = True) -> None:
        """Wait for an operation from :meth:`allreduce_grouped_async_` (its result is in its tensors);
        ``watched``: from the rank's main thread (the stall watchdog sees the wait, and its end sets
        :attr:`last_collective_end`)."""
        raise NotImplementedError

    @abstractmethod
    def barrier(self, group: Group = None) -> None: ...

    def align(self, tag: str = "align") -> None:
        """Return once every rank has called this: a one-value world all-reduce. Over Horovod every rank
        learns of its completion in the same coordination cycle, so what each rank enqueues right after it
        is normally coordinated in one cycle too (not guaranteed: a rank whose thread wakes late enqueues a
        cycle later): process-set operations enqueued so start together instead of one
        waiting, in the world's coordination round, for another set's transfer to finish (dssync
        ``exchange="aligned"``; README, "Over shaped links")."""
        self.allreduce(torch.zeros(1), op="sum", tag=tag)

    @abstractmethod
    def ensure_groups(self, groups: Sequence[Sequence[int]]) -> None:
        """Create the process sets for ``groups`` that do not exist yet.

        A collective over ALL ranks: every rank must call it with the same list at the same point.
        """

    @abstractmethod
    def shutdown(self) -> None: ...
