"""Any fsspec file system as a store, one class per kind that zarrckpt knows: `S3Store`
and `GCSStore` (object stores that check the conditions zarrckpt sends: `ObjectStore`),
`MemoryStore` (fsspec's in-process memory://), and `Fsspec` for any other (azure, http,
a wrapper...). Each says what it can do (`exclusive`, `late`, and how it copies), so
that nothing asks which protocol it is. `Protocol` holds the client settings of each
kind: how many requests to keep in flight and how to talk to the client library in as
few round trips as possible.

A request to an asynchronous client (s3fs, gcsfs) runs on fsspec's event loop with a
deadline, past which it is cancelled: a store that stops answering costs a timeout,
never a hang. Their own retries are turned off, so that every retry is zarrckpt's and
follows one classification (`guard.classify`): one call here can be several HTTP
requests (an S3 `exists` is a HEAD and a listing, a GCS `rm` a listing and a delete
per object), so each HTTP request is also tried again on its own, REQUEST_TRIES
times, inside the call's deadline; `guard` then tries the whole call again.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import copy
import dataclasses
import datetime
import errno
import logging
import posixpath
import threading
import types
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import fsspec
import fsspec.asyn
import numpy as np

from . import guard as _guard, hedge as _hedge
from .store import Check, DeadlinePassed, Entry, Larger, SourceChanged, Store

log = logging.getLogger("zarrckpt")
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class Protocol:
    """How zarrckpt talks to one kind of store's client library."""

    # The store class of this kind (what it can do: see the module docstring).
    kind: type[Fsspec]
    # Requests kept in flight by default (save's and restore's thread pools).
    concurrency: int
    # The client accepts only `bytes` bodies, so a chunk's memoryview is copied first.
    bytes_body: bool = True
    # Extra arguments to `cat_file`, passed where the installed client takes them.
    read_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Storage options merged under the user's (the user's win, key by key).
    option_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # The client's own attempts per request, set on the file system zarrckpt uses
    # (s3fs takes no such option): 1, so that retries are zarrckpt's alone.
    client_attempts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # The client's coroutine that makes every HTTP request (s3fs's `_call_s3`, gcsfs's
    # `_request`): each request is tried again through it (`_retry_each_request`), gcsfs's own
    # retrying decorator (six tries, sleeping up to 32 s) removed.
    request_method: str | None = None
    # zarrckpt's extra that installs the client (`pip install 'zarrckpt[<extra>]'`), a
    # release zarrckpt was tested with.
    extra: str | None = None


# The most S3's CopyObject copies in one request (5 GiB), less a margin for what a chunk
# object holds past its data (a checksum): copies are asked for by the data's size.
_ONE_COPY_BYTES = 5 * 2**30 - 2**20
# s3fs's and gcsfs's default `chunksize`, the size of a multipart or resumable upload's parts.
_CLIENT_CHUNK_BYTES = 50 * 2**20


@dataclasses.dataclass(frozen=True)
class Honoured:
    """What a store was found to honour of the conditions zarrckpt sends (`ObjectStore.probe`):
    `create`, a write only if absent (S3's If-None-Match, GCS's ifGenerationMatch=0);
    `copy_source`, a copy only from the source's version named (S3's
    x-amz-copy-source-if-match, GCS's ifSourceGenerationMatch)."""

    create: bool
    copy_source: bool


_TRUSTED = Honoured(create=True, copy_source=True)  # a store not probed: trusted to honour both

# Where a probed store is: its protocol, endpoint and bucket.
_Where = tuple[str, "str | None", "str | None"]


