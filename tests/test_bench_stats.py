"""The one ideal (lightning_straggler.ideal) used by the matrix and the simulator, and the shared
benchmark statistics applied by ring_vs_plain and dssync_vs_ring: pure arithmetic, one process."""
from __future__ import annotations

import glob
import json
import os
import shutil
import statistics

import pytest

from benchmarks import dssync_vs_ring, matrix, ring_vs_plain, stats
from lightning_straggler import ideal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ideal_closed_form_and_bad_input():
    # G = 96 samples at 600 samples/s is 160 ms, plus a 40 ms all-reduce: 96 / 0.2 = 480 samples/s
    assert ideal.ideal_throughput([400.0, 100.0, 100.0], 96, 0.04) == pytest.approx(480.0)
    assert ideal.ideal_throughput([400.0, 400.0], 64, -1.0) == pytest.approx(800.0)  # no negative all-reduce
    with pytest.raises(ValueError, match="positive rates"):
        ideal.ideal_throughput([0.0, 0.0], 64, 0.0)


def test_the_matrix_and_the_simulator_use_the_one_ideal():
    from lightning_straggler.sim import Workload
    from lightning_straggler.sim import result as sim_result
    from lightning_straggler.sim.network import from_bandwidth

    assert matrix.ideal_throughput is ideal.ideal_throughput
    w = Workload(world_size=4, batch_per_worker=32, per_sample_s=1e-3, steps=30, grad_bytes=4e6, loop_overhead_s=0.002,
                 straggler={"scenario": "static", "factors": [1.0, 1.0, 2.0, 4.0]})
    net = from_bandwidth("1g", 1.0, 1e-4)
    # the workload's own rates: 32 samples per (32 ms x factor + 2 ms loop overhead)
    rates = [32 / (0.032 * f + 0.002) for f in (1.0, 1.0, 2.0, 4.0)]
    assert list(w.rates()) == pytest.approx(rates)
    t_ar = net.allreduce_s(4, 4e6)
    assert t_ar > 0
    assert sim_result.ideal_throughput(w, net) == pytest.approx(128 / (128 / sum(rates) + t_ar))


def test_shuffled_order_is_seeded_per_key_and_not_always_the_same():
    labels = ["plain", "ring", "ddp", "ring#2"]
    assert stats.shuffled(labels, "k:1") == stats.shuffled(labels, "k:1")
    assert sorted(stats.shuffled(labels, "k:1")) == sorted(labels)
    firsts = {stats.shuffled(labels, f"k:{i}")[0] for i in range(40)}
    assert len(firsts) >= 3  # the reference is not always first


def test_labelled_gives_interval_and_label_in_each_direction():
    win = stats.labelled([1.10, 1.20, 1.15])
    assert (win["lo"], win["hi"], win["label"]) == (pytest.approx(1.10), pytest.approx(1.20), "win")
    # lower is better (sync time): an interval wholly below 1 is a win
    assert stats.labelled([0.5, 0.6, 0.7], 1.0, False)["label"] == "win"
    assert stats.labelled([0.9, 1.1, 1.0])["label"] == "no difference"
    assert stats.labelled([1.1, 1.2])["label"] == "n/a"
    assert stats.fmt_interval(win, ".2f") == "1.15 [1.10, 1.20] **win**"


def _run(workers, rnd, impl, throughput, pos=0):
    return {"workers": workers, "round": rnd, "position": pos, "impl": impl, "samples": throughput * 2.0, "seconds": 2.0}


def test_ring_vs_plain_pairs_the_ratios_per_round():
    runs = []
    for rnd, (plain, ring, ddp, ring2) in enumerate([(100, 90, 95, 91), (200, 170, 160, 175), (150, 150, 140, 150)], 1):
        runs += [_run(4, rnd, "plain", plain), _run(4, rnd, "ring", ring), _run(4, rnd, "ddp", ddp),
                 _run(4, rnd, "ring#2", ring2)]
    runs.append(_run(8, 1, "plain", 50))  # a world size with one implementation: no ratio
    agg = ring_vs_plain.aggregate(runs)
    cell = agg["4"]
    assert cell["rounds"] == 3 and cell["throughput"]["ring"]["median"] == pytest.approx(150)
    rp = cell["ratios"]["ring/plain"]
    assert rp["per_round"] == pytest.approx([0.9, 0.85, 1.0])
    assert rp["median"] == pytest.approx(0.9) and (rp["lo"], rp["hi"]) == (pytest.approx(0.85), pytest.approx(1.0))
    assert rp["label"] == "no difference"
    assert cell["ratios"]["ring/ddp"]["per_round"] == pytest.approx([90 / 95, 170 / 160, 150 / 140])
    assert cell["ratios"]["ring#2/ring"]["per_round"] == pytest.approx([91 / 90, 175 / 170, 1.0])
    assert agg["8"]["ratios"] == {}


