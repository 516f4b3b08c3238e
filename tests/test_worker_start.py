"""How workers start: the fork server the command line starts early (lightning_straggler.worker_start) and the
rendezvous server every local and cluster launch starts (lightning_straggler.launcher)."""
import socket
import subprocess
import sys

import pytest

from lightning_straggler.launcher import RENDEZVOUS_BACKLOG, rendezvous_server


def _connect_all(address, n, timeout_s):
    """Open ``n`` connections to ``address`` (nobody accepts them); how many completed their handshake."""
    socks, done = [], 0
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(timeout_s)
            socks.append(s)
            try:
                s.connect(address)
                done += 1
            except (socket.timeout, OSError):
                pass
    finally:
        for s in socks:
            s.close()
    return done


def test_the_server_queues_a_whole_world_of_workers_connecting_at_once():
    """Workers connect to the rendezvous together; the server takes them one by one. A listen backlog of 5
    (Python's HTTP server default) dropped the 7th and later connections, which TCP retried after 1 s, 2 s,
    ...: ~5.5 s in hvd.init at 8 workers. Here nothing accepts, so every connection must wait in the queue."""
    world = 64
    assert RENDEZVOUS_BACKLOG >= world
    server = rendezvous_server("127.0.0.1", 0)  # bound and listening, not serving
    try:
        assert _connect_all(server.server_address, world, timeout_s=5.0) == world
    finally:
        server.server_close()


def test_the_default_backlog_is_what_made_workers_wait():
    """The reference: the same server class with Python's default backlog loses connections past it (so the
    test above can fail)."""
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    server = RendezvousHTTPServer(("127.0.0.1", 0), RendezvousHandler, 0)
    try:
        assert RendezvousHTTPServer.request_queue_size == 5
        assert _connect_all(server.server_address, 8, timeout_s=0.3) < 8  # 8 workers: what took 5.5 s
    finally:
        server.server_close()


def test_the_command_line_starts_the_fork_server_before_it_imports_torch():
    """In a fresh interpreter, as ``python -m lightning_straggler.train`` runs it: the server is running (and
    preloading torch in its own process) while this process has not imported torch yet."""
    code = ("import sys, multiprocessing.forkserver as fs\n"
            "from lightning_straggler.worker_start import start_fork_server_early\n"
            "started = start_fork_server_early(['algorithm=dpar', 'trainer.devices=4'])\n"
            "pid = fs._forkserver._forkserver_pid\n"
            "print(started, 'torch' in sys.modules, pid is not None, flush=True)\n"
            "import os, signal; os.kill(pid, signal.SIGKILL)\n")  # no need to wait for its imports
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False", "True"]


@pytest.mark.parametrize("argv", [["--help"], ["--cfg", "job"], ["--cfg=job"], ["-c", "job"], ["--info"],
                                  ["algorithm=ring", "trainer.devices=1"],
                                  ["-m", "hydra/launcher=submitit_slurm", "seed=0,1"]])
def test_no_fork_server_for_a_command_that_starts_no_worker(argv):
    from lightning_straggler.worker_start import start_fork_server_early

    assert start_fork_server_early(argv) is False


def test_no_fork_server_under_an_external_horovod_launcher(monkeypatch):
    from lightning_straggler.worker_start import start_fork_server_early

    monkeypatch.setenv("HOROVOD_RANK", "0")
    assert start_fork_server_early(["trainer.devices=4"]) is False


def test_a_refused_command_line_ends_the_early_fork_server():
    """A refused configuration ends the server at once (else it finishes importing, seconds, holding the
    command's stdout and stderr, and ``... | tee`` or a captured run waits for it)."""
    code = ("import os, multiprocessing.forkserver as fs\n"
            "from lightning_straggler.worker_start import end_early_fork_server, start_fork_server_early\n"
            "assert start_fork_server_early(['trainer.devices=4'])\n"
            "pid = fs._forkserver._forkserver_pid\n"
            "end_early_fork_server()\n"
            "try:\n    os.kill(pid, 0)\n    print('running')\n"
            "except ProcessLookupError:\n    print('gone')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["gone"]


def test_no_fork_server_as_a_task_of_a_multi_task_srun_step(monkeypatch):
    from lightning_straggler.worker_start import start_fork_server_early

    for name, value in (("SLURM_STEP_ID", "0"), ("SLURM_PROCID", "1"), ("SLURM_STEP_NUM_TASKS", "4")):
        monkeypatch.setenv(name, value)
    assert start_fork_server_early(["trainer.devices=4"]) is False
