"""SLURM task environment parsing and the attach rule (no SLURM, no workers)."""
import socket

import pytest

from lightning_straggler import cluster_env
from lightning_straggler.cluster_env import (ClusterEnvError, attach_env, expand_nodelist, expand_tasks_per_node,
                                             rendezvous_endpoint, slurm_layout, srun_launched)


@pytest.mark.parametrize("spec, names", [
    ("node1", ["node1"]),
    ("node[1-3],other", ["node1", "node2", "node3", "other"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("a[1,3-4]b,c[2]", ["a1b", "a3b", "a4b", "c2"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("ls[1-2]", ["ls1", "ls2"]),
])
def test_expand_nodelist(spec, names):
    assert expand_nodelist(spec) == names


@pytest.mark.parametrize("spec", ["n[1-", "n]1", "n[3-1]", "n[a-b]"])
def test_expand_nodelist_rejects(spec):
    with pytest.raises(ClusterEnvError):
        expand_nodelist(spec)


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ClusterEnvError):
        expand_tasks_per_node("2(x)")


def step_env(procid, localid, nodeid, ntasks=4, nodes="ls[1-2]", per_node="2(x2)", **extra):
    env = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid),
           "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid), "SLURM_NTASKS": str(ntasks),
           "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_STEP_NODELIST": nodes, "SLURM_JOB_NODELIST": nodes,
           "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_TASKS_PER_NODE": per_node, "SLURM_JOB_NAME": "train"}
    env.update(extra)
    return env


def test_layout_two_nodes_two_tasks_each():
    # SLURM's block distribution: tasks 0,1 on ls1, tasks 2,3 on ls2
    layouts = [slurm_layout(step_env(r, r % 2, r // 2, SLURMD_NODENAME=f"ls{r // 2 + 1}")) for r in range(4)]
    assert [(l.rank, l.size, l.local_rank, l.local_size, l.cross_rank, l.cross_size, l.hostname) for l in layouts] == [
        (0, 4, 0, 2, 0, 2, "ls1"), (1, 4, 1, 2, 0, 2, "ls1"), (2, 4, 0, 2, 1, 2, "ls2"), (3, 4, 1, 2, 1, 2, "ls2")]


def test_layout_uneven_nodes():
    # 3 tasks on n1, 1 on n2 (what `srun -N2 -n4` gives here): local rank 1 and 2 exist on n1 only
    env = dict(nodes="n[1-2]", per_node="3,1")
    l2 = slurm_layout(step_env(2, 2, 0, **env))
    assert (l2.local_size, l2.cross_rank, l2.cross_size, l2.hostname) == (3, 0, 1, "n1")
    l3 = slurm_layout(step_env(3, 0, 1, **env))
    assert (l3.local_rank, l3.local_size, l3.cross_rank, l3.cross_size, l3.hostname) == (0, 1, 1, 2, "n2")


def test_layout_falls_back_to_job_variables():
    env = step_env(1, 1, 0)
    for k in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE"):
        del env[k]
    layout = slurm_layout(env)
    assert (layout.rank, layout.size, layout.local_size, layout.nodes) == (1, 4, 2, ("ls1", "ls2"))


def test_layout_inconsistent():
    with pytest.raises(ClusterEnvError, match="do not add up"):
        slurm_layout(step_env(0, 0, 0, ntasks=5))
    with pytest.raises(ClusterEnvError, match="does not fit"):
        slurm_layout(step_env(0, 2, 0))


def test_not_under_srun():
    assert srun_launched(step_env(0, 0, 0))
    # a one-task step (a sweep point; an interactive step): the process spawns its own workers
    assert not srun_launched(step_env(0, 0, 0, ntasks=1, nodes="ls1", per_node="1"))
    # an salloc shell or a batch script: job variables, no step, no task id
    alloc = {k: v for k, v in step_env(0, 0, 0).items() if k not in ("SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS")}
    assert not srun_launched(alloc)
    shell = {k: v for k, v in alloc.items() if k != "SLURM_PROCID"}
    assert not srun_launched({**shell, "SLURM_JOB_NAME": "interactive"})
    # horovodrun's variables win; LS_CLUSTER_ATTACH=0 turns it off
    assert not srun_launched({**step_env(0, 0, 0), "HOROVOD_RANK": "0", "HOROVOD_SIZE": "4"})
    assert not srun_launched({**step_env(0, 0, 0), "LS_CLUSTER_ATTACH": "0"})
    # srun -n4 bash -c "python ..." is a real 4-task step although the job is named bash
    assert srun_launched(step_env(0, 0, 0, SLURM_JOB_NAME="bash"))
    assert not srun_launched({})


def test_attach_does_nothing_outside_srun(monkeypatch):
    env = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}  # inside an allocation, not a task
    assert cluster_env.attach(env=env) is None
    assert env == {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}


def test_rendezvous_endpoint_and_env():
    layout = slurm_layout(step_env(3, 1, 1, SLURMD_NODENAME="ls2"))
    addr, port = rendezvous_endpoint(layout, {"LS_RENDEZVOUS_ADDR": "127.0.0.1"})
    assert (addr, port) == ("127.0.0.1", 15000 + 1234)
    assert rendezvous_endpoint(layout, {"LS_RENDEZVOUS_ADDR": "localhost", "MASTER_PORT": "29500"}) == ("127.0.0.1", 29500)
    with pytest.raises(ClusterEnvError, match="cannot resolve"):
        rendezvous_endpoint(layout, {"LS_RENDEZVOUS_ADDR": "no-such-host.invalid"})
    env = attach_env(layout, addr, port, "lo", 120)
    assert {k: env[k] for k in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                                "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME",
                                "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_GLOO_IFACE",
                                "HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS")} == {
        "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2", "HOROVOD_HOSTNAME": "ls2",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_GLOO_IFACE": "lo", "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"}


def test_interface_towards_loopback():
    assert cluster_env.interface_towards("127.0.0.1") == "lo"


def test_wait_for_times_out():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ClusterEnvError, match="did not answer"):
        cluster_env.wait_for("127.0.0.1", port, 0.5)


def test_rendezvous_falls_back_to_slurm_node_addr(monkeypatch):
    layout = slurm_layout(step_env(1, 1, 0))  # nodes ls1, ls2: not host names
    monkeypatch.setattr(cluster_env, "slurm_node_addr", lambda node: "127.0.0.1" if node == "ls1" else None)
    assert rendezvous_endpoint(layout, {})[0] == "127.0.0.1"
    monkeypatch.setattr(cluster_env, "slurm_node_addr", lambda node: None)
    with pytest.raises(ClusterEnvError, match="NodeAddr: none"):
        rendezvous_endpoint(layout, {})
