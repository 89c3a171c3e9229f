"""Matching a target to a checkpoint: for each target leaf, the saved leaf it restores,
and the form it comes back in (`Form`: what to read, and how to build the value).

Nothing is read here but the few saved Python scalars whose value decides whether they
fit their target: the whole target is checked, and every mismatch reported at once,
before any array is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .._format import dtypes as _dtypes, tree as _tree
from .._format.tree import PerProcess
from .._util import multihost as _multihost, permute as _permute
from .._util.regions import Region, region_of, region_shape, relative
from ..errors import CheckpointMismatchError, UnsupportedLeafError
from . import (
    abstract_mesh as _abstract_mesh,
    checkpoint as _reader,
    mismatch as _mismatch,
    plan as _plan,
    renames as _renames,
)
from .plan import Placement

# Leaves at least this large are put on their devices by the reader threads (transfers
# overlap); smaller ones by the main thread from host pieces (per-call cost dominates,
# and threads contending for the GIL made a 1000-leaf restore 3x slower). On CPU devices
# nothing is transferred (a put takes the memory of a box, see `checkpoint.aligned_empty`,
# or of a piece cut from it at a 64-byte boundary, as its own: the box then lives as long
# as the array; a piece elsewhere is copied), and one call per leaf beats one per piece
# up to larger leaves (an 80 MiB model of 27 tensors onto 8 devices: 2x faster, warm). One
# leaf's host pieces are what a restore holds beyond its byte budget.
_READER_PLACEMENT_BYTES = 2**20
_CPU_READER_PLACEMENT_BYTES = 2**24
_PY_SCALARS = {"bool": bool, "int": int, "float": float, "complex": complex}
_SCALAR_KINDS = {"bool": "b", "int": "iub", "float": "f", "complex": "c"}
_TARGET_KINDS = {"bool": "b", "int": "iu", "float": "f", "complex": "c"}  # of 0-d arrays a Python scalar fits


class Form:
    """How a target leaf wants its value: what to read, and how to build the value.

    This base reads the whole array to the host and returns it as a numpy array.
    """

    dtype: np.dtype  # the values' dtype once read (converted from the stored one)
    whole_on_host: ClassVar[bool] = True  # read whole by every process that restores it

    def mismatch(self, stored: _reader.StoredLeaf, allow_dtype_cast: bool) -> str | None:
        if stored.kind == "prng_key":
            return (f"typed PRNG keys ({stored.prng_impl}) in the checkpoint, {self.dtype} data in the target: "
                    "restore them as keys (a key array, a ShapeDtypeStruct of a key dtype, or a Sharding as the "
                    "target leaf), then take jax.random.key_data of them if raw data is wanted")
        if self.dtype != stored.dtype and not allow_dtype_cast and not _scalar_fits(stored, self.dtype):
            return (f"dtype {stored.dtype} in the checkpoint, {self.dtype} in the target "
                    "(pass allow_dtype_cast=True to convert)")
        return None

    def reads(self, stored: _reader.StoredLeaf, process: int) -> list[tuple[Region, Placement]]:
        """The boxes `process` reads, each with the regions cut from it and where they go."""
        full: Region = tuple((0, d) for d in stored.shape)
        return [(full, {full: []})]

    def fetch(self, ckpt: _reader.Checkpoint, stored: _reader.StoredLeaf, box: Region,
              places: Placement) -> list[Any]:
        """On a reader thread: reads `box` and cuts out each region, as (region, host array)."""
        return cut(ckpt.read(stored, box), self.dtype, box, places)

    def build(self, stored: _reader.StoredLeaf, pieces: list[Any]) -> Any:
        """On the main thread: the value, from every piece `fetch` returned."""
        ((_, data),) = pieces
        return self.convert(data)

    def convert(self, data: np.ndarray) -> Any:
        return data

    def tie(self, value: Any) -> Any:
        """The value of a target leaf restored from the same saved leaf as another (tied
        weights), made of that one's restored `value`: nothing more is read. Its buffers
        are its own, never `value`'s (a step donating both leaves would donate one buffer
        twice)."""
        host = jax.device_get(value) if isinstance(value, jax.Array) else value
        return self.convert(np.asarray(host).astype(self.dtype))


def cut(data: np.ndarray, dtype: np.dtype, box: Region, places: Placement) -> list[tuple[Region, np.ndarray]]:
    """The values `data` read of `box`, in `dtype`, cut into the regions of `places`."""
    data = data if data.dtype == dtype else data.astype(dtype)
    return [(region, data[relative(region, box)]) for region in places]


@dataclasses.dataclass(frozen=True)
class Numpy(Form):
    dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class NumpyScalar(Form):
    dtype: np.dtype

    def convert(self, data: np.ndarray) -> Any:
        return data[()]


@dataclasses.dataclass(frozen=True)
class PythonScalar(Form):
    dtype: np.dtype  # the stored dtype: a Python scalar has none of its own
    type_name: str

    def mismatch(self, stored: _reader.StoredLeaf, allow_dtype_cast: bool) -> str | None:
        if stored.dtype.kind in _SCALAR_KINDS[self.type_name]:
            return None
        saved = f"a Python {stored.kind}" if stored.kind in _PY_SCALARS else f"dtype {stored.dtype}"
        if stored.dtype.kind not in "biuf" or stored.shape:  # a complex number has no real value
            return f"{saved} in the checkpoint, a Python {self.type_name} in the target"
        if allow_dtype_cast:
            return None  # converted as Python converts: float(3), int(3.9) == 3
        return (f"{saved} in the checkpoint, a Python {self.type_name} in the target (pass allow_dtype_cast=True "
                "to convert it)")

    def convert(self, data: np.ndarray) -> Any:
        return _PY_SCALARS[self.type_name](data.item())


@dataclasses.dataclass(frozen=True)
class DefaultDevice(Form):
    """An array placed as jax places what is given no placement (uncommitted), on the
    default device, or on `device` where an uncommitted target leaf was."""

    dtype: np.dtype
    device: Any = None

    def convert(self, data: np.ndarray) -> Any:
        # An array already placed (by `DefaultDeviceByReaders`) is returned as it is.
        if self.device is None:
            return jax.device_put(data)
        with jax.default_device(self.device):
            return jax.device_put(data)


@dataclasses.dataclass(frozen=True)
class DefaultDeviceByReaders(DefaultDevice):
    """A large array placed as `DefaultDevice` places it, by the reader thread (transfers
    overlap); the default device is per thread, so `device` is set there."""

    def fetch(self, ckpt: _reader.Checkpoint, stored: _reader.StoredLeaf, box: Region,
              places: Placement) -> list[Any]:
        return [(region, self.convert(data)) for region, data in super().fetch(ckpt, stored, box, places)]


def default_device(dtype: np.dtype, device: jax.Device, stored: _reader.StoredLeaf) -> Form:
    """How to read a leaf that comes back uncommitted on `device`, as `jax.device_put` of
    host data places it."""
    cpu = getattr(device, "platform", None) == "cpu"
    large = _dtypes.nbytes(stored.shape, dtype) >= (_CPU_READER_PLACEMENT_BYTES if cpu else _READER_PLACEMENT_BYTES)
    return (DefaultDeviceByReaders if large else DefaultDevice)(dtype, device)


@dataclasses.dataclass(frozen=True)
class PrngKeys(Form):
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
        if self.sharding is None or self.sharding.is_fully_addressable:
            keys = jax.random.wrap_key_data(data, impl=stored.prng_impl)
            return keys if self.sharding is None else jax.device_put(keys, self.sharding)
        # Across processes: each puts its own shards of the key data (device_put would
        # ask the others), then wraps them where they are.
        spread = jax.make_array_from_callback(data.shape, self.sharding, lambda index: data[index])
        return jax.random.wrap_key_data(spread, impl=stored.prng_impl)

    def tie(self, value: Any) -> Any:
        return jax.device_put(value, self.sharding, may_alias=False)


@dataclasses.dataclass(frozen=True)
class Text(Form):
    """A str or bytes leaf, stored as its bytes (UTF-8 for a str)."""

    dtype: np.dtype
    type_name: str  # "str" or "bytes"

    def mismatch(self, stored: _reader.StoredLeaf, allow_dtype_cast: bool) -> str | None:
        if stored.kind != self.type_name:
            return f"a {self.type_name} in the target, saved as {_saved_as(stored)}"
        return None

    def convert(self, data: np.ndarray) -> Any:
        raw = data.tobytes()
        return raw.decode("utf-8") if self.type_name == "str" else raw

    def tie(self, value: Any) -> Any:
        return value


@dataclasses.dataclass(frozen=True)
class OwnValue(Form):
    """A per-process leaf: this process reads its own value (see `_tree.PerProcess`)."""

    dtype: np.dtype
    target: PerProcess
    whole_on_host: ClassVar[bool] = False

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

    def reads(self, stored: _reader.StoredLeaf, process: int) -> list[tuple[Region, Placement]]:
        return [((), {(): []})]

    def fetch(self, ckpt: _reader.Checkpoint, stored: _reader.StoredLeaf, box: Region,
              places: Placement) -> list[Any]:
        if (mismatch := self._count_mismatch(stored)) is None:
            return [((), PerProcess(ckpt.read_own(stored, _multihost.process_index()), self.target.strict))]
        if self.target.strict:
            raise CheckpointMismatchError(f"leaf {stored.where} of {ckpt.url}: {mismatch}")
        return [((), self.target)]

    def tie(self, value: Any) -> Any:
        return value


@dataclasses.dataclass(frozen=True)
class EveryValue(Form):
    """A per-process leaf restored without a target by another number of processes than
    saved it: every process's value, as a dict by process index."""

    dtype: np.dtype
    whole_on_host: ClassVar[bool] = False

    def reads(self, stored: _reader.StoredLeaf, process: int) -> list[tuple[Region, Placement]]:
        return [((), {(): []})]

    def fetch(self, ckpt: _reader.Checkpoint, stored: _reader.StoredLeaf, box: Region,
              places: Placement) -> list[Any]:
        return [((), {process: ckpt.read_own(stored, process) for process in range(stored.processes or 0)})]

    def tie(self, value: Any) -> Any:
        return value


