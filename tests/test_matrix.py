"""benchmarks.matrix: the ideal-rate and aggregation arithmetic on constructed inputs (no processes),
option errors, and the real path on a tiny grid (2 workers, ring and dpar, few steps)."""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

from benchmarks import matrix as m


# --- pure arithmetic ----------------------------------------------------------------------------
def test_seconds_per_sample_exact_between_and_outside():
    cal = {1.0: 400.0, 4.0: 100.0, 10.0: 40.0}
    assert m.seconds_per_sample(1.0, cal) == pytest.approx(1 / 400)
    assert m.seconds_per_sample(4.0, cal) == pytest.approx(1 / 100)
    assert m.seconds_per_sample(10.0, cal) == pytest.approx(1 / 40)
    # linear in f between measured factors
    assert m.seconds_per_sample(2.5, cal) == pytest.approx((1 / 400 + 1 / 100) / 2)
    assert m.seconds_per_sample(7.0, cal) == pytest.approx((1 / 100 + 1 / 40) / 2)
    # beyond the last point: the last segment extended
    slope = (1 / 40 - 1 / 100) / 6
    assert m.seconds_per_sample(13.0, cal) == pytest.approx(1 / 40 + 3 * slope)
    # one point: proportional to the factor
    assert m.seconds_per_sample(3.0, {1.0: 500.0}) == pytest.approx(3 / 500)
    with pytest.raises(ValueError):
        m.seconds_per_sample(1.0, {})


def test_worker_rates_are_time_weighted():
    cal = {1.0: 400.0, 4.0: 100.0}
    # constant factors: the solo rates themselves
    assert m.worker_rates([[1.0] * 9, [4.0] * 9], cal) == pytest.approx([400.0, 100.0])
    # a third of the steps at 4x: samples / time = 3 / (2/400 + 1/100)
    assert m.worker_rates([[1.0, 4.0, 1.0]], cal)[0] == pytest.approx(3 / (2 / 400 + 1 / 100))


def test_ideal_throughput_formula():
    assert m.ideal_throughput([400.0, 400.0], 64, 0.0) == pytest.approx(800.0)
    # G = 64 samples per step at 800/s is 80 ms, plus 20 ms all-reduce: 640 samples/s
    assert m.ideal_throughput([400.0, 400.0], 64, 0.02) == pytest.approx(640.0)
    assert m.ideal_throughput([400.0, 100.0, 100.0], 96, 0.0) == pytest.approx(600.0)


def test_allreduce_cost_is_the_transfer_profiling_reports():
    # summary.json's comm_s is already net of waiting (profiling.summarise): it is not reduced again
    s = {"per_rank": {"0": {"steps": 10, "comm_s": {"total": 0.2}, "wait_s": {"total": 0.3}},
                      "1": {"steps": 10, "comm_s": {"total": 0.4}, "wait_s": {"total": 0.0}}}}
    assert m.allreduce_cost(s) == pytest.approx(0.03)
    assert m.allreduce_cost({"per_rank": {}}) is None


def test_allreduce_cost_from_real_profiling_records():
    from lightning_straggler.profiling import StepRecord, summarise

    # every step: rank 0 arrives first and blocks 30 ms for rank 1, then both transfer for 20 ms
    recs = []
    for step in range(5):
        recs.append(StepRecord(0, step, 0.0, 0.01, 0.05, 32, 0))
        recs.append(StepRecord(1, step, 0.0, 0.04, 0.02, 32, 0))
    per_rank = {str(k): v for k, v in summarise(recs).items()}
    assert per_rank["0"]["wait_s"]["total"] == pytest.approx(0.15)
    assert m.allreduce_cost({"per_rank": per_rank}) == pytest.approx(0.02)


def test_spread_and_run_names():
    assert m.spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert m.spread([None])["median"] is None
    name = m.run_name("dssync", "my_schedule", 8, 2)
    assert name == "dssync_my_schedule_N8_seed2"
    assert m.parse_run_name(name) == {"algorithm": "dssync", "scenario": "my_schedule", "world_size": 8, "seed": 2}
    assert m.parse_run_name("solo0") is None and m.parse_run_name("sgd_none_N4_seed0") is None


def test_scenario_overrides():
    ov, dep = m.scenario_overrides("mix3", "static", 8, 124, 0)
    assert not dep and ov == ["straggler.factors=[1.0,1.0,1.0,1.667,1.667,1.667,3.333,3.333]"]
    ov, dep = m.scenario_overrides("transient4x", "transient", 4, 90, 0)
    assert not dep and ov == ["straggler.events=[{rank:3,factor:4.0,start_step:30,end_step:60}]"]
    a, dep = m.scenario_overrides("random2", "transient", 8, 60, 1)
    assert dep and a == m.scenario_overrides("random2", "transient", 8, 60, 1)[0]
    assert a != m.scenario_overrides("random2", "transient", 8, 60, 2)[0]
    ev = m.random2_events(5, 8, 60)
    assert len({e["rank"] for e in ev}) == 2 and all(e["end_step"] - e["start_step"] == 20 for e in ev)
    assert all(0 <= e["start_step"] and e["end_step"] <= 60 for e in ev)
    assert m.scenario_overrides("random", "random", 4, 60, 3) == (["straggler.seed=${seed}"], False)
    assert m.scenario_overrides("permanent10x", "transient", 4, 60, 0) == ([], False)


