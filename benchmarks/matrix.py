"""The benchmark matrix: every algorithm x straggler scenario x world size x seed, side by side.

    python -m benchmarks.matrix [--quick] [--algorithms ring ddp dpar awar dssync boa]
        [--scenarios none mix3 transient4x random2 permanent10x] [--world-sizes 4 8] [--seeds 3]
        [--steps S | --epochs E] [--device-ms 2.0] [--target-acc A] [--output-dir DIR]
        [--sweep [--launcher submitit_slurm]] [--aggregate-only DIR] [--resume DIR]

Each cell is one real multi-process Horovod run (``ddp``: Lightning's own DDPStrategy over torch.distributed,
same job otherwise; opt-in with ``--algorithms ddp``; ``ddplocal``: the same with post-local SGD, parameters
averaged every 4 steps after 8 plain steps, Lightning's documented example, not with ``--sweep``) of the main job, ``python -m lightning_straggler.train``
with Hydra overrides (``algorithm=<a> straggler=<scenario> trainer.devices=<N> seed=<s> ...``), on
MNIST-1D (MLP 40-256-256-10, batch 32 per worker) with EMULATED device time: every batch sleeps
factor x ``--device-ms`` ms per sample after backward, plus (factor - 1) x its real compute. A scenario
is any file ``conf/straggler/<name>.yaml`` and is passed as ``straggler=<name>``; the built-in ones that
depend on the run get a few extra overrides (recorded per run in summary.json ``runs[].command``):

  none          no straggler;
  mix3          static 1.0 / 0.6 / 0.3 speeds (factors 1 / 1.667 / 3.333) spread over the ranks:
                ``straggler.factors`` = speed_mix(N) (4: [1, 1, 1.667, 3.333];
                8: [1, 1, 1, 1.667 x3, 3.333 x2]);
  transient4x   rank min(3, N-1) 4x slow for the middle third of the run (steps S//3 .. 2S//3 - 1);
  random2       two random 4x stragglers, seeded: two distinct ranks from numpy default_rng(seed), each
                slow for S//3 of its own steps from a drawn start (random2_events);
  permanent10x  the file as it is: rank 3 10x slow for the whole run;
  mixtransient  mix3's speeds for the whole run and rank 0 (a fast worker) 10x slow for the middle third
                (mixtransient_events);
  random36      the file as it is (random slowdowns, 3-6x for 20-60 steps, probability 0.1 per window);
  any other     the file as it is; a ``scenario: random`` file also gets ``straggler.seed=<seed>``.

Raw output per run: ``<out>/runs/<algorithm>_<scenario>_N<world>_seed<s>/summary.json`` (+ train.log,
timeline.png where plotted); the 1-worker calibration runs under ``<out>/solo/``; then ``summary.json``,
``matrix.md`` and PNG plots in ``<out>`` (default ``benchmarks/results/matrix/<stamp>/``).

What ships (is committed): the raw runs/ and solo/ are git-ignored, but every aggregation also writes
``<out>/runs.jsonl``, one line per run directory: {"path": "runs/<name>/summary.json" (or solo/...),
"summary": the summary trimmed to what the aggregation reads (``trim_summary``: no events, emulation
notes or restarts; a few KB), or null for a run that left none}, next to ``commands.jsonl`` (every command
line). ``--aggregate-only DIR`` reads the raw directories where they exist and runs.jsonl otherwise
(``--shipped`` forces runs.jsonl); given nothing but the directory it re-plans with the options the
measuring invocation recorded (summary.json ``settings.argv``; for a grid interrupted before its
summary.json, ``invocation.json``, written when a grid starts), so on a checkout
``python -m benchmarks.matrix --aggregate-only DIR`` reproduces summary.json and matrix.md. Result
directories under benchmarks/results/matrix/ are not ignored except ``*-quick*`` ones (.gitignore).

Figures (every one relative to something measured in the same invocation):
  throughput   = summary ``throughput_samples_per_s`` = train_samples / wall_s (validation included;
                 samples of discarded local steps are not counted);
  ratio        = X / ring under the same scenario, world size and seed (then median, min, max over
                 seeds, and the interval below); time to target ratio likewise (X / ring, lower is better);
                 accuracy difference in points against ring;
  efficiency   = throughput / ideal, with
      r(f)     = the sample rate of a 1-worker run ALONE at constant slowdown factor f (straggler=static,
                 factors [f]), same emulation, same steps, same torch threads per process: samples per step
                 / (p50 compute_s + p50 comm_s), medians so that a neighbour's load spike does not move
                 every ideal (its train_samples / wall_s is recorded too); one run per distinct factor of
                 the grid's schedules; tau(f) = 1 / r(f) seconds per sample, piecewise linear in f between
                 measured factors (only needed when a schedule has more than MAX_SOLO distinct factors,
                 e.g. scenario: random, then measured at the extremes and 1);
      R_i      = S / sum_{s < S} tau(f_i(s)): worker i's time-weighted rate over its schedule f_i(s)
                 for the run's S steps (= r(f_i) for a constant factor);
      t_ar     = the all-reduce transfer per step: mean over ranks of comm_s.total / steps (summary.json's
                 comm_s is the transfer alone: lightning_straggler.profiling subtracts each step's waiting
                 before summarising, so wait_s is not subtracted again) of the ring run with no straggler at the same N and seed (else ring under the
                 same scenario; else the median over seeds at that N; else 0, flagged);
      ideal    = G / (G / sum_i R_i + t_ar), G = N x batch (the global batch of one step): the N workers
                 each at their own solo speed, perfectly balanced, plus one all-reduce per step.
  Efficiency therefore counts as loss everything but each worker's typical step and one all-reduce:
  waiting, protocol overhead, omitted data, validation and Lightning's work between steps, load spikes,
  and the CPU sharing of N processes on the machine's cores.

Statistics (the scoring rules, fixed in code before a grid runs: ``STATISTICS`` is written into summary.json):
  order        the runs of every (world size, scenario, seed) block run in an order drawn from
               random.Random("matrix-order:<order_seed>:<N>:<scenario>:<seed>") (``--order-seed``, default 0;
               recorded in settings and per run as order_seed / order_position), not ring first;
  pairs        every ratio is per seed, X's run against ring's run of the same block (same seed, scenario
               and world size); a seed where a run failed (time to target: or did not reach it) has no pair;
  interval     per cell the median of the paired values and a 95% percentile bootstrap interval of that
               median: 10,000 resamples of the pairs with replacement, numpy default_rng(14); with fewer
               than 3 pairs the interval is "not available" and the label "n/a". With 3 to 5 pairs the
               interval is the range of the pairs (a resample's median is the smallest value with
               probability > 2.5%), so a win then means every seed won; from 6-7 pairs on it trims;
  label        "win" only when the interval lies wholly on the better side of the reference (throughput
               X/ring: lower end > 1; time to target X/ring, lower is better: upper end < 1; accuracy
               points: lower end > 0), "loss" only when wholly on the worse side, else "no difference";
  noise        ``--noise`` runs ring twice in every block (the second is ``ring#2``, run directory
               ``<ring run name>_rep2``, drawn into the block's order like any algorithm) and reports
               ring#2 / ring with the same interval per (N, scenario) at the top of matrix.md: the
               machine's own run-to-run noise, which a "win" has to clear.
  (``--sweep`` runs in Hydra's order: no shuffled order and no ``--noise`` there.)

``--sweep`` runs the same grid through Hydra multirun (``-m``, one invocation per scenario and world
size, and per seed where the scenario's overrides depend on it), into the same layout
(``hydra.sweep.dir=<out>/runs``, ``hydra.sweep.subdir=<algorithm>_<scenario>_N<world>_seed<s>``), so with
``--launcher submitit_slurm`` each run is a SLURM job; the aggregation is the same function.
"""
from __future__ import annotations

import argparse
import copy
import fnmatch
import glob
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

from benchmarks.stats import (BOOT_RESAMPLES, BOOT_SEED, CONFIDENCE, MIN_PAIRS_FOR_INTERVAL, fmt_interval, label,
                              paired_bootstrap, shuffled)
from lightning_straggler.ideal import ideal_throughput

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = os.path.join(ROOT, "conf")
RESULTS = os.path.join(ROOT, "benchmarks", "results", "matrix")
ALGORITHMS = ("ring", "ringc5", "ddp", "ddplocal", "dpar", "awar", "dssync", "boa", "adaptivewait", "adaptive")  # every one --algorithms accepts, in table order
# a row that is an algorithm file plus settings: ddplocal = Lightning's DDP with post-local SGD, the straggler option
# Lightning offers (its documented example: parameters averaged every 4 steps after 8 steps of plain DDP)
# ringc5 = ring with Horovod's coordination cycle at 5 ms instead of its 1 ms default (idle ranks cost less CPU)
# adaptivewait = adaptive without its step deadline (every step waits for every rank): what the deadline adds
ALGORITHM_VARIANTS = {"ddplocal": ["algorithm=ddp", "algorithm.model_averaging_period=4", "algorithm.warmup_steps=8"],
                      "ringc5": ["algorithm=ring", "trainer.horovod_cycle_time_ms=5"],
                      "adaptivewait": ["algorithm=adaptive", "algorithm.deadline_factor=0"]}


def algorithm_overrides(label: str) -> list[str]:
    """The Hydra overrides that select --algorithms ``label``."""
    return list(ALGORITHM_VARIANTS.get(label, [f"algorithm={label}"]))

# run when --algorithms is not given. ddp (Lightning's own DDPStrategy, the peer baseline) is opt-in for now:
# --algorithms ddp adds it (ring is always there), ratios to ring as for any algorithm
DEFAULT_ALGORITHMS = ("ring", "dpar", "awar", "dssync", "boa")
SCENARIOS = ("none", "mix3", "transient4x", "random2", "permanent10x")
QUICK = {"world_sizes": [4], "scenarios": ["none", "transient4x", "permanent10x"], "seeds": 1, "steps": 40,
         "target_acc": 0.25}
