import pytest

from lightning_straggler.profiling import StepRecord, StepRecorder, format_table, split_wait, summarise


def rec(rank, step, compute, comm, leader=0, samples=32):
    return StepRecord(rank, step, 1000.0 + step, compute, comm, samples, leader)


def test_wait_is_comm_beyond_the_last_arriver_in_the_same_group():
    # rank 2 arrives last (slow compute) and only transfers: 5 ms; the others waited for it.
    records = [rec(0, 0, 0.010, 0.045), rec(1, 0, 0.020, 0.035), rec(2, 0, 0.050, 0.005)]
    wait = split_wait(records)
    assert wait[(0, 0)] == pytest.approx(0.040)
    assert wait[(1, 0)] == pytest.approx(0.030)
    assert wait[(2, 0)] == pytest.approx(0.0)


def test_groups_of_one_step_are_separate():
    # ranks 0,1 in one group, ranks 2,3 in another: waits are relative to each group's fastest
    records = [rec(0, 0, 0.01, 0.03, 0), rec(1, 0, 0.01, 0.01, 0), rec(2, 0, 0.01, 0.05, 2), rec(3, 0, 0.01, 0.02, 2)]
    wait = split_wait(records)
    assert wait[(0, 0)] == pytest.approx(0.02) and wait[(1, 0)] == 0
    assert wait[(2, 0)] == pytest.approx(0.03) and wait[(3, 0)] == 0


def test_summarise_totals_and_percentiles():
    records = [rec(r, s, 0.01 * (s + 1), 0.002, samples=10) for r in range(2) for s in range(10)]
    out = summarise(records)
    assert set(out) == {0, 1}
    s0 = out[0]
    assert s0["steps"] == 10 and s0["samples"] == 100
    assert s0["compute_s"]["total"] == pytest.approx(sum(0.01 * (s + 1) for s in range(10)))
    assert s0["compute_s"]["p50"] == pytest.approx(0.055)
    assert s0["compute_s"]["mean"] == pytest.approx(0.055)
    assert s0["wait_s"]["total"] == pytest.approx(0.0)
    assert s0["comm_s"]["total"] == pytest.approx(0.02)
    table = format_table(out)
    assert "rank" in table and len(table.splitlines()) == 4


def test_row_round_trip():
    r = rec(3, 17, 0.1, 0.2, leader=1, samples=7)
    assert StepRecord.from_row(r.as_row()) == r


def test_recorder_phases_with_a_fake_clock():
    now = [0.0]
    recorder = StepRecorder(rank=2, clock=lambda: now[0], wall=lambda: 500.0 + now[0])
    recorder.begin_batch(16)
    now[0] = 0.3
    recorder.begin_batch(16)  # gradient accumulation: the step spans two batches
    now[0] = 0.5
    recorder.mark_compute_end()
    recorder.add_comm(0.1)
    r = recorder.end_step(step=0, group_leader=0)
    assert (r.rank, r.step, r.samples, r.group_leader) == (2, 0, 32, 0)
    assert r.compute_s == pytest.approx(0.5) and r.comm_s == pytest.approx(0.1) and r.start_s == 500.0
    assert recorder.take_unsent() == [r] and recorder.take_unsent() == []
    assert recorder.end_step(step=1) is None  # no batch began