def _saved_as(stored: _reader.StoredLeaf) -> str:
    return {"str": "a str", "bytes": "bytes", "per_process": "a zarrckpt.PerProcess"}.get(
        stored.kind, f"{stored.dtype} data")


@dataclasses.dataclass(frozen=True)
class Sharded(Form):
    """A jax.Array on `sharding`: each process reads what its own devices hold, and the
    main thread assembles host pieces (small leaves)."""

    dtype: np.dtype
    sharding: jax.sharding.Sharding
    whole_on_host: ClassVar[bool] = False

    def reads(self, stored: _reader.StoredLeaf, process: int) -> list[tuple[Region, Placement]]:
        return _plan.sharded_reads(self.sharding, stored.shape, stored.chunks, process)

    def build(self, stored: _reader.StoredLeaf, pieces: list[Any]) -> Any:
        by_region = dict(pieces)

        def piece(index: tuple[slice, ...] | None) -> Any:
            assert index is not None  # jax asks for each shard by its index
            return by_region[region_of(index, stored.shape)]

        return jax.make_array_from_callback(stored.shape, self.sharding, piece)

    def tie(self, value: Any) -> Any:
        if isinstance(value, jax.Array):
            return jax.device_put(value, self.sharding, may_alias=False).astype(self.dtype)
        data = np.asarray(value).astype(self.dtype)
        return jax.make_array_from_callback(data.shape, self.sharding, lambda index: data[index])


