import heapq
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_straggler.policies.boa import (
    PER_SAMPLE_FLOOR_S, BoaPlan, LinearTimeModel, choose_worker_set, fit_linear_time_model,
    gradient_weights, plan, predicted_step_time, solve_batch_sizes)


# ------------------------------------------------------------------------------------------------
# references
# ------------------------------------------------------------------------------------------------


def compositions(total, parts, lo, hi):
    """Every tuple of ``parts`` integers in [lo, hi] summing to ``total``."""
    if parts == 1:
        if lo <= total <= hi:
            yield (total,)
        return
    for first in range(lo, min(hi, total - lo * (parts - 1)) + 1):
        for rest in compositions(total - first, parts - 1, lo, hi):
            yield (first,) + rest


def brute_force_makespan(models, B, lo, hi):
    hi = B if hi is None else hi
    return min(max(m.predict(b) for m, b in zip(models, comp)) for comp in compositions(B, len(models), lo, hi))


def greedy_reference(models, B, lo, hi):
    """Sample-by-sample greedy from all-minimum: provably optimal, O(B log n)."""
    hi = B if hi is None else hi
    b = [lo] * len(models)
    heap = [(m.predict(lo + 1), i) for i, m in enumerate(models) if lo < hi]
    heapq.heapify(heap)
    for _ in range(B - lo * len(models)):
        _, i = heapq.heappop(heap)
        b[i] += 1
        if b[i] < hi:
            heapq.heappush(heap, (models[i].predict(b[i] + 1), i))
    return b


def models_from(a, c):
    return [LinearTimeModel(float(x), float(y)) for x, y in zip(a, c)]


model_st = st.builds(
    LinearTimeModel,
    intercept_s=st.floats(0.0, 0.5, allow_nan=False, allow_infinity=False),
    per_sample_s=st.floats(1e-4, 0.1, allow_nan=False, allow_infinity=False),
)


# ------------------------------------------------------------------------------------------------
# fit_linear_time_model
# ------------------------------------------------------------------------------------------------


def test_fit_recovers_noiseless_line():
    b = [8, 16, 32, 64, 128]
    m = fit_linear_time_model(b, [0.012 + 0.0005 * x for x in b])
    assert m.intercept_s == pytest.approx(0.012, rel=1e-9)
    assert m.per_sample_s == pytest.approx(0.0005, rel=1e-9)
    assert m.predict(100) == pytest.approx(0.012 + 0.05, rel=1e-9)


@settings(max_examples=50, deadline=None)
@given(a=st.floats(0.0, 1.0), c=st.floats(1e-5, 1e-1))
def test_fit_recovers_any_noiseless_line(a, c):
    b = [4, 8, 16, 32, 64, 128]
    m = fit_linear_time_model(b, [a + c * x for x in b])
    assert m.per_sample_s == pytest.approx(c, rel=1e-6)
    assert m.intercept_s == pytest.approx(a, rel=1e-6, abs=1e-9)


def test_fit_is_close_under_noise():
    rng = np.random.default_rng(0)
    a, c = 0.02, 0.001
    b = np.repeat([16, 32, 64, 128, 256], 20)
    t = (a + c * b) * (1.0 + 0.02 * rng.standard_normal(b.size))
    m = fit_linear_time_model(b.tolist(), t.tolist())
    assert m.per_sample_s == pytest.approx(c, rel=0.03)
    assert m.intercept_s == pytest.approx(a, abs=0.005)


def test_fit_predict_accepts_arrays():
    m = LinearTimeModel(1.0, 2.0)
    np.testing.assert_allclose(m.predict(np.array([0, 1, 2])), [1.0, 3.0, 5.0])


def test_fit_single_batch_size_goes_through_origin():
    m = fit_linear_time_model([32, 32, 32], [0.30, 0.34, 0.32])
    assert m.intercept_s == 0.0
    assert m.per_sample_s == pytest.approx(0.32 / 32)


def test_fit_negative_intercept_is_clamped_to_zero():
    b = [10, 20, 30]
    m = fit_linear_time_model(b, [0.5, 1.6, 2.7])  # OLS: a = -0.6, c = 0.11
    assert m.intercept_s == 0.0
    # Least squares through the origin.
    assert m.per_sample_s == pytest.approx(np.dot(b, [0.5, 1.6, 2.7]) / np.dot(b, b))


