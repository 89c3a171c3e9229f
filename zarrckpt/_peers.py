"""Peer copies of the local tier: which process keeps whose copy, and how shards move
between them over the device network.

With `local_peer_copies=k`, process p's part of each local step is also kept by k other
processes, `holders[m][p]` for m < k: each holder writes the chunks of p's copy that its
own copy lacks into its own copy of the step (so a copy holds its own part and its
peers'). Each `holders[m]` is a permutation of the processes, and the holders are
chosen in other failure domains than p (`choose`): by default another slice where the
devices say which slice they are on, else another host.

Shards move by one collective permute per leaf (`move`): the k-th device of process p
(in device id order) sends its block of the array to the k-th device of its holder, as
a save does; a restore sends the blocks its peers read back to the devices that hold
them. XLA carries them over the device network (NVLink, ICI; gloo on CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import socket
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _devices

log = logging.getLogger("zarrckpt")

# A collective permute: (source, destination) pairs of positions in a mesh's devices.
Pairs = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Peers:
    """Who keeps the peer copies: `holders[m][p]`, the process keeping process p's
    m-th peer copy (a permutation of the processes, for each m)."""

    holders: tuple[tuple[int, ...], ...] = ()

    def sources(self, process: int) -> list[int]:
        """The processes whose part `process` keeps, besides its own."""
        return [p for holder in self.holders for p, q in enumerate(holder) if q == process]


def where() -> dict[str, str | None]:
    """Where this process runs: the slice its devices are on, where they say (TPU
    multislice), and its host; `domains` makes failure domains of every process's."""
    return {"slice": str(getattr(jax.local_devices()[0], "slice_index", None)), "host": socket.gethostname()}


def domains(found: Sequence[dict[str, str | None]]) -> list[str]:
    """Each process's failure domain when the user names none: its slice where the job
    spans several (a slice fails and restarts whole), else its host."""
    key = "slice" if len({f["slice"] for f in found}) > 1 else "host"
    return [f"{key} {f[key]}" for f in found]


def choose(copies: int, groups: Sequence[str]) -> Peers:
    """The holders of `copies` peer copies of each process, `groups` naming each process's
    failure domain: the processes ordered by domain, each copy goes `shift` places further
    along the ring, shifts spread evenly, so that no copy shares a domain with its
    process or another copy where the domains allow it. Raises ValueError naming
    `local_peer_copies` where they do not."""
    count = len(groups)
    if copies == 0 or count == 1:
        return Peers()
    if copies >= count:
        raise ValueError(f"local_peer_copies={copies} needs more processes than the job's {count}: each copy is kept "
                         "by another process")
    order = sorted(range(count), key=lambda p: (groups[p], p))
    sizes: dict[str, int] = {}
    for group in groups:
        sizes[group] = sizes.get(group, 0) + 1
    largest = max(sizes.values())
    spacing = count // (copies + 1)
    if len(sizes) > 1 and spacing < largest:
        raise ValueError(f"local_peer_copies={copies} cannot keep each copy in another failure domain: the job's "
                         f"{count} processes are in {len(sizes)} (local_peer_group, by default the host or slice) "
                         f"of up to {largest} processes; give fewer copies or a grouping with more domains")
    if len(sizes) == 1:
        log.info("every process is in one failure domain (%s): peer copies survive the loss of a process's disk, "
                 "not of the whole domain", groups[0])
    holders = []
    for m in range(1, copies + 1):
        holder = [0] * count
        for t, p in enumerate(order):
            holder[p] = order[(t + m * spacing) % count]
        holders.append(tuple(holder))
    return Peers(tuple(holders))


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
