"""Which leaves of a save hold exactly what a committed step holds, so that their chunks
are made from that step's (`Location.copy_new`: a hard link, a copy inside the store)
instead of being copied off the devices and written again.

A leaf is unchanged on this process when it is stored as it was in the step (the same
array document: shape, dtype, chunk grid, codec) and either it is the very jax.Array
that was saved as, or restored from, that step's leaf (a jax.Array never changes), or
every shard this process writes from has the fingerprint that shard had when that step
was saved. Nothing is guessed from a name, a place in the tree or a training schedule.

A fingerprint is computed on the shard's own device (`_fingerprints`), so that
unchanged bytes never cross to the host: two 32-bit sums over the shard's bytes taken
as 32-bit words (`_words`) of a mixing
function (MurmurHash3's finalizer, a bijection) of each word combined with its place
and a key. The two keys are drawn at random for each manager, unknown to the training.
A changed shard passes for unchanged only if both sums agree by chance: about 2**-64 a
shard, for a mixing function that behaves as a random one (docs/pytree-zarr-checkpoint.md).

A full pass costs a read of the shard in device memory, which a changing leaf need not
pay at every save: a sample of its words is fingerprinted first (`_SAMPLE` of them,
evenly spaced); a leaf is fingerprinted whole only once every shard's sample is found
unchanged, and from then on whole at once (one wait for the devices, not two), sampled
again only when that finds it changed; a leaf found changed by its sample is sampled
ever more rarely. A leaf smaller than `_MIN_BYTES` on this process is copied off its
devices unless it is the same array; its chunks are then compared by their bytes
(`same_chunks`), as every chunk a save writes is.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import secrets
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import _commit, _storage
from .._format import tree as _tree, vouched as _vouched, zarrjson as _zarrjson
from .._format.chunks import ChunkCodec
from .._save.collaborators import NoReuse, Reused, reused_of
from .._save.host_copies import shard_source
from .._save.plan import ArrayPlan
from .._save.protocol import missing
from .._util import devices as _devices
from .._util.programs import Key, Programs
from .._util.regions import Region, region_size, replicas_of
from ..errors import CheckpointError, CheckpointWriteError
from .same_chunks import NOTHING_SAME, SameChunks

log = logging.getLogger("zarrckpt")

# Words of a shard's sample: a changing leaf is told from an unchanged one by this much.
_SAMPLE = 4096
# The most saves in a row a leaf that keeps changing is written without a fingerprint.
_MAX_QUIET = 63
# A leaf of which this process writes less than this is copied off its devices unless it
# is the very same array (and its chunks compared by their bytes): fingerprinting it (a
# program compiled for its shape, a call, a wait) costs more than that copy.
_MIN_BYTES = 4 * 2**20
Fingerprint = tuple[int, int]
Version = str | None  # what tells one version of an object from another (`_storage.Entry.version`)


@dataclasses.dataclass(frozen=True)
class Known:
    """What a committed step holds of one leaf, as this process knows it: where (the
    step), how it is stored (its array document), the jax.Array it was saved from or
    restored into (while that lives), and, per shard region this process wrote from,
    the fingerprints of its sample and of all of it, where computed. `changes` counts
    the saves in a row that found it changed, `quiet` the saves it is written without a
    fingerprint (a leaf that keeps changing is sampled ever more rarely)."""

    step: _storage.Location
    document: dict[str, Any]
    value: weakref.ref[jax.Array] | None
    samples: dict[Region, Fingerprint] = dataclasses.field(default_factory=dict)
    wholes: dict[Region, Fingerprint] = dataclasses.field(default_factory=dict)
    changes: int = 0
    quiet: int = 0


class Lineage:
    """What this process knows of the newest committed step's leaves (`Known`) of one
    directory of steps, and which leaves of a new save it holds as they are (`mark`).
    A save is handed it through `ReuseUnchanged`. Thread-safe:
    a save is marked on the training thread and committed on a background one.
    Its fingerprints are computed by programs of `programs`: those a save could not
    run, not compiled yet, are compiled once it has committed or failed
    (`compile_programs`), on the save's thread."""

    def __init__(self, programs: Programs) -> None:
        self._programs = programs
        self._keys = np.frombuffer(secrets.token_bytes(8), np.uint32).copy()
        self._known: dict[str, Known] = {}
        self._save_id: str | None = None  # the identity of the step known, where told
        self._versions: Mapping[str, Version] = {}  # of the step known's objects, as it became known
        self._crcs: Mapping[str, int] = {}  # of its chunks, as its commit records them (see `_format.vouched`)
        self._step: _storage.Location | None = None  # the step known
        self._lock = threading.Lock()

    def mark(self, plans: Sequence[ArrayPlan], documents: Mapping[str, dict[str, Any]],
             step: _storage.Location) -> Marked:
        """Which leaves of `plans`, a save into `step`, are unchanged since the newest
        committed step this process knows: their chunks are made from that step's.
        Computes the fingerprints it needs on the devices, and waits for them. Never
        raises an Exception: every process of a save must go into it, so a failure here
        leaves every leaf to be written."""
        try:
            return self._mark(plans, documents, step)
        except Exception:
            log.warning("could not tell which leaves are unchanged: this save writes them all", exc_info=True)
            return Marked({}, {}, None)

    def step(self) -> tuple[_storage.Location, str | None] | None:
        """The step this process knows, and that step's identity where it was told;
        None when it knows none."""
        with self._lock:
            return None if self._step is None else (self._step, self._save_id)

    def same_chunks(self) -> SameChunks:
        """The chunks of the step known, as a save writing a chunk makes it from one that
        holds the very same bytes (`SameChunks`): each known by the CRC-32C its commit
        records and the version this process knows."""
        with self._lock:
            return NOTHING_SAME if self._step is None else SameChunks(self._step, self._crcs, self._versions)

    def _mark(self, plans: Sequence[ArrayPlan], documents: Mapping[str, dict[str, Any]],
              step: _storage.Location) -> Marked:
        with self._lock:
            known, known_id, versions, crcs = dict(self._known), self._save_id, self._versions, self._crcs
        if known_id is None:  # a step of unknown identity: nothing can tell that it is still the one known
            known = {}
        reused: dict[str, Reused] = {}
        by_step: dict[str, Reused] = {}  # one for each step made from, by URL

        def reuse(plan: ArrayPlan, source: _storage.Location) -> None:
            """Makes `plan`'s chunks from `source`, where the version of each is known (a
            process of several knows those it made itself: one another made is written)."""
            if all(versions.get(plan.key(unit)) is not None for unit in plan.writes):
                if (made_from := by_step.get(source.url)) is None:
                    made_from = by_step[source.url] = Reused(source, versions, crcs)
                reused[plan.leaf.name] = made_from

        seen: dict[str, Known] = {}
        # Looked at by a sample first: a leaf that keeps changing is never read whole.
        sampled: list[tuple[ArrayPlan, dict[Region, jax.Array], Known | None]] = []
        # Its whole fingerprints taken at the last look (its sample unchanged there): all of
        # it at once, one wait for the devices where a sample first would take two (a
        # frozen leaf that the step rebuilds, at every save).
        direct: list[tuple[ArrayPlan, dict[Region, jax.Array], Known]] = []
        for plan in plans:
            value, name = plan.leaf.value, plan.leaf.name
            if plan.moved is not None or name not in documents or not isinstance(value, jax.Array):
                continue
            if value.is_deleted():  # donated: saved by nobody, as its staging says (as without reuse)
                continue
            before = known.get(name)
            if before is not None and before.document is not documents[name] and before.document != documents[name]:
                before = None  # stored otherwise now: its chunks are other chunks
            if before is not None and before.value is not None and before.value() is value:
                reuse(plan, before.step)
                # Not `dataclasses.replace`, whose field-by-field look is most of a frozen
                # base's cost here when the tree has thousands of leaves.
                seen[name] = Known(step, before.document, before.value, before.samples, before.wholes)
            elif not _fingerprinted(plan):
                seen[name] = Known(step, documents[name], weakref.ref(value))
            elif before is not None and before.quiet:  # its sample kept: the next look compares with it
                seen[name] = Known(step, documents[name], weakref.ref(value), before.samples, changes=before.changes,
                                   quiet=before.quiet - 1)
            elif before is not None and before.wholes:
                direct.append((plan, _shards_written(plan), before))
            else:
                sampled.append((plan, _shards_written(plan), before))

        def judged(plan: ArrayPlan, before: Known | None, sample: dict[Region, Fingerprint] | None,
                   whole: dict[Region, Fingerprint] | None) -> bool:
            """Records what `plan`'s leaf holds at this step, from its `sample` and, where
            taken, its `whole` fingerprints; returns whether the sample is the one last seen."""
            name, value = plan.leaf.name, plan.leaf.value
            if sample is None:  # not computed (see `_fingerprints`): written, and looked at again next time
                seen[name] = Known(step, documents[name], weakref.ref(value))
                return False
            changes, quiet = before.changes if before is not None else 0, 0
            then = before.samples if before is not None else {}
            same = _matches(then, sample)
            differs = not same and bool(sample) and all(region in then for region in sample)
            if same:
                changes = 0
            elif differs:  # sampled ever more rarely
                changes += 1
                quiet = min(2 ** changes, _MAX_QUIET + 1) - 1
            # else nothing to compare with (a first save, a restore, a quiet spell): the next save will
            seen[name] = Known(step, documents[name], weakref.ref(value), sample,
                               {} if whole is None or differs else whole, changes, quiet)
            return same

        first = _fingerprints([shards for _, shards, _ in sampled + direct],
                              sample=[True] * len(sampled) + [False] * len(direct), keys=self._keys,
                              programs=self._programs)
        same_sample = []  # is all of it the same, too?
        for (plan, shards, before), sample in zip(sampled, first):
            if judged(plan, before, sample, None):
                same_sample.append((plan, shards, before))
        changed = []  # its sample tells a change here and there from one all over
        for (plan, shards, before), whole in zip(direct, first[len(sampled):]):
            if whole is not None and _matches(before.wholes, whole):
                reuse(plan, before.step)
                # The same bytes, so the same sample.
                seen[plan.leaf.name] = Known(step, documents[plan.leaf.name], weakref.ref(plan.leaf.value),
                                             before.samples, whole)
            elif whole is None:
                judged(plan, before, None, None)
            else:
                changed.append((plan, shards, before, whole))
        second = _fingerprints([shards for _, shards, _ in same_sample] + [shards for _, shards, _, _ in changed],
                               sample=[False] * len(same_sample) + [True] * len(changed), keys=self._keys,
                               programs=self._programs)
        for (plan, _, before), whole in zip(same_sample, second):
            if whole is None:
                continue
            seen[plan.leaf.name] = dataclasses.replace(seen[plan.leaf.name], wholes=whole)
            if before is not None and _matches(before.wholes, whole):
                reuse(plan, before.step)
        for (plan, _, before, whole), sample in zip(changed, second[len(same_sample):]):
            judged(plan, before, sample, whole)
        return Marked(seen, reused, known_id)

    def committed(self, step: _storage.Location, seen: dict[str, Known], save_id: str | None = None,
                  made: Mapping[str, Version] | None = None, crcs: Mapping[str, int] | None = None) -> None:
        """The save into `step` that `mark` returned `seen` for committed, with identity
        `save_id`: `step` is now what this process knows (of leaves not in it,
        nothing: an older step may be deleted), with the versions of the chunks it
        `made` (`SaveJob.made`: what the store answered each write and copy) and their
        CRC-32C as its commit records them (`SaveJob.crcs`). Never from a listing made
        now: that would take another program's write since for this save's. A chunk
        whose version the store did not say is written again."""
        self._learnt(step, seen, save_id, dict(made or {}), dict(crcs or {}))

    def _learnt(self, step: _storage.Location, known: dict[str, Known], save_id: str | None,
                versions: Mapping[str, Version], crcs: Mapping[str, int]) -> None:
        """`known` is what this process knows, of the step `step` of identity `save_id` whose
        objects had the `versions` (`mark` makes nothing from a chunk without one: no
        later save could check that it holds what it did) and whose commit records the
        `crcs` of its chunks."""
        with self._lock:
            self._known, self._save_id, self._versions, self._crcs = known, save_id, versions, crcs
            self._step = step

    def restored(self, step: _storage.Location, stored: Mapping[str, Any], state: Any,
                 save_id: str | None, versions: Mapping[str, Version], crcs: Mapping[str, int]) -> None:
        """`step` (identity `save_id`), whose leaves by name are `stored` (each with its
        shape and codec) and whose objects had the `versions` before it was
        read (`listed`: a chunk rewritten while it was read is then not taken for the
        one read), and whose commit records the `crcs` of its chunks, was restored into
        `state`: each jax.Array of it that `step` holds (not a leaf of a partial
        restore's target that `step` lacks) holds exactly what `step` does."""
        known = {}
        for path, value in jax.tree_util.tree_flatten_with_path(state)[0]:
            if not isinstance(value, jax.Array):
                continue
            try:
                leaf = stored.get(_tree.name_of(path))
            except CheckpointError:  # no name a saved leaf has
                continue
            if leaf is not None and isinstance(leaf.codec, ChunkCodec):
                known[leaf.name] = Known(step, _zarrjson.array_document(leaf.shape, leaf.codec), weakref.ref(value))
        if known:
            self._learnt(step, known, save_id, versions, crcs)
            return
        with self._lock:
            replaced = (self._step is not None and directory_key(self._step) == directory_key(step)
                        and save_id != self._save_id)
        if replaced:
            self.forget()
        # else restored as numpy values, say: what the arrays hold is as known before

    def read(self, ckpt: Any, read: Callable[[], Any], *, arrays: bool) -> Any:
        """`read()`, the restore of the opened checkpoint `ckpt` (a `_restore.checkpoint.
        Checkpoint`), told to `restored` with the versions of its objects as listed just
        before (a chunk rewritten while it is read is not taken for the one read), where
        the restore makes jax.Arrays (`arrays`: no listing for numpy values)."""
        versions = listed(ckpt.loc) if arrays else {}
        state = read()
        self.restored(ckpt.loc, ckpt.leaves, state, ckpt.save_id, versions, _vouched.by_key(ckpt.vouched))
        return state

    def dropped(self, urls: set[str]) -> None:
        """The steps at `urls` were deleted: nothing is made from them any more."""
        with self._lock:
            self._known = {name: known for name, known in self._known.items() if known.step.url not in urls}
            if self._step is not None and self._step.url in urls:
                self._step = None

    def failed(self, error: BaseException) -> None:
        """A save that `mark`ed its plans failed with `error`, uncommitted. The step known
        stays known, so that the next save makes its unchanged chunks from it again (each
        only from the version known, see `check_after_writes`): a full disk or a store's
        outage changes nothing of it. Nothing is known any more where `error` comes of a
        chunk made from it that was gone or not what it was, or where the
        step is no longer committed as the save known (one read of its commit; one that
        fails counts as such)."""
        known = self.step()
        if known is None:
            return
        try:
            now = None if missing(error) else _commit.head(known[0])
        except Exception:
            now = None
        if now is None or now.state is not _commit.State.COMMITTED or now.save_id != known[1]:
            self.forget()

    def compile_programs(self) -> None:
        """Compiles the fingerprints' programs that saves asked for and could not run
        (see `_util.programs`), on the calling thread."""
        self._programs.compile_pending()

    def forget(self) -> None:
        """Nothing known: after a deletion, or a failed save that found the step known
        changed, the next save writes all."""
        with self._lock:
            self._known, self._save_id, self._versions, self._crcs, self._step = {}, None, {}, {}, None


