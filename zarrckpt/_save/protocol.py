"""Saving one pytree as one zarr group: the write protocol.

    process 0 decides: remove a leftover uncommitted group (see _objects), write the
                       group's metadata with the save's new identity (see _commit)
    all check:         write the chunks this process owns (see _planning), durably;
                       process 0 also writes every array's metadata
    process 0 decides: write the commit marker, durably (see _commit)

A decision's outcome (or error) reaches every process before any goes on, and a
check raises on every process if any process's part failed (see _multihost), so
all of them raise and nothing is committed.

How a save commits is its `Commit`: `SHARED`, one group for the whole job (above), or
`PER_PROCESS`, each process its own group on its own disk (a local-tier copy, see
`_tiers`): process 0 decides the save's identity (the same in every copy), every
process prepares its group and writes every chunk its devices hold, and each commits
its own copy only once every process has written all of its (so a process killed while
the copies are written leaves no committed copy of that step anywhere). Every object
is on stable storage before the commit marker is written, and the marker before the
save returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import functools
import itertools
import logging
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import zarr

from .. import _commit, _objects, _storage, errors
from .._format import naming as _naming, tree as _tree, vouched as _vouched, zarrjson as _zarrjson
from .._options import SaveOptions
from .._storage.store import SourceChanged
from .._util import (
    concurrency as _concurrency,
    multihost as _multihost,
    progress as _progress,
)
from . import plan as _planning, transfer as _transfer
from .collaborators import NO_REUSE, NOTHING_BESIDE, UNGUARDED, Beside, Guard, Reuse, Reused, reused_of
from .compression import Compressor
from .plan import ArrayPlan, WriteUnit
from .plan_cache import PlanCache, Planned

log = logging.getLogger("zarrckpt")


def save(loc: _storage.Location, tree: Any, options: SaveOptions, *,
         extra_metadata: dict[str, Any] | None = None, guard: Guard = UNGUARDED) -> SaveJob:
    """`save_pytree` at `loc`, guarded by `guard`: plan, then write as the budget lets
    each unit in; returns the job done. Agreement."""
    job = SaveJob.create(loc, tree, options, extra_metadata=extra_metadata, guard=guard)
    write(job)
    return job


def write(job: SaveJob) -> None:
    """Runs `job`, writing as it copies, on the calling thread, and says so on process 0
    (with what was made from a committed step). Agreement."""
    note = job.reuse_note()
    seconds = job.run_admitted()
    if _multihost.process_index() == 0:
        log.info("saved %s: %d leaves, %s%s", job.loc.url, len(job.plans), _progress.rate(job.nbytes, seconds), note)


Work = Iterable[tuple[ArrayPlan, WriteUnit]]
# Units per batched transfer of a save that writes as it copies: enough that a call's
# fixed cost is shared, few enough that the writers start while the rest are being
# prepared (10,000 small leaves in one batch kept every writer waiting for all of them:
# 40% slower). A snapshot sends all the budget admits at once: on CPU devices, a second
# `device_put` into pinned memory waited for the copies of the first.
_BATCH_UNITS = 64


@dataclasses.dataclass(frozen=True)
class Commit:
    """How a save's group is made and committed (see the module docstring)."""

    name: str
    per_process: bool  # each process its own group, holding every chunk its devices hold

    @property
    def writers(self) -> _planning.Writers:
        """Which chunks each process writes."""
        return _planning.EVERY_HOLDER if self.per_process else _planning.ONE_WRITER

    def prepare(self, op: _multihost.Agreement, prepare: Callable[[str], str]) -> str:
        """Prepares the group (`prepare(save_id)`) with a new save identity; returns it."""
        if not self.per_process:
            return op.decide("prepare", lambda: prepare(_commit.new_save_id()))
        save_id = op.decide("identity", _commit.new_save_id)  # the same in every process's copy
        op.check("prepare", lambda: prepare(save_id))
        return save_id

    def write(self, op: _multihost.Agreement, write: Callable[[], dict[str, Any]]) -> list[dict[str, Any]]:
        """Runs every process's writes (`write`, which returns its report of the CRC-32C
        and version of each chunk it made, see `_format.vouched`); returns what the
        commit records: every process's, on process 0, for one group. A process's own group (a local
        copy on its own disk, whose chunks each process frames, compressed or not, as
        its own writes go) records none: it is read back only by that process."""
        if not self.per_process:
            return op.gather("write", write, to=0)
        op.check("write", write)
        return []

    def commit(self, op: _multihost.Agreement, commit: Callable[[], None]) -> None:
        """Commits once every process has written all of its part."""
        (op.check if self.per_process else op.decide)("commit", commit)

    def writes_arrays_metadata(self, process: int) -> bool:
        """Whether `process` writes every shared array's `zarr.json` in its group."""
        return self.per_process or process == 0


