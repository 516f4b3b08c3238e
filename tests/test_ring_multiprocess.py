"""Real Horovod workers (Gloo on loopback) started by the strategy itself, as a user's script would."""
import json
import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader

import lightning_straggler  # noqa: F401  registers the strategies
from lightning_straggler import RingStrategy
from lightning_straggler.data import ArrayDataModule
from lightning_straggler.models import Classifier
from lightning_straggler.summary import SUMMARY_KEYS
from tests.helpers import EnvironmentProbe, ListeningSockets, RankSpread, flat_params

pytestmark = pytest.mark.multiprocess


def make_model(seed=0):
    pl.seed_everything(seed, verbose=False)
    return Classifier("mlp", 40, 10, hidden=[32], optimizer="sgd", lr=0.1, momentum=0.9)


def train_set():
    data = ArrayDataModule("synthetic", num_samples=2000, seed=1)
    return data._dataset("x", "y")


def fit(model, strategy, devices, batch_size, steps, callbacks=(), sampler=None, **trainer_kwargs):
    loader = DataLoader(train_set(), batch_size=batch_size, sampler=sampler, shuffle=False)
    options = dict(limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False)
    options.update(trainer_kwargs)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps,
                         callbacks=list(callbacks), **options)
    trainer.fit(model, train_dataloaders=loader)
    return trainer


def test_registered_by_string():
    assert "ring" in StrategyRegistry.available_strategies()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ring", logger=False)
    assert isinstance(trainer.strategy, RingStrategy)
    assert trainer.strategy.is_distributed and trainer.strategy.num_processes == 2


def test_workers_see_the_launching_process_environment_as_it_is_at_each_fit(monkeypatch):
    """Workers fork from a server started at the first fit; the second fit's workers must still see the
    environment of the second fit (a variable set, another removed), as spawned workers would."""
    from lightning_straggler.launcher import WORKER_START_METHOD

    assert WORKER_START_METHOD == "forkserver"  # Linux: the fast start is the one tested
    monkeypatch.setenv("LS_TEST_FIRST", "1")
    first = fit(make_model(), "ring", 2, 8, 1, callbacks=[EnvironmentProbe("LS_TEST_FIRST", "LS_TEST_SECOND")])
    monkeypatch.delenv("LS_TEST_FIRST")
    monkeypatch.setenv("LS_TEST_SECOND", "2")
    second = fit(make_model(), "ring", 2, 8, 1, callbacks=[EnvironmentProbe("LS_TEST_FIRST", "LS_TEST_SECOND")])
    assert first.callback_metrics["env_LS_TEST_FIRST"].item() == 1
    assert first.callback_metrics["env_LS_TEST_SECOND"].item() == -1
    assert second.callback_metrics["env_LS_TEST_FIRST"].item() == -1
    assert second.callback_metrics["env_LS_TEST_SECOND"].item() == 2


def test_ring_equals_single_process_training_on_the_global_batch():
    """4 ranks x batch 8 for k steps == 1 process x batch 32 (the concatenated batches), same init."""
    steps, per_rank = 6, 8
    # Lightning shuffles training data through DistributedSampler(seed=PL_GLOBAL_SEED, shuffle=True):
    # rank r takes perm[r::4], so one step's four batches together are perm[32k:32k+32].
    perm = torch.randperm(len(train_set()), generator=torch.Generator().manual_seed(0)).tolist()
    reference = make_model()
    fit(reference, "auto", 1, 4 * per_rank, steps, sampler=perm)

    distributed = make_model()
    trainer = fit(distributed, "ring", 4, per_rank, steps, callbacks=[RankSpread()])
    # the average of the four ranks' mean-loss gradients is the gradient of the global batch's mean loss
    diff = (flat_params(distributed) - flat_params(reference)).abs().max().item()
    assert diff < 1e-5, f"ring differs from single-process training by {diff}"
    moved = (flat_params(distributed) - flat_params(make_model())).abs().max().item()
    assert moved > 1e-3  # training actually changed the parameters
    assert trainer.callback_metrics["gathered_ranks"].item() == 4
    assert trainer.callback_metrics["rank_param_spread"].item() < 1e-6  # every rank holds the same model


def test_strategy_instance_and_collectives_listen_on_loopback_only():
    trainer = fit(make_model(), RingStrategy(), 2, 16, 4, callbacks=[ListeningSockets()])
    assert trainer.callback_metrics["listeners_total"].item() > 0  # the check saw the sockets
    assert trainer.callback_metrics["listeners_not_loopback"].item() == 0