def directory_key(loc: _storage.Location) -> str:
    """`loc` as a `Lineage` knows it: one name however a local path is spelled."""
    return loc.canonical


def listed(step: _storage.Location) -> dict[str, Version]:
    """The version of every object of `step`, as one listing finds them; {} where it
    cannot be listed (then nothing is made from it: the next save writes all)."""
    try:
        return {entry.name: entry.version for entry in step.walk()}
    except Exception as e:
        log.debug("%s could not be listed: the next save writes every chunk: %s", step.url, e)
        return {}


class Marked(NamedTuple):
    """What `Lineage.mark` found: what the step saved will hold once committed (`seen`,
    for `Lineage.committed`), the leaves whose chunks are made from a committed step
    (`reused`, by name), and the identity of the step it compared with (None: none known)."""

    seen: dict[str, Known]
    reused: dict[str, Reused]
    save_id: str | None


class ReuseUnchanged(NoReuse):
    """A manager's `Reuse` (see `_save.collaborators`; `reuse_unchanged`): each leaf
    unchanged since the newest step its `lineage` knows has its chunks made from that
    step's, without a copy off its devices; each chunk of the others that the step
    holds byte for byte is made from it too (`SameChunks`: a leaf too small to
    fingerprint, a rebuilt one, a process's small share of a leaf). Told the commit, the
    lineage learns what the step saved holds; a failed save leaves that step known
    unless the failure comes of it (`Lineage.failed`)."""

    def __init__(self, lineage: Lineage) -> None:
        self._lineage = lineage
        self._seen: dict[str, Known] = {}  # what the step saved will hold once committed
        self._source_id: str | None = None  # the identity of the step chunks are made from
        self._same = NOTHING_SAME
        self._step: _storage.Location | None = None  # the step saved

    def plan(self, plans: Sequence[ArrayPlan], documents: Mapping[str, dict[str, Any]],
             step: _storage.Location) -> dict[str, Reused]:
        self._step, self._same = step, self._lineage.same_chunks()
        self._seen, reused, self._source_id = self._lineage.mark(plans, documents, step)
        return reused

    def write_chunk(self, loc: _storage.Location, key: str, parts: Sequence[Any], crc: int | None
                    ) -> tuple[str | None, bool]:
        return self._same.write_chunk(loc, key, parts, crc)

    def check_after_writes(self, plans: Sequence[ArrayPlan], reused: Mapping[str, Reused],
                           made: Mapping[str, Version]) -> None:
        """Raises CheckpointWriteError (naming `reuse_unchanged`) if the step that
        `plans` made chunks from (`reused`) is no longer committed as the save they were
        made from: another writer deleted or replaced it meanwhile. A replacement
        uncommits a step before it changes a chunk, and each chunk was made only from
        the version it had when that step became known here (`Location.copy_new`), so
        every chunk `made` holds what was saved. A chunk that could not be made is named,
        with what became of it: rewritten by another program (zarr-python, a copy over
        the step) or deleted. Nothing to check where nothing was made from a step."""
        sources = {found.step for plan in plans if plan.writes and (found := reused_of(reused, plan)) is not None}
        if not sources or self._source_id is None:  # `mark` makes nothing from a step of unknown identity
            return
        (source,) = sources  # one step known at a time
        _check_source_still_committed(source, self._source_id, plans, reused, made)

    def committed(self, save_id: str | None, made: Mapping[str, Version], crcs: Mapping[str, int]) -> None:
        assert self._step is not None, "a save commits only once planned"
        self._same.say("reuse_unchanged")
        self._lineage.committed(self._step, self._seen, save_id, made, crcs)
        self._lineage.compile_programs()

    def failed(self, error: BaseException, *, prepared: bool) -> None:
        self._lineage.failed(error)
        if isinstance(error, Exception):  # not while a Ctrl-C or an exit goes up
            self._lineage.compile_programs()