SHARED = Commit("shared", per_process=False)
PER_PROCESS = Commit("per process", per_process=True)


@dataclasses.dataclass
class SaveJob:
    """One planned save: what to write where. `run` executes the write protocol.

    Its writes hold bytes of `budget` (`options.max_inflight_bytes`) from the moment
    they are copied off their devices until they are written: `admitted` takes them,
    for a save that writes as it copies and for `stage` (an async save's snapshot).
    """

    loc: _storage.Location
    plans: list[ArrayPlan]
    arrays: dict[str, dict[str, Any]]  # every shared array's zarr.json (the same on every process)
    own: dict[str, dict[str, Any]]  # the zarr.json of this process's per-process values
    group: dict[str, Any]  # the group's zarr.json, uncommitted
    options: SaveOptions
    budget: _concurrency.ByteBudget
    channel: str = "save"
    guard: Guard = UNGUARDED  # asked before anything is written, and before the commit (see `Guard`)
    reuse: Reuse = NO_REUSE  # which leaves are made from a committed step, told how the save ends
    # What `reuse` decided: the leaves whose chunks are made from a committed step, by name.
    reused: dict[str, Reused] = dataclasses.field(default_factory=dict)
    # Whether a save that fails removes the group it began (see `_discard`); else that is
    # left to the next save there, and to `gc`.
    discard: bool = False
    save_id: str | None = None  # this save's identity, once prepared (see `_commit`)
    # The version of each chunk this process made, by key, as the store said it when it
    # was made (None where it did not): what a later save makes from this step checks.
    made: dict[str, str | None] = dataclasses.field(default_factory=dict)
    # The CRC-32C of each chunk this process made, by key, where it has a checksum: what
    # the commit records (see `_format.vouched`), and a later save makes from this step.
    crcs: dict[str, int] = dataclasses.field(default_factory=dict)
    commit: Commit = SHARED
    # Which chunks are compressed, with `options.compression` (a manager's outlasts a save).
    compressor: Compressor = dataclasses.field(default_factory=Compressor)
    # How many of the writers may run at once (a save in the background's: see `BackgroundSave`).
    share: _concurrency.Share = _concurrency.ALL_WORKERS

    @classmethod
    def create(cls, loc: _storage.Location, tree: Any, options: SaveOptions, *,
               extra_metadata: dict[str, Any] | None = None, channel: str = "save", commit: Commit = SHARED,
               beside: Beside = NOTHING_BESIDE, compressor: Compressor | None = None,
               plans: PlanCache | None = None, guard: Guard = UNGUARDED, reuse: Reuse = NO_REUSE,
               discard: bool = False) -> SaveJob:
        """Plans a save; raises UnsupportedLeafError before anything is written. `guard`
        and `discard`: see the fields of the same names. `reuse` is asked, once the plans
        exist, which leaves' chunks are made from a committed step (collective where it
        computes on the devices); then `guard` is told what is saved. `beside`
        gives the plans written beside each shared leaf's own (a `PER_PROCESS` save's
        peer copies: the chunks of the processes this one keeps a copy of that its own
        devices lack). `compressor`: the cost model of `options.compression` to go on with (a
        manager's, which knows how fast its last saves wrote). `plans`: the last save's
        plans, used where `tree` has the same signature, and given this save's."""
        process, processes = _multihost.process_index(), _multihost.process_count()
        # What planning reads besides the tree.
        key = (options.max_chunk_bytes, options.min_chunk_bytes, options.checksums, options.compression,
               process, processes, commit.writers)
        planned, note = None, None
        if plans is not None and not beside.adds:  # else a leaf may have several plans
            planned, values, note = plans.find(tree, key)
        if planned is not None:
            spec, version, leaves = planned.spec, planned.version, planned.leaves(values)
        else:
            spec, leaves = _tree.record(tree)
            records = [rec for _, rec in _tree.recorded_leaves(spec)]
            version = _naming.format_version({rec["type"] for rec in records})
        job_plans, arrays, own = [], {}, {}
        for i, leaf in enumerate(leaves):
            if planned is not None and (template := planned.templates[i]) is not None:
                job_plans.append(template.again(leaf))
                continue
            if isinstance(leaf.value, _tree.Encoded):  # a PerProcess leaf: this process's value, its own array
                mine = _tree.Leaf(leaf.path, _naming.per_process_name(leaf.name, process),
                                  leaf.value.data)
                plan = _planning.plan_array(mine, i, options.max_chunk_bytes, options.checksums, process=process,
                                            processes=processes, own=True, min_chunk_bytes=options.min_chunk_bytes)
                own[mine.name] = _zarrjson.array_document(
                    plan.shape, plan.codec, {_naming.META_ATTR: {"encoding": leaf.value.encoding}})
            else:
                plan = _planning.plan_array(leaf, i, options.max_chunk_bytes, options.checksums, process=process,
                                            processes=processes, writers=commit.writers,
                                            min_chunk_bytes=options.min_chunk_bytes, compression=options.compression)
                # Every process knows every shared array's metadata without asking the store.
                if planned is None:
                    arrays[leaf.name] = _zarrjson.array_document(plan.shape, plan.codec)
                job_plans.append(plan)
                job_plans += beside.plans(plan, options, process)
                continue
            job_plans.append(plan)
        if planned is not None:
            arrays = planned.arrays
        elif plans is not None and note is not None:  # one plan per leaf: no peers, no per-process value
            paths = [(leaf.path, leaf.name, rec["type"] == "prng_key") for leaf, rec in zip(leaves, records)]
            plans.keep(note, key, Planned(spec, version, paths, [plan.template() for plan in job_plans], arrays))
        meta = {**_tree_metadata(spec, version), **(extra_metadata or {})}
        reused = reuse.plan(job_plans, arrays, loc)
        guard.planned(job_plans, arrays, reused.keys())
        return cls(loc, job_plans, arrays, own, _zarrjson.group_document({_naming.META_ATTR: meta}), options,
                   _concurrency.ByteBudget(options.max_inflight_bytes), channel, guard=guard, reuse=reuse,
                   reused=reused, discard=discard, commit=commit, compressor=compressor or Compressor())

    @property
    def meta(self) -> dict[str, Any]:
        """zarrckpt's attribute of the group, for a caller to add to before the save runs."""
        return self.group["attributes"][_naming.META_ATTR]

    @property
    def nbytes(self) -> int:
        """Logical bytes of the tree (each global array counted once)."""
        return sum(p.nbytes for p in self.plans if p.moved is None)

    @property
    def reused_bytes(self) -> int:
        """Bytes of this process's writes made from a committed step (`reused`)."""
        return sum(unit.nbytes for plan, unit in self.made_from_steps())

    def reuse_note(self) -> str:
        """For a log line: what this process makes from committed steps instead of
        writing it ("" where nothing)."""
        sources = sorted({found.step.url for plan in self.plans
                          if plan.writes and (found := reused_of(self.reused, plan)) is not None})
        return (f"; {_progress.size(self.reused_bytes)} unchanged, made from {', '.join(sources)}, not written "
                "(process 0's part)" if sources else "")

    def units(self) -> Work:
        """This process's writes to copy off the devices (all but those made from a
        committed step), in order."""
        return ((plan, unit) for plan in self.plans if reused_of(self.reused, plan) is None for unit in plan.writes)

    def made_from_steps(self) -> Work:
        """This process's writes made from a committed step: nothing to copy or hold."""
        return ((plan, unit) for plan in self.plans if reused_of(self.reused, plan) is not None
                for unit in plan.writes)

    def admitted(self, *, snapshot: bool = False, before_waiting: Callable[[], None] | None = None
                 ) -> Generator[tuple[ArrayPlan, WriteUnit], None, None]:
        """This process's writes in order, each holding its bytes of the budget and its
        copy to the host started (see `_transfer`): whenever the budget has room, the
        units it admits go out in batched transfers. With `snapshot`, a batch's
        copies no longer depend on the caller's state once it is yielded.
        `before_waiting` is called before anything here may wait on others: for room
        in the budget, or in a collective move (what they wait on must be running).

        A peer copy's blocks (see `_peers`) are moved onto this process's devices just
        before its first units are copied, and let go once they all are, so that the
        moves cost at most a batch of extra device memory. Moves are collective: every
        process makes all of them, in plan order, even if its units stop coming (its
        writer failed, or this generator is closed early), so that no other process
        waits in one for ever."""
        position = {id(plan): i for i, plan in enumerate(self.plans)}
        moves = [plan for plan in self.plans if plan.moved is not None]

        def move_through(index: int) -> None:
            while moves and position[id(moves[0])] <= index:
                plan = moves.pop(0)
                assert plan.moved is not None
                if before_waiting is not None:
                    before_waiting()
                plan.moved.start()
                if not plan.writes:
                    plan.moved.array = None

        yield from self.made_from_steps()
        units = iter(self.units())
        try:
            item = next(units, None)
            while item is not None:
                batch = []
                hold = self.budget.take(item[1].nbytes, block=False)
                if hold is None:  # the first of a batch waits for room
                    if before_waiting is not None:
                        before_waiting()
                    hold = self.budget.take(item[1].nbytes)
                while item is not None and hold is not None:
                    item[1].hold = hold
                    batch.append(item)
                    item = next(units, None)
                    if item is None or (len(batch) == _BATCH_UNITS and not snapshot):
                        break
                    hold = self.budget.take(item[1].nbytes, block=False)
                move_through(position[id(batch[-1][0])])
                _transfer.start(batch, snapshot=snapshot)
                for plan, unit in batch:
                    if plan.moved is not None and unit is plan.writes[-1]:
                        plan.moved.array = None  # its copies hold what they need of it
                yield from batch
        finally:
            move_through(len(self.plans))

    def run_admitted(self) -> float:
        """`run` writing as it copies (`admitted`), on the calling thread. Agreement."""
        with contextlib.closing(self.admitted()) as work:
            return self.run(work)

    def run(self, work: Work) -> float:
        """Runs the write protocol over `work` (`admitted()`, or what `stage` staged);
        returns the seconds it took. Tells `reuse` that the save committed, or failed.
        Agreement."""
        started = time.perf_counter()
        try:
            self._run(work)
        except BaseException as e:
            self.reuse.failed(e, prepared=self.save_id is not None)
            raise
        seconds = time.perf_counter() - started
        self.reuse.committed(self.save_id, self.made, self.crcs)
        return seconds

    def _run(self, work: Work) -> None:
        loc = self.loc
        with (_multihost.Agreement(self.channel, self.options.timeout_s, what=f"saving {loc.url}",
                                   error=errors.CheckpointWriteError, note="nothing was committed") as op,
              _progress.bar(f"saving {loc.url}", self.nbytes, self.options.progress) as advance):
            committing = False
            try:
                self.save_id = self.commit.prepare(op, self._prepare)
                self.compressor.start()
                crcs = self.commit.write(op, lambda: self._write(work, advance))
                committing = True
                self.commit.commit(op, functools.partial(self._commit, crcs))
            except BaseException as e:
                self.budget.abort(e)  # a stager waiting for room must not wait forever
                # Where a commit whose request failed may still land (any remote store), its
                # step is left as it is: deleted, it could come back committed with no chunks.
                if isinstance(e, Exception) and not (committing and loc.lands_late):
                    self._discard()
                raise

    def _write(self, work: Work, advance: Callable[[int], None]) -> dict[str, Any]:
        try:
            _write_all(self.loc, work, self._array_metadata(), self.options.max_workers or self.loc.concurrency,
                       self.share, advance, self.compressor, self.reuse, self.reused, self.made, self.crcs)
        except Exception as e:
            # Say why where it can be known: the run taken over by another job (whose
            # objects refused this save's), or a chunk made from one not what it was.
            fence = functools.partial(self.guard.fence, f"{self._named()} not committed")
            for explain, why in ((fence, errors.DirectoryInUseError),
                                 (self._check_after_writes if missing(e) else None, errors.CheckpointWriteError)):
                if explain is None:
                    continue
                try:
                    explain()
                except why as found:
                    raise found from e
                except Exception:  # the store failing on: the writes' own error says it
                    pass
            raise
        self._check_after_writes()
        return _vouched.report(self.crcs, self.made)

    def _check_after_writes(self) -> None:
        self.reuse.check_after_writes(self.plans, self.reused, self.made)

    def _named(self) -> str:
        """This save as the lease's error says it: "step N" where it writes a step of a run."""
        step = _naming.step_of_url(self.loc.url)
        return self.loc.url if step is None else f"step {step}"

    def _commit(self, reports: list[dict[str, Any]]) -> None:
        """Writes the commit, recording the CRC-32C and version of every chunk made
        (`reports`, each process's), once the lease, where there is one, is found still
        this job's."""
        self.guard.fence(f"{self._named()} not committed")
        self.group["attributes"][_naming.META_ATTR].update(_vouched.attributes(reports))
        _commit.commit(self.loc, _zarrjson.group_document(self.group["attributes"], self.arrays))

    def _discard(self) -> None:
        """Once the save has failed on every process (its agreement raised everywhere, so
        every process that answered it has stopped writing), removes what it wrote, where
        `discard` is set, on process 0 (each process, of its own group): its group,
        where it is still this save's (uncommitted, of this save's identity; on S3 and
        GCS, with no group metadata: none is written before the commit), so that a retry
        finds the room it took (a full disk). Never raises: the save's own error is what
        is said. A write that lands after it (a request of the save landing late, a
        process that never answered) leaves a leftover, as a save cut short does."""
        if not self.discard or self.save_id is None or not (
                self.commit.per_process or _multihost.process_index() == 0):
            return
        try:
            # A job that lost the run deletes nothing of the one that took it.
            self.guard.fence(f"what the failed save of {self._named()} wrote is left as it is")
            found = _commit.head(self.loc)
            ours = (found.state is _commit.State.ABSENT if self.loc.late_safe else
                    found.state is _commit.State.UNCOMMITTED and found.save_id == self.save_id)
            if not ours:
                log.warning("%s is not what its failed save left (another writer's?): left as it is", self.loc.url)
                return
            _objects.remove_leftover(self.loc)
        except Exception as e:
            log.warning("what the failed save of %s wrote is left there (zarrckpt gc removes it): %s", self.loc.url, e)
            return
        log.info("removed what the failed save of %s wrote", self.loc.url)

    def _array_metadata(self) -> list[tuple[ArrayPlan, dict[str, Any]]]:
        """The `zarr.json` documents this process writes, each with its array's plan:
        its own per-process arrays' and, on process 0 (every process, for its local
        copy), every shared array's."""
        shared = self.arrays if self.commit.writes_arrays_metadata(_multihost.process_index()) else {}
        return [(plan, doc) for plan in self.plans
                if plan.moved is None
                and (doc := self.own.get(plan.leaf.name) or shared.get(plan.leaf.name)) is not None]

    def _prepare(self, save_id: str) -> str:
        """Process 0 (every process, for its local copy): clears the way and writes the
        group metadata, uncommitted, with the save's identity first (not on S3 and GCS:
        see `_commit`); returns the identity."""
        found = self.guard.before_prepare()
        _objects.make_way(self.loc, overwrite=self.options.overwrite)
        meta = {**self.group["attributes"][_naming.META_ATTR], **found}
        self.group = _zarrjson.group_document({_naming.META_ATTR: {_commit.SAVE_ID: save_id, **meta}})
        if not self.loc.late_safe:  # else the commit alone is written (see `_commit.write_marker`)
            self.loc.unversioned().write("zarr.json", _zarrjson.encode_document(self.group), atomic=True,
                                         durable=True)
        return save_id


