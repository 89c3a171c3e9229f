"""When a `CheckpointManager` saves: every so many steps, every so many seconds, or at
every call."""

from __future__ import annotations

import time

from ._util import multihost as _multihost


class SaveSchedule:
    """Due every `steps` steps (`step % steps == 0`), or once `seconds` have passed since
    the last save started; with neither, at every step."""

    def __init__(self, steps: int | None, seconds: float | None, *, timeout_s: float) -> None:
        self.steps = steps
        self.seconds = seconds
        self._timeout_s = timeout_s
        self._last = time.monotonic()

    def started(self) -> None:
        """A save started now: the next is due `seconds` from here."""
        self._last = time.monotonic()

    def due(self, step: int) -> bool:
        """Whether `step` is due. With `seconds`, process 0's clock decides for every
        process (clocks differ across hosts): collective then."""
        if self.steps is None and self.seconds is None:
            return True
        if self.steps and step % self.steps == 0:
            return True
        if (interval := self.seconds) is None:
            return False
        with _multihost.Agreement("manager-decide", self._timeout_s) as op:
            return bool(op.decide("due", lambda: time.monotonic() - self._last >= interval))
