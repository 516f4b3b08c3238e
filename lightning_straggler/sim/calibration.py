"""Turning a measured run (its ``summary.json``) into simulator inputs: the workload, the network and the
algorithm's settings. Shared by ``benchmarks/sim_validate.py`` (which predicts measured benchmark runs;
its module docstring states the calibration rules) and ``lightning_straggler.advise`` (which replays one
run under every strategy from the run's own per-step compute times).

Two ways to give the compute times:

* from the run's configuration (``factors=None``): the straggler schedule the run was configured with,
  the constants fitted on a no-straggler run (``overhead_s``, ``jitter_cv``), as ``sim_validate`` does;
* measured (``factors`` = a [rank, position] matrix of compute relative to a full-speed step, with
  ``base_compute_s`` = that full-speed step's compute at the run's local batch): the replay of what each
  rank actually took at every step, jitter included (``jitter_cv`` = 0).
"""
from __future__ import annotations

import math
import statistics
from typing import Any

from lightning_straggler.sim import Network, Workload, simulate
from lightning_straggler.sim.workload import MatrixSchedule


def positions(s: dict[str, Any]) -> int:
    return max(int(r["steps"]) for r in s["per_rank"].values())


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


def calibration_constants(s: dict[str, Any], factors=None, base_compute_s: float | None = None,
                          per_sample_s: float | None = None, allreduce_s: float | None = None,
                          fit_on: str = "ring", fit_settings: dict[str, Any] | None = None,
                          jitter_cv: float = 0.0) -> dict[str, float]:
    """The simulator's constants for run ``s`` (rules: ``benchmarks/sim_validate.py``'s docstring).

    Without ``factors``: from the run's per-rank summary (meant for a no-straggler run). With measured
    ``factors`` (see the module docstring): ``base_compute_s`` is the full-speed compute of a step,
    split into ``per_sample_s`` x batch (default: the emulated device time per sample) and a fixed
    ``overhead_s``; ``allreduce_s`` overrides the all-reduce time per step (default: mean over ranks of
    comm_s.total / steps); the loop overhead is fitted by simulating the run's own algorithm ``fit_on``
    (with ``fit_settings``) so that its replay takes the measured wall time; ``jitter_cv`` is applied on
    top of ``factors`` (0 for measured times, which carry their own jitter)."""
    n, b = int(s["world_size"]), local_batch(s)
    device_s = float(s["config"]["straggler"].get("device_ms_per_sample", 0.0)) / 1e3
    if factors is None:
        compute = mean_over_ranks(s, lambda r: r["compute_s"]["mean"])
        jitter = mean_over_ranks(s, lambda r: math.log(max(r["compute_s"]["p95"], 1e-9) / max(r["compute_s"]["p50"], 1e-9)) / 1.645)
    else:
        compute, jitter = float(base_compute_s), float(jitter_cv)
    t_ar = mean_over_ranks(s, lambda r: r["comm_s"]["total"] / r["steps"]) if allreduce_s is None else allreduce_s
    consts = {"overhead_s": max(0.0, compute - device_s * b), "jitter_cv": max(0.0, jitter),
              "alpha_s": t_ar / (2 * (n - 1)) if n > 1 else 0.0, "control_op_s": 0.0}
    if per_sample_s is not None:
        consts |= {"per_sample_s": float(per_sample_s), "overhead_s": max(0.0, compute - per_sample_s * b)}
    probe = workload_for(s, consts | {"loop_overhead_s": 0.0}, factors)
    step = simulate(fit_on, probe, network_for(consts), **(fit_settings or {})).wall_s / probe.steps
    consts["loop_overhead_s"] = max(0.0, float(s["wall_s"]) / positions(s) - step)
    return consts


def network_for(consts: dict[str, float]) -> Network:
    return Network("calibrated", consts["alpha_s"], 0.0, consts.get("control_op_s", 0.0))


def model_size(s: dict[str, Any]) -> tuple[float, int, float]:
    """(parameter bytes, state_dict tensors, parameters + optimizer state bytes) of the run's model:
    an MLP features -> hidden... -> classes, float32, a weight and a bias per layer; SGD with
    momentum keeps one buffer per parameter. Other models: 1 MB, 1 tensor, 2 MB."""
    m, d = s["config"]["model"], s["config"]["data"]
    if m.get("name") != "mlp" or "features" not in d or "classes" not in d:
        return 1e6, 1, 2e6
    widths = [int(d["features"]), *(int(h) for h in (m.get("hidden") or [])), int(d["classes"])]
    params = sum(a * b + b for a, b in zip(widths, widths[1:]))
    momentum = m.get("optimizer", "sgd") != "sgd" or float(m.get("momentum", 0.0)) > 0
    return 4.0 * params, 2 * (len(widths) - 1), 4.0 * params * (2 if momentum else 1)


def workload_for(s: dict[str, Any], consts: dict[str, float], factors=None) -> Workload:
    """The run's workload: its configured straggler schedule, or the measured ``factors`` matrix."""
    per_epoch, val_every = epoch_and_validation(s)
    straggler = dict(s["config"]["straggler"])
    grad_bytes, tensors, state_bytes = model_size(s)
    per_sample_s = consts.get("per_sample_s", float(straggler.get("device_ms_per_sample", 0.0)) / 1e3)
    return Workload(world_size=int(s["world_size"]), batch_per_worker=local_batch(s),
                    per_sample_s=per_sample_s,
                    overhead_s=consts["overhead_s"], loop_overhead_s=consts["loop_overhead_s"], steps=positions(s),
                    grad_bytes=grad_bytes, state_tensors=tensors, state_bytes=state_bytes,
                    straggler=straggler if factors is None else MatrixSchedule(factors),
                    jitter_cv=consts["jitter_cv"], seed=int(s["config"].get("seed", 0)),
                    steps_per_epoch=per_epoch, val_every_steps=val_every)


def algorithm_settings(s: dict[str, Any]) -> dict[str, Any]:
    """The simulator's keyword arguments for the run's algorithm, from its ``config.algorithm``."""
    from lightning_straggler.policies.awar import AwarThresholds
    from lightning_straggler.policies.dpar import DparThresholds

    a, name = dict(s["config"]["algorithm"]), s["algorithm"]
    if name == "dpar":
        keys = ("slow_ratio", "strikeout_ratio", "strikeout_windows", "readmit_ratio", "readmit_windows", "min_active",
                "data_penalty")
        return {"window_steps": a["window_steps"], "thresholds": DparThresholds(**{k: a[k] for k in keys if k in a})} \
            | ({"react_steps": a["react_steps"]} if "react_steps" in a else {})
    if name == "awar":
        return {"period_steps": a["period_steps"], "weighting": a.get("weighting", "updates"),
                "thresholds": AwarThresholds(a["slow_ratio"], a["recover_ratio"], a["min_group"])} \
            | ({"react_steps": a["react_steps"]} if "react_steps" in a else {})
    if name == "adaptive":
        keys = ("react_steps", "react_ratio", "history_steps", "global_batch", "min_local_batch", "max_local_batch",
                "window_steps", "rebalance_gain", "tune_workers", "initial_batch_sizes", "seed")
        return {k: a[k] for k in keys if k in a}
    if name == "boa":
        keys = ("window_steps", "rebalance_gain", "history_windows", "global_batch", "min_local_batch",
                "max_local_batch", "tune_workers", "initial_batch_sizes")
        return {k: a[k] for k in keys if k in a}
    if name == "dssync":
        keys = ("group_size", "schedule", "num_partitions", "seed", "global_every_steps", "exchange")
        return {k: a[k] for k in keys if k in a}
    return {}
