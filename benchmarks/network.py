"""Hosts on one machine: network namespaces on a virtual bridge, their links shaped with ``tc``.

    .venv/bin/python -m benchmarks.network check   [--hosts 2] [--rate-mbit 100] [--delay-ms 0]
    .venv/bin/python -m benchmarks.network cleanup  # remove namespaces a crashed run left behind
    .venv/bin/python -m benchmarks.network slurm [--hosts 2] [--rate-mbit R] [--timeout-s 1800] -- COMMAND  # a Slurm node per host

Layout (everything inside namespaces this module creates; the machine's own namespace is not touched):

    namespace PREFIX-sw:  bridge br0 (no address)
    namespace PREFIX-hI:  eth0 = 10.77.0.(I+1)/24, veth to port pI on br0; lo up; its own /etc/hosts
                          (/etc/netns/PREFIX-hI/hosts: this machine's name -> 10.77.0.(I+1), hJ -> host J)

Shaping, per host: a token bucket (``tc qdisc ... tbf rate R``) on the host's eth0 (its uplink:
everything it sends) and on its bridge port (its downlink: everything it receives, so two senders cannot
push it past R). A byte from host A to host B crosses A's uplink and B's downlink, both at R: the path's
rate is R. Latency D (``netem delay``, on the uplink) needs the kernel's sch_netem, which this project's
CI machines lack: there D must be 0 (a clear error otherwise); loopback-like veth latency is ~0.02 ms. Workers on the same host talk over the namespace's local route (not shaped),
as ranks on one machine do. Needs root (``ip netns``).

:class:`NamespacedHosts` is a context manager: the namespaces exist inside the ``with`` block and are
removed on the way out, also on an exception, and its processes (``popen``) are killed first. Namespace
names carry the creating process's pid (``lsnet<pid>-...``); ``cleanup`` removes those whose process is
gone. :func:`launch_workers` runs one Horovod worker per slot over the hosts: rank r on host
r // per_host, task 0's host runs Horovod's rendezvous server, and every worker gets the variables
horovodrun would set (:func:`lightning_straggler.cluster_env.attach_env`), so the strategy attaches.
:func:`launch_torchrun` runs ``algorithm=ddp`` the same way under real ``torchrun`` (one agent per host).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBNET = "10.77.0"
PREFIX = "lsnet"
MAX_HOSTS = 16
RENDEZVOUS_PORT = 29450
IP_TIMEOUT_S = 20
NETNS_ETC = "/etc/netns"  # per-namespace files ip-netns(8) mounts over /etc


class NetworkError(RuntimeError):
    """The namespaces could not be made, or a worker on them failed."""


@dataclass(frozen=True)
class LinkShape:
    """Every host's link: ``rate_mbit`` (None: not shaped) and one-way latency ``delay_ms``."""

    rate_mbit: Optional[float] = None
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not (0.1 <= self.rate_mbit <= 100000):
            raise ValueError(f"rate_mbit={self.rate_mbit}: must be between 0.1 and 100000 (Mbit/s), or None")
        if not (0 <= self.delay_ms <= 1000):
            raise ValueError(f"delay_ms={self.delay_ms}: must be between 0 and 1000")

    def tbf(self) -> List[str]:
        """``tc`` arguments of the rate limiter (a token bucket), [] when not shaped."""
        if self.rate_mbit is None:
            return []
        bytes_per_s = self.rate_mbit * 1e6 / 8
        # burst: at least what the rate sends in one 4 ms kernel tick (else tbf cannot reach the rate);
        # latency: the queue a collective's megabytes wait in (deep, so TCP sees delay rather than drops)
        burst = max(32 * 1024, int(bytes_per_s * 0.004))
        return ["tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", str(burst), "latency", "500ms"]

    def describe(self) -> str:
        rate = f"{self.rate_mbit:g} Mbit/s" if self.rate_mbit is not None else "unshaped"
        return f"{rate}, {self.delay_ms:g} ms"


