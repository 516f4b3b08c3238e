"""Which samples each rank takes at each step under BOA's changing batch allocations (pure logic).

Every epoch has one shared, seeded permutation of the training set. At step s the allocation
(b_0 .. b_{N-1}, summing to the global batch B) in force at s decides the slices: rank i takes the
next b_i samples after ranks 0..i-1, and the step consumes B samples. So within an epoch every sample
is used exactly once whatever the allocations were, and every rank has the same number of steps
(floor(len / B)); the last partial global batch is dropped, as ``drop_last`` would.

A rank excluded by worker-set tuning (b_i = 0) still steps in lock-step with the others on a one-sample
placeholder batch whose gradient weight is 0; placeholders are reported as such, never counted.
"""
from __future__ import annotations

import bisect
from typing import List, Sequence, Tuple


class AllocationSchedule:
    """Batch sizes in force from given steps on; changes are appended in step order."""

    def __init__(self, initial: Sequence[int]) -> None:
        self._from: List[int] = [0]
        self._sizes: List[Tuple[int, ...]] = [tuple(int(b) for b in initial)]
        self._check(self._sizes[0])

    def _check(self, sizes: Tuple[int, ...]) -> None:
        if any(b < 0 for b in sizes) or sum(sizes) <= 0:
            raise ValueError(f"batch sizes must be >= 0 with a positive sum (got {list(sizes)})")
        if self._sizes and sum(sizes) != sum(self._sizes[0]):
            raise ValueError(f"batch sizes must keep the global batch {sum(self._sizes[0])} (got {list(sizes)})")

    @property
    def global_batch(self) -> int:
        return sum(self._sizes[0])

    def at(self, step: int) -> Tuple[int, ...]:
        return self._sizes[bisect.bisect_right(self._from, step) - 1]

    def change(self, from_step: int, sizes: Sequence[int]) -> None:
        sizes = tuple(int(b) for b in sizes)
        self._check(sizes)
        if from_step < self._from[-1]:
            raise ValueError(f"changes must come in step order ({from_step} < {self._from[-1]})")
        if from_step == self._from[-1]:
            self._sizes[-1] = sizes
        else:
            self._from.append(int(from_step))
            self._sizes.append(sizes)

    def weight(self, rank: int, step: int) -> float:
        """This rank's share of the global gradient at ``step``: b_i / B."""
        return self.at(step)[rank] / self.global_batch

    def state(self) -> dict:
        return {"from": list(self._from), "sizes": [list(s) for s in self._sizes]}


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> List[int]:
    import torch  # here only: the schedule itself (also the simulator's) needs no torch

    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def rank_slice(perm: Sequence[int], step_in_epoch: int, sizes: Sequence[int], rank: int) -> Tuple[List[int], bool]:
    """(indices, placeholder) for ``rank`` at one step; ``placeholder`` marks an excluded rank's dummy."""
    offset = step_in_epoch * sum(sizes) + sum(sizes[:rank])
    if sizes[rank] == 0:
        return [perm[step_in_epoch * sum(sizes)]], True
    return list(perm[offset:offset + sizes[rank]]), False
