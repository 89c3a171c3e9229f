"""Preemption notices, as a manager hears them: JAX's, agreed by every process of a
`jax.distributed` job at one step (its preemption sync point); in a job of one process
without `jax.distributed`, SIGTERM itself, which schedulers send before they kill.

SIGTERM is taken from the first save on (a manager that only restores, in an evaluator
say, leaves it alone), only where nothing else handles it, and a second SIGTERM ends the
process as SIGTERM does: a loop that never stops at the notice can still be stopped.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from jax.experimental import multihost_utils

from . import _multihost


class Notice:
    """Whether a preemption notice has come, and the step at which it was first seen
    (`at`), the same on every process."""

    def __init__(self, *, listen: bool) -> None:
        self.at: int | None = None
        self._listen = listen
        self._signalled = threading.Event()
        self._previous: Any = None
        self._ours = False
        self._tried = False

    def first_seen(self, step: int) -> bool:
        """Whether the notice is seen for the first time at `step` (then `at` is `step`),
        called at each save. Under `jax.distributed`, collective: every process calls it
        at every step."""
        if not self._listen or self.at is not None:
            return False
        if not self._tried:
            self._tried = True
            if not _multihost.coordinated() and threading.current_thread() is threading.main_thread() and \
                    signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
                self._ours = True
        if _multihost.coordinated():
            seen = multihost_utils.reached_preemption_sync_point(step)
        else:
            seen = self._signalled.is_set()
        if seen:
            self.at = step
        return seen

    def close(self) -> None:
        """Gives SIGTERM back to what handled it before, if the handler is still ours."""
        if self._ours and threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous)
        self._ours = False

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Nothing that takes a lock here (logging would): the main thread may hold it.
        if self._signalled.is_set():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        self._signalled.set()
