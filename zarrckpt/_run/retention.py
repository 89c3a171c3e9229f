"""Which committed steps to keep, and deleting the rest safely.

The rules, applied after every commit (and by hand with the CLI):
- the newest committed step is always kept, as is every pinned step;
- `keep_last`: the newest N committed steps;
- `keep_every`: every step divisible by K, forever;
- `keep_best`: the N best steps by `metrics[best_metric]` (`best_mode` "min" or "max");
- with neither `keep_last` nor `keep_best` set, nothing is deleted;
- where either is, the newest step saved without NaN or infinities is kept too, until a
  newer such step commits: a diverged run never rotates out its last good step.
Uncommitted directories older than the newest committed step are leftovers of
crashed saves and are deleted; a newer one may be a save in progress and is kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

from .. import _commit, _objects, _options
from .._finite import NON_FINITE
from .._storage import Location, TooLarge
from .._util import concurrency as _concurrency
from . import steps as _steps

log = logging.getLogger("zarrckpt")

PIN_FILE = "PINNED"  # a step directory holding this file is never deleted (T5X's convention)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy:
    """What to keep. Raises TypeError or ValueError (see `_options.check`) on a bad
    setting, and ValueError on settings that contradict each other."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            _options.check(name, getattr(self, name), _options.COUNT + "?")
        if self.best_metric is not None and not isinstance(self.best_metric, str):
            raise TypeError(f"option best_metric must be a metric's name, got {self.best_metric!r}")
        if self.keep_best is not None and not self.best_metric:
            raise ValueError("keep_best needs best_metric: the name of the metric to rank steps by")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")

    @property
    def deletes(self) -> bool:
        return self.keep_last is not None or self.keep_best is not None


def steps_to_keep(policy: Policy, committed: Collection[int], metrics: Mapping[int, Mapping[str, Any]]) -> set[int]:
    """The committed steps that `policy` keeps (pins are checked separately, on disk)."""
    steps = sorted(committed)
    if not policy.deletes or not steps:
        return set(steps)
    keep = {steps[-1]}
    if policy.keep_last is not None:
        keep.update(steps[-policy.keep_last:])
    if policy.keep_every is not None:
        keep.update(s for s in steps if s % policy.keep_every == 0)
    if policy.keep_best is not None:
        keep.update(ranked(policy, metrics)[: policy.keep_best])
    return keep


def ranked(policy: Policy, metrics: Mapping[int, Mapping[str, Any]]) -> list[int]:
    """The steps of `metrics` with a finite `best_metric`, best first (ties: newest first).
    Metrics are read from storage: a NaN, an infinity or a non-number there (a bare
    `NaN` in JSON, a string) ranks as no score at all, never as the best."""
    metric, sign = policy.best_metric or "", -1 if policy.best_mode == "max" else 1
    scored = [s for s in metrics if isinstance(metrics[s].get(metric), (int, float))
              and not isinstance(metrics[s][metric], bool) and math.isfinite(metrics[s][metric])]
    scored.sort(key=lambda s: (metrics[s][metric] * sign, -s))
    return scored


def metrics_of(root: Location, step: Location) -> dict[str, Any] | None:
    """The metrics saved in the step at `step`, or None; metrics that are not a dict of
    named values are ignored with a warning naming the step."""
    group = _commit.read_group(step)
    found = group.meta.get("metrics") if group else None
    if found is not None and (not isinstance(found, dict) or not all(isinstance(k, str) for k in found)):
        log.warning("step %s under %s has metrics %.100r, not a dict of named numbers: ignored",
                    step.url.rsplit("/", 1)[-1].lstrip("0") or "0", root.url, found)
        return None
    return found


def load_metrics(root: Location, steps: Collection[int]) -> dict[int, dict[str, Any]]:
    """The metrics each of `steps` under `root` was saved with ({} where none)."""
    ordered = sorted(steps)
    found = _concurrency.run_all(lambda step: metrics_of(root, root.step(step)), ordered, root.concurrency)
    return {step: metrics or {} for step, metrics in zip(ordered, found)}


