"""Local launch: start N Horovod workers from a plain ``python`` process, the way ``ddp_spawn`` does.

The rendezvous server (Horovod's Gloo key-value store) is started here on 127.0.0.1 and Gloo is told to
use the loopback interface, so a local launch listens on loopback only (``horovod.run`` would open its
driver and rendezvous services on every interface). Workers are started with Lightning's
multiprocessing launcher (forked from Python's fork server, which has imported torch, Lightning and
Horovod once: see ``WORKER_START_METHOD``), which also hands rank 0's weights, state and metrics back to
this process; we add the Horovod environment per rank and the run report.

The launcher also watches the job: a worker that dies (signal, exit code) or raises ends all of them
within seconds (:class:`WorkerFailure` names the rank and why); a collective that some ranks wait in for
``stall_timeout_s`` is reported with every rank's collective and ends the job (the workers note their
collectives on the shared board of ``watchdog.py``); workers die with their
parent, the fork server (the kernel's parent-death signal), which ends with this process, so a killed
launcher leaves no spinning orphans.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing.connection
import os
import pickle
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.multiprocessing as mp
from lightning.fabric.strategies.launchers.multiprocessing import _disable_module_memory_sharing
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _check_missing_main_guard,
    _GlobalStateSnapshot,
    _MultiProcessingLauncher,
)
from lightning.pytorch.trainer.states import TrainerFn

from lightning_straggler import watchdog
from lightning_straggler.errors import WorkerFailure  # noqa: F401  (re-exported: raised here)
from lightning_straggler.worker_start import WORKER_START_METHOD, set_server_preload  # noqa: F401  (re-exported)
from lightning_straggler.watchdog import BUSY_FACTOR, CollectiveBoard, main_thread_cpu, process_stopped

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


# Peers of a dead or failed rank fail too (broken Gloo connection, Horovod shut down by the failing rank,
# its process sets gone, a collective aborted); such errors are consequences, not causes, when the
# launcher works out which rank to blame. Matched (case-insensitively) against the exception's own text,
# not the traceback's frames.
CONSEQUENCES = (
    "horovod has been shut down", "horovodinternalerror", "horovodshutdownerror",
    "process set provided does not exist", "has not been registered",
    "connection closed by peer", "connection reset by peer", "connection refused", "broken pipe",
    "gloo/transport", "gloo error", "aborted",
)
_BUSY_WINDOW_S = 3.0  # a rank whose main thread used CPU this recently is busy, not stuck
_GRACE_S = 5.0  # how long the survivors get to end by themselves before SIGTERM (then as long before SIGKILL)


@dataclass
class Report:
    """How one worker ended: ``exitcode`` (negative: killed by that signal), its traceback (empty when
    it did not raise), when it noted its own exception (``noted``, before it shut Horovod down; 0 when it
    did not) and when the launcher saw it exit (``seen``). ``frozen`` describes a worker the watchdog
    found frozen (and ended); ``stopped`` one still running when the launcher stopped the job after
    another's failure (its exit code is then the launcher's signal, not its own)."""

    rank: int
    exitcode: Optional[int]
    traceback: str = ""
    noted: float = 0.0
    seen: float = 0.0
    frozen: str = ""
    stopped: str = ""

    @property
    def at(self) -> float:
        """When the cause happened, as far as the launcher can tell."""
        return self.noted or self.seen


# Levels of blame, most to least likely to be the cause; STOPPED (still running when the job was
# stopped) is listed, never blamed.
OWN, ABORTED, CONSEQUENCE, STOPPED = 0, 1, 2, 3


def exception_text(traceback_text: str) -> str:
    """The exception's own lines at the end of a formatted traceback (after the last indented frame line)."""
    lines = [line for line in traceback_text.rstrip().splitlines() if line.strip()]
    last_frame = max((i for i, line in enumerate(lines) if line.startswith(" ")), default=-1)
    return "\n".join(lines[last_frame + 1:]) or (lines[-1] if lines else "")


