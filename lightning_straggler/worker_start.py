"""How worker processes start, importable without torch: the command line starts the fork server before
it imports torch and Lightning itself (:func:`start_fork_server_early`), so the two imports, ~6 s of CPU
each, run side by side instead of one after the other."""
from __future__ import annotations

import multiprocessing
import os
import signal
from typing import Sequence

# Workers start from Python's fork server, which imports these once per launching process and forks a
# worker per rank: a spawned worker imports them afresh, about 10 s of CPU each (8 workers on 2 cores took
# ~45 s to start). Neither CUDA nor Horovod is initialised in the server, so forking from it is safe.
WORKER_START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
SERVER_PRELOAD = ("torch", "lightning.pytorch", "torchmetrics", "horovod.torch")

_started_early = False  # whether start_fork_server_early started the server (end_early_fork_server ends it)

# command-line arguments after which no worker starts (Hydra prints or checks something and exits)
_NO_WORKERS_FLAGS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "--version", "--shell-completion", "-sc")


def set_server_preload() -> None:
    """What the fork server imports when it starts (no effect once it runs)."""
    if WORKER_START_METHOD == "forkserver":
        multiprocessing.set_forkserver_preload(list(SERVER_PRELOAD))


def start_fork_server_early(argv: Sequence[str]) -> bool:
    """At the start of ``python -m lightning_straggler.train ARGS``: start the fork server now unless the
    command cannot start workers here (a help or config-printing flag, ``trainer.devices=1``, a sweep
    through another Hydra launcher, or attached: under ``horovodrun`` or ``torchrun``, or as a task of a
    multi-task ``srun``). Returns whether it started. A wrong configuration is still refused before any worker
    starts: the server only imports modules."""
    from lightning_straggler.cluster_env import srun_launched, torchrun_launched

    if (WORKER_START_METHOD != "forkserver" or "HOROVOD_RANK" in os.environ or srun_launched()
            or torchrun_launched()):
        return False  # (attached: this process is one worker and starts none)
    if any(a in _NO_WORKERS_FLAGS or a.split("=", 1)[0] in _NO_WORKERS_FLAGS for a in argv):
        return False
    if "trainer.devices=1" in argv:
        return False
    if any(a.startswith("hydra/launcher=") and a != "hydra/launcher=basic" for a in argv):
        return False  # a sweep submitted elsewhere (SLURM): the jobs start their own
    from multiprocessing import forkserver

    global _started_early
    set_server_preload()
    forkserver.ensure_running()
    _started_early = True
    return True


def end_early_fork_server() -> None:
    """When the command line exits with an error (a refused configuration above all): stop the server
    started early, which would otherwise finish its imports (seconds) holding this process's stdout and
    stderr, and keep a reader of the output waiting."""
    global _started_early
    if not _started_early:
        return
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)  # CPython internal
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    _started_early = False