def test_demo_run_writes_a_complete_summary(tmp_path, cli):
    out = tmp_path / "run"
    res = cli("trainer=quick", "trainer.devices=4", "straggler=transient",
              "straggler.events=[{rank:3,factor:3.0,start_step:5,end_step:20}]",
              f"output_dir={out}", "target_acc=0.2")
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for key in SUMMARY_KEYS:
        assert key in summary, key
    assert summary["algorithm"] == "ring" and summary["world_size"] == 4
    assert summary["events"] == []
    assert set(summary["per_rank"]) == {"0", "1", "2", "3"}
    steps = {r["steps"] for r in summary["per_rank"].values()}
    assert steps == {30}
    assert summary["train_samples"] == 4 * 30 * 32
    assert summary["throughput_samples_per_s"] == pytest.approx(summary["train_samples"] / summary["wall_s"])
    assert 0.0 <= summary["val_acc"] <= 1.0
    assert summary["time_to_target_s"] is not None  # 0.2 is reached after 15 steps on MNIST-1D
    # the straggler shows up as compute on rank 3 and as waiting on the others
    pr = summary["per_rank"]
    assert pr["3"]["compute_s"]["p95"] > 2 * pr["0"]["compute_s"]["p50"]
    assert pr["0"]["wait_s"]["total"] > pr["3"]["wait_s"]["total"]
    emulated = summary["emulated"]
    assert emulated["device_ms_per_sample"] == 1.0
    assert emulated["per_rank_seconds"]["3"]["slowdown_s"] > 0
    assert emulated["per_rank_seconds"]["0"]["slowdown_s"] == 0
    assert os.path.exists(summary["timeline_png"])
    assert "Per-rank profile" in res.stdout and "summary:" in res.stdout


def test_multirun_grid(tmp_path, cli):
    res = cli("-m", "trainer=quick", "trainer.max_steps=8", "trainer.val_check_interval=4", "algorithm=ring",
              "straggler=none,static", "straggler.factors=[1.0,2.0]", f"hydra.sweep.dir={tmp_path}",
              "profiler.plot=false", "data=synthetic")
    assert res.returncode == 0, res.stderr[-3000:]
    summaries = sorted(tmp_path.glob("*/summary.json"))
    assert len(summaries) == 2
    scenarios = sorted(json.loads(p.read_text())["config"]["straggler"]["scenario"] for p in summaries)
    assert scenarios == ["none", "static"]


def test_checkpoint_written_once_by_rank_0_and_loadable(tmp_path):
    model = make_model()
    trainer = fit(model, "ring", 2, 16, 6, enable_checkpointing=True, default_root_dir=str(tmp_path))
    files = list(tmp_path.rglob("*.ckpt"))
    assert len(files) == 1, files
    state = torch.load(files[0], weights_only=False)["state_dict"]
    restored = make_model(seed=123)
    restored.load_state_dict(state)
    assert torch.equal(flat_params(restored), flat_params(model))  # the trained weights handed back
    assert trainer.checkpoint_callback.best_model_path == str(files[0])


def test_a_model_with_more_tensors_than_the_fork_server_passes_starts_with_spawn_and_trains_right(caplog):
    """Every CPU tensor reaches a worker as a file descriptor and the fork server passes at most ~250: a
    model with 300 parameter tensors starts with spawn (logged) and still equals single-process training."""
    import logging

    def deep(seed=0):
        pl.seed_everything(seed, verbose=False)
        model = Classifier("mlp", 40, 10, hidden=[8] * 149, optimizer="sgd", lr=0.1)  # 150 layers: 300 tensors
        assert sum(1 for _ in model.parameters()) >= 300
        return model

    perm = torch.randperm(len(train_set()), generator=torch.Generator().manual_seed(0)).tolist()
    reference = deep()
    fit(reference, "auto", 1, 2 * 8, 2, sampler=perm)
    distributed = deep()
    with caplog.at_level(logging.WARNING, logger="lightning_straggler.launcher"):
        fit(distributed, "ring", 2, 8, 2)
    assert any("starting the workers with spawn" in r.getMessage() for r in caplog.records)
    diff = (flat_params(distributed) - flat_params(reference)).abs().max().item()
    assert diff < 1e-5, f"ring (spawned) differs from single-process training by {diff}"
