"""How much of what ring loses to stragglers an algorithm wins back, per seed, from a committed matrix grid.

Rule (fixed before the random-slowdown grid it was written for had results): in each (world size,
scenario, seed) block the matrix gives ring's throughput, the algorithm's, and the block's ideal (the
sum-of-rates ideal of README ("The ideal", under Benchmarks), the same number for every algorithm of the block, since it
depends on the schedule only). What ring loses is ``ideal - ring``; the algorithm recovers

    recovered = (X - ring) / (ideal - ring)

of it (1: the ideal; 0: no better than ring; negative: worse than ring). Per cell: the median over
seeds with its 95% bootstrap interval (``benchmarks.stats``); the target is met when the interval's lower
end reaches ``--target`` (the median is reported beside it). A block where ring is within 1% of the ideal
has nothing to recover and is left out (said in the output). With ``--reference-grid`` (one or more grids
with straggler-free ring runs, same settings and seeds) it also gives X's final accuracy minus that
ring's, per seed, in points.

    python -m benchmarks.recovery benchmarks/results/matrix/<grid> --algorithm adaptive [--target 0.6] \
        [--reference-grid GRID ...]

writes ``recovery_<algorithm>.json`` and ``.md`` into the grid directory.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.report import write_rescore
from benchmarks.stats import fmt_interval, labelled
from benchmarks.versus_best import read_runs

NOTHING_TO_RECOVER = 0.01  # ring within 1% of the ideal: the ratio would divide by noise


def read_blocks(grid: str) -> dict[tuple[str, str, int, int], dict[str, Any]]:
    """(algorithm, scenario, world size, seed) -> the aggregated run record (throughput, ideal, val_acc)
    of ``grid``'s summary.json."""
    path = os.path.join(grid, "summary.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{grid} has no summary.json")
    with open(path) as f:
        summary = json.load(f)
    return {(r["algorithm"], r["scenario"], int(r["world_size"]), int(r["seed"])): r
            for r in summary["runs"] if r.get("throughput") is not None}


def recovered_fraction(x: float, ring: float, ideal: float) -> float | None:
    """(x - ring) / (ideal - ring); None when ring is within NOTHING_TO_RECOVER of the ideal."""
    if ideal - ring <= NOTHING_TO_RECOVER * ideal:
        return None
    return (x - ring) / (ideal - ring)


def score(blocks: dict, algorithm: str, target: float, reference: dict | None = None) -> list[dict[str, Any]]:
    cells = []
    for scenario, n in sorted({(k[1], k[2]) for k in blocks if k[0] == algorithm}, key=lambda c: (c[1], c[0])):
        seeds = sorted(k[3] for k in blocks if k[:3] == (algorithm, scenario, n))
        fractions, skipped, acc, per_seed = [], [], [], []
        for sd in seeds:
            mine, ring = blocks[(algorithm, scenario, n, sd)], blocks.get(("ring", scenario, n, sd))
            if ring is None or mine.get("ideal") is None:
                skipped.append({"seed": sd, "why": "no ring run or no ideal in this block"})
                continue
            f = recovered_fraction(mine["throughput"], ring["throughput"], mine["ideal"])
            per_seed.append({"seed": sd, "x": mine["throughput"], "ring": ring["throughput"], "ideal": mine["ideal"],
                             "recovered": f})
            if f is None:
                skipped.append({"seed": sd, "why": f"ring within {NOTHING_TO_RECOVER:.0%} of the ideal"})
            else:
                fractions.append(f)
            ref = (reference or {}).get(("ring", "none", n, sd))
            if ref is not None and mine.get("val_acc") is not None and ref.get("val_acc") is not None:
                acc.append(100.0 * (mine["val_acc"] - ref["val_acc"]))
        ci = labelled(fractions, reference=0.0)
        cells.append({"scenario": scenario, "world_size": n, "seeds": seeds, "per_seed": per_seed, "skipped": skipped,
                      "recovered": ci, "target": target,
                      "target_met": ci.get("lo") is not None and ci["lo"] >= target,
                      "target_met_by_median": ci.get("median") is not None and ci["median"] >= target,
                      "acc_vs_straggler_free_ring_points": labelled(acc, reference=0.0) if acc else None,
                      "per_seed_acc_points": acc})
    return cells


def to_markdown(cells: list[dict[str, Any]], algorithm: str, argv: Sequence[str]) -> str:
    lines = [f"# How much of ring's loss {algorithm} recovers", "",
             f"`python -m benchmarks.recovery {' '.join(argv)}`: per seed (X − ring) / (ideal − ring), X = {algorithm}'s "
             "throughput, ring's and the ideal of the same block (summary.json); median [95% bootstrap] label "
             "(win: the interval above 0, i.e. better than ring); target met when the interval's lower end reaches it.",
             "", "| N | scenario | recovered | target | met (interval / median) | per seed (X, ring, ideal samples/s) | "
             "accuracy − straggler-free ring (points) |", "|---:|---|---|---:|---|---|---|"]
    for c in cells:
        acc = fmt_interval(c["acc_vs_straggler_free_ring_points"], "+.1f") if c["acc_vs_straggler_free_ring_points"] else "-"
        met = f"{'yes' if c['target_met'] else 'no'} / {'yes' if c['target_met_by_median'] else 'no'}"
        seeds = "; ".join(f"{p['seed']}: {'-' if p['recovered'] is None else format(p['recovered'], '.2f')} "
                          f"({p['x']:.0f}, {p['ring']:.0f}, {p['ideal']:.0f})" for p in c["per_seed"])
        lines.append(f"| {c['world_size']} | {c['scenario']} | {fmt_interval(c['recovered'])} | {c['target']} | {met} | "
                     f"{seeds} | {acc} |")
        for s in c["skipped"]:
            lines.append(f"|  |  | seed {s['seed']} left out: {s['why']} |  |  |  |  |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.recovery", description=__doc__.split("\n\n")[0])
    p.add_argument("grid")
    p.add_argument("--algorithm", required=True)
    p.add_argument("--target", type=float, default=0.6, help="the fraction the interval's lower end must reach")
    p.add_argument("--reference-grid", nargs="+", default=[],
                   help="grids with straggler-free ring runs (same settings, seeds)")
    a = p.parse_args(argv)
    try:
        blocks = read_blocks(a.grid)
        reference: dict = {}
        for g in a.reference_grid:
            reference.update(read_runs(g))
    except FileNotFoundError as e:
        p.error(str(e))
    if not any(k[0] == a.algorithm for k in blocks):
        p.error(f"--algorithm {a.algorithm}: no runs of it in {a.grid}")
    cells = score(blocks, a.algorithm, a.target, reference or None)
    write_rescore(os.path.join(a.grid, f"recovery_{a.algorithm}"), {"argv": argv, "cells": cells},
                  to_markdown(cells, a.algorithm, argv))
    return cells


if __name__ == "__main__":
    main()
