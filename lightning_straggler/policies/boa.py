"""Batch-Orchestrating Algorithm (BOA): per-worker local batch sizes for heterogeneous clusters.

In synchronous data parallelism every step lasts as long as the slowest worker. When the workers
differ in speed (mixed GPU generations, shared nodes) an even split of the global batch leaves the
fast ones idle. BOA gives each worker i its own local batch size ``b_i`` so all finish together:

1. profile compute time per worker at a few batch sizes;
2. fit a time model ``t_i(b) = a_i + c_i * b`` per worker (:func:`fit_linear_time_model`);
3. choose integers ``b_i`` that minimise ``max_i t_i(b_i)`` subject to ``sum b_i = B`` and
   ``min_local_batch <= b_i <= max_local_batch`` (:func:`solve_batch_sizes`, exact);
4. optionally drop workers that cost more than they add (:func:`choose_worker_set`);
5. average gradients weighted by ``b_i / B`` (:func:`gradient_weights`) so the global gradient is
   still the mean over all ``B`` samples.

Pure decision logic: numbers in, decisions out. Every input is plain data and every result is
deterministic (ties are broken by worker index), so all ranks compute the same plan from the same
profile without talking to each other.
"""
from __future__ import annotations

import heapq
import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import numpy as np

#: Smallest per-sample time a fitted model may have. A zero or negative slope (noise on a device
#: that is latency bound over the profiled range) would make a worker look able to take unbounded
#: work for free; the floor keeps every model strictly increasing in the batch size.
PER_SAMPLE_FLOOR_S = 1e-9

__all__ = [
    "PER_SAMPLE_FLOOR_S",
    "LinearTimeModel",
    "fit_linear_time_model",
    "solve_batch_sizes",
    "predicted_step_time",
    "choose_worker_set",
    "gradient_weights",
    "BoaPlan",
    "plan",
    "initial_allocation",
    "time_model_from_points",
    "allreduce_cost_at",
    "rebalance_decision",
]


# --------------------------------------------------------------------------------------------------
# Time model
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearTimeModel:
    """Predicted compute time of one step on one worker: ``intercept_s + per_sample_s * b``."""

    intercept_s: float
    per_sample_s: float

    def predict(self, b):
        """Predicted seconds for local batch size ``b`` (a number or a numpy array)."""
        return self.intercept_s + self.per_sample_s * b


def _as_finite_positive_array(values: Sequence[float], name: str) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=float)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a sequence of numbers: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} must not be empty")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite, got {values!r}")
    if not np.all(arr > 0):
        raise ValueError(f"{name} must be positive, got {values!r}")
    return arr