def test_dssync_vs_ring_pairs_per_seed_and_sync_lower_is_better():
    def run(n, seed, algo, tp, sync):
        return {"workers": n, "seed": seed, "algo": algo, "throughput": tp, "sync_ms": sync, "comm_ms": sync / 2,
                "sync_p50_ms": sync, "steps": 50, "position": 0}
    runs = [run(4, s, "ring", 100, 10.0) for s in range(3)] + [run(4, s, "dssync", 120 + s, 5.0 + s) for s in range(3)]
    row = dssync_vs_ring.aggregate(runs, params=1000)[0]
    assert row["ratio_sync"]["median"] == pytest.approx(0.6) and row["ratio_sync"]["label"] == "win"
    assert row["ratio_throughput"]["median"] == pytest.approx(1.21) and row["ratio_throughput"]["label"] == "win"
    assert row["ratio_bytes"] == pytest.approx((2 * 1 / 2) / (2 * 3 / 4))
    assert row["target_ratio_g1_over_n1"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("module,key", [(ring_vs_plain, "aggregate"), (dssync_vs_ring, "by_workers")])
def test_committed_reports_equal_a_fresh_aggregation_of_their_runs(module, key, tmp_path):
    name = module.__name__.split(".")[-1]
    reports = sorted(p for p in glob.glob(os.path.join(ROOT, "benchmarks", "results", name, "*", "report.json"))
                     if "-quick" not in p)
    if not reports:
        pytest.skip(f"no committed {name} report yet")
    for path in reports:
        with open(path) as f:
            committed = json.load(f)
        copy = tmp_path / os.path.basename(os.path.dirname(path))
        shutil.copytree(os.path.dirname(path), copy)
        fresh = module.main(["--aggregate-only", str(copy)])
        assert json.loads(json.dumps(fresh[key])) == committed[key], path
        assert (copy / "report.md").read_text() == open(os.path.join(os.path.dirname(path), "report.md")).read()


def test_time_to_a_second_target_rescored_at_the_grids_own_target_reproduces_its_intervals(tmp_path):
    """benchmarks.time_to_target re-scores a committed grid from runs.jsonl: at the grid's own target it must
    give the grid's own time-to-target intervals (same pairs, same statistics), and it writes its files."""
    from benchmarks import time_to_target

    grid = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "matrix", "20261203-N4-transient4x")
    shutil.copy(os.path.join(grid, "runs.jsonl"), tmp_path / "runs.jsonl")
    with open(os.path.join(grid, "summary.json")) as f:
        committed = json.load(f)
    result = time_to_target.main([str(tmp_path), "--target", str(committed["settings"]["target_acc"])])
    got = {(c["world_size"], c["scenario"], c["algorithm"]): c["ttt_ratio_to_ring"] for c in result["cells"]}
    checked = 0
    for cell in committed["cells"]:
        want = cell["intervals"]["ttt_ratio_to_ring"]
        have = got[(cell["world_size"], cell["scenario"], cell["algorithm"])]
        if cell["algorithm"] == "ring":
            assert have is None
            continue
        assert (have["median"], have["lo"], have["hi"]) == pytest.approx((want["median"], want["lo"], want["hi"]))
        assert have["label"] == want["label"]
        checked += 1
    assert checked == 5
    assert (tmp_path / f"ttt_{committed['settings']['target_acc']:g}.md").exists()


def test_versus_best_divides_by_the_better_of_the_others_per_seed(tmp_path):
    """benchmarks.versus_best on a committed grid: each seed's ratio is X over the faster of the others in the
    same seed (recomputed here from runs.jsonl), the interval is stats.labelled's, and the accuracy column is
    against the straggler-free ring of the reference grid, seed by seed."""
    from benchmarks import versus_best

    results = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "matrix")
    shutil.copy(os.path.join(results, "20261203-N4-mix3", "runs.jsonl"), tmp_path / "runs.jsonl")
    cells = versus_best.main([str(tmp_path), "--algorithm", "boa", "--against", "dpar", "awar", "--target", "1.1",
                              "--reference-grid", os.path.join(results, "20261203-ddp-none")])
    runs = versus_best.read_runs(str(tmp_path))
    ref = versus_best.read_runs(os.path.join(results, "20261203-ddp-none"))
    (cell,) = cells
    want = []
    for sd in range(5):
        thr = {a: runs[(a, "mix3", 4, sd)]["throughput_samples_per_s"] for a in ("boa", "dpar", "awar")}
        want.append(thr["boa"] / max(thr["dpar"], thr["awar"]))
    assert cell["per_seed_ratio"] == pytest.approx(want)
    assert cell["ratio"]["median"] == pytest.approx(sorted(want)[2])
    assert cell["ratio"] == stats.labelled(want)
    assert cell["target_met"] == (cell["ratio"]["lo"] >= 1.1)
    acc = [100 * (runs[("boa", "mix3", 4, sd)]["val_acc"] - ref[("ring", "none", 4, sd)]["val_acc"]) for sd in range(5)]
    assert cell["per_seed_acc_points"] == pytest.approx(acc)
    assert (tmp_path / "versus_best_boa.md").exists()
    with pytest.raises(SystemExit):
        versus_best.main([str(tmp_path), "--algorithm", "adaptive", "--against", "boa"])  # no such runs: named


