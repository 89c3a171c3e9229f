"""Step directories: `<checkpoint_dir>/<step, zero-padded to 10 digits>`, one checkpoint each."""

from __future__ import annotations

from typing import Any

from . import _commit, _concurrency, _multihost, _naming, _restore, _save, _storage
from ._storage import Location


def step_location(checkpoint_dir: str, step: int, storage_options: dict[str, Any] | None = None) -> Location:
    return _storage.resolve(checkpoint_dir, storage_options).child(_naming.step_dir_name(step))


def save_checkpoint(checkpoint_dir: str, step: int, state: Any, *,
                    storage_options: dict[str, Any] | None = None, **options: Any) -> None:
    """Saves `state` as step `step` under `checkpoint_dir` and commits it.

    Collective, like `save_pytree`, whose keyword options it takes (`overwrite`, ...).
    Raises what `save_pytree` raises; CheckpointExistsError if the step is committed.
    """
    loc = step_location(checkpoint_dir, step, storage_options)
    _save.save_pytree(loc.url, state, storage_options=storage_options, **options)


def all_steps(checkpoint_dir: str, *, storage_options: dict[str, Any] | None = None) -> list[int]:
    """Every committed step under `checkpoint_dir`, ascending. Not collective."""
    return scan(_storage.resolve(checkpoint_dir, storage_options))[1]


def latest_step(checkpoint_dir: str, *, storage_options: dict[str, Any] | None = None) -> int | None:
    """The newest committed step under `checkpoint_dir`, or None. Not collective.

    Reads the commit marker of candidates newest first and stops at the first
    committed one, so uncommitted leftovers (a crashed save) are skipped.
    """
    root = _storage.resolve(checkpoint_dir, storage_options)
    return next((s for s in reversed(candidate_steps(root)) if _is_committed(root, s)), None)


def candidate_steps(root: Location) -> list[int]:
    steps = (_naming.parse_step_dir_name(name) for name in root.list_dir())
    return sorted(s for s in steps if s is not None)


def scan(root: Location) -> tuple[list[int], list[int]]:
    """Every step directory under `root`, and the committed ones among them, ascending:
    one listing, then every commit marker read concurrently."""
    steps = candidate_steps(root)
    committed = _concurrency.run_all(lambda s: _is_committed(root, s), steps, root.concurrency)
    return steps, [s for s, ok in zip(steps, committed) if ok]


def _is_committed(root: Location, step: int) -> bool:
    return _commit.state(root.child(_naming.step_dir_name(step))) is _commit.State.COMMITTED


def load_checkpoint_if_it_exists(checkpoint_dir: str, target: Any, *,
                                 storage_options: dict[str, Any] | None = None,
                                 timeout_s: float = _multihost.DEFAULT_TIMEOUT_S,
                                 **options: Any) -> tuple[Any, int]:
    """Restores the newest committed step under `checkpoint_dir` onto `target`.

    Returns (state, step), or (target, 0) unchanged when nothing is committed yet, so
    a training loop can call it unconditionally at start-up.

    Collective: process 0 chooses the step and every process restores that one, even
    if a save commits another step in between. Takes `load_pytree`'s keyword options
    and raises what it raises.
    """
    step = _choose_step(checkpoint_dir, storage_options, timeout_s)
    if step is None:
        return target, 0
    loc = step_location(checkpoint_dir, step, storage_options)
    return _restore.load_pytree(loc.url, target, storage_options=storage_options, **options), step


def _choose_step(checkpoint_dir: str, storage_options: dict[str, Any] | None, timeout_s: float) -> int | None:
    """Process 0's latest_step, on every process; its failure is raised everywhere."""
    op = _multihost.Collective("restore", timeout_s, what=f"choosing the step to restore under {checkpoint_dir}")
    try:
        return op.decide("step", lambda: latest_step(checkpoint_dir, storage_options=storage_options))
    finally:
        op.close()
