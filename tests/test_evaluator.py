"""An evaluator following a training run: checkpoints_iterator, load_checkpoint, and a
read that loses the race with retention."""

import os
import subprocess
import sys
import threading

import forked_cli
import numpy as np
import pytest
from builders import train_state

import zarrckpt
from zarrckpt import _commit, _storage
from zarrckpt._run import retention as _retention, steps as _steps


def test_checkpoints_iterator_follows_a_training_run(tmp_path):
    run = str(tmp_path)
    zarrckpt.save_checkpoint(run, 1, train_state(1.0))
    zarrckpt.save_checkpoint(run, 2, train_state(2.0))
    seen, values, gone = [], [], []
    writer_may_go = threading.Event()

    def train():
        writer_may_go.wait(10)
        with zarrckpt.CheckpointManager(run, keep_last=2) as mgr:
            for step in (3, 4, 5, 6):
                mgr.save(step, train_state(float(step)))

    trainer = threading.Thread(target=train)
    trainer.start()
    # The timeout only ends a test whose trainer never reaches step 6.
    for step in zarrckpt.checkpoints_iterator(run, timeout_s=60, poll_interval_s=0.05):
        seen.append(step)
        try:
            back = zarrckpt.load_checkpoint(run, step, {"params": train_state()["params"]}, partial=True)
            values.append((step, float(back["params"]["w"][0, 0])))
        except zarrckpt.CheckpointNotFoundError:
            gone.append(step)  # deleted by retention while being read: never a false alarm of damage
        writer_may_go.set()  # after the first read, which nothing can delete yet
        if step == 6:
            break
    trainer.join()
    assert seen[0] == 2  # the newest step at the start, then every later one still there
    assert seen == sorted(set(seen)) and set(seen) <= {2, 3, 4, 5, 6} and seen[-1] == 6
    assert all(step == value for step, value in values)
    # Step 2 was read before training went on, step 6 is never deleted (keep_last=2);
    # a step found gone is one that retention did delete.
    assert {2, 6} <= {step for step, _ in values}, values
    assert not set(gone) & set(zarrckpt.all_steps(run)), (gone, zarrckpt.all_steps(run))


def test_a_poll_of_checkpoints_iterator_reads_only_the_commit_markers_of_steps_newer_than_the_last(
        tmp_path, monkeypatch):
    """An evaluator follows a run that keeps many steps (keep_every): each poll reads
    the markers of the steps after the one it yielded last, not of every step kept (on
    an object store, a request each, every few seconds)."""
    run = str(tmp_path)
    for step in range(1, 41):
        zarrckpt.save_checkpoint(run, step, {"x": np.full(1, step)})
    read, polls = [], []
    head, listing = _commit.head, _steps.candidate_steps
    monkeypatch.setattr(_commit, "head", lambda loc: read.append(loc.url.rsplit("/", 1)[-1]) or head(loc))
    monkeypatch.setattr(_steps, "candidate_steps", lambda root: polls.append(1) or listing(root))
    steps = zarrckpt.checkpoints_iterator(run, timeout_s=0.2, poll_interval_s=0.01)
    assert next(steps) == 40
    assert read == ["0000000040", "0000000040"]  # the newest, then once more before it is yielded
    zarrckpt.save_checkpoint(run, 41, {"x": np.full(1, 41)})
    zarrckpt.save_checkpoint(run, 42, {"x": np.full(1, 42)})
    read.clear()  # the saves' own
    assert next(steps) == 41 and next(steps) == 42
    assert sorted(read) == ["0000000041", "0000000041", "0000000042", "0000000042"], read
    read.clear()
    polls.clear()
    assert list(steps) == []  # nothing newer until the timeout
    assert len(polls) >= 1 and read == [], (len(polls), read)
    # A step being saved (on an object store its marker reads as absent until the
    # commit): its marker is read once a poll, from one listing.
    (tmp_path / "0000000043").mkdir()
    steps = zarrckpt.checkpoints_iterator(run, start_after=42, timeout_s=0.2, poll_interval_s=0.01)
    scans, scan = [], _steps.scan
    monkeypatch.setattr(_steps, "scan", lambda root, **kw: scans.append(1) or scan(root, **kw))
    read.clear()
    polls.clear()
    assert list(steps) == []
    assert len(scans) >= 1 and len(polls) == len(scans) and read == ["0000000043"] * len(scans), (
        len(scans), len(polls), read)


def test_checkpoints_iterator_start_after_and_timeout(tmp_path):
    run = str(tmp_path)
    for step in (1, 2, 3):
        zarrckpt.save_checkpoint(run, step, {"x": np.ones(1)})
    assert list(zarrckpt.checkpoints_iterator(run, start_after=1, timeout_s=0.1, poll_interval_s=0.02)) == [2, 3]
    assert list(zarrckpt.checkpoints_iterator(str(tmp_path / "none"), timeout_s=0.05, poll_interval_s=0.01)) == []
    with pytest.raises(ValueError, match="option poll_interval_s must be positive"):
        next(zarrckpt.checkpoints_iterator(run, poll_interval_s=0))


