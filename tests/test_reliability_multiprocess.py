"""A dead, failing or stalled worker ends the job within seconds with a message naming it; with
restart_on_failure the job goes on from the last checkpoint on the surviving workers (real Horovod)."""
import json
import re
import time

import pytest
import torch

from lightning_straggler.launcher import CONSEQUENCE, WorkerFailure, classify
from lightning_straggler.train import train
from tests.reliability_helpers import FreezeRank, KillRank, RaiseAfterPeersFail, RaiseOnRank, SleepOnRank, StallRank

pytestmark = pytest.mark.multiprocess


def small_job(out, **trainer):
    options = {"devices": 4, "max_epochs": 1, "max_steps": 20, "val_check_interval": 1.0,
               "enable_progress_bar": False, "checkpoint_every_n_steps": 5, **trainer}
    return {"algorithm": {"name": "ring"}, "straggler": {"scenario": "none"}, "trainer": options,
            "data": {"name": "synthetic", "num_samples": 2000, "batch_size": 16},
            "model": {"hidden": [32]}, "profiler": {"plot": False}, "output_dir": str(out)}


def test_killed_worker_ends_the_job_naming_the_rank_and_the_signal(tmp_path):
    with pytest.raises(WorkerFailure) as info:
        train(small_job(tmp_path), callbacks=[KillRank(rank=2, step=12, world=4)])
    failure = info.value
    assert failure.kind == "died" and failure.rank == 2 and failure.dead_ranks == [2]
    assert "rank 2" in str(failure) and "SIGKILL" in str(failure)
    # the last checkpoint is whole and is the one from step 10
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 10 and "state_dict" in ckpt
    assert not list((tmp_path / "checkpoints").glob("*.tmp-*"))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("algorithm", ["ring", "dssync", "dpar", "awar", "boa", "adaptive"])
def test_restart_on_failure_goes_on_from_the_last_checkpoint_without_the_dead_worker(tmp_path, algorithm):
    # 640 training samples: an epoch is 10 batches on 4 workers, 14 on 3. The step-10 checkpoint is the
    # first epoch's last batch; the restart must start the second epoch whole and reach max_steps in it
    # (it used to count the old epoch's 10 batches as done and stop at step 14, "max_epochs=2 reached").
    job = small_job(tmp_path, restart_on_failure=1, max_epochs=2)
    job["algorithm"] = {"name": algorithm}
    job["data"]["num_samples"] = 800
    summary = train(job, callbacks=[KillRank(rank=2, step=12, world=4)])
    assert summary["world_size"] == 3 and summary["algorithm"] == algorithm
    [restart] = summary["restarts"]
    assert restart["dead_rank"] == 2 and restart["dead_ranks"] == [2] and "SIGKILL" in restart["reason"]
    assert restart["new_world_size"] == 3 and restart["from_checkpoint"].endswith("last.ckpt")
    assert json.loads((tmp_path / "summary.json").read_text())["restarts"] == summary["restarts"]
    assert set(summary["per_rank"]) == {"0", "1", "2"}
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 20  # finished: 10 steps on 4 workers (checkpointed), then 10 on 3
    assert ckpt["epoch"] == 1 and ckpt["lightning_straggler"]["world_size"] == 3


@pytest.mark.timeout(400)
def test_frozen_worker_is_named_ended_and_the_job_goes_on_without_it(tmp_path):
    """Rank 2 SIGSTOPs itself after step 12: alive, never in the next collective. The watchdog names it
    (rank, the collective the others wait in, how long), SIGKILLs it, and the job restarts from the step-10
    checkpoint with the three healthy workers (not, as before, counting the healthy ranks as dead)."""
    started = time.monotonic()
    summary = train(small_job(tmp_path, restart_on_failure=1, stall_timeout_s=6),
                    callbacks=[FreezeRank(rank=2, step=12, world=4)])
    [restart] = summary["restarts"]
    assert restart["dead_ranks"] == [2] and restart["dead_original_ranks"] == [2], restart
    reason = restart["reason"]
    assert reason.startswith("froze: stopped (SIGSTOP"), reason
    assert re.search(r"while ranks 0, 1, 3 wait in '[a-z_.]+all' for \d+ s; ended with SIGKILL", reason), reason
    assert restart["new_world_size"] == 3 and summary["world_size"] == 3
    assert restart["from_checkpoint"].endswith("last.ckpt")
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 20
    print(f"frozen worker test: {time.monotonic() - started:.1f} s")


def test_exception_in_user_code_names_the_rank_and_the_exception(tmp_path):
    started = time.monotonic()
    with pytest.raises(WorkerFailure) as info:
        train(small_job(tmp_path), callbacks=[RaiseOnRank(rank=1, step=4, world=4)])
    failure = info.value
    assert failure.kind == "raised" and failure.rank == 1
    assert "ValueError: boom on purpose at step 4" in str(failure)
    print(f"ended {time.monotonic() - started:.1f} s after the start")