def test_solo_factors():
    assert m.solo_factors([[[1.0, 4.0], [1.0, 1.0]], [[10.0, 1.0]]]) == [1.0, 4.0, 10.0]
    many = [[[1.0 + i / 10 for i in range(30)]]]
    assert m.solo_factors(many) == [1.0, 3.9]


def _summary(algo, n, thr, ttt, acc, comm=0.2, wait=0.1, steps=10, batch=32):
    per_rank = {str(r): {"steps": steps, "samples": steps * batch, "comm_s": {"total": comm, "mean": comm / steps},
                         "wait_s": {"total": wait if r else 0.0}, "compute_s": {"total": 1.0}} for r in range(n)}
    return {"algorithm": algo, "world_size": n, "throughput_samples_per_s": thr, "time_to_target_s": ttt,
            "val_acc": acc, "wall_s": 1.0, "launch_s": 5.0, "train_samples": n * steps * batch,
            "per_rank": per_rank, "val_history": [{"elapsed_s": 0.5, "step": 5, "val_acc": acc}],
            "timeline_png": None, "config": {"data": {"batch_size": batch}}}


def test_aggregate_ratios_efficiency_and_errors():
    solo = {"1": {"factor": 1.0, "rate": 400.0}, "4": {"factor": 4.0, "rate": 100.0}}
    f_none = [[1.0] * 10, [1.0] * 10]
    f_slow = [[1.0] * 10, [4.0] * 10]
    runs = []
    for sd, scale in ((0, 1.0), (1, 1.2)):
        runs += [
            {"algorithm": "ring", "scenario": "none", "world_size": 2, "seed": sd,
             "summary": _summary("ring", 2, 600.0 * scale, 2.0, 0.5, comm=0.2, wait=0.1)},
            {"algorithm": "dpar", "scenario": "none", "world_size": 2, "seed": sd,
             "summary": _summary("dpar", 2, 660.0 * scale, 1.0, 0.52)},
            {"algorithm": "ring", "scenario": "slow", "world_size": 2, "seed": sd,
             "summary": _summary("ring", 2, 150.0 * scale, None, 0.4)},
        ]
    runs.append({"algorithm": "dpar", "scenario": "slow", "world_size": 2, "seed": 0, "error": "exit code 1"})
    factors = {}
    for r in runs:
        factors[m.run_name(r["algorithm"], r["scenario"], 2, r["seed"])] = f_none if r["scenario"] == "none" else f_slow
    agg = m.aggregate(runs, solo, factors)
    cells = {(c["scenario"], c["algorithm"]): c for c in agg["cells"]}
    ring = cells[("none", "ring")]
    assert ring["throughput_ratio_to_ring"] == {"median": 1.0, "min": 1.0, "max": 1.0, "n": 2}
    assert cells[("none", "dpar")]["throughput_ratio_to_ring"]["median"] == pytest.approx(1.1)
    assert cells[("none", "dpar")]["ttt_ratio_to_ring"]["median"] == pytest.approx(0.5)
    assert cells[("none", "dpar")]["acc_diff_points_vs_ring"]["median"] == pytest.approx(2.0)
    # t_ar: ranks' comm (already net of waiting) / steps = 0.2 / 10 = 20 ms, whatever wait_s says
    ideal = 64 / (64 / 800 + 0.02)
    assert agg["comm_cost"]["N2_seed0"]["t_ar_s"] == pytest.approx(0.02)
    run0 = next(r for r in agg["runs"] if (r["algorithm"], r["scenario"], r["seed"]) == ("ring", "none", 0))
    assert run0["ideal"] == pytest.approx(ideal) and run0["efficiency"] == pytest.approx(600 / ideal)
    assert ring["efficiency"]["min"] == pytest.approx(600 / ideal) and ring["efficiency"]["max"] == pytest.approx(720 / ideal)
    # the slow scenario's ideal uses the slow worker's solo rate, and the same t_ar (ring / none)
    slow = next(r for r in agg["runs"] if (r["algorithm"], r["scenario"], r["seed"]) == ("ring", "slow", 0))
    assert slow["ideal"] == pytest.approx(64 / (64 / 500 + 0.02)) and slow["t_ar_source"] == "ring_none_N2_seed0"
    # a failed run is recorded and the cell keeps the other seeds' figures
    bad = cells[("slow", "dpar")]
    assert bad["ok"] == 0 and bad["runs"] == 1 and bad["errors"] == [{"seed": 0, "error": "exit code 1"}]
    assert bad["throughput"]["median"] is None
    assert cells[("slow", "ring")]["reached_target"] == 0


def test_aggregate_without_ring_none_falls_back():
    solo = {"1": {"factor": 1.0, "rate": 400.0}}
    runs = [{"algorithm": "ring", "scenario": "x", "world_size": 2, "seed": 0,
             "summary": _summary("ring", 2, 600.0, 1.0, 0.5)}]
    agg = m.aggregate(runs, solo, {"ring_x_N2_seed0": [[1.0] * 10] * 2})
    assert agg["runs"][0]["t_ar_source"] == "ring_x_N2_seed0"
    agg = m.aggregate(runs, {}, {"ring_x_N2_seed0": [[1.0] * 10] * 2})
    assert "efficiency" not in agg["runs"][0] and agg["cells"][0]["efficiency"]["median"] is None


