"""What every request to any store goes through (`Guarded.call`), in one place: the
abort check, a deadline, retries with backoff, counting, and the error the caller sees
(credential-free, naming the object's URL).

- A request is abandoned after its deadline: `request_timeout_s` (a storage option,
  20 s by default) plus a second per MiB it moves, where the store can abandon one
  (see `store.Store`). Every failure is sorted once, the same way for every request
  kind (read, ranged read, check, list, write, delete) and every store (`classify`):
  by the HTTP status where the client keeps it (5xx but 501, 408, 429 and 401, an
  access token that expired, pass; other 4xx do not), by the store's error code (S3's
  SlowDown, GCS's rateLimitExceeded), and by type and errno otherwise (s3fs turns an
  S3 500 into a plain OSError with EREMOTEIO). A timeout, the deadline's or the
  client's own, and a refused connection (nothing listens: a wrong endpoint, or a
  server down) are tried once more; other transient failures up to RETRIES (10) more
  times, waiting 0.1 s, 0.2 s, ... (at most 5 s, jittered) in between, and after
  throttling (429, 503, SlowDown) from 1 s on, since the store asked for fewer
  requests. Every request zarrckpt makes may be made twice (a create that finds its
  own earlier attempt landed knows it by its content, see `Location.write_new`). The
  clients' own retries are off (`remote`, which also tries each of their HTTP
  requests again, briefly, inside one call): a store that stops answering fails a
  request in about two deadlines, not their product.
- Nothing is tried (or tried again) once the operation the request is part of has
  failed elsewhere (`_concurrency.aborted`): a failed save stops talking to the store
  at once instead of retrying requests whose result no longer matters.
- A failure that persists is an OSError (FileNotFoundError, PermissionError,
  FileExistsError, IsADirectoryError, NotADirectoryError or OSError) whose message
  names the object's URL, the HTTP status where there was one, and the tries, and
  leaves out every credential; a symbolic link or a special file met on a local
  disk is `NotAFileInCheckpoint`, and an object larger than a read takes (`store.Larger`)
  `TooLarge`, both CheckpointCorruptErrors.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .._util import concurrency as _concurrency, stats as _stats
from ..errors import CheckpointCorruptError
from .store import DeadlinePassed, Larger, NotAFile, SourceChanged

_T = TypeVar("_T")
log = logging.getLogger("zarrckpt")

DEFAULT_REQUEST_TIMEOUT_S = 20.0
_SECONDS_PER_MIB = 1.0  # on top of request_timeout_s: a request may move as slowly as 1 MiB/s
RETRIES = 10
TIMEOUT_RETRIES = 1
_FIRST_BACKOFF_S = 0.1
_FIRST_THROTTLED_BACKOFF_S = 1.0
_MAX_BACKOFF_S = 5.0
_TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.EBUSY, errno.EINTR, errno.ETIMEDOUT, errno.ECONNRESET,
                               errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE, errno.EREMOTEIO})
# What aiohttp, botocore and the clients raise for a connection that failed or dropped,
# or an answer whose bytes the client found changed on the way (botocore checks S3's
# own checksum of what it sends).
_TRANSIENT_NAMES = frozenset({"ServerDisconnectedError", "ClientOSError", "ClientConnectionError",
                              "ClientPayloadError", "EndpointConnectionError", "ConnectionClosedError",
                              "ProxyError", "ChecksumError", "FlexibleChecksumError"})
# Error codes of S3 (and GCS's reasons) that mean "try again", whatever the status.
_TRANSIENT_CODES = frozenset({"InternalError", "ServiceUnavailable", "RequestTimeout", "OperationAborted",
                              "ConditionalRequestConflict", "backendError", "internalError"})
_THROTTLED_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                              "TooManyRequestsException", "rateLimitExceeded", "userRateLimitExceeded"})
# Timeouts, whoever's (DeadlinePassed, the deadline's, is a TimeoutError): botocore's and
# aiohttp's, fsspec's, and S3's own "RequestTimeout" (the socket was idle too long).
_TIMEOUT_NAMES = frozenset({"ReadTimeoutError", "ConnectTimeoutError", "ServerTimeoutError", "RequestTimeout",
                            "FSTimeoutError"})


class NotAFileInCheckpoint(CheckpointCorruptError, OSError):
    """A symbolic link (never followed) or a special file (a FIFO, a socket, a device:
    never read or written) where a checkpoint's object or directory should be: the
    checkpoint is not what it claims. `what` says which ("a symbolic link", "a FIFO")."""

    def __init__(self, message: str, what: str) -> None:
        super().__init__(message)
        self.what = what


class TooLarge(CheckpointCorruptError, OSError):
    """An object larger than zarrckpt reads of its kind (`Location.read`'s `cap`): not
    read, as no zarrckpt writes one so large. Names the object's URL (`url`) and the cap."""

    def __init__(self, url: str, cap: int) -> None:
        self.reason = (f"larger than {_bytes(cap)}, the most zarrckpt reads of such an object (see "
                       "docs/reliability.md): not read")
        super().__init__(f"{url} is {self.reason}")
        self.errno, self.url, self.cap = errno.EFBIG, url, cap


def _bytes(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n:,} bytes"


@dataclasses.dataclass(frozen=True)
class Failure:
    """What a failed request's error means: `kind` is "timeout", "unreachable" (the
    connection was refused), "throttled" (the store asked for fewer requests),
    "transient" (may pass if made again) or "permanent";
    `http_status` and `code` what the store answered, if known."""

    kind: str
    http_status: int | None = None
    code: str | None = None

    @property
    def retried(self) -> bool:
        return self.kind != "permanent"

    @property
    def status(self) -> str | None:
        """What the store answered, for messages ("HTTP 503 SlowDown"), if known."""
        if self.http_status is None:
            return None
        return " ".join(str(x) for x in ("HTTP", self.http_status, self.code) if x not in (None, str(self.http_status)))


def classify(e: BaseException) -> Failure:
    """How a request that raised `e` failed (see the module docstring): the HTTP status
    and error code of the first error in its chain that carries one decide, then the
    error's type and errno."""
    code, status = _answer(e)
    answered = functools.partial(Failure, http_status=status, code=code)
    if isinstance(e, (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError)):
        return answered("permanent")
    if is_timeout(e) or code in ("RequestTimeout",) or status == 408:
        return answered("timeout")
    if status is None and any(isinstance(x, ConnectionRefusedError) or getattr(x, "errno", None) == errno.ECONNREFUSED
                              for x in _chain(e)):
        return Failure("unreachable")  # nothing listens there: a wrong endpoint, or a server down
    if status == 429 or code in _THROTTLED_CODES or (status == 503 and code in (None, "SlowDown")):
        return answered("throttled")
    # 401 from GCS is an access token that expired meanwhile: the client fetches a new one.
    if code in _TRANSIENT_CODES or status == 401 or (status is not None and status >= 500 and status != 501):
        return answered("transient")
    if status is not None:
        return answered("permanent")
    if isinstance(e, ConnectionError) or type(e).__name__ in _TRANSIENT_NAMES:
        return Failure("transient")
    return Failure("transient" if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS else "permanent")


def backoff_s(failure: Failure, attempt: int) -> float:
    """How long to wait before trying again a request that failed `attempt + 1` times."""
    first = _FIRST_THROTTLED_BACKOFF_S if failure.kind == "throttled" else _FIRST_BACKOFF_S
    return min(_MAX_BACKOFF_S, first * 2**attempt) * random.uniform(0.5, 1.0)


def is_timeout(e: BaseException) -> bool:
    return isinstance(e, TimeoutError) or type(e).__name__ in _TIMEOUT_NAMES


def _answer(e: BaseException) -> tuple[str | None, int | None]:
    """The store's error code and HTTP status, from the first error in `e`'s chain that
    keeps them: botocore's ClientError (`response`), gcsfs's HttpError (`code`, and
    its reason), aiohttp's ClientResponseError (`status`)."""
    for error in _chain(e):
        response = getattr(error, "response", None)
        if isinstance(response, dict) and isinstance(response.get("Error"), dict):
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            code = response["Error"].get("Code")
            return (code if isinstance(code, str) else None), (status if isinstance(status, int) else None)
        if type(error).__name__ == "HttpError" and isinstance(getattr(error, "code", None), int):
            errors = (getattr(error, "_error_response", None) or {}).get("errors") or [{}]
            reason = errors[0].get("reason") if isinstance(errors[0], dict) else None
            return (reason if isinstance(reason, str) else None), error.code  # type: ignore[attr-defined]
        if type(error).__name__ == "ClientResponseError" and isinstance(getattr(error, "status", None), int):
            return None, error.status  # type: ignore[attr-defined]
    return None, None


class Guarded:
    """The requests of one store, each through `call`. `secrets`: every string of the
    store's options (and URL) that may be a credential, never shown."""

    def __init__(self, request_timeout_s: float, secrets: Sequence[str]) -> None:
        self.request_timeout_s = request_timeout_s
        self.secrets = tuple(secrets)

    def call(self, action: str, where: str, fn: Callable[..., _T], *args: Any, nbytes: int = 0, **kwargs: Any) -> _T:
        """`fn(*args, timeout=..., **kwargs)`, one request about `where` (a URL, for
        messages) moving about `nbytes`, as the module's docstring says."""
        timeout = self.deadline(nbytes)
        timeouts = 0
        for attempt in range(RETRIES + 1):
            if _concurrency.aborted():
                raise _concurrency.Aborted(f"not {action}ing {where}: the operation had already failed")
            _stats.add(f"store_{action}")
            try:
                return fn(*args, timeout=timeout, **kwargs)
            except Exception as e:  # any failure inside the store's client library
                failure = classify(e)
                timeouts += failure.kind in ("timeout", "unreachable")  # tried once more, as no answer is
                if attempt < RETRIES and failure.retried and timeouts <= TIMEOUT_RETRIES:
                    delay = backoff_s(failure, attempt)
                    log.debug("retrying %s of %s in %.2fs after %s", action, where, delay, self.redact(repr(e)))
                    time.sleep(delay)
                    continue
                error = self._error(e, failure, action, where, attempt, timeout)
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

    def deadline(self, nbytes: int = 0) -> float:
        """How long one request moving about `nbytes` may take before it is abandoned."""
        return self.request_timeout_s + _SECONDS_PER_MIB * nbytes / 2**20

    def patience(self, nbytes: int = 0) -> float:
        """How long `call` may take in all for such a request: every try to its deadline,
        and the longest waits between them."""
        return (RETRIES + 1) * self.deadline(nbytes) + RETRIES * _MAX_BACKOFF_S

    def _error(self, e: Exception, failure: Failure, action: str, where: str, retries: int,
               timeout: float) -> OSError:
        if isinstance(e, NotAFile):
            # It names the file: a local path holds no credential.
            return NotAFileInCheckpoint(e.strerror or str(e), e.what)
        if isinstance(e, Larger):
            return TooLarge(where, e.most)
        if isinstance(e, SourceChanged):
            kind: type[OSError] = SourceChanged
            why = "what it is made from is not the object it was (rewritten or deleted meanwhile)"
        elif isinstance(e, FileNotFoundError):
            kind = FileNotFoundError
            # A write creates any missing "directory", so only the bucket can be missing.
            why = "the bucket does not exist" if action == "write" else "not found"
        elif isinstance(e, PermissionError):
            kind, why = PermissionError, "access denied (do the credentials in storage_options allow this?)"
        elif isinstance(e, FileExistsError):
            kind, why = FileExistsError, "already there"
        elif isinstance(e, IsADirectoryError):
            kind, why = IsADirectoryError, "a directory is where an object should be"
        elif isinstance(e, NotADirectoryError):
            kind, why = NotADirectoryError, "a file is in the way"
        elif isinstance(e, DeadlinePassed):
            kind, why = TimeoutError, f"no answer in {timeout:.0f} s (storage_options request_timeout_s)"
        elif is_timeout(e):
            kind, why = TimeoutError, "no answer in time (the client's own timeouts)"
        elif failure.kind == "throttled":
            kind, why = OSError, "the store kept asking for fewer requests"
        else:
            kind, why = OSError, "the store failed"
        if failure.status is not None:
            why += f", {failure.status}"
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
    return [text for current in _chain(e) for text in (str(current), repr(current.args))]


def _chain(e: BaseException) -> list[BaseException]:
    """`e` and every exception chained to it (causes first, then contexts), each once."""
    found: list[BaseException] = []
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        found.append(current)
        todo += [current.__cause__, current.__context__]
    return found
