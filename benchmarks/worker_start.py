"""How long a local launch takes to start its workers: Python's fork server (the launcher's default) vs
``spawn`` (every worker imports torch, Lightning and Horovod itself).

Each run is a fresh ``python`` process (as a user's script is) that calls ``Trainer.fit`` twice with
``strategy="ring"``, ``devices`` workers and one optimizer step, and times each ``fit`` call (launch,
rendezvous, one step, results back): the first ``fit`` pays for starting the fork server, the second
finds it running. Per repeat both start methods run, in a seeded random order; the figure is the per-repeat
ratio spawn / forkserver with a 95% percentile bootstrap interval (``benchmarks.matrix.paired_bootstrap``).

    python -m benchmarks.worker_start --devices 8 --repeats 5 --out benchmarks/results/worker-start

Writes ``worker_start.json`` (every run's record and the command) and ``worker_start.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from typing import Any, Dict, List

METHODS = ("spawn", "forkserver")


def _child(method: str, devices: int) -> None:
    # (imports timed too: what a user's script pays before its first fit)
    t0 = time.perf_counter()
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_straggler.launcher as launcher
    from lightning_straggler.models import Classifier

    launcher.WORKER_START_METHOD = method  # read when the strategy builds its launcher
    imported = time.perf_counter() - t0
    data = TensorDataset(torch.randn(64 * devices, 8), torch.randint(0, 2, (64 * devices,)))
    fits = []
    for _ in range(2):
        model = Classifier("mlp", 8, 2, hidden=[8], optimizer="sgd", lr=0.1)
        trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ring", max_steps=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             limit_val_batches=0)
        t = time.perf_counter()
        trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=8))
        fits.append(time.perf_counter() - t)
    print("RESULT " + json.dumps({"method": method, "devices": devices, "import_s": imported,
                                  "first_fit_s": fits[0], "second_fit_s": fits[1]}), flush=True)


def run_one(method: str, devices: int, timeout_s: float) -> Dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.worker_start", "--child", method,
                           "--devices", str(devices)], capture_output=True, text=True, timeout=timeout_s)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"worker_start child ({method}, {devices} workers) failed with exit code "
                       f"{proc.returncode}:\n{proc.stderr[-3000:]}")


def summarise(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    from benchmarks.matrix import paired_bootstrap

    by_repeat: Dict[int, Dict[str, Dict[str, Any]]] = {}
    for r in records:
        by_repeat.setdefault(r["repeat"], {})[r["method"]] = r
    out: Dict[str, Any] = {}
    for key in ("first_fit_s", "second_fit_s"):
        ratios = [rep["spawn"][key] / rep["forkserver"][key] for rep in by_repeat.values()
                  if "spawn" in rep and "forkserver" in rep]
        medians = {m: sorted(r[key] for r in records if r["method"] == m) for m in METHODS}
        out[key] = {"ratio_spawn_over_forkserver": paired_bootstrap(ratios),
                    "median_s": {m: v[len(v) // 2] if v else None for m, v in medians.items()}}
    return out


def table(summary: Dict[str, Any], command: str, devices: int, repeats: int) -> str:
    lines = [f"# Worker start-up: fork server vs spawn, {devices} workers, {repeats} repeats", "",
             f"Command: `{command}`", "",
             "Each `fit` is one optimizer step with `strategy=\"ring\"` in a fresh process; the second `fit` of "
             "the same process finds the fork server running.", "",
             "| fit | spawn median (s) | forkserver median (s) | spawn / forkserver: median [95% interval] |",
             "|---|---|---|---|"]
    for key, name in (("first_fit_s", "first"), ("second_fit_s", "second")):
        s = summary[key]
        ci = s["ratio_spawn_over_forkserver"]
        interval = f"[{ci['lo']:.2f}, {ci['hi']:.2f}]" if ci["lo"] is not None else ci["interval"]
        lines.append(f"| {name} | {s['median_s']['spawn']:.1f} | {s['median_s']['forkserver']:.1f} | "
                     f"{ci['median']:.2f} {interval} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="seeds the run order of each repeat")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    parser.add_argument("--out", default="benchmarks/results/worker-start")
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.devices < 1:
        parser.error(f"--devices must be >= 1 (got {args.devices})")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1 (got {args.repeats})")
    if args.child:
        _child(args.child, args.devices)
        return 0
    command = "python -m benchmarks.worker_start " + " ".join(argv if argv is not None else sys.argv[1:])
    records = []
    rng = random.Random(f"worker-start:{args.seed}")
    for repeat in range(args.repeats):
        order = list(METHODS)
        rng.shuffle(order)
        for method in order:
            rec = run_one(method, args.devices, args.timeout_s)
            rec.update(repeat=repeat, order=order)
            records.append(rec)
            print(f"[worker_start] repeat {repeat + 1}/{args.repeats} {method}: first fit {rec['first_fit_s']:.1f} s, "
                  f"second {rec['second_fit_s']:.1f} s", flush=True)
    summary = summarise(records)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "worker_start.json"), "w") as f:
        json.dump({"command": command, "devices": args.devices, "repeats": args.repeats, "seed": args.seed,
                   "summary": summary, "records": records}, f, indent=1)
    text = table(summary, command, args.devices, args.repeats)
    with open(os.path.join(args.out, "worker_start.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
