"""BOA's data plumbing: every sample exactly once per epoch under changing allocations."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_straggler.policies.boa_schedule import AllocationSchedule, epoch_permutation, rank_slice
from lightning_straggler.strategies.boa import GlobalBatchSampler


@st.composite
def allocations(draw):
    n = draw(st.integers(1, 6))
    total = draw(st.integers(n, 40))

    def split():
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=n - 1, max_size=n - 1)))
        return [b - a for a, b in zip([0] + cuts, cuts + [total])]

    changes = [(draw(st.integers(0, 30)), split()) for _ in range(draw(st.integers(0, 4)))]
    return n, total, split(), sorted(changes, key=lambda c: c[0])


@settings(max_examples=60, deadline=None)
@given(allocations(), st.integers(50, 400), st.integers(0, 3))
def test_every_sample_exactly_once_per_epoch_whatever_the_allocation(alloc, num_samples, epochs):
    n, total, initial, changes = alloc
    schedule = AllocationSchedule(initial)
    for step, sizes in changes:
        schedule.change(step, sizes)
    samplers = [GlobalBatchSampler(num_samples, r, schedule, seed=5) for r in range(n)]
    for epoch in range(epochs + 1):
        for s in samplers:
            s.set_epoch(epoch)
        per_rank = [list(iter(s)) for s in samplers]
        assert len({len(batches) for batches in per_rank}) == 1  # lock-step: same number of steps
        steps = len(per_rank[0])
        assert steps == num_samples // total
        used = []
        for k in range(steps):
            start_step = epoch * steps + k
            sizes = schedule.at(start_step)
            for r in range(n):
                if sizes[r] > 0:
                    assert len(per_rank[r][k]) == sizes[r]
                    used += per_rank[r][k]
                else:
                    assert len(per_rank[r][k]) == 1  # placeholder, weight 0
        assert sorted(used) == sorted(epoch_permutation(num_samples, 5, epoch)[:steps * total])
        assert len(set(used)) == len(used)


def test_weights_are_shares_of_the_global_batch():
    s = AllocationSchedule([4, 8, 12, 8])
    assert [s.weight(r, 0) for r in range(4)] == [4 / 32, 8 / 32, 12 / 32, 8 / 32]
    s.change(5, [10, 10, 12, 0])
    assert s.at(4) == (4, 8, 12, 8) and s.at(5) == (10, 10, 12, 0) and s.weight(3, 9) == 0.0


def test_bad_allocations_are_refused():
    with pytest.raises(ValueError, match="global batch"):
        AllocationSchedule([4, 4]).change(3, [4, 5])
    with pytest.raises(ValueError, match=">= 0"):
        AllocationSchedule([4, -1])
    s = AllocationSchedule([4, 4])
    s.change(5, [6, 2])
    with pytest.raises(ValueError, match="step order"):
        s.change(3, [2, 6])


def test_rank_slice_concatenates_to_the_global_batch():
    perm = list(range(100, 200))
    sizes = [3, 0, 5, 2]
    pieces = [rank_slice(perm, 2, sizes, r) for r in range(4)]
    assert pieces[1] == ([perm[20]], True)
    assert pieces[0][0] + pieces[2][0] + pieces[3][0] == perm[20:30]


def test_time_model_does_not_turn_settled_noise_into_a_free_worker():
    from lightning_straggler.policies.boa import time_model_from_points

    # a settled allocation: batch sizes 44..46, noisy times around 5 ms/sample
    settled = [(44, 0.230), (45, 0.221), (46, 0.226), (45, 0.229)]
    m = time_model_from_points(settled, 45)
    assert m.intercept_s == 0.0 and m.per_sample_s > 0.004
    # well-spread sizes: the least-squares line (10 ms + 2 ms/sample) is kept
    spread = [(8, 0.026), (16, 0.042), (32, 0.074)]
    m = time_model_from_points(spread, 16)
    assert abs(m.intercept_s - 0.010) < 1e-3 and abs(m.per_sample_s - 0.002) < 1e-4