def _check_source_still_committed(source: _storage.Location, save_id: str, plans: Sequence[ArrayPlan],
                                  reused: Mapping[str, Reused], made: Mapping[str, Version]) -> None:
    now = _commit.head(source)
    if now.state is not _commit.State.COMMITTED or now.save_id != save_id:
        raise CheckpointWriteError(f"{source.url}, the step this save made unchanged chunks from (reuse_unchanged), "
                                   "was deleted or replaced by another writer meanwhile: save again")
    unmade = [(found, key) for plan in plans if (found := reused_of(reused, plan)) is not None
              for key in map(plan.key, plan.writes) if key not in made]
    if not unmade:
        return
    # A copy failed: say which chunk was not what it was (a listing that fails fails the
    # save, saying why), else the copy's own error says it.
    listing = {entry.name: entry.version for entry in source.walk()}
    for found, key in unmade:
        if (version := listing.get(key, "")) != found.versions.get(key):
            what = ("is gone (deleted by another program)" if version == "" else
                    "is not the object it was when that step was saved or restored here (rewritten by another "
                    "program, or the step copied over)")
            raise CheckpointWriteError(f"{source.url}/{key}, a chunk this save made an unchanged chunk from "
                                       f"(reuse_unchanged), {what}; the next save writes every chunk")