class Honours:
    """What the object stores probed in this process honour (`Honoured`), by where they
    are (protocol, endpoint, bucket). Kept for the process, not on a store object: the
    answer is the server's, not a client's, while fsspec makes a client per set of
    storage options and every call resolves its URL anew (each manager,
    `save_checkpoint`, a CLI command), so that an answer kept on one store object would
    be asked again at every manager's start. `HONOURED` is the process's, which
    `resolve` hands every object store it makes. Every process of a job asks on its own
    (`CheckpointManager`), so that all of them write and copy alike. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._found: dict[_Where, Honoured] = {}

    def known(self, where: _Where) -> bool:
        """Whether the store at `where` was probed in this process."""
        with self._lock:
            return where in self._found

    def of(self, where: _Where) -> Honoured:
        """What the store at `where` was found to honour; both conditions where it was
        not probed."""
        with self._lock:
            return self._found.get(where, _TRUSTED)

    def found(self, where: _Where, honoured: Honoured) -> None:
        """Records what a probe of the store at `where` found."""
        with self._lock:
            self._found[where] = honoured


HONOURED = Honours()
_PROBE_ETAG = '"ffffffffffffffffffffffffffffffff"'  # no object's: the MD5 of no bytes anyone writes
_PROBE_GENERATION = "1"  # no object's: GCS's generations are microseconds since 1970
REQUEST_TRIES = 4  # per HTTP request, within one call (see the module docstring)


def _retry_each_request(fs: fsspec.AbstractFileSystem, name: str) -> None:
    """Makes `fs.name`, the coroutine each HTTP request of `fs` goes through, try a
    request that failed transiently again, up to REQUEST_TRIES times. On the file
    system itself (fsspec shares one per set of options), once. The coroutine is the
    client's own (s3fs's `_call_s3`, gcsfs's `_request`): neither client offers a
    public hook around each of its requests."""
    made = getattr(fs, name)
    if getattr(made, "zarrckpt_retried", False):
        return
    method = getattr(type(fs), name)
    once = types.MethodType(getattr(method, "__wrapped__", method), fs)  # the client's own retries removed

    async def retried(*args: Any, **kwargs: Any) -> Any:
        for attempt in range(REQUEST_TRIES):
            try:
                return await once(*args, **kwargs)
            except Exception as e:  # any failure inside the client library
                failure = _guard.classify(e)
                if attempt + 1 == REQUEST_TRIES or failure.kind in ("permanent", "timeout", "unreachable"):
                    raise
                # Short waits only: throttling's longer ones are `guard`'s, between calls,
                # so that they never eat the call's deadline.
                await asyncio.sleep(_guard.backoff_s(_guard.Failure("transient"), attempt))
        raise AssertionError("unreachable")

    retried.zarrckpt_retried = True  # type: ignore[attr-defined]
    setattr(fs, name, retried)


class Fsspec(Store):
    """An fsspec file system below `root` (a path in it, as fsspec spells it) that
    zarrckpt knows nothing more of (azure, http, a wrapper...): assumed remote, so that
    a request abandoned at its deadline may still be applied (`late`); `create` is a
    check, then a write, so that two jobs can both succeed (not `exclusive`); a copy's
    bytes pass through this process, its source looked at once the copy is made. The
    kinds zarrckpt knows more of say what they do instead (`MemoryStore`, `S3Store`,
    `GCSStore`).

    Requests to an asynchronous client go through fsspec's asynchronous interface (its
    `_`-prefixed coroutines), so that they can be cancelled at their deadline."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, protocol: Protocol,
                 read_options: Mapping[str, Any], endpoint: str | None) -> None:
        self.fs, self.root, self.protocol = fs, root, protocol
        self.read_options = read_options  # what of protocol.read_options this client takes
        self.concurrency = protocol.concurrency
        self.endpoint = endpoint
        self.hedging = _hedge.of(fs)
        for name, value in protocol.client_attempts.items():
            if hasattr(fs, name):
                setattr(fs, name, value)
        if protocol.request_method is not None and hasattr(fs, protocol.request_method):
            _retry_each_request(fs, protocol.request_method)

    # -- what this kind of store can do (the kinds below say otherwise)

    # A write's answer names no version: asked only where a caller needs it (a chunk's).
    says_versions = False

    @property
    def exclusive(self) -> bool:
        return False

    @property
    def late(self) -> bool:
        return True

    def _copies_inside(self) -> bool:
        """Whether the store copies an object itself (`_copy`), its bytes passing through
        no process; else `copy` reads and writes them."""
        return False

    def _source_condition(self, expect: str, size: int) -> dict[str, str] | None:
        """The precondition that makes the store copy only from the version `expect` of its
        source (see `_version`; `size` bytes), in the copy's own request; None where it
        has none."""
        return None

    def _checked_by_copy(self, made: str | None, expect: str) -> bool:
        """Whether a copy sent with its source's condition (`_source_condition`), which
        made the version `made`, is known to be of the version `expect`: else the source
        is looked at once the copy is made."""
        return False

    def _whole(self, size: int) -> dict[str, int]:
        """`pipe_file`'s options that send an object of `size` bytes in one request, whose
        answer names the version made."""
        return {}

    def _copy(self, source: str, target: str, size: int, condition: Mapping[str, str] | None,
              timeout: float | None) -> Any:
        """Copies `source` (`size` bytes) to `target` inside the store, with `condition`
        on the source where the store takes one; returns the store's answer."""
        return self._run("cp_file", source, target, timeout=timeout)

    def _copy_new(self, source: str, target: str, size: int, condition: Mapping[str, str] | None,
                  timeout: float | None) -> Any:
        """`_copy`, only if nothing is at `target` (FileExistsError if something is)."""
        return self._if_absent(target, lambda: self._copy(source, target, size, condition, timeout), timeout=timeout)

    def _put_new(self, path: str, body: object, timeout: float | None) -> str | None:
        """`_put`, only if nothing is at `path` (FileExistsError if something is)."""
        return self._if_absent(path, lambda: self._put(path, body, timeout), timeout=timeout)

    def _if_absent(self, path: str, make: Callable[[], _T], *, timeout: float | None) -> _T:
        """`make()` once a check found nothing at `path` (FileExistsError if something
        is): two writers can both pass the check."""
        self.fs.invalidate_cache(path)
        if self._run("exists", path, timeout=timeout):
            raise FileExistsError(errno.EEXIST, f"{path} exists")
        return make()

    # -- requests

    def _path(self, key: str) -> str:
        return posixpath.join(self.root, key) if key else self.root

    def _run(self, method: str, *args: Any, timeout: float | None, **kwargs: Any) -> Any:
        """`fs.method(*args, **kwargs)`; an asynchronous client's is cancelled after
        `timeout` seconds (DeadlinePassed).

        The deadline is kept from this thread, and the request cancelled only once it
        has passed: an asyncio timeout around the request (fsspec's `sync(timeout=)`,
        `asyncio.timeout`) kept aiohttp's own read timeout from firing on Python 3.11,
        so that botocore's 2 s timeout became zarrckpt's 60 s."""
        if not self._on_loop:
            return getattr(self.fs, method)(*args, **kwargs)
        return self._await(getattr(self.fs, f"_{method}")(*args, **kwargs), timeout)

    @property
    def _on_loop(self) -> bool:
        """Whether the client's requests run on fsspec's event loop, as futures this
        thread waits on (and may cancel): an asynchronous client's."""
        return isinstance(self.fs, fsspec.asyn.AsyncFileSystem) and not self.fs.asynchronous

    def _cat(self, path: str, *, nbytes: int, timeout: float | None, check: Check | None = None,
             **kwargs: Any) -> bytes:
        """`fs.cat_file(path, **kwargs)` (as `_run`), hedged on an asynchronous client
        (see `hedge`: `nbytes` is about what it moves, `check` what is wrong with an answer)."""
        if not self._on_loop:
            return self._run("cat_file", path, timeout=timeout, **kwargs)  # type: ignore[no-any-return, unused-ignore]
        return _hedge.first_good(
            lambda: asyncio.run_coroutine_threadsafe(self.fs._cat_file(path, **kwargs), self.fs.loop),
            self.hedging, nbytes=nbytes, timeout=timeout, check=check)

    def _await(self, coroutine: Any, timeout: float | None) -> Any:
        """Runs `coroutine` on the client's event loop, abandoned after `timeout` (see `_run`)."""
        request = asyncio.run_coroutine_threadsafe(coroutine, self.fs.loop)
        try:
            return request.result(timeout)
        except TimeoutError:
            if request.done():  # the client's own timeout
                raise
            request.cancel()
            raise DeadlinePassed(f"abandoned after {timeout:.0f} s") from None

    def list_dir(self, key: str, *, timeout: float | None) -> list[Entry]:
        path = self._path(key)
        self.fs.invalidate_cache(path)  # other processes add and remove steps
        found = self._run("ls", path, detail=True, timeout=timeout)
        # An object store can list a name twice: an object `run/5` and the prefix `run/5/`.
        entries: dict[str, Entry] = {}
        for item in found:
            name = posixpath.basename(item["name"].rstrip("/"))
            found_type = "dir" if item.get("type") == "directory" else "file"
            if name not in entries or found_type == "dir":
                entries[name] = Entry(name, found_type, int(item.get("size") or 0))
            if found_type == "file" and entries[name].type == "dir":
                log.warning("%s/%s is both an object and a directory: the object is ignored", path, name)
        return sorted(entries.values(), key=lambda e: e.name)

    def walk(self, key: str, *, timeout: float | None, empty_directories: bool = False) -> list[Entry]:
        path = self._path(key)  # an object store's "directories" are prefixes of objects: never empty
        self.fs.invalidate_cache(path)
        found = self._run("find", path, detail=True, timeout=timeout)
        return sorted((Entry(posixpath.relpath(item["name"].rstrip("/"), path), "file", int(item.get("size") or 0),
                             _version(item)) for item in found.values()), key=lambda e: e.name)

    def write(self, key: str, parts: Sequence[object], *, atomic: bool, durable: bool,
              timeout: float | None) -> str | None:
        # A PUT is atomic, and durable once acknowledged (docs/pytree-zarr-checkpoint.md).
        return self._put(self._path(key), self._body(parts), timeout)

    def _put(self, path: str, body: object, timeout: float | None, **mode: str) -> str | None:
        """Writes `body` at `path` in one request where the store takes it so (`_whole`,
        with `pipe_file`'s `mode`); returns the version made (`_made`)."""
        size = _size(body)
        return self._made(path, self._run("pipe_file", path, body, timeout=timeout, **self._whole(size), **mode),
                          size, timeout)

    def _body(self, parts: Sequence[object]) -> object:
        """`parts` as one body the client takes, copied only where it must be."""
        data = parts[0] if len(parts) == 1 else b"".join(parts)  # type: ignore[arg-type]
        # A chunk's numpy array as bytes (gcsfs adds a body to bytes: an array would add elementwise).
        return bytes(data) if self.protocol.bytes_body else memoryview(data).cast("B")  # type: ignore[call-overload, arg-type]

    def _made(self, path: str, answer: Any, size: int, timeout: float | None) -> str | None:
        """The version of the object at `path` (`size` bytes) that a request just made:
        from the store's `answer` (S3's ETag, GCS's object resource), else, where
        `says_versions` (S3's multipart upload past 5 GiB), asked of the store at once;
        None where neither says it (memory://, an fsspec file system zarrckpt has no
        protocol for: `version` asks where a caller needs it)."""
        if isinstance(answer, dict):
            fields = answer.get("CopyObjectResult") or answer.get("resource") or answer
            if "ETag" in fields or "generation" in fields:
                return _version({**fields, "size": size})
        return self._asked(path, timeout) if self.says_versions else None

    def version(self, key: str, *, timeout: float | None) -> str | None:
        return self._asked(self._path(key), timeout)

    def _asked(self, path: str, timeout: float | None) -> str | None:
        """The version of the object at `path`, one request; None where that fails."""
        try:
            self.fs.invalidate_cache(path)
            return _version(self._run("info", path, timeout=timeout))
        except Exception as e:  # not known, so never made from: a later save writes it again
            log.debug("no version of %s: %s", path, e)
            return None

    def create(self, key: str, parts: Sequence[object], *, timeout: float | None) -> str | None:
        return self._put_new(self._path(key), self._body(parts), timeout)

    def copy(self, key: str, source: str, *, size: int, exclusive: bool, expect: str,
             timeout: float | None) -> str | None:
        # Only from the version asked for: where the store checks it in the copy's own
        # request and its answer says so (`_checked_by_copy`), that is all; elsewhere the
        # source is looked at once the copy is made (a version never comes back, so it was
        # that version all along).
        source, target = self._path(source), self._path(key)
        checked = False
        if not self._copies_inside():
            data = self._run("cat_file", source, timeout=timeout)
            made = self.create(key, [data], timeout=timeout) if exclusive else \
                self.write(key, [data], atomic=False, durable=True, timeout=timeout)
        else:
            condition = self._source_condition(expect, size)
            try:
                answer = self._copy_new(source, target, size, condition, timeout) if exclusive else \
                    self._copy(source, target, size, condition, timeout)
            except OSError as e:
                # A precondition that failed: the target's (FileExistsError) or the source's.
                if condition is not None and _refused(e):
                    self._expect(source, expect, timeout)
                raise
            finally:
                self.fs.invalidate_cache(target)
            # A copy's size is its source's (S3, GCS and memory:// say sizes).
            made = self._made(target, answer, int(_version_parts(expect)[2]), timeout)
            checked = condition is not None and self._checked_by_copy(made, expect)
        if not checked:
            try:
                self._expect(source, expect, timeout)
            except SourceChanged:
                with contextlib.suppress(OSError):
                    self._run("rm_file", target, timeout=timeout)
                raise
        return made

    def _expect(self, source: str, expect: str, timeout: float | None) -> None:
        """SourceChanged unless the object `source` is the version `expect`."""
        self.fs.invalidate_cache(source)
        try:
            found = _version(self._run("info", source, timeout=timeout))
        except FileNotFoundError:
            found = None
        if found != expect:
            raise SourceChanged(errno.ENOENT, f"{source} is not the object it was (now {found or 'gone'})")

    def read(self, key: str, limit: int | None, *, timeout: float | None,
             check: Check | None = None, most: int | None = None) -> bytes:
        if limit is None and most is None:
            return self._cat(self._path(key), nbytes=0, timeout=timeout, check=check, **self.read_options)
        try:
            data = self._cat(self._path(key), start=0, end=(most or 0) + 1 if limit is None else limit,
                             nbytes=limit or 0, timeout=timeout, check=check)
        except Exception as e:
            # S3 and GCS refuse any range of an empty object (HTTP 416): that is its bytes.
            if _guard.classify(e).http_status == 416 or "not satisfiable" in str(e):
                return b""
            raise
        if most is not None and len(data) > most:
            raise Larger(self._path(key), most)
        return data

    def read_into(self, key: str, buffers: Sequence[memoryview], *, timeout: float | None,
                  check: Check | None = None) -> tuple[int, int]:
        data = np.frombuffer(self._cat(self._path(key), nbytes=sum(map(len, buffers)), timeout=timeout, check=check,
                                       **self.read_options), np.uint8)
        offset = 0
        for buffer in buffers:
            piece = data[offset: offset + len(buffer)]
            # numpy copies without holding the GIL (a memoryview copy holds it),
            # so many chunks arriving together are copied side by side.
            np.frombuffer(buffer, np.uint8)[: len(piece)] = piece
            offset += len(piece)
        return len(data), len(data)

    def read_range(self, key: str, start: int, buffer: memoryview, *, timeout: float | None) -> int:
        data = self._cat(self._path(key), start=start, end=start + len(buffer), nbytes=len(buffer), timeout=timeout)
        np.frombuffer(buffer, np.uint8)[: len(data)] = np.frombuffer(data, np.uint8)
        return len(data)

    def exists(self, key: str, *, timeout: float | None) -> bool:
        path = self._path(key)
        self.fs.invalidate_cache(path)
        return bool(self._run("exists", path, timeout=timeout))

    def remove_file(self, key: str, *, timeout: float | None) -> None:
        self._run("rm_file", self._path(key), timeout=timeout)

    def remove_tree(self, key: str, *, timeout: float | None) -> None:
        path = self._path(key)
        try:
            self._run("rm", path, recursive=True, timeout=timeout)
        finally:
            self.fs.invalidate_cache(path)

    def moved(self, root: str) -> Fsspec:
        moved = copy.copy(self)  # the same client, settings and kind
        moved.root = root
        return moved

    def place(self, key: str) -> tuple[str, str]:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return f"{protocol}:{self.endpoint}", posixpath.normpath("/" + self._path(key))


