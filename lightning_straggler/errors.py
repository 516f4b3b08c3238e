"""Why a job ended, importable without torch or Lightning (the command line reports it)."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence


class WorkerFailure(RuntimeError):
    """The job ended because a worker died, raised, stalled in a collective or ran over the time limit.

    ``kind`` is ``died`` (signal or exit code), ``raised`` (an exception in the worker), ``stall`` or
    ``timeout``; ``rank`` is the rank to blame (``None`` when no single rank is); ``dead_ranks`` are the
    workers a restart has to go on without; ``reports`` how each worker ended, in the order the launcher
    saw them (``launcher.Report``; empty for a stall or a time-out).
    """

    def __init__(self, message: str, kind: str, rank: Optional[int], reason: str, dead_ranks: List[int],
                 reports: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.kind, self.rank, self.reason, self.dead_ranks = kind, rank, reason, list(dead_ranks)
        self.reports = list(reports)