def test_a_rank_still_running_when_the_job_is_stopped_is_reported_not_dropped(tmp_path):
    """rank 1 raises; rank 3 sleeps in its own code past the launcher's grace period: the launcher stops
    it, and its report says so (not blamed, not among the dead) instead of being left out."""
    with pytest.raises(WorkerFailure) as info:
        train(small_job(tmp_path), callbacks=[RaiseOnRank(rank=1, step=4, world=4), SleepOnRank(rank=3, step=4, world=4)])
    failure = info.value
    assert failure.kind == "raised" and failure.rank == 1 and failure.dead_ranks == [1], str(failure)
    assert sorted(r.rank for r in failure.reports) == [0, 1, 2, 3]
    [sleeper] = [r for r in failure.reports if r.rank == 3]
    assert sleeper.stopped and classify(sleeper)[1] == "stopped"
    assert re.search(r"rank 3 was still running \d+\.\d s after the first failure; stopped by the launcher", str(failure))


@pytest.mark.timeout(300)
def test_own_error_is_blamed_even_when_the_peers_consequences_arrive_first(tmp_path):
    """The race seen on a fresh clone, provoked: rank 2 shuts Horovod down, waits until its peers have
    failed from that and exited (at most 3 s), and only then raises: the first failure the launcher sees
    (and the first noted) is a peer's consequence."""
    with pytest.raises(WorkerFailure) as info:
        train(small_job(tmp_path), callbacks=[RaiseAfterPeersFail(rank=2, step=4, world=4)])
    failure = info.value
    order = [(r.rank, r.exitcode, classify(r)[0], r.noted, r.seen, r.stopped) for r in failure.reports]
    assert sorted(r.rank for r in failure.reports) == [0, 1, 2, 3], order  # nobody's report dropped
    mine = next(r for r in failure.reports if r.rank == 2)
    peers = [r for r in failure.reports if r.rank != 2]
    assert not mine.stopped and all(classify(r)[0] == CONSEQUENCE for r in peers), order  # consequences only
    assert min(r.seen for r in peers) < mine.seen and min(r.noted for r in peers) < mine.noted, order  # one first
    assert failure.kind == "raised" and failure.rank == 2 and failure.dead_ranks == [2], str(failure)
    assert str(failure).startswith("worker rank 2 (of 4) raised ValueError: own error on purpose at step 4")


def test_stalled_collective_ends_the_job_naming_the_ranks_and_the_tensors(tmp_path):
    with pytest.raises(WorkerFailure) as info:
        train(small_job(tmp_path, stall_timeout_s=4), callbacks=[StallRank(rank=1, step=3, world=4)])
    failure = info.value
    message = str(failure)
    assert failure.kind == "stall", message
    assert "rank 1 waits in 'stall_probe.all'" in message
    for rank in (0, 2, 3):
        assert f"rank {rank} waits in 'grads.all'" in message
    assert "trainer.stall_timeout_s=4" in message


def test_every_socket_of_a_local_job_is_on_loopback(tmp_path):
    """Gloo's listeners are gone once its pairs are connected, so check the connections themselves too."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_straggler import RingStrategy
    from lightning_straggler.data import ArrayDataModule
    from lightning_straggler.models import Classifier
    from tests.reliability_helpers import SocketAddresses

    data = ArrayDataModule("synthetic", num_samples=400, seed=1)._dataset("x", "y")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=RingStrategy(), max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, callbacks=[SocketAddresses()])
    trainer.fit(Classifier("mlp", 40, 10, hidden=[8]), train_dataloaders=DataLoader(data, batch_size=8))
    assert trainer.callback_metrics["sockets_total"].item() >= 2 * 2  # each worker's Gloo pair + rendezvous
    assert trainer.callback_metrics["sockets_not_loopback"].item() == 0


def test_job_time_limit_ends_a_slow_job(tmp_path):
    job = small_job(tmp_path, job_timeout_s=10)
    job["straggler"] = {"scenario": "static", "factors": [1.0, 50.0], "device_ms_per_sample": 5.0}  # ~4 s a step
    started = time.monotonic()
    with pytest.raises(WorkerFailure) as info:
        train(job)
    assert info.value.kind == "timeout" and "trainer.job_timeout_s=10" in str(info.value)
    assert time.monotonic() - started < 10 + 30  # the limit, then at most SIGTERM grace and SIGKILL


def test_a_killed_launching_process_leaves_no_worker_behind(tmp_path):
    """SIGKILL of the process that called fit: its workers (forked from Python's fork server, so not its
    own children) and the fork server are gone within seconds."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    job = small_job(tmp_path, max_steps=100000, max_epochs=1000, checkpoint_every_n_steps=0)
    code = f"from lightning_straggler.train import train\ntrain({job!r})\n"
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    descendants = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and launcher.poll() is None:
            descendants = psutil.Process(launcher.pid).children(recursive=True)
            workers = [p for p in descendants if p.ppid() != launcher.pid]  # forked by the server
            if len(workers) >= 4:
                break
            time.sleep(0.5)
        assert len(workers) >= 4, f"4 workers did not start ({len(descendants)} processes under the launcher)"
        time.sleep(2.0)  # training
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        gone, alive = psutil.wait_procs(descendants, timeout=20)
        assert not alive, f"left behind: {[(p.pid, p.status()) for p in alive]}"
    finally:
        for p in [launcher] + descendants:
            try:
                p.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