def _shards_written(plan: ArrayPlan) -> dict[Region, jax.Array]:
    """The shards this process's writes of `plan` read, one device's copy of each, by
    the region of the array it holds, in order."""
    value = plan.leaf.value
    shard, regions = shard_source(value), _regions_of(value)
    shards: dict[Region, jax.Array] = {}
    for device in sorted({part[0] for unit in plan.writes for part in unit.sources}, key=lambda d: d.id):
        if regions[device] not in shards:
            shards[regions[device]] = shard(device)[1]
    return dict(sorted(shards.items()))


def _regions_of(value: jax.Array) -> dict[jax.Device, Region]:
    """The region of `value` each device holds, from its sharding (`replicas_of`, cached:
    its buffers are asked for through `shard_source` alone)."""
    return {device: region for region, devices in replicas_of(value.sharding, value.shape).items()
            for device in devices}


def _fingerprinted(plan: ArrayPlan) -> bool:
    """Whether `plan`'s leaf is looked at by its fingerprints on this process: one that
    this process writes at least `_MIN_BYTES` of, in device memory (a host-memory shard
    is left alone: it is no device's to compute on), of elements a byte wide or wider
    (int4 and such are packed otherwise), each shard under 2**32 words (where a word's
    place would repeat)."""
    value = plan.leaf.value
    return (sum(unit.nbytes for unit in plan.writes) >= _MIN_BYTES
            and getattr(value.sharding, "memory_kind", None) in (None, "device")
            and jax.dtypes.itemsize_bits(plan.dtype) in (8, 16, 32, 64, 128)
            and max(map(region_size, replicas_of(value.sharding, value.shape)), default=0) * plan.dtype.itemsize
            < 4 * 2**32)


