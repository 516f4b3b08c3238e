import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_straggler.policies.awar import NORMAL, STRAGGLER, AwarThresholds, average_weights, classify

T = AwarThresholds(slow_ratio=1.5, recover_ratio=1.2, min_group=0)


def test_equal_times_keep_everyone_in_the_group():
    states, changes = classify([1.0, 1.0, 1.0, 1.0], [NORMAL] * 4, T)
    assert states == [NORMAL] * 4 and changes == []


def test_a_slow_worker_becomes_a_straggler_and_recovers_with_hysteresis():
    states, changes = classify([1.0, 1.0, 1.1, 4.0], [NORMAL] * 4, T)
    assert states == [NORMAL, NORMAL, NORMAL, STRAGGLER]
    assert changes[0]["rank"] == 3 and changes[0]["ratio"] == pytest.approx(4.0 / 1.05)  # vs the median
    states, _ = classify([1.0, 1.0, 1.0, 1.3], states, T)  # between the thresholds: stays out
    assert states[3] == STRAGGLER
    states, changes = classify([1.0, 1.0, 1.0, 1.1], states, T)
    assert states[3] == NORMAL and changes[0]["reason"] == "recovered"


def test_min_group_limits_how_many_leave_slowest_first():
    # median 4.0: ranks 2, 3, 4 (7, 9, 8 = 1.75x, 2.25x, 2x) all qualify, but min_group=4 lets only 2 leave:
    # the slowest two (3, then 4); rank 2, the least slow, stays
    states, changes = classify([1.0, 1.0, 7.0, 9.0, 8.0, 1.0], [NORMAL] * 6, AwarThresholds(1.5, 1.2, min_group=4))
    assert states == [NORMAL, NORMAL, NORMAL, STRAGGLER, STRAGGLER, NORMAL]
    assert [(c["rank"], c["ratio"]) for c in changes] == [(3, pytest.approx(2.25)), (4, pytest.approx(2.0))]
    # the same times in another rank order: still the slowest two, whatever their ranks
    states, _ = classify([9.0, 7.0, 1.0, 1.0, 1.0, 8.0], [NORMAL] * 6, AwarThresholds(1.5, 1.2, min_group=4))
    assert states == [STRAGGLER, NORMAL, NORMAL, NORMAL, NORMAL, STRAGGLER]


def test_a_straggler_that_did_no_step_stays_a_straggler():
    states, changes = classify([1.0, 1.0, 1.0, None], [NORMAL, NORMAL, NORMAL, STRAGGLER], T)
    assert states[3] == STRAGGLER and changes == []


def test_one_worker_and_nothing_measured():
    assert classify([1.0], [NORMAL], T) == ([NORMAL], [])
    assert classify([None, None], [NORMAL, NORMAL], T) == ([NORMAL, NORMAL], [])


def test_weights_follow_updates_or_samples():
    assert average_weights([20, 20, 20, 5], [640, 640, 640, 160], "updates") == pytest.approx([20 / 65] * 3 + [5 / 65])
    assert average_weights([20, 20, 20, 5], [100, 100, 100, 700], "samples") == pytest.approx([0.1, 0.1, 0.1, 0.7])
    assert average_weights([10, 0], [1, 0], "updates") == [1.0, 0.0]  # zero steps: weight 0
    assert average_weights([0, 0, 0], [0, 0, 0]) == pytest.approx([1 / 3] * 3)  # nobody moved: plain mean


def test_bad_inputs_name_the_setting():
    with pytest.raises(ValueError, match="weighting"):
        average_weights([1], [1], "magic")
    with pytest.raises(ValueError, match="recover_ratio"):
        AwarThresholds(1.5, 1.6).validate(4)
    with pytest.raises(ValueError, match="slow_ratio"):
        AwarThresholds(1.0, 1.0).validate(4)
    with pytest.raises(ValueError, match="min_group"):
        AwarThresholds(1.5, 1.2, 5).validate(4)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.lists(st.one_of(st.none(), st.floats(0.001, 100)), min_size=n, max_size=n),
    st.lists(st.sampled_from([NORMAL, STRAGGLER]), min_size=n, max_size=n),
    st.integers(0, n))))
def test_invariants(args):
    times, states, min_group = args
    if sum(s == NORMAL for s in states) == 0:
        states[0] = NORMAL
    t = AwarThresholds(1.5, 1.2, min_group)
    new, changes = classify(times, states, t)
    floor = min(t.min_group_for(len(states)), sum(s == NORMAL for s in states))
    assert sum(s == NORMAL for s in new) >= floor  # never below min_group (unless it started below)
    assert [(c["rank"], c["from_state"], c["to_state"]) for c in changes] == \
        [(i, a, b) for i, (a, b) in enumerate(zip(states, new)) if a != b]
    assert classify(times, states, t) == (new, changes)  # deterministic
    w = average_weights([5] * len(states), [1] * len(states))
    assert math.isclose(sum(w), 1.0)
