"""Two tiers: local copies beside the persistent checkpoints, restored by 4 real JAX
processes x 2 CPU devices (gloo), on a mesh of 2 data-parallel replicas: processes 0
and 2 hold the same shards, as do 1 and 3 (tests/workers/mp_tiers.py). Every shard on
every process is checked against the step restored."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import forked_cli
import multiprocess
import numpy as np
import pytest
from builders import copies, flip_bit, logged_bytes, one_state

import zarrckpt

SCENARIOS = ("all", "replaced", "both_replicas", "other_run", "damaged", "flipped", "flipped_both", "other_count",
             "killed")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run per scenario, each saved by 4 processes: local copies of steps 50, 100 and
    150 (keeping 1), persistent step 100."""
    base = tmp_path_factory.mktemp("tiers")
    multiprocess.run("mp_tiers", "save", *(f"{base}/{s}-p:{base}/{s}-l" for s in SCENARIOS),
                     processes=4, devices=2, timeout=300)
    return base


def restore(base: Path, *scenarios: str, processes: int = 4, persistent: dict | None = None) -> dict:
    """Restarts the job: `processes` processes restore each scenario in turn; returns,
    per scenario, what each process restored."""
    pairs = [f"{(persistent or {}).get(s, base / f'{s}-p')}:{base}/{s}-l" for s in scenarios]
    results = multiprocess.run("mp_tiers", "restore", *pairs, processes=processes, devices=8 // processes,
                               timeout=300)
    return {s: [r["results"][i] for r in results] for i, s in enumerate(scenarios)}


def without_chunks(step: Path) -> None:
    """Leaves only the metadata of a persistent step: reading any of its chunks fails."""
    for chunk in step.glob("*/c*"):
        chunk.unlink()


def test_local_tier_layout(saved: Path) -> None:
    mine = copies(saved / "all-p", saved / "all-l").parent
    assert [p.name for p in (saved / "all-l").iterdir()] == [mine.name]  # the run's own directory
    assert sorted(p.name for p in mine.iterdir()) == [f"process{i}" for i in range(4)]
    for i in range(4):  # keep_last=1: only the newest copy; private directories
        assert zarrckpt.all_steps(str(mine / f"process{i}")) == [150]
        assert (mine / f"process{i}").stat().st_mode & 0o777 == 0o700
    assert (saved / "all-l").stat().st_mode & 0o777 == mine.stat().st_mode & 0o777 == 0o700
    assert zarrckpt.all_steps(str(saved / "all-p")) == [100]
    # Replicas hold the same chunks, and each process only its devices' ones.
    def chunks(i: int) -> set[str]:
        return {str(p.relative_to(mine / f"process{i}/0000000150")) for p in (mine / f"process{i}").rglob("c*")}
    assert chunks(0) == chunks(2) and chunks(1) == chunks(3) and chunks(0) != chunks(1)


