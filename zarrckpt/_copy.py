"""Copying one checkpoint between any two URLs (local, s3://, gs://...), commit last.

The copy follows the save protocol: first the group metadata without the commit
marker, then every other object as it is stored, concurrently, and last the object
holding the commit marker (`zarr.json`, or `.zattrs` in seqax's layout). So a copy
cut short is an uncommitted checkpoint, which readers skip and the next copy or
save replaces, never a committed one with holes (Orbax #394: copies made without
their commit file).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable

from . import _commit, _concurrency, _naming, _progress, _reader, _storage, _zarrjson
from ._storage import Location
from .errors import CheckpointError, CheckpointWriteError


@dataclasses.dataclass(frozen=True)
class CopyResult:
    """What `copy_checkpoint` copied."""

    source: str
    destination: str
    objects: int
    nbytes: int
    seconds: float


def copy_checkpoint(
    src: str,
    dst: str,
    *,
    src_storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    allow_uncommitted: bool = False,
    max_workers: int | None = None,
    max_inflight_bytes: int = _concurrency.DEFAULT_MAX_INFLIGHT_BYTES,
    progress: bool | None = None,
) -> CopyResult:
    """Copies the checkpoint at `src` to `dst`, writing the commit marker last. Not collective.

    Args:
      src, dst: local paths or fsspec URLs of one checkpoint each (not of a directory
        of steps: give the step's URL, e.g. `.../0000000100`).
      src_storage_options, dst_storage_options: passed to fsspec for each side.
      overwrite: replace a committed checkpoint at `dst` (removed commit marker first).
      allow_uncommitted: copy an uncommitted source too; the copy is uncommitted.
      max_workers: objects copied at once (default: the larger of the two stores'
        concurrency, e.g. 128 when either is an object store).
      max_inflight_bytes: bound on bytes read and not yet written.
      progress: show a progress bar (default: when stderr is a terminal).

    Raises:
      CheckpointNotFoundError: no checkpoint at `src`, or it is not committed and
        `allow_uncommitted` is False.
      CheckpointExistsError: `dst` holds a committed checkpoint and `overwrite` is
        False, or `dst` holds something that is not a checkpoint (never deleted).
      CheckpointWriteError: an object could not be copied; `dst` is left uncommitted.
      CheckpointError: `src` changed during the copy; `dst` is left uncommitted.
      ValueError: `src` and `dst` are the same place, or one lies inside the other.
    """
    started = time.perf_counter()
    source = _storage.resolve(src, src_storage_options)
    target = _storage.resolve(dst, dst_storage_options)
    _check_apart(source, target)
    ckpt = _reader.open_checkpoint(source, require_committed=not allow_uncommitted)
    marker_key = "zarr.json" if ckpt.layout == "zarrckpt" else ".zattrs"
    marker = source.read(marker_key)
    first_key, first = _uncommitted_group(source, marker_key, marker)
    objects = {key: size for key, size in source.sizes(recursive=True).items() if key not in (marker_key, first_key)}
    _commit.make_way(target, overwrite=overwrite)
    total = sum(objects.values()) + len(marker)
    with _progress.bar(f"copying to {target.url}", total, progress) as advance:
        target.write(first_key, first, atomic=True)
        try:
            _copy_all(source, target, objects, max_workers or max(source.concurrency, target.concurrency),
                      _concurrency.ByteBudget(max_inflight_bytes), advance)
        except Exception as e:
            raise CheckpointWriteError(f"copying {source.url} to {target.url} failed; {target.url} holds an "
                                       f"uncommitted partial copy: {e}") from e
        if source.read(marker_key) != marker:
            raise CheckpointError(f"{source.url} changed while it was being copied (overwritten or deleted); "
                                  f"{target.url} holds an uncommitted partial copy")
        target.write(marker_key, marker, atomic=True)
        advance(len(marker))
    return CopyResult(source.url, target.url, len(objects) + len({first_key, marker_key}), total,
                      time.perf_counter() - started)


def _check_apart(source: Location, target: Location) -> None:
    if source.fs != target.fs:
        return
    a, b = source.path.rstrip("/"), target.path.rstrip("/")
    if a == b or b.startswith(a + "/") or a.startswith(b + "/"):
        raise ValueError(f"cannot copy {source.url} to {target.url}: one is the other or lies inside it")


def _uncommitted_group(source: Location, marker_key: str, marker: bytes) -> tuple[str, bytes]:
    """The key and bytes of the group metadata that marks the copy in progress as an
    uncommitted checkpoint: `zarr.json` without the marker, or seqax's `.zgroup`."""
    if marker_key == ".zattrs":
        return ".zgroup", source.read(".zgroup")
    document = json.loads(marker)
    document["attributes"] = {k: v for k, v in document["attributes"].items() if k != _naming.COMMIT_ATTR}
    return "zarr.json", _zarrjson.encode_document(document)


def _copy_all(source: Location, target: Location, objects: dict[str, int], workers: int,
              budget: _concurrency.ByteBudget, advance: Callable[[int], None]) -> None:
    """Copies `objects` concurrently, at most `budget` bytes in memory; stops at the
    first failure and raises it (see `_concurrency`)."""
    with _concurrency.Operation(workers, "copy") as op:
        op.fan_out(sorted(objects), lambda key: target.write(key, source.read(key)), budget=budget,
                   nbytes=objects.__getitem__, on_done=lambda key, _: advance(objects[key]))
