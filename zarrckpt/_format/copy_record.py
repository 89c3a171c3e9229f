"""What a local-tier copy of a step says about itself (docs/pytree-zarr-checkpoint.md,
"Local copies"): written into the copy's group metadata, under `local`, when it is
saved, and read back, checked, before the copy is trusted with a restore. The one
place that knows its fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeGuard

KEY = "local"  # under zarrckpt's attribute of the copy's group


@dataclasses.dataclass(frozen=True)
class CopyRecord:
    """One process's copy of one step of one run."""

    run: str  # the run's identity (`_tiers.run_identity`): a copy of another run is never used
    step: int
    after: int | None  # the newest persistent step committed when it was saved
    process: int  # whose copy it is, of `processes`
    processes: int
    held: dict[str, list[tuple[int, ...]]]  # per array name, the grid coordinates of the chunks it holds
    peers: tuple[tuple[int, ...], ...] = ()  # who keeps whose peer copy (`_peers.Peers.holders`)

    def as_meta(self) -> dict[str, Any]:
        return {"run": self.run, "step": self.step, "after": self.after, "process": self.process,
                "processes": self.processes, "held": {name: [list(c) for c in coords] for name, coords in
                                                      self.held.items()},
                "peers": [list(holder) for holder in self.peers]}

    @classmethod
    def parse(cls, meta: Any) -> CopyRecord:
        """The record in zarrckpt's attribute `meta` of a copy's group; ValueError saying
        what is wrong with it (a disk may hold anything). A chunk's coordinates are
        checked against its array's grid by the caller, which knows the grid."""
        record = meta.get(KEY) if isinstance(meta, dict) else None
        if not isinstance(record, dict) or not isinstance(record.get("held"), dict):
            raise ValueError("it is not a local-tier copy (no record of what it holds)")
        run, step, after = record.get("run"), record.get("step"), record.get("after")
        process, processes, peers = record.get("process"), record.get("processes"), record.get("peers", [])
        if not isinstance(run, str):
            raise ValueError(f"it records run {run!r}")
        if not _count(step):
            raise ValueError(f"it holds step {step!r}")
        if after is not None and not _count(after):
            raise ValueError(f"it records persistent step {after!r}")
        if not (_count(processes) and processes > 0 and _count(process) and process < processes):
            raise ValueError(f"it records process {process!r} of {processes!r}")
        if not (isinstance(peers, list) and all(isinstance(h, list) and all(_count(p) for p in h)
                                                and sorted(h) == list(range(processes)) for h in peers)):
            raise ValueError(f"it records peer copies {peers!r} that are not kept by {processes!r} processes")
        held = {}
        for name, coords in record["held"].items():
            if not isinstance(coords, list):
                raise ValueError(f"it says it holds chunks {coords!r:.100} of array {name!r}")
            bad = next((i for i, c in enumerate(coords) if not (isinstance(c, list) and all(map(_count, c)))), None)
            if bad is not None:
                raise ValueError(f"it says it holds chunk {coords[bad]!r:.100} of array {name!r}")
            held[name] = [tuple(c) for c in coords]
        return cls(run, step, after, process, processes, held, tuple(map(tuple, peers)))


def _count(value: Any) -> TypeGuard[int]:
    """Whether `value` is a non-negative int (not a bool), as JSON gives one back."""
    return type(value) is int and value >= 0
