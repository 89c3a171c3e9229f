"""Restoring one checkpoint onto a target: open it, match the target, read, share.

    checkpoint  open the checkpoint: commit check, leaf records (one metadata read)
    match       each target leaf against its saved leaf: every mismatch before any read
    mismatch    the report of those mismatches: grouped by subtree, capped, what helps
    plan        which boxes each process reads (pure: sharding, chunks, process index)
    load        here: read every box on a pool, leaf by leaf in order, under a byte
                budget, and build each leaf on the target's devices
    broadcast   leaves several processes need, read once for all, moved onto their
                targets over the device network
    coordination  what the read loop asks of the other processes, in one interface:
                nothing (`alone`), the local tier's gate (`Gated`), or relief
    relief      a slow process's part of those leaves read by another for it

A jax.Array is read region by region, only the regions this process's devices of the
target sharding hold, and built from pieces on those devices, which is what makes
restoring onto another mesh, device count or process count work.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from .. import _options, _storage
from .._format import dtypes as _dtypes, tree as _tree
from .._options import LoadOptions
from .._util import concurrency as _concurrency, multihost as _multihost, progress as _progress, stats as _stats
from .._util.regions import Region, region_shape
from ..errors import CheckpointError
from . import broadcast as _broadcast, checkpoint as _reader, relief as _relief, renames as _renames
from .coordination import Coordination, Gate, Gated, alone
from .match import Assembly, Request, match, saved_form
from .plan import Placement

log = logging.getLogger("zarrckpt")


def load_pytree(
    url: str,
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
    """Restores the committed checkpoint at `url` onto `target`.

    Each process reads only what its own devices hold of the target, so the mesh,
    device count and process count may differ from the save's. Collective under
    jax.distributed when the target places a leaf on devices of several processes:
    every process calls it with the same target.

    Args:
      url: a local path or fsspec URL of one checkpoint (not of a directory of steps).
      target: a pytree of the saved structure whose leaves are jax.Array (shape, dtype
        and sharding taken from it), jax.ShapeDtypeStruct (with a sharding, or none for
        the default device), jax.sharding.Sharding (shape and dtype from the
        checkpoint), numpy arrays or scalars, Python scalars, str or bytes (the saved
        value comes back), or `PerProcess(None)` (this process's saved value comes
        back). None: the saved tree as nested dicts and lists of numpy arrays and
        scalars, str and bytes; a per-process leaf comes back as this process's own
        value (a PerProcess) where as many processes saved it as restore it, else as
        a dict of every saving process's value by process index.
      storage_options: passed to fsspec.
      partial: restore only the leaves the target has (all must be in the checkpoint);
        the others are never read.
      allow_dtype_cast: convert a leaf whose saved dtype differs from the target's;
        without it that is a mismatch.
      donate_target: delete each jax.Array of the target just before its replacement
        is read, keeping peak device memory near one copy of the state. Any other
        reference to those arrays becomes unusable. Nothing is deleted if matching
        fails; if reading fails after it began, the target is unusable (restore again).
      load_and_broadcast: where several processes hold the same part of a leaf, each
        reads a distinct piece and the pieces are shared over the device network, so
        the store serves each byte once; a process that falls far behind has its
        piece read for it by another. Costs about `max_inflight_bytes` (plus one
        leaf) of extra device memory per process while pieces wait to be shared,
        twice that for a group in which a piece was read for a slow process. Off:
        every process reads all it needs itself.
      max_inflight_bytes: bound on host bytes read and not yet placed on devices.
      max_workers: concurrent reads (default: one per core, 8 to 32, on a local disk;
        128 on an object store; 100 on GCS).
      progress: show a progress bar on process 0 (default: when stderr is a terminal).
      rename: which checkpoint leaf each target leaf restores from, by name (the dotted
        names `zarrckpt info` shows, `params.backbone.fc_in.kernel`): a sequence of
        `(regex, replacement)` pairs applied in order with `re.sub` to each target
        leaf's name, or a function from a target leaf's name to the checkpoint's name,
        or to None (not from the checkpoint: the leaf counts as one the checkpoint
        lacks). Target leaves renamed onto one saved leaf (tied weights) each get its
        values, on their own shardings and buffers, read once: in the saved dtype where
        one of them has it, each other leaf cast from those. Default: each leaf's own name.
      fallback: target leaves the checkpoint lacks come back as they are (the target's
        own objects, not copies); each must be a value (a jax.Array, numpy array or
        scalar, Python scalar, str or bytes), not a ShapeDtypeStruct or Sharding. The
        log line says how many leaves and bytes fell back. Without it they are a
        mismatch.

    Returns:
      The restored pytree: the target's structure, or the saved one when `target` is None.

    Raises:
      TypeError, ValueError: an option of the wrong type or value (named), a `rename`
        pair that is not a pair of str, a regex that does not compile (named), a
        `rename` function that returns other than a str or None, or `rename` or
        `fallback` with `target` None.
      CheckpointNotFoundError: nothing committed at `url`, or it was deleted or
        replaced while being read.
      CheckpointMismatchError: the target does not match; lists every missing and
        unexpected key path and every shape and dtype difference (beyond 20, a whole
        subtree with one problem as one line, and the first 20 lines), and says what
        can help (a subtree under another name, the `rename=` that maps the target's
        names onto the checkpoint's, partial=True, fallback=True); a renamed leaf the
        checkpoint lacks is named with its renamed name beside it. Nothing was read.
      CheckpointCorruptError: a chunk or metadata the checkpoint declares is missing
        or damaged.
    """
    options = LoadOptions(allow_dtype_cast=allow_dtype_cast, donate_target=donate_target, partial=partial,
                          load_and_broadcast=load_and_broadcast, max_inflight_bytes=max_inflight_bytes,
                          max_workers=max_workers, progress=progress, rename=_renames.parse(rename),
                          fallback=fallback).onto(target)
    return load(_storage.resolve(url, storage_options), target, options)


def load(loc: _storage.Location, target: Any, options: LoadOptions) -> Any:
    """`load_pytree` of the checkpoint at `loc`."""
    return load_opened(_reader.open_checkpoint(loc), target, options)


def load_opened(ckpt: _reader.Checkpoint, target: Any, options: LoadOptions) -> Any:
    """`load_pytree` of the opened checkpoint `ckpt`. Raises CheckpointNotFoundError if
    it was deleted or replaced before its last read was checked (see `_commit`)."""
    if target is None:
        return load_requests(ckpt, [Request(s, saved_form(s)) for s in ckpt.leaves.values()], None, options)
    requests, assembly = match(ckpt, target, options.allow_dtype_cast, options.partial, options.load_and_broadcast,
                               rename=options.rename, fallback=options.fallback)
    return load_requests(ckpt, requests, assembly, options)


class GateClosed(CheckpointError):
    """Raised by a `Gate`: some process's reads failed."""


def load_requests(ckpt: _reader.Checkpoint, requests: list[Request], assembly: Assembly | None,
                  options: LoadOptions, gate: Gate | None = None) -> Any:
    """Reads `requests` (matched to a target, whose leaves `assembly` makes of them, or
    None for the saved tree) from `ckpt` and builds the result. Collective when a
    request is shared.

    With a `gate`, a read that fails on one process never leaves the others waiting in
    a collective: every process passes the gate before each sharing and at the end,
    and the failure is raised there on all of them (the local tier, whose copies may
    be damaged, falls back to another source together)."""
    started = time.perf_counter()
    total = sum(r.nbytes for r in requests)
    with _progress.bar(f"restoring {ckpt.url}", total, options.progress) as advance:
        try:
            values = _read_all(ckpt, requests, options, advance, gate)
            ckpt.check_unchanged()  # one small read: these values are all of one save
        except Exception as e:
            if gate is None or isinstance(e, GateClosed):
                raise
            gate(e)  # raises GateClosed here, as on every other process
            raise
        if gate is not None:
            gate(None)
    kept = (0, 0)
    if assembly is None:
        result = _tree.rebuild(ckpt.spec, lambda rec: values[rec["name"]])
    else:
        result, kept = assembly.build(values), assembly.kept()
    seconds = time.perf_counter() - started
    # From the local tier's copies, the tier says how much came from where instead.
    log.log(logging.INFO if gate is None else logging.DEBUG, "restored %s: %d leaves, %s%s", ckpt.url,
            len(requests), _progress.rate(total, seconds),
            f"; {kept[0]} leaves ({_progress.size(kept[1])}) fell back to the target's own values" if kept[0] else "")
    return result


@dataclasses.dataclass(frozen=True)
class _Read:
    """One box of one leaf to read, the regions to cut from it, and where they go."""

    request: Request
    box: Region
    places: Placement
    last: bool  # the leaf's last read: once it is in, the leaf can be built

    @property
    def nbytes(self) -> int:
        return _dtypes.nbytes(region_shape(self.box), self.request.form.dtype)


def _read_all(ckpt: _reader.Checkpoint, requests: list[Request], options: LoadOptions,
              advance: Callable[[int], None], gate: Gate | None) -> dict[str, Any]:
    """Reads every request, leaf by leaf in order, with bounded host memory.

    Pool threads read (and, for large leaves, put each piece on its devices); this
    thread builds the leaves in order as their last read comes in.
    """
    done: dict[str, Any] = {}
    reads: list[_Read] = []
    process = _multihost.process_index()
    for request in requests:
        groups = request.form.reads(request.stored, process)
        if not groups:  # no device of this process holds any of it
            done[request.stored.name] = request.form.build(request.stored, [])
        reads += [_Read(request, box, places, i == len(groups) - 1) for i, (box, places) in enumerate(groups)]
    donated: set[int] = set()

    def admit(read: _Read) -> None:
        if options.donate_target and (old := read.request.old) is not None and id(old) not in donated \
                and not old.is_deleted():
            donated.add(id(old))
            old.delete()
        others.began(read.request)

    budget = _concurrency.ByteBudget(options.max_inflight_bytes)
    pieces: list[Any] = []
    # Leaves read for load and broadcast wait on the devices (staged) until shared, in
    # groups of about max_inflight_bytes (that bounds the extra memory), the same
    # groups in the same order on every process, as sharing is collective.
    sharing = _broadcast.groups([r for r in requests if r.share is not None], options.max_inflight_bytes)
    others = _coordination(ckpt, sharing, options, {r.request.stored.name for r in reads}, gate)

    def share_ready() -> None:
        while sharing and all(r.stored.name in done for r in sharing[0]):
            _broadcast.share(others.settle(sharing.pop(0), done), done)

    try:
        share_ready()
        with _concurrency.Operation(options.max_workers or ckpt.loc.concurrency, "read") as op:
            given_up = others.abandon
            for read, result, hold in op.window(reads, lambda r: others.fetch(r.request, r.box, r.places),
                                                budget=budget, nbytes=lambda r: r.nbytes, admit=admit,
                                                abandon=given_up and (lambda r: given_up(r.request))):
                hold.release()  # the pieces are on their devices, or small
                if result is _concurrency.ABANDONED:
                    _stats.add("reads_given_up")
                    result = _relief.Relief.zeros(read.request, read.places)
                pieces += result
                if read.last:
                    request = read.request
                    others.ended(request)
                    done[request.stored.name] = request.form.build(request.stored, pieces)
                    advance(request.nbytes)
                    pieces = []
                    share_ready()
    except BaseException as e:
        others.close(e)  # the others learn of it at their next barrier, not waiting for this process
        raise
    others.close()
    return done


def _coordination(ckpt: _reader.Checkpoint, sharing: list[list[Request]], options: LoadOptions, reading: set[str],
                  gate: Gate | None) -> Coordination:
    """How this restore's processes read together: through the local tier's `gate`, with
    relief where a slow process's shared part can be read by another (not from the local
    tier, whose copies and routes are its own), else each alone."""
    if gate is not None:
        return Gated(ckpt, gate)
    return _relief.start(ckpt, sharing, options, reading) or alone(ckpt)
