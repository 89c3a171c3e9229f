"""One save run in the background: the caller's thread stages the writes (copies off
the devices, see `protocol.stage`), a thread of the save's own writes and commits them
(`SaveJob.run`).

Each save has its own queue, byte budget (the job's) and thread, so two saves in flight
(the persistent tier's and a local-tier copy) never wait on each other, and the failure
of one never stops the other. What happens after is the caller's: `on_commit` runs on
the save's thread once it has committed, `on_failure` with whatever stopped it (the
save's own error, or one raised by `on_commit`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .._util import concurrency as _concurrency
from ..errors import CheckpointError
from .protocol import SaveJob, Work, stage

log = logging.getLogger("zarrckpt")

_END = object()  # every write was staged
_STOPPED = object()  # staging stopped part-way: the writer fails the save


class BackgroundSave:
    """`job`, staged by `start` on the calling thread and written on a thread of its own.
    Once it has ended it holds nothing of the state saved (the caller may free it).

    Started (`start`), its thread and those it writes with run at a lower scheduling
    priority (`_concurrency.yield_to_training`), and write with fewer threads unless
    the job's options say how many (`_concurrency.Share.beside_training`): the caller's
    thread goes on training. Once the caller waits for it (`join`), it writes with all
    of them."""

    def __init__(self, job: SaveJob, name: str, *, on_commit: Callable[[], None],
                 on_failure: Callable[[BaseException], None]) -> None:
        self.url = job.loc.url
        self._job: SaveJob | None = job  # until it runs: then only its run holds it
        self._writing: SaveJob | None = None  # handed from `start` to the save's thread
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._on_commit, self._on_failure = on_commit, on_failure
        self._staging_failed = False
        self._ended = False  # whether the writer has taken the staging's last item
        self.staged: float | None = None  # when `start` had dispatched every copy (perf_counter)
        self.save_id: str | None = None  # the identity of the save, once committed (see `_commit`)
        self._name = name
        self._share = _concurrency.Share()  # how many of the job's writers may run: all, unless `start` says
        self._thread: threading.Thread | None = None
        # Set by the save itself when it has committed or failed: a `Thread.join` that a
        # KeyboardInterrupt cut short leaves the thread reading as stopped while it
        # still writes (python/cpython#90882).
        self._finished = threading.Event()
        # Set once the save's thread may begin: the copies are dispatched, the staging is
        # about to wait on it (see `start`), or the staging failed.
        self._go = threading.Event()

    def start(self) -> None:
        """Stages every write of the job and returns once the copies are dispatched; the
        save's thread writes them as they come. Raises what stopped the staging here (a
        KeyboardInterrupt, a device error: the writer then fails the save without
        reporting it again); a failure of the writer is its own (`on_failure`)."""
        job, self._job = self._job, None
        assert job is not None, "a save starts once"
        if job.options.max_workers is None:
            job.share = self._share = _concurrency.Share.beside_training(job.loc.requests_wait)
        self._writing = job
        thread = threading.Thread(target=self._write, name=self._name, daemon=True)
        self._thread = thread
        # The writer waits until the copies are dispatched: beside the staging, its
        # Python took turns with it at the GIL and doubled how long training was blocked
        # (600 leaves on CPU: 89 ms, against 141 ms). Sooner where the staging may wait
        # on it: for writes to give memory back, or in a collective move, whose other
        # processes' writers may be waiting in an agreement for this one. It always
        # runs: a failed staging is its to fail on every process.
        try:
            thread.start()
            stage(job, self._queue.put, before_waiting=self._go.set)
            self.staged = time.perf_counter()  # before the end: the commit comes after it
            self._queue.put(_END)
            self._go.set()
        except _concurrency.Aborted:  # the writer failed first, and reports it
            self._go.set()  # every way out of here leaves it set (a writer that aborted the budget runs)
            self._queue.put(_STOPPED)
        except BaseException as e:  # a Ctrl-C anywhere here included: the writer is told, and waited for
            self._staging_failed = True  # before the writer may begin: it must not report the failure again
            self._go.set()
            self._queue.put(_STOPPED)  # after an _END, never read
            # Said here, before the wait that a second Ctrl-C may cut short: the writer
            # does not report a save whose staging failed, and a Ctrl-C's traceback alone
            # does not say that the step was lost.
            log.warning("%s was not saved: %s while its state was being copied off the devices; nothing was "
                        "committed", self.url, type(e).__name__)
            if thread.ident is None:  # interrupted before it started: nothing else will end it
                self._writing = None
                self._finished.set()
            self._finished.wait()
            raise

    def run(self) -> None:
        """The whole save on the calling thread: writes as it copies, then commits."""
        job, self._job = self._job, None
        assert job is not None, "a save runs once"
        with contextlib.closing(job.admitted()) as work:
            self._run(job, work)

    def join(self, timeout: float | None = None) -> bool:
        """Waits until the save has committed (and `on_commit` has run) or failed, at most
        `timeout` seconds; returns whether it has. A KeyboardInterrupt leaves the save
        going on, and a later `join` waits for it again. The caller is not training
        meanwhile: the save writes with all its threads from now on."""
        self._share.hurry()
        return self._thread is None or self._finished.wait(timeout)

    @property
    def started(self) -> bool:
        """Whether `start` or `run` has been called (a save never started never ends)."""
        return self._job is None

    @property
    def done(self) -> bool:
        """Whether the save has committed or failed (a save run on the calling thread
        is done when `run` returns)."""
        return self._thread is None or self._finished.is_set()

    def _write(self) -> None:
        """The save's thread: writes what `start` stages, then says the save is done."""
        _concurrency.yield_to_training()
        self._go.wait()
        job, self._writing = self._writing, None
        if job is None:  # `start` was interrupted as this thread started, and ended the save
            return
        try:
            self._run(job, self._staged())
        except BaseException:  # the caller's on_commit or on_failure failed: said, and its traceback let go
            log.exception("the save to %s failed as it ended", self.url)
        finally:
            # The job holds the state saved: this thread lets it go before it says the
            # save is done, not after (as `Thread(args=...)` would), when the interpreter
            # may be exiting: a jax array freed by a thread that finalization stops
            # aborts the process ("FATAL: exception not rethrown").
            del job
            self._finished.set()

    def _run(self, job: SaveJob, work: Work) -> None:
        try:
            job.run(work)
            self.save_id = job.save_id
            self._on_commit()
        except BaseException as e:
            self._drop_staged()
            if not self._staging_failed:
                self._on_failure(e)

    def _staged(self) -> Iterator[Any]:
        while (item := self._queue.get()) is not _END:
            if item is _STOPPED:
                self._ended = True
                raise CheckpointError(f"staging {self.url} stopped part-way; nothing was committed")
            yield item
        self._ended = True

    def _drop_staged(self) -> None:
        """Gives back what staged writes still hold (pinned buffers, budget), up to the
        end of the staging, which the failed save's budget has stopped (see `SaveJob.run`)."""
        if self._thread is None:
            return  # a save run on the calling thread stages nothing
        while not self._ended:
            item = self._queue.get()
            self._ended = item is _END or item is _STOPPED
            if not self._ended:
                item[1].release()
