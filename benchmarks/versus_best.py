"""One algorithm against the better of others, per seed, from a committed matrix grid (no new runs).

The matrix reports each algorithm against ring. A question like "is adaptive 1.15 x faster than the
better of boa and dpar?" needs, per seed, X / max(Y_1, Y_2, ...) of the same world size, scenario and
seed: that ratio's median, 95% bootstrap interval and label come from ``benchmarks.stats`` (a win when
the whole interval is above 1; the target is met when the interval's lower end is at least
``--target``). With ``--reference-grid`` it also compares X's final accuracy, per seed, with the
straggler-free ring (``scenario none``) of another grid measured with the same settings and seeds.

    python -m benchmarks.versus_best benchmarks/results/matrix/<grid> --algorithm adaptive --against boa dpar \
        [--target 1.15] [--reference-grid benchmarks/results/matrix/<none grid>]

writes ``versus_best_<algorithm>.json`` and ``.md`` into the grid directory.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.matrix import RUN_RE, RUNS_JSONL
from benchmarks.report import write_rescore
from benchmarks.stats import fmt_interval, labelled


def read_runs(grid: str) -> dict[tuple[str, str, int, int], dict[str, Any]]:
    """(algorithm, scenario, world size, seed) -> trimmed summary, for every run of ``grid``'s runs.jsonl."""
    path = os.path.join(grid, RUNS_JSONL)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{grid} has no {RUNS_JSONL}")
    out = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            m = RUN_RE.match(os.path.basename(os.path.dirname(r["path"])))
            if m is not None and r.get("summary"):
                out[(m["algorithm"], m["scenario"], int(m["world"]), int(m["seed"]))] = r["summary"]
    return out


def compare(runs: dict, algorithm: str, against: Sequence[str], target: float,
            reference: dict | None = None) -> list[dict[str, Any]]:
    cells = []
    for scenario, n in sorted({(k[1], k[2]) for k in runs if k[0] == algorithm}, key=lambda c: (c[1], c[0])):
        seeds = sorted(k[3] for k in runs if k[:3] == (algorithm, scenario, n))
        ratios, best_of, acc = [], [], []
        for sd in seeds:
            mine = runs[(algorithm, scenario, n, sd)]
            others = {a: runs[(a, scenario, n, sd)] for a in against if (a, scenario, n, sd) in runs}
            if len(others) == len(against):
                best = max(others, key=lambda a: others[a]["throughput_samples_per_s"])
                ratios.append(mine["throughput_samples_per_s"] / others[best]["throughput_samples_per_s"])
                best_of.append(best)
            ring = (reference or {}).get(("ring", "none", n, sd))
            if ring is not None and mine["val_acc"] is not None and ring["val_acc"] is not None:
                acc.append(100.0 * (mine["val_acc"] - ring["val_acc"]))
        ci = labelled(ratios)
        cells.append({"scenario": scenario, "world_size": n, "seeds": seeds, "per_seed_ratio": ratios,
                      "per_seed_best": best_of, "ratio": ci, "target": target,
                      "target_met": ci.get("lo") is not None and ci["lo"] >= target,
                      "target_met_by_median": ci.get("median") is not None and ci["median"] >= target,
                      "acc_vs_straggler_free_ring_points": labelled(acc, reference=0.0) if acc else None,
                      "per_seed_acc_points": acc})
    return cells


def to_markdown(cells: list[dict[str, Any]], algorithm: str, against: Sequence[str], argv: Sequence[str]) -> str:
    vs = " / ".join(against)
    lines = [f"# {algorithm} against the better of {vs}", "",
             f"`python -m benchmarks.versus_best {' '.join(argv)}`: per seed {algorithm}'s throughput over the best of "
             f"{vs} in the same world size, scenario and seed; median [95% bootstrap] label (benchmarks/stats.py); "
             "target met when the interval's lower end reaches it.", "",
             f"| N | scenario | {algorithm} / best of {vs} | target | met (interval / median) | best per seed | "
             "accuracy − straggler-free ring (points) |", "|---:|---|---|---:|---|---|---|"]
    for c in cells:
        acc = fmt_interval(c["acc_vs_straggler_free_ring_points"], "+.1f") if c["acc_vs_straggler_free_ring_points"] else "-"
        met = f"{'yes' if c['target_met'] else 'no'} / {'yes' if c['target_met_by_median'] else 'no'}"
        lines.append(f"| {c['world_size']} | {c['scenario']} | {fmt_interval(c['ratio'])} | {c['target']} | {met} | "
                     f"{', '.join(c['per_seed_best'])} | {acc} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.versus_best", description=__doc__.split("\n\n")[0])
    p.add_argument("grid")
    p.add_argument("--algorithm", required=True)
    p.add_argument("--against", nargs="+", required=True)
    p.add_argument("--target", type=float, default=1.0, help="the ratio the interval's lower end must reach")
    p.add_argument("--reference-grid", default=None, help="a grid with straggler-free ring runs (same settings, seeds)")
    a = p.parse_args(argv)
    try:
        runs = read_runs(a.grid)
        reference = read_runs(a.reference_grid) if a.reference_grid else None
    except FileNotFoundError as e:
        p.error(str(e))
    if not any(k[0] == a.algorithm for k in runs):
        p.error(f"--algorithm {a.algorithm}: no runs of it in {a.grid}")
    cells = compare(runs, a.algorithm, a.against, a.target, reference)
    write_rescore(os.path.join(a.grid, f"versus_best_{a.algorithm}"), {"argv": argv, "cells": cells},
                  to_markdown(cells, a.algorithm, a.against, argv))
    return cells


if __name__ == "__main__":
    main()
