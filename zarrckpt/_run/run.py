"""A run: one directory of steps as the job that holds its lease sees it.

A `Run` owns the directory's location, its lease (process 0's), the committed steps and
their metrics as this job knows them, what to keep (`retention.Policy`) and deleting
the rest, and its lineage: what the newest step saved or restored holds, which a save
makes its unchanged chunks from. `CheckpointManager` is a run plus the policies of
when to save and a local tier; the calls marked collective below must be made by every
process of a `jax.distributed` job, with the same arguments.
"""

from __future__ import annotations

import difflib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .. import _finite, _options, _save, errors
from .._storage import Location
from .._util import multihost as _multihost
from .._util.programs import Programs
from . import guards as _guards, lease as _lease, lineage as _lineage, retention as _retention, steps as _steps

log = logging.getLogger("zarrckpt")


class Run:
    """The directory of steps `root`, held by this job (see `claim`).

    Thread-safe: commits are recorded from background saves while the training thread
    asks which steps are committed."""

    def __init__(self, root: Location, keep: _retention.Policy, *, heartbeat_s: float, timeout_s: float,
                 reuse_unchanged: bool) -> None:
        """Lists `root`'s committed steps (and, with `keep.best_metric`, reads their
        metrics). With `reuse_unchanged`, saves make the chunks of leaves unchanged since
        the newest step saved or restored from that step's. Raises
        CheckpointLocationError if `root` is a checkpoint itself or holds another
        library's checkpoints. Takes no lease: see `claim`."""
        self.root = root
        self.keep = keep
        # The device programs of this run's saves, compiled off the training thread.
        self.programs = Programs()
        self.lineage = _lineage.Lineage(self.programs) if reuse_unchanged else None
        # What the NaN check found in the newest step this job committed (process 0's),
        # with that save's identity: a leaf made from that very save holds what it held then.
        self._findings: tuple[str, str | None, _finite.Findings] | None = None
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._committed = set(_steps.scan(root)[1])
        _steps.check_directory_of_steps(root, has_steps=bool(self._committed))
        self._metrics = _retention.load_metrics(root, self._committed) if keep.best_metric is not None else {}
        self.lease = _lease.Lease(root, heartbeat_s) if _multihost.process_index() == 0 else None
        self._warned_unranked = False

    def claim(self, decide: Callable[[], str | None] = lambda: None) -> str | None:
        """Process 0 claims the directory, then runs `decide` (whose value every process
        gets back); a refusal is raised on every process (DirectoryInUseError naming the
        holder). On an object store every process first asks what the store honours
        (`Location.probe`), so that all write and copy alike. Collective."""
        def claimed() -> str | None:
            if self.lease is not None:
                self.lease.claim()
            return decide()

        with _multihost.Agreement("manager-open", self._timeout_s, what=f"claiming {self.root.url} for this job",
                                  error=errors.CheckpointWriteError) as op:
            if self.root.needs_probe:
                op.check("probe", lambda: self.root.probe(_lease.LEASES))
            return op.decide("claim", claimed)

    @property
    def fence(self) -> Callable[[str], None] | None:
        """Process 0's lease check (`Lease.check`, raising DirectoryInUseError once
        another job holds the directory), None on the other processes."""
        return None if self.lease is None else self.lease.check

    # -- what is committed ---------------------------------------------------------

    def committed_steps(self) -> set[int]:
        """The steps committed as this job knows them (its own commits included)."""
        with self._lock:
            return set(self._committed)

    def committed(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        """This job committed `step`, saved with `metrics`."""
        with self._lock:
            self._committed.add(step)
            if metrics is not None:
                self._metrics[step] = dict(metrics)

    def all_steps(self) -> list[int]:
        """Committed steps, ascending, read from storage. Not collective."""
        return _steps.scan(self.root)[1]

    def latest_step(self) -> int | None:
        """The newest committed step read from storage, or None. Not collective."""
        return _steps.latest(self.root)

    def step(self, step: int) -> Location:
        """The directory of committed `step`; CheckpointNotFoundError if it is not one."""
        return _steps.committed_step(self.root, step)

    # -- saving and restoring ------------------------------------------------------

    def plan_save(self, step: int, state: Any, options: _options.SaveOptions, *,
                  metrics: Mapping[str, Any] | None, compressor: _save.Compressor,
                  plans: _save.PlanCache) -> tuple[_save.SaveJob, Callable[[str | None], None]]:
        """Plans the save of `state` as `step`, guarded by the lease and checked for NaN
        and infinities (`_guards.ManagerGuard`), its unchanged leaves' chunks made from
        the lineage's step; returns the job and what to call, with the save's identity,
        once it has committed. Raises what `SaveJob.create` raises."""
        location = self.root.step(step)
        with self._lock:
            then = self._findings
        source = self.lineage.step() if self.lineage is not None else None
        same = then is not None and source is not None and (source[0].url, source[1]) == then[:2]
        guard = _guards.ManagerGuard(self.lease, step, then[2] if then is not None and same else None, self.programs)
        reuse = _lineage.ReuseUnchanged(self.lineage) if self.lineage is not None else _save.NO_REUSE
        job = _save.SaveJob.create(location, state, options, channel="manager-save",
                                   extra_metadata={"metrics": metrics} if metrics is not None else None,
                                   compressor=compressor, plans=plans, discard=True, guard=guard, reuse=reuse)

        def committed(save_id: str | None) -> None:
            self.committed(step, metrics)
            with self._lock:
                found = guard.findings
                self._findings = (location.url, save_id, found) if found is not None else None

        return job, committed

    def save_failed(self, step: int, url: str, error: BaseException) -> None:
        """The save of `step` into `url` failed with `error` (what it wrote is gone
        already, and its reuse collaborator was told), or what its commit triggered: after
        a failed retention, which may have deleted steps unknown, the next save writes
        every chunk. A Ctrl-C in a save run on the caller's thread is said by a warning."""
        committed = step in self.committed_steps()
        if self.lineage is not None and committed:
            self.lineage.forget()
        if not isinstance(error, Exception) and not committed:
            log.warning("%s was not saved: %s while it was being written; nothing was committed unless its commit "
                        "had been written (zarrckpt.all_steps says)", url, type(error).__name__)

    def restore(self, target: Any, options: _options.LoadOptions, step: int | None) -> tuple[Any, int | None]:
        """Restores `step`, or the newest committed step (None when there is none, and
        `target` comes back), onto `target`, and learns what it holds (a save makes its
        unchanged chunks from it). Raises CheckpointNotFoundError if `step` is not
        committed, and what `load_pytree` raises. Collective."""
        if step is None:
            state, restored, ckpt = _steps.restore_latest(self.root, target, options, self._timeout_s, self.lineage)
        else:
            (state, ckpt), restored = _steps.load_step(self.root, step, target, options, self.lineage), step
        if ckpt is None:  # none of any older save's
            self.restored_elsewhere()
        return state, restored

    def restored_elsewhere(self) -> None:
        """The state now comes from elsewhere (the local tier): no chunk is made from any
        step of this run until one is saved or restored again."""
        if self.lineage is not None:
            self.lineage.forget()

    # -- metrics -------------------------------------------------------------------

    def metrics(self, step: int) -> dict[str, Any] | None:
        """The metrics saved with committed `step`, or None if it was saved without.
        CheckpointNotFoundError if `step` is not committed. Not collective."""
        return _retention.metrics_of(self.root, self.step(step))

    def best_step(self) -> int | None:
        """The committed step with the best `best_metric`, among those saved with it, or
        None. ValueError without `best_metric`. Not collective."""
        if self.keep.best_metric is None:
            raise ValueError("best_step needs best_metric (and best_mode) given to the CheckpointManager")
        with self._lock:
            metrics = {step: self._metrics.get(step, {}) for step in self._committed}
        ranked = _retention.ranked(self.keep, metrics)
        return ranked[0] if ranked else None

    def warn_unranked(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        """Warns, once, when `keep_best` cannot rank a save: its metrics lack
        `best_metric` (a misspelling would delete the best step as unranked)."""
        name = self.keep.best_metric
        if name is None or self._warned_unranked or (metrics is not None and name in metrics):
            return
        self._warned_unranked = True
        close = difflib.get_close_matches(name, list(metrics or ()), n=1)
        log.warning("step %d is saved without best_metric %r in its metrics (%s): keep_best cannot rank it, and "
                    "keeps only steps that have it%s", step, name, ", ".join(map(repr, metrics or ())) or "none",
                    f"; did you mean {close[0]!r}?" if close else "")

    # -- keeping and deleting ------------------------------------------------------

    def retain(self) -> list[int]:
        """Applies the keep policy: process 0 deletes (its lease checked first), every
        process waits for it and learns what went; returns the steps deleted.
        Collective."""
        with self._lock:
            metrics = dict(self._metrics)
        with _multihost.Agreement("manager-retain", self._timeout_s, what=f"retention under {self.root.url}") as op:
            deleted: list[int] = op.decide("retain", lambda: _retention.apply(self.root, self.keep, metrics,
                                                                              fence=self.fence))
        with self._lock:
            self._committed.difference_update(deleted)
        self._drop(deleted)  # a rollback's step, older than the newest: gone
        return deleted

    def _drop(self, steps: Iterable[int]) -> None:
        """No save makes its chunks from `steps` any more."""
        if self.lineage is not None:
            self.lineage.dropped({self.root.step(step).url for step in steps})

    def delete(self, step: int, *, forget: Iterable[Callable[[int], None]] = ()) -> None:
        """Deletes committed `step`, pinned or not, its commit marker first; each of
        `forget` (what would bring the step back) and the lineage are told first on every
        process. Process 0 deletes, its lease checked first; every process
        returns once it has. Raises CheckpointNotFoundError if `step` is not committed,
        CheckpointWriteError if its directory holds files that are not the
        checkpoint's (nothing is then deleted), DirectoryInUseError if another job took
        the directory over. Collective."""
        with _multihost.Agreement("manager-delete", self._timeout_s,
                                  what=f"deleting step {step} of {self.root.url}") as op:
            # Asked of process 0 for all: asked by each, a process behind would find the step
            # that process 0 had already deleted, and fail alone.
            op.decide("committed", lambda: self.step(step).url)
            for tell in forget:
                tell(step)
            self._drop([step])
            deleted = op.decide("delete", lambda: self._delete_on_process_0(step))
        if not deleted:
            raise errors.CheckpointWriteError(f"step {step} of {self.root.url} was not deleted: its directory also "
                                              "holds files that are not the checkpoint's (see the warning)")
        with self._lock:
            self._committed.discard(step)
            self._metrics.pop(step, None)

    def _delete_on_process_0(self, step: int) -> bool:
        # The lease is checked inside the decision: its error reaches every process.
        assert self.lease is not None  # process 0's
        self.lease.check(f"step {step} not deleted")
        return _retention.delete(self.root, step, committed=True, why="delete()")

    def pin(self, step: int) -> None:
        """Exempts committed `step` from retention, by a PINNED file in its directory.
        ValueError, on a local disk, if a top-level leaf of the step is named so."""
        if not _retention.pin(self.step(step)):
            raise ValueError(f"step {step} cannot be pinned: a leaf of it is named {_retention.PIN_FILE!r}, the "
                             "pin file's name")

    def unpin(self, step: int) -> None:
        """Lets retention delete committed `step` again (removes its PINNED file, if
        any). CheckpointNotFoundError if `step` is not committed."""
        _retention.unpin(self.step(step))
