"""DPAR decision logic: constructed timings, thresholds validation, and invariants over random runs."""
from __future__ import annotations

import copy
import math
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_straggler.policies.dpar import (
    ACTIVE,
    REASON_EXCLUDED,
    REASON_RECOVERED,
    REASON_STRUCK_OUT,
    SLOW,
    STRUCK_OUT,
    DparDecision,
    DparMemory,
    DparThresholds,
    Transition,
    decide,
    window_median,
)

FAST = settings(max_examples=150, deadline=None)
DEFAULT = DparThresholds()


def run(windows, thresholds=DEFAULT, memory=None):
    """Feed windows of times through decide; return the list of decisions."""
    mem = memory or DparMemory.initial(len(windows[0]))
    out = []
    for times in windows:
        d = decide(times, mem, thresholds)
        out.append(d)
        mem = d.memory
    return out


# --------------------------------------------------------------------------------------------------
# window_median
# --------------------------------------------------------------------------------------------------


def test_window_median_empty_is_none():
    assert window_median([]) is None
    assert window_median([float("nan")]) is None


def test_window_median_ignores_spikes_and_nan():
    assert window_median([0.1, 0.1, 5.0]) == pytest.approx(0.1)
    assert window_median([0.1, 0.3]) == pytest.approx(0.2)
    assert window_median([0.2, float("nan"), 0.4, 0.3]) == pytest.approx(0.3)
    assert isinstance(window_median((1, 2, 3)), float)


# --------------------------------------------------------------------------------------------------
# Thresholds
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, name", [
    (dict(slow_ratio=1.0), "slow_ratio"),
    (dict(slow_ratio=0.5), "slow_ratio"),
    (dict(slow_ratio=float("nan")), "slow_ratio"),
    (dict(slow_ratio="2"), "slow_ratio"),
    (dict(strikeout_ratio=1.4), "strikeout_ratio"),
    (dict(strikeout_ratio=float("inf")), "strikeout_ratio"),
    (dict(strikeout_windows=0), "strikeout_windows"),
    (dict(strikeout_windows=1.0), "strikeout_windows"),
    (dict(strikeout_windows=True), "strikeout_windows"),
    (dict(readmit_ratio=1.5), r"readmit_ratio must be in \[1, slow_ratio\)"),
    (dict(readmit_ratio=0.9), "readmit_ratio"),
    (dict(readmit_windows=0), "readmit_windows"),
    (dict(min_active=-1), "min_active"),
    (dict(min_active=5), "min_active"),
    (dict(data_penalty=-0.1), "data_penalty"),
    (dict(data_penalty=float("inf")), "data_penalty"),
])
def test_validate_names_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DparThresholds(**kwargs).validate(4)


def test_validate_world_size_and_defaults_ok():
    DEFAULT.validate(1)
    DparThresholds(slow_ratio=2.0, strikeout_ratio=2.0, readmit_ratio=1.0, strikeout_windows=1,
                   readmit_windows=1, min_active=4, data_penalty=0.0).validate(4)
    with pytest.raises(ValueError, match="world_size"):
        DEFAULT.validate(0)


def test_decide_validates_thresholds_against_world_size():
    with pytest.raises(ValueError, match="min_active"):
        decide([1.0, 1.0], DparMemory.initial(2), DparThresholds(min_active=3))


@pytest.mark.parametrize("world, expected", [(1, 1), (2, 1), (3, 2), (4, 2), (5, 3), (16, 8)])
def test_min_active_default_is_half_rounded_up(world, expected):
    assert DEFAULT.min_active_for(world) == expected


def test_min_active_explicit():
    assert DparThresholds(min_active=3).min_active_for(4) == 3
    assert DparThresholds(min_active=1).min_active_for(16) == 1


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------


def test_memory_initial_roundtrip_and_pickle():
    m = DparMemory.initial(3)
    assert m.states == [ACTIVE] * 3 and m.slow_streak == [0] * 3 and m.recovered_streak == [0] * 3
    m2 = DparMemory(states=[ACTIVE, SLOW, STRUCK_OUT], slow_streak=[0, 2, 0], recovered_streak=[0, 1, 0])
    assert DparMemory.from_dict(m2.to_dict()) == m2
    assert pickle.loads(pickle.dumps(m2)) == m2
    import json
    assert DparMemory.from_dict(json.loads(json.dumps(m2.to_dict()))) == m2