def _ip(*args: str, ns: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise NetworkError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def available() -> Optional[str]:
    """None when namespaces can be made here, else why not (for a test's skip reason)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (`ip`, `tc`)"
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    return None


def namespaces() -> List[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=IP_TIMEOUT_S).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def own_namespaces() -> List[str]:
    """This process's namespaces (``lsnet<pid>-*``): what it may check without seeing another process's."""
    return [ns for ns in namespaces() if _owner_pid(ns) == os.getpid()]


def cleanup(only_dead: bool = True) -> List[str]:
    """Remove this module's namespaces (``lsnet<pid>-*``) whose creating process is gone (all of them
    with ``only_dead=False``); returns the names removed."""
    removed = []
    for ns in namespaces():
        pid = _owner_pid(ns)
        if pid is None or (only_dead and pid != os.getpid() and _alive(pid)):
            continue
        _kill_namespace_processes(ns)
        _ip("ip", "netns", "del", ns, check=False)
        removed.append(ns)
    for folder in (os.listdir(NETNS_ETC) if os.path.isdir(NETNS_ETC) else []):
        pid = _owner_pid(folder)
        if pid is not None and (not only_dead or not _alive(pid)) and folder not in namespaces():
            shutil.rmtree(os.path.join(NETNS_ETC, folder), ignore_errors=True)
    return removed


def _owner_pid(name: str) -> Optional[int]:
    """The creating process of one of this module's namespaces (``lsnet<pid>-...``), else None."""
    m = re.fullmatch(rf"{PREFIX}(\d+)-\w+", name)
    return int(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _kill_namespace_processes(ns: str) -> None:
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    for pid in done.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


class NamespacedHosts:
    """``hosts`` network namespaces on one bridge, links shaped as ``shape`` (see the module docstring)."""

    def __init__(self, hosts: int, shape: LinkShape = LinkShape()) -> None:
        if not (1 <= hosts <= MAX_HOSTS):
            raise ValueError(f"hosts={hosts}: must be between 1 and {MAX_HOSTS}")
        self.hosts = hosts
        self.shape = shape
        self.prefix = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.prefix}-sw"
        self.names = [f"{self.prefix}-h{i}" for i in range(hosts)]
        self._procs: List[subprocess.Popen] = []
        self._up = False
        self._previous_sigterm = None

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def __enter__(self) -> "NamespacedHosts":
        reason = available()
        if reason:
            raise NetworkError(f"network namespaces unavailable: {reason}")
        self._previous_sigterm = None
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            # a plain `kill` would end the process without unwinding the `with`: make it unwind (teardown)
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self._create()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)

    def _create(self) -> None:
        self._up = True
        _ip("ip", "netns", "add", self.switch)
        _ip("ip", "link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("ip", "link", "set", "br0", "up", ns=self.switch)
        for i, ns in enumerate(self.names):
            _ip("ip", "netns", "add", ns)
            self._write_hosts_file(i)
            _ip("ip", "link", "set", "lo", "up", ns=ns)
            # both ends made inside the host, the port end then moved to the switch: nothing touches the
            # machine's own namespace
            _ip("ip", "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", ns=ns)
            _ip("ip", "link", "set", f"p{i}", "netns", self.switch, ns=ns)
            _ip("ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0", ns=ns)
            _ip("ip", "link", "set", "eth0", "up", ns=ns)
            _ip("ip", "link", "set", f"p{i}", "master", "br0", ns=self.switch)
            _ip("ip", "link", "set", f"p{i}", "up", ns=self.switch)
            self._shape(ns, "eth0", delay=True)
            self._shape(self.switch, f"p{i}", delay=False)

    def _write_hosts_file(self, host: int) -> None:
        """``ip netns exec`` mounts /etc/netns/NAME/hosts over /etc/hosts: inside each host the machine's
        name resolves to that host's address, as on a real host. Needed, not cosmetic: Horovod 0.28.1
        builds the Gloo device of every process set (the world's included) without HOROVOD_GLOO_IFACE,
        from the address the host name resolves to (here a loopback one, unreachable from the others)."""
        name = socket.gethostname()
        lines = ["127.0.0.1 localhost", f"{self.address(host)} {name} {name.split('.')[0]}"]
        lines += [f"{self.address(j)} h{j}" for j in range(self.hosts)]
        folder = os.path.join(NETNS_ETC, self.names[host])
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "hosts"), "w") as f:
            f.write("\n".join(lines) + "\n")

    def _shape(self, ns: str, dev: str, delay: bool) -> None:
        rate = self.shape.tbf()
        if delay and self.shape.delay_ms > 0:
            # latency needs netem (sch_netem), which some kernels lack (this project's CI machine's does)
            done = _ip("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                       f"{self.shape.delay_ms:g}ms", "limit", "100000", ns=ns, check=False)
            if done.returncode != 0:
                raise NetworkError(f"delay_ms={self.shape.delay_ms:g}: this kernel cannot add latency (tc netem: "
                                   f"{done.stderr.strip()}); use delay_ms=0 (rate shaping uses tbf)")
            if rate:
                _ip("tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *rate, ns=ns)
        elif rate:
            _ip("tc", "qdisc", "add", "dev", dev, "root", *rate, ns=ns)

    def reshape(self, shape: LinkShape) -> None:
        """Every link shaped as ``shape`` from now on (the queues of the old shape are dropped)."""
        for i, ns in enumerate(self.names):
            for where, dev in ((ns, "eth0"), (self.switch, f"p{i}")):
                _ip("tc", "qdisc", "del", "dev", dev, "root", ns=where, check=False)  # none when unshaped
        self.shape = shape
        for i, ns in enumerate(self.names):
            self._shape(ns, "eth0", delay=True)
            self._shape(self.switch, f"p{i}", delay=False)

    def popen(self, host: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside host ``host``'s namespace (killed on close)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[host], *argv], start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: int, argv: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.names[host], *argv], capture_output=True, text=True,
                              timeout=timeout_s)

    def bytes_sent(self, host: int) -> int:
        """Bytes host ``host`` has sent onto the bridge so far (its port's receive counter)."""
        done = _ip("ip", "-j", "-s", "link", "show", f"p{host}", ns=self.switch)
        return int(json.loads(done.stdout)[0]["stats64"]["rx"]["bytes"])

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=30)
        self._procs.clear()
        if not self._up:
            return
        for ns in self.names + [self.switch]:
            if ns in namespaces():
                _kill_namespace_processes(ns)
                _ip("ip", "netns", "del", ns, check=False)
            shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
        self._up = False
        left = [ns for ns in namespaces() if ns.startswith(self.prefix + "-")]
        if left:
            raise NetworkError(f"namespaces left behind: {left}")


def worker_layouts(workers: int, hosts: int):
    """One TaskLayout per rank: rank r on host r // per_host (block placement, as SLURM's default)."""
    from lightning_straggler.cluster_env import TaskLayout

    if workers % hosts:
        raise ValueError(f"workers={workers} must be a multiple of hosts={hosts}")
    per_host = workers // hosts
    nodes = tuple(f"h{i}" for i in range(hosts))
    return [TaskLayout(rank=r, size=workers, local_rank=r % per_host, local_size=per_host, cross_rank=r // per_host,
                       cross_size=hosts, node_rank=r // per_host, nodes=nodes, tasks_per_node=(per_host,) * hosts,
                       job_id="0") for r in range(workers)]


def launch_workers(net: NamespacedHosts, workers: int, argv: Sequence[str], run_dir: str, timeout_s: float,
                   stall_timeout_s: float = 120.0, extra_env: Optional[Dict[str, str]] = None) -> List[str]:
    """Run ``argv`` (``{rank}`` in an argument: the worker's rank) as ``workers`` Horovod workers over
    ``net``'s hosts and wait (at most ``timeout_s``); returns each rank's stdout. Raises NetworkError
    naming the first rank that failed, with its log."""
    from lightning_straggler.cluster_env import attach_env

    os.makedirs(run_dir, exist_ok=True)
    layouts = worker_layouts(workers, net.hosts)
    addr = net.address(0)
    ready = os.path.join(run_dir, "rendezvous.ready")
    if os.path.exists(ready):  # an earlier run's
        os.remove(ready)
    with open(os.path.join(run_dir, "rendezvous.err"), "w") as server_err:
        server = net.popen(0, [sys.executable, "-m", "benchmarks.network", "_rendezvous", "--size", str(workers),
                               "--hosts", ",".join(f"{n}:{k}" for n, k in zip(layouts[0].nodes,
                                                                               layouts[0].tasks_per_node)),
                               "--addr", addr, "--port", str(RENDEZVOUS_PORT), "--ready-file", ready],
                           cwd=ROOT, stdout=subprocess.DEVNULL, stderr=server_err)
    deadline = time.monotonic() + 60
    while not os.path.exists(ready):
        if server.poll() is not None or time.monotonic() > deadline:
            raise NetworkError(f"the rendezvous server on {addr} did not start: "
                               f"{open(os.path.join(run_dir, 'rendezvous.err')).read()[-2000:]}")
        time.sleep(0.1)
    starts = [(layout.node_rank, f"rank{layout.rank}", [a.replace("{rank}", str(layout.rank)) for a in argv],
               {**os.environ, **attach_env(layout, addr, RENDEZVOUS_PORT, "eth0", stall_timeout_s),
                "LS_CLUSTER_ATTACH": "0", **(extra_env or {})}) for layout in layouts]
    return _run_all(net, starts, run_dir, timeout_s, lambda i: f"rank {i} failed")


def _run_all(net: NamespacedHosts, starts: Sequence[tuple], run_dir: str, timeout_s: float,
             failure: Callable[[int], str]) -> List[str]:
    """Start every ``(host, log name, command, env)`` on its host (output in ``run_dir/NAME.out/.err``),
    wait until all have exited (at most ``timeout_s``) and return their outputs; raise NetworkError with
    ``failure(i)`` and the i-th process's error log for the first one that failed."""
    procs, logs, handles = [], [], []
    for host, name, command, env in starts:
        out = open(os.path.join(run_dir, f"{name}.out"), "w")
        err = open(os.path.join(run_dir, f"{name}.err"), "w")
        logs.append((out.name, err.name))
        handles += [out, err]
        procs.append(net.popen(host, command, cwd=ROOT, env=env, stdout=out, stderr=err))
    try:
        failed = _wait_all(procs, timeout_s, run_dir)
    finally:
        for handle in handles:
            handle.close()
    if failed is not None:
        raise NetworkError(f"{failure(failed)} (exit {procs[failed].poll()}): {open(logs[failed][1]).read()[-3000:]}")
    return [open(out).read() for out, _ in logs]


TORCHRUN_PORT = 29460


def launch_torchrun(net: NamespacedHosts, workers: int, argv: Sequence[str], run_dir: str, timeout_s: float,
                    extra_env: Optional[Dict[str, str]] = None) -> List[str]:
    """Run ``argv`` (a ``python -m MODULE ARGS`` Hydra command; ``{rank}`` in an argument becomes Hydra's
    ``${oc.env:RANK}``, the worker's rank) as ``workers`` torch.distributed workers over
    ``net``'s hosts with real ``torchrun``: one agent per host (``--nnodes hosts --nproc-per-node
    workers/hosts --node-rank i``, static rendezvous at host 0's address), Gloo on each namespace's eth0;
    ranks are block-placed as in :func:`launch_workers`. Waits at most ``timeout_s``; returns each host's
    agent output. Raises NetworkError naming the first host that failed, with its log."""
    if workers % net.hosts:
        raise NetworkError(f"{workers} workers do not split evenly over {net.hosts} hosts (torchrun needs that)")
    if argv[1:2] != ["-m"]:
        raise NetworkError(f"launch_torchrun needs a 'python -m MODULE ...' command (got {list(argv[:3])})")
    os.makedirs(run_dir, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "HOROVOD_RANK"}
    env.update({"GLOO_SOCKET_IFNAME": "eth0", "LS_CLUSTER_ATTACH": "0", **(extra_env or {})})
    worker = [a.replace("{rank}", "${oc.env:RANK}") for a in argv[2:]]  # (Hydra resolves it per worker)

    def agent(host: int) -> List[str]:
        return [argv[0], "-m", "torch.distributed.run", f"--nnodes={net.hosts}",
                f"--nproc-per-node={workers // net.hosts}", f"--node-rank={host}", f"--master-addr={net.address(0)}",
                f"--master-port={TORCHRUN_PORT}", "-m", *worker]

    starts = [(host, f"host{host}", agent(host), env) for host in range(net.hosts)]
    return _run_all(net, starts, run_dir, timeout_s, lambda i: f"host {i}'s torchrun failed")


def _wait_all(procs: List[subprocess.Popen], timeout_s: float, run_dir: str) -> Optional[int]:
    """Until every worker has exited, or one failed (its rank returned), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            raise NetworkError(f"workers did not finish within {timeout_s:g} s (logs in {run_dir})")
        failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
        if failed is not None:
            return failed
        time.sleep(0.2)
    return next((r for r, p in enumerate(procs) if p.poll() != 0), None)


def _serve_rendezvous(args) -> None:
    import logging

    from lightning_straggler.launcher import _Rendezvous

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)  # the key-value store's puts: rendezvous.err
    hosts = [(h.split(":")[0], int(h.split(":")[1])) for h in args.hosts.split(",")]
    server = _Rendezvous(args.size, host=args.addr, port=args.port, hosts=hosts)
    with open(args.ready_file, "w") as f:
        f.write(str(server.port))
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


def _allreduce_probe(args) -> None:
    """One worker of the all-reduce probe: for each of ``phases`` link shapes, ``repeats`` timed all-reduces
    of ``floats`` float32 values (after two untimed ones). Between phases rank 0 waits for the launching
    process to re-shape the links (file ``go-P`` in ``phase_dir``) and the others wait for rank 0; rank 0
    writes ``done-P`` after each phase and prints ``RESULT {json}`` with every repeat's seconds by phase."""
    import horovod.torch as hvd
    import torch

    torch.set_num_threads(1)
    hvd.init()
    tensor = torch.ones(args.floats)
    by_phase = []
    for phase in range(args.phases):
        if phase > 0:
            if hvd.rank() == 0:
                _wait_for_file(os.path.join(args.phase_dir, f"go-{phase}"), 60.0)
            hvd.allreduce(torch.zeros(1), name=f"phase.{phase}")  # the others wait here for rank 0
        for i in range(2):
            hvd.allreduce(tensor, op=hvd.Sum, name=f"warmup.{phase}.{i}")
        seconds = []
        for i in range(args.repeats):
            hvd.allreduce(torch.zeros(1), name=f"align.{phase}.{i}")  # start every repeat together
            t0 = time.perf_counter()
            out = hvd.allreduce(tensor, op=hvd.Sum, name=f"probe.{phase}.{i}")
            seconds.append(time.perf_counter() - t0)
        assert float(out[0]) == hvd.size(), "the all-reduce's sum is wrong"
        by_phase.append(seconds)
        if hvd.rank() == 0 and args.phase_dir:
            open(os.path.join(args.phase_dir, f"done-{phase}"), "w").close()
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({"size": hvd.size(), "floats": args.floats, "seconds": by_phase}), flush=True)
    hvd.shutdown()


