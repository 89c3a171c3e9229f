"""Copying one checkpoint between any two URLs (local, s3://, gs://...), commit last.

The copy follows the save protocol: first the group metadata without the commit
marker, then every other object the checkpoint records (see `_objects`: nothing else
under the source is read), concurrently, the arrays' metadata before their chunks, each
checked as it goes (a zarrckpt chunk's size and CRC-32C), and last the object holding
the commit marker (`zarr.json`, or `.zattrs` in seqax's layout), once the source is
found unchanged (the same save) and every object is on stable storage. So a copy cut
short, of a damaged source, or of a source overwritten meanwhile is an uncommitted
checkpoint, which readers skip and the next copy or save replaces, never a committed
one with holes or parts of two saves.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from . import _commit, _deprecated, _objects, _seqax, _storage
from ._format import naming as _naming, zarrjson as _zarrjson
from ._format.chunks import DamagedChunk
from ._restore import checkpoint as _reader
from ._run import lease as _lease
from ._storage import Location
from ._util import concurrency as _concurrency, progress as _progress
from .errors import CheckpointCorruptError, CheckpointNotFoundError, CheckpointWriteError

_MARKERS = ("zarr.json", _seqax.MARKER)  # where the commit marker is: zarrckpt's layout, seqax's
_ARRAY_METADATA = ("zarr.json", _seqax.ARRAY, _seqax.MARKER)  # an array's, in either layout

@dataclasses.dataclass(frozen=True)
class CopyResult:
    """What `copy_checkpoint` copied: from `source` to `url`, its objects (files, the
    metadata's too) and bytes, in `seconds`. `destination` is a deprecated alias of
    `url` (DeprecationWarning)."""

    source: str
    url: str
    objects: int
    nbytes: int
    seconds: float

    destination = _deprecated.renamed("url", "destination", "CopyResult")


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
      overwrite: replace a committed checkpoint at `dst` (its commit marker is
        removed first).
      allow_uncommitted: copy an uncommitted source too; the copy is uncommitted.
      max_workers: objects copied at once (default: the larger of the two stores'
        concurrency, e.g. 128 when either is an object store).
      max_inflight_bytes: bound on bytes read and not yet written.
      progress: show a progress bar (default: when stderr is a terminal).

    Returns:
      A `CopyResult`.

    Raises:
      CheckpointNotFoundError: no checkpoint at `src`, or it is not committed and
        `allow_uncommitted` is False, or it was replaced or deleted during the copy
        (`dst` is left uncommitted).
      CheckpointCorruptError: an object of `src` is missing or damaged (named); `dst`
        is left uncommitted.
      CheckpointExistsError: `dst` holds a committed checkpoint and `overwrite` is
        False, or `dst` holds something that is no checkpoint's (never deleted).
      DirectoryInUseError: `dst` is a step of a directory a live job's manager holds.
      CheckpointWriteError: an object could not be copied; `dst` is left uncommitted.
      ValueError: `src` and `dst` are the same place (however spelled), or one lies
        inside the other.
    """
    started = time.perf_counter()
    source = _storage.resolve(src, src_storage_options, option="src_storage_options")
    target = _storage.resolve(dst, dst_storage_options, option="dst_storage_options")
    _check_apart(source, target)
    # The commit marker's object is read once: the copy ends with these very bytes.
    marker_key, marker = next(((key, raw) for key, raw in zip(
        _MARKERS, source.read_if_present(_MARKERS, cap=_storage.GROUP_BYTES)) if raw is not None), (_MARKERS[0], None))
    group = None if marker is None else _commit.parse_group(marker_key, marker)
    try:
        ckpt = _reader.open_checkpoint(source, require_committed=not allow_uncommitted, group=group)
    except CheckpointNotFoundError as e:
        if group is not None and group.state is _commit.State.UNCOMMITTED:
            raise CheckpointNotFoundError(f"{e}; pass allow_uncommitted=True to copy it as it is") from None
        raise
    marker = marker if marker is not None else source.read(marker_key, cap=_storage.GROUP_BYTES)
    first_key, first = _uncommitted_group(source, marker_key, marker)
    found = _objects.inventory(ckpt)
    if found.missing:
        _check_unchanged(ckpt, marker_key, marker)
        raise _reader.MissingObject(f"{found.some_missing[0]!r} is missing from checkpoint {source.url}" + (
            f" ({found.missing:,} objects it records are missing)" if found.missing > 1 else "") + "; nothing copied")
    objects = [o for o in found.owned if o.key not in (marker_key, first_key)]
    _lease.refuse_if_held(target, "zarrckpt cp")
    _objects.make_way(target, overwrite=overwrite)
    total = sum(o.nbytes for o in objects) + len(marker)
    with _progress.bar(f"copying to {target.url}", total, progress) as advance:
        if not target.late_safe:  # else the commit alone is written (see `_commit.write_marker`)
            target.write(first_key, first, atomic=True, durable=True)
        try:
            # Every array's metadata before any chunk: a copy cut short leaves no chunk
            # without its array's (what tells seqax's keys from someone's numbered
            # files, see `_objects.not_ours`).
            metadata = [o for o in objects if _is_array_metadata(o.key)]
            for batch in (metadata, [o for o in objects if not _is_array_metadata(o.key)]):
                _copy_all(source, target, batch, max_workers or max(source.concurrency, target.concurrency),
                          _concurrency.ByteBudget(max_inflight_bytes), advance)
            if target.late_safe and first_key != marker_key:  # seqax's `.zgroup`, not written first there
                target.write_new(first_key, first)
        except CheckpointCorruptError as e:  # the source's damage, named as the public class, not the reader's own
            _check_unchanged(ckpt, marker_key, marker, target)
            raise CheckpointCorruptError(f"{e}; not copied: {target.url} holds an uncommitted partial copy") from None
        except Exception as e:
            raise CheckpointWriteError(f"copying {source.url} to {target.url} failed; {target.url} holds an "
                                       f"uncommitted partial copy: {e}") from e
        _check_unchanged(ckpt, marker_key, marker, target)
        _commit.write_marker(target, marker_key, marker)
        advance(len(marker))
    return CopyResult(source.url, target.url, len(objects) + len({first_key, marker_key}), total,
                      time.perf_counter() - started)


def _is_array_metadata(key: str) -> bool:
    return key.rsplit("/", 1)[-1] in _ARRAY_METADATA


def _check_apart(source: Location, target: Location) -> None:
    (store_a, a), (store_b, b) = source.place(), target.place()
    if store_a == store_b and (a == b or b.startswith(a.rstrip("/") + "/") or a.startswith(b.rstrip("/") + "/")):
        raise ValueError(f"cannot copy {source.url} to {target.url}: one is the other or lies inside it")


def _check_unchanged(ckpt: _reader.Checkpoint, marker_key: str, marker: bytes, target: Location | None = None
                     ) -> None:
    """Raises CheckpointNotFoundError if the source is no longer the save being copied
    (naming the partial copy at `target`, if one was begun)."""
    if ckpt.save_id is not None:
        now = _commit.head(ckpt.loc)
        same = now.save_id == ckpt.save_id and (now.state is _commit.State.COMMITTED or not ckpt.committed)
    else:  # seqax's layout, or a checkpoint written before save identities
        same = ckpt.loc.holds(marker_key, marker)
    if not same:
        partial = "nothing copied" if target is None else f"{target.url} holds an uncommitted partial copy"
        raise CheckpointNotFoundError(f"{ckpt.loc.url} was replaced or deleted while being copied; {partial}")


def _uncommitted_group(source: Location, marker_key: str, marker: bytes) -> tuple[str, bytes]:
    """The key and bytes of the group metadata that marks the copy in progress as an
    uncommitted checkpoint: `zarr.json` without the marker, or seqax's `.zgroup`."""
    if marker_key == _seqax.MARKER:
        return _seqax.GROUP, source.read(_seqax.GROUP, cap=_storage.GROUP_BYTES)
    document = _zarrjson.decode(marker)
    document["attributes"] = {k: v for k, v in document["attributes"].items() if k != _naming.COMMIT_ATTR}
    return "zarr.json", _zarrjson.encode_document(document)


def _copy_all(source: Location, target: Location, objects: list[_objects.Owned], workers: int,
              budget: _concurrency.ByteBudget, advance: Callable[[int], None]) -> None:
    """Copies `objects` concurrently, durably, at most `budget` bytes in memory, checking
    each chunk it can; stops at the first failure and raises it (see `_concurrency`)."""
    def copy(obj: _objects.Owned) -> None:
        try:
            # A chunk is read no further than it can hold (then its codec finds it damaged),
            # an array's metadata no further than any array's (else TooLarge: damage).
            data = source.read(obj.key, limit=obj.nbytes + 1, check=obj.codec.damage) if obj.codec is not None \
                else source.read(obj.key, cap=_storage.SMALL_BYTES if _is_array_metadata(obj.key) else None)
        except FileNotFoundError:
            raise _reader.MissingObject(f"{obj.key!r} is missing from checkpoint {source.url}") from None
        if obj.codec is not None and (damage := obj.codec.damage(data)) is not None:
            raise DamagedChunk(obj.key, source.url, damage)
        target.write_new(obj.key, data)

    with _concurrency.Operation(workers, "copy") as op:
        op.fan_out(objects, copy, budget=budget, nbytes=lambda obj: obj.nbytes,
                   on_done=lambda obj, _: advance(obj.nbytes))
