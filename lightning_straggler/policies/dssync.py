"""Divide-and-Shuffle Synchronization (DS-Sync): which workers average together at a step.

Reference: W. Wang, C. Zhang, L. Yang, K. Chen, K. Tan, "Addressing Network Bottlenecks with
Divide-and-Shuffle Synchronization for Distributed DNN Training", arXiv:2007.03298 (2020).

The ``world_size`` (N) workers are divided into small groups of about ``group_size`` (g) that
average only among themselves at a step; membership is reshuffled from step to step so that
information still mixes through the whole job. A straggler then only holds up its own group.

Everything here is a pure function of (world_size, group_size, kind, seed, num_partitions): every
rank derives the same partition for step ``t`` without communicating. Horovod process sets must be
registered once, up front, so the schedule is a finite cycle of ``num_partitions`` partitions
(step ``t`` uses partition ``t % num_partitions``) and :meth:`DSSyncSchedule.all_groups` lists every
group the cycle can ever use.

Group sizes -- no worker is ever dropped and no group is smaller than ``group_size``:

* ``random`` kind, and any world size that ``group_size`` does not divide: a sequence of N workers
  is cut into ``k = N // g`` consecutive groups of g, and the ``r = N % g`` leftover workers are
  spread one at a time over the LAST groups (as evenly as possible), so sizes lie in
  ``g .. g + ceil(r / k)``. Example: N=5, g=2 -> sizes (2, 3); N=11, g=4 -> sizes (5, 6).
* ``butterfly`` kind, see below: sizes lie in ``g .. 2 * r_s`` where ``r_s >= g`` is the radix of
  the stage.

``butterfly`` kind (hypercube / butterfly all-reduce pattern, deterministic, ``seed`` unused):

* N and g both powers of two (N = 2**n, g = 2**b, b >= 1): stage s groups the ranks that differ
  only in a block of b bits starting at bit ``min(s * b, n - b)``. There are
  ``S = ceil(n / b) = ceil(log2 N / log2 g)`` stages. When b does not divide n the last block is
  moved down to end at the top bit (it overlaps the previous one), so every group still has exactly
  g members. Guarantee: any S consecutive steps mix every worker with every other (the blocks cover
  all n bits, and each stage can set the bits of its block to anything), and S - 1 steps never do
  (at most (S-1)*b < n bits can change, so some pair of ranks never meets).
* Any other N (or a g that is not a power of two, g >= 2): mixed-radix digits. D is the largest d
  with ``g**d <= N``; D radices start at g and the smallest is raised by one while their product P
  stays ``<= N`` (so P > N*g/(g+1) >= 2N/3 and the leftover ``N - P < P/2``). Ranks ``0..P-1``
  ("core") are mixed-radix numbers; stage s groups the core ranks that differ only in digit s, and
  each leftover rank ``e >= P`` always joins the group of core rank ``e - P`` (its "shadow"). When
  N = g**D this is exactly the base-g butterfly. Guarantee: any D consecutive steps mix everyone
  (the shadows follow their core rank) and D - 1 never do (N > 1). If N < g**2 then D = 1 and the
  single stage is one group of everyone: there is no way to split into digits of size >= g.
* g == 1: every worker alone, one partition, no mixing at all (N > 1).

Number of distinct groups (= Horovod process sets to create) as N grows:

* butterfly: (N / g) groups per stage times ceil(log_g N) stages, i.e. O(N log N / g)
  (the general form has P / r_s groups at stage s, fewer still).
* random: at most ``num_partitions * (N // g)``, i.e. O(num_partitions * N / g).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

KINDS = ("butterfly", "random")
DEFAULT_RANDOM_PARTITIONS = 4

Group = Tuple[int, ...]
Partition = Tuple[Group, ...]


def _is_int(x) -> bool:
    # bool is an int subclass, but True as a world size is a bug, not a 1.
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_int(name: str, value, lo: int, hi: Optional[int] = None, hint: str = "",
               hi_name: Optional[str] = None) -> int:
    allowed = f"{lo}..{hi_name or hi}" if hi is not None else f">= {lo}"
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be an integer in {allowed}{hint} (got {value!r})")
    return int(value)


def chunk_sizes(n: int, group_size: int) -> List[int]:
    """Sizes of the consecutive groups that n workers are cut into (the remainder rule).

    ``n // group_size`` groups; the ``n % group_size`` leftovers go one at a time to the last groups,
    so no group is smaller than ``group_size`` and sizes differ by at most one above it.
    """
    if group_size < 1 or n < group_size:
        raise ValueError(f"group_size must be in 1..n (n={n}) (got {group_size})")
    k, r = divmod(n, group_size)
    base, extra = divmod(r, k)
    # Larger groups last: "the remainder joins the last group(s)".
    return [group_size + base + (1 if i >= k - extra else 0) for i in range(k)]


def chunk(order: Sequence[int], group_size: int) -> Partition:
    """Cut ``order`` into groups by :func:`chunk_sizes`; canonical form (sorted groups, sorted by first)."""
    groups, i = [], 0
    for size in chunk_sizes(len(order), group_size):
        groups.append(tuple(sorted(int(x) for x in order[i:i + size])))
        i += size
    return tuple(sorted(groups))


def _power_of_two_exponent(x: int) -> Optional[int]:
    return x.bit_length() - 1 if x >= 1 and x & (x - 1) == 0 else None


def _mixed_radices(world_size: int, group_size: int) -> List[int]:
    """D = floor(log_g N) radices >= g, as balanced as possible, with the largest product <= N."""
    d, p = 0, 1
    while p * group_size <= world_size:  # integer loop: float log would misjudge exact powers
        d, p = d + 1, p * group_size
    radices = [group_size] * d
    while True:
        i = min(range(d), key=lambda j: (radices[j], j))  # raise the smallest first: balanced digits
        if p // radices[i] * (radices[i] + 1) > world_size:
            return radices
        p = p // radices[i] * (radices[i] + 1)
        radices[i] += 1


def _butterfly_pow2(world_size: int, group_size: int) -> List[Partition]:
    n, b = _power_of_two_exponent(world_size), _power_of_two_exponent(group_size)
    stages = -(-n // b)
    out = []
    for s in range(stages):
        start = min(s * b, n - b)  # overlap the last block rather than make groups smaller than g
        mask = (group_size - 1) << start
        bases = sorted({x & ~mask for x in range(world_size)})
        out.append(tuple(tuple(base | (v << start) for v in range(group_size)) for base in bases))
    return out


def _butterfly_mixed_radix(world_size: int, group_size: int) -> List[Partition]:
    radices = _mixed_radices(world_size, group_size)
    core = int(np.prod(radices))
    strides = [int(np.prod(radices[:s])) for s in range(len(radices))]
    out = []
    for s, (radix, stride) in enumerate(zip(radices, strides)):
        groups: Dict[int, List[int]] = {}
        for c in range(core):
            digit = (c // stride) % radix
            groups.setdefault(c - digit * stride, []).append(c)
        for e in range(core, world_size):  # leftover ranks shadow core rank e - core
            c = e - core
            groups[c - ((c // stride) % radix) * stride].append(e)
        out.append(tuple(sorted(tuple(sorted(g)) for g in groups.values())))
    return out


def butterfly_stages(world_size: int, group_size: int) -> List[Partition]:
    """The distinct partitions of the butterfly schedule, in stage order (see the module docstring)."""
    if group_size == 1:
        return [tuple((i,) for i in range(world_size))]
    if _power_of_two_exponent(world_size) is not None and _power_of_two_exponent(group_size) is not None:
        return _butterfly_pow2(world_size, group_size)
    return _butterfly_mixed_radix(world_size, group_size)


class DSSyncSchedule:
    """Which group each rank averages with at each step; identical on every rank."""

    def __init__(self, world_size: int, group_size: int = 2, kind: str = "butterfly",
                 num_partitions: Optional[int] = None, seed: int = 0) -> None:
        self.world_size = _check_int("world_size", world_size, 1)
        self.group_size = _check_int("group_size", group_size, 1, self.world_size,
                                     f" (world_size={self.world_size})", hi_name="world_size")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(map(repr, KINDS))} (got {kind!r})")
        self.kind = kind
        self.seed = _check_int("seed", seed, 0)  # SeedSequence rejects negative entries

        if kind == "butterfly":
            stages = butterfly_stages(self.world_size, self.group_size)
            # Fewer stages would never mix everyone, more would only repeat stages: the cycle IS the stages.
            if num_partitions is not None and (not _is_int(num_partitions) or num_partitions != len(stages)):
                raise ValueError(
                    f"num_partitions for kind='butterfly' must be None or {len(stages)} (the number of stages "
                    f"for world_size={self.world_size}, group_size={self.group_size}) (got {num_partitions!r})")
            self.num_partitions = len(stages)
            self._partitions = stages
        else:
            n = DEFAULT_RANDOM_PARTITIONS if num_partitions is None else num_partitions
            self.num_partitions = _check_int("num_partitions", n, 1)
            self._partitions = [self._random_partition(i) for i in range(self.num_partitions)]

        # rank -> its group, per partition: group_of is a lookup, not a search.
        self._owner: List[List[Group]] = []
        for part in self._partitions:
            owner: List[Group] = [()] * self.world_size
            for g in part:
                for r in g:
                    owner[r] = g
            self._owner.append(owner)
        # first appearance over the cycle: partition 0's groups, then partition 1's new ones, ... Horovod
        # coordinates its process sets in creation order every cycle, one thread per rank; created so, a
        # step's groups never wait in an idle set's coordination for a member still in another of the
        # step's transfers, so they run at the same time (README, "Over shaped links")
        self._all_groups = list(dict.fromkeys(g for part in self._partitions for g in part))

    def _random_partition(self, index: int) -> Partition:
        # One generator per (seed, index): any partition is recomputable alone, in any order.
        perm = np.random.default_rng([self.seed, index]).permutation(self.world_size)
        return chunk(perm, self.group_size)

    def _index(self, step: int) -> int:
        return _check_int("step", step, 0) % self.num_partitions

    def partition(self, step: int) -> Partition:
        """Groups at ``step``: sorted tuples, sorted by first rank, every rank exactly once."""
        return self._partitions[self._index(step)]

    def group_of(self, rank: int, step: int) -> Group:
        rank = _check_int("rank", rank, 0, self.world_size - 1, f" (world_size={self.world_size})",
                          hi_name="world_size-1")
        return self._owner[self._index(step)][rank]

    def all_groups(self) -> List[Group]:
        """Every distinct group over the cycle, in order of first appearance (each partition's groups
        together): the process sets to create up front, in this order."""
        return list(self._all_groups)

    def describe(self) -> dict:
        return {"kind": self.kind, "group_size": self.group_size, "num_partitions": self.num_partitions,
                "seed": self.seed, "num_groups": len(self._all_groups)}


def mixing_matrix(partition: Sequence[Sequence[int]], world_size: int) -> np.ndarray:
    """Averaging matrix of one step: W[i, j] = 1/|G| if i and j are in the same group G, else 0.

    Row-stochastic (and symmetric, so doubly stochastic): x_next = W @ x is the in-group average.
    """
    world_size = _check_int("world_size", world_size, 1)
    w = np.zeros((world_size, world_size))
    seen = np.zeros(world_size, dtype=bool)
    for g in partition:
        idx = np.asarray(list(g), dtype=int)
        if idx.size == 0 or idx.min() < 0 or idx.max() >= world_size or seen[idx].any() or len(set(idx.tolist())) != idx.size:
            raise ValueError(f"partition must cover 0..{world_size - 1} with every rank exactly once "
                             f"(bad group {tuple(g)!r})")
        seen[idx] = True
        w[np.ix_(idx, idx)] = 1.0 / idx.size
    if not seen.all():
        raise ValueError(f"partition must cover 0..{world_size - 1} with every rank exactly once "
                         f"(missing {np.flatnonzero(~seen).tolist()})")
    return w


def steps_to_full_mixing(schedule: DSSyncSchedule, max_steps: int, start: int = 0) -> Optional[int]:
    """Smallest k in 1..max_steps such that W[start+k-1] @ ... @ W[start] has every entry > 0
    (every worker's value has reached every other worker), or None.

    Positivity is tracked as a boolean reachability matrix: the float product would underflow for
    large N and k, and only its sign pattern matters.
    """
    max_steps = _check_int("max_steps", max_steps, 0)
    start = _check_int("start", start, 0)
    n = schedule.world_size
    reach = np.eye(n, dtype=bool)
    for k in range(1, max_steps + 1):
        b = mixing_matrix(schedule.partition(start + k - 1), n) > 0
        reach = (b.astype(np.int64) @ reach.astype(np.int64)) > 0
        if reach.all():
            return k
    return None