def test_fit_decreasing_times_clamp_slope_to_floor():
    m = fit_linear_time_model([16, 32, 64], [0.30, 0.29, 0.20])
    assert m.per_sample_s == PER_SAMPLE_FLOOR_S
    assert m.intercept_s > 0
    assert m.intercept_s == pytest.approx(np.mean([0.30, 0.29, 0.20]) - PER_SAMPLE_FLOOR_S * np.mean([16, 32, 64]))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 512), st.floats(1e-4, 10.0)), min_size=1, max_size=12))
def test_fit_always_satisfies_constraints(pairs):
    b, t = zip(*pairs)
    m = fit_linear_time_model(list(b), list(t))
    assert m.intercept_s >= 0.0
    assert m.per_sample_s >= PER_SAMPLE_FLOOR_S
    assert math.isfinite(m.intercept_s) and math.isfinite(m.per_sample_s)


@pytest.mark.parametrize("b, t, name", [
    ([], [], "batch_sizes"),
    ([1, 2], [], "times"),
    ([1, 2], [0.1], "same length"),
    ([1, float("nan")], [0.1, 0.2], "batch_sizes"),
    ([1, 2], [0.1, float("inf")], "times"),
    ([0, 2], [0.1, 0.2], "batch_sizes"),
    ([-1, 2], [0.1, 0.2], "batch_sizes"),
    ([1, 2], [0.1, 0.0], "times"),
    ([1, 2], [0.1, -0.2], "times"),
])
def test_fit_rejects_bad_input_naming_the_argument(b, t, name):
    with pytest.raises(ValueError, match=name):
        fit_linear_time_model(b, t)


# ------------------------------------------------------------------------------------------------
# solve_batch_sizes
# ------------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    models=st.lists(model_st, min_size=1, max_size=4),
    B=st.integers(1, 24),
    lo=st.integers(1, 4),
    hi=st.one_of(st.none(), st.integers(1, 24)),
)
def test_solver_matches_brute_force(models, B, lo, hi):
    n = len(models)
    if hi is not None and hi < lo:
        hi = lo
    if B < n * lo or (hi is not None and B > n * hi):
        with pytest.raises(ValueError):
            solve_batch_sizes(models, B, lo, hi)
        return
    sizes = solve_batch_sizes(models, B, lo, hi)
    assert len(sizes) == n
    assert all(isinstance(s, int) for s in sizes)
    assert sum(sizes) == B
    assert all(lo <= s <= (B if hi is None else hi) for s in sizes)
    assert predicted_step_time(models, sizes) == brute_force_makespan(models, B, lo, hi)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 64),
    per_worker=st.integers(1, 64),
    lo=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
    spread=st.sampled_from([1.0, 3.0, 1e3, 1e6]),
)
def test_solver_matches_greedy_reference_on_larger_cases(n, per_worker, lo, seed, spread):
    rng = np.random.default_rng(seed)
    models = models_from(rng.uniform(0, 1, n) * rng.choice([0, 1], n), 1e-3 * rng.uniform(1, spread, n))
    B = n * max(lo, per_worker)
    hi = None if seed % 2 else int(math.ceil(B / n)) + int(rng.integers(0, 8))
    sizes = solve_batch_sizes(models, B, lo, hi)
    ref = greedy_reference(models, B, lo, hi)
    assert sum(sizes) == B
    assert predicted_step_time(models, sizes) == predicted_step_time(models, ref)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 200), B_extra=st.integers(0, 1000), a=st.floats(0, 1), c=st.floats(1e-6, 1))
def test_equal_workers_differ_by_at_most_one(n, B_extra, a, c):
    B = n + B_extra
    sizes = solve_batch_sizes([LinearTimeModel(a, c)] * n, B)
    assert sum(sizes) == B
    assert max(sizes) - min(sizes) <= 1


