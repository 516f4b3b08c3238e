"""The one boundary rule of dpar and awar (policies/boundary.py), on closed cases, and the simulator's
windows built from it."""
from __future__ import annotations

from lightning_straggler.policies.boundary import is_boundary


def test_window_ends_epoch_ends_run_end_validation_and_checkpoints_are_boundaries():
    assert [p for p in range(45) if is_boundary(p, 20, last_of_epoch=False)] == [19, 39]
    assert is_boundary(6, 20, last_of_epoch=True)
    assert is_boundary(29, 20, last_of_epoch=False, total_steps=30) and not is_boundary(28, 20, last_of_epoch=False,
                                                                                        total_steps=30)
    assert not is_boundary(28, 20, last_of_epoch=False, total_steps=0)  # 0 = no step limit
    assert is_boundary(4, 20, last_of_epoch=False, validation_follows=True)
    assert is_boundary(14, 20, last_of_epoch=False, checkpoint_every=[0, 15])
    assert not is_boundary(13, 20, last_of_epoch=False, checkpoint_every=[0, 15])


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
