"""Saving one pytree as one zarr group: the write protocol.

    process 0: remove a leftover uncommitted group, write the group's metadata
    all:       agree that it worked
    all:       write the chunks this process owns (see _planning); process 0 also
               writes every array's metadata
    all:       agree that every write of every process succeeded
    process 0: write the commit marker (see _commit)
    all:       agree that the commit happened

A failure anywhere is reported to every process at the next agreement, so all of
them raise and nothing is committed.
"""

from __future__ import annotations

import collections
import concurrent.futures
import datetime
import logging
import time
from typing import Any, Callable

import jax
import zarr

from . import _commit, _multihost, _naming, _planning, _storage, _tree, _zarrjson
from . import errors
from ._planning import ArrayPlan, WriteUnit

log = logging.getLogger("zarrckpt")

DEFAULT_MAX_INFLIGHT_BYTES = 2 * 2**30


def save_pytree(
    url: str,
    tree: Any,
    *,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    max_chunk_bytes: int = _planning.DEFAULT_MAX_CHUNK_BYTES,
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
    max_workers: int | None = None,
    timeout_s: float = _multihost.DEFAULT_TIMEOUT_S,
) -> None:
    """Saves `tree` as a checkpoint at `url` and commits it.

    Collective: under `jax.distributed` every process must call it with the same tree
    structure (each passes its own shards). Returns once the checkpoint is committed.

    Args:
      url: a local path or fsspec URL (file://, memory://, s3://, gs://...).
      tree: a pytree whose leaves are jax.Array (any sharding), numpy arrays or scalars,
        or Python bool/int/float/complex. None and empty containers are kept.
      storage_options: passed to fsspec (credentials, endpoint_url...). Never logged.
      overwrite: replace a committed checkpoint at `url`. Without it that is an error.
      max_chunk_bytes: shards larger than this are split into several chunks.
      max_inflight_bytes: bound on host bytes copied off devices and not yet written.
      max_workers: concurrent writes per process (default: 8 on a local disk, 64 on
        an object store).
      timeout_s: how long a process waits for the others at each agreement.

    Raises:
      UnsupportedLeafError: a leaf or key that cannot be saved (names its key path).
      CheckpointExistsError: `url` holds a committed checkpoint and overwrite is False.
      CheckpointWriteError: a write failed on some process (names process and leaf);
        nothing was committed.
      CoordinationTimeoutError: a process did not arrive at an agreement in time.
    """
    loc = _storage.resolve(url, storage_options)
    spec, leaves = _tree.record(tree)
    plans = [_planning.plan_array(leaf, i, max_chunk_bytes) for i, leaf in enumerate(leaves)]
    # Every process knows every array's metadata without asking the store.
    arrays = {p.leaf.name: _zarrjson.array_document(p.shape, p.dtype, p.chunks) for p in plans}
    group = _zarrjson.group_document({_naming.META_ATTR: _tree_metadata(spec)})
    is_primary = _multihost.process_index() == 0
    started = time.perf_counter()
    op = _multihost.Collective("save", timeout_s)
    with concurrent.futures.ThreadPoolExecutor(max_workers or loc.concurrency) as pool:
        try:
            _agree(op, "prepare", loc, lambda: _prepare(loc, group, overwrite) if is_primary else None)
            _agree(op, "write", loc, lambda: _write_all(loc, plans, arrays if is_primary else {}, pool,
                                                        max_inflight_bytes))
            _agree(op, "commit", loc, lambda: _commit.commit(loc, _zarrjson.group_document(
                group["attributes"], arrays)) if is_primary else None)
        finally:
            op.close()
    if is_primary:
        seconds = time.perf_counter() - started
        total = sum(p.nbytes for p in plans)
        log.info("saved %s: %d leaves, %.3f GB in %.2fs (%.2f GB/s)", loc.url, len(plans), total / 1e9,
                 seconds, total / 1e9 / max(seconds, 1e-9))


def _tree_metadata(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "format_version": _naming.FORMAT_VERSION,
        "tree": spec,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "zarr_version": zarr.__version__,
    }


def _agree(op: _multihost.Collective, tag: str, loc: _storage.Location, step: Callable[[], Any]) -> None:
    """Runs this process's part of a step, then raises on every process if any failed."""
    mine: BaseException | None = None
    report = None
    try:
        step()
    except Exception as e:  # reported to every process, then re-raised below
        mine = e
        kind = type(e).__name__ if isinstance(e, errors.CheckpointError) else None
        report = [kind, f"{type(e).__name__}: {e}" if kind is None else str(e)]
    failures = op.agree(tag, report)
    if not failures:
        return
    (_, (kind, message)), *others = failures
    if not others and kind not in (None, errors.CheckpointWriteError.__name__):
        # A refusal by process 0 (e.g. CheckpointExistsError) keeps its type everywhere.
        if mine is not None:
            raise mine
        raise getattr(errors, kind)(message)
    lines = "\n".join(f"  process {pid}: {message}" for pid, (_, message) in failures)
    raise errors.CheckpointWriteError(
        f"saving {loc.url} failed at '{tag}' on {len(failures)} of {_multihost.process_count()} "
        f"process(es); nothing was committed:\n{lines}"
    ) from mine


def _prepare(loc: _storage.Location, group: dict[str, Any], overwrite: bool) -> None:
    """Process 0: clears the way and writes the (uncommitted) group metadata."""
    current = _commit.state(loc)
    if current is _commit.State.COMMITTED and not overwrite:
        raise errors.CheckpointExistsError(
            f"{loc.url} already holds a committed checkpoint; pass overwrite=True to replace it"
        )
    if current is not _commit.State.ABSENT:
        _commit.remove(loc)
    loc.write("zarr.json", _zarrjson.encode_document(group), atomic=True)


def _write_all(loc: _storage.Location, plans: list[ArrayPlan], arrays: dict[str, dict[str, Any]],
               pool: concurrent.futures.ThreadPoolExecutor, max_inflight_bytes: int) -> None:
    """Writes `arrays`' metadata and this process's chunks, at most `max_inflight_bytes`
    staged on the host at once.

    Device-to-host copies are started for everything that fits in the bound before
    any write waits, so transfers overlap with each other and with writing. Array
    metadata is only read once committed, so it goes out alongside the chunks.
    """
    pending: collections.deque[tuple[concurrent.futures.Future[None], int]] = collections.deque()
    pending.extend((pool.submit(loc.write, f"{name}/zarr.json", _zarrjson.encode_document(doc)), 0)
                   for name, doc in arrays.items())
    inflight = 0
    try:
        for plan in plans:
            for unit in plan.writes:
                while pending and inflight + unit.nbytes > max_inflight_bytes:
                    future, nbytes = pending.popleft()
                    future.result()
                    inflight -= nbytes
                unit.start_transfer()
                pending.append((pool.submit(_write_one, loc, plan, unit), unit.nbytes))
                inflight += unit.nbytes
        for future, _ in pending:
            future.result()
    except BaseException:
        for future, _ in pending:
            future.cancel()
        raise


def _write_one(loc: _storage.Location, plan: ArrayPlan, unit: WriteUnit) -> None:
    coords = [start // size for (start, _), size in zip(unit.region, plan.chunks)]
    try:
        loc.write(_zarrjson.chunk_key(plan.leaf.name, coords), _zarrjson.encode_chunk(unit.host_array(), plan.chunks))
    except Exception as e:
        raise errors.CheckpointWriteError(
            f"writing leaf {plan.leaf.where} (array {plan.leaf.name!r}) chunk {coords}: {type(e).__name__}: {e}"
        ) from e
    finally:
        unit.release()
