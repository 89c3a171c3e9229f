"""CheckpointManager: when to save, saving in the background, what to keep."""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook is registered before ours: see _AtExit)
import contextlib
import dataclasses
import difflib
import functools
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from . import _deprecated, _finite, _options, _preemption, _save, _storage, errors
from ._format import naming as _naming
from ._run import lease as _lease, lineage as _lineage, retention as _retention, steps as _steps
from ._tier import tier as _tiers
from ._util import concurrency as _concurrency, multihost as _multihost, progress as _progress

log = logging.getLogger("zarrckpt")
_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}  # JSON has no such numbers


def default_inflight_bytes() -> int:
    """A manager's byte budget by default: a quarter of the memory this process may use
    (the host's, or its cgroup's limit), at least 8 GiB, so that a training state
    that size is staged whole and an async save never waits for writes (a fixed 8 GiB
    made `save` of an 8.0001 GiB state on a 128 GiB GPU host block until a chunk was
    written, 0.24 s instead of milliseconds)."""
    return max(8 * 2**30, _concurrency.memory_bytes() // 4)


class CheckpointManager:
    """Saves a training state every so often under one directory, and restores it.

        with zarrckpt.CheckpointManager("gs://bucket/run", save_interval_steps=1000, keep_last=3) as mgr:
            state, step = mgr.restore(state)          # newest committed step, or (state, 0)
            for step in range(step + 1, num_steps + 1):
                state = train_step(state)
                mgr.save(step, state)                  # saves when a policy says so

    Agreement: under `jax.distributed` every process must make the same calls
    (`save`, `restore`, `wait`, `close`) with the same arguments; process 0 takes the
    decisions that depend on its clock and broadcasts them. `all_steps`,
    `latest_step` and `pin` are not collective.

    One manager per directory: a second one on a directory that a live manager
    holds is refused (DirectoryInUseError). Evaluators and other readers need no
    manager: `latest_step`, `load_checkpoint`, `load_checkpoint_if_it_exists` and
    `checkpoints_iterator` read a directory that a training job is writing.

    A manager is its process's: in a process forked from it (`os.fork`, a worker of
    multiprocessing's `fork` start method), `save`, `restore`, `delete`, `wait` and
    `reached_preemption` raise RuntimeError, `close` does nothing, and its lease stays
    the parent's (a child's exit never gives it back).

    Args:
      checkpoint_dir: local path or fsspec URL holding one directory per step.
      save_interval_steps: save when `step % save_interval_steps == 0`.
      save_interval_seconds: save when this long has passed since the last save.
        With neither interval, every `save` call saves (as Orbax's default interval
        of 1 step does).
      keep_last, keep_every, keep_best, best_metric, best_mode: retention, applied on
        process 0 after each commit, off the training thread; see `zarrckpt._run.retention`.
        The newest committed step and pinned steps are never deleted.
      async_save: `save` returns once the state's copies to host memory are dispatched
        (pinned host memory where the devices have it); writing and committing continue
        on a background thread (at most one save in flight).
      reuse_unchanged: write only what changed (default True). A jax.Array leaf that
        holds exactly what it held in the newest step this manager saved or restored
        (the very same array, or every shard with the same fingerprint, computed on
        its device) is neither copied off the devices nor written: its chunks are
        made from that step's, a hard link on a local disk, a copy inside the store on
        S3 and GCS. Every step stays complete: deleting the older one loses nothing.
        A fine-tune's frozen weights cost no PCIe traffic and no bytes from the second
        save on when they are the same arrays, from the third when the step rebuilds
        them (a leaf under 4 MiB on a process is then written). `save` waits for the
        fingerprints it compares (so for the step that made the arrays). See
        docs/pytree-zarr-checkpoint.md, "Unchanged chunks", for the guarantee.
      max_inflight_bytes: bound on host memory holding a save's copies off the devices
        that are not yet written (default: a quarter of the memory this process may
        use, the host's or its cgroup's limit, at least 8 GiB; each process of a host
        takes as much: with several on one host, give less); a larger state makes
        `save` wait for writes to drain before it has copied everything.
        `max_staged_bytes`, its name before, still works, with a DeprecationWarning.
      save_on_preemption: save at a preemption notice (JAX's preemption sync point; in
        a job of one process, SIGTERM), and say so by `reached_preemption`.
      heartbeat_s: how often process 0 renews its lease on the directory; a second
        manager on a directory whose lease is alive is refused (see `zarrckpt._run.lease`).
      progress: progress bars on process 0 (default: when stderr is a terminal).
      local_directory: a path on each host's own disk (a RAM disk such as /dev/shm/run1,
        or a local SSD) for the local tier: every `local_save_interval_steps` steps, each
        process saves what its own devices hold there (under `run-<run>/process<i>`),
        beside the persistent checkpoints; `restore` takes the newest step the surviving
        local copies can rebuild when it is newer than the newest persistent step (see
        README, "Two tiers"). It must be this user's alone (made with mode 0700 if
        missing): one another user owns or can write is refused
        (CheckpointLocationError), as is a second live job of the same run on it
        (DirectoryInUseError, as for the checkpoint directory). A local
        save that would not fit, or that fails, is skipped with a warning (a half-written
        copy is deleted): training and the persistent tier go on. A copy that fails any
        check while restoring is set aside with a warning, and the restore goes on to a
        replica, then to the persistent tier. After a restore, each process deletes its
        copies newer than the step restored (abandoned training).
      local_save_interval_steps: the local tier's interval; needed with local_directory.
      local_keep_last: local copies each process keeps.
      local_peer_copies: how many other processes keep a copy of each process's local
        copy (default 0): each also writes, into its own copy of the step, the chunks
        of its peers' copies that its own devices do not hold, moved over the device
        network, so that a lost host (its disk gone) is rebuilt from its peers, with no
        read of the persistent store, even when no other process holds a replica of its
        shards (fully sharded training). Each copy costs about one local copy more of
        disk and of device-network traffic per local save. Peers are chosen in other
        failure domains (see local_peer_group). Needs at least copies + 1 processes.
      local_peer_group: this process's failure domain (a rack, a slice, a host name),
        each process naming its own: peer copies are kept in other domains. Default:
        the slice its devices are on where they say (TPU), else its host.
      storage_options, timeout_s, max_chunk_bytes, min_chunk_bytes, max_workers,
        checksums, compression: as for `save_pytree` (the persistent tier's; local
        copies are never compressed). A manager's saves go on from what the last one
        learned of the store's speed.
    Raises TypeError or ValueError, naming the option, on an unknown, ill-typed or
    contradictory setting.
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
        for name, value, kind in (("save_interval_steps", save_interval_steps, _options.COUNT + "?"),
                                  ("local_save_interval_steps", local_save_interval_steps, _options.COUNT + "?"),
                                  ("local_keep_last", local_keep_last, _options.COUNT),
                                  ("local_peer_copies", local_peer_copies, _options.COUNT_OR_ZERO),
                                  ("save_interval_seconds", save_interval_seconds, _options.NUMBER + "?"),
                                  ("async_save", async_save, _options.FLAG),
                                  ("reuse_unchanged", reuse_unchanged, _options.FLAG),
                                  (inflight_option, inflight, _options.COUNT + "?"),
                                  ("save_on_preemption", save_on_preemption, _options.FLAG),
                                  ("heartbeat_s", heartbeat_s, _options.NUMBER)):
            _options.check(name, value, kind)
        inflight = default_inflight_bytes() if inflight is None else inflight
        self._policy = _retention.Policy(keep_last=keep_last, keep_every=keep_every, keep_best=keep_best,
                                         best_metric=best_metric, best_mode=best_mode)
        self._save_options = _options.SaveOptions(max_chunk_bytes=max_chunk_bytes, min_chunk_bytes=min_chunk_bytes,
                                                  max_inflight_bytes=inflight,
                                                  max_workers=max_workers, timeout_s=timeout_s, progress=progress,
                                                  checksums=checksums, compression=compression)
        # A local disk takes writes at the speed of memory: compressing never pays there.
        self._local_options = dataclasses.replace(self._save_options, compression=None)
        self._compressor = _save.Compressor()
        self._plans = _save.PlanCache()  # the last persistent save's, for the next of the same tree
        self._root = _storage.resolve(checkpoint_dir, storage_options).keeping_found()  # the lease guards it
        self._pid = os.getpid()
        local = self._local_directory(local_directory, local_save_interval_steps, local_peer_copies, local_peer_group)
        self._interval_steps = save_interval_steps
        self._interval_seconds = save_interval_seconds
        self._async = async_save
        self._unchanged = _lineage.Unchanged() if reuse_unchanged else None
        # What the NaN check found in the newest step this manager committed (process
        # 0's), with that save's identity: a leaf made from that very save holds what it
        # held then.
        self._findings: tuple[str, str | None, _finite.Findings] | None = None
        self._preemption = _preemption.Notice(listen=save_on_preemption)
        self._warned_unranked = False
        self._warned_older = False
        self._progress = progress
        self._timeout_s = timeout_s
        self._last_save = time.monotonic()
        self._committed = set(_steps.scan(self._root)[1])
        # A checkpoint itself (even one a manager saved steps into), or Orbax's: refused.
        _steps.check_directory_of_steps(self._root, has_steps=bool(self._committed))
        self._restored_step: int | None = None
        self._restored_tier: str | None = None
        self._metrics = _retention.load_metrics(self._root, self._committed) if best_metric is not None else {}
        self._lock = threading.Lock()
        self._in_flight: list[_save.BackgroundSave] = []  # the saves of the last `save` call
        self._in_flight_step = 0  # their step
        self._errors: list[BaseException] = []
        self._lease = _lease.Lease(self._root, heartbeat_s) if _multihost.process_index() == 0 else None
        self._tier: _tiers.LocalTier | None = None
        self._closed = True  # until the leases are ours
        try:  # a failure or a Ctrl-C from here on gives back what was taken: no caller holds a manager to close
            run = self._claim_lease(local is not None)
            if local is not None and run is not None:
                self._tier = _tiers.LocalTier.open(local, run, local_save_interval_steps or 0, local_keep_last,
                                                   heartbeat_s=heartbeat_s, timeout_s=timeout_s,
                                                   peer_copies=local_peer_copies, peer_group=local_peer_group)
            # A manager nobody holds any more (a notebook cell run again) gives its leases
            # back; the leases' threads never hold the manager.
            self._release = weakref.finalize(self, _release, self._lease, self._tier)
        except BaseException:
            _release(self._lease, self._tier)
            raise
        self._closed = False
        _close_at_exit.register(self)

    # -- saving ----------------------------------------------------------------

    def save(self, step: int, state: Any, *, metrics: Mapping[str, Any] | None = None,
             force: bool = False) -> bool:
        """Saves `state` as `step` if a policy says so (or `force`); returns whether it did.

        `metrics` (for `keep_best`, and kept in the checkpoint) maps names to real
        numbers: Python or numpy numbers, or 0-d numpy or jax arrays (a jax value is
        fetched to the host here, as `float(loss)` would). NaN and infinities are kept
        as the strings "NaN", "Infinity", "-Infinity" and never rank as best.

        With async_save, returns once the state's copies off the devices are dispatched
        and numpy leaves are copied (and the fingerprints of the leaves it compares for
        `reuse_unchanged` computed): the caller may then donate or overwrite its buffers
        (the runtime finishes the copies first). Waits first for the previous save.
        Without async_save, returns once the save has committed and the retention
        it triggers has run. Raises TypeError or ValueError for a bad step or metric
        (nothing is saved, and the next save works), the error of an earlier
        background save or deletion, if any, and what `save_pytree` raises (a save
        that fails removes what it wrote before its error is raised: a full disk has
        its room back for the next one, which still makes unchanged chunks). A step
        already committed is not saved again, nor, without `force`, one older than
        the newest committed step (a restore would never pick it: a warning, once),
        unless newer than the step `restore` was asked for (a rollback).
        """
        step = _naming.step_number(step)  # a bad step is refused here
        self._check_open()
        location = self._root.step(step)
        values = _metric_values(metrics)
        # Asked at every call, before anything can return early: under jax.distributed
        # the notice is agreed at one step, which every process must ask about.
        if self._preemption.first_seen(step):
            log.warning("preemption notice at step %d: saving it; `if mgr.reached_preemption(step): break` stops the "
                        "loop there", step)
        self._raise_errors()
        for_notice = self._preemption.unsaved  # this save is the notice's, whatever the policy says
        persistent = self._should_save(step, force or for_notice)
        if for_notice and not persistent:  # committed or in flight already: that save is the notice's
            self._preemption.saved = step
        copy = self._tier is not None and self._tier.due(step)
        if not (persistent or copy):
            return False
        if persistent:
            self._warn_unranked(step, values)
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
                if (copy_save := self._tier.save(step, state, self._local_options, self._committed_steps(),
                                                 self._timeout_s)) is not None:
                    saves.append(copy_save)
            making = None
            if not saves:
                return False
            with self._lock:
                self._in_flight, self._in_flight_step = saves, step
            for save in saves:
                save.start() if self._async else save.run()
        except BaseException as e:
            unstarted = [save for save in saves if not save.started]
            with self._lock:  # not in flight, so that a `save` of the step again saves it
                self._in_flight = [save for save in self._in_flight if save.started and not save.done]
            if not isinstance(e, Exception):
                # A Ctrl-C's traceback alone does not say that the step was lost (a save
                # that had started says so itself).
                for what in [save.url for save in unstarted] + ([making] if making is not None else []):
                    log.warning("%s was not saved: %s before its save started; nothing was committed", what,
                                type(e).__name__)
            raise
        self._raise_errors()  # without async_save: the persistent save's error
        if for_notice:
            self._preemption.saved = step
        return True

    def _warn_unranked(self, step: int, metrics: Mapping[str, float] | None) -> None:
        """Warns, once, when `keep_best` cannot rank a save: its metrics lack
        `best_metric` (a misspelling deletes the best step as unranked)."""
        name = self._policy.best_metric
        if name is None or self._warned_unranked or (metrics is not None and name in metrics):
            return
        self._warned_unranked = True
        close = difflib.get_close_matches(name, list(metrics or ()), n=1)
        log.warning("step %d is saved without best_metric %r in its metrics (%s): keep_best cannot rank it, and "
                    "keeps only steps that have it%s", step, name, ", ".join(map(repr, metrics or ())) or "none",
                    f"; did you mean {close[0]!r}?" if close else "")

    def _persistent_save(self, step: int, location: _storage.Location, state: Any,
                         metrics: Mapping[str, float] | None, called: float) -> _save.BackgroundSave:
        started = time.perf_counter()
        self._last_save = time.monotonic()
        job = _save.SaveJob.create(location, state, self._save_options, channel="manager-save",
                                   extra_metadata={"metrics": metrics} if metrics is not None else None,
                                   compressor=self._compressor, plans=self._plans, discard=True,
                                   fence=self._lease_check)
        meta = job.meta  # not the job: no cycle may hold the state
        seen = None
        if self._unchanged is not None:
            seen = self._unchanged.mark(job.plans, job.arrays, location)
            job.after_writes = self._unchanged.after_writes(job.plans, "reuse_unchanged", job.made)
        # The findings of the step the unchanged leaves were made from, where it is the
        # very save this manager checked.
        then, source = self._findings, self._unchanged.step() if self._unchanged is not None else None
        same = then is not None and source is not None and (source[0].url, source[1]) == then[:2]
        check = _finite.start([plan.leaf for plan in job.plans if plan.moved is None],
                              before=then[2] if then is not None and same else None,
                              unchanged={plan.leaf.name for plan in job.plans if plan.reuse_from is not None})
        findings: list[_finite.Findings] = []  # process 0's, once known

        def before_prepare() -> None:  # process 0, in the background, before anything is written
            if self._lease is not None:
                self._lease.check()
            findings.append(check())
            if found := list(findings[0].bad.values()):
                meta[_finite.NON_FINITE] = found
                log.warning("step %d holds NaN or infinities, in %s%s: saving it; retention keeps the newest step "
                            "without them until a newer one commits", step, ", ".join(found[:5]),
                            f" and {len(found) - 5} more leaves" if len(found) > 5 else "")

        job.before_prepare = before_prepare
        # The job holds the state: the commit's report must not.
        nbytes, note, known, made, crcs = job.nbytes, job.reuse_note(), self._unchanged, job.made, job.crcs

        def committed() -> None:
            seconds = time.perf_counter() - started
            with self._lock:
                self._committed.add(step)
                if metrics is not None:
                    self._metrics[step] = dict(metrics)
                self._findings = (location.url, save.save_id, findings[0]) if findings else None
            if _multihost.process_index() == 0:
                # `save` blocked training from its call until the copies were dispatched,
                # waiting for the save before it included.
                blocked = "" if save.staged is None else (
                    f", training blocked {save.staged - called:.3f}s"
                    + (f" ({started - called:.3f}s of it waiting for the previous save)"
                       if started - called >= 0.001 else ""))
                log.info("checkpoint step %d committed to %s: %s%s%s", step, self._root.url,
                         _progress.rate(nbytes, seconds), blocked, note)
            if known is not None and seen is not None:
                known.committed(seen, save.save_id, made, crcs)
            if self._policy.deletes:
                self._retain()

        save = _save.BackgroundSave(job, f"zarrckpt-save-{step}", on_commit=committed,
                                    on_failure=functools.partial(self._failed, step, location.url))
        return save

    def _failed(self, step: int, url: str, error: BaseException) -> None:
        """A persistent save failed (what it wrote is gone already, see
        `SaveJob.discard`), or what its commit triggered (retention): raised by
        the next call on the training thread. The next save makes its unchanged chunks
        from the step it would have (see `Unchanged.failed`), or, after a failed
        retention, which may have deleted steps unknown, writes every chunk."""
        with self._lock:
            committed = step in self._committed
            self._errors.append(error)
        if self._unchanged is not None and committed:
            self._unchanged.forget()
        elif self._unchanged is not None:
            self._unchanged.failed(error)
        if not isinstance(error, Exception) and not committed:  # a Ctrl-C in a save run on this thread
            log.warning("%s was not saved: %s while it was being written; nothing was committed unless its commit "
                        "had been written (zarrckpt.all_steps says)", url, type(error).__name__)

    def _should_save(self, step: int, force: bool) -> bool:
        with self._lock:
            in_flight = {save.url for save in self._in_flight}
            if step in self._committed or self._root.step(step).url in in_flight:
                return False
            # The steps in flight too: `_committed` learns of a commit on each process's
            # own background thread, `_in_flight` only here, the same on every process.
            newest = max(self._committed | ({self._in_flight_step} if self._in_flight else set()), default=None)
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
        every_call = self._interval_steps is None and self._interval_seconds is None
        due = force or every_call or bool(self._interval_steps and step % self._interval_steps == 0)
        if not due and (interval := self._interval_seconds) is not None:
            # Clocks differ across hosts: process 0 decides for everyone.
            with _multihost.Agreement("manager-decide", self._timeout_s) as op:
                due = bool(op.decide("due", lambda: time.monotonic() - self._last_save >= interval))
        return due

    def _committed_steps(self) -> set[int]:
        with self._lock:
            return set(self._committed)

    def _retain(self) -> None:
        """Applies retention after a commit, on the thread that committed: process 0
        deletes, every process waits for it (so `wait` covers it) and learns what
        went. Agreement."""
        with self._lock:
            metrics = dict(self._metrics)
        with _multihost.Agreement("manager-retain", self._timeout_s, what=f"retention under {self._root.url}") as op:
            deleted = op.decide("retain", lambda: _retention.apply(self._root, self._policy, metrics,
                                                                   fence=self._lease_check))
        with self._lock:
            self._committed.difference_update(deleted)
        if self._unchanged is not None:  # a rollback's step, older than the newest: gone
            self._unchanged.dropped({self._root.step(step).url for step in deleted})

    # -- waiting, restoring, listing --------------------------------------------

    def wait(self) -> None:
        """Blocks until the save in flight has committed and the retention its commit
        triggered has run; raises its error if it failed. Agreement."""
        self._check_process()
        with self._lock:
            in_flight = self._in_flight
        try:
            for save in in_flight:
                save.join()
        except KeyboardInterrupt:
            for save in in_flight:
                if not save.done:
                    log.warning("interrupted while waiting for %s to be saved: the save goes on, and the next "
                                "save, wait() or close() waits for it, as does this program's exit", save.url)
            raise
        with self._lock:
            if self._in_flight is in_flight:
                self._in_flight = []
        self._raise_errors()

    def restore(self, target: Any, *, step: int | None = None, partial: bool = False, allow_dtype_cast: bool = False,
                donate_target: bool = False, load_and_broadcast: bool = True,
                max_inflight_bytes: int = _options.DEFAULT_MAX_INFLIGHT_BYTES,
                max_workers: int | None = None, progress: bool | None = None) -> tuple[Any, int]:
        """Restores the newest committed step (or `step`) onto `target`. Agreement.

        Returns (state, step); (target, 0) when nothing is committed and no `step`
        was asked for, which is logged as a warning naming the directory and leaves
        `restored_step` None. With a local tier and no `step`, the newest step the
        local copies rebuild is taken when newer than the newest persistent one
        (`restored_tier` says which tier was read; each process logs its bytes by
        source). Waits for a save in flight first. Takes `load_pytree`'s options
        (see there; the manager's `max_workers` and `progress` unless given).
        Raises CheckpointNotFoundError if `step` is not a committed step, and what
        `load_pytree` raises.
        """
        step = None if step is None else _naming.step_number(step)
        if isinstance(target, (int, np.integer)) and not isinstance(target, bool):
            raise TypeError(f"CheckpointManager.restore takes the restore target first (the state to restore "
                            f"into, or None for numpy arrays); to restore step {target}, call "
                            f"mgr.restore(state, step={target})")
        options = _options.LoadOptions(partial=partial, allow_dtype_cast=allow_dtype_cast,
                                       donate_target=donate_target, load_and_broadcast=load_and_broadcast,
                                       max_inflight_bytes=max_inflight_bytes,
                                       max_workers=max_workers or self._save_options.max_workers,
                                       progress=self._progress if progress is None else progress)
        self._check_open()
        self.wait()
        started = time.perf_counter()
        local, restored = None, step
        if step is None and self._tier is not None:
            local = _tiers.restore_newer_copy(self._root, self._tier, target, options, self._timeout_s)
        ckpt = None
        if local is not None:
            (state, restored), tier = local, "local"
        elif step is None:  # a save reuses the restored step's chunks (told to `_unchanged`)...
            state, restored, ckpt = _steps.restore_latest(self._root, target, options, self._timeout_s,
                                                          self._unchanged)
            tier = "persistent"
        else:
            (state, ckpt), tier = _steps.load_step(self._root, step, target, options, self._unchanged), "persistent"
        if self._unchanged is not None and ckpt is None:  # ...and none after a local step, none of any older save's
            self._unchanged.forget()
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
        step = _naming.step_number(step)
        return _retention.metrics_of(self._root, _steps.committed_step(self._root, step))

    def best_step(self) -> int | None:
        """The committed step with the best `best_metric` (by `best_mode`), among those
        saved with it, or None. Needs `best_metric`. Not collective."""
        if self._policy.best_metric is None:
            raise ValueError("best_step needs best_metric (and best_mode) given to the CheckpointManager")
        with self._lock:
            metrics = {step: self._metrics.get(step, {}) for step in self._committed}
        ranked = _retention.ranked(self._policy, metrics)
        return ranked[0] if ranked else None

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (read from storage). Not collective."""
        return _steps.scan(self._root)[1]

    def latest_step(self) -> int | None:
        """The newest committed step, or None. Not collective."""
        return _steps.latest(self._root)

    def pin(self, step: int) -> None:
        """Exempts committed `step` from retention, by a PINNED file in its directory.
        ValueError, on a local disk, if a top-level leaf of the step is named so (its
        array's directory is there)."""
        step = _naming.step_number(step)
        if not _retention.pin(_steps.committed_step(self._root, step)):
            raise ValueError(f"step {step} cannot be pinned: a leaf of it is named {_retention.PIN_FILE!r}, the "
                             "pin file's name")

    def unpin(self, step: int) -> None:
        """Lets retention delete committed `step` again (removes its PINNED file, if any:
        an imported step's too). CheckpointNotFoundError if `step` is not committed."""
        step = _naming.step_number(step)
        with contextlib.suppress(IsADirectoryError):  # a leaf named so: no pin to remove
            _steps.committed_step(self._root, step).remove_file(_retention.PIN_FILE)

    def delete(self, step: int) -> None:
        """Deletes committed `step` now, pinned or not, its commit marker first (an
        interruption leaves an uncommitted leftover, never a damaged step), after the
        save in flight; with a local tier, each process's copy of it too. Collective
        under `jax.distributed`: process 0 deletes, every process returns once it has
        (process 0 does not wait for the others to reach the call: one that reads the
        step's files first needs a barrier of its own before it). Raises
        CheckpointNotFoundError if `step` is not committed, CheckpointWriteError if its
        directory holds files that are not the checkpoint's (nothing is then deleted),
        DirectoryInUseError if another job took the directory over."""
        step = _naming.step_number(step)
        self._check_open()
        self.wait()
        with _multihost.Agreement("manager-delete", self._timeout_s,
                                  what=f"deleting step {step} of {self._root.url}") as op:
            # Asked of process 0 for all: asked by each, a process behind would find the step
            # that process 0 had already deleted, and fail alone.
            op.decide("committed", lambda: _steps.committed_step(self._root, step).url)
            if self._tier is not None:  # else a restore would bring it back from the local tier
                self._tier.forget(step)
            if self._unchanged is not None:  # a save must not make its chunks from a deleted step
                self._unchanged.dropped({self._root.step(step).url})
            deleted = op.decide("delete", lambda: self._delete_on_process_0(step))
        if not deleted:
            raise errors.CheckpointWriteError(f"step {step} of {self._root.url} was not deleted: its directory also "
                                              "holds files that are not the checkpoint's (see the warning)")
        with self._lock:
            self._committed.discard(step)
            self._metrics.pop(step, None)

    def _delete_on_process_0(self, step: int) -> bool:
        # The lease is checked inside the decision: its error reaches every process.
        assert self._lease is not None  # process 0's
        self._lease.check(f"step {step} not deleted")
        return _retention.delete(self._root, step, committed=True, why="delete()")

    @property
    def _lease_check(self) -> Callable[[str], None] | None:
        """Process 0's lease check (`Lease.check`), None elsewhere."""
        return None if self._lease is None else self._lease.check

    # -- lifetime ----------------------------------------------------------------

    def reached_preemption(self, step: int) -> bool:
        """Whether a preemption notice came, and `step` is at or past the step saved for
        it; then the save has committed (this waits for it) and the loop should stop:
        `if mgr.reached_preemption(step): break` after `mgr.save(step, state)`. The same
        on every process. The notice is JAX's preemption sync point under
        `jax.distributed`, and in a job of one process SIGTERM (taken from the first
        call of this until `close`, unless something else handles it; a second SIGTERM
        ends the process).

        A notice seen here rather than in `save` (it came after this step's save, or the
        loop calls `save` only when a save is due) makes the next `save` call save its
        step whatever the policy says, with a warning; this returns True from that step
        on. Under `jax.distributed`, collective: every process calls it at every step,
        with the same steps. Always False with `save_on_preemption=False`."""
        step = _naming.step_number(step)
        self._check_process()
        if not self._closed:  # a closed manager listens no more: SIGTERM ends the process again
            self._preemption.take_sigterm()
        if self._preemption.first_seen(step):
            log.warning("preemption notice at step %d, after its save or where the loop does not save: the next "
                        "`save` call saves its step whatever the policy, and reached_preemption is True from that "
                        "step on (a loop that calls mgr.save(step, state) at every step, leaving the policy to "
                        "decide, saves at the notice's step)", step)
        saved = self._preemption.saved
        if saved is None or step < saved:
            return False
        self.wait()
        return True

    def close(self) -> None:
        """Waits for the save in flight and pending deletions; raises their errors.

        Interrupted (Ctrl-C), it leaves the manager open with the save going on: the
        next `close`, or this program's exit, waits for it again. A manager never
        closed is closed at exit, its save in flight waited for (at most `timeout_s`).
        In a process forked from the manager's, does nothing (all of it is the parent's)."""
        if self._closed or os.getpid() != self._pid:
            return
        try:
            self.wait()
        except KeyboardInterrupt:
            if not self._unfinished():
                self._end()
            raise
        except BaseException:
            self._end()
            raise
        self._end()
        self._raise_errors()

    def _unfinished(self) -> list[_save.BackgroundSave]:
        """The saves of the last `save` call still writing or committing."""
        with self._lock:
            return [save for save in self._in_flight if not save.done]

    def _end(self) -> None:
        self._closed = True
        self._preemption.close()
        self._release()

    def _close_at_exit(self) -> None:
        """`close`, at this program's exit, for a manager nobody closed: its save in
        flight commits (or, after `timeout_s` or another Ctrl-C, is left uncommitted,
        said by a warning naming it), never cut off by the interpreter's end."""
        if self._closed:
            return
        for save in self._unfinished():
            log.warning("exiting while %s is being saved by a CheckpointManager nobody closed: waiting for it "
                        "(close() the manager, or use `with`, to wait where you choose)", save.url)
            try:
                finished = save.join(self._timeout_s)
            except KeyboardInterrupt:
                finished = False
            if not finished:
                log.error("%s left uncommitted at exit: its save did not finish (every reader skips it)", save.url)
                return  # the rest is cut off with the interpreter, as it would be without this
        self.close()  # its error is logged by the exit hook

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: Any) -> None:
        if kind is KeyboardInterrupt:
            if pending := [save.url for save in self._unfinished()]:
                log.warning("waiting for %s to commit before leaving (Ctrl-C again stops waiting here; the program's "
                            "exit then waits for it)", ", ".join(pending))
        self.close()

    def _claim_lease(self, tiers: bool) -> str | None:
        """Process 0 claims the directory (and, with a local tier, reads or makes its run
        identity, which every process learns and this returns); a refusal is raised on
        every process. Agreement."""
        def claim() -> str | None:
            if self._lease is not None:
                self._lease.claim()
            return _tiers.run_identity(self._root) if tiers else None

        with _multihost.Agreement("manager-open", self._timeout_s, what=f"claiming {self._root.url} for this job",
                                  error=errors.CheckpointWriteError) as op:
            if self._root.needs_probe:  # every process asks what the store honours: all then write and copy alike
                op.check("probe", lambda: self._root.probe(_lease.LEASES))
            return op.decide("claim", claim)

    def _local_directory(self, directory: str | None, interval: int | None, peer_copies: int,
                         peer_group: str | None) -> _storage.Location | None:
        if peer_group is not None and not isinstance(peer_group, str):
            raise TypeError(f"local_peer_group must be a str naming this process's failure domain, got "
                            f"{type(peer_group).__name__}")
        if (peer_copies or peer_group is not None) and directory is None:
            raise ValueError("local_peer_copies and local_peer_group keep copies of the local tier: give "
                             "local_directory and local_save_interval_steps too")
        processes = _multihost.process_count()
        if peer_copies >= processes > 1:
            raise ValueError(f"local_peer_copies={peer_copies} needs more processes than the job's {processes}: "
                             "each copy is kept by another process")
        if peer_copies and processes == 1:
            log.warning("local_peer_copies=%d: a job of one process has no peer to keep a copy", peer_copies)
        if directory is None and interval is None:
            return None
        if directory is None or interval is None:
            raise ValueError("local_directory and local_save_interval_steps go together: give both for a local "
                             "tier, or neither")
        if not isinstance(directory, str):
            raise TypeError(f"local_directory must be a str path, got {type(directory).__name__}")
        local = _storage.resolve(directory)
        if not local.is_local:
            raise ValueError(f"local_directory must be a path on this host's own disk (a RAM disk or a local SSD), "
                             f"got {directory!r}; the persistent tier is checkpoint_dir")
        return local

    def _check_open(self) -> None:
        self._check_process()
        if self._closed:
            raise RuntimeError(f"CheckpointManager for {self._root.url} is closed")

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"CheckpointManager for {self._root.url} belongs to process {self._pid}, which made it; this process "
                f"(pid {os.getpid()}) was forked from it and cannot use it (its lease and its saves are the "
                "parent's): save from the parent, and read steps here with zarrckpt.load_checkpoint or "
                "zarrckpt.latest_step, which need no manager")

    def _raise_errors(self) -> None:
        with self._lock:
            pending, self._errors = self._errors, []
        if pending:
            raise pending[0]


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
        values[name] = value if math.isfinite(value) else _NON_FINITE[str(value)]
    return values


class _AtExit:
    """Closes, at this program's exit, every manager still open (see `_close_at_exit`).

    It runs where the interpreter's shutdown begins, with threading's own exit hooks
    (Python's `atexit` where those are missing), registered after `concurrent.futures`
    registered its own, so before it (they run last registered first): after it thread
    pools take no more work, and a save still writing could not finish. `atexit` comes
    later still, after `jax.distributed`'s shutdown. A forked child leaves its parent's
    managers alone (their threads are the parent's), and closes its own."""

    def __init__(self) -> None:
        self._managers: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()
        getattr(threading, "_register_atexit", atexit.register)(self._close_all)
        os.register_at_fork(after_in_child=self._forget)

    def register(self, manager: CheckpointManager) -> None:
        self._managers.add(manager)

    def _forget(self) -> None:
        self._managers = weakref.WeakSet()

    def _close_all(self) -> None:
        for manager in list(self._managers):
            try:
                manager._close_at_exit()
            except BaseException as e:  # a Ctrl-C here must not stop the rest of the shutdown
                log.error("closing the CheckpointManager of %s at exit: %s", manager._root.url, e)


_close_at_exit = _AtExit()