def test_restores_local_and_falls_back(saved: Path) -> None:
    """The first five failure cases of the issue, each a restart of all processes."""
    for scenario in ("all", "replaced"):
        without_chunks(saved / f"{scenario}-p/0000000100")  # zero bytes may come from the persistent store
    def copy(scenario: str, process: int) -> Path:
        return copies(saved / f"{scenario}-p", saved / f"{scenario}-l", process)

    shutil.rmtree(copy("replaced", 1))  # a replaced host
    for lost in (1, 3):  # both replicas of the same shards
        shutil.rmtree(copy("both_replicas", lost))
    other_run = saved / "other_run-p2"  # the same local copies, another run's persistent directory
    shutil.copytree(saved / "other_run-p/0000000100", other_run / "0000000100")
    (copy("damaged", 0) / "0000000150/w/c.0.0").write_bytes(b"cut short")
    flip_bit(copy("flipped", 0) / "0000000150/w/c.0.0")  # found only by reading it: its checksum
    for process in (0, 2):  # both replicas of a chunk
        flip_bit(copy("flipped_both", process) / "0000000150/w/c.0.0")
    got = restore(saved, "all", "replaced", "both_replicas", "other_run", "damaged", "flipped", "flipped_both",
                  persistent={"other_run": other_run})

    for scenario in ("all", "replaced", "damaged", "flipped"):
        for pid, r in enumerate(got[scenario]):
            assert (r["step"], r["tier"]) == (150, "local"), (scenario, pid, r)
            assert r["checked"] == 11  # and nothing from the persistent store, whose chunks are gone
            assert r["seconds"] < 30, (scenario, pid, r["seconds"])  # nobody waited for a process that gave up
    assert all(_peer_mb(r) == 0 for r in got["all"])
    assert _peer_mb(got["replaced"][1]) > 0  # its parts came from its replica, process 3
    for scenario in ("both_replicas", "flipped_both"):
        for r in got[scenario]:
            assert (r["step"], r["tier"], r["checked"]) == (100, "persistent", 11), (scenario, r)
            assert r["seconds"] < 30, (scenario, r["seconds"])
    assert any("cannot rebuild it" in line and "['v']" in line for line in got["both_replicas"][0]["said"])
    for r in got["other_run"]:  # another run's copies are not this run's: the persistent step, nothing deleted
        assert (r["step"], r["tier"]) == (100, "persistent"), r
        assert any("also holds the copies of 1 other run" in line for line in r["said"])
    for i in range(4):
        assert zarrckpt.all_steps(str(copy("other_run", i))) == [150]
    assert any("0000000150 not used: chunk w/c.0.0 has 9 bytes" in line for line in got["damaged"][0]["said"])
    assert _peer_mb(got["damaged"][0]) > 0  # its copy set aside: its parts came from process 2
    # A flipped bit is found while reading: every process falls back together, the copy
    # is set aside (deleted), and process 0's parts come from its replica, process 2.
    assert any("0000000150 set aside (deleted)" in line and "w/c.0.0" in line for line in got["flipped"][0]["said"])
    assert _peer_mb(got["flipped"][0]) > 0
    assert zarrckpt.all_steps(str(copy("flipped", 0))) == [] and zarrckpt.all_steps(str(copy("flipped", 2))) == [150]


def test_other_process_count_restores_persistent(saved: Path) -> None:
    got = restore(saved, "other_count", processes=8)["other_count"]
    for r in got:
        assert (r["step"], r["tier"], r["checked"]) == (100, "persistent", 7), r  # one device each


def test_process_killed_mid_local_save_restores_previous_step(saved: Path) -> None:
    persistent, local = saved / "killed-p", saved / "killed-l"
    # Restored from local step 150, trains on: step 200 is saved to both tiers, then
    # process 2 is killed after writing one chunk of its local copy of step 250.
    died = multiprocess.run("mp_tiers", "die", str(persistent), str(local), "250", "2", processes=4, devices=2,
                            timeout=300, expect_ok=False)
    # The others' local save of step 250 fails (a warning): they go on, and exit cleanly.
    assert [d["returncode"] for d in died] == [0, 0, -9, 0] and died[0]["restored"] == 150
    for i in range(4):  # no process committed its copy of step 250
        assert zarrckpt.all_steps(str(copies(persistent, local, i))) == [200]
    results = multiprocess.run("mp_tiers", "restore", f"{persistent}:{local}", processes=4, devices=2, timeout=300)
    for r in results:  # the previous complete step (both tiers have it: the persistent one is read)
        (only,) = r["results"]
        assert (only["step"], only["tier"], only["checked"]) == (200, "persistent", 11), only


def _peer_mb(result: dict) -> float:
    (line,) = [s for s in result["said"] if "from other processes" in s]
    return logged_bytes(line.split(" from its own copy, ")[1].split(" from other")[0]) / 1e6


# -- one process ----------------------------------------------------------------

def test_one_process_restores_the_newer_tier(tmp_path: Path) -> None:
    persistent, local = str(tmp_path / "run"), str(tmp_path / "local")
    with zarrckpt.CheckpointManager(persistent, save_interval_steps=4, local_directory=local,
                                    local_save_interval_steps=3, local_keep_last=2) as mgr:
        saved = [step for step in range(1, 11) if mgr.save(step, one_state(1, step))]
    assert saved == [3, 4, 6, 8, 9]
    assert zarrckpt.all_steps(persistent) == [4, 8] and zarrckpt.all_steps(str(copies(persistent, local))) == [6, 9]
    with zarrckpt.CheckpointManager(persistent, local_directory=local, local_save_interval_steps=3) as mgr:
        state, step = mgr.restore(one_state(1, 0))
        assert (step, mgr.restored_tier, state["step"]) == (9, "local", 9)
        np.testing.assert_array_equal(state["w"], one_state(1, 9)["w"])
        saved_tree, step = mgr.restore(None)  # no target: numpy arrays and Python scalars
        assert step == 9 and saved_tree["step"] == 9 and isinstance(saved_tree["w"], np.ndarray)
    with zarrckpt.CheckpointManager(persistent) as mgr:  # no local tier: the persistent one
        state, step = mgr.restore(one_state(1, 0))
        assert (step, mgr.restored_tier, state["step"]) == (8, "persistent", 8)
    done = forked_cli.run("ls", local)
    assert done.returncode == 0, done.stderr
    listed = done.stdout.splitlines()
    run = copies(persistent, local).parent.name[len("run-"):][:8]
    assert listed[0].split()[:5] == ["run", "process", "peers", "step", "state"]
    assert [line.split()[:5] for line in listed[1:]] == [[run, "0", "-", "6", "committed"],
                                                         [run, "0", "-", "9", "committed"]]