@pytest.mark.parametrize("d, name", [
    ({"states": ["active"], "slow_streak": [0]}, "recovered_streak"),
    ({"states": ["bogus"], "slow_streak": [0], "recovered_streak": [0]}, "states"),
    ({"states": ["active"], "slow_streak": [0, 0], "recovered_streak": [0]}, "slow_streak"),
    ({"states": ["active"], "slow_streak": [-1], "recovered_streak": [0]}, "slow_streak"),
    ({"states": [], "slow_streak": [], "recovered_streak": []}, "states"),
])
def test_memory_from_dict_rejects_bad_input(d, name):
    with pytest.raises(ValueError, match=name):
        DparMemory.from_dict(d)


@pytest.mark.parametrize("times, name", [
    ([1.0, 1.0, 1.0], "memory.states has 4 ranks but times has 3"),
    ([1.0, 1.0, 1.0, -1.0], r"times\[3\]"),
    ([1.0, float("inf"), 1.0, 1.0], r"times\[1\]"),
    ([1.0, "x", 1.0, 1.0], r"times\[1\]"),
    ([], "times"),
])
def test_decide_rejects_bad_times(times, name):
    with pytest.raises(ValueError, match=name):
        decide(times, DparMemory.initial(4), DEFAULT)


# --------------------------------------------------------------------------------------------------
# Constructed timings
# --------------------------------------------------------------------------------------------------


def test_keep_when_all_equal():
    d = decide([0.2] * 4, DparMemory.initial(4), DEFAULT)
    assert d.states == (ACTIVE,) * 4
    assert d.transitions == ()
    assert d.active == (0, 1, 2, 3)
    assert d.group_time == pytest.approx(0.2)


def test_exclude_one_4x_worker_among_4():
    d = decide([1.0, 1.0, 1.0, 4.0], DparMemory.initial(4), DEFAULT)
    assert d.states == (ACTIVE, ACTIVE, ACTIVE, SLOW)
    assert d.active == (0, 1, 2)
    assert d.group_time == pytest.approx(1.0)
    (tr,) = d.transitions
    assert tr == Transition(rank=3, from_state=ACTIVE, to_state=SLOW, ratio=pytest.approx(4.0),
                            keep_cost=pytest.approx(4 * 3.0), exclude_cost=pytest.approx(1.5),
                            reason=REASON_EXCLUDED)
    # 4 < strikeout_ratio: the strike-out streak does not start.
    assert d.memory.slow_streak == [0, 0, 0, 0] and d.memory.recovered_streak == [0, 0, 0, 0]


def test_slightly_slow_worker_is_not_a_candidate():
    d = decide([1.0, 1.0, 1.0, 1.49], DparMemory.initial(4), DEFAULT)
    assert d.transitions == () and d.states == (ACTIVE,) * 4


def test_readmit_after_readmit_windows_and_not_before():
    th = DparThresholds(readmit_windows=3)
    ds = run([[1.0, 1.0, 1.0, 4.0]] + [[1.0, 1.0, 1.0, 1.1]] * 3, th)
    assert [d.states[3] for d in ds] == [SLOW, SLOW, SLOW, ACTIVE]
    assert [d.memory.recovered_streak[3] for d in ds] == [0, 1, 2, 0]
    (tr,) = ds[-1].transitions
    assert (tr.rank, tr.from_state, tr.to_state, tr.reason) == (3, SLOW, ACTIVE, REASON_RECOVERED)
    assert tr.ratio == pytest.approx(1.1)


def test_readmit_streak_resets_in_the_hysteresis_band():
    # 1.3 is between readmit_ratio (1.2) and slow_ratio (1.5): not slow enough to exclude, not fast
    # enough to come back, and it breaks the recovery streak.
    ds = run([[1.0, 1.0, 1.0, 4.0], [1, 1, 1, 1.1], [1, 1, 1, 1.3], [1, 1, 1, 1.1], [1, 1, 1, 1.1]])
    assert [d.states[3] for d in ds] == [SLOW, SLOW, SLOW, SLOW, ACTIVE]
    assert [d.memory.recovered_streak[3] for d in ds] == [0, 1, 0, 1, 0]


