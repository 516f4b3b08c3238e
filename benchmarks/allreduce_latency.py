"""Where ring's step loses to Lightning's ddp: one gradient all-reduce, Horovod against torch.distributed.

    .venv/bin/python -m benchmarks.allreduce_latency [--world-sizes 4 8] [--steps 200] [--step-ms 60]
        [--repeats 3] [--cycles-ms 1] [--order-seed 0]

Every variant exchanges the matrix MLP's gradient tensors (float32, 78 K values) in jobs of its own (one
job per variant and repeat, in an order shuffled per repeat from ``--order-seed``), after a sleep of
``--step-ms`` per round (the emulated device time; ranks differ by up to 8 ms so they arrive at different
moments):

* ``gloo``: what Lightning's ddp does with one bucket: copy the gradients into one flat tensor,
  ``dist.all_reduce`` it over torch.distributed's Gloo group, divide and copy back;
* ``horovod``: what ring does, ``HorovodCollectives.allreduce_grouped_(op="mean")`` (a grouped all-reduce
  started asynchronously), with this project's Horovod build as it runs (the background loop does not
  sleep out its cycle while tensors wait, and the wait sleeps, in 0.5 ms slices, until the operation
  completes: ``scripts/patches/horovod-0.28.1-latency.patch``; the all-reduce runs by recursive
  halving-doubling: ``scripts/patches/horovod-0.28.1-halving-doubling.patch``);
* ``horovod-ring``: the same with Gloo's ring all-reduce (``HOROVOD_LS_STOCK_ALLREDUCE=1``);
* ``horovod-poll``: the same as ``horovod-ring``, waiting by polling with short sleeps (what stock builds
  do here);
* ``horovod-stock``: polling, Gloo's ring, and the background loop sleeping out every cycle as stock
  Horovod does (``HOROVOD_LS_STOCK_CYCLE=1``): this project before both patches;
* ``horovod-spin``: stock Horovod as a user would call it: stock cycle and ring, ``hvd.synchronize`` (a
  ``yield`` loop).

Per round: the critical path the exchange adds to a step, from the moment the LAST rank enters to the
moment the last rank leaves (the monotonic clock is shared by the processes of one host). Reported: median
over rounds (the first 10 skipped), median over ``--repeats`` jobs, per world size and Horovod cycle time
(``HOROVOD_CYCLE_TIME``). Output: ``<out>/allreduce_latency.json`` and ``.md`` (default
``benchmarks/results/scale``).
"""
from __future__ import annotations

import os
import random
import socket
import statistics
import time
from typing import Any

from benchmarks.report import write_rescore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "scale")
VARIANTS = ("gloo", "horovod", "horovod-ring", "horovod-poll", "horovod-stock", "horovod-spin")
MLP_SHAPES = [(256, 40), (256,), (256, 256), (256,), (10, 256), (10,)]  # the matrix's model (mlp 256-256, 40 in, 10 out)
SKIP = 10  # first rounds: names negotiated, caches warm


