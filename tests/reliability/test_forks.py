"""A forked child does nothing on its parent's behalf: it ends at SIGTERM though its
parent listens for one, it never gives back its parent's lease, and it cannot save
with its parent's manager. Each case is a one-process loop (tests/workers/
forked_children.py) that forks as training programs do: multiprocessing's `fork`
start method (a data loader, an evaluator, a `Pool`), and `os.fork`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import zarrckpt

WORKER = Path(__file__).parent.parent / "workers" / "forked_children.py"
HANG_S = 120  # far beyond what a scenario takes: only a child that never ends reaches it


def run(scenario: str, run_dir: Path) -> tuple[int, list[str]]:
    """Runs the scenario in a session of its own; one that hangs is killed with every
    child it forked, and fails the test."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).parent.parent.parent))
    env.pop("XLA_FLAGS", None)
    script = subprocess.Popen([sys.executable, str(WORKER), scenario, str(run_dir)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = script.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(script.pid, signal.SIGKILL)
        out, _ = script.communicate()
        pytest.fail(f"{scenario}: still running after {HANG_S}s (a child that does not end), killed:\n{out}")
    return script.returncode, out.splitlines()


def test_a_fork_started_worker_ends_at_terminate_after_the_loop_asked_reached_preemption(tmp_path):
    code, lines = run("process", tmp_path / "run")
    assert code == 0, lines
    assert f"worker exit {-signal.SIGTERM}" in lines


def test_a_fork_started_pool_terminates_after_the_loop_asked_reached_preemption(tmp_path):
    code, lines = run("pool", tmp_path / "run")
    assert code == 0, lines
    assert "pool terminated" in lines


def test_the_readme_loop_with_a_daemon_worker_forked_after_reached_preemption_exits(tmp_path):
    """multiprocessing's exit hook SIGTERMs daemon children and joins them."""
    code, lines = run("daemon", tmp_path / "run")
    assert code == 0, lines
    assert "loop done" in lines
    assert zarrckpt.all_steps(str(tmp_path / "run")) == [1, 2, 3]


def test_an_os_fork_child_s_normal_exit_leaves_the_parents_lease_held(tmp_path):
    """The child leaves the parent's `with` block and exits normally; another job is
    still refused while the parent lives, and the parent saves on."""
    code, lines = run("os-fork", tmp_path / "run")
    assert "child exit 0" in lines, lines
    other = next((line for line in lines if line.startswith("other ")), "")
    assert other.startswith("other refused:") and "still alive" in other, lines
    assert code == 0, lines
    assert "saved 2" in lines
    assert zarrckpt.all_steps(str(tmp_path / "run")) == [1, 2]


def test_a_manager_used_in_an_os_fork_child_refuses_naming_its_directory_and_parent(tmp_path):
    run_dir = tmp_path / "run"
    code, lines = run("os-fork-save", run_dir)
    refused = next((line for line in lines if line.startswith("child ")), "")
    assert refused.startswith("child refused:") and str(run_dir) in refused and "forked" in refused, lines
    assert code == 0, lines
    assert "saved 2" in lines
    np.testing.assert_array_equal(zarrckpt.load_checkpoint(str(run_dir), 2)["w"], np.arange(4))
