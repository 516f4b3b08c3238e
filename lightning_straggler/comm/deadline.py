"""A step's gradient all-reduce that a late rank does not hold up (``adaptive``'s step deadline; the
rule is ``policies/deadline.py``).

Every rank hands each step's all-reduce in exactly once, under the same name, so the collectives match
as Horovod needs: either its main thread hands in its gradients (:meth:`DeadlineExchange.exchange`), or,
once the step's deadline has passed, a helper thread hands in zeros for it (a zero contribution is no
contribution: the all-reduce is a sum). A lock decides which of the two, so never both and never
neither. The rank's main thread then takes the step's result like every other rank, whichever thread
handed in: every rank applies the same update.

Only the step the main thread is in can be handed in by the helper (it is armed at the step's start,
:meth:`DeadlineExchange.arm`): nothing runs ahead of the training loop, so a rank never hands in a step
the others will not run (at the end of training, at a validation, before a re-plan).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, List, Optional, Sequence

import torch

from lightning_straggler.comm.base import Collectives
from lightning_straggler.watchdog import waiting

POLL_S = 2e-4  # the helper's sleep between polls of a cut step's all-reduce

# zeros(step, waited_s): the tensors a cut rank hands in for ``step``, ``waited_s`` after the group's
# last collective (zeros, with whatever slots the strategy fills for a rank that did not arrive)
ZerosFor = Callable[[int, float], List[torch.Tensor]]


class DeadlineExchange:
    """One rank's side of the deadline protocol (see the module docstring)."""

    def __init__(self, comm: Collectives, zeros_for: ZerosFor, tag: str = "grads") -> None:
        self.comm, self.zeros_for, self.tag = comm, zeros_for, tag
        self._cv = threading.Condition()
        self._armed: Optional[int] = None  # the step whose deadline is set (None: none)
        self._deadline = 0.0  # time.monotonic() when the helper hands the armed step in
        self._anchor = 0.0  # the group's last shared moment when the step was armed
        self._taken: Optional[int] = None  # the last step handed in, by either thread
        self._cut: dict = {}  # step -> {"zeros", "handle", "done"}: handed in with zeros for this rank
        self._stop = False
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._helper, name="deadline-exchange", daemon=True)
        self._thread.start()

    # --- the main thread -----------------------------------------------------------------------------
    def arm(self, step: int, seconds: Optional[float], not_before: float = 0.0) -> bool:
        """At the start of ``step``: it stays open until ``seconds`` after the group's last collective, or
        after ``not_before`` (time.monotonic()) when that is later (None: no deadline). A deadline already
        past is taken at once, by this thread. Returns whether the step has been cut (the rank then skips
        its compute)."""
        with self._cv:
            self._raise_helper_error()
            if seconds is None:
                self._armed = None
                return False
            anchor = max(self.comm.last_collective_end, not_before)
            deadline = anchor + seconds
            if time.monotonic() >= deadline:
                self._hand_in_zeros(step, time.monotonic() - anchor)
                return True
            self._armed, self._deadline, self._anchor = step, deadline, anchor
            self._cv.notify_all()
            return False

    def exchange(self, step: int, tensors: Sequence[torch.Tensor]) -> tuple:
        """Hand ``tensors`` in for ``step`` (in place: they hold the sum afterwards) unless the helper has
        handed zeros in for it; returns (the result tensors, whether this rank was cut)."""
        with self._cv:
            self._raise_helper_error()
            cut = step in self._cut
            if not cut:
                self._take(step)  # the helper no longer hands it in
                handle = self.comm.allreduce_grouped_async_(list(tensors), op="sum", tag=self.tag)
        if not cut:
            self.comm.finish(handle, tag=self.tag)
            return list(tensors), False
        with waiting(f"{self.tag}.all (this rank cut by the deadline)"), self._cv:
            while not self._cut[step]["done"]:  # the helper waits for the result and notes when it came
                self._raise_helper_error()
                self._cv.wait(timeout=1.0)
            return self._cut.pop(step)["zeros"], True

    def close(self) -> None:
        """Stop the helper (at the end of training; nothing is armed then)."""
        with self._cv:
            self._stop = True
            self._armed = None
            self._cv.notify_all()
        self._thread.join(timeout=10)
        self._raise_helper_error()

    # --- the helper thread ---------------------------------------------------------------------------
    def _take(self, step: int) -> None:
        # (holding the lock) the step is this rank's to hand in, once, by whichever thread calls this
        if self._taken is not None and step <= self._taken:
            raise RuntimeError(f"deadline exchange: step {step} handed in twice (last {self._taken})")
        self._taken, self._armed = step, None

    def _hand_in_zeros(self, step: int, waited_s: float) -> None:
        zeros = self.zeros_for(step, waited_s)
        self._take(step)
        handle = self.comm.allreduce_grouped_async_(zeros, op="sum", tag=self.tag)
        self._cut[step] = {"zeros": zeros, "handle": handle, "done": False}
        self._cv.notify_all()

    def _helper(self) -> None:
        """Hands in zeros when the armed step's deadline passes, and waits for every cut step's result:
        the moment it comes is when the group closed the step, the next step's anchor (the rank's main
        thread may still be computing then)."""
        try:
            while True:
                with self._cv:
                    while True:
                        if self._stop:
                            return
                        pending = next((s for s, c in self._cut.items() if not c["done"]), None)
                        if pending is not None:
                            handle = self._cut[pending]["handle"]
                            break
                        if self._armed is None:
                            self._cv.wait()
                            continue
                        left = self._deadline - time.monotonic()
                        if left > 0:
                            self._cv.wait(timeout=left)
                            continue
                        self._hand_in_zeros(self._armed, time.monotonic() - self._anchor)
                while not self.comm.done(handle):  # (without the lock: the main thread goes on)
                    if self._stop:  # closed after a failure: the step will not complete
                        return
                    time.sleep(POLL_S)
                closed = time.monotonic()
                self.comm.finish(handle, tag=self.tag, watched=False)
                with self._cv:
                    self._cut[pending]["done"] = True
                    self.comm.last_collective_end = max(self.comm.last_collective_end, closed)
                    self._cv.notify_all()
        except BaseException as e:  # told to the main thread at its next call
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _raise_helper_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"deadline exchange: the helper thread failed: {self._error!r}") from self._error


__all__ = ["DeadlineExchange", "ZerosFor"]
