"""Start ``size`` local Horovod workers (Gloo on loopback) running one function, and collect what each puts
on its result queue. Shared by the benchmarks that time Horovod without Lightning."""
from __future__ import annotations

import argparse
import multiprocessing as mp
import queue as queue_mod
import time
from typing import Any, Callable


def run_workers(target: Callable[..., None], size: int, args: tuple, timeout_s: float, what: str) -> dict[int, Any]:
    """``target(rank, size, port, *args, results)`` in ``size`` worker processes; each puts ``(rank, value)``
    on ``results``. Returns ``{rank: value}``; a crashed worker or the deadline raises at once, naming ``what``."""
    from lightning_straggler.launcher import WORKER_START_METHOD, _Rendezvous, prepare_worker_start

    # started as the strategies start theirs (the fork server: torch is imported once, not per worker)
    launch_env = prepare_worker_start(WORKER_START_METHOD)
    ctx = mp.get_context(WORKER_START_METHOD)
    results = ctx.Queue()
    rendezvous = _Rendezvous(size)
    procs = [ctx.Process(target=_enter, args=(target, launch_env, r, size, rendezvous.port, *args, results))
             for r in range(size)]
    got: dict[int, Any] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.time() + timeout_s
        while len(got) < size:
            try:
                rank, value = results.get(timeout=2)
                got[rank] = value
            except queue_mod.Empty:
                # a crashed worker would otherwise leave us waiting for the whole deadline
                if any(p.exitcode not in (None, 0) for p in procs) or time.time() > deadline:
                    raise RuntimeError(f"{what} failed or passed {timeout_s:.0f} s "
                                       f"(worker exit codes {[p.exitcode for p in procs]})") from None
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:  # only the processes started here
            if p.is_alive():
                p.terminate()
        rendezvous.stop()
    return got


def _enter(target: Callable[..., None], launch_env: dict[str, str], *args: Any) -> None:
    from lightning_straggler.launcher import enter_worker

    enter_worker(launch_env)  # the caller's environment now, and die with the caller
    target(*args)


def probe_arguments(prog: str, doc: str, steps: int, steps_help: str, repeats_help: str, out: str,
                    argv: list[str] | None, min_steps: int = 1, step_ms: float = 30.0,
                    parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The command line the small Horovod probes share (``--world-sizes --steps --step-ms --repeats --out``),
    checked: world sizes >= 2, ``--steps`` >= ``min_steps``, ``--repeats`` >= 1, ``--step-ms`` >= 0. A probe with
    options of its own passes a ``parser`` that already has them."""
    ap = parser or argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--steps", type=int, default=steps, help=f"{steps_help} (default {steps})")
    ap.add_argument("--step-ms", type=float, default=step_ms, help=f"emulated device time per step (default {step_ms:g})")
    ap.add_argument("--repeats", type=int, default=3, help=f"{repeats_help} (default 3)")
    ap.add_argument("--out", default=out)
    a = ap.parse_args(argv)
    for n in a.world_sizes:
        if n < 2:
            ap.error(f"--world-sizes: each must be >= 2 (got {n})")
    if a.steps < min_steps or a.repeats < 1 or a.step_ms < 0:
        ap.error(f"--steps must be >= {min_steps}, --repeats >= 1, --step-ms >= 0")
    return a
