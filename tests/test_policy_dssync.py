"""DS-Sync schedule: partitions, determinism, group sizes, mixing guarantees, process-set bound."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_straggler.policies.dssync import (
    DSSyncSchedule,
    chunk,
    chunk_sizes,
    mixing_matrix,
    steps_to_full_mixing,
)

FAST = settings(max_examples=100, deadline=None)
KINDS = ["butterfly", "random"]
POW2 = [(1 << n, 1 << b) for n in range(1, 7) for b in range(1, n + 1)]  # N in 2..64, g in 2..N


@st.composite
def configs(draw, max_world=64, min_group=1):
    world = draw(st.integers(max(1, min_group), max_world))
    group = draw(st.integers(min_group, world))
    kind = draw(st.sampled_from(KINDS))
    seed = draw(st.integers(0, 2**32 - 1))
    parts = draw(st.one_of(st.none(), st.integers(1, 6))) if kind == "random" else None
    return dict(world_size=world, group_size=group, kind=kind, num_partitions=parts, seed=seed)


def cycle(s: DSSyncSchedule):
    return [s.partition(t) for t in range(s.num_partitions)]


def expected_stages(n_workers: int, g: int) -> int:
    return math.ceil(math.log2(n_workers) / math.log2(g))


# --- every partition is a partition -------------------------------------------------------------

@FAST
@given(configs(), st.integers(0, 1000))
def test_partition_covers_every_worker_exactly_once(cfg, step):
    s = DSSyncSchedule(**cfg)
    part = s.partition(step)
    flat = [r for g in part for r in g]
    assert sorted(flat) == list(range(cfg["world_size"]))
    assert len(flat) == len(set(flat))
    assert all(isinstance(r, int) for r in flat)
    assert all(list(g) == sorted(g) for g in part)
    assert [g[0] for g in part] == sorted(g[0] for g in part)


@FAST
@given(configs())
def test_group_sizes_at_least_group_size(cfg):
    s = DSSyncSchedule(**cfg)
    g = cfg["group_size"]
    for part in cycle(s):
        assert all(len(grp) >= g for grp in part)
        assert len(part) <= cfg["world_size"] // g  # never more groups than N // g


@FAST
@given(configs())
def test_random_group_sizes_follow_remainder_rule(cfg):
    cfg = dict(cfg, kind="random")
    s = DSSyncSchedule(**cfg)
    n, g = cfg["world_size"], cfg["group_size"]
    k, r = divmod(n, g)
    for part in cycle(s):
        sizes = sorted(len(grp) for grp in part)
        assert len(sizes) == k
        assert sizes == sorted(chunk_sizes(n, g))
        assert max(sizes) <= g + math.ceil(r / k)


@FAST
@given(configs(), st.integers(0, 1000))
def test_group_of_matches_partition(cfg, step):
    s = DSSyncSchedule(**cfg)
    part = s.partition(step)
    for grp in part:
        for r in grp:
            assert s.group_of(r, step) == grp


@FAST
@given(configs(), st.integers(0, 1000))
def test_cycle_is_periodic(cfg, step):
    s = DSSyncSchedule(**cfg)
    assert s.partition(step) == s.partition(step + s.num_partitions) == s.partition(step % s.num_partitions)


# --- determinism ---------------------------------------------------------------------------------

@FAST
@given(configs())
def test_two_independent_schedules_agree(cfg):
    a, b = DSSyncSchedule(**cfg), DSSyncSchedule(**cfg)
    assert cycle(a) == cycle(b)
    assert a.all_groups() == b.all_groups()
    assert a.describe() == b.describe()
    # Order of queries must not matter (no hidden generator state).
    assert [b.partition(t) for t in reversed(range(b.num_partitions))] == cycle(a)[::-1]


def test_random_matches_reference_construction():
    # Pin the spec: partition i is default_rng([seed, i]).permutation(N), chunked by the remainder rule.
    s = DSSyncSchedule(10, 3, kind="random", num_partitions=5, seed=7)
    for i in range(5):
        perm = np.random.default_rng([7, i]).permutation(10)
        assert s.partition(i) == chunk(perm, 3)


def test_random_seed_changes_partitions_and_default_count():
    a = DSSyncSchedule(16, 2, kind="random", seed=0)
    b = DSSyncSchedule(16, 2, kind="random", seed=1)
    assert a.num_partitions == 4
    assert cycle(a) != cycle(b)
    assert len(set(cycle(a))) == 4  # distinct partitions in the cycle


def test_butterfly_ignores_seed():
    assert cycle(DSSyncSchedule(12, 2, seed=0)) == cycle(DSSyncSchedule(12, 2, seed=99))


# --- remainder rule ------------------------------------------------------------------------------

@pytest.mark.parametrize("n, g, sizes", [
    (5, 2, [2, 3]), (7, 2, [2, 2, 3]), (11, 4, [5, 6]), (7, 3, [3, 4]), (5, 3, [5]),
    (8, 2, [2, 2, 2, 2]), (4, 4, [4]), (3, 1, [1, 1, 1]), (14, 4, [4, 5, 5]),
])
def test_chunk_sizes_remainder_joins_last_groups(n, g, sizes):
    assert chunk_sizes(n, g) == sizes
    assert sum(sizes) == n


def test_chunk_keeps_remainder_in_last_group():
    assert chunk([4, 3, 2, 1, 0], 2) == ((0, 1, 2), (3, 4))
    assert chunk([0, 1, 2, 3, 4], 2) == ((0, 1), (2, 3, 4))


def test_five_workers_group_size_two_random():
    s = DSSyncSchedule(5, 2, kind="random", num_partitions=8, seed=3)
    for part in cycle(s):
        assert sorted(map(len, part)) == [2, 3]


# --- group_size == world_size, group_size == 1 ----------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 64])
def test_group_size_equal_world_size_single_group(kind, n):
    s = DSSyncSchedule(n, n, kind=kind)
    for t in range(10):
        assert s.partition(t) == (tuple(range(n)),)
    assert s.all_groups() == [tuple(range(n))]
    assert steps_to_full_mixing(s, 5) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_group_size_one_is_singletons_never_mixing(kind):
    s = DSSyncSchedule(6, 1, kind=kind)
    for t in range(5):
        assert s.partition(t) == tuple((i,) for i in range(6))
    assert steps_to_full_mixing(s, 20) is None


# --- butterfly structure and mixing guarantees ----------------------------------------------------

def test_butterfly_eight_workers_pairs():
    s = DSSyncSchedule(8, 2)
    assert cycle(s) == [
        ((0, 1), (2, 3), (4, 5), (6, 7)),        # bit 0
        ((0, 2), (1, 3), (4, 6), (5, 7)),        # bit 1
        ((0, 4), (1, 5), (2, 6), (3, 7)),        # bit 2
    ]


def test_butterfly_block_not_dividing_bits_overlaps_last_block():
    # N=8, g=4: blocks of 2 bits over 3 bits -> bits {0,1} then {1,2}; groups stay of size 4.
    s = DSSyncSchedule(8, 4)
    assert cycle(s) == [((0, 1, 2, 3), (4, 5, 6, 7)), ((0, 2, 4, 6), (1, 3, 5, 7))]


@pytest.mark.parametrize("n, g", POW2)
def test_butterfly_power_of_two_groups_differ_in_one_bit_block(n, g):
    s = DSSyncSchedule(n, g)
    nb, b = n.bit_length() - 1, g.bit_length() - 1
    assert s.num_partitions == expected_stages(n, g)
    for stage, part in enumerate(cycle(s)):
        start = min(stage * b, nb - b)
        mask = (g - 1) << start
        for grp in part:
            assert len(grp) == g
            assert len({r & ~mask for r in grp}) == 1  # same outside the block
            assert sorted((r & mask) >> start for r in grp) == list(range(g))  # every block value


@pytest.mark.parametrize("n, g", POW2)
def test_butterfly_power_of_two_full_mixing_exactly_at_stage_count(n, g):
    s = DSSyncSchedule(n, g)
    k = expected_stages(n, g)
    ws = [mixing_matrix(s.partition(t), n) for t in range(k)]
    prod = np.eye(n)
    for w in ws:
        prod = w @ prod
    assert (prod > 0).all()
    np.testing.assert_allclose(prod, np.full((n, n), 1.0 / n))  # exact average after the full cycle
    if k > 1:
        fewer = np.eye(n)
        for w in ws[:-1]:
            fewer = w @ fewer
        assert not (fewer > 0).all()
    assert steps_to_full_mixing(s, 3 * k) == k


@pytest.mark.parametrize("n", [4, 8, 16, 32, 64])
def test_butterfly_pairs_not_mixed_one_step_early(n):
    s = DSSyncSchedule(n, 2)
    k = int(math.log2(n))
    prod = np.eye(n)
    for t in range(k - 1):
        prod = mixing_matrix(s.partition(t), n) @ prod
    assert not (prod > 0).all()
    assert (prod > 0).sum() == n * 2 ** (k - 1)  # each worker has reached exactly 2**(k-1) workers
    assert steps_to_full_mixing(s, k - 1) is None
    assert steps_to_full_mixing(s, k) == k


@pytest.mark.parametrize("n, g", POW2)
def test_butterfly_any_window_of_stage_count_mixes(n, g):
    s = DSSyncSchedule(n, g)
    k = s.num_partitions
    for start in range(k):
        assert steps_to_full_mixing(s, k, start=start) == k


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 64).flatmap(lambda n: st.tuples(st.just(n), st.integers(2, n))), st.integers(0, 10))
def test_butterfly_general_full_mixing_exactly_at_stage_count(ng, start):
    n, g = ng
    s = DSSyncSchedule(n, g)
    k = s.num_partitions
    assert k <= math.ceil(math.log(n) / math.log(g) - 1e-9) or k == 1
    assert steps_to_full_mixing(s, k, start=start) == k
    if k > 1:
        assert steps_to_full_mixing(s, k - 1, start=start) is None


@pytest.mark.parametrize("n, g", [(6, 2), (12, 3), (27, 3), (9, 3), (10, 2), (63, 2), (48, 4), (100, 3)])
def test_butterfly_general_examples(n, g):
    s = DSSyncSchedule(n, g)
    for part in cycle(s):
        assert all(len(grp) >= g for grp in part)
    assert steps_to_full_mixing(s, s.num_partitions) == s.num_partitions


def test_butterfly_power_of_group_size_is_base_g_butterfly():
    s = DSSyncSchedule(9, 3)
    assert cycle(s) == [((0, 1, 2), (3, 4, 5), (6, 7, 8)), ((0, 3, 6), (1, 4, 7), (2, 5, 8))]


def test_random_kind_mixes_eventually():
    s = DSSyncSchedule(32, 2, kind="random", num_partitions=8, seed=0)
    k = steps_to_full_mixing(s, 200)
    assert k is not None and k >= 5  # pairs: at least log2(32) steps are needed


# --- all_groups (process sets) --------------------------------------------------------------------

@FAST
@given(configs())
def test_all_groups_is_exactly_the_groups_used(cfg):
    s = DSSyncSchedule(**cfg)
    used = {grp for t in range(2 * s.num_partitions) for grp in s.partition(t)}
    groups = s.all_groups()
    assert set(groups) == used
    assert len(groups) == len(set(groups))
    # creation order: no group appears before a group of an earlier partition that is new there
    first = {grp: min(t for t in range(s.num_partitions) if grp in s.partition(t)) for grp in groups}
    assert [first[grp] for grp in groups] == sorted(first[grp] for grp in groups)
    assert s.describe()["num_groups"] == len(groups)
    # Bounded process sets: at most num_partitions * (N // g).
    assert len(groups) <= s.num_partitions * (cfg["world_size"] // cfg["group_size"])


@pytest.mark.parametrize("n, g", POW2)
def test_butterfly_groups_come_partition_by_partition(n, g):
    """Each butterfly partition's groups are one consecutive block of all_groups(), in partition order:
    the process sets are created so (Horovod coordinates them in creation order; README, "Over shaped
    links")."""
    s = DSSyncSchedule(n, g)
    groups, per = s.all_groups(), n // g
    for t in range(s.num_partitions):
        assert sorted(groups[t * per:(t + 1) * per]) == sorted(s.partition(t))


@pytest.mark.parametrize("n, g", POW2)
def test_butterfly_process_set_count(n, g):
    assert len(DSSyncSchedule(n, g).all_groups()) == (n // g) * expected_stages(n, g)


def test_all_groups_returns_a_copy():
    s = DSSyncSchedule(8, 2)
    s.all_groups().clear()
    assert len(s.all_groups()) == 12


# --- mixing_matrix --------------------------------------------------------------------------------

@FAST
@given(configs(), st.integers(0, 100))
def test_mixing_matrix_is_doubly_stochastic_block_average(cfg, step):
    s = DSSyncSchedule(**cfg)
    n = cfg["world_size"]
    w = mixing_matrix(s.partition(step), n)
    assert w.shape == (n, n)
    np.testing.assert_allclose(w.sum(axis=1), 1.0)
    np.testing.assert_allclose(w, w.T)
    for i in range(n):
        grp = s.group_of(i, step)
        for j in range(n):
            assert w[i, j] == (1.0 / len(grp) if j in grp else 0.0)


def test_mixing_matrix_example():
    w = mixing_matrix(((0, 2), (1,)), 3)
    np.testing.assert_array_equal(w, [[0.5, 0, 0.5], [0, 1, 0], [0.5, 0, 0.5]])


@pytest.mark.parametrize("part, n", [
    (((0, 1),), 3),          # missing 2
    (((0, 1), (1, 2)), 3),   # 1 twice
    (((0, 0), (1, 2)), 3),   # duplicate within a group
    (((0, 3), (1, 2)), 3),   # out of range
    (((-1, 0), (1, 2)), 3),  # negative
    (((), (0, 1, 2)), 3),    # empty group
])
def test_mixing_matrix_rejects_non_partitions(part, n):
    with pytest.raises(ValueError, match="partition"):
        mixing_matrix(part, n)


# --- describe -------------------------------------------------------------------------------------

def test_describe_is_json_summary():
    d = DSSyncSchedule(8, 2, kind="random", num_partitions=3, seed=5).describe()
    assert d == {"kind": "random", "group_size": 2, "num_partitions": 3, "seed": 5,
                 "num_groups": d["num_groups"]}
    assert 4 <= d["num_groups"] <= 12
    json.dumps(d)
    assert DSSyncSchedule(8, 2).describe() == {"kind": "butterfly", "group_size": 2, "num_partitions": 3,
                                               "seed": 0, "num_groups": 12}


def test_numpy_integers_accepted():
    s = DSSyncSchedule(np.int64(8), np.int32(2), seed=np.uint8(1))
    assert s.world_size == 8 and type(s.world_size) is int
    assert s.group_of(np.int64(3), np.int64(1)) == (1, 3)


# --- bad arguments --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    (dict(world_size=0), "world_size"),
    (dict(world_size=-3), "world_size"),
    (dict(world_size=2.0), "world_size"),
    (dict(world_size=True), "world_size"),
    (dict(world_size=4, group_size=0), "group_size"),
    (dict(world_size=4, group_size=5), "group_size"),
    (dict(world_size=4, group_size=-1), "group_size"),
    (dict(world_size=4, group_size=2.5), "group_size"),
    (dict(world_size=4, kind="ring"), "kind"),
    (dict(world_size=4, kind="Random"), "kind"),
    (dict(world_size=4, kind="random", num_partitions=0), "num_partitions"),
    (dict(world_size=4, kind="random", num_partitions=-2), "num_partitions"),
    (dict(world_size=4, kind="random", num_partitions=1.0), "num_partitions"),
    (dict(world_size=8, kind="butterfly", num_partitions=2), "num_partitions"),
    (dict(world_size=8, kind="butterfly", num_partitions=4), "num_partitions"),
    (dict(world_size=4, seed=-1), "seed"),
    (dict(world_size=4, seed=1.5), "seed"),
])
def test_bad_constructor_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DSSyncSchedule(**kwargs)