def test_a_second_job_of_several_processes_on_a_live_jobs_local_directory_is_refused_as_in_use(
        tmp_path: Path) -> None:
    """Two processes of a job hold a local directory; a second job of two processes of
    the same run (its persistent directory copied) on it is refused on both processes
    with DirectoryInUseError, as a second manager on a checkpoint directory is, and
    restores nothing."""
    persistent, local = tmp_path / "run", tmp_path / "local"
    multiprocess.run("mp_tiers", "save", f"{persistent}:{local}", processes=2, devices=4, timeout=300)
    shutil.copytree(persistent, tmp_path / "fork")  # the same run identity
    holders = multiprocess.launch("mp_tiers", "hold", str(persistent), str(local), processes=2, devices=4)
    try:
        deadline = time.monotonic() + 120
        while not all("open" in multiprocess.said(p) for p in holders):
            assert time.monotonic() < deadline and all(p.poll() is None for p in holders), "the holders did not open"
            time.sleep(0.1)
        results = multiprocess.run("mp_tiers", "restore", f"{tmp_path / 'fork'}:{local}", processes=2, devices=4)
    finally:
        for p in holders:
            p.kill()
            p.wait()
    for result in results:
        (refused,) = result["results"]
        assert refused["kind"] == "DirectoryInUseError" and str(local) in refused["refused"], refused


def test_a_step_deleted_by_hand_never_comes_back_from_the_local_tier(tmp_path: Path) -> None:
    persistent, local = str(tmp_path / "run"), str(tmp_path / "local")
    with zarrckpt.CheckpointManager(persistent, save_interval_steps=4, local_directory=local,
                                    local_save_interval_steps=4, local_keep_last=2) as mgr:
        for step in range(1, 9):
            mgr.save(step, one_state(1, step))
        mgr.delete(8)  # say, it holds what training should not go on from
    assert zarrckpt.all_steps(persistent) == [4] and zarrckpt.all_steps(str(copies(persistent, local))) == [4]
    with zarrckpt.CheckpointManager(persistent, local_directory=local, local_save_interval_steps=4) as mgr:
        _, step = mgr.restore(one_state(1, 0))
        assert step == 4