def _matches(then: Mapping[Region, Fingerprint], now: dict[Region, Fingerprint]) -> bool:
    """Whether every shard's fingerprint `now` is the one `then` recorded for its region
    (a region `then` lacks never matches; no shards, nothing to match)."""
    return bool(now) and all(then.get(region) == f for region, f in now.items())


def _fingerprints(leaves: list[dict[Region, jax.Array]], *, sample: Sequence[bool], keys: np.ndarray,
                  programs: Programs) -> list[dict[Region, Fingerprint] | None]:
    """Each leaf's shards' fingerprints (of their samples, where its `sample` is True),
    each computed on the shard's own device by a program of `programs`; waits for them
    all. One call per leaf where its shards have one shape (one program for all of
    them: one per device was compiled once per device), else one per shard. A leaf
    whose fingerprints cannot be computed (its program not compiled yet, the device out
    of memory, an error of the runtime) has None: it is written, and the save goes on,
    as it does on every other process (no process may leave a save that the others
    are in)."""
    pending: list[list[jax.Array] | None] = []
    for shards, sampled in zip(leaves, sample, strict=True):
        try:
            pending.append(_dispatch(list(shards.values()), sampled, keys, programs))
        except Exception as e:  # the leaf is written; the reason is for the curious
            log.debug("no fingerprint of a leaf's shards %s: %s", list(shards), e)
            pending.append(None)
    try:
        fetched = jax.device_get(pending)
    except Exception as e:
        log.debug("no fingerprints this save: %s", e)
        return [None] * len(leaves)
    return [None if out is None else dict(zip(shards, ((int(a), int(b)) for rows in out
                                                        for a, b in np.reshape(rows, (-1, 2)))))
            for shards, out in zip(leaves, fetched)]


