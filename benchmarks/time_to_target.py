"""Time to a second target accuracy, from a committed matrix grid's runs (no new runs).

A grid measures time to its ``--target-acc``; every run also keeps its validation history
(``runs.jsonl``: the elapsed training time and accuracy at each validation). This scores the same runs
against another target by the same rule (training time at the first validation at or above it,
``lightning_straggler.summary.time_to_target``), paired with ring's run of the same world size,
scenario and seed, with ``benchmarks.stats``' median, interval and label (lower is better). It also
applies the matrix's TARGET_RULE to the new target where the grid has straggler-free ring runs.

    python -m benchmarks.time_to_target benchmarks/results/matrix/<grid> --target 0.5

writes ``ttt_<target>.json`` and ``ttt_<target>.md`` into the grid directory.
"""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

from benchmarks.matrix import RUN_RE, RUNS_JSONL, TARGET_RULE, target_check
from benchmarks.report import write_rescore
from benchmarks.stats import fmt_interval, labelled
from lightning_straggler.summary import time_to_target


def rescore(runs: Sequence[dict[str, Any]], target: float) -> dict[str, Any]:
    """``runs``: runs.jsonl records ({"path", "summary"}). Per run its time to ``target``; per cell
    (world size, scenario, algorithm) the paired ratio to ring's."""
    per_run = []
    for r in runs:
        s = r["summary"]
        m = RUN_RE.match(os.path.basename(os.path.dirname(r["path"])))
        if m is None:
            continue  # solo calibration runs and the --noise replica of ring (<run>_rep2): not cells here
        per_run.append({"algorithm": m["algorithm"], "scenario": m["scenario"], "world_size": int(m["world"]),
                        "seed": int(m["seed"]), "wall_s": s["wall_s"],
                        "time_to_target_s": time_to_target(s.get("val_history", []), target)})
    ring = {(p["world_size"], p["scenario"], p["seed"]): p for p in per_run if p["algorithm"] == "ring"}
    cells = []
    for n, sc, algo in sorted({(p["world_size"], p["scenario"], p["algorithm"]) for p in per_run}):
        ratios, reached = [], 0
        for p in per_run:
            if (p["world_size"], p["scenario"], p["algorithm"]) != (n, sc, algo):
                continue
            reached += p["time_to_target_s"] is not None
            g = ring.get((n, sc, p["seed"]))
            ok = g is not None and p["time_to_target_s"] is not None and g["time_to_target_s"]
            ratios.append(p["time_to_target_s"] / g["time_to_target_s"] if ok else None)
        seeds = sum(1 for p in per_run if (p["world_size"], p["scenario"], p["algorithm"]) == (n, sc, algo))
        cells.append({"world_size": n, "scenario": sc, "algorithm": algo, "seeds": seeds, "reached": reached,
                      "ttt_ratio_to_ring": None if algo == "ring" else labelled(ratios, higher_is_better=False)})
    return {"target_acc": target, "rule": TARGET_RULE, "target_check": target_check(per_run), "cells": cells,
            "per_run": per_run}


def to_markdown(result: dict[str, Any], grid: str) -> str:
    t = result["target_acc"]
    lines = [f"# Time to {t} in {grid}", "",
             f"Re-scored from the grid's runs.jsonl (`python -m benchmarks.time_to_target {grid} --target {t}`): "
             "training time at the first validation with val_acc >= target; ratio to ring's run of the same "
             "world size, scenario and seed (lower is better), median [95% bootstrap] and label (benchmarks/stats.py).",
             ""]
    for n, check in result["target_check"].items():
        lines.append(f"- {n}: straggler-free ring reaches {t} at "
                     + ", ".join("never" if f is None else f"{f:.2f}" for f in check["fraction_of_wall"])
                     + f" of its training time: {'fair' if check['fair'] else 'NOT fair'} by the rule")
    if not result["target_check"]:
        lines.append("- no straggler-free ring runs in this grid: the two-thirds rule cannot be checked here")
    lines += ["", f"| N | scenario | algorithm | reached | time to {t} / ring |", "|---:|---|---|---:|---|"]
    for c in result["cells"]:
        ratio = "1 (reference)" if c["ttt_ratio_to_ring"] is None else fmt_interval(c["ttt_ratio_to_ring"])
        lines.append(f"| {c['world_size']} | {c['scenario']} | {c['algorithm']} | {c['reached']}/{c['seeds']} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.time_to_target", description=__doc__.split("\n\n")[0])
    p.add_argument("grid", help="a matrix result directory with runs.jsonl")
    p.add_argument("--target", type=float, required=True, help="target validation accuracy in (0, 1]")
    a = p.parse_args(argv)
    if not 0 < a.target <= 1:
        p.error(f"--target must be in (0, 1] (got {a.target})")
    path = os.path.join(a.grid, RUNS_JSONL)
    if not os.path.exists(path):
        p.error(f"{a.grid} has no {RUNS_JSONL}")
    with open(path) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    result = rescore(runs, a.target)
    write_rescore(os.path.join(a.grid, f"ttt_{a.target:g}"), result, to_markdown(result, a.grid.rstrip("/")))
    return result


if __name__ == "__main__":
    main()
