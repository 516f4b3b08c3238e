"""Hosts on one machine (benchmarks/network.py): 4 Horovod workers on 2 namespaced hosts, links shaped with
tc; the all-reduce time grows as the bandwidth predicts, a training run attaches across the hosts (so does
Lightning's DDP under torchrun), and
every namespace (and its /etc/netns folder) is gone afterwards, also after a failure."""
import json
import os
import statistics
import sys

import pytest

from benchmarks import network
from benchmarks.network import (LinkShape, NamespacedHosts, allreduce_seconds, halving_doubling_allreduce_predicted_s,
                                ring_allreduce_predicted_s)

pytestmark = [pytest.mark.netns, pytest.mark.multiprocess]
FLOATS = 524288  # 2 MiB: at the slow rate the links, not the CPUs, take most of the time


@pytest.fixture(autouse=True)
def _needs_namespaces():
    why = network.available()
    if why:
        pytest.skip(why)
    yield
    assert not network.own_namespaces()


def _ours():
    mine = f"{network.PREFIX}{os.getpid()}-"
    folders = os.listdir(network.NETNS_ETC) if os.path.isdir(network.NETNS_ETC) else []
    return network.own_namespaces() + [f for f in folders if f.startswith(mine)]


@pytest.mark.exclusive  # times against a prediction: nothing else runs beside it under pytest -n 2
def test_allreduce_time_grows_as_the_bandwidth_predicts(tmp_path):
    # Prediction (halving_doubling_allreduce_predicted_s, the all-reduce this project's Horovod build runs):
    # 2(h-1)/h x 2 MiB over each host's link (a ring would send 2(k-1)/k, 1.5 x as much: checked against
    # at the low rate below). Bounds: no faster than
    # 0.9x the prediction (the link cannot be beaten; the token bucket's burst lets at most ~3% of the data
    # through early); no slower than 1.2x it (TCP and Ethernet headers: ~5%, 1448 payload bytes per 1514 on
    # the wire; ramp-up) plus 3x the unshaped time (the sums and copies on this machine's two CPUs, which
    # overlap the transfers only in part, measured here under the same load).
    # one job times all three (the links re-shaped between phases): same processes, same load
    rates = (None, 200.0, 50.0)
    secs = allreduce_seconds(2, 4, [LinkShape(rate) for rate in rates], FLOATS, 5, str(tmp_path / "probe"))
    assert [len(s) for s in secs] == [5, 5, 5]
    median = {rate: statistics.median(s) for rate, s in zip(rates, secs)}
    base = median[None]
    for rate in (200.0, 50.0):
        predicted = halving_doubling_allreduce_predicted_s(4, 2, FLOATS, rate)
        assert 0.9 * predicted <= median[rate] <= 1.2 * predicted + 3 * base, (rate, median, predicted)
    # not the ring's traffic: at the low rate the ring's prediction is well above what was measured
    assert median[50.0] < 0.9 * ring_allreduce_predicted_s(4, 2, FLOATS, 50.0), median
    # shaping, not the machine, sets the time at the low rate
    assert base < halving_doubling_allreduce_predicted_s(4, 2, FLOATS, 50.0) / 4, median
    assert not _ours()


def test_training_attaches_across_hosts(tmp_path):
    out = tmp_path / "run"
    with NamespacedHosts(2, LinkShape(500.0)) as net:
        network.launch_workers(net, 4, [sys.executable, "-m", "lightning_straggler.train", "algorithm=ring",
                                        "trainer=quick", "trainer.devices=4", "trainer.max_steps=8",
                                        "trainer.val_check_interval=8", f"output_dir={out}",
                                        f"hydra.run.dir={tmp_path}/hydra{{rank}}"],
                               str(tmp_path / "logs"), timeout_s=300, extra_env={"OMP_NUM_THREADS": "1"})
        sent = [net.bytes_sent(h) for h in range(2)]
        names = net.names
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["train_samples"] == 8 * 32 * 4
    # every rank's profiler saw all 8 steps: the four workers trained together, two per host
    assert [summary["per_rank"][str(r)]["steps"] for r in range(4)] == [8, 8, 8, 8]
    # and the gradients crossed the link: each host sent at least 2(h-1)/h of the gradient per step
    # (float32; the quick trainer's MLP 40-256-256-10), as a halving-doubling all-reduce across two hosts
    # must (this project's Horovod build; a ring: 2(k-1)/k)
    params = 40 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    assert min(sent) >= 8 * 1.0 * params * 4, sent
    assert not [ns for ns in network.namespaces() if ns in names]
    assert not _ours()


