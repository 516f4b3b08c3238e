"""Attaching to the tasks a cluster launcher started: SLURM's ``srun`` (what submitit uses for
``hydra.launcher.nodes`` x ``hydra.launcher.tasks_per_node``).

When this process is one of several tasks of an ``srun`` step, each task is one Horovod worker: its rank,
world size, local rank and node come from SLURM's task variables, the way Lightning's
``SLURMEnvironment`` reads them for DDP, and are handed to Horovod as the variables ``horovodrun`` would
set (``HOROVOD_RANK`` ...). Task 0 hosts Horovod's Gloo rendezvous server (the key-value store the
workers find each other through; the same server a local launch starts, :class:`launcher._Rendezvous`)
on its node's address; the other tasks wait until it answers before they initialise Horovod. From then
on the strategy follows its ordinary attach path (as under ``horovodrun``).

Rule (when it attaches): ``SLURM_STEP_ID`` and ``SLURM_PROCID`` are set (the process is a task of an
``srun`` step, not a batch script nor an ``salloc`` shell) and the step has more than one task
(``SLURM_STEP_NUM_TASKS``, else ``SLURM_NTASKS``). One task (a sweep point with ``tasks_per_node: 1``, an
interactive step, ``srun -n1 python ...``) spawns ``trainer.devices`` local workers as on a laptop.
Lightning also tells interactive sessions apart by the job name (``bash``, ``interactive``); a step
variable says it directly, and ``srun -n4 bash -c "python ..."`` (job name ``bash``) is a real 4-task step.
Processes started by ``horovodrun`` (``HOROVOD_RANK`` set) are left alone, and ``LS_CLUSTER_ATTACH=0``
turns attaching off.

Rendezvous address: ``LS_RENDEZVOUS_ADDR`` (or ``MASTER_ADDR``), else the first node of the step's node
list (where task 0 runs under SLURM's block and cyclic distributions) resolved by name, or through its
Slurm ``NodeAddr`` when the node name is not a host name. Port:
``LS_RENDEZVOUS_PORT`` (or ``MASTER_PORT``), else 15000 + the job id mod 10000 (the same port on every
task without talking first; Lightning derives ``MASTER_PORT`` from the job id the same way). Gloo's
interface: ``HOROVOD_GLOO_IFACE`` if set, else the interface whose address this host uses to reach the
rendezvous address (the kernel's route; no packet is sent).

``torchrun`` (``TORCHELASTIC_RUN_ID`` set) starts ``algorithm=ddp`` workers: Lightning's DDP reads torchrun's
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``GROUP_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` itself (its
``TorchElasticEnvironment``); :func:`torchrun_layout` only checks the launch against the configuration and
gives the Trainer its per-node ``devices`` and ``num_nodes``.
"""
from __future__ import annotations

import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

log = logging.getLogger(__name__)
_BRACKETS = re.compile(r"\[([^\]]*)\]")


class ClusterEnvError(RuntimeError):
    """The cluster's task environment is inconsistent or the rendezvous could not be reached."""


def expand_nodelist(spec: str) -> List[str]:
    """SLURM's compact host list to names, in order: ``node[1-3],other`` -> node1, node2, node3, other;
    zero padding is kept (``n[08-10]``), several bracket groups multiply (``r[1-2]n[1-2]``)."""
    names: List[str] = []
    for part in _split_top_level(spec.strip()):
        names.extend(_expand_one(part))
    return names


def _split_top_level(spec: str) -> List[str]:
    parts, depth, current = [], 0, ""
    for ch in spec:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ClusterEnvError(f"unbalanced ']' in node list {spec!r}")
        if ch == "," and depth == 0:
            if current:
                parts.append(current)
            current = ""
        else:
            current += ch
    if depth != 0:
        raise ClusterEnvError(f"unbalanced '[' in node list {spec!r}")
    if current:
        parts.append(current)
    return parts