@dataclasses.dataclass(frozen=True)
class ShardedByReaders(Sharded):
    """A large jax.Array: the reader threads put each piece on its devices (one batched
    call per read, so jax overlaps the transfers)."""

    def fetch(self, ckpt: _reader.Checkpoint, stored: _reader.StoredLeaf, box: Region,
              places: Placement) -> list[Any]:
        pieces = super().fetch(ckpt, stored, box, places)
        return jax.device_put([piece for region, piece in pieces for _ in places[region]],
                              [device for region in places for device in places[region]])

    def build(self, stored: _reader.StoredLeaf, pieces: list[Any]) -> Any:
        return jax.make_array_from_single_device_arrays(stored.shape, self.sharding, pieces)


def sharded(dtype: np.dtype, sharding: jax.sharding.Sharding, stored: _reader.StoredLeaf,
            broadcast: bool = False) -> tuple[Form, Share | None]:
    """How to read a jax.Array on `sharding`, and how to share it after. With `broadcast`,
    a leaf that several processes need is read once in total: on a staging sharding cut
    at chunk boundaries (then resharded), or else by one reader per part (then summed
    over the replicas), and shared by device collectives (see `broadcast`)."""
    if (broadcast and isinstance(sharding, jax.sharding.NamedSharding)
            and _plan.held_by_several_processes(sharding, stored.shape)):
        staged = _plan.staging_sharding(sharding, stored.shape, stored.chunks)
        if staged is not None:
            return sharded(dtype, staged, stored)[0], Share(sharding, summed=False, staging=staged)
        if _permute.as_bits(dtype):
            readers = _plan.one_readers(sharding, stored.shape, stored.chunks, stored.name)
            return OneReader(dtype, sharding, readers), Share(sharding, summed=True)
    cpu = all(getattr(device, "platform", None) == "cpu" for device in sharding.device_set)
    large = _dtypes.nbytes(stored.shape, dtype) >= (_CPU_READER_PLACEMENT_BYTES if cpu else _READER_PLACEMENT_BYTES)
    return (ShardedByReaders if large else Sharded)(dtype, sharding), None


