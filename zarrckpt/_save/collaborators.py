"""What `SaveJob.create` is handed besides the tree: a `Guard` (may the save write, may
it commit), a `Reuse` (which leaves' chunks are made from a committed step instead of
being copied off the devices) and `Beside` (plans written beside each leaf's own: the
local tier's peer copies). The run directory (`_run`) and the local tier (`_tier`)
provide the ones that do something; `UNGUARDED`, `NO_REUSE` and `NOTHING_BESIDE` do
nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence, Set as AbstractSet
from typing import Any, Protocol

from .._options import SaveOptions
from .._storage import Location
from .plan import ArrayPlan


@dataclasses.dataclass(frozen=True)
class Reused:
    """A leaf whose chunks are made from the committed step `step` (`Location.copy_new`):
    each only from the version its chunk had there as that step became known (`versions`,
    by key; a chunk whose version is not known is never made so), and, where that step's
    commit records it, with its CRC-32C (`crcs`, by key; see `_format.vouched`)."""

    step: Location
    versions: Mapping[str, str | None]
    crcs: Mapping[str, int]


def reused_of(reused: Mapping[str, Reused], plan: ArrayPlan) -> Reused | None:
    """What `plan`'s chunks are made from, among a save's `reused` (by leaf name); None
    where they are written (a peer copy's part always is)."""
    return reused.get(plan.leaf.name) if plan.moved is None else None


class Guard(Protocol):
    """What a save asks before it writes and before it commits or removes anything: that
    the place is still the caller's to write (a run's lease), and what the state saved
    holds (a check for NaN and infinities)."""

    def planned(self, plans: Sequence[ArrayPlan], documents: Mapping[str, dict[str, Any]],
                reused: AbstractSet[str]) -> None:
        """Told, on the caller's thread, once the save is planned: its `plans` (each
        shared array stored as its document in `documents`, by name), the leaves named
        in `reused` made from a committed step. A check of the state starts here, while
        the state is the caller's."""

    def before_prepare(self) -> Mapping[str, Any]:
        """Run on process 0 (every process, for a per-process save) before anything is
        written; returns what the group's zarrckpt attribute is to record besides. Raises
        to stop the save (DirectoryInUseError: the place is another job's)."""

    def fence(self, doing: str) -> None:
        """Run where the commit is written, just before it, before a failed save's group
        is removed, and to explain a failed write; raises DirectoryInUseError, saying what
        it stops (`doing`), where another job took the place over."""


class Reuse(Protocol):
    """Which leaves of a save hold what a committed step holds, so that their chunks are
    made from that step's; told how the save ended, so that the next save knows."""

    def plan(self, plans: Sequence[ArrayPlan], documents: Mapping[str, dict[str, Any]],
             step: Location) -> dict[str, Reused]:
        """The leaves of `plans` (each stored as its array document in `documents`, by
        name) whose chunks the save into `step` makes from a committed step, by name.
        Called once by `SaveJob.create` on every process (collective where it computes on
        the devices); never raises an Exception: a failure leaves every leaf written."""

    def check_after_writes(self, plans: Sequence[ArrayPlan], reused: Mapping[str, Reused],
                           made: Mapping[str, str | None]) -> None:
        """Run on each process once its writes are in (or one failed for want of what it
        was made from), before the commit: raises CheckpointWriteError if a step that
        chunks were made from (`reused`) is no longer what they were made from, or a chunk
        of it that could not be made (not in `made`) was not what it was."""

    def write_chunk(self, loc: Location, key: str, parts: Sequence[Any], crc: int | None) -> tuple[str | None, bool]:
        """Makes the chunk `key` of the save at `loc` hold the bytes `parts` (whose
        CRC-32C is `crc`, where it has one; called from the save's writer threads);
        returns the version made and whether the bytes were written (not made from a
        committed step that holds the very same chunk)."""

    def committed(self, save_id: str | None, made: Mapping[str, str | None], crcs: Mapping[str, int]) -> None:
        """The save committed as `save_id`, having made the chunks `made` (their versions,
        as the store said them) with the CRC-32C `crcs`."""

    def failed(self, error: BaseException, *, prepared: bool) -> None:
        """The save failed with `error`, uncommitted; `prepared`: whether it had got past
        its preparation (and may have written). Never raises."""


class Beside(Protocol):
    """Plans a save writes beside each leaf's own plan (a peer copy's part, moved onto
    this process's devices)."""

    @property
    def adds(self) -> bool:
        """Whether it adds any plan: a leaf may then have several, and the plans of an
        earlier save are not used again."""

    def plans(self, own: ArrayPlan, options: SaveOptions, process: int) -> list[ArrayPlan]:
        """The plans written beside `own` (the same on every process: moves are
        collective)."""


class Unguarded:
    """Writes wherever it is aimed, with nothing to record besides; a guard that asks
    only some of a `Guard`'s questions answers the others as this does."""

    def planned(self, plans: Sequence[ArrayPlan], documents: Mapping[str, dict[str, Any]],
                reused: AbstractSet[str]) -> None:
        pass

    def before_prepare(self) -> Mapping[str, Any]:
        return {}

    def fence(self, doing: str) -> None:
        pass


class NoReuse:
    """Every chunk written; nothing learnt. A reuse that answers only some of a
    `Reuse`'s questions answers the others as this does."""

    def plan(self, plans: Sequence[ArrayPlan], documents: Mapping[str, dict[str, Any]],
             step: Location) -> dict[str, Reused]:
        return {}

    def check_after_writes(self, plans: Sequence[ArrayPlan], reused: Mapping[str, Reused],
                           made: Mapping[str, str | None]) -> None:
        pass

    def write_chunk(self, loc: Location, key: str, parts: Sequence[Any], crc: int | None) -> tuple[str | None, bool]:
        return loc.write_new(key, *parts), True

    def committed(self, save_id: str | None, made: Mapping[str, str | None], crcs: Mapping[str, int]) -> None:
        pass

    def failed(self, error: BaseException, *, prepared: bool) -> None:
        pass


class _NothingBeside:
    """Each leaf's own plan alone."""

    adds = False

    def plans(self, own: ArrayPlan, options: SaveOptions, process: int) -> list[ArrayPlan]:
        return []


UNGUARDED: Guard = Unguarded()
NO_REUSE: Reuse = NoReuse()
NOTHING_BESIDE: Beside = _NothingBeside()
