"""URLs -> Locations: the few storage operations zarrckpt needs, on any fsspec URL.

Local paths and file:// URLs are read and written with plain file calls (chunks go
straight between files and array memory), never through a symbolic link below the
path given (`_local`); every other protocol goes through fsspec, with per-protocol
settings (`_Protocol`) for how many requests to keep in flight and how to talk to its
client library in as few round trips as possible. Every request goes through
`Location._call`: retries, the abort check, the error's shape.

Every failure of the store surfaces as an OSError (FileNotFoundError, PermissionError
or OSError; `_local.SymlinkError` for a link met on a local disk) whose message names
the object's URL and leaves out every credential passed in `storage_options`.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import inspect
import logging
import os
import posixpath
import random
import re
import reprlib
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import fsspec
import numpy as np

from . import _concurrency, _local, _stats
from ._format import naming as _naming
from ._local import Entry

_T = TypeVar("_T")
log = logging.getLogger("zarrckpt")


@dataclasses.dataclass(frozen=True)
class _Protocol:
    """How zarrckpt uses one kind of store."""

    # Requests kept in flight by default (save's and restore's thread pools).
    concurrency: int
    # The client accepts only `bytes` bodies, so a chunk's memoryview is copied first.
    bytes_body: bool = True
    # Extra arguments to `cat_file`, passed where the installed client takes them.
    read_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Storage options merged under the user's (the user's win, key by key).
    option_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)


# Transient store failures (dropped connections, timeouts, throttling) are retried up
# to RETRIES times, waiting 0.1 s, 0.2 s, ... (at most 5 s, with jitter) in between.
RETRIES = 6
_FIRST_BACKOFF_S = 0.1
_MAX_BACKOFF_S = 5.0
_TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.EBUSY, errno.EINTR, errno.ETIMEDOUT, errno.ECONNRESET,
                               errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE})
# What s3fs and gcsfs raise for throttling and server errors once their own retries end.
_TRANSIENT_NAMES = frozenset({"ServerDisconnectedError", "ClientOSError", "ClientConnectionError",
                              "ClientPayloadError", "SlowDown", "ThrottlingException", "RequestTimeout",
                              "InternalError", "ServiceUnavailable"})

# A local disk (or tmpfs) is kept busy by a thread per core: each write is a memory copy
# into the page cache, and the CRC before it runs at memory speed.
LOCAL_CONCURRENCY = max(8, min(32, os.cpu_count() or 8))
# An object store answers each request in tens of milliseconds, mostly spent waiting:
# with 128 in flight a 1000-leaf restore at 20 ms per request took 15 round-trip
# times on 2 cores, with 64, 22 (the waves of requests no longer hide the CPU work).
# A bound all the same: S3 and GCS throttle one prefix past a few thousand requests
# a second (their clients retry), and each request in flight holds a thread.
OBJECT_STORE_CONCURRENCY = 128
_LOCAL = _Protocol(LOCAL_CONCURRENCY, bytes_body=False)
_S3 = _Protocol(
    OBJECT_STORE_CONCURRENCY,
    # botocore refuses memoryview bodies; a file object would be read 64 KiB at a time
    # through aiohttp's executor, far slower than one copy.
    bytes_body=True,
    # With its default max_concurrency, s3fs (2026.2 on; older ones take no such
    # argument) sends a HEAD before every GET to decide whether to split the read into
    # ranges: a second round trip per object. Objects here are at most one chunk and
    # many are read at once, so one GET each is best.
    read_options={"max_concurrency": 1},
    # botocore keeps at most 10 connections per client by default, which would cap
    # the requests in flight at 10 whatever the thread count; this is above any
    # sensible worker count, and connections are only opened when used.
    option_defaults={"config_kwargs": {"max_pool_connections": 256}},
)
# gcsfs copies the body into its multipart upload anyway (or slices a memoryview for
# resumable uploads of large objects), so a memoryview saves a copy. Its aiohttp
# session opens at most 100 connections: more requests would only queue for them.
_GCS = _Protocol(100, bytes_body=False)
# The in-process memory file system: more threads would only contend for the GIL.
_MEMORY = _Protocol(8, bytes_body=False)
# Anything else (azure, http, a wrapper...) is assumed remote and given bytes.
_OTHER = _Protocol(OBJECT_STORE_CONCURRENCY)
_PROTOCOLS = {"file": _LOCAL, "local": _LOCAL, "memory": _MEMORY,
              "s3": _S3, "s3a": _S3, "gs": _GCS, "gcs": _GCS}

def _transient(e: BaseException) -> bool:
    """Whether a failure may pass if the same request is made again."""
    if isinstance(e, (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)) or type(e).__name__ in _TRANSIENT_NAMES:
        return True
    return isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS


# gcsfs's token modes: not credentials, and too common as words to scrub from messages.
_NOT_SECRETS = frozenset({"anon", "google_default", "cache", "cloud", "browser"})
_SECRET_OPTION = re.compile(r"key|secret|token|password|passwd|credential|session|auth|signature|sas",
                            re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Location:
    """A directory-like place on some file system: a checkpoint or a checkpoint dir.

    `url` is what the user gave (used in messages); storage options, and the
    credentials among them, are kept apart and never printed. On a local disk, `root`
    is the path the user gave: nothing below it is ever reached through a symbolic
    link (see `_local`); `child` and `step` keep the root.
    """

    url: str
    fs: fsspec.AbstractFileSystem = dataclasses.field(repr=False)
    path: str
    storage_options: dict[str, Any] = dataclasses.field(repr=False, compare=False)
    protocol: _Protocol = dataclasses.field(repr=False, compare=False, default=_OTHER)
    read_options: Mapping[str, Any] = dataclasses.field(repr=False, compare=False, default_factory=dict)
    secrets: tuple[str, ...] = dataclasses.field(repr=False, compare=False, default=())
    root: str = dataclasses.field(repr=False, compare=False, default="")

    @property
    def is_local(self) -> bool:
        return "file" in _protocols(self.fs)

    @property
    def concurrency(self) -> int:
        """How many requests to keep in flight here by default."""
        return self.protocol.concurrency

    def child(self, name: str) -> Location:
        return dataclasses.replace(
            self, url=posixpath.join(self.url.rstrip("/"), name), path=posixpath.join(self.path, name)
        )

    def step(self, step: int) -> Location:
        """The directory of `step` in this checkpoint directory (ValueError for a bad step)."""
        return self.child(_naming.step_dir_name(step))

    def _below(self, key: str = "") -> str:
        """`key` as a path below the local root."""
        here = self.path[len(self.root):].strip("/")
        return posixpath.join(here, key) if here else key

    def _full(self, key: str = "") -> str:
        return posixpath.join(self.path, key) if key else self.path

    def list_dir(self, key: str = "", *, missing_ok: bool = True) -> list[Entry]:
        """The entries directly below `key`, by name: files, directories, and (on a local
        disk) symbolic links, never followed; empty if the directory does not exist
        (FileNotFoundError without `missing_ok`).

        One listing request on an object store. Never answered from fsspec's listing
        cache: other processes add and remove steps.
        """
        try:
            if self.is_local:
                return sorted(self._call("list", key or None, _local.list_dir, self.root, self._below(key)),
                              key=lambda e: e.name)
            path = self._full(key)
            self.fs.invalidate_cache(path)
            found = self._call("list", key or None, self.fs.ls, path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            if missing_ok:
                return []
            raise
        # An object store can list a name twice: an object `run/5` and the prefix `run/5/`.
        entries = {}
        for item in found:
            name = posixpath.basename(item["name"].rstrip("/"))
            found_type = "dir" if item.get("type") == "directory" else "file"
            if name not in entries or found_type == "dir":
                entries[name] = Entry(name, found_type, int(item.get("size") or 0))
            if found_type == "file" and entries[name].type == "dir":
                log.warning("%s/%s is both an object and a directory: the object is ignored",
                            self._full(key), name)
        return sorted(entries.values(), key=lambda e: e.name)

    def walk(self) -> list[Entry]:
        """Every object below this location at any depth, by key relative to it (on a
        local disk, symbolic links as `link` entries, never followed)."""
        try:
            if self.is_local:
                return self._call("list", None, _local.walk, self.root, self._below())
            self.fs.invalidate_cache(self.path)
            found = self._call("list", None, self.fs.find, self.path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted((Entry(posixpath.relpath(item["name"].rstrip("/"), self.path), "file",
                             int(item.get("size") or 0)) for item in found.values()), key=lambda e: e.name)

    def write(self, key: str, *parts: Any, atomic: bool = False, durable: bool = False) -> None:
        """Writes the object `key`, the concatenation of the bytes-like `parts`, below
        this location, creating directories as needed.

        With `atomic`, a reader sees either the old object or the whole new one: a
        local file is written aside and renamed over; an object store PUT already is
        (see docs/pytree-zarr-checkpoint.md, Commit). With `durable`, the object is on
        stable storage when this returns, and so is every directory entry leading to it
        (on a local disk see `_local`; a store that acknowledged a PUT has it).
        """
        _stats.add("store_bytes_written", sum(memoryview(p).nbytes for p in parts))
        if self.is_local:
            self._call("write", key, _local.write, self.root, self._below(key), parts, atomic=atomic,
                       durable=durable)
            return
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        body = bytes(data) if self.protocol.bytes_body else data
        self._call("write", key, self.fs.pipe_file, self._full(key), body)

    def read(self, key: str, *, limit: int | None = None) -> bytes:
        """The whole object `key` below this location (its first `limit` bytes with a
        limit), in one request; FileNotFoundError if absent."""
        if self.is_local:
            data = self._call("read", key, _local.read, self.root, self._below(key), limit)
        elif limit is not None:
            data = self._call("read", key, self.fs.cat_file, self._full(key), start=0, end=limit)
        else:
            data = self._call("read", key, self.fs.cat_file, self._full(key), **self.read_options)
        _stats.add("store_bytes_read", len(data))
        return data

    def read_if_present(self, keys: Sequence[str]) -> list[bytes | None]:
        """Several small objects, None for each that is absent: one round trip, as the
        requests go out together."""
        def attempt(key: str) -> bytes | None:
            try:
                return self.read(key)
            except FileNotFoundError:
                return None

        return _concurrency.run_all(attempt, keys, 1 if self.is_local else len(keys))

    def read_into(self, key: str, *buffers: memoryview) -> int:
        """Reads object `key` into `buffers`, filling each in turn (as far as the object
        goes); returns the object's size.

        Local files are read straight into the buffers, with no intermediate copy: on
        restore the first buffer is the new array's memory.
        """
        if self.is_local:
            size, done = self._call("read", key, _local.read_into, self.root, self._below(key), buffers)
            _stats.add("store_bytes_read", done)
            return size
        data = np.frombuffer(self.read(key), np.uint8)
        offset = 0
        for buffer in buffers:
            piece = data[offset: offset + len(buffer)]
            # numpy copies without holding the GIL (a memoryview copy holds it),
            # so many chunks arriving together are copied side by side.
            np.frombuffer(buffer, np.uint8)[: len(piece)] = piece
            offset += len(piece)
        return len(data)

    def exists(self) -> bool:
        """Whether anything is here. Never answered from fsspec's listing cache."""
        if self.is_local:
            return bool(self._call("check", None, _local.exists, self.root, self._below()))
        self.fs.invalidate_cache(self.path)
        return bool(self._call("check", None, self.fs.exists, self.path))

    def remove_file(self, name: str) -> None:
        """Deletes one object if it is there (one request)."""
        try:
            if self.is_local:
                self._call("delete", name, _local.remove_file, self.root, self._below(name))
            else:
                self._call("delete", name, self.fs.rm_file, self._full(name))
        except FileNotFoundError:
            pass

    def remove_tree(self) -> None:
        """Deletes everything below this location, if anything (on a local disk, a link
        inside is deleted itself, never followed)."""
        try:
            if self.is_local:
                self._call("delete", None, _local.remove_tree, self.root, self._below())
            else:
                self._call("delete", None, self.fs.rm, self.path, recursive=True)
        except FileNotFoundError:
            pass
        if not self.is_local:
            self.fs.invalidate_cache(self.path)

    def _call(self, action: str, key: str | None, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Runs one store operation, retrying transient failures with exponential
        backoff; a failure that persists becomes a credential-free OSError naming the
        object's URL. Every operation here is idempotent, so a retry is safe.

        Nothing is tried (or tried again) once the operation this request is part of
        has failed elsewhere (`_concurrency.aborted`): a failed save stops talking to
        the store at once instead of retrying requests whose result no longer matters.
        """
        for attempt in range(RETRIES + 1):
            if _concurrency.aborted():
                raise _concurrency.Aborted(f"not {action}ing {key or self.url}: the operation had already failed")
            _stats.add(f"store_{action}")
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # any failure inside the store's client library
                if attempt < RETRIES and _transient(e):
                    delay = min(_MAX_BACKOFF_S, _FIRST_BACKOFF_S * 2**attempt) * random.uniform(0.5, 1.0)
                    log.debug("retrying %s of %s in %.2fs after %s", action, key or self.url, delay, type(e).__name__)
                    time.sleep(delay)
                    continue
                error = self._store_error(e, action, key, attempt)
                break
        # Raised outside the `except` block so that the original cannot ride along as
        # __context__ when it has to be dropped (see _store_error). The name is dropped
        # as it goes: this frame, in the error's traceback, must not hold the error, or
        # the cycle would keep every caller's frame (a save's whole state) alive until
        # the garbage collector runs, though the caller caught and dropped the error.
        try:
            raise error
        finally:
            del error

    def _store_error(self, e: Exception, action: str, key: str | None, retries: int = 0) -> OSError:
        where = self.url if key is None else f"{self.url.rstrip('/')}/{key}"
        if isinstance(e, _local.SymlinkError):
            return e  # it names the link; a local path holds no credential
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
        """`text` with every credential from storage_options replaced by '***'."""
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


def protocol_of(loc: Location) -> str:
    """The name of `loc`'s store's protocol ("file", "s3", "gs", "memory"...)."""
    return _protocols(loc.fs)[0]


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def resolve(url: str, storage_options: dict[str, Any] | None = None) -> Location:
    """A Location for a local path or any fsspec URL (file://, memory://, s3://, gs://...)."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"checkpoint URL must be a non-empty string, got {reprlib.repr(url)}")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(f"storage_options must be a dict of fsspec options, got {type(storage_options).__name__}")
    scheme = fsspec.core.split_protocol(url)[0] or "file"
    protocol = _PROTOCOLS.get(scheme, _OTHER)
    options = _merged(protocol.option_defaults, storage_options or {})
    fs, path = _url_to_fs(url, tuple(sorted(options.items(), key=lambda kv: kv[0])))
    path = path.rstrip("/") or path
    shown, password = redacted_url(url)
    return Location(url=shown.rstrip("/") or shown, fs=fs, path=path, storage_options=options, protocol=protocol,
                    read_options=_taken(fs, protocol.read_options),
                    secrets=_secrets(storage_options or {}, password), root=path)


def redacted_url(url: str) -> tuple[str, list[str]]:
    """`url` as messages show it, with the password of its userinfo (`scheme://user:
    PASSWORD@host/...`) replaced by '***', and that password as written and decoded
    (for `Location.redact`, since clients quote the URL in their errors)."""
    if "@" not in url or "://" not in url:
        return url, []
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL urllib can split (a bad port): show no userinfo at all
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}", [rest.split("/", 1)[0].rsplit("@", 1)[0]]
    if not password:
        return url, []
    userinfo, host = parts.netloc.rsplit("@", 1)
    user = userinfo.split(":", 1)[0]
    return url.replace(parts.netloc, f"{user}:***@{host}", 1), [password, urllib.parse.unquote(password)]


def _taken(fs: fsspec.AbstractFileSystem, options: Mapping[str, Any]) -> dict[str, Any]:
    """The `cat_file` options that this version of the client accepts."""
    parameters = inspect.signature(getattr(fs, "_cat_file", fs.cat_file)).parameters
    return {name: value for name, value in options.items() if name in parameters}


def _merged(defaults: Mapping[str, Any], options: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(options)
    for name, default in defaults.items():
        given = merged.get(name)
        if isinstance(default, Mapping) and (given is None or isinstance(given, Mapping)):
            merged[name] = _merged(default, given or {})  # a copy: clients may change what they get
        elif given is None:
            merged[name] = default
    return merged


def _secrets(options: Mapping[str, Any], also: Sequence[str] = ()) -> tuple[str, ...]:
    """Every string that may be a credential: the values of storage options whose
    names say so, at any depth (a `token` dict of service-account fields included),
    and `also`."""
    found: set[str] = set(also)
    _find_secrets(options, False, found)
    # Longest first, so that a secret containing another is replaced whole.
    return tuple(sorted((s for s in found if len(s) >= 4 and s not in _NOT_SECRETS), key=len, reverse=True))


def _find_secrets(value: Any, secret: bool, found: set[str]) -> None:
    if isinstance(value, Mapping):
        for name, item in value.items():
            _find_secrets(item, secret or bool(_SECRET_OPTION.search(str(name))), found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _find_secrets(item, secret, found)
    elif isinstance(value, str) and secret:
        found.add(value)


def _url_to_fs(url: str, options: tuple[tuple[str, Any], ...]) -> tuple[fsspec.AbstractFileSystem, str]:
    try:
        return _cached_url_to_fs(url, options)
    except TypeError:  # unhashable storage option values: skip the cache
        return fsspec.core.url_to_fs(url, **dict(options))


@functools.lru_cache(maxsize=64)
def _cached_url_to_fs(url: str, options: tuple[tuple[str, Any], ...]) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(url, **dict(options))
