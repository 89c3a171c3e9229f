"""Restoring one checkpoint onto a target: match, validate, then read.

Nothing is read until the whole target has been checked against the checkpoint;
every mismatch is reported at once. Each target leaf then gets a `_Form` that says
what to read and how to build its value: a jax.Array is read region by region,
only the regions this process's devices of the target sharding hold, and built
from pieces on those devices, which is what makes restoring onto another mesh,
device count or process count work.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import _concurrency, _dtypes, _multihost, _planning, _progress, _reader, _storage, _tree
from ._options import LoadOptions
from ._planning import Region
from ._tree import PerProcess
from .errors import CheckpointMismatchError, UnsupportedLeafError

log = logging.getLogger("zarrckpt")

# Leaves at least this large are put on their devices by the reader threads (transfers
# overlap); smaller ones by the main thread from host pieces (per-call cost dominates,
# and threads contending for the GIL made a 1000-leaf restore 3x slower).
_READER_PLACEMENT_BYTES = 2**20
_PY_SCALARS = {"bool": bool, "int": int, "float": float, "complex": complex}
_SCALAR_KINDS = {"bool": "b", "int": "iub", "float": "f", "complex": "c"}
_TARGET_KINDS = {"bool": "b", "int": "iu", "float": "f", "complex": "c"}  # of 0-d arrays a Python scalar fits

# Where each region read goes: the devices that need it, or none (the host).
Placement = dict[Region, list[jax.Device]]


class _Form:
    """How a target leaf wants its value: what to read, and how to build the value.

    This base reads the whole array to the host and returns it as a numpy array.
    """

    dtype: np.dtype  # the values' dtype once read (converted from the stored one)

    def mismatch(self, stored: _reader.StoredLeaf, allow_dtype_cast: bool) -> str | None:
        if stored.kind == "prng_key":
            return (f"typed PRNG keys ({stored.prng_impl}) in the checkpoint, {self.dtype} data in the target: "
                    "restore them as keys (a key array, a ShapeDtypeStruct of a key dtype, or a Sharding as the "
                    "target leaf), then take jax.random.key_data of them if raw data is wanted")
        if self.dtype != stored.dtype and not allow_dtype_cast and not _scalar_fits(stored, self.dtype):
            return (f"dtype {stored.dtype} in the checkpoint, {self.dtype} in the target "
                    "(pass allow_dtype_cast=True to convert)")
        return None

    def reads(self, stored: _reader.StoredLeaf) -> list[tuple[Region, Placement]]:
        full: Region = tuple((0, d) for d in stored.shape)
        return [(full, {full: []})]

    def fetch(self, ckpt: _reader.Checkpoint, stored: _reader.StoredLeaf, box: Region,
              places: Placement) -> list[Any]:
        """On a reader thread: reads `box` and cuts out each region, as (region, host array)."""
        data = ckpt.read(stored, box)
        data = data if data.dtype == self.dtype else data.astype(self.dtype)
        return [(region, data[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(region, box))])
                for region in places]

    def build(self, stored: _reader.StoredLeaf, pieces: list[Any]) -> Any:
        """On the main thread: the value, from every piece `fetch` returned."""
        ((_, data),) = pieces
        return self.convert(data)

    def convert(self, data: np.ndarray) -> Any:
        return data


@dataclasses.dataclass(frozen=True)
class _Numpy(_Form):
    dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class _NumpyScalar(_Form):
    dtype: np.dtype

    def convert(self, data: np.ndarray) -> Any:
        return data[()]


@dataclasses.dataclass(frozen=True)
class _PythonScalar(_Form):
    dtype: np.dtype  # the stored dtype: a Python scalar has none of its own
    type_name: str

    def mismatch(self, stored: _reader.StoredLeaf, allow_dtype_cast: bool) -> str | None:
        if stored.dtype.kind not in _SCALAR_KINDS[self.type_name]:
            return f"dtype {stored.dtype} in the checkpoint, Python {self.type_name} in the target"
        return None

    def convert(self, data: np.ndarray) -> Any:
        return _PY_SCALARS[self.type_name](data.item())


@dataclasses.dataclass(frozen=True)
class _DefaultDevice(_Form):
    dtype: np.dtype

    def convert(self, data: np.ndarray) -> Any:
        return jax.device_put(data)


@dataclasses.dataclass(frozen=True)
class _PrngKeys(_Form):
    """Typed PRNG keys, stored as their key data: read it, then wrap it as keys."""

    dtype: np.dtype
    sharding: jax.sharding.Sharding | None

    def mismatch(self, stored: _reader.StoredLeaf, allow_dtype_cast: bool) -> str | None:
        if stored.kind != "prng_key":
            return (f"a typed PRNG key array in the target, saved as plain {stored.dtype} data: restore that data "
                    "into a target of its dtype, then make keys of it with jax.random.wrap_key_data")
        return None

    def build(self, stored: _reader.StoredLeaf, pieces: list[Any]) -> Any:
        ((_, data),) = pieces
        keys = jax.random.wrap_key_data(data, impl=stored.prng_impl)
        return keys if self.sharding is None else jax.device_put(keys, self.sharding)


@dataclasses.dataclass(frozen=True)
class _Text(_Form):
    """A str or bytes leaf, stored as its bytes (UTF-8 for a str)."""

    dtype: np.dtype
    kind: str  # "str" or "bytes"

    def mismatch(self, stored: _reader.StoredLeaf, allow_dtype_cast: bool) -> str | None:
        if stored.kind != self.kind:
            return f"a {self.kind} in the target, saved as {_saved_as(stored)}"
        return None

    def convert(self, data: np.ndarray) -> Any:
        raw = data.tobytes()
        return raw.decode("utf-8") if self.kind == "str" else raw


@dataclasses.dataclass(frozen=True)
class _OwnValue(_Form):
    """A per-process leaf: this process reads its own value (see `_tree.PerProcess`)."""

    dtype: np.dtype
    target: PerProcess

    def mismatch(self, stored: _reader.StoredLeaf, allow_dtype_cast: bool) -> str | None:
        if stored.kind != "per_process":
            return f"a zarrckpt.PerProcess in the target, saved as {_saved_as(stored)}"
        return self._count_mismatch(stored) if self.target.strict else None

    def _count_mismatch(self, stored: _reader.StoredLeaf) -> str | None:
        if stored.processes == _multihost.process_count():
            return None
        return (f"saved by {stored.processes} process(es), restored by {_multihost.process_count()}: each "
                "process's value belongs to its part of the data; a target leaf "
                "zarrckpt.PerProcess(None, strict=False) gets itself back instead")

    def reads(self, stored: _reader.StoredLeaf) -> list[tuple[Region, Placement]]:
        return [((), {(): []})]

    def fetch(self, ckpt: _reader.Checkpoint, stored: _reader.StoredLeaf, box: Region,
              places: Placement) -> list[Any]:
        if (mismatch := self._count_mismatch(stored)) is None:
            return [((), PerProcess(ckpt.read_own(stored), self.target.strict))]
        if self.target.strict:
            raise CheckpointMismatchError(f"leaf {stored.where} of {ckpt.loc.url}: {mismatch}")
        return [((), self.target)]


def _saved_as(stored: _reader.StoredLeaf) -> str:
    return {"str": "a str", "bytes": "bytes", "per_process": "a zarrckpt.PerProcess"}.get(
        stored.kind, f"{stored.dtype} data")


@dataclasses.dataclass(frozen=True)
class _Sharded(_Form):
    """A jax.Array on `sharding`: each process reads what its own devices hold, and the
    main thread assembles host pieces (small leaves)."""

    dtype: np.dtype
    sharding: jax.sharding.Sharding

    def reads(self, stored: _reader.StoredLeaf) -> list[tuple[Region, Placement]]:
        me = _multihost.process_index()
        devices: Placement = {}
        for region, holders in _planning.replicas_of(self.sharding, stored.shape).items():
            if mine := [d for d in holders if d.process_index == me]:
                devices[region] = mine
        return [(box, {region: devices[region] for region in regions})
                for box, regions in _planning.plan_reads(list(devices), stored.chunks, stored.shape)]

    def build(self, stored: _reader.StoredLeaf, pieces: list[Any]) -> Any:
        by_region = dict(pieces)
        return jax.make_array_from_callback(stored.shape, self.sharding,
                                            lambda index: by_region[_planning.region_of(index, stored.shape)])


@dataclasses.dataclass(frozen=True)
class _ShardedByReaders(_Sharded):
    """A large jax.Array: the reader threads put each piece on its devices (one batched
    call per read, so jax overlaps the transfers)."""

    def fetch(self, ckpt: _reader.Checkpoint, stored: _reader.StoredLeaf, box: Region,
              places: Placement) -> list[Any]:
        pieces = super().fetch(ckpt, stored, box, places)
        return jax.device_put([piece for region, piece in pieces for _ in places[region]],
                              [device for region in places for device in places[region]])

    def build(self, stored: _reader.StoredLeaf, pieces: list[Any]) -> Any:
        return jax.make_array_from_single_device_arrays(stored.shape, self.sharding, pieces)


def _sharded(dtype: np.dtype, sharding: jax.sharding.Sharding, stored: _reader.StoredLeaf,
             broadcast: bool = False) -> _Form:
    """How to read a jax.Array on `sharding`. With `broadcast`, a leaf that several
    processes need is read once in total: on a staging sharding cut at chunk
    boundaries, or else by one reader per shard, then shared by device collectives."""
    if broadcast and _held_by_several_processes(sharding, stored.shape):
        staged = _staging_sharding(sharding, stored.shape, stored.chunks)
        if staged is not None:
            return _Broadcast(dtype, sharding, _sharded(dtype, staged, stored))
        if _summable(dtype):
            return _OneReader(dtype, sharding, _one_readers(sharding, stored))
    large = _dtypes.nbytes(stored.shape, dtype) >= _READER_PLACEMENT_BYTES
    return (_ShardedByReaders if large else _Sharded)(dtype, sharding)


@dataclasses.dataclass(frozen=True)
class _Broadcast(_Form):
    """Load and broadcast, cut: each process reads its slice of the leaf on the staging
    sharding (the target's, with the replica axes also cutting the leaf, at chunk
    boundaries), then one reshard moves the slices onto the target (see `_share`)."""

    dtype: np.dtype
    sharding: jax.sharding.Sharding  # the target's
    staged: _Form  # reads and builds the leaf on the staging sharding

    def reads(self, stored: _reader.StoredLeaf) -> list[tuple[Region, Placement]]:
        return self.staged.reads(stored)

    def fetch(self, ckpt: _reader.Checkpoint, stored: _reader.StoredLeaf, box: Region,
              places: Placement) -> list[Any]:
        return self.staged.fetch(ckpt, stored, box, places)

    def build(self, stored: _reader.StoredLeaf, pieces: list[Any]) -> Any:
        return self.staged.build(stored, pieces)


@dataclasses.dataclass(frozen=True)
class _OneReader(_Sharded):
    """Load and broadcast, whole: each chunk of each shard of the target is read by one
    device, of one of the processes holding that shard (dealt out chunk by chunk);
    every other replica holds zeros there, and a sum over the replicas (exact: on the
    bits, as integers) fills them in (see `_share`). For leaves the staging sharding
    cannot cut at chunk boundaries: small ones, whole in one chunk, and others."""

    readers: tuple[tuple[Region, jax.Device], ...] = ()  # the one device reading each part (`_one_readers`)

    def reads(self, stored: _reader.StoredLeaf) -> list[tuple[Region, Placement]]:
        me = _multihost.process_index()
        mine = [part for part, device in self.readers if device.process_index == me]
        return [(box, {part: [] for part in parts}) for box, parts in _planning.plan_reads(mine, stored.chunks,
                                                                                           stored.shape)]

    def build(self, stored: _reader.StoredLeaf, pieces: list[Any]) -> Any:
        readers = dict(self.readers)
        arrays = []
        for device, index in self.sharding.addressable_devices_indices_map(stored.shape).items():
            region = _planning.region_of(index, stored.shape)
            mine = [(part, piece) for part, piece in pieces if readers[part] == device]
            if not mine:  # made on the device: nothing to copy from the host
                arrays.append(jnp.zeros(_planning.region_shape(region), self.dtype, device=device))
                continue
            data = np.zeros(_planning.region_shape(region), self.dtype)
            for part, piece in mine:
                data[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(part, region))] = piece
            arrays.append(jax.device_put(data, device))
        return jax.make_array_from_single_device_arrays(stored.shape, self.sharding, arrays)


def _one_readers(sharding: jax.sharding.Sharding, stored: _reader.StoredLeaf) -> tuple[tuple[Region, jax.Device], ...]:
    """The one device reading each part of a leaf (a shard's overlap with a chunk): the
    first device (by id) of one of the processes holding the shard, taken in turn."""
    # Start the turn at a place of the leaf's own, so that many one-chunk leaves
    # spread over the processes too.
    readers, k = [], zlib.crc32(stored.name.encode())
    for region, devices in sorted(_planning.replicas_of(sharding, stored.shape).items()):
        processes = sorted({d.process_index for d in devices})
        for chunk in _planning.chunks_touching(region, stored.chunks, stored.shape):
            process = processes[k % len(processes)]
            k += 1
            readers.append((_planning.intersect(chunk, region), next(d for d in devices if d.process_index == process)))
    return tuple(readers)


def _held_by_several_processes(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> bool:
    if not isinstance(sharding, jax.sharding.NamedSharding) or _multihost.process_count() == 1:
        return False
    return any(len({d.process_index for d in devices}) > 1
               for devices in _planning.replicas_of(sharding, shape).values())


def _replica_axes(sharding: jax.sharding.NamedSharding) -> list[str]:
    """The mesh axes the spec leaves out: the target is replicated along them."""
    used = {a for e in sharding.spec if e is not None for a in (e if isinstance(e, tuple) else (e,))}
    return [a for a in sharding.mesh.axis_names if a not in used and sharding.mesh.shape[a] > 1]


def _staging_sharding(target: jax.sharding.NamedSharding, shape: tuple[int, ...],
                      chunks: tuple[int, ...]) -> jax.sharding.NamedSharding | None:
    """The target's sharding with every replica axis also cutting one dimension, where
    the cut falls on chunk boundaries (so no chunk is read twice); None when some
    replica axis finds no such dimension."""
    spec = list(target.spec) + [None] * (len(shape) - len(target.spec))
    entries = [[] if e is None else list(e) if isinstance(e, tuple) else [e] for e in spec]
    mesh = target.mesh
    for axis in _replica_axes(target):
        for dim, entry in enumerate(entries):
            pieces = math.prod(mesh.shape[a] for a in entry) * mesh.shape[axis]
            if shape[dim] % pieces == 0 and (shape[dim] // pieces) % chunks[dim] == 0:
                entry.append(axis)
                break
        else:
            return None
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
        *(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries)))


def _summable(dtype: np.dtype) -> bool:
    """Whether a sum over replicas can carry this dtype's bits exactly (as integers)."""
    return dtype.kind != "c" and dtype.itemsize in (1, 2, 4, 8)


def _share(requests: list["_Request"], done: dict[str, Any]) -> None:
    """Load and broadcast's second half for `requests`, whose staged arrays are in
    `done` and are replaced there by the target's arrays, in one compiled program
    (collective: every process calls it with the same leaves, as they complete in the
    same order everywhere): a staged leaf is resharded onto its target, a leaf read by
    one replica is summed over the replicas. XLA's collectives (gloo on CPU, NCCL or
    ICI on accelerators) carry the bytes between hosts."""
    staged = [done[r.stored.name] for r in requests]
    moved = _sharing_program(tuple(r.form for r in requests))(*staged)
    for request, array, old in zip(requests, moved, staged):
        done[request.stored.name] = array
        old.delete()


@functools.lru_cache(maxsize=16)
def _sharing_program(forms: tuple[_Form, ...]) -> Callable[..., Any]:
    """One jitted program per set of leaves (restoring the same state again, as an
    evaluator does, compiles nothing new)."""
    shardings = tuple(form.sharding for form in forms)  # type: ignore[attr-defined]
    return jax.jit(lambda *xs: tuple(_shared(x, f) for x, f in zip(xs, forms)), out_shardings=shardings)


def _shared(x: jax.Array, form: _Form) -> jax.Array:
    """Inside the program: one leaf as its target holds it."""
    if isinstance(form, _Broadcast):
        return x  # out_shardings reshards it
    assert isinstance(form, _OneReader) and isinstance(form.sharding, jax.sharding.NamedSharding)
    same = np.dtype(f"uint{x.dtype.itemsize * 8}")
    wide = np.dtype(np.int64) if x.dtype.itemsize == 8 else np.dtype(np.int32)
    axes = tuple(_replica_axes(form.sharding))

    def total(block: jax.Array) -> jax.Array:
        # A sum with zeros is exact on the bits (as integers): -0.0 and NaN payloads survive.
        boolean = block.dtype == np.bool_
        bits = block.astype(same) if boolean else jax.lax.bitcast_convert_type(block, same)
        summed = jax.lax.convert_element_type(jax.lax.psum(jax.lax.convert_element_type(bits, wide), axes), same)
        return summed.astype(np.bool_) if boolean else jax.lax.bitcast_convert_type(summed, block.dtype)

    spec = form.sharding.spec
    return jax.shard_map(total, mesh=form.sharding.mesh, in_specs=spec, out_specs=spec)(x)


@dataclasses.dataclass(frozen=True)
class _Request:
    """One leaf to restore and the form it must come back in."""

    stored: _reader.StoredLeaf
    form: _Form
    old: jax.Array | None = None  # the target array this replaces, freed before reading (with donation)

    @property
    def nbytes(self) -> int:
        return _dtypes.nbytes(self.stored.shape, self.form.dtype)


def load_pytree(
    url: str,
    target: Any = None,
    *,
    storage_options: dict[str, Any] | None = None,
    partial: bool = False,
    allow_dtype_cast: bool = False,
    donate_target: bool = False,
    load_and_broadcast: bool = True,
    max_inflight_bytes: int = _concurrency.DEFAULT_MAX_INFLIGHT_BYTES,
    max_workers: int | None = None,
    progress: bool | None = None,
) -> Any:
    """Restores the committed checkpoint at `url`.

    Each process reads only what its own devices need, so it works whatever the
    process count; under `jax.distributed` every process calls it with the same
    target to get one consistent global state. Collective when a leaf of the target
    is held by several processes (data-parallel replicas) and `load_and_broadcast`
    is on: that leaf is read once in total and shared over device collectives.

    Args:
      url: a local path or fsspec URL of one checkpoint (not a step directory parent).
      target: what to restore into, a pytree with the saved structure whose leaves are
        jax.Array (shape, dtype and sharding are taken from it), jax.ShapeDtypeStruct
        (with a sharding, or none for the default device), jax.sharding.Sharding (shape
        and dtype from the checkpoint), numpy arrays or scalars, Python scalars, a str
        or bytes (any: the saved one comes back), or `zarrckpt.PerProcess(None)` (this
        process's saved value comes back). None restores the saved tree as nested
        dicts/lists of numpy arrays and scalars, str, bytes and PerProcess values.
      partial: restore only the leaves the target has; the checkpoint's other leaves
        are skipped and never read. The target's leaves must all be in the checkpoint.
      allow_dtype_cast: convert leaves whose saved dtype differs from the target's;
        without it such a leaf is a mismatch.
      donate_target: free each jax.Array of the target just before its replacement is
        read, so that peak device memory stays near one copy of the state; any other
        reference to those arrays dies with them (an `eqx.filter` of a model, say).
        Off by default: nothing the caller holds is freed. Nothing is freed if
        validation fails; if reading fails after it began, the arrays already freed
        are gone (the target is unusable, the checkpoint unchanged): restore again.
      load_and_broadcast: where several processes need the same part of a leaf (its
        target sharding replicates it across hosts), each process reads a distinct
        part of it (the replica axes of the target's NamedSharding cut the leaf at
        chunk boundaries, or else each chunk is read by one replica) and a compiled
        program sends the parts to the replicas over the device network, so the store
        serves each byte once, not once per host. Leaves
        wait on the devices, staged, until shared in groups of about
        `max_inflight_bytes` (one leaf more at most): that is the extra device memory
        it costs. Off: every process reads all it needs itself.
      max_inflight_bytes: bound on host bytes read and not yet placed on devices.
      max_workers: concurrent reads (default: one per core, 8 to 32, on a local disk;
        128 on an object store; 100 on GCS).
      progress: show a progress bar on process 0 (default: when stderr is a terminal).

    Raises:
      TypeError, ValueError: an option of the wrong type or value (named).
      CheckpointNotFoundError: nothing committed at `url`, or it was deleted while
        being read (by retention, say).
      CheckpointMismatchError: the target does not match; lists every missing and
        unexpected key path and every shape and dtype difference. Nothing was read.
      CheckpointCorruptError: a chunk or metadata the checkpoint declares is missing
        or damaged.
    """
    options = LoadOptions(allow_dtype_cast, donate_target, partial, load_and_broadcast, max_inflight_bytes,
                          max_workers, progress)
    return load(_storage.resolve(url, storage_options), target, options)


def load(loc: _storage.Location, target: Any, options: LoadOptions) -> Any:
    """`load_pytree` of the checkpoint at `loc`."""
    return load_opened(_reader.open_checkpoint(loc), target, options)


def load_opened(ckpt: _reader.Checkpoint, target: Any, options: LoadOptions) -> Any:
    """`load_pytree` of the opened checkpoint `ckpt`. Raises CheckpointNotFoundError if
    it was deleted or replaced before its last read was checked (see `_commit`)."""
    started = time.perf_counter()
    if target is None:
        requests = [_Request(s, _saved_form(s)) for s in ckpt.leaves.values()]
        treedef = None
    else:
        requests, treedef = _match(ckpt, target, options.allow_dtype_cast, options.partial,
                                   options.load_and_broadcast)
    total = sum(r.nbytes for r in requests)
    with _progress.bar(f"restoring {ckpt.loc.url}", total, options.progress) as advance:
        values = _read_all(ckpt, requests, options, advance)
    ckpt.check_unchanged()  # one small read: these values are all of one save
    if treedef is None:
        result = _tree.rebuild(ckpt.spec, lambda rec: values[rec["name"]])
    else:
        result = jax.tree_util.tree_unflatten(treedef, [values[r.stored.name] for r in requests])
    seconds = time.perf_counter() - started
    log.info("restored %s: %d leaves, %.3f GB in %.2fs (%.2f GB/s)", ckpt.loc.url, len(requests),
             total / 1e9, seconds, total / 1e9 / max(seconds, 1e-9))
    return result


def _match(ckpt: _reader.Checkpoint, target: Any, allow_dtype_cast: bool, partial: bool,
           load_and_broadcast: bool) -> tuple[list[_Request], Any]:
    """One request per target leaf; raises listing every mismatch before any read. With
    `partial`, the checkpoint's leaves that the target lacks are skipped, never read."""
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
        request, shape = _request_for(leaf, stored, where, load_and_broadcast)
        requests.append(request)
        if shape != stored.shape:
            problems.append(f"{where}: shape {stored.shape} in the checkpoint, {shape} in the target")
        elif (mismatch := request.form.mismatch(stored, allow_dtype_cast)) is not None:
            problems.append(f"{where}: {mismatch}")
        elif not allow_dtype_cast and request.form.dtype != stored.dtype and _scalar_fits(stored, request.form.dtype):
            if (inexact := _inexact_scalar(ckpt, stored, request.form.dtype)) is not None:
                problems.append(f"{where}: {inexact}")
    extra = [stored.where for name, stored in ckpt.leaves.items() if name not in seen]
    if not partial:
        problems += [f"{where}: in the checkpoint but not in the target" for where in extra]
    if problems:
        hint = ("\n(pass partial=True to restore only the target's leaves and skip the checkpoint's others)"
                if extra and not partial else "")
        raise CheckpointMismatchError(
            f"checkpoint {ckpt.loc.url} does not match the target ({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems) + hint
        )
    return requests, treedef


def _scalar_fits(stored: _reader.StoredLeaf, dtype: np.dtype) -> bool:
    """Whether a saved Python scalar may restore into a 0-d target of `dtype`: one of its
    kind (an int into any integer dtype, a float into any float dtype...), as
    `jax.eval_shape` makes int32 and float32 targets of Python 0 and 0.0. Its value
    must then fit (`_inexact_scalar`)."""
    return stored.kind in _PY_SCALARS and stored.shape == () and _dtypes.kind(dtype) in _TARGET_KINDS[stored.kind]


def _inexact_scalar(ckpt: _reader.Checkpoint, stored: _reader.StoredLeaf, dtype: np.dtype) -> str | None:
    """Reads a saved Python scalar (one small read); says why it does not fit `dtype`:
    an int or bool must be exactly representable; a float or complex rounds to the
    nearest value, as JAX rounds a Python float into float32, but must not overflow
    to infinity or vanish to zero."""
    saved = ckpt.read(stored, ())
    with np.errstate(all="ignore"):
        converted = saved.astype(dtype)
        back = converted.astype(stored.dtype)
    if stored.kind in ("float", "complex"):
        parts = [(saved.real, back.real), (saved.imag, back.imag)] if stored.kind == "complex" else [(saved, back)]
        if all(np.isfinite(a) == np.isfinite(b) and (a == 0) == (b == 0) for a, b in parts if not np.isnan(a)):
            return None
    elif np.array_equal(back, saved):
        return None
    return f"saved Python {stored.kind} {saved.item()!r} is not representable as {dtype}"


def _saved_form(stored: _reader.StoredLeaf) -> _Form:
    """The form a leaf comes back in without a target: numpy arrays and scalars, Python
    scalars, and typed PRNG keys as keys on the default device."""
    if stored.kind in _PY_SCALARS:
        return _PythonScalar(stored.dtype, stored.kind)
    if stored.kind == "numpy_scalar":
        return _NumpyScalar(stored.dtype)
    if stored.kind == "prng_key":
        return _PrngKeys(stored.dtype, None)
    if stored.kind in ("str", "bytes"):
        return _Text(stored.dtype, stored.kind)
    if stored.kind == "per_process":
        return _OwnValue(stored.dtype, PerProcess(None))
    return _Numpy(stored.dtype)


def _request_for(leaf: Any, stored: _reader.StoredLeaf, where: str,
                 broadcast: bool) -> tuple[_Request, tuple[int, ...]]:
    """How a target leaf asks to be restored, and the shape it expects."""
    if stored.kind == "prng_key" and isinstance(leaf, jax.sharding.Sharding):
        # The saved kind decides: typed keys come back typed on a target that only
        # says where they go.
        return _Request(stored, _PrngKeys(stored.dtype, leaf)), stored.shape
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) and _dtypes.is_prng_key(leaf.dtype):
        # Typed keys are stored as their key data: compare that shape, and rebuild keys.
        data_shape = tuple(jax.eval_shape(jax.random.key_data, leaf).shape)
        old = leaf if isinstance(leaf, jax.Array) else None
        return _Request(stored, _PrngKeys(stored.dtype, leaf.sharding), old), data_shape
    if isinstance(leaf, jax.Array):
        return (_Request(stored, _sharded(np.dtype(leaf.dtype), leaf.sharding, stored, broadcast), leaf),
                tuple(leaf.shape))
    if isinstance(leaf, jax.ShapeDtypeStruct):
        dtype = np.dtype(leaf.dtype)
        form = _DefaultDevice(dtype) if leaf.sharding is None else _sharded(dtype, leaf.sharding, stored, broadcast)
        return _Request(stored, form), tuple(leaf.shape)
    if isinstance(leaf, jax.sharding.Sharding):
        return _Request(stored, _sharded(stored.dtype, leaf, stored, broadcast)), stored.shape
    if isinstance(leaf, np.ndarray):
        return _Request(stored, _Numpy(leaf.dtype)), leaf.shape
    if isinstance(leaf, np.generic):
        return _Request(stored, _NumpyScalar(leaf.dtype)), ()
    if isinstance(leaf, (bool, int, float, complex)):
        return _Request(stored, _PythonScalar(stored.dtype, type(leaf).__name__)), ()
    if isinstance(leaf, (str, bytes)):  # any text of that kind: the stored length is taken
        return _Request(stored, _Text(stored.dtype, type(leaf).__name__)), stored.shape
    if isinstance(leaf, PerProcess):
        return _Request(stored, _OwnValue(stored.dtype, leaf)), stored.shape
    raise UnsupportedLeafError(
        f"target leaf {where} is a {type(leaf).__qualname__}; expected jax.Array, jax.ShapeDtypeStruct, "
        "a Sharding, a numpy array or scalar, a Python scalar, a str, bytes or a zarrckpt.PerProcess"
    )


