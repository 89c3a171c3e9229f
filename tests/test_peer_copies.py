"""Peer copies of the local tier (`local_peer_copies`): real JAX processes (gloo) on a
fully sharded state, every array leaf cut over all 8 devices, so that no process holds
a replica of another's shards, each process with a local directory of its own (its own
disk), tests/workers/mp_peers.py. Every shard on every process is checked against the
step restored."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
from pathlib import Path

import jax
import ml_dtypes
import multiprocess
import numpy as np
import pytest
from builders import copies, flip_bit, logged_bytes, one_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import zarrckpt
from zarrckpt import _cli
from zarrckpt._tier import peers as _peers
from zarrckpt._util import permute as _permute


def save(*runs: Path, processes: int) -> None:
    multiprocess.run("mp_peers", "save", *(f"{run}/p:{run}/l" for run in runs), processes=processes,
                     devices=8 // processes, timeout=300)


def restore(*runs: Path, processes: int) -> list[list[dict]]:
    """Restarts the job on each run in turn; per run, what each process restored."""
    results = multiprocess.run("mp_peers", "restore", *(f"{run}/p:{run}/l" for run in runs), processes=processes,
                               devices=8 // processes, timeout=300)
    return [[r["results"][i] for r in results] for i in range(len(runs))]


def copy_of(run: Path, process: int) -> Path:
    return copies(run / "p", run / "l" / f"host{process}", process)


def listed(run: Path, process: int) -> list[dict]:
    """What `zarrckpt ls --json` says of a process's local directory (the command's own
    code, run here: tests/test_cli.py runs it as a process)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert _cli.main(["ls", "--json", str(run / "l" / f"host{process}")]) == 0
    return json.loads(out.getvalue())


def no_persistent_reads(run: Path) -> None:
    """Leaves only the metadata of the persistent steps: reading any chunk of them fails."""
    for chunk in (run / "p").glob("*/*/c*"):
        chunk.unlink()


def said(result: dict, text: str) -> list[str]:
    return [line for line in result["said"] if text in line]


def megabytes(result: dict) -> tuple[float, float]:
    """What a process read from its own copy, and got from other processes (MB)."""
    (line,) = said(result, "from other processes")
    own, rest = line.split(": ", 1)[1].split(" from its own copy, ")
    return logged_bytes(own) / 1e6, logged_bytes(rest.split(" from other")[0]) / 1e6


