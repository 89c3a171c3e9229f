"""One checkpoint at one URL: `save_pytree`, which never writes into a step of a run
that a live manager holds (see `guards.RefuseIfHeld`)."""

from __future__ import annotations

from typing import Any

from .. import _options, _save, _storage
from .guards import RefuseIfHeld


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