def test_speed_mix_gets_batches_proportional_to_speed():
    speeds = [1.0, 0.6, 0.3]
    models = [LinearTimeModel(0.0, 1.0 / s) for s in speeds]
    assert solve_batch_sizes(models, 190) == [100, 60, 30]
    B = 256
    sizes = solve_batch_sizes(models, B)
    assert sum(sizes) == B
    for s, v in zip(sizes, speeds):
        assert abs(s - B * v / sum(speeds)) <= 1.0
    even = predicted_step_time(models, [86, 85, 85])
    assert predicted_step_time(models, sizes) < 0.5 * even


def test_speed_mix_with_intercept_is_still_balanced():
    speeds = [1.0, 0.6, 0.3]
    models = [LinearTimeModel(0.01, 0.001 / s) for s in speeds]
    sizes = solve_batch_sizes(models, 1900)
    times = [m.predict(b) for m, b in zip(models, sizes)]
    assert max(times) - min(times) <= max(m.per_sample_s for m in models)
    assert sizes[0] > sizes[1] > sizes[2]


def test_intercept_heavy_worker_is_held_at_minimum():
    models = [LinearTimeModel(0.0, 0.001), LinearTimeModel(1.0, 0.001)]
    assert solve_batch_sizes(models, 100, min_local_batch=4) == [96, 4]


def test_max_local_batch_caps_fast_worker():
    models = [LinearTimeModel(0.0, 0.001), LinearTimeModel(0.0, 0.01)]
    assert solve_batch_sizes(models, 100) == [91, 9]
    assert solve_batch_sizes(models, 100, max_local_batch=64) == [64, 36]


def test_solver_edge_cases():
    m = LinearTimeModel(0.1, 0.01)
    assert solve_batch_sizes([m], 7) == [7]
    assert solve_batch_sizes([m] * 3, 6, min_local_batch=2) == [2, 2, 2]
    assert solve_batch_sizes([m] * 3, 6, min_local_batch=1, max_local_batch=2) == [2, 2, 2]
    assert solve_batch_sizes([m, m], np.int64(4)) == [2, 2]


def test_solver_is_deterministic():
    rng = np.random.default_rng(3)
    models = models_from(rng.uniform(0, 0.1, 100), rng.uniform(1e-4, 1e-3, 100))
    assert solve_batch_sizes(models, 10_000) == solve_batch_sizes(list(models), 10_000)


def test_extreme_magnitudes_stay_exact():
    models = [LinearTimeModel(1e6, 1e-9), LinearTimeModel(1e6 + 1e-3, 1e-9), LinearTimeModel(0.0, 1e3),
              LinearTimeModel(1e6, 2e-9)]
    B = 5000
    sizes = solve_batch_sizes(models, B)
    assert sum(sizes) == B
    assert predicted_step_time(models, sizes) == predicted_step_time(models, greedy_reference(models, B, 1, None))


@pytest.mark.parametrize("kind", ["random", "equal", "two_classes"])
def test_1024_workers_solve_fast(kind):
    rng = np.random.default_rng(0)
    n = 1024
    if kind == "random":
        models = models_from(rng.uniform(0, 0.05, n), rng.uniform(1e-4, 1e-3, n))
    elif kind == "equal":
        models = [LinearTimeModel(0.01, 5e-4)] * n
    else:
        models = [LinearTimeModel(0.01, 5e-4 if i % 2 else 1e-3) for i in range(n)]
    B = 64 * n
    solve_batch_sizes(models, B, 1, 256)  # warm-up
    start = time.perf_counter()
    sizes = solve_batch_sizes(models, B, 1, 256)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5
    assert sum(sizes) == B
    assert all(1 <= s <= 256 for s in sizes)
    assert predicted_step_time(models, sizes) == predicted_step_time(models, greedy_reference(models, B, 1, 256))


@pytest.mark.parametrize("kwargs, name", [
    (dict(global_batch=10, min_local_batch=0), "min_local_batch"),
    (dict(global_batch=10, min_local_batch=-3), "min_local_batch"),
    (dict(global_batch=5, min_local_batch=2), "global_batch"),
    (dict(global_batch=5, min_local_batch=2), "min_local_batch"),
    (dict(global_batch=13, max_local_batch=4), "max_local_batch"),
    (dict(global_batch=12, min_local_batch=4, max_local_batch=3), "max_local_batch"),
    (dict(global_batch=12.0), "global_batch"),
    (dict(global_batch=12, min_local_batch=1.5), "min_local_batch"),
])
def test_infeasible_settings_raise_naming_the_setting(kwargs, name):
    models = [LinearTimeModel(0.0, 0.01)] * 3
    with pytest.raises(ValueError, match=name):
        solve_batch_sizes(models, **kwargs)