class MemoryStore(Fsspec):
    """fsspec's memory file system, which lives in this process: a request is applied
    as it is made (never `late`); `create` is exclusive by a lock of this process around
    the check and the write; a copy is the file system's own (`cp_file`, in memory)."""

    # Every memory file system of the process holds the same objects: one lock for all.
    _creating = threading.Lock()

    @property
    def exclusive(self) -> bool:
        return True

    @property
    def late(self) -> bool:
        return False

    def _copies_inside(self) -> bool:
        return True

    def _if_absent(self, path: str, make: Callable[[], _T], *, timeout: float | None) -> _T:
        with self._creating:
            return super()._if_absent(path, make, timeout=timeout)


class ObjectStore(Fsspec, abc.ABC):
    """A bucket (the root's first part) of an object store that checks the conditions
    zarrckpt sends in a request (S3, GCS): `create` is a write that the store refuses
    where an object is, and a copy is made inside the store, only from the version of
    its source named, as far as `probe` found the store to honour them (`honours`, the
    process's `HONOURED` unless given): a store found to ignore the first is one
    without an exclusive `create`, one found to ignore the second has a copy's bytes
    read and written through this process."""

    # A write's answer names the version made (asked at once where it does not: S3's
    # multipart upload).
    says_versions = True

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, protocol: Protocol,
                 read_options: Mapping[str, Any], endpoint: str | None, honours: Honours = HONOURED) -> None:
        super().__init__(fs, root, protocol, read_options, endpoint)
        self.honours = honours

    @property
    def exclusive(self) -> bool:
        return self.honours.of(self._probed_as()).create

    def _copies_inside(self) -> bool:
        return self.honours.of(self._probed_as()).copy_source

    @property
    def needs_probe(self) -> bool:
        return True

    def bucket(self) -> str | None:
        return self.root.split("/", 1)[0]

    def _probed_as(self) -> _Where:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return protocol, self.endpoint, self.bucket()

    def _put_new(self, path: str, body: object, timeout: float | None) -> str | None:
        if not self.exclusive:
            return super()._put_new(path, body, timeout)
        return _refused_as_existing(path, lambda: self._put(path, body, timeout, mode="create"))

    def _copy_new(self, source: str, target: str, size: int, condition: Mapping[str, str] | None,
                  timeout: float | None) -> Any:
        if not self.exclusive:
            return super()._copy_new(source, target, size, condition, timeout)
        return _refused_as_existing(target, lambda: self._copy_if_absent(source, target, size, condition, timeout))

    @abc.abstractmethod
    def _copy_if_absent(self, source: str, target: str, size: int, condition: Mapping[str, str] | None,
                        timeout: float | None) -> Any:
        """`_copy` in a request that the store refuses where an object is at `target`."""

    @abc.abstractmethod
    def _copy_from_no_version(self, source: str, target: str, size: int, timeout: float | None) -> None:
        """A copy of `source` (`size` bytes) to `target` only from a version that no object
        is (the probe's): one that the store must refuse."""

    def probe(self, key: str, *, timeout: float | None) -> None:
        # The probe's objects are made below `key` (the run's lease area), named so that
        # nothing else takes them for its own, and deleted; two probes never meet.
        if self.honours.known(self._probed_as()):
            return
        path = self._path(posixpath.join(key, f"probe-{uuid.uuid4().hex}"))
        copied, body = f"{path}-copy", b"zarrckpt: a second create of this object must be refused\n"

        def created() -> bool:
            try:
                self._put(path, body, timeout, mode="create")
            except OSError as e:  # refused: this probe's own first attempt landed unseen, or the second
                if _refused(e):
                    return False
                raise
            return True

        made = [path]
        try:
            create = not (created() and created())
            made.append(copied)
            try:
                self._copy_from_no_version(path, copied, len(body), timeout)
                copy_source = False
            except OSError as e:
                if not _refused(e):
                    raise
                copy_source = True
                made.remove(copied)  # refused: nothing made there
        finally:
            for made_here in made:
                try:
                    self._run("rm_file", made_here, timeout=timeout)
                except FileNotFoundError:
                    pass
                except OSError as e:  # an object of no checkpoint: in the way of nothing
                    log.warning("could not delete %s, the probe of what the store honours: %s", made_here, e)
        self.honours.found(self._probed_as(), Honoured(create, copy_source))