def test_versus_best_within_noise_takes_each_cells_target_from_ring_run_twice(tmp_path, capsys):
    """--within-noise: the target of each cell is the lower end of ring#2 / ring's interval, recomputed here
    from the _rep2 runs (and equal to what matrix.md reported as the cell's noise); the rule is met on the
    median, the interval reading reported beside it; a grid without ring#2 runs is refused, naming why."""
    from benchmarks import versus_best

    results = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "matrix")
    shutil.copy(os.path.join(results, "20261203-random36", "runs.jsonl"), tmp_path / "runs.jsonl")
    cells = versus_best.main([str(tmp_path), "--algorithm", "adaptive", "--against", "ring", "awar", "boa", "dpar",
                              "--within-noise"])
    runs = versus_best.read_runs(str(tmp_path))
    repeats = versus_best.read_runs(str(tmp_path), repeats=True)
    assert sorted(repeats) == [("ring", "random36", n, sd) for n in (4, 8) for sd in range(5)]
    assert [c["world_size"] for c in cells] == [4, 8]
    for cell in cells:
        n = cell["world_size"]
        pairs = [repeats[("ring", "random36", n, sd)]["throughput_samples_per_s"]
                 / runs[("ring", "random36", n, sd)]["throughput_samples_per_s"] for sd in range(5)]
        assert cell["noise"] == stats.labelled(pairs)
        assert cell["target"] == cell["noise"]["lo"] < 1.0
        assert cell["target_met_by_median"] == (cell["ratio"]["median"] >= cell["noise"]["lo"])
        assert cell["target_met"] == (cell["ratio"]["lo"] >= cell["noise"]["lo"])
    # the same noise intervals matrix.md printed for this grid: 1.00 [0.97, 1.05] and 0.99 [0.93, 1.03]
    assert [round(c["noise"]["lo"], 2) for c in cells] == [0.97, 0.93]
    with open(tmp_path / "versus_best_adaptive.md") as f:
        assert "noise 1.00 [0.97, 1.05]" in f.read()
    shutil.copy(os.path.join(results, "20261203-mixtransient", "runs.jsonl"), tmp_path / "runs.jsonl")
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        versus_best.main([str(tmp_path), "--algorithm", "adaptive", "--against", "boa", "--within-noise"])
    assert refused.value.code == 2
    assert "--within-noise:" in (err := capsys.readouterr().err) and "has no ring#2 runs" in err, err


def test_versus_best_by_median_divides_every_seed_by_the_cells_best_strategy(tmp_path):
    """--best-by median: per cell one candidate, the one with the highest median throughput over the seeds,
    divides X in every seed (recomputed here). On the committed 4-worker grid the none cell is where the two
    rules differ: per seed the best is ring in three seeds and awar in one, by median it is ring."""
    from benchmarks import versus_best

    results = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "matrix")
    shutil.copy(os.path.join(results, "20261204-N4-adaptive", "runs.jsonl"), tmp_path / "runs.jsonl")
    against = ["ring", "awar", "boa"]
    per_seed = versus_best.main([str(tmp_path), "--algorithm", "adaptive", "--against", *against, "--within-noise"])
    by_median = versus_best.main([str(tmp_path), "--algorithm", "adaptive", "--against", *against, "--within-noise",
                                  "--best-by", "median"])
    runs = versus_best.read_runs(str(tmp_path))
    assert [c["scenario"] for c in by_median] == [c["scenario"] for c in per_seed]
    for cell in by_median:
        sc, seeds = cell["scenario"], cell["seeds"]
        medians = {a: statistics.median(runs[(a, sc, 4, sd)]["throughput_samples_per_s"] for sd in seeds) for a in against}
        best = max(medians, key=medians.get)
        assert cell["best_by"] == "median" and cell["per_seed_best"] == [best] * len(seeds)
        want = [runs[("adaptive", sc, 4, sd)]["throughput_samples_per_s"] / runs[(best, sc, 4, sd)]["throughput_samples_per_s"]
                for sd in seeds]
        assert cell["per_seed_ratio"] == pytest.approx(want)
        assert cell["ratio"] == stats.labelled(want)
    none_seed = next(c for c in per_seed if c["scenario"] == "none")
    none_median = next(c for c in by_median if c["scenario"] == "none")
    assert sorted(none_seed["per_seed_best"]) == ["awar", "ring", "ring", "ring"]
    assert none_median["per_seed_best"] == ["ring"] * 4
    assert none_median["noise"] == none_seed["noise"]  # the threshold does not depend on the rule
    with open(tmp_path / "versus_best_adaptive_by_median.md") as f:  # beside the per-seed file, not over it
        assert "highest median throughput in the cell" in f.read()
    with open(tmp_path / "versus_best_adaptive.md") as f:
        assert "highest median throughput in the cell" not in f.read()
    versus_best.main([str(tmp_path), "--algorithm", "adaptive", "--against", "boa", "--tag", "vs_boa"])
    assert (tmp_path / "versus_best_adaptive_vs_boa.md").exists()
    with pytest.raises(ValueError, match="best_by must be one of seed, median"):
        versus_best.compare(runs, "adaptive", against, 1.0, best_by="mean")


