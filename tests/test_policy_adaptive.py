"""adaptive's speed-change detector (policies/adaptive.py), in one process on closed cases."""
from __future__ import annotations

import pytest

from lightning_straggler.policies.adaptive import SpeedChangeDetector


def _steps(detector, per_sample, batch=(4, 4, 4, 4), n=1):
    """Feed ``n`` steps where rank r takes per_sample[r] seconds per sample; the changes of each step."""
    return [detector.observe(list(batch), [p * b for p, b in zip(per_sample, batch)]) for _ in range(n)]


def test_a_collapse_is_a_change_after_exactly_react_steps_and_drops_the_old_points():
    d = SpeedChangeDetector(4, react_steps=2, ratio=1.5, history_steps=10)
    assert _steps(d, [1.0, 1.0, 1.0, 1.0], n=5) == [[]] * 5
    assert _steps(d, [1.0, 1.0, 1.0, 10.0], n=2) == [[], [3]]  # the second slow step
    assert d.points()[3] == [(4.0, 40.0), (4.0, 40.0)]  # its new speed only: the time model sees 10 s per sample
    assert len(d.points()[0]) == 7 and d.up == [0, 0, 0, 0]
    assert _steps(d, [1.0, 1.0, 1.0, 10.0], n=3) == [[]] * 3  # the new speed is its own reference now


def test_a_recovery_is_a_change_and_a_placeholder_counts_per_sample():
    d = SpeedChangeDetector(3, react_steps=3, ratio=2.0, history_steps=10)
    _steps(d, [1.0, 1.0, 8.0], batch=(6, 5, 1), n=4)  # rank 2 on a one-sample placeholder, 8x slow
    assert _steps(d, [1.0, 1.0, 1.0], batch=(6, 5, 1), n=3) == [[], [], [2]]


def test_two_workers_cannot_tell_who_moved_both_count_as_changed():
    d = SpeedChangeDetector(2, react_steps=1, ratio=1.5)
    _steps(d, [1.0, 1.0], batch=(2, 2), n=2)
    assert _steps(d, [1.0, 3.0], batch=(2, 2)) == [[0, 1]]  # against their median, 0 got faster as 1 got slower


def test_everyone_slower_at_once_is_nobodys_change_but_one_rank_against_the_rest_is():
    d = SpeedChangeDetector(4, react_steps=2, ratio=1.5)
    _steps(d, [1.0, 1.0, 1.0, 1.0], n=3)
    assert _steps(d, [4.0, 4.0, 4.0, 4.0], n=3) == [[]] * 3  # a load spike on the machine
    assert _steps(d, [4.0, 4.0, 4.0, 4.0 * 1.6], n=2)[-1] == [3]  # 1.6 x the others' common move


def test_no_reference_before_react_steps_points_and_history_is_capped():
    d = SpeedChangeDetector(2, react_steps=3, ratio=1.5, history_steps=4)
    assert d.reference(0) is None
    _steps(d, [1.0, 1.0], batch=(2, 2), n=2)
    assert d.reference(0) is None
    _steps(d, [1.0, 1.0], batch=(2, 2), n=5)
    assert d.reference(0) == 1.0 and len(d.points()[0]) == 4


def test_state_round_trips_and_bad_input_is_named():
    d = SpeedChangeDetector(3, react_steps=2, ratio=1.5)
    _steps(d, [1.0, 1.0, 1.0], batch=(2, 2, 2), n=3)
    _steps(d, [1.0, 1.0, 3.0], batch=(2, 2, 2), n=1)
    copy = SpeedChangeDetector(3, react_steps=2, ratio=1.5)
    copy.restore(d.to_dict())
    assert _steps(copy, [1.0, 1.0, 3.0], batch=(2, 2, 2)) == _steps(d, [1.0, 1.0, 3.0], batch=(2, 2, 2)) == [[2]]
    with pytest.raises(ValueError, match="for 3 ranks, this run has 2"):
        SpeedChangeDetector(2).restore(d.to_dict())
    d = SpeedChangeDetector(2, react_steps=2, ratio=1.5)
    with pytest.raises(ValueError, match="rank 1 computed 0 samples"):
        d.observe([2, 0], [1.0, 1.0])
    with pytest.raises(ValueError, match="expected 2 batch sizes and times"):
        d.observe([2], [1.0])
    for kwargs, setting in (({"react_steps": 0}, "react_steps"), ({"react_steps": True}, "react_steps"),
                            ({"ratio": 1.0}, "react_ratio"), ({"ratio": float("nan")}, "react_ratio"),
                            ({"react_steps": 3, "history_steps": 2}, "history_steps")):
        with pytest.raises(ValueError, match=f"^{setting} must be"):
            SpeedChangeDetector(2, **kwargs)
