"""CheckpointManager: when to save, saving in the background, what to keep."""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook is registered before ours: see _OpenManagers)
import dataclasses
import functools
import gc
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from . import _deprecated, _inflight, _options, _preemption, _save, _schedule, _storage
from ._format import naming as _naming, zarrjson as _zarrjson
from ._restore import renames as _renames
from ._run import (
    lease as _lease,
    retention as _retention,
    run as _run,
)
from ._tier import tier as _tiers
from ._util import concurrency as _concurrency, multihost as _multihost, progress as _progress
from .errors import DirectoryInUseError

log = logging.getLogger("zarrckpt")


def default_inflight_bytes() -> int:
    """A manager's byte budget by default: a quarter of the memory this process may use
    (the host's, or its cgroup's limit), at least 8 GiB, so that a training state
    that size is staged whole and an async save never waits for writes (a fixed 8 GiB
    made `save` of an 8.0001 GiB state on a 128 GiB GPU host block until a chunk was
    written, 0.24 s instead of milliseconds)."""
    return max(8 * 2**30, _concurrency.memory_bytes() // 4)


class CheckpointManager:
    """Saves a training state every so often under one directory of steps, and restores it.

        with zarrckpt.CheckpointManager("gs://bucket/run", save_interval_steps=1000, keep_last=3) as mgr:
            state, step = mgr.restore(state)          # newest committed step, or (state, 0)
            for step in range(step + 1, num_steps + 1):
                state = train_step(state)
                mgr.save(step, state)                  # saves when a policy says so

    Collective under `jax.distributed`: every process makes the same calls (`save`,
    `restore`, `wait`, `delete`, `reached_preemption`, `close`) with the same
    arguments; `all_steps`, `latest_step`, `metrics`, `best_step`, `pin` and `unpin`
    are not. One manager holds a directory at a time (a lease): one of another process
    or host is refused with DirectoryInUseError. A manager of this process still open on
    the same directory (a notebook cell run again, whose traceback holds the manager it
    made; one deleted while its save was in flight) is taken over, with a warning: its
    saves in flight commit first (waited for at most `timeout_s`), its leases are given
    back and claimed anew, and it then refuses `save`, `delete` and `restore` with
    DirectoryInUseError naming this one. Readers need no manager (`load_checkpoint`,
    `checkpoints_iterator`). In a process forked from the one that made it, a manager
    raises RuntimeError and its lease stays the parent's.

    Args:
      checkpoint_dir: local path or fsspec URL holding one directory per step.
      save_interval_steps: save when `step % save_interval_steps == 0`.
      save_interval_seconds: save when this long has passed since the last save
        started. With neither interval, every `save` call saves.
      keep_last, keep_every, keep_best, best_metric, best_mode: what retention keeps
        (process 0, after each commit, off the training thread): the newest N steps,
        every step divisible by K, the N best by `metrics[best_metric]` ("min" or
        "max"). The newest step, pinned steps and the newest step without NaN or
        infinities are always kept; without keep_last or keep_best nothing is deleted.
      async_save: `save` returns once the copies off the devices are dispatched;
        writing and committing go on in the background (one save in flight), on threads
        at a lower priority (Linux), on a local disk one per 4 cores unless `max_workers`.
      reuse_unchanged: a jax.Array leaf that holds exactly what it held in the newest step
        this manager saved or restored (the very same array, or every shard with the same
        fingerprint, computed on its device) has its chunks made from that step's (a hard
        link, a copy inside S3 or GCS) instead of written. Each step is complete on its own.
      max_inflight_bytes: host memory a save may hold in copies not yet written
        (default: a quarter of this process's memory limit, at least 8 GiB); past it,
        `save` waits for writes. `max_staged_bytes` is a deprecated alias.
      save_on_preemption: save at a preemption notice (JAX's preemption sync point;
        SIGTERM in a job of one process) and report it by `reached_preemption`.
      heartbeat_s: how often process 0 renews its lease on the directory.
      progress: progress bars on process 0 (default: when stderr is a terminal).
      local_directory, local_save_interval_steps: the local tier, given together: every
        N steps each process saves what its devices hold under this path on its own
        disk (a RAM disk, a local SSD; this user's alone, made with mode 0700), and
        `restore` takes the newest step the local copies rebuild when it is newer than
        the newest persistent one. A local save that fails or would not fit is skipped
        with a warning; a damaged copy is set aside and the restore goes on.
      local_keep_last: local copies each process keeps.
      local_peer_copies: how many other processes also keep each process's local copy,
        so that a lost host is rebuilt from its peers (needs more processes than that).
      local_peer_group: this process's failure domain; peers are chosen in others
        (default: its slice where the devices say, else its host).
      storage_options, timeout_s, max_chunk_bytes, min_chunk_bytes: as for `save_pytree`, for the persistent tier.
      max_workers, checksums, compression: as for `save_pytree`, for the persistent tier.

    Raises TypeError or ValueError naming the option on an unknown, ill-typed or
    contradictory setting; CheckpointLocationError if `checkpoint_dir` is a checkpoint
    itself, holds another library's checkpoints, or `local_directory` is not this
    user's alone; DirectoryInUseError if another live job holds either directory, or
    if the save in flight of the manager of this process it takes over has not
    finished within `timeout_s` (that manager is then left as it was).
    """

    def __init__(
        self,
        checkpoint_dir: str,
        *,
        save_interval_steps: int | None = None,
        save_interval_seconds: float | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        async_save: bool = True,
        reuse_unchanged: bool = True,
        max_inflight_bytes: int | None = None,
        save_on_preemption: bool = True,
        heartbeat_s: float = _lease.DEFAULT_HEARTBEAT_S,
        progress: bool | None = None,
        storage_options: dict[str, Any] | None = None,
        timeout_s: float = _options.DEFAULT_TIMEOUT_S,
        max_chunk_bytes: int = _options.DEFAULT_MAX_CHUNK_BYTES,
        min_chunk_bytes: int = _options.DEFAULT_MIN_CHUNK_BYTES,
        max_workers: int | None = None,
        checksums: bool = True,
        compression: str | None = None,
        local_directory: str | None = None,
        local_save_interval_steps: int | None = None,
        local_keep_last: int = 1,
        local_peer_copies: int = 0,
        local_peer_group: str | None = None,
        max_staged_bytes: int | None = None,
    ) -> None:
        inflight, inflight_option = _deprecated.argument("CheckpointManager", "max_inflight_bytes", max_inflight_bytes,
                                                         "max_staged_bytes", max_staged_bytes)
        _check_options(save_interval_steps=save_interval_steps, local_save_interval_steps=local_save_interval_steps,
                       local_keep_last=local_keep_last, local_peer_copies=local_peer_copies,
                       save_interval_seconds=save_interval_seconds, async_save=async_save,
                       reuse_unchanged=reuse_unchanged, **{inflight_option: inflight},
                       save_on_preemption=save_on_preemption, heartbeat_s=heartbeat_s)
        keep = _retention.Policy(keep_last=keep_last, keep_every=keep_every, keep_best=keep_best,
                                 best_metric=best_metric, best_mode=best_mode)
        self._save_options = _options.SaveOptions(
            max_chunk_bytes=max_chunk_bytes, min_chunk_bytes=min_chunk_bytes, max_workers=max_workers,
            max_inflight_bytes=default_inflight_bytes() if inflight is None else inflight, timeout_s=timeout_s,
            progress=progress, checksums=checksums, compression=compression)
        # A local disk takes writes at the speed of memory: compressing never pays there.
        self._local_options = dataclasses.replace(self._save_options, compression=None)
        self._compressor = _save.Compressor()
        self._plans = _save.PlanCache()  # the last persistent save's, for the next of the same tree
        root = _storage.resolve(checkpoint_dir, storage_options).keeping_found()  # the lease guards it
        self._pid = os.getpid()
        self._root = root
        self._name = f"the CheckpointManager made at {_made_at()}"  # in messages
        self._successor: str | None = None  # the manager of this process that took this one's directory over
        local = _tiers.local_directory(local_directory, local_save_interval_steps, local_peer_copies, local_peer_group)
        if (earlier := _open_managers.take(root.place())) is not None:  # checked first: what a new one refuses
            # Before the run is read: the steps its saves in flight commit are committed then.
            _open_managers.hand_over(earlier, self._name, timeout_s)
        self._schedule = _schedule.SaveSchedule(save_interval_steps, save_interval_seconds, timeout_s=timeout_s)
        self._async = async_save
        self._preemption = _preemption.Notice(listen=save_on_preemption)
        self._warned_older = False
        self._progress = progress
        self._timeout_s = timeout_s
        # A checkpoint itself (even one a manager saved steps into), or Orbax's: refused.
        self._run = _run.Run(root, keep, heartbeat_s=heartbeat_s, timeout_s=timeout_s,
                            reuse_unchanged=reuse_unchanged)
        self._restored_step: int | None = None
        self._restored_tier: str | None = None
        self._in_flight = _inflight.InFlight()
        self._tier: _tiers.LocalTier | None = None
        self._closed = True  # until the leases are ours
        try:  # a failure or a Ctrl-C from here on gives back what was taken: no caller holds a manager to close
            run = self._run.claim((lambda: _tiers.run_identity(root)) if local is not None else (lambda: None))
            if local is not None and run is not None:
                self._tier = _tiers.LocalTier.open(local, run, local_save_interval_steps or 0, local_keep_last,
                                                   heartbeat_s=heartbeat_s, timeout_s=timeout_s,
                                                   peer_copies=local_peer_copies, peer_group=local_peer_group)
            # A manager nobody holds any more (a notebook cell run again) gives its leases
            # back; the leases' threads never hold the manager.
            self._release = weakref.finalize(self, _release, self._run.lease, self._tier)
        except BaseException:
            _release(self._run.lease, self._tier)
            raise
        self._closed = False
        _open_managers.register(self)

    # -- saving ----------------------------------------------------------------

    def save(self, step: int, state: Any, *, metrics: Mapping[str, Any] | None = None,
             force: bool = False) -> bool:
        """Saves `state` as `step` if a policy says so (or `force`); returns whether it did.

        `metrics` (for `keep_best`, and kept in the checkpoint) maps names to real
        numbers (Python or numpy numbers, 0-d numpy or jax arrays); NaN and infinities
        are kept as "NaN", "Infinity", "-Infinity" and never rank as best.

        With async_save, returns once the state's copies off the devices are dispatched
        (and the fingerprints `reuse_unchanged` compares computed): the caller may then
        donate or overwrite its buffers. Waits first for the previous save. Without
        async_save, returns once the save and the retention it triggers are done.
        Raises TypeError or ValueError for a bad step or metric (nothing is saved), the
        error of an earlier background save or deletion, and what `save_pytree` raises
        (a failed save removes what it wrote first). A step already committed is not
        saved again, nor, without `force`, one older than the newest committed step (a
        warning, once), unless newer than the step `restore` was asked for.
        """
        step = _naming.step_number(step)  # a bad step is refused here
        self._check_open()
        location = self._root.step(step)
        values = _metric_values(metrics)
        # Asked at every call, before anything can return early: under jax.distributed
        # the notice is agreed at one step, which every process must ask about.
        self._preemption.look(step, saving=True)
        self._in_flight.raise_errors()
        for_notice = self._preemption.unsaved  # this save is the notice's, whatever the policy says
        persistent = self._should_save(step, force or for_notice)
        if for_notice and not persistent:  # committed or in flight already: that save is the notice's
            self._preemption.saved = step
        copy = self._tier is not None and self._tier.due(step)
        if not (persistent or copy):
            return False
        if persistent:
            self._run.warn_unranked(step, values)
        called = time.perf_counter()
        self.wait()
        saves: list[_save.BackgroundSave] = []  # the persistent save first: the one that must not fail
        making = None  # what the save being made writes, while it is made
        try:
            if persistent:
                making = location.url
                saves.append(self._persistent_save(step, location, state, values, called))
            if copy and self._tier is not None:
                making = f"the local copy of step {step}"
                if (copy_save := self._tier.save(step, state, self._local_options, self._run.committed_steps(),
                                                 self._timeout_s)) is not None:
                    saves.append(copy_save)
        except BaseException as e:
            if not isinstance(e, Exception):  # a Ctrl-C's traceback alone does not say that the step was lost
                _inflight.warn_unsaved([save.url for save in saves] + [making], e)
            raise
        if not saves:
            return False
        self._in_flight.start(saves, step, background=self._async)
        self._in_flight.raise_errors()  # without async_save: the persistent save's error
        if for_notice:
            self._preemption.saved = step
        return True

    def _persistent_save(self, step: int, location: _storage.Location, state: Any,
                         metrics: Mapping[str, float] | None, called: float) -> _save.BackgroundSave:
        started = time.perf_counter()
        self._schedule.started()
        job, record = self._run.plan_save(step, state, self._save_options, metrics=metrics,
                                          compressor=self._compressor, plans=self._plans)
        # The job holds the state: the commit's report must not.
        nbytes, note = job.nbytes, job.reuse_note()

        def committed() -> None:
            seconds = time.perf_counter() - started
            record(save.save_id)
            if _multihost.process_index() == 0:
                # `save` blocked training from its call until the copies were dispatched,
                # waiting for the save before it included.
                blocked = "" if save.staged is None else (
                    f", training blocked {save.staged - called:.3f}s"
                    + (f" ({started - called:.3f}s of it waiting for the previous save)"
                       if started - called >= 0.001 else ""))
                log.info("checkpoint step %d committed to %s: %s%s%s", step, self._root.url,
                         _progress.rate(nbytes, seconds), blocked, note)
            if self._run.keep.deletes:
                self._run.retain()

        save = _save.BackgroundSave(job, f"zarrckpt-save-{step}", on_commit=committed,
                                    on_failure=functools.partial(self._failed, step, location.url))
        return save

    def _failed(self, step: int, url: str, error: BaseException) -> None:
        """A persistent save failed: its error is raised by the next call."""
        self._in_flight.failed(error)
        self._run.save_failed(step, url, error)

    def _should_save(self, step: int, force: bool) -> bool:
        # Committed read first: a save in flight stays in `_in_flight` until `wait`, so a
        # commit between the two reads is seen by one of them.
        committed = self._run.committed_steps()
        in_flight, flying = self._in_flight.urls(), self._in_flight.step()
        # The step in flight too: the run learns of a commit on each process's own
        # background thread, `_in_flight` only here, the same on every process.
        newest = max(committed | ({flying} if flying is not None else set()), default=None)
        if step in committed or self._root.step(step).url in in_flight:
            return False
        # A loop restored on purpose to an older step (`restore(..., step=...)`) saves on from it.
        rolled_back = self._restored_step is not None and step > self._restored_step
        if newest is not None and step < newest and not force and not rolled_back:
            if not self._warned_older:
                self._warned_older = True
                log.warning("step %d is older than step %d, the newest committed under %s: not saved, nor any "
                            "older step (a restore would never pick it; was the step counter restored with the "
                            "state?); save(..., force=True) saves one anyway, and mgr.delete(%d) deletes the "
                            "newer one", step, newest, self._root.url, newest)
            return False
        return force or self._schedule.due(step)

    # -- waiting, restoring, listing --------------------------------------------

    def wait(self) -> None:
        """Blocks until the save in flight has committed and the retention its commit
        triggered has run; raises its error if it failed. Agreement."""
        self._check_process()
        self._in_flight.wait()

    def restore(self, target: Any, *, step: int | None = None, partial: bool = False, allow_dtype_cast: bool = False,
                donate_target: bool = False, load_and_broadcast: bool = True,
                max_inflight_bytes: int = _options.DEFAULT_MAX_INFLIGHT_BYTES, max_workers: int | None = None,
                progress: bool | None = None, rename: _renames.Given = None, fallback: bool = False) -> tuple[Any, int]:
        """Restores the newest committed step (or `step`) onto `target`. Agreement.

        Returns (state, step); (target, 0), with a warning, when nothing is committed
        and no `step` was asked for. With a local tier and no `step`, the newest step
        the local copies rebuild is taken when newer than the newest persistent one
        (`restored_tier` says which). Waits for a save in flight first. Takes
        `load_pytree`'s options, `rename` and `fallback` among them (the manager's
        `max_workers` and `progress` unless given). Raises CheckpointNotFoundError if
        `step` is not a committed step, and what `load_pytree` raises.
        """
        step = None if step is None else _naming.step_number(step)
        if isinstance(target, (int, np.integer)) and not isinstance(target, bool):
            raise TypeError(f"CheckpointManager.restore takes the restore target first (the state to restore "
                            f"into, or None for numpy arrays); to restore step {target}, call "
                            f"mgr.restore(state, step={target})")
        options = _options.LoadOptions(partial=partial, allow_dtype_cast=allow_dtype_cast,
                                       donate_target=donate_target, load_and_broadcast=load_and_broadcast,
                                       max_inflight_bytes=max_inflight_bytes, rename=_renames.parse(rename),
                                       max_workers=max_workers or self._save_options.max_workers, fallback=fallback,
                                       progress=self._progress if progress is None else progress).onto(target)
        self._check_open()
        self.wait()
        started = time.perf_counter()
        local, restored = None, step
        if step is None and self._tier is not None:
            local = _tiers.restore_newer_copy(self._root, self._tier, target, options, self._timeout_s)
        if local is not None:
            (state, restored), tier = local, "local"
            self._run.restored_elsewhere()
        else:
            (state, restored), tier = self._run.restore(target, options, step), "persistent"
        self._restored_step = restored
        self._restored_tier = tier if restored is not None else None
        if self._tier is not None:  # copies newer than this are of abandoned training: never restore them
            self._tier.forget_newer(restored)
        if restored is not None and _multihost.process_index() == 0:  # the read itself said what it read
            log.debug("restored step %d from %s in %.2fs", restored,
                      self._root.url if tier == "persistent" else "the local tier", time.perf_counter() - started)
        return state, restored or 0

    @property
    def restored_step(self) -> int | None:
        """The step the last `restore` restored, or None if it restored nothing (nothing
        was committed: it returned the target and step 0) or none was called."""
        return self._restored_step

    @property
    def restored_tier(self) -> str | None:
        """The tier the last `restore` read: "local", "persistent", or None if it
        restored nothing."""
        return self._restored_tier

    def metrics(self, step: int) -> dict[str, Any] | None:
        """The metrics saved with committed `step` (as `save` stored them: numbers, and
        "NaN", "Infinity", "-Infinity"), or None if it was saved without. Reads the
        step's metadata; CheckpointNotFoundError if `step` is not committed. Not
        collective."""
        return self._run.metrics(_naming.step_number(step))

    def best_step(self) -> int | None:
        """The committed step with the best `best_metric` (by `best_mode`), among those
        saved with it, or None. Needs `best_metric`. Not collective."""
        return self._run.best_step()

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (read from storage). Not collective."""
        return self._run.all_steps()

    def latest_step(self) -> int | None:
        """The newest committed step, or None. Not collective."""
        return self._run.latest_step()

    def pin(self, step: int) -> None:
        """Exempts committed `step` from retention, by a PINNED file in its directory;
        ValueError, on a local disk, if a top-level leaf of the step is named so."""
        self._run.pin(_naming.step_number(step))

    def unpin(self, step: int) -> None:
        """Lets retention delete committed `step` again (removes its PINNED file, if any:
        an imported step's too). CheckpointNotFoundError if `step` is not committed."""
        self._run.unpin(_naming.step_number(step))

    def delete(self, step: int) -> None:
        """Deletes committed `step` now, pinned or not, its commit marker first, after the
        save in flight; with a local tier, each process's copy of it too. Collective:
        process 0 deletes, every process returns once it has. Raises
        CheckpointNotFoundError if `step` is not committed, CheckpointWriteError if its
        directory holds files that are not the checkpoint's (nothing is deleted),
        DirectoryInUseError if another job took the directory over."""
        step = _naming.step_number(step)
        self._check_open()
        self.wait()
        # Told before the deletion: a restore would bring the step back from the local
        # tier, and a save would make its chunks from it.
        self._run.delete(step, forget=[self._tier.forget] if self._tier is not None else [])

    # -- lifetime ----------------------------------------------------------------

    def reached_preemption(self, step: int) -> bool:
        """Whether a preemption notice came and `step` is at or past the step saved for
        it; then that save has committed (this waits for it) and the loop should stop:
        `if mgr.reached_preemption(step): break` after `mgr.save(step, state)`. A notice
        seen here rather than in `save` makes the next `save` save its step whatever the
        policy. The notice is JAX's preemption sync point under `jax.distributed` (then
        this is collective: every process calls it at every step), SIGTERM in a job of
        one process. Always False with `save_on_preemption=False`."""
        step = _naming.step_number(step)
        self._check_process()
        if not self._closed:  # a closed manager listens no more: SIGTERM ends the process again
            self._preemption.take_sigterm()
        self._preemption.look(step, saving=False)
        saved = self._preemption.saved
        if saved is None or step < saved:
            return False
        self.wait()
        return True

    def close(self) -> None:
        """Waits for the save in flight and pending deletions; raises their errors.
        Interrupted (Ctrl-C), it leaves the manager open with the save going on. A manager
        never closed is closed at exit (its save waited for at most `timeout_s`). In a
        process forked from the manager's, does nothing."""
        if self._closed or os.getpid() != self._pid:
            return
        try:
            self.wait()
        except KeyboardInterrupt:
            if not self._in_flight.unfinished():
                self._end()
            raise
        except BaseException:
            self._end()
            raise
        self._end()
        self._in_flight.raise_errors()

    def _end(self) -> None:
        self._closed = True
        self._preemption.close()
        self._release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: Any) -> None:
        if kind is KeyboardInterrupt:
            if pending := [save.url for save in self._in_flight.unfinished()]:
                log.warning("waiting for %s to commit before leaving (Ctrl-C again stops waiting here; the program's "
                            "exit then waits for it)", ", ".join(pending))
        self.close()

    def _check_open(self) -> None:
        self._check_process()
        if self._successor is not None:
            raise DirectoryInUseError(
                f"{self._root.url} was taken over by {self._successor} of this process: this one ({self._name}) "
                "saves, deletes and restores no more; use the newer one (or, if it failed to open, make a new one)")
        if self._closed:
            raise RuntimeError(f"CheckpointManager for {self._root.url} is closed")

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"CheckpointManager for {self._root.url} belongs to process {self._pid}, which made it; this process "
                f"(pid {os.getpid()}) was forked from it and cannot use it (its lease and its saves are the "
                "parent's): save from the parent, and read steps here with zarrckpt.load_checkpoint or "
                "zarrckpt.latest_step, which need no manager")