def test_ddp_under_torchrun_trains_across_hosts(tmp_path):
    # Lightning's DDP, started by real torchrun (one agent per namespaced host, 2 workers each: num_nodes=2)
    out = tmp_path / "run"
    with NamespacedHosts(2, LinkShape(500.0)) as net:
        network.launch_torchrun(net, 4, [sys.executable, "-m", "lightning_straggler.train", "algorithm=ddp",
                                         "trainer=quick", "trainer.devices=4", "trainer.max_steps=8",
                                         "trainer.val_check_interval=8", "straggler=none", f"output_dir={out}",
                                         f"hydra.run.dir={tmp_path}/hydra{{rank}}"],
                                str(tmp_path / "logs"), timeout_s=300, extra_env={"OMP_NUM_THREADS": "1"})
        sent = [net.bytes_sent(h) for h in range(2)]
        names = net.names
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "ddp" and summary["world_size"] == 4
    assert [summary["per_rank"][str(r)]["steps"] for r in range(4)] == [8, 8, 8, 8]
    assert summary["profiling"]["launch"].startswith("torchrun")
    assert sorted(os.listdir(tmp_path)) == sorted(["run", "logs"] + [f"hydra{r}" for r in range(4)])  # per rank
    # the gradients crossed the link: at least the whole gradient per step and host (Gloo's ring over 4
    # block-placed ranks sends 2(k-1)/k = 1.5 x across each host link)
    params = 40 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    assert min(sent) >= 8 * 1.0 * params * 4, sent
    assert not [ns for ns in network.namespaces() if ns in names]
    assert not _ours()


def test_teardown_after_a_failing_worker(tmp_path):
    with pytest.raises(network.NetworkError, match="rank 1 failed"):
        with NamespacedHosts(2) as net:
            names = net.names
            network.launch_workers(net, 2, [sys.executable, "-c", "import os,sys; sys.exit(3 if os.environ['HOROVOD_RANK'] == '1' else 0)"],
                                   str(tmp_path / "logs"), timeout_s=60)
    assert not [ns for ns in network.namespaces() if ns in names]
    assert not _ours()


def test_bad_shape_is_refused_before_anything_is_made():
    with pytest.raises(ValueError, match="rate_mbit=0.*between 0.1 and 100000"):
        LinkShape(rate_mbit=0)
    with pytest.raises(ValueError, match="delay_ms=-1.*between 0 and 1000"):
        LinkShape(delay_ms=-1)
    with pytest.raises(ValueError, match="hosts=0: must be between 1 and 16"):
        NamespacedHosts(0)
    assert not _ours()


def test_teardown_when_the_process_is_terminated(tmp_path):
    # a plain `kill` (SIGTERM) of a process inside the `with` block still removes its namespaces
    import signal
    import subprocess

    code = ("import sys, time\nfrom benchmarks.network import NamespacedHosts\n"
            "with NamespacedHosts(2) as net:\n    print(' '.join(net.names), flush=True)\n    time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=network.ROOT, stdout=subprocess.PIPE, text=True)
    try:
        names = proc.stdout.readline().split()
        assert len(names) == 2 and all(ns in network.namespaces() for ns in names)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            network.cleanup()
    assert not [ns for ns in network.namespaces() if ns in names]
    folders = os.listdir(network.NETNS_ETC) if os.path.isdir(network.NETNS_ETC) else []
    assert not [f for f in folders if f in names]
