"""Moving each device's block of an array to another device of its mesh in one
collective permute, and arrays as the unsigned integers of their bits (which a permute,
a sum or an OR carries exactly)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import devices as _devices

# A collective permute: (source, destination) pairs of positions in a mesh's devices.
Pairs = tuple[tuple[int, int], ...]


def pairs(mesh: jax.sharding.Mesh, holder: Sequence[int]) -> Pairs | None:
    """The permute sending each device's block to the device of the same rank (by id) of
    its process's holder, as positions in `mesh`; None if the processes do not all have
    the same number of devices in the mesh."""
    flat = list(mesh.devices.flat)
    by_process: dict[int, list[Any]] = {}
    for device in sorted(flat, key=lambda d: d.id):
        by_process.setdefault(device.process_index, []).append(device)
    if len({len(devices) for devices in by_process.values()}) != 1 or len(by_process) != len(holder):
        return None
    position = {device: i for i, device in enumerate(flat)}
    return tuple((position[d], position[by_process[holder[p]][rank]])
                 for p, devices in by_process.items() for rank, d in enumerate(devices))


def mesh_of(sharding: jax.sharding.NamedSharding) -> jax.sharding.Mesh:
    """The mesh of `sharding`, which places an array on devices: a concrete `Mesh` (an
    `AbstractMesh` has no devices, and places nothing)."""
    mesh = sharding.mesh
    assert isinstance(mesh, jax.sharding.Mesh)
    return mesh


def movable(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> bool:
    """Whether blocks of an array on `sharding` can move by `move`: a NamedSharding whose
    blocks all have one shape (each sharded dimension divides evenly)."""
    if not isinstance(sharding, jax.sharding.NamedSharding) or not shape:
        return False
    for dim, entry in zip(shape, sharding.spec):
        axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        if dim % math.prod(sharding.mesh.shape[a] for a in axes):
            return False
    return True


def move(array: jax.Array, route: Pairs) -> jax.Array:
    """`array` with each device's block sent where `route` says: an array on the same
    sharding whose block on a device is another device's. Collective."""
    with _devices.outside_callers_mesh():
        return _permute(array.sharding, route)(array)


@functools.lru_cache(maxsize=256)
def _permute(sharding: jax.sharding.NamedSharding, route: Pairs) -> Any:
    mesh, spec = sharding.mesh, sharding.spec

    def send(block: jax.Array) -> jax.Array:
        if not as_bits(block.dtype):  # moved as they are (no NaN payload to lose: see `as_bits`)
            return jax.lax.ppermute(block, mesh.axis_names, route)
        return from_bits(jax.lax.ppermute(bits(block), mesh.axis_names, route), block.dtype)

    # check_vma off: a block replicated along an axis is sent along it all the same.
    return jax.jit(jax.shard_map(send, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def as_bits(dtype: Any) -> bool:
    """Whether values of `dtype` can be taken as unsigned integers of their width
    (`bits`): not complex (two floats), not narrower than a byte (int4, float4)."""
    dtype = np.dtype(dtype)
    return dtype.kind != "c" and (dtype == np.bool_ or jax.dtypes.itemsize_bits(dtype) == 8 * dtype.itemsize)


def carried_exactly(dtype: Any, mesh: Any) -> bool:
    """Whether XLA's own collectives between `mesh`'s devices keep every bit of `dtype`:
    all but bf16 on CPU devices, whose collectives turn a NaN's payload into the
    canonical NaN (those go as `bits`)."""
    return not (np.dtype(dtype) == np.dtype(jnp.bfloat16)
                and any(device.platform == "cpu" for device in mesh.devices.flat))


def bits(x: jax.Array) -> jax.Array:
    """`x` (of a dtype `as_bits` accepts) as unsigned integers of its width (bool:
    uint8), to move, or or, or sum exactly: a permute of bf16 on CPU devices turns a
    NaN's payload into the canonical NaN."""
    unsigned = np.dtype(f"uint{x.dtype.itemsize * 8}")
    return x.astype(unsigned) if x.dtype == np.bool_ else jax.lax.bitcast_convert_type(x, unsigned)


def from_bits(x: jax.Array, dtype: Any) -> jax.Array:
    """The inverse of `bits`: integers back as `dtype`."""
    return x.astype(np.bool_) if dtype == np.bool_ else jax.lax.bitcast_convert_type(x, dtype)


def inverse(route: Pairs) -> Pairs:
    return tuple((b, a) for a, b in route)


def mapping(mesh: jax.sharding.Mesh, route: Pairs) -> dict[Any, Any]:
    """`route` as devices: each device to the one its block goes to."""
    flat = list(mesh.devices.flat)
    return {flat[a]: flat[b] for a, b in route}
