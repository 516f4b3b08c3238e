"""Which strategy for this job? ``python -m lightning_straggler.advise RUN_DIR [--plot] [--json]``.

Reads a main-job output directory (``summary.json`` and ``step_times.csv.gz``, every rank's compute,
communication and samples of every step, written by the profiler), replays the job in the simulator
(``lightning_straggler.sim``) under every strategy (ring, dpar, awar, dssync, boa, adaptive) with the measured
per-rank per-step compute times as the workload, and prints each strategy's predicted throughput and
efficiency, the recommendation with its Hydra override, the evidence (which ranks were slow, how much,
and whether persistently, in one stretch or in scattered episodes), what the run cannot tell, and the
simulator's error as measured by ``benchmarks/sim_validate.py`` (read from its committed output).

The replay (``replay``):

* factors F[r, s] = measured compute of rank r at step s / a full-speed step's compute at that rank's
  batch. A full-speed step at batch b costs ``overhead + per_sample x b``: with emulated device time
  (``straggler.device_ms_per_sample`` > 0) per_sample is that time and the overhead the rest of the
  fastest rank's median step; without, compute is taken as proportional to the batch (overhead 0);
  the fastest rank is the one with the smallest median of its normalised times. Batches a rank passed
  over (dpar / awar) have no time: they take the rank's nearest measured step's factor (and are said so).
* the network and the per-step loop overhead: ``sim.calibration.calibration_constants`` (the rules of
  ``benchmarks/sim_validate.py``) with the measured factors; the all-reduce time per step is the mean
  over steps of the transfer time (the fastest member's time in the step's largest group, scaled from a
  group of g to all N by (N - 1) / (g - 1)); the loop overhead is fitted so that the replay of the run's
  own algorithm takes the measured wall time.
* what a ring run cannot show, each strategy's own costs (a control collective's fixed cost at boundaries,
  merges, global averages and boa's exchange; per-step bookkeeping beyond ring's): with ``--overheads auto``
  (the default) taken from the committed ``benchmarks.sim_validate`` output where it fitted them at the run's
  world size (its "own-none" calibration on the strategy's no-straggler benchmark runs; ``strategy_overheads``),
  else charged their latency only (``--overheads none``: always).
* every strategy with its default settings (``conf/algorithm/<name>.yaml``), the run's own with the
  run's settings.

Runs without ``step_times.csv.gz`` (made before it existed) are replayed from the configured straggler
schedule, with the fastest rank's median step and jitter (``--source schedule`` forces it); that
replay cannot see slowness that was not configured and says so.

Recommendation: the strategy with the highest predicted throughput if it beats ring by more than
``--min-gain`` (default 5%), else ring. Throughput only: the strategies' effect on accuracy (omitted
samples, group averages) is not modelled.

``--evaluate-grid MATRIX_DIR`` runs the advisor on every ring run of a ``benchmarks.matrix`` directory and
compares its recommendation with the strategy that measured best on the same scenario and seed.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np

from lightning_straggler.profiling import STEP_TIMES_FILE, StepRecord, read_step_times
from lightning_straggler.sim import factor_matrix, schedule_from_config, simulate
from lightning_straggler.sim.calibration import (
    algorithm_settings,
    calibration_constants,
    local_batch,
    network_for,
    positions,
    workload_for,
)

STRATEGIES = ("ring", "dpar", "awar", "dssync", "boa", "adaptive")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VALIDATION_GLOB = os.path.join(ROOT, "benchmarks", "results", "**", "sim_validate.json")
SLOW_RATIO = 1.5  # a rank is slow at a step when its (smoothed) compute is this many times the fastest rank's
PERSISTENT_SHARE = 0.8  # slow in at least this share of the steps: persistent
SMOOTH = 5  # steps of the rolling median the classification looks at
MIN_EPISODE = SMOOTH  # steps; shorter slow stretches are noise (a burst of load, a validation)
MERGE_GAP = 2  # slow stretches this close are one episode


class AdviseError(ValueError):
    """The run directory cannot be advised on (the message names the problem)."""


# --- reading a run ----------------------------------------------------------------------------------
def load_run(run_dir: str) -> tuple[dict[str, Any], Optional[list[StepRecord]]]:
    """(summary, step records or None when the run has none)."""
    if not os.path.isdir(run_dir):
        raise AdviseError(f"{run_dir}: not a directory (give a main job's output directory)")
    path = os.path.join(run_dir, "summary.json")
    if not os.path.isfile(path):
        raise AdviseError(f"{run_dir}: no summary.json (not a finished main-job output directory)")
    try:
        with open(path) as f:
            s = json.load(f)
    except (OSError, ValueError) as e:
        raise AdviseError(f"{path}: not readable JSON ({e})") from None
    missing = [k for k in ("algorithm", "world_size", "wall_s", "per_rank", "config") if not s.get(k)]
    if missing:
        raise AdviseError(f"{path}: lacks {', '.join(missing)} (a summary.json of python -m lightning_straggler.train has them)")
    if int(s["world_size"]) < 2:
        raise AdviseError(f"{path}: the run had {s['world_size']} worker; the strategies differ only with 2 or more "
                          "workers (run with trainer.devices >= 2)")
    steps_path = os.path.join(run_dir, STEP_TIMES_FILE)
    records = None
    if os.path.isfile(steps_path):
        try:
            records = read_step_times(steps_path)
        except (OSError, ValueError, EOFError) as e:
            raise AdviseError(f"{steps_path}: unreadable ({e})") from None
        if not records:
            raise AdviseError(f"{steps_path}: holds no steps")
    return s, records


# --- the measured workload ----------------------------------------------------------------------------
@dataclass
class Measured:
    """The replay's inputs, from a run."""

    source: str  # "step_times" (every step measured) or "schedule" (the configured schedule)
    factors: np.ndarray  # [rank, position], filled where unmeasured
    measured: np.ndarray  # [rank, position] bool: a compute time was recorded
    base_compute_s: float  # a full-speed step at the run's local batch
    per_sample_s: float
    allreduce_s: Optional[float]  # all-reduce over all N per step (None: the summary's comm means)
    jitter_cv: float = 0.0
    reference_rank: int = 0
    local_steps: dict = field(default_factory=dict)  # rank -> steps it computed outside the main group
    group_sizes: list = field(default_factory=list)  # distinct sizes of the groups that all-reduced