def test_bad_models_raise():
    with pytest.raises(ValueError, match="models"):
        solve_batch_sizes([], 10)
    with pytest.raises(ValueError, match="per_sample_s"):
        solve_batch_sizes([LinearTimeModel(0.0, 0.0)], 10)
    with pytest.raises(ValueError, match="finite"):
        solve_batch_sizes([LinearTimeModel(float("nan"), 0.1)], 10)


# ------------------------------------------------------------------------------------------------
# predicted_step_time and gradient_weights
# ------------------------------------------------------------------------------------------------


def test_predicted_step_time_is_max_and_ignores_excluded():
    models = [LinearTimeModel(0.1, 0.01), LinearTimeModel(0.0, 0.02), LinearTimeModel(5.0, 1.0)]
    assert predicted_step_time(models, [10, 10, 0]) == pytest.approx(0.2)
    assert predicted_step_time(models, [10, 10, 1]) == pytest.approx(6.0)
    with pytest.raises(ValueError, match="same length"):
        predicted_step_time(models, [1, 2])
    with pytest.raises(ValueError, match="positive"):
        predicted_step_time(models, [0, 0, 0])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=64).filter(lambda xs: sum(xs) > 0))
def test_weights_sum_to_one_and_are_proportional(sizes):
    w = gradient_weights(sizes)
    assert math.fsum(w) == pytest.approx(1.0, abs=1e-12)
    assert all(wi >= 0 for wi in w)
    for s, wi in zip(sizes, w):
        assert wi == pytest.approx(s / sum(sizes))
        assert (wi == 0) == (s == 0)


def test_weighted_average_equals_global_mean():
    rng = np.random.default_rng(1)
    sizes = [5, 17, 3, 0, 11]
    samples = [rng.standard_normal((s, 4)) for s in sizes]
    local_means = [x.mean(axis=0) if len(x) else np.zeros(4) for x in samples]
    combined = sum(w * g for w, g in zip(gradient_weights(sizes), local_means))
    np.testing.assert_allclose(combined, np.concatenate(samples).mean(axis=0))


def test_weights_reject_bad_input():
    for bad, name in [([], "empty"), ([0, 0], "positive sum"), ([3, -1], "non-negative"), ([1.5], "integer")]:
        with pytest.raises(ValueError, match=name):
            gradient_weights(bad)


# ------------------------------------------------------------------------------------------------
# choose_worker_set
# ------------------------------------------------------------------------------------------------


def test_drops_a_20x_slower_worker_when_allreduce_is_cheap():
    models = [LinearTimeModel(0.01, 0.001)] * 3 + [LinearTimeModel(0.2, 0.02)]
    keep = choose_worker_set(models, 96, 4, 64, allreduce_cost_s=lambda n: 0.001 * n)
    assert keep == [0, 1, 2]


def test_drops_slow_worker_even_in_the_middle():
    models = [LinearTimeModel(0.01, 0.001), LinearTimeModel(0.2, 0.02), LinearTimeModel(0.01, 0.001)]
    assert choose_worker_set(models, 64, 4, None) == [0, 2]


def test_keeps_all_equal_workers():
    models = [LinearTimeModel(0.01, 0.001)] * 8
    assert choose_worker_set(models, 256, 1, None) == list(range(8))
    assert choose_worker_set(models, 256, 1, None, allreduce_cost_s=lambda n: 0.001 * n) == list(range(8))


def test_ties_keep_more_workers():
    # Intercept-only cost: adding workers never helps or hurts the step time.
    models = [LinearTimeModel(1.0, PER_SAMPLE_FLOOR_S)] * 4
    assert choose_worker_set(models, 8) == [0, 1, 2, 3]


