"""The local tier attacked, as its users and an attacker would: a copy damaged in any
way, two jobs on one local directory, a directory another user controls, a disk that
fills during a save, a manager nobody closed. A restore falls back and the job trains
on, never a crash loop or a hang; nothing of another job is used or deleted.
(Multi-process damage, a flipped bit with and without a replica: tests/test_tiers.py.)"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest
from builders import copies, flip_bit, mesh, one_state
from jax.sharding import NamedSharding, PartitionSpec as P

import zarrckpt
from zarrckpt._run import lease as _lease
from zarrckpt._tier import tier as _tiers

# -- damage ----------------------------------------------------------------------------


def state(step: int) -> dict:
    """A sharded jax array, a host array and a Python int, each holding `step`."""
    sharding = NamedSharding(mesh(), P("data", "model"))
    return {"w": jax.device_put(np.full((64, 64), step, np.float32), sharding),
            "host": np.full((8,), step, np.int32), "step": step}


def trained(tmp_path: Path) -> tuple[str, str, Path]:
    """Persistent step 4; local copies 3 and 6: the restore wants local step 6."""
    persistent, local = str(tmp_path / "run"), str(tmp_path / "local")
    with zarrckpt.CheckpointManager(persistent, save_interval_steps=4, local_directory=local,
                                    local_save_interval_steps=3, local_keep_last=2) as mgr:
        for step in range(1, 7):
            mgr.save(step, state(step))
    assert zarrckpt.all_steps(persistent) == [4] and zarrckpt.all_steps(str(copies(persistent, local))) == [3, 6]
    return persistent, local, copies(persistent, local) / "0000000006"


def edit_metadata(change: Callable[[dict], None]) -> Callable[[Path], None]:
    """Damage done by editing the copy's group metadata (its `zarrckpt` attribute)."""
    def damage(copy: Path) -> None:
        document = json.loads((copy / "zarr.json").read_text())
        change(document["attributes"]["zarrckpt"])
        (copy / "zarr.json").write_text(json.dumps(document))
    return damage


def chunk(copy: Path) -> Path:
    (found,) = (copy / "w").glob("c.*")
    return found


def replace_with_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def link_to_the_persistent_chunk(copy: Path) -> None:
    target = chunk(copy.parents[2].parent / "run" / "0000000004")  # a file of the same size, outside the copy
    chunk(copy).unlink()
    (copy / "w" / target.name).symlink_to(target)


DAMAGE = {
    "a flipped bit in a chunk": lambda copy: flip_bit(chunk(copy)),
    "a flipped bit in a saved Python int": lambda copy: flip_bit(next((copy / "step").glob("c*"))),
    "a chunk cut short": lambda copy: chunk(copy).write_bytes(chunk(copy).read_bytes()[:-3]),
    "a chunk missing": lambda copy: chunk(copy).unlink(),
    "a chunk that is a directory": lambda copy: replace_with_directory(chunk(copy)),
    "a chunk that is a symbolic link": link_to_the_persistent_chunk,
    "zarr.json that is a directory": lambda copy: replace_with_directory(copy / "zarr.json"),
    "zarr.json that is not JSON": lambda copy: (copy / "zarr.json").write_bytes(b"\x00garbage"),
    "zarr.json cut short": lambda copy: (copy / "zarr.json").write_bytes((copy / "zarr.json").read_bytes()[:300]),
    "a held coordinate that is an int": edit_metadata(lambda m: m["local"]["held"].update(w=[0])),
    "a held coordinate that is null": edit_metadata(lambda m: m["local"]["held"].update(w=[None])),
    "a held coordinate outside the grid": edit_metadata(lambda m: m["local"]["held"].update(w=[[7, 0]])),
    "held, not a dict": edit_metadata(lambda m: m["local"].update(held=[1, 2])),
    "held naming an array it does not describe": edit_metadata(lambda m: m["local"]["held"].update(x=[[0, 0]])),
    "a persistent step that is not a number": edit_metadata(lambda m: m["local"].update(after="4")),
    "another step recorded": edit_metadata(lambda m: m["local"].update(step=7)),
    "another run recorded": edit_metadata(lambda m: m["local"].update(run="0" * 32)),
    "no tree record": edit_metadata(lambda m: m.update(tree=None)),
    "a format from the future": edit_metadata(lambda m: m.update(format_version=99)),
    "a leaf's shape changed": edit_metadata(lambda m: m["tree"]["children"][2].update(shape=[65, 64])),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_copy_falls_back_and_training_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                          damage: str) -> None:
    persistent, local, copy = trained(tmp_path)
    DAMAGE[damage](copy)
    for restart in range(2):  # never a crash loop: every restart restores, and trains on
        with caplog.at_level(logging.WARNING, logger="zarrckpt"), \
                zarrckpt.CheckpointManager(persistent, save_interval_steps=4, local_directory=local,
                                           local_save_interval_steps=3) as mgr:
            restored, step = mgr.restore(state(0))
            assert (step, mgr.restored_tier) == (4 + restart, "persistent"), damage
            for name, value in restored.items():
                assert np.all(np.asarray(value) == step), (damage, name)
            assert mgr.save(step + 1, state(step + 1), force=True)
        if restart == 0:  # a warning names the copy
            assert any("0000000006" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING), damage
    assert zarrckpt.all_steps(persistent) == [4, 5, 6]