def fit_linear_time_model(batch_sizes: Sequence[float], times: Sequence[float]) -> LinearTimeModel:
    """Least-squares fit of ``t(b) = a + c * b`` to profiled (batch size, seconds) pairs.

    Why linear: on an accelerator, once the batch is large enough to fill the device, a step costs a
    fixed part (kernel launches, Python and framework overhead, optimizer step, synchronisation
    points, all independent of the batch) plus work proportional to the number of samples (every
    sample goes through the same layers). So compute time is affine in the batch size, and two
    numbers per worker are enough to balance a cluster: ``c`` says how fast the worker is, ``a`` says
    how much a step costs it regardless of the batch.

    Limits:

    * Small batches do not fill the device: time is nearly flat there (latency bound) and the line
      over-estimates their marginal cost. Profile at the batch sizes you will actually use.
    * Near the memory limit time can grow faster than linearly (allocator churn, activation
      checkpointing, cache misses); cap ``max_local_batch`` below that.
    * Shapes that vary per batch (variable sequence lengths), data-loading stalls, thermal
      throttling and contention from other jobs are not modelled: the fit describes the device as it
      was when profiled. Re-profile when conditions change.
    * Communication (the gradient all-reduce) does not depend on the local batch size and is not
      part of this model; see ``allreduce_cost_s`` in :func:`choose_worker_set`.

    Fitting: ordinary least squares over all pairs (repeats of a batch size are fine and average out
    noise). With a single distinct batch size the intercept is unidentifiable, so the model goes
    through the origin with ``per_sample_s = mean(t / b)``. The result is constrained to
    ``intercept_s >= 0`` and ``per_sample_s >= PER_SAMPLE_FLOOR_S``; when the unconstrained fit
    breaks a constraint (noise), the least-squares optimum on the constraint boundary is returned.

    Raises ``ValueError`` (naming the argument) for empty, mismatched, non-finite or non-positive
    inputs.
    """
    b = _as_finite_positive_array(batch_sizes, "batch_sizes")
    t = _as_finite_positive_array(times, "times")
    if b.size != t.size:
        raise ValueError(f"batch_sizes and times must have the same length, got {b.size} and {t.size}")

    if np.unique(b).size == 1:
        return LinearTimeModel(0.0, max(float(np.mean(t / b)), PER_SAMPLE_FLOOR_S))

    b_mean, t_mean = float(b.mean()), float(t.mean())
    db = b - b_mean
    slope = float(np.dot(db, t - t_mean) / np.dot(db, db))
    intercept = t_mean - slope * b_mean
    if slope >= PER_SAMPLE_FLOOR_S and intercept >= 0.0:
        return LinearTimeModel(float(intercept), float(slope))

    # The unconstrained optimum is outside {a >= 0, c >= floor}. The squared error is convex, so the
    # constrained optimum lies on one of the two edges; take the best edge optimum.
    def sse(a: float, c: float) -> float:
        r = t - (a + c * b)
        return float(np.dot(r, r))

    c_origin = max(float(np.dot(b, t) / np.dot(b, b)), PER_SAMPLE_FLOOR_S)  # edge a = 0
    a_floor = max(float(np.mean(t - PER_SAMPLE_FLOOR_S * b)), 0.0)  # edge c = floor
    candidates = [(sse(0.0, c_origin), 0.0, c_origin), (sse(a_floor, PER_SAMPLE_FLOOR_S), a_floor, PER_SAMPLE_FLOOR_S)]
    _, a_best, c_best = min(candidates)
    return LinearTimeModel(float(a_best), float(c_best))


# --------------------------------------------------------------------------------------------------
# Exact batch-size solver
# --------------------------------------------------------------------------------------------------


def _as_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _model_arrays(models: Sequence[LinearTimeModel]):
    models = list(models)
    if not models:
        raise ValueError("models must not be empty")
    a = np.array([float(m.intercept_s) for m in models], dtype=float)
    c = np.array([float(m.per_sample_s) for m in models], dtype=float)
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(c))):
        raise ValueError("models must have finite intercept_s and per_sample_s")
    if np.any(c <= 0):
        raise ValueError("models must have per_sample_s > 0 (fit them with fit_linear_time_model)")
    return a, c


def _check_bounds(n: int, global_batch, min_local_batch, max_local_batch):
    global_batch = _as_int(global_batch, "global_batch")
    min_local_batch = _as_int(min_local_batch, "min_local_batch")
    if min_local_batch < 1:
        raise ValueError(f"min_local_batch must be >= 1, got {min_local_batch}")
    if max_local_batch is not None:
        max_local_batch = _as_int(max_local_batch, "max_local_batch")
        if max_local_batch < min_local_batch:
            raise ValueError(
                f"max_local_batch ({max_local_batch}) must be >= min_local_batch ({min_local_batch})")
    if global_batch < n * min_local_batch:
        raise ValueError(
            f"global_batch ({global_batch}) is smaller than {n} workers x min_local_batch "
            f"({min_local_batch}) = {n * min_local_batch}")
    if max_local_batch is not None and global_batch > n * max_local_batch:
        raise ValueError(
            f"global_batch ({global_batch}) is larger than {n} workers x max_local_batch "
            f"({max_local_batch}) = {n * max_local_batch}")
    return global_batch, min_local_batch, max_local_batch


