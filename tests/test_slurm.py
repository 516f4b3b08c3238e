"""Through a real Slurm: a local cluster (scripts/local_slurm.sh, two node names on this host) runs a
2-point sweep with hydra/launcher=submitit_slurm, a failing point and a user's script under srun on 2
nodes; a second cluster whose nodes are two network namespaces (one slurmd each) runs a 2-node x 2-task
job over a shaped link (each task one Horovod worker, attached through cluster_env). The loopback cluster
is started once for the module (installing slurm-wlm and munge with apt-get when missing), and each
cluster is stopped afterwards, whatever happened."""
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


def _places_and_attach(out, rendezvous_re, iface):
    """Each task's place (local rank, node, global rank) from submitit's log lines, checking the attach line:
    task 0 hosts Horovod's rendezvous at ``rendezvous_re``, Gloo on ``iface``. Returns {place: node name}."""
    places = {}
    for log in glob.glob(str(out / ".submitit" / "*" / "*_log.out")):
        with open(log) as f:
            text = f.read()
        m = re.search(r"local_rank=(\d)\(2\), node=(\d)\(2\), global_rank=(\d)\(4\)", text)
        assert m, log
        place = tuple(int(g) for g in m.groups())
        m = re.search(r"SLURM task (\d) of 4 \(local (\d) of 2\) on node (ls[12]): Horovod rendezvous "
                      + rendezvous_re + r":\d+( \(hosted here\))?, Gloo on " + iface, text)
        assert m, text[-2000:]
        assert (m.group(1) == "0") == bool(m.group(4))
        places[place] = m.group(3)
    return places


@pytest.mark.netns
def test_two_nodes_two_tasks_on_two_namespaced_hosts(tmp_path):
    """A 2-node x 2-task job where each Slurm node is its own host: two network namespaces on a bridge
    (benchmarks/network.py), one slurmd in each, slurmctld in the first (local_slurm.sh with LS_SLURM_NETNS),
    the sweep submitted from inside the first. Each task is one Horovod worker attached through cluster_env:
    task 0's rendezvous on its node's address, Gloo on the namespace's eth0, and the gradients cross the
    shaped link between the hosts (its byte counters), as between two machines."""
    from benchmarks import network

    why = _installable() or network.available()
    if why:
        pytest.skip(why)
    out = tmp_path / "multirun"
    with network.NamespacedHosts(2, network.LinkShape(200.0)) as net:
        addrs = [net.address(h) for h in range(2)]
        with network.slurm_on_hosts(net, str(tmp_path / "cluster"), port=17417) as env:
            before = [net.bytes_sent(h) for h in range(2)]
            cmd = [sys.executable, "-m", "lightning_straggler.train", "-m", "hydra/launcher=submitit_slurm", *FAST,
                   "algorithm=ring", "trainer.devices=2", "hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=2",
                   "hydra.launcher.cpus_per_task=1", f"hydra.sweep.dir={out}"]
            started = time.monotonic()
            proc = net.popen(0, cmd, env={**env, "OMP_NUM_THREADS": "1"}, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            _, stderr = proc.communicate(timeout=480)
            print(f"\n[slurm] 2 nodes x 2 tasks on 2 namespaced hosts: {time.monotonic() - started:.1f} s", file=sys.stderr)
            sent = [net.bytes_sent(h) - before[h] for h in range(2)]
        names = net.names
    assert not [ns for ns in network.namespaces() if ns in names]  # torn down
    assert proc.returncode == 0, stderr[-4000:]
    _check(_summary(out / "0" / "summary.json"), "ring", 4)
    places = _places_and_attach(out, re.escape(addrs[0]), "eth0")
    assert places == {(0, 0, 0): "ls1", (1, 0, 1): "ls1", (0, 1, 2): "ls2", (1, 1, 3): "ls2"}
    # the gradient all-reduce across two hosts (recursive halving-doubling, this project's Horovod build:
    # pairs within a host, then across): each host's link carries half the gradient in the reduce-scatter
    # and half in the all-gather, the whole of it per step (float32, the quick trainer's MLP 40-256-256-10;
    # a ring would carry 2(k-1)/k = 1.5 of it), plus the rendezvous, validation and Slurm's own messages
    params = 40 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    assert min(sent) >= STEPS * 1.0 * params * 4, sent


@pytest.mark.netns
def test_the_slurm_command_runs_inside_the_first_host_and_passes_its_exit_code(capfd):
    """``python -m benchmarks.network slurm --hosts 2 -- CMD``: CMD runs inside the first namespaced host
    (its own address there, both Slurm nodes up and reachable), its exit code is the command's, and the
    cluster and the hosts are gone afterwards."""
    from benchmarks import network

    why = _installable() or network.available()
    if why:
        pytest.skip(why)
    script = "hostname -I; sinfo -h -N -o '%N %t'; exit 3"
    rc = network.main(["slurm", "--hosts", "2", "--port", "17517", "--timeout-s", "120", "--", "sh", "-c", script])
    out, err = capfd.readouterr()
    assert rc == 3, err[-2000:]
    assert "10.77.0.1" in out.split()  # inside host 0
    nodes = dict(line.split() for line in out.splitlines() if line.startswith("ls"))
    assert set(nodes) == {"ls1", "ls2"} and all(state in ("idle", "mix", "alloc") for state in nodes.values()), out
    assert "cluster stopped, hosts torn down" in err
    assert not network.own_namespaces()  # another xdist worker's may exist meanwhile


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


@pytest.mark.netns
def test_the_slurm_command_past_its_timeout_is_killed_and_gives_124(capfd):
    """``--timeout-s``: a command still running then is killed at once (before the cluster stops under it),
    the exit code is 124 and says so, and the hosts are gone afterwards."""
    from benchmarks import network

    why = _installable() or network.available()
    if why:
        pytest.skip(why)
    start = time.monotonic()
    rc = network.main(["slurm", "--hosts", "2", "--port", "17519", "--timeout-s", "3", "--", "sleep", "600"])
    _, err = capfd.readouterr()
    assert rc == 124, err[-2000:]
    assert "ran past --timeout-s 3; killed" in err
    assert time.monotonic() - start < 300  # not the command's 600 s
    assert not network.own_namespaces()  # another xdist worker's may exist meanwhile