DEFAULT_STEPS, DEFAULT_TARGET_ACC, DEFAULT_DEVICE_MS = 60, 0.3, 2.0
MAX_SOLO = 6  # more distinct factors than this: measure the extremes (and 1) and interpolate
RUN_RE = re.compile(r"^(?P<algorithm>[a-z0-9]+)_(?P<scenario>.+)_N(?P<world>\d+)_seed(?P<seed>\d+)$")
# a repeated run of the same configuration (the --noise replica of ring): <run name>_rep<k>, k >= 2; RUN_RE
# (read by benchmarks.sim_validate) deliberately does not match it
REP_RE = re.compile(r"^(?P<base>.+_N\d+_seed\d+)_rep(?P<rep>[2-9]|[1-9]\d+)$")
NOISE_LABEL = "ring#2"  # the second ring run of a block under --noise (run directory <ring run name>_rep2)
# statistics, fixed before any grid runs (see the module docstring, "Statistics")
MIN_SEEDS_FOR_INTERVAL = MIN_PAIRS_FOR_INTERVAL
# the per-run ratios that get an interval and a label: (key, reference value, higher is better)
RATIO_METRICS = (("throughput_ratio_to_ring", 1.0, True), ("ttt_ratio_to_ring", 1.0, False),
                 ("acc_diff_points_vs_ring", 0.0, True))
STATISTICS = {
    "pairs": "one value per seed: X's run / ring's run of the same seed, scenario and world size (accuracy: "
             "difference in points); a seed where either run failed, or (time to target) either did not reach "
             "the target, has no pair",
    "statistic": "median of the paired values",
    "interval": f"{CONFIDENCE:.0%} percentile bootstrap of that median: {BOOT_RESAMPLES} resamples of the pairs "
                f"with replacement, numpy default_rng({BOOT_SEED}); not available with fewer than "
                f"{MIN_SEEDS_FOR_INTERVAL} pairs",
    "label": "win only when the whole interval is on the better side of the reference (throughput ratio: lower "
             "end > 1; time-to-target ratio X/ring, lower is better: upper end < 1; accuracy points: lower end > "
             "0), loss only when wholly on the worse side, else no difference; n/a without an interval",
    "resamples": BOOT_RESAMPLES, "boot_seed": BOOT_SEED, "min_seeds": MIN_SEEDS_FOR_INTERVAL, "confidence": CONFIDENCE,
    "metrics": {k: {"reference": ref, "higher_is_better": hib} for k, ref, hib in RATIO_METRICS},
    "noise": f"--noise: ring runs twice in every block ({NOISE_LABEL}, run directory <ring run>_rep2), and "
             f"{NOISE_LABEL}/ring gets the same interval: a ratio that size is the machine's, not the algorithm's",
    "order": "the runs of each (world size, scenario, seed) block run in an order shuffled by "
             "random.Random('matrix-order:<order_seed>:<N>:<scenario>:<seed>'); --order-seed, recorded per run",
}
METRICS = ("throughput", "time_to_target_s", "val_acc", "throughput_ratio_to_ring", "ttt_ratio_to_ring",
           "acc_diff_points_vs_ring", "efficiency", "ideal", "wall_s")
EFFICIENCY_FORMULA = (
    "efficiency = throughput / ideal; ideal = G / (G / sum_i R_i + t_ar); G = N x batch per worker; "
    "R_i = S / sum_{s<S} tau(f_i(s)) (worker i's time-weighted solo rate over its schedule, S steps); "
    "tau(f) = 1 / r(f), r(f) = samples per step / (p50 compute_s + p50 comm_s) of a 1-worker run alone at "
    "constant factor f (same emulation, steps and threads), tau piecewise linear in f between measured factors; t_ar = mean over ranks of "
    "comm_s.total / steps (comm_s is the transfer alone: profiling reports it net of waiting) of ring with no straggler at the same N and seed (fallbacks: ring "
    "under the same scenario, median over seeds at N, 0)")