@dataclasses.dataclass(frozen=True)
class Share:
    """Load and broadcast's second half for one leaf: onto the target's `sharding`, by a
    reshard of the staged slices, or (`summed`) by a sum over the replicas of what one
    replica read of each part, the others holding zeros there. With `routes` (the local
    tier's peer copies, see `_restore.copies`; a slow process's reads done by another,
    see `_restore.relief`), the staged leaf comes with one array of blocks per route,
    read by peers, which each route's permute sends to the devices holding them first."""

    sharding: jax.sharding.NamedSharding
    summed: bool
    routes: tuple[tuple[tuple[int, int], ...], ...] = ()
    staging: jax.sharding.NamedSharding | None = None  # the staged slices' sharding, when not `summed`


@dataclasses.dataclass(frozen=True)
class OneReader(Sharded):
    """Load and broadcast, whole: each chunk of each shard of the target is read by one
    device, of one of the processes holding that shard (dealt out chunk by chunk);
    every other replica holds zeros there, and a sum over the replicas (exact: on the
    bits, as integers) fills them in (see `broadcast`). For leaves the staging sharding
    cannot cut at chunk boundaries: small ones, whole in one chunk, and others."""

    readers: tuple[tuple[Region, jax.Device], ...] = ()  # the one device reading each part (`plan.one_readers`)

    def reads(self, stored: _reader.StoredLeaf, process: int) -> list[tuple[Region, Placement]]:
        return _plan.one_reader_reads(self.readers, stored.shape, stored.chunks, process)

    def build(self, stored: _reader.StoredLeaf, pieces: list[Any]) -> Any:
        readers = dict(self.readers)
        arrays = []
        for device, index in self.sharding.addressable_devices_indices_map(stored.shape).items():
            assert index is not None  # a device's own index
            region = region_of(index, stored.shape)
            mine = [(part, piece) for part, piece in pieces if readers[part] == device]
            if not mine:  # made on the device: nothing to copy from the host
                arrays.append(jnp.zeros(region_shape(region), self.dtype, device=device))
                continue
            data = np.zeros(region_shape(region), self.dtype)
            for part, piece in mine:
                data[relative(part, region)] = piece
            arrays.append(jax.device_put(data, device))
        return jax.make_array_from_single_device_arrays(stored.shape, self.sharding, arrays)


