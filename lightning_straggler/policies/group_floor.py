"""How many ranks dpar and awar may leave out of their group at once (no torch, no Horovod).

The group is formed with Horovod's ``join()``: ranks out of the group have joined and add zeros to the
others' all-reduces. Horovod 0.28.1 corrupts memory (glibc "free(): invalid next size", the job aborts)
when two or more ranks of an 8-rank Gloo job are joined while the others all-reduce; with one joined
rank at 8, and with up to three at 4 ranks, it ran clean (``python -m benchmarks.join_safety`` reproduces
both). Above ``JOIN_SAFE_WORLD`` ranks at most one rank is out of the group at a time. The strategies
and the simulator both take their group floor from here.
"""
from __future__ import annotations

JOIN_SAFE_WORLD = 4


def max_outside(world_size: int) -> int:
    """How many ranks may be out of the group (joined) at once."""
    return max(0, world_size - 1) if world_size <= JOIN_SAFE_WORLD else 1


def join_safe_floor(world_size: int, configured: int) -> int:
    """The group floor actually used: the configured one, raised so that no more than
    :func:`max_outside` ranks are ever out of the group at once."""
    return max(configured, world_size - max_outside(world_size))
