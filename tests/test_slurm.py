"""Through a real Slurm: a local cluster (scripts/local_slurm.sh, two node names on this host) runs a
2-point sweep with hydra/launcher=submitit_slurm, a 2-node x 2-task job (each task one Horovod worker,
attached through cluster_env) and a failing point. The cluster is started once for the module (installing
slurm-wlm and munge with apt-get when missing) and stopped afterwards, whatever happened."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "local_slurm.sh")
STEPS = 10
# tiny runs: 10 steps, one validation, small data, no plot
FAST = ["trainer=quick", "straggler=none", f"trainer.max_steps={STEPS}", "trainer.val_check_interval=5",
        "data.num_samples=2000", "profiler.plot=false"]


def _installable() -> str:
    """Why the local cluster cannot run here ('' when it can)."""
    if os.geteuid() != 0:
        return "the local cluster (scripts/local_slurm.sh) installs slurm with apt-get and runs its daemons as root"
    if shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("munged") and shutil.which("sbatch"):
        return ""
    if not shutil.which("apt-get"):
        return "slurm-wlm/munge are not installed and there is no apt-get to install them"
    return ""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = _installable()
    if why:
        pytest.skip(why)
    base = str(tmp_path_factory.mktemp("slurm"))
    env = {**os.environ, "LS_SLURM_DIR": base, "LS_SLURM_NODES": "2", "LS_SLURM_PORT": "17317",
           "LS_SLURM_WAIT_S": "90"}
    started = time.monotonic()
    try:
        start = subprocess.run(["bash", SCRIPT, "start"], env=env, capture_output=True, text=True, timeout=1200)
        if start.returncode != 0 and "apt-get" in start.stderr and not shutil.which("slurmctld"):
            pytest.skip(f"slurm could not be installed: {start.stderr[-1500:]}")
        assert start.returncode == 0, start.stderr[-3000:]
        print(f"\n[slurm] local cluster up in {time.monotonic() - started:.1f} s", file=sys.stderr)
        job_env = {**os.environ, "SLURM_CONF": os.path.join(base, "slurm.conf"),
                   "PATH": os.path.join(base, "bin") + os.pathsep + os.environ["PATH"], "OMP_NUM_THREADS": "1"}
        yield job_env
    finally:
        stop = subprocess.run(["bash", SCRIPT, "stop"], env=env, capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stderr[-2000:]


def _sweep(env, out, *overrides, timeout=480):
    cmd = [sys.executable, "-m", "lightning_straggler.train", "-m", "hydra/launcher=submitit_slurm", *FAST,
           *overrides, f"hydra.sweep.dir={out}"]
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    print(f"\n[slurm] {' '.join(overrides)}: {time.monotonic() - started:.1f} s", file=sys.stderr)
    return proc


def _summary(path):
    with open(path) as f:
        return json.load(f)


def _check(summary, algorithm, world):
    assert summary["algorithm"] == algorithm
    assert summary["world_size"] == world
    assert sorted(summary["per_rank"]) == [str(r) for r in range(world)]
    assert all(r["steps"] == STEPS for r in summary["per_rank"].values()), summary["per_rank"]
    assert summary["val_acc"] is not None


def test_sweep_two_points(cluster, tmp_path):
    out = tmp_path / "multirun"
    proc = _sweep(cluster, out, "algorithm=ring,boa", "trainer.devices=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    # one SLURM job per point (an array), each writing summary.json in its Hydra directory
    _check(_summary(out / "0" / "summary.json"), "ring", 2)
    _check(_summary(out / "1" / "summary.json"), "boa", 2)
    assert len(glob.glob(str(out / ".submitit" / "*_[01]" / "*_result.pkl"))) == 2


def test_two_nodes_two_tasks(cluster, tmp_path):
    out = tmp_path / "multirun"
    proc = _sweep(cluster, out, "algorithm=ring", "trainer.devices=2", "hydra.launcher.nodes=2",
                  "hydra.launcher.tasks_per_node=2", "hydra.launcher.cpus_per_task=1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check(_summary(out / "0" / "summary.json"), "ring", 4)
    # 4 tasks of one job over both nodes, each a worker: submitit's log line per task names its place
    places = set()
    for log in glob.glob(str(out / ".submitit" / "*" / "*_log.out")):
        with open(log) as f:
            text = f.read()
        m = re.search(r"local_rank=(\d)\(2\), node=(\d)\(2\), global_rank=(\d)\(4\)", text)
        assert m, log
        places.add(tuple(int(g) for g in m.groups()))
        # what the task attached with: task 0's rendezvous on the first node's (loopback) address, Gloo on lo
        m = re.search(r"SLURM task (\d) of 4 \(local (\d) of 2\) on node (ls[12]): Horovod rendezvous "
                      r"127\.0\.0\.1:\d+( \(hosted here\))?, Gloo on lo", text)
        assert m, text[-2000:]
        assert (m.group(1) == "0") == bool(m.group(4))
    assert places == {(0, 0, 0), (1, 0, 1), (0, 1, 2), (1, 1, 3)}


def test_failing_point_reports_submitit_logs(cluster, tmp_path):
    out = tmp_path / "multirun"
    proc = _sweep(cluster, out, "algorithm=ring", "trainer.devices=2", "trainer.stall_timeout_s=1", timeout=300)
    assert proc.returncode != 0
    assert "trainer.stall_timeout_s must be in" in proc.stderr
    m = re.search(r"submitit logs of this job: (\S+), (\S+)", proc.stderr)
    assert m, proc.stderr[-3000:]
    with open(m.group(2)) as f:
        assert "trainer.stall_timeout_s must be in" in f.read()


def test_srun_by_hand(cluster):
    # a user's own script under `srun -N2 --ntasks-per-node=2`: 4 attached workers, in step
    script = os.path.join(ROOT, "tests", "scripts", "attached_fit.py")
    started = time.monotonic()
    proc = subprocess.run(["srun", "-N2", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10",
                           sys.executable, script], env=cluster, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    print(f"\n[slurm] srun -N2 --ntasks-per-node=2: {time.monotonic() - started:.1f} s", file=sys.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert all(r["world"] == 4 and r["steps"] == 5 and r["launcher"] == "NoneType" for r in results)
    assert all(r["params"] == pytest.approx(results[0]["params"], abs=1e-7) for r in results)
