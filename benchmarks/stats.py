"""The statistics every side-by-side benchmark here reports (rules fixed in code, before any run).

* order: the runs of one block (same world size, scenario, seed or round) run in an order shuffled by
  ``random.Random(key)``, the key naming the block, so the same options give the same order;
* pairs: one value per block, X's run against the reference's run of the same block;
* statistic: the median of the paired values;
* interval: a 95% percentile bootstrap of that median over the pairs (10,000 resamples with
  replacement, numpy default_rng(14)); with fewer than 3 pairs there is none. With 3 to 5 pairs it
  is the range of the pairs (a resample's median is the smallest value with probability > 2.5%);
* label: "win" only when the whole interval is on the better side of the reference, "loss" only when
  wholly on the worse side, else "no difference"; "n/a" without an interval.
"""
from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

BOOT_RESAMPLES = 10_000
BOOT_SEED = 14
MIN_PAIRS_FOR_INTERVAL = 3
CONFIDENCE = 0.95


def shuffled(labels: Sequence[str], key: str) -> list[str]:
    """``labels`` in the order ``random.Random(key)`` shuffles them to (deterministic per key)."""
    out = list(labels)
    random.Random(key).shuffle(out)
    return out


def paired_bootstrap(values: Iterable[float | None], resamples: int = BOOT_RESAMPLES, seed: int = BOOT_SEED,
                     confidence: float = CONFIDENCE, min_n: int = MIN_PAIRS_FOR_INTERVAL) -> dict[str, Any]:
    """Median of paired statistics (one value per pair; None = no pair) and a percentile bootstrap
    interval of that median: resample the pairs with replacement ``resamples`` times (numpy
    default_rng(seed)), take each resample's median, and the (1-confidence)/2 and (1+confidence)/2
    quantiles. Fewer than ``min_n`` pairs: no interval."""
    import numpy as np

    v = np.asarray([float(x) for x in values if x is not None], dtype=float)
    out: dict[str, Any] = {"median": float(np.median(v)) if len(v) else None, "lo": None, "hi": None, "n": int(len(v)),
                           "confidence": confidence, "resamples": resamples, "boot_seed": seed}
    if len(v) < min_n:
        out["interval"] = f"not available (fewer than {min_n} paired seeds: {len(v)})"
        return out
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(v), size=(resamples, len(v)))
    meds = np.median(v[idx], axis=1)
    out["lo"], out["hi"] = (float(q) for q in np.quantile(meds, [(1 - confidence) / 2, (1 + confidence) / 2]))
    out["interval"] = "percentile bootstrap over paired seeds"
    return out


def label(ci: dict[str, Any], reference: float = 1.0, higher_is_better: bool = True) -> str:
    """"win" only when the whole interval is on the better side of ``reference``, "loss" only when it is
    wholly on the worse side, else "no difference"; "n/a" without an interval (too few pairs)."""
    if ci.get("lo") is None or ci.get("hi") is None:
        return "n/a"
    if ci["lo"] > reference:
        return "win" if higher_is_better else "loss"
    if ci["hi"] < reference:
        return "loss" if higher_is_better else "win"
    return "no difference"


def labelled(values: Iterable[float | None], reference: float = 1.0, higher_is_better: bool = True) -> dict[str, Any]:
    """paired_bootstrap of ``values`` with its label."""
    ci = paired_bootstrap(values)
    ci["label"] = label(ci, reference, higher_is_better)
    return ci


def fmt_interval(ci: dict[str, Any] | None, spec: str = ".2f") -> str:
    """median [lo, hi] label (win / loss in bold); without an interval: median (n pairs) n/a."""
    if not ci or ci.get("median") is None:
        return "-"
    if ci.get("lo") is None:
        return f"{format(ci['median'], spec)} (n={ci['n']}) n/a"
    lab = ci.get("label", "")
    lab = f"**{lab}**" if lab in ("win", "loss") else lab
    return f"{format(ci['median'], spec)} [{format(ci['lo'], spec)}, {format(ci['hi'], spec)}] {lab}"
