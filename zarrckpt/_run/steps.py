"""Step directories: `<checkpoint_dir>/<step, zero-padded to 10 digits>`, one checkpoint each:
listing them, finding the newest committed one, and reading one onto a target."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax

from .. import _commit, _options, _restore
from .._foreign import orbax as _orbax
from .._format import naming as _naming
from .._restore import checkpoint as _reader
from .._storage import Location
from .._util import concurrency as _concurrency, multihost as _multihost
from ..errors import CheckpointLocationError, CheckpointNotFoundError
from . import lineage as _lineage

log = logging.getLogger("zarrckpt")
T = TypeVar("T")


def latest(root: Location) -> int | None:
    """`latest_step` of the checkpoint directory `root`; CheckpointLocationError if it
    is no directory of steps (see `check_directory_of_steps`)."""
    step = newest_committed(root, lambda loc: (_commit.head(loc).state, None))[1]
    if step is None:
        check_directory_of_steps(root)
    return step


def newest_committed(root: Location, look: Callable[[Location], tuple[_commit.State, T]]
                     ) -> tuple[list[int], int | None, T | None]:
    """The step directories under `root` (the last listing, see `listings`), the newest
    of them that `look` (its state, and what else it read) finds committed, newest
    first, and what `look` read of it; None for both where none is."""
    for steps in listings(root):
        gone = False
        for step in reversed(steps):
            state, found = look(root.step(step))
            if state is _commit.State.COMMITTED:
                return steps, step, found
            gone |= state is _commit.State.ABSENT
        if not gone:
            break
    return steps, None, None


# A listing is a moment: retention deletes a step only once a newer one has committed,
# so a listed step found gone where none listed was committed means that a newer one
# committed after the listing (an evaluator beside a job keeping one step, on a slow
# store, was told that nothing was committed). The directory is listed again, a few
# times.
_LISTINGS = 4


def listings(root: Location) -> Iterator[list[int]]:
    """The step directories under `root` (`candidate_steps`), listed again each time the
    caller asks, at most `_LISTINGS` times: a caller that finds nothing committed among
    them, and a listed step gone, asks again."""
    for _ in range(_LISTINGS):
        yield candidate_steps(root)


def candidate_steps(root: Location) -> list[int]:
    """The step directories under `root`, ascending. An entry named like a step that is
    no directory (a file, a symbolic link, an object beside a prefix) is skipped with a
    warning naming it: it cannot be a step, and must not stop a run from resuming."""
    steps = []
    for entry in root.list_dir():
        step = _naming.parse_step_dir_name(entry.name)
        if step is None:
            continue
        if entry.type == "dir":
            steps.append(step)
        else:
            what = "a symbolic link (never followed)" if entry.type == "link" else "not a directory"
            _commit.warn_once(f"{root.url}/{entry.name} is named like a step but is {what}: skipped")
    return sorted(steps)


def check_directory_of_steps(root: Location, *, has_steps: bool = False) -> None:
    """Raises CheckpointLocationError if `root` is not what a directory of steps can be:
    a checkpoint itself, or (unless it `has_steps` of zarrckpt's) a directory of another
    library's checkpoints. Called where no committed step was found, so that a run
    pointed at the wrong place fails instead of training from scratch."""
    if _commit.head(root).state is not _commit.State.ABSENT:
        if _commit.someone_elses(_commit.read_group(root)):
            raise CheckpointLocationError(f"{root.url} is a zarr group that zarrckpt did not write, not a directory "
                                          "of steps: pass the directory that holds step directories")
        parent, name = root.url.rstrip("/").rsplit("/", 1) if "/" in root.url.rstrip("/") else ("", root.url)
        step = _naming.parse_step_dir_name(name)
        what = f"step {step} of {parent}" if step is not None else "not a directory of steps"
        raise CheckpointLocationError(
            f"{root.url} is a checkpoint itself ({what}): pass the directory that holds step directories"
            f"{f' ({parent})' if step is not None else ''}, or load this one with load_pytree")
    if has_steps:
        return
    entries = root.list_dir()
    names = {e.name for e in entries}
    if names & set(_orbax.MARKERS):
        raise CheckpointLocationError(f"{root.url} is a checkpoint of Orbax, not a directory of zarrckpt steps: "
                                      f"import it (zarrckpt import {root.url} NEW_DIR, or "
                                      "zarrckpt.import_checkpoint), then use NEW_DIR")
    numbered = sorted((e.name for e in entries if e.type == "dir" and e.name.isascii() and e.name.isdigit()
                       and e.name == str(int(e.name)) and _naming.parse_step_dir_name(e.name) is None), key=int)
    if numbered:
        orbax = bool(set(_orbax.MARKERS) & {e.name for e in root.list_dir(numbered[-1])})
        how = (f": import its newest step (zarrckpt import {root.url} NEW_DIR, or zarrckpt.import_checkpoint), "
               "then resume from NEW_DIR" if orbax else "")
        raise CheckpointLocationError(
            f"{root.url} holds {'Orbax' if orbax else 'another library'}'s checkpoints (steps "
            f"{', '.join(numbered[-3:])}), not zarrckpt's (whose step directories have 10 digits: "
            f"{_naming.step_dir_name(int(numbered[-1]))}){how}")
    if not entries and (bucket := root.missing_bucket()) is not None:
        raise CheckpointLocationError(f"{root.url}: the bucket {bucket!r} does not exist (or these credentials "
                                      "cannot see it)")


def scan(root: Location, *, after: int | None = None) -> tuple[list[int], list[int]]:
    """Every step directory under `root`, and the committed ones among them (with
    `after`: among those newer than it, from one listing, as a step committed since
    is the next call's), ascending: one listing (more, see `listings`), then the first
    bytes of each of those commit markers, read concurrently."""
    for steps in listings(root):
        looked = steps if after is None else [s for s in steps if s > after]
        states = _concurrency.run_all(lambda s: _commit.head(root.step(s)).state, looked, root.concurrency)
        committed = [s for s, state in zip(looked, states) if state is _commit.State.COMMITTED]
        # A step being saved to an object store reads as absent (see `_commit`): past
        # `after`, nothing committed is no sign of a newer step committed since.
        if committed or _commit.State.ABSENT not in states or after is not None:
            break
    return steps, committed


def is_committed(loc: Location) -> bool:
    return _commit.head(loc).state is _commit.State.COMMITTED


def load_step(root: Location, step: int, target: Any, options: _options.LoadOptions,
              known: _lineage.Lineage | None) -> tuple[Any, _reader.Checkpoint]:
    """`load_checkpoint` under `root`, and the checkpoint it read; told to what this
    process `known`s of it (for a later save's unchanged chunks), if given."""
    ckpt = _reader.open_checkpoint(committed_step(root, step))
    return _read(ckpt, target, options, known), ckpt


def _read(ckpt: _reader.Checkpoint, target: Any, options: _options.LoadOptions,
          known: _lineage.Lineage | None) -> Any:
    def read() -> Any:
        return _restore.load_opened(ckpt, target, options)

    if known is None:
        return read()
    if options.rename is not None:
        # The state's leaves are named as the target's, not as the step's leaves they
        # hold: a later save takes none of its chunks for unchanged.
        known.forget()
        return read()
    arrays = any(isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, jax.sharding.Sharding))
                 for leaf in jax.tree_util.tree_leaves(target))  # else numpy values: nothing a save reuses
    return known.read(ckpt, read, arrays=arrays)


def committed_step(root: Location, step: int) -> Location:
    """The directory of `step` under `root`; CheckpointNotFoundError listing the
    committed steps if it is not a committed checkpoint."""
    loc = root.step(step)
    if not is_committed(loc):
        raise CheckpointNotFoundError(f"step {step} is not a committed checkpoint in {root.url}; "
                                      f"committed steps: {scan(root)[1]}")
    return loc


def restore_latest(root: Location, target: Any, options: _options.LoadOptions, timeout_s: float,
                   known: _lineage.Lineage | None) -> tuple[Any, int | None, _reader.Checkpoint | None]:
    """`load_checkpoint_if_it_exists` under `root`, but None for the step when nothing
    was restored (step 0 may have been saved), and the checkpoint it read, told to what
    this process `known`s of it, if given. Agreement."""
    chosen: dict[str, Any] = {}
    with _multihost.Agreement("restore", timeout_s, what=f"choosing the step to restore under {root.url}") as op:
        step, save_id = op.decide("step", lambda: _newest(root, chosen))
    if step is None:
        return target, None, None
    # Every process opens the save process 0 chose, or fails: never two saves of a step.
    ckpt = _reader.open_checkpoint(root.step(step), group=chosen.get("group"), save_id=save_id)
    return _read(ckpt, target, options, known), step, ckpt


def _newest(root: Location, chosen: dict[str, Any]) -> tuple[int | None, str | None]:
    """The newest committed step under `root` whose group metadata can be read, and its
    save identity; that metadata goes into `chosen`, so that opening it reads it no
    more. Damaged steps are skipped, with a warning."""
    def look(loc: Location) -> tuple[_commit.State, _commit.Group | None]:
        group = _commit.read_group(loc)
        return _commit.state(loc, group), group

    candidates, step, group = newest_committed(root, look)
    if step is not None and group is not None:
        chosen["group"] = group
        return step, group.save_id
    check_directory_of_steps(root)
    if not root.exists():
        log.warning("nothing to restore: %s does not exist; starting from the state given", root.url)
    else:
        log.warning("no committed checkpoint under %s%s: starting from the state given", root.url,
                    f" ({len(candidates)} uncommitted step directories)" if candidates else "")
    return None, None