@pytest.mark.parametrize("strikeout_windows, struck_at", [(1, 1), (2, 1), (3, 2), (4, 3)])
def test_strikeout_of_permanent_20x_worker(strikeout_windows, struck_at):
    th = DparThresholds(strikeout_windows=strikeout_windows)
    ds = run([[1.0, 1.0, 1.0, 20.0]] * 6, th)
    states = [d.states[3] for d in ds]
    # Excluded in window 0 (never struck out in the same window), struck out once the streak,
    # counting the exclusion window, reaches strikeout_windows.
    assert states == [SLOW] * struck_at + [STRUCK_OUT] * (6 - struck_at)
    assert ds[0].memory.slow_streak[3] == 1
    (tr,) = ds[struck_at].transitions
    assert (tr.rank, tr.from_state, tr.to_state, tr.reason) == (3, SLOW, STRUCK_OUT, REASON_STRUCK_OUT)
    assert all(d.transitions == () for d in ds[struck_at + 1:])


def test_strikeout_is_absorbing_even_when_fast_again():
    ds = run([[1.0, 1.0, 1.0, 20.0]] * 3 + [[1.0, 1.0, 1.0, 1.0]] * 4 + [[1.0, 1.0, 1.0, None]] * 2)
    assert [d.states[3] for d in ds] == [SLOW, SLOW, STRUCK_OUT] + [STRUCK_OUT] * 6


def test_slow_rank_without_measurement_counts_as_infinitely_slow():
    ds = run([[1.0, 1.0, 1.0, 4.0], [1.0, 1.0, 1.0, None], [1.0, 1.0, 1.0, None], [1.0, 1.0, 1.0, None]])
    assert [d.memory.slow_streak[3] for d in ds[:3]] == [0, 1, 2]
    assert [d.states[3] for d in ds] == [SLOW, SLOW, SLOW, STRUCK_OUT]
    assert ds[-1].transitions[0].ratio == math.inf and ds[-1].transitions[0].keep_cost == math.inf


def test_strikeout_streak_resets_when_less_slow():
    ds = run([[1.0, 1.0, 1.0, 20.0], [1, 1, 1, 20.0], [1, 1, 1, 3.0], [1, 1, 1, 20.0], [1, 1, 1, 20.0]])
    assert [d.memory.slow_streak[3] for d in ds] == [1, 2, 0, 1, 2]
    assert all(d.states[3] == SLOW for d in ds)


def test_min_active_blocks_exclusion_within_a_window():
    # Two candidates (ratios 5/3, 2); min_active=3 lets only the slowest go.
    d = decide([1.0, 1.0, 5.0, 6.0], DparMemory.initial(4), DparThresholds(min_active=3))
    assert d.states == (ACTIVE, ACTIVE, ACTIVE, SLOW)
    assert [tr.rank for tr in d.transitions] == [3]  # kept rank 2 records nothing
    d = decide([1.0, 1.0, 1.0, 4.0], DparMemory.initial(4), DparThresholds(min_active=4))
    assert d.states == (ACTIVE,) * 4 and d.transitions == ()


def test_min_active_blocks_exclusion_3_of_4_slow():
    # Window 0 excludes ranks 2 and 3 (the default min_active for 4 is 2). In window 1 rank 1 is slow
    # too and excluding it would be cheaper, but only 2 ranks are active: it must stay.
    th = DparThresholds(data_penalty=0.0)
    ds = run([[1.0, 1.0, 5.0, 6.0], [1.0, 4.0, 5.0, 6.0]], th)
    assert ds[0].states == (ACTIVE, ACTIVE, SLOW, SLOW)
    assert ds[0].transitions[0].rank == 2 and ds[0].transitions[1].rank == 3
    assert ds[1].group_time == pytest.approx(2.5)
    assert 2 * (4.0 - 2.5) > 2.5 * (1 + 0.0)  # the cost rule alone would exclude rank 1
    assert ds[1].states == (ACTIVE, ACTIVE, SLOW, SLOW)
    assert ds[1].transitions == ()
    # Without the floor it goes.
    ds = run([[1.0, 1.0, 5.0, 6.0], [1.0, 4.0, 5.0, 6.0]], DparThresholds(data_penalty=0.0, min_active=1))
    assert ds[1].active == (0,)


def test_single_worker_is_never_excluded():
    ds = run([[1.0]] * 3, DparThresholds(min_active=1))
    assert all(d.states == (ACTIVE,) for d in ds)