def stage(job: SaveJob, put: Callable[[tuple[ArrayPlan, WriteUnit]], None], *,
          before_waiting: Callable[[], None] | None = None) -> None:
    """An async save's snapshot: hands each of this process's writes of `job` to `put`,
    in order, with its copy to host memory dispatched; returns once every copy is
    dispatched and none depends on the caller's state any more, so training may go on
    and donate its buffers (see `_transfer`). Blocks while `job.budget` is full: each
    unit holds its bytes until it is written. `before_waiting`: see `SaveJob.admitted`."""
    for item in job.admitted(snapshot=True, before_waiting=before_waiting):
        put(item)


def _tree_metadata(spec: dict[str, Any], version: int) -> dict[str, Any]:
    return {
        "format_version": version,
        "tree": spec,
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "zarr_version": zarr.__version__,
    }


def _write_all(loc: _storage.Location, work: Work, metadata: list[tuple[ArrayPlan, dict[str, Any]]],
               workers: int, share: _concurrency.Share, advance: Callable[[int], None], compressor: Compressor,
               reuse: Reuse, reused: Mapping[str, Reused], made: dict[str, str | None], crcs: dict[str, int]
               ) -> None:
    """Writes each array's `metadata` document and every unit of `work` (each chunk's
    version into `made`; of a leaf in `reused`, made from the step named there; each
    chunk written, as `reuse.write_chunk` makes it),
    `workers` at a time (as many as `share` lets run), all on stable storage before this
    returns (written together: see `Location.write_batch`): the commit that follows must
    never find a chunk only in the page cache. Array metadata is only read once
    committed, so it goes out alongside the chunks. Chunks are compressed where
    `compressor` finds it pays. Stops at the first failure (see `_concurrency`)."""
    def write(out: _storage.Location, documents: _storage.Location,
              item: tuple[ArrayPlan, WriteUnit | dict[str, Any]]) -> None:
        plan, what = item
        if isinstance(what, dict):
            _write_metadata(documents, plan, what)
        else:
            _write_one(out, plan, what, compressor, reuse, reused_of(reused, plan), made, crcs)
            advance(what.nbytes)

    def written(item: tuple[ArrayPlan, WriteUnit | dict[str, Any]]) -> int:  # bytes passing through this process
        plan, what = item
        return 0 if isinstance(what, dict) or reused_of(reused, plan) is not None else what.nbytes

    items: Iterable[tuple[ArrayPlan, WriteUnit | dict[str, Any]]] = itertools.chain(metadata, work)
    with loc.write_batch() as out, _concurrency.Operation(workers, "write") as op:
        # On a local disk small files (documents, links, small chunks) are written in turn;
        # the bytes of chunks, and writes that wait, add threads. Nobody keeps a document's
        # version: not asked of a store whose answers name none (`unversioned`).
        op.fan_out(items, functools.partial(write, out, out.unversioned()), nbytes=written,
                   start=None if loc.requests_wait else 1, share=share)


