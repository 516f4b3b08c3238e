"""adaptive's step deadline: the rule (policies/deadline.py), the protocol (comm/deadline.py) in a fake
world of threads under randomised straggler schedules, and real Horovod workers at 4 and 8 ranks."""
from __future__ import annotations

import random
import time

import pytest
import torch

from lightning_straggler.comm.deadline import DeadlineExchange
from lightning_straggler.comm.fake import FakeWorld
from lightning_straggler.policies import deadline as rule


# --- the rule ------------------------------------------------------------------------------------
def test_no_deadline_until_enough_periods_then_factor_times_their_median():
    d = rule.StepDeadline(factor=3.0, history_steps=6)
    for period in (0.1, 0.1, 0.1, 0.1):
        d.observe(period)
        assert d.seconds() is None
    d.observe(0.5)  # one long step (a validation between two) does not move the median
    assert d.seconds() == pytest.approx(0.3)
    for period in (0.2,) * 6:  # the window keeps the last history_steps periods only
        d.observe(period)
    assert d.seconds() == pytest.approx(0.6)
    d.restore(d.to_dict())
    assert d.seconds() == pytest.approx(0.6)
    off = rule.StepDeadline(factor=0)
    for _ in range(10):
        off.observe(0.1)
    assert not off.enabled and off.seconds() is None
    tiny = rule.StepDeadline(factor=2.0)
    for _ in range(5):
        tiny.observe(1e-5)
    assert tiny.seconds() == rule.MIN_DEADLINE_S


def test_arrived_gradients_are_weighted_by_their_samples():
    assert rule.arrived_scale([8, 8, 16], [True, True, True]) == 1.0
    assert rule.arrived_scale([8, 8, 16], [True, False, True]) == pytest.approx(32 / 24)
    assert rule.arrived_scale([8, 0, 24], [False, True, False]) is None  # the only arrival had no samples
    # the scaled BOA sum is the mean gradient over the arrived samples
    grads, sizes, arrived = [1.0, 5.0, 2.0], [8, 8, 16], [True, False, True]
    boa_sum = sum(g * b / sum(sizes) for g, b, a in zip(grads, sizes, arrived) if a)
    mean = sum(g * b for g, b, a in zip(grads, sizes, arrived) if a) / sum(b for b, a in zip(sizes, arrived) if a)
    assert boa_sum * rule.arrived_scale(sizes, arrived) == pytest.approx(mean)


@pytest.mark.parametrize("factor, history, words", [(0.5, 20, "deadline_factor"), (1.0, 20, "deadline_factor"),
                                                     (2000, 20, "deadline_factor"), (True, 20, "deadline_factor"),
                                                     (3.0, 4, "deadline_history_steps")])
def test_bad_settings_name_the_setting_and_the_range(factor, history, words):
    with pytest.raises(ValueError, match=words) as info:
        rule.check_settings(factor, history)
    assert ("(1, 1000]" in str(info.value)) if words == "deadline_factor" else (">= 5" in str(info.value))


def test_the_config_refuses_a_bad_deadline_naming_the_setting(compose):
    from lightning_straggler.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"algorithm\.deadline_factor.*\(1, 1000\]"):
        load_config(compose("algorithm=adaptive", "algorithm.deadline_factor=0.5"))
    assert load_config(compose("algorithm=adaptive")).algorithm.deadline_factor == rule.DEFAULT_FACTOR


def test_a_cut_ranks_lower_bound_is_amended_with_its_real_time():
    from lightning_straggler.policies.adaptive import SpeedChangeDetector

    d = SpeedChangeDetector(2, react_steps=2, ratio=1.5, history_steps=5)
    d.observe([8, 8], [0.08, 0.08])
    d.observe([8, 8], [0.08, 0.3])  # rank 1 cut: 0.3 s is what it had been given
    d.amend_last(1, 0.8)  # its real time, sent with the next step
    assert d.points()[1][-1] == (8.0, 0.8) and d.points()[0][-1] == (8.0, 0.08)
    empty = SpeedChangeDetector(1)
    empty.amend_last(0, 1.0)  # nothing observed yet: nothing to amend
    assert empty.points() == [[]]


# --- the protocol, one thread per rank -------------------------------------------------------------
def _run_protocol(world: int, steps: int, compute_s, deadline_s, timeout_s: float = 120.0):
    """Every rank: arm the step, compute (sleep) unless already cut, exchange [its value, arrival slots]."""
    def body(comm):
        rank = comm.rank
        comm.barrier()  # the first anchor: a collective every rank has left

        def zeros_for(step, waited_s):
            return [torch.zeros(3), torch.zeros(world)]

        exchange = DeadlineExchange(comm, zeros_for)
        rows = []
        try:
            for step in range(steps):
                cut_at_start = exchange.arm(step, deadline_s(step))
                if not cut_at_start:
                    time.sleep(compute_s(rank, step))
                mine = torch.full((3,), float(rank + 1) * (step + 1))
                arrived = torch.zeros(world)
                arrived[rank] = 1.0
                result, cut = exchange.exchange(step, [mine, arrived])
                rows.append((step, result[0].clone(), result[1].clone(), cut, cut_at_start))
        finally:
            exchange.close()
        return rows

    return FakeWorld(world, timeout_s=timeout_s).run(body)