def test_expensive_allreduce_drops_workers():
    models = [LinearTimeModel(0.0, 0.001)] * 4
    # Compute step: 0.1 s / n for B = 100. Allreduce 0.06 s per extra worker: best is 1 worker.
    assert choose_worker_set(models, 100, allreduce_cost_s=lambda n: 0.06 * (n - 1)) == [0]
    # 0.05 s per extra worker: 1 and 2 workers tie at 0.1 s; ties keep more workers.
    assert choose_worker_set(models, 100, allreduce_cost_s=lambda n: 0.05 * (n - 1)) == [0, 1]


def test_min_workers_and_max_local_batch_limit_dropping():
    models = [LinearTimeModel(0.01, 0.001)] * 2 + [LinearTimeModel(1.0, 0.05), LinearTimeModel(2.0, 0.05)]
    assert choose_worker_set(models, 64, 4, None) == [0, 1]
    assert choose_worker_set(models, 64, 4, None, min_workers=3) == [0, 1, 2]
    assert choose_worker_set(models, 64, 4, None, max_dropped=1) == [0, 1, 2]
    # Two or three workers cannot hold 64 samples with max 20 each: keep enough to fit.
    assert choose_worker_set(models, 64, 4, 20) == [0, 1, 2, 3]


@settings(max_examples=80, deadline=None)
@given(models=st.lists(model_st, min_size=1, max_size=5), B=st.integers(5, 24),
       comm=st.floats(0.0, 0.05))
def test_worker_set_is_best_prefix_by_brute_force(models, B, comm):
    n = len(models)
    cost = lambda k: comm * k  # noqa: E731
    keep = choose_worker_set(models, B, 1, None, allreduce_cost_s=cost)
    order = sorted(range(n), key=lambda i: (models[i].per_sample_s, models[i].intercept_s, i))
    tp = {k: B / (brute_force_makespan([models[i] for i in order[:k]], B, 1, None) + cost(k))
          for k in range(1, n + 1)}
    best = max(tp.values())
    assert keep == sorted(order[:len(keep)])
    assert tp[len(keep)] == pytest.approx(best, rel=1e-9)
    # Every larger set is strictly worse (ties keep more workers).
    assert all(tp[k] < tp[len(keep)] for k in range(len(keep) + 1, n + 1))


def _every_k_worker_set(models, B, lo, hi, cost):
    """choose_worker_set's rule with every prefix solved exactly (no bound): the reference."""
    order = sorted(range(len(models)), key=lambda i: (models[i].per_sample_s, models[i].intercept_s, i))
    best_k, best_tp = None, -math.inf
    for k in range(len(models), 0, -1):
        if B < k * lo or (hi is not None and B > k * hi):
            continue
        sub = [models[i] for i in order[:k]]
        tp = B / (predicted_step_time(sub, solve_batch_sizes(sub, B, lo, hi)) + cost(k))
        if best_k is None or tp > best_tp * (1.0 + 1e-12):
            best_k, best_tp = k, tp
    return sorted(order[:best_k])


@pytest.mark.parametrize("case", range(12))
def test_worker_set_bound_skips_solves_but_not_the_answer(case, monkeypatch):
    """At hundreds of workers (speed mixes, frozen workers, an all-reduce that grows with k, a batch cap)
    the bounded search returns exactly what solving every prefix returns, with far fewer exact solves."""
    import lightning_straggler.policies.boa as boa

    rng = np.random.default_rng(case)
    n = int(rng.choice([64, 256, 700]))
    frozen = case % 2 == 0  # a seventh of the workers 400x slow: each one dropped is a real improvement
    factors = rng.choice([1.0, 1.0, 1.0, 1.7, 3.3, 10.0] + ([400.0] if frozen else []), size=n)
    models = [LinearTimeModel(float(rng.uniform(0.001, 0.01)), 0.002 * f * float(rng.uniform(0.95, 1.05)))
              for f in factors]
    B, lo = 32 * n, int(rng.choice([1, 4]))
    hi = None if case % 3 else 64
    cost = (lambda k: 0.0) if case % 4 == 0 else boa.allreduce_cost_at(float(rng.uniform(0.001, 0.1)), n)
    solves = []
    real_solve = boa._solve
    monkeypatch.setattr(boa, "_solve", lambda *a: solves.append(1) or real_solve(*a))
    keep = choose_worker_set(models, B, lo, hi, allreduce_cost_s=cost)
    monkeypatch.setattr(boa, "_solve", real_solve)
    assert keep == _every_k_worker_set(models, B, lo, hi, cost)
    assert len(solves) < (n / 3 if frozen else n / 5)


