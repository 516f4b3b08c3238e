"""The stall watchdog's shared view of the local workers' collectives (no torch, no Horovod).

Each worker notes the collective it is blocked in, and since when, on a :class:`CollectiveBoard` in shared
memory (``comm`` wraps every blocking collective in :func:`waiting`); the launcher reads the board to
name a collective some ranks never join, and a frozen rank (:meth:`CollectiveBoard.frozen`, with
:func:`process_stopped` and :func:`main_thread_cpu` from ``/proc``).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import time
from typing import Dict, Iterator, List, Optional, Sequence

_NAME_BYTES = 96
BUSY_FACTOR = 3  # a rank busy in its own code (not frozen) holds the others up for at most this x stall_timeout_s


class CollectiveBoard:
    """Shared memory where each local worker notes the collective it is blocked in and since when; the
    launcher reads it to catch a collective that some ranks never join (Horovod 0.28.1's own stall
    inspector stayed silent for such a stall when tried on this project's machines)."""

    def __init__(self, size: int, start_method: str = "spawn") -> None:
        ctx = multiprocessing.get_context(start_method)  # the workers' start method (the board travels to them)
        self.size = size
        self._since = ctx.RawArray("d", size)  # 0 = not inside a collective
        self._last = ctx.RawArray("d", size)  # when the last collective ended
        self._names = ctx.RawArray("c", size * _NAME_BYTES)
        self._failed = ctx.RawArray("d", size)  # when the rank's exception reached the launcher's wrapper

    def enter(self, rank: int, name: str) -> None:
        raw = name.encode()[:_NAME_BYTES].ljust(_NAME_BYTES, b"\0")
        self._names[rank * _NAME_BYTES:(rank + 1) * _NAME_BYTES] = raw
        self._since[rank] = time.time()

    def leave(self, rank: int) -> None:
        self._since[rank] = 0.0
        self._last[rank] = time.time()

    def note_failure(self, rank: int) -> None:
        """Called by the worker when an exception leaves its training function, before it shuts Horovod
        down (which is what makes its peers fail): the cause's time, whatever order the exits come in."""
        if not self._failed[rank]:
            self._failed[rank] = time.time()

    def failed_at(self, rank: int) -> float:
        return self._failed[rank]

    def name(self, rank: int) -> str:
        return bytes(self._names[rank * _NAME_BYTES:(rank + 1) * _NAME_BYTES]).rstrip(b"\0").decode(errors="replace")

    def frozen(self, alive: Sequence[int], stopped: Sequence[int], timeout_s: float,
               now: Optional[float] = None, busy: Sequence[int] = ()) -> Dict[int, str]:
        """The live ranks that froze, each with a description naming the collective the others wait in
        and for how long: the ``stopped`` ones (SIGSTOP, a debugger), else, once some rank has waited in a
        collective longer than ``timeout_s``, those not in any collective (stuck in their own code: a hung
        data loader, a deadlock), except ``busy`` ones (their main thread is running: a straggler) until the
        wait passes ``BUSY_FACTOR`` x ``timeout_s``. A rank waiting in a collective itself is not frozen (a
        mismatch of collectives is a stall with no single culprit)."""
        now = time.time() if now is None else now
        waits = [now - self._since[r] if self._since[r] else 0.0 for r in range(self.size)]
        longest = max(waits, default=0.0)
        suspects = [r for r in alive if r in stopped]
        if not suspects and longest > timeout_s:
            suspects = [r for r in alive if not self._since[r] and (r not in busy or longest > BUSY_FACTOR * timeout_s)]
        if not suspects:
            return {}
        groups: Dict[str, List[int]] = {}
        for r in range(self.size):
            if self._since[r] and r not in suspects:
                groups.setdefault(self.name(r), []).append(r)
        others = "; ".join(f"{_rank_list(rs)} wait{'s' if len(rs) == 1 else ''} in '{name}' for "
                           f"{max(waits[r] for r in rs):.0f} s" for name, rs in groups.items())
        out = {}
        for r in suspects:
            if self._since[r]:
                where = f"itself inside '{self.name(r)}' for {waits[r]:.0f} s"
            elif self._last[r]:
                where = f"not in a collective, its last one '{self.name(r)}' ended {now - self._last[r]:.0f} s ago"
            else:
                where = "not in a collective, none yet"
            how = ("stopped (SIGSTOP or a debugger)" if r in stopped else
                   "busy in its own code for too long" if r in busy else "stuck in its own code (not running)")
            out[r] = f"froze: {how}, {where}, while {others or 'no other rank is in a collective'}; ended with SIGKILL"
        return out

    def stalled(self, timeout_s: float, now: Optional[float] = None) -> Optional[str]:
        """A description naming every rank and the collective it waits in, once one rank has waited
        longer than ``timeout_s``; else ``None``."""
        now = time.time() if now is None else now
        waits = [now - self._since[r] if self._since[r] else 0.0 for r in range(self.size)]
        if max(waits) <= timeout_s:
            return None
        parts = []
        for r in range(self.size):
            if self._since[r]:
                parts.append(f"rank {r} waits in '{self.name(r)}' for {waits[r]:.0f} s")
            else:
                last = f"'{self.name(r)}' {now - self._last[r]:.0f} s ago" if self._last[r] else "none yet"
                parts.append(f"rank {r} is not in a collective (busy or stuck in its own code; last collective: {last})")
        return "; ".join(parts)


def _rank_list(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def main_thread_cpu(pid: int) -> Optional[int]:
    """CPU ticks (user + system) of the process's main thread (where Python runs; Horovod's background
    thread, which keeps polling, is another), or ``None`` when it is gone."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def process_stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, SIGTSTP, a debugger): state T or t in /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


_board: Optional[CollectiveBoard] = None
_board_rank = 0


def watch(board: Optional[CollectiveBoard], rank: int) -> None:
    """In a worker started by the local launcher: note this rank's collectives on ``board``."""
    global _board, _board_rank
    _board, _board_rank = board, rank


@contextlib.contextmanager
def waiting(name: str) -> Iterator[None]:
    """Wrap a blocking collective so that the launcher's stall watchdog can see it (a no-op when not
    started by :class:`HorovodLauncher`)."""
    if _board is None:
        yield
        return
    _board.enter(_board_rank, name)
    try:
        yield
    finally:
        _board.leave(_board_rank)