def _fill(row: np.ndarray) -> np.ndarray:
    """NaNs take the nearest earlier value (the first ones the nearest later one)."""
    out = row.copy()
    idx = np.where(np.isfinite(out))[0]
    if idx.size == 0:
        return np.ones_like(out)
    for j in range(out.size):
        if not np.isfinite(out[j]):
            before = idx[idx < j]
            out[j] = out[before[-1]] if before.size else out[idx[0]]
    return out


def measured_from_records(s: dict[str, Any], records: list[StepRecord]) -> Measured:
    n, p_count, b0 = int(s["world_size"]), positions(s), local_batch(s)
    device_s = float(s["config"]["straggler"].get("device_ms_per_sample", 0.0)) / 1e3
    compute = np.full((n, p_count), np.nan)
    batch = np.full((n, p_count), np.nan)
    by_step: dict[int, dict[int, list[StepRecord]]] = {}
    for r in records:
        if 0 <= r.rank < n and 0 <= r.step < p_count:
            compute[r.rank, r.step], batch[r.rank, r.step] = r.compute_s, max(1, r.samples)
            by_step.setdefault(r.step, {}).setdefault(r.group_leader, []).append(r)
    measured = np.isfinite(compute)
    if not measured.any(axis=1).all():
        lacking = [r for r in range(n) if not measured[r].any()]
        raise AdviseError(f"{STEP_TIMES_FILE}: no step of rank(s) {', '.join(map(str, lacking))}")

    def median_unit(rank: int, overhead: float, per_sample: float) -> float:
        m = measured[rank]
        return float(np.median(compute[rank, m] / (overhead + per_sample * batch[rank, m])))

    if device_s > 0:  # emulated device time per sample known: the rest of a full-speed step is fixed
        per_sample, overhead = device_s, 0.0
        for _ in range(3):
            ref = min(range(n), key=lambda r: median_unit(r, overhead, per_sample))
            m = measured[ref]
            overhead = max(0.0, float(np.median(compute[ref, m] - per_sample * batch[ref, m])))
    else:  # proportional to the batch
        overhead = 0.0
        ref = min(range(n), key=lambda r: float(np.median(compute[r, measured[r]] / batch[r, measured[r]])))
        per_sample = float(np.median(compute[ref, measured[ref]] / batch[ref, measured[ref]]))
    if per_sample <= 0 and overhead <= 0:
        raise AdviseError(f"{STEP_TIMES_FILE}: the fastest rank's steps took no time")
    raw = compute / (overhead + per_sample * np.where(measured, batch, b0))
    factors = np.vstack([_fill(raw[r]) for r in range(n)])
    factors = np.maximum(factors, 1e-6)
    # the all-reduce: per step, the transfer of the largest group (its fastest member's time), scaled to N
    transfers, sizes, local = [], set(), {r: 0 for r in range(n)}
    for step, groups in by_step.items():
        # the step's main group: the largest, and of equal ones the fastest (the stragglers are the ones left out)
        biggest = max(groups.values(), key=lambda g: (len(g), -min(m.compute_s for m in g)))
        for members in groups.values():
            if members is not biggest and len(members) == 1:
                local[members[0].rank] += 1
        g = len(biggest)
        if g >= 2:
            sizes.add(g)
            transfers.append(min(m.comm_s for m in biggest) * (n - 1) / (g - 1))
    # who was left out, by the run's own decisions where it logged them (dpar transitions, awar classes): with
    # 2 workers the group and the straggler are both groups of one
    left_out = {int(e["rank"]) for e in s.get("events", []) if "rank" in e and (
        e.get("kind") == "transition" and e.get("to_state") != "active"
        or e.get("kind") == "classification" and e.get("to_state") == "straggler")}
    return Measured("step_times", factors, measured, overhead + per_sample * b0, per_sample,
                    float(np.mean(transfers)) if transfers else 0.0, 0.0, ref,
                    {r: k for r, k in local.items() if k and (not left_out or r in left_out)}, sorted(sizes))