_OPTION_KINDS = {"save_interval_steps": _options.COUNT + "?", "local_save_interval_steps": _options.COUNT + "?",
                 "local_keep_last": _options.COUNT, "local_peer_copies": _options.COUNT_OR_ZERO,
                 "save_interval_seconds": _options.NUMBER + "?", "async_save": _options.FLAG,
                 "reuse_unchanged": _options.FLAG, "max_inflight_bytes": _options.COUNT + "?",
                 "max_staged_bytes": _options.COUNT + "?", "save_on_preemption": _options.FLAG,
                 "heartbeat_s": _options.NUMBER}


def _check_options(**given: Any) -> None:
    """Raises TypeError or ValueError naming the first of a manager's `given` options
    (see `_OPTION_KINDS`) that is ill-typed or out of range."""
    for name, value in given.items():
        _options.check(name, value, _OPTION_KINDS[name])


def _release(lease: _lease.Lease | None, tier: _tiers.LocalTier | None) -> None:
    """Gives a manager's leases back (on `close`, or once nobody holds the manager)."""
    if lease is not None:
        lease.release()
    if tier is not None:
        tier.close()


def _metric_values(metrics: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`metrics` as JSON numbers (see `CheckpointManager.save`); TypeError naming the
    first metric that is not a real number."""
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must map names to numbers, got {type(metrics).__name__}")
    values = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise TypeError(f"metric names must be str, got {name!r}")
        if isinstance(value, (jax.Array, np.ndarray, np.generic)) and np.shape(value) == ():
            value = np.asarray(value).item()  # a jax value is fetched to the host here
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"metric {name!r} must be a real number (a Python or numpy number, or a 0-d numpy or "
                            f"jax array), got {type(value).__name__} {value!r}")
        values[name] = value if math.isfinite(value) else _zarrjson.NON_FINITE[str(value)]
    return values


def _made_at() -> str:
    """Where the caller outside zarrckpt made a manager ("file:line"), to name the
    manager in another one's messages."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _close_left_open(manager: CheckpointManager) -> None:
    """`close`, at this program's exit, for a manager nobody closed: its save in flight
    commits (or, after `timeout_s` or another Ctrl-C, is left uncommitted, said by a
    warning naming it), never cut off by the interpreter's end."""
    if manager._closed:
        return
    for save in manager._in_flight.unfinished():
        log.warning("exiting while %s is being saved by a CheckpointManager nobody closed: waiting for it "
                    "(close() the manager, or use `with`, to wait where you choose)", save.url)
        try:
            finished = save.join(manager._timeout_s)
        except KeyboardInterrupt:
            finished = False
        if not finished:
            log.error("%s left uncommitted at exit: its save did not finish (every reader skips it)", save.url)
            return  # the rest is cut off with the interpreter, as it would be without this
    manager.close()  # its error is logged by the exit hook


class _OpenManagers:
    """The managers of this process still open: each closed at this program's exit (see
    `_close_left_open`), and one found by a new manager on its directory (`take`).

    It runs where the interpreter's shutdown begins, with threading's own exit hooks
    (Python's `atexit` where those are missing), registered after `concurrent.futures`
    registered its own, so before it (they run last registered first): after it thread
    pools take no more work, and a save still writing could not finish. `atexit` comes
    later still, after `jax.distributed`'s shutdown. A forked child leaves its parent's
    managers alone (their threads are the parent's), and closes its own, and a new
    manager in it never takes one of the parent's over.

    Held weakly: a manager nobody holds gives its leases back (its finalizer). A manager
    with a save in flight is never such, the save's thread holding it until it ends.
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._managers: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()
        getattr(threading, "_register_atexit", atexit.register)(self._close_all)
        os.register_at_fork(after_in_child=self._forget)

    def register(self, manager: CheckpointManager) -> None:
        with self._lock:
            self._managers.add(manager)

    def take(self, place: tuple[str, str]) -> CheckpointManager | None:
        """The manager of this process still open on the directory at `place`
        (`Location.place`: the store, its endpoint included, and the path), no longer
        kept here (one new manager takes it over); None if there is none, once the
        garbage is collected (a manager only garbage holds gives its leases back as it
        is collected: nothing to take over)."""
        if self._find(place) is None:
            return None
        gc.collect()
        with self._lock:
            if (found := self._find(place)) is not None:
                self._managers.discard(found)
            return found

    def hand_over(self, earlier: CheckpointManager, successor: str, timeout_s: float) -> None:
        """Ends `earlier` for `successor`, a new manager of this process on its
        directory: waits for its saves in flight to commit (at most `timeout_s`; their
        errors are logged, none raised), gives its leases back, and from then on refuses
        `save`, `delete` and `restore` naming `successor`. Raises DirectoryInUseError,
        handing nothing over, if a save is still in flight after `timeout_s`. Not
        collective: under `jax.distributed` each process hands its own earlier manager
        over, so a handover that fails on one process leaves the others' ended."""
        pending = earlier._in_flight.unfinished()
        log.warning("%s is held by %s, of this process and never closed (a notebook cell run again, or a manager "
                    "deleted while saving): %s takes it over%s, and the earlier one saves no more", earlier._root.url,
                    earlier._name, successor,
                    f" once {', '.join(save.url for save in pending)} has committed" if pending else "")
        deadline = time.monotonic() + timeout_s
        try:
            for save in pending:
                if not save.join(max(0.0, deadline - time.monotonic())):
                    raise DirectoryInUseError(
                        f"{earlier._root.url} is held by {earlier._name}, of this process, whose save of "
                        f"{save.url} did not finish within {timeout_s:g}s: wait for it, or close() that manager")
        except BaseException:  # a Ctrl-C too: still open, so closed at exit or taken over by a later manager
            self.register(earlier)
            raise
        try:
            earlier._in_flight.wait()
        except Exception as e:  # the earlier manager's, which nobody would raise any more
            log.warning("the earlier CheckpointManager of %s, taken over, had a save or deletion that failed: %s",
                        earlier._root.url, e)
        earlier._successor = successor
        earlier._end()

    def _find(self, place: tuple[str, str]) -> CheckpointManager | None:
        pid = os.getpid()
        return next((m for m in list(self._managers)
                     if not m._closed and m._pid == pid and m._root.place() == place), None)

    def _forget(self) -> None:
        self._managers = weakref.WeakSet()

    def _close_all(self) -> None:
        for manager in list(self._managers):
            try:
                _close_left_open(manager)
            except BaseException as e:  # a Ctrl-C here must not stop the rest of the shutdown
                log.error("closing the CheckpointManager of %s at exit: %s", manager._root.url, e)


_open_managers = _OpenManagers()
