"""Restoring one checkpoint onto a target: match, validate, then read.

Nothing is read until the whole target has been checked against the checkpoint;
every mismatch is reported at once. Each leaf is then rebuilt with
`jax.make_array_from_callback` on the target's sharding, which is what makes
restoring onto another mesh, device count or process count work.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import jax
import numpy as np

from . import _concurrency, _dtypes, _planning, _progress, _reader, _storage, _tree
from ._options import LoadOptions
from ._planning import Region
from .errors import CheckpointMismatchError, UnsupportedLeafError

log = logging.getLogger("zarrckpt")

_READER_PLACEMENT_BYTES = 2**20
_PY_SCALARS = {"bool": bool, "int": int, "float": float, "complex": complex}


@dataclasses.dataclass
class _Request:
    """One leaf to restore and the form it must come back in."""

    stored: _reader.StoredLeaf
    dtype: np.dtype
    make: str  # "jax" (on `sharding`), "device" (default device), "numpy", "numpy_scalar", "prng_key",
    # or a Python scalar type
    sharding: jax.sharding.Sharding | None = None
    old: jax.Array | None = None  # the target array this replaces, freed before reading
    # Put on devices by the reader threads (large leaves: transfers overlap), or by the
    # main thread from host pieces (small leaves: per-call cost dominates, and threads
    # contending for the GIL made a 1000-leaf restore 3x slower).
    placed_by_readers: bool = False


def load_pytree(
    url: str,
    target: Any = None,
    *,
    storage_options: dict[str, Any] | None = None,
    allow_dtype_cast: bool = False,
    donate_target: bool = True,
    max_inflight_bytes: int = _concurrency.DEFAULT_MAX_INFLIGHT_BYTES,
    max_workers: int | None = None,
    progress: bool | None = None,
) -> Any:
    """Restores the committed checkpoint at `url`.

    Not collective: each process reads only what its own devices need, so it works
    whatever the process count; under `jax.distributed` every process should call it
    with the same target structure to get one consistent global state.

    Args:
      url: a local path or fsspec URL of one checkpoint (not a step directory parent).
      target: what to restore into, a pytree with the saved structure whose leaves are
        jax.Array (shape, dtype and sharding are taken from it), jax.ShapeDtypeStruct
        (with a sharding, or none for the default device), jax.sharding.Sharding (shape
        and dtype from the checkpoint), numpy arrays or scalars, or Python scalars.
        None restores the saved tree as nested dicts/lists of numpy arrays and scalars.
      allow_dtype_cast: convert leaves whose saved dtype differs from the target's;
        without it such a leaf is a mismatch.
      donate_target: free each jax.Array of the target just before its replacement is
        read, so that peak device memory stays near one copy of the state. The target
        must not be used afterwards. Nothing is freed if validation fails.
      max_inflight_bytes: bound on host bytes read and not yet placed on devices.
      max_workers: concurrent reads (default: 8 on a local disk, 128 on an object store,
        100 on GCS).
      progress: show a progress bar on process 0 (default: when stderr is a terminal).

    Raises:
      TypeError, ValueError: an option of the wrong type or value (named).
      CheckpointNotFoundError: nothing committed at `url`.
      CheckpointMismatchError: the target does not match; lists every missing and
        unexpected key path and every shape and dtype difference. Nothing was read.
      CheckpointCorruptError: a chunk or metadata the checkpoint declares is missing.
    """
    options = LoadOptions(allow_dtype_cast, donate_target, max_inflight_bytes, max_workers, progress)
    return load(_storage.resolve(url, storage_options), target, options)


def load(loc: _storage.Location, target: Any, options: LoadOptions) -> Any:
    """`load_pytree` of the checkpoint at `loc`."""
    started = time.perf_counter()
    ckpt = _reader.open_checkpoint(loc)
    if target is None:
        requests = [_Request(s, s.dtype, "numpy" if s.kind in ("jax", "numpy") else s.kind)
                    for s in ckpt.leaves.values()]  # typed keys come back as keys, on the default device
        treedef = None
    else:
        requests, treedef = _match(ckpt, target, options.allow_dtype_cast)
    total = sum(_dtypes.nbytes(r.stored.shape, r.dtype) for r in requests)
    with _progress.bar(f"restoring {ckpt.loc.url}", total, options.progress) as advance:
        values = _read_all(ckpt, requests, options, advance)
    if treedef is None:
        result = _tree.rebuild(ckpt.spec, lambda rec: values[rec["name"]])
    else:
        result = jax.tree_util.tree_unflatten(treedef, [values[r.stored.name] for r in requests])
    seconds = time.perf_counter() - started
    log.info("restored %s: %d leaves, %.3f GB in %.2fs (%.2f GB/s)", ckpt.loc.url, len(requests),
             total / 1e9, seconds, total / 1e9 / max(seconds, 1e-9))
    return result


def _match(ckpt: _reader.Checkpoint, target: Any, allow_dtype_cast: bool) -> tuple[list[_Request], Any]:
    """One request per target leaf; raises listing every mismatch before any read."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    problems: list[str] = []
    requests: list[_Request] = []
    seen: set[str] = set()
    for path, leaf in flat:
        where = _tree.describe_path(path)
        name = ckpt.name_of(tuple(path))
        stored = ckpt.leaves.get(name)
        if stored is None:
            problems.append(f"{where}: in the target but not in the checkpoint")
            continue
        seen.add(name)
        request, shape = _request_for(leaf, stored, where)
        requests.append(request)
        if shape != stored.shape:
            problems.append(f"{where}: shape {stored.shape} in the checkpoint, {shape} in the target")
        elif request.make in _PY_SCALARS:
            if stored.dtype.kind not in _scalar_kinds(request.make):
                problems.append(f"{where}: dtype {stored.dtype} in the checkpoint, Python {request.make} in the target")
        elif request.make == "prng_key" and stored.kind != "prng_key":
            problems.append(f"{where}: a typed PRNG key array in the target, saved as plain {stored.dtype} data")
        elif request.dtype != stored.dtype and not allow_dtype_cast:
            problems.append(f"{where}: dtype {stored.dtype} in the checkpoint, {request.dtype} in the target "
                            "(pass allow_dtype_cast=True to convert)")
    for name, stored in ckpt.leaves.items():
        if name not in seen:
            problems.append(f"{stored.where}: in the checkpoint but not in the target")
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {ckpt.loc.url} does not match the target ({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems)
        )
    return requests, treedef