@pytest.mark.parametrize("world, seed", [(4, 0), (4, 1), (8, 2)])
def test_random_straggler_schedules_finish_with_one_result_per_step_on_every_rank(world, seed):
    """Ranks slow down at random (some far past the deadline, some just around it, which races the
    helper against the main thread); quiet steps have a generous deadline. Every step completes on every
    rank with the same sum, which is the sum of exactly the ranks that arrived; a rank is cut iff its slot
    says it did not arrive; ranks still computing when a step opens are cut at its start (they catch up)."""
    rng = random.Random(seed)
    steps, short = 24, 0.03
    quiet = {s for s in range(steps) if rng.random() < 0.3}
    plan = {(r, s): (0.25 if rng.random() < 0.15 else rng.choice([0.0, 0.0, 0.02, 0.03, 0.04]))
            for r in range(world) for s in range(steps)}
    for s in quiet:
        for r in range(world):
            plan[r, s] = 0.0
    out = _run_protocol(world, steps, lambda r, s: plan[r, s], lambda s: 5.0 if s in quiet else short)
    for step in range(steps):
        sums = {tuple(out[r][step][1].tolist()) for r in range(world)}
        slots = {tuple(out[r][step][2].tolist()) for r in range(world)}
        assert len(sums) == 1 and len(slots) == 1, (step, sums, slots)
        arrived = [a > 0.5 for a in out[0][step][2].tolist()]
        want = sum((r + 1) * (step + 1) for r in range(world) if arrived[r])
        assert out[0][step][1].tolist() == [float(want)] * 3
        assert [out[r][step][3] for r in range(world)] == [not a for a in arrived]
        if step in quiet:
            assert all(arrived), step  # 5 s of deadline: nobody is cut
    cut_steps = [(r, s) for r in range(world) for s in range(steps) if out[r][s][3]]
    assert cut_steps, "no rank was ever cut: the schedule did not exercise the deadline"
    # a rank 0.25 s late (8x the deadline) on a non-quiet step is cut there; ranks that start a step already
    # past its deadline (still computing when the group's previous step closed) are cut at once and skip it
    late = [(r, s) for (r, s), t in plan.items() if t == 0.25 and s not in quiet]
    assert late and all(out[r][s][3] or out[r][s][4] for r, s in late)
    assert any(out[r][s][4] for r in range(world) for s in range(steps))


def test_a_step_every_rank_misses_completes_with_nothing_arrived():
    out = _run_protocol(4, 3, lambda r, s: 0.3 if s == 1 else 0.0, lambda s: 5.0 if s != 1 else 0.02)
    assert [row[3] for row in (out[r][1] for r in range(4))] == [True] * 4
    assert out[0][1][1].tolist() == [0.0] * 3 and out[0][1][2].tolist() == [0.0] * 4
    assert [out[r][2][3] for r in range(4)] == [False] * 4  # the next (quiet) step: everyone on time


def test_handing_a_step_in_twice_is_refused():
    def body(comm):
        comm.barrier()
        exchange = DeadlineExchange(comm, lambda step, waited: [torch.zeros(1)])
        try:
            exchange.exchange(0, [torch.ones(1)])
            with pytest.raises(RuntimeError, match="step 0 handed in twice"):
                exchange.exchange(0, [torch.ones(1)])
        finally:
            exchange.close()
        return True

    assert FakeWorld(2, timeout_s=30).run(body) == [True, True]


@pytest.mark.parametrize("validated", [False, True])
def test_a_step_after_a_validation_counts_its_deadline_from_the_validation_end(validated):
    """0.2 s between the group's last collective and the step (a validation that ended with none): with
    the validation's end as the anchor the step is open (0.1 s deadline); without it, it is cut at once."""
    def body(comm):
        comm.barrier()
        exchange = DeadlineExchange(comm, lambda step, waited: [torch.zeros(1)])
        try:
            time.sleep(0.2)
            cut_at_start = exchange.arm(0, 0.1, not_before=time.monotonic() if validated else 0.0)
            result, cut = exchange.exchange(0, [torch.ones(1)])
            return cut_at_start, cut, result[0].item()
        finally:
            exchange.close()

    want = (False, False, 2.0) if validated else (True, True, 0.0)
    assert FakeWorld(2, timeout_s=30).run(body) == [want, want]