def test_a_read_that_loses_the_race_with_retention_is_not_found_not_corrupt(tmp_path, monkeypatch):
    run = str(tmp_path)
    zarrckpt.save_checkpoint(run, 1, train_state())
    original = _storage.Location.read_into
    step_dir = _storage.resolve(run).step(1)

    def delete_then_read(self, key, *buffers, **options):
        if key.startswith("params.w/"):  # retention deletes the step, marker first, mid-read
            zarrckpt._commit.remove(step_dir)
        return original(self, key, *buffers, **options)

    monkeypatch.setattr(_storage.Location, "read_into", delete_then_read)
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match="was deleted while it was being read"):
        zarrckpt.load_checkpoint(run, 1, train_state())


def test_an_evaluator_needs_no_manager(tmp_path):
    run = str(tmp_path)
    with zarrckpt.CheckpointManager(run, heartbeat_s=0.05) as mgr:
        mgr.save(1, train_state(4.0))
        mgr.wait()
        # While training holds the directory, readers use the functions.
        assert zarrckpt.latest_step(run) == 1
        back, step = zarrckpt.load_checkpoint_if_it_exists(run, train_state())
        assert step == 1 and float(back["params"]["w"][0, 0]) == 4.0
        # A manager is a writer: an evaluator's, in a process of its own, is refused.
        evaluator = subprocess.run(
            [sys.executable, "-c", "import sys, zarrckpt\ntry:\n    zarrckpt.CheckpointManager(sys.argv[1])\n"
             "except zarrckpt.DirectoryInUseError:\n    print('refused')", run],
            capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
        assert evaluator.stdout.strip() == "refused", evaluator.stderr


def test_verify_of_a_step_retention_deletes_meanwhile_says_it_is_gone_not_damaged(tmp_path, monkeypatch):
    """`zarrckpt verify` beside a job keeping one step: the step's chunks vanish under
    it, which is not damage."""
    run = str(tmp_path)
    zarrckpt.save_checkpoint(run, 1, train_state())
    step_dir = _storage.resolve(run).step(1)
    original = _storage.Location.read

    def delete_then_read(self, key, *args, **options):
        if key.startswith("params.w/") and _commit.head(step_dir).state is _commit.State.COMMITTED:
            _retention.delete(_storage.resolve(run), 1, committed=True, why="kept 1")  # marker first, then all
        return original(self, key, *args, **options)

    monkeypatch.setattr(_storage.Location, "read", delete_then_read)
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match="was deleted while it was being read"):
        zarrckpt.verify(step_dir.url)


def test_metadata_of_a_step_still_being_written_says_it_is_not_committed_not_corrupt(tmp_path, monkeypatch):
    """A save between writing its group's metadata and its last array's: `metadata` and
    `verify` say that the step is not committed and not all there, as `zarrckpt info`
    does, not that it is damaged."""
    run = str(tmp_path)

    def never_commits(*args, **kwargs):
        raise OSError("the save is still running")

    monkeypatch.setattr(_commit, "commit", never_commits)
    with pytest.raises(zarrckpt.CheckpointWriteError):
        zarrckpt.save_checkpoint(run, 1, train_state())
    step_dir = tmp_path / "0000000001"
    (step_dir / "params.w" / "zarr.json").unlink()  # not written yet
    for describe in (zarrckpt.metadata, zarrckpt.verify):
        with pytest.raises(zarrckpt.CheckpointNotFoundError, match="not committed and not all there"):
            describe(str(step_dir))
    cli = forked_cli.run("info", str(step_dir))
    assert cli.returncode == 1 and "not committed and not all there" in cli.stderr, cli.stderr


def test_a_newer_step_committed_after_the_listing_whose_steps_retention_deleted_is_found(tmp_path, monkeypatch):
    """An evaluator lists step N; before it reads step N's marker, the job commits step
    N+1 and its retention (keep one) deletes step N: the newest step is N+1, never
    "nothing committed" (which `load_checkpoint_if_it_exists` takes for a fresh start)."""
    run = str(tmp_path)
    root = _storage.resolve(run)
    zarrckpt.save_checkpoint(run, 1, train_state(1.0))
    listed = _steps.candidate_steps
    racing = []

    def list_then_train_on(where):
        steps = listed(where)
        if racing:  # once per call: the job saves the next step and deletes this one
            step = racing.pop()
            zarrckpt.save_checkpoint(run, step + 1, train_state(float(step + 1)))
            _retention.delete(root, step, committed=True, why="kept 1")
        return steps

    monkeypatch.setattr(_steps, "candidate_steps", list_then_train_on)
    racing.append(1)
    assert zarrckpt.latest_step(run) == 2
    racing.append(2)
    assert zarrckpt.all_steps(run) == [3]
    racing.append(3)
    back, got = zarrckpt.load_checkpoint_if_it_exists(run, train_state())
    assert got == 4 and float(back["params"]["w"][0, 0]) == 4.0


def test_checkpoints_iterator_pointed_at_a_step_says_so(tmp_path):
    zarrckpt.save_checkpoint(str(tmp_path), 1, {"x": np.ones(1)})
    with pytest.raises(zarrckpt.CheckpointLocationError, match="is a checkpoint itself"):
        next(zarrckpt.checkpoints_iterator(str(tmp_path / "0000000001"), timeout_s=5, poll_interval_s=0.01))
