"""Preemption notices, as a manager hears them: JAX's, agreed by every process of a
`jax.distributed` job at one step (its preemption sync point); in a job of one process
without `jax.distributed`, SIGTERM itself, which schedulers send before they kill.

SIGTERM is taken only once a loop asks `reached_preemption` (it then stops where told),
only from the main thread, only where nothing else handles it; while no open manager
listens, or at a second SIGTERM, the handler ends the process as SIGTERM does. A
process forked from one that listens (a data loader, an evaluator, a `Pool` started
by fork) starts with SIGTERM as it was before, and nothing listening: its parent's
managers are not its own, and `terminate()` must end it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import weakref
from typing import Any

from jax.experimental import multihost_utils

from ._util import multihost as _multihost

log = logging.getLogger("zarrckpt")


class Notice:
    """Whether a preemption notice has come, the step at which it was first seen (`at`),
    and the step saved for it (`saved`, at or after `at`), the same on every process."""

    def __init__(self, *, listen: bool) -> None:
        self.at: int | None = None
        self.saved: int | None = None
        self._listen = listen
        self.signalled = False  # set by the handler: a plain attribute, no lock to take there

    @property
    def unsaved(self) -> bool:
        """Whether a notice has come whose step is not saved yet: the next save is due."""
        return self.at is not None and self.saved is None

    def first_seen(self, step: int) -> bool:
        """Whether the notice is seen for the first time at `step` (then `at` is `step`),
        asked at each save and each `reached_preemption`. Under `jax.distributed`,
        collective: every process asks with the same steps, in the same order (JAX
        agrees on the step after the newest any process has asked with, so a loop that
        asks only at the steps it saves would never reach it)."""
        if not self._listen or self.at is not None:
            return False
        if _multihost.coordinated():
            from jax._src import distributed  # is the preemption service on?

            seen = distributed.global_state.preemption_sync_manager is not None and \
                multihost_utils.reached_preemption_sync_point(step)
        else:
            seen = self.signalled
        if seen:
            self.at = step
        return bool(seen)

    def look(self, step: int, *, saving: bool) -> None:
        """`first_seen(step)`, saying so with a warning: at a step being `saving`, that
        it is saved; elsewhere, that the next save call saves its step whatever the
        policy. Collective, as `first_seen`."""
        if not self.first_seen(step):
            return
        if saving:
            log.warning("preemption notice at step %d: saving it; `if mgr.reached_preemption(step): break` stops the "
                        "loop there", step)
        else:
            log.warning("preemption notice at step %d, after its save or where the loop does not save: the next "
                        "`save` call saves its step whatever the policy, and reached_preemption is True from that "
                        "step on (a loop that calls mgr.save(step, state) at every step, leaving the policy to "
                        "decide, saves at the notice's step)", step)

    def take_sigterm(self) -> None:
        """Listens for SIGTERM, in a job of one process, if nothing else handles it."""
        if not self._listen or _multihost.coordinated() or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, _on_sigterm):
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
        _listening.add(self)

    def close(self) -> None:
        _listening.discard(self)


_listening: weakref.WeakSet[Notice] = weakref.WeakSet()


def _on_sigterm(signum: int, frame: Any) -> None:
    listening = list(_listening)
    if not listening or any(notice.signalled for notice in listening):
        if listening:  # else the ending is what the sender asked for, and nothing of ours is in flight
            log.warning("a second SIGTERM: the process ends now, without waiting for the save in flight (not "
                        "committed unless it had committed before)")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # nobody listens, or a second one: as SIGTERM does
        os.kill(os.getpid(), signal.SIGTERM)
        return
    for notice in listening:
        notice.signalled = True


def _forget_in_child() -> None:
    _listening.clear()
    if signal.getsignal(signal.SIGTERM) == _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # ours replaced only SIG_DFL (`take_sigterm`)


os.register_at_fork(after_in_child=_forget_in_child)
