"""An in-process world of ranks for tests: :class:`FakeWorld` runs one thread per rank, each speaking to
its own :class:`FakeCollectives`, with Horovod's matching rules and without Horovod or processes.

What it keeps of Horovod (so a protocol that works here has the properties it needs there):
  * collectives match by name, the tag and the group, as :class:`~lightning_straggler.comm.HorovodCollectives`
    names them: a rank's call joins the pending operation of that name it has not yet contributed to
    (Horovod matches names, not counts); a rank that calls a different collective, or calls one more
    often, waits forever, and the world reports it (a deadlock);
  * ``join``: a joined rank adds zeros to every world all-reduce the others run until every rank has
    joined; ``join`` returns the rank that joined last, the same on every rank; an all-gather or
    broadcast while a rank is joined is refused (Horovod cannot do it either);
  * results are computed once, in rank order, and copied to every member (deterministic sums).
What it does not model: time, bandwidth, process sets' creation cost, failures of a process.

Deadlock detection is exact, not a timeout: when every rank that has not finished waits in a
collective that cannot complete (its other members wait elsewhere or have finished), :meth:`FakeWorld.run`
raises :class:`FakeDeadlock` naming what each rank waits in. A wall-clock ``timeout_s`` is the backstop
for a rank stuck outside the collectives.
"""
from __future__ import annotations

import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from lightning_straggler.comm.base import Collectives, Group, normalize_group

__all__ = ["FakeDeadlock", "FakeWorld", "FakeCollectives"]

_REDUCE = {"sum": lambda ts: torch.stack(ts).sum(0), "mean": lambda ts: torch.stack(ts).mean(0),
           "avg": lambda ts: torch.stack(ts).mean(0), "min": lambda ts: torch.stack(ts).min(0).values,
           "max": lambda ts: torch.stack(ts).max(0).values}


class FakeDeadlock(RuntimeError):
    """Every unfinished rank waits in a collective that cannot complete."""


@dataclass
class _Op:
    kind: str
    members: Tuple[int, ...]
    payload: Dict[int, Any] = field(default_factory=dict)
    result: Any = None
    done: bool = False