@pytest.mark.parametrize("data_penalty, excluded", [(0.0, True), (0.19, True), (0.21, False), (0.5, False), (1.0, False)])
def test_data_penalty_can_make_exclusion_more_expensive(data_penalty, excluded):
    # Two workers, 1 s and 4 s: group median 2.5, ratio 1.6 (a candidate). keep_cost = 2 * 1.5 = 3,
    # exclude_cost = 2.5 * (1 + p): exclusion pays off only for p < 0.2.
    d = decide([1.0, 4.0], DparMemory.initial(2), DparThresholds(data_penalty=data_penalty))
    assert d.group_time == pytest.approx(2.5)
    assert d.states == ((ACTIVE, SLOW) if excluded else (ACTIVE, ACTIVE))
    assert len(d.transitions) == int(excluded)


def test_exclusion_order_slowest_first_ties_by_rank():
    # 8 workers: median 1, three candidates at 3x, 3x, 4x; min_active=6 allows two exclusions.
    times = [1.0, 3.0, 1.0, 3.0, 1.0, 4.0, 1.0, 1.0]
    d = decide(times, DparMemory.initial(8), DparThresholds(min_active=6))
    assert d.active == (0, 2, 3, 4, 6, 7)
    by_rank = {tr.rank: tr for tr in d.transitions}
    assert set(by_rank) == {1, 5}
    assert by_rank[5].keep_cost == pytest.approx(8 * 3.0)  # first: 8 active
    assert by_rank[1].keep_cost == pytest.approx(7 * 2.0)  # second: 7 active
    assert [tr.rank for tr in d.transitions] == [1, 5]  # reported sorted by rank


def test_struck_out_times_are_ignored_and_active_without_measurement_is_kept():
    mem = DparMemory(states=[ACTIVE, ACTIVE, ACTIVE, STRUCK_OUT], slow_streak=[0] * 4, recovered_streak=[0] * 4)
    d = decide([1.0, None, 1.0, 0.01], mem, DEFAULT)
    assert d.group_time == pytest.approx(1.0)
    assert d.states == (ACTIVE, ACTIVE, ACTIVE, STRUCK_OUT) and d.transitions == ()


def test_nothing_measured_means_no_change():
    mem = DparMemory(states=[ACTIVE, SLOW, STRUCK_OUT], slow_streak=[0, 1, 0], recovered_streak=[0, 0, 0])
    d = decide([None, float("nan"), None], mem, DEFAULT)
    assert math.isnan(d.group_time)
    assert d.transitions == () and d.states == tuple(mem.states)
    assert d.memory == mem and d.memory is not mem


def test_reference_falls_back_to_all_measured():
    # No ACTIVE rank has a measurement: the SLOW rank's own time is the reference (ratio 1).
    mem = DparMemory(states=[ACTIVE, SLOW], slow_streak=[0, 0], recovered_streak=[0, 1])
    d = decide([None, 2.0], mem, DEFAULT)
    assert d.group_time == pytest.approx(2.0)
    assert d.states == (ACTIVE, ACTIVE)


def test_zero_reference_is_handled():
    d = decide([0.0, 0.0, 0.0, 1.0], DparMemory.initial(4), DEFAULT)
    assert d.group_time == 0.0
    assert d.states == (ACTIVE, ACTIVE, ACTIVE, SLOW)
    assert d.transitions[0].ratio == math.inf


def test_numpy_inputs_are_accepted():
    np = pytest.importorskip("numpy")
    d = decide(np.array([1.0, 1.0, 1.0, 4.0]), DparMemory.initial(4), DEFAULT)
    assert d.active == (0, 1, 2)
    assert isinstance(d.transitions[0].ratio, float)


# --------------------------------------------------------------------------------------------------
# Invariants over random runs
# --------------------------------------------------------------------------------------------------

TIME = st.one_of(
    st.none(),
    st.sampled_from([0.0, 1.0, 1.0, 1.0, 1.1, 1.3, 2.0, 4.0, 6.0, 20.0, float("nan")]),
    st.floats(0.01, 50.0),
)


@st.composite
def thresholds_strategy(draw, world):
    slow = draw(st.floats(1.01, 4.0))
    return DparThresholds(
        slow_ratio=slow,
        strikeout_ratio=draw(st.floats(slow, 25.0)),
        strikeout_windows=draw(st.integers(1, 4)),
        readmit_ratio=draw(st.floats(1.0, slow, exclude_max=True)),
        readmit_windows=draw(st.integers(1, 4)),
        min_active=draw(st.integers(0, world)),
        data_penalty=draw(st.floats(0.0, 3.0)),
    )


