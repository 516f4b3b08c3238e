"""The advisor (``python -m lightning_straggler.advise RUN_DIR``).

In one process: synthetic run directories (summary.json + step_times.csv.gz written by the profiler's
own writer) whose compute times follow known factors; the advisor's table is checked against the
simulator run independently here on the generating constants. One end-to-end test runs a real 2-worker
main job with ``advise=true`` and then the command on its output directory.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf

from lightning_straggler import advise as adv
from lightning_straggler.config import AdaptiveConfig, DparConfig, load_config
from lightning_straggler.profiling import STEP_TIMES_FILE, StepRecord, summarise, write_step_times
from lightning_straggler.sim import Network, simulate
from lightning_straggler.sim.calibration import workload_for

N, STEPS, BATCH = 4, 120, 32
DEVICE_MS = 2.0  # emulated device time per sample
OVERHEAD_S = 0.010  # the rest of a full-speed step
ALLREDUCE_S = 0.002  # per step, over all N
LOOP_S = 0.015  # per step, outside compute and transfer


def _config(world: int) -> dict:
    cfg = load_config({"algorithm": {"name": "ring"}, "trainer": {"devices": world, "max_steps": STEPS},
                       "straggler": {"scenario": "none", "device_ms_per_sample": DEVICE_MS}, "profiler": {"plot": False}})
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def _truth(summary: dict, factors: np.ndarray):
    """The generating constants as the simulator takes them (not the advisor's calibration)."""
    n = factors.shape[0]
    consts = {"overhead_s": OVERHEAD_S, "per_sample_s": DEVICE_MS / 1e3, "jitter_cv": 0.0,
              "loop_overhead_s": LOOP_S, "alpha_s": ALLREDUCE_S / (2 * (n - 1)) if n > 1 else 0.0, "control_op_s": 0.0}
    return workload_for(summary, consts, factors), Network("truth", consts["alpha_s"], 0.0, 0.0)


def make_run(path, factors: np.ndarray, world: int = N) -> str:
    """A ring run whose rank r computed factors[r, s] x a full-speed step at step s, all-reduced in
    ALLREDUCE_S and spent LOOP_S per step besides; wall_s is what the simulator's ring takes for that."""
    os.makedirs(path, exist_ok=True)
    full = OVERHEAD_S + DEVICE_MS / 1e3 * BATCH
    records, t = [], 1.7e9
    for s in range(factors.shape[1]):
        compute = factors[:, s] * full
        slowest = compute.max()
        for r in range(world):
            records.append(StepRecord(r, s, t, float(compute[r]), float(slowest - compute[r] + ALLREDUCE_S), BATCH, 0))
        t += slowest + ALLREDUCE_S + LOOP_S
    summary = {"algorithm": "ring", "world_size": world, "config": _config(world),
               "per_rank": {str(k): v for k, v in summarise(records).items()}}
    workload, network = _truth(summary, factors)
    ring = simulate("ring", workload, network)
    summary |= {"wall_s": ring.wall_s, "train_samples": ring.train_samples,
                "throughput_samples_per_s": ring.throughput_samples_per_s}
    with open(os.path.join(path, "summary.json"), "w") as f:
        json.dump(summary, f)
    write_step_times(records, os.path.join(path, STEP_TIMES_FILE))
    return str(path)


def persistent(rank=3, factor=4.0):
    f = np.ones((N, STEPS))
    f[rank] = factor
    return f


def transient(rank=2, factor=4.0, start=40, end=80):
    f = np.ones((N, STEPS))
    f[rank, start:end] = factor
    return f


def _expected(run_dir):
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    return summary


def test_persistent_straggler_table_matches_the_simulator_and_recommends_the_fastest(tmp_path):
    factors = persistent()
    run = make_run(tmp_path / "run", factors)
    a = adv.advise(run, overheads="none")  # the replay alone: what the test can compute from the constants
    workload, network = _truth(_expected(run), factors)
    independent = {name: simulate(name, workload, network, **adv.default_settings(name, _expected(run)))
                   for name in adv.STRATEGIES}
    table = {r["strategy"]: r for r in a["table"]}
    for name, res in independent.items():
        assert table[name]["predicted_samples_per_s"] == pytest.approx(res.throughput_samples_per_s, rel=1e-6)
        assert table[name]["efficiency"] == pytest.approx(res.efficiency, rel=1e-6)
    fastest = max(independent, key=lambda k: independent[k].throughput_samples_per_s)
    # one of those that stop waiting for a persistent straggler (awar since its early boundaries: it leaves
    # the group after 3 steps instead of a window; adaptive re-plans its batch 2 steps after the change)
    assert fastest in ("boa", "dpar", "awar", "adaptive") and independent[fastest].throughput_samples_per_s > \
        1.3 * independent["ring"].throughput_samples_per_s
    assert a["recommended"] == fastest and a["override"] == f"algorithm={fastest}"
    text = adv.format_advice(a)
    for name, res in independent.items():  # the printed table carries the simulator's numbers
        assert f"{res.throughput_samples_per_s:,.0f}" in text
    assert f"python -m lightning_straggler.train algorithm={fastest}" in text
    assert "rank 3 was 4.0x slower in 100% of steps: persistent" in text
    assert [c["kind"] for c in a["stragglers"]] == ["none", "none", "none", "persistent"]
    # the replay of the measured ring run is its measurement (the loop overhead is fitted on it)
    assert a["replayed_own_samples_per_s"] == pytest.approx(a["measured_samples_per_s"], rel=1e-6)


def test_transient_straggler_is_classified_transient(tmp_path):
    a = adv.advise(make_run(tmp_path / "run", transient(start=40, end=80)))
    kinds = {c["rank"]: c for c in a["stragglers"]}
    assert kinds[2]["kind"] == "transient" and kinds[2]["episodes"] == [[40, 80]]
    assert kinds[2]["slowdown"] == pytest.approx(4.0)
    assert all(kinds[r]["kind"] == "none" for r in (0, 1, 3))
    assert "rank 2 was 4.0x slower in steps 40-79 (33% of steps, one stretch): transient" in adv.format_advice(a)


def test_scattered_episodes_are_classified_random(tmp_path):
    f = np.ones((N, STEPS))
    f[1, 10:20] = f[1, 50:58] = f[1, 95:110] = 3.0
    kinds = {c["rank"]: c["kind"] for c in adv.advise(make_run(tmp_path / "run", f))["stragglers"]}
    assert kinds == {0: "none", 1: "random", 2: "none", 3: "none"}


def test_no_straggler_keeps_ring(tmp_path):
    rng = np.random.default_rng(0)
    factors = np.exp(rng.normal(0.0, 0.03, (N, STEPS)))  # a few percent of noise, nobody slow
    a = adv.advise(make_run(tmp_path / "run", factors), overheads="none")
    assert all(c["kind"] == "none" for c in a["stragglers"])
    assert a["recommended"] == "ring" and a["override"] == "algorithm=ring"
    best = max(a["table"], key=lambda r: r["predicted_samples_per_s"])
    assert best["strategy"] == "ring" or best["vs_ring"] <= 1 + a["min_gain"]
    assert adv.recommendation_line(a).startswith("Recommendation: ring (keep algorithm=ring)")
    # the benchmark's per-strategy costs (where committed) only add to the other strategies: still ring
    assert adv.advise(make_run(tmp_path / "run", factors))["recommended"] == "ring"


def test_validation_error_is_read_from_the_file_or_unknown(tmp_path):
    cells = [{"run": f"r{i}", "status": "predicted", "superseded": False, "ring_only_error": e, "error": e}
             for i, e in enumerate([0.10, -0.20, 0.05])]
    cells.append({"run": "cal", "status": "calibration", "superseded": False, "ring_only_error": 0.0})
    path = tmp_path / "sim_validate.json"
    path.write_text(json.dumps({"cells": cells}))
    v = adv.validation_error([str(path)])
    assert v["known"] and v["runs"] == 3 and v["within_15"] == 2
    assert v["median_abs"] == pytest.approx(0.10) and v["worst"] == pytest.approx(-0.20)
    assert "ring-only calibration, as here, median |error| 10.0%, 2 of 3 within ±15%, worst -20.0%" in adv.validation_line(v)
    unknown = adv.validation_error([str(tmp_path / "absent.json")])
    assert not unknown["known"] and "Prediction error: unknown" in adv.validation_line(unknown)


def test_committed_validation_is_what_the_report_prints(tmp_path):
    a = adv.advise(make_run(tmp_path / "run", persistent()))
    assert adv.validation_line(adv.validation_error(), bool(a["overheads"])) in adv.format_advice(a)
    plain = adv.advise(make_run(tmp_path / "plain", persistent()), overheads="none")
    assert adv.validation_line(adv.validation_error(), False) in adv.format_advice(plain)


def test_missing_summary_one_worker_and_no_step_times_are_named(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(adv.AdviseError, match="no summary.json"):
        adv.advise(str(empty))
    with pytest.raises(adv.AdviseError, match="not a directory"):
        adv.advise(str(tmp_path / "nowhere"))
    one = make_run(tmp_path / "one", np.ones((1, STEPS)), world=1)
    with pytest.raises(adv.AdviseError, match="1 worker"):
        adv.advise(one)
    run = make_run(tmp_path / "run", persistent())
    os.remove(os.path.join(run, STEP_TIMES_FILE))
    with pytest.raises(adv.AdviseError, match="no step_times.csv.gz"):
        adv.advise(run, source="step_times")
    # the command says so and exits 2
    assert adv.main([str(empty)]) == 2


def test_run_without_step_times_replays_the_configured_schedule_and_says_so(tmp_path):
    run = make_run(tmp_path / "run", persistent(factor=4.0))
    os.remove(os.path.join(run, STEP_TIMES_FILE))
    summary = _expected(run)
    summary["config"]["straggler"] = {**summary["config"]["straggler"], "scenario": "transient",
                                      "events": [{"rank": 3, "factor": 4.0, "start_step": 0, "end_step": None}]}
    with open(os.path.join(run, "summary.json"), "w") as f:
        json.dump(summary, f)
    a = adv.advise(run)
    assert a["source"] == "schedule"
    assert [c["kind"] for c in a["stragglers"]] == ["none", "none", "none", "persistent"]
    assert any("no step_times.csv.gz" in c for c in a["caveats"])


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    run = make_run(tmp_path / "run", transient())
    path = adv.plot(run)
    assert os.path.getsize(path) > 1000 and path.endswith("advise.png")


def test_end_to_end_two_workers_then_the_command(cli, tmp_path):
    out = tmp_path / "job"
    p = cli("trainer=quick", "trainer.devices=2", "trainer.max_steps=30", "algorithm=ring", "straggler=transient",
            "straggler.events=[{rank:1,factor:4.0,start_step:8,end_step:22}]", "straggler.device_ms_per_sample=2.0",
            "profiler.plot=false", "advise=true", f"output_dir={out}", f"hydra.run.dir={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert os.path.exists(out / STEP_TIMES_FILE)
    assert "Recommendation:" in p.stdout  # the optional line at the end of the main job
    r = subprocess.run([sys.executable, "-m", "lightning_straggler.advise", str(out), "--json", str(tmp_path / "a.json")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    a = json.loads((tmp_path / "a.json").read_text())
    assert [row["strategy"] for row in a["table"]] == list(adv.STRATEGIES)
    assert a["source"] == "step_times" and a["world_size"] == 2 and a["steps"] == 30
    assert a["recommended"] in adv.STRATEGIES and f"algorithm={a['recommended']}" in r.stdout
    assert "Prediction error" in r.stdout and "What this run cannot tell" in r.stdout


def test_validation_md_table_is_read_when_there_is_no_json(tmp_path):
    md = tmp_path / "sim_validate.md"
    md.write_text("\n".join([
        "# Simulator vs measured throughput", "",
        "| run | algorithm | N | scenario | device ms | measured | predicted | error | on | ring-only error | control op ms | loop ms | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        "| a/runs/x | dpar | 4 | none | 2 | 900 | 900 | +0.0% | own-none | +4.0% | 1 | 2 | calibration (own-none) |",
        "| a/runs/y | dpar | 4 | t | 2 | 600 | 630 | +5.0% | own-none | -12.0% | 1 | 2 | predicted |",
        "| a/runs/z | ring | 4 | t | 2 | 500 | 600 | +20.0% **miss** | ring-only | +20.0% | 0 | 2 | predicted |",
        "| old/runs/z | ring | 4 | t | 2 | 500 | 900 | +80.0% **miss** | ring-only | +80.0% | 0 | 2 | predicted, superseded |",
    ]))
    v = adv.validation_error([str(md)])
    assert v["runs"] == 2 and v["within_15"] == 1
    assert v["median_abs"] == pytest.approx(0.16) and v["worst"] == pytest.approx(0.20)


def _own_none_cell(folder, algo, seed, control, extra, world=N):
    return {"run": f"benchmarks/results/{folder}/runs/{algo}_none_N{world}_seed{seed}/summary.json", "algorithm": algo,
            "world_size": world, "status": "calibration (own-none)",
            "own_calibration": {"control_op_s": control, "loop_extra_s": extra}}


def test_overheads_from_validation_are_added_to_each_strategy(tmp_path):
    old = [_own_none_cell("matrix/1-old", "dpar", s, 1.0, 1.0) for s in range(3)]
    new = [_own_none_cell("matrix/2-new", "dpar", s, c, e) for s, (c, e) in enumerate([(0.04, 0.01), (0.05, 0.02), (0.09, 0.0)])]
    other_n = [_own_none_cell("matrix/2-new", "boa", 0, 0.5, 0.5, world=8)]
    (tmp_path / "a.json").write_text(json.dumps({"cells": old}))
    (tmp_path / "b.json").write_text(json.dumps({"cells": new + other_n}))
    paths = [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    o = adv.strategy_overheads(N, paths)
    assert set(o) == {"dpar"}  # boa's was at 8 workers
    assert o["dpar"]["control_op_s"] == pytest.approx(0.05) and o["dpar"]["loop_extra_s"] == pytest.approx(0.01)
    assert o["dpar"]["source"] == "benchmarks/results/matrix/2-new" and o["dpar"]["runs"] == 3  # the newest folder
    factors = persistent()
    run = make_run(tmp_path / "run", factors)
    a = adv.advise(run, validation=paths, overheads="validation")
    summary = _expected(run)
    workload, _ = _truth(summary, factors)
    alpha = ALLREDUCE_S / (2 * (N - 1))
    consts = {"overhead_s": OVERHEAD_S, "per_sample_s": DEVICE_MS / 1e3, "jitter_cv": 0.0, "alpha_s": alpha,
              "loop_overhead_s": LOOP_S + 0.01, "control_op_s": 0.05}
    dpar = simulate("dpar", workload_for(summary, consts, factors), Network("t", alpha, 0.0, 0.05),
                    **adv.default_settings("dpar", summary))
    table = {r["strategy"]: r["predicted_samples_per_s"] for r in a["table"]}
    assert table["dpar"] == pytest.approx(dpar.throughput_samples_per_s, rel=1e-6)
    assert table["ring"] == pytest.approx(adv.advise(run, overheads="none")["table"][0]["predicted_samples_per_s"], rel=1e-9)
    assert "+ dpar's own costs: 50.0 ms per control call, +10.0 ms per step over ring" in adv.format_advice(a)
    with pytest.raises(adv.AdviseError, match="no own-none calibration at 4 workers"):
        adv.advise(run, validation=[str(tmp_path / "absent.json")], overheads="validation")


def test_evaluate_grid_compares_the_recommendation_with_the_measured_best(tmp_path):
    runs = tmp_path / "grid" / "runs"
    ring = make_run(runs / "ring_p4x_N4_seed0", persistent())
    ring_tp = _expected(ring)["throughput_samples_per_s"]
    for algo, ratio in (("dpar", 1.5), ("boa", 2.2)):
        d = runs / f"{algo}_p4x_N4_seed0"
        d.mkdir()
        (d / "summary.json").write_text(json.dumps({"algorithm": algo, "throughput_samples_per_s": ring_tp * ratio}))
    e = adv.evaluate_grid(str(tmp_path / "grid"), overheads="none")
    (cell,) = e["cells"]
    assert cell["best"] == "boa" and cell["recommended"] == max(cell["predicted"], key=cell["predicted"].get) == "boa"
    assert e["match"] == e["within_noise"] == 1 and cell["source"] == "step_times"
    assert cell["error"] == pytest.approx(cell["predicted"]["boa"] / (2.2 * ring_tp) - 1)
    assert "Recommendation = measured best: 1 of 1" in adv.format_evaluation(e)


def test_dpar_run_says_what_the_excluded_rank_hides(tmp_path):
    """A dpar run: rank 3 (4x) leaves the group at step 20, then computes one local step per 4 group steps
    and passes over the rest (no record): its speed is still seen, the passed-over batches are not."""
    path = tmp_path / "dpar"
    path.mkdir()
    full = OVERHEAD_S + DEVICE_MS / 1e3 * BATCH
    records = []
    for s in range(STEPS):
        for r in range(3):
            records.append(StepRecord(r, s, float(s), full, ALLREDUCE_S + (3 * full if s < 20 else 0.0), BATCH, 0))
        if s < 20:
            records.append(StepRecord(3, s, float(s), 4 * full, ALLREDUCE_S, BATCH, 0))
        elif s % 4 == 0:
            records.append(StepRecord(3, s, float(s), 4 * full, 0.0, BATCH, 3))
    cfg = load_config({"algorithm": {"name": "dpar"}, "trainer": {"devices": N, "max_steps": STEPS},
                       "straggler": {"scenario": "none", "device_ms_per_sample": DEVICE_MS}})
    summary = {"algorithm": "dpar", "world_size": N, "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
               "per_rank": {str(k): v for k, v in summarise(records).items()}, "wall_s": STEPS * (full + 0.03),
               "throughput_samples_per_s": 3 * BATCH / (full + 0.03)}
    (path / "summary.json").write_text(json.dumps(summary))
    write_step_times(records, str(path / STEP_TIMES_FILE))
    a = adv.advise(str(path), overheads="none")
    m = adv.measured_from_records(summary, records)
    assert m.local_steps == {3: 25} and not m.measured[3, 21] and m.measured[3, 24]
    assert m.factors[3, 21] == pytest.approx(4.0) and m.factors[0, 21] == pytest.approx(1.0)  # filled from step 20
    assert m.allreduce_s == pytest.approx(ALLREDUCE_S * 3 / 2 * (STEPS - 20) / STEPS + ALLREDUCE_S * 20 / STEPS)
    assert [c["kind"] for c in a["stragglers"]] == ["none", "none", "none", "persistent"]
    hidden = next(c for c in a["caveats"] if c.startswith("a dpar run"))
    assert "rank(s) 3 trained outside the group (25 steps)" in hidden
    assert f"{int((~m.measured).sum())} rank-steps" in hidden
    assert any("loop overhead was fitted on the dpar replay" in c for c in a["caveats"])


def test_adaptive_is_replayed_and_an_adaptive_run_is_advised_with_its_own_settings(tmp_path):
    """adaptive is one of the strategies the advisor replays (the simulator's adaptive with the config defaults
    for a ring run); an adaptive run is replayed with its own settings (react_steps 5 here, not the default 2;
    likewise a dpar run's react_steps) and its caveat says the batches differed per rank."""
    factors = transient(rank=1, factor=6.0, start=30, end=90)
    run = make_run(tmp_path / "ring", factors)
    a = adv.advise(run, overheads="none")
    workload, network = _truth(_expected(run), factors)
    want = simulate("adaptive", workload, network, **adv.default_settings("adaptive", _expected(run)))
    row = next(r for r in a["table"] if r["strategy"] == "adaptive")
    assert row["predicted_samples_per_s"] == pytest.approx(want.throughput_samples_per_s, rel=1e-6)
    assert row["vs_ring"] > 1.3  # a 6x collapse of one rank in half the run: re-planned around
    for name, default in (("adaptive", AdaptiveConfig.react_steps), ("dpar", DparConfig.react_steps)):
        summary = dict(_expected(run), algorithm=name)
        summary["config"] = dict(summary["config"], algorithm=dict(
            OmegaConf.to_container(OmegaConf.structured(load_config({"algorithm": {"name": name}}).algorithm)),
            react_steps=5))
        assert adv.default_settings(name, summary)["react_steps"] == 5 != default
    summary = dict(_expected(run), algorithm="adaptive")
    summary["config"] = dict(summary["config"], algorithm={"name": "adaptive", "react_steps": 5})
    path = tmp_path / "adaptive"
    path.mkdir()
    (path / "summary.json").write_text(json.dumps(summary))
    shutil.copy(os.path.join(run, STEP_TIMES_FILE), path / STEP_TIMES_FILE)  # the same steps, as if adaptive's
    b = adv.advise(str(path), overheads="none")
    assert b["replayed_own"] == "adaptive"
    assert any(c.startswith("an adaptive run: ranks computed different batch sizes") for c in b["caveats"])
    assert [r["strategy"] for r in b["table"]] == list(adv.STRATEGIES)