class S3Store(ObjectStore):
    """An S3 bucket, or an S3-compatible server's: If-None-Match on a create; a copy by
    CopyObject, sent with x-amz-copy-source-if-match, whose answer (the copy's ETag, a
    digest of its bytes) says which version it copied."""

    def _whole(self, size: int) -> dict[str, int]:
        # PutObject, whose answer names the ETag: s3fs would send an object of 100 MiB or
        # more as a multipart upload, whose answer names none (then a later save could
        # make nothing from it). S3 takes at most 5 GiB in one request.
        return {"chunksize": max(size, _CLIENT_CHUNK_BYTES)} if size <= _ONE_COPY_BYTES else {}

    def _source_condition(self, expect: str, size: int) -> dict[str, str] | None:
        # CopyObject's; s3fs's multipart copy of a larger object sends it in no request.
        field, value, _ = _version_parts(expect)
        return {"CopySourceIfMatch": value} if field == "ETag" and size <= _ONE_COPY_BYTES else None

    def _checked_by_copy(self, made: str | None, expect: str) -> bool:
        # The copy's ETag is its source's, as an S3-compatible store that ignores the
        # condition would not answer (nor one whose ETags are no digest: SSE-KMS).
        return made == expect

    def _copy(self, source: str, target: str, size: int, condition: Mapping[str, str] | None,
              timeout: float | None) -> Any:
        return self._copy_object(source, target, size, timeout, **(condition or {}))

    def _copy_if_absent(self, source: str, target: str, size: int, condition: Mapping[str, str] | None,
                        timeout: float | None) -> Any:
        return self._copy_object(source, target, size, timeout, IfNoneMatch="*", **(condition or {}))

    def _copy_from_no_version(self, source: str, target: str, size: int, timeout: float | None) -> None:
        self._copy_object(source, target, size, timeout, CopySourceIfMatch=_PROBE_ETAG)

    def _copy_object(self, source: str, target: str, size: int, timeout: float | None, **conditions: str) -> Any:
        """S3's CopyObject of `source` (`size` bytes) to `target`, in one request where S3
        copies that much in one (5 GiB); a larger one by s3fs's multipart copy. Returns
        S3's answer (None for a multipart copy).

        Through s3fs's `_call_s3`, its own coroutine for a request (which turns S3's
        errors into OSErrors): s3fs's public `cp_file` asks for the size first, a HEAD
        per copy, and offers no other way to send one CopyObject."""
        if size > _ONE_COPY_BYTES:
            self._run("cp_file", source, target, timeout=timeout, **conditions)
            return None
        (source_bucket, source_key, _), (bucket, key, _) = self.fs.split_path(source), self.fs.split_path(target)
        return self._await(self.fs._call_s3("copy_object", Bucket=bucket, Key=key,
                                            CopySource={"Bucket": source_bucket, "Key": source_key}, **conditions),
                           timeout)


