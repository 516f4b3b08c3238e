"""``dssync`` (group_size 2, butterfly, sync=params) against ``ring`` where communication dominates a step.

    .venv/bin/python -m benchmarks.dssync_vs_ring [--workers 4 8] [--seeds 5] [--steps 50] [--order-seed 0]
        [--output-dir DIR] [--quick]
    .venv/bin/python -m benchmarks.dssync_vs_ring --aggregate-only DIR

MLP 40-1024-1024-1024-10 (~2.15 M parameters) on synthetic data, ``--steps`` steps, no emulated device
time, no validation inside the steps, no straggler. (dssync's accuracy and throughput on the small model
with emulated device time are the matrix's dssync rows: ``python -m benchmarks.matrix``.) Checks the
target of the DS-Sync issue: synchronisation time per step at most (g-1)/(N-1) of ring's plus a fixed
overhead.

Every (workers, seed) block runs ring and dssync in an order shuffled by
``random.Random("dssync_vs_ring:<order_seed>:<N>:<seed>")`` (recorded per run). Ratios dssync / ring are
paired per block, then reported with benchmarks/stats.py's rules (median, 95% bootstrap interval, label).
Sync time per step per worker = median over ranks of (per_rank comm_s.mean + wait_s.mean) from
summary.json; "comm only" = median over ranks of comm_s.mean (wait = time beyond the group's fastest
member). For dssync it includes the all-worker average at the end of training (it runs inside that step).

Output: ``<out>/report.json`` (every run's record), ``report.md``, ``command.txt``; default ``<out>`` =
``benchmarks/results/dssync_vs_ring/<stamp>`` (committed; the raw run directories under runs/ are not).
On loopback Gloo over shared cores "communication" is CPU time; see the shaped-network benchmark for links.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from typing import Any, Dict, List

from benchmarks.report import write_report
from benchmarks.stats import fmt_interval, labelled, shuffled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "dssync_vs_ring")
ALGOS = {"ring": ["algorithm=ring"],
         "dssync": ["algorithm=dssync", "algorithm.group_size=2", "algorithm.schedule=butterfly",
                    "algorithm.sync=params"]}
G = 2  # dssync group size
BYTES_FORMULA = ("analytic, fp32: ring all-reduce over N workers sends 2*(N-1)/N * P * 4 bytes per worker per "
                 "step; a group all-reduce of size g sends 2*(g-1)/g * P * 4 (P = parameter count)")
LOAD_NOTE = (f"{os.cpu_count()} CPU cores are shared by all workers; runs[*].load1_before/after is the 1-minute load "
             "average around each run: well above the run's worker count means other processes competed for the cores")
SETTING = {"hidden": [1024, 1024, 1024], "data": "synthetic", "device_ms_per_sample": 0.0, "target_acc": 0.5}


def param_count(hidden: List[int]) -> int:
    from lightning_straggler.models import build_network

    return sum(p.numel() for p in build_network("mlp", 40, 10, hidden).parameters())  # both data sets: 40 -> 10


def allreduce_bytes(group: int, params: int) -> float:
    return 2.0 * (group - 1) / group * params * 4


def run_one(algo: str, workers: int, seed: int, part: Dict[str, Any], trainer: List[str], out_dir: str) -> Dict[str, Any]:
    import lightning_straggler.config  # noqa: F401  (registers the group schemas before composing)
    from hydra import compose, initialize_config_dir

    from lightning_straggler.train import train

    overrides = ALGOS[algo] + [
        "straggler=none", f"straggler.device_ms_per_sample={part['device_ms_per_sample']}",
        "model=mlp", f"model.hidden=[{','.join(map(str, part['hidden']))}]", f"data={part['data']}",
        f"trainer.devices={workers}", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false",
        "profiler.plot=false", f"seed={seed}", f"target_acc={part['target_acc']}", f"output_dir={out_dir}",
    ] + trainer
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    load_before = os.getloadavg()[0]
    s = train(cfg)
    ranks = s["per_rank"].values()
    sync = statistics.median(r["comm_s"]["mean"] + r["wait_s"]["mean"] for r in ranks)
    comm = statistics.median(r["comm_s"]["mean"] for r in ranks)
    sync_p50 = statistics.median(r["comm_s"]["p50"] + r["wait_s"]["p50"] for r in ranks)
    steps = statistics.median(r["steps"] for r in ranks)
    global_avgs = sum(1 for e in s["events"] if e.get("kind") == "global_average")
    return {"algo": algo, "workers": workers, "seed": seed, "throughput": s["throughput_samples_per_s"],
            "sync_ms": 1e3 * sync, "comm_ms": 1e3 * comm, "sync_p50_ms": 1e3 * sync_p50, "steps": steps,
            "train_samples": s["train_samples"], "wall_s": s["wall_s"], "launch_s": s["launch_s"],
            "val_acc": s["val_acc"], "time_to_target_s": s["time_to_target_s"], "global_averages": global_avgs,
            "load1_before": load_before, "load1_after": os.getloadavg()[0],
            "summary": os.path.join(out_dir, "summary.json")}


def med(runs, key):
    vals = [r[key] for r in runs if r[key] is not None]
    return statistics.median(vals) if len(vals) == len(runs) and vals else None  # None if any run lacks it


def aggregate(runs: List[Dict[str, Any]], params: int) -> List[Dict[str, Any]]:
    """Per world size: medians per algorithm, and the per-seed paired ratios dssync / ring with their
    interval and label (sync time: lower is better; throughput: higher is better)."""
    rows = []
    for n in sorted({r["workers"] for r in runs}):
        agg = {}
        for algo in ALGOS:
            rs = [r for r in runs if r["workers"] == n and r["algo"] == algo]
            g = n if algo == "ring" else min(G, n)
            agg[algo] = {k: med(rs, k) for k in ("throughput", "sync_ms", "comm_ms", "sync_p50_ms", "steps")}
            agg[algo]["bytes_per_step"] = allreduce_bytes(g, params)
        pairs = {}
        for r in runs:
            if r["workers"] == n:
                pairs.setdefault(r["seed"], {})[r["algo"]] = r

        def paired(key: str) -> List[float]:
            return [p["dssync"][key] / p["ring"][key] for _, p in sorted(pairs.items())
                    if "dssync" in p and "ring" in p and p["ring"][key]]

        d, r = agg["dssync"], agg["ring"]
        rows.append({"workers": n, **agg,
                     "ratio_throughput": labelled(paired("throughput"), 1.0, True),
                     "ratio_sync": labelled(paired("sync_ms"), 1.0, False),
                     "ratio_comm": labelled(paired("comm_ms"), 1.0, False),
                     "ratio_bytes": d["bytes_per_step"] / r["bytes_per_step"],
                     "target_ratio_g1_over_n1": (G - 1) / (n - 1),
                     "excess_over_target_ms": d["sync_ms"] - (G - 1) / (n - 1) * r["sync_ms"]})
    return rows


def markdown(report: Dict[str, Any]) -> str:
    st = report["settings"]
    out = [f"# dssync vs ring, communication-bound ({st['model']}, {st['params']:,} parameters)", "",
           f"Command: `{report['command']}`", "",
           f"{st['steps']} steps, synthetic data, batch 32 per worker, no emulated device time, no straggler; "
           f"dssync group 2, butterfly, sync=params; {st['seeds']} seeds, order shuffled per seed (order seed "
           f"{st['order_seed']}); machine: {report['environment']['cpu_count']} cores (loopback Gloo: communication "
           "is CPU time here). Ratios dssync / ring paired per seed: median [95% bootstrap interval] label "
           "(sync: lower is better, a win is an upper end < 1).", "",
           "| N | ring sync ms | dssync sync ms | sync dssync/ring | comm only dssync/ring | target (g-1)/(N-1) "
           "| excess over target | bytes ratio | samples/s ring / dssync | throughput dssync/ring |",
           "|---|---:|---:|---|---|---:|---:|---:|---:|---|"]
    for row in report["by_workers"]:
        r, d = row["ring"], row["dssync"]
        out.append(f"| {row['workers']} | {r['sync_ms']:.2f} | {d['sync_ms']:.2f} | {fmt_interval(row['ratio_sync'], '.3f')} "
                   f"| {fmt_interval(row['ratio_comm'], '.3f')} | {row['target_ratio_g1_over_n1']:.3f} "
                   f"| {row['excess_over_target_ms']:+.2f} ms | {row['ratio_bytes']:.3f} "
                   f"| {r['throughput']:.0f} / {d['throughput']:.0f} | {fmt_interval(row['ratio_throughput'], '.3f')} |")
    out += ["", f"Bytes: {BYTES_FORMULA}.", "", "Per run:", "",
            "| N | seed | position | algorithm | samples/s | sync ms | comm ms | load before/after |",
            "|---|---|---|---|---:|---:|---:|---|"]
    for x in report["runs"]:
        out.append(f"| {x['workers']} | {x['seed']} | {x['position']} | {x['algo']} | {x['throughput']:.0f} "
                   f"| {x['sync_ms']:.2f} | {x['comm_ms']:.2f} | {x['load1_before']:.1f} / {x['load1_after']:.1f} |")
    return "\n".join(out) + "\n"


def write(report: Dict[str, Any], out: str) -> None:
    write_report(report, out, markdown)


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: 4 workers, 1 seed, 20 steps")
    ap.add_argument("--workers", type=int, nargs="+", default=None, help="worker counts (default 4 8; quick: 4)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per world size (default 5; quick: 1)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 50; quick: 20)")
    ap.add_argument("--order-seed", type=int, default=0, help="seed of the per-block run order (default 0)")
    ap.add_argument("--output-dir", default=None, help="default benchmarks/results/dssync_vs_ring/<stamp>[-quick]")
    ap.add_argument("--aggregate-only", metavar="DIR", default=None,
                    help="recompute DIR/report.{json,md} from the runs recorded in DIR/report.json; runs nothing")
    args = ap.parse_args(argv)
    if args.aggregate_only:
        with open(os.path.join(args.aggregate_only, "report.json")) as f:
            report = json.load(f)
        report["by_workers"] = aggregate(report["runs"], report["settings"]["params"])
        write(report, args.aggregate_only)
        print(markdown(report))
        return report
    workers = args.workers or ([4] if args.quick else [4, 8])
    seeds = args.seeds or (1 if args.quick else 5)
    steps = args.steps or (20 if args.quick else 50)
    if min(workers) < G or seeds < 1 or steps < 1:
        ap.error(f"--workers must each be >= {G}, --seeds and --steps >= 1 (got {workers}, {seeds}, {steps})")
    out_dir = args.output_dir or os.path.join(RESULTS, time.strftime("%Y%m%d-%H%M%S") + ("-quick" if args.quick else ""))
    command = "python -m benchmarks.dssync_vs_ring " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    started = time.time()
    trainer = ["trainer.max_epochs=1", f"trainer.max_steps={steps}", "trainer.val_check_interval=1.0"]
    runs = []
    for n in workers:
        for seed in range(seeds):
            for pos, algo in enumerate(shuffled(list(ALGOS), f"dssync_vs_ring:{args.order_seed}:{n}:{seed}")):
                r = run_one(algo, n, seed, SETTING, trainer, os.path.join(out_dir, "runs", f"N{n}_seed{seed}_{algo}"))
                r.pop("summary", None)  # the run directory is not committed; the record is
                r["position"] = pos
                runs.append(r)
                print(f"[dssync_vs_ring] N={n} seed={seed} {algo:6s} ({steps} steps): {r['throughput']:.0f} samples/s, "
                      f"sync {r['sync_ms']:.2f} ms/step (comm {r['comm_ms']:.2f}), wall {r['wall_s']:.1f} s "
                      f"+ launch {r['launch_s']:.1f} s, load {r['load1_before']:.1f}->{r['load1_after']:.1f}  "
                      f"[{time.time() - started:.0f} s elapsed]", flush=True)
    params = param_count(SETTING["hidden"])

    import horovod
    import lightning
    import torch

    report = {
        "command": command,
        "what": __doc__.strip(),
        "dssync": {"group_size": G, "schedule": "butterfly", "sync": "params"},
        "bytes_formula": BYTES_FORMULA,
        "sync_time_definition": "median over ranks of per_rank comm_s.mean + wait_s.mean (ms); comm only: comm_s.mean",
        "load_note": LOAD_NOTE,
        "settings": {**SETTING, "params": params, "model": f"MLP 40-{'-'.join(map(str, SETTING['hidden']))}-10",
                     "batch_per_worker": 32, "steps": steps, "workers": workers, "seeds": seeds,
                     "order_seed": args.order_seed, "quick": args.quick},
        "total_runtime_s": time.time() - started,
        "environment": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "lightning": lightning.__version__,
                        "horovod": horovod.__version__},
        "runs": runs,
    }
    report["by_workers"] = aggregate(runs, params)
    write(report, out_dir)
    print(markdown(report))
    print(f"results: {out_dir}", flush=True)
    return report


if __name__ == "__main__":
    main()
