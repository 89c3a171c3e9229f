"""Peer copies of the local tier: which process keeps whose copy, and how shards move
between them over the device network.

With `local_peer_copies=k`, process p's part of each local step is also kept by k other
processes, `holders[m][p]` for m < k: each holder writes the chunks of p's copy that its
own copy lacks into its own copy of the step (so a copy holds its own part and its
peers'). Each `holders[m]` is a permutation of the processes, and the holders are
chosen in other failure domains than p (`choose`): by default another slice where the
devices say which slice they are on, else another host.

Shards move by one collective permute per leaf (`_util.permute.move`): the k-th device
of process p (in device id order) sends its block of the array to the k-th device of
its holder, as a save does; a restore sends the blocks its peers read back to the
devices that hold them. XLA carries them over the device network (NVLink, ICI; gloo on
CPU).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Sequence

import jax

from .._options import SaveOptions
from .._save import plan as _planning
from .._save.plan import ArrayPlan
from .._util import permute as _permute, regions as _regions

log = logging.getLogger("zarrckpt")

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


class PeerPlans:
    """The plans a local-tier save writes beside each shared leaf's own: the parts of
    the peer copies this process keeps that its own devices lack, moved onto them over
    the device network (`_save.collaborators.Beside`)."""

    def __init__(self, peers: Peers) -> None:
        self._peers = peers

    @property
    def adds(self) -> bool:
        return bool(self._peers.holders)

    def plans(self, own: ArrayPlan, options: SaveOptions, process: int) -> list[ArrayPlan]:
        """The peer copies' parts of the leaf `own` plans, one per copy whose move some
        process needs (the same on every process: moves are collective)."""
        value = own.leaf.value
        if not self._peers.holders or not isinstance(value, jax.Array) or value.is_fully_addressable:
            return []
        sharding = value.sharding
        if not (isinstance(sharding, jax.sharding.NamedSharding) and _permute.movable(sharding, own.shape)):
            return []
        processes = [frozenset(d.process_index for d in devices)
                     for devices in _regions.replicas_of(sharding, own.shape).values()]
        written = {u.region for u in own.writes}
        plans = []
        for holder in self._peers.holders:
            route = _permute.pairs(_permute.mesh_of(sharding), holder)
            if route is None or all(holder[p] in found for found in processes for p in found):
                continue  # every holder already holds all its peer holds
            plan = _planning.plan_peer_array(own, route, options.max_chunk_bytes, process=process,
                                             min_chunk_bytes=options.min_chunk_bytes, written=written)
            written |= {u.region for u in plan.writes}
            plans.append(plan)
        return plans