def _dispatch(arrays: list[jax.Array], sample: bool, keys: np.ndarray, programs: Programs) -> list[jax.Array] | None:
    """Starts the fingerprints of one leaf's shards: two sums a shard, in order; None
    where a program they need is not compiled yet (see `Programs.get`)."""
    with _devices.outside_callers_mesh():
        if arrays and arrays[0].ndim and all(a.shape == arrays[0].shape for a in arrays):
            mesh = Mesh(np.array([next(iter(a.devices())) for a in arrays]), ("shards",))
            shape, dtype = (len(arrays) * arrays[0].shape[0], *arrays[0].shape[1:]), arrays[0].dtype
            sharding = NamedSharding(mesh, PartitionSpec("shards"))
            program = _asked(programs, sample, functools.partial(_side_by_side_program, mesh, sharding, shape, dtype))
            if program is None:
                return None
            side_by_side = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
            return [program(side_by_side, _keys_on(mesh, keys.tobytes()))]
        meshes = [Mesh(np.array(list(a.devices())), ("shards",)) for a in arrays]
        programs_of = [_asked(programs, sample, functools.partial(_one_shard_program, a, mesh))
                       for a, mesh in zip(arrays, meshes)]
        ready = [program for program in programs_of if program is not None]
        if len(ready) < len(arrays):
            return None
        return [program(a, _keys_on(mesh, keys.tobytes())) for program, a, mesh in zip(ready, arrays, meshes)]


