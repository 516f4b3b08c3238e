"""What a group of N-1 ranks costs on this machine: as a Horovod process set, and with the left-out
rank joined (``hvd.join()``, the mechanism ``dpar`` and ``awar`` use).

    .venv/bin/python -m benchmarks.process_set_cost [--world-sizes 4 8] [--repeats 60] [--out DIR]

Until issue 13 dpar and awar formed their group as a Horovod process set (static ones at 4 ranks,
DYNAMIC ones above: the first time a group forms, every rank calls ``hvd.add_process_set``, a
collective over all ranks that also builds the set's Gloo context). Now the left-out rank joins and
the others all-reduce over the ordinary world ring (it adds zeros). Both are measured here, alone,
with real Horovod workers (Gloo on loopback), for each world size N, in two jobs (one with dynamic
process sets enabled, one without, as dpar/awar now run):

* ``allreduce_global_s``: median time of a named all-reduce of the MLP's gradient (313 KB, the
  matrix's 40-256-256-10 model) over all N ranks, in a job with dynamic process sets enabled;
* ``create_s``: wall time of ``hvd.add_process_set`` for the N-1 ranks without the last one (the
  first exclusion dpar makes), median over ``--creations`` sets (each leaves out a different rank);
* ``allreduce_subset_s``: median all-reduce over that set while the left-out rank does nothing;
* ``allreduce_plain_s``: the world all-reduce in a job WITHOUT dynamic process sets (what ``ring`` runs);
* ``allreduce_joined_s``: in that job, the sum-all-reduce of the N-1 ranks while the last rank has
  joined (``comm.join_async``, polled; its main thread sleeping), i.e. a dpar/awar group step's exchange;
* ``join_s``: the N-1 ranks' own ``join()`` that releases everyone (the boundary signal).

Every figure is rank 0's wall clock after a named all-reduce that lines the ranks up. Output:
``<out>/process_set_cost.json`` and ``.md`` (default ``benchmarks/results/scale``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from benchmarks.report import write_rescore

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


def _join_worker(rank: int, size: int, port: int, repeats: int, rounds: int, results) -> None:
    from lightning_straggler.comm.horovod import HorovodCollectives
    from lightning_straggler.launcher import horovod_worker_env

    os.environ.update(horovod_worker_env(rank, size, port, 300))
    import horovod.torch as hvd
    import torch

    torch.set_num_threads(1)
    comm = HorovodCollectives()
    comm.init(dynamic_groups=False)  # no process sets: as ring, dpar and awar run
    try:
        grad = torch.ones(GRAD_FLOATS)

        def timed(name: str, op) -> list[float]:
            out = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                hvd.allreduce(grad, name=name, op=op)
                out.append(time.perf_counter() - t0)
            return out

        hvd.allreduce(torch.zeros(1), name="lineup.warm")
        plain = timed("grads.all", hvd.Average)
        joined, join = [], []
        for r in range(rounds):
            hvd.allreduce(torch.zeros(1), name="lineup.round")
            if rank == size - 1:  # out of the group: joined (polled, as dpar and awar wait), main thread idle
                handle = comm.join_async()
                while not comm.join_done(handle):
                    time.sleep(0.001)
                comm.join_wait(handle)
            else:
                joined += timed("grads.among.all", hvd.Sum)
                t0 = time.perf_counter()
                comm.join()
                join.append(time.perf_counter() - t0)
        results.put((rank, {"allreduce_plain_s": plain, "allreduce_joined_s": joined, "join_s": join}))
    finally:
        hvd.shutdown()


def measure(size: int, repeats: int, creations: int, timeout_s: float = 600) -> dict[str, Any]:
    from benchmarks.local_workers import run_workers

    got = run_workers(_worker, size, (repeats, creations), timeout_s, f"process_set_cost N={size}")
    r0 = got[0]
    r0.update(run_workers(_join_worker, size, (repeats, creations), timeout_s, f"join cost N={size}")[0])
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
              f"{1e3 * r['allreduce_global_s']:.2f} ms, subset {1e3 * r['allreduce_subset_s']:.2f} ms; without "
              f"process sets: all-reduce {1e3 * r['allreduce_plain_s']:.2f} ms, N-1 with one rank joined "
              f"{1e3 * r['allreduce_joined_s']:.2f} ms, join {1e3 * r['join_s']:.2f} ms", flush=True)
    report = {"what": __doc__, "load_avg": os.getloadavg(), "rows": rows}
    lines = ["# A group of N-1 ranks on this machine (Gloo, loopback): process set vs join", "",
             f"Load average at the end: {', '.join(f'{x:.1f}' for x in report['load_avg'])} (2 cores). Medians, ms.", "",
             "| N | create set | each creation | all-reduce all N (dynamic sets on) | all-reduce N-1 in its set | "
             "all-reduce all N (no sets) | all-reduce N-1, 1 joined | join |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['world_size']} | {1e3 * r['create_s']:.1f} | "
                     f"{', '.join(f'{1e3 * c:.1f}' for c in r['create_s_all'])} | {1e3 * r['allreduce_global_s']:.2f} | "
                     f"{1e3 * r['allreduce_subset_s']:.2f} | {1e3 * r['allreduce_plain_s']:.2f} | "
                     f"{1e3 * r['allreduce_joined_s']:.2f} | {1e3 * r['join_s']:.2f} |")
    os.makedirs(a.out, exist_ok=True)
    write_rescore(os.path.join(a.out, "process_set_cost"), report, "\n".join(lines) + "\n")
    return report


if __name__ == "__main__":
    main()
