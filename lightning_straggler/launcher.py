"""Local launch: start N Horovod workers from a plain ``python`` process, the way ``ddp_spawn`` does.

The rendezvous server (Horovod's Gloo key-value store) is started here on 127.0.0.1 and Gloo is told to
use the loopback interface, so a local launch listens on loopback only (``horovod.run`` would open its
driver and rendezvous services on every interface). Workers are spawned with Lightning's
multiprocessing launcher, which also hands rank 0's weights, state and metrics back to this process;
we add the Horovod environment per rank and the run report.
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
from typing import Any, Callable, Dict, Optional

import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def attached_to_horovod() -> bool:
    """True inside processes started by horovodrun (or any launcher that sets Horovod's rank variables)."""
    return "HOROVOD_RANK" in os.environ and "HOROVOD_SIZE" in os.environ


class _Rendezvous:
    """Horovod's HTTP rendezvous server bound to loopback, for one local job of ``size`` workers."""

    def __init__(self, size: int) -> None:
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

        self.server = RendezvousHTTPServer((LOOPBACK, 0), RendezvousHandler, 0)
        self.port = self.server.server_address[1]
        self.server.init(get_host_assignments(parse_hosts(f"localhost:{size}"), size))
        self._thread = threading.Thread(target=self.server.serve_forever, name="horovod-rendezvous", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


def horovod_worker_env(rank: int, size: int, port: int, stall_timeout_s: float) -> Dict[str, str]:
    """Environment for local rank ``rank`` of a one-host Gloo job."""
    env = {
        "HOROVOD_HOSTNAME": "localhost",
        "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": str(rank), "HOROVOD_LOCAL_SIZE": str(size),
        "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1",
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": LOOPBACK, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_GLOO_IFACE": "lo",
        # A stalled collective is reported after 60 s and ends the job after stall_timeout_s.
        "HOROVOD_STALL_CHECK_TIME_SECONDS": str(int(min(60, stall_timeout_s))),
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(int(stall_timeout_s)),
    }
    return env


class HorovodLauncher(_MultiProcessingLauncher):
    """Spawns ``strategy.num_processes`` Horovod workers on this host and joins them."""

    def __init__(self, strategy, stall_timeout_s: float = 300.0) -> None:
        super().__init__(strategy, start_method="spawn")
        self._stall_timeout_s = stall_timeout_s
        self._port: Optional[int] = None

    def launch(self, function: Callable, *args: Any, trainer=None, **kwargs: Any) -> Any:
        size = self._strategy.num_processes
        rendezvous = _Rendezvous(size)
        self._port = rendezvous.port
        log.info("starting %d Horovod workers (Gloo on loopback, rendezvous %s:%d)", size, LOOPBACK, self._port)
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            rendezvous.stop()

    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        os.environ.update(horovod_worker_env(process_idx, self._strategy.num_processes, self._port, self._stall_timeout_s))
        try:
            super()._wrapping_function(process_idx, *args, **kwargs)
        finally:
            self._strategy.comm.shutdown()

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