def _write_metadata(loc: _storage.Location, plan: ArrayPlan, document: dict[str, Any]) -> None:
    with _as_write_error(plan, "metadata"):
        loc.write_new(_naming.object_key(plan.codec.array, "zarr.json"), _zarrjson.encode_document(document))


def _write_one(loc: _storage.Location, plan: ArrayPlan, unit: WriteUnit, compressor: Compressor, reuse: Reuse,
               made_from: Reused | None, made: dict[str, str | None], crcs: dict[str, int]) -> None:
    where, key = f"chunk {plan.codec.coords(unit.region)}", plan.key(unit)
    try:
        if made_from is not None:  # unchanged since that step: its chunk is this one
            expect, crc = made_from.versions[key], made_from.crcs.get(key)
            assert expect is not None, "`Reuse.plan` reuses only chunks of known versions"
            with _as_write_error(plan, where):
                try:
                    made[key] = loc.copy_new(key, made_from.step, nbytes=unit.nbytes, expect=expect)
                except SourceChanged:
                    if crc is None:
                        raise
                    made[key] = _write_as_recorded(loc, plan, made_from.step, key, crc)
            if crc is not None:
                crcs[key] = crc
            return
        # An import's chunk is read from its source here: a read that fails is the
        # source's error as it is (see `Deferred.values`), not a write's.
        with contextlib.nullcontext() if unit.imported else _as_write_error(plan, where):
            values = unit.host_array()
        with _as_write_error(plan, where):
            parts = compressor.frame(plan.leaf.name, plan.codec, values)
            crc = plan.codec.crc_of(parts)
            started = time.perf_counter()
            made[key], written = reuse.write_chunk(loc, key, parts, crc)
            if written:
                compressor.wrote(sum(memoryview(p).nbytes for p in parts), time.perf_counter() - started)
        if crc is not None:
            crcs[key] = crc
    finally:
        unit.release()


