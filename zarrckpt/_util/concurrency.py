"""Bounded concurrency: every place that keeps several requests (or copies) in flight.

Three shapes, all on an `Operation` (a thread pool and the fate of one job):
- `Operation.fan_out`: run a function on many items at once; optionally each item
  holds bytes of a `ByteBudget` (a `Hold`) until it ends (copies, checksum reads);
- `Operation.window`: the same, but results come back in the items' order and items
  are admitted only while a budget has room (restore and export reads, staging); an
  item its consumer no longer needs (another process read it) may be given up;
- `run_all`: `fan_out` for a few small requests (listings, metadata reads).

The failure rule is the same for all: once one item of an operation has failed, no
new item starts (queued ones are cancelled), every storage request made for the
operation checks `aborted()` first and before each retry (see `_storage`), and the
first failure is raised once the items already running have ended. An item given up
(`window`'s `abandon`) is the exception: nothing waits for it, it ends on its own (at
its next request, which it does not make), and what it raises is dropped.

An operation started inside an item of another (the chunks of one large restore read,
read at once by workers the outer operation lends, see `spare_workers`) is part of that
item: its requests stop when the outer operation fails or gives the item up (those
waiting on a slow answer are cancelled when it is given up), and take their spare bytes
from the outer budget.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar, cast

_T = TypeVar("_T")
_R = TypeVar("_R")

# Host bytes read or staged and not yet written or consumed, by default: the one bound
# shared by save, restore, copy, verify and export.
DEFAULT_MAX_INFLIGHT_BYTES = 2 * 2**30

log = logging.getLogger("zarrckpt")

_current = threading.local()  # the Operation whose item this thread is running
_DONE = object()
# What `Operation.window` yields as the result of an item given up.
ABANDONED: Any = object()
# How often a window waiting for an item asks whether it is still needed.
_ABANDON_POLL_S = 0.02
# A fan-out started with fewer workers than it may have (`start`) adds one after an item
# that took this long, or as its items move this many bytes: such work waits on the
# store or copies memory outside the interpreter's lock, and another thread pays. A
# small file on a local disk takes a tenth of the time; handed among threads that
# contend for the interpreter, such files cost 2-3 times as much as written in turn.
_RAMP_S = 0.001
_RAMP_BYTES = 2**20


class Share:
    """How many of a fan-out's workers may run at once (`cap`): all of them, or, for
    work in the background of a training loop (`Share.beside_training`), `beside` of
    them until someone waits for the work (`hurry`; the caller is then not training)."""

    def __init__(self, beside: int = sys.maxsize) -> None:
        self._beside = beside
        self._hurry = threading.Event()

    @classmethod
    def beside_training(cls, requests_wait: bool) -> Share:
        """Where each request waits on a store, all workers (such threads wait, they
        do not compute); else one for every 4 cores this process may run on, at least
        one: each of those copies memory and computes checksums, taking a core and
        turns at the interpreter's lock from the training loop beside it."""
        if requests_wait:
            return cls()
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux
            cores = os.cpu_count() or 1
        return cls(max(1, cores // 4))

    def hurry(self) -> None:
        """Someone waits for the work: from now on every worker may run."""
        self._hurry.set()

    def cap(self, workers: int) -> int:
        """How many of `workers` may run now."""
        return workers if self._hurry.is_set() else max(1, min(workers, self._beside))


ALL_WORKERS = Share()


# How far a save in the background lowers its threads' priority (a nice value, Linux):
# enough for a training loop's thread to get a core first whenever it can run, not so
# far that processes busy beside it (data loaders, other ranks) starve the save. Each
# busy thread of nice 0 leaves it about a tenth of a core.
BACKGROUND_NICE = 10


def yield_to_training() -> None:
    """Lowers the calling thread's scheduling priority by `BACKGROUND_NICE` on Linux,
    where it is the thread's own and the threads it starts inherit it, so that the
    training loop beside a save in the background gets a core first whenever it can
    run (an idle core still runs the save at full speed). Nothing elsewhere: there it
    would be the whole process's. A thread's priority cannot be raised again without
    privileges: only threads that end with their save lower theirs."""
    if sys.platform != "linux":
        return
    try:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + BACKGROUND_NICE))
    except OSError as e:  # a sandbox that refuses it: the save runs as it is
        log.debug("a save's thread kept its priority: %s", e)


