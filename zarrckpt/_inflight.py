"""The saves of a manager's last `save` call, in flight, and the errors of those that failed."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from ._save import BackgroundSave

log = logging.getLogger("zarrckpt")


class InFlight:
    """The saves of the last `save` call (at most one call's in flight) and the errors
    that saves and what their commits triggered left for the training thread.
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._saves: list[BackgroundSave] = []
        self._step = 0
        self._errors: list[BaseException] = []

    def start(self, saves: list[BackgroundSave], step: int, *, background: bool) -> None:
        """Starts `saves`, of `step`, in the background (else runs them here, one after the
        other), as the ones in flight. Interrupted, those not started are not in flight
        (a `save` of their step again saves it), and a warning names them."""
        with self._lock:
            self._saves, self._step = saves, step
        try:
            for save in saves:
                save.start() if background else save.run()
        except BaseException as e:
            unstarted = [save.url for save in saves if not save.started]
            with self._lock:
                self._saves = [save for save in self._saves if save.started and not save.done]
            if not isinstance(e, Exception):  # a save that had started says so itself
                warn_unsaved(unstarted, e)
            raise

    def urls(self) -> set[str]:
        with self._lock:
            return {save.url for save in self._saves}

    def step(self) -> int | None:
        """The step of the saves in flight, None with none."""
        with self._lock:
            return self._step if self._saves else None

    def unfinished(self) -> list[BackgroundSave]:
        """The saves still writing or committing."""
        with self._lock:
            return [save for save in self._saves if not save.done]

    def wait(self) -> None:
        """Blocks until every save in flight has finished (a Ctrl-C leaves them going, with
        a warning naming each), then raises the first error left, if any."""
        with self._lock:
            saves = self._saves
        try:
            for save in saves:
                save.join()
        except KeyboardInterrupt:
            for save in saves:
                if not save.done:
                    log.warning("interrupted while waiting for %s to be saved: the save goes on, and the next "
                                "save, wait() or close() waits for it, as does this program's exit", save.url)
            raise
        with self._lock:
            if self._saves is saves:
                self._saves = []
        self.raise_errors()

    def failed(self, error: BaseException) -> None:
        """Keeps `error` for the training thread (`raise_errors`)."""
        with self._lock:
            self._errors.append(error)

    def raise_errors(self) -> None:
        """Raises the first error kept, forgetting them all."""
        with self._lock:
            pending, self._errors = self._errors, []
        if pending:
            raise pending[0]


def warn_unsaved(what: Iterable[str | None], error: BaseException) -> None:
    """Says that each of `what` was not saved, `error` (a Ctrl-C, whose traceback alone
    does not say so) having come before its save started."""
    for url in what:
        if url is not None:
            log.warning("%s was not saved: %s before its save started; nothing was committed", url,
                        type(error).__name__)
