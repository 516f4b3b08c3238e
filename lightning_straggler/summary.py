"""``summary.json``: the one record of a run that benchmarks and tests read. Keep names stable.

Keys: algorithm, world_size, wall_s (training loop: first step to end, validation included),
launch_s (process start-up around it), train_samples (samples whose gradients reached the model),
throughput_samples_per_s (train_samples / wall_s), val_acc (last validation), target_acc,
time_to_target_s (training time at the first validation with val_acc >= target_acc, else null),
val_history, per_rank (compute_s / comm_s / wait_s each with mean, p50, p95, total; steps; samples),
events (membership and decision changes; empty for ring), emulated (what was emulated), timeline_png,
step_times (the file of every rank's every step, ``profiling.write_step_times``; null when none), config (the resolved configuration); only for ``ddp``: profiling (how its launch and the compute / comm
split were measured, and what that split cannot separate).
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

SUMMARY_KEYS = ("algorithm", "world_size", "wall_s", "launch_s", "train_samples", "throughput_samples_per_s",
                "val_acc", "target_acc", "time_to_target_s", "val_history", "per_rank", "events", "emulated",
                "timeline_png", "config", "restarts")


def time_to_target(val_history: List[Dict[str, float]], target: float, key: str = "val_acc") -> Optional[float]:
    for point in val_history:
        if point.get(key, -1.0) >= target:
            return float(point["elapsed_s"])
    return None


def build_summary(algorithm: str, world_size: int, report: Dict[str, Any], total_s: float,
                  target_acc: float, config: Dict[str, Any], val_acc: Optional[float]) -> Dict[str, Any]:
    profile = report.get("profile", {})
    per_rank = profile.get("per_rank", {})
    wall = float(profile.get("train_time_s", total_s))
    discarded = int(report.get("discarded_samples", 0))
    train_samples = sum(int(r["samples"]) for r in per_rank.values()) - discarded
    history = profile.get("val_history", [])
    return {
        "algorithm": algorithm,
        "world_size": world_size,
        "wall_s": wall,
        "launch_s": max(0.0, total_s - wall),
        "train_samples": train_samples,
        "throughput_samples_per_s": train_samples / wall if wall > 0 else 0.0,
        "val_acc": val_acc,
        "target_acc": target_acc,
        "time_to_target_s": time_to_target(history, target_acc),
        "val_history": history,
        "per_rank": per_rank,
        "events": report.get("events", []),
        "emulated": report.get("emulated", {"device_time": "none", "slowdown": "none"}),
        "timeline_png": profile.get("timeline_png"),
        "step_times": profile.get("step_times"),
        "config": config,
        **({"profiling": report["profiling"]} if "profiling" in report else {}),
        **({"deadline": report["deadline"]} if "deadline" in report else {}),
        **({"partial_group": partial_group_summary(report)} if "outside_rank_holds" in report else {}),
    }


def partial_group_summary(report: Dict[str, Any]) -> Dict[str, Any]:
    """dpar / awar: local steps outside ranks held back for a boundary, and what the group waited at the
    boundaries while a rank was outside (the join + exchange, as the old group's first rank measured it)."""
    waits = report.get("group_boundary_wait", {})
    return {"outside_rank_holds": int(report["outside_rank_holds"]),
            "boundaries_with_a_rank_outside": int(waits.get("boundaries", 0)),
            "boundary_wait_s_total": float(waits.get("total_s", 0.0)), "boundary_wait_s_max": float(waits.get("max_s", 0.0))}


def write_summary(summary: Dict[str, Any], output_dir: str) -> str:
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return path
