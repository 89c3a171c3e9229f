"""URLs -> Locations: the few storage operations zarrckpt needs, on any fsspec URL.

Local paths and file:// URLs are read and written with plain file calls (chunks go
straight between files and array memory); every other protocol goes through fsspec.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import posixpath
import uuid
from typing import Any

import fsspec
import zarr
import zarr.storage

from .errors import CheckpointCorruptError

LOCAL_CONCURRENCY = 8
REMOTE_CONCURRENCY = 64
# Keys that hold metadata; any other key zarr asks for is a chunk.
_METADATA_KEYS = frozenset({"zarr.json", ".zgroup", ".zattrs", ".zarray", ".zmetadata"})


@dataclasses.dataclass(frozen=True)
class Location:
    """A directory-like place on some file system: a checkpoint or a checkpoint dir.

    `url` is what the user gave (used in messages; storage options and their
    credentials are kept apart and never printed).
    """

    url: str
    fs: fsspec.AbstractFileSystem = dataclasses.field(repr=False)
    path: str
    storage_options: dict[str, Any] = dataclasses.field(repr=False, compare=False)

    @property
    def is_local(self) -> bool:
        return "file" in _protocols(self.fs)

    @property
    def concurrency(self) -> int:
        """How many requests to keep in flight here by default: a local disk is busy
        with a few, an object store answers each in tens of milliseconds."""
        return LOCAL_CONCURRENCY if self.is_local else REMOTE_CONCURRENCY

    def child(self, name: str) -> "Location":
        return dataclasses.replace(
            self, url=posixpath.join(self.url.rstrip("/"), name), path=posixpath.join(self.path, name)
        )

    def zarr_store(self) -> zarr.abc.store.Store:
        """A read-only zarr store rooted here that raises on a missing chunk (zarr
        itself reads only seqax's layout; zarrckpt's own is read directly)."""
        if self.is_local:
            store: zarr.abc.store.Store = zarr.storage.LocalStore(self.path, read_only=True)
        else:
            store = zarr.storage.FsspecStore.from_url(
                self.url, storage_options=dict(self.storage_options) or None, read_only=True
            )
        return _StrictStore(store, self.url)

    def list_dir(self) -> list[str]:
        """Names of the entries directly below; empty if the directory does not exist."""
        try:
            entries = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    def write(self, key: str, data: bytes | memoryview, *, atomic: bool = False) -> None:
        """Writes the object `key` below this location, creating directories as needed.

        With `atomic`, a reader sees either the old object or the whole new one: a
        local file is written aside and renamed over; an object store PUT already is.
        """
        path = posixpath.join(self.path, key)
        if not self.is_local:
            self.fs.pipe_file(path, bytes(data))
            return
        target = f"{path}.{uuid.uuid4().hex}.tmp" if atomic else path
        try:
            f = open(target, "wb")
        except FileNotFoundError:  # first object in its directory; most writes skip this
            os.makedirs(os.path.dirname(path), exist_ok=True)
            f = open(target, "wb")
        with f:
            f.write(data)
        if atomic:
            os.replace(target, path)

    def read(self, key: str) -> bytes:
        """The whole object `key` below this location; FileNotFoundError if absent."""
        return self.fs.cat_file(posixpath.join(self.path, key))

    def read_into(self, key: str, buffer: memoryview) -> int:
        """Reads object `key` into `buffer` (up to its length); returns the object's size.

        Local files are read straight into the buffer, with no intermediate copy: on
        restore the buffer is the new array's memory.
        """
        if not self.is_local:
            data = self.read(key)
            buffer[: len(data)] = data[: len(buffer)]
            return len(data)
        with open(posixpath.join(self.path, key), "rb", buffering=0) as f:
            done = 0
            while done < len(buffer):
                n = f.readinto(buffer[done:])
                if not n:
                    break
                done += n
            return os.fstat(f.fileno()).st_size

    def exists(self) -> bool:
        return bool(self.fs.exists(self.path))

    def remove_file(self, name: str) -> None:
        path = posixpath.join(self.path, name)
        if self.fs.exists(path):
            self.fs.rm(path)

    def remove_tree(self) -> None:
        if self.fs.exists(self.path):
            self.fs.rm(self.path, recursive=True)
        self.fs.invalidate_cache(self.path)


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def resolve(url: str, storage_options: dict[str, Any] | None = None) -> Location:
    """A Location for a local path or any fsspec URL (file://, memory://, s3://, gs://...)."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"checkpoint URL must be a non-empty string, got {url!r}")
    options = dict(storage_options or {})
    fs, path = _url_to_fs(url, tuple(sorted(options.items(), key=lambda kv: kv[0])))
    return Location(url=url.rstrip("/") or url, fs=fs, path=path.rstrip("/") or path, storage_options=options)


def _url_to_fs(url: str, options: tuple[tuple[str, Any], ...]) -> tuple[fsspec.AbstractFileSystem, str]:
    try:
        return _cached_url_to_fs(url, options)
    except TypeError:  # unhashable storage option values: skip the cache
        return fsspec.core.url_to_fs(url, **dict(options))


@functools.lru_cache(maxsize=64)
def _cached_url_to_fs(url: str, options: tuple[tuple[str, Any], ...]) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(url, **dict(options))


class _StrictStore(zarr.storage.WrapperStore):
    """Raises on a missing chunk instead of letting zarr return fill values.

    zarrckpt writes every chunk, so in a committed checkpoint an absent chunk is
    damage, never "all zeros". One wrapper does this for every zarr version (zarr
    3.1 has no setting for it).
    """

    def __init__(self, store: zarr.abc.store.Store, url: str) -> None:
        super().__init__(store)
        self._url = url

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        value = await super().get(key, prototype, byte_range)
        if value is None and posixpath.basename(key) not in _METADATA_KEYS:
            raise CheckpointCorruptError(f"chunk {key!r} is missing from checkpoint {self._url}")
        return value
