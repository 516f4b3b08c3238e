"""Soak test: randomised straggler schedules through every algorithm; nothing may hang.

    .venv/bin/python -m benchmarks.soak [--schedules 100] [--seed 0] [--timeout-s 300] [--stall-timeout-s 60]
        [--algorithms ring dssync boa dpar awar adaptive] [--ranks 4] [--steps 16] [--jobs 1]
        [--output-dir benchmarks/results/soak] [--faults [--checkpoint-every 4]]

Each schedule is one short job (``python -m lightning_straggler.train``, 4 Horovod workers on loopback,
synthetic data, ``trainer.max_steps`` steps over two epochs with a validation in between) in its own process
group with a hard timeout. Schedules come from ``random.Random(seed)`` and are spread round-robin over the
algorithms; each is one of:

  transient  1-5 slowdown events on random ranks, factor log-uniform in [1.5, 50], random (often overlapping)
             windows, some open-ended;
  all_slow   every rank slow at once (overlapping windows, factors up to 50x);
  static     per-rank factors, 1-3 ranks slowed up to 50x for the whole run;
  random     the seeded random scenario with probability up to 0.5 and factor_max up to 50.

Device time is emulated (``straggler.device_ms_per_sample`` 0.5 ms x factor per sample, plus (factor - 1) x
the rank's real compute). Outcomes: ``finished`` (exit 0 and summary.json), ``errored`` (non-zero exit with
an ``error:`` message), ``stalled`` (the launcher's watchdog ended a collective stalled for
``--stall-timeout-s``: a protocol hang caught, i.e. a bug), ``hung`` (killed at ``--timeout-s``: a hang
nobody caught). Writes ``soak.json`` and ``soak.md`` under the output directory, one line per run as it goes.

``--faults``: faults instead of stragglers. Each run kills (SIGKILL) or freezes (SIGSTOP) one random worker
after a random optimizer step (``python -m benchmarks.faults``), with ``trainer.restart_on_failure=1`` and a
checkpoint every ``--checkpoint-every`` steps; kills and freezes alternate, algorithms round-robin. A run
counts as ``finished`` only when it exits 0 with its summary AND passes every check: the job restarted once,
without exactly the struck worker (``dead_original_ranks``); the final checkpoint holds every optimizer
step (``global_step == --steps``); the restart went on from a checkpoint at most ``--checkpoint-every``
steps before the fault (lost steps); and nothing is left behind: no process of the job's process group,
no results or checkpoint temporary file. A failed check makes the run ``wrong`` (with what failed).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGORITHMS = ("ring", "dssync", "boa", "dpar", "awar", "adaptive")
KINDS = ("transient", "all_slow", "static", "random")
OUTCOMES = ("finished", "wrong", "errored", "stalled", "hung")
FAULTS = ("kill", "freeze")


def _factor(rng: random.Random, high: float = 50.0) -> float:
    return round(math.exp(rng.uniform(math.log(1.5), math.log(high))), 2)


def make_schedule(rng: random.Random, ranks: int, steps: int) -> Dict[str, Any]:
    """One straggler scenario as Hydra overrides plus a short description."""
    kind = rng.choice(KINDS)
    if kind in ("transient", "all_slow"):
        who = list(range(ranks)) if kind == "all_slow" else [rng.randrange(ranks) for _ in range(rng.randint(1, 5))]
        events = []
        for r in who:
            start = rng.randrange(0, steps)
            end = None if rng.random() < 0.2 else rng.randint(start + 1, steps + 4)
            events.append({"rank": r, "factor": _factor(rng), "start_step": start, "end_step": end})
        if kind == "all_slow":  # make sure they overlap: everyone slow over one common window
            common = rng.randrange(0, steps // 2)
            for e in events:
                e["start_step"] = min(e["start_step"], common)
                e["end_step"] = None if e["end_step"] is None else max(e["end_step"], common + steps // 3)
        body = ",".join("{rank:%d,factor:%s,start_step:%d,end_step:%s}" % (
            e["rank"], e["factor"], e["start_step"], "null" if e["end_step"] is None else e["end_step"]) for e in events)
        return {"kind": kind, "events": events, "overrides": ["straggler=transient", f"straggler.events=[{body}]"]}
    if kind == "static":
        factors = [1.0] * ranks
        for r in rng.sample(range(ranks), rng.randint(1, 3)):
            factors[r] = _factor(rng)
        return {"kind": kind, "factors": factors,
                "overrides": ["straggler=static", "straggler.factors=[%s]" % ",".join(map(str, factors))]}
    params = {"seed": rng.randrange(10_000), "probability": round(rng.uniform(0.05, 0.5), 3),
              "factor_min": 1.5, "factor_max": _factor(rng), "duration_min": 1,
              "duration_max": rng.randint(2, steps), "window_steps": rng.randint(2, 8)}
    params["factor_max"] = max(params["factor_max"], params["factor_min"])
    return {"kind": kind, "params": params,
            "overrides": ["straggler=random"] + [f"straggler.{k}={v}" for k, v in params.items()]}


def describe(schedule: Dict[str, Any]) -> str:
    if "events" in schedule:
        top = max(e["factor"] for e in schedule["events"])
        return f"{schedule['kind']}({len(schedule['events'])} events, max {top:g}x)"
    if "fault" in schedule:
        f = schedule["fault"]
        return f"{f['kind']} rank {f['rank']} after step {f['step']}"
    if "factors" in schedule:
        return f"static({schedule['factors']})"
    p = schedule["params"]
    return f"random(p={p['probability']}, max {p['factor_max']:g}x, seed {p['seed']})"


def run_one(index: int, algorithm: str, schedule: Dict[str, Any], args, out_dir: str) -> Dict[str, Any]:
    run_dir = os.path.join(out_dir, "runs", f"{index:04d}_{algorithm}_{schedule['kind']}")
    os.makedirs(run_dir, exist_ok=True)
    fault = schedule.get("fault")
    entry = (["-m", "benchmarks.faults", "--fault", fault["kind"], "--rank", str(fault["rank"]), "--step",
              str(fault["step"])] if fault else ["-m", "lightning_straggler.train"])
    extra = (["trainer.restart_on_failure=1", f"trainer.checkpoint_every_n_steps={args.checkpoint_every}"]
             if fault else [])
    leftovers_before = _temporary_files(run_dir)
    command = [sys.executable, *entry, f"algorithm={algorithm}", "trainer=quick",
               f"trainer.devices={args.ranks}", f"trainer.max_steps={args.steps}", "trainer.max_epochs=2",
               f"trainer.val_check_interval={max(1, args.steps // 2)}", f"trainer.stall_timeout_s={args.stall_timeout_s}",
               "data=synthetic", f"data.num_samples={args.ranks * 16 * args.steps * 10 // 8 // 2 + 10}",
               "data.batch_size=16", "model.hidden=[32]", "straggler.device_ms_per_sample=0.5",
               "profiler.plot=false", "profiler.gather_every_n_steps=4", "target_acc=0.0",
               f"output_dir={run_dir}", f"hydra.run.dir={run_dir}", *extra, *schedule["overrides"]]
    started = time.monotonic()
    with open(os.path.join(run_dir, "stdout.log"), "w") as so, open(os.path.join(run_dir, "stderr.log"), "w") as se:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=so, stderr=se, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the job and its workers
            proc.wait()
            rc = None
    left_processes = _group_alive(proc.pid, grace_s=15.0)
    wall = time.monotonic() - started
    with open(os.path.join(run_dir, "stderr.log")) as f:
        err = f.read()
    messages = [line[len("error: "):] for line in err.splitlines() if line.startswith("error: ")]
    summary_path = os.path.join(run_dir, "summary.json")
    record: Dict[str, Any] = {"index": index, "algorithm": algorithm, "schedule": describe(schedule),
                              "spec": {k: v for k, v in schedule.items() if k != "overrides"},
                              "overrides": schedule["overrides"], "rc": rc, "wall_s": round(wall, 1),
                              "run_dir": os.path.relpath(run_dir, ROOT)}
    if rc is None:
        record["outcome"] = "hung"
        record["message"] = f"no exit after {args.timeout_s} s; last stderr: {err.strip().splitlines()[-1:] }"
    elif rc == 0 and os.path.exists(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
        record["outcome"] = "finished"
        record["steps"] = {r: v["steps"] for r, v in summary["per_rank"].items()}
        record["events"] = Counter(e["kind"] for e in summary["events"])
        if fault:
            problems = check_fault_run(fault, summary, run_dir, args, left_processes,
                                       _temporary_files(run_dir) - leftovers_before)
            record.update(fault=fault, restarts=summary.get("restarts"), problems=problems)
            if problems:
                record["outcome"], record["message"] = "wrong", "; ".join(problems)
    else:
        record["message"] = messages[-1] if messages else (err.strip().splitlines() or ["(no stderr)"])[-1]
        record["outcome"] = "stalled" if "collective stalled" in record["message"] else "errored"
    return record


def _temporary_files(run_dir: str) -> set:
    """The launcher's results files in the temp directory and checkpoint temporaries of ``run_dir``."""
    import glob
    import tempfile

    found = glob.glob(os.path.join(tempfile.gettempdir(), "lightning-straggler-results-*"))
    found += glob.glob(os.path.join(run_dir, "checkpoints", "*.tmp-*"))
    return set(found)