def _solve(a: np.ndarray, c: np.ndarray, B: int, lo: int, hi: Optional[int]) -> np.ndarray:
    """Exact minimax split for validated inputs (see :func:`solve_batch_sizes`)."""
    n = a.size
    # No worker can take more than what is left after the others take their minimum.
    hi_eff = B - (n - 1) * lo if hi is None else min(hi, B - (n - 1) * lo)
    if B == n * lo:
        return np.full(n, lo, dtype=np.int64)

    def caps(T: float) -> np.ndarray:
        k = np.floor((T - a) / c)
        return np.clip(k, lo, hi_eff)

    def total(T: float) -> float:
        return float(caps(T).sum())

    # Bisection on the makespan T for a T_low with total(T_low) < B, as close as floats allow to the
    # smallest T with total(T) >= B.
    T_low = float(np.min(a + c * lo))
    if total(T_low) >= B:
        base = np.full(n, lo, dtype=np.int64)
    else:
        T_high = float(np.max(a + c * hi_eff))
        step = max(abs(T_high), 1.0) * 1e-12
        while total(T_high) < B:  # float rounding at the boundary
            T_high += step
            step *= 2.0
        for _ in range(2000):
            mid = 0.5 * (T_low + T_high)
            if not (T_low < mid < T_high):
                break
            if total(mid) >= B:
                T_high = mid
            else:
                T_low = mid
        # One sample of margin per worker guards against rounding in floor(); the greedy below
        # refills it exactly.
        base = np.clip(np.floor((T_low - a) / c) - 1, lo, hi_eff).astype(np.int64)

    b = base
    remaining = B - int(b.sum())
    # Greedy fill: give the next sample to the worker whose time after taking it is smallest. Each
    # worker's successive sample times increase, so this takes the globally smallest "slots".
    heap = [(float(a[i] + c[i] * (b[i] + 1)), i) for i in range(n) if b[i] < hi_eff]
    heapq.heapify(heap)
    while remaining > 0:
        _, i = heapq.heappop(heap)
        b[i] += 1
        remaining -= 1
        if b[i] < hi_eff:
            heapq.heappush(heap, (float(a[i] + c[i] * (b[i] + 1)), i))

    # Optimality check and repair (normally no iterations). The split is optimal when the slowest
    # worker is at the minimum batch (its time is a lower bound for every split) or when no worker
    # can take one more sample and still finish before the current makespan: then the used samples
    # are the B cheapest slots, which no split can beat.
    while True:
        cur = a + c * b
        i = int(np.argmax(cur))
        if b[i] <= lo:
            break
        nxt = np.where(b < hi_eff, a + c * (b + 1), np.inf)
        j = int(np.argmin(nxt))
        if not nxt[j] < cur[i]:
            break
        b[i] -= 1
        b[j] += 1
    return b


def solve_batch_sizes(models: Sequence[LinearTimeModel], global_batch: int, min_local_batch: int = 1,
                      max_local_batch: Optional[int] = None) -> List[int]:
    """Integer local batch sizes, one per model, that sum to ``global_batch`` and minimise the
    predicted step time ``max_i models[i].predict(b_i)``, with ``min_local_batch <= b_i <=
    max_local_batch`` (``None``: no cap).

    Exact. Worker i's k-th sample above the minimum costs it ``t_i(min + k)``; these "slot" times
    increase with k, so the best split takes the ``global_batch - n * min_local_batch`` cheapest
    slots over all workers. A bisection on the makespan T (worker i fits ``floor((T - a_i) / c_i)``
    samples) finds, in O(n) per probe, the level just below the last slot taken; a heap greedy then
    places the few remaining samples one by one on the worker with the smallest ``t_i(b_i + 1)``,
    and a final check proves optimality (and repairs rounding, if any). About 1-5 ms for 1024
    workers. Ties are broken by worker index, so the result is deterministic.

    Raises ``ValueError`` naming the setting when the problem is infeasible: ``min_local_batch < 1``,
    ``max_local_batch < min_local_batch``, ``global_batch < n * min_local_batch`` or
    ``global_batch > n * max_local_batch``.
    """
    a, c = _model_arrays(models)
    B, lo, hi = _check_bounds(a.size, global_batch, min_local_batch, max_local_batch)
    return [int(x) for x in _solve(a, c, B, lo, hi)]