@dataclasses.dataclass(frozen=True)
class _Read:
    """One box of one leaf to read, the regions to cut from it, and where they go."""

    request: _Request
    box: Region
    places: Placement
    last: bool  # the leaf's last read: once it is in, the leaf can be built

    @property
    def nbytes(self) -> int:
        return _dtypes.nbytes(_planning.region_shape(self.box), self.request.form.dtype)

    def fetch(self, ckpt: _reader.Checkpoint) -> list[Any]:
        return self.request.form.fetch(ckpt, self.request.stored, self.box, self.places)


def _read_all(ckpt: _reader.Checkpoint, requests: list[_Request], options: LoadOptions,
              advance: Callable[[int], None]) -> dict[str, Any]:
    """Reads every request, leaf by leaf in order, with bounded host memory.

    Pool threads read (and, for large leaves, put each piece on its devices); this
    thread builds the leaves in order as their last read comes in.
    """
    done: dict[str, Any] = {}
    reads: list[_Read] = []
    for request in requests:
        groups = request.form.reads(request.stored)
        if not groups:  # no device of this process holds any of it
            done[request.stored.name] = request.form.build(request.stored, [])
        reads += [_Read(request, box, places, i == len(groups) - 1) for i, (box, places) in enumerate(groups)]
    donated: set[int] = set()

    def donate(read: _Read) -> None:
        old = read.request.old
        if options.donate_target and old is not None and id(old) not in donated and not old.is_deleted():
            donated.add(id(old))
            old.delete()

    budget = _concurrency.ByteBudget(options.max_inflight_bytes)
    pieces: list[Any] = []
    # Leaves read for load and broadcast wait on the devices (staged) until shared, in
    # groups of about max_inflight_bytes (that bounds the extra memory), the same
    # groups in the same order on every process, as sharing is collective.
    groups = _groups([r for r in requests if isinstance(r.form, (_Broadcast, _OneReader))],
                     options.max_inflight_bytes)

    def share_ready() -> None:
        while groups and all(r.stored.name in done for r in groups[0]):
            _share(groups.pop(0), done)

    share_ready()
    with _concurrency.Operation(options.max_workers or ckpt.loc.concurrency, "read") as op:
        for read, result in op.window(reads, lambda r: r.fetch(ckpt), budget=budget, nbytes=lambda r: r.nbytes,
                                      admit=donate):
            budget.release(read.nbytes)
            pieces += result
            if read.last:
                request = read.request
                done[request.stored.name] = request.form.build(request.stored, pieces)
                advance(request.nbytes)
                pieces = []
                share_ready()
    return done


def _groups(requests: list[_Request], max_bytes: int) -> list[list[_Request]]:
    """`requests` cut, in order, into runs of at least `max_bytes` (the last: what is left)."""
    groups: list[list[_Request]] = [[]]
    for request in requests:
        if sum(r.nbytes for r in groups[-1]) >= max_bytes:
            groups.append([])
        groups[-1].append(request)
    return [group for group in groups if group]
