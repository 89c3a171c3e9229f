"""The planners are pure: given which process holds each device, a layout over many
hosts is planned in one process. Here 8 CPU devices play 4 hosts of 2 devices and 8
hosts of 1, and every chunk has exactly one writer, every host writes its share of
replicated data, and every part a host needs is read once, by someone."""

import collections

import numpy as np
import pytest
from builders import mesh
from jax.sharding import NamedSharding, PartitionSpec as P

from zarrckpt._regions import region_size, replicas_of
from zarrckpt._restore import plan as read_plan
from zarrckpt._save import plan as write_plan


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