# --- small helpers ------------------------------------------------------------------------------
def spread(xs: Iterable[float | None]) -> dict[str, Any]:
    """Median, min, max and count of the values that are not None."""
    v = [float(x) for x in xs if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def run_name(algorithm: str, scenario: str, world: int, seed: int, rep: int = 1) -> str:
    return f"{algorithm}_{scenario}_N{world}_seed{seed}" + (f"_rep{rep}" if rep > 1 else "")


def parse_run_name(name: str) -> dict[str, Any] | None:
    rep = 1
    if (r := REP_RE.match(name)) is not None:
        name, rep = r["base"], int(r["rep"])
    m = RUN_RE.match(name)
    if not m or m["algorithm"] not in ALGORITHMS:
        return None
    out = {"algorithm": m["algorithm"], "scenario": m["scenario"], "world_size": int(m["world"]), "seed": int(m["seed"])}
    if rep > 1:
        out["rep"] = rep
    return out


def _name(r: dict[str, Any]) -> str:
    return run_name(r["algorithm"], r["scenario"], r["world_size"], r["seed"], r.get("rep", 1))


# --- statistics (the rules: benchmarks/stats.py) -----------------------------------------------
def block_order(labels: Sequence[str], world: int, scenario: str, seed: int, order_seed: int) -> list[str]:
    """The run order of one (world size, scenario, seed) block, drawn from (order_seed, world, scenario,
    seed), so the same options give the same order (``--resume``)."""
    return shuffled(labels, f"matrix-order:{order_seed}:{world}:{scenario}:{seed}")


def interval_table(rs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Median, bootstrap interval and label of every RATIO_METRICS key over the per-run records ``rs``
    (one per seed: each value is already paired with ring's run of the same seed)."""
    out = {}
    for key, ref, higher in RATIO_METRICS:
        ci = paired_bootstrap(r.get(key) for r in rs)
        ci["label"] = label(ci, ref, higher)
        out[key] = ci
    return out


def steps_per_epoch(world: int, num_samples: int = 10000, batch: int = 32) -> int:
    return max(1, (int(0.8 * num_samples) // world) // batch)  # 80% train, sharded, drop_last


def available_scenarios() -> list[str]:
    return sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(CONF, "straggler", "*.yaml"))
                  if not os.path.basename(p).startswith("_"))


# --- scenarios ----------------------------------------------------------------------------------
MIX3_FACTORS = (1.0, 1.667, 3.333)  # slowdown factors of relative speeds 1.0 / 0.6 / 0.3


def speed_mix(n: int) -> list[float]:
    """mix3's slowdown factor per rank: 4 -> [1, 1, 1.667, 3.333]; 8 -> [1, 1, 1, 1.667 x3, 3.333 x2]."""
    fast, mid_f, slow_f = MIX3_FACTORS
    slow = max(1, n // 4)
    mid = max(1, (n - slow) // 2)
    return [fast] * (n - slow - mid) + [mid_f] * mid + [slow_f] * slow


def random2_events(seed: int, world: int, steps: int, factor: float = 4.0) -> list[dict[str, Any]]:
    """random2: two distinct ranks drawn from numpy default_rng(seed), each ``factor`` x slow for
    steps//3 of its own steps from a drawn start."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ranks = sorted(int(r) for r in rng.choice(world, min(2, world), replace=False))
    length = max(1, steps // 3)
    events = []
    for rank in ranks:
        start = int(rng.integers(0, steps - length + 1))
        events.append({"rank": rank, "factor": factor, "start_step": start, "end_step": start + length})
    return events


def mixtransient_events(world: int, steps: int) -> list[dict[str, Any]]:
    """mixtransient: mix3's speeds for the whole run (permanent events) and rank 0, a fast worker, 10x slow
    for the middle third (steps S//3 .. 2S//3 - 1)."""
    events: list[dict[str, Any]] = [{"rank": r, "factor": f, "start_step": 0, "end_step": None}
                                    for r, f in enumerate(speed_mix(world)) if f != 1.0]
    events.append({"rank": 0, "factor": 10.0, "start_step": steps // 3, "end_step": max(steps // 3 + 1, (2 * steps) // 3)})
    return events


def _events_override(events: Sequence[dict[str, Any]]) -> str:
    """The Hydra override for a list of transient slowdown events."""
    def end(e):
        return "null" if e["end_step"] is None else e["end_step"]

    body = ",".join(f"{{rank:{e['rank']},factor:{e['factor']},start_step:{e['start_step']},end_step:{end(e)}}}"
                    for e in events)
    return f"straggler.events=[{body}]"


def scenario_overrides(scenario: str, kind: str, world: int, steps: int, seed: int) -> tuple[list[str], bool]:
    """Extra overrides of a scenario for one run, and whether they depend on the seed."""
    if scenario == "mix3":
        return [f"straggler.factors=[{','.join(str(f) for f in speed_mix(world))}]"], False
    if scenario == "transient4x":
        rank = min(3, world - 1)
        return [_events_override([{"rank": rank, "factor": 4.0, "start_step": steps // 3,
                                   "end_step": max(steps // 3 + 1, (2 * steps) // 3)}])], False
    if scenario == "random2":
        return [_events_override(random2_events(seed, world, steps))], True
    if scenario == "mixtransient":
        return [_events_override(mixtransient_events(world, steps))], False
    if kind == "random":
        return ["straggler.seed=${seed}"], False  # interpolated: the same override for every seed
    return [], False


# --- planning -----------------------------------------------------------------------------------
class Plan:
    """Every run of an invocation and its overrides, validated before anything starts."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cells: list[dict[str, Any]] = []
        self.solo: list[dict[str, Any]] = []

    def steps(self, world: int) -> int:
        a = self.args
        return a.steps if a.steps else a.epochs * steps_per_epoch(world, self.num_samples, self.batch)

    def val_every(self, world: int, steps: int) -> int:
        """Validate every S//4 steps (4 points on the accuracy curve), within an epoch as Lightning needs."""
        return max(1, min(steps_per_epoch(world, self.num_samples, self.batch), steps // 4))

    def common(self, world: int, steps: int) -> list[str]:
        a = self.args
        return [f"straggler.device_ms_per_sample={a.device_ms}", f"trainer.devices={world}", "trainer.accelerator=cpu",
                f"trainer.max_steps={steps}", f"trainer.max_epochs={steps}",
                f"trainer.val_check_interval={self.val_every(world, steps)}",
                "trainer.enable_progress_bar=false", f"target_acc={a.target_acc}"]

    def build(self) -> None:
        """Compose and validate every cell's configuration (raises ConfigError / ValueError with the option)."""
        from hydra import compose, initialize_config_dir

        import lightning_straggler.config  # noqa: F401  (registers the group schemas)
        from lightning_straggler.config import load_config

        a = self.args
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            base = load_config(compose(config_name="train", overrides=["straggler=none"]))
            self.num_samples, self.batch = base.data.num_samples, base.data.batch_size
            kinds = {}
            for sc in a.scenarios:  # the scenario type, read without validating against a world size
                raw = compose(config_name="train", overrides=[f"straggler={sc}"])
                kinds[sc] = str(raw.straggler.scenario)
            self.kinds = kinds
            composed: dict[tuple[str, ...], Any] = {}
            for seed in a.seeds_list:
                for world in a.world_sizes:
                    steps = self.steps(world)
                    for sc in a.scenarios:
                        extra, seed_dep = scenario_overrides(sc, kinds[sc], world, steps, seed)
                        block: dict[str, dict[str, Any]] = {}
                        for algo in a.algorithms:
                            ov = [*algorithm_overrides(algo), f"straggler={sc}", *extra, *self.common(world, steps), f"seed={seed}"]
                            try:
                                cfg = load_config(composed_for_seed(composed, compose, ov[:-1], seed))
                            except Exception as e:  # noqa: BLE001  (ConfigError or a Hydra composition error: both name the setting)
                                raise ValueError(f"--scenarios {sc} with --algorithms {algo} at --world-sizes {world}: "
                                                 f"{e}") from None
                            block[algo] = {"algorithm": algo, "scenario": sc, "world_size": world, "seed": seed,
                                           "steps": steps, "overrides": ov, "extra": extra, "seed_dependent": seed_dep,
                                           "factors": factor_table(cfg.straggler, world, steps)}
                        if a.noise:  # ring again, same configuration: the machine's own run-to-run noise
                            block[NOISE_LABEL] = dict(block["ring"], rep=2)
                        # the block's run order, drawn per block (ring no longer always first)
                        for pos, lab in enumerate(block_order(list(block), world, sc, seed, a.order_seed)):
                            self.cells.append(dict(block[lab], order_seed=a.order_seed, order_position=pos))
            # solo calibration: one 1-worker run per distinct factor of the grid's schedules
            self.solo_steps = max(self.steps(w) for w in a.world_sizes)
            self.solo_val = self.val_every(1, self.solo_steps)
            for f in solo_factors(c["factors"] for c in self.cells):
                ov = ["algorithm=ring", "straggler=static", f"straggler.factors=[{f}]",
                      f"straggler.device_ms_per_sample={a.device_ms}", "trainer.devices=1", "trainer.accelerator=cpu",
                      f"trainer.max_steps={self.solo_steps}", f"trainer.max_epochs={self.solo_steps}",
                      f"trainer.val_check_interval={self.solo_val}", "trainer.enable_progress_bar=false",
                      "profiler.plot=false", f"seed={a.seeds_list[0]}", f"target_acc={a.target_acc}"]
                load_config(compose(config_name="train", overrides=ov))
                self.solo.append({"factor": f, "overrides": ov})


def composed_for_seed(cache: dict[tuple[str, ...], Any], compose, overrides: list[str], seed: int):
    """``compose(config_name="train", overrides=[*overrides, f"seed={seed}"])``, composing once per override
    list: Hydra's composition is most of the planning time (~0.3 s a run), and runs that differ only in the
    top-level ``seed`` get a copy with the seed set (``${seed}`` interpolations resolve on access)."""
    key = tuple(overrides)
    if key not in cache:
        cache[key] = compose(config_name="train", overrides=[*overrides, f"seed={seed}"])
    cfg = copy.deepcopy(cache[key])
    cfg.seed = seed
    return cfg


def factor_table(straggler_cfg, world: int, steps: int) -> list[list[float]]:
    """f_i(s) for every rank i and step s < steps, from the library's own schedule."""
    sched = straggler_cfg.schedule()
    return [[float(sched.factor(r, s)) for s in range(steps)] for r in range(world)]


def solo_factors(tables: Iterable[list[list[float]]]) -> list[float]:
    fs = sorted({round(f, 4) for t in tables for row in t for f in row} | {1.0})
    if len(fs) > MAX_SOLO:
        fs = sorted({1.0, fs[0], fs[-1]})
    return fs


# --- the ideal-rate arithmetic (pure) -----------------------------------------------------------
def seconds_per_sample(factor: float, calibration: dict[float, float]) -> float:
    """tau(f) from {factor: solo throughput}: exact at measured factors, piecewise linear between,
    linear extrapolation from the nearest two outside (a single point: proportional to f)."""
    pts = sorted((float(f), 1.0 / r) for f, r in calibration.items() if r and r > 0)
    if not pts:
        raise ValueError("no solo calibration")
    if len(pts) == 1:
        f0, t0 = pts[0]
        return t0 * factor / f0
    for k in range(len(pts) - 1):  # the first segment reaching the factor, else the last one
        if factor <= pts[k + 1][0] or k == len(pts) - 2:
            (f0, t0), (f1, t1) = pts[k], pts[k + 1]
            return t0 + (t1 - t0) * (factor - f0) / (f1 - f0)
    raise AssertionError("unreachable")


def worker_rates(factors: list[list[float]], calibration: dict[float, float]) -> list[float]:
    """R_i = S / sum_s tau(f_i(s)): each worker's time-weighted solo rate over its schedule."""
    return [len(row) / sum(seconds_per_sample(f, calibration) for f in row) for row in factors]


def allreduce_cost(summary: dict[str, Any]) -> float | None:
    """Transfer time per step, mean over ranks, from a summary's per_rank: ``comm_s`` there is already the
    transfer alone (lightning_straggler.profiling.summarise subtracts each step's wait), so it is not
    reduced by ``wait_s`` again."""
    vals = []
    for r in summary.get("per_rank", {}).values():
        if r.get("steps"):  # profiling.summarise reports comm_s net of waiting already (transfer only)
            vals.append(max(0.0, r["comm_s"]["total"]) / r["steps"])
    return statistics.mean(vals) if vals else None


# --- aggregation (shared by the direct and the sweep paths) --------------------------------------
def load_runs(runs_dir: str, planned: Sequence[dict[str, Any]] | None = None,
              errors: dict[str, str] | None = None, shipped: dict[str, dict[str, Any]] | None = None
              ) -> list[dict[str, Any]]:
    """One record per run directory (``<algorithm>_<scenario>_N<world>_seed<s>``) and per planned run
    without a summary (``error``); ``shipped``: read_trimmed's records instead of the directories."""
    errors = errors or {}
    found: dict[str, dict[str, Any]] = {}
    if shipped is not None:
        dirs = sorted({os.path.dirname(p) for p in _summaries(os.path.join(runs_dir, "*", "summary.json"), shipped)})
    else:
        dirs = [d for d in sorted(glob.glob(os.path.join(runs_dir, "*"))) if os.path.isdir(d)]
    for d in dirs:
        key = parse_run_name(os.path.basename(d))
        if key is None:
            continue
        path = os.path.join(d, "summary.json")
        rec = dict(key, run_dir=d)
        if shipped is not None and shipped.get(path) is not None:
            rec["summary"] = shipped[path]
        elif shipped is None and os.path.exists(path):
            with open(path) as f:
                rec["summary"] = json.load(f)
        else:
            rec["error"] = errors.get(os.path.basename(d), "no summary.json (the run failed or did not finish)")
        found[os.path.basename(d)] = rec
    for c in planned or []:
        name = _name(c)
        if name not in found:
            found[name] = {k: c[k] for k in ("algorithm", "scenario", "world_size", "seed", "rep") if k in c}
            found[name].update(run_dir=os.path.join(runs_dir, name), error=errors.get(name, "did not run"))
        found[name].update({k: c[k] for k in ("order_seed", "order_position") if k in c})
    return list(found.values())


# --- raw data that ships: every run's summary trimmed to what the aggregation reads ----------------
RUNS_JSONL = "runs.jsonl"
TRIM_KEYS = ("algorithm", "world_size", "wall_s", "launch_s", "train_samples", "throughput_samples_per_s", "val_acc",
             "target_acc", "time_to_target_s", "val_history", "per_rank", "timeline_png", "config", "partial_group")
TRIM_RANK_KEYS = ("steps", "samples", "compute_s", "comm_s", "wait_s")


def trim_summary(s: dict[str, Any]) -> dict[str, Any]:
    """A run's summary.json without what aggregate / load_solo / factors_from_summary never read (events,
    emulated, restarts, anything else a strategy adds): a few KB per run."""
    out = {k: s[k] for k in TRIM_KEYS if k in s}
    out["per_rank"] = {r: {k: v[k] for k in TRIM_RANK_KEYS if k in v} for r, v in s.get("per_rank", {}).items()}
    out["val_history"] = [{k: v[k] for k in ("elapsed_s", "step", "val_acc") if k in v} for v in s.get("val_history", [])]
    return out


def write_trimmed(out: str) -> str:
    """``<out>/runs.jsonl``: one line per run directory (``runs/<name>/``, and ``solo/<x>/`` with a summary),
    {"path": its summary.json relative to <out>, "summary": trimmed, or null where the run left none}.
    Raw runs/ and solo/ stay unshipped (git-ignored); this file and summary.json reproduce the aggregate.
    A line already in runs.jsonl whose raw directory is gone (e.g. solo/ cleaned after the grid) is kept."""
    kept = {os.path.relpath(p, out): s for p, s in read_trimmed(out).items()}
    lines = []
    for d in sorted(glob.glob(os.path.join(out, "runs", "*"))):
        if os.path.isdir(d) and parse_run_name(os.path.basename(d)) is not None:
            path = os.path.join(d, "summary.json")
            s = None
            if os.path.exists(path):
                with open(path) as f:
                    s = trim_summary(json.load(f))
            lines.append({"path": os.path.relpath(path, out), "summary": s})
    for path in sorted(glob.glob(os.path.join(out, "solo", "*", "summary.json"))):
        with open(path) as f:
            lines.append({"path": os.path.relpath(path, out), "summary": trim_summary(json.load(f))})
    written = {rec["path"] for rec in lines}
    lines += [{"path": p, "summary": s} for p, s in sorted(kept.items()) if p not in written]
    dst = os.path.join(out, RUNS_JSONL)
    with open(dst, "w") as f:
        for rec in lines:
            f.write(json.dumps(rec, sort_keys=True, separators=(",", ":")) + "\n")
    return dst


def read_trimmed(out: str) -> dict[str, dict[str, Any]]:
    """{absolute summary.json path: trimmed summary} from ``<out>/runs.jsonl`` (empty if there is none)."""
    found = {}
    path = os.path.join(out, RUNS_JSONL)
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    found[os.path.join(out, rec["path"])] = rec["summary"]
    return found


def has_raw_runs(out: str) -> bool:
    return bool(glob.glob(os.path.join(out, "runs", "*", "summary.json")))


def _summaries(pattern: str, shipped: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any] | None]:
    """{summary.json path: summary or None (read from disk later)} from the raw files, or from runs.jsonl."""
    if shipped is not None:
        return {p: s for p, s in sorted(shipped.items()) if fnmatch.fnmatch(p, pattern)}
    return {p: None for p in sorted(glob.glob(pattern))}


def _read(path: str, s: dict[str, Any] | None) -> dict[str, Any]:
    if s is not None:
        return s
    with open(path) as f:
        return json.load(f)


def load_solo(solo_dir: str, shipped: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """{factor: solo record} from the 1-worker calibration runs (factor read from each run's config);
    ``shipped``: read_trimmed's records instead of the files."""
    out: dict[str, Any] = {}
    for path, s in _summaries(os.path.join(solo_dir, "*", "summary.json"), shipped).items():
        if shipped is not None and s is None:
            continue
        s = _read(path, s)
        st = s["config"]["straggler"]
        f = float(st["factors"][0]) if st.get("scenario") == "static" and st.get("factors") else 1.0
        r0 = s["per_rank"]["0"]
        per_step = r0["samples"] / r0["steps"] if r0["steps"] else 0
        step_s = r0["compute_s"]["p50"] + r0["comm_s"]["p50"]
        # medians: one load spike from a neighbour on a shared machine must not move every ideal
        out[f"{f:g}"] = {"factor": f, "rate": per_step / step_s if step_s > 0 else None,
                         "step_p50_s": step_s, "throughput": s["throughput_samples_per_s"], "wall_s": s["wall_s"],
                         "train_samples": s["train_samples"], "steps": r0["steps"],
                         "compute_rate": r0["samples"] / r0["compute_s"]["total"] if r0["compute_s"]["total"] else None,
                         "summary": path}
    return out


def aggregate(runs: list[dict[str, Any]], solo: dict[str, Any], factors: dict[str, list[list[float]]],
              batch: int = 32) -> dict[str, Any]:
    """Per-run figures, per-cell medians and spreads.

    runs: records with algorithm, scenario, world_size, seed and either ``summary`` (summary.json) or
    ``error``; solo: {factor: {"factor": f, "rate": r(f)}}; factors: run name -> f_i(s) table (ranks x steps).
    """
    calibration = {float(v["factor"]): float(v["rate"]) for v in solo.values() if v.get("rate")}
    noise_runs = [r for r in runs if r.get("rep", 1) > 1]
    runs = [r for r in runs if r.get("rep", 1) == 1]
    ok = {(r["algorithm"], r["scenario"], r["world_size"], r["seed"]): r for r in runs if "summary" in r}

    # all-reduce cost per (N, seed)
    comm: dict[tuple[int, int], dict[str, Any]] = {}
    worlds = sorted({r["world_size"] for r in runs})
    seeds = sorted({r["seed"] for r in runs})
    for n in worlds:
        for sd in seeds:
            r = ok.get(("ring", "none", n, sd))
            if r is not None:
                comm[(n, sd)] = {"t_ar_s": allreduce_cost(r["summary"]), "source": run_name("ring", "none", n, sd)}
    per_world = {n: statistics.median([v["t_ar_s"] for (m, _), v in comm.items() if m == n and v["t_ar_s"] is not None])
                 for n in worlds if any(m == n and v["t_ar_s"] is not None for (m, _), v in comm.items())}

    def t_ar_for(n: int, sc: str, sd: int) -> tuple[float, str]:
        if (n, sd) in comm and comm[(n, sd)]["t_ar_s"] is not None:
            return comm[(n, sd)]["t_ar_s"], comm[(n, sd)]["source"]
        r = ok.get(("ring", sc, n, sd))
        if r is not None and allreduce_cost(r["summary"]) is not None:
            return allreduce_cost(r["summary"]), run_name("ring", sc, n, sd)
        if n in per_world:
            return per_world[n], f"median over seeds of ring/none at N={n}"
        return 0.0, "NOT MEASURED (no ring run): t_ar = 0"

    per_run: list[dict[str, Any]] = []
    for r in sorted(runs, key=lambda r: (r["world_size"], r["scenario"], r["seed"], ALGORITHMS.index(r["algorithm"]))):
        name = run_name(r["algorithm"], r["scenario"], r["world_size"], r["seed"])
        rec: dict[str, Any] = {k: r[k] for k in ("algorithm", "scenario", "world_size", "seed")}
        rec.update({k: r[k] for k in ("run_dir", "order_seed", "order_position") if k in r})
        if "summary" not in r:
            rec["error"] = r.get("error", "unknown")
            per_run.append(rec)
            continue
        s = r["summary"]
        rec.update(throughput=s["throughput_samples_per_s"], time_to_target_s=s["time_to_target_s"],
                   val_acc=s["val_acc"], wall_s=s["wall_s"], launch_s=s.get("launch_s"),
                   train_samples=s["train_samples"],
                   steps_per_rank=[v["steps"] for _, v in sorted(s["per_rank"].items(), key=lambda kv: int(kv[0]))],
                   timeline_png=s.get("timeline_png"),
                   val_history=[[v["elapsed_s"], v["val_acc"]] for v in s.get("val_history", [])])
        ring = ok.get(("ring", r["scenario"], r["world_size"], r["seed"]))
        if ring is not None:
            rec.update(vs_ring(s, ring["summary"]))
        table = factors.get(name)
        if table is None:  # sweep output of a run not planned here: rebuild the schedule from its config
            table = factors_from_summary(s)
        if calibration and table:
            t_ar, src = t_ar_for(r["world_size"], r["scenario"], r["seed"])
            rates = worker_rates(table, calibration)
            g_batch = int(s["config"]["data"]["batch_size"]) * r["world_size"]
            ideal = ideal_throughput(rates, g_batch, t_ar)
            rec.update(ideal=ideal, efficiency=s["throughput_samples_per_s"] / ideal, ideal_rates=rates,
                       t_ar_s=t_ar, t_ar_source=src, global_batch=g_batch)
        per_run.append(rec)

    cells: list[dict[str, Any]] = []
    keys = sorted({(r["world_size"], r["scenario"], r["algorithm"]) for r in runs},
                  key=lambda k: (k[0], k[1], ALGORITHMS.index(k[2])))
    for n, sc, algo in keys:
        rs = [p for p in per_run if (p["world_size"], p["scenario"], p["algorithm"]) == (n, sc, algo)]
        good = [p for p in rs if "error" not in p]
        cell: dict[str, Any] = {"algorithm": algo, "scenario": sc, "world_size": n, "runs": len(rs), "ok": len(good),
                                "reached_target": sum(p["time_to_target_s"] is not None for p in good),
                                "errors": [{"seed": p["seed"], "error": p["error"]} for p in rs if "error" in p]}
        for m in METRICS:
            cell[m] = spread(p.get(m) for p in good)
        # per-seed ratios are paired with ring's run of the same seed: bootstrap them as pairs
        cell["intervals"] = interval_table(good)
        cells.append(cell)

    # machine noise: ring's second run of a block against its first (same configuration, same block)
    noise_per_run: list[dict[str, Any]] = []
    for r in sorted(noise_runs, key=lambda r: (r["world_size"], r["scenario"], r["seed"], r.get("rep", 1))):
        rec = {k: r[k] for k in ("algorithm", "scenario", "world_size", "seed", "rep") if k in r}
        rec.update({k: r[k] for k in ("run_dir", "order_seed", "order_position") if k in r})
        rec["label"] = NOISE_LABEL if r.get("rep", 1) == 2 else f"ring#{r['rep']}"
        ring = ok.get(("ring", r["scenario"], r["world_size"], r["seed"]))
        if "summary" not in r:
            rec["error"] = r.get("error", "unknown")
        elif ring is None:
            rec["error"] = "no first ring run in its block to pair with"
        else:
            s = r["summary"]
            rec.update(throughput=s["throughput_samples_per_s"], time_to_target_s=s["time_to_target_s"],
                       val_acc=s["val_acc"], wall_s=s["wall_s"], **vs_ring(s, ring["summary"]))
        noise_per_run.append(rec)
    noise = []
    for n, sc in sorted({(p["world_size"], p["scenario"]) for p in noise_per_run}):
        rs = [p for p in noise_per_run if (p["world_size"], p["scenario"]) == (n, sc) and "error" not in p]
        noise.append({"world_size": n, "scenario": sc, "label": NOISE_LABEL, "runs": len(rs),
                      "throughput": spread(p["throughput"] for p in rs),
                      "intervals": interval_table(rs)})
    return {"runs": per_run, "cells": cells, "noise_runs": noise_per_run, "noise": noise,
            "target_check": target_check(per_run), "statistics": STATISTICS,
            "comm_cost": {f"N{n}_seed{sd}": v for (n, sd), v in sorted(comm.items())},
            "calibration": solo, "efficiency_formula": EFFICIENCY_FORMULA}


TARGET_RULE = ("the target accuracy is a fair time-to-target yardstick at a world size when the straggler-free ring "
               "reaches it in every seed within the first two thirds of its training time (time_to_target_s <= 2/3 "
               "wall_s); otherwise time-to-target ratios there say little")


def target_check(per_run: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per world size, from ring's runs with no straggler: each seed's time_to_target_s / wall_s and whether
    the target meets TARGET_RULE (fixed before any grid: a target reached only at the very end, or never,
    would make time-to-target ratios meaningless)."""
    out: dict[str, Any] = {}
    for n in sorted({p["world_size"] for p in per_run}):
        rs = [p for p in per_run if p["world_size"] == n and p["algorithm"] == "ring" and p["scenario"] == "none"
              and "error" not in p]
        if not rs:
            continue
        fr = [None if p["time_to_target_s"] is None else p["time_to_target_s"] / p["wall_s"] for p in rs]
        out[f"N{n}"] = {"seeds": len(rs), "fraction_of_wall": fr,
                        "fair": all(f is not None and f <= 2 / 3 for f in fr)}
    return out


def vs_ring(s: dict[str, Any], g: dict[str, Any]) -> dict[str, float | None]:
    """One run's ratios to ring's run of the same scenario, world size and seed (summary dicts)."""
    return {"throughput_ratio_to_ring": (s["throughput_samples_per_s"] / g["throughput_samples_per_s"]
                                         if g["throughput_samples_per_s"] else None),
            "ttt_ratio_to_ring": (s["time_to_target_s"] / g["time_to_target_s"]
                                  if s["time_to_target_s"] is not None and g["time_to_target_s"] else None),
            "acc_diff_points_vs_ring": (100.0 * (s["val_acc"] - g["val_acc"])
                                        if s["val_acc"] is not None and g["val_acc"] is not None else None)}


def factors_from_summary(s: dict[str, Any]) -> list[list[float]] | None:
    from lightning_straggler.config import load_config

    try:
        cfg = load_config(s["config"])
    except Exception:  # noqa: BLE001  (a summary from another version: no ideal rather than no report)
        return None
    steps = max(v["steps"] for v in s["per_rank"].values())
    return factor_table(cfg.straggler, int(s["world_size"]), steps)


# --- reports ------------------------------------------------------------------------------------
def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _cellfmt(d: dict[str, Any], spec: str) -> str:
    if d["median"] is None:
        return "-"
    if d["n"] == 1:
        return format(d["median"], spec)
    return f"{format(d['median'], spec)} [{format(d['min'], spec)}–{format(d['max'], spec)}]"


def markdown(report: dict[str, Any]) -> str:
    st = report["settings"]
    out = [f"# Benchmark matrix {report['stamp']}", "",
           (f"{len(st['algorithms'])} algorithms x {len(st['scenarios'])} scenarios x world sizes {st['world_sizes']} x "
           f"seeds {st['seeds']}; {st['steps_by_world']} optimizer steps per run (by world size), batch "
           f"{st['batch']} per worker, MNIST-1D MLP; device time EMULATED ({st['device_ms']} ms/sample x slowdown "
           f"factor); target accuracy {st['target_acc']}. Median over seeds, [min–max] where more than one seed."),
           "", (f"Load average (1/5/15 min) at start {report['load_avg']['start']}, at end {report['load_avg']['end']}; "
           f"{report['cpu_count']} CPUs; total {report['total_runtime_s']:.0f} s."), "",
           f"Efficiency: {EFFICIENCY_FORMULA}.", ""]
    checks = report.get("target_check") or {}
    if checks:
        out += [f"Target {st['target_acc']}: " + "; ".join(
            f"{n}: ring without stragglers reached it at " + ", ".join("never" if f is None else f"{f:.0%}"
                                                                    for f in c["fraction_of_wall"])
            + f" of its training time, {'fair' if c['fair'] else 'NOT fair'}" for n, c in checks.items())
            + f" (rule: {TARGET_RULE}).", ""]
    stats = report.get("statistics", STATISTICS)
    out += [f"Statistics: ratios are paired per seed with ring's run of the same block; per cell the {stats['statistic']} "
            f"[{stats['interval']}] and a label: {stats['label']}. Run order shuffled per block (order seed "
            f"{st.get('order_seed', '-')}).", ""]
    noise = report.get("noise") or []
    if noise:
        out += [f"## Machine noise: {NOISE_LABEL} / ring (ring run twice in every block, same configuration)", "",
                f"A ratio of an algorithm to ring inside this cell's {NOISE_LABEL} interval is indistinguishable from "
                "running ring again.", "",
                f"| N | scenario | pairs | samples/s {NOISE_LABEL} / ring | ttt {NOISE_LABEL} / ring | acc {NOISE_LABEL} − ring (pts) |",
                "|---:|---|---:|---:|---:|---:|"]
        for c in noise:
            iv = c["intervals"]
            out.append(f"| {c['world_size']} | {c['scenario']} | {c['runs']} | {fmt_interval(iv['throughput_ratio_to_ring'], '.2f')} "
                       f"| {fmt_interval(iv['ttt_ratio_to_ring'], '.2f')} | {fmt_interval(iv['acc_diff_points_vs_ring'], '+.1f')} |")
        out.append("")
    elif st.get("noise"):
        out += [f"Machine noise: --noise was given but no {NOISE_LABEL} run has a first ring run to pair with.", ""]
    else:
        out += ["Machine noise: not measured in this invocation (run with `--noise`).", ""]
    out += ["## Cells", "",
            ("Columns \"/ ring\", \"ttt / ring\" and \"acc − ring\": median over paired seeds [95% bootstrap interval] "
             "label; samples/s, efficiency, ideal, time, val acc: median [min–max] over seeds."), "",
            ("| N | scenario | algorithm | ok | samples/s | / ring | efficiency | ideal samples/s "
             f"| time to {st['target_acc']} (s) | ttt / ring | reached | val acc | acc − ring (pts) |"),
            "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in report["cells"]:
        iv = c.get("intervals") or {}
        ref = c["algorithm"] == "ring"  # ring against itself: 1 by construction
        out.append(f"| {c['world_size']} | {c['scenario']} | {c['algorithm']} | {c['ok']}/{c['runs']} "
                   f"| {_cellfmt(c['throughput'], '.0f')} "
                   f"| {'1 (reference)' if ref else fmt_interval(iv.get('throughput_ratio_to_ring'), '.2f')} "
                   f"| {_cellfmt(c['efficiency'], '.2f')} | {_cellfmt(c['ideal'], '.0f')} "
                   f"| {_cellfmt(c['time_to_target_s'], '.1f')} "
                   f"| {'-' if ref else fmt_interval(iv.get('ttt_ratio_to_ring'), '.2f')} "
                   f"| {c['reached_target']}/{c['ok']} | {_cellfmt(c['val_acc'], '.3f')} "
                   f"| {'-' if ref else fmt_interval(iv.get('acc_diff_points_vs_ring'), '+.1f')} |")
    out += ["", "## Solo calibration (1 worker alone, same emulation)", "",
            "| factor | r(f) samples/s (p50 step) | s/sample | train_samples / wall_s | steps |",
            "|---:|---:|---:|---:|---:|"]
    for v in sorted(report["calibration"].values(), key=lambda v: v["factor"]):
        out.append(f"| {v['factor']:g} | {_f(v.get('rate'), '.1f')} | {_f(1 / v['rate'] if v.get('rate') else None, '.5f')} "
                   f"| {v['throughput']:.1f} | {v['steps']} |")
    out += ["", "## All-reduce transfer per step (t_ar)", ""]
    out += [f"- {k}: {_f(1e3 * v['t_ar_s'] if v['t_ar_s'] is not None else None, '.2f')} ms ({v['source']})"
            for k, v in report["comm_cost"].items()] or ["- not measured (no ring / none run)"]
    out += ["", "## Scenarios", ""] + [f"- `{k}`: {v}" for k, v in report["scenario_descriptions"].items()]
    failed = [r for r in report["runs"] + report.get("noise_runs", []) if "error" in r]
    if failed:
        out += ["", "## Failed runs", ""] + [f"- {_name(r)}: {r['error'][:300]}" for r in failed]
    out += ["", "## Plots", ""] + [f"- {os.path.basename(p)}" for p in report.get("plots", [])]
    return "\n".join(out) + "\n"


def plots(report: dict[str, Any], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st, made = report["settings"], []
    worlds, scen = st["world_sizes"], st["scenarios"]
    algos = [a for a in ALGORITHMS if a in st["algorithms"]]
    colors = {a: plt.get_cmap("tab10")(i) for i, a in enumerate(ALGORITHMS)}
    cells = {(c["world_size"], c["scenario"], c["algorithm"]): c for c in report["cells"]}
    for metric, fname, label in (("throughput", "throughput.png", "samples/s (median, min–max)"),
                                 ("efficiency", "efficiency.png", "efficiency = throughput / ideal")):
        fig, axes = plt.subplots(len(worlds), 1, figsize=(max(6, 1.6 * len(scen) * max(1, len(algos)) / 3), 3.2 * len(worlds)),
                                 squeeze=False)
        w = 0.8 / max(1, len(algos))
        for ax, n in zip(axes[:, 0], worlds):
            for j, a in enumerate(algos):
                xs, ys, lo, hi = [], [], [], []
                for i, sc in enumerate(scen):
                    d = cells.get((n, sc, a), {}).get(metric)
                    if d and d["median"] is not None:
                        xs.append(i + (j - (len(algos) - 1) / 2) * w)
                        ys.append(d["median"])
                        lo.append(d["median"] - d["min"])
                        hi.append(d["max"] - d["median"])
                ax.bar(xs, ys, w, yerr=[lo, hi] if xs else None, color=colors[a], label=a, capsize=2)
            ax.set_xticks(range(len(scen)), scen)
            ax.set_ylabel(label, fontsize=8)
            ax.set_title(f"{metric} per scenario, N={n}", fontsize=9)
            if metric == "efficiency":
                ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.legend(fontsize=7, ncol=len(algos))
        fig.tight_layout()
        p = os.path.join(out, fname)
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p)

    # validation accuracy against wall time: one panel per (N, scenario), one line per run
    fig, axes = plt.subplots(len(worlds), len(scen), figsize=(3.4 * len(scen), 2.8 * len(worlds)), squeeze=False)
    for i, n in enumerate(worlds):
        for j, sc in enumerate(scen):
            ax = axes[i, j]
            for r in report["runs"]:
                if (r["world_size"], r["scenario"]) == (n, sc) and r.get("val_history"):
                    t, acc = zip(*r["val_history"])
                    ax.plot(t, acc, marker=".", color=colors[r["algorithm"]], lw=1, alpha=0.8,
                            label=r["algorithm"] if r["seed"] == st["seeds"][0] else None)
            ax.axhline(st["target_acc"], color="grey", lw=0.6, ls=":")
            ax.set_title(f"N={n} {sc}", fontsize=9)
            ax.set_xlabel("wall time (s)", fontsize=8)
            ax.set_ylabel("val acc", fontsize=8)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=6)
    fig.tight_layout()
    p = os.path.join(out, "accuracy_vs_time.png")
    fig.savefig(p, dpi=100)
    plt.close(fig)
    made.append(p)

    # per-rank timelines: the profiler's own PNG of one run per algorithm, copied and combined
    chosen = [r for r in report["runs"] if r.get("timeline_png") and os.path.exists(r["timeline_png"])]
    picks = {}
    for r in sorted(chosen, key=lambda r: (r["scenario"] == "none", r["world_size"], r["seed"])):
        picks.setdefault(r["algorithm"], r)
    if picks:
        tdir = os.path.join(out, "timelines")
        os.makedirs(tdir, exist_ok=True)
        fig, axes = plt.subplots(len(picks), 1, figsize=(10, 3.2 * len(picks)), squeeze=False)
        for ax, a in zip(axes[:, 0], [a for a in ALGORITHMS if a in picks]):
            r = picks[a]
            dst = os.path.join(tdir, f"{run_name(a, r['scenario'], r['world_size'], r['seed'])}.png")
            shutil.copyfile(r["timeline_png"], dst)
            made.append(dst)
            ax.imshow(plt.imread(dst))
            ax.set_axis_off()
            ax.set_title(f"{a}: {r['scenario']}, N={r['world_size']}, seed {r['seed']}", fontsize=9)
        fig.tight_layout()
        p = os.path.join(out, "timelines.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p)
    else:  # re-aggregated without the raw runs: the timelines drawn when they existed still stand
        made += sorted(glob.glob(os.path.join(out, "timelines", "*.png")))
        made += [p for p in [os.path.join(out, "timelines.png")] if os.path.exists(p)]
    return made


def describe(plan: Plan) -> dict[str, str]:
    out = {}
    for sc in plan.args.scenarios:
        cs = [c for c in plan.cells if c["scenario"] == sc and c["algorithm"] == plan.args.algorithms[0]]
        per = sorted({(c["world_size"], c["seed"] if c["seed_dependent"] else None, " ".join(c["extra"])) for c in cs},
                     key=lambda t: (t[0], -1 if t[1] is None else t[1]))
        txt = "; ".join(f"N={n}{'' if sd is None else f' seed {sd}'}: {ex or '(the file as it is)'}" for n, sd, ex in per)
        out[sc] = f"straggler={sc} (scenario: {plan.kinds[sc]}); {txt}"
    return out


def finish(plan: Plan, out: str, started: float, load_start, runs: list[dict[str, Any]], solo: dict[str, Any],
           commands: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    a = plan.args
    factors = {_name(c): c["factors"] for c in plan.cells}
    agg = aggregate(runs, solo, factors, plan.batch)
    report = {
        "what": "benchmarks.matrix: algorithms x straggler scenarios x world sizes x seeds (see the module docstring)",
        "stamp": os.path.basename(out.rstrip("/")), "mode": mode,
        "settings": {"algorithms": a.algorithms, "scenarios": a.scenarios, "world_sizes": a.world_sizes,
                     "seeds": a.seeds_list, "steps_by_world": {str(n): plan.steps(n) for n in a.world_sizes},
                     "epochs": a.epochs, "device_ms": a.device_ms, "batch": plan.batch, "num_samples": plan.num_samples,
                     "target_acc": a.target_acc, "threads_per_worker": a.threads,
                     "order_seed": a.order_seed, "noise": a.noise, "argv": getattr(a, "argv", None),
                     "val_check_interval_steps": {str(n): plan.val_every(n, plan.steps(n)) for n in a.world_sizes}, "solo_steps": plan.solo_steps,
                     "solo_val_check_interval_steps": plan.solo_val, "timeline_scenario": a.timeline_scenario,
                     "emulated": f"device time EMULATED: every batch sleeps factor x {a.device_ms} ms per sample after "
                                 "backward, plus (factor - 1) x its real compute"},
        "scenario_descriptions": describe(plan),
        "commands": commands, "load_avg": {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]},
        "cpu_count": os.cpu_count(), "total_runtime_s": time.time() - started, "output_dir": out,
        **agg,
    }
    for k, v in getattr(a, "previous", {}).items():  # --aggregate-only keeps what the runs measured
        report[k] = v
    if has_raw_runs(out) or glob.glob(os.path.join(out, "solo", "*", "summary.json")):
        write_trimmed(out)  # the raw data that ships (a re-aggregation of shipped runs keeps the file as it is)
    report["runs_jsonl"] = RUNS_JSONL if os.path.exists(os.path.join(out, RUNS_JSONL)) else None
    report["plots"] = []
    try:
        if not getattr(a, "no_plots", False):
            report["plots"] = plots(report, out)
    except Exception as e:  # noqa: BLE001  the numbers matter more than the pictures
        report["plot_error"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    md = markdown(report)
    with open(os.path.join(out, "matrix.md"), "w") as f:
        f.write(md)
    return report


# --- running ------------------------------------------------------------------------------------
def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_train(overrides: list[str], run_dir: str, timeout_s: float, multirun: bool = False,
              threads: int = 1) -> dict[str, Any]:
    """One ``python -m lightning_straggler.train`` process; its own process group so a timeout ends it whole."""
    cmd = [sys.executable, "-m", "lightning_straggler.train", *(["-m"] if multirun else []), *overrides]
    os.makedirs(run_dir, exist_ok=True)
    log = os.path.join(run_dir, "train.log")
    t0 = time.time()
    with open(log, "w") as f:
        # the same torch threads in every worker, solo or not: 2 OpenMP threads per process on an
        # oversubscribed machine spin-wait (a solo step took 4x a 2-worker one's)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
    rec = {"command": f"OMP_NUM_THREADS={threads} " + shlex.join(cmd), "returncode": rc, "seconds": time.time() - t0, "log": log,
           "load_avg_before": None}
    if rc != 0:
        with open(log) as f:
            tail = f.read()[-1500:]
        rec["error"] = (f"timed out after {timeout_s:.0f} s" if rc is None else f"exit code {rc}") + f"; log tail: {tail}"
    return rec


def run_direct(plan: Plan, out: str, started: float) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]:
    a = plan.args
    commands: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    total = len(plan.solo) + len(plan.cells)
    done_s: list[float] = []

    def progress(i: int, label: str, rec: dict[str, Any]) -> None:
        done_s.append(rec["seconds"])
        el = time.time() - started
        eta = statistics.mean(done_s) * (total - i)
        status = "FAILED" if "error" in rec else "ok"
        print(f"[matrix] {i}/{total} {label}: {status} in {rec['seconds']:.0f} s{rec.get('brief', '')} | elapsed "
              f"{el / 60:.1f} min, ETA {eta / 60:.1f} min, load {os.getloadavg()[0]:.1f}", flush=True)

    # every finished run is appended to commands.jsonl at once, so --resume can skip it after an interruption
    journal = os.path.join(out, "commands.jsonl")
    previous = read_journal(journal) if a.resume else {}

    def record(rec: dict[str, Any]) -> None:
        commands.append(rec)
        with open(journal, "a") as f:
            f.write(json.dumps({k: v for k, v in rec.items() if k != "brief"}) + "\n")

    def reused(d: str, key: str) -> dict[str, Any] | None:
        if not a.resume or not os.path.exists(os.path.join(d, "summary.json")):
            return None
        rec = dict(previous.get(key) or {"command": "(finished before this --resume; command not journaled)",
                                          "returncode": 0, "seconds": 0.0, "log": os.path.join(d, "train.log")})
        rec["reused"] = True
        return rec

    i = 0
    for s in plan.solo:
        i += 1
        d = os.path.join(out, "solo", f"f{s['factor']:g}")
        if (rec := reused(d, f"solo:{s['factor']:g}")) is not None:
            commands.append(rec)
            print(f"[matrix] {i}/{total} solo factor {s['factor']:g}: finished earlier, reused", flush=True)
            continue
        load = _load()
        rec = run_train(s["overrides"] + [f"output_dir={d}", f"hydra.run.dir={d}"], d, a.run_timeout, threads=a.threads)
        rec.update(kind="solo", factor=s["factor"], load_avg_before=load)
        if "error" not in rec:
            with open(os.path.join(d, "summary.json")) as f:
                rec["brief"] = f", {json.load(f)['throughput_samples_per_s']:.0f} samples/s"
        record(rec)
        progress(i, f"solo factor {s['factor']:g}", rec)
    for c in plan.cells:
        i += 1
        name = _name(c)
        d = os.path.join(out, "runs", name)
        if (rec := reused(d, name)) is not None:
            commands.append(rec)
            print(f"[matrix] {i}/{total} {name}: finished earlier, reused", flush=True)
            continue
        plot = c["scenario"] == a.timeline_scenario and c["seed"] == a.seeds_list[0]
        load = _load()
        rec = run_train(c["overrides"] + [f"profiler.plot={str(plot).lower()}", f"output_dir={d}", f"hydra.run.dir={d}"],
                        d, a.run_timeout, threads=a.threads)
        rec.update(kind="cell", run=name, load_avg_before=load, order_seed=c["order_seed"],
                   order_position=c["order_position"])
        if "error" in rec:
            errors[name] = rec["error"]
        else:
            with open(os.path.join(d, "summary.json")) as f:
                s = json.load(f)
            rec["brief"] = (f", {s['throughput_samples_per_s']:.0f} samples/s, val_acc {_f(s['val_acc'], '.3f')}, "
                            f"wall {s['wall_s']:.1f} s + launch {s.get('launch_s', 0):.1f} s")
        record(rec)
        progress(i, name, rec)
    for rec in commands:
        rec.pop("brief", None)
    runs = load_runs(os.path.join(out, "runs"), plan.cells, errors)
    return runs, load_solo(os.path.join(out, "solo")), commands


def sweep_invocations(plan: Plan, out: str, launcher: str | None) -> list[dict[str, Any]]:
    """Hydra multirun command lines covering the grid: one per (scenario, N), and per seed where the
    scenario's overrides depend on it; algorithms and seeds are swept inside each."""
    a = plan.args
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for c in plan.cells:
        key = (c["scenario"], c["world_size"], c["seed"] if c["seed_dependent"] else None, tuple(c["extra"]))
        groups.setdefault(key, []).append(c)
    launch = [f"hydra/launcher={launcher}"] if launcher else []
    inv = []
    solo_f = ",".join(f"[{s['factor']}]" for s in plan.solo)
    if plan.solo:
        ov = [o for o in plan.solo[0]["overrides"] if not o.startswith("straggler.factors=")]
        inv.append({"kind": "solo", "overrides": ov + [f"straggler.factors={solo_f}", *launch,
                                                       f"hydra.sweep.dir={os.path.join(out, 'solo')}",
                                                       "hydra.sweep.subdir=solo${hydra.job.num}"]})
    for (sc, n, sd, extra), cs in groups.items():
        seeds = sorted({c["seed"] for c in cs})
        algos = [x for x in a.algorithms if any(c["algorithm"] == x for c in cs)]
        plot = "true" if sc == a.timeline_scenario else "false"
        ov = [f"algorithm={','.join(algos)}", f"straggler={sc}", *extra, *plan.common(n, plan.steps(n)),
              f"seed={','.join(map(str, seeds))}", f"profiler.plot={plot}", *launch,
              f"hydra.sweep.dir={os.path.join(out, 'runs')}",
              f"hydra.sweep.subdir=${{algorithm.name}}_{sc}_N{n}_seed${{seed}}"]
        inv.append({"kind": "cells", "scenario": sc, "world_size": n, "overrides": ov})
    return inv


def read_journal(path: str) -> dict[str, dict[str, Any]]:
    """The finished runs of an earlier invocation in the same directory, by run name (``solo:<factor>`` for solo)."""
    found: dict[str, dict[str, Any]] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by the interruption
                    continue
                key = rec.get("run") or f"solo:{rec.get('factor', 0):g}"
                found[key] = rec
    return found


def run_sweep(plan: Plan, out: str, started: float, launcher: str | None):
    commands = []
    invs = sweep_invocations(plan, out, launcher)
    for i, inv in enumerate(invs, 1):
        d = os.path.join(out, "sweep_logs", f"{i:02d}_{inv['kind']}")
        load = _load()
        rec = run_train(inv["overrides"], d, plan.args.run_timeout * 40, multirun=True, threads=plan.args.threads)
        rec.update(kind=f"multirun ({inv['kind']})", load_avg_before=load)
        commands.append(rec)
        print(f"[matrix] multirun {i}/{len(invs)} ({inv['kind']} {inv.get('scenario', '')} N={inv.get('world_size', 1)}): "
              f"{'FAILED' if 'error' in rec else 'ok'} in {rec['seconds']:.0f} s | elapsed {(time.time() - started) / 60:.1f} min",
              flush=True)
    return load_runs(os.path.join(out, "runs"), plan.cells), load_solo(os.path.join(out, "solo")), commands


# --- command line -------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.matrix", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"one seed, world size {QUICK['world_sizes']}, scenarios {QUICK['scenarios']}, the default algorithms, "
                         f"{QUICK['steps']} steps (options given explicitly still win)")
    ap.add_argument("--algorithms", nargs="+", choices=ALGORITHMS, default=None,
                    help=f"any of {', '.join(ALGORITHMS)} (default: {', '.join(DEFAULT_ALGORITHMS)}; ddp is Lightning's own "
                         "DDPStrategy, the baseline; ddplocal the same with post-local SGD; ringc5 ring with Horovod's cycle at 5 ms; adaptivewait adaptive without its step deadline); "
                         "ring is always added (the reference)")
    ap.add_argument("--scenarios", nargs="+", default=None,
                    help=f"names of conf/straggler/<name>.yaml (default: {' '.join(SCENARIOS)})")
    ap.add_argument("--world-sizes", nargs="+", type=int, default=None, help="workers per run (default 4 8)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per cell, 0..seeds-1 (default 3; quick 1)")
    ap.add_argument("--seed-offset", type=int, default=0, help="first seed (default 0)")
    length = ap.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, default=None,
                        help=f"optimizer steps per run, the same at every world size (default {DEFAULT_STEPS}; quick "
                             f"{QUICK['steps']})")
    length.add_argument("--epochs", type=int, default=None, help="epochs per run instead (steps then depend on N)")
    ap.add_argument("--device-ms", type=float, default=DEFAULT_DEVICE_MS,
                    help=f"emulated device ms per sample at factor 1 (default {DEFAULT_DEVICE_MS})")
    ap.add_argument("--target-acc", type=float, default=None,
                    help=f"target validation accuracy (default {DEFAULT_TARGET_ACC}; quick {QUICK['target_acc']})")
    ap.add_argument("--timeline-scenario", default=None,
                    help="scenario whose first-seed runs draw a per-rank timeline (default: the first straggler scenario)")
    ap.add_argument("--output-dir", default=None, help="default benchmarks/results/matrix/<stamp>")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per worker process, solo runs included (OMP_NUM_THREADS; default 1)")
    ap.add_argument("--run-timeout", type=float, default=900, help="seconds per run before it is stopped (default 900)")
    ap.add_argument("--sweep", action="store_true", help="run the grid through Hydra multirun (-m)")
    ap.add_argument("--launcher", default=None,
                    help="with --sweep: a Hydra launcher of conf/hydra/launcher/ (e.g. submitit_slurm)")
    ap.add_argument("--aggregate-only", metavar="DIR", default=None,
                    help="re-aggregate an existing output directory (its runs/ and solo/) without running anything")
    ap.add_argument("--shipped", action="store_true",
                    help=f"with --aggregate-only: read the trimmed runs of DIR/{RUNS_JSONL} even where the raw runs/ "
                         "exist (what a checkout of the repository has)")
    ap.add_argument("--no-plots", action="store_true",
                    help="write summary.json and matrix.md only, not the PNG plots (a quick re-aggregation)")
    ap.add_argument("--resume", metavar="DIR", default=None,
                    help="continue an interrupted invocation in DIR with the same options: runs that finished "
                         "(summary.json present) are reused, the rest run")
    ap.add_argument("--noise", action="store_true",
                    help=f"run ring twice in every (N, scenario, seed) block ({NOISE_LABEL}) and report {NOISE_LABEL}/ring "
                         "with its interval: the machine's run-to-run noise")
    ap.add_argument("--order-seed", type=int, default=0,
                    help="seed of the per-block run order (default 0; recorded in the output)")
    ap.add_argument("--dry-run", action="store_true", help="validate and print the plan, run nothing")
    a = ap.parse_args(argv)

    def bad(option: str, msg: str) -> None:
        ap.error(f"{option}: {msg}")

    a.algorithms = list(a.algorithms or DEFAULT_ALGORITHMS)
    if "ring" not in a.algorithms:
        a.algorithms.insert(0, "ring")
    a.algorithms = [x for x in ALGORITHMS if x in a.algorithms]
    known = available_scenarios()
    a.scenarios = list(dict.fromkeys(a.scenarios or (QUICK["scenarios"] if a.quick else SCENARIOS)))
    for sc in a.scenarios:
        if sc not in known:
            bad("--scenarios", f"invalid choice {sc!r} (choose from the files in conf/straggler/: {', '.join(known)})")
    a.world_sizes = list(dict.fromkeys(a.world_sizes or (QUICK["world_sizes"] if a.quick else [4, 8])))
    from lightning_straggler.config import max_local_workers

    limit = max_local_workers()
    for n in a.world_sizes:
        if not 2 <= n <= limit:
            bad("--world-sizes", f"each must be in 2..{limit} (got {n})")
    a.seeds = a.seeds if a.seeds is not None else (QUICK["seeds"] if a.quick else 3)
    if a.seeds < 1:
        bad("--seeds", f"must be >= 1 (got {a.seeds})")
    if a.seed_offset < 0:
        bad("--seed-offset", f"must be >= 0 (got {a.seed_offset})")
    a.seeds_list = list(range(a.seed_offset, a.seed_offset + a.seeds))
    if a.epochs is None and a.steps is None:
        a.steps = QUICK["steps"] if a.quick else DEFAULT_STEPS
    if a.steps is not None and a.steps < 3:
        bad("--steps", f"must be >= 3 (got {a.steps})")
    if a.epochs is not None and a.epochs < 1:
        bad("--epochs", f"must be >= 1 (got {a.epochs})")
    if a.device_ms < 0:
        bad("--device-ms", f"must be >= 0 (got {a.device_ms})")
    a.target_acc = a.target_acc if a.target_acc is not None else (QUICK["target_acc"] if a.quick else DEFAULT_TARGET_ACC)
    if not 0 < a.target_acc <= 1:
        bad("--target-acc", f"must be in (0, 1] (got {a.target_acc})")
    if a.timeline_scenario is None:
        a.timeline_scenario = next((s for s in a.scenarios if s != "none"), a.scenarios[0])
    elif a.timeline_scenario not in a.scenarios:
        bad("--timeline-scenario", f"must be one of the --scenarios ({', '.join(a.scenarios)}) (got {a.timeline_scenario!r})")
    if a.threads < 1:
        bad("--threads", f"must be >= 1 (got {a.threads})")
    if a.run_timeout <= 0:
        bad("--run-timeout", f"must be > 0 (got {a.run_timeout})")
    if a.sweep and any(x in ALGORITHM_VARIANTS for x in a.algorithms):
        bad("--algorithms", f"{', '.join(x for x in a.algorithms if x in ALGORITHM_VARIANTS)} not with --sweep (a Hydra "
                            "multirun sweeps algorithm files; this row is a file plus settings): run it without --sweep")
    if a.sweep and a.noise:
        bad("--noise", "not with --sweep (a Hydra multirun cannot run ring twice into one sweep directory)")
    if a.launcher is not None:
        if not a.sweep:
            bad("--launcher", "only with --sweep")
        launchers = sorted(os.path.splitext(p)[0] for p in os.listdir(os.path.join(CONF, "hydra", "launcher")))
        if a.launcher not in launchers + ["basic"]:
            bad("--launcher", f"invalid choice {a.launcher!r} (choose from basic, {', '.join(launchers)})")
    if a.resume is not None:
        if a.aggregate_only or a.sweep or a.output_dir:
            bad("--resume", "cannot be combined with --aggregate-only, --sweep or --output-dir (it names the directory)")
        if not os.path.isdir(a.resume):
            bad("--resume", f"{a.resume} is not a directory")
    if a.aggregate_only and not (os.path.isdir(os.path.join(a.aggregate_only, "runs"))
                                 or os.path.exists(os.path.join(a.aggregate_only, RUNS_JSONL))):
        bad("--aggregate-only", f"{a.aggregate_only} has neither a runs/ directory nor {RUNS_JSONL}")
    if a.shipped and not a.aggregate_only:
        bad("--shipped", "only with --aggregate-only")
    if a.shipped and not os.path.exists(os.path.join(a.aggregate_only, RUNS_JSONL)):
        bad("--shipped", f"{a.aggregate_only} has no {RUNS_JSONL}")
    return a


INVOCATION_JSON = "invocation.json"


def _without(argv: Sequence[str], options: Sequence[str], flags: Sequence[str] = ()) -> list[str]:
    """argv less the given options (with their value, ``--x v`` or ``--x=v``) and flags."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in options:
            skip = True
        elif not (x in flags or any(x.startswith(o + "=") for o in options)):
            out.append(x)
    return out


# flags that change how a directory is re-aggregated, not which grid it holds
AGGREGATE_ONLY_FLAGS = ["--shipped", "--no-plots"]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    raw = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(raw)
    measured_argv = None  # a re-aggregation (or a resumed grid) records the measuring invocation's command line
    directory = a.aggregate_only or a.resume
    if directory and not _without(raw, ["--aggregate-only", "--resume"], AGGREGATE_ONLY_FLAGS):
        # only the directory given: re-plan with the options of the invocation that measured it
        # summary.json's settings; an interrupted grid has none yet, only the invocation written at its start
        flag = "--aggregate-only" if a.aggregate_only else "--resume"
        before = {}
        for name, key in (("summary.json", "settings"), (INVOCATION_JSON, None)):
            path = os.path.join(directory, name)
            if os.path.exists(path):
                with open(path) as f:
                    before = json.load(f)
                before = before.get(key, {}) if key else before
                if before.get("argv") is not None:
                    break
        if before.get("argv") is not None:
            measured_argv = list(before["argv"])
            raw = _without(before["argv"], ["--output-dir", "--resume", "--aggregate-only"], ["--dry-run"]) + raw
            print(f"[matrix] {flag}: the measuring invocation's options {shlex.join(raw)}", flush=True)
            a = parse_args(raw)
        elif a.resume:  # else the default grid would run into another grid's directory
            print(f"error: --resume {directory}: no recorded options there ({INVOCATION_JSON} or summary.json); "
                  "give the grid's options as well", file=sys.stderr)
            sys.exit(2)
    # recorded: the options that define the grid (a re-aggregation records those, not its own directory)
    a.argv = measured_argv or (_without(raw, ["--aggregate-only"], AGGREGATE_ONLY_FLAGS) if a.aggregate_only else raw)
    started, load_start = time.time(), _load()
    plan = Plan(a)
    try:
        plan.build()
    except Exception as e:  # noqa: BLE001  (any composition or validation error, before anything runs)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    stamp = time.strftime("%Y%m%d-%H%M%S") + ("-quick" if a.quick else "") + ("-sweep" if a.sweep else "")
    out = os.path.abspath(a.aggregate_only or a.resume or a.output_dir or os.path.join(RESULTS, stamp))
    print(f"[matrix] {len(a.algorithms)} algorithms {a.algorithms} x {len(a.scenarios)} scenarios {a.scenarios} x "
          f"N {a.world_sizes} x seeds {a.seeds_list}: {len(plan.cells)} runs + {len(plan.solo)} solo calibration runs "
          f"(factors {[s['factor'] for s in plan.solo]}); steps per run {[plan.steps(n) for n in a.world_sizes]}; "
          f"device time EMULATED {a.device_ms} ms/sample x factor; load avg {load_start}; output {out}", flush=True)
    if a.dry_run:
        for c in plan.cells:  # in run order: each block shuffled
            print(f"  [{_name(c)}] python -m lightning_straggler.train " + shlex.join(c["overrides"]))
        if a.sweep:
            for inv in sweep_invocations(plan, out, a.launcher):
                print("  python -m lightning_straggler.train -m " + shlex.join(inv["overrides"]))
        return {}
    os.makedirs(out, exist_ok=True)
    if not a.aggregate_only:  # the grid's options, for an --aggregate-only DIR of a grid interrupted before summary.json
        with open(os.path.join(out, INVOCATION_JSON), "w") as f:
            json.dump({"argv": a.argv}, f)
    if a.aggregate_only:
        # the raw run directories where they exist, else (a checkout) the trimmed runs that ship
        shipped = read_trimmed(out) if a.shipped or not has_raw_runs(out) else None
        print(f"[matrix] aggregating {'<out>/' + RUNS_JSONL if shipped is not None else 'the raw runs/ and solo/'}",
              flush=True)
        runs = load_runs(os.path.join(out, "runs"), plan.cells, shipped=shipped)
        solo, commands, mode = load_solo(os.path.join(out, "solo"), shipped), [], "aggregate-only"
        prev = os.path.join(out, "summary.json")
        if os.path.exists(prev):
            with open(prev) as f:
                before = json.load(f)
            commands = before.get("commands", [])
            # the measuring invocation's load and duration, not this re-aggregation's
            load_start = before.get("load_avg", {}).get("start", load_start)
            a.previous = {k: before[k] for k in ("load_avg", "total_runtime_s", "mode", "cpu_count") if k in before}
    elif a.sweep:
        runs, solo, commands = run_sweep(plan, out, started, a.launcher)
        mode = "sweep"
    else:
        runs, solo, commands = run_direct(plan, out, started)
        mode = ("quick" if a.quick else "direct") + (" (resumed)" if a.resume else "")
    report = finish(plan, out, started, load_start, runs, solo, commands, mode)
    print()
    print(markdown(report))
    print(f"[matrix] wrote {out}/summary.json, matrix.md and {len(report['plots'])} plots in "
          f"{report['total_runtime_s'] / 60:.1f} min", flush=True)
    return report


if __name__ == "__main__":
    main()
