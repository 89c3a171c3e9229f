"""Hedged reads: a read that is still unanswered after nearly every read of its size on
the same store has been answered gets a second request for the same bytes, and the
first good answer wins; the other request is cancelled. A few slow requests then cost
a restore a little more than the usual time of a read each, not their own time (an
object store answers a few percent of GETs many times slower than the rest).

When: after `_MARGIN` times the time within which `_TAIL` of the last reads of about
its size on this client were answered (sizes by powers of 4; `_SAMPLES` of them
answered first, so nothing is hedged blind), and never before `FLOOR_S`: a read's
ordinary ups and downs seldom get one (they would spend what stragglers need), while a
straggler (a few percent of GETs, ten or a hundred times slower) does. A read waiting while
that is not yet known looks again every `_POLL_S`, so the first reads of a restore are
hedged too once enough have come back.

Bounded: each read started on the client earns `SHARE` of a second request, and a
second request spends one; what is earned and not spent is kept up to `_BURST`, so that
over any run of reads the second requests are at most `SHARE` of them plus `_BURST`.
Each takes its bytes from the byte budget of the operation it serves, without waiting
(`_concurrency.spare`): no room, no second request. Only reads are hedged (a chunk read
twice is the same bytes; a write's second request could land late, see `_commit`), and
only on a client whose requests can be cancelled (an asynchronous one: s3fs, gcsfs),
so that a request given up on ends at once instead of holding a connection. A read
whose operation gives it up (another process read the same part: `_restore.relief`)
cancels its requests at once, hedged or not, and raises `Aborted`.

Good: where both requests may still answer, an answer is taken only if `check` (the
chunk codec's: size, checksum, header) finds nothing wrong with it; a wrong one is kept
until the other answers, and is what the caller gets when the other fails too (its
codec then reports the damage).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from .._util import concurrency as _concurrency, stats as _stats
from . import guard as _guard
from .store import Check, DeadlinePassed

SHARE = 0.05
_TAIL = 0.95
_MARGIN = 1.2
FLOOR_S = 0.05
_BURST = 4.0
_SAMPLES = 20
_WINDOW = 256  # the latest answers of each size kept
_POLL_S = 0.05


class Hedging:
    """What one client's reads have taken so far (and those still unanswered, for how
    long), and how many second requests may go out. Thread-safe: every reader of the
    client shares it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._answered: dict[int, collections.deque[float]] = {}
        self._waiting: dict[int, dict[object, float]] = {}  # by size: each read unanswered, sent when
        self._earned = 0.0  # second requests that may go out (see the module docstring)

    def delay(self, nbytes: int) -> float | None:
        """How long a read of about `nbytes` waits before a second request may go out;
        None while too few such reads have been answered to tell. Reads still waiting
        count as answered now: when a batch of reads goes out together, the first
        answers alone would make the rest look slow."""
        size = _size_class(nbytes)
        now = time.monotonic()
        with self._lock:
            seen = self._answered.get(size)
            if seen is None or len(seen) < _SAMPLES:
                return None
            ordered = sorted([*seen, *(now - sent for sent in self._waiting.get(size, {}).values())])
        return max(FLOOR_S, _MARGIN * ordered[int(_TAIL * (len(ordered) - 1))])

    def started(self, read: object, nbytes: int) -> None:
        """`read` (a key of the caller's) has gone out; each read earns `SHARE` of a
        second request."""
        with self._lock:
            self._waiting.setdefault(_size_class(nbytes), {})[read] = time.monotonic()
            self._earned = min(_BURST, self._earned + SHARE)

    def ended(self, read: object, nbytes: int, seconds: float | None) -> None:
        """`read` has ended: answered after `seconds` (its request's own time), or
        failed or given up on (None)."""
        size = _size_class(nbytes)
        with self._lock:
            self._waiting.get(size, {}).pop(read, None)
            if seconds is not None:
                self._answered.setdefault(size, collections.deque(maxlen=_WINDOW)).append(seconds)

    def second(self) -> bool:
        """Whether a second request may go out now (then it is counted as sent)."""
        with self._lock:
            if self._earned < 1:
                return False
            self._earned -= 1
        _stats.add("store_hedged_reads")
        return True


