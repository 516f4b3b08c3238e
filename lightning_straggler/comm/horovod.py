"""Horovod implementation of :class:`Collectives` with a process-set cache.

Facts this relies on (checked on Horovod 0.28.1 with Gloo):
- Horovod matches collectives across ranks by *name*. Its automatic names come from a per-process
  counter, so as soon as some ranks run an extra operation inside a process set, the automatic names
  of later global operations differ between ranks and the job hangs. Every call here is named.
- Horovod caches the negotiation of an operation by its name; a fresh name every step defeats the
  cache (ring ran at well under half the plain loop's speed that way). Blocking operations therefore
  use one stable name per (tag, group).
- ``hvd.join()`` (world-level): a joined rank adds zeros to every all-reduce the others run until all
  have joined; ``dpar``/``awar`` build their partial group on it (no process set per group).
- Stock Horovod 0.28.1 corrupts memory with two or more joined ranks at 8 ranks; ``scripts/setup.sh``
  builds it with the fix (``scripts/patches/``) and marks the wheel with a local version label
  (``0.28.1+ls<hash of the patches>``), which :meth:`HorovodCollectives.join_is_fixed` reads.
- ``hvd.add_process_set`` is a collective over all ranks and raises for a rank list that already
  exists, so sets are created only through :meth:`ensure_groups` and cached by rank tuple.
- ``hvd.synchronize`` waits in a ``sched_yield`` loop (``WaitAndClear``, seen with ``py-spy dump --native``):
  each waiting rank keeps a core busy. With more workers than cores that spin takes the CPU the background
  threads need to move the data; ring ran at 0.6-0.75 x Lightning's ddp at 4 workers on 2 cores that way.
  Collectives here start asynchronously and wait (:func:`_wait`) with ``horovod_torch_wait_handle``, which
  ``scripts/patches/horovod-0.28.1-latency.patch`` adds (asleep on a condition variable until the operation
  completes), or on a stock build by polling with short sleeps (which notice the end up to 0.5 ms late;
  ``benchmarks.allreduce_latency`` measures both).
- ``hvd.join()`` waits the same way, and a rank outside dpar's/awar's group stays joined for a whole
  window: from a helper thread that spin took a whole core for the whole time and made the group's
  all-reduce 1.6 x slower (``benchmarks.join_wait_cpu``, 8 ranks on 2 cores: 0.91 against 0.13 CPU s per
  s, 23.8 against 14.9 ms). So joins start asynchronously too (:func:`_join_start`) and are waited for
  as above: no helper thread.
"""
from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Any, Dict, Iterator, Sequence, Tuple

from lightning_straggler.comm.base import Collectives, Group, flat_per_dtype, normalize_group, unflatten_into
from lightning_straggler.watchdog import waiting  # the launcher's stall watchdog sees blocked collectives

_OPS = ("mean", "avg", "sum", "max", "min", "product")