def measured_from_schedule(s: dict[str, Any]) -> Measured:
    """No per-step records: the configured straggler schedule, the fastest rank's median and jitter."""
    n, p_count, b0 = int(s["world_size"]), positions(s), local_batch(s)
    device_s = float(s["config"]["straggler"].get("device_ms_per_sample", 0.0)) / 1e3
    factors = factor_matrix(schedule_from_config(s["config"]["straggler"]), n, p_count)
    per_rank = {int(k): v for k, v in s["per_rank"].items() if v.get("steps")}
    # each rank's median step relative to its configured median factor: the fastest is the reference
    norm = {r: per_rank[r]["compute_s"]["p50"] / float(np.median(factors[r])) for r in per_rank}
    ref = min(norm, key=norm.get)
    base = norm[ref]
    p50, p95 = per_rank[ref]["compute_s"]["p50"], per_rank[ref]["compute_s"]["p95"]
    jitter = max(0.0, float(np.log(max(p95, 1e-9) / max(p50, 1e-9)) / 1.645))
    per_sample = device_s if device_s > 0 else base / b0
    return Measured("schedule", factors, np.zeros_like(factors, dtype=bool), base, per_sample, None, jitter, ref)


# --- straggler classification -------------------------------------------------------------------------
def _rolling_nanmedian(row: np.ndarray, k: int) -> np.ndarray:
    out = np.full(row.size, np.nan)
    h = k // 2
    for j in range(row.size):
        w = row[max(0, j - h):j + h + 1]
        w = w[np.isfinite(w)]
        if w.size:
            out[j] = np.median(w)
    return out


def _episodes(slow: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) stretches of slow steps, gaps up to MERGE_GAP merged, those under MIN_EPISODE dropped."""
    runs, start = [], None
    for j, x in enumerate(list(slow) + [False]):
        if x and start is None:
            start = j
        elif not x and start is not None:
            runs.append([start, j])
            start = None
    merged: list[list[int]] = []
    for a, b in runs:
        if merged and a - merged[-1][1] <= MERGE_GAP:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged if b - a >= MIN_EPISODE]


def classify(factors: np.ndarray, measured: Optional[np.ndarray] = None, slow_ratio: float = SLOW_RATIO) -> list[dict]:
    """Per rank: kind (persistent / transient / random / none), the slowdown, the slow steps.

    A rank is slow at a step when its compute (rolling median over SMOOTH steps) is ``slow_ratio`` x or
    more the fastest rank's at that step (so a slowdown of the whole machine slows nobody)."""
    f = np.where(measured, factors, np.nan) if measured is not None and measured.any() else factors.astype(float)
    smooth = np.vstack([_rolling_nanmedian(row, SMOOTH) for row in f])
    floor = np.nanmin(smooth, axis=0)
    ratio = smooth / floor
    out = []
    for r in range(f.shape[0]):
        valid = np.isfinite(ratio[r])
        eps = _episodes(np.where(valid, ratio[r] >= slow_ratio, False))
        slow_steps = sum(b - a for a, b in eps)
        share = slow_steps / max(1, int(valid.sum()))
        in_eps = np.concatenate([ratio[r, a:b] for a, b in eps]) if eps else np.array([])
        in_eps = in_eps[np.isfinite(in_eps)]
        kind = ("none" if not eps else "persistent" if share >= PERSISTENT_SHARE
                else "transient" if len(eps) == 1 else "random")
        out.append({"rank": r, "kind": kind, "slowdown": float(np.median(in_eps)) if in_eps.size else 1.0,
                    "share": share, "episodes": [[int(a), int(b)] for a, b in eps],
                    "median_ratio": float(np.nanmedian(ratio[r])) if valid.any() else 1.0})
    return out


def evidence_line(c: dict, steps: int) -> str:
    pct = f"{100 * c['share']:.0f}% of steps"
    if c["kind"] == "persistent":
        return f"rank {c['rank']} was {c['slowdown']:.1f}x slower in {pct}: persistent"
    if c["kind"] == "transient":
        a, b = c["episodes"][0]
        return f"rank {c['rank']} was {c['slowdown']:.1f}x slower in steps {a}-{b - 1} ({pct}, one stretch): transient"
    if c["kind"] == "random":
        eps = ", ".join(f"{a}-{b - 1}" for a, b in c["episodes"][:6]) + (", ..." if len(c["episodes"]) > 6 else "")
        return (f"rank {c['rank']} was {c['slowdown']:.1f}x slower in {len(c['episodes'])} separate episodes "
                f"(steps {eps}; {pct}): random")
    return ""


# --- the replay -------------------------------------------------------------------------------------
def default_settings(name: str, s: dict[str, Any]) -> dict[str, Any]:
    """The simulator's settings for ``name``: the run's own if it ran ``name``, else the config defaults."""
    if s["algorithm"] == name:
        return algorithm_settings(s)
    from lightning_straggler.config import ALGORITHM_SCHEMAS

    return algorithm_settings({"algorithm": name, "config": {"algorithm": asdict(ALGORITHM_SCHEMAS[name]())}})


def replay(s: dict[str, Any], m: Measured, overheads: Optional[dict[str, dict[str, Any]]] = None
           ) -> tuple[dict[str, float], Any, Any, dict[str, Any]]:
    """(constants, workload, network, {strategy: SimResult}). ``overheads`` (``strategy_overheads``): per
    strategy, a control-call cost and a per-step cost relative to ring's, added to what this run shows."""
    own = s["algorithm"] if s["algorithm"] in STRATEGIES else "ring"  # ddp: lock-step like ring
    consts = calibration_constants(s, factors=m.factors, base_compute_s=m.base_compute_s, per_sample_s=m.per_sample_s,
                                   allreduce_s=m.allreduce_s, fit_on=own, fit_settings=default_settings(own, s),
                                   jitter_cv=m.jitter_cv)
    workload = workload_for(s, consts, m.factors)
    network = network_for(consts)
    results = {}
    for name in STRATEGIES:
        w, net = workload, network
        if overheads and name in overheads:
            extra = overheads[name]["loop_extra_s"] - (overheads[own]["loop_extra_s"] if own in overheads else 0.0)
            c = consts | {"control_op_s": overheads[name]["control_op_s"],
                          "loop_overhead_s": max(0.0, consts["loop_overhead_s"] + extra)}
            w, net = workload_for(s, c, m.factors), network_for(c)
        results[name] = simulate(name, w, net, **default_settings(name, s))
    return consts, workload, network, results


