"""An evaluator following a training run: checkpoints_iterator, load_checkpoint, and a
read that loses the race with retention."""

import threading

import numpy as np
import pytest
from builders import train_state

import zarrckpt
from zarrckpt import _storage


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
        with pytest.raises(zarrckpt.DirectoryInUseError):
            zarrckpt.CheckpointManager(run, heartbeat_s=0.05)