def _worker(rank: int, size: int, port: int, variant: str, torch_port: int, cycle_ms: float, steps: int,
            step_s: float, results) -> None:
    import torch

    from lightning_straggler.launcher import LOOPBACK, horovod_worker_env

    torch.set_num_threads(1)
    if variant.startswith("horovod"):
        os.environ.update(horovod_worker_env(rank, size, port, 300, cycle_time_ms=cycle_ms))
        os.environ.pop("HOROVOD_LS_STOCK_ALLREDUCE", None)  # an exported switch would make "horovod" the ring
        os.environ.pop("HOROVOD_LS_STOCK_CYCLE", None)
        if variant != "horovod":
            os.environ["HOROVOD_LS_STOCK_ALLREDUCE"] = "1"
        if variant in ("horovod-stock", "horovod-spin"):
            os.environ["HOROVOD_LS_STOCK_CYCLE"] = "1"
        import horovod.torch as hvd

        from lightning_straggler.comm import horovod as comm_horovod
        from lightning_straggler.comm.horovod import HorovodCollectives

        if variant in ("horovod-poll", "horovod-stock"):
            comm_horovod._sleeping_wait = lambda: None  # type: ignore[assignment]  (as on a stock build)

        comm = HorovodCollectives()
        comm.init(dynamic_groups=False)
        hvd.allreduce(torch.zeros(1), name="lineup")
        close = hvd.shutdown
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{LOOPBACK}:{torch_port}", rank=rank, world_size=size)
        dist.barrier()
        close = dist.destroy_process_group
    try:
        grads = [torch.randn(shape) for shape in MLP_SHAPES]
        bucket = torch.zeros(sum(g.numel() for g in grads))

        def exchange() -> None:
            if variant in ("horovod", "horovod-ring", "horovod-poll", "horovod-stock"):
                comm.allreduce_grouped_(grads, op="mean", tag="grads")
                return
            if variant == "horovod-spin":  # Horovod's own wait (a sched_yield loop) instead of polling
                hvd.synchronize(hvd.grouped_allreduce_async_(grads, op=hvd.Average, name="grads"))
                return
            offset = 0
            for g in grads:  # DDP copies gradients into its bucket, all-reduces it and copies them back
                bucket[offset:offset + g.numel()].copy_(g.reshape(-1))
                offset += g.numel()
            dist.all_reduce(bucket)
            bucket.div_(size)
            offset = 0
            for g in grads:
                g.copy_(bucket[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

        spans: list[tuple[float, float]] = []
        for step in range(steps):
            time.sleep(step_s + 0.002 * ((7 * step + 3 * rank) % 5))
            t0 = time.perf_counter()
            exchange()
            spans.append((t0, time.perf_counter()))
        results.put((rank, spans))
    finally:
        close()


def _free_port() -> int:
    from lightning_straggler.launcher import LOOPBACK

    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def critical_paths(spans: dict[int, list[tuple[float, float]]]) -> list[float]:
    """Per round: last rank's exit minus last rank's entry (what the exchange adds to the step)."""
    ranks = sorted(spans)
    return [max(spans[r][i][1] for r in ranks) - max(spans[r][i][0] for r in ranks)
            for i in range(len(spans[ranks[0]]))]


def measure(size: int, variant: str, cycle_ms: float, steps: int, step_s: float, timeout_s: float = 900) -> float:
    """One job of one variant: the median critical path over its rounds (seconds)."""
    from benchmarks.local_workers import run_workers

    got = run_workers(_worker, size, (variant, _free_port(), cycle_ms, steps, step_s), timeout_s,
                      f"allreduce_latency {variant} N={size} cycle={cycle_ms:g} ms")
    return statistics.median(critical_paths(got)[SKIP:])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import argparse

    from benchmarks.local_workers import probe_arguments
    from lightning_straggler.config import CYCLE_TIME_RANGE

    prog = "python -m benchmarks.allreduce_latency"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--cycles-ms", nargs="+", type=float, default=[1.0])
    parser.add_argument("--order-seed", type=int, default=0)
    a = probe_arguments(prog, __doc__, 200, "rounds per job", "jobs per world size and cycle", OUT, argv,
                        min_steps=SKIP + 5, step_ms=60.0, parser=parser)
    low, high = CYCLE_TIME_RANGE  # what trainer.horovod_cycle_time_ms accepts
    for c in a.cycles_ms:
        if not low <= c <= high:
            parser.error(f"--cycles-ms: each must be in [{low:g}, {high:g}] milliseconds (got {c:g})")
    rows = []
    for n in a.world_sizes:
        for cycle in a.cycles_ms:
            runs = []
            for i in range(a.repeats):
                order = list(VARIANTS)
                random.Random(f"{a.order_seed}-{n}-{cycle}-{i}").shuffle(order)
                runs.append({"order": order, **{v: measure(n, v, cycle, a.steps, a.step_ms / 1e3) for v in order}})
                print(f"[allreduce_latency] N={n} cycle {cycle:g} ms #{i}: "
                      + ", ".join(f"{v} {1e3 * runs[-1][v]:.2f} ms" for v in VARIANTS), flush=True)
            rows.append({"world_size": n, "cycle_ms": cycle, "runs": runs,
                         **{v: statistics.median(r[v] for r in runs) for v in VARIANTS}})
    report = {"what": __doc__, "argv": argv, "order_seed": a.order_seed, "steps": a.steps, "step_ms": a.step_ms,
              "repeats": a.repeats,
              "load_avg": os.getloadavg(), "rows": rows}
    lines = ["# One gradient all-reduce: Horovod (ring) against torch.distributed Gloo (ddp), loopback", "",
             f"Each variant in jobs of its own ({a.steps} rounds, order shuffled per repeat, order seed "
             f"{a.order_seed}), {a.step_ms:g}-{a.step_ms + 8:g} ms device time (a sleep) before each round; the "
             f"exchange's critical path (last rank in to last rank out), median over rounds, median over "
             f"{a.repeats} jobs (variants: see the module's docstring); load average at the end {', '.join(f'{x:.1f}' for x in report['load_avg'])} "
             "(2 cores).", "",
             "| N | Horovod cycle (ms) | " + " | ".join(f"{v} (ms)" for v in VARIANTS) + " |",
             "|---:|---:|" + "---:|" * len(VARIANTS)]
    for r in rows:
        lines.append(f"| {r['world_size']} | {r['cycle_ms']:g} | " + " | ".join(f"{1e3 * r[v]:.2f}" for v in VARIANTS)
                     + " |")
    os.makedirs(a.out, exist_ok=True)
    write_rescore(os.path.join(a.out, "allreduce_latency"), report, "\n".join(lines) + "\n")
    return report


if __name__ == "__main__":
    main()
