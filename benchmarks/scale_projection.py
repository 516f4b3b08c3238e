"""Projected throughput and efficiency of every algorithm from 16 to 1024 workers (the scale simulator).

    .venv/bin/python -m benchmarks.scale_projection [--quick] [--steps 160] [--out benchmarks/results/scale]

Writes ``projection.json`` (every cell), ``projection.md`` (tables) and ``projection.png`` under the
output folder. Everything here is SIMULATED (``lightning_straggler/sim``): no process is started.

Workloads (assumptions, per worker, data-parallel, fp32, one V100-class GPU per worker):

* ``resnet50``: 25.6 M parameters -> 102.4 MB of fp32 gradients; 3.0 ms of forward+backward per
  224x224 image (about 330 images/s, V100 fp32) plus 10 ms fixed per step (optimizer, launches);
  64 images per worker.
* ``bert-large``: 340 M parameters -> 1.36 GB of gradients; 14 ms per sequence of 128 tokens
  (about 70 sequences/s, V100 fp32) plus 25 ms fixed per step; 16 sequences per worker.

Networks: 25 Gbit/s Ethernet (alpha 30 us) and 200 Gbit/s InfiniBand HDR (alpha 5 us); see
``sim/network.py`` for the collective formulas. Compute and communication do not overlap in the
model, and concurrent groups do not contend for links.

Scenarios, scaled from the benchmark grid (the same dict shapes as ``conf/straggler/*.yaml``):

* ``none``;
* ``static-mix``: the 1.0 / 0.6 / 0.3 speed mix of ``benchmarks.matrix.speed_mix`` (scenario mix3) (a quarter of
  the workers at 0.3, then half the rest at 0.6);
* ``transient-1pct``: 1% of the workers (at least one, seeded choice) 4x slower for steps
  [steps/4, steps/4 + steps/3);
* ``random``: ``conf/straggler/random.yaml`` as it is (each worker, per window of 20 steps, slow with
  probability 0.1, by 2-4x, for 10-40 steps), so the number of stragglers grows with N;
* ``permanent-10x``: one worker 10x slower throughout;
* ``mix-transient``: the matrix's ``mixtransient`` (``benchmarks.matrix.mixtransient_events``): the static mix
  above and worker 0, a fast one, 10x slower for the middle third of the run (the case ``adaptive`` is for).

Per-step compute has lognormal jitter with a 2% coefficient of variation. Algorithms with their
``conf/algorithm`` defaults: ``dssync`` (groups of 2, butterfly), ``boa`` (re-plan every 10 steps),
``dpar`` (windows of 20, early boundaries after 3 slow steps), ``awar`` (merge every 20 steps, likewise),
``adaptive`` (BOA re-planned 2 steps after a speed change, and every 10 steps); baselines: synchronous SGD with backup
workers (b = max(1, N/32), i.e. about 3% as in Chen et al. 2016) and asynchronous SGD (throughput
only: staleness costs accuracy, which is not modelled).

Reported throughput is AFTER WARM-UP: samples counted over the last 3/4 of each run divided by their
time (the first windows, where dpar/awar/boa are still measuring, weigh far more in a run of 160 steps
than in a real training run; the transient event starts exactly where the measurement starts, so it
is fully inside it). The whole-run figure is in the JSON as well. Efficiency =
throughput / ideal, ideal = G / (G / sum_i rate_i + allreduce(N, gradient bytes)) (``sim/result.py``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Any

import numpy as np

from benchmarks.matrix import mixtransient_events, speed_mix
from lightning_straggler.sim import ETHERNET_25G, INFINIBAND_200G, Workload, simulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "scale")

MODELS = {
    "resnet50": {"params": 25.6e6, "per_sample_ms": 3.0, "overhead_ms": 10.0, "batch": 64},
    "bert-large": {"params": 340e6, "per_sample_ms": 14.0, "overhead_ms": 25.0, "batch": 16},
}
NETWORKS = [ETHERNET_25G, INFINIBAND_200G]
SIZES = [16, 32, 64, 128, 256, 512, 1024]
SCENARIOS = ["none", "static-mix", "transient-1pct", "random", "permanent-10x", "mix-transient"]
ALGORITHMS = ["ring", "dssync", "boa", "dpar", "awar", "adaptive", "backup", "async"]
JITTER_CV = 0.02
MEASURED_FRACTION = 0.75  # throughput over the last 3/4 of a run: after dpar's/awar's first windows and boa's first plans
RANDOM_CONF = {"scenario": "random", "seed": 0, "probability": 0.1, "factor_min": 2.0, "factor_max": 4.0,
               "duration_min": 10, "duration_max": 40, "window_steps": 20}


def scenario(name: str, n: int, steps: int) -> dict[str, Any]:
    if name == "none":
        return {"scenario": "none"}
    if name == "static-mix":
        return {"scenario": "static", "factors": speed_mix(n)}
    if name == "transient-1pct":
        k = max(1, round(0.01 * n))
        ranks = np.random.default_rng([n, 1]).choice(n, size=k, replace=False)
        start = steps // 4
        return {"scenario": "transient", "events": [{"rank": int(r), "factor": 4.0, "start_step": start,
                                                     "end_step": start + steps // 3} for r in sorted(ranks)]}
    if name == "random":
        return dict(RANDOM_CONF)
    if name == "permanent-10x":
        return {"scenario": "static", "factors": [1.0] * (n - 1) + [10.0]}
    if name == "mix-transient":
        return {"scenario": "transient", "events": mixtransient_events(n, steps)}
    raise ValueError(f"unknown scenario {name!r}")


def algorithm_params(name: str, n: int) -> dict[str, Any]:
    return {"dssync": {"group_size": 2}, "boa": {"window_steps": 10}, "dpar": {"window_steps": 20},
            "awar": {"period_steps": 20}, "backup": {"backups": max(1, n // 32)}}.get(name, {})


def run_grid(sizes: list[int], steps: int, models: list[str], scenarios: list[str]) -> list[dict[str, Any]]:
    cells = []
    started = time.time()
    for model in models:
        spec = MODELS[model]
        for n in sizes:
            for scen in scenarios:
                workload = Workload(world_size=n, batch_per_worker=spec["batch"], per_sample_s=spec["per_sample_ms"] / 1e3,
                                    overhead_s=spec["overhead_ms"] / 1e3, steps=steps, grad_bytes=4 * spec["params"],
                                    straggler=scenario(scen, n, steps), jitter_cv=JITTER_CV, seed=n)
                for network in NETWORKS:
                    for algo in ALGORITHMS:
                        result = simulate(algo, workload, network, **algorithm_params(algo, n))
                        s = result.summary()
                        after_warmup = result.tail_throughput(MEASURED_FRACTION)
                        cells.append({"model": model, "network": network.name, "world_size": n, "scenario": scen,
                                      "algorithm": algo, "params": algorithm_params(algo, n),
                                      "throughput_samples_per_s": after_warmup,
                                      "efficiency": after_warmup / s["ideal_samples_per_s"],
                                      "whole_run_samples_per_s": s["throughput_samples_per_s"],
                                      "whole_run_efficiency": s["efficiency"], "ideal_samples_per_s": s["ideal_samples_per_s"],
                                      "step_s": s["step_s"], "notes": s["notes"]})
            print(f"[{time.time() - started:6.1f}s] {model} N={n} done", flush=True)
    return cells


def ratio_to_ring(cells: list[dict[str, Any]]) -> None:
    ring = {(c["model"], c["network"], c["world_size"], c["scenario"]): c["throughput_samples_per_s"]
            for c in cells if c["algorithm"] == "ring"}
    for c in cells:
        base = ring[(c["model"], c["network"], c["world_size"], c["scenario"])]
        c["vs_ring"] = c["throughput_samples_per_s"] / base if base > 0 else math.nan


def markdown(cells: list[dict[str, Any]], sizes: list[int], steps: int) -> str:
    lines = ["# Scale projection (simulated)", "",
             (f"Throughput after warm-up (the last 3/4 of {steps}-step runs, samples/s) and efficiency = "
              "throughput / ideal. Assumptions: see the docstring of `benchmarks/scale_projection.py`. `async` "
              "ignores staleness; `backup` aggregates the first N-b of N gradients."), ""]
    index = {(c["model"], c["network"], c["scenario"], c["algorithm"], c["world_size"]): c for c in cells}
    models = sorted({c["model"] for c in cells}, key=list(MODELS).index)
    networks = [n.name for n in NETWORKS]
    scenarios = [s for s in SCENARIOS if any(c["scenario"] == s for c in cells)]
    lines += ["## Best synchronous algorithm (excluding async) and its efficiency", "",
              "| model | network | scenario | " + " | ".join(f"N={n}" for n in sizes) + " |",
              "|---|---|---|" + "---|" * len(sizes)]
    for model in models:
        for net in networks:
            for scen in scenarios:
                row = []
                for n in sizes:
                    options = [index[(model, net, scen, a, n)] for a in ALGORITHMS if a != "async"]
                    best = max(options, key=lambda c: c["throughput_samples_per_s"])
                    row.append(f"{best['algorithm']} {best['efficiency']:.2f}")
                lines.append(f"| {model} | {net} | {scen} | " + " | ".join(row) + " |")
    for model in models:
        for net in networks:
            lines += ["", f"## {model}, {net}: throughput (samples/s) / efficiency", ""]
            for scen in scenarios:
                lines += [f"**{scen}**", "", "| algorithm | " + " | ".join(f"N={n}" for n in sizes) + " |",
                          "|---|" + "---|" * len(sizes)]
                for algo in ALGORITHMS:
                    row = [f"{index[(model, net, scen, algo, n)]['throughput_samples_per_s']:,.0f} / "
                           f"{index[(model, net, scen, algo, n)]['efficiency']:.2f}" for n in sizes]
                    label = "backup (b=max(1,N/32))" if algo == "backup" else algo
                    lines.append(f"| {label} | " + " | ".join(row) + " |")
                lines.append("")
    return "\n".join(lines) + "\n"


def plot(cells: list[dict[str, Any]], sizes: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({c["model"] for c in cells}, key=list(MODELS).index)
    columns = [(m, n.name) for m in models for n in NETWORKS]
    scenarios = [s for s in SCENARIOS if any(c["scenario"] == s for c in cells)]
    fig, axes = plt.subplots(len(scenarios), len(columns), figsize=(4.2 * len(columns), 2.8 * len(scenarios)),
                             sharex=True, squeeze=False)
    for i, scen in enumerate(scenarios):
        for j, (model, net) in enumerate(columns):
            ax = axes[i][j]
            for algo in ALGORITHMS:
                ys = [next(c["efficiency"] for c in cells if (c["model"], c["network"], c["scenario"], c["algorithm"],
                                                             c["world_size"]) == (model, net, scen, algo, n)) for n in sizes]
                ax.plot(sizes, ys, marker="o", ms=3, label=algo, linestyle="--" if algo in ("backup", "async") else "-")
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.8)  # dssync and async can exceed 1: the ideal pays a full all-reduce
            ax.grid(alpha=0.3)
            if i == 0:
                ax.set_title(f"{model}, {net}", fontsize=9)
            if j == 0:
                ax.set_ylabel(f"{scen}\nefficiency", fontsize=9)
            if i == len(scenarios) - 1:
                ax.set_xlabel("workers")
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle("Simulated efficiency = throughput / ideal (after warm-up)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16..128 workers, 80 steps, resnet50 only")
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    sizes = SIZES[:4] if args.quick else SIZES
    steps = 80 if args.quick else args.steps
    models = ["resnet50"] if args.quick else list(MODELS)
    os.makedirs(args.out, exist_ok=True)
    cells = run_grid(sizes, steps, models, SCENARIOS)
    ratio_to_ring(cells)
    record = {"what": __doc__, "steps": steps, "sizes": sizes, "models": {m: MODELS[m] for m in models},
              "networks": [n.describe() for n in NETWORKS], "jitter_cv": JITTER_CV, "cells": cells}
    with open(os.path.join(args.out, "projection.json"), "w") as f:
        json.dump(record, f, indent=1)
    with open(os.path.join(args.out, "projection.md"), "w") as f:
        f.write(markdown(cells, sizes, steps))
    plot(cells, sizes, os.path.join(args.out, "projection.png"))
    print(markdown(cells, sizes, steps).split("\n## ")[1])
    print(f"wrote {args.out}/projection.{{json,md,png}}")


if __name__ == "__main__":
    main()