def _group_alive(pgid: int, grace_s: float = 0.0) -> bool:
    """Whether any process of the job's process group (its workers included) is still there after
    ``grace_s`` seconds (workers end on their parent's death signal, a moment after it exits)."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.2)


def _checkpoint_step(path: str) -> int | None:
    import torch

    try:
        return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])
    except (OSError, KeyError, RuntimeError):
        return None


def check_fault_run(fault: Dict[str, Any], summary: Dict[str, Any], run_dir: str, args, left_processes: bool,
                    new_temporaries: set) -> List[str]:
    """What is wrong with a finished fault run (empty: nothing). See the module docstring."""
    problems = []
    restarts = summary.get("restarts") or []
    if len(restarts) != 1:
        problems.append(f"{len(restarts)} restarts (expected 1)")
    elif restarts[0].get("dead_original_ranks") != [fault["rank"]]:
        problems.append(f"restart without ranks {restarts[0].get('dead_original_ranks')} (struck: {fault['rank']})")
    final = _checkpoint_step(os.path.join(run_dir, "checkpoints", "last.ckpt"))
    if final != args.steps:
        problems.append(f"final checkpoint at step {final} (expected {args.steps})")
    elif restarts:
        # the restarted job's own steps (its profiler's count) end at the final step: it went on from here
        resumed = final - int(summary["per_rank"]["0"]["steps"])
        lost = fault["step"] - resumed
        if lost > args.checkpoint_every:
            problems.append(f"went on from step {resumed}: lost {lost} steps (at most {args.checkpoint_every})")
        restarts[0]["resumed_at_step"] = resumed
    if left_processes:
        problems.append("processes of the job left running")
    if new_temporaries:
        problems.append(f"temporary files left: {sorted(new_temporaries)[:3]}")
    return problems


def make_fault(rng: random.Random, index: int, ranks: int, steps: int) -> Dict[str, Any]:
    """A worker struck after a random step in the first launch's middle (so a checkpoint exists before)."""
    kind = FAULTS[index % len(FAULTS)]
    return {"kind": kind, "fault": {"kind": kind, "rank": rng.randrange(ranks), "step": rng.randint(2, steps - 2)},
            "overrides": ["straggler=none"]}