def classify(report: Report) -> Tuple[int, str, str]:
    """``(level, kind, reason)`` of one failed worker. Level OWN: its own failure (an exception of its
    own, a kill by any signal but SIGABRT, an exit code, a freeze); ABORTED: SIGABRT, which is what Gloo's
    background thread ends a process with when a peer's connection breaks or a collective gives up, so
    usually a peer's death; CONSEQUENCE: an exception that follows from a peer's exit or Horovod shutting
    down (see CONSEQUENCES). STOPPED: a worker the launcher stopped while it was still running."""
    if report.stopped:
        return STOPPED, "stopped", report.stopped
    if report.frozen:
        return OWN, "frozen", report.frozen
    code = report.exitcode
    if code is not None and code < 0:
        name = _signal_name(-code)
        reason = f"killed by {name}" + (" (also what the kernel's out-of-memory killer sends)" if name == "SIGKILL" else "")
        return (ABORTED if name == "SIGABRT" else OWN), "died", reason
    if report.traceback:
        text = exception_text(report.traceback)
        level = CONSEQUENCE if any(k in text.lower() for k in CONSEQUENCES) else OWN
        return level, "raised", "raised " + _last_line(report.traceback)
    return OWN, "died", f"exited with code {code}"


def blame(reports: Sequence[Report], size: int) -> "WorkerFailure":
    """The first cause wins: the failure with the lowest level (see :func:`classify`), then the earliest
    ``at``, then the lowest rank, whatever order the reports came in. ``dead_ranks`` (those a restart goes
    on without) are every rank that failed on its own; a single SIGABRT when nobody failed on their own;
    none when only consequences (or several SIGABRTs) were seen."""
    failed = [(classify(r), r) for r in reports if r.exitcode != 0 or r.frozen or r.stopped]
    if all(level == STOPPED for (level, _, _), _ in failed):
        return WorkerFailure(f"the workers (of {size}) ended without a reported failure", "died", None,
                             "no failure reported", [])
    failed.sort(key=lambda item: (item[0][0], item[1].at, item[1].rank))
    (level, kind, reason), first = failed[0]
    same_level = [r.rank for (lv, _, _), r in failed if lv == level]
    if level == OWN:
        dead = same_level
    elif level == ABORTED and len(same_level) == 1:
        dead = same_level
    else:
        dead = []
    rank = first.rank
    msg = f"worker rank {rank} (of {size}) {reason}; the other workers were stopped"
    if level != OWN:
        msg += " (no worker failed on its own; this is the first of the failures that usually follow a peer's)"
    also = [f"rank {r.rank} {why}" for (lv, _, why), r in failed[1:] if lv == level]
    then = [f"rank {r.rank} {why}" for (lv, _, why), r in failed[1:] if lv != level]
    if also:
        msg += "\n-- also: " + "; ".join(also)
    if then:
        msg += "\n-- then, following from it (not blamed): " + "; ".join(then)
    if kind == "raised" and first.traceback:
        msg += f"\n-- rank {rank} traceback:\n{first.traceback}"
    return WorkerFailure(msg, kind, rank, reason, sorted(dead), reports)


def prepare_worker_start(start_method: str) -> Dict[str, str]:
    """Called in the launching process before its workers start; returns the environment they must see.
    A forked worker inherits the fork server's environment (this process's when the server started: the
    first launch, or the start of the command line), so the current one travels with the job (see
    :func:`enter_worker`)."""
    if start_method == "forkserver":
        set_server_preload()  # no effect once the server runs
    return dict(os.environ)


def enter_worker(launch_env: Dict[str, str]) -> None:
    """First thing in every worker: die with the launching process, and see its ``os.environ`` at launch
    (what a spawned worker would see; what the interpreter and native libraries read when the server
    started, e.g. ``OMP_NUM_THREADS``, ``PYTHONHASHSEED``, stays as it was at the first launch)."""
    _release_fork_server()
    _die_with_parent()
    for key in set(os.environ) - set(launch_env):
        del os.environ[key]
    os.environ.update(launch_env)


def start_workers(launcher, process_args: List[Any]):
    """``torch.multiprocessing.start_processes`` for a Lightning multiprocessing launcher. Every CPU tensor in
    the job's arguments reaches a worker as a file descriptor, and Python's fork server passes at most
    about 250 in one message ("too many fds": a model with that many parameters and buffers); such a job
    starts with ``spawn`` instead, which has no such limit (logged)."""
    def start():
        return mp.start_processes(launcher._wrapping_function, args=process_args,
                                  nprocs=launcher._strategy.num_processes, start_method=launcher._start_method,
                                  join=False)

    try:
        return start()
    except ValueError as e:
        if launcher._start_method != "forkserver" or "too many fds" not in str(e):
            raise
    log.warning("the job's arguments hold more tensors than Python's fork server can pass to a worker; "
                "starting the workers with spawn instead (slower start: each imports torch and Lightning)")
    launcher._start_method = "spawn"
    return start()


