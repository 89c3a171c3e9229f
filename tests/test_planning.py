"""The planners are pure: given which process holds each device, a layout over many
hosts is planned in one process. Here 8 CPU devices play 4 hosts of 2 devices and 8
hosts of 1, and every chunk has exactly one writer, every host writes its share of
replicated data, and every part a host needs is read once, by someone."""

import collections
import dataclasses
import gc
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import mesh
from jax.sharding import NamedSharding, PartitionSpec as P

from zarrckpt import PerProcess, _storage
from zarrckpt._format import tree as _tree
from zarrckpt._options import SaveOptions
from zarrckpt._restore import plan as read_plan
from zarrckpt._save import PER_PROCESS, SHARED, PlanCache, SaveJob, plan as write_plan
from zarrckpt._tier.peers import PeerPlans, Peers
from zarrckpt._util import multihost as _multihost
from zarrckpt._util.regions import region_size, replicas_of
from zarrckpt.errors import UnsupportedLeafError


def host_of(devices_per_host: int):
    return lambda device: device.id // devices_per_host


HOSTS = [pytest.param(2, id="4 hosts of 2 devices"), pytest.param(1, id="8 hosts of 1 device")]


@pytest.mark.parametrize("per_host", HOSTS)
@pytest.mark.parametrize("spec", [P(), P("data"), P(None, "model"), P("data", "model")])
def test_every_chunk_has_one_writer_and_replicas_share_the_writing(per_host, spec):
    shape = (1024, 2048)  # 8 MiB of float32
    layout = write_plan.layout(NamedSharding(mesh(), spec), shape, 4, 64 * 2**20, 2**20, host_of(per_host))
    writers = collections.Counter()
    covered = 0
    for chunk, writer, parts in layout.assignments(salt=0):
        assert all(host_of(per_host)(device) == writer for device, _, _ in parts)
        writers[writer] += region_size(chunk)
        covered += region_size(chunk)
    assert covered == np.prod(shape)  # every element in exactly one chunk
    holders = {host_of(per_host)(d) for devices in layout.replicas.values() for d in devices}
    assert set(writers) == holders  # every host holding data writes part of it


