"""The one boundary rule of dpar and awar (policies/boundary.py), on closed cases, and the simulator's
windows built from it."""
from __future__ import annotations

import pytest

from lightning_straggler.policies.boundary import boundary_eta, is_boundary, next_boundary, outside_rank_holds


def test_window_ends_epoch_ends_run_end_validation_and_checkpoints_are_boundaries():
    assert [p for p in range(45) if is_boundary(p, 20, last_of_epoch=False)] == [19, 39]
    assert is_boundary(6, 20, last_of_epoch=True)
    assert is_boundary(29, 20, last_of_epoch=False, total_steps=30) and not is_boundary(28, 20, last_of_epoch=False,
                                                                                        total_steps=30)
    assert not is_boundary(28, 20, last_of_epoch=False, total_steps=0)  # 0 = no step limit
    assert is_boundary(4, 20, last_of_epoch=False, validation_follows=True)
    assert is_boundary(14, 20, last_of_epoch=False, checkpoint_every=[0, 15])
    assert not is_boundary(13, 20, last_of_epoch=False, checkpoint_every=[0, 15])


def test_next_boundary_is_the_first_position_the_rule_calls_one():
    # windows of 20, validation after every 10th batch of an epoch of 25 batches starting at position 25
    kw = dict(epoch_start=25, epoch_batches=25, validation_every=10)
    assert next_boundary(24, 20, **kw) == 34  # batch 9 of the epoch: a validation follows
    assert next_boundary(34, 20, **kw) == 39  # the window's end
    assert next_boundary(39, 20, **kw) == 44  # batch 19: validation
    assert next_boundary(44, 20, **kw) == 49  # the epoch's last batch
    assert next_boundary(5, 20, epoch_start=0) == 19  # nothing else known: the window's end
    assert next_boundary(5, 20, epoch_start=0, total_steps=12) == 11  # the run's last step
    assert next_boundary(5, 20, epoch_start=0, checkpoint_every=[8]) == 7  # a step-based checkpoint
    for after in range(60):  # agrees with is_boundary everywhere
        want = next(p for p in range(after + 1, after + 21)
                    if is_boundary(p, 20, last_of_epoch=p == 49, validation_follows=(p - 25 + 1) % 10 == 0 and p >= 25))
        if after >= 24:
            assert next_boundary(after, 20, **kw) == want


def test_an_outside_rank_holds_only_when_its_next_step_would_end_after_the_predicted_boundary():
    eta = boundary_eta(100.0, 10, 0.1)  # left the last boundary at 100 s, 10 group steps of 0.1 s to go
    assert eta == pytest.approx(101.0)
    assert not outside_rank_holds(100.5, eta, 0.4, 1)  # ends at 100.9: computes
    assert outside_rank_holds(100.7, eta, 0.4, 1)  # would end at 101.1: waits for the boundary instead
    assert not outside_rank_holds(100.7, eta, 0.4, 0)  # no local step yet this window: computes (measured)
    assert not outside_rank_holds(100.7, None, 0.4, 3)  # no prediction: computes
    assert not outside_rank_holds(100.7, eta, None, 3)
    assert boundary_eta(100.0, 10, None) is None and boundary_eta(100.0, 10, 0.0) is None


def test_the_simulators_windows_end_where_the_rule_says():
    from lightning_straggler.sim import Workload

    w = Workload(world_size=4, batch_per_worker=8, per_sample_s=1e-3, steps=50, grad_bytes=1e3, steps_per_epoch=25,
                 val_every_steps=10)
    got = [p for p in range(50) if is_boundary(p, 20, last_of_epoch=w.last_of_epoch(p), total_steps=w.steps,
                                                validation_follows=w.validation_follows(p))]
    # windows of 20 (19, 39), validation every 10 steps of an epoch (9, 19; 34, 44), epoch ends (24, 49)
    assert got == [9, 19, 24, 34, 39, 44, 49]
    assert [p for p in range(50) if w.is_sync_point(p)] == [9, 19, 24, 34, 44, 49]


def test_early_boundary_fires_after_exactly_react_steps_slow_steps_in_a_row():
    from lightning_straggler.policies.boundary import EarlyBoundary

    e = EarlyBoundary(4, react_steps=3, slow_ratio=1.5)
    normal, slow = [1.0, 1.0, 1.1, 1.0], [1.0, 1.0, 1.1, 1.6]  # rank 3: 1.6 >= 1.5 x median 1.05
    assert [e.observe(t) for t in (slow, slow, normal, slow, slow)] == [False] * 5  # a fast step resets the run
    assert e.streaks == [0, 0, 0, 2]
    assert e.observe(slow) is True
    assert e.recent_medians() == [1.0, 1.0, 1.1, 1.6]  # over the last 3 steps
    e.reset()
    assert e.streaks == [0] * 4 and not e.observe(slow)


def test_early_boundary_is_relative_to_the_median_and_off_at_zero():
    from lightning_straggler.policies.boundary import EarlyBoundary

    e = EarlyBoundary(4, react_steps=1, slow_ratio=1.5)
    assert not e.observe([2.0, 2.0, 2.0, 2.9])  # everyone slower together: not a straggler (2.9 < 1.5 x 2)
    assert e.observe([2.0, 2.0, 2.0, 3.0])  # exactly the ratio counts
    # two ranks of two: the median is their mean, so 1.5 x can only be reached by more than 3 x
    pair = EarlyBoundary(2, react_steps=1, slow_ratio=1.5)
    assert not pair.observe([1.0, 2.9]) and pair.observe([1.0, 3.0])
    off = EarlyBoundary(4, react_steps=0, slow_ratio=1.5)
    assert not off.enabled and not off.observe([1.0, 1.0, 1.0, 100.0])


def test_early_boundary_state_round_trips_and_checks_its_settings():
    import pytest
    from lightning_straggler.policies.boundary import EarlyBoundary

    e = EarlyBoundary(3, react_steps=2, slow_ratio=2.0)
    e.observe([1.0, 1.0, 5.0])
    copy = EarlyBoundary(3, react_steps=2, slow_ratio=2.0)
    copy.restore(e.to_dict())
    assert copy.observe([1.0, 1.0, 5.0]) and e.observe([1.0, 1.0, 5.0])
    with pytest.raises(ValueError, match="for 3 ranks"):
        EarlyBoundary(4, 2, 2.0).restore(e.to_dict())
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="react_steps must be an integer >= 0"):
            EarlyBoundary(4, bad, 2.0)
    with pytest.raises(ValueError, match="slow_ratio must be > 1"):
        EarlyBoundary(4, 2, 1.0)
    with pytest.raises(ValueError, match="expected 3 compute times"):
        EarlyBoundary(3, 2, 2.0).observe([1.0, 1.0])