def _scalar_kinds(python_type: str) -> str:
    return {"bool": "b", "int": "iub", "float": "f", "complex": "c"}[python_type]


def _request_for(leaf: Any, stored: _reader.StoredLeaf, where: str) -> tuple[_Request, tuple[int, ...]]:
    """How a target leaf asks to be restored, and the shape it expects."""
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) and _dtypes.is_prng_key(leaf.dtype):
        # Typed keys are stored as their key data: compare that shape, and rebuild keys.
        data_shape = tuple(jax.eval_shape(jax.random.key_data, leaf).shape)
        old = leaf if isinstance(leaf, jax.Array) else None
        return _Request(stored, stored.dtype, "prng_key", leaf.sharding, old=old), data_shape
    if isinstance(leaf, jax.Array):
        return _Request(stored, np.dtype(leaf.dtype), "jax", leaf.sharding, old=leaf), tuple(leaf.shape)
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = leaf.sharding
        return _Request(stored, np.dtype(leaf.dtype), "jax" if sharding else "device", sharding), tuple(leaf.shape)
    if isinstance(leaf, jax.sharding.Sharding):
        return _Request(stored, stored.dtype, "jax", leaf), stored.shape
    if isinstance(leaf, np.ndarray):
        return _Request(stored, leaf.dtype, "numpy"), leaf.shape
    if isinstance(leaf, np.generic):
        return _Request(stored, leaf.dtype, "numpy_scalar"), ()
    if isinstance(leaf, (bool, int, float, complex)):
        return _Request(stored, stored.dtype, type(leaf).__name__), ()
    raise UnsupportedLeafError(
        f"target leaf {where} is a {type(leaf).__qualname__}; expected jax.Array, jax.ShapeDtypeStruct, "
        "a Sharding, a numpy array or scalar, or a Python scalar"
    )