def _wait_for_file(path: str, timeout_s: float, stop: Optional[threading.Event] = None) -> bool:
    """Poll for ``path``; False when ``stop`` was set first. Raises NetworkError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if stop is not None and stop.is_set():
            return False
        if time.monotonic() > deadline:
            raise NetworkError(f"{path} did not appear within {timeout_s:g} s")
        time.sleep(0.02)
    return True


def allreduce_seconds(hosts: int, workers: int, shapes: Sequence[LinkShape], floats: int, repeats: int,
                      run_dir: str, timeout_s: float = 240.0) -> List[List[float]]:
    """Rank 0's seconds per all-reduce of ``floats`` float32 values, ``workers`` ranks over ``hosts``, for
    each link shape in ``shapes`` (one list per shape). One job measures them all: the links are re-shaped
    between phases while the workers wait, so every shape is timed by the same processes under the same load
    (and the job's start, seconds of imports, is paid once)."""
    phase_dir = os.path.join(run_dir, "phases")
    shutil.rmtree(phase_dir, ignore_errors=True)
    os.makedirs(phase_dir)
    stop = threading.Event()
    errors: List[BaseException] = []

    def reshape_between_phases(net: NamespacedHosts) -> None:
        try:
            for phase in range(1, len(shapes)):
                if not _wait_for_file(os.path.join(phase_dir, f"done-{phase - 1}"), timeout_s, stop):
                    return
                net.reshape(shapes[phase])
                open(os.path.join(phase_dir, f"go-{phase}"), "w").close()
        except BaseException as e:  # the workers then time out waiting for go-P and say so
            errors.append(e)

    with NamespacedHosts(hosts, shapes[0]) as net:
        controller = threading.Thread(target=reshape_between_phases, args=(net,), daemon=True)
        controller.start()
        try:
            outs = launch_workers(net, workers, [sys.executable, "-m", "benchmarks.network", "_allreduce", "--floats",
                                                 str(floats), "--repeats", str(repeats), "--phases", str(len(shapes)),
                                                 "--phase-dir", phase_dir], run_dir, timeout_s,
                                  extra_env={"OMP_NUM_THREADS": "1"})
        finally:
            stop.set()
            controller.join(timeout=30)
    if errors:
        raise NetworkError(f"re-shaping the links between phases failed: {errors[0]}")
    line = [l for l in outs[0].splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])["seconds"]


