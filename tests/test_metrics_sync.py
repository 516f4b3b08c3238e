"""In-process tests of the torchmetrics synchronisation a HorovodStrategy attaches (lightning_straggler.metrics).

A world of N ranks is simulated by N threads whose collectives meet in memory (``ThreadWorld``), so the
real gather code runs on every "rank" with that rank's own metric states, and the synchronised values
can be compared with one metric fed everyone's data.
"""
import os
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC
from torchmetrics.aggregation import CatMetric, SumMetric

from lightning_straggler.comm.base import Collectives, normalize_group
from lightning_straggler.metrics import HorovodAvailable, HorovodGather, attach_horovod_sync, horovod_sync_kwargs
from lightning_straggler.strategies import DparStrategy, DSSyncStrategy, RingStrategy, AwarStrategy, BoaStrategy


class ThreadWorld:
    """Collectives of ``size`` threads: each call deposits this rank's tensor and returns everyone's."""

    def __init__(self, size):
        self.size = size
        self.lock = threading.Lock()
        self.barriers = {}  # one per group
        self.slots = {}
        self.calls = []  # (rank, tag, group) of every collective, for the assertions

    def barrier(self, members):
        with self.lock:
            return self.barriers.setdefault(members, threading.Barrier(len(members), timeout=20))

    def abort(self):
        with self.lock:
            for b in self.barriers.values():
                b.abort()

    def allgather(self, rank, tensor, group, tag):
        members = normalize_group(group, self.size)
        assert rank in members
        self.calls.append((rank, tag, members))
        self.slots[rank] = tensor.clone()
        self.barrier(members).wait()
        out = torch.cat([self.slots[r] for r in members])
        self.barrier(members).wait()
        return out


class ThreadComm(Collectives):
    def __init__(self, world, rank):
        self.world, self._rank = world, rank

    def init(self, dynamic_groups=True, static_groups=()):
        pass

    initialized = True
    rank = property(lambda self: self._rank)
    local_rank = property(lambda self: self._rank)
    size = property(lambda self: self.world.size)

    def allgather(self, tensor, group=None, tag="allgather"):
        return self.world.allgather(self._rank, tensor, group, tag)

    def _unused(self, *args, **kwargs):
        raise AssertionError("metric sync must only all-gather")

    allreduce = allreduce_grouped_ = broadcast_ = broadcast_object = broadcast_async = _unused
    poll = wait = barrier = ensure_groups = shutdown = _unused


def run_ranks(size, fn):
    """fn(rank, comm) on ``size`` threads; returns the results in rank order (re-raises a failure)."""
    world = ThreadWorld(size)
    results, errors = [None] * size, []

    def target(rank):
        try:
            results[rank] = fn(rank, ThreadComm(world, rank))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            world.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a simulated rank hung"
    if errors:
        raise errors[0]
    return results, world


