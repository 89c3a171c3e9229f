"""The guards of saves into a run (see `_save.collaborators.Guard`): a one-off save's
(`RefuseIfHeld`: never beside a live manager) and a manager's (`ManagerGuard`: its
lease, and the check for NaN and infinities that retention reads)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence, Set as AbstractSet
from typing import Any

from .. import _finite
from .._save.collaborators import Unguarded
from .._save.plan import ArrayPlan
from .._storage import Location
from .._util.programs import Programs
from .lease import Lease, refuse_if_held

log = logging.getLogger("zarrckpt")


class RefuseIfHeld(Unguarded):
    """The guard of a one-off save (named `what`) into `step`: raises DirectoryInUseError
    before anything is written if `step` is a step of a run a live manager holds (with
    `existing_only`: only where `step` holds something already; see `refuse_if_held`).
    A step it is writing would be taken for a leftover and deleted, and one replaced
    would hold what the manager's record of it does not (its next save would make
    unchanged chunks from the replacement)."""

    def __init__(self, step: Location, what: str, *, existing_only: bool) -> None:
        self._step, self._what, self._existing_only = step, what, existing_only

    def before_prepare(self) -> Mapping[str, Any]:
        refuse_if_held(self._step, self._what, existing_only=self._existing_only)
        return {}


class ManagerGuard:
    """The guard of a manager's save of `step`: its `lease` (process 0's; None on the
    others) checked before anything is written and where the save commits or removes
    what it wrote, and the check of the state for NaN and infinities (`_finite`),
    started once the save is planned and waited for before anything is written: leaves
    found holding them are recorded in the step's metadata (`NON_FINITE`), with a
    warning. `before`: what the check found in the step the reused leaves are made
    from, where it is the very save this manager checked (those leaves are not looked
    at again). The check's programs are `programs`' (see `_finite.start`). `findings`
    holds what process 0's check found, once known."""

    def __init__(self, lease: Lease | None, step: int, before: _finite.Findings | None, programs: Programs) -> None:
        self._lease, self._step, self._before, self._programs = lease, step, before, programs
        self._check: Callable[[], _finite.Findings] | None = None
        self.findings: _finite.Findings | None = None

    def planned(self, plans: Sequence[ArrayPlan], documents: Mapping[str, dict[str, Any]],
                reused: AbstractSet[str]) -> None:
        self._check = _finite.start([plan.leaf for plan in plans if plan.moved is None], self._programs,
                                    before=self._before, unchanged=reused)

    def before_prepare(self) -> Mapping[str, Any]:
        if self._lease is not None:
            self._lease.check()
        assert self._check is not None, "`SaveJob.create` tells the guard what is saved"
        self.findings = self._check()
        if not (found := list(self.findings.bad.values())):
            return {}
        log.warning("step %d holds NaN or infinities, in %s%s: saving it; retention keeps the newest step without "
                    "them until a newer one commits", self._step, ", ".join(found[:5]),
                    f" and {len(found) - 5} more leaves" if len(found) > 5 else "")
        return {_finite.NON_FINITE: found}

    def fence(self, doing: str) -> None:
        if self._lease is not None:
            self._lease.check(doing)