# --- the validation's error -----------------------------------------------------------------------------
def _md_table_rows(lines: list[str], marker: str):
    """Rows (header -> cell) of the Markdown table whose header has ``marker``, ``status`` and ``run``."""
    header = None
    for line in lines:
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if marker in cols and "status" in cols and "run" in cols:
            header = cols
            continue
        if header is None or len(cols) != len(header) or set(line) <= set("|-: "):
            continue
        yield dict(zip(header, cols))


def _md_runs(path: str) -> dict[str, dict[str, float]]:
    """The per-run table of a ``sim_validate.md``: {run: {ring_only_error, error}} of its predicted,
    not superseded rows (a grid's md has its per-cell table first; only the per-run one has these columns)."""
    out: dict[str, dict[str, float]] = {}
    with open(path) as f:
        lines = f.read().splitlines()
    for row in _md_table_rows(lines, "ring-only error"):
        if not row["status"].startswith("predicted") or "superseded" in row["status"]:
            continue
        try:
            ring_only = float(row["ring-only error"].rstrip("%")) / 100
            judged = float(row["error"].split()[0].rstrip("%")) / 100
        except ValueError:
            continue
        out[row["run"]] = {"ring_only_error": ring_only, "error": judged}
    return out


def _json_runs(path: str) -> dict[str, dict[str, float]]:
    with open(path) as f:
        cells = json.load(f).get("cells", [])
    out = {}
    for c in cells:
        if c.get("status") == "predicted" and not c.get("superseded") and "ring_only_error" in c:
            run = c["run"].removesuffix("/summary.json").replace("benchmarks/results/", "")  # as the md names it
            out[run] = {"ring_only_error": float(c["ring_only_error"]),
                        "error": float(c.get("error", c["ring_only_error"]))}
    return out


def validation_error(paths: Optional[list[str]] = None) -> dict[str, Any]:
    """The simulator's error on measured runs, from committed ``benchmarks.sim_validate`` output (``.json``,
    else the ``.md`` table) over every predicted, not superseded run of every file, each run once: the
    ring-only calibration's error (the replay without the strategies' own costs) and the judged one
    (``judged``: with them, where sim_validate had them)."""
    if paths is None:
        paths = _validation_files()
    runs: dict[str, dict[str, float]] = {}
    used = []
    for path in paths:
        try:
            got = _json_runs(path) if path.endswith(".json") else _md_runs(path)
        except (OSError, ValueError):
            continue
        if got:
            used.append(os.path.relpath(path, ROOT) if path.startswith(ROOT) else path)
        for run, e in got.items():
            runs.setdefault(run, e)
    if not runs:
        return {"known": False, "files": used}

    def stats(e: list[float]) -> dict[str, Any]:
        return {"median_abs": statistics.median(abs(x) for x in e), "within_15": sum(abs(x) <= 0.15 for x in e),
                "worst": max(e, key=abs)}

    return {"known": True, "files": used, "runs": len(runs), **stats([r["ring_only_error"] for r in runs.values()]),
            "judged": stats([r["error"] for r in runs.values()])}


def validation_line(v: dict[str, Any], overheads: bool = False) -> str:
    """The error of the calibration the replay used: ring-only, or with the strategies' own costs ("judged":
    sim_validate's own-none calibration where the strategy had no-straggler runs, else ring-only)."""
    if not v["known"]:
        return ("Prediction error: unknown (no benchmarks/results/**/sim_validate.json or .md with predicted runs; "
                "python -m benchmarks.sim_validate measures it)")
    e, how = (v["judged"], "with each strategy's own fitted costs, as here") if overheads else (v, "with a ring-only calibration, as here")
    return (f"Prediction error (simulator validation, {', '.join(v['files'])}): over {v['runs']} measured runs "
            f"predicted {how}, median |error| {e['median_abs']:.1%}, "
            f"{e['within_15']} of {v['runs']} within ±15%, worst {e['worst']:+.1%}")


def _validation_files() -> list[str]:
    found = sorted(glob.glob(VALIDATION_GLOB, recursive=True)) + sorted(glob.glob(VALIDATION_GLOB[:-4] + "md", recursive=True))
    with_json = {p[:-5] for p in found if p.endswith(".json")}
    return [p for p in found if p.endswith(".json") or p[:-3] not in with_json]  # a grid's md repeats its json


