"""DS-Sync with real Horovod workers at 4 ranks."""
import json

import pytest

from lightning_straggler import DSSyncStrategy
from lightning_straggler.callbacks import StragglerInjector
from lightning_straggler.policies.dssync import DSSyncSchedule
from lightning_straggler.policies.injection import RandomSchedule
from tests.helpers import NoWorldProcessGroup, RankSpread, Snapshots
from tests.test_ring_multiprocess import fit, make_model

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("exchange", ["sets", "aligned", "alltoall", "direct"])
def test_groups_average_inside_and_leave_other_groups_alone_then_global_average_makes_consensus(exchange):
    world = 4
    schedule = DSSyncSchedule(world, 2, "butterfly")
    strategy = DSSyncStrategy(group_size=2, schedule="butterfly", sync="params", global_every_steps=3,
                              global_at_epoch_end=False, exchange=exchange)
    trainer = fit(make_model(), strategy, world, 8, 5, callbacks=[Snapshots([0, 1, 2]), RankSpread()])
    m = trainer.callback_metrics
    for step in (0, 1):
        params = m[f"params_after_step{step}"]
        groups = schedule.partition(step)
        for group in groups:
            for r in group:  # members of a group hold the group's average
                assert (params[r] - params[group[0]]).abs().max() < 1e-6
        # different groups trained on different data: their models differ
        assert (params[groups[0][0]] - params[groups[1][0]]).abs().max() > 1e-4
    # step index 2 is the third step: global_every_steps=3 averaged over everyone
    after_global = m["params_after_step2"]
    assert (after_global - after_global[0]).abs().max() < 1e-6
    # end of training: the handed-back model is the consensus of all ranks
    assert m["rank_param_spread"].item() < 1e-6
    events = strategy.run_report["events"]
    assert events[0]["kind"] == "schedule" and events[0]["schedule"]["kind"] == "butterfly"
    reasons = [e["reason"] for e in events if e["kind"] == "global_average"]
    assert reasons == ["every 3 steps", "end of training"]


# One group of everyone equals ring: in one process, tests/test_inprocess_strategies.py.


def test_direct_exchange_trains_the_models_process_sets_do():
    """exchange="direct" (torch.distributed Gloo groups) averages what the process sets average: the same
    parameters on every rank after every step (pairs: a sum of two and a halving, exact either way)."""
    steps = range(5)
    params = {}
    for exchange in ("sets", "direct"):
        strategy = DSSyncStrategy(group_size=2, schedule="random", seed=1, sync="grads", global_every_steps=0,
                                  global_at_epoch_end=False, exchange=exchange)
        trainer = fit(make_model(), strategy, 4, 8, len(steps), callbacks=[Snapshots(steps), NoWorldProcessGroup()])
        params[exchange] = [trainer.callback_metrics[f"params_after_step{k}"] for k in steps]
    for k, (a, b) in enumerate(zip(params["sets"], params["direct"])):
        assert (a - b).abs().max().item() < 1e-6, f"step {k}"
        assert (a[0] - a[1:]).abs().max().item() > 1e-4  # not trivially equal: the ranks' models differ


def test_direct_exchange_finishes_random_straggler_schedules_at_8_ranks():
    for seed in (2, 3):
        injector = StragglerInjector(RandomSchedule(seed, 0.5, 2.0, 20.0, 1, 6, 3))
        strategy = DSSyncStrategy(group_size=2, schedule="random", seed=seed, global_every_steps=4,
                                  exchange="direct")
        trainer = fit(make_model(seed), strategy, 8, 8, 10, callbacks=[injector, RankSpread(), NoWorldProcessGroup()])
        assert trainer.state.finished
        assert trainer.callback_metrics["rank_param_spread"].item() < 1e-6


def test_random_straggler_schedules_always_finish():
    # one schedule over real Horovod workers (process sets); more in one process: tests/test_inprocess_strategies.py
    for seed in range(1):
        injector = StragglerInjector(RandomSchedule(seed, 0.5, 2.0, 20.0, 1, 6, 3))
        strategy = DSSyncStrategy(group_size=2, schedule="random", seed=seed, global_every_steps=4)
        trainer = fit(make_model(seed), strategy, 4, 8, 12, callbacks=[injector, RankSpread()])
        assert trainer.state.finished
        assert trainer.callback_metrics["rank_param_spread"].item() < 1e-6


def test_run_records_schedule_and_global_averages(tmp_path, compose):
    """``train(cfg)`` from code, as the command line calls it (the command line itself: the dpar, demo and
    multirun tests)."""
    from lightning_straggler.train import train

    out = tmp_path / "run"
    train(compose("algorithm=dssync", "trainer=quick", "trainer.devices=4", "straggler=none", "data=synthetic",
              "trainer.max_steps=20", "trainer.val_check_interval=10", "profiler.plot=false", f"output_dir={out}"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "dssync"
    kinds = [e["kind"] for e in summary["events"]]
    assert kinds[0] == "schedule" and summary["events"][0]["schedule"]["num_groups"] == 4
    assert kinds.count("global_average") >= 2  # before each validation, and at the end
    assert summary["train_samples"] == 4 * 20 * 32


def test_a_run_from_the_config_with_direct_groups_and_rank_state_files(tmp_path, compose):
    """The whole job path (validation, torchmetrics, ModelCheckpoint, summary) with exchange=direct and
    trainer.rank_states=files: last.ckpt names the four rank files beside it, which carry its token.
    (Resuming from such files: tests/test_resume_multiprocess.py.)"""
    import torch

    from lightning_straggler.train import train

    out = tmp_path / "run"
    train(compose("algorithm=dssync", "algorithm.exchange=direct", "trainer=quick", "trainer.devices=4",
                  "trainer.rank_states=files", "straggler=none", "data=synthetic", "trainer.max_steps=20",
                  "trainer.val_check_interval=10", "profiler.plot=false", f"output_dir={out}"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "dssync" and summary["val_acc"] is not None
    assert summary["config"]["algorithm"]["exchange"] == "direct" and summary["train_samples"] == 4 * 20 * 32
    ckpts = out / "checkpoints"
    part = torch.load(ckpts / "last.ckpt", weights_only=True)["lightning_straggler"]
    assert part["rank_files"] == [f"last.ckpt.rank{r}" for r in range(4)] and "ranks" not in part
    for r in range(4):
        content = torch.load(ckpts / f"last.ckpt.rank{r}", weights_only=False)
        assert content["save_token"] == part["save_token"] and content["state"]["steps_done"] == 20