@dataclasses.dataclass(frozen=True)
class Request:
    """One leaf to restore: the form it must come back in, how it is shared after it is
    read (load and broadcast), and the target array it replaces."""

    stored: _reader.StoredLeaf
    form: Form
    share: Share | None = None
    old: jax.Array | None = None  # freed just before the leaf is read, with donation

    @property
    def nbytes(self) -> int:
        return _dtypes.nbytes(self.stored.shape, self.form.dtype)


@dataclasses.dataclass(frozen=True)
class Read:
    """A target leaf restored from the saved leaf `name`, read for it."""

    name: str

    def value(self, values: Mapping[str, Any]) -> Any:
        return values[self.name]


@dataclasses.dataclass(frozen=True)
class Tied:
    """A target leaf renamed onto a saved leaf another target leaf restores from: made
    of that one's value, in its own `form`."""

    name: str
    form: Form

    def value(self, values: Mapping[str, Any]) -> Any:
        return self.form.tie(values[self.name])


@dataclasses.dataclass(frozen=True)
class Kept:
    """A target leaf the checkpoint lacks, restored as itself (`fallback=True`)."""

    leaf: Any

    def value(self, values: Mapping[str, Any]) -> Any:
        return self.leaf


@dataclasses.dataclass(frozen=True)
class Assembly:
    """How the restored tree is made of the values read (by saved name): one source per
    target leaf, in the order of `treedef`'s leaves."""

    treedef: Any
    sources: list[Read | Tied | Kept]

    def build(self, values: Mapping[str, Any]) -> Any:
        return jax.tree_util.tree_unflatten(self.treedef, [source.value(values) for source in self.sources])

    def kept(self) -> tuple[int, int]:
        """How many target leaves fell back to their own values, and their bytes."""
        kept = [source.leaf for source in self.sources if isinstance(source, Kept)]
        return len(kept), sum(int(np.asarray(leaf).nbytes) if not isinstance(leaf, jax.Array) else leaf.nbytes
                              for leaf in kept if not isinstance(leaf, (str, bytes)))


