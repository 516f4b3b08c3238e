"""The BOA thesis's comparison, in simulation: ``boa`` against synchronous SGD with one backup worker.

    .venv/bin/python -m benchmarks.boa_thesis_sim [--out benchmarks/results/scale]

Setting (SIMULATED, ``lightning_straggler/sim``): 8 workers of three GPU types in the 1.0 / 0.6 / 0.3
speed mix (3 x 1.0, 3 x 0.6, 2 x 0.3: ``benchmarks.matrix.speed_mix(8)``, the same cluster as the
measured matrix scenario mix3), 32 samples per worker (global batch 256), 2% compute jitter.
``boa`` re-plans every 10 steps with the strategy's own time models and solver; the baseline
aggregates the first 7 of 8 gradients each step (Chen et al. 2016). Throughput counts only samples
whose gradients reach the model, after the first 50 of 200 steps (boa's first plans).

Why the simulator cannot say +23% for this mix unless communication dominates. Per unit of per-sample
time, without communication: boa finishes every step together, so its throughput is the sum of the
speeds, 3 x 1.0 + 3 x 0.6 + 2 x 0.3 = 5.4; one backup worker drops one of the two 0.3 workers, but
the other one still sets the pace: 7 gradients of b samples per b / 0.3 seconds = 2.1. Hence
boa / backup = 5.4 / 2.1 = 2.57 (+157%); the simulator says +146% (integer batch sizes and 2% jitter
on boa's slowest worker take the rest). Communication (the same all-reduce in both) pulls the
ratio towards 8/7 (+14%: boa counts 8 batches, backup 7). The script prints the ratio over a sweep of
the communication share and of the cluster's layout, and solves for the communication share at which
the ratio is +23%. So the thesis's +23% is consistent with a communication-bound setting (the
all-reduce several times the compute of a step), or a mix in which backup workers can drop every slow
worker (e.g. one slow worker: 4 x 1.0, 3 x 0.6, 1 x 0.3), or boa losing part of its gain to time-model
error, which the simulator does not have: its compute times are exactly linear in the batch.
(We have not the thesis's exact cluster, model and network; the script states what it assumed.)
"""
from __future__ import annotations

import argparse
import json
import os

from benchmarks.matrix import speed_mix
from lightning_straggler.sim import Network, Workload, simulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "scale")
N, BATCH, PER_SAMPLE_S, STEPS, MEASURED = 8, 32, 2e-3, 200, 0.75
THESIS_GAIN = 0.23
# A network whose all-reduce costs `share` x the compute of a full-speed worker's step: beta chosen per case.
GRAD_BYTES = 1e8


def network_for(share: float) -> Network:
    full_speed_step = PER_SAMPLE_S * BATCH
    beta = share * full_speed_step / (2 * (N - 1) / N * GRAD_BYTES)
    return Network(f"comm={share:g}x", 0.0, beta)


def compare(factors, share: float) -> dict:
    workload = Workload(world_size=N, batch_per_worker=BATCH, per_sample_s=PER_SAMPLE_S, steps=STEPS,
                        grad_bytes=GRAD_BYTES, straggler={"scenario": "static", "factors": factors},
                        jitter_cv=0.02, seed=1)
    network = network_for(share)
    boa = simulate("boa", workload, network, window_steps=10)
    backup = simulate("backup", workload, network, backups=1)
    ring = simulate("ring", workload, network)
    tp = {name: r.tail_throughput(MEASURED) for name, r in (("boa", boa), ("backup1", backup), ("ring", ring))}
    return {"factors": [round(f, 3) for f in factors], "comm_share": share, "throughput": tp,
            "boa_vs_backup1": tp["boa"] / tp["backup1"] - 1.0, "boa_vs_ring": tp["boa"] / tp["ring"] - 1.0,
            "boa_batch_sizes": boa.events[-1]["batch_sizes"] if boa.events else None}


def share_for_gain(factors, gain: float) -> float:
    """Communication share at which boa / backup1 - 1 equals ``gain`` (bisection; the ratio falls with it)."""
    lo, hi = 0.0, 64.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if compare(factors, mid)["boa_vs_backup1"] > gain:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    mix = speed_mix(N)
    one_slow = [1.0] * 4 + [1 / 0.6] * 3 + [1 / 0.3]
    layouts = {"3x1.0 3x0.6 2x0.3 (mix3)": mix, "4x1.0 3x0.6 1x0.3": one_slow}
    rows = []
    print("boa vs synchronous SGD with 1 backup worker, 8 workers, simulated (throughput after warm-up)\n")
    print("| cluster | all-reduce / full-speed compute | boa | backup1 | ring | boa vs backup1 | boa vs ring |")
    print("|---|---|---|---|---|---|---|")
    for label, factors in layouts.items():
        for share in (0.0, 0.1, 0.5, 1.0, 2.0, 5.0):
            r = compare(factors, share)
            r["cluster"] = label
            rows.append(r)
            tp = r["throughput"]
            print(f"| {label} | {share:g} | {tp['boa']:,.0f} | {tp['backup1']:,.0f} | {tp['ring']:,.0f} | "
                  f"{r['boa_vs_backup1']:+.0%} | {r['boa_vs_ring']:+.0%} |")
    solved = {label: share_for_gain(f, THESIS_GAIN) for label, f in layouts.items()}
    headline = rows[0]
    print(f"\nSimulator, thesis setting without communication: boa {headline['boa_vs_backup1']:+.0%} over one backup "
          f"worker (thesis: {THESIS_GAIN:+.0%}); closed form 5.4 / 2.1 - 1 = {5.4 / 2.1 - 1:+.0%}.")
    for label, share in solved.items():
        print(f"+23% needs the all-reduce to cost {share:.2f}x a full-speed worker's compute per step ({label}).")
    print("boa's final batch sizes (mix, no comm):", headline["boa_batch_sizes"])
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "boa_thesis_sim.json")
    with open(path, "w") as f:
        json.dump({"what": __doc__, "rows": rows, "comm_share_for_thesis_gain": solved, "thesis_gain": THESIS_GAIN},
                  f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