def test_worker_set_validation():
    models = [LinearTimeModel(0.0, 0.01)] * 3
    with pytest.raises(ValueError, match="min_workers"):
        choose_worker_set(models, 30, min_workers=0)
    with pytest.raises(ValueError, match="min_workers"):
        choose_worker_set(models, 30, min_workers=4)
    with pytest.raises(ValueError, match="min_local_batch"):
        choose_worker_set(models, 30, min_local_batch=0)
    with pytest.raises(ValueError, match="global_batch"):
        choose_worker_set(models, 40, max_local_batch=10)
    with pytest.raises(ValueError, match="allreduce_cost_s"):
        choose_worker_set(models, 30, allreduce_cost_s=lambda n: -1.0)


def test_worker_set_is_deterministic():
    rng = np.random.default_rng(7)
    models = models_from(rng.uniform(0, 0.05, 32), rng.uniform(1e-4, 1e-2, 32))
    first = choose_worker_set(models, 1024, 1, 128, allreduce_cost_s=lambda n: 0.002 * math.log2(n + 1))
    assert first == choose_worker_set(models, 1024, 1, 128, allreduce_cost_s=lambda n: 0.002 * math.log2(n + 1))


# ------------------------------------------------------------------------------------------------
# plan
# ------------------------------------------------------------------------------------------------


def test_plan_without_tuning_keeps_everyone():
    models = [LinearTimeModel(0.0, 1.0), LinearTimeModel(0.0, 1 / 0.6), LinearTimeModel(0.0, 1 / 0.3)]
    p = plan(models, 190)
    assert isinstance(p, BoaPlan)
    assert p.batch_sizes == [100, 60, 30]
    assert p.active == [0, 1, 2] and p.excluded == []
    assert p.weights == pytest.approx([100 / 190, 60 / 190, 30 / 190])
    assert p.predicted_step_time_s == pytest.approx(100.0)
    assert p.global_batch == 190
    assert p.describe()["batch_sizes"] == [100, 60, 30]


def test_plan_with_tuning_zeroes_excluded_workers():
    models = [LinearTimeModel(0.01, 0.001)] * 3 + [LinearTimeModel(0.2, 0.02)]
    p = plan(models, 96, min_local_batch=4, max_local_batch=64, tune_workers=True,
             allreduce_cost_s=lambda n: 0.001 * n)
    assert p.active == [0, 1, 2]
    assert p.excluded == [3]
    assert p.batch_sizes == [32, 32, 32, 0]
    assert p.weights[3] == 0.0
    assert math.fsum(p.weights) == pytest.approx(1.0)
    assert p.predicted_step_time_s == pytest.approx(predicted_step_time(models, p.batch_sizes))
    assert p.predicted_step_time_s < predicted_step_time(models, solve_batch_sizes(models, 96, 4, 64))


def test_plan_propagates_infeasible_settings():
    with pytest.raises(ValueError, match="max_local_batch"):
        plan([LinearTimeModel(0.0, 0.01)] * 2, 100, max_local_batch=10)


def test_end_to_end_profile_fit_plan():
    """Profile three simulated devices, fit, plan: the plan balances the true times."""
    rng = np.random.default_rng(5)
    true = [(0.005, 0.0010), (0.005, 0.0010 / 0.6), (0.005, 0.0010 / 0.3)]
    sizes = [16, 32, 64, 128]
    fitted = []
    for a, c in true:
        bs = sizes * 3
        ts = [(a + c * b) * (1 + 0.01 * rng.standard_normal()) for b in bs]
        fitted.append(fit_linear_time_model(bs, ts))
    p = plan(fitted, 384)
    true_times = [a + c * b for (a, c), b in zip(true, p.batch_sizes)]
    even_times = [a + c * 128 for a, c in true]
    assert max(true_times) < 0.6 * max(even_times)
    assert max(true_times) / min(true_times) < 1.1