def _asked(programs: Programs, sample: bool, program: Callable[[bool], tuple[Key, Callable[[], Any]]]
           ) -> Any:
    """The program fingerprinting a sample (`sample`) or all of an array, where compiled:
    `program(sampled)` names it and how to compile it. The other is asked for at once
    too: a leaf whose sample holds still is fingerprinted whole at its next save."""
    wanted, _ = (programs.get(*program(sampled)) for sampled in (sample, not sample))
    return wanted


def _side_by_side_program(mesh: Mesh, sharding: NamedSharding, shape: tuple[int, ...], dtype: np.dtype,
                          sampled: bool) -> tuple[Key, Callable[[], Any]]:
    """The program fingerprinting each device's block of an array of `shape` laid out
    side by side over `mesh` (`_on_each`), and how to compile it."""
    return (("fingerprints", mesh, shape, dtype, sampled),
            functools.partial(_compile, _on_each(mesh, sampled), sharding, shape, dtype, mesh))


def _one_shard_program(shard: jax.Array, mesh: Mesh, sampled: bool) -> tuple[Key, Callable[[], Any]]:
    """The program fingerprinting one shard laid out as `shard` is (`mesh`: its device),
    and how to compile it (from its shape alone: what is kept holds no array)."""
    return (("fingerprint", shard.sharding, shard.shape, shard.dtype, sampled),
            functools.partial(_compile, functools.partial(_fingerprint, sample=sampled), shard.sharding, shard.shape,
                              shard.dtype, mesh))


