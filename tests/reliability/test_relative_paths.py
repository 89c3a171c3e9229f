"""A relative path names the directory it names when the call is made: two jobs in one
process, each in a directory of its own with `os.chdir` between them (a Hydra sweep, a
notebook's `%cd`), each writing "checkpoints" or "ck", never see each other's runs.
Before the fix, a cache keyed by the relative spelling sent job B to job A's directory:
B resumed from A's step, `save_pytree` said a checkpoint existed, `load_pytree` returned
A's arrays."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import zarrckpt
from zarrckpt import _cli


@pytest.fixture
def two_jobs(tmp_path, monkeypatch):
    """Two job directories, `a` and `b`; the test starts in `a`."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    return tmp_path / "a", tmp_path / "b"


def test_a_manager_on_a_relative_path_after_chdir_starts_a_run_of_its_own(two_jobs):
    a, b = two_jobs
    with zarrckpt.CheckpointManager("checkpoints") as mgr:
        assert mgr.save(1, {"w": np.ones(3)})
    os.chdir(b)
    with zarrckpt.CheckpointManager("checkpoints") as mgr:
        assert mgr.latest_step() is None
        assert mgr.save(2, {"w": np.zeros(3)})
    assert zarrckpt.all_steps(str(a / "checkpoints")) == [1]
    assert zarrckpt.all_steps(str(b / "checkpoints")) == [2]


def test_save_and_load_pytree_on_a_relative_path_after_chdir_use_this_directory(two_jobs):
    a, b = two_jobs
    zarrckpt.save_pytree("ck", {"w": np.ones(3)})
    os.chdir(b)
    zarrckpt.save_pytree("ck", {"w": np.zeros(3)})  # no checkpoint here: no CheckpointExistsError
    np.testing.assert_array_equal(zarrckpt.load_pytree("ck")["w"], np.zeros(3))
    os.chdir(a)
    np.testing.assert_array_equal(zarrckpt.load_pytree("ck")["w"], np.ones(3))


def test_the_cli_on_a_relative_path_after_chdir_lists_this_directory(two_jobs, capsys):
    a, b = two_jobs
    with zarrckpt.CheckpointManager("checkpoints") as mgr:
        mgr.save(1, {"w": np.ones(3)})
    assert _cli.main(["ls", "--json", "checkpoints"]) == 0
    assert [row["step"] for row in json.loads(capsys.readouterr().out)] == [1]
    os.chdir(b)
    Path("checkpoints").mkdir()
    assert _cli.main(["ls", "--json", "checkpoints"]) == 0
    assert json.loads(capsys.readouterr().out) == []