def match(ckpt: _reader.Checkpoint, target: Any, allow_dtype_cast: bool, partial: bool,
          load_and_broadcast: bool, *, values: bool = True, rename: _renames.Rename | None = None,
          fallback: bool = False) -> tuple[list[Request], Assembly]:
    """One request per saved leaf to read, and how the target's leaves are made of them;
    raises listing every mismatch before any read. With `partial`, the checkpoint's
    leaves that the target lacks are skipped, never read. Without `values`, saved Python
    scalars are not read to check that they fit their target (a process with no copy of
    the local tier's step leaves that to others). `rename` gives the checkpoint's name of
    each target leaf's (None: not from the checkpoint); target leaves renamed onto one
    saved leaf read it once, in the saved dtype where one of them has it, and the
    others are made of that one's value. With `fallback`, target leaves the checkpoint lacks are
    kept as they are (each must be a concrete value)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    to_saved = rename or _renames.unchanged
    problems: list[_mismatch.Problem] = []
    requests: list[Request] = []
    sources: list[Read | Tied | Kept] = []
    renamed: dict[str, tuple[str, str]] = {}  # of the target's leaves the checkpoint lacks: own name, name looked up
    looked_up: dict[str, _mismatch.Shaped] = {}  # the names looked up of the target's leaves the checkpoint lacks
    concrete = True  # whether each of those is a value fallback=True can keep
    readers: dict[str, tuple[int, int, Any, str]] = {}  # by saved name: its request's index, its Read's, its leaf
    for path, leaf in flat:
        where = _tree.describe_path(path)
        own = ckpt.name_of(tuple(path))
        name = to_saved(own)
        if name is None or (stored := ckpt.leaves.get(name)) is None:
            if fallback and _concrete(leaf):
                sources.append(Kept(leaf))
                continue
            concrete = concrete and _concrete(leaf)
            text = (_mismatch.MISSING if name == own else
                    _mismatch.RENAMED_AWAY if name is None else _mismatch.RENAMED_MISSING)
            if fallback:
                text += (", and fallback=True keeps only a concrete target value (a jax.Array, numpy array or "
                         f"scalar, a Python scalar, str or bytes), not a {type(leaf).__qualname__}")
            if name is not None:
                looked_up[where] = (name, _shape_of(leaf))
                if name != own:
                    renamed[where] = (own, name)
            problems.append((path, text))
            continue
        if name not in readers:
            request, shape = _request_for(leaf, stored, where, load_and_broadcast)
            readers[name] = (len(requests), len(sources), leaf, where)
            requests.append(request)
            sources.append(Read(name))
        else:
            # A leaf tied to one read is made of its value, on the devices: never staged to share.
            request, shape = _request_for(leaf, stored, where, False)
            at, read_at, first, first_where = readers[name]
            if requests[at].form.dtype != stored.dtype and request.form.dtype == stored.dtype:
                # Read in the saved dtype: no tied leaf is made of values cast once already.
                sources[read_at] = Tied(name, _request_for(first, stored, first_where, False)[0].form)
                if load_and_broadcast:
                    request = _request_for(leaf, stored, where, True)[0]
                requests[at] = request
                readers[name] = (at, len(sources), leaf, where)
                sources.append(Read(name))
            else:
                sources.append(Tied(name, request.form))
        if shape != stored.shape:
            problems.append((path, f"shape {stored.shape} in the checkpoint, {shape} in the target"))
        elif (mismatch := request.form.mismatch(stored, allow_dtype_cast)) is not None:
            problems.append((path, mismatch))
        elif (values and not allow_dtype_cast and request.form.dtype != stored.dtype
              and _scalar_fits(stored, request.form.dtype)):
            if (inexact := _inexact_scalar(ckpt, stored, request.form.dtype)) is not None:
                problems.append((path, inexact))
    if kept := {id(source.leaf) for source in sources if isinstance(source, Kept)}:
        # A leaf kept as it is may be the same array as one read (an EMA started as the
        # params): that array is not deleted (donate_target) before its replacement is read.
        requests = [dataclasses.replace(r, old=None) if r.old is not None and id(r.old) in kept else r
                    for r in requests]
    extra = [stored for name, stored in ckpt.leaves.items() if name not in readers]
    if problems or (extra and not partial):
        raise CheckpointMismatchError(_mismatch.report(
            ckpt.url, problems, [path for path, _ in flat], [stored.path for stored in extra],
            [stored.path for stored in ckpt.leaves.values()], partial, labels=renamed,
            names=_mismatch.Names(looked_up, {stored.where: (stored.name, stored.shape) for stored in extra},
                                  renamed=rename is not None),
            fallback_helps=concrete and not fallback))
    return requests, Assembly(treedef, sources)


_CONCRETE = (jax.Array, np.ndarray, np.generic, bool, int, float, complex, str, bytes)


def _shape_of(leaf: Any) -> tuple[int, ...] | None:
    """A target leaf's shape where it has one of its own (a Sharding takes the saved one)."""
    shape = getattr(leaf, "shape", None)
    return tuple(shape) if shape is not None and not isinstance(leaf, jax.sharding.Sharding) else None


def _concrete(leaf: Any) -> bool:
    """Whether `fallback=True` can keep a target leaf as it is: a value, not a description of one."""
    return isinstance(leaf, _CONCRETE)


def _scalar_fits(stored: _reader.StoredLeaf, dtype: np.dtype) -> bool:
    """Whether a saved Python scalar may restore into a 0-d target of `dtype`: one of its
    kind (an int into any integer dtype, a float into any float dtype...), as
    `jax.eval_shape` makes int32 and float32 targets of Python 0 and 0.0. Its value
    must then fit (`_inexact_scalar`)."""
    return (stored.kind in _PY_SCALARS and stored.shape == ()
            and _dtypes.number_kind(dtype) in _TARGET_KINDS[stored.kind])


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


