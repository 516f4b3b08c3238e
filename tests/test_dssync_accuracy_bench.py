"""benchmarks/dssync_accuracy.py's arithmetic, in one process: paired differences in points, the verdict
rule fixed before its runs, the shuffled order."""
import pytest

from benchmarks import dssync_accuracy as da


def _run(algo, seed, acc, workers=4):
    return {"algorithm": algo, "workers": workers, "seed": seed, "val_acc": acc,
            "val_history": [{"step": 10, "val_acc": acc - 0.1}, {"step": 20, "val_acc": acc}]}


def test_differences_are_paired_by_seed_in_points():
    runs = []
    for seed, (ring, ds) in enumerate([(0.60, 0.595), (0.62, 0.625), (0.58, 0.572), (0.61, 0.61), (0.59, 0.585)]):
        runs += [_run("ring", seed, ring), _run("dssync-direct", seed, ds)]
    cell = da.aggregate(runs, ["ring", "dssync-direct"])["4"]
    assert cell["dssync-direct"]["points_minus_ring"] == pytest.approx([-0.5, 0.5, -0.8, 0.0, -0.5])
    assert cell["dssync-direct"]["difference"]["median"] == pytest.approx(-0.5)
    assert cell["dssync-direct"]["difference"]["verdict"] == "within 1 point, interval too"
    assert cell["ring"]["val_acc"] == [0.60, 0.62, 0.58, 0.61, 0.59]


@pytest.mark.parametrize("diffs,expected", [
    ([-0.5] * 5, "within 1 point, interval too"),
    ([-0.2, -0.5, -0.8, -3.0, -4.0], "within 1 point (median; the interval reaches below -1)"),
    ([-2.0, -1.5, -1.2, 0.0, -3.0], "not within 1 point"),
    ([2.0, 3.0, 1.0, 2.5, 4.0], "within 1 point, interval too"),  # better than ring: the bound is on the cost
])
def test_verdict_rule(diffs, expected):
    runs = []
    for seed, d in enumerate(diffs):
        runs += [_run("ring", seed, 0.6), _run("dssync-direct", seed, 0.6 + d / 100.0)]
    assert da.aggregate(runs, ["ring", "dssync-direct"])["4"]["dssync-direct"]["difference"]["verdict"] == expected


def test_too_few_seeds_give_no_interval_and_say_so():
    runs = [_run("ring", 0, 0.6), _run("dssync-direct", 0, 0.6)]
    ci = da.aggregate(runs, ["ring", "dssync-direct"])["4"]["dssync-direct"]["difference"]
    assert ci["lo"] is None and ci["verdict"] == "within 1 point (median; the interval reaches below -1)"


def test_order_is_shuffled_per_block_and_reproducible():
    orders = {tuple(da.block_order(["ring", "dssync-direct"], 4, s)) for s in range(8)}
    assert len(orders) == 2
    assert da.block_order(["ring", "dssync-direct"], 8, 3) == da.block_order(["ring", "dssync-direct"], 8, 3)


def test_markdown_lists_every_seed_and_epoch():
    runs = []
    for seed in range(3):
        runs += [_run("ring", seed, 0.6), _run("dssync-direct", seed, 0.59)]
    result = {"command": "x", "options": {"workers": [4], "seeds": 3, "epochs": 2,
                                          "algorithms": ["ring", "dssync-direct"]}, "runs": runs}
    result["table"] = da.aggregate(runs, result["options"]["algorithms"])
    md = da.markdown(result)
    assert "| 4 | dssync-direct | 0.590 0.590 0.590 | 0.600 0.600 0.600 | -1.00 [-1.00, -1.00]" in md
    assert "| 4 | ring | 0.500 | 0.600 |" in md


def test_committed_results_equal_a_fresh_aggregation_of_their_runs(tmp_path):
    import glob
    import json
    import os
    import shutil

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results",
                        "dssync_accuracy")
    committed = sorted(glob.glob(os.path.join(root, "*", "results.json")))
    if not committed:
        pytest.skip("no committed dssync_accuracy results yet")
    for path in committed:
        copy = tmp_path / os.path.basename(os.path.dirname(path))
        shutil.copytree(os.path.dirname(path), copy)
        da.main(["--aggregate-only", str(copy)])
        assert json.loads((copy / "results.json").read_text())["table"] == json.load(open(path))["table"], path
        assert (copy / "results.md").read_text() == open(os.path.join(os.path.dirname(path), "results.md")).read()