class GCSStore(ObjectStore):
    """A GCS bucket: ifGenerationMatch=0 on a create; a copy by GCS's rewrite, sent with
    ifSourceGenerationMatch, checked by the store in the copy's own request."""

    def _whole(self, size: int) -> dict[str, int]:
        # A simple upload, whose answer names the generation: gcsfs would send an object
        # of 50 MiB or more as a resumable upload, whose answer names none.
        return {"chunksize": max(size + 1, _CLIENT_CHUNK_BYTES)}

    def _source_condition(self, expect: str, size: int) -> dict[str, str] | None:
        field, value, _ = _version_parts(expect)
        return {"ifSourceGenerationMatch": value} if field == "generation" else None

    def _checked_by_copy(self, made: str | None, expect: str) -> bool:
        return True  # GCS refuses the request otherwise; its answer names the new object's generation

    def _copy(self, source: str, target: str, size: int, condition: Mapping[str, str] | None,
              timeout: float | None) -> Any:
        # gcsfs's `cp_file` would send no condition on the source.
        return self._await(_rewrite(self.fs, source, target, condition or {}), timeout)

    def _copy_if_absent(self, source: str, target: str, size: int, condition: Mapping[str, str] | None,
                        timeout: float | None) -> Any:
        return self._await(_rewrite(self.fs, source, target, {"ifGenerationMatch": 0, **(condition or {})}), timeout)

    def _copy_from_no_version(self, source: str, target: str, size: int, timeout: float | None) -> None:
        self._await(_rewrite(self.fs, source, target,
                             {"ifGenerationMatch": 0, "ifSourceGenerationMatch": _PROBE_GENERATION}), timeout)