def test_recovery_is_the_share_of_rings_loss_to_the_ideal_won_back(tmp_path):
    """benchmarks.recovery on a committed grid: per seed (X - ring) / (ideal - ring) from the grid's
    summary.json (recomputed here), interval from stats.labelled against 0, target on the lower end, the
    closed form's edge cases, and accuracy against the straggler-free ring of the reference grid."""
    from benchmarks import recovery, versus_best

    assert recovery.recovered_fraction(300.0, 200.0, 400.0) == pytest.approx(0.5)
    assert recovery.recovered_fraction(400.0, 200.0, 400.0) == pytest.approx(1.0)
    assert recovery.recovered_fraction(150.0, 200.0, 400.0) == pytest.approx(-0.25)
    assert recovery.recovered_fraction(500.0, 398.0, 400.0) is None  # nothing to recover
    results = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "matrix")
    shutil.copy(os.path.join(results, "20261203-mixtransient", "summary.json"), tmp_path / "summary.json")
    cells = recovery.main([str(tmp_path), "--algorithm", "adaptive", "--target", "0.5",
                           "--reference-grid", os.path.join(results, "20261203-ddp-none")])
    with open(tmp_path / "summary.json") as f:
        runs = {(r["algorithm"], r["world_size"], r["seed"]): r for r in json.load(f)["runs"]
                if r["scenario"] == "mixtransient" and r.get("throughput") is not None}
    ref = versus_best.read_runs(os.path.join(results, "20261203-ddp-none"))
    assert [c["world_size"] for c in cells] == [4, 8]
    for cell in cells:
        n = cell["world_size"]
        seeds = sorted(sd for (a, w, sd) in runs if a == "adaptive" and w == n)
        assert seeds == [0, 1, 2]  # the grid stopped after three seed blocks
        want = [(runs[("adaptive", n, sd)]["throughput"] - runs[("ring", n, sd)]["throughput"])
                / (runs[("ring", n, sd)]["ideal"] - runs[("ring", n, sd)]["throughput"]) for sd in seeds]
        assert [p["recovered"] for p in cell["per_seed"]] == pytest.approx(want)
        assert all(0 < w < 1 for w in want)  # better than ring, short of the ideal
        assert cell["recovered"] == stats.labelled(want, reference=0.0)
        assert cell["target_met"] == (cell["recovered"]["lo"] >= 0.5)
        acc = [100 * (runs[("adaptive", n, sd)]["val_acc"] - ref[("ring", "none", n, sd)]["val_acc"])
               for sd in seeds]
        assert cell["per_seed_acc_points"] == pytest.approx(acc)
    assert (tmp_path / "recovery_adaptive.md").exists()
    with pytest.raises(SystemExit):
        recovery.main([str(tmp_path), "--algorithm", "awar"])  # no such runs: named


def test_the_horovod_probes_refuse_bad_arguments_naming_the_setting(capsys):
    from benchmarks.local_workers import probe_arguments

    ok = probe_arguments("p", "doc", 100, "rounds", "jobs", "/tmp/out", ["--world-sizes", "4", "12"], min_steps=10)
    assert (ok.world_sizes, ok.steps, ok.step_ms, ok.repeats, ok.out) == ([4, 12], 100, 30.0, 3, "/tmp/out")
    for argv, setting in ((["--world-sizes", "1"], "--world-sizes"), (["--steps", "9"], "--steps must be >= 10"),
                          (["--repeats", "0"], "--repeats >= 1"), (["--step-ms", "-1"], "--step-ms >= 0")):
        with pytest.raises(SystemExit):
            probe_arguments("p", "doc", 100, "rounds", "jobs", "/tmp/out", argv, min_steps=10)
        assert setting in capsys.readouterr().err
