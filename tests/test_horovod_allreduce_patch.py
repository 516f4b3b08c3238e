"""scripts/patches/horovod-0.28.1-halving-doubling.patch, over real Horovod workers (Gloo on loopback).

Horovod's CPU all-reduce of a tensor with at least 2 x size elements runs by recursive halving-doubling
(Gloo's bcube) instead of Gloo's ring; ``HOROVOD_LS_STOCK_ALLREDUCE=1`` keeps the ring. Checked here: the
sums are right and bit-identical on every rank, in the world and in a process set, for world sizes that
are and are not powers of two, sizes on both sides of the 2 x size switch and the dtypes the strategies
use; and which algorithm ran, from the order in which it adds (float addition is not associative)."""
from __future__ import annotations

import pytest

DTYPES = ("float32", "float64", "float16")


def _counts(size: int) -> list[int]:
    # 1: the ring's case (most of its segments empty); 2 x n - 1 and 2 x n: either side of the switch for
    # the world (n = size) and for the process set (n = size - 1); 1001: uneven chunks; 78858: the
    # matrix MLP's gradients
    return sorted({1, 2 * (size - 1) - 1, 2 * (size - 1), 2 * size - 1, 2 * size, 1001, 78858})


def _inputs(rank: int, count: int, dtype: str):
    import torch

    g = torch.Generator().manual_seed(1000 * rank + count)
    return torch.randn(count, generator=g, dtype=torch.float64).to(getattr(torch, dtype))


def _worker_env(rank: int, size: int, port: int, stock: bool) -> None:
    """A local Gloo job's environment for this rank; ``stock``: Gloo's ring (``HOROVOD_LS_STOCK_ALLREDUCE``)."""
    import os

    from lightning_straggler.launcher import horovod_worker_env

    os.environ.update(horovod_worker_env(rank, size, port, 120))
    if stock:
        os.environ["HOROVOD_LS_STOCK_ALLREDUCE"] = "1"
    else:
        os.environ.pop("HOROVOD_LS_STOCK_ALLREDUCE", None)


def _sums(rank: int, size: int, port: int, stock: bool, results) -> None:
    _worker_env(rank, size, port, stock)
    import horovod.torch as hvd
    import torch

    subset = hvd.ProcessSet(list(range(size - 1)))  # all ranks but the last
    hvd.init(process_sets=[subset])
    try:
        out = {}
        for dtype in DTYPES:
            for count in _counts(size):
                x = _inputs(rank, count, dtype)
                out[("world", dtype, count)] = hvd.allreduce(x, op=hvd.Sum, name=f"w.{dtype}.{count}").numpy()
                if subset.included():
                    out[("subset", dtype, count)] = hvd.allreduce(x, op=hvd.Sum, name=f"s.{dtype}.{count}",
                                                                  process_set=subset).numpy()
        # the last rank has no process-set work: it must not shut Horovod down under the others' feet
        hvd.allreduce(torch.zeros(1), name="done")
        results.put((rank, out))  # numpy arrays: pickled whole, not shared memory that dies with the worker
    finally:
        hvd.shutdown()


@pytest.mark.parametrize("size", [3, 4, 8])
def test_allreduce_sums_are_right_and_the_same_bits_on_every_rank(size):
    import torch

    from benchmarks.local_workers import run_workers

    got = run_workers(_sums, size, (False,), 300, f"halving-doubling sums, {size} ranks")
    for group, members in (("world", range(size)), ("subset", range(size - 1))):
        for dtype in DTYPES:
            for count in _counts(size):
                key = (group, dtype, count)
                first = got[members[0]][key]
                for r in members:  # every member has the same bits
                    assert got[r][key].tobytes() == first.tobytes(), (key, r)
                # and the right sum (within the dtype's rounding over len(members) additions)
                want = sum(_inputs(r, count, dtype).double() for r in members)
                tol = {"float16": 5e-3, "float32": 1e-6, "float64": 1e-14}[dtype] * len(members) * 4
                assert torch.allclose(torch.from_numpy(first).double(), want, rtol=tol, atol=tol), key


ORDER_VALUES = (1e8, 1.0, -1e8, 1.0)  # float32: 1e8 + 1 == 1e8, so the order of additions shows


def _order(rank: int, size: int, port: int, stock: bool, results) -> None:
    _worker_env(rank, size, port, stock)
    import horovod.torch as hvd
    import torch

    hvd.init()
    try:
        x = torch.full((64,), ORDER_VALUES[rank], dtype=torch.float32)
        results.put((rank, sorted(set(hvd.allreduce(x, op=hvd.Sum, name="order").tolist()))))
    finally:
        hvd.shutdown()


@pytest.mark.parametrize("stock", [False, True], ids=["patched", "stock-ring"])
def test_halving_doubling_adds_every_element_in_one_tree_order_and_the_stock_switch_keeps_the_ring(stock):
    """Halving-doubling adds every element in the same tree (pairs, then pairs of pairs): one value
    throughout. The ring starts each chunk's sum at a different rank: values differ between chunks."""
    from benchmarks.local_workers import run_workers

    got = run_workers(_order, 4, (stock,), 120, "all-reduce order, 4 ranks")
    values = got[0]
    assert all(got[r] == values for r in range(4))
    if stock:
        assert len(values) > 1, values  # e.g. [0.0, 1.0]: the ring
    else:
        assert len(values) == 1 and values[0] in (0.0, 2.0), values  # (a + b) + (c + d) or (a + c) + (b + d)