class Aborted(Exception):
    """A request was not made because its operation had already failed."""


def memory_bytes(cgroups: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int:
    """The memory this process may use: the host's, or the lowest limit of its cgroup and
    the cgroups above it where lower (v2 or v1: a container, a Slurm job, a systemd
    slice); 0 where none can be told."""
    try:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # a platform that does not say
        limit = 0
    for path in _cgroup_limit_files(cgroups, root):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        # "max" (v2) or a number near 2**63 (v1) where unlimited.
        if text.isdigit() and 0 < int(text) < 2**60:
            limit = min(limit, int(text)) if limit else int(text)
    return limit


def _cgroup_limit_files(cgroups: str, root: str) -> list[str]:
    """The memory limit files of this process's cgroups (as `cgroups` lists them, under
    `root`) and of every cgroup above them."""
    try:
        with open(cgroups) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    files = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            top, name = root, "memory.max"
        elif "memory" in controllers.split(","):  # v1
            top, name = os.path.join(root, "memory"), "memory.limit_in_bytes"
        else:
            continue
        parts = [part for part in path.split("/") if part and part != ".."]
        files += [os.path.join(top, *parts[:depth], name) for depth in range(len(parts), -1, -1)]
    return files


def aborted() -> bool:
    """Whether the operation this thread is working for (or one it is part of) has
    already failed, or has given up the item this thread is running (or the one its
    operation is part of)."""
    op = getattr(_current, "op", None)
    item = getattr(_current, "item", None)
    while op is not None:
        if op.error is not None or (item is not None and item.abandoned):
            return True
        op, item = op.outer
    return False


class ByteBudget:
    """Bounds bytes held at once (staged for writing, read and not yet consumed).

    The one rule: bytes are taken as a `Hold`, and whoever holds the data they stand
    for when it is done with it releases the hold, once. A single item larger than the
    whole budget is still let through alone. `abort` wakes every waiter with an error,
    so a failed writer never leaves a stager stuck.
    """

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"a byte budget must be a positive int, got {limit!r}")
        self._limit = limit
        self._used = 0
        self._error: BaseException | None = None
        self._cv = threading.Condition()

    def take(self, nbytes: int, *, block: bool = True, timeout: float | None = None) -> Hold | None:
        """Takes `nbytes`, waiting for room (or returning None without `block`, or when
        `timeout` seconds pass first); raises `Aborted` once the budget has been aborted."""
        with self._cv:
            while True:
                if self._error is not None:
                    raise Aborted(f"aborted: {self._error}") from self._error
                if self._used == 0 or self._used + nbytes <= self._limit:
                    self._used += nbytes
                    return Hold(self, nbytes)
                if not block or not self._cv.wait(timeout):
                    return None

    def _give_back(self, nbytes: int) -> None:
        with self._cv:
            self._used -= nbytes
            self._cv.notify_all()

    def abort(self, error: BaseException) -> None:
        with self._cv:
            self._error = error
            self._cv.notify_all()


def given_up() -> concurrent.futures.Future[None] | None:
    """A future done once the item this thread is running is given up (None outside an
    operation): a request waiting on futures waits on it too, and cancels itself. In
    an operation that is part of an item, the nearest item out that can be given up (a
    window's, with `abandon`)."""
    op = getattr(_current, "op", None)
    item = first = getattr(_current, "item", None)
    while item is not None and not item.can_be_given_up and op is not None:
        op, item = op.outer
    item = item or first
    return None if item is None else item.gone


def spare_workers(wanted: int) -> contextlib.AbstractContextManager[int]:
    """Up to `wanted` workers of this thread's operation that no item runs on, lent to
    this thread's item while the block runs (as its count); none outside an operation.
    What a large item may do at once beside itself, without making the operation's
    workers more than they are."""
    op = getattr(_current, "op", None)
    return contextlib.nullcontext(0) if op is None else op.lend(wanted)


def spare(nbytes: int) -> Hold | None:
    """`nbytes` for something this thread's operation may do without (a second request
    for a slow read), from the byte budget it keeps (the newest) without waiting; None
    if it has no room. Outside an operation's budget, nothing bounds it but itself."""
    op = getattr(_current, "op", None)
    budget = op.budget() if op is not None else None
    return Hold(None, 0) if budget is None else budget.take(nbytes, block=False)