def saved_form(stored: _reader.StoredLeaf) -> Form:
    """The form a leaf comes back in without a target: numpy arrays and scalars, Python
    scalars, typed PRNG keys as keys on the default device, and a per-process leaf as
    this process's own value (a `PerProcess`) where as many processes saved it, else as
    a dict of every process's value by process index."""
    if stored.kind in _PY_SCALARS:
        return PythonScalar(stored.dtype, stored.kind)
    if stored.kind == "numpy_scalar":
        return NumpyScalar(stored.dtype)
    if stored.kind == "prng_key":
        return PrngKeys(stored.dtype, None)
    if stored.kind in ("str", "bytes"):
        return Text(stored.dtype, stored.kind)
    if stored.kind == "per_process":
        if stored.processes == _multihost.process_count():
            return OwnValue(stored.dtype, PerProcess(None))
        return EveryValue(stored.dtype)
    return Numpy(stored.dtype)


def _request_for(leaf: Any, stored: _reader.StoredLeaf, where: str,
                 broadcast: bool) -> tuple[Request, tuple[int, ...]]:
    """How a target leaf asks to be restored, and the shape it expects."""
    leaf = _abstract_mesh.concrete_leaf(leaf, where)
    if stored.kind == "prng_key" and isinstance(leaf, jax.sharding.Sharding):
        # The saved kind decides: typed keys come back typed on a target that only
        # says where they go.
        return Request(stored, PrngKeys(stored.dtype, leaf)), stored.shape
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) and _dtypes.is_prng_key(leaf.dtype):
        # Typed keys are stored as their key data: compare that shape, and rebuild keys.
        data_shape = tuple(jax.eval_shape(jax.random.key_data, leaf).shape)
        old = leaf if isinstance(leaf, jax.Array) else None
        placed = None if old is not None and not old.committed else leaf.sharding
        return Request(stored, PrngKeys(stored.dtype, placed), old=old), data_shape
    if isinstance(leaf, jax.Array) and not leaf.committed:
        # Made without a placement (optax's `count` from `init`, its `mu` and `nu` from
        # `jax.jit(init)`, a step counter): it comes back the same, so that jit places it
        # beside the arrays it meets, as it did the original; committed to its device,
        # a step meeting it with arrays on a mesh would fail on incompatible devices.
        dtype = np.dtype(leaf.dtype)
        return Request(stored, default_device(dtype, next(iter(leaf.devices())), stored), old=leaf), \
            tuple(leaf.shape)
    if isinstance(leaf, jax.Array):
        return Request(stored, *sharded(np.dtype(leaf.dtype), leaf.sharding, stored, broadcast), old=leaf), \
            tuple(leaf.shape)
    if isinstance(leaf, jax.ShapeDtypeStruct):
        dtype = np.dtype(leaf.dtype)
        if leaf.sharding is None:
            return Request(stored, DefaultDevice(dtype)), tuple(leaf.shape)
        return Request(stored, *sharded(dtype, leaf.sharding, stored, broadcast)), tuple(leaf.shape)
    if isinstance(leaf, jax.sharding.Sharding):
        return Request(stored, *sharded(stored.dtype, leaf, stored, broadcast)), stored.shape
    if isinstance(leaf, np.ndarray):
        return Request(stored, Numpy(leaf.dtype)), leaf.shape
    if isinstance(leaf, np.generic):
        return Request(stored, NumpyScalar(leaf.dtype)), ()
    if isinstance(leaf, (bool, int, float, complex)):
        return Request(stored, PythonScalar(stored.dtype, type(leaf).__name__)), ()
    if isinstance(leaf, (str, bytes)):  # any text of that kind: the stored length is taken
        return Request(stored, Text(stored.dtype, type(leaf).__name__)), stored.shape
    if isinstance(leaf, PerProcess):
        return Request(stored, OwnValue(stored.dtype, leaf)), stored.shape
    raise UnsupportedLeafError(
        f"target leaf {where} is a {type(leaf).__qualname__}; expected jax.Array, jax.ShapeDtypeStruct, "
        "a Sharding, a numpy array or scalar, a Python scalar, a str, bytes or a zarrckpt.PerProcess"
    )
