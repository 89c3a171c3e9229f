"""URLs -> Locations: the few storage operations zarrckpt needs, on any fsspec URL.

Three layers, imported only through this package:
- `store.Store`, the interface, with one class per kind of storage, each saying what it
  can do: `local.LocalDisk` (local paths and file:// URLs: plain file calls, chunks
  straight between files and array memory, never through a symbolic link below the
  path given), and in `remote` `S3Store`, `GCSStore`, `MemoryStore` and `Fsspec` (any
  other fsspec protocol);
- `guard.Guarded`, what every request needs whatever the store: a deadline, retries,
  the abort check, counting, and errors without credentials;
- `Location`, a place in a store (a checkpoint, or a directory of steps) that the rest
  of zarrckpt reads and writes through, and `resolve`, which makes one of a URL.

Every failure of the store surfaces as an OSError (FileNotFoundError, PermissionError,
FileExistsError for a `create` of an object that is there, TimeoutError or OSError)
whose message names the object's URL and leaves out every credential passed in
`storage_options` or the URL; a symbolic link or a special file met on a local
disk as `NotAFileInCheckpoint`, a CheckpointCorruptError; an object larger than a
read of it takes (`Location.read`'s cap) as `TooLarge`, another.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import math
import posixpath
import re
import reprlib
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import fsspec

from .._format import naming as _naming
from .._util import concurrency as _concurrency, stats as _stats
from ..errors import CheckpointLocationError
from .guard import DEFAULT_REQUEST_TIMEOUT_S, RETRIES, Guarded, NotAFileInCheckpoint, TooLarge
from .local import LOCAL_CONCURRENCY, LocalDisk, UnsafeDirectory
from .remote import OBJECT_STORE_CONCURRENCY, OTHER, PROTOCOLS
from .store import Check, Entry, Store

__all__ = ["DEFAULT_REQUEST_TIMEOUT_S", "GROUP_BYTES", "LOCAL_CONCURRENCY", "OBJECT_STORE_CONCURRENCY", "RETRIES",
           "SMALL_BYTES", "Entry", "NotAFileInCheckpoint", "Location", "TooLarge", "redacted_url", "resolve"]

_ONE_SLASH = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):/(?!/)")
REQUEST_TIMEOUT_OPTION = "request_timeout_s"  # zarrckpt's own storage option (not passed to fsspec)
_LATE_TRIES = 8  # creates of an object another writer deletes each time
# The most bytes zarrckpt reads of an object it reads whole, whoever may have written
# it (see docs/reliability.md): a lease, a pin, an array's zarr.json (zarrckpt writes
# them under 4 KiB), and a group's metadata, which lists every array (about 700 bytes
# a leaf: 7 MB at 10,000 leaves, so about 90,000 leaves fit).
SMALL_BYTES = 1 << 20
GROUP_BYTES = 64 << 20

# gcsfs's token modes: not credentials, and too common as words to scrub from messages.
_NOT_SECRETS = frozenset({"anon", "google_default", "cache", "cloud", "browser"})
_SECRET_OPTION = re.compile(r"key|secret|token|password|passwd|credential|session|auth|signature|sas",
                            re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Location:
    """A directory-like place in a store: a checkpoint or a checkpoint dir.

    `url` is what the user gave, with any password in it shown as '***' (used in
    messages); storage options, and the credentials among them, stay in the store and
    are never printed. `below` is the place's key below the store's root (the URL the
    user gave); `child` and `step` keep the store. Every method is one request (or a
    few), through `Guarded.call`.
    """

    url: str
    store: Store = dataclasses.field(repr=False, compare=False)
    guard: Guarded = dataclasses.field(repr=False, compare=False)
    below: str = ""
    # Whether an object found where a save creates one, not its own, is left as it is
    # (`_created`): where a lease guards the place, as a manager's run (see `keeping_found`).
    keep_found: bool = dataclasses.field(default=False, repr=False, compare=False)
    # Whether a write, create or copy asks the store the version it made where its answer
    # names none (`unversioned`: not for a document, whose version nobody keeps).
    learns_versions: bool = dataclasses.field(default=True, repr=False, compare=False)

    @property
    def path(self) -> str:
        """Where this is in its store: a local path, or a path as fsspec spells it."""
        return posixpath.join(self.store.root, self.below) if self.below else self.store.root

    @property
    def is_local(self) -> bool:
        """Whether this is on this machine's own disk."""
        return self.store.local

    @property
    def concurrency(self) -> int:
        """How many requests to keep in flight here by default."""
        return self.store.concurrency

    @property
    def requests_wait(self) -> bool:
        """Whether a request here mostly waits for its answer (a remote store's round
        trip), so that more in flight hide the wait; where not (a local disk's system
        calls, answered from the page cache), threads cost more than they save."""
        return self.store.requests_wait

    def patience(self, nbytes: int = 0) -> float | None:
        """How long a request here moving about `nbytes` may take in all, every retry
        included (`Guarded.patience`), before it is abandoned; None where requests are
        never abandoned (a local disk's system calls run to their end)."""
        return self.guard.patience(nbytes) if self.store.abandons else None

    @property
    def has_directories(self) -> bool:
        """Whether directories here are things of their own, there when empty and
        renamed whole (a local disk); an object store's are prefixes of its objects,
        there while something is below them."""
        return self.store.has_directories

    @property
    def has_links(self) -> bool:
        """Whether a name here may be a symbolic link to another file (`followed`)."""
        return self.store.has_links

    @property
    def can_fill(self) -> bool:
        """Whether the store can fill up, as a disk does (`free_bytes` says how far)."""
        return self.store.can_fill

    @property
    def takes_options(self) -> bool:
        """Whether the store is reached through a client that takes fsspec's storage
        options (credentials, an endpoint); a local disk takes none but
        `request_timeout_s`, zarrckpt's own."""
        return self.store.takes_options

    @property
    def canonical(self) -> str:
        """One name for this place however its URL was spelled, where the store can tell
        (a local path, every symbolic link resolved); else the URL as given. For keys
        of what is known about a place."""
        return self.store.canonical(self.below) or self.url

    @property
    def file_path(self) -> str | None:
        """This place as a path another program on this machine can open (a local
        disk's, absolute); None where it is no file of this machine."""
        return self.store.file_path(self.below)

    def keeping_found(self) -> Location:
        """This location, and every place below it, for a job that holds its lease: an
        object found where a save of it creates one, other than that save's own, may be
        another job's (one that took the run over while this one was paused), so it is
        never deleted (`write_new`, `copy_new`)."""
        return dataclasses.replace(self, keep_found=True)

    def unversioned(self) -> Location:
        """This location, for writes whose version nobody keeps (a save's documents: its
        group's and arrays' metadata, its commit): where the store's answer names no
        version (memory://, an fsspec file system zarrckpt has no protocol for), a write,
        create or copy through it returns None, asking the store nothing more."""
        return dataclasses.replace(self, learns_versions=False)

    def child(self, name: str) -> Location:
        return dataclasses.replace(self, url=posixpath.join(self.url.rstrip("/"), name),
                                   below=posixpath.join(self.below, name) if self.below else name)

    def sibling(self, name: str) -> Location:
        """The place named `name` beside this one, in the same store, rooted there."""
        parent, parent_url = posixpath.dirname(self.path.rstrip("/")), self.url.rstrip("/").rpartition("/")[0]
        return Location(url=posixpath.join(parent_url, name) if parent_url else name,
                        store=self.store.moved(posixpath.join(parent, name)), guard=self.guard)

    def parent(self) -> Location | None:
        """The place this one is directly in, in the same store; None at the store's root
        (the URL the user gave names no parent then)."""
        parent, parent_url = posixpath.dirname(self.path.rstrip("/")), self.url.rstrip("/").rpartition("/")[0]
        if not parent or not parent_url or parent_url.endswith(":/") or parent_url.endswith(":"):
            return None
        return Location(url=parent_url, store=self.store.moved(parent), guard=self.guard)

    def step(self, step: int) -> Location:
        """The directory of `step` in this checkpoint directory (ValueError for a bad step)."""
        return self.child(_naming.step_dir_name(step))

    def _key(self, key: str | None) -> str:
        return posixpath.join(self.below, key) if key and self.below else key or self.below

    def _call(self, action: str, key: str | None, method: Any, *args: Any, nbytes: int = 0, **kwargs: Any) -> Any:
        where = self.url if key is None else f"{self.url.rstrip('/')}/{key}"
        return self.guard.call(action, where, method, self._key(key), *args, nbytes=nbytes, **kwargs)

    def list_dir(self, key: str = "", *, missing_ok: bool = True) -> list[Entry]:
        """The entries directly below `key`, by name: files, directories, and (on a local
        disk) symbolic links, never followed; empty if the directory does not exist
        (FileNotFoundError without `missing_ok`).

        One listing request on an object store. Never answered from fsspec's listing
        cache: other processes add and remove steps.
        """
        try:
            return self._call("list", key or None, self.store.list_dir)
        except (FileNotFoundError, NotADirectoryError):
            if missing_ok:
                return []
            raise

    def walk(self, *, empty_directories: bool = False) -> list[Entry]:
        """Every object below this location at any depth, by key relative to it (on a
        local disk, symbolic links as `link` entries, never followed); with
        `empty_directories`, on a local disk, each directory that holds nothing too (a
        `dir` entry)."""
        try:
            return self._call("list", None, self.store.walk, empty_directories=empty_directories)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def write(self, key: str, *parts: Any, atomic: bool = False, durable: bool = False) -> str | None:
        """Writes the object `key`, the concatenation of the bytes-like `parts`, below
        this location, creating directories as needed.

        With `atomic`, a reader sees either the old object or the whole new one: a
        local file is written aside and renamed over; an object store PUT already is
        (see docs/pytree-zarr-checkpoint.md, Commit). With `durable`, the object is on
        stable storage when this returns, and so is every directory entry leading to it
        (on a local disk see `local`; a store that acknowledged a PUT has it).
        Returns the version of the object made (see `Entry.version`: a local file's; on
        S3 and GCS from the answer to the request; elsewhere asked of the store at once,
        except `unversioned`), None where the store says none; so do `write_new` and
        `copy_new`.
        """
        nbytes = sum(memoryview(p).nbytes for p in parts)
        _stats.add("store_bytes_written", nbytes)
        return self._versioned(key, self._call("write", key, self.store.write, parts, atomic=atomic, durable=durable,
                                               nbytes=nbytes))

    def create(self, key: str, *parts: Any) -> str | None:
        """Writes the object `key` (the concatenation of `parts`), durably, only if
        nothing is there: FileExistsError if something is. Of two creates of one key,
        from any processes, at most one succeeds where `exclusive` is true (a local disk:
        a hard link; S3: If-None-Match; GCS: ifGenerationMatch=0). A create retried after
        its first attempt landed unseen finds its own object: compare the content.
        Returns the version made, as `write`."""
        nbytes = sum(memoryview(p).nbytes for p in parts)
        _stats.add("store_bytes_written", nbytes)
        return self._versioned(key, self._call("write", key, self.store.create, parts, nbytes=nbytes))

    def _versioned(self, key: str, made: str | None) -> str | None:
        """The version of the object `key` that a write, create or copy just made, as
        its store's call returned it (`made`): that, where the store says the version of
        what it makes (a local disk, S3, GCS), or `unversioned`; else asked of the store
        (one request). None where it says none."""
        if made is not None or self.store.says_versions or not self.learns_versions:
            return made
        return self._call("check", key, self.store.version)

    @property
    def exclusive(self) -> bool:
        """Whether `create` here is exclusive against writers in other processes (as far
        as `probe` found the store to honour the condition it is sent)."""
        return self.store.exclusive

    def probe(self, key: str) -> None:
        """Finds out, once per store (its endpoint and bucket) in this process, whether the
        store honours the conditions it is trusted to check (S3, GCS): a create of an
        object below `key` made twice, the second of which it must refuse; and, where
        unchanged chunks are copied inside the store, a copy of that object from a
        version it is not, which it must refuse too. The objects are deleted. A store
        found to ignore the first is one without an exclusive `create` from then on
        (`exclusive` false: the lease is taken otherwise, and no save relies on creates
        failing); one found to ignore the second gets `copy_new`'s bytes through this
        process, its source looked at once the copy is made. `key` is a place of the
        caller's own (a run's lease area): nothing else is written."""
        self._call("write", key, self.store.probe)

    @property
    def needs_probe(self) -> bool:
        """Whether `probe` asks the store anything (S3, GCS): where it does, every process
        of a job asks, so that all of them write and copy alike."""
        return self.store.needs_probe

    @property
    def lands_late(self) -> bool:
        """Whether a request abandoned here (at its deadline) may still be applied later
        (every remote store)."""
        return self.store.late

    @property
    def late_safe(self) -> bool:
        """Whether a request abandoned here (at its deadline) may still be applied later,
        and `create` is exclusive (S3, GCS): saves and copies here then follow the
        protocol against late requests (`write_new`, `_commit.write_marker`)."""
        return self.store.late and self.store.exclusive

    def write_new(self, key: str, *parts: Any, atomic: bool = False) -> str | None:
        """Writes the object `key`, which the save or copy in progress makes (a chunk, an
        array's or the group's metadata), durably.

        Where requests may land late and `create` is exclusive (S3, GCS), it is created
        only if absent, so that no request of this or an earlier save that lands later
        can change it: an object found there that is not these bytes (such a request
        that landed before, or another writer's) is deleted and the object made again,
        or, `keeping_found`, left as it is, and FileExistsError raised. Elsewhere it is
        a `write` (`atomic` as there)."""
        if not self.late_safe:
            return self.write(key, *parts, atomic=atomic, durable=True)
        return self._created(key, lambda: self.create(key, *parts),
                             lambda: b"".join(memoryview(p).cast("B") for p in parts))

    @contextlib.contextmanager
    def write_batch(self) -> Iterator[Location]:
        """This location, for writes made together (one save's chunks and array
        documents): a `durable` write through it is on stable storage when the block
        ends, not always when its call returns. On a local disk each directory is
        opened from its parent, most kept open, and a file system that can be synced
        whole safely is synced once at the end instead of file by file
        (`local.WriteBatch`); elsewhere it changes nothing. Leaving the block by an
        exception leaves what was written unsynced."""
        with self.store.write_batch() as store:
            yield dataclasses.replace(self, store=store)

    def copy_new(self, key: str, source: Location, *, nbytes: int, expect: str) -> str | None:
        """Makes the object `key`, which the save in progress makes (a chunk that has not
        changed), durably what the object `key` of `source` is (a committed step of the
        same store), its `nbytes` passing through no process where the store can copy
        them itself: a hard link on a local disk (a copy inside the kernel where links
        cannot be made), CopyObject on S3, a rewrite on GCS. Only from the version
        `expect` of that object (`Entry.version`): SourceChanged if it is not, checked
        by the store in the copy's own request on S3 and GCS, on the link made on a
        local disk, once the copy is made elsewhere.

        Where requests may land late (as `write_new`), it is created only if absent: an
        object found there that is not the source's bytes is treated as `write_new`
        treats one."""
        if source.guard is not self.guard or source.store.root != self.store.root:
            raise ValueError(f"{source.url} is not in the store of {self.url}: a chunk is copied within one store")
        _stats.add("store_bytes_copied", nbytes)
        made = functools.partial(self._call, "write", key, self.store.copy, source._key(key), size=nbytes,
                                 expect=expect, nbytes=nbytes)
        if not self.late_safe:
            return self._versioned(key, made(exclusive=False))
        return self._created(key, lambda: self._versioned(key, made(exclusive=True)),
                             lambda: source.read(key, limit=nbytes + 1))

    def _created(self, key: str, create: Callable[[], str | None], meant: Callable[[], bytes]) -> str | None:
        """Makes `key` by `create` (exclusive), against requests that land late: where an
        object is there already, and holds the bytes `meant()` gives, it is an earlier
        attempt of this one that landed unseen (whose version is then not known: None).
        One that does not is a request of an earlier save that landed late (deleted, and
        the object made again) or, where a lease guards the place (`keep_found`), may be
        another job's (one that took the run over while this one was paused): left as it
        is, FileExistsError naming it. Returns the version `create` returned."""
        for _ in range(_LATE_TRIES):
            try:
                return create()
            except FileExistsError:
                expected = meant()
                try:  # one byte past what is meant: a larger object is another
                    if self.read(key, limit=len(expected) + 1) == expected:
                        return None
                except FileNotFoundError:
                    continue  # deleted since: made again
                if not self.keep_found:
                    self.remove_file(key)
                    continue
                raise FileExistsError(
                    f"cannot write {self.url.rstrip('/')}/{key}: another writer made it meanwhile (a job that took "
                    "the run over while this one was paused, or a request of an earlier save of this step that "
                    "landed late); left as it is, nothing committed") from None
        raise OSError(f"cannot write {self.url.rstrip('/')}/{key}: it keeps being made and deleted by another "
                      f"writer (tried {_LATE_TRIES} times)")

    def read(self, key: str, *, limit: int | None = None, cap: int | None = SMALL_BYTES,
             check: Check | None = None) -> bytes:
        """The whole object `key` below this location, in one request (two, hedged, where
        one is slow: see `hedge`; `check` says what is wrong with an answer, so that a
        good one wins); FileNotFoundError if absent.

        At most `cap` bytes (SMALL_BYTES; GROUP_BYTES for a group's metadata): TooLarge,
        naming the object and the cap, for a larger object, of which no more than `cap`
        + 1 bytes were read (none on a local disk). `cap=None` only for an object whose
        size the caller bounds itself (a chunk). With `limit`, its first `limit` bytes
        instead (`cap` unused)."""
        data: bytes = self._call("read", key, self.store.read, limit, most=cap if limit is None else None,
                                 nbytes=limit or 0, check=check)
        _stats.add("store_bytes_read", len(data))
        return data

    def holds(self, key: str, *parts: Any) -> bool:
        """Whether the object `key` is there and is exactly the bytes of `parts`, one
        after the other (reading no more than one byte past them; compared in place,
        never joined)."""
        views = [memoryview(part).cast("B") for part in parts]
        try:
            held = self.read(key, limit=sum(view.nbytes for view in views) + 1)
        except FileNotFoundError:
            return False
        offset = 0
        for view in views:
            if not held.startswith(view, offset):
                return False
            offset += view.nbytes
        return offset == len(held)

    def read_if_present(self, keys: Sequence[str], *, cap: int = SMALL_BYTES) -> list[bytes | None]:
        """Several small objects, None for each that is absent: one round trip, as the
        requests go out together. `cap`: as for `read`."""
        def attempt(key: str) -> bytes | None:
            try:
                return self.read(key, cap=cap)
            except FileNotFoundError:
                return None

        return _concurrency.run_all(attempt, keys, len(keys) if self.requests_wait else 1)

    def read_into(self, key: str, *buffers: memoryview, check: Check | None = None) -> int:
        """Reads object `key` into `buffers`, filling each in turn (as far as the object
        goes); returns the object's size. `check`: as for `read`.

        Local files are read straight into the buffers, with no intermediate copy: on
        restore the first buffer is the new array's memory.
        """
        size, done = self._call("read", key, self.store.read_into, buffers, nbytes=sum(map(len, buffers)),
                                check=check)
        _stats.add("store_bytes_read", done)
        return size

    def read_range(self, key: str, start: int, buffer: memoryview) -> int:
        """Reads object `key` from byte `start` into `buffer` (one request), as far as the
        object goes; returns the bytes read. FileNotFoundError if absent."""
        done: int = self._call("read", key, self.store.read_range, start, buffer, nbytes=len(buffer))
        _stats.add("store_bytes_read", done)
        return done

    def exists(self) -> bool:
        """Whether anything is here. Never answered from fsspec's listing cache."""
        return bool(self._call("check", None, self.store.exists))

    def remove_file(self, name: str) -> None:
        """Deletes one object if it is there (one request)."""
        try:
            self._call("delete", name, self.store.remove_file)
        except FileNotFoundError:
            pass

    def remove_tree(self) -> None:
        """Deletes everything below this location, if anything (on a local disk, a link
        inside is deleted itself, never followed)."""
        try:
            self._call("delete", None, self.store.remove_tree)
        except FileNotFoundError:
            pass

    def missing_bucket(self) -> str | None:
        """The bucket this is in, if the store has buckets and this one does not exist
        (one request); else None. A missing bucket is a wrong URL, where a missing
        directory is a run not started yet."""
        bucket = self.store.bucket()
        if bucket is None:
            return None
        scheme = self.url.split("://", 1)[0]
        there = Location(url=f"{scheme}://{bucket}", store=self.store.moved(bucket), guard=self.guard)
        return None if there.exists() else bucket

    def place(self) -> tuple[str, str]:
        """Where this really is: its store's identity, and its path with every other
        spelling undone (`a/./b`, `a//b`, `a/x/../b`; on a local disk, symbolic links
        in the path too), to tell whether two Locations overlap."""
        return self.store.place(self.below)

    def make_private(self, what: str, option: str) -> None:
        """Makes this a directory that only this user can change, on this machine's own
        disk (see `local.private_directory`); else CheckpointLocationError saying what
        to do, `what` naming the place as the user gave it and `option` the argument."""
        try:
            self.store.private_directory(self.below)
        except UnsafeDirectory as e:
            raise CheckpointLocationError(
                f"{what} is not safe to restore from: {e.strerror}. Another user could plant or swap the copies "
                f"this job restores. Give a {option} that is yours alone (zarrckpt creates it with mode 0700), or "
                "make it so (chown it to this user, chmod 700)") from None

    def free_bytes(self) -> int:
        """The bytes free on the disk this is on (this machine's own)."""
        return self.store.free_bytes(self.below)

    def followed(self, names: Sequence[str]) -> tuple[Location, dict[str, str], dict[str, int]]:
        """Where the files `names` of this folder on this machine's disk really are, every
        symbolic link on the way followed: their common folder, each one's key there and
        its size. Only for files a user named that are no checkpoint (a Hugging Face
        cache's snapshots link into its blobs): a checkpoint is never read through a
        link. FileNotFoundError (its filename: the name) for a link to nothing."""
        root, keys, sizes = self.store.followed(self.below, names)
        return Location(url=root, store=self.store.moved(root), guard=self.guard), keys, sizes

    def redact(self, text: str) -> str:
        """`text` with every credential of this store replaced by '***'."""
        return self.guard.redact(text)


