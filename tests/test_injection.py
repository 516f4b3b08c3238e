import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_straggler.policies.injection import (
    RandomSchedule, SlowdownEvent, StaticSchedule, StragglerSchedule, TransientSchedule, added_delay_s)


def test_none_is_always_full_speed():
    s = StragglerSchedule()
    assert all(s.factor(r, t) == 1.0 for r in range(8) for t in range(100))


def test_static_factors_per_rank_and_default_for_unlisted_ranks():
    s = StaticSchedule([1.0, 1.67, 3.33])
    assert [s.factor(r, 5) for r in range(4)] == [1.0, 1.67, 3.33, 1.0]


def test_transient_window_is_half_open_and_overlaps_take_max():
    s = TransientSchedule([SlowdownEvent(3, 4.0, 40, 160), SlowdownEvent(3, 6.0, 100, 110), SlowdownEvent(1, 2.0, 0, None)])
    assert s.factor(3, 39) == 1.0
    assert s.factor(3, 40) == 4.0
    assert s.factor(3, 105) == 6.0
    assert s.factor(3, 159) == 4.0
    assert s.factor(3, 160) == 1.0
    assert s.factor(1, 10_000) == 2.0
    assert s.factor(0, 50) == 1.0


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31), p=st.floats(0, 1), dmin=st.integers(1, 30), extra=st.integers(0, 30),
       window=st.integers(1, 40))
def test_random_schedule_is_a_pure_function_of_seed_rank_step(seed, p, dmin, extra, window):
    a = RandomSchedule(seed, p, 2.0, 5.0, dmin, dmin + extra, window)
    b = RandomSchedule(seed, p, 2.0, 5.0, dmin, dmin + extra, window)
    steps = 200
    events = a.events_until(4, steps)
    for rank in range(4):
        for step in range(0, steps, 3):
            f = a.factor(rank, step)
            assert f == b.factor(rank, step)  # identical on every rank / every process
            # equals the max over the explicitly listed events covering (rank, step)
            expected = max([e.factor for e in events if e.active(rank, step)], default=1.0)
            assert f == pytest.approx(expected)
            assert f == 1.0 or 2.0 <= f <= 5.0


def test_random_probability_bounds():
    never = RandomSchedule(0, 0.0, 2.0, 4.0, 5, 10, 10)
    always = RandomSchedule(0, 1.0, 2.0, 4.0, 10, 10, 10)
    assert all(never.factor(r, t) == 1.0 for r in range(4) for t in range(300))
    assert all(always.factor(r, t) >= 2.0 for r in range(4) for t in range(300))


def test_random_rate_is_close_to_probability():
    s = RandomSchedule(7, 0.25, 2.0, 4.0, 5, 5, 10)
    events = s.events_until(8, 10 * 1000)
    assert abs(len(events) / (8 * 1000) - 0.25) < 0.03


def test_added_delay_closed_form():
    assert added_delay_s(1.0, 0.5, 0.0, 32) == 0.0
    assert added_delay_s(3.0, 0.010, 0.0, 32) == pytest.approx(0.020)
    # emulated device time scales with the factor: 2 x 5 ms x 32 samples, plus (2-1) x 10 ms of real compute
    assert added_delay_s(2.0, 0.010, 5.0, 32) == pytest.approx(0.010 + 0.320)


def test_trace_schedule_is_a_pure_function_of_seed_rank_step():
    from lightning_straggler.policies.injection import TraceSchedule

    args = (3, 1.5, 60, 20, 300, 1.5, 6.0)
    forward, backward = TraceSchedule(*args), TraceSchedule(*args)
    steps = range(0, 2000, 7)
    a = [forward.factor(r, s) for r in range(4) for s in steps]
    b = [backward.factor(r, s) for r in reversed(range(4)) for s in reversed(steps)]
    assert a == [x for r in range(4) for x in reversed(b[(3 - r) * len(steps):(4 - r) * len(steps)])]
    assert any(f > 1 for f in a)
    with pytest.raises(ValueError, match="gap_min >= 1"):
        TraceSchedule(0, 1.5, 0, 0, 10, 1.5, 6.0)  # would never advance
    assert [TraceSchedule(s, *args[1:]).events_until(1, 2000) for s in (3, 4)][0] != \
        TraceSchedule(4, *args[1:]).events_until(1, 2000)