_CLIENTS: weakref.WeakKeyDictionary[Any, Hedging] = weakref.WeakKeyDictionary()
_CLIENTS_LOCK = threading.Lock()


def of(client: Any) -> Hedging:
    """The one `Hedging` of `client` (an fsspec file system, which fsspec shares between
    the places opened with the same options): a manager's restores learn from the ones
    before."""
    with _CLIENTS_LOCK:
        found = _CLIENTS.get(client)
        if found is None:
            found = _CLIENTS[client] = Hedging()
        return found


def first_good(start: Callable[[], concurrent.futures.Future[bytes]], hedging: Hedging, *, nbytes: int,
               timeout: float | None, check: Check | None) -> bytes:
    """The answer of a read that `start` sends (each call one request, as a future that
    `cancel` ends), with a second request where it is slow (see the module docstring).
    Raises at once an error that no second answer would change (not found, denied),
    else the first error once every request has failed or the deadline (`timeout`
    seconds in all) has come with an error in hand; DeadlinePassed at the deadline with
    nothing in hand (a wrong answer in hand is returned then)."""
    began = time.monotonic()
    read = object()
    hedging.started(read, nbytes)
    answered: float | None = None  # the answer's own time, once taken
    requests = {start(): began}  # each request, and when it was sent
    hold: _concurrency.Hold | None = None
    hedged, not_before = False, began  # a second request: sent; not to be asked for before
    kept: bytes | None = None
    error: Exception | None = None
    gone = _concurrency.given_up()  # done if the read is given up: its requests are cancelled then
    try:
        while True:
            now = time.monotonic()
            left = None if timeout is None else began + timeout - now
            if left is not None and left <= 0 and not any(request.done() for request in requests):
                if kept is not None:
                    return kept
                if error is not None:
                    raise error
                raise DeadlinePassed(f"abandoned after {timeout:.0f} s")
            wait = left
            if not hedged:
                delay = hedging.delay(nbytes)
                until = _POLL_S if delay is None else max(0.0, max(not_before, began + delay) - now)
                wait = until if left is None else min(left, until)
            waited: list[concurrent.futures.Future[Any]] = [*requests, *([gone] if gone else [])]
            done, _ = concurrent.futures.wait(waited,
                                              timeout=max(0.0, wait) if wait is not None else None,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            if gone is not None and gone.done():
                raise _concurrency.Aborted("read given up: another process read it")
            for request in done:
                sent = requests.pop(request)  # `gone` is not done here
                try:
                    data = request.result()
                except Exception as e:  # the other request may still answer, unless this is final
                    if _guard.classify(e).kind == "permanent":
                        raise
                    error = error or e
                    continue
                if not requests or check is None or check(data) is None:
                    answered = time.monotonic() - sent
                    return data
                kept = kept or data  # wrong: the other's answer may be good
            if not requests:
                if kept is not None:
                    return kept
                assert error is not None
                raise error
            now = time.monotonic()
            if not hedged and (delay := hedging.delay(nbytes)) is not None and now >= max(not_before, began + delay):
                hold = _concurrency.spare(nbytes)
                if hold is not None and hedging.second():
                    hedged = True
                    requests[start()] = now
                else:  # no room in the budget, or the share is spent: perhaps later
                    if hold is not None:
                        hold.release()
                        hold = None
                    not_before = now + _POLL_S
    finally:
        hedging.ended(read, nbytes, answered)
        for request in requests:
            request.cancel()
        if hold is not None:
            hold.release()


def _size_class(nbytes: int) -> int:
    return max(nbytes, 1).bit_length() // 2
