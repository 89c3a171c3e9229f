"""Step directories: `<checkpoint_dir>/<step, zero-padded to 10 digits>`, one checkpoint each."""

from __future__ import annotations

from typing import Any

from . import _commit, _concurrency, _multihost, _naming, _options, _restore, _save, _storage
from ._storage import Location


def save_checkpoint(checkpoint_dir: str, step: int, state: Any, *,
                    storage_options: dict[str, Any] | None = None, **options: Any) -> None:
    """Saves `state` as step `step` under `checkpoint_dir` and commits it.

    Collective, like `save_pytree`, whose keyword options it takes (`overwrite`,
    `max_chunk_bytes`, ...). Raises what `save_pytree` raises (TypeError for an
    unknown option); CheckpointExistsError if the step is committed.
    """
    save_options = _options.gather(_options.SaveOptions, "save_checkpoint", options)
    job = _save.SaveJob.create(_storage.resolve(checkpoint_dir, storage_options).step(step), state, save_options)
    job.run(job.admitted())


def all_steps(checkpoint_dir: str, *, storage_options: dict[str, Any] | None = None) -> list[int]:
    """Every committed step under `checkpoint_dir`, ascending. Not collective."""
    return scan(_storage.resolve(checkpoint_dir, storage_options))[1]


def latest_step(checkpoint_dir: str, *, storage_options: dict[str, Any] | None = None) -> int | None:
    """The newest committed step under `checkpoint_dir`, or None. Not collective.

    Reads the commit marker of candidates newest first and stops at the first
    committed one, so uncommitted leftovers (a crashed save) are skipped.
    """
    return latest(_storage.resolve(checkpoint_dir, storage_options))


def latest(root: Location) -> int | None:
    """`latest_step` of the checkpoint directory `root`."""
    return next((s for s in reversed(candidate_steps(root)) if is_committed(root.step(s))), None)


def candidate_steps(root: Location) -> list[int]:
    steps = (_naming.parse_step_dir_name(name) for name in root.list_dir())
    return sorted(s for s in steps if s is not None)


def scan(root: Location) -> tuple[list[int], list[int]]:
    """Every step directory under `root`, and the committed ones among them, ascending:
    one listing, then every commit marker read concurrently."""
    steps = candidate_steps(root)
    committed = _concurrency.run_all(lambda s: is_committed(root.step(s)), steps, root.concurrency)
    return steps, [s for s, ok in zip(steps, committed) if ok]


def is_committed(loc: Location) -> bool:
    return _commit.state(loc) is _commit.State.COMMITTED


def load_checkpoint_if_it_exists(checkpoint_dir: str, target: Any, *,
                                 storage_options: dict[str, Any] | None = None,
                                 timeout_s: float = _multihost.DEFAULT_TIMEOUT_S,
                                 **options: Any) -> tuple[Any, int]:
    """Restores the newest committed step under `checkpoint_dir` onto `target`.

    Returns (state, step), or (target, 0) unchanged when nothing is committed yet, so
    a training loop can call it unconditionally at start-up.

    Collective: process 0 chooses the step and every process restores that one, even
    if a save commits another step in between. Takes `load_pytree`'s keyword options
    and raises what it raises (TypeError for an unknown option).
    """
    load_options = _options.gather(_options.LoadOptions, "load_checkpoint_if_it_exists", options)
    return restore_latest(_storage.resolve(checkpoint_dir, storage_options), target, load_options, timeout_s)


def restore_latest(root: Location, target: Any, options: _options.LoadOptions,
                   timeout_s: float) -> tuple[Any, int]:
    """`load_checkpoint_if_it_exists` under `root`. Collective."""
    step = _choose_step(root, timeout_s)
    if step is None:
        return target, 0
    return _restore.load(root.step(step), target, options), step


def _choose_step(root: Location, timeout_s: float) -> int | None:
    """Process 0's `latest`, on every process; its failure is raised everywhere."""
    op = _multihost.Collective("restore", timeout_s, what=f"choosing the step to restore under {root.url}")
    try:
        return op.decide("step", lambda: latest(root))
    finally:
        op.close()