def horovod_has_join_fix() -> bool:
    """Whether the installed Horovod is this project's patched build (local version label ``+ls...``)."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("horovod")
    except importlib.metadata.PackageNotFoundError:
        return False
    return "+ls" in version


def _hvd():
    import horovod.torch as hvd  # imported lazily: the launcher process never needs it

    return hvd


POLL_FIRST_S, POLL_MAX_S = 5e-5, 5e-4  # sleeps between polls: doubling up to 0.5 ms (the latency it may add)
# A sleeping wait returns this often (and is called again): Python runs its signal handlers in between,
# and at 8 ranks on 2 cores a wait asleep until completion made the all-reduce slower (20 against 14 ms;
# waking every 0.5 ms as the polling did keeps 14 ms, and at 4 ranks keeps the sleeping wait's gain:
# benchmarks.allreduce_latency probes; likely idle CPUs' wake-up latency, not isolated).
WAIT_SLICE_S = 5e-4
# dssync exchange="direct": how long a torch.distributed Gloo operation (or its rendezvous) may wait for its
# peers before it raises, unless the caller says (the strategies pass the launcher's backstop for their
# stall timeout: the watchdog names a stalled rank first)
DIRECT_TIMEOUT_S = 600.0


@functools.lru_cache(maxsize=1)
def _sleeping_wait():
    """``horovod_torch_wait_handle(handle, timeout_s)`` of this project's Horovod build (it sleeps on a
    condition variable that the operation's completion signals: no spin, no polling latency), or None
    on a stock build."""
    from horovod.torch import mpi_ops

    return getattr(mpi_ops.mpi_lib, "horovod_torch_wait_handle", None)


def _wait(hvd, handle):
    """The result of an asynchronous Horovod operation, waiting without Horovod's spin: asleep until it
    completes (patched build), else polling with short sleeps."""
    wait = _sleeping_wait()
    if wait is not None:
        while not wait(handle, WAIT_SLICE_S):
            pass
    else:
        delay = POLL_FIRST_S
        while not hvd.poll(handle):
            time.sleep(delay)
            delay = min(2 * delay, POLL_MAX_S)
    return hvd.synchronize(handle)


def _differentiable(tensor) -> bool:
    # Horovod's blocking calls are autograd functions (Lightning's all_gather(sync_grads=True) needs that)
    import torch

    return tensor.requires_grad and torch.is_grad_enabled()


def _join_start(hvd):
    """Start ``hvd.join()`` without waiting for it: a handle for ``hvd.poll`` / :func:`_wait`, whose result
    is the rank that joined last. ``horovod.torch.join`` is exactly this followed by its spinning
    ``synchronize`` (Horovod 0.28.1, pinned); the handle is registered where ``synchronize`` looks."""
    import torch
    from horovod.torch import mpi_ops

    last = torch.tensor(-1, dtype=torch.int)
    try:
        handle = mpi_ops.mpi_lib.horovod_torch_join(last, -1)  # -1: zeros for the others' tensors on the CPU
    except RuntimeError as error:  # as hvd.join() reports it (Horovod shut down)
        raise mpi_ops.HorovodInternalError(error) from error
    mpi_ops._handle_map[handle] = (None, last)
    return handle


class HorovodCollectives(Collectives):
    def __init__(self) -> None:
        self._sets: Dict[Tuple[int, ...], Any] = {}
        self._dynamic = False
        # exchange="direct": torch's Gloo process group per group (None where this rank is not a member)
        self._direct: Dict[Tuple[int, ...], Any] = {}
        self._direct_store = None  # the TCPStore the groups met through

    # --- lifecycle -------------------------------------------------------------------------------
    def init(self, dynamic_groups: bool = True, static_groups: Sequence[Sequence[int]] = ()) -> None:
        hvd = _hvd()
        static = [hvd.ProcessSet(sorted(g)) for g in sorted({tuple(sorted(g)) for g in static_groups})]
        if not hvd.is_initialized():
            # Dynamic process sets cost a little on every step (measured ~10% on 4 CPU workers), so
            # algorithms that only ever use the whole world turn them off, and algorithms with few
            # possible groups register them all here instead.
            hvd.init(process_sets="dynamic" if dynamic_groups else (static or None))
        else:
            static = []  # someone else initialised Horovod: use what it registered (and add dynamically)
        self._dynamic = dynamic_groups
        self._sets = {tuple(range(hvd.size())): hvd.global_process_set}
        self._sets.update({tuple(s.ranks): s for s in static})

    @property
    def initialized(self) -> bool:
        try:
            return _hvd().is_initialized()
        except ImportError:
            return False

    def shutdown(self) -> None:
        self._direct.clear()  # their connections close with them
        self._direct_store = None
        if self.initialized:
            _hvd().shutdown()
        self._sets.clear()

    @property
    def rank(self) -> int:
        return _hvd().rank()

    @property
    def local_rank(self) -> int:
        return _hvd().local_rank()

    @property
    def size(self) -> int:
        return _hvd().size()

    # --- groups ------------------------------------------------------------------------------------
    def ensure_groups(self, groups: Sequence[Sequence[int]]) -> None:
        hvd = _hvd()
        wanted = []
        for g in groups:
            key = normalize_group(g, self.size)
            if key not in self._sets and key not in wanted:
                wanted.append(key)
        if wanted and not self._dynamic:
            raise RuntimeError(f"process sets {wanted} were not registered at init and dynamic process sets are off")
        for key in wanted:  # the given order (the same on every rank): Horovod coordinates sets in this order
            self._sets[key] = hvd.add_process_set(list(key))

    def ensure_direct_groups(self, groups: Sequence[Sequence[int]], timeout_s: float = DIRECT_TIMEOUT_S) -> None:
        """A Gloo process group (torch's ``ProcessGroupGloo``) for each of ``groups`` of two or more ranks, on
        connections of its own. torch.distributed's default (world) group is NOT started: Lightning
        broadcasts on it at every training batch once it exists, which would make every step a world sync
        again (and torchmetrics would sync over it). The groups meet through a ``TCPStore`` on rank 0 at the
        address of Horovod's Gloo interface (the port the OS picks, told to the others through Horovod);
        each rank builds only its own groups, in the given order (the same on every rank: no cycle of
        waits). ``GLOO_SOCKET_IFNAME``: Horovod's interface unless set."""
        import datetime

        import torch.distributed as dist

        keys = []
        for g in groups:
            key = normalize_group(g, self.size)
            if len(key) > 1 and key not in self._direct and key not in keys:
                keys.append(key)
        if not keys:
            return
        timeout = datetime.timedelta(seconds=timeout_s)
        if self._direct_store is None:
            from lightning_straggler.cluster_env import gloo_interface, interface_address

            iface = gloo_interface()
            os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
            store, where = None, None
            if self.rank == 0:
                addr = interface_address(iface)
                store = dist.TCPStore(addr, 0, self.size, True, timeout=timeout, wait_for_workers=False)
                where = (addr, int(store.port))
            where = self.broadcast_object(where, root=0, tag="direct_store")
            if store is None:
                with self._blocking("direct_store"):
                    store = dist.TCPStore(where[0], where[1], self.size, False, timeout=timeout)
            self._direct_store = store
        for key in keys:
            if self.rank in key:  # only the members meet (through the store): nothing for the others to join
                with self._blocking(f"direct_group.{'-'.join(map(str, key))}"):
                    prefixed = dist.PrefixStore(f"direct/{'-'.join(map(str, key))}", self._direct_store)
                    self._direct[key] = dist.ProcessGroupGloo(prefixed, key.index(self.rank), len(key), timeout)
            else:
                self._direct[key] = None  # exists, this rank is not in it

    def allreduce_direct_(self, tensors, group, op="mean", tag="direct"):
        key = normalize_group(group, self.size)
        if key not in self._direct:
            raise RuntimeError(f"no direct group for ranks {key}: create it with ensure_direct_groups() on every "
                               "rank first")
        if self._direct[key] is None:
            raise ValueError(f"rank {self.rank} all-reduces within direct group {key}, which it is not in")
        if op not in ("mean", "avg", "sum"):
            raise ValueError(f"reduce op {op!r} within a direct group: use mean or sum")
        with self._blocking(f"{tag}.{'-'.join(map(str, key))}.direct"):
            for same, flat in flat_per_dtype(tensors):  # one operation per dtype (usually one)
                if op != "sum" and not flat.is_floating_point():
                    raise ValueError(f"a mean within a direct group needs floating-point tensors (got {flat.dtype})")
                self._direct[key].allreduce([flat]).wait()  # a sum
                if op != "sum":
                    flat.div_(len(key))
                unflatten_into(same, flat)

    def process_set(self, group: Group):
        key = normalize_group(group, self.size)
        try:
            return self._sets[key]
        except KeyError:
            raise RuntimeError(
                f"no Horovod process set for ranks {key}: create it with ensure_groups() on every rank first"
            ) from None

    def _name(self, tag: str, group: Group) -> Tuple[str, Any]:
        key = normalize_group(group, self.size)
        members = "all" if len(key) == self.size else "-".join(map(str, key))
        return f"{tag}.{members}", self.process_set(key)

    @staticmethod
    def _op(op: str):
        hvd = _hvd()
        op = op.lower()
        if op not in _OPS:
            raise ValueError(f"reduce op {op!r} is not supported; use one of {', '.join(_OPS)}")
        return {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max,
                "min": hvd.Min, "product": hvd.Product}[op]

    @contextlib.contextmanager
    def _blocking(self, name: str) -> Iterator[None]:
        """A blocking collective: the watchdog sees the wait; its end is a moment every rank shares."""
        with waiting(name):
            yield
        self.last_collective_end = time.monotonic()

    # --- collectives ----------------------------------------------------------------------------
    def allreduce(self, tensor, op="mean", group=None, tag="allreduce"):
        name, ps = self._name(tag, group)
        hvd = _hvd()
        with self._blocking(name):
            if _differentiable(tensor):
                return hvd.allreduce(tensor, op=self._op(op), name=name, process_set=ps)
            return _wait(hvd, hvd.allreduce_async(tensor, op=self._op(op), name=name, process_set=ps))

    def allreduce_grouped_(self, tensors, op="mean", group=None, tag="grads"):
        if not tensors:
            return
        name, ps = self._name(tag, group)
        hvd = _hvd()
        with self._blocking(name):
            _wait(hvd, hvd.grouped_allreduce_async_(list(tensors), op=self._op(op), name=name, process_set=ps))

    def allgather(self, tensor, group=None, tag="allgather"):
        name, ps = self._name(tag, group)
        hvd = _hvd()
        with self._blocking(name):
            if _differentiable(tensor):
                return hvd.allgather(tensor, name=name, process_set=ps)
            return _wait(hvd, hvd.allgather_async(tensor, name=name, process_set=ps))

    def broadcast_(self, tensor, root, group=None, tag="broadcast"):
        name, ps = self._name(tag, group)
        hvd = _hvd()
        with self._blocking(name):
            return _wait(hvd, hvd.broadcast_async_(tensor, root_rank=root, name=name, process_set=ps))

    def broadcast_object(self, obj, root=0, group=None, tag="object"):
        name, ps = self._name(tag, group)
        with self._blocking(name):
            return _hvd().broadcast_object(obj, root_rank=root, name=name, process_set=ps)

    def alltoall(self, tensor, splits, tag="alltoall"):
        import torch

        name, ps = self._name(tag, None)
        hvd = _hvd()
        with self._blocking(name):
            output, counts = _wait(hvd, hvd.alltoall_async(tensor, splits=torch.tensor(list(splits), dtype=torch.int32),
                                                           name=name, process_set=ps))
        return output, [int(c) for c in counts.tolist()]

    def join_is_fixed(self) -> bool:
        return horovod_has_join_fix()

    def join(self) -> int:
        hvd = _hvd()
        with self._blocking("join"):
            return int(_wait(hvd, _join_start(hvd)).item())

    def join_async(self) -> int:
        # joined, this rank's background thread feeds zeros to the others' all-reduces while its main
        # thread goes on computing; it polls the handle between its own steps
        return _join_start(_hvd())

    def join_done(self, handle: int) -> bool:
        return bool(_hvd().poll(handle))

    def join_wait(self, handle: int) -> int:
        hvd = _hvd()
        with self._blocking("join"):
            return int(_wait(hvd, handle).item())

    def allreduce_grouped_async_(self, tensors, op="sum", tag="grads"):
        name, ps = self._name(tag, None)
        return _hvd().grouped_allreduce_async_(list(tensors), op=self._op(op), name=name, process_set=ps)

    def done(self, handle) -> bool:
        return bool(_hvd().poll(handle))

    def finish(self, handle, tag="grads", watched=True) -> None:
        hvd = _hvd()
        if watched:
            with self._blocking(self._name(tag, None)[0]):
                _wait(hvd, handle)
        else:
            _wait(hvd, handle)

    def barrier(self, group=None) -> None:
        with self._blocking(self._name("barrier", group)[0]):
            _hvd().barrier(process_set=self.process_set(group))
