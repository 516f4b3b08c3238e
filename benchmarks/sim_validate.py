"""The scale simulator against MEASURED runs: predicted vs measured throughput for every cell.

    .venv/bin/python -m benchmarks.sim_validate [--roots DIR ...] [--out benchmarks/results/scale]

Reads every run's ``summary.json`` under the roots (default: ``benchmarks/results/matrix/*/runs`` and
the older ``benchmarks/results/{dpar,boa,dssync,ring_runs}``; a matrix's own aggregate summary.json is
skipped: it has no ``per_rank``), and writes ``sim_validate.json`` and ``sim_validate.md``.

Calibration, from a measured ``ring`` run with NO straggler at the same world size, model and batch
(preferring one from the same benchmark invocation, then the same emulated device time; several
candidates: the median of each constant):

* ``overhead_s`` (the real CPU compute of a step, slowed by a factor like the device time) =
  mean over ranks of compute_s.mean - device_ms_per_sample x batch;
* ``jitter_cv`` = mean over ranks of ln(compute p95 / p50) / 1.645 (a lognormal's spread);
* all-reduce: ``alpha`` = t_ar / (2 (N - 1)), ``beta`` = 0, with t_ar = mean over ranks of
  (comm_s.total - wait_s.total) / steps (as ``benchmarks/matrix.py``): the gradients of these MLPs are
  small and the loopback "network" is CPU time, so latency, not bandwidth, is what is left;
* ``loop_overhead_s`` = measured wall_s / steps minus the simulated ring step without it: whatever
  the ring run spent besides compute and transfer (Lightning's loop, validation, logging), per step.

Then every other cell is predicted from its own config (straggler schedule, emulated device time,
batch, steps, epochs and validation points, algorithm settings) and the calibration of its world
size; error = predicted / measured throughput - 1 (target |error| <= 15%). The calibration runs
themselves are listed with error 0 ("calibration"). A second column, ``own-none``, re-fits only
``loop_overhead_s`` on the SAME algorithm's no-straggler run at that N (where one exists): the
difference between the two columns is the algorithm's own protocol cost, which ring cannot reveal.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
from typing import Any

from lightning_straggler.sim import Network, Workload, simulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
DEFAULT_ROOTS = [os.path.join(RESULTS, "matrix"), *(os.path.join(RESULTS, d) for d in ("dpar", "boa", "dssync", "ring_runs"))]
OUT = os.path.join(RESULTS, "scale")
TARGET = 0.15


# --- reading runs ---------------------------------------------------------------------------------
def load_runs(roots: list[str]) -> list[dict[str, Any]]:
    runs = []
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "**", "summary.json"), recursive=True)):
            if os.sep + "solo" + os.sep in path:
                continue  # matrix's 1-worker calibration runs
            with open(path) as f:
                s = json.load(f)
            if not s.get("per_rank") or not s.get("config") or not s.get("wall_s"):
                continue
            s["path"] = os.path.relpath(path, ROOT)
            runs.append(s)
    return runs


def positions(s: dict[str, Any]) -> int:
    return max(int(r["steps"]) for r in s["per_rank"].values())


def model_key(s: dict[str, Any]) -> str:
    m, d = s["config"]["model"], s["config"]["data"]
    return f"{m['name']}{m.get('hidden')}/{d['name']}/b{d['batch_size']}"


def scenario_label(cfg: dict[str, Any]) -> str:
    kind = cfg.get("scenario", "none")
    if kind == "static":
        return "static[" + ",".join(f"{f:g}" for f in cfg["factors"]) + "]"
    if kind == "transient":
        return "transient[" + ";".join(f"r{e['rank']}x{e['factor']:g}@{e['start_step']}-{e['end_step']}"
                                       for e in cfg["events"]) + "]"
    if kind == "random":
        return f"random[p={cfg['probability']},seed={cfg['seed']}]"
    return "none"


def mean_over_ranks(s: dict[str, Any], fn) -> float:
    return statistics.mean(fn(r) for r in s["per_rank"].values() if r.get("steps"))


def local_batch(s: dict[str, Any]) -> int:
    return int(s["config"]["data"]["batch_size"])


def epoch_and_validation(s: dict[str, Any]) -> tuple[int, int]:
    cfg, n = s["config"], int(s["world_size"])
    data, trainer = cfg["data"], cfg["trainer"]
    global_batch = int(cfg["algorithm"].get("global_batch") or 0) or n * local_batch(s)
    per_epoch = max(1, int(0.8 * data["num_samples"]) // global_batch)  # 80% train split, drop_last
    v = trainer.get("val_check_interval", 1.0)
    val_every = int(per_epoch * v) if isinstance(v, float) and v <= 1.0 else int(v)
    return per_epoch, max(1, val_every)


# --- calibration -----------------------------------------------------------------------------------
def calibration_constants(s: dict[str, Any]) -> dict[str, float]:
    n, b = int(s["world_size"]), local_batch(s)
    device_s = float(s["config"]["straggler"].get("device_ms_per_sample", 0.0)) / 1e3
    compute = mean_over_ranks(s, lambda r: r["compute_s"]["mean"])
    jitter = mean_over_ranks(s, lambda r: math.log(max(r["compute_s"]["p95"], 1e-9) / max(r["compute_s"]["p50"], 1e-9)) / 1.645)
    t_ar = mean_over_ranks(s, lambda r: max(0.0, r["comm_s"]["total"] - r["wait_s"]["total"]) / r["steps"])
    consts = {"overhead_s": max(0.0, compute - device_s * b), "jitter_cv": max(0.0, jitter),
              "alpha_s": t_ar / (2 * (n - 1)) if n > 1 else 0.0}
    probe = workload_for(s, consts | {"loop_overhead_s": 0.0})
    ring_step = simulate("ring", probe, Network("calibrated", consts["alpha_s"], 0.0)).wall_s / probe.steps
    consts["loop_overhead_s"] = max(0.0, float(s["wall_s"]) / positions(s) - ring_step)
    return consts


def workload_for(s: dict[str, Any], consts: dict[str, float]) -> Workload:
    per_epoch, val_every = epoch_and_validation(s)
    straggler = dict(s["config"]["straggler"])
    return Workload(world_size=int(s["world_size"]), batch_per_worker=local_batch(s),
                    per_sample_s=float(straggler.get("device_ms_per_sample", 0.0)) / 1e3,
                    overhead_s=consts["overhead_s"], loop_overhead_s=consts["loop_overhead_s"], steps=positions(s),
                    grad_bytes=1e6, straggler=straggler, jitter_cv=consts["jitter_cv"], seed=int(s["config"].get("seed", 0)),
                    steps_per_epoch=per_epoch, val_every_steps=val_every)


def algorithm_settings(s: dict[str, Any]) -> dict[str, Any]:
    from lightning_straggler.policies.awar import AwarThresholds
    from lightning_straggler.policies.dpar import DparThresholds

    a, name = dict(s["config"]["algorithm"]), s["algorithm"]
    if name == "dpar":
        keys = ("slow_ratio", "strikeout_ratio", "strikeout_windows", "readmit_ratio", "readmit_windows", "min_active",
                "data_penalty")
        return {"window_steps": a["window_steps"], "thresholds": DparThresholds(**{k: a[k] for k in keys if k in a})}
    if name == "awar":
        return {"period_steps": a["period_steps"], "weighting": a.get("weighting", "updates"),
                "thresholds": AwarThresholds(a["slow_ratio"], a["recover_ratio"], a["min_group"])}
    if name == "boa":
        keys = ("window_steps", "rebalance_gain", "history_windows", "global_batch", "min_local_batch",
                "max_local_batch", "tune_workers", "initial_batch_sizes")
        return {k: a[k] for k in keys if k in a}
    if name == "dssync":
        keys = ("group_size", "schedule", "num_partitions", "seed", "global_every_steps")
        return {k: a[k] for k in keys if k in a}
    return {}


def is_none_run(s: dict[str, Any]) -> bool:
    return s["config"]["straggler"].get("scenario", "none") == "none"


def pick_calibration(s: dict[str, Any], candidates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ring no-straggler runs of the same world size, model and batch: same invocation first, then the
    same emulated device time, then any."""
    same = [c for c in candidates if c["world_size"] == s["world_size"] and model_key(c) == model_key(s)]
    folder = os.path.dirname(os.path.dirname(s["path"]))
    device = s["config"]["straggler"].get("device_ms_per_sample", 0.0)
    for pool in ([c for c in same if os.path.dirname(os.path.dirname(c["path"])) == folder],
                 [c for c in same if c["config"]["straggler"].get("device_ms_per_sample", 0.0) == device], same):
        if pool:
            return pool
    return []