def _release_fork_server() -> None:
    # Python hands every forked process the write end of the pipe that keeps the fork server running, so
    # the server outlived a killed launching process as long as its workers ran, and they (whose
    # parent-death signal is tied to the server) ran on. Only the launching process keeps it now.
    import multiprocessing.forkserver as forkserver

    fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)  # CPython internal
    if fd is not None:
        os.close(fd)
        forkserver._forkserver._forkserver_alive_fd = None


def private_module_copies(start_method: str, strategy, args: Any, kwargs: Any) -> Tuple[Any, Any]:
    """In a worker: its own copy of every module's tensors in the job's arguments. Tensors reach a worker
    started by 'spawn' or 'forkserver' through shared memory; Lightning unshares modules only for 'spawn',
    so on CPU every forked-from-server rank would update the same parameters."""
    if start_method == "forkserver" and isinstance(strategy.accelerator, CPUAccelerator):
        return _disable_module_memory_sharing((args, kwargs))
    return args, kwargs


def _die_with_parent() -> None:
    # A worker blocked inside Horovod never runs Python's handler for the SIGINT torch asks for when the
    # launching process dies, so orphans spun on; the kernel's SIGKILL always lands.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent is already gone
        os._exit(1)


def attached_to_horovod() -> bool:
    """True inside processes started by horovodrun (or any launcher that sets Horovod's rank variables)."""
    return "HOROVOD_RANK" in os.environ and "HOROVOD_SIZE" in os.environ


RENDEZVOUS_BACKLOG = 1024  # connections the rendezvous server queues (the kernel caps it at net.core.somaxconn)


def rendezvous_server(host: str, port: int):
    """Horovod's rendezvous HTTP server bound to ``host``:``port`` (not yet serving). Python's HTTP server
    listens with a backlog of 5, so the 6th and later workers connecting at once were dropped and retried
    after TCP's 1 s, 2 s, ... back-off: hvd.init took ~5.5 s at 8 workers against 0.25 s at 4 (~0.8 s at 8
    with a deep backlog)."""
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    class Server(RendezvousHTTPServer):
        request_queue_size = RENDEZVOUS_BACKLOG

    return Server((host, port), RendezvousHandler, 0)


