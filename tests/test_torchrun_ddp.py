"""``algorithm=ddp`` under real ``torchrun``: Lightning's DDP attaches to the launcher's workers (any number of
nodes) instead of spawning its own, and trains as the spawned baseline does.

In-process: the launch is checked against the configuration (torchrun serves ddp only; ``trainer.devices``
must be torchrun's world size) with errors naming the setting, before any worker starts. Real runs: two
torchrun agents as two nodes of 2 workers each on loopback (4 ranks, ``num_nodes=2``) end at the spawned
4-worker ddp's validation accuracy and parameters, and nothing is spawned."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from lightning_straggler.cluster_env import ClusterEnvError, torchrun_launched, torchrun_layout
from lightning_straggler.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = {"TORCHELASTIC_RUN_ID": "t", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "RANK": "3", "LOCAL_RANK": "1",
            "GROUP_RANK": "1"}


def test_torchrun_is_recognised_by_torchs_own_variable():
    assert torchrun_launched(TORCHRUN)
    assert not torchrun_launched({k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RUN_ID"})
    assert torchrun_layout("ddp", 4, {}) is None  # not under torchrun: the project's own launch


def test_torchrun_layout_gives_lightning_its_per_node_devices_and_nodes():
    layout = torchrun_layout("ddp", 4, TORCHRUN)
    assert (layout.world_size, layout.devices, layout.num_nodes) == (4, 2, 2)
    one_node = torchrun_layout("ddp", 3, {**TORCHRUN, "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"})
    assert (one_node.devices, one_node.num_nodes) == (3, 1)


@pytest.mark.parametrize("algorithm,devices,env,needle", [
    ("ring", 4, TORCHRUN, "algorithm=ddp only"),
    ("ddp", 2, TORCHRUN, "trainer.devices must equal torchrun's world size 4"),
    ("ddp", 6, {**TORCHRUN, "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, "same --nproc-per-node"),
    ("ddp", 4, {**TORCHRUN, "WORLD_SIZE": "four"}, "not integers"),
])
def test_a_launch_that_disagrees_with_the_configuration_is_refused(algorithm, devices, env, needle):
    with pytest.raises(ClusterEnvError, match=needle):
        torchrun_layout(algorithm, devices, env)


def test_train_refuses_a_mismatch_before_any_worker_starts(compose, monkeypatch, tmp_path):
    from lightning_straggler.train import train

    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    cfg = compose("algorithm=ddp", "trainer=quick", "trainer.devices=2", "straggler=none", f"output_dir={tmp_path}")
    with pytest.raises(ConfigError, match=r"trainer.devices must equal torchrun's world size 4 .*got 2"):
        train(cfg)
    assert not os.path.exists(tmp_path / "summary.json")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PARAMS_SCRIPT = """
import json, sys, torch
ckpt = torch.load(sys.argv[1], map_location="cpu", weights_only=False)
flat = torch.cat([v.reshape(-1).float() for v in ckpt["state_dict"].values()])
print(json.dumps([float(flat.sum()), float(flat.abs().sum())]))
"""


def _final_params(out) -> list:
    r = subprocess.run([sys.executable, "-c", PARAMS_SCRIPT, str(out / "checkpoints" / "last.ckpt")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_two_torchrun_nodes_of_two_workers_train_like_spawned_ddp(cli, tmp_path):
    steps = 12
    common = ["algorithm=ddp", "trainer=quick", "trainer.devices=4", f"trainer.max_steps={steps}",
              f"trainer.val_check_interval={steps}", "data.num_samples=2000", "straggler=none", "profiler.plot=false"]
    spawned = cli(*common, f"output_dir={tmp_path / 'spawned'}", f"hydra.run.dir={tmp_path / 'hs'}", timeout=540)
    assert spawned.returncode == 0, spawned.stdout[-3000:] + spawned.stderr[-3000:]

    port, out = _free_port(), tmp_path / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node}",
         "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "lightning_straggler.train", *common,
         f"output_dir={out}", f"hydra.run.dir={tmp_path}/h" + "${oc.env:RANK}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in range(2)]
    try:
        logs = [a.communicate(timeout=480) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    for a, (stdout, stderr) in zip(agents, logs):
        assert a.returncode == 0, stdout[-3000:] + stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    ref = json.loads((tmp_path / "spawned" / "summary.json").read_text())
    assert s["algorithm"] == "ddp" and s["world_size"] == 4 and sorted(s["per_rank"]) == ["0", "1", "2", "3"]
    assert all(p["steps"] == steps for p in s["per_rank"].values())
    assert s["train_samples"] == ref["train_samples"] == 4 * steps * 32
    # attached, not spawned
    assert s["profiling"]["launch"].startswith("torchrun (attached")
    assert "multiprocessing launcher" in ref["profiling"]["launch"]
    # the same training: same data shards, same averaged gradients (Gloo sums in its own order: float noise only)
    assert s["val_acc"] == pytest.approx(ref["val_acc"], abs=1e-3)
    assert _final_params(out) == pytest.approx(_final_params(tmp_path / "spawned"), rel=1e-4)