def merged_constants(runs: list[dict[str, Any]]) -> dict[str, float]:
    each = [calibration_constants(r) for r in runs]
    return {k: statistics.median(c[k] for c in each) for k in each[0]}


# --- prediction -----------------------------------------------------------------------------------
def predict(s: dict[str, Any], consts: dict[str, float]) -> float:
    workload = workload_for(s, consts)
    network = Network("calibrated", consts["alpha_s"], 0.0)
    return simulate(s["algorithm"], workload, network, **algorithm_settings(s)).throughput_samples_per_s


def validate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ring_none = [r for r in runs if r["algorithm"] == "ring" and is_none_run(r)]
    cells = []
    for s in runs:
        measured = float(s["throughput_samples_per_s"])
        cell = {"run": s["path"], "algorithm": s["algorithm"], "world_size": s["world_size"],
                "scenario": scenario_label(s["config"]["straggler"]), "model": model_key(s),
                "device_ms_per_sample": s["config"]["straggler"].get("device_ms_per_sample", 0.0),
                "measured_samples_per_s": measured}
        pool = pick_calibration(s, ring_none)
        if not pool:
            cells.append(cell | {"status": "no ring no-straggler run at this world size and model"})
            continue
        if s["algorithm"] == "ring" and is_none_run(s) and s in pool:
            pool = [s]  # a calibration run is predicted from itself: error 0 by construction
            cell["status"] = "calibration"
        else:
            cell["status"] = "predicted"
        consts = merged_constants(pool)
        predicted = predict(s, consts)
        cell |= {"calibrated_from": [p["path"] for p in pool], "calibration": consts,
                 "predicted_samples_per_s": predicted, "error": predicted / measured - 1.0}
        own = [r for r in runs if r["algorithm"] == s["algorithm"] and is_none_run(r) and r is not s
               and r["world_size"] == s["world_size"] and model_key(r) == model_key(s)]
        if own and s["algorithm"] != "ring" and not is_none_run(s):
            refit = dict(consts)
            losses = [float(o["wall_s"]) / positions(o) - _step_without_loop(o, consts) for o in own]
            refit["loop_overhead_s"] = max(0.0, statistics.median(losses))
            cell["own_none_error"] = predict(s, refit) / measured - 1.0
        cells.append(cell)
    return cells


