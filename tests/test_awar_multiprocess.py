"""AWAR with real Horovod workers at 4 ranks."""
import json

import lightning.pytorch as pl
import pytest

from lightning_straggler import AwarStrategy
from lightning_straggler.callbacks import StragglerInjector
from lightning_straggler.policies.injection import RandomSchedule, SlowdownEvent, TransientSchedule
from tests.awar_helpers import BatchNormAdamNet, CheckedMergeAwar
from tests.helpers import ClosedFormAwar, RankSpread
from tests.test_ring_multiprocess import fit, make_model

pytestmark = pytest.mark.multiprocess


# Without stragglers dpar / awar equal ring: at 4 ranks in one process (tests/test_inprocess_strategies.py),
# at 8 real Horovod ranks in tests/test_partial_group_multiprocess.py.


@pytest.mark.exclusive  # bounds a wait in seconds: nothing else runs beside it under pytest -n 2
def test_weighted_average_matches_the_closed_form_and_the_group_waits_at_most_a_straggler_step():
    # rank 3 is 10x slower: 2 ms/sample x 8 samples x 10 = 160 ms of emulated device time per step
    injector = StragglerInjector(TransientSchedule([SlowdownEvent(3, 10.0, 0, None)]), device_ms_per_sample=2.0)
    # slow_ratio 3 (rank 3 is 10x): no other rank classified a straggler for ~10 ms more of real compute
    strategy = ClosedFormAwar(period_steps=6, slow_ratio=3.0)
    trainer = fit(make_model(), strategy, 4, 8, 36, callbacks=[injector, RankSpread()])
    report = strategy.run_report
    averages = [e for e in report["events"] if e["kind"] == "average"]
    assert averages, report["events"]
    assert max(report["average_errors"]) < 1e-6
    for event, weights in zip(averages, report["average_weights"]):
        updates = event["updates"]
        assert weights == pytest.approx([u / sum(updates) for u in updates])  # w_i = u_i / sum u
        assert event["stragglers"] == [3] and updates[3] < updates[0]  # the straggler did fewer local steps
    # a straggler step is 160 ms of device time plus 10 x its real compute (the injector stretches that too,
    # so a pause in it is stretched 10x): bounded by the longest step rank 3 actually took
    straggler_step_s = max(10 * 2.0 * 8 / 1000, report["emulated"]["per_rank_seconds"]["3"]["longest_batch_s"])
    waits = report["group_boundary_waits_s"]
    assert waits and max(waits) < 2 * straggler_step_s + 0.25, (waits, straggler_step_s)  # about one straggler step
    assert trainer.callback_metrics["rank_param_spread"].item() < 1e-6


def test_random_straggler_schedules_always_finish():
    # one schedule over real Horovod workers; many more in one process: tests/test_inprocess_strategies.py
    for seed in range(1):
        injector = StragglerInjector(RandomSchedule(seed, 0.4, 2.0, 12.0, 1, 10, 4), device_ms_per_sample=0.5)
        strategy = AwarStrategy(period_steps=3)
        trainer = fit(make_model(seed), strategy, 4, 8, 24, callbacks=[injector, RankSpread()],
                      limit_val_batches=2, val_check_interval=7)
        assert trainer.state.finished
        assert trainer.callback_metrics["rank_param_spread"].item() < 1e-6


def test_awar_run_summary_has_classifications_and_averages(tmp_path, compose):
    """``train(cfg)`` from code, as the command line calls it (the command line itself: the dpar, demo and
    multirun tests)."""
    from lightning_straggler.train import train

    out = tmp_path / "run"
    train(compose("algorithm=awar", "algorithm.period_steps=5", "trainer=quick", "trainer.devices=4", "straggler=transient",
              "straggler.events=[{rank:1,factor:4.0,start_step:0,end_step:30}]", "data=synthetic",
              "trainer.max_steps=30", "profiler.plot=false", f"output_dir={out}"))
    summary = json.loads((out / "summary.json").read_text())
    kinds = [e["kind"] for e in summary["events"]]
    assert "classification" in kinds and "average" in kinds
    average = [e for e in summary["events"] if e["kind"] == "average"][0]
    assert sum(average["weights"]) == pytest.approx(1.0)


def test_merge_averages_batchnorm_statistics_and_hands_out_the_leaders_optimizer_state():
    # rank 3 is 10x slow: it trains alone between merges, so its BN statistics and Adam moments drift apart
    injector = StragglerInjector(TransientSchedule([SlowdownEvent(3, 10.0, 0, None)]), device_ms_per_sample=2.0)
    strategy = CheckedMergeAwar(period_steps=6)
    pl.seed_everything(0, verbose=False)
    trainer = fit(BatchNormAdamNet(), strategy, 4, 8, 30, callbacks=[injector, RankSpread()])
    checks = strategy.run_report["merge_checks"]
    averages = [e for e in strategy.run_report["events"] if e["kind"] == "average"]
    assert len(checks) == len(averages) >= 2
    for float_error, int_error, moments_error, moments_spread_before in checks:
        assert float_error < 1e-6  # running mean/var: sum_i w_i buffer_i
        assert int_error == 0  # num_batches_tracked: the leader's
        assert moments_error == 0  # Adam's exp_avg, exp_avg_sq and step: the leader's, on every rank
    assert max(c[3] for c in checks) > 0  # the straggler's moments differed before the merge
    assert trainer.callback_metrics["rank_param_spread"].item() < 1e-6
