"""What every request to any store goes through (`Guarded.call`), in one place: the
abort check, a deadline, retries with backoff, counting, and the error the caller sees
(credential-free, naming the object's URL).

- A request is abandoned after its deadline: `request_timeout_s` (a storage option,
  20 s by default) plus a second per MiB it moves, where the store can abandon one
  (see `store.Store`). A timeout, the deadline's or the client's own, is tried once
  more; other transient failures (dropped connections, throttling, server errors) up to
  RETRIES more times, waiting 0.1 s, 0.2 s, ... (at most 5 s, with jitter) in between.
  Every operation zarrckpt asks of a store is idempotent, so a retry is safe. The
  clients' own retries are off (`remote`): a store that stops answering fails a
  request in about two deadlines, not their product.
- Nothing is tried (or tried again) once the operation the request is part of has
  failed elsewhere (`_concurrency.aborted`): a failed save stops talking to the store
  at once instead of retrying requests whose result no longer matters.
- A failure that persists is an OSError (FileNotFoundError, PermissionError,
  IsADirectoryError, NotADirectoryError or OSError) whose message names the object's
  URL and leaves out every credential; a symbolic link met on a local disk is
  `LinkInCheckpoint`, a CheckpointCorruptError.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .. import _concurrency, _stats
from ..errors import CheckpointCorruptError
from .store import DeadlinePassed, LinkFound

_T = TypeVar("_T")
log = logging.getLogger("zarrckpt")

DEFAULT_REQUEST_TIMEOUT_S = 20.0
_SECONDS_PER_MIB = 1.0  # on top of request_timeout_s: a request may move as slowly as 1 MiB/s
RETRIES = 6
TIMEOUT_RETRIES = 1
_FIRST_BACKOFF_S = 0.1
_MAX_BACKOFF_S = 5.0
_TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.EBUSY, errno.EINTR, errno.ETIMEDOUT, errno.ECONNRESET,
                               errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE})
# What s3fs and gcsfs raise for throttling and server errors.
_TRANSIENT_NAMES = frozenset({"ServerDisconnectedError", "ClientOSError", "ClientConnectionError",
                              "ClientPayloadError", "SlowDown", "ThrottlingException", "InternalError",
                              "ServiceUnavailable", "EndpointConnectionError", "ConnectionClosedError"})
# Timeouts, whoever's (DeadlinePassed, the deadline's, is a TimeoutError): botocore's and
# aiohttp's, fsspec's, and S3's own "RequestTimeout" (the socket was idle too long).
_TIMEOUT_NAMES = frozenset({"ReadTimeoutError", "ConnectTimeoutError", "ServerTimeoutError", "RequestTimeout",
                            "FSTimeoutError"})


class LinkInCheckpoint(CheckpointCorruptError, OSError):
    """A symbolic link where a checkpoint's object or directory should be (never
    followed): the checkpoint is not what it claims."""


def is_timeout(e: BaseException) -> bool:
    return isinstance(e, TimeoutError) or type(e).__name__ in _TIMEOUT_NAMES


def is_transient(e: BaseException) -> bool:
    """Whether a failure may pass if the same request is made again."""
    if isinstance(e, (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, ConnectionError) or is_timeout(e) or type(e).__name__ in _TRANSIENT_NAMES:
        return True
    return isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS


class Guarded:
    """The requests of one store, each through `call`. `secrets`: every string of the
    store's options (and URL) that may be a credential, never shown."""

    def __init__(self, request_timeout_s: float, secrets: Sequence[str]) -> None:
        self.request_timeout_s = request_timeout_s
        self.secrets = tuple(secrets)

    def call(self, action: str, where: str, fn: Callable[..., _T], *args: Any, nbytes: int = 0, **kwargs: Any) -> _T:
        """`fn(*args, timeout=..., **kwargs)`, one request about `where` (a URL, for
        messages) moving about `nbytes`, as the module's docstring says."""
        timeout = self.request_timeout_s + _SECONDS_PER_MIB * nbytes / 2**20
        timeouts = 0
        for attempt in range(RETRIES + 1):
            if _concurrency.aborted():
                raise _concurrency.Aborted(f"not {action}ing {where}: the operation had already failed")
            _stats.add(f"store_{action}")
            try:
                return fn(*args, timeout=timeout, **kwargs)
            except Exception as e:  # any failure inside the store's client library
                timeouts += is_timeout(e)
                if attempt < RETRIES and is_transient(e) and timeouts <= TIMEOUT_RETRIES:
                    delay = min(_MAX_BACKOFF_S, _FIRST_BACKOFF_S * 2**attempt) * random.uniform(0.5, 1.0)
                    log.debug("retrying %s of %s in %.2fs after %s", action, where, delay, self.redact(repr(e)))
                    time.sleep(delay)
                    continue
                error = self._error(e, action, where, attempt, timeout)
                break
        # Raised outside the `except` block so that the original cannot ride along as
        # __context__ when it has to be dropped (see _error). The name is dropped as it
        # goes: this frame, in the error's traceback, must not hold the error, or the
        # cycle would keep every caller's frame (a save's whole state) alive until the
        # garbage collector runs, though the caller caught and dropped the error.
        try:
            raise error
        finally:
            del error

    def _error(self, e: Exception, action: str, where: str, retries: int, timeout: float) -> OSError:
        if isinstance(e, LinkFound):
            return LinkInCheckpoint(e.strerror)  # it names the link; a local path holds no credential
        if isinstance(e, FileNotFoundError):
            kind: type[OSError] = FileNotFoundError
            # A write creates any missing "directory", so only the bucket can be missing.
            why = "the bucket does not exist" if action == "write" else "not found"
        elif isinstance(e, PermissionError):
            kind, why = PermissionError, "access denied (do the credentials in storage_options allow this?)"
        elif isinstance(e, IsADirectoryError):
            kind, why = IsADirectoryError, "a directory is where an object should be"
        elif isinstance(e, NotADirectoryError):
            kind, why = NotADirectoryError, "a file is in the way"
        elif isinstance(e, DeadlinePassed):
            kind, why = TimeoutError, f"no answer in {timeout:.0f} s (storage_options request_timeout_s)"
        elif is_timeout(e):
            kind, why = TimeoutError, "no answer in time (the client's own timeouts)"
        else:
            kind, why = OSError, "the store failed"
        detail = f"{type(e).__name__}: {e}"
        tries = f", after {retries + 1} tries" if retries else ""
        error = kind(f"cannot {action} {where}: {why} ({self.redact(detail)}){tries}")
        # The original exception keeps the client's traceback for debugging, unless
        # something in its chain quotes a credential.
        if not any(self.redact(text) != text for text in _chain_texts(e)):
            error.__cause__ = e
        return error

    def redact(self, text: str) -> str:
        """`text` with every credential replaced by '***'."""
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text


def _chain_texts(e: BaseException) -> list[str]:
    """The messages and arguments of `e` and every exception chained to it."""
    texts: list[str] = []
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        texts += [str(current), repr(current.args)]
        todo += [current.__cause__, current.__context__]
    return texts
