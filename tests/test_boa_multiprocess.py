"""BOA with real Horovod workers at 4 ranks."""
import json

import pytest

from lightning_straggler import BoaStrategy
from lightning_straggler.callbacks import StragglerInjector
from lightning_straggler.policies.boa_schedule import epoch_permutation
from lightning_straggler.policies.injection import RandomSchedule, StaticSchedule
from tests.helpers import RankSpread, flat_params
from tests.test_ring_multiprocess import fit, make_model, train_set

pytestmark = pytest.mark.multiprocess


def test_unequal_batches_equal_one_single_process_step_on_the_global_batch():
    sizes = [4, 8, 12, 8]
    reference = make_model()
    perm = epoch_permutation(len(train_set()), 0, 0)
    fit(reference, "auto", 1, sum(sizes), 1, sampler=perm)  # rank slices concatenated = perm[:32]
    boa = make_model()
    trainer = fit(boa, BoaStrategy(initial_batch_sizes=sizes, window_steps=0), 4, 8, 1, callbacks=[RankSpread()])
    diff = (flat_params(boa) - flat_params(reference)).abs().max().item()
    assert diff < 1e-5, diff
    assert (flat_params(boa) - flat_params(make_model())).abs().max().item() > 1e-3
    assert trainer.callback_metrics["rank_param_spread"].item() < 1e-6


def test_bf16_mixed_unequal_batches_equal_one_single_process_bf16_step():
    """precision="bf16-mixed" (CPU autocast) goes through boa's sample weighting like fp32 does: 2 ranks
    with 12 and 20 samples take the single-process bf16 step on the 32 samples. bf16 rounds each matmul's
    output, and a slice's sums round differently from the whole batch's, so the tolerance is bf16's, well
    below how far the step moves the parameters."""
    sizes = [12, 20]
    perm = epoch_permutation(len(train_set()), 0, 0)
    reference = make_model()
    fit(reference, "auto", 1, sum(sizes), 1, sampler=perm, precision="bf16-mixed")
    boa = make_model()
    trainer = fit(boa, BoaStrategy(initial_batch_sizes=sizes, window_steps=0), 2, 16, 1, callbacks=[RankSpread()],
                  precision="bf16-mixed")
    moved = (flat_params(reference) - flat_params(make_model())).abs().max().item()
    diff = (flat_params(boa) - flat_params(reference)).abs().max().item()
    assert moved > 1e-2, moved
    assert diff < moved / 50, (diff, moved)
    assert trainer.callback_metrics["rank_param_spread"].item() < 1e-6


def test_rebalances_towards_fast_workers_under_a_static_mix():
    # ranks 2 and 3 are 2x and 4x slower (emulated device time 5 ms per sample x factor: at 2 ms the real
    # compute's noise on a loaded 2-core machine could reorder the time models; it failed so once)
    injector = StragglerInjector(StaticSchedule([1.0, 1.0, 2.0, 4.0]), device_ms_per_sample=5.0)
    strategy = BoaStrategy(window_steps=5, rebalance_gain=0.05)
    trainer = fit(make_model(), strategy, 4, 16, 20, callbacks=[injector, RankSpread()])
    events = strategy.run_report["events"]
    assert events[0]["kind"] == "allocation" and events[0]["batch_sizes"] == [16, 16, 16, 16]
    rebalances = [e for e in events if e["kind"] == "rebalance"]
    assert rebalances, events
    sizes = rebalances[-1]["batch_sizes"]
    assert sum(sizes) == 64
    assert sizes[0] > sizes[2] > sizes[3]  # faster workers take more samples
    assert sizes[3] <= 16 * 0.6
    assert trainer.callback_metrics["rank_param_spread"].item() < 1e-6


def test_random_straggler_schedules_always_finish():
    # one schedule over real Horovod workers; more in one process: tests/test_inprocess_strategies.py
    for seed in range(1):
        injector = StragglerInjector(RandomSchedule(seed, 0.5, 2.0, 20.0, 1, 6, 3), device_ms_per_sample=0.5)
        strategy = BoaStrategy(window_steps=3, rebalance_gain=0.0, tune_workers=True)
        trainer = fit(make_model(seed), strategy, 4, 8, 12, callbacks=[injector, RankSpread()])
        assert trainer.state.finished
        assert trainer.callback_metrics["rank_param_spread"].item() < 1e-6


def test_boa_run_summary_starts_with_the_allocation(tmp_path, compose):
    """``train(cfg)`` from code, as the command line calls it (the command line itself: the dpar, demo and
    multirun tests)."""
    from lightning_straggler.train import train

    out = tmp_path / "run"
    train(compose("algorithm=boa", "algorithm.window_steps=5", "trainer=quick", "trainer.devices=4", "straggler=static",
              "straggler.factors=[1.0,1.0,1.67,3.33]", "data=synthetic", "trainer.max_steps=20",
              "trainer.val_check_interval=10", "profiler.plot=false", f"output_dir={out}"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "boa"
    assert summary["events"][0]["kind"] == "allocation"
    assert summary["train_samples"] == 20 * 128


def test_adaptive_at_4_real_ranks_replans_after_a_collapse_and_ends_on_one_model():
    """adaptive over real Horovod workers (the compute times ride on Horovod's gradient all-reduce): rank 1
    collapses 10x at step 6 (emulated 5 ms per sample); within react_steps=2 steps every rank re-plans with
    rank 1 changed and fewer samples for it; the run finishes with one model everywhere."""
    from lightning_straggler import AdaptiveStrategy
    from lightning_straggler.policies.injection import SlowdownEvent, TransientSchedule

    injector = StragglerInjector(TransientSchedule([SlowdownEvent(1, 10.0, 6, None)]), device_ms_per_sample=5.0)
    strategy = AdaptiveStrategy(window_steps=0, react_steps=2, react_ratio=3.0, deadline_factor=0)  # the detector alone
    trainer = fit(make_model(), strategy, 4, 8, 16, callbacks=[injector, RankSpread()])
    replans = [e for e in strategy.run_report["events"] if e["kind"] == "rebalance"]
    assert replans and replans[0]["changed_ranks"] == [1] and replans[0]["step"] == 7, replans
    assert replans[0]["batch_sizes"][1] < 8 and sum(replans[0]["batch_sizes"]) == 32
    assert trainer.callback_metrics["rank_param_spread"].item() < 1e-6