def _write_as_recorded(loc: _storage.Location, plan: ArrayPlan, step: _storage.Location, key: str,
                       crc: int) -> str | None:
    """Writes the chunk `key` of `step`, which `plan` makes its unchanged chunks from, which
    is no longer the version known there (a `touch`, a scratch file system's anti-purge
    job, a copy of the same bytes), with the bytes it holds now where those are still
    the ones that step's commit records (`crc`: its CRC-32C, and the chunk's size and
    checksum); returns the version written. SourceChanged where they are not (rewritten
    with other bytes, or deleted)."""
    try:
        stored = step.read(key, limit=plan.codec.stored_bytes + 1)
    except FileNotFoundError:
        raise SourceChanged(errno.ENOENT, f"{step.url}/{key} is gone") from None
    if (damage := plan.codec.damage(stored, crc)) is not None:
        raise SourceChanged(errno.ENOENT, f"{step.url}/{key} {damage}")
    return loc.write_new(key, stored)


def missing(e: BaseException) -> bool:
    """Whether `e` comes of something not found (a file or object gone), through the
    errors that wrap it."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, FileNotFoundError):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1  # type: ignore[assignment]
    return False


@contextlib.contextmanager
def _as_write_error(plan: ArrayPlan, what: str) -> Iterator[None]:
    """Turns a failure inside into a CheckpointWriteError naming the leaf and `what`."""
    try:
        yield
    except Exception as e:
        raise errors.CheckpointWriteError(
            f"writing leaf {plan.leaf.where} (array {plan.leaf.name!r}) {what}: {type(e).__name__}: {e}"
        ) from e


def held(plans: Sequence[ArrayPlan], documents: Mapping[str, dict[str, Any]]) -> dict[str, list[tuple[int, ...]]]:
    """Per shared array (those with a document in `documents`), the grid coordinates of
    the chunks `plans` write (of a `PER_PROCESS` save: what this process's group holds)."""
    chunks: dict[str, list[tuple[int, ...]]] = {}
    for plan in plans:
        if plan.leaf.name in documents:
            chunks.setdefault(plan.leaf.name, []).extend(tuple(plan.codec.coords(u.region)) for u in plan.writes)
    return chunks
