"""What numbers carried on the gradient all-reduce cost, by their dtype (dpar's / awar's boundary rows).

    .venv/bin/python -m benchmarks.carried_dtype_cost [--world-sizes 4 8] [--steps 100] [--step-ms 30] [--repeats 3]

Every rank runs ``--steps`` rounds; in each round, for every variant in turn, a sleep of ``--step-ms`` (the
emulated device time; ranks differ by up to 8 ms so they arrive at different moments), then one grouped
mean all-reduce of the matrix MLP's gradient tensors (float32) plus:

* ``grads``: nothing (a ring step);
* ``float64``: an N x 14 float64 slot tensor (dpar / awar carried N x 8 float64 rows until 2026-12-05; the
  same size as the float32 one here, so only the dtype differs);
* ``float32``: N x 14 float32 (``CARRIED_COLUMNS``, the gradients' dtype: what they carry now).

Reported per variant and N: the median over steps of the step's transfer time, the fastest rank's time in
the all-reduce (the last rank to arrive waits for nobody: what the operation itself costs); medians over
``--repeats`` jobs. Output: ``<out>/carried_dtype_cost.json`` and ``.md`` (default ``benchmarks/results/scale``).
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any

from benchmarks.report import write_rescore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "scale")
VARIANTS = ("grads", "float64", "float32")
MLP_SHAPES = [(256, 40), (256,), (256, 256), (256,), (10, 256), (10,)]  # the matrix's model (mlp 256-256, 40 in, 10 out)


def _worker(rank: int, size: int, port: int, steps: int, step_s: float, results) -> None:
    from lightning_straggler.launcher import horovod_worker_env

    os.environ.update(horovod_worker_env(rank, size, port, 300))
    import horovod.torch as hvd
    import torch

    from lightning_straggler.comm.horovod import HorovodCollectives
    from lightning_straggler.strategies.partial_group import CARRIED_COLUMNS

    torch.set_num_threads(1)
    comm = HorovodCollectives()
    comm.init(dynamic_groups=False)
    try:
        grads = [torch.randn(shape) for shape in MLP_SHAPES]
        extra = {"grads": None, "float64": torch.float64, "float32": torch.float32}
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        hvd.allreduce(torch.zeros(1), name="lineup")
        for step in range(steps):
            for variant in VARIANTS:
                time.sleep(step_s + 0.002 * ((7 * step + 3 * rank) % 5))
                tensors = list(grads)
                if extra[variant] is not None:
                    tensors.append(torch.zeros((size, CARRIED_COLUMNS), dtype=extra[variant]))
                t0 = time.perf_counter()
                comm.allreduce_grouped_(tensors, op="mean", tag=f"grads.{variant}")
                times[variant].append(time.perf_counter() - t0)
        results.put((rank, times))
    finally:
        hvd.shutdown()


def measure(size: int, steps: int, step_s: float, timeout_s: float = 600) -> dict[str, float]:
    from benchmarks.local_workers import run_workers

    got = run_workers(_worker, size, (steps, step_s), timeout_s, f"carried_dtype_cost N={size}")
    skip = min(5, steps // 5)  # the first rounds negotiate names
    return {v: statistics.median(min(got[r][v][i] for r in range(size)) for i in range(skip, steps))
            for v in VARIANTS}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.local_workers import probe_arguments

    a = probe_arguments("python -m benchmarks.carried_dtype_cost", __doc__, 100, "rounds per job",
                        "jobs per world size", OUT, argv, min_steps=10)
    rows = []
    for n in a.world_sizes:
        runs = []
        for i in range(a.repeats):
            runs.append(measure(n, a.steps, a.step_ms / 1e3))
            print(f"[carried_dtype_cost] N={n} #{i}: " + ", ".join(f"{v} {1e3 * runs[-1][v]:.2f} ms" for v in VARIANTS),
                  flush=True)
        rows.append({"world_size": n, "runs": runs, **{v: statistics.median(r[v] for r in runs) for v in VARIANTS}})
    report = {"what": __doc__, "argv": argv, "steps": a.steps, "step_ms": a.step_ms, "repeats": a.repeats,
              "load_avg": os.getloadavg(), "rows": rows}
    lines = ["# Numbers carried on the gradient all-reduce, by dtype (Gloo, loopback)", "",
             f"{a.steps} rounds of the three variants in turn, {a.step_ms:g}-{a.step_ms + 8:g} ms device time (a "
             f"sleep) before each; the step's transfer time (fastest rank in the all-reduce), median over steps, "
             f"median over {a.repeats} jobs; load average at the end "
             f"{', '.join(f'{x:.1f}' for x in report['load_avg'])} (2 cores).", "",
             "| N | gradients only (ms) | + float64 rows (ms) | + float32 rows (ms) |", "|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['world_size']} | " + " | ".join(f"{1e3 * r[v]:.2f}" for v in VARIANTS) + " |")
    os.makedirs(a.out, exist_ok=True)
    write_rescore(os.path.join(a.out, "carried_dtype_cost"), report, "\n".join(lines) + "\n")
    return report


if __name__ == "__main__":
    main()
