"""Step directories: `<checkpoint_dir>/<step, zero-padded to 10 digits>`, one checkpoint each."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax

from .. import _commit, _options, _restore, _save, _storage
from .._foreign import orbax as _orbax
from .._format import naming as _naming
from .._restore import checkpoint as _reader
from .._storage import Location
from .._util import concurrency as _concurrency, multihost as _multihost
from ..errors import CheckpointLocationError, CheckpointNotFoundError
from . import lineage as _lineage
from .guards import RefuseIfHeld

log = logging.getLogger("zarrckpt")
T = TypeVar("T")
# What this process knows of the newest step it saved or restored in each directory of
# steps without a manager (for `save_checkpoint`'s `unchanged_since`).
_lineages = _lineage.Lineages()


def save_checkpoint(
    checkpoint_dir: str,
    step: int,
    state: Any,
    *,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    max_chunk_bytes: int = _options.DEFAULT_MAX_CHUNK_BYTES,
    min_chunk_bytes: int = _options.DEFAULT_MIN_CHUNK_BYTES,
    max_inflight_bytes: int = _options.DEFAULT_MAX_INFLIGHT_BYTES,
    max_workers: int | None = None,
    timeout_s: float = _options.DEFAULT_TIMEOUT_S,
    progress: bool | None = None,
    checksums: bool = True,
    compression: str | None = None,
    unchanged_since: int | None = None,
) -> None:
    """Saves `state` as step `step` under `checkpoint_dir` and commits it.

    Agreement, like `save_pytree`, whose options it takes (see there), and:

    Args:
      unchanged_since: a committed step of `checkpoint_dir` that this process saved
        (with `save_checkpoint`), or restored into jax.Arrays (with `load_checkpoint`
        or `load_checkpoint_if_it_exists`), last there. Each jax.Array leaf that holds
        exactly what that step holds of it (the very same array, or every shard with
        the fingerprint it had when saved: see a `CheckpointManager`'s
        `reuse_unchanged`) has its chunks made from that step's (a hard link, a copy
        inside S3 or GCS) instead of copied off the devices and written; the new step
        is complete on its own. A step this process does not know so, or that another
        save has deleted or replaced since, is not used: every chunk is written (a
        warning says why). A save that makes chunks from it also fingerprints the
        leaves it compares, so that leaves rebuilt with the same values are found
        unchanged by the next such save. This process knows the last 8 directories it
        saved to or restored from so.

    Raises what `save_pytree` raises; CheckpointExistsError if the step is committed
    and `overwrite` is False, ValueError for a bad step (or `unchanged_since` equal to
    `step`); DirectoryInUseError, naming the holder, if a live `CheckpointManager`
    holds `checkpoint_dir` and `step` is there already, committed (with `overwrite`:
    the manager would take the replacement for the step it saved, and make unchanged
    chunks from it) or not (a step it is writing would be taken for a leftover and
    deleted). A lease found unreleased whose holder may be alive on another machine is
    watched first, as a manager claiming it would (2.5 heartbeats). CheckpointWriteError, with nothing
    committed, if step `unchanged_since` is deleted or replaced while chunks are made
    from it.
    """
    step = _naming.step_number(step)
    options = _options.SaveOptions(overwrite=overwrite, max_chunk_bytes=max_chunk_bytes,
                                   min_chunk_bytes=min_chunk_bytes, max_inflight_bytes=max_inflight_bytes,
                                   max_workers=max_workers, timeout_s=timeout_s, progress=progress,
                                   checksums=checksums, compression=compression)
    _options.check("unchanged_since", unchanged_since, _options.COUNT_OR_ZERO + "?")
    if unchanged_since == step:
        raise ValueError(f"unchanged_since={unchanged_since} is the step being saved: name the step its unchanged "
                         "chunks are made from")
    root = _storage.resolve(checkpoint_dir, storage_options)
    loc = root.step(step)
    source = None if unchanged_since is None else root.step(unchanged_since)
    job = _save.SaveJob.create(loc, state, options,
                               guard=RefuseIfHeld(loc, "save_checkpoint", existing_only=not overwrite),
                               reuse=_lineage.ReuseSince(_lineages.of(root), source))
    _save.write(job)


def all_steps(checkpoint_dir: str, *, storage_options: dict[str, Any] | None = None) -> list[int]:
    """Every committed step under `checkpoint_dir`, ascending. Not collective.

    Raises:
      CheckpointLocationError: `checkpoint_dir` is a checkpoint itself or holds another
        library's checkpoints.
    """
    root = _storage.resolve(checkpoint_dir, storage_options)
    committed = scan(root)[1]
    if not committed:
        check_directory_of_steps(root)
    return committed


def latest_step(checkpoint_dir: str, *, storage_options: dict[str, Any] | None = None) -> int | None:
    """The newest committed step under `checkpoint_dir`, or None if there is none.

    Not collective. Uncommitted step directories (a save running or crashed) are skipped.

    Raises:
      CheckpointLocationError: `checkpoint_dir` is a checkpoint itself or holds another
        library's checkpoints.
    """
    return latest(_storage.resolve(checkpoint_dir, storage_options))


def latest(root: Location) -> int | None:
    """`latest_step` of the checkpoint directory `root`; CheckpointLocationError if it
    is no directory of steps (see `check_directory_of_steps`)."""
    step = _newest_committed(root, lambda loc: (_commit.head(loc).state, None))[1]
    if step is None:
        check_directory_of_steps(root)
    return step


def _newest_committed(root: Location, look: Callable[[Location], tuple[_commit.State, T]]
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


def load_checkpoint_if_it_exists(
    checkpoint_dir: str,
    target: Any,
    *,
    storage_options: dict[str, Any] | None = None,
    partial: bool = False,
    allow_dtype_cast: bool = False,
    donate_target: bool = False,
    load_and_broadcast: bool = True,
    max_inflight_bytes: int = _options.DEFAULT_MAX_INFLIGHT_BYTES,
    max_workers: int | None = None,
    progress: bool | None = None,
    timeout_s: float = _options.DEFAULT_TIMEOUT_S,
) -> tuple[Any, int]:
    """Restores the newest committed step under `checkpoint_dir` onto `target`.

    Collective under jax.distributed: every process calls it; process 0 chooses the
    step and every process restores that one, even if a save commits another step
    meanwhile. A restore into jax.Arrays lets a later `save_checkpoint` of this process
    make unchanged chunks from this step (`unchanged_since`).

    Args:
      checkpoint_dir: a local path or fsspec URL of a directory of steps.
      target: as for `load_pytree`.
      storage_options, partial, allow_dtype_cast, donate_target, load_and_broadcast,
        max_inflight_bytes, max_workers, progress: as for `load_pytree`.
      timeout_s: how long a process waits for process 0's choice of step.

    Returns:
      (state, step); or (target, 0), with a warning naming the URL, when nothing is
      committed yet, so a training loop can call it unconditionally at start-up.

    Raises:
      CheckpointLocationError: on every process, if `checkpoint_dir` is a checkpoint
        itself or holds another library's checkpoints.
      CoordinationTimeoutError: the step was not chosen within `timeout_s`.
      Anything `load_pytree` raises.
    """
    options = _options.LoadOptions(partial=partial, allow_dtype_cast=allow_dtype_cast, donate_target=donate_target,
                                   load_and_broadcast=load_and_broadcast, max_inflight_bytes=max_inflight_bytes,
                                   max_workers=max_workers, progress=progress)
    _options.check("timeout_s", timeout_s, _options.NUMBER)
    root = _storage.resolve(checkpoint_dir, storage_options)
    state, step, _ = restore_latest(root, target, options, timeout_s, _lineages.of(root))
    return state, step or 0


def load_checkpoint(
    checkpoint_dir: str,
    step: int,
    target: Any = None,
    *,
    storage_options: dict[str, Any] | None = None,
    partial: bool = False,
    allow_dtype_cast: bool = False,
    donate_target: bool = False,
    load_and_broadcast: bool = True,
    max_inflight_bytes: int = _options.DEFAULT_MAX_INFLIGHT_BYTES,
    max_workers: int | None = None,
    progress: bool | None = None,
) -> Any:
    """Restores committed step `step` under `checkpoint_dir` onto `target`, as an
    evaluator does for each step `checkpoints_iterator` yields.

    Collective exactly as `load_pytree` is. A restore into jax.Arrays lets a later
    `save_checkpoint` of this process make unchanged chunks from this step
    (`unchanged_since`).

    Args:
      checkpoint_dir: a local path or fsspec URL of a directory of steps.
      step: the step to restore.
      target, storage_options, partial, allow_dtype_cast, donate_target,
        load_and_broadcast, max_inflight_bytes, max_workers, progress: as for
        `load_pytree`.

    Returns:
      The restored pytree.

    Raises:
      CheckpointNotFoundError: `step` is not committed (the message lists the
        committed steps), or was deleted (by retention, say) while being read.
      Anything `load_pytree` raises.
    """
    step = _naming.step_number(step)
    options = _options.LoadOptions(partial=partial, allow_dtype_cast=allow_dtype_cast, donate_target=donate_target,
                                   load_and_broadcast=load_and_broadcast, max_inflight_bytes=max_inflight_bytes,
                                   max_workers=max_workers, progress=progress)
    root = _storage.resolve(checkpoint_dir, storage_options)
    return load_step(root, step, target, options, _lineages.of(root))[0]


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


def checkpoints_iterator(checkpoint_dir: str, *, timeout_s: float | None = None, poll_interval_s: float = 5.0,
                         start_after: int | None = None,
                         storage_options: dict[str, Any] | None = None) -> Iterator[int]:
    """Yields the steps committed under `checkpoint_dir` as they appear, in increasing
    order, for an evaluator's loop beside a training job. Not collective.

        for step in zarrckpt.checkpoints_iterator(run_dir, timeout_s=3600):
            params = zarrckpt.load_checkpoint(run_dir, step, {"params": target}, partial=True)

    Yields first the newest step already committed (or, with `start_after`, every
    committed step after it), then each step committed later. A step deleted (by
    retention, say) before it is yielded is skipped. Each poll lists the directory and
    reads the commit markers of steps newer than the last one yielded.

    Args:
      checkpoint_dir: a local path or fsspec URL of a directory of steps.
      timeout_s: stop once this many seconds pass without a new step (None: never).
      poll_interval_s: seconds between polls.
      start_after: yield every committed step after this one instead of the newest only.
      storage_options: passed to fsspec.

    Raises:
      CheckpointLocationError: at a poll that lists no step directory, if
        `checkpoint_dir` is a checkpoint itself or holds another library's checkpoints.
    """
    _options.check("timeout_s", timeout_s, _options.NUMBER + "?")
    _options.check("poll_interval_s", poll_interval_s, _options.NUMBER)
    _options.check("start_after", start_after, _options.COUNT_OR_ZERO + "?")
    root = _storage.resolve(checkpoint_dir, storage_options)
    last, first, idle_since = start_after, start_after is None, time.monotonic()
    while True:
        if first:  # the newest step committed already, and none older
            steps, newest, _ = _newest_committed(root, lambda loc: (_commit.head(loc).state, None))
            new = [] if newest is None else [newest]
        else:
            steps, new = scan(root, after=last)
        if not steps:  # a step's own directory, say, which would never yield one
            check_directory_of_steps(root)
        first = False
        for step in new:
            if is_committed(root.step(step)):  # not deleted since the listing
                last = step
                yield step
                idle_since = time.monotonic()
        waited = time.monotonic() - idle_since
        if timeout_s is not None and waited >= timeout_s:
            return
        time.sleep(poll_interval_s if timeout_s is None else min(poll_interval_s, timeout_s - waited))


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

    candidates, step, group = _newest_committed(root, look)
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
