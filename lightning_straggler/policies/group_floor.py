"""How many ranks dpar and awar may leave out of their group at once (no torch, no Horovod).

The group is formed with Horovod's ``join()``: ranks out of the group have joined and add zeros to the
others' all-reduces. Stock Horovod 0.28.1 corrupts its coordinator's heap (glibc "free(): invalid next
size", the job aborts) when two or more ranks of an 8-rank job are joined while the others all-reduce:
``Controller::ConstructResponse`` sizes a per-rank vector by the number of requests received (fewer than
the ranks while some are joined) and then indexes it by rank. With one joined rank at 8, and up to three
at 4 ranks, the stray writes happened to stay inside malloc's slack (``python -m benchmarks.join_safety``
reproduces it). ``scripts/setup.sh`` builds Horovod with this project's fix
(``scripts/patches/horovod-0.28.1-join.patch``); with that build any number of ranks may be out. With a
stock Horovod (e.g. an existing installation under ``horovodrun``) above ``JOIN_SAFE_WORLD`` ranks at
most one rank is out of the group at a time. The strategies and the simulator both take their group
floor from here.
"""
from __future__ import annotations

JOIN_SAFE_WORLD = 4


def max_outside(world_size: int, join_fixed: bool = True) -> int:
    """How many ranks may be out of the group (joined) at once: all but one with the fixed Horovod,
    else all but one up to ``JOIN_SAFE_WORLD`` ranks and one above."""
    if join_fixed or world_size <= JOIN_SAFE_WORLD:
        return max(0, world_size - 1)
    return 1


def join_safe_floor(world_size: int, configured: int, join_fixed: bool = True) -> int:
    """The group floor actually used: the configured one, raised so that no more than
    :func:`max_outside` ranks are ever out of the group at once."""
    return max(configured, world_size - max_outside(world_size, join_fixed))