# --- statistics ---------------------------------------------------------------------------------
def test_paired_bootstrap_small_samples_give_the_range_and_no_interval_below_three():
    # with 3 (or 5) pairs the median of a resample is the smallest value with probability > 2.5%:
    # the 95% interval is the whole range, so a "win" needs every seed's ratio above 1
    for vals in ([1.2, 1.05, 1.3], [1.2, 1.05, 1.3, 1.1, 1.15]):
        ci = m.paired_bootstrap(vals)
        assert ci["median"] == pytest.approx(sorted(vals)[len(vals) // 2])
        assert (ci["lo"], ci["hi"]) == (pytest.approx(min(vals)), pytest.approx(max(vals)))
        assert ci["n"] == len(vals) and ci["resamples"] == 10_000
        assert m.label(ci) == "win"
    two = m.paired_bootstrap([1.5, 1.6, None])
    assert two["median"] == pytest.approx(1.55) and two["lo"] is None and two["hi"] is None and two["n"] == 2
    assert "not available" in two["interval"] and m.label(two) == "n/a"
    assert m.paired_bootstrap([])["median"] is None


def test_paired_bootstrap_seven_pairs_trims_the_extremes_and_is_seeded():
    # 7 pairs: P(median of a resample = the smallest) = 1.0%, P(<= the 2nd smallest) = 10.8%: the 2.5%
    # quantile is the 2nd smallest value, the 97.5% quantile the 2nd largest
    vals = [0.80, 1.02, 1.04, 1.06, 1.08, 1.10, 1.50]
    ci = m.paired_bootstrap(vals)
    assert ci["median"] == pytest.approx(1.06)
    assert ci["lo"] == pytest.approx(1.02) and ci["hi"] == pytest.approx(1.10)
    assert m.label(ci) == "win"  # one bad seed of seven does not decide it
    assert m.paired_bootstrap(vals) == ci  # the same seed, the same interval
    assert m.paired_bootstrap(list(reversed(vals)))["lo"] == pytest.approx(1.02)


def test_labels_for_each_direction():
    inside = {"lo": 0.95, "hi": 1.08}
    assert m.label(inside) == "no difference" and m.label(inside, 1.0, False) == "no difference"
    above, below = {"lo": 1.01, "hi": 1.3}, {"lo": 0.7, "hi": 0.99}
    assert m.label(above) == "win" and m.label(below) == "loss"
    # time to target X/ring: lower is better
    assert m.label(below, 1.0, False) == "win" and m.label(above, 1.0, False) == "loss"
    # accuracy difference in points against 0
    assert m.label({"lo": 0.2, "hi": 1.0}, 0.0) == "win" and m.label({"lo": -1.0, "hi": 0.5}, 0.0) == "no difference"
    # the interval touching the reference is not a win
    assert m.label({"lo": 1.0, "hi": 1.2}) == "no difference"
    assert m.label({"lo": None, "hi": None}) == "n/a"


def test_block_order_is_seeded_per_block_and_not_ring_first():
    labels = ["ring", "dpar", "awar", "dssync", "boa", m.NOISE_LABEL]
    orders = {(n, sc, sd): m.block_order(labels, n, sc, sd, 0)
              for n in (4, 8) for sc in ("none", "mix3") for sd in range(5)}
    assert all(sorted(o) == sorted(labels) for o in orders.values())
    assert orders == {k: m.block_order(labels, *k, 0) for k in orders}  # reproducible (--resume relies on it)
    firsts = {o[0] for o in orders.values()}
    assert len(firsts) >= 3 and len({tuple(o) for o in orders.values()}) >= 15
    assert any(m.block_order(labels, *k, 1) != o for k, o in orders.items())  # --order-seed changes it


def test_rep_run_names_are_the_matrix_own_and_invisible_to_run_re():
    name = m.run_name("ring", "mix3", 4, 2, rep=2)
    assert name == "ring_mix3_N4_seed2_rep2" and m.run_name("ring", "mix3", 4, 2) == "ring_mix3_N4_seed2"
    assert m.parse_run_name(name) == {"algorithm": "ring", "scenario": "mix3", "world_size": 4, "seed": 2, "rep": 2}
    assert m.RUN_RE.match(name) is None  # benchmarks.sim_validate's grid rows use RUN_RE: no second ring row
    assert m.parse_run_name("ring_mix3_N4_seed2_rep1") is None


def _paired_runs(ratios, noise=None, scenario="none", n=4):
    """ring at 1000 samples/s per seed, dpar at ratio x 1000, and ring#2 at noise x 1000."""
    runs = []
    for sd, r in enumerate(ratios):
        runs.append({"algorithm": "ring", "scenario": scenario, "world_size": n, "seed": sd,
                     "summary": _summary("ring", n, 1000.0, 10.0, 0.5)})
        runs.append({"algorithm": "dpar", "scenario": scenario, "world_size": n, "seed": sd,
                     "summary": _summary("dpar", n, 1000.0 * r, 10.0 / r, 0.5 + 0.01 * (r - 1))})
        if noise is not None:
            runs.append({"algorithm": "ring", "rep": 2, "scenario": scenario, "world_size": n, "seed": sd,
                         "summary": _summary("ring", n, 1000.0 * noise[sd], 10.0, 0.5)})
    return runs


def test_aggregate_intervals_labels_and_noise():
    ratios, noise = [1.3, 1.2, 1.25, 1.4, 1.15], [1.02, 0.97, 1.05, 0.99, 1.01]
    agg = m.aggregate(_paired_runs(ratios, noise), {}, {})
    cells = {c["algorithm"]: c for c in agg["cells"]}
    assert set(cells) == {"ring", "dpar"}  # the replica is not a cell of its own
    iv = cells["dpar"]["intervals"]
    assert iv["throughput_ratio_to_ring"]["median"] == pytest.approx(1.25)
    assert iv["throughput_ratio_to_ring"]["lo"] == pytest.approx(1.15) and iv["throughput_ratio_to_ring"]["label"] == "win"
    assert iv["ttt_ratio_to_ring"]["hi"] == pytest.approx(1 / 1.15) and iv["ttt_ratio_to_ring"]["label"] == "win"
    assert iv["acc_diff_points_vs_ring"]["label"] == "win"
    assert cells["dpar"]["throughput_ratio_to_ring"]["n"] == 5  # the ring#2 runs are not ring's pairs
    assert cells["ring"]["runs"] == 5 and cells["ring"]["throughput"]["median"] == pytest.approx(1000.0)
    (nc,) = agg["noise"]
    assert (nc["world_size"], nc["scenario"], nc["runs"], nc["label"]) == (4, "none", 5, "ring#2")
    tn = nc["intervals"]["throughput_ratio_to_ring"]
    assert tn["median"] == pytest.approx(1.01) and (tn["lo"], tn["hi"]) == (pytest.approx(0.97), pytest.approx(1.05))
    assert tn["label"] == "no difference"
    assert {r["seed"]: r["throughput_ratio_to_ring"] for r in agg["noise_runs"]} == pytest.approx(dict(enumerate(noise)))
    assert agg["statistics"]["resamples"] == 10_000 and agg["statistics"]["min_seeds"] == 3

    # a loss, and a cell without enough pairs (one seed's dpar run failed, one more absent)
    runs = _paired_runs([0.8, 0.9, 0.85])
    runs[1] = {k: runs[1][k] for k in ("algorithm", "scenario", "world_size", "seed")} | {"error": "exit code 1"}
    agg = m.aggregate(runs, {}, {})
    d = next(c for c in agg["cells"] if c["algorithm"] == "dpar")
    assert d["intervals"]["throughput_ratio_to_ring"]["n"] == 2 and d["intervals"]["throughput_ratio_to_ring"]["label"] == "n/a"
    agg = m.aggregate(_paired_runs([0.8, 0.9, 0.85]), {}, {})
    d = next(c for c in agg["cells"] if c["algorithm"] == "dpar")
    assert d["intervals"]["throughput_ratio_to_ring"]["label"] == "loss" and agg["noise"] == []


def _report(agg, noise):
    st = {"algorithms": ["ring", "dpar"], "scenarios": ["none"], "world_sizes": [4], "seeds": [0, 1, 2, 3, 4],
          "steps_by_world": {"4": 10}, "batch": 32, "device_ms": 2.0, "target_acc": 0.3, "order_seed": 0, "noise": noise}
    return {"stamp": "t", "settings": st, "load_avg": {"start": [0, 0, 0], "end": [0, 0, 0]}, "cpu_count": 2,
            "total_runtime_s": 1.0, "scenario_descriptions": {}, "plots": [], **agg}


def test_markdown_prints_noise_first_and_labels():
    md = m.markdown(_report(m.aggregate(_paired_runs([1.3, 1.2, 1.25, 1.4, 1.15], [1.02, 0.97, 1.05, 0.99, 1.01]),
                                        {}, {}), True))
    assert md.index("## Machine noise: ring#2 / ring") < md.index("## Cells")
    assert "| 4 | none | 5 | 1.01 [0.97, 1.05] no difference |" in md
    assert "| 4 | none | dpar | 5/5 | 1250 [1150–1400] | 1.25 [1.15, 1.40] **win** |" in md
    assert "| 4 | none | ring | 5/5 | 1000 [1000–1000] | 1 (reference) |" in md
    md = m.markdown(_report(m.aggregate(_paired_runs([1.3]), {}, {}), False))
    assert "not measured in this invocation (run with `--noise`)" in md and "1.30 (n=1) n/a" in md


def test_noise_plan_runs_ring_twice_per_block_in_a_drawn_order():
    a = m.parse_args(["--algorithms", "ring", "dpar", "--scenarios", "none", "--world-sizes", "4", "--seeds", "4",
                      "--steps", "30", "--noise", "--order-seed", "3"])
    plan = m.Plan(a)
    plan.build()
    assert len(plan.cells) == 4 * 3
    for sd in range(4):
        block = [c for c in plan.cells if c["seed"] == sd]
        assert [c["order_position"] for c in block] == [0, 1, 2] and all(c["order_seed"] == 3 for c in block)
        labels = [m.NOISE_LABEL if c.get("rep", 1) == 2 else c["algorithm"] for c in block]
        assert labels == m.block_order(["ring", "dpar", m.NOISE_LABEL], 4, "none", sd, 3)
        rep = next(c for c in block if c.get("rep") == 2)
        ring = next(c for c in block if c["algorithm"] == "ring" and c.get("rep", 1) == 1)
        assert rep["overrides"] == ring["overrides"] and m._name(rep) == f"ring_none_N4_seed{sd}_rep2"
    assert len({m._name(c) for c in plan.cells}) == len(plan.cells)
    with pytest.raises(SystemExit):
        m.parse_args(["--noise", "--sweep"])


# --- raw data that ships ---------------------------------------------------------------------------
def _full(summary, extra_events=300):
    """A summary as a run writes it: what the aggregation reads plus what it does not (events, emulation)."""
    s = json.loads(json.dumps(summary))
    s["events"] = [{"step": i, "kind": "membership", "members": list(range(8)), "note": "x" * 40}
                   for i in range(extra_events)]
    s["emulated"] = {"device_time": "sleep", "slowdown": "factor x compute"}
    s["restarts"] = 0
    for r in s["per_rank"].values():
        r["compute_s"] |= {"p50": 0.1, "p95": 0.2, "mean": 0.1}
        r["comm_s"] |= {"p50": 0.02, "p95": 0.03}
        r["wait_s"] |= {"mean": 0.0, "p50": 0.0, "p95": 0.0}
    for v in s["val_history"]:
        v["val_loss"] = 1.0
    s["config"] |= {"straggler": {"scenario": "none"}, "algorithm": {"name": s["algorithm"]}, "seed": 0}
    return s


def _write_grid(out):
    runs = _paired_runs([1.3, 1.2, 1.25], [1.02, 0.97, 1.05])
    for r in runs:
        d = out / "runs" / m._name(r)
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps(_full(r["summary"]), indent=2))
        (d / "train.log").write_text("a log that does not ship\n" * 100)
    (out / "runs" / "dpar_none_N4_seed3").mkdir()  # a run that failed: a directory without summary
    solo = _full(_summary("ring", 1, 450.0, 5.0, 0.5), extra_events=0)
    solo["config"]["straggler"] = {"scenario": "static", "factors": [1.0]}
    (out / "solo" / "f1").mkdir(parents=True)
    (out / "solo" / "f1" / "summary.json").write_text(json.dumps(solo))


def test_trimmed_runs_reproduce_the_aggregate_of_the_raw_ones(tmp_path):
    out = tmp_path / "grid"
    _write_grid(out)
    factors = {}  # rebuilt per run from the summaries' own configs (none here: no ideal), the same both ways
    raw_runs, raw_solo = m.load_runs(str(out / "runs")), m.load_solo(str(out / "solo"))
    assert len(raw_runs) == 10 and raw_solo["1"]["rate"] == pytest.approx(32 / 0.12)
    raw = m.aggregate(raw_runs, raw_solo, factors)

    m.write_trimmed(str(out))
    lines = (out / m.RUNS_JSONL).read_text().splitlines()
    assert len(lines) == 11  # 9 runs, the failed one (summary null), 1 solo
    big = max(len(json.dumps(json.loads((p / "summary.json").read_text()))) for p in (out / "runs").iterdir()
              if (p / "summary.json").exists())
    assert big > 20_000 and max(len(x) for x in lines) < 4_000  # a few KB a run, the events gone
    assert json.loads(lines[0])["path"].startswith("runs/")

    # a checkout has runs.jsonl only: the raw directories are not needed
    shipped_dir = tmp_path / "checkout"
    shipped_dir.mkdir()
    (shipped_dir / m.RUNS_JSONL).write_text((out / m.RUNS_JSONL).read_text())
    shipped = m.read_trimmed(str(out))
    again = m.aggregate(m.load_runs(str(out / "runs"), shipped=shipped), m.load_solo(str(out / "solo"), shipped), factors)
    assert again == raw
    assert any(r.get("error") for r in again["runs"])  # the failed run is there, as in the raw aggregate
    assert next(c for c in again["cells"] if c["algorithm"] == "dpar")["intervals"]["throughput_ratio_to_ring"]["label"] == "win"
    assert again["noise"][0]["intervals"]["throughput_ratio_to_ring"]["median"] == pytest.approx(1.02)
    co = m.read_trimmed(str(shipped_dir))
    moved = m.aggregate(m.load_runs(str(shipped_dir / "runs"), shipped=co), m.load_solo(str(shipped_dir / "solo"), co), {})
    assert moved["cells"] == raw["cells"] and moved["noise"] == raw["noise"] and moved["calibration"]["1"]["rate"] == \
        raw["calibration"]["1"]["rate"]


def test_result_directories_meant_to_ship_are_not_ignored():
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def ignored(path):
        return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=root).returncode == 0

    for p in ("benchmarks/results/matrix/20261129-full/summary.json", "benchmarks/results/matrix/20991231-full/runs.jsonl",
              "benchmarks/results/matrix/20991231-full/matrix.md", "benchmarks/results/matrix/20991231-full/commands.jsonl",
              "benchmarks/results/matrix/20991231-120000/matrix.md", "benchmarks/results/scale/projection.md",
              "benchmarks/results/soak/soak.md"):
        assert not ignored(p), p
    for p in ("benchmarks/results/matrix/20991231-full/runs/ring_none_N4_seed0/summary.json",
              "benchmarks/results/matrix/20991231-full/solo/f1/summary.json",
              "benchmarks/results/matrix/20991231-120000-quick/summary.json",
              "benchmarks/results/matrix/20991231-120000-quick-sweep/runs.jsonl",
              "benchmarks/results/matrix/20991231-120000/timelines/ring_none_N4_seed0.png",
              "benchmarks/results/dpar/x.json"):
        assert ignored(p), p