# An object store answers each request in tens of milliseconds, mostly spent waiting:
# with 128 in flight a 1000-leaf restore at 20 ms per request took 15 round-trip
# times on 2 cores, with 64, 22 (the waves of requests no longer hide the CPU work).
# A bound all the same: S3 and GCS throttle one prefix past a few thousand requests
# a second (their clients retry), and each request in flight holds a thread.
OBJECT_STORE_CONCURRENCY = 128
S3 = Protocol(
    S3Store,
    OBJECT_STORE_CONCURRENCY,
    # botocore refuses memoryview bodies; a file object would be read 64 KiB at a time
    # through aiohttp's executor, far slower than one copy.
    bytes_body=True,
    # With its default max_concurrency, s3fs (2026.2 on; older ones take no such
    # argument) sends a HEAD before every GET to decide whether to split the read into
    # ranges: a second round trip per object. Objects here are at most one chunk and
    # many are read at once, so one GET each is best.
    read_options={"max_concurrency": 1},
    option_defaults={"config_kwargs": {
        # botocore keeps at most 10 connections per client by default, which would cap
        # the requests in flight at 10 whatever the thread count; this is above any
        # sensible worker count, and connections are only opened when used.
        "max_pool_connections": 256,
        # One attempt per request: botocore's retries times s3fs's times zarrckpt's
        # kept a save blocked for minutes on a store that stopped answering.
        "retries": {"total_max_attempts": 1},
    }},
    client_attempts={"retries": 1},
    request_method="_call_s3",
    extra="s3",
)
# gcsfs copies the body into its multipart upload anyway (or slices a memoryview for
# resumable uploads of large objects), so a memoryview saves a copy. Its aiohttp
# session opens at most 100 connections: more requests would only queue for them.
GCS = Protocol(GCSStore, 100, bytes_body=False, request_method="_request", extra="gcs")
# The in-process memory file system: more threads would only contend for the GIL.
MEMORY = Protocol(MemoryStore, 8, bytes_body=False)
# Anything else (azure, http, a wrapper...) is assumed remote and given bytes.
OTHER = Protocol(Fsspec, OBJECT_STORE_CONCURRENCY)
PROTOCOLS = {"memory": MEMORY, "s3": S3, "s3a": S3, "gs": GCS, "gcs": GCS}


