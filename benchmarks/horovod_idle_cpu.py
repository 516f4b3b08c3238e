"""CPU that idle Horovod workers spend, by Horovod's coordination cycle (``HOROVOD_CYCLE_TIME``).

Horovod's background thread coordinates with the other ranks every cycle even when no tensor is pending.
Each of ``--workers`` local workers (Gloo on loopback, started as the strategies start theirs) runs
``hvd.init()`` and one all-reduce, then sleeps ``--idle-s`` seconds and reports the CPU time its process
used meanwhile. One round per cycle value per repeat, the order of the values shuffled per repeat
(``--order-seed``). Writes ``records.jsonl`` (one line per rank and round) and ``report.md``.

    python -m benchmarks.horovod_idle_cpu --workers 4 --cycles-ms 1 2 5 --repeats 3 --idle-s 5 --order-seed 0 \\
        --output-dir benchmarks/results/horovod-idle/20261204
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any, Dict

from benchmarks.local_workers import run_workers


def _idle_worker(rank: int, size: int, port: int, cycle_ms: float, idle_s: float, results) -> None:
    from lightning_straggler.launcher import horovod_worker_env

    os.environ.update(horovod_worker_env(rank, size, port, 300, cycle_ms))
    import horovod.torch as hvd
    import torch

    hvd.init()
    try:
        hvd.allreduce(torch.ones(1), name="warm")  # the background thread and Gloo's pairs are up
        before = time.process_time()
        time.sleep(idle_s)
        used = time.process_time() - before
        hvd.allreduce(torch.ones(1), name="done")
        results.put((rank, used))
    finally:
        hvd.shutdown()


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--cycles-ms", type=float, nargs="+", default=[1.0, 2.0, 5.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--order-seed", type=int, default=0)
    ap.add_argument("--output-dir", required=True)
    a = ap.parse_args(argv)
    if a.workers < 2 or a.repeats < 1 or a.idle_s <= 0:
        ap.error("--workers >= 2, --repeats >= 1 and --idle-s > 0 are needed")
    os.makedirs(a.output_dir, exist_ok=True)
    rng = random.Random(a.order_seed)
    records = []
    for repeat in range(a.repeats):
        order = list(a.cycles_ms)
        rng.shuffle(order)
        for cycle in order:
            used = run_workers(_idle_worker, a.workers, (cycle, a.idle_s), 300, f"idle workers at {cycle:g} ms")
            records += [{"repeat": repeat, "cycle_ms": cycle, "rank": r, "cpu_s": round(s, 4), "idle_s": a.idle_s}
                        for r, s in sorted(used.items())]
            print(f"[horovod_idle_cpu] repeat {repeat} cycle {cycle:g} ms: CPU s per rank "
                  f"{[round(used[r], 2) for r in sorted(used)]}", flush=True)
    with open(os.path.join(a.output_dir, "records.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    lines = [f"# CPU of idle Horovod workers ({a.workers} workers, {a.idle_s:g} s idle, {a.repeats} repeats, "
             f"order seed {a.order_seed}, {os.cpu_count()} CPUs)", "",
             "| cycle (ms) | CPU s per rank: median [min-max] | cores busy, all ranks together (median) |",
             "|---:|---|---:|"]
    for cycle in a.cycles_ms:
        vals = [r["cpu_s"] for r in records if r["cycle_ms"] == cycle]
        cores = statistics.median(vals) * a.workers / a.idle_s
        lines.append(f"| {cycle:g} | {statistics.median(vals):.2f} [{min(vals):.2f}-{max(vals):.2f}] | {cores:.2f} |")
    report = "\n".join(lines) + "\n"
    with open(os.path.join(a.output_dir, "report.md"), "w") as f:
        f.write(report)
    print(report)
    return {"records": records}


if __name__ == "__main__":
    main()