def test_a_local_copy_that_does_not_fit_is_skipped(tmp_path: Path, small_disk: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    persistent, local = str(tmp_path / "run"), str(small_disk / "local")
    with zarrckpt.CheckpointManager(persistent, save_interval_steps=2, local_directory=local,
                                    local_save_interval_steps=1, async_save=False) as mgr:
        assert mgr.save(1, one_state(1, 1))
        with caplog.at_level(logging.WARNING, logger="zarrckpt"):
            assert mgr.save(2, one_state(4, 2))  # the persistent save still happens
            assert not mgr.save(3, one_state(4, 3))  # nothing else was due
    assert any("local checkpoint of step 2 skipped (training goes on)" in r.getMessage() and "GB free" in
               r.getMessage() for r in caplog.records)
    assert zarrckpt.all_steps(str(copies(persistent, local))) == [1] and zarrckpt.all_steps(persistent) == [2]


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"local_directory": "/dev/shm/x"}, ValueError, "local_directory and local_save_interval_steps go together"),
    ({"local_save_interval_steps": 10}, ValueError, "local_directory and local_save_interval_steps go together"),
    ({"local_directory": "memory://x", "local_save_interval_steps": 10}, ValueError,
     "local_directory must be a path on this host's own disk"),
    ({"local_directory": "/dev/shm/x", "local_save_interval_steps": 0}, ValueError, "local_save_interval_steps"),
    ({"local_directory": "/dev/shm/x", "local_save_interval_steps": 5, "local_keep_last": 0}, ValueError,
     "local_keep_last"),
])
def test_local_tier_options(tmp_path: Path, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        zarrckpt.CheckpointManager(str(tmp_path / "run"), **kwargs)


def test_copies_of_abandoned_training_are_never_restored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    persistent, local = str(tmp_path / "run"), str(tmp_path / "local")
    tiers = {"local_directory": local, "local_save_interval_steps": 3, "local_keep_last": 3}

    def train(last: int) -> None:
        with zarrckpt.CheckpointManager(persistent, save_interval_steps=4, **tiers) as mgr:
            for step in range(1, last + 1):
                mgr.save(step, one_state(1, step))

    def restore(**kwargs) -> tuple[int, str | None]:
        with zarrckpt.CheckpointManager(persistent, **tiers) as mgr:
            state, step = mgr.restore(one_state(1, 0), **kwargs)
            assert state["step"] == step
            return step, mgr.restored_tier

    train(10)
    mine = copies(persistent, local)
    assert zarrckpt.all_steps(str(mine)) == [3, 6, 9] and zarrckpt.all_steps(persistent) == [4, 8]
    shutil.rmtree(f"{persistent}/0000000008")  # rolled back by hand: copy 9 came after step 8
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        assert restore() == (6, "local")
    assert any("0000000009 not used: it was saved after persistent step 8, which is gone" in r.getMessage()
               for r in caplog.records)
    assert zarrckpt.all_steps(str(mine)) == [3, 6]  # the restore deleted the newer copy

    shutil.rmtree(persistent)  # a new run in the same directory: the old run's copies are not its own, nor lost
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        assert restore() == (0, None)
    assert any("also holds the copies of 1 other run" in r.getMessage() for r in caplog.records)
    assert zarrckpt.all_steps(str(mine)) == [3, 6]
    shutil.rmtree(local)

    train(9)
    assert restore(step=4) == (4, "persistent")  # a rollback: copies after step 4 go
    assert zarrckpt.all_steps(str(copies(persistent, local))) == [3]


def test_someone_s_folder_named_like_a_process_s_copies_is_not_taken_for_another_run_s(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """In a local_directory, `process<i>` holding steps is the copies of a run of an older
    layout (named, never deleted); one holding anything else is someone's, not named as
    a run's copies to delete."""
    local = tmp_path / "local"
    (local / "process0" / "frames").mkdir(parents=True)
    (local / "process0" / "frames" / "0").write_bytes(b"image")
    (local / "process1" / "0000000003").mkdir(parents=True)
    local.chmod(0o700)
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        with zarrckpt.CheckpointManager(str(tmp_path / "run"), local_directory=str(local),
                                        local_save_interval_steps=1) as mgr:
            mgr.save(1, one_state(1, 1))
    said = [r.getMessage() for r in caplog.records if "process1" in r.getMessage()]
    assert len(said) == 1 and "process0" not in said[0], said
    assert (local / "process0" / "frames" / "0").read_bytes() == b"image"
    assert (local / "process1" / "0000000003").is_dir()


@pytest.mark.parametrize("async_save", [True, False])
def test_a_failing_local_copy_is_a_warning_and_the_persistent_save_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, async_save: bool) -> None:
    persistent, local = str(tmp_path / "run"), tmp_path / "local"
    Path(persistent).mkdir()
    (Path(persistent) / "zarrckpt.run").write_text("ab" * 16)  # the run's identity, made beforehand
    mine = copies(persistent, local)
    (mine / "0000000004").mkdir(parents=True)
    (mine / "0000000004/NOTES.md").write_text("not a checkpoint")  # the local save of step 4 fails
    with caplog.at_level(logging.WARNING, logger="zarrckpt"), \
            zarrckpt.CheckpointManager(persistent, save_interval_steps=4, local_directory=str(local),
                                       local_save_interval_steps=2, async_save=async_save) as mgr:
        assert mgr.save(2, one_state(1, 2))  # local only
        assert mgr.save(2, one_state(1, 2), force=True)  # the same step to the persistent tier too
        assert mgr.save(4, one_state(1, 4))  # both tiers: the local one fails
        mgr.wait()
        assert mgr.save(6, one_state(1, 6))  # and the local tier goes on
    assert any("local checkpoint of step 4 failed (training goes on)" in r.getMessage() for r in caplog.records)
    assert zarrckpt.all_steps(persistent) == [2, 4]
    assert zarrckpt.all_steps(str(mine)) == [6]
    assert (mine / "0000000004/NOTES.md").read_text() == "not a checkpoint"