class _Rendezvous:
    """Horovod's HTTP rendezvous server for one job of ``size`` workers: bound to loopback on a free port
    for a local job; on ``host``:``port`` with ``hosts`` ([(name, workers)], Horovod's hostnames) when
    task 0 of a cluster job hosts it (:mod:`lightning_straggler.cluster_env`)."""

    def __init__(self, size: int, host: str = LOOPBACK, port: int = 0,
                 hosts: Optional[Sequence[Tuple[str, int]]] = None) -> None:
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

        self.server = rendezvous_server(host, port)
        self.port = self.server.server_address[1]
        plan = ",".join(f"{name}:{n}" for name, n in hosts) if hosts else f"localhost:{size}"
        self.server.init(get_host_assignments(parse_hosts(plan), size))
        self._thread = threading.Thread(target=self.server.serve_forever, name="horovod-rendezvous", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


def backstop_timeout_s(stall_timeout_s: float) -> int:
    """Horovod's and Gloo's own time-outs: past the longest the watchdog lets a busy rank hold the others
    up (``BUSY_FACTOR`` x its limit), plus one limit and 30 s (a rank may freeze up to a step before its peers
    start waiting in a collective)."""
    return int((BUSY_FACTOR + 1) * stall_timeout_s + 30)


def horovod_worker_env(rank: int, size: int, port: int, stall_timeout_s: float,
                       cycle_time_ms: Optional[float] = None) -> Dict[str, str]:
    """Environment for local rank ``rank`` of a one-host Gloo job (``cycle_time_ms``: Horovod's coordination
    cycle, ``HOROVOD_CYCLE_TIME``; ``None`` leaves it as the environment has it)."""
    env = {
        "HOROVOD_HOSTNAME": "localhost",
        "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": str(rank), "HOROVOD_LOCAL_SIZE": str(size),
        "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1",
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": LOOPBACK, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_GLOO_IFACE": "lo",
        # Horovod's own stall inspector warns at the limit (at most 60 s). Its shut-down and Gloo's own
        # time-out (30 s by default; a collective that gives up ends the process with SIGABRT, so a frozen
        # rank used to take its healthy peers down first) come well after the launcher's watchdog, which
        # names and ends the frozen rank itself.
        "HOROVOD_STALL_CHECK_TIME_SECONDS": str(int(min(60, stall_timeout_s))),
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(backstop_timeout_s(stall_timeout_s)),
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(backstop_timeout_s(stall_timeout_s)),
    }
    if cycle_time_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = f"{cycle_time_ms:g}"
    return env


class ResultsThroughFile:
    """For a spawning launcher (mixed in before Lightning's ``_MultiProcessingLauncher``): rank 0's
    results, and the strategy's ``run_report``, reach the launching process through a temporary file."""

    def get_extra_results(self, trainer) -> Dict[str, Any]:
        # Lightning sends these through a pipe that the parent reads only after every worker has
        # exited; a payload over the pipe's buffer (64 KiB) would block rank 0 forever. A file doesn't.
        extra = super().get_extra_results(trainer)
        extra["run_report"] = self._strategy.run_report
        fd, path = tempfile.mkstemp(prefix="lightning-straggler-results-", suffix=".pt")
        with os.fdopen(fd, "wb") as f:
            torch.save(extra, f)
        return {"results_path": path}

    def update_main_process_results(self, trainer, extra: Dict[str, Any]) -> None:
        path = extra["results_path"]
        try:
            extra = torch.load(path, weights_only=False)
        finally:
            os.remove(path)
        super().update_main_process_results(trainer, extra)
        self._strategy.run_report = extra.get("run_report", {})


class HorovodLauncher(ResultsThroughFile, _MultiProcessingLauncher):
    """Starts ``strategy.num_processes`` Horovod workers on this host and watches them: a worker that dies
    or raises, a collective stalled for ``stall_timeout_s`` or a job over ``job_timeout_s`` ends every
    worker within seconds and raises :class:`WorkerFailure` naming the rank and the cause."""

    def __init__(self, strategy, stall_timeout_s: float = 300.0) -> None:
        super().__init__(strategy, start_method=WORKER_START_METHOD)
        self._stall_timeout_s = stall_timeout_s
        self._launch_env: Dict[str, str] = {}
        self._port: Optional[int] = None
        self._board: Optional[CollectiveBoard] = None

    def launch(self, function: Callable, *args: Any, trainer=None, **kwargs: Any) -> Any:
        size = self._strategy.num_processes
        rendezvous = _Rendezvous(size)
        self._port = rendezvous.port
        self._board = CollectiveBoard(size, WORKER_START_METHOD)
        log.info("starting %d Horovod workers (Gloo on loopback, rendezvous %s:%d)", size, LOOPBACK, self._port)
        try:
            return self._launch(function, *args, trainer=trainer, **kwargs)
        finally:
            rendezvous.stop()

    def _launch(self, function: Callable, *args: Any, trainer=None, **kwargs: Any) -> Any:
        # Lightning's launch, with our own join: theirs waits up to 30 s per stuck worker after a failure
        # and cannot see a stall.
        _check_missing_main_guard()
        if self._already_fit and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            raise NotImplementedError("fit() twice on one Trainer with a spawning strategy; make a new Trainer "
                                      "and pass fit(ckpt_path=...)")
        self._launch_env = prepare_worker_start(self._start_method)
        context = mp.get_context(self._start_method)
        return_queue = context.SimpleQueue()
        process_args = [trainer, function, args, kwargs, return_queue, _GlobalStateSnapshot.capture()]
        process_context = start_workers(self, process_args)
        self.procs = process_context.processes
        self._join(process_context)
        worker_output = return_queue.get()
        if trainer is None:
            return worker_output
        self._already_fit |= trainer.state.fn == TrainerFn.FITTING
        self._recover_results_in_main_process(worker_output, trainer)
        return worker_output.trainer_results

    def _join(self, context) -> None:
        procs = context.processes
        pending = {p.sentinel: i for i, p in enumerate(procs)}
        job_timeout = float(getattr(self._strategy, "job_timeout_s", 0.0) or 0.0)
        deadline = getattr(self._strategy, "job_deadline", None) or (time.monotonic() + job_timeout)
        deadline = deadline if job_timeout > 0 else None
        exits: Dict[int, int] = {}
        seen: Dict[int, float] = {}
        stall: Optional[str] = None
        timed_out = False
        frozen: Dict[int, str] = {}
        cpu: Dict[int, Tuple[Optional[int], float]] = {}  # rank -> (main thread's CPU ticks, when they last moved)
        busy_noted = False
        while pending:
            self._collect(procs, pending, exits, seen, 1.0)
            if any(code != 0 for code in exits.values()):
                break
            busy = self._busy(procs, pending, cpu)
            stall = self._board.stalled(self._stall_timeout_s) if self._board is not None else None
            timed_out = deadline is not None and time.monotonic() > deadline
            if timed_out:
                break
            if stall:
                frozen = self._end_frozen(procs, pending, exits, seen, healthy_peers_died=False, busy=busy)
                if frozen or not any(not self._board._since[i] for i in busy):
                    break
                if not busy_noted:  # a rank busy in its own code holds the others up: a straggler, wait
                    log.warning("collective wait past trainer.stall_timeout_s=%g s, but ranks %s are busy in their "
                                "own code (main thread running); waiting up to %d x the limit: %s",
                                self._stall_timeout_s, sorted(busy), BUSY_FACTOR, stall)
                    busy_noted = True
                stall = None
        if not pending and all(code == 0 for code in exits.values()):
            return
        if not (frozen or stall or timed_out):
            # Reports arrive in any order (a peer's consequence often before the cause), so collect them
            # for a grace period; a rank that noted its own exception but has not exited yet gets as long again.
            self._collect_for(procs, pending, exits, seen, _GRACE_S)
            if self._board is not None:
                noted = [s for s, i in pending.items() if self._board.failed_at(i)]
                self._collect_for(procs, pending, exits, seen, _GRACE_S, only=noted)
            if not any(classify(self._report(context, i, code, seen))[0] == OWN
                       for i, code in exits.items() if code != 0):
                # only consequences so far (e.g. healthy ranks whose collective gave up): a frozen peer?
                frozen = self._end_frozen(procs, pending, exits, seen, healthy_peers_died=True)
        natural = dict(exits)  # exits before we stopped anyone (and the frozen ranks we ended)
        running = self._still_running(pending, natural, seen)
        self._stop(procs)
        raise self._diagnose(context, natural, seen, stall, timed_out, job_timeout, frozen, running)

    def _still_running(self, pending, exits: Dict[int, int], seen: Dict[int, float]) -> Dict[int, str]:
        """The ranks about to be stopped while still running, described: their reports are not dropped."""
        now = time.time()
        failures = [seen[i] for i, code in exits.items() if code != 0]
        since = f" {now - min(failures):.1f} s after the first failure" if failures else ""
        running = {}
        for i in sorted(pending.values()):
            noted = self._board.failed_at(i) if self._board is not None else 0.0
            own = f" (it had caught an exception of its own {now - noted:.1f} s before)" if noted else ""
            running[i] = f"was still running{since}{own}; stopped by the launcher"
        return running

    @staticmethod
    def _busy(procs, pending, cpu: Dict[int, Tuple[Optional[int], float]]) -> List[int]:
        """Live ranks whose main thread used CPU in the last ``_BUSY_WINDOW_S`` seconds."""
        now = time.monotonic()
        busy = []
        for i in pending.values():
            ticks = main_thread_cpu(procs[i].pid)
            last, moved = cpu.get(i, (None, now))
            if ticks != last:
                moved = now
            cpu[i] = (ticks, moved)
            if ticks is not None and now - moved < _BUSY_WINDOW_S:
                busy.append(i)
        return busy

    def _end_frozen(self, procs, pending, exits, seen, healthy_peers_died: bool,
                    busy: Sequence[int] = ()) -> Dict[int, str]:
        """SIGKILL the live workers that froze (see :meth:`CollectiveBoard.frozen`); returns their
        descriptions. After the healthy ranks died, only stopped ranks, or ranks that have not been in a
        collective for the stall limit, count as frozen."""
        if self._board is None:
            return {}
        alive = sorted(pending.values())
        stopped = [i for i in alive if process_stopped(procs[i].pid)]
        now = time.time()
        if healthy_peers_died:
            timeout = self._stall_timeout_s
            alive = [i for i in alive if i in stopped or (not self._board._since[i] and self._board._last[i]
                                                          and now - self._board._last[i] > timeout)]
        frozen = self._board.frozen(alive, stopped, self._stall_timeout_s, now, busy=busy)
        for i in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[i].pid, signal.SIGKILL)
        sentinels = {s: i for s, i in pending.items() if i in frozen}
        for s, i in sentinels.items():
            procs[i].join(30.0)
            pending.pop(s)
            exits[i] = procs[i].exitcode
            seen[i] = time.time()
        if frozen:
            log.warning("ended frozen worker(s) %s", "; ".join(f"rank {i} {d}" for i, d in frozen.items()))
        return frozen

    def _report(self, context, i: int, code: Optional[int], seen: Dict[int, float], frozen: str = "") -> Report:
        return Report(i, code, _read_traceback(context.error_files[i]),
                      self._board.failed_at(i) if self._board is not None else 0.0, seen.get(i, 0.0), frozen)

    @staticmethod
    def _collect(procs, pending, exits, seen, timeout: float, only: Optional[Sequence[Any]] = None) -> None:
        """Wait up to ``timeout`` for exits of the pending workers (of those in ``only`` if given)."""
        watch = [s for s in pending if only is None or s in only]
        for sentinel in multiprocessing.connection.wait(watch, timeout=timeout):
            i = pending.pop(sentinel)
            procs[i].join()
            exits[i] = procs[i].exitcode
            seen[i] = time.time()

    @classmethod
    def _collect_for(cls, procs, pending, exits, seen, seconds: float, only: Optional[Sequence[Any]] = None) -> None:
        end = time.monotonic() + seconds
        while any(only is None or s in only for s in pending) and time.monotonic() < end:
            cls._collect(procs, pending, exits, seen, max(0.0, end - time.monotonic()), only)

    @staticmethod
    def _stop(procs) -> None:
        for sig, wait_s in ((signal.SIGTERM, _GRACE_S), (signal.SIGKILL, None)):
            alive = [p for p in procs if p.is_alive()]
            for p in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, sig)
            end = time.monotonic() + (wait_s or 30.0)
            for p in alive:
                p.join(max(0.0, end - time.monotonic()))

    def _diagnose(self, context, exits: Dict[int, int], seen: Dict[int, float], stall: Optional[str],
                  timed_out: bool, job_timeout: float, frozen: Optional[Dict[int, str]] = None,
                  running: Optional[Dict[int, str]] = None) -> WorkerFailure:
        size = len(context.processes)
        frozen = frozen or {}
        if stall and not frozen:
            msg = (f"a collective stalled for more than trainer.stall_timeout_s={self._stall_timeout_s:g} s; "
                   f"all {size} workers were stopped: {stall}")
            return WorkerFailure(msg, "stall", None, "stalled collective", [])
        if timed_out:
            msg = f"the job ran over trainer.job_timeout_s={job_timeout:g} s; all {size} workers were stopped"
            return WorkerFailure(msg, "timeout", None, "job timeout", [])
        reports = [self._report(context, i, code, seen, frozen.get(i, "")) for i, code in exits.items()]
        for i, why in (running or {}).items():
            report = self._report(context, i, context.processes[i].exitcode, seen)
            report.stopped = why
            reports.append(report)
        return blame(reports, size)

    def _wrapping_function(self, process_idx: int, trainer, function: Callable, args: Any, kwargs: Any,
                           *rest: Any) -> None:
        enter_worker(self._launch_env)
        os.environ.update(horovod_worker_env(process_idx, self._strategy.num_processes, self._port, self._stall_timeout_s,
                                            getattr(self._strategy, "horovod_cycle_time_ms", None)))
        watchdog.watch(self._board, process_idx)
        args, kwargs = private_module_copies(self._start_method, self._strategy, args, kwargs)
        try:
            super()._wrapping_function(process_idx, trainer, function, args, kwargs, *rest)
        except BaseException:
            self._board.note_failure(process_idx)
            raise
        finally:
            self._strategy.comm.shutdown()


def _read_traceback(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return ""


def _last_line(traceback_text: str) -> str:
    lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