def strategy_overheads(world_size: int, paths: Optional[list[str]] = None) -> dict[str, dict[str, Any]]:
    """Per strategy, what ``benchmarks.sim_validate`` fitted on its own no-straggler benchmark runs at this
    world size ("own-none": ``control_op_s``, the fixed cost of a control collective, and ``loop_extra_s``,
    its per-step cost beyond ring's): costs a ring run cannot show. From the newest benchmark directory
    that has them (json ``own_calibration``; md: control op ms, and loop ms less the grid's ring loop);
    medians over its runs, a negative per-step extra taken as 0."""
    per: dict[tuple[str, str], dict[str, tuple[float, float]]] = {}  # (algorithm, folder) -> run -> (control, extra)
    for path in _validation_files() if paths is None else paths:
        try:
            if path.endswith(".json"):
                with open(path) as f:
                    cells = json.load(f).get("cells", [])
                for c in cells:
                    if c.get("status") == "calibration (own-none)" and int(c.get("world_size", 0)) == world_size:
                        run = c["run"].removesuffix("/summary.json")
                        per.setdefault((c["algorithm"], os.path.dirname(os.path.dirname(run))), {})[run] = (
                            float(c["own_calibration"]["control_op_s"]), float(c["own_calibration"]["loop_extra_s"]))
                continue
            with open(path) as f:
                lines = f.read().splitlines()
        except (OSError, ValueError, KeyError):
            continue
        own, ring = [], {}
        for row in _md_table_rows(lines, "loop ms"):
            try:
                if int(row["N"]) != world_size:
                    continue
                folder = os.path.dirname(os.path.dirname(row["run"]))
                if row["status"].startswith("calibration (own-none)"):
                    own.append((row["algorithm"], folder, row["run"], float(row["control op ms"]) / 1e3,
                                float(row["loop ms"]) / 1e3))
                elif row["status"].startswith("calibration") and row["algorithm"] == "ring":
                    ring.setdefault(folder, []).append(float(row["loop ms"]) / 1e3)
            except (KeyError, ValueError):
                continue
        for algo, folder, run, control, loop in own:
            if folder in ring:
                per.setdefault((algo, "benchmarks/results/" + folder), {}).setdefault(
                    "benchmarks/results/" + run, (control, loop - statistics.median(ring[folder])))
    out: dict[str, dict[str, Any]] = {}
    for (algo, folder), d in sorted(per.items(), key=lambda kv: kv[0][1]):  # newest folder (its stamp) last: wins
        # a strategy does ring's per-step work and more: a negative extra is the noise between invocations
        out[algo] = {"control_op_s": statistics.median(c for c, _ in d.values()),
                     "loop_extra_s": max(0.0, statistics.median(e for _, e in d.values())), "runs": len(d), "source": folder}
    return out


# --- what the run cannot tell -----------------------------------------------------------------------------
def caveats(s: dict[str, Any], m: Measured, overheads: bool = False) -> list[str]:
    algo, n = s["algorithm"], int(s["world_size"])
    out = []
    if algo == "ring" and m.source == "step_times" and not (~m.measured).any():
        out.append("nothing about the workload: a ring run computes every step on every rank, so each rank's "
                   "speed at every step was measured")
    if m.source == "schedule":
        out.append(f"no {STEP_TIMES_FILE} in the run (made before the profiler wrote it): replayed from the "
                   "configured straggler schedule with the fastest rank's median step and jitter; slowness that "
                   "was not configured (a really slow machine, contention) is not seen step by step")
    unmeasured = int((~m.measured).sum()) if m.source == "step_times" else 0
    if algo in ("dpar", "awar"):
        ranks = sorted(m.local_steps)
        out.append(f"{'an' if algo == 'awar' else 'a'} {algo} run: rank(s) {', '.join(map(str, ranks)) or 'none'} trained outside the group "
                   f"({', '.join(f'{m.local_steps[r]} steps' for r in ranks) or '-'}); their compute was measured on "
                   "local steps, but how long they would have kept the group waiting (their wait and all-reduce "
                   "inside it) was not, and the batches they passed over have no time at all"
                   + (f" ({unmeasured} rank-steps, given the factor of the rank's nearest measured step)" if unmeasured else ""))
    elif unmeasured:
        out.append(f"{unmeasured} rank-steps have no compute time; they take the rank's nearest measured step's factor")
    if algo in ("boa", "adaptive"):
        out.append(f"{'an' if algo == 'adaptive' else 'a'} {algo} run: ranks computed different batch sizes, so the replay assumes one split of a step "
                   f"into fixed and per-sample time for every rank (per sample {1e3 * m.per_sample_s:.2f} ms); how the "
                   "slow ranks would do at ring's equal batches is extrapolated from it")
    if algo == "dssync":
        out.append(f"a dssync run: only all-reduces within groups of {', '.join(map(str, m.group_sizes)) or '?'} were "
                   f"measured; the all-reduce over all {n} workers is extrapolated with the latency model "
                   "(x (N-1)/(g-1))")
    if algo == "ddp":
        out.append("a ddp run (Lightning's DDP): replayed as ring; its compute / communication split is the first "
                   "gradient bucket's (summary.json profiling)")
    if algo != "ring" and m.source == "step_times":
        out.append(f"the loop overhead was fitted on the {algo if algo in STRATEGIES else 'ring'} replay, so ring's "
                   "own per-step cost is inferred, not measured")
    if not overheads:
        out.append("the strategies' own costs (a control collective's fixed cost at boundaries, merges, global averages "
                   "and boa's exchange; per-step bookkeeping such as dssync's group switches) are not measurable on "
                   "this run and are charged their latency only (no benchmark calibration at this world size)")
    else:
        out.append("the strategies' own costs (+ lines above) are the benchmark's, measured on the machine and model of "
                   "benchmarks/results (--overheads none leaves them out); on other hardware they differ")
    out.append("throughput only: the effect on accuracy (dpar's omitted samples, dssync's group averages, awar's "
               "local steps) is not predicted")
    return out


