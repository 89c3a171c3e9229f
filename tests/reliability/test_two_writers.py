"""A second job writing into the same checkpoint directory is refused, not interleaved."""

import json
import os

import numpy as np
import pytest

import zarrckpt
from zarrckpt import _lease

BEAT = 0.1


def test_second_live_manager_is_refused(tmp_path):
    with zarrckpt.CheckpointManager(str(tmp_path), heartbeat_s=BEAT) as first:
        first.save(1, {"a": np.ones(2)}, force=True)
        in_use = f"in this process \\(pid {os.getpid()}\\) that is still open"
        with pytest.raises(zarrckpt.DirectoryInUseError, match=in_use):
            zarrckpt.CheckpointManager(str(tmp_path), heartbeat_s=BEAT)
        first.save(2, {"a": np.ones(2)}, force=True)
    assert zarrckpt.all_steps(str(tmp_path)) == [1, 2]
    assert not (tmp_path / _lease.LEASE_FILE).exists()  # released on close


def test_lease_of_a_dead_job_is_taken_over(tmp_path):
    # What a killed job leaves behind: a lease nobody renews.
    (tmp_path / _lease.LEASE_FILE).write_text(json.dumps({"owner": "dead", "host": "h", "pid": 1, "beat": 7}))
    with zarrckpt.CheckpointManager(str(tmp_path), heartbeat_s=BEAT) as mgr:
        assert mgr.save(1, {"a": np.ones(2)}, force=True)


def test_a_manager_whose_lease_was_taken_stops_saving(tmp_path):
    mgr = zarrckpt.CheckpointManager(str(tmp_path), heartbeat_s=BEAT, async_save=False)
    (tmp_path / _lease.LEASE_FILE).write_text(json.dumps({"owner": "other", "host": "h", "pid": 2, "beat": 1}))
    with pytest.raises(zarrckpt.DirectoryInUseError, match="was taken over by another CheckpointManager"):
        mgr.save(1, {"a": np.ones(2)}, force=True)
    assert zarrckpt.all_steps(str(tmp_path)) == []
    mgr.close()


def test_lease_of_a_killed_job_on_this_machine_is_taken_over_at_once(tmp_path):
    """A job restarted in place after a crash does not wait: the lease's writer ran here,
    in this PID namespace, and its process is gone."""
    import subprocess
    import sys
    import time

    dead = subprocess.run([sys.executable, "-c", "import os, sys, zarrckpt; mgr = zarrckpt.CheckpointManager("
                           "sys.argv[1], heartbeat_s=60); os._exit(0)", str(tmp_path)],
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert dead.returncode == 0 and (tmp_path / _lease.LEASE_FILE).exists()  # left behind, never released
    started = time.monotonic()
    with zarrckpt.CheckpointManager(str(tmp_path), heartbeat_s=60):
        assert time.monotonic() - started < 5  # no watching for 2.5 heartbeats of 60 s