def ring_allreduce_predicted_s(workers: int, hosts: int, floats: int, rate_mbit: float) -> float:
    """Seconds a ring all-reduce of ``floats`` float32 values spends on the links, ranks placed in blocks:
    every rank sends 2(k-1)/k of the data to the next rank; between hosts only the last rank of a block
    sends to the next host, so each host's uplink (and the next one's downlink) carries 2(k-1)/k x S."""
    k = workers
    if hosts < 2:
        return 0.0
    return 2 * (k - 1) / k * floats * 4 * 8 / (rate_mbit * 1e6)


def halving_doubling_allreduce_predicted_s(workers: int, hosts: int, floats: int, rate_mbit: float) -> float:
    """Seconds a recursive halving-doubling all-reduce (this project's Horovod build on CPU,
    ``scripts/patches/horovod-0.28.1-halving-doubling.patch``) of ``floats`` float32 values spends on the
    links, ranks placed in blocks of ``workers / hosts``, both powers of two: the steps within a host come
    first (peers at distance 1, 2, ...), so each rank enters the steps across hosts with hosts / workers of
    the data and sends (h-1)/k of it across in the reduce-scatter, as much in the all-gather: each host's
    uplink carries 2(h-1)/h x S (a ring: 2(k-1)/k x S, :func:`ring_allreduce_predicted_s`)."""
    k, h = workers, hosts
    if h < 2:
        return 0.0
    per_host = k // h
    if k % h or per_host & (per_host - 1) or h & (h - 1):
        raise ValueError(f"workers / hosts and hosts must be powers of two (got {k} workers on {h} hosts)")
    return 2 * (h - 1) / h * floats * 4 * 8 / (rate_mbit * 1e6)


