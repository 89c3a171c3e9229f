"""Checkpoints without a manager: one at one URL (`save_pytree`), and the steps of a
directory (`save_checkpoint`, `load_checkpoint`, `latest_step`, ...). A one-off save never
writes into a step of a run that a live manager holds (`guards.RefuseIfHeld`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from .. import _commit, _options, _save, _storage
from .._format import naming as _naming
from .._restore import renames as _renames
from . import steps as _steps
from .guards import RefuseIfHeld
from .same_chunks import SameChunksSince


def save_pytree(
    url: str,
    tree: Any,
    *,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    max_chunk_bytes: int = _options.DEFAULT_MAX_CHUNK_BYTES,
    min_chunk_bytes: int = _options.DEFAULT_MIN_CHUNK_BYTES,
    max_inflight_bytes: int = _options.DEFAULT_MAX_INFLIGHT_BYTES,
    max_workers: int | None = None,
    timeout_s: float = _options.DEFAULT_TIMEOUT_S,
    progress: bool | None = None,
    checksums: bool = True,
    compression: str | None = None,
) -> None:
    """Saves `tree` as a checkpoint at `url` and commits it.

    Agreement: under `jax.distributed` every process must call it with the same tree
    structure (each passes its own shards). Returns once the checkpoint is committed.

    Args:
      url: a local path or fsspec URL (file://, memory://, s3://, gs://...).
      tree: a pytree whose leaves are jax.Array (any sharding; typed PRNG keys
        included), numpy arrays or scalars, Python bool/int/float/complex, str, bytes,
        or `zarrckpt.PerProcess` (each process saves its own value). None and empty
        containers are kept.
      storage_options: passed to fsspec (credentials, endpoint_url...). Never logged.
      overwrite: replace a committed checkpoint at `url`. Without it that is an error.
      max_chunk_bytes: shards larger than this are split into several chunks.
      min_chunk_bytes: shards smaller than this are merged into larger chunks where one
        process holds several side by side (fewer objects: each is a request on S3/GCS).
      max_inflight_bytes: bound on host bytes copied off devices and not yet written.
      max_workers: concurrent writes per process (default: one per core, 8 to 32, on a local
        disk; 128 on an object store; 100 on GCS).
      timeout_s: how long a process may wait for the others, in all, during the save
        (its own work not counted).
      progress: show a progress bar on process 0 (default: when stderr is a terminal).
      checksums: store a CRC-32C after every chunk (zarr's crc32c codec), verified on
        every read. Turning it off is for measuring its cost.
      compression: "zstd" stores chunks through zarr v3's `blosc` codec (zstd,
        bit-shuffled by the dtype's size), which zarr-python and TensorStore read as
        they are: each chunk of 64 KiB or more is compressed where a probe of its leaf
        shows that pays at the speed this process's writes are going (a slow object
        store), else stored as it is behind blosc's 16-byte header, so that it is never
        slower than it would be uncompressed by more than the probe; on a local disk
        that is about never. None (the default): uncompressed.

    Raises:
      TypeError, ValueError: an option of the wrong type or value (named).
      UnsupportedLeafError: a leaf or key that cannot be saved (names its key path).
      CheckpointExistsError: `url` holds a committed checkpoint and overwrite is False.
      DirectoryInUseError: `url` is a step, there already, of a directory of steps
        that a live `CheckpointManager` holds (names the holder); a lease left
        unreleased whose holder may be alive elsewhere is watched first (2.5
        heartbeats).
      CheckpointWriteError: a write failed on some process (names process and leaf);
        nothing was committed.
      CoordinationTimeoutError: a process did not arrive at an agreement in time.
    """
    options = _options.SaveOptions(overwrite=overwrite, max_chunk_bytes=max_chunk_bytes,
                                   min_chunk_bytes=min_chunk_bytes, max_inflight_bytes=max_inflight_bytes,
                                   max_workers=max_workers, timeout_s=timeout_s, progress=progress,
                                   checksums=checksums, compression=compression)
    loc = _storage.resolve(url, storage_options)
    _save.save(loc, tree, options, guard=RefuseIfHeld(loc, "save_pytree", existing_only=not overwrite))


def save_checkpoint(
    checkpoint_dir: str,
    step: int,
    state: Any,
    *,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    max_chunk_bytes: int = _options.DEFAULT_MAX_CHUNK_BYTES,
    min_chunk_bytes: int = _options.DEFAULT_MIN_CHUNK_BYTES,
    max_inflight_bytes: int = _options.DEFAULT_MAX_INFLIGHT_BYTES,
    max_workers: int | None = None,
    timeout_s: float = _options.DEFAULT_TIMEOUT_S,
    progress: bool | None = None,
    checksums: bool = True,
    compression: str | None = None,
    unchanged_since: int | None = None,
) -> None:
    """Saves `state` as step `step` under `checkpoint_dir` and commits it.

    Agreement, like `save_pytree`, whose options it takes (see there), and:

    Args:
      unchanged_since: a committed step of `checkpoint_dir`. Each chunk this save
        writes that step holds byte for byte under the same name (its CRC-32C and size
        as the step's commit records them, then its bytes as read) is made from that
        step's (a hard link on a local disk, a copy inside S3 or GCS) instead of
        written, and only from the version of it the commit records: a chunk rewritten
        or deleted since is never made from, its bytes are written instead. What the
        step holds is all it takes: it may have been saved by another process or before
        a restart. Every leaf is still copied off its devices and checksummed; what is
        saved is the bytes written (a disk's space, an object store's uploads). A
        `CheckpointManager` also skips the copy off the devices for leaves it finds
        unchanged (`reuse_unchanged`). A step that is not committed, cannot be read, or
        records no checksums (saved with `checksums=False`) makes nothing: every chunk
        is written, with a warning. The new step is complete on its own.

    Raises what `save_pytree` raises; CheckpointExistsError if the step is committed
    and `overwrite` is False, ValueError for a bad step (or `unchanged_since` equal to
    `step`); DirectoryInUseError, naming the holder, if a live `CheckpointManager`
    holds `checkpoint_dir` and `step` is there already, committed (with `overwrite`:
    the manager would take the replacement for the step it saved, and make unchanged
    chunks from it) or not (a step it is writing would be taken for a leftover and
    deleted). A lease found unreleased whose holder may be alive on another machine is
    watched first, as a manager claiming it would (2.5 heartbeats).
    """
    step = _naming.step_number(step)
    options = _options.SaveOptions(overwrite=overwrite, max_chunk_bytes=max_chunk_bytes,
                                   min_chunk_bytes=min_chunk_bytes, max_inflight_bytes=max_inflight_bytes,
                                   max_workers=max_workers, timeout_s=timeout_s, progress=progress,
                                   checksums=checksums, compression=compression)
    _options.check("unchanged_since", unchanged_since, _options.COUNT_OR_ZERO + "?")
    if unchanged_since == step:
        raise ValueError(f"unchanged_since={unchanged_since} is the step being saved: name the step its unchanged "
                         "chunks are made from")
    root = _storage.resolve(checkpoint_dir, storage_options)
    loc = root.step(step)
    source = None if unchanged_since is None else root.step(unchanged_since)
    job = _save.SaveJob.create(loc, state, options,
                               guard=RefuseIfHeld(loc, "save_checkpoint", existing_only=not overwrite),
                               reuse=_save.NO_REUSE if source is None else SameChunksSince(source))
    _save.write(job)


def all_steps(checkpoint_dir: str, *, storage_options: dict[str, Any] | None = None) -> list[int]:
    """Every committed step under `checkpoint_dir`, ascending. Not collective.

    Raises:
      CheckpointLocationError: `checkpoint_dir` is a checkpoint itself or holds another
        library's checkpoints.
    """
    root = _storage.resolve(checkpoint_dir, storage_options)
    committed = _steps.scan(root)[1]
    if not committed:
        _steps.check_directory_of_steps(root)
    return committed


def latest_step(checkpoint_dir: str, *, storage_options: dict[str, Any] | None = None) -> int | None:
    """The newest committed step under `checkpoint_dir`, or None if there is none.

    Not collective. Uncommitted step directories (a save running or crashed) are skipped.

    Raises:
      CheckpointLocationError: `checkpoint_dir` is a checkpoint itself or holds another
        library's checkpoints.
    """
    return _steps.latest(_storage.resolve(checkpoint_dir, storage_options))


def load_checkpoint_if_it_exists(
    checkpoint_dir: str,
    target: Any,
    *,
    storage_options: dict[str, Any] | None = None,
    partial: bool = False,
    allow_dtype_cast: bool = False,
    donate_target: bool = False,
    load_and_broadcast: bool = True,
    max_inflight_bytes: int = _options.DEFAULT_MAX_INFLIGHT_BYTES,
    max_workers: int | None = None,
    progress: bool | None = None,
    timeout_s: float = _options.DEFAULT_TIMEOUT_S,
    rename: _renames.Given = None,
    fallback: bool = False,
) -> tuple[Any, int]:
    """Restores the newest committed step under `checkpoint_dir` onto `target`.

    Collective under jax.distributed: every process calls it; process 0 chooses the
    step and every process restores that one, even if a save commits another step
    meanwhile.

    Args:
      checkpoint_dir: a local path or fsspec URL of a directory of steps.
      target: as for `load_pytree`.
      storage_options, partial, allow_dtype_cast, donate_target: as for `load_pytree`.
      load_and_broadcast, max_inflight_bytes, max_workers, progress: as for `load_pytree`.
      rename, fallback: as for `load_pytree` (with fallback=True, step 0 of a run
        imported from weights alone restores a whole training state).
      timeout_s: how long a process waits for process 0's choice of step.

    Returns:
      (state, step); or (target, 0), with a warning naming the URL, when nothing is
      committed yet, so a training loop can call it unconditionally at start-up.

    Raises:
      CheckpointLocationError: on every process, if `checkpoint_dir` is a checkpoint
        itself or holds another library's checkpoints.
      CoordinationTimeoutError: the step was not chosen within `timeout_s`.
      Exception: anything `load_pytree` raises.
    """
    options = _options.LoadOptions(partial=partial, allow_dtype_cast=allow_dtype_cast, donate_target=donate_target,
                                   load_and_broadcast=load_and_broadcast, max_inflight_bytes=max_inflight_bytes,
                                   max_workers=max_workers, progress=progress, rename=_renames.parse(rename),
                                   fallback=fallback).onto(target)
    _options.check("timeout_s", timeout_s, _options.NUMBER)
    root = _storage.resolve(checkpoint_dir, storage_options)
    state, step, _ = _steps.restore_latest(root, target, options, timeout_s, None)
    return state, step or 0


def load_checkpoint(
    checkpoint_dir: str,
    step: int,
    target: Any = None,
    *,
    storage_options: dict[str, Any] | None = None,
    partial: bool = False,
    allow_dtype_cast: bool = False,
    donate_target: bool = False,
    load_and_broadcast: bool = True,
    max_inflight_bytes: int = _options.DEFAULT_MAX_INFLIGHT_BYTES,
    max_workers: int | None = None,
    progress: bool | None = None,
    rename: _renames.Given = None,
    fallback: bool = False,
) -> Any:
    """Restores committed step `step` under `checkpoint_dir` onto `target`, as an
    evaluator does for each step `checkpoints_iterator` yields.

    Collective exactly as `load_pytree` is.

    Args:
      checkpoint_dir: a local path or fsspec URL of a directory of steps.
      step: the step to restore.
      target, storage_options, partial, allow_dtype_cast, donate_target: as for `load_pytree`.
      load_and_broadcast, max_inflight_bytes, max_workers, progress: as for `load_pytree`.
      rename, fallback: as for `load_pytree`.

    Returns:
      The restored pytree.

    Raises:
      CheckpointNotFoundError: `step` is not committed (the message lists the
        committed steps), or was deleted (by retention, say) while being read.
      Exception: anything `load_pytree` raises.
    """
    step = _naming.step_number(step)
    options = _options.LoadOptions(partial=partial, allow_dtype_cast=allow_dtype_cast, donate_target=donate_target,
                                   load_and_broadcast=load_and_broadcast, max_inflight_bytes=max_inflight_bytes,
                                   max_workers=max_workers, progress=progress, rename=_renames.parse(rename),
                                   fallback=fallback).onto(target)
    root = _storage.resolve(checkpoint_dir, storage_options)
    return _steps.load_step(root, step, target, options, None)[0]


def checkpoints_iterator(checkpoint_dir: str, *, timeout_s: float | None = None, poll_interval_s: float = 5.0,
                         start_after: int | None = None,
                         storage_options: dict[str, Any] | None = None) -> Iterator[int]:
    """Yields the steps committed under `checkpoint_dir` as they appear, in increasing
    order, for an evaluator's loop beside a training job. Not collective.

        for step in zarrckpt.checkpoints_iterator(run_dir, timeout_s=3600):
            params = zarrckpt.load_checkpoint(run_dir, step, {"params": target}, partial=True)

    Yields first the newest step already committed (or, with `start_after`, every
    committed step after it), then each step committed later. A step deleted (by
    retention, say) before it is yielded is skipped. Each poll lists the directory and
    reads the commit markers of steps newer than the last one yielded.

    Args:
      checkpoint_dir: a local path or fsspec URL of a directory of steps.
      timeout_s: stop once this many seconds pass without a new step (None: never).
      poll_interval_s: seconds between polls.
      start_after: yield every committed step after this one instead of the newest only.
      storage_options: passed to fsspec.

    Raises:
      CheckpointLocationError: at a poll that lists no step directory, if
        `checkpoint_dir` is a checkpoint itself or holds another library's checkpoints.
    """
    _options.check("timeout_s", timeout_s, _options.NUMBER + "?")
    _options.check("poll_interval_s", poll_interval_s, _options.NUMBER)
    _options.check("start_after", start_after, _options.COUNT_OR_ZERO + "?")
    root = _storage.resolve(checkpoint_dir, storage_options)
    last, first, idle_since = start_after, start_after is None, time.monotonic()
    while True:
        if first:  # the newest step committed already, and none older
            steps, newest, _ = _steps.newest_committed(root, lambda loc: (_commit.head(loc).state, None))
            new = [] if newest is None else [newest]
        else:
            steps, new = _steps.scan(root, after=last)
        if not steps:  # a step's own directory, say, which would never yield one
            _steps.check_directory_of_steps(root)
        first = False
        for step in new:
            if _steps.is_committed(root.step(step)):  # not deleted since the listing
                last = step
                yield step
                idle_since = time.monotonic()
        waited = time.monotonic() - idle_since
        if timeout_s is not None and waited >= timeout_s:
            return
        time.sleep(poll_interval_s if timeout_s is None else min(poll_interval_s, timeout_s - waited))
