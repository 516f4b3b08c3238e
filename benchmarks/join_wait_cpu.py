"""What a rank outside dpar's/awar's group costs the others while it is joined, by how it waits for the join.

    .venv/bin/python -m benchmarks.join_wait_cpu [--world-sizes 4 8] [--steps 60] [--step-ms 30] [--repeats 3]

Ranks 0..N-2 run ``--steps`` group steps (a sleep of ``--step-ms``, the emulated device time, then the
summed all-reduce of the matrix MLP's gradient) and join; rank N-1 has joined from the start and waits:

* ``thread``: ``hvd.join()`` in a helper thread, the main thread polling it every 10 ms (how dpar and awar
  waited until 2026-12-05). Horovod's blocking wait spins in ``sched_yield``;
* ``polled``: :meth:`HorovodCollectives.join_async` (the join started without waiting and polled with
  short sleeps, as every other collective here), what they run now.

Reported per way and N: the joined rank's CPU seconds per wall second (``process_time``, all its
threads), the group's median all-reduce, and the group's wall time for its steps; medians over
``--repeats`` jobs, the two ways alternating. Output: ``<out>/join_wait_cpu.json`` and ``.md``
(default ``benchmarks/results/scale``).
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any

from benchmarks.process_set_cost import GRAD_FLOATS
from benchmarks.report import write_rescore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "scale")
WAYS = ("thread", "polled")


def _worker(rank: int, size: int, port: int, way: str, steps: int, step_s: float, results) -> None:
    import threading

    from lightning_straggler.launcher import horovod_worker_env

    os.environ.update(horovod_worker_env(rank, size, port, 300))
    import horovod.torch as hvd
    import torch

    from lightning_straggler.comm.horovod import HorovodCollectives

    torch.set_num_threads(1)
    comm = HorovodCollectives()
    comm.init(dynamic_groups=False)  # as dpar and awar run
    try:
        grad = torch.ones(GRAD_FLOATS)
        hvd.allreduce(torch.zeros(1), name="lineup")
        wall0, cpu0 = time.perf_counter(), time.process_time()
        if rank == size - 1:  # outside the group: joined until the group joins too
            if way == "thread":
                helper = threading.Thread(target=hvd.join)
                helper.start()
                while helper.is_alive():
                    time.sleep(0.01)
            else:
                handle = comm.join_async()
                while not comm.join_done(handle):
                    time.sleep(0.01)
                comm.join_wait(handle)
            results.put((rank, {"cpu_per_wall": (time.process_time() - cpu0) / (time.perf_counter() - wall0)}))
            return
        members = tuple(range(size - 1))
        allreduce = []
        for _ in range(steps):
            time.sleep(step_s)
            t0 = time.perf_counter()
            comm.allreduce_among_([grad], members, op="sum", tag="grads")
            allreduce.append(time.perf_counter() - t0)
            grad.fill_(1.0)
        wall = time.perf_counter() - wall0
        comm.join()
        results.put((rank, {"allreduce_s": statistics.median(allreduce), "group_wall_s": wall}))
    finally:
        hvd.shutdown()


def measure(size: int, way: str, steps: int, step_s: float, timeout_s: float = 300) -> dict[str, Any]:
    from benchmarks.local_workers import run_workers

    got = run_workers(_worker, size, (way, steps, step_s), timeout_s, f"join_wait_cpu N={size} {way}")
    return {"cpu_per_wall": got[size - 1]["cpu_per_wall"],
            "allreduce_s": statistics.median(got[r]["allreduce_s"] for r in range(size - 1)),
            "group_wall_s": max(got[r]["group_wall_s"] for r in range(size - 1))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.local_workers import probe_arguments

    a = probe_arguments("python -m benchmarks.join_wait_cpu", __doc__, 60, "group steps per job",
                        "jobs per way and world size", OUT, argv)
    rows = []
    for n in a.world_sizes:
        runs: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
        for i in range(a.repeats):
            for way in (WAYS if i % 2 == 0 else WAYS[::-1]):  # alternate which way goes first
                runs[way].append(measure(n, way, a.steps, a.step_ms / 1e3))
                r = runs[way][-1]
                print(f"[join_wait_cpu] N={n} {way} #{i}: joined rank {r['cpu_per_wall']:.2f} CPU s / s, group "
                      f"all-reduce {1e3 * r['allreduce_s']:.1f} ms, {a.steps} steps in {r['group_wall_s']:.2f} s",
                      flush=True)
        for way in WAYS:
            rows.append({"world_size": n, "way": way, "runs": runs[way],
                         **{k: statistics.median(r[k] for r in runs[way])
                            for k in ("cpu_per_wall", "allreduce_s", "group_wall_s")}})
    report = {"what": __doc__, "argv": argv, "steps": a.steps, "step_ms": a.step_ms, "repeats": a.repeats,
              "load_avg": os.getloadavg(), "rows": rows}
    lines = ["# A joined rank's wait: hvd.join() in a helper thread against the polled join (Gloo, loopback)", "",
             f"{a.steps} group steps of {a.step_ms:g} ms device time (a sleep) + the summed all-reduce of "
             f"{4 * GRAD_FLOATS} bytes; medians over {a.repeats} jobs per cell; load average at the end "
             f"{', '.join(f'{x:.1f}' for x in report['load_avg'])} (2 cores).", "",
             "| N | joined rank waits | its CPU s per s | group all-reduce (ms) | group wall (s) |",
             "|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['world_size']} | {r['way']} | {r['cpu_per_wall']:.2f} | {1e3 * r['allreduce_s']:.1f} | "
                     f"{r['group_wall_s']:.2f} |")
    os.makedirs(a.out, exist_ok=True)
    write_rescore(os.path.join(a.out, "join_wait_cpu"), report, "\n".join(lines) + "\n")
    return report


if __name__ == "__main__":
    main()