def _expand_one(pattern: str) -> List[str]:
    match = _BRACKETS.search(pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    values: List[str] = []
    for item in match.group(1).split(","):
        item = item.strip()
        if not item:
            continue
        lo, sep, hi = item.partition("-")
        if not sep:
            values.append(lo)
            continue
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise ClusterEnvError(f"bad range {item!r} in node list pattern {pattern!r}")
        width = len(lo) if lo.startswith("0") else 0
        values.extend(str(v).zfill(width) for v in range(int(lo), int(hi) + 1))
    return [head + v + rest for v in values for rest in _expand_one(tail)]


def expand_tasks_per_node(spec: str) -> List[int]:
    """``SLURM_TASKS_PER_NODE`` to a count per node: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: List[int] = []
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if m is None:
            raise ClusterEnvError(f"bad tasks-per-node entry {part!r} in {spec!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


@dataclass(frozen=True)
class TaskLayout:
    """Where one task sits: Horovod's rank numbers and the step's nodes."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int  # this node's index among the nodes that have a task with this local rank
    cross_size: int  # how many nodes have a task with this local rank
    node_rank: int
    nodes: Tuple[str, ...]
    tasks_per_node: Tuple[int, ...]
    job_id: str

    @property
    def hostname(self) -> str:
        return self.nodes[self.node_rank]


def _get(env: Mapping[str, str], *names: str) -> Optional[str]:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            return value
    return None


def srun_launched(env: Mapping[str, str] = os.environ) -> bool:
    """True in a task of a multi-task ``srun`` step (see the module's rule); False in a batch script,
    an ``salloc`` shell, a one-task step, under ``horovodrun`` or with ``LS_CLUSTER_ATTACH=0``."""
    if env.get("LS_CLUSTER_ATTACH", "1") == "0" or "HOROVOD_RANK" in env:
        return False
    if _get(env, "SLURM_STEP_ID", "SLURM_STEPID") is None or _get(env, "SLURM_PROCID") is None:
        return False
    tasks = _get(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    try:
        return tasks is not None and int(tasks) > 1
    except ValueError:
        return False


def slurm_layout(env: Mapping[str, str] = os.environ) -> TaskLayout:
    """The task's layout from SLURM's variables (the step's where set, else the job's)."""
    try:
        rank = int(env["SLURM_PROCID"])
        size = int(_get(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") or "")
        local_rank = int(env.get("SLURM_LOCALID", "0"))
    except (KeyError, ValueError) as e:
        raise ClusterEnvError(f"SLURM task variables missing or not integers: {e}") from e
    nodelist = _get(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if nodelist is None:
        raise ClusterEnvError("SLURM_STEP_NODELIST / SLURM_JOB_NODELIST not set")
    nodes = expand_nodelist(nodelist)
    per_node_spec = _get(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    per_node = expand_tasks_per_node(per_node_spec) if per_node_spec else [size // max(1, len(nodes))] * len(nodes)
    if len(per_node) != len(nodes) or sum(per_node) != size:
        raise ClusterEnvError(f"{len(nodes)} nodes ({nodelist}) with tasks per node {per_node_spec} do not add up "
                              f"to {size} tasks")
    here = env.get("SLURMD_NODENAME")
    if here in nodes:
        node_rank = nodes.index(here)
    else:
        try:
            node_rank = int(env["SLURM_NODEID"])
        except (KeyError, ValueError) as e:
            raise ClusterEnvError("neither SLURMD_NODENAME (in the node list) nor SLURM_NODEID is set") from e
    if not 0 <= node_rank < len(nodes):
        raise ClusterEnvError(f"node index {node_rank} outside the node list {nodelist}")
    if not (0 <= rank < size and 0 <= local_rank < per_node[node_rank]):
        raise ClusterEnvError(f"task {rank} (local {local_rank}) does not fit {size} tasks, {per_node[node_rank]} "
                              f"on node {nodes[node_rank]}")
    with_local = [i for i, n in enumerate(per_node) if n > local_rank]
    return TaskLayout(rank=rank, size=size, local_rank=local_rank, local_size=per_node[node_rank],
                      cross_rank=with_local.index(node_rank), cross_size=len(with_local), node_rank=node_rank,
                      nodes=tuple(nodes), tasks_per_node=tuple(per_node), job_id=env.get("SLURM_JOB_ID", "0"))


def rendezvous_endpoint(layout: TaskLayout, env: Mapping[str, str] = os.environ) -> Tuple[str, int]:
    """(address, port) of task 0's rendezvous server (see the module docstring)."""
    given = _get(env, "LS_RENDEZVOUS_ADDR", "MASTER_ADDR")
    host = given or layout.nodes[0]
    try:
        addr = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as e:
        node_addr = None if given else slurm_node_addr(host)
        try:
            addr = socket.getaddrinfo(node_addr, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0] if node_addr else None
        except socket.gaierror:
            addr = None
        if addr is None:
            raise ClusterEnvError(f"cannot resolve the rendezvous host {host!r} (task 0's node; Slurm's NodeAddr: "
                                  f"{node_addr or 'none'}); set LS_RENDEZVOUS_ADDR to its address: {e}") from e
    port_text = _get(env, "LS_RENDEZVOUS_PORT", "MASTER_PORT")
    try:
        port = int(port_text) if port_text else 15000 + int(re.sub(r"\D", "", layout.job_id) or 0) % 10000
    except ValueError as e:
        raise ClusterEnvError(f"LS_RENDEZVOUS_PORT / MASTER_PORT must be an integer (got {port_text!r})") from e
    return addr, port


def slurm_node_addr(node: str) -> Optional[str]:
    """Slurm's ``NodeAddr`` of ``node`` (``scontrol show node``), for node names that are not host names
    (several node names on one host, as in scripts/local_slurm.sh); ``None`` when scontrol cannot say."""
    import subprocess

    try:
        out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True,
                             timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"\bNodeAddr=(\S+)", out)
    return m.group(1) if m else None


def interface_towards(addr: str) -> str:
    """The network interface holding the local address the kernel would use to reach ``addr`` (a UDP
    socket's connect picks the route and sends nothing)."""
    import psutil

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))
        local = s.getsockname()[0]
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addrs):
            return name
    raise ClusterEnvError(f"no interface holds {local} (the route to the rendezvous address {addr}); "
                          f"set HOROVOD_GLOO_IFACE")


def interface_address(iface: str) -> str:
    """The IPv4 address of network interface ``iface`` (e.g. ``lo``: 127.0.0.1)."""
    import psutil

    for a in psutil.net_if_addrs().get(iface, []):
        if a.family == socket.AF_INET:
            return a.address
    raise ClusterEnvError(f"network interface {iface!r} has no IPv4 address (HOROVOD_GLOO_IFACE)")


def gloo_interface(env: Mapping[str, str] = os.environ) -> str:
    """The interface Horovod's Gloo uses: ``HOROVOD_GLOO_IFACE`` (set by horovodrun, this project's
    launcher and the SLURM attach path), else the one towards the rendezvous address, else ``lo``."""
    if env.get("HOROVOD_GLOO_IFACE"):
        return env["HOROVOD_GLOO_IFACE"]
    if env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"):
        return interface_towards(env["HOROVOD_GLOO_RENDEZVOUS_ADDR"])
    return "lo"


def wait_for(addr: str, port: int, timeout_s: float) -> None:
    """Until a TCP connect to (addr, port) succeeds, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=2.0):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise ClusterEnvError(f"task 0's rendezvous server at {addr}:{port} did not answer within "
                                      f"{timeout_s:g} s ({e})") from e
            time.sleep(0.2)


_server = None  # task 0's rendezvous server, kept for the process's lifetime


# --- torchrun (torch.distributed's elastic launcher): algorithm=ddp only -------------------------------


def torchrun_launched(env: Mapping[str, str] = os.environ) -> bool:
    """True in a worker started by ``torchrun`` (``python -m torch.distributed.run``), by torch's own rule
    (``TORCHELASTIC_RUN_ID`` set): Lightning's DDP attaches to it (its ``TorchElasticEnvironment``)."""
    return env.get("TORCHELASTIC_RUN_ID") is not None


@dataclass(frozen=True)
class TorchrunLayout:
    """What ``torchrun`` told this worker, in Lightning's terms: ``devices`` per node, ``num_nodes``."""

    world_size: int
    devices: int
    num_nodes: int


def torchrun_layout(algorithm: str, devices: int, env: Mapping[str, str] = os.environ) -> Optional[TorchrunLayout]:
    """Under ``torchrun``: the layout Lightning's Trainer needs for ``algorithm=ddp`` (``devices`` = the
    workers per node, ``num_nodes``), after checking it against ``trainer.devices`` (the job's workers in
    all); ``None`` when not started by torchrun. Raises ClusterEnvError naming the setting when the
    launch and the configuration disagree: torchrun serves ``ddp`` only (the Horovod strategies attach to
    ``horovodrun`` and ``srun``), and ``trainer.devices`` must equal torchrun's world size."""
    if not torchrun_launched(env):
        return None
    try:
        world = int(env["WORLD_SIZE"])
        local = int(env["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError) as e:
        raise ClusterEnvError(f"torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE missing or not integers: {e}") from e
    if algorithm != "ddp":
        raise ClusterEnvError(f"algorithm={algorithm} under torchrun: torchrun launches serve algorithm=ddp only; the "
                              "Horovod strategies run under horovodrun, srun, or spawn their workers themselves "
                              "(README, Clusters)")
    if devices != world:
        raise ClusterEnvError(f"trainer.devices must equal torchrun's world size {world} (its --nnodes x "
                              f"--nproc-per-node; got {devices})")
    if local < 1 or world % local:
        raise ClusterEnvError(f"torchrun's {world} workers do not split into nodes of {local} (LOCAL_WORLD_SIZE): "
                              "Lightning needs the same --nproc-per-node on every node")
    return TorchrunLayout(world_size=world, devices=local, num_nodes=world // local)


def attach_env(layout: TaskLayout, addr: str, port: int, iface: str, stall_timeout_s: float,
               cycle_time_ms: Optional[float] = None) -> Dict[str, str]:
    """Horovod's variables for one task (what horovodrun would set), on top of a local launch's."""
    from lightning_straggler.launcher import horovod_worker_env

    env = horovod_worker_env(layout.rank, layout.size, port, stall_timeout_s, cycle_time_ms)
    env.update({
        "HOROVOD_HOSTNAME": layout.hostname,
        "HOROVOD_LOCAL_RANK": str(layout.local_rank), "HOROVOD_LOCAL_SIZE": str(layout.local_size),
        "HOROVOD_CROSS_RANK": str(layout.cross_rank), "HOROVOD_CROSS_SIZE": str(layout.cross_size),
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr, "HOROVOD_GLOO_IFACE": iface,
    })
    return env


def attach(stall_timeout_s: float = 300.0, env: Optional[Dict[str, str]] = None,
           cycle_time_ms: Optional[float] = None) -> Optional[TaskLayout]:
    """If this process is a task of a multi-task ``srun`` step, set Horovod's variables in ``env``
    (``os.environ``), start the rendezvous server on task 0 or wait for it on the others, and return the
    layout; else do nothing and return ``None``. Idempotent within a process."""
    global _server
    env = os.environ if env is None else env
    if not srun_launched(env):
        return None
    layout = slurm_layout(env)
    addr, port = rendezvous_endpoint(layout, env)
    iface = env.get("HOROVOD_GLOO_IFACE") or interface_towards(addr)
    if layout.rank == 0 and _server is None:
        from lightning_straggler.launcher import _Rendezvous

        hosts = [(n, k) for n, k in zip(layout.nodes, layout.tasks_per_node)]
        try:
            _server = _Rendezvous(layout.size, host=addr, port=port, hosts=hosts)
        except OSError as e:
            raise ClusterEnvError(f"task 0 cannot open the rendezvous server on {addr}:{port} ({e}); it must run on "
                                  f"the first node of the step (or set LS_RENDEZVOUS_ADDR / LS_RENDEZVOUS_PORT)") from e
    elif layout.rank != 0:
        wait_for(addr, port, float(env.get("LS_RENDEZVOUS_WAIT_S", "300")))
    env.update(attach_env(layout, addr, port, iface, stall_timeout_s, cycle_time_ms))
    log.info("SLURM task %d of %d (local %d of %d) on node %s: Horovod rendezvous %s:%d%s, Gloo on %s",
             layout.rank, layout.size, layout.local_rank, layout.local_size, layout.hostname, addr, port,
             " (hosted here)" if layout.rank == 0 else "", iface)
    return layout
