"""What a Horovod process set costs on this machine: creating one at run time, and all-reducing in one.

    .venv/bin/python -m benchmarks.process_set_cost [--world-sizes 4 8] [--repeats 60] [--out DIR]

dpar and awar at 8 ranks use DYNAMIC process sets (more than 16 possible groups, see
``strategies/partial_group.static_groups``): the first time a group forms, every rank calls
``hvd.add_process_set`` (a collective over all ranks that also builds the set's Gloo context). The
simulator charges that creation as a platform constant, ``process_set_create_s``, which no
no-straggler run can show (none creates a set), so it is measured here, alone, with real Horovod
workers (Gloo on loopback), for each world size N:

* ``allreduce_global_s``: median time of a named all-reduce of the MLP's gradient (313 KB, the
  matrix's 40-256-256-10 model) over all N ranks, in a job with dynamic process sets enabled;
* ``create_s``: wall time of ``hvd.add_process_set`` for the N-1 ranks without the last one (the
  first exclusion dpar makes), median over ``--creations`` sets (each leaves out a different rank);
* ``allreduce_subset_s``: median all-reduce over that set while the left-out rank does nothing.

Every figure is rank 0's wall clock after a named all-reduce that lines the ranks up. Output:
``<out>/process_set_cost.json`` and ``.md`` (default ``benchmarks/results/scale``), read by
``benchmarks.sim_validate``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "scale")
GRAD_FLOATS = 40 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10  # the matrix's MLP, float32


def _worker(rank: int, size: int, port: int, repeats: int, creations: int, results) -> None:
    from lightning_straggler.launcher import horovod_worker_env

    os.environ.update(horovod_worker_env(rank, size, port, 300))
    import horovod.torch as hvd
    import torch

    torch.set_num_threads(1)
    hvd.init(process_sets="dynamic")
    try:
        grad = torch.ones(GRAD_FLOATS)

        def line_up(tag: str) -> None:
            hvd.allreduce(torch.zeros(1), name=f"lineup.{tag}")

        def timed_allreduces(tag: str, process_set) -> list[float]:
            out = []
            for i in range(repeats):
                t0 = time.perf_counter()
                hvd.allreduce(grad, name=f"{tag}.grad", process_set=process_set)  # a fixed name, as gradients use
                out.append(time.perf_counter() - t0)
            return out

        line_up("warm")
        glob = timed_allreduces("global", hvd.global_process_set)
        create, subset = [], []
        for c in range(creations):
            left_out = size - 1 - (c % size)
            members = [r for r in range(size) if r != left_out]
            line_up(f"create{c}")
            t0 = time.perf_counter()
            ps = hvd.add_process_set(members)
            create.append(time.perf_counter() - t0)
            if rank in members:
                subset += timed_allreduces(f"subset{c}", ps)
            line_up(f"after{c}")
            hvd.remove_process_set(ps)
        results.put((rank, {"allreduce_global_s": glob, "create_s": create, "allreduce_subset_s": subset}))
    finally:
        hvd.shutdown()


def measure(size: int, repeats: int, creations: int, timeout_s: float = 600) -> dict[str, Any]:
    from benchmarks.local_workers import run_workers

    got = run_workers(_worker, size, (repeats, creations), timeout_s, f"process_set_cost N={size}")
    r0 = got[0]
    return {"world_size": size, "repeats": repeats, "creations": creations, "grad_bytes": 4 * GRAD_FLOATS,
            **{k: statistics.median(v) for k, v in r0.items()},
            "create_s_all": r0["create_s"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.process_set_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--repeats", type=int, default=60, help="all-reduces per measurement (default 60)")
    ap.add_argument("--creations", type=int, default=3, help="process sets created per world size (default 3)")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args(argv)
    for n in a.world_sizes:
        if n < 2:
            ap.error(f"--world-sizes: each must be >= 2 (got {n})")
    if a.repeats < 1 or a.creations < 1:
        ap.error("--repeats and --creations must be >= 1")
    rows = []
    for n in a.world_sizes:
        print(f"[process_set_cost] N={n}: {a.repeats} all-reduces, {a.creations} set creations ...", flush=True)
        rows.append(measure(n, a.repeats, a.creations))
        r = rows[-1]
        print(f"[process_set_cost] N={n}: create {1e3 * r['create_s']:.1f} ms, all-reduce global "
              f"{1e3 * r['allreduce_global_s']:.2f} ms, subset {1e3 * r['allreduce_subset_s']:.2f} ms", flush=True)
    report = {"what": __doc__, "load_avg": os.getloadavg(), "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "process_set_cost.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = ["# Horovod process sets on this machine (Gloo, loopback)", "",
             "| N | create (ms, median) | each creation (ms) | all-reduce all N (ms) | all-reduce N-1 (ms) |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['world_size']} | {1e3 * r['create_s']:.1f} | "
                     f"{', '.join(f'{1e3 * c:.1f}' for c in r['create_s_all'])} | {1e3 * r['allreduce_global_s']:.2f} | "
                     f"{1e3 * r['allreduce_subset_s']:.2f} |")
    with open(os.path.join(a.out, "process_set_cost.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return report


if __name__ == "__main__":
    main()