def predicted_step_time(models: Sequence[LinearTimeModel], batch_sizes: Sequence[int]) -> float:
    """Predicted compute time of a synchronous step: ``max_i models[i].predict(batch_sizes[i])``.

    Workers with batch size 0 are excluded (they do not compute) and do not count.
    """
    models = list(models)
    sizes = list(batch_sizes)
    if len(models) != len(sizes):
        raise ValueError(f"models and batch_sizes must have the same length, got {len(models)} and {len(sizes)}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"batch_sizes must be non-negative, got {sizes}")
    times = [float(m.predict(s)) for m, s in zip(models, sizes) if s > 0]
    if not times:
        raise ValueError("batch_sizes must have at least one positive entry")
    return max(times)


# --------------------------------------------------------------------------------------------------
# Worker-set tuning
# --------------------------------------------------------------------------------------------------


def _speed_order(models: Sequence[LinearTimeModel]) -> List[int]:
    """Worker indices, fastest first: by per-sample time, then intercept, then index."""
    return sorted(range(len(models)), key=lambda i: (models[i].per_sample_s, models[i].intercept_s, i))


def _step_time_lower_bounds(a: np.ndarray, c: np.ndarray, B: int, lo: int) -> np.ndarray:
    """For each prefix of the workers (arrays in speed order), a lower bound on the step time of any
    split of ``B`` samples over the first k of them, at index k - 1. Two bounds, the larger counts:
    every worker takes at least ``lo`` samples (step >= max_i a_i + c_i lo), and a step of length T
    fits at most (T - a_i) / c_i samples on worker i, so B <= sum_i (T - a_i) / c_i, i.e.
    T >= (B + sum_i a_i / c_i) / sum_i 1 / c_i. O(n) for all prefixes together."""
    at_least_lo = np.maximum.accumulate(a + c * lo)
    fits_batch = (B + np.cumsum(a / c)) / np.cumsum(1.0 / c)
    return np.maximum(at_least_lo, fits_batch)


def choose_worker_set(models: Sequence[LinearTimeModel], global_batch: int, min_local_batch: int = 1,
                      max_local_batch: Optional[int] = None,
                      allreduce_cost_s: Optional[Callable[[int], float]] = None,
                      min_workers: int = 1, max_dropped: Optional[int] = None) -> List[int]:
    """Indices (ascending) of the workers worth keeping.

    A very slow worker can hurt even with a tiny batch: its intercept alone may exceed the makespan
    the others reach without it, and every extra worker makes the all-reduce more expensive. So,
    with the workers ordered fastest first (per-sample time, then intercept, then index), the
    candidates are the fastest k workers for k = n, n-1, ..., ``min_workers`` (at most
    ``max_dropped`` dropped, ``None``: no limit). Each candidate gets the optimal split from
    :func:`solve_batch_sizes` and is scored by its predicted throughput

        global_batch / (step_time(k) + allreduce_cost_s(k))   samples per second,

    where ``allreduce_cost_s(k)`` is the communication time of a step with k workers (``None``:
    free). The best-scoring set wins; ties (within a relative 1e-12) keep more workers, since
    dropping a worker is never free in practice (its memory, a restart of the ring). Candidates
    for which ``global_batch`` does not fit the local-batch bounds are skipped; if none fits,
    ``ValueError`` is raised. The search considers every k rather than stopping at the first
    loss, because throughput need not be unimodal in k; but it solves a candidate exactly only when
    a bound says it could beat the best so far (:func:`_step_time_lower_bounds`), which leaves a few
    dozen solves at 1024 workers instead of 1024, with the same result. Deterministic.
    """
    models = list(models)
    a, c = _model_arrays(models)
    n = a.size
    min_workers = _as_int(min_workers, "min_workers")
    if not 1 <= min_workers <= n:
        raise ValueError(f"min_workers must be in [1, {n}], got {min_workers}")
    if max_dropped is not None:
        max_dropped = _as_int(max_dropped, "max_dropped")
        if max_dropped < 0:
            raise ValueError(f"max_dropped must be >= 0, got {max_dropped}")
    # Validate settings that do not depend on k (bounds that depend on k are checked per candidate).
    B = _as_int(global_batch, "global_batch")
    lo = _as_int(min_local_batch, "min_local_batch")
    if lo < 1:
        raise ValueError(f"min_local_batch must be >= 1, got {lo}")
    hi = None if max_local_batch is None else _as_int(max_local_batch, "max_local_batch")
    if hi is not None and hi < lo:
        raise ValueError(f"max_local_batch ({hi}) must be >= min_local_batch ({lo})")

    order = _speed_order(models)
    smallest_k = min_workers if max_dropped is None else max(min_workers, n - max_dropped)
    step_floor = _step_time_lower_bounds(a[order], c[order], B, lo)
    best_k, best_tp = None, -math.inf
    for k in range(n, smallest_k - 1, -1):
        if B < k * lo or (hi is not None and B > k * hi):
            continue
        comm = 0.0 if allreduce_cost_s is None else float(allreduce_cost_s(k))
        if not math.isfinite(comm) or comm < 0:
            raise ValueError(f"allreduce_cost_s({k}) must be finite and >= 0, got {comm}")
        if best_k is not None:
            # The most this set could reach; a margin far above float rounding keeps the result exact.
            bound = B / (step_floor[k - 1] + comm) if step_floor[k - 1] + comm > 0 else math.inf
            if bound * (1.0 + 1e-9) <= best_tp * (1.0 + 1e-12):
                continue
        idx = np.array(order[:k])
        sizes = _solve(a[idx], c[idx], B, lo, hi)
        step = float(np.max(a[idx] + c[idx] * sizes))
        tp = B / (step + comm) if step + comm > 0 else math.inf
        if best_k is None or tp > best_tp * (1.0 + 1e-12):
            best_k, best_tp = k, tp
    if best_k is None:
        raise ValueError(
            f"global_batch ({B}) fits no worker set of size {smallest_k}..{n} with min_local_batch "
            f"({lo}) and max_local_batch ({hi})")
    return sorted(order[:best_k])


# --------------------------------------------------------------------------------------------------
# Gradient weights and the combined plan
# --------------------------------------------------------------------------------------------------


def gradient_weights(batch_sizes: Sequence[int]) -> List[float]:
    """Per-worker weights ``b_i / sum(b)`` for a weighted gradient average.

    Each worker's gradient is the mean over its own ``b_i`` samples; weighting by ``b_i / B`` makes
    the sum the mean over all ``B`` samples, i.e. the same gradient as one big batch. (A plain
    average would over-weight the samples of workers with small batches.) Excluded workers
    (batch size 0) get weight 0.
    """
    sizes = [_as_int(s, "batch_sizes") for s in batch_sizes]
    if not sizes:
        raise ValueError("batch_sizes must not be empty")
    if any(s < 0 for s in sizes):
        raise ValueError(f"batch_sizes must be non-negative, got {sizes}")
    total = sum(sizes)
    if total <= 0:
        raise ValueError("batch_sizes must have a positive sum")
    return [s / total for s in sizes]


@dataclass
class BoaPlan:
    """Local batch sizes and gradient weights for every worker (excluded workers: 0 and 0.0)."""

    batch_sizes: List[int]
    weights: List[float]
    active: List[int]
    predicted_step_time_s: float
    global_batch: int = 0
    excluded: List[int] = field(default_factory=list)

    def describe(self) -> dict:
        return {"batch_sizes": list(self.batch_sizes), "weights": list(self.weights),
                "active": list(self.active), "excluded": list(self.excluded),
                "global_batch": self.global_batch, "predicted_step_time_s": self.predicted_step_time_s}


def plan(models: Sequence[LinearTimeModel], global_batch: int, min_local_batch: int = 1,
         max_local_batch: Optional[int] = None, tune_workers: bool = False,
         allreduce_cost_s: Optional[Callable[[int], float]] = None, min_workers: int = 1,
         max_dropped: Optional[int] = None) -> BoaPlan:
    """The BOA decision for one profile: which workers run, their batch sizes and gradient weights.

    With ``tune_workers`` the worker set comes from :func:`choose_worker_set`; otherwise all workers
    are kept. The kept workers get the exact split of :func:`solve_batch_sizes`; excluded workers
    get batch size 0 and weight 0. ``predicted_step_time_s`` is the compute makespan of the kept
    workers (communication not included).
    """
    models = list(models)
    a, c = _model_arrays(models)
    n = a.size
    if tune_workers:
        active = choose_worker_set(models, global_batch, min_local_batch, max_local_batch,
                                   allreduce_cost_s=allreduce_cost_s, min_workers=min_workers,
                                   max_dropped=max_dropped)
    else:
        active = list(range(n))
    B, lo, hi = _check_bounds(len(active), global_batch, min_local_batch, max_local_batch)
    idx = np.array(active)
    sizes = _solve(a[idx], c[idx], B, lo, hi)
    batch_sizes = [0] * n
    for i, s in zip(active, sizes):
        batch_sizes[i] = int(s)
    return BoaPlan(
        batch_sizes=batch_sizes,
        weights=gradient_weights(batch_sizes),
        active=list(active),
        predicted_step_time_s=float(np.max(a[idx] + c[idx] * sizes)),
        global_batch=B,
        excluded=sorted(set(range(n)) - set(active)),
    )


# --------------------------------------------------------------------------------------------------
# The strategy's decisions (BoaStrategy gathers and applies them; sim/boa.py calls the same functions)
# --------------------------------------------------------------------------------------------------


def initial_allocation(world_size: int, local_batch: int, global_batch: int = 0, min_local_batch: int = 1,
                       max_local_batch: int = 0, initial_batch_sizes: Optional[Sequence[int]] = None) -> List[int]:
    """The first split: ``initial_batch_sizes`` if given, else the global batch (0 = workers x
    ``local_batch``) split evenly, the first ``B mod N`` workers one sample more."""
    n = world_size
    if initial_batch_sizes is not None:
        sizes = [int(b) for b in initial_batch_sizes]
        if len(sizes) != n:
            raise ValueError(f"initial_batch_sizes needs one entry per worker ({n}) (got {sizes})")
        return sizes
    total = global_batch or local_batch * n
    if total < n * min_local_batch or (max_local_batch and total > n * max_local_batch):
        raise ValueError(f"global_batch {total} cannot be placed on {n} workers within "
                         f"min_local_batch={min_local_batch}, max_local_batch={max_local_batch or 'none'}")
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def time_model_from_points(points: Sequence[tuple], current: int) -> LinearTimeModel:
    """One worker's time model from its (batch size, compute seconds) records.

    Least squares where the batch sizes spread enough to tell slope from intercept; otherwise (and
    whenever the fit puts less than half the time on the samples) time proportional to the batch. Once
    an allocation settles, each rank's sizes barely move, and a free fit then turns noise into a zero
    slope: the planner would treat that rank as free and pile samples on it."""
    real = [(b, t) for b, t in points if current > 0 or b > 1] or list(points)  # skip placeholders when possible
    sizes, times = [b for b, _ in real], [t for _, t in real]
    per_sample = float(statistics.median(t / b for b, t in real))
    proportional = LinearTimeModel(0.0, max(per_sample, PER_SAMPLE_FLOOR_S))
    mean_b = sum(sizes) / len(sizes)
    if max(sizes) - min(sizes) < 0.25 * mean_b:
        return proportional
    fitted = fit_linear_time_model(sizes, times)
    return fitted if fitted.per_sample_s >= 0.5 * per_sample else proportional


def allreduce_cost_at(measured_s: float, world_size: int) -> Callable[[int], float]:
    """The all-reduce cost measured at ``world_size`` workers, scaled to k workers: a ring all-reduce moves
    2(k-1)/k of the gradient per worker."""
    n = world_size

    def cost(k: int) -> float:
        return measured_s * (2 * (k - 1) / k) / (2 * (n - 1) / n) if n > 1 else 0.0

    return cost


def rebalance_decision(points: Sequence[Sequence[tuple]], current: Sequence[int], global_batch: int,
                       min_local_batch: int = 1, max_local_batch: int = 0, tune_workers: bool = False,
                       measured_allreduce_s: float = 0.0, rebalance_gain: float = 0.05) -> Optional[dict]:
    """Rank 0's re-planning at a window's end, from ``points[i]`` = rank i's (batch size, compute seconds)
    records over the recent windows: the new batch sizes, the workers left out and the predicted step
    times, or None to keep ``current`` (the predicted gain is at most ``rebalance_gain``, or the plan is
    the same). ``models`` holds each rank's :class:`LinearTimeModel`."""
    n = len(current)
    models = [time_model_from_points(list(points[i]), current[i]) for i in range(n)]
    result = plan(models, global_batch, min_local_batch, max_local_batch or None, tune_workers=tune_workers,
                  allreduce_cost_s=allreduce_cost_at(measured_allreduce_s, n) if tune_workers else None)
    predicted_now = predicted_step_time(models, current)
    gain = (predicted_now - result.predicted_step_time_s) / predicted_now if predicted_now > 0 else 0.0
    if gain <= rebalance_gain or list(result.batch_sizes) == list(current):
        return None
    return {"batch_sizes": list(result.batch_sizes), "excluded": list(result.excluded),
            "predicted_step_s_before": predicted_now, "predicted_step_s_after": result.predicted_step_time_s,
            "predicted_gain": gain, "models": models}