SLURM_SCRIPT = os.path.join(ROOT, "scripts", "local_slurm.sh")


@contextlib.contextmanager
def slurm_on_hosts(net: NamespacedHosts, state_dir: str, port: int = 16817, wait_s: float = 90):
    """``scripts/local_slurm.sh``'s cluster with Slurm node ``lsI`` on host I-1 (``LS_SLURM_NETNS``): slurmctld and
    ls1's slurmd inside host 0, each other slurmd inside its own host. Yields the environment for clients, which
    must run inside host 0 (``net.popen(0, ...)``). Stops the cluster on the way out, also on an exception; the
    namespaces stay ``net``'s."""
    env = {**os.environ, "LS_SLURM_DIR": state_dir, "LS_SLURM_NODES": str(net.hosts), "LS_SLURM_PORT": str(port),
           "LS_SLURM_WAIT_S": str(int(wait_s)), "LS_SLURM_NETNS": " ".join(net.names),
           "LS_SLURM_NODE_ADDRS": " ".join(net.address(h) for h in range(net.hosts))}
    ok = False
    try:
        start = subprocess.run(["bash", SLURM_SCRIPT, "start"], env=env, capture_output=True, text=True, timeout=1200)
        if start.returncode != 0:
            raise NetworkError(f"the local cluster did not start on the hosts: {start.stderr.strip()[-2000:]}")
        yield {**os.environ, "SLURM_CONF": os.path.join(state_dir, "slurm.conf"),
               "PATH": os.path.join(state_dir, "bin") + os.pathsep + os.environ.get("PATH", "")}
        ok = True
    finally:
        stop = subprocess.run(["bash", SLURM_SCRIPT, "stop"], env=env, capture_output=True, text=True, timeout=120)
        if stop.returncode != 0 and ok:
            raise NetworkError(f"the local cluster did not stop: {stop.stderr.strip()[-2000:]}")