class UserModule(nn.Module):
    """Metrics where users put them: attributes, a nested block, a MetricCollection."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(3, 4)
        self.acc = MulticlassAccuracy(num_classes=4, average="micro")
        self.block = nn.Module()
        self.block.auroc = MulticlassAUROC(num_classes=4, thresholds=None)  # cat states: per-rank lengths differ
        self.collection = MetricCollection({"seen": CatMetric(), "total": SumMetric()})


def rank_data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    n = [7, 0, 12][rank]  # rank 1 sees no data at all: torchmetrics' empty placeholder has another shape
    probs = torch.softmax(torch.randn(n, 4, generator=g), dim=1)
    target = torch.randint(0, 4, (n,), generator=g)
    return probs, target


def feed(module, probs, target):
    if len(target):
        module.acc.update(probs, target)
        module.block.auroc.update(probs, target)
        module.collection.update(target.float())


@pytest.mark.filterwarnings("ignore:The ``compute`` method")  # rank 1 never updates (threads: no pytest.warns)
def test_every_metric_in_the_module_is_synchronised_with_uneven_and_empty_ranks():
    def rank_fn(rank, comm):
        module = UserModule()
        strategy = RingStrategy(comm=comm)
        strategy._lightning_module = module
        assert strategy.attach_metric_sync() == 4  # acc, auroc and the collection's two metrics
        feed(module, *rank_data(rank))
        values = (module.acc.compute(), module.block.auroc.compute(), module.collection.compute())
        # compute synchronised a copy: the local states are back afterwards (torchmetrics' unsync)
        local = len(module.collection["seen"].value)
        return values, local

    results, world = run_ranks(3, rank_fn)
    reference = UserModule()
    for r in range(3):
        feed(reference, *rank_data(r))
    expected = (reference.acc.compute(), reference.block.auroc.compute(), reference.collection.compute())
    for rank, ((acc, auroc, coll), local) in enumerate(results):
        assert torch.allclose(acc, expected[0]), rank
        assert torch.allclose(auroc, expected[1], atol=1e-6), rank
        assert torch.equal(coll["seen"], expected[2]["seen"]) and torch.equal(coll["total"], expected[2]["total"])
        assert local == (0 if rank == 1 else 1)  # CatMetric keeps its own list (one update per rank)
    tags = {tag for _, tag, _ in world.calls}
    assert tags == {"metric_header", "metric_state"}  # named collectives of the comm layer only


class Holder:
    """Stands in for the strategy (the metric handles hold it weakly)."""

    def __init__(self, comm):
        self.comm = comm


def test_gather_handles_shapes_dtypes_scalars_and_groups():
    def rank_fn(rank, comm):
        holder = Holder(comm)
        gather = HorovodGather(holder)
        scalar = gather(torch.tensor(float(rank)))
        rows = gather(torch.full((rank + 1, 2), rank, dtype=torch.int64))  # different first dimensions
        empty_mix = gather(torch.tensor([]) if rank == 0 else torch.tensor([rank, rank], dtype=torch.int64))
        flags = gather(torch.tensor([rank % 2 == 0]))
        half = gather(torch.tensor([rank], dtype=torch.bfloat16))
        pair = gather(torch.tensor([rank * 10]), group=[1, 2]) if rank in (1, 2) else None
        return scalar, rows, empty_mix, flags, half, pair

    results, _ = run_ranks(3, rank_fn)
    for rank, (scalar, rows, empty_mix, flags, half, pair) in enumerate(results):
        assert [t.item() for t in scalar] == [0.0, 1.0, 2.0] and all(t.dim() == 0 for t in scalar)
        assert [tuple(t.shape) for t in rows] == [(1, 2), (2, 2), (3, 2)]
        assert all(torch.equal(t, torch.full_like(t, r)) for r, t in enumerate(rows))
        # the empty placeholder (float, 1-D) takes the dtype of the ranks that hold data
        assert [t.dtype for t in empty_mix] == [torch.int64] * 3 and empty_mix[0].numel() == 0
        assert torch.equal(torch.cat(empty_mix), torch.tensor([1, 1, 2, 2]))
        assert [t.dtype for t in flags] == [torch.bool] * 3 and [bool(t) for t in flags] == [True, False, True]
        assert [t.dtype for t in half] == [torch.bfloat16] * 3 and [t.item() for t in half] == [0.0, 1.0, 2.0]
        if rank in (1, 2):
            assert [t.item() for t in pair] == [10, 20]


def test_attachment_leaves_custom_sync_alone_and_respects_sync_on_compute():
    def custom_gather(tensor, group=None):
        return [tensor]

    module = nn.Module()
    module.mine = SumMetric(dist_sync_fn=custom_gather)
    module.local = SumMetric(sync_on_compute=False)
    module.legacy = SumMetric(**horovod_sync_kwargs())
    world = ThreadWorld(2)
    strategy = RingStrategy(comm=ThreadComm(world, 0))
    strategy._lightning_module = module
    assert attach_horovod_sync(module, strategy) == 2  # local and legacy; "mine" stays the user's
    assert module.mine.dist_sync_fn is custom_gather
    assert isinstance(module.legacy.dist_sync_fn, HorovodGather) and module.legacy.dist_sync_fn.strategy is strategy
    module.local.update(torch.tensor(3.0))
    assert module.local.compute().item() == 3.0 and world.calls == []  # sync_on_compute=False: no collective
    assert attach_horovod_sync(module, strategy) == 2  # idempotent
    # a metric copied after attachment keeps the handle, without copying the strategy
    copy = module.legacy.clone()
    assert copy.dist_sync_fn is module.legacy.dist_sync_fn


@pytest.mark.parametrize("cls,lockstep", [(RingStrategy, True), (DSSyncStrategy, True), (BoaStrategy, True),
                                          (DparStrategy, False), (AwarStrategy, False)])
def test_when_metrics_synchronise(cls, lockstep):
    world = ThreadWorld(2)
    strategy = cls(comm=ThreadComm(world, 0))
    module = UserModule()
    strategy._lightning_module = module
    available = HorovodAvailable(strategy)
    assert strategy.trains_in_lockstep() is lockstep
    assert available()  # no trainer: as in validate / test
    module._trainer = SimpleNamespace(training=False)  # validation, test, sanity check
    assert available()
    module._trainer = SimpleNamespace(training=True)  # train epoch end: dpar/awar ranks are not in step
    assert available() is lockstep
    single = RingStrategy(comm=ThreadComm(ThreadWorld(1), 0))
    assert not HorovodAvailable(single)()  # one rank: nothing to synchronise


def test_metric_computed_while_training_under_partial_groups_stays_local():
    def rank_fn(rank, comm):
        module = UserModule()
        module._trainer = SimpleNamespace(training=True)
        strategy = DparStrategy(comm=comm)
        strategy._lightning_module = module
        strategy.attach_metric_sync()
        module.collection["total"].update(torch.tensor(float(rank + 1)))
        return module.collection["total"].compute().item()

    results, world = run_ranks(2, rank_fn)
    assert results == [1.0, 2.0] and world.calls == []


def _ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        metric = MulticlassAccuracy(num_classes=2, average="micro", **horovod_sync_kwargs())
        target = torch.zeros(4, dtype=torch.long)
        metric.update(target if rank == 0 else 1 - target, target)  # rank 0 all right, rank 1 all wrong
        with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
            f.write(str(float(metric.compute())))
    finally:
        dist.destroy_process_group()


def test_horovod_sync_kwargs_metric_syncs_over_torch_distributed_without_horovod(tmp_path):
    """The same LightningModule under Lightning's own ddp: a metric built with horovod_sync_kwargs() syncs
    as torchmetrics would over torch.distributed (it used to compute each rank's own shard: 1.0 and 0.0)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_ddp_worker, args=(2, port, str(tmp_path)), nprocs=2, start_method="spawn", join=True)
    assert [float((tmp_path / f"rank{r}").read_text()) for r in range(2)] == [0.5, 0.5]
