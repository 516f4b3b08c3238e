"""One algorithm against the better of others, per seed, from a committed matrix grid (no new runs).

The matrix reports each algorithm against ring. A question like "is adaptive 1.15 x faster than the
better of boa and dpar?" needs, per seed, X / max(Y_1, Y_2, ...) of the same world size, scenario and
seed: that ratio's median, 95% bootstrap interval and label come from ``benchmarks.stats`` (a win when
the whole interval is above 1; the target is met when the interval's lower end is at least
``--target``). With ``--reference-grid`` it also compares X's final accuracy, per seed, with the
straggler-free ring (``scenario none``) of another grid measured with the same settings and seeds.

``--within-noise`` (grids measured with ``--noise``) replaces the fixed target by the machine's own noise
in each cell: the 95% interval of ring#2 / ring (ring run twice in every seed block). "No worse than the
best by more than the noise" is met when the median ratio is at least that interval's lower end; the
stricter reading (the whole interval at least that) is reported beside it. The best of several noisy
runs is itself biased upwards, which makes this rule harder to meet, not easier.

``--best-by median`` picks one strategy per cell instead of one per seed: the candidate with the highest
median throughput over the cell's seeds (the strategy a user who knew the scenario would choose), and
divides by it in every seed. The default, ``--best-by seed``, takes the faster candidate of each seed block.

    python -m benchmarks.versus_best benchmarks/results/matrix/<grid> --algorithm adaptive --against boa dpar \
        [--target 1.15 | --within-noise] [--best-by seed|median] [--reference-grid benchmarks/results/matrix/<none grid>]

writes ``versus_best_<algorithm>.json`` and ``.md`` into the grid directory (``_by_median`` added with
``--best-by median``; ``--tag T`` adds ``_T``, so comparisons against other sets do not overwrite each other).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.matrix import REP_RE, RUN_RE, RUNS_JSONL
from benchmarks.report import write_rescore
from benchmarks.stats import fmt_interval, labelled


def read_runs(grid: str, repeats: bool = False) -> dict[tuple[str, str, int, int], dict[str, Any]]:
    """(algorithm, scenario, world size, seed) -> trimmed summary, for every run of ``grid``'s runs.jsonl;
    with ``repeats``, for the repeated runs instead (``--noise``'s ring#2: <run name>_rep2)."""
    path = os.path.join(grid, RUNS_JSONL)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{grid} has no {RUNS_JSONL}")
    out = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            name = os.path.basename(os.path.dirname(r["path"]))
            if repeats:
                rep = REP_RE.match(name)
                name = rep["base"] if rep is not None and rep["rep"] == "2" else ""
            m = RUN_RE.match(name)
            if m is not None and r.get("summary"):
                out[(m["algorithm"], m["scenario"], int(m["world"]), int(m["seed"]))] = r["summary"]
    return out


def noise_interval(runs: dict, repeats: dict, scenario: str, n: int) -> dict[str, Any]:
    """ring#2 / ring per seed of one cell, labelled like any ratio (benchmarks.stats)."""
    pairs = [repeats[k]["throughput_samples_per_s"] / runs[k]["throughput_samples_per_s"]
             for k in sorted(repeats) if k[:3] == ("ring", scenario, n) and k in runs]
    return labelled(pairs)


BEST_BY = ("seed", "median")


def best_by_median(runs: dict, against: Sequence[str], scenario: str, n: int, seeds: Sequence[int]) -> str | None:
    """The candidate with the highest median throughput over the seeds where every candidate ran."""
    full = [sd for sd in seeds if all((a, scenario, n, sd) in runs for a in against)]
    if not full:
        return None
    return max(against, key=lambda a: statistics.median(runs[(a, scenario, n, sd)]["throughput_samples_per_s"]
                                                        for sd in full))


def compare(runs: dict, algorithm: str, against: Sequence[str], target: float,
            reference: dict | None = None, repeats: dict | None = None,
            best_by: str = "seed") -> list[dict[str, Any]]:
    """Per cell: X / best of ``against`` (per seed, or the best by median over the cell's seeds). With
    ``repeats`` (ring#2 runs) the target is the cell's noise, the lower end of ring#2 / ring's interval,
    instead of ``target``."""
    if best_by not in BEST_BY:
        raise ValueError(f"best_by must be one of {', '.join(BEST_BY)}, got {best_by!r}")
    cells = []
    for scenario, n in sorted({(k[1], k[2]) for k in runs if k[0] == algorithm}, key=lambda c: (c[1], c[0])):
        seeds = sorted(k[3] for k in runs if k[:3] == (algorithm, scenario, n))
        chosen = best_by_median(runs, against, scenario, n, seeds) if best_by == "median" else None
        ratios, best_of, acc = [], [], []
        for sd in seeds:
            mine = runs[(algorithm, scenario, n, sd)]
            others = {a: runs[(a, scenario, n, sd)] for a in against if (a, scenario, n, sd) in runs}
            if len(others) == len(against):
                best = chosen or max(others, key=lambda a: others[a]["throughput_samples_per_s"])
                ratios.append(mine["throughput_samples_per_s"] / others[best]["throughput_samples_per_s"])
                best_of.append(best)
            ring = (reference or {}).get(("ring", "none", n, sd))
            if ring is not None and mine["val_acc"] is not None and ring["val_acc"] is not None:
                acc.append(100.0 * (mine["val_acc"] - ring["val_acc"]))
        ci = labelled(ratios)
        noise = noise_interval(runs, repeats, scenario, n) if repeats is not None else None
        if noise is not None:
            target = noise.get("lo")
            if target is None:
                raise ValueError(f"--within-noise: N={n} {scenario} has fewer than 3 ring#2 / ring pairs")
        cells.append({"scenario": scenario, "world_size": n, "seeds": seeds, "best_by": best_by, "per_seed_ratio": ratios,
                      "per_seed_best": best_of, "ratio": ci, "target": target, "noise": noise,
                      "target_met": ci.get("lo") is not None and ci["lo"] >= target,
                      "target_met_by_median": ci.get("median") is not None and ci["median"] >= target,
                      "acc_vs_straggler_free_ring_points": labelled(acc, reference=0.0) if acc else None,
                      "per_seed_acc_points": acc})
    return cells


def to_markdown(cells: list[dict[str, Any]], algorithm: str, against: Sequence[str], argv: Sequence[str],
                best_by: str = "seed") -> str:
    vs = " / ".join(against)
    which = (f"the best of {vs} in the same world size, scenario and seed" if best_by == "seed" else
             f"the one of {vs} with the highest median throughput in the cell (the same strategy in every seed)")
    lines = [f"# {algorithm} against the better of {vs}", "",
             f"`python -m benchmarks.versus_best {' '.join(argv)}`: per seed {algorithm}'s throughput over {which}; "
             "median [95% bootstrap] label (benchmarks/stats.py); "
             "target met when the interval's lower end reaches it"
             + ("; target = the lower end of the cell's ring#2 / ring interval (the machine's noise), the rule "
                "met when the median reaches it." if cells and cells[0]["noise"] is not None else "."), "",
             f"| N | scenario | {algorithm} / best of {vs} | target | met (interval / median) | best per seed | "
             "accuracy − straggler-free ring (points) |", "|---:|---|---|---:|---|---|---|"]
    for c in cells:
        acc = fmt_interval(c["acc_vs_straggler_free_ring_points"], "+.1f") if c["acc_vs_straggler_free_ring_points"] else "-"
        met = f"{'yes' if c['target_met'] else 'no'} / {'yes' if c['target_met_by_median'] else 'no'}"
        target = (f"{c['target']:.2f} (noise {fmt_interval(c['noise'])})" if c["noise"] is not None
                  else f"{c['target']}")
        lines.append(f"| {c['world_size']} | {c['scenario']} | {fmt_interval(c['ratio'])} | {target} | {met} | "
                     f"{', '.join(c['per_seed_best'])} | {acc} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.versus_best", description=__doc__.split("\n\n")[0])
    p.add_argument("grid")
    p.add_argument("--algorithm", required=True)
    p.add_argument("--against", nargs="+", required=True)
    goal = p.add_mutually_exclusive_group()
    goal.add_argument("--target", type=float, default=1.0, help="the ratio the interval's lower end must reach")
    goal.add_argument("--within-noise", action="store_true",
                      help="target per cell = the lower end of ring#2 / ring's interval (a grid run with --noise)")
    p.add_argument("--best-by", choices=BEST_BY, default="seed",
                   help="seed: the faster candidate of each seed block (default); median: per cell the candidate "
                        "with the highest median throughput, the same one in every seed")
    p.add_argument("--reference-grid", default=None, help="a grid with straggler-free ring runs (same settings, seeds)")
    p.add_argument("--tag", default="", help="added to the output files' names (versus_best_<algorithm>[_by_median]_<tag>)")
    a = p.parse_args(argv)
    try:
        runs = read_runs(a.grid)
        reference = read_runs(a.reference_grid) if a.reference_grid else None
        repeats = read_runs(a.grid, repeats=True) if a.within_noise else None
    except FileNotFoundError as e:
        p.error(str(e))
    if not any(k[0] == a.algorithm for k in runs):
        p.error(f"--algorithm {a.algorithm}: no runs of it in {a.grid}")
    if repeats is not None and not repeats:
        p.error(f"--within-noise: {a.grid} has no ring#2 runs (measure the grid with --noise)")
    try:
        cells = compare(runs, a.algorithm, a.against, a.target, reference, repeats, a.best_by)
    except ValueError as e:
        p.error(str(e))
    name = f"versus_best_{a.algorithm}" + ("_by_median" if a.best_by == "median" else "") + (f"_{a.tag}" if a.tag else "")
    write_rescore(os.path.join(a.grid, name), {"argv": argv, "cells": cells},
                  to_markdown(cells, a.algorithm, a.against, argv, a.best_by))
    return cells


if __name__ == "__main__":
    main()