def _version(item: dict[str, Any]) -> str | None:
    """What tells this version of a listed object from any other made at its key: S3's
    ETag (with its size: a multipart upload's is no digest of the bytes), GCS's
    generation, else the time it was made, as the file system says."""
    for field in ("generation", "ETag", "etag", "created", "mtime", "LastModified"):
        if (value := item.get(field)) is not None:
            # A time as a listing says it, or an object's information (memory://: a datetime).
            value = value.timestamp() if isinstance(value, datetime.datetime) else value
            return f"{field}:{value}:{item.get('size')}"
    return None


def _version_parts(version: str) -> tuple[str, str, str]:
    """The field, value and size (as `_version` wrote it: "None" where the store says
    none) a version of `_version` names."""
    field, _, rest = version.partition(":")
    value, _, size = rest.rpartition(":")
    return field, value, size


def _refused(e: OSError) -> bool:
    """Whether `e` is a store's refusal of a request's precondition (412): s3fs says
    FileExistsError only where S3 names the condition."""
    return isinstance(e, FileExistsError) or _guard.classify(e).http_status == 412


def _size(body: object) -> int:
    return memoryview(body).nbytes  # type: ignore[arg-type]


def _refused_as_existing(path: str, request: Callable[[], _T]) -> _T:
    """`request()`, a request the store refuses where an object is at `path`: its
    refusal as FileExistsError."""
    try:
        return request()
    except OSError as e:
        if not isinstance(e, FileExistsError) and _refused(e):
            raise FileExistsError(errno.EEXIST, f"{path} exists") from e
        raise


async def _rewrite(fs: Any, source: str, target: str, preconditions: Mapping[str, object]) -> dict[str, Any]:
    """GCS's copy (a rewrite, in as many calls as it asks for) of `source` to `target`,
    sent with `preconditions` (ifGenerationMatch=0: only if no object is there;
    ifSourceGenerationMatch: only from that generation of `source`), which gcsfs's
    `cp_file` does not send. Returns GCS's last answer, which holds the object made.
    Through gcsfs's `_call`, its own coroutine for a request of its JSON API: gcsfs
    offers no public call that sends a rewrite's preconditions."""
    (source_bucket, source_key, _), (bucket, key, _) = fs.split_path(source), fs.split_path(target)
    token = None
    while True:
        out: dict[str, Any] = await fs._call("POST", "b/{}/o/{}/rewriteTo/b/{}/o/{}", source_bucket, source_key,
                                             bucket, key, headers={"Content-Type": "application/json"},
                                             json_out=True, rewriteToken=token, **preconditions)
        if out.get("done", True):
            return out
        token = out["rewriteToken"]