def _step_without_loop(s: dict[str, Any], consts: dict[str, float]) -> float:
    """Simulated seconds per position of run ``s``'s algorithm without the per-step loop overhead."""
    workload = workload_for(s, consts | {"loop_overhead_s": 0.0})
    result = simulate(s["algorithm"], workload, Network("calibrated", consts["alpha_s"], 0.0), **algorithm_settings(s))
    return result.wall_s / workload.steps


def mark_superseded(cells: list[dict[str, Any]]) -> None:
    """A cell is superseded when a later invocation of the same benchmark (results/<bench>/<stamp>/...)
    measured the same algorithm, world size, scenario, device time and model: the code changed in
    between (e.g. boa's time-model fix, dpar's first version), so only the latest invocation tells what
    the current code does."""
    def key(c):
        parts = c["run"].split(os.sep)
        return (parts[2], c["algorithm"], c["world_size"], c["scenario"], c["device_ms_per_sample"], c["model"])

    latest: dict[tuple, str] = {}
    for c in cells:
        stamp = c["run"].split(os.sep)[3]
        latest[key(c)] = max(latest.get(key(c), stamp), stamp)
    for c in cells:
        c["superseded"] = c["run"].split(os.sep)[3] < latest[key(c)]


def score(cells: list[dict[str, Any]]) -> str:
    scored = [c for c in cells if c.get("status") == "predicted"]
    if not scored:
        return "no predicted cells"
    within = [c for c in scored if abs(c["error"]) <= TARGET]
    return (f"{len(within)} of {len(scored)} within ±{TARGET:.0%}, median |error| "
            f"{statistics.median(abs(c['error']) for c in scored):.1%}")


# --- report ---------------------------------------------------------------------------------------
def markdown(cells: list[dict[str, Any]]) -> str:
    current = [c for c in cells if not c["superseded"]]
    lines = ["# Simulator vs measured throughput", "",
             (f"All predicted cells: {score(cells)}. Latest invocation of each benchmark only (not superseded): "
             f"{score(current)}."), "",
             "| run | algorithm | N | scenario | device ms | measured | predicted | error | own-none error | status |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(cells, key=lambda c: (c["world_size"], c["algorithm"], c["scenario"], c["run"])):
        pred = f"{c['predicted_samples_per_s']:,.0f}" if "predicted_samples_per_s" in c else "-"
        err = f"{c['error']:+.1%}" if "error" in c else "-"
        own = f"{c['own_none_error']:+.1%}" if "own_none_error" in c else "-"
        flag = "" if c.get("status") != "predicted" or abs(c["error"]) <= TARGET else " **miss**"
        status = c["status"] + (", superseded" if c["superseded"] else "")
        run = os.path.dirname(c["run"]).replace("benchmarks/results/", "")
        lines.append(f"| {run} | {c['algorithm']} | {c['world_size']} | {c['scenario']} | {c['device_ms_per_sample']:g} | "
                     f"{c['measured_samples_per_s']:,.0f} | {pred} | {err}{flag} | {own} | {status} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--roots", nargs="+", default=DEFAULT_ROOTS)
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    runs = load_runs(args.roots)
    cells = validate(runs)
    mark_superseded(cells)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sim_validate.json"), "w") as f:
        json.dump({"what": __doc__, "target_abs_error": TARGET, "cells": cells}, f, indent=1)
    text = markdown(cells)
    with open(os.path.join(args.out, "sim_validate.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {args.out}/sim_validate.{{json,md}}")


if __name__ == "__main__":
    main()