def _compile(fingerprint: Any, sharding: jax.sharding.Sharding, shape: tuple[int, ...], dtype: np.dtype,
             mesh: Mesh) -> Any:
    """`fingerprint` (a jitted function of an array and the keys) compiled for an array
    of `shape` and `dtype` laid out by `sharding`, with the keys on every device of `mesh`."""
    keys = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, PartitionSpec()))
    with _devices.outside_callers_mesh():
        return jax.jit(fingerprint).lower(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding), keys).compile()


@functools.lru_cache(maxsize=64)
def _keys_on(mesh: Mesh, keys: bytes) -> jax.Array:
    """The fingerprint keys on every device of `mesh`."""
    return jax.device_put(np.frombuffer(keys, np.uint32), NamedSharding(mesh, PartitionSpec()))


@functools.lru_cache(maxsize=64)
def _on_each(mesh: Mesh, sample: bool) -> Any:
    """The program that fingerprints each device's block of an array laid out over
    `mesh` (one block a device), on that device, into one row each."""
    return jax.jit(jax.shard_map(lambda blocks, keys: _fingerprint(blocks, keys, sample)[None], mesh=mesh,
                                 in_specs=(PartitionSpec("shards"), PartitionSpec()),
                                 out_specs=PartitionSpec("shards")))


@functools.partial(jax.jit, static_argnums=2)
def _fingerprint(array: jax.Array, keys: jax.Array, sample: bool) -> jax.Array:
    """The two sums of `array`'s words (those of `_SAMPLE` evenly spaced elements, with
    `sample`), each word mixed with its place and a key (wrapping at 2**32). A sample
    is taken before anything else: the rest of the array is never read."""
    flat = array.reshape(-1)
    stride = max(1, flat.size // _SAMPLE) if sample else 1
    words = _words(flat[::stride])
    # Each place mixed first: a mask linear in the place (place * constant + key) let two
    # words 2**31 apart, swapped with their top bits flipped, leave both sums as they were.
    place = _mix(jax.lax.iota(jnp.uint32, words.size) * jnp.uint32(stride) * jnp.uint32(0x9E3779B9))
    mixed = tuple(_mix(words ^ (place + key)) for key in (keys[0], keys[1]))
    # Both sums in one pass over the words (a reduce of two operands): on CPU, two
    # `jnp.sum`s took six times as long. Sums modulo 2**32 are the same in any order.
    zero = jnp.uint32(0)
    return jnp.stack(jax.lax.reduce(mixed, (zero, zero), lambda x, y: (x[0] + y[0], x[1] + y[1]), (0,)))


def _mix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection whose every output bit depends on
    every input bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(flat: jax.Array) -> jax.Array:
    """The bytes of a flat array as 32-bit words: elements of 1 or 2 bytes packed four or
    two to a word (widened one to a word where they do not fill the last), of 8 bytes
    split in two."""
    if flat.dtype == jnp.bool_:
        flat = flat.astype(jnp.uint8)
    if jnp.issubdtype(flat.dtype, jnp.complexfloating):
        flat = jnp.stack([flat.real, flat.imag], axis=-1).reshape(-1)
    size = flat.dtype.itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(flat, jnp.uint32)
    if size == 8:
        return jax.lax.bitcast_convert_type(flat, jnp.uint32).reshape(-1)
    narrow = jax.lax.bitcast_convert_type(flat, {1: jnp.uint8, 2: jnp.uint16}[size])
    if flat.size % (4 // size):
        return narrow.astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(narrow.reshape(-1, 4 // size), jnp.uint32)