# --- the advice ------------------------------------------------------------------------------------------
def advise(run_dir: str, source: str = "auto", min_gain: float = 0.05, slow_ratio: float = SLOW_RATIO,
           validation: Optional[list[str]] = None, overheads: str = "auto") -> dict[str, Any]:
    """Everything the report prints, as a dict (``--json`` writes it)."""
    if not (isinstance(min_gain, (int, float)) and min_gain >= 0 and np.isfinite(min_gain)):
        raise AdviseError(f"min_gain must be a finite number >= 0 (got {min_gain!r})")
    if not (isinstance(slow_ratio, (int, float)) and slow_ratio > 1 and np.isfinite(slow_ratio)):
        raise AdviseError(f"slow_ratio must be a finite number > 1 (got {slow_ratio!r})")
    s, records = load_run(run_dir)
    if source not in ("auto", "step_times", "schedule"):
        raise AdviseError(f"source must be one of auto, step_times, schedule (got {source!r})")
    if source == "step_times" and records is None:
        raise AdviseError(f"{run_dir}: no {STEP_TIMES_FILE} (the per-step records the replay needs)")
    if overheads not in ("auto", "none", "validation"):
        raise AdviseError(f"overheads must be one of auto, none, validation (got {overheads!r})")
    m = measured_from_records(s, records) if records is not None and source != "schedule" else measured_from_schedule(s)
    extra = strategy_overheads(int(s["world_size"]), validation) if overheads != "none" else {}
    if overheads == "validation" and not extra:
        raise AdviseError(f"overheads=validation: no own-none calibration at {s['world_size']} workers in the "
                          "committed sim_validate output")
    consts, workload, network, results = replay(s, m, extra)
    ring = results["ring"].throughput_samples_per_s
    table = [{"strategy": k, "predicted_samples_per_s": r.throughput_samples_per_s,
              "vs_ring": r.throughput_samples_per_s / ring if ring > 0 else 0.0, "efficiency": r.efficiency,
              "notes": r.notes} for k, r in results.items()]
    best = max(table, key=lambda row: row["predicted_samples_per_s"])
    recommended = best["strategy"] if best["strategy"] != "ring" and best["vs_ring"] > 1 + min_gain else "ring"
    stragglers = classify(m.factors, m.measured if m.source == "step_times" else None, slow_ratio)
    own = s["algorithm"] if s["algorithm"] in STRATEGIES else "ring"
    return {
        "run_dir": os.path.abspath(run_dir), "algorithm": s["algorithm"], "world_size": int(s["world_size"]),
        "steps": positions(s), "measured_samples_per_s": float(s.get("throughput_samples_per_s") or 0.0),
        "source": m.source, "reference_rank": m.reference_rank, "base_compute_s": m.base_compute_s,
        "calibration": consts, "replayed_own": own,
        "replayed_own_samples_per_s": results[own].throughput_samples_per_s,
        "table": table, "best": best["strategy"], "recommended": recommended,
        "override": f"algorithm={recommended}", "min_gain": min_gain, "slow_ratio": slow_ratio,
        "stragglers": stragglers, "evidence": [evidence_line(c, positions(s)) for c in stragglers if c["kind"] != "none"],
        "caveats": caveats(s, m, bool(extra)), "validation": validation_error(validation), "overheads": extra,
    }


def recommendation_line(a: dict[str, Any]) -> str:
    row = {r["strategy"]: r for r in a["table"]}
    if a["recommended"] == "ring":
        best = row[a["best"]]
        why = ("ring is predicted fastest" if a["best"] == "ring" else
               f"no gain over ring worth a switch: best is {a['best']} at {best['vs_ring']:.2f}x, under the "
               f"{a['min_gain']:.0%} margin")
        return f"Recommendation: ring (keep algorithm=ring): {why}"
    r = row[a["recommended"]]
    return (f"Recommendation: {a['recommended']} ({r['vs_ring']:.2f}x ring's throughput predicted): "
            f"python -m lightning_straggler.train {a['override']}")


def format_advice(a: dict[str, Any]) -> str:
    c = a["calibration"]
    lines = [f"Advice for {a['run_dir']}",
             f"  measured: {a['algorithm']}, {a['world_size']} workers, {a['steps']} steps, "
             f"{a['measured_samples_per_s']:,.0f} samples/s",
             "",
             f"Stragglers (compute per step against the fastest rank at that step, rolling median of {SMOOTH} steps; "
             f"slow = {a['slow_ratio']:g}x or more):"]
    lines += [f"  {e}" for e in a["evidence"]] or ["  none"]
    calm = [s for s in a["stragglers"] if s["kind"] == "none"]
    if calm and len(calm) < len(a["stragglers"]):
        lines.append("  rank(s) " + ", ".join(f"{s['rank']} ({s['median_ratio']:.2f}x)" for s in calm)
                     + ": no straggler (median against the fastest)")
    source = ("every rank's measured compute of every step" if a["source"] == "step_times"
              else "the configured straggler schedule (no per-step records)")
    lines += ["",
              f"Replay in the simulator ({source}; full-speed step {1e3 * a['base_compute_s']:.1f} ms (rank "
              f"{a['reference_rank']}), all-reduce {1e3 * 2 * (a['world_size'] - 1) * c['alpha_s']:.1f} ms, "
              f"loop overhead {1e3 * c['loop_overhead_s']:.1f} ms per step, fitted on this run):"]
    for name, o in a.get("overheads", {}).items():
        lines.append(f"  + {name}'s own costs: {1e3 * o['control_op_s']:.1f} ms per control call, "
                     f"{1e3 * o['loop_extra_s']:+.1f} ms per step over ring (benchmark's own-none calibration, "
                     f"{o['runs']} run(s) in {o['source']})")
    lines.append(f"  {'strategy':<9}{'predicted samples/s':>21}{'vs ring':>9}{'efficiency':>12}")
    for r in a["table"]:
        mark = "  <- recommended" if r["strategy"] == a["recommended"] else ""
        lines.append(f"  {r['strategy']:<9}{r['predicted_samples_per_s']:>21,.0f}{r['vs_ring']:>9.2f}"
                     f"{r['efficiency']:>12.2f}{mark}")
    lines += [f"  (replay of the measured {a['replayed_own']}: {a['replayed_own_samples_per_s']:,.0f} samples/s against "
              f"{a['measured_samples_per_s']:,.0f} measured; efficiency = throughput / ideal, the sum of the "
              "workers' own rates less one all-reduce per step)",
              "",
              recommendation_line(a),
              validation_line(a["validation"], bool(a.get("overheads"))),
              "",
              "What this run cannot tell:"]
    lines += [f"  - {x}" for x in a["caveats"]]
    return "\n".join(lines)