def test_a_flipped_bit_in_the_newest_copy_falls_back_to_the_older_copy(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    persistent, local = str(tmp_path / "run"), str(tmp_path / "local")
    tiers = {"local_directory": local, "local_save_interval_steps": 3, "local_keep_last": 2}
    with zarrckpt.CheckpointManager(persistent, save_interval_steps=100, **tiers) as mgr:
        for step in range(1, 7):
            mgr.save(step, state(step))
    flip_bit(chunk(copies(persistent, local) / "0000000006"))
    with caplog.at_level(logging.WARNING, logger="zarrckpt"), zarrckpt.CheckpointManager(persistent, **tiers) as mgr:
        restored, step = mgr.restore(state(0))
        assert (step, mgr.restored_tier) == (3, "local")
        assert all(np.all(np.asarray(value) == 3) for value in restored.values())
    (warning,) = [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
    assert "0000000006" in warning and "checksum" in warning  # names the copy and the chunk's fault
    assert zarrckpt.all_steps(str(copies(persistent, local))) == [3]


# -- two jobs, one local directory ------------------------------------------------------

JOB = """
import json, sys
import numpy as np
import zarrckpt
persistent, local, offset = sys.argv[1], sys.argv[2], int(sys.argv[3])
tiers = dict(local_directory=local, local_save_interval_steps=1, local_keep_last=2, heartbeat_s=0.2)
with zarrckpt.CheckpointManager(persistent, save_interval_steps=25, **tiers) as mgr:
    for step in range(1, 41):
        mgr.save(step, {"w": np.full((64, 1024), offset + step, np.float32)})
with zarrckpt.CheckpointManager(persistent, **tiers) as mgr:
    state, step = mgr.restore({"w": np.zeros((64, 1024), np.float32)})
    print(json.dumps({"step": step, "tier": mgr.restored_tier, "values": np.unique(state["w"]).tolist()}))
"""


def test_two_jobs_sharing_a_local_directory_keep_their_own_copies(tmp_path: Path) -> None:
    local = tmp_path / "shared-local"  # a sweep's template: every job gets the same local_directory
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    jobs = [subprocess.Popen([sys.executable, "-c", JOB, str(tmp_path / f"run{i}"), str(local), str(1000 * i)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in (1, 2)]
    results = [job.communicate(timeout=300) for job in jobs]
    for i, (job, (out, err)) in enumerate(zip(jobs, results), start=1):
        assert job.returncode == 0, err
        assert json.loads(out.splitlines()[-1]) == {"step": 40, "tier": "local", "values": [1000 * i + 40]}
        run = copies(tmp_path / f"run{i}", local)
        assert zarrckpt.all_steps(str(run)) == [39, 40]  # its own copies, all committed, none deleted by the other
        for step in (39, 40):
            assert zarrckpt.verify(str(run / f"{step:010d}")).ok
    assert len(list(local.iterdir())) == 2


def test_a_second_live_job_of_the_same_run_is_refused(tmp_path: Path) -> None:
    persistent, local = tmp_path / "run", tmp_path / "local"
    tiers = {"local_directory": str(local), "local_save_interval_steps": 1, "heartbeat_s": 0.2}
    with zarrckpt.CheckpointManager(str(persistent), **tiers) as mgr:
        mgr.save(1, one_state(1, 1))
    shutil.copytree(persistent, tmp_path / "fork")  # the whole run directory copied: the same run identity
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, zarrckpt; m = zarrckpt.CheckpointManager(sys.argv[1], "
         "local_directory=sys.argv[2], local_save_interval_steps=1, heartbeat_s=0.2); print('open', flush=True); "
         "time.sleep(120)", str(persistent), str(local)],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(zarrckpt.CheckpointLocationError, match="holds the copies of a live job of the same run"):
            zarrckpt.CheckpointManager(str(tmp_path / "fork"), **tiers)
        with pytest.raises(zarrckpt.DirectoryInUseError):  # "in use" is one error, whichever directory
            zarrckpt.CheckpointManager(str(tmp_path / "fork"), **tiers)
    finally:
        holder.kill()
        holder.wait()
    assert zarrckpt.all_steps(str(copies(persistent, local))) == [1]  # nothing deleted


# -- a directory another user controls -------------------------------------------------


@pytest.mark.parametrize("setup", ["writable by others", "a parent writable by others", "another user's"])
def test_a_local_directory_another_user_controls_is_refused(tmp_path: Path, setup: str) -> None:
    parent = tmp_path / "shared"
    local = parent / "ckpt-local"
    local.mkdir(parents=True)
    if setup == "writable by others":
        local.chmod(0o777)  # made beforehand by someone else, as anyone can under /tmp
        why = "writable by other users"
    elif setup == "a parent writable by others":
        parent.chmod(0o777)  # not sticky: anyone can swap ckpt-local itself
        why = "writable by other users"
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        os.chown(local, 12345, -1)
        why = "belongs to user id 12345"
    with pytest.raises(zarrckpt.CheckpointLocationError, match=why):
        zarrckpt.CheckpointManager(str(tmp_path / "run"), local_directory=str(local), local_save_interval_steps=1)
    assert list(local.iterdir()) == []  # nothing written there


# -- a disk that fills during a local save ---------------------------------------------


@pytest.mark.parametrize("async_save", [True, False])
def test_a_local_save_that_fills_the_disk_is_removed_and_the_tier_resumes(
        tmp_path: Path, small_disk: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        async_save: bool) -> None:
    persistent, local = str(tmp_path / "run"), str(small_disk / "local")
    # The disk fills between the room check and the writes (another job's files, say).
    monkeypatch.setattr(_tiers, "_footprint", lambda job: 0)
    with caplog.at_level(logging.WARNING, logger="zarrckpt"), \
            zarrckpt.CheckpointManager(persistent, save_interval_steps=100, local_directory=local,
                                       local_save_interval_steps=1, async_save=async_save) as mgr:
        assert mgr.save(1, one_state(4, 1))  # 4 MiB on a 3 MiB disk
        mgr.wait()
        for step in (2, 3, 4):  # the disk is free again: the tier goes on
            assert mgr.save(step, one_state(1, step))
    assert any("local checkpoint of step 1 failed (training goes on)" in r.getMessage() for r in caplog.records)
    mine = copies(persistent, local)
    assert zarrckpt.all_steps(str(mine)) == [4]
    assert [p.name for p in mine.iterdir() if p.name != _lease.LEASES] == ["0000000004"]  # no half-written copy


# -- a manager nobody closed -----------------------------------------------------------


@pytest.mark.parametrize("tiers", [False, True])
def test_a_manager_nobody_holds_gives_its_directories_back(tmp_path: Path, tiers: bool, caplog) -> None:
    options = {"local_directory": str(tmp_path / "local"), "local_save_interval_steps": 1} if tiers else {}
    run = str(tmp_path / "run")
    mgr = zarrckpt.CheckpointManager(run, heartbeat_s=60, **options)  # a notebook cell
    held = [mgr]  # as the failed cell's traceback holds it
    started = time.monotonic()
    mgr = zarrckpt.CheckpointManager(run, heartbeat_s=60, **options)  # the cell run again: takes over
    assert time.monotonic() - started < 30  # at once, not after watching the lease for 150 s
    with pytest.raises(zarrckpt.DirectoryInUseError, match="was taken over by the CheckpointManager made at"):
        held[0].save(1, one_state(1, 1), force=True)
    held.clear()
    mgr = None  # the variable rebound: nobody holds the second manager
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        mgr = zarrckpt.CheckpointManager(run, heartbeat_s=60, **options)
    assert not [r for r in caplog.records if "takes it over" in r.getMessage()]  # it had given its leases back
    assert mgr.save(1, one_state(1, 1))
    mgr.close()
