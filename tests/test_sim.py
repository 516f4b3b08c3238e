"""The scale simulator against closed forms and against the policies it must defer to (no processes)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from lightning_straggler.policies import boa as boa_policy
from lightning_straggler.policies import injection as inj
from lightning_straggler.sim import (
    ETHERNET_25G,
    FREE,
    INFINIBAND_200G,
    Network,
    Workload,
    factor_matrix,
    simulate,
)
from lightning_straggler.policies.boa import rebalance_decision

MIX = [1.0, 1.0, 1.0, 1 / 0.6, 1 / 0.6, 1 / 0.6, 1 / 0.3, 1 / 0.3]


def workload(n=8, straggler=None, **kw):
    base = {"world_size": n, "batch_per_worker": 32, "per_sample_s": 2e-3, "steps": 120, "grad_bytes": 4e6, "straggler": straggler}
    base.update(kw)
    return Workload(**base)



def rank0_slow_in_step0():
    """8 workers, 4 steps, rank 0 50 x slow in step 0 only (the dssync straggler tests)."""
    return workload(8, {"scenario": "transient", "events": [{"rank": 0, "factor": 50.0, "start_step": 0, "end_step": 1}]},
                    steps=4, steps_per_epoch=0)

def test_network_formulas_and_single_worker_costs_nothing():
    net = Network("t", alpha_s=1e-5, beta_s_per_byte=1e-9)
    assert net.allreduce_s(8, 1e6) == pytest.approx(2 * 7 * 1e-5 + 2 * 7 / 8 * 1e6 * 1e-9)
    assert net.allgather_s(4, 100) == pytest.approx(3 * (1e-5 + 100e-9))
    assert net.broadcast_s(5, 1e6) == pytest.approx(3 * 1e-5 + 1e-3)
    assert net.allreduce_s(1, 1e9) == net.broadcast_s(1, 1e9) == net.allgather_s(1, 1e9) == 0.0
    assert ETHERNET_25G.beta_s_per_byte == pytest.approx(8 / 25e9)
    assert INFINIBAND_200G.beta_s_per_byte == pytest.approx(8 / 200e9)


@pytest.mark.parametrize("n", [2, 8, 64])
def test_ring_without_stragglers_is_compute_plus_allreduce(n):
    w = workload(n, overhead_s=0.004, loop_overhead_s=0.001, grad_bytes=102.4e6)
    net = ETHERNET_25G
    compute = 0.004 + 2e-3 * 32
    allreduce = 2 * (n - 1) * net.alpha_s + 2 * (n - 1) / n * 102.4e6 * net.beta_s_per_byte
    result = simulate("ring", w, net)
    assert np.allclose(result.step_times_s, compute + allreduce + 0.001)
    assert result.throughput_samples_per_s == pytest.approx(n * 32 / (compute + allreduce + 0.001))


def test_factor_matrix_equals_the_schedule_pointwise():
    schedules = [inj.StaticSchedule([1.0, 3.0]),
                 inj.TransientSchedule([inj.SlowdownEvent(1, 4.0, 5, 9), inj.SlowdownEvent(1, 2.0, 7, None)]),
                 inj.RandomSchedule(3, 0.4, 2.0, 5.0, 2, 9, 5)]
    for schedule in schedules:
        f = factor_matrix(schedule, 4, 40)
        expected = np.array([[schedule.factor(r, s) for s in range(40)] for r in range(4)])
        assert np.array_equal(f, expected), schedule.describe()


def test_boa_settles_on_the_solver_step_time_for_a_static_mix():
    w = workload(8, {"scenario": "static", "factors": MIX}, steps=60)
    result = simulate("boa", w, FREE, window_steps=10)
    models = [boa_policy.LinearTimeModel(0.0, f * 2e-3) for f in MIX]
    best = boa_policy.plan(models, 8 * 32)
    assert result.events, "boa never re-planned under a static mix"
    assert result.events[-1]["batch_sizes"] == best.batch_sizes
    assert result.step_times_s[-1] == pytest.approx(best.predicted_step_time_s, rel=1e-9)
    assert best.predicted_step_time_s < max(MIX) * 32 * 2e-3  # and it is a real gain over the even split


def test_backup_with_zero_backups_is_ring_and_one_backup_hides_one_straggler():
    scenario = {"scenario": "random", "seed": 1, "probability": 0.3, "factor_min": 2, "factor_max": 6,
                "duration_min": 3, "duration_max": 10, "window_steps": 10}
    w = workload(8, scenario, jitter_cv=0.05)
    ring, backup0 = simulate("ring", w, ETHERNET_25G), simulate("backup", w, ETHERNET_25G, backups=0)
    assert np.array_equal(ring.step_times_s, backup0.step_times_s)
    assert backup0.train_samples == ring.train_samples
    slow = workload(8, {"scenario": "static", "factors": [1.0] * 7 + [10.0]})
    backup1 = simulate("backup", slow, ETHERNET_25G, backups=1)
    step = 2e-3 * 32 + ETHERNET_25G.allreduce_s(8, 4e6)
    assert backup1.throughput_samples_per_s == pytest.approx(7 * 32 / step)


def test_dpar_strikes_out_a_permanent_heavy_straggler_and_approaches_the_smaller_ring():
    n = 8
    w = workload(n, {"scenario": "static", "factors": [1.0] * (n - 1) + [20.0]}, steps=400)
    result = simulate("dpar", w, INFINIBAND_200G)
    last = {}
    for e in result.events:
        if e["kind"] == "transition":
            last[e["rank"]] = e["to_state"]
    assert last == {n - 1: "struck_out"}
    reference = simulate("ring", workload(n - 1, steps=400), INFINIBAND_200G).throughput_samples_per_s
    assert result.tail_throughput() == pytest.approx(reference, rel=0.03)
    assert result.tail_throughput() > 5 * simulate("ring", w, INFINIBAND_200G).throughput_samples_per_s


def test_awar_merge_weights_are_the_normalised_updates():
    events = [inj.SlowdownEvent(2, 6.0, 10, 70)]
    w = workload(4, inj.TransientSchedule(events), steps=100)
    result = simulate("awar", w, ETHERNET_25G, period_steps=20)
    averages = [e for e in result.events if e["kind"] == "average"]
    assert averages, "the straggler was never classified out"
    for e in averages:
        assert sum(e["weights"]) == pytest.approx(1.0)
        total = sum(e["updates"])
        assert e["weights"] == pytest.approx([u / total for u in e["updates"]])
        assert e["stragglers"] == [2]
        assert e["updates"][2] <= e["updates"][0]
    assert averages[0]["updates"][2] < averages[0]["updates"][0]  # while slow it contributed fewer local steps


def test_async_throughput_is_the_sum_of_the_workers_rates():
    w = workload(6, {"scenario": "static", "factors": [1.0, 2.0, 3.0, 1.0, 5.0, 1.5]}, overhead_s=0.01)
    rates = [32 / (f * (0.01 + 2e-3 * 32)) for f in [1.0, 2.0, 3.0, 1.0, 5.0, 1.5]]
    result = simulate("async", w, FREE)
    assert result.throughput_samples_per_s == pytest.approx(sum(rates))
    assert result.efficiency == pytest.approx(1.0)


def test_dssync_with_one_group_of_everyone_is_ring():
    w = workload(4, {"scenario": "static", "factors": [1.0, 1.0, 2.0, 1.0]}, jitter_cv=0.1, steps_per_epoch=30)
    ring, dssync = simulate("ring", w, ETHERNET_25G), simulate("dssync", w, ETHERNET_25G, group_size=4)
    assert dssync.wall_s == pytest.approx(ring.wall_s)


def test_dssync_contains_a_straggler_to_its_group_for_one_step():
    # rank 0 is 50x slow in step 0 only; butterfly pairs of 2: step 0 (0,1)(2,3)..., step 1 (0,2)(1,3)...
    w = rank0_slow_in_step0()
    step = 32 * 2e-3
    end = simulate("dssync", w, FREE, group_size=2).rank_step_end_s
    # step 0: only rank 0's partner waits for it; the other six finish at full speed
    assert end[0, :2] == pytest.approx([50 * step] * 2) and end[0, 2:] == pytest.approx([step] * 6)
    # step 1: the delay reaches the partners of ranks 0 and 1 (2 and 3), not ranks 4-7
    assert end[1, :4] == pytest.approx([51 * step] * 4) and end[1, 4:] == pytest.approx([2 * step] * 4)
    # ring: every rank waits in step 0; by the last step dssync's delay has reached everyone, so the
    # run ends at the same time
    ring = simulate("ring", w, FREE)
    assert ring.wall_s == pytest.approx(53 * step)
    assert end[-1] == pytest.approx([53 * step] * 8)


def test_dssync_alltoall_exchange_holds_everyone_for_a_straggler_and_costs_a_pairs_bytes():
    # the straggler of the test above: with one world all-to-all per step every rank waits for it at once
    w = rank0_slow_in_step0()
    step = 32 * 2e-3
    end = simulate("dssync", w, FREE, group_size=2, exchange="alltoall").rank_step_end_s
    assert end[0] == pytest.approx([50 * step] * 8) and end[-1] == pytest.approx([53 * step] * 8)
    # a pair moves its model once each way (full duplex) after a round for the counts: a pair's all-reduce
    net = Network("n", alpha_s=1e-4, beta_s_per_byte=1e-9)
    assert net.group_alltoall_s(2, 4e6) == pytest.approx(net.allreduce_s(2, 4e6))
    assert net.group_alltoall_s(4, 4e6) == pytest.approx(2e-4 + 3 * 4e6 * 1e-9)  # each sends to 3 others
    assert net.group_alltoall_s(1, 4e6) == 0.0
    # groups of one exchange nothing: no world-wide wait either (the strategy runs no all-to-all then)
    alone = simulate("dssync", w, FREE, group_size=1, exchange="alltoall").rank_step_end_s
    assert alone[0, 1:] == pytest.approx([step] * 7)  # step 0: only rank 0 paid for its slow step
    with pytest.raises(ValueError, match="exchange must be one of sets, aligned, alltoall, direct"):
        simulate("dssync", w, FREE, exchange="ring")


def test_dssync_aligned_exchange_holds_everyone_for_a_straggler_then_starts_every_pair_together():
    w = rank0_slow_in_step0()
    step = 32 * 2e-3
    end = simulate("dssync", w, FREE, group_size=2, exchange="aligned").rank_step_end_s
    assert end[0] == pytest.approx([50 * step] * 8) and end[-1] == pytest.approx([53 * step] * 8)
    # with a network: the one-value world all-reduce, then a pair's all-reduce, every pair at once
    net = Network("n", alpha_s=1e-4, beta_s_per_byte=1e-9)
    quiet = workload(8, steps=3, steps_per_epoch=0)
    ends = simulate("dssync", quiet, net, group_size=2, exchange="aligned").rank_step_end_s
    per_step = 32 * 2e-3 + net.allreduce_s(8, 4) + net.allreduce_s(2, quiet.grad_bytes)
    assert ends[1] == pytest.approx([2 * per_step] * 8)  # (the last step adds the end's global average)
    # groups of one exchange nothing and align nothing
    alone = simulate("dssync", w, FREE, group_size=1, exchange="aligned").rank_step_end_s
    assert alone[0, 1:] == pytest.approx([step] * 7)


def test_the_strategy_decides_with_the_policy_on_its_gathered_records():
    """BoaStrategy._decide sorts rank 0's gathered (rank, batch, seconds) rows per rank and takes the policy's
    decision (the simulator calls the same policy), adding the step it applies from."""
    from lightning_straggler.policies.boa_schedule import AllocationSchedule
    from lightning_straggler.strategies.boa import BoaStrategy

    rng = np.random.default_rng(0)
    n, total = 5, 160
    current = [32] * n
    points = [[(32.0, float(f * 32 * 1e-3 * (1 + 0.02 * rng.standard_normal()))) for _ in range(10)]
              for f in [1.0, 1.0, 1.7, 3.3, 1.2]]
    ours = rebalance_decision(points, current, total, rebalance_gain=0.05)
    # two windows, every window's rows interleaved by rank as the all-gather returns them
    windows = [[(float(i), b, t) for i in range(n) for b, t in points[i][w * 5:(w + 1) * 5]] for w in range(2)]
    stub = SimpleNamespace(world_size=n, _points=windows, schedule=AllocationSchedule(current),
                           _allreduce_cost_s=lambda: 0.0, min_local_batch=1, max_local_batch=0, tune_workers=False,
                           rebalance_gain=0.05)
    stub.plan_from = lambda pts, from_step: BoaStrategy.plan_from(stub, pts, from_step)
    theirs = BoaStrategy._decide(stub, 12)
    assert ours is not None and theirs is not None
    assert theirs["from_step"] == 12
    assert theirs["batch_sizes"] == ours["batch_sizes"] and sum(ours["batch_sizes"]) == total
    assert ours["batch_sizes"][3] < 32 < ours["batch_sizes"][0]  # the 3.3x slow rank gives samples away
    assert theirs["predicted_gain"] == ours["predicted_gain"] > 0.05
    assert theirs["models"] == [{"intercept_s": m.intercept_s, "per_sample_s": m.per_sample_s} for m in ours["models"]]


def test_counted_samples_follow_the_summary_rules():
    w = workload(8, {"scenario": "static", "factors": [1.0] * 7 + [20.0]}, steps=200)
    dpar, awar = simulate("dpar", w, FREE), simulate("awar", w, FREE)
    # dpar discards the excluded worker's local steps; awar keeps them (they enter the weighted average)
    assert dpar.train_samples <= 8 * 32 * 200 - 32 * (200 - 20)
    assert awar.train_samples > 7 * 32 * 200
    assert not math.isnan(dpar.efficiency) and 0 < dpar.efficiency <= 1.0


# --- explicit protocol costs (control calls, state broadcast, merges, process sets) -------------------
CONTROLLED = Network("controlled", 1e-4, 1e-9, control_op_s=5e-3)


@pytest.mark.parametrize("algorithm,window_key", [("dpar", "window_steps"), ("awar", "period_steps")])
@pytest.mark.parametrize("n", [4, 8])
def test_partial_group_without_stragglers_costs_what_ring_costs(algorithm, window_key, n):
    # window ends take their numbers from the step's gradient all-reduce: no boundary collective
    w = workload(n, steps=120)
    ring = simulate("ring", w, CONTROLLED)
    res = simulate(algorithm, w, CONTROLLED, **{window_key: 20})
    assert res.events == [] or all(e["kind"] != "transition" for e in res.events)
    assert res.wall_s == pytest.approx(ring.wall_s, rel=1e-12)


def test_control_calls_and_broadcast_object_closed_forms():
    net = CONTROLLED
    assert net.control_s(1, "broadcast", 1e6) == 0.0
    assert net.control_s(4, "allgather", 64, calls=3) == pytest.approx(3 * (net.allgather_s(4, 64) + 5e-3))
    assert net.broadcast_object_s(4, 1e6) == pytest.approx(net.broadcast_s(4, 8) + net.broadcast_s(4, 1e6) + 2 * 5e-3)


def test_dpar_state_broadcast_and_awar_merge_closed_forms():
    from lightning_straggler.sim.awar import merge_s
    from lightning_straggler.sim.dpar import state_broadcast_s

    w = workload(4, state_tensors=6, state_bytes=8e6)
    c, n = CONTROLLED.control_op_s, 4
    state = 6 * (CONTROLLED.broadcast_s(n, 4e6 / 6) + c) + CONTROLLED.broadcast_object_s(n, 4e6)
    assert state_broadcast_s(CONTROLLED, w) == pytest.approx(state)
    assert merge_s(CONTROLLED, w) == pytest.approx(CONTROLLED.allreduce_s(n, 4e6) + c + CONTROLLED.broadcast_object_s(n, 4e6))


def _costs(algorithm, w, **params):
    """Wall time with the control calls and alpha-beta minus the same run with control_op_s = 0."""
    free_ctrl = Network("x", CONTROLLED.alpha_s, CONTROLLED.beta_s_per_byte, 0.0)
    return simulate(algorithm, w, CONTROLLED, **params).wall_s - simulate(algorithm, w, free_ctrl, **params).wall_s


def test_dpar_pays_the_state_broadcast_while_someone_is_excluded_only_before_the_model_is_read():
    # rank 3 permanently 10x slow: excluded at the first boundary and never back; 6 boundaries in all
    # (window ends only: react_steps=0)
    w = workload(4, steps=120, straggler={"scenario": "static", "factors": [1, 1, 1, 10]}, state_tensors=6)
    res = simulate("dpar", w, CONTROLLED, window_steps=20, react_steps=0)
    assert any(e["kind"] == "transition" and e["step"] == 19 for e in res.events)
    c = CONTROLLED.control_op_s
    # from the second boundary on (rank 3 out): the allgather (1 call) and the signal (1 call); the first,
    # with everyone in, takes its numbers from the step's all-reduce. The state broadcast (6 tensors + 2 for
    # the optimizer object) only where the model is read next: the run's end (119); not at the exclusion
    # (rank 3 leaves holding the group's model) nor at mere window ends
    calls = 5 * 1 + 1 * 8 + 5 * 1
    assert _costs("dpar", w, window_steps=20, react_steps=0) == pytest.approx(calls * c, rel=1e-9)
    # with a validation after every 40th step the broadcast comes before each of them too (39, 79, 119)
    w = workload(4, steps=120, straggler={"scenario": "static", "factors": [1, 1, 1, 10]}, state_tensors=6,
                 val_every_steps=40)
    calls = 5 * 1 + 3 * 8 + 5 * 1
    assert _costs("dpar", w, window_steps=20, react_steps=0) == pytest.approx(calls * c, rel=1e-9)


def test_dpar_early_boundary_excludes_after_react_steps_and_costs_one_more_boundary():
    w = workload(4, steps=120, straggler={"scenario": "static", "factors": [1, 1, 1, 10]}, state_tensors=6)
    res = simulate("dpar", w, CONTROLLED, window_steps=20, react_steps=3)
    # slow from step 0: three slow steps (0, 1, 2) call a boundary after position 2, which excludes it
    assert [(e["kind"], e["step"]) for e in res.events][:2] == [("transition", 2), ("early_boundary", 2)]
    assert [e["step"] for e in res.events if e["kind"] == "early_boundary"] == [2]  # none while it is out
    c = CONTROLLED.control_op_s
    # boundaries 2, 19, 39, ..., 119: 7 allgathers, 6 signals (someone outside), one state broadcast (8 calls,
    # before the run's end)
    assert _costs("dpar", w, window_steps=20, react_steps=3) == pytest.approx((7 + 1 * 8 + 6) * c, rel=1e-9)
    # and the group stops waiting for the straggler 17 steps sooner than with window ends only
    late = simulate("dpar", w, CONTROLLED, window_steps=20, react_steps=0)
    assert res.wall_s < late.wall_s - 15 * 9 * w.base_step_s(w.batch_per_worker)


@pytest.mark.parametrize("algorithm", ["dpar", "awar"])
@pytest.mark.parametrize("n", [4, 8, 64, 1024])
def test_a_group_step_costs_a_ring_step_at_any_world_size(algorithm, n):
    # rank n-1 permanently 10x slow: out of the group from the first boundary on. Between boundaries the
    # group's step is the no-straggler ring step (the outside rank has joined and adds zeros to the
    # world's all-reduce); a membership change creates nothing, whatever the number of possible groups.
    window = {"dpar": "window_steps", "awar": "period_steps"}[algorithm]
    straggler = {"scenario": "static", "factors": [1.0] * (n - 1) + [10.0]}
    res = simulate(algorithm, workload(n, steps=60, straggler=straggler), CONTROLLED, **{window: 20})
    ring = simulate("ring", workload(n, steps=60), CONTROLLED)
    inner = [k for k in range(21, 59) if (k + 1) % 20 != 0 and k != 20]  # after the exclusion, not a boundary
    assert any(e.get("to_state") in ("slow", "straggler") for e in res.events)
    assert np.allclose(res.step_times_s[inner], ring.step_times_s[inner], rtol=1e-12)


def test_dssync_global_average_is_a_control_call():
    w = workload(4, steps=40)
    res = simulate("dssync", w, CONTROLLED, global_every_steps=10)
    globals_done = int(res.notes.split(", ")[-1].split()[0])
    assert globals_done == 4
    assert _costs("dssync", w, global_every_steps=10) == pytest.approx(globals_done * CONTROLLED.control_op_s, rel=1e-9)


def test_adaptive_replans_where_the_strategy_does_and_beats_boa_on_a_collapse():
    # rank 0 10x slow from step 30 (a fast worker collapsing): the detector sees its 2nd slow step (31), the
    # plan applies from 32, as AdaptiveStrategy's (tests/test_inprocess_strategies.py: 7 -> 8 there)
    strag = {"scenario": "transient", "events": [{"rank": 0, "factor": 10.0, "start_step": 30, "end_step": 90}]}
    w = workload(4, strag, steps=120)
    res = simulate("adaptive", w, INFINIBAND_200G, window_steps=0, deadline_factor=0)  # as the strategy's test
    first = [e for e in res.events if e["kind"] == "rebalance" and e["changed_ranks"]][0]
    assert (first["step"], first["from_step"], first["changed_ranks"]) == (31, 32, [0])
    assert first["batch_sizes"][0] < w.batch_per_worker
    boa = simulate("boa", w, INFINIBAND_200G)
    assert res.throughput_samples_per_s > 1.3 * boa.throughput_samples_per_s


def test_adaptive_deadline_cuts_a_collapsed_rank_and_its_samples_and_wins_over_waiting():
    """The same collapse with the step deadline (3x the step period): rank 0 is cut from its first slow
    step (every other rank hands in on time), the step no longer waits its 10x compute, the cut steps
    count the other ranks' samples only; the re-plan follows with the plan waiting gives (the real time
    amends the lower bound), and the run is faster than waiting."""
    strag = {"scenario": "transient", "events": [{"rank": 0, "factor": 10.0, "start_step": 30, "end_step": 90}]}
    w = workload(4, strag, steps=120)
    cut = simulate("adaptive", w, INFINIBAND_200G, window_steps=0, deadline_factor=3.0)
    wait = simulate("adaptive", w, INFINIBAND_200G, window_steps=0, deadline_factor=0)
    cuts = [e for e in cut.events if e["kind"] == "deadline_cut"]
    assert cuts and cuts[0]["step"] == 30 and all(e["ranks"] == [0] for e in cuts)
    assert not [e for e in wait.events if e["kind"] == "deadline_cut"]
    assert cut.step_times_s[30] < wait.step_times_s[30] / 2
    assert cut.step_samples[30] == 3 * w.batch_per_worker
    # the cut step's lower bound is amended with the real time at the next step: the same plan as waiting
    plans = [[e["batch_sizes"] for e in r.events if e["kind"] == "rebalance" and e["changed_ranks"] == [0]][0]
             for r in (cut, wait)]
    assert plans[0] == plans[1] and plans[0][0] < w.batch_per_worker
    assert cut.throughput_samples_per_s > wait.throughput_samples_per_s


@pytest.mark.parametrize("n", [4, 8])
def test_an_outside_rank_holding_for_the_boundary_saves_the_group_its_wait(n, monkeypatch):
    """A 4x transient straggler (steps 100-199 of 300) is out of dpar's group for several windows. With the
    hold (policies/boundary.outside_rank_holds, as the strategy) it starts no local step predicted to end
    after the group reaches a boundary, so the group does not wait there for it: the run is shorter by at
    least a quarter straggler step per hold, with the same samples trained; without the hold it computes
    more local steps, whose updates dpar discards anyway."""
    import lightning_straggler.sim.partial_group as protocol

    w = workload(n, steps=300, straggler={"scenario": "transient", "events": [
        {"rank": n - 1, "factor": 4.0, "start_step": 100, "end_step": 200}]})
    held = simulate("dpar", w, CONTROLLED, window_steps=20)
    monkeypatch.setattr(protocol, "outside_rank_holds", lambda *args: False)
    waited = simulate("dpar", w, CONTROLLED, window_steps=20)
    holds = waited.per_rank_steps[-1] - held.per_rank_steps[-1]
    assert holds >= 3  # one per window out, from the second on (the first window's period includes the slow steps)
    assert held.per_rank_steps[:-1] == waited.per_rank_steps[:-1] and held.train_samples == waited.train_samples
    straggler_step = 4 * w.base_step_s(w.batch_per_worker)
    assert held.wall_s < waited.wall_s - holds * straggler_step / 4
