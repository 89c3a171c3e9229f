"""Load and broadcast's second half: leaves read once for several processes (staged on
the devices of the processes that read them) are moved onto their targets by one
compiled program per group of leaves, over the device network (gloo on CPU, NCCL or
ICI on accelerators)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._util import devices as _devices, permute as _permute
from . import plan as _plan
from .match import Request, Share


def share(requests: list[Request], done: dict[str, Any]) -> None:
    """Load and broadcast's second half for `requests`, whose staged arrays are in
    `done` and are replaced there by the target's arrays, in one compiled program
    (collective: every process calls it with the same leaves, as they complete in the
    same order everywhere): a staged leaf is resharded onto its target, a leaf read by
    one replica is summed over the replicas. XLA's collectives (gloo on CPU, NCCL or
    ICI on accelerators) carry the bytes between hosts."""
    staged = [done[r.stored.name] for r in requests]
    with _devices.outside_callers_mesh():
        moved = _program(tuple(r.share for r in requests if r.share is not None))(*staged)
    for request, array, old in zip(requests, moved, staged):
        done[request.stored.name] = array
        for used in old if isinstance(old, tuple) else (old,):
            used.delete()


@functools.lru_cache(maxsize=16)
def _program(shares: tuple[Share, ...]) -> Callable[..., Any]:
    """One jitted program per set of leaves (restoring the same state again, as an
    evaluator does, compiles nothing new)."""
    shardings = tuple(s.sharding for s in shares)
    return jax.jit(lambda *xs: tuple(_shared(x, s) for x, s in zip(xs, shares)), out_shardings=shardings)


def _shared(x: jax.Array | tuple[jax.Array, ...], share: Share) -> jax.Array:
    """Inside the program: one leaf as its target holds it.

    Summed, ORed and permuted as unsigned integers of its width (`_permute.bits`): sums
    and ors with zeros are then exact, -0.0 and NaN payloads survive. Resharded by XLA
    as it is where that keeps every bit (`_permute.carried_exactly`), else as integers too,
    through a program of its own that XLA cannot fold back (slower: about 1.7x on CPU)."""
    staged = x if isinstance(x, tuple) else (x,)
    dtype = staged[0].dtype
    if not share.summed and not share.routes and (
            not _permute.as_bits(dtype) or _permute.carried_exactly(dtype, share.sharding.mesh)):
        return staged[0]  # out_shardings reshards it (XLA's own reshard: the fastest)
    # Complex and 4-bit leaves are never summed nor routed (`_permute.as_bits`, `relief`).
    assert _permute.as_bits(dtype), (dtype, share)
    same = np.dtype(f"uint{dtype.itemsize * 8}")
    wide = np.dtype(np.int64) if dtype.itemsize == 8 else np.dtype(np.int32)
    axes = tuple(_plan.replica_axes(share.sharding))
    # Routes meet the blocks where they were read: the staged slices, when staged.
    mesh, spec = share.sharding.mesh, (share.staging or share.sharding).spec

    def total(block: jax.Array, *moved: jax.Array) -> jax.Array:
        # Each part is read once (or, relieved, twice the same): the others hold zeros there.
        bits = _permute.bits(block)
        for blocks, route in zip(moved, share.routes):
            bits = bits | jax.lax.ppermute(_permute.bits(blocks), mesh.axis_names, route)  # peers' reads, placed
        if share.summed:
            bits = jax.lax.convert_element_type(jax.lax.psum(jax.lax.convert_element_type(bits, wide), axes), same)
        return bits

    # check_vma off: blocks replicated along an axis are sent along it all the same.
    bits = jax.shard_map(total, mesh=mesh, in_specs=(spec,) * len(staged), out_specs=spec,
                         check_vma=not share.routes)(*staged)
    if not share.summed and not _permute.carried_exactly(dtype, mesh):
        bits = jax.lax.with_sharding_constraint(bits, share.sharding)  # resharded as integers, not by out_shardings
    return _permute.from_bits(bits, dtype)


def groups(requests: list[Request], max_bytes: int) -> list[list[Request]]:
    """`requests` cut, in order, into runs of at least `max_bytes` (the last: what is left)."""
    groups: list[list[Request]] = [[]]
    for request in requests:
        if sum(r.nbytes for r in groups[-1]) >= max_bytes:
            groups.append([])
        groups[-1].append(request)
    return [group for group in groups if group]