# --- options ------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    (["--algorithms", "sgd"], ["--algorithms", "invalid choice", "ring", "boa"]),
    (["--scenarios", "nope"], ["--scenarios", "nope", "none", "mix3", "permanent10x"]),
    (["--world-sizes", "1"], ["--world-sizes", "2.."]),
    (["--seeds", "0"], ["--seeds", ">= 1"]),
    (["--steps", "1"], ["--steps", ">= 3"]),
    (["--target-acc", "2"], ["--target-acc", "(0, 1]"]),
    (["--launcher", "submitit_slurm"], ["--launcher", "--sweep"]),
    (["--sweep", "--launcher", "pbs"], ["--launcher", "submitit_slurm"]),
])
def test_bad_options_name_the_option_and_the_allowed_values(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        m.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, (w, err)


def test_a_scenario_invalid_at_a_world_size_fails_before_anything_runs(capsys, tmp_path):
    # permanent10x slows rank 3: not a rank of 2 workers
    with pytest.raises(SystemExit) as e:
        m.main(["--scenarios", "permanent10x", "--world-sizes", "2", "--output-dir", str(tmp_path / "x")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--scenarios permanent10x" in err and "straggler.events[0].rank" in err
    assert not (tmp_path / "x").exists()


def test_quick_plan_and_sweep_commands(capsys):
    a = m.parse_args(["--quick", "--scenarios", "none", "mix3", "random2", "--world-sizes", "4", "8", "--seeds", "2"])
    plan = m.Plan(a)
    plan.build()
    assert len(plan.cells) == 5 * 3 * 2 * 2
    assert [s["factor"] for s in plan.solo] == [1.0, 1.667, 3.333, 4.0]
    inv = m.sweep_invocations(plan, "/out", "submitit_slurm")
    assert inv[0]["kind"] == "solo" and "straggler.factors=[1.0],[1.667],[3.333],[4.0]" in inv[0]["overrides"]
    cells = [i for i in inv if i["kind"] == "cells"]
    # none and mix3: one multirun per N; random2: per N and seed (its events depend on the seed)
    assert len(cells) == 2 + 2 + 2 * 2
    for i in cells:
        assert "algorithm=ring,dpar,awar,dssync,boa" in i["overrides"]
        assert "hydra/launcher=submitit_slurm" in i["overrides"]
        assert f"hydra.sweep.subdir=${{algorithm.name}}_{i['scenario']}_N{i['world_size']}_seed${{seed}}" in i["overrides"]
    assert sum("seed=0,1" in i["overrides"] for i in cells) == 4


def test_ddplocal_row_is_ddp_with_post_local_sgd_and_composes():
    a = m.parse_args(["--algorithms", "ring", "ddp", "ddplocal", "--scenarios", "none", "--world-sizes", "4",
                      "--seeds", "1", "--steps", "30"])
    plan = m.Plan(a)
    plan.build()
    by_label = {c["algorithm"]: c for c in plan.cells}
    assert set(by_label) == {"ring", "ddp", "ddplocal"}
    ov = by_label["ddplocal"]["overrides"]
    assert ov[:3] == ["algorithm=ddp", "algorithm.model_averaging_period=4", "algorithm.warmup_steps=8"]
    assert by_label["ddp"]["overrides"][0] == "algorithm=ddp" and "algorithm.model_averaging_period=4" not in by_label["ddp"]["overrides"]
    assert m.parse_run_name(m.run_name("ddplocal", "none", 4, 0)) == {"algorithm": "ddplocal", "scenario": "none",
                                                                        "world_size": 4, "seed": 0}


def test_ddplocal_is_refused_with_sweep_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        m.parse_args(["--sweep", "--algorithms", "ring", "ddplocal"])
    err = capsys.readouterr().err
    assert "--algorithms" in err and "ddplocal" in err and "--sweep" in err


# --- the real thing, tiny ----------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.timeout(900)  # 4 short runs; on 2 cores shared with other jobs (load 14) one start takes 60 s
def test_tiny_grid_end_to_end(tmp_path):
    out = tmp_path / "matrix"
    report = m.main(["--algorithms", "ring", "dpar", "--scenarios", "none", "--world-sizes", "2", "--seeds", "1",
                     "--steps", "8", "--output-dir", str(out)])
    for f in ("summary.json", "matrix.md", "throughput.png", "efficiency.png", "accuracy_vs_time.png", "timelines.png"):
        assert (out / f).exists() and (out / f).stat().st_size > 0, f
    for name in ("ring_none_N2_seed0", "dpar_none_N2_seed0"):
        assert (out / "runs" / name / "summary.json").exists()
    assert (out / "solo" / "f1" / "summary.json").exists()
    s = json.loads((out / "summary.json").read_text())
    assert s == json.loads(json.dumps(report, default=str))
    for key in ("settings", "cells", "runs", "calibration", "comm_cost", "efficiency_formula", "commands", "load_avg",
                "scenario_descriptions", "plots"):
        assert key in s, key
    assert len(s["load_avg"]["start"]) == 3 and len(s["load_avg"]["end"]) == 3
    assert all("lightning_straggler.train" in c["command"] for c in s["commands"])
    cells = {c["algorithm"]: c for c in s["cells"]}
    assert set(cells) == {"ring", "dpar"} and all(c["ok"] == 1 and not c["errors"] for c in cells.values())
    assert cells["ring"]["throughput_ratio_to_ring"]["median"] == pytest.approx(1.0)
    run = {r["algorithm"]: r for r in s["runs"]}
    assert run["dpar"]["throughput_ratio_to_ring"] == pytest.approx(
        run["dpar"]["throughput"] / run["ring"]["throughput"])
    for c in cells.values():
        for k in ("throughput", "val_acc", "efficiency", "ideal"):
            assert c[k]["n"] == 1 and c[k]["min"] <= c[k]["median"] <= c[k]["max"]
        assert 0 < c["efficiency"]["median"] <= 1.5
        assert math.isclose(c["efficiency"]["median"] * c["ideal"]["median"], c["throughput"]["median"], rel_tol=1e-9)
    md = (out / "matrix.md").read_text()
    assert "| 2 | none | ring |" in md and "| 2 | none | dpar |" in md and "efficiency" in md
    assert os.path.exists(s["plots"][0])

    # an interrupted invocation: the calibration run never finished; --resume reruns only it, the rest is
    # reused (solo and grid runs are skipped by the same rule; the 1-worker run is the cheap one to redo)
    before = {name: json.loads((out / "runs" / name / "summary.json").read_text())
              for name in ("ring_none_N2_seed0", "dpar_none_N2_seed0")}
    (out / "solo" / "f1" / "summary.json").unlink()
    again = m.main(["--resume", str(out)])  # the directory alone: the grid's options are the recorded ones
    reused = {c.get("run") or f"solo:{c.get('factor', 0):g}": c.get("reused", False) for c in again["commands"]}
    assert reused == {"solo:1": False, "ring_none_N2_seed0": True, "dpar_none_N2_seed0": True}
    # the reused records are the journaled ones, with the original command lines
    assert all("lightning_straggler.train" in c["command"] for c in again["commands"])
    assert (out / "solo" / "f1" / "summary.json").exists()
    for name, summary in before.items():
        assert json.loads((out / "runs" / name / "summary.json").read_text()) == summary
    assert {c["algorithm"]: c["ok"] for c in again["cells"]} == {"ring": 1, "dpar": 1}
    assert again["mode"] == "direct (resumed)"

    # the raw data that ships: runs.jsonl alone (--shipped ignores runs/ and solo/) reproduces the aggregate,
    # re-planned from the options the measuring invocation recorded
    assert {json.loads(x)["path"] for x in (out / "runs.jsonl").read_text().splitlines()} == {
        "runs/ring_none_N2_seed0/summary.json", "runs/dpar_none_N2_seed0/summary.json", "solo/f1/summary.json"}
    shipped = m.main(["--aggregate-only", str(out), "--shipped"])
    assert shipped["settings"] | {"argv": None} == again["settings"] | {"argv": None}
    for k in ("cells", "runs", "noise", "noise_runs", "comm_cost", "calibration", "commands", "total_runtime_s"):
        assert json.loads(json.dumps(shipped[k], default=str)) == json.loads(json.dumps(again[k], default=str)), k


def test_resume_of_a_directory_without_recorded_options_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        m.main(["--resume", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "no recorded options" in err
    assert os.listdir(tmp_path) == []  # nothing ran, nothing written


def test_resume_needs_a_directory_alone(tmp_path, capsys):
    for argv, words in ((["--resume", str(tmp_path / "none")], ["--resume", "not a directory"]),
                        (["--resume", str(tmp_path), "--sweep"], ["--resume", "cannot be combined"])):
        with pytest.raises(SystemExit):
            m.parse_args(argv)
        err = capsys.readouterr().err
        assert all(w in err for w in words), err


def test_aggregate_only_of_an_interrupted_grid_plans_with_its_own_options(tmp_path, capsys):
    """A grid stopped before its summary.json: --aggregate-only DIR re-plans with the options the grid was
    started with (its invocation.json), not with the default grid's 150 cells."""
    out = tmp_path / "grid"
    (out / "runs").mkdir(parents=True)
    argv = ["--algorithms", "ring", "dpar", "--scenarios", "none", "--world-sizes", "2", "--seeds", "1"]
    (out / m.INVOCATION_JSON).write_text(json.dumps({"argv": argv}))
    report = m.main(["--aggregate-only", str(out)])
    printed = capsys.readouterr().out
    assert "--aggregate-only: the measuring invocation's options" in printed
    assert "2 algorithms ['ring', 'dpar'] x 1 scenarios ['none'] x N [2] x seeds [0]: 2 runs" in printed, printed
    assert report["settings"]["argv"] == argv


COMMITTED_GRIDS = sorted(p for p in (Path(__file__).parent.parent / "benchmarks" / "results" / "matrix").iterdir()
                         if (p / m.RUNS_JSONL).exists())


@pytest.mark.parametrize("grid", COMMITTED_GRIDS, ids=lambda p: p.name)
def test_committed_aggregate_equals_a_fresh_aggregation_of_the_committed_runs(grid, tmp_path):
    """Every README figure of a committed grid can be recomputed from what ships: --aggregate-only --shipped on a
    copy of its runs.jsonl, commands.jsonl and summary.json gives the committed summary.json (paths aside)."""
    out = tmp_path / grid.name
    out.mkdir()
    for name in (m.RUNS_JSONL, "commands.jsonl", "summary.json", "invocation.json"):
        if (grid / name).exists():
            shutil.copy(grid / name, out / name)
    committed = json.loads((grid / "summary.json").read_text())
    m.main(["--aggregate-only", str(out), "--shipped", "--no-plots"])  # the numbers; plots: the tiny grid's test
    fresh = json.loads((out / "summary.json").read_text())
    assert fresh["plots"] == [] and not list(out.glob("*.png"))

    def comparable(summary):  # where the grid ran and where it is re-aggregated are the same directory
        text = json.dumps(summary).replace(committed["output_dir"], "<out>").replace(str(out), "<out>")
        s = json.loads(text)
        for volatile in ("stamp", "output_dir", "plots", "plot_error"):
            s.pop(volatile, None)
        s["settings"].pop("argv", None)
        return s

    a, b = comparable(committed), comparable(fresh)
    assert a["cells"] and a["cells"] == b["cells"]
    assert a == b


def test_rewriting_runs_jsonl_keeps_shipped_lines_whose_raw_directory_is_gone(tmp_path):
    """A grid whose solo/ was cleaned after it ran: re-aggregating from the raw runs/ must not drop the
    calibration runs from runs.jsonl (they are the only record of them)."""
    run = tmp_path / "runs" / "ring_none_N2_seed0"
    run.mkdir(parents=True)
    raw = {"algorithm": "ring", "world_size": 2, "wall_s": 1.0, "events": [1, 2], "per_rank": {"0": {"steps": 3, "x": 1}}}
    (run / "summary.json").write_text(json.dumps(raw))
    solo = {"path": "solo/f1/summary.json", "summary": {"algorithm": "ring", "world_size": 1, "wall_s": 2.0}}
    stale = {"path": "runs/ring_none_N2_seed0/summary.json", "summary": {"algorithm": "old"}}
    (tmp_path / m.RUNS_JSONL).write_text(json.dumps(solo) + "\n" + json.dumps(stale) + "\n")
    m.write_trimmed(str(tmp_path))
    lines = [json.loads(x) for x in (tmp_path / m.RUNS_JSONL).read_text().splitlines()]
    by_path = {x["path"]: x["summary"] for x in lines}
    assert set(by_path) == {"solo/f1/summary.json", "runs/ring_none_N2_seed0/summary.json"}
    assert by_path["solo/f1/summary.json"] == solo["summary"]  # kept as it was
    assert by_path["runs/ring_none_N2_seed0/summary.json"]["algorithm"] == "ring"  # the raw run wins over the old line
    assert "events" not in by_path["runs/ring_none_N2_seed0/summary.json"]


def test_target_check_applies_the_two_thirds_rule_per_world_size():
    def run(n, seed, ttt, wall=30.0, algo="ring", sc="none"):
        return {"world_size": n, "seed": seed, "algorithm": algo, "scenario": sc, "time_to_target_s": ttt, "wall_s": wall}
    per_run = [run(4, 0, 10.0), run(4, 1, 19.5), run(8, 0, 10.0), run(8, 1, 25.0), run(8, 2, None),
               run(4, 0, 29.0, algo="dpar"), run(4, 0, 29.0, sc="transient4x")]
    chk = m.target_check(per_run)
    assert chk["N4"]["fair"] is True and chk["N4"]["fraction_of_wall"] == pytest.approx([1 / 3, 0.65])
    assert chk["N8"]["fair"] is False and chk["N8"]["fraction_of_wall"][2] is None


def test_planning_composes_once_per_override_list_and_each_seed_equals_composing_it_afresh():
    """composed_for_seed reuses one Hydra composition for runs that differ only in the seed: every copy must be
    the configuration a fresh composition with that seed gives (interpolated straggler seeds included)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from lightning_straggler.config import load_config

    cache, calls = {}, []

    def counting_compose(**kw):
        calls.append(kw)
        return compose(**kw)

    with initialize_config_dir(config_dir=m.CONF, version_base="1.3"):
        for sc, extra in (("random", ["straggler.seed=${seed}"]), ("mix3", [])):
            ov = ["algorithm=dpar", f"straggler={sc}", "trainer.devices=4", *extra]
            for seed in (0, 3, 7):
                reused = m.composed_for_seed(cache, counting_compose, ov, seed)
                fresh = compose(config_name="train", overrides=[*ov, f"seed={seed}"])
                assert OmegaConf.to_yaml(reused) == OmegaConf.to_yaml(fresh)
                assert load_config(reused) == load_config(fresh)
    assert len(calls) == 2