@dataclasses.dataclass(frozen=True)
class _Read:
    """One box of one leaf to read, the regions to cut from it, and where they go."""

    request: _Request
    box: Region
    places: "Placement"
    last: bool  # the leaf's last read: once it is in, the leaf can be built

    @property
    def nbytes(self) -> int:
        return _dtypes.nbytes(_planning.region_shape(self.box), self.request.dtype)


def _read_all(ckpt: _reader.Checkpoint, requests: list[_Request], options: LoadOptions,
              advance: Callable[[int], None]) -> dict[str, Any]:
    """Reads every request, leaf by leaf in order, with bounded host memory.

    Pool threads read (and, for large leaves, put each piece on its devices); this
    thread assembles the leaves in order as their last read comes in.
    """
    done: dict[str, Any] = {}
    reads: list[_Read] = []
    for request in requests:
        groups = _read_plan(ckpt, request)
        nbytes = sum(_dtypes.nbytes(_planning.region_shape(box), request.dtype) for box, _ in groups)
        request.placed_by_readers = request.make == "jax" and nbytes >= _READER_PLACEMENT_BYTES
        if not groups:  # no device of this process holds any of it
            done[request.stored.name] = _build(request, [])
        reads += [_Read(request, box, places, i == len(groups) - 1) for i, (box, places) in enumerate(groups)]
    donated: set[int] = set()

    def donate(read: _Read) -> None:
        old = read.request.old
        if options.donate_target and old is not None and id(old) not in donated and not old.is_deleted():
            donated.add(id(old))
            old.delete()

    budget = _concurrency.ByteBudget(options.max_inflight_bytes)
    pieces: list[Any] = []
    with _concurrency.Operation(options.max_workers or ckpt.loc.concurrency, "read") as op:
        for read, result in op.window(reads, lambda r: _read_group(ckpt, r.request, r.box, r.places),
                                      budget=budget, nbytes=lambda r: r.nbytes, admit=donate):
            budget.release(read.nbytes)
            pieces += result
            if read.last:
                done[read.request.stored.name] = _build(read.request, pieces)
                advance(_dtypes.nbytes(read.request.stored.shape, read.request.dtype))
                pieces = []
    return done


# Where each region read goes: the devices that need it, or none (the host).
Placement = dict[Region, list[jax.Device]]


def _read_plan(ckpt: _reader.Checkpoint, request: _Request) -> list[tuple[Region, Placement]]:
    shape = request.stored.shape
    full: Region = tuple((0, d) for d in shape)
    if request.make != "jax":
        return [(full, {full: []})]
    devices: Placement = {}
    for device, index in request.sharding.addressable_devices_indices_map(shape).items():
        devices.setdefault(_planning.region_of(index, shape), []).append(device)
    return [(box, {region: devices[region] for region in regions})
            for box, regions in _planning.plan_reads(list(devices), request.stored.chunks, shape)]


def _read_group(ckpt: _reader.Checkpoint, request: _Request, box: Region, places: Placement) -> list[Any]:
    """Reads `box` and cuts out each region: as (region, host array) pairs, or, when
    `request.placed_by_readers`, already put on its devices (one batched call, so jax
    overlaps the transfers)."""
    data = ckpt.read(request.stored, box)
    data = data if data.dtype == request.dtype else data.astype(request.dtype)
    pieces = [(region, data[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(region, box))])
              for region in places]
    if not request.placed_by_readers:
        return pieces
    return jax.device_put([piece for region, piece in pieces for _ in places[region]],
                          [device for region in places for device in places[region]])


def _build(request: _Request, pieces: list[Any]) -> Any:
    shape = request.stored.shape
    if request.placed_by_readers:
        return jax.make_array_from_single_device_arrays(shape, request.sharding, pieces)
    by_region = dict(pieces)
    if request.make == "jax":
        return jax.make_array_from_callback(shape, request.sharding,
                                            lambda index: by_region[_planning.region_of(index, shape)])
    (data,) = by_region.values()
    if request.make == "prng_key":
        keys = jax.random.wrap_key_data(data, impl=request.stored.prng_impl)
        return keys if request.sharding is None else jax.device_put(keys, request.sharding)
    if request.make == "device":
        return jax.device_put(data)
    if request.make == "numpy":
        return data
    if request.make == "numpy_scalar":
        return data[()]
    return _PY_SCALARS[request.make](data.item())