def write_report(records: List[Dict[str, Any]], args, out_dir: str) -> None:
    per_algorithm: Dict[str, Counter] = defaultdict(Counter)
    for r in records:
        per_algorithm[r["algorithm"]][r["outcome"]] += 1
    totals = Counter(r["outcome"] for r in records)
    report = {"command": " ".join([os.path.relpath(sys.executable, ROOT), "-m", "benchmarks.soak", *sys.argv[1:]]),
              "seed": args.seed, "schedules": len(records), "totals": {k: totals[k] for k in OUTCOMES},
              "per_algorithm": {a: {k: c[k] for k in OUTCOMES} for a, c in per_algorithm.items()},
              "runs": records}
    with open(os.path.join(out_dir, "soak.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    what = f"faults (checkpoint every {args.checkpoint_every} steps)" if args.faults else "schedules"
    lines = [f"# Soak: {len(records)} {what}, seed {args.seed}, {args.ranks} ranks, {args.steps} steps, "
             f"hard timeout {args.timeout_s} s, stall timeout {args.stall_timeout_s} s", "",
             f"Command: `{report['command']}`", "",
             "| algorithm | runs | " + " | ".join(OUTCOMES) + " |", "|---|---|" + "---|" * len(OUTCOMES)]
    for a in sorted(per_algorithm, key=ALGORITHMS.index):
        c = per_algorithm[a]
        lines.append(f"| {a} | {sum(c.values())} | " + " | ".join(str(c[k]) for k in OUTCOMES) + " |")
    lines.append(f"| all | {len(records)} | " + " | ".join(str(totals[k]) for k in OUTCOMES) + " |")
    bad = [r for r in records if r["outcome"] != "finished"]
    if bad:
        lines += ["", "Not finished:", ""]
        lines += [f"- #{r['index']} {r['algorithm']} {r['schedule']}: {r['outcome']}: {r.get('message', '')[:400]}"
                  for r in bad]
    with open(os.path.join(out_dir, "soak.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=100, help="total runs, spread over the algorithms")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="hard limit per run (then: hung)")
    parser.add_argument("--stall-timeout-s", type=float, default=None,
                        help="trainer.stall_timeout_s of each run (default 60; --faults: 10, how soon a freeze is found)")
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--jobs", type=int, default=1, help="runs at the same time")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--output-dir", default=None, help="default benchmarks/results/soak (--faults: soak-faults)")
    parser.add_argument("--faults", action="store_true", help="kill or freeze a worker per run, restarts on")
    parser.add_argument("--checkpoint-every", type=int, default=4, help="--faults: checkpoint_every_n_steps")
    args = parser.parse_args(argv)
    if args.steps < 6:
        parser.error(f"--steps must be >= 6 (got {args.steps})")
    if args.faults and args.ranks < 2:
        parser.error(f"--ranks must be >= 2 with --faults: a restart goes on without the struck worker (got {args.ranks})")
    if not 1 <= args.checkpoint_every <= args.steps:
        parser.error(f"--checkpoint-every must be in 1..--steps ({args.steps}) (got {args.checkpoint_every})")
    if args.stall_timeout_s is None:
        args.stall_timeout_s = 10.0 if args.faults else 60.0
    args.output_dir = args.output_dir or os.path.join(ROOT, "benchmarks", "results", "soak-faults" if args.faults else "soak")
    out_dir = os.path.abspath(args.output_dir)
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(args.seed)
    draw = (lambda i: make_fault(rng, i, args.ranks, args.steps)) if args.faults else \
        (lambda i: make_schedule(rng, args.ranks, args.steps))
    plan = [(i, args.algorithms[i % len(args.algorithms)], draw(i)) for i in range(args.schedules)]  # drawn up front: the same whatever --jobs is
    records: List[Dict[str, Any]] = []
    lock = threading.Lock()

    def one(item) -> None:
        record = run_one(*item, args, out_dir)
        with lock:
            records.append(record)
            records.sort(key=lambda r: r["index"])
            write_report(records, args, out_dir)
            counts = Counter(r["outcome"] for r in records)
            print(f"[{len(records):3d}/{args.schedules}] #{record['index']:<3d} {record['algorithm']:6s} "
                  f"{record['schedule']:45s} {record['outcome']:8s} {record['wall_s']:6.1f} s  ("
                  + ", ".join(f"{k} {counts[k]}" for k in OUTCOMES) + ")"
                  + (f"\n      {record['message'][:300]}" if record.get("message") else ""), flush=True)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, plan))
    print(f"wrote {os.path.join(out_dir, 'soak.json')} and soak.md", flush=True)
    return 0 if all(r["outcome"] == "finished" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