# --- the plot ----------------------------------------------------------------------------------------------
def plot(run_dir: str, path: Optional[str] = None, source: str = "auto", overheads: str = "auto") -> str:
    """PNG: the measured per-rank compute per step (the replay's input) and, next to it, samples over time
    for the measured run and every strategy's replay."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, records = load_run(run_dir)
    m = measured_from_records(s, records) if records is not None and source != "schedule" else measured_from_schedule(s)
    _, workload, _, results = replay(s, m, strategy_overheads(int(s["world_size"])) if overheads != "none" else {})
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    compute = m.factors * m.base_compute_s
    for r in range(compute.shape[0]):
        y = np.where(m.measured[r], compute[r], np.nan) if m.source == "step_times" else compute[r]
        left.plot(np.arange(y.size), 1e3 * y, lw=0.9, label=f"rank {r}")
    left.set_xlabel("step")
    left.set_ylabel("compute ms" + (" (measured)" if m.source == "step_times" else " (configured schedule)"))
    left.set_title(f"measured: {s['algorithm']}, {s['world_size']} workers")
    left.legend(fontsize="small")
    if records:
        ends: dict[int, float] = {}
        got: dict[int, float] = {}
        origin = min(r.start_s for r in records)
        for r in records:
            ends[r.step] = max(ends.get(r.step, 0.0), r.start_s - origin + r.compute_s + r.comm_s)
            got[r.step] = got.get(r.step, 0.0) + r.samples
        steps = sorted(ends)
        right.plot([ends[k] for k in steps], np.cumsum([got[k] for k in steps]), "k--", lw=1.5,
                   label=f"measured {s['algorithm']}")
    for name, res in results.items():
        st = np.asarray(res.step_times_s, dtype=float)
        per = (np.full(st.size, res.train_samples / st.size) if res.step_samples is None
               else np.asarray(res.step_samples, dtype=float))
        right.plot(np.cumsum(st), np.cumsum(per), lw=1.2, label=f"replay {name}")
    right.set_xlabel("seconds")
    right.set_ylabel("samples trained")
    right.set_title("replay under every strategy")
    right.legend(fontsize="small")
    fig.tight_layout()
    path = path or os.path.join(run_dir, "advise.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --- against a benchmark grid ------------------------------------------------------------------------------
def evaluate_grid(grid: str, overheads: str = "auto", min_gain: float = 0.05) -> dict[str, Any]:
    """The advisor on every ``ring`` run of a ``benchmarks.matrix`` directory against the strategy that measured
    best on the same scenario, world size and seed (among the strategies the grid ran). Runs from ``runs/``
    where present (their ``step_times.csv.gz`` when they have one), else from the shipped ``runs.jsonl``
    (no per-step records: the configured schedule is replayed). Noise: the median |ring#2 / ring - 1| of the
    grid's ``--noise`` pairs (0 without); "within noise" = the recommendation measured at least (1 - noise)
    x the best."""
    import tempfile

    try:
        from benchmarks.matrix import RUN_RE
    except ImportError as e:
        raise AdviseError(f"evaluating a grid needs the repository's benchmarks package ({e})") from None
    runs: dict[str, str] = {}  # run name -> a directory holding its summary.json
    tmp = tempfile.mkdtemp(prefix="advise-grid-")
    for path in sorted(glob.glob(os.path.join(grid, "runs", "*", "summary.json"))):
        runs[os.path.basename(os.path.dirname(path))] = os.path.dirname(path)
    shipped = os.path.join(grid, "runs.jsonl")
    if not runs and os.path.isfile(shipped):
        with open(shipped) as f:
            for line in f:
                r = json.loads(line)
                if not r["path"].startswith("runs/"):
                    continue  # solo calibration runs
                name = os.path.basename(os.path.dirname(r["path"]))
                os.makedirs(os.path.join(tmp, name))
                with open(os.path.join(tmp, name, "summary.json"), "w") as g:
                    json.dump(r["summary"], g)
                runs[name] = os.path.join(tmp, name)
    if not runs:
        raise AdviseError(f"{grid}: neither runs/*/summary.json nor runs.jsonl (not a benchmarks.matrix directory)")

    def throughput(name: str) -> float:
        with open(os.path.join(runs[name], "summary.json")) as f:
            return float(json.load(f)["throughput_samples_per_s"])

    measured: dict[tuple, dict[str, float]] = {}
    noise = []
    for name in runs:
        if "_rep" in name:
            if name.split("_rep")[0] in runs:
                noise.append(abs(throughput(name) / throughput(name.split("_rep")[0]) - 1))
            continue
        m = RUN_RE.match(name)
        if m:
            measured.setdefault((m["scenario"], int(m["world"]), int(m["seed"])), {})[m["algorithm"]] = throughput(name)
    level = statistics.median(noise) if noise else 0.0
    cells = []
    for (scenario, n, seed), algos in sorted(measured.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        ring_run = f"ring_{scenario}_N{n}_seed{seed}"
        if ring_run not in runs or len(algos) < 2:
            continue
        a = advise(runs[ring_run], min_gain=min_gain, overheads=overheads)
        predicted = {r["strategy"]: r["predicted_samples_per_s"] for r in a["table"]}
        among = [k for k in algos if k in predicted]
        top = max(among, key=predicted.get)
        rec = top if top != "ring" and predicted[top] > predicted["ring"] * (1 + min_gain) else "ring"
        best = max(algos, key=algos.get)
        cells.append({"scenario": scenario, "world_size": n, "seed": seed, "source": a["source"], "recommended": rec,
                      "recommended_of_all": a["recommended"], "best": best, "match": rec == best,
                      "within_noise": algos[rec] >= algos[best] * (1 - level),
                      "error": predicted[rec] / algos[rec] - 1, "measured": algos,
                      "predicted": {k: predicted[k] for k in among}, "evidence": a["evidence"]})
    if not cells:
        raise AdviseError(f"{grid}: no cell with a ring run and another strategy")
    return {"grid": grid, "noise": level, "noise_pairs": len(noise), "overheads": overheads, "cells": cells,
            "match": sum(c["match"] for c in cells), "within_noise": sum(c["within_noise"] for c in cells),
            "within_15": sum(abs(c["error"]) <= 0.15 for c in cells), "n": len(cells)}


def format_evaluation(e: dict[str, Any]) -> str:
    lines = [f"Advisor vs the benchmark grid {e['grid']} (overheads: {e['overheads']}; noise {e['noise']:.1%} from "
             f"{e['noise_pairs']} ring#2/ring pairs); the recommendation among the strategies the grid measured:",
             "| N | scenario | seed | replay of | advisor | (of all five) | measured best | predicted / measured "
             "(advisor's) | measured samples/s | predicted |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in e["cells"]:
        lines.append(f"| {c['world_size']} | {c['scenario']} | {c['seed']} | {c['source']} | {c['recommended']} | "
                     f"{c['recommended_of_all']} | {c['best']} | {c['error']:+.1%} | "
                     + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(c["measured"].items())) + " | "
                     + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(c["predicted"].items())) + " |")
    labels = sorted({c["recommended"] for c in e["cells"]} | {c["best"] for c in e["cells"]})
    lines += ["", f"Recommendation = measured best: {e['match']} of {e['n']}; within the noise: {e['within_noise']} of "
              f"{e['n']}; the recommendation's predicted throughput within 15% of its measurement: {e['within_15']} of "
              f"{e['n']}.", "", "Confusion (rows: advisor, columns: measured best): | " + " | ".join(labels) + " |"]
    for a in labels:
        lines.append(f"| {a} | " + " | ".join(str(sum(1 for c in e["cells"] if c["recommended"] == a and c["best"] == b))
                                              for b in labels) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_straggler.advise", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="a main job's output directory (summary.json, step_times.csv.gz); with "
                                        "--evaluate-grid, a benchmarks.matrix directory")
    parser.add_argument("--evaluate-grid", action="store_true",
                        help="RUN_DIR is a benchmark grid: advise on each ring run, compare with the measured best")
    parser.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                        help="write the replay next to the measured timeline (default RUN_DIR/advise.png)")
    parser.add_argument("--json", metavar="PATH", help="also write the advice as JSON")
    parser.add_argument("--min-gain", type=float, default=0.05, help="a switch from ring must gain more than this (0.05)")
    parser.add_argument("--slow-ratio", type=float, default=SLOW_RATIO, help="slow = this many times the fastest (1.5)")
    parser.add_argument("--source", choices=("auto", "step_times", "schedule"), default="auto",
                        help="replay the per-step records (auto: when present) or the configured schedule")
    parser.add_argument("--overheads", choices=("auto", "none", "validation"), default="auto",
                        help="each strategy's control-call and per-step costs fitted by benchmarks.sim_validate on its "
                             "own no-straggler benchmark runs at this world size: auto = where committed, validation = "
                             "required, none = left out")
    args = parser.parse_args(argv)
    try:
        if args.evaluate_grid:
            e = evaluate_grid(args.run_dir, args.overheads, args.min_gain)
            print(format_evaluation(e))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(e, f, indent=1, default=float)
            return 0
        a = advise(args.run_dir, args.source, args.min_gain, args.slow_ratio, overheads=args.overheads)
        print(format_advice(a))
        if args.plot is not None:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                print("plot: skipped (matplotlib is not installed)")
            else:
                print(f"plot: {plot(args.run_dir, args.plot or None, args.source, args.overheads)} "
                      f"(measured timeline: {os.path.join(args.run_dir, 'timeline.png')})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(a, f, indent=1, default=float)
            print(f"advice: {args.json}")
    except AdviseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