def test_group_size_error_message_shows_range():
    with pytest.raises(ValueError) as e:
        DSSyncSchedule(4, 0)
    msg = str(e.value)
    assert "group_size" in msg and "1..world_size" in msg and "world_size=4" in msg and "got 0" in msg
    with pytest.raises(ValueError, match=r"'butterfly', 'random'.*got 'ring'"):
        DSSyncSchedule(4, kind="ring")


def test_butterfly_accepts_matching_num_partitions():
    assert DSSyncSchedule(8, 2, num_partitions=3).num_partitions == 3


@pytest.mark.parametrize("call, name", [
    (lambda s: s.partition(-1), "step"),
    (lambda s: s.partition(1.5), "step"),
    (lambda s: s.group_of(4, 0), "rank"),
    (lambda s: s.group_of(-1, 0), "rank"),
    (lambda s: s.group_of(0, -1), "step"),
    (lambda s: steps_to_full_mixing(s, -1), "max_steps"),
    (lambda s: steps_to_full_mixing(s, 3, start=-1), "start"),
    (lambda s: mixing_matrix(s.partition(0), 0), "world_size"),
])
def test_bad_call_arguments_name_the_argument(call, name):
    s = DSSyncSchedule(4, 2)
    with pytest.raises(ValueError, match=name):
        call(s)


def test_chunk_sizes_rejects_bad_group_size():
    with pytest.raises(ValueError, match="group_size"):
        chunk_sizes(3, 4)
    with pytest.raises(ValueError, match="group_size"):
        chunk_sizes(3, 0)


def test_steps_to_full_mixing_zero_budget_and_single_worker():
    assert steps_to_full_mixing(DSSyncSchedule(8, 2), 0) is None
    assert steps_to_full_mixing(DSSyncSchedule(1, 1), 1) == 1