@pytest.mark.parametrize("per_host", HOSTS)
def test_each_host_reads_what_its_devices_hold_each_chunk_once(per_host):
    sharding = NamedSharding(mesh(), P("data"))
    shape, chunks = (64, 32), (8, 32)
    for host in range(8 // per_host):
        reads = read_plan.sharded_reads(sharding, shape, chunks, host, host_of(per_host))
        regions = {r for _, places in reads for r in places}
        mine = {r for r, devices in replicas_of(sharding, shape).items()
                if any(host_of(per_host)(d) == host for d in devices)}
        assert regions == mine
        boxes = [box for box, _ in reads]
        assert len(boxes) == len(set(boxes))


@pytest.mark.parametrize("per_host", HOSTS)
def test_load_and_broadcast_reads_each_part_once_spread_over_the_hosts(per_host):
    sharding = NamedSharding(mesh(), P())  # replicated on every host
    assert read_plan.held_by_several_processes(sharding, (8,), host_of(per_host))
    readers_of = collections.Counter()
    for leaf in range(64):
        readers = read_plan.one_readers(sharding, (8,), (8,), f"leaf{leaf}", host_of(per_host))
        assert len(readers) == 1  # one part, read by one device
        readers_of[host_of(per_host)(readers[0][1])] += 1
        reads = [read_plan.one_reader_reads(readers, (8,), (8,), host, host_of(per_host))
                 for host in range(8 // per_host)]
        assert sum(len(r) for r in reads) == 1
    assert len(readers_of) == 8 // per_host  # many one-chunk leaves spread over every host


# -- plans kept from a manager's last save (`_save.plan_cache`) ------------------------

@dataclasses.dataclass
class Static:
    """A custom node whose static data cannot be compared with `==` (an array)."""

    w: Any
    table: np.ndarray


jax.tree_util.register_dataclass(Static, data_fields=["w"], meta_fields=["table"])


Point = collections.namedtuple("Point", "x y")


def many_kinds(scale: float) -> dict:
    """A tree of every kind of leaf whose plan a manager keeps or plans afresh: sharded,
    replicated and single-device arrays, typed PRNG keys, numpy arrays and scalars,
    Python numbers, None and empty containers, a named tuple, a large leaf cut into
    several chunks and small ones merged."""
    m = mesh()
    return {
        "w": jax.device_put(jnp.full((64, 32), scale, jnp.bfloat16), NamedSharding(m, P("data", "model"))),
        "big": jax.device_put(jnp.full((512, 256), scale, jnp.float32), NamedSharding(m, P("data"))),
        "small": [jax.device_put(jnp.full((8,), scale), NamedSharding(m, P("model"))) for _ in range(3)],
        "replicated": jax.device_put(jnp.full((4, 4), scale), NamedSharding(m, P())),
        "one_device": jnp.full((3,), scale),
        "key": jax.random.key(int(scale)),
        "host": np.full((5, 2), scale, np.float64),
        "scalar": np.int32(scale),
        "python": [int(scale), float(scale), bool(scale), complex(scale, 1)],
        "empty": ({}, [], None),
        "point": Point(jnp.full((2,), scale), np.float32(scale)),
    }


def plans_of(job: SaveJob) -> list[tuple]:
    """Everything a job's plans say of what is written where, value aside."""
    return [(plan.leaf.path, plan.leaf.name, plan.shape, plan.dtype, plan.chunks, plan.checksum, plan.compression,
             plan.copy_from, plan.copy_all, plan.codec, [(u.region, u.nbytes, u.sources) for u in plan.writes],
             [None if u.host is None else np.asarray(u.host).tolist() for u in plan.writes])
            for plan in job.plans]


def without_time(job: SaveJob) -> dict:
    return {k: v for k, v in job.meta.items() if k != "created_at"}


def planned_afresh(monkeypatch) -> list[int]:
    """Counts the saves planned afresh: each records its tree (kept plans hold the record)."""
    calls = []
    record = _tree.record
    monkeypatch.setattr(_tree, "record", lambda tree: (calls.append(1), record(tree))[1])
    return calls


@pytest.mark.parametrize("processes", [(0, 1), (1, 4)], ids=["one process", "process 1 of 4"])
@pytest.mark.parametrize("commit", [SHARED, PER_PROCESS], ids=["shared", "local copy"])
def test_a_tree_of_the_last_saves_signature_is_planned_exactly_as_afresh(tmp_path, monkeypatch, processes, commit):
    """Kept plans (see `plan_cache`) give what planning afresh gives, value by value:
    every plan's chunks, writers, parts and codec, the array documents and the tree
    record, for a persistent save and a local-tier copy (each process writes what it
    holds, no peer copies); a kept plan holds no value of the save it came from."""
    monkeypatch.setattr(_multihost, "process_index", lambda: processes[0])
    monkeypatch.setattr(_multihost, "process_count", lambda: processes[1])
    loc, options, cache = _storage.resolve(str(tmp_path)), SaveOptions(max_chunk_bytes=2**17), PlanCache()
    kw = {"commit": commit, **({"beside": PeerPlans(Peers())} if commit is PER_PROCESS else {})}
    first = SaveJob.create(loc, many_kinds(1.0), options, plans=cache, **kw)
    afresh = planned_afresh(monkeypatch)
    again = SaveJob.create(loc, many_kinds(2.0), options, plans=cache, **kw)
    assert afresh == []  # planned from the first save's plans
    afresh = SaveJob.create(loc, many_kinds(2.0), options, **kw)
    assert plans_of(again) == plans_of(afresh)
    assert again.arrays == afresh.arrays and again.own == afresh.own == {}
    assert without_time(again) == without_time(afresh)
    for plan, fresh in zip(again.plans, afresh.plans):  # the values of this save, not of the first
        assert plan.leaf.value is fresh.leaf.value or np.array_equal(np.asarray(plan.leaf.value),
                                                                     np.asarray(fresh.leaf.value))
    first_values = [weakref.ref(plan.leaf.value) for plan in first.plans if isinstance(plan.leaf.value, jax.Array)]
    del first
    gc.collect()
    assert all(ref() is None for ref in first_values), "the cache keeps a value of the save it was planned for"


@pytest.mark.parametrize("change", ["sharding", "shape", "dtype", "structure", "kind", "options"])
def test_a_tree_of_another_signature_is_planned_afresh(tmp_path, monkeypatch, change):
    """Any change of what planning reads plans the save afresh, and is kept for the next."""
    m, loc, options, cache = mesh(), _storage.resolve(str(tmp_path)), SaveOptions(), PlanCache()

    def tree(sharding=("data",), shape=(64, 8), dtype=jnp.float32, extra=False, host=False):
        w = np.ones(shape, dtype) if host else jax.device_put(jnp.ones(shape, dtype), NamedSharding(m, P(*sharding)))
        return {"w": w, **({"v": 1} if extra else {})}

    SaveJob.create(loc, tree(), options, plans=cache)
    other, other_options = {"sharding": (tree((None, "model")), options), "shape": (tree(shape=(32, 8)), options),
                            "dtype": (tree(dtype=jnp.bfloat16), options), "structure": (tree(extra=True), options),
                            "kind": (tree(host=True), options),
                            "options": (tree(), SaveOptions(max_chunk_bytes=2**10))}[change]
    afresh = planned_afresh(monkeypatch)
    changed = SaveJob.create(loc, other, other_options, plans=cache)
    assert afresh == [1] and plans_of(changed) == plans_of(SaveJob.create(loc, other, other_options))
    SaveJob.create(loc, other, other_options, plans=cache)
    assert afresh == [1, 1], "the new signature's plans were not kept"


def test_a_tree_with_a_value_dependent_record_is_planned_afresh_at_every_save(tmp_path, monkeypatch):
    """A str's record holds its length (numpy's str_ and bytes_ too, stored as UTF-8),
    a PerProcess's its value, and a Python int past int64 must be refused at every save:
    such trees are never planned from kept plans, nor a custom node whose static data
    cannot be compared; the plans of the last of them are not kept."""
    loc, options, cache = _storage.resolve(str(tmp_path)), SaveOptions(), PlanCache()
    for name in ("a", "abcd", np.str_("abc"), np.str_("ééé"), np.bytes_(b"xy"), np.bytes_(b"xyz"),
                 PerProcess({"i": 1}), PerProcess({"i": 1000})):
        tree = {"name": name, "w": jnp.ones(4)}
        kept, fresh = SaveJob.create(loc, tree, options, plans=cache), SaveJob.create(loc, tree, options)
        assert plans_of(kept) == plans_of(fresh) and kept.own == fresh.own
    SaveJob.create(loc, {"n": 1}, options, plans=cache)
    with pytest.raises(UnsupportedLeafError, match=r"\['n'\]"):
        SaveJob.create(loc, {"n": 2**70}, options, plans=cache)
    afresh = planned_afresh(monkeypatch)
    tables = [np.arange(3), np.arange(3)]
    for table in tables:
        SaveJob.create(loc, {"s": Static(jnp.ones(2), table)}, options, plans=cache)
    assert afresh == [1, 1]
    held = [weakref.ref(table) for table in tables]
    del tables, table
    gc.collect()
    assert [ref() for ref in held] == [None, None], "plans that are never used keep a custom node's static data"


@pytest.mark.parametrize("key", [True, 1.0, np.int64(1)], ids=repr)
def test_a_dict_key_equal_to_the_last_saves_but_of_a_type_that_cannot_be_saved_is_refused(tmp_path, key):
    """`==` takes 1, 1.0, True and numpy's 1 for the same dict key (and jax's tree
    structures with them): a save after one keyed by 1 still refuses the others."""
    loc, options, cache = _storage.resolve(str(tmp_path)), SaveOptions(), PlanCache()
    SaveJob.create(loc, {1: jnp.ones(2)}, options, plans=cache)
    with pytest.raises(UnsupportedLeafError, match="only str and int dict keys"):
        SaveJob.create(loc, {key: jnp.ones(2)}, options, plans=cache)