@st.composite
def scenarios(draw):
    world = draw(st.integers(1, 16))
    th = draw(thresholds_strategy(world))
    n_windows = draw(st.integers(1, 12))
    # Per-rank "base" speed keeps some ranks consistently slow, so runs reach SLOW and STRUCK_OUT.
    base = draw(st.lists(st.sampled_from([1.0, 1.0, 1.0, 2.0, 10.0, 30.0]), min_size=world, max_size=world))
    windows = []
    for _ in range(n_windows):
        row = draw(st.lists(TIME, min_size=world, max_size=world))
        use_base = draw(st.lists(st.booleans(), min_size=world, max_size=world))
        windows.append([b if u else x for b, u, x in zip(base, use_base, row)])
    return world, th, windows


@FAST
@given(scenarios())
def test_invariants_over_random_runs(scenario):
    world, th, windows = scenario
    floor = th.min_active_for(world)
    mem = DparMemory.initial(world)
    excluded_at = {}
    for w, times in enumerate(windows):
        before = copy.deepcopy(mem)
        snapshot = mem.to_dict()
        d = decide(times, mem, th)

        # Input memory not mutated; output is a new object.
        assert mem.to_dict() == snapshot and mem == before
        assert d.memory is not mem
        assert d.memory.states is not mem.states

        # Determinism: same inputs -> identical decision (repr compares NaN group_time too).
        again = decide(list(times), copy.deepcopy(before), th)
        assert repr(again) == repr(d)

        old, new = mem.states, d.states
        assert isinstance(d, DparDecision) and len(new) == world
        assert list(new) == d.memory.states

        # Transitions are exactly the state differences, sorted by rank, of the allowed kinds only.
        assert [(tr.rank, tr.from_state, tr.to_state) for tr in d.transitions] == \
            [(i, old[i], new[i]) for i in range(world) if old[i] != new[i]]
        for tr in d.transitions:
            assert (tr.from_state, tr.to_state) in {(ACTIVE, SLOW), (SLOW, ACTIVE), (SLOW, STRUCK_OUT)}
            assert tr.reason == {SLOW: REASON_EXCLUDED, ACTIVE: REASON_RECOVERED,
                                 STRUCK_OUT: REASON_STRUCK_OUT}[tr.to_state]
            if tr.to_state == SLOW:
                assert tr.keep_cost > tr.exclude_cost and tr.ratio >= th.slow_ratio

        # STRUCK_OUT is absorbing.
        for i in range(world):
            if old[i] == STRUCK_OUT:
                assert new[i] == STRUCK_OUT

        # Never fewer than min_active ACTIVE ranks (unless it started below: then no exclusion).
        n_old, n_new = old.count(ACTIVE), new.count(ACTIVE)
        assert n_new >= min(floor, n_old)
        assert d.active == tuple(i for i in range(world) if new[i] == ACTIVE)

        # Hysteresis: ACTIVE -> SLOW -> ACTIVE takes at least readmit_windows windows.
        for tr in d.transitions:
            if tr.to_state == SLOW:
                excluded_at[tr.rank] = w
            elif tr.to_state == ACTIVE:
                assert w - excluded_at[tr.rank] >= th.readmit_windows

        # Counters are non-negative ints, zero outside SLOW; the memory round-trips.
        for i in range(world):
            assert d.memory.slow_streak[i] >= 0 and d.memory.recovered_streak[i] >= 0
            if new[i] != SLOW and not math.isnan(d.group_time):
                assert d.memory.slow_streak[i] == 0 and d.memory.recovered_streak[i] == 0
        assert DparMemory.from_dict(d.memory.to_dict()) == d.memory
        assert pickle.loads(pickle.dumps(d.memory)) == d.memory

        mem = d.memory


@FAST
@given(st.integers(1, 16), st.data())
def test_equal_times_never_change_anything(world, data):
    th = data.draw(thresholds_strategy(world))
    t = data.draw(st.floats(0.01, 10.0))
    d = decide([t] * world, DparMemory.initial(world), th)
    assert d.states == (ACTIVE,) * world and d.transitions == ()