def _newest_finite(root: Location, committed: Collection[int]) -> int | None:
    """The newest of `committed` whose save found no NaN or infinity in its arrays (see
    `_finite`): one read of a step's metadata for each step looked at, newest first;
    almost always one."""
    for step in sorted(committed, reverse=True):
        group = _commit.read_group(root.step(step))
        if not (group and group.meta.get(NON_FINITE)):
            return step
    return None


def pin(step_loc: Location) -> bool:
    """Pins committed `step_loc` (a PIN_FILE in it, on stable storage); returns False,
    pinning nothing, where a leaf's array takes the pin file's name (a directory, on a
    local disk): such a step cannot be pinned."""
    try:
        step_loc.write(PIN_FILE, b"", durable=True)
    except IsADirectoryError:
        return False
    return True


def unpin(step_loc: Location) -> None:
    """Removes the pin of `step_loc`, if it has one: retention may delete the step again."""
    with contextlib.suppress(IsADirectoryError):  # the array of a leaf named so: no pin to remove
        step_loc.remove_file(PIN_FILE)


def is_pinned(step_loc: Location) -> bool:
    # One GET, where asking whether an absent object exists takes an object store two
    # requests (a HEAD, then a listing in case it is a directory). A pin says nothing
    # but that it is there: none of it is read (a cap of 0), and one of any size pins.
    try:
        return step_loc.read_if_present([PIN_FILE], cap=0)[0] is not None
    except IsADirectoryError:  # the array of a leaf named so (a local disk's directory): no pin
        return False
    except TooLarge:
        return True


def apply(root: Location, policy: Policy, metrics: Mapping[int, Mapping[str, Any]], *,
          dry_run: bool = False, leftovers_free: Callable[[], bool] | None = None,
          fence: Callable[[str], None] | None = None) -> list[int]:
    """Deletes what `policy` does not keep under `root`; returns the deleted steps.
    `fence` (a lease check, `Lease.check`) is called once all is decided, immediately
    before the first deletion: what it raises stops this with nothing deleted.

    Uncommitted steps older than the newest committed one are leftovers, deleted too
    unless `leftovers_free`, asked only where there are some, says otherwise (another
    job may be saving one: `force`, an older step); a newer one may be a save in
    flight, and is never touched. Each deletion removes
    the commit marker first, so an interrupted one leaves only an uncommitted leftover.
    """
    candidates, committed_steps = _steps.scan(root)
    committed = set(committed_steps)
    if not committed:
        return []
    newest = max(committed)
    keep = steps_to_keep(policy, committed, metrics)
    if policy.deletes and (finite := _newest_finite(root, committed)) not in (None, newest):
        log.info("keeping step %s under %s: the newest without NaN or infinities (newer steps hold them)", finite,
                 root.url)
        keep.add(finite)
    doomed = sorted(s for s in committed - keep if not is_pinned(root.step(s)))
    uncommitted = sorted(s for s in set(candidates) - committed if s < newest)
    if uncommitted and leftovers_free is not None and not leftovers_free():
        uncommitted = []
    if fence is not None and (doomed or uncommitted) and not dry_run:
        fence("retention deleted nothing")
    return [step for step in doomed + uncommitted
            if delete(root, step, committed=step in doomed, why="retention" if step in doomed else
                      "uncommitted leftover", dry_run=dry_run)]


def delete(root: Location, step: int, *, committed: bool, why: str, dry_run: bool = False) -> bool:
    """Deletes step `step` under `root`, its commit marker first, and logs `why`; returns
    whether it did. A step directory that also holds what is not the checkpoint's is
    left alone, with a warning: nothing outside a checkpoint is ever deleted."""
    if foreign := _objects.not_ours(root.step(step), committed=committed):
        log.warning("step %d under %s not deleted: it also holds %s, which is not the checkpoint's", step,
                    root.url, ", ".join(sorted(foreign)[:3]) + (" ..." if len(foreign) > 3 else ""))
        return False
    if not dry_run:
        _commit.remove(root.step(step))
    log.info("%s step %d under %s (%s)", "would delete" if dry_run else "deleted", step, root.url, why)
    return True
