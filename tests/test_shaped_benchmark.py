"""benchmarks/shaped_network.py's arithmetic in one process: parameter counts, the simulator's prediction,
the run order, the paired ratios and verdicts, bad options."""
import pytest

from benchmarks import shaped_network as sn
from benchmarks.network import halving_doubling_allreduce_predicted_s, ring_allreduce_predicted_s, worker_layouts


def test_parameter_count_matches_the_model():
    from lightning_straggler.models import build_network

    net = build_network("mlp", 40, 10, [1024, 1024])
    assert sn.parameter_count([1024, 1024]) == sum(p.numel() for p in net.parameters())


def test_simulator_predicts_ring_as_the_host_link_carries_it():
    floats = sn.parameter_count([1024, 1024])
    assert sn.sim_sync_s("ring", 4, [1024, 1024], 100.0) == pytest.approx(ring_allreduce_predicted_s(4, 2, floats, 100.0))
    # a group of 2 sends the whole payload once: 2(g-1)/g = 1
    assert sn.sim_sync_s("dssync", 4, [1024, 1024], 100.0) == pytest.approx(floats * 4 * 8 / 100e6)


def test_block_placement():
    layouts = worker_layouts(4, 2)
    assert [(l.node_rank, l.local_rank, l.cross_rank, l.local_size, l.cross_size) for l in layouts] == [
        (0, 0, 0, 2, 2), (0, 1, 0, 2, 2), (1, 0, 1, 2, 2), (1, 1, 1, 2, 2)]
    with pytest.raises(ValueError, match="workers=4 must be a multiple of hosts=3"):
        worker_layouts(4, 3)


def test_order_is_shuffled_per_block_and_reproducible():
    labels = ["ring", "dssync", "ring#2"]
    orders = {tuple(sn.block_order(labels, 2, s)) for s in range(10)}
    assert len(orders) > 1 and all(sorted(o) == sorted(labels) for o in orders)
    assert sn.block_order(labels, 2, 3) == sn.block_order(labels, 2, 3)


def _run(algo, seed, throughput, acc=0.5, sync=0.5):
    return {"algorithm": algo, "hosts": 2, "seed": seed, "throughput": throughput, "val_acc": acc,
            "sync_s_per_step": sync, "bytes_per_step_per_host": [1e6, 2e6]}


def test_aggregate_pairs_by_seed_and_labels_by_interval():
    runs = []
    for seed in range(5):
        runs += [_run("ring", seed, 100.0 + seed), _run("dssync", seed, 2.0 * (100.0 + seed), acc=0.49, sync=0.3),
                 _run("ring#2", seed, 100.0 + seed + (1 if seed % 2 else -1))]
    options = {"workers": 4, "hidden": [1024, 1024], "rate_mbit": 100.0}
    cell = sn.aggregate(runs, ["ring", "dssync"], options)["2"]
    assert cell["dssync"]["ratios"] == pytest.approx([2.0] * 5)
    assert cell["dssync"]["throughput_vs_ring"]["label"] == "win"
    assert cell["dssync"]["target_1_5x"] == "reached"
    assert cell["dssync"]["val_acc_minus_ring_median"] == pytest.approx(-0.01)
    assert cell["dssync"]["bytes_per_step_per_host_median"] == 2e6  # the busiest host
    assert cell["ring#2"]["throughput_vs_ring"]["label"] == "no difference"
    sim = cell["ring"]["sim_network"]
    assert sim["error"] == pytest.approx(sim["predicted_sync_s_per_step"] / 0.5 - 1)


def test_with_ddp_in_the_run_every_other_algorithm_is_also_scored_against_it():
    runs = []
    for seed in range(5):
        runs += [_run("ring", seed, 100.0 + seed), _run("ddp", seed, 80.0 + seed), _run("dssync", seed, 160.0 + seed),
                 _run("ring#2", seed, 100.0 + seed)]
    cell = sn.aggregate(runs, ["ring", "dssync", "ddp"], {"workers": 4, "hidden": [8], "rate_mbit": 100.0})["2"]
    assert cell["ddp"]["throughput_vs_ring"]["label"] == "loss" and "throughput_vs_ddp" not in cell["ddp"]
    assert cell["dssync"]["throughput_vs_ddp"]["median"] == pytest.approx(162.0 / 82.0)
    assert cell["dssync"]["throughput_vs_ddp"]["label"] == "win"
    assert cell["ring#2"]["throughput_vs_ddp"]["label"] == "win"
    without = sn.aggregate([r for r in runs if r["algorithm"] != "ddp"], ["ring", "dssync"],
                           {"workers": 4, "hidden": [8], "rate_mbit": 100.0})["2"]
    assert "throughput_vs_ddp" not in without["dssync"]


def test_target_needs_the_interval_not_the_median():
    runs = []
    for seed, ratio in enumerate([1.2, 1.6, 1.6, 1.7, 1.3]):
        runs += [_run("ring", seed, 100.0), _run("dssync", seed, 100.0 * ratio), _run("ring#2", seed, 100.0)]
    cell = sn.aggregate(runs, ["ring", "dssync"], {"workers": 4, "hidden": [8], "rate_mbit": 100.0})["2"]
    assert cell["dssync"]["throughput_vs_ring"]["median"] == pytest.approx(1.6)
    assert cell["dssync"]["throughput_vs_ring"]["label"] == "win"
    assert cell["dssync"]["target_1_5x"] == "not reached"  # the interval's lower end is under 1.5


def test_bad_options_fail_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        sn.main(["--hosts", "3", "--workers", "4"])
    assert "--hosts 3: must divide --workers 4" in capsys.readouterr().err
    # a run longer than one epoch would stop at its first run (Lightning: val_check_interval > batches)
    assert sn.batches_per_epoch(4) == 125 and sn.batches_per_epoch(8) == 62  # 16,000 samples, batch 32
    with pytest.raises(SystemExit):
        sn.main(["--hosts", "4", "--workers", "4", "--steps", "150"])
    assert "--steps 150: at most 125 with --workers 4" in capsys.readouterr().err


def test_halving_doubling_prediction_is_what_crosses_each_host_link():
    mbit_s = 100.0
    one = 1000 * 4 * 8 / (mbit_s * 1e6)  # 1000 float32 values over the link once
    assert halving_doubling_allreduce_predicted_s(4, 2, 1000, mbit_s) == pytest.approx(one)  # 2(h-1)/h = 1
    assert halving_doubling_allreduce_predicted_s(8, 4, 1000, mbit_s) == pytest.approx(1.5 * one)
    assert halving_doubling_allreduce_predicted_s(8, 1, 1000, mbit_s) == 0.0
    # less than a ring's 2(k-1)/k whenever a host holds more than one rank
    assert halving_doubling_allreduce_predicted_s(8, 2, 1000, mbit_s) < ring_allreduce_predicted_s(8, 2, 1000, mbit_s)
    for workers, hosts in ((6, 2), (12, 4), (6, 3)):
        with pytest.raises(ValueError, match="powers of two"):
            halving_doubling_allreduce_predicted_s(workers, hosts, 1000, mbit_s)