class FakeWorld:
    """``size`` ranks in one process. ``run(fn)`` calls ``fn(comm)`` on one thread per rank and returns
    the ranks' return values in rank order (an exception on any rank is re-raised, naming the rank)."""

    def __init__(self, size: int, timeout_s: float = 60.0) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an integer >= 1 (got {size!r})")
        self.size, self.timeout_s = size, timeout_s
        self._cv = threading.Condition()
        self._ops: Dict[str, List[_Op]] = {}  # name -> its operations in flight, oldest first
        self._waiting: Dict[int, str] = {}  # rank -> name of the collective it blocks in
        self._finished: set = set()
        self._joined: List[int] = []  # in join order; cleared when every rank has joined
        self._join_round = 0
        self._last_joined: Dict[int, int] = {}  # join round -> the rank that joined last
        self._deadlock: Optional[str] = None
        self.log: List[Tuple[int, str]] = []  # (rank, name) of every collective, in completion order per rank

    def collectives(self, rank: int) -> "FakeCollectives":
        return FakeCollectives(self, rank)

    def run(self, fn: Callable[["FakeCollectives"], Any]) -> List[Any]:
        results: List[Any] = [None] * self.size
        errors: Dict[int, BaseException] = {}

        def body(rank: int) -> None:
            try:
                results[rank] = fn(self.collectives(rank))
            except BaseException as e:  # noqa: BLE001  (re-raised in the caller, naming the rank)
                errors[rank] = e
            finally:
                with self._cv:
                    self._finished.add(rank)
                    self._waiting.pop(rank, None)
                    self._check_deadlock()
                    self._cv.notify_all()

        threads = [threading.Thread(target=body, args=(r,), name=f"fake-rank-{r}", daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            with self._cv:
                where = self._describe()
                self._deadlock = self._deadlock or f"timed out after {self.timeout_s:g} s: {where}"
                self._cv.notify_all()
            raise FakeDeadlock(f"fake world of {self.size}: {self._deadlock}")
        causes = {r: e for r, e in errors.items() if not isinstance(e, FakeDeadlock)}
        if causes:  # a rank's own error first: the others' deadlock is its consequence
            rank = min(causes)
            raise RuntimeError(f"rank {rank} of the fake world failed: {causes[rank]!r}") from causes[rank]
        if errors:
            raise next(iter(errors.values()))
        return results

    # --- the rendezvous (callers hold no lock) -------------------------------------------------------
    def _describe(self) -> str:
        parts = [f"rank {r} waits in '{n}'" for r, n in sorted(self._waiting.items())]
        parts += [f"rank {r} has finished" for r in sorted(self._finished)]
        running = [r for r in range(self.size) if r not in self._waiting and r not in self._finished]
        parts += [f"rank {r} is running its own code" for r in running]
        return "; ".join(parts)

    def _check_deadlock(self) -> None:
        """Under the lock: every unfinished rank waits and none of their collectives can complete."""
        unfinished = [r for r in range(self.size) if r not in self._finished]
        if not unfinished or any(r not in self._waiting for r in unfinished):
            return
        if any(self._can_complete(self._waiting[r], r) for r in unfinished):
            return
        self._deadlock = self._describe()

    def _active(self, op: _Op) -> Tuple[int, ...]:
        """Members that must deposit: for a world all-reduce, those that have not joined."""
        if (op.kind == "allreduce" and len(op.members) == self.size and self._joined
                and all(p[0] == "sum" for p in op.payload.values())):  # only world sums take joined ranks' zeros
            return tuple(r for r in op.members if r not in self._joined)
        return op.members

    def _can_complete(self, name: str, rank: int) -> bool:
        if name.startswith("join#"):
            return int(name[5:]) in self._last_joined
        op = next((o for o in self._ops.get(name, []) if rank in o.payload), None)
        return op is not None and (op.done or all(r in op.payload for r in self._active(op)))

    def _complete(self, op: _Op) -> None:
        if op.kind == "allreduce":
            reduce_op, first = next(iter(op.payload.values()))
            reduce_op = "sum" if reduce_op in ("mean", "avg") else reduce_op  # the mean: divided by the caller
            # member order, joined members' zeros included: the same sum on every rank
            per_member = [op.payload[r][1] if r in op.payload else [torch.zeros_like(t) for t in first]
                          for r in op.members]
            op.result = [_REDUCE[reduce_op]([m[i] for m in per_member]) for i in range(len(first))]
        elif op.kind == "allgather":
            op.result = torch.cat([op.payload[r] for r in op.members], dim=0)
        elif op.kind == "alltoall":  # every rank's parts; each rank picks what was sent to it (_collect's caller)
            op.result = dict(op.payload)
        elif op.kind == "broadcast":
            roots = {p[0] for p in op.payload.values()}
            if len(roots) != 1:
                raise RuntimeError(f"broadcast with different roots on different ranks: {sorted(roots)}")
            root = roots.pop()
            if root not in op.members:
                raise RuntimeError(f"broadcast root {root} is not a member of {op.members}")
            op.result = op.payload[root][1]
        op.done = True

    def _complete_if_ready(self, op: _Op) -> None:
        """Under the lock: compute ``op``'s result once every member that must deposit has."""
        if not op.done and all(r in op.payload for r in self._active(op)):
            self._complete(op)
            self._cv.notify_all()

    def _wait_or_raise(self) -> None:
        """Under the lock: raise FakeDeadlock if the world is deadlocked, else wait for a change."""
        self._check_deadlock()
        if self._deadlock:
            self._cv.notify_all()
            raise FakeDeadlock(f"fake world of {self.size}: {self._deadlock}")
        self._cv.wait(0.5)

    def _collective(self, rank: int, name: str, kind: str, members: Tuple[int, ...], payload: Any) -> Any:
        return self._collect(rank, name, self._deposit(rank, name, kind, members, payload))

    def _deposit(self, rank: int, name: str, kind: str, members: Tuple[int, ...], payload: Any) -> _Op:
        """This rank's part of the next operation named ``name`` it has not contributed to (it may
        complete at once); does not wait."""
        with self._cv:
            if self._deadlock:
                raise FakeDeadlock(f"fake world of {self.size}: {self._deadlock}")
            if rank in self._joined:
                raise RuntimeError(f"rank {rank} calls '{name}' while it is joined (it must wait for the join first)")
            if kind == "allreduce" and self._joined and (len(members) < self.size or payload[0] != "sum"):
                # Horovod runs only world all-reduces with joined ranks; how it divides a mean then is not
                # modelled here, so only sums (allreduce_among_ and allgather_among use sums)
                raise RuntimeError(f"rank {rank}: {payload[0]} all-reduce '{name}' over {members} while ranks "
                                   f"{sorted(self._joined)} are joined: only world sums run then")
            if kind != "allreduce" and self._joined:
                raise RuntimeError(f"rank {rank}: {kind} '{name}' while ranks {sorted(self._joined)} are joined "
                                   "(only all-reduces run with joined ranks, as in Horovod)")
            queue = self._ops.setdefault(name, [])
            op = next((o for o in queue if not o.done and rank not in o.payload), None)
            if op is None:
                op = _Op(kind, members)
                queue.append(op)
            elif (op.kind, op.members) != (kind, members):
                raise RuntimeError(f"rank {rank}: '{name}' is a {kind} over {members} here but a {op.kind} over "
                                   f"{op.members} on another rank")
            if rank not in members:
                raise RuntimeError(f"rank {rank} calls '{name}' over {members} without being a member")
            op.payload[rank] = payload
            self._complete_if_ready(op)
            return op

    def _collect(self, rank: int, name: str, op: _Op) -> Any:
        """Wait until ``op`` (deposited by this rank) is complete; its result."""
        with self._cv:
            self._waiting[rank] = name
            while True:
                self._complete_if_ready(op)
                if op.done:
                    break
                self._wait_or_raise()
            self._waiting.pop(rank, None)
            self.log.append((rank, name))
            del op.payload[rank]
            queue = self._ops.get(name, [])
            if not op.payload and op in queue:  # every member has its result
                queue.remove(op)
                if not queue:
                    del self._ops[name]
            return op.result

    def _join(self, rank: int) -> int:
        with self._cv:
            if rank in self._joined:
                raise RuntimeError(f"rank {rank} joined twice")
            my_round = self._join_round
            self._joined.append(rank)
            if len(self._joined) == self.size:
                self._last_joined[my_round] = self._joined[-1]
                self._joined = []
                self._join_round += 1
            # a world all-reduce others wait in may complete now that this rank adds zeros
            for queue in self._ops.values():
                for op in queue:
                    self._complete_if_ready(op)
            self._cv.notify_all()
            self._waiting[rank] = f"join#{my_round}"
            while my_round not in self._last_joined:
                self._wait_or_raise()
            self._waiting.pop(rank, None)
            self.log.append((rank, f"join#{my_round}"))
            return self._last_joined[my_round]


class _JoinHandle:
    def __init__(self, world: FakeWorld, rank: int) -> None:
        self.result: Optional[int] = None
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, args=(world, rank), name=f"fake-join-{rank}", daemon=True)
        self.thread.start()

    def _run(self, world: FakeWorld, rank: int) -> None:
        try:
            self.result = world._join(rank)
        except BaseException as e:  # noqa: BLE001  (surfaces in join_wait)
            self.error = e


class FakeCollectives(Collectives):
    """Rank ``rank`` of a :class:`FakeWorld`; names collectives as HorovodCollectives does (tag and group)."""

    needs_launcher = False  # each rank is a thread of FakeWorld.run, already running

    def __init__(self, world: FakeWorld, rank: int) -> None:
        self.world, self._rank = world, rank
        self._initialized = False

    def _name(self, tag: str, group: Group) -> Tuple[str, Tuple[int, ...]]:
        members = normalize_group(group, self.world.size)
        return f"{tag}.{'all' if len(members) == self.world.size else '-'.join(map(str, members))}", members

    def init(self, dynamic_groups: bool = True, static_groups: Sequence[Sequence[int]] = ()) -> None:
        self._initialized = True

    @property
    def initialized(self) -> bool:
        return self._initialized

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def local_rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self.world.size

    def _blocking(self, name, kind, members, payload):
        result = self.world._collective(self._rank, name, kind, members, payload)
        self.last_collective_end = time.monotonic()
        return result

    def allreduce_grouped_async_(self, tensors, op="sum", tag="grads"):
        if op != "sum":
            raise ValueError(f"the fake world's asynchronous all-reduce sums (got op {op!r})")
        name, members = self._name(tag, None)
        deposited = self.world._deposit(self._rank, name, "allreduce", members, (op, [t.detach().clone() for t in tensors]))
        return (name, deposited, list(tensors))

    def done(self, handle) -> bool:
        with self.world._cv:
            return handle[1].done

    def finish(self, handle, tag="grads", watched=True) -> None:
        name, deposited, tensors = handle
        result = self.world._collect(self._rank, name, deposited)
        for t, r in zip(tensors, result):
            t.copy_(r)
        if watched:
            self.last_collective_end = time.monotonic()

    def allreduce(self, tensor, op="mean", group=None, tag="allreduce"):
        out = torch.empty_like(tensor).copy_(tensor)
        self.allreduce_grouped_([out], op=op, group=group, tag=tag)
        return out

    def allreduce_grouped_(self, tensors, op="mean", group=None, tag="grads"):
        if not tensors:
            return
        if op not in _REDUCE:
            raise ValueError(f"reduce op {op!r}: one of {', '.join(_REDUCE)}")
        name, members = self._name(tag, group)
        result = self._blocking(name, "allreduce", members, (op, [t.detach().clone() for t in tensors]))
        for t, r in zip(tensors, result):
            t.copy_(r / len(members) if op in ("mean", "avg") else r)

    def allgather(self, tensor, group=None, tag="allgather"):
        name, members = self._name(tag, group)
        return self._blocking(name, "allgather", members, tensor.detach().clone()).clone()

    def alltoall(self, tensor, splits, tag="alltoall"):
        name, members = self._name(tag, None)
        splits = [int(c) for c in splits]
        if len(splits) != self.size or sum(splits) > tensor.shape[0] or min(splits) < 0:
            raise ValueError(f"alltoall splits {splits}: one count >= 0 per rank, {tensor.shape[0]} rows in all")
        bounds = [sum(splits[:r]) for r in range(self.size + 1)]
        parts = [tensor.detach()[bounds[r]:bounds[r + 1]].clone() for r in range(self.size)]
        every = self._blocking(name, "alltoall", members, parts)
        mine = [every[r][self._rank] for r in range(self.size)]
        return torch.cat(mine, dim=0), [p.shape[0] for p in mine]

    def broadcast_(self, tensor, root, group=None, tag="broadcast"):
        name, members = self._name(tag, group)
        payload = (root, tensor.detach().clone() if self._rank == root else None)
        result = self._blocking(name, "broadcast", members, payload)
        tensor.copy_(result)
        return tensor

    def broadcast_object(self, obj, root=0, group=None, tag="object"):
        name, members = self._name(tag, group)
        payload = (root, pickle.dumps(obj) if self._rank == root else None)
        return pickle.loads(self._blocking(name, "broadcast", members, payload))

    def barrier(self, group=None):
        name, members = self._name("barrier", group)
        self._blocking(name, "barrier", members, None)

    def ensure_groups(self, groups):
        self.barrier()  # a collective over every rank, as creating process sets is

    def ensure_direct_groups(self, groups, timeout_s=600.0):
        self.barrier()  # a collective over every rank, as creating torch.distributed groups is

    def allreduce_direct_(self, tensors, group, op="mean", tag="direct"):
        if op not in ("mean", "avg", "sum"):
            raise ValueError(f"reduce op {op!r} within a direct group: use mean or sum")
        self.allreduce_grouped_(tensors, op=op, group=group, tag=f"{tag}.direct")

    def shutdown(self):
        self._initialized = False

    def join_is_fixed(self) -> bool:
        return True

    def join(self) -> int:
        return self.world._join(self._rank)

    def join_async(self) -> _JoinHandle:
        return _JoinHandle(self.world, self._rank)

    def join_done(self, handle: _JoinHandle) -> bool:
        return not handle.thread.is_alive()

    def join_wait(self, handle: _JoinHandle) -> int:
        handle.thread.join()
        if handle.error is not None:
            raise handle.error
        return int(handle.result)