def test_a_lost_host_is_rebuilt_from_its_peer(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save(run, processes=2)
    # Each process's copy holds its own chunks and its peer's, byte for byte as the peer
    # wrote them.
    for name in ("w", "v", "key"):
        for chunk in ("c.0.0", "c.1.0"):
            assert (copy_of(run, 0) / f"0000000150/{name}/{chunk}").read_bytes() == \
                   (copy_of(run, 1) / f"0000000150/{name}/{chunk}").read_bytes()
    assert [(r["process"], r["peers_of"], r["step"]) for r in listed(run, 0)] == [(0, [1], 150)]
    no_persistent_reads(run)
    shutil.rmtree(run / "l" / "host1")  # a replaced host: its disk is gone
    (got,) = restore(run, processes=2)
    for r in got:
        assert (r["step"], r["tier"], r["checked"]) == (150, "local", 14), r  # no persistent chunk left to read
    assert megabytes(got[0])[1] == 0  # process 0 read its own copy alone...
    own, peers = megabytes(got[1])
    assert own == 0 and peers > 0  # ...and sent process 1 its part, from process 0's peer copy
    # Training went on: both processes keep a copy of step 200 again, each with its peer's.
    assert zarrckpt.all_steps(str(copy_of(run, 0))) == zarrckpt.all_steps(str(copy_of(run, 1))) == [200]
    assert [r["peers_of"] for r in listed(run, 1)] == [[0]]


def test_peer_copies_on_four_processes(tmp_path: Path) -> None:
    one, pair = tmp_path / "one", tmp_path / "pair"
    save(one, processes=4)
    shutil.copytree(one, pair)  # the same run twice: two restarts, each losing other hosts
    keeper = {r["peers_of"][0]: p for p in range(4) for r in listed(one, p)}  # whose copy each keeps
    assert sorted(keeper) == [0, 1, 2, 3] and all(keeper[p] != p for p in keeper)
    no_persistent_reads(one)  # the other reads the persistent step
    lost = 1
    shutil.rmtree(one / "l" / f"host{lost}")
    for p in (lost, keeper[lost]):  # two lost hosts that keep each other's copies
        shutil.rmtree(pair / "l" / f"host{p}")
    got_one, got_pair = restore(one, pair, processes=4)
    for r in got_one:
        assert (r["step"], r["tier"], r["checked"]) == (150, "local", 8), r  # 3 arrays of 2 shards, 2 values
    own, peers = megabytes(got_one[lost])
    assert own == 0 and peers > 0
    for r in got_pair:
        assert (r["step"], r["tier"], r["checked"]) == (100, "persistent", 8), r
    assert said(got_pair[0], "local step 150 is not used: the local copies cannot rebuild it")


def test_a_damaged_peer_copy_is_set_aside(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save(run, processes=2)
    shutil.rmtree(run / "l" / "host1")
    flip_bit(copy_of(run, 0) / "0000000150/w/c.1.0")  # process 1's part, kept by process 0
    (got,) = restore(run, processes=2)  # both processes exit 0 (multiprocess.run checks)
    for r in got:
        assert (r["step"], r["tier"], r["checked"]) == (100, "persistent", 14), r
    assert any("w/c.1.0" in line for line in said(got[0], "0000000150 set aside (deleted)"))


# -- one process ----------------------------------------------------------------

def test_choose_keeps_copies_in_other_domains() -> None:
    two_hosts = _peers.choose(1, ["host a", "host a", "host b", "host b"])
    (holder,) = two_hosts.holders
    assert sorted(holder) == [0, 1, 2, 3]
    assert all({p, holder[p]} & {0, 1} and {p, holder[p]} & {2, 3} for p in range(4))  # on the other host
    # Two copies over three racks: each process's copies on the two other racks.
    racks = ["r0", "r1", "r2"] * 2
    holders = _peers.choose(2, racks).holders
    for p in range(6):
        assert len({racks[p], racks[holders[0][p]], racks[holders[1][p]]}) == 3
    assert _peers.choose(1, ["host a"] * 4).holders == ((2, 3, 0, 1),)  # one domain: half-way round
    assert _peers.choose(1, ["host a"]).holders == ()  # one process: no peer
    assert _peers.domains([{"slice": "0", "host": "a"}, {"slice": "1", "host": "a"}]) == ["slice 0", "slice 1"]
    assert _peers.domains([{"slice": "0", "host": "a"}, {"slice": "0", "host": "b"}]) == ["host a", "host b"]


@pytest.mark.parametrize(("copies", "groups"), [(2, ["a"] * 8 + ["b"] * 8), (1, ["a", "a", "a", "b"]), (4, ["a"] * 4)])
def test_choose_refuses_what_the_domains_cannot_hold(copies: int, groups: list[str]) -> None:
    with pytest.raises(ValueError, match=f"local_peer_copies={copies}"):
        _peers.choose(copies, groups)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"local_peer_copies": 1}, ValueError, "give local_directory and local_save_interval_steps too"),
    ({"local_peer_group": "rack 1"}, ValueError, "give local_directory and local_save_interval_steps too"),
    ({"local_peer_copies": -1, "local_directory": "/dev/shm/x", "local_save_interval_steps": 5}, ValueError,
     "local_peer_copies must be 0 or more"),
    ({"local_peer_copies": 1.0, "local_directory": "/dev/shm/x", "local_save_interval_steps": 5}, TypeError,
     "local_peer_copies must be an int"),
    ({"local_peer_group": 3, "local_directory": "/dev/shm/x", "local_save_interval_steps": 5}, TypeError,
     "local_peer_group must be a str"),
])
def test_peer_copy_options(tmp_path: Path, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        zarrckpt.CheckpointManager(str(tmp_path / "run"), **kwargs)


def test_one_process_has_no_peer(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    persistent, local = str(tmp_path / "run"), str(tmp_path / "local")
    with caplog.at_level(logging.WARNING, logger="zarrckpt"), \
            zarrckpt.CheckpointManager(persistent, save_interval_steps=2, local_directory=local,
                                       local_save_interval_steps=1, local_peer_copies=1) as mgr:
        assert mgr.save(1, one_state(1, 1))
    assert any("a job of one process has no peer" in r.getMessage() for r in caplog.records)
    with zarrckpt.CheckpointManager(persistent, local_directory=local, local_save_interval_steps=1) as mgr:
        state, step = mgr.restore(one_state(1, 0))
        assert (step, mgr.restored_tier, state["step"]) == (1, "local", 1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64", "bool", "int8", "complex64",
                                   "int4", "float4_e2m1fn"])
def test_blocks_moved_to_a_peer_keep_every_bit(dtype: str) -> None:
    """A peer copy's blocks cross the device network by a permute: -0.0 and NaN payloads
    arrive as they left (a permute of bf16 on CPU devices once made every NaN canonical),
    and dtypes that are no integers of their width (complex, 4-bit) move as they are."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    kind = np.dtype(getattr(ml_dtypes, dtype, dtype))
    if kind.itemsize == 1 and kind.kind != "b" and dtype not in ("int8",):  # 4-bit: a value per byte
        host = np.arange(8 * 4).reshape(8, 4).astype(kind)
    else:
        width = kind.itemsize
        raw = np.random.default_rng(0).integers(0, 256, (8, 4 * width), dtype=np.uint8)
        values = raw.view(np.uint8 if dtype == "bool" else f"uint{width * 8}")
        if dtype == "bool":
            values = (values & 1).astype(bool)
        elif kind.kind in "fc":
            top = np.array(1, values.dtype) << (width * 8 - 1)
            values[:, 0] = top  # -0.0
            values[:, 1] = ~top  # a NaN whose payload is all ones (for complex: in one part)
            values[:, 2] = ~top - 2  # another payload
        host = values if dtype == "bool" else values.view(kind)
    with jax.enable_x64(dtype == "float64"):
        array = jax.device_put(host, NamedSharding(mesh, P("x")))
        moved = _permute.move(array, tuple((i, (i + 1) % 8) for i in range(8)))
        assert np.asarray(moved).tobytes() == np.roll(host, 1, axis=0).tobytes()