def _slurm(args) -> int:
    """Run a command inside host 0 with a Slurm cluster whose nodes are the hosts."""
    if not args.cmd:
        print("slurm: give the command to run after --, e.g. -- sinfo -N", file=sys.stderr)
        return 2
    import tempfile

    shape = LinkShape(args.rate_mbit, args.delay_ms)
    with NamespacedHosts(args.hosts, shape) as net, tempfile.TemporaryDirectory(prefix="ls-slurm-netns-") as state:
        with slurm_on_hosts(net, state, port=args.port) as env:
            print(f"[network] Slurm nodes ls1..ls{net.hosts} on hosts {', '.join(net.names)} ({shape.describe()}); "
                  f"running inside {net.names[0]}: {' '.join(args.cmd)}", file=sys.stderr, flush=True)
            proc = net.popen(0, args.cmd, env=env)
            try:
                rc = proc.wait(timeout=args.timeout_s)
            except subprocess.TimeoutExpired:
                # ended now, before the cluster stops under it (its session: srun and what it started)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                print(f"[network] the command ran past --timeout-s {args.timeout_s:g}; killed", file=sys.stderr)
                rc = 124
    print("[network] cluster stopped, hosts torn down", file=sys.stderr)
    return rc


def _check(args) -> int:
    """Time a bulk TCP transfer from the first host to the last."""
    shape = LinkShape(args.rate_mbit, args.delay_ms)
    with NamespacedHosts(args.hosts, shape) as net:
        print(f"{net.hosts} hosts ({shape.describe()}): {', '.join(net.names)}")
        probe = ("import socket,sys,time\n"
                 "s=socket.socket(); s.settimeout(30)\n"
                 "s.connect((sys.argv[1],29460)); b=bytes(1<<20); t=time.monotonic()\n"
                 "for _ in range(int(sys.argv[2])): s.sendall(b)\n"
                 "s.shutdown(socket.SHUT_WR); s.recv(1); print(time.monotonic()-t)\n")
        sink = ("import socket\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
                f"s.bind(('{net.address(net.hosts - 1)}',29460)); s.listen(1); s.settimeout(30); c,_=s.accept()\n"
                "while c.recv(1<<20): pass\nc.sendall(b'k')\n")
        net.popen(net.hosts - 1, [sys.executable, "-c", sink])
        time.sleep(0.5)
        mb = args.megabytes
        sent = net.run(0, [sys.executable, "-c", probe, net.address(net.hosts - 1), str(mb)], timeout_s=60)
        if sent.returncode != 0:
            print(f"transfer failed: {sent.stderr[-1000:]}")
            return 1
        seconds = float(sent.stdout.strip())
        print(f"{mb} MiB in {seconds:.3f} s: {mb * 8 * 1.048576 / seconds:.1f} Mbit/s")
    print("torn down")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.network", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="make the hosts, time a transfer between two, tear down")
    check.add_argument("--hosts", type=int, default=2)
    check.add_argument("--rate-mbit", type=float, default=100.0)
    check.add_argument("--delay-ms", type=float, default=0.0)
    check.add_argument("--megabytes", type=int, default=8)
    slurm = sub.add_parser("slurm", help="make the hosts, run a Slurm cluster with one node per host "
                           "(scripts/local_slurm.sh), run a command inside host 0, stop, tear down")
    slurm.add_argument("--hosts", type=int, default=2, help="hosts = Slurm nodes (1-16)")
    slurm.add_argument("--rate-mbit", type=float, default=None, help="shape every host's link (default: unshaped)")
    slurm.add_argument("--delay-ms", type=float, default=0.0)
    slurm.add_argument("--port", type=int, default=16817, help="slurmctld's port; slurmd's follow it")
    slurm.add_argument("--timeout-s", type=float, default=1800, help="the command is ended after this long")
    slurm.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command (e.g. python -m lightning_straggler.train -m ...)")
    clean = sub.add_parser("cleanup", help="remove namespaces left by runs whose process is gone")
    clean.add_argument("--all", action="store_true", help="also those of running processes")
    probe = sub.add_parser("_allreduce")  # internal: one worker of allreduce_seconds
    probe.add_argument("--floats", type=int, required=True)
    probe.add_argument("--repeats", type=int, required=True)
    probe.add_argument("--phases", type=int, default=1)
    probe.add_argument("--phase-dir", default="")
    rdv = sub.add_parser("_rendezvous")  # internal: task 0's server inside host 0's namespace
    rdv.add_argument("--size", type=int, required=True)
    rdv.add_argument("--hosts", required=True)
    rdv.add_argument("--addr", required=True)
    rdv.add_argument("--port", type=int, required=True)
    rdv.add_argument("--ready-file", required=True)
    args = parser.parse_args(argv)
    if args.command == "_allreduce":
        _allreduce_probe(args)
        return 0
    if args.command == "_rendezvous":
        _serve_rendezvous(args)
        return 0
    if args.command == "slurm":
        args.cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return _slurm(args)
    if args.command == "cleanup":
        print(json.dumps({"removed": cleanup(only_dead=not args.all)}))
        return 0
    return _check(args)


if __name__ == "__main__":
    sys.exit(main())