class Hold:
    """Bytes taken from a `ByteBudget`; `release` gives them back (once, whoever calls)."""

    def __init__(self, budget: ByteBudget | None, nbytes: int) -> None:
        self._budget: ByteBudget | None = budget
        self.nbytes = nbytes

    def release(self) -> None:
        budget, self._budget = self._budget, None
        if budget is not None:
            budget._give_back(self.nbytes)


class _Item:
    """One item submitted to an operation; `abandoned` once its consumer gave it up,
    and `gone` done then (a wait can include it: see `given_up`)."""

    def __init__(self, can_be_given_up: bool = False) -> None:
        self.can_be_given_up = can_be_given_up  # a window's with `abandon`
        self.abandoned = False
        self.gone: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.thread: threading.Thread | None = None  # the pool thread running it

    def abandon(self) -> None:
        self.abandoned = True
        self.gone.set_result(None)


class _Pool(concurrent.futures.ThreadPoolExecutor):
    """A thread pool that goes on where no thread can be started: at the interpreter's
    exit (Python 3.12 starts none once it has begun), a save a manager never closed is
    finished by the exit's wait, with the threads the pool has, or on the thread that
    submits when it has none (`_adjust_thread_count` is the pool's own hook for
    starting a thread, called as each item is queued). That thread runs what is queued
    once `submit` has let go of the executors' locks: one of them is shared by every
    executor, and an item that starts an operation of its own submits again."""

    _stranded = False  # a thread could not be started

    def _adjust_thread_count(self) -> None:
        try:
            super()._adjust_thread_count()
        except RuntimeError:
            self._stranded = True

    def submit(self, fn: Callable[..., _R], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[_R]:
        future = super().submit(fn, *args, **kwargs)
        if self._stranded and not self._threads:  # with threads, they take what is queued
            while True:
                try:
                    item = self._work_queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item.run()
        return future


class Operation:
    """A pool of `workers` threads doing the items of one job, which fails as a whole.

    Use as a context manager: leaving it (normally or by an exception) cancels what
    has not started and waits for what is running, but for items given up (`window`).
    """

    def __init__(self, workers: int, name: str) -> None:
        # The operation and item this one is part of, when started inside an item.
        self.outer: tuple[Operation | None, _Item | None] = (getattr(_current, "op", None),
                                                             getattr(_current, "item", None))
        self._workers = max(1, workers)
        self._pool = _Pool(self._workers, thread_name_prefix=f"zarrckpt-{name}")
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._budgets: list[ByteBudget] = []
        self._running: dict[concurrent.futures.Future[Any], _Item] = {}
        # One for each item running and each worker lent (`lend`): never more than `workers`.
        self._slots = threading.Semaphore(self._workers)

    def __enter__(self) -> Operation:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> None:
        if error is not None:
            self.fail(error)
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:  # a thread still running an item given up ends by itself
            stray = {item.thread for item in self._running.values() if item.abandoned}
        for thread in list(self._pool._threads):
            if thread not in stray:
                thread.join()

    def fail(self, error: BaseException) -> None:
        """Marks the operation failed (the first error wins) and aborts its budgets."""
        with self._lock:
            if self.error is None:
                self.error = error
            budgets = list(self._budgets)
        for budget in budgets:
            budget.abort(error)

    def submit(self, fn: Callable[..., _R], *args: Any, can_be_given_up: bool = False
               ) -> concurrent.futures.Future[_R]:
        """Runs `fn(*args)` on the pool as part of this operation; a failure fails it.
        Raises the operation's first failure instead once it has failed."""
        self._raise_if_failed()
        item = _Item(can_be_given_up)

        def run() -> _R:
            # A worker lent to another item is not this one's; run on the submitting
            # thread (no thread can start), it is not a worker's at all.
            slot = not self._pool._stranded and self._slots.acquire()
            if self.error is not None:
                if slot:
                    self._slots.release()
                raise Aborted("not started: the operation had already failed")
            # Put back after: where no thread can start (see `_Pool`), this runs on the
            # thread that submitted it, which may be running an item of another operation.
            outer = getattr(_current, "op", None), getattr(_current, "item", None)
            _current.op, _current.item, item.thread = self, item, threading.current_thread()
            try:
                return fn(*args)
            except BaseException as e:
                if not item.abandoned:
                    self.fail(e)
                raise
            finally:
                if slot:
                    self._slots.release()
                _current.op, _current.item = outer

        future = self._pool.submit(run)
        with self._lock:
            self._running[future] = item
        future.add_done_callback(self._ended)
        return future

    def _ended(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._running.pop(future, None)

    def fan_out(self, items: Iterable[_T], fn: Callable[[_T], _R], *, budget: ByteBudget | None = None,
                nbytes: Callable[[_T], int] = lambda item: 0,
                on_done: Callable[[_T, _R], None] | None = None, start: int | None = None,
                share: Share = ALL_WORKERS) -> list[_R]:
        """`fn(item)` for every item, concurrently; returns the results in order.

        Every worker of the pool takes the next item in turn (so `items` is pulled as
        the work goes, never ahead of it: a generator may block, e.g. on a budget) and
        runs it: no future per item, which for many small files was most of the cost.
        `start` workers begin (default: all of them); one more starts as the items
        taken since the last one was added reach `_RAMP_BYTES` of `nbytes(item)`, and
        after each item that took `_RAMP_S` or longer, until all have: where most items
        are small files on a local disk, fewer threads write them sooner. No more
        than `share` lets run start (`Share.cap`, asked again as each worker would
        be added). With
        `budget`, each item takes `nbytes(item)` before it starts (waiting for room)
        and gives them back when it ends. `on_done` runs as each item succeeds. Stops
        taking items at the first failure, waits for those running, and raises the
        first failure.
        """
        if budget is not None:
            self._watch(budget)
        source, turn, count = iter(items), threading.Lock(), itertools.count()
        results: dict[int, _R] = {}
        workers: list[concurrent.futures.Future[None]] = []
        grown = threading.Lock()
        started = min(self._workers if start is None else max(1, min(start, self._workers)),
                      share.cap(self._workers))
        moved = 0  # bytes of the items taken since the last worker was added

        def add(nbytes: int, seconds: float) -> None:
            """Starts one more worker if the item just taken (`nbytes`) or just done
            (`seconds`) says that it pays. Submitted with no lock held: where no thread
            can start, `submit` runs the worker on this very thread (see `_Pool`), and
            there one more worker only nests deeper."""
            nonlocal started, moved
            if started >= share.cap(self._workers) or self._pool._stranded:
                return
            with grown:
                moved += nbytes
                if started >= share.cap(self._workers) or (moved < _RAMP_BYTES and seconds < _RAMP_S):
                    return
                started, moved = started + 1, 0
            try:
                workers.append(self.submit(worker))  # before this worker ends: the wait below sees it
            except Exception as e:  # optional: the workers running carry on (the interpreter exiting, a failure)
                log.debug("no worker added to a fan-out: %s", e)

        def worker() -> None:
            while self.error is None:
                with turn:
                    if self.error is not None:
                        return
                    following = next(source, _DONE)
                    if following is _DONE:
                        return
                    item = cast(_T, following)
                    index = next(count)
                    size = nbytes(item)
                    hold = budget.take(size) if budget is not None else None
                add(size, 0.0)  # many bytes to move: a worker for the next item at once
                began = time.perf_counter()
                try:
                    results[index] = fn(item)
                finally:
                    if hold is not None:
                        hold.release()
                if on_done is not None:
                    on_done(item, results[index])
                add(0, time.perf_counter() - began)

        for _ in range(started):
            workers.append(self.submit(worker))
        waited = 0
        while waited < len(workers):
            pending = workers[waited:]
            concurrent.futures.wait(pending)
            waited += len(pending)
        self._raise_if_failed()
        return [results[i] for i in range(len(results))]

    def window(self, items: Iterable[_T], fn: Callable[[_T], _R], *, budget: ByteBudget,
               nbytes: Callable[[_T], int], admit: Callable[[_T], None] | None = None,
               abandon: Callable[[_T], bool] | None = None) -> Iterator[tuple[_T, _R, Hold]]:
        """`fn(item)` for every item, concurrently, yielded as (item, result, hold) in
        order.

        Each item takes `nbytes(item)` of `budget` before it starts, as `hold`; while
        the budget is full, finished items are handed back first, so that the consumer
        (which releases each hold when it is done with the bytes, or hands it on to
        whoever is) can make room. `admit(item)` runs on the calling thread once the
        item's bytes are taken, just before it starts.

        With `abandon`, an item not yet finished when its turn comes is given up as
        soon as `abandon(item)` is true (asked every few milliseconds while waiting):
        it is yielded with the result `ABANDONED` at once; it keeps its bytes until
        it ends, makes no further request (`aborted()` is true for it), its failure
        is dropped, and leaving the operation does not wait for it. An item for which
        `abandon` is true before it starts never starts, and takes no bytes: a window
        whose budget is held by items given up still moves past the items it no
        longer needs (`admit` still runs for them).
        """
        self._watch(budget)
        pending: collections.deque[tuple[_T, concurrent.futures.Future[_R], Hold]] = collections.deque()
        try:
            for item in items:
                size = nbytes(item)
                while (hold := budget.take(size, block=not pending,
                                           timeout=None if abandon is None else _ABANDON_POLL_S)) is None:
                    if pending:
                        yield self._settle(pending.popleft(), abandon)
                    elif abandon is not None and abandon(item):
                        break
                if hold is None:  # given up before it started (admitted all the same: see `admit`)
                    if admit is not None:
                        admit(item)
                    pending.append((item, _finished(ABANDONED), Hold(None, 0)))
                    continue
                if admit is not None:
                    admit(item)
                pending.append((item, self.submit(fn, item, can_be_given_up=abandon is not None), hold))
            while pending:
                yield self._settle(pending.popleft(), abandon)
        except BaseException as e:
            self.fail(e)
            self._raise_if_failed()  # the first failure, not the `Aborted` it caused here
            raise

    def _settle(self, entry: tuple[_T, concurrent.futures.Future[_R], Hold],
                abandon: Callable[[_T], bool] | None) -> tuple[_T, _R, Hold]:
        item, future, hold = entry
        while abandon is not None and not future.done():
            if abandon(item):
                with self._lock:
                    running = self._running.get(future)
                    if running is not None:  # still running: given up, its bytes kept until it ends
                        running.abandon()
                        future.add_done_callback(lambda _: hold.release())
                        return item, ABANDONED, Hold(None, 0)
                break
            concurrent.futures.wait([future], timeout=_ABANDON_POLL_S)
        try:
            return item, future.result(), hold
        except BaseException:
            self._raise_if_failed()  # the first failure, not a later `Aborted`
            raise

    @contextlib.contextmanager
    def lend(self, wanted: int) -> Iterator[int]:
        """Up to `wanted` of this operation's workers that no item runs on, lent while
        the block runs (see `spare_workers`): an item that starts meanwhile waits for
        one of them, so that no more than `workers` work at once."""
        count = 0
        while count < wanted and self._slots.acquire(blocking=False):
            count += 1
        try:
            yield count
        finally:
            for _ in range(count):
                self._slots.release()

    def budget(self) -> ByteBudget | None:
        """The byte budget this operation's items take from, the newest if several; for
        one without, that of the operation it is part of."""
        with self._lock:
            if self._budgets:
                return self._budgets[-1]
        outer = self.outer[0]
        return None if outer is None else outer.budget()

    def _watch(self, budget: ByteBudget) -> None:
        with self._lock:
            self._budgets.append(budget)
            error = self.error
        if error is not None:
            budget.abort(error)

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error


def _finished(result: _R) -> concurrent.futures.Future[_R]:
    future: concurrent.futures.Future[_R] = concurrent.futures.Future()
    future.set_result(result)
    return future


def run_all(fn: Callable[[_T], _R], items: Sequence[_T], workers: int, name: str = "io") -> list[_R]:
    """`fn(item)` for a few items at once, results in order; the first failure is raised
    and stops the rest. One item, or one worker, runs on the calling thread."""
    if len(items) < 2 or workers < 2:
        return [fn(item) for item in items]
    with Operation(min(workers, len(items)), name) as op:
        return op.fan_out(items, fn)
