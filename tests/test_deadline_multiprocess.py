"""adaptive's step deadline over real Horovod workers: the helper thread's zeros and the main thread's
gradients meet in Horovod's all-reduce as they do in the fake world (tests/test_deadline.py)."""
import pytest
import torch
from lightning.pytorch import Callback

from lightning_straggler import AdaptiveStrategy
from lightning_straggler.callbacks import StragglerInjector
from lightning_straggler.policies.injection import RandomSchedule, SlowdownEvent, TransientSchedule
from tests.helpers import RankSpread, flat_params
from tests.test_ring_multiprocess import fit, make_model

pytestmark = pytest.mark.multiprocess


class StepsTaken(Callback):
    """Rank 0's optimizer steps at the end of fit, in callback_metrics["steps_taken"]."""

    def on_fit_end(self, trainer, pl_module):
        trainer.callback_metrics["steps_taken"] = torch.tensor(float(trainer.global_step))


def _cuts(strategy):
    return [e for e in strategy.run_report["events"] if e["kind"] == "deadline_cut"]


def test_a_collapsed_rank_is_cut_from_steps_at_4_ranks_and_every_rank_ends_on_one_model():
    """Rank 2 turns 30x slow at step 10 (emulated 4 ms per sample: 32 ms -> ~1 s a step): the deadline (3x the
    step period) cuts it from steps before the re-plan gives it fewer samples; the cuts are counted as
    dropped samples; every rank applies the same updates."""
    injector = StragglerInjector(TransientSchedule([SlowdownEvent(2, 30.0, 10, None)]), device_ms_per_sample=4.0)
    strategy = AdaptiveStrategy(window_steps=0, react_steps=2, deadline_factor=3.0)
    trainer = fit(make_model(), strategy, 4, 8, 24, callbacks=[injector, RankSpread()])
    cuts = _cuts(strategy)
    # (a load spike may cut some rank for one step at any time: 3x the period is not much on 2 shared cores)
    assert any(c["step"] >= 10 and 2 in c["ranks"] for c in cuts), cuts
    report = strategy.run_report["deadline"]
    assert report["cut_rank_steps"] >= 1 and report["factor"] == 3.0
    assert report["dropped_samples"] == sum(c["dropped_samples"] for c in cuts)
    assert trainer.callback_metrics["rank_param_spread"].item() == 0


@pytest.mark.timeout(400)
def test_random_straggler_schedule_at_8_ranks_finishes_with_cuts_and_one_model():
    """Every rank may turn 15-30x slow (10 ms per sample: 0.6-1.2 s a step) for 2-6 steps in each window of 6
    (seeded); the run finishes all its steps, the deadline cut some ranks from some steps, and the ranks end
    on the same parameters."""
    schedule = RandomSchedule(seed=5, probability=0.25, factor_min=15.0, factor_max=30.0, duration_min=2,
                              duration_max=6, window_steps=6)
    strategy = AdaptiveStrategy(window_steps=6, react_steps=2, deadline_factor=3.0)
    trainer = fit(make_model(), strategy, 8, 4, 30,
                  callbacks=[StragglerInjector(schedule, device_ms_per_sample=10.0), RankSpread(), StepsTaken()])
    assert trainer.callback_metrics["steps_taken"].item() == 30
    assert _cuts(strategy), "no rank was cut: the schedule did not exercise the deadline"
    assert trainer.callback_metrics["rank_param_spread"].item() == 0


def test_an_armed_deadline_that_never_fires_changes_no_number():
    """The helper thread armed at every step (factor 1000: never reached) and the arrival slots on the
    all-reduce leave the training exactly as without a deadline."""
    models = {}
    for factor in (0, 1000):
        models[factor] = make_model()
        # no re-plans (they follow measured times, which no two runs share): the allocation stays even
        strategy = AdaptiveStrategy(window_steps=0, react_ratio=1000.0, deadline_factor=factor)
        fit(models[factor], strategy, 4, 8, 12)
        assert not _cuts(strategy)
    report = strategy.run_report["deadline"]
    assert report["factor"] == 1000 and report["cut_rank_steps"] == 0
    assert report["steps_with_deadline"] >= 12 - 1 - 5  # armed from the step after 5 periods were seen
    assert (flat_params(models[0]) - flat_params(make_model())).abs().max() > 1e-3  # it trained
    assert (flat_params(models[0]) == flat_params(models[1000])).all()