def resolve(url: str, storage_options: dict[str, Any] | None = None, *, option: str = "storage_options") -> Location:
    """A Location for a local path or any fsspec URL (file://, memory://, s3://, gs://...).

    `storage_options` go to fsspec, but for `request_timeout_s` (zarrckpt's: how long a
    request may take before it is abandoned, see `guard`), the only one a local path
    takes. Raises ValueError or TypeError naming what is wrong with the URL or an option
    (the options by `option`, the caller's keyword for them); ImportError naming the
    extra to install where the URL's client is missing (`zarrckpt[s3]`, `zarrckpt[gcs]`).
    """
    if not isinstance(url, str) or not url:
        raise ValueError(f"checkpoint URL must be a non-empty string, got {reprlib.repr(url)}")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(f"{option} must be a dict of fsspec options, got {type(storage_options).__name__}")
    if (one := _ONE_SLASH.match(url)) and one.group(1).lower() in fsspec.available_protocols() and \
            one.group(1).lower() not in ("file", "local"):  # else `gs:/bucket/run` is the local ./gs:/bucket/run
        raise ValueError(f"checkpoint URL {url!r:.300} has one slash after '{one.group(1)}:': write "
                         f"{one.group(1) + '://' + url[len(one.group(0)):]!r:.300}")
    given = dict(storage_options or {})
    request_timeout_s = _request_timeout(given.pop(REQUEST_TIMEOUT_OPTION, DEFAULT_REQUEST_TIMEOUT_S), option)
    scheme = fsspec.core.split_protocol(url)[0] or "file"
    protocol = PROTOCOLS.get(scheme, OTHER)
    options = _merged(protocol.option_defaults, given)
    shown, password = redacted_url(url)
    try:
        fs, path = _url_to_fs(url, tuple(sorted(options.items(), key=lambda kv: kv[0])))
    except ImportError as e:  # fsspec's words name a package, not the release zarrckpt needs
        install = f"pip install 'zarrckpt[{protocol.extra}]'" if protocol.extra else "install it"
        raise ImportError(f"{shown!r:.300} needs fsspec's client for {scheme}://, which is not installed "
                          f"({e}): {install}") from None
    path = path.rstrip("/") or path
    store: Store
    if "file" in ((fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol):
        if given:  # zarrckpt reads and writes a local disk itself: they would do nothing, silently
            raise ValueError(f"{option} {sorted(given)!r:.300} do nothing for the local path {shown!r:.300}: "
                             f"they are fsspec's options for object stores (s3://, gs://); only "
                             f"{REQUEST_TIMEOUT_OPTION!r} applies here")
        store = LocalDisk(path)
    else:
        endpoint = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
        store = protocol.kind(fs, path, protocol, _taken(fs, protocol.read_options), endpoint)
    return Location(url=shown.rstrip("/") or shown, store=store,
                    guard=Guarded(request_timeout_s, _secrets(given, password)))


def takes_options(url: str) -> bool:
    """Whether the store `url` names takes fsspec's storage options (see
    `Location.takes_options`): every URL but a local path's (no scheme, or file://)."""
    return not _is_local_url(url)


def _is_local_url(url: str) -> bool:
    """Whether `url` names a local path (no scheme, or file://)."""
    return (fsspec.core.split_protocol(url)[0] or "file") in ("file", "local")


def _request_timeout(value: Any, option: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{option}[{REQUEST_TIMEOUT_OPTION!r}] must be a number of seconds above 0, got "
                         f"{value!r}")
    return float(value)


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
    """The user's `options` over zarrckpt's `defaults`, an option given whole winning
    whole: in a dict of options such as `config_kwargs`, each entry the user gives (a
    `retries` dict of their own) replaces zarrckpt's, and the others stay."""
    merged = dict(options)
    for name, default in defaults.items():
        given = merged.get(name)
        if isinstance(default, Mapping) and (given is None or isinstance(given, Mapping)):
            merged[name] = {**copy.deepcopy(default), **(given or {})}  # a copy: clients may change what they get
        elif given is None:
            merged[name] = copy.deepcopy(default)
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
    if _is_local_url(url):
        # A relative path names what it names now: after `os.chdir`, the same spelling is
        # another directory (another job's run), so it is never a key of the cache.
        return fsspec.core.url_to_fs(url, **dict(options))
    try:
        return _cached_url_to_fs(url, options)
    except TypeError:  # unhashable storage option values: skip the cache
        return fsspec.core.url_to_fs(url, **dict(options))


@functools.lru_cache(maxsize=64)
def _cached_url_to_fs(url: str, options: tuple[tuple[str, Any], ...]) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(url, **dict(options))