def test_trace_schedule_episodes_are_heavy_tailed_within_their_bounds():
    from lightning_straggler.policies.injection import TraceSchedule

    t = TraceSchedule(0, 1.5, 60, 20, 300, 1.5, 6.0)
    events = t.events_until(64, 5000)
    lengths = np.array([e.end_step - e.start_step for e in events])
    assert len(events) > 1000
    assert lengths.min() >= 20 and lengths.max() <= 300
    assert all(1.5 <= e.factor <= 6.0 for e in events)
    # Pareto(1.5) above its minimum: P(L > 4 x min) = 4^-1.5 = 1/8, P(L > 10 x min) = 10^-1.5 = 3.2% (then capped)
    assert abs(np.mean(lengths > 80) - 0.125) < 0.03
    assert 0.015 < np.mean(lengths >= 200) < 0.05
    # per rank the episodes do not overlap and gaps are at least gap_min
    for rank in range(4):
        own = [e for e in events if e.rank == rank]
        assert own[0].start_step >= 60
        assert all(b.start_step - a.end_step >= 60 for a, b in zip(own, own[1:]))


def test_trace_settings_are_checked_by_name():
    from lightning_straggler.config import ConfigError, StragglerConfig

    StragglerConfig(scenario="trace").validate(4)
    for bad, name in (({"tail_index": 0.1}, "straggler.tail_index"), ({"gap_min": 0}, "straggler.gap_min"),
                      ({"duration_max": 5}, "straggler.duration_max"), ({"factor_min": 0.5}, "straggler.factor_min")):
        with pytest.raises(ConfigError, match=name):
            StragglerConfig(scenario="trace", **bad).validate(4)
    assert StragglerConfig(scenario="trace").schedule().describe()["scenario"] == "trace"


def test_the_simulator_lays_a_trace_onto_its_factor_matrix_exactly():
    from lightning_straggler.policies.injection import TraceSchedule
    from lightning_straggler.sim import factor_matrix

    t = TraceSchedule(1, 1.3, 30, 10, 200, 1.5, 6.0)
    bulk = factor_matrix(t, 6, 700)
    assert (bulk > 1).any()
    assert bulk.tolist() == [[TraceSchedule(1, 1.3, 30, 10, 200, 1.5, 6.0).factor(r, s) for s in range(700)]
                             for r in range(6)]


def test_the_injector_stretches_the_batch_s_compute_not_the_strategy_s_wait_at_its_start(monkeypatch):
    """Lightning calls the strategy's batch-start hook after the callbacks': a dpar/awar boundary there (a
    join, a hold for the group) is waiting. It used to count as the rank's compute, stretched (f - 1) x."""
    import types

    import torch

    from lightning_straggler.callbacks import injector as injector_module
    from lightning_straggler.callbacks import StragglerInjector

    now, slept = [100.0], []
    clock = types.SimpleNamespace(perf_counter=lambda: now[0], sleep=lambda s: (slept.append(s), now.__setitem__(0, now[0] + s)))
    monkeypatch.setattr(injector_module, "time", clock)
    strategy = types.SimpleNamespace(skip_this_batch=lambda: False, steps_done=0, batch_compute_started=0.0)
    trainer = types.SimpleNamespace(strategy=strategy, global_rank=1, global_step=0)
    injector = StragglerInjector(StaticSchedule([1.0, 4.0]), device_ms_per_sample=1.0)
    injector.on_train_batch_start(trainer, None, (torch.zeros(8, 3), torch.zeros(8)), 0)
    now[0] += 0.5  # the strategy's boundary wait
    strategy.batch_compute_started = now[0]
    now[0] += 0.02  # forward + backward
    injector.on_after_backward(trainer, None)
    assert slept == [pytest.approx(3 * 0.02 + 4 * 1.0 * 8 / 1000)]  # (4 - 1) x 20 ms + 4 x 8 ms of device time
    assert injector.longest_s == pytest.approx(0.02 + slept[0])
    # without a strategy that says when its work ended (Lightning's ddp), the batch's start it is
    del strategy.batch_compute_started
    injector.on_train_batch_start(trainer, None, (torch.zeros(8, 3), torch.zeros(8)), 1)
    now[0] += 0.02
    injector.on_after_backward(trainer, None)
    assert slept[1] == pytest.approx(3 * 0.02 + 4 * 1.0 * 8 / 1000)
