"""Ctrl-C, exit and preemption never lose a save silently: a script (tests/workers/interrupted.py)
whose save's commit is held gets a SIGINT inside `wait`, `save`, `close` and a `with`
block (the commit let go a second after), or exits without closing its manager. The save goes on and commits;
a later call waits for it; no second save runs beside it; the exit waits for it.

A `Thread.join` cut short by KeyboardInterrupt leaves the thread reading as stopped
while it still writes (python/cpython#90882): before the fix, the second `wait` and
`close` returned at once and the script exited with the step uncommitted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import zarrckpt

WORKERS = Path(__file__).parent / "workers"


# Runs the script named next on its command line in a process forked after zarrckpt
# was imported (a pre-forking launcher); exits as it does.
_FORKED = ("import os, runpy, sys, zarrckpt\n"
           "child = os.fork()\n"
           "if child == 0:\n"
           "    sys.argv = sys.argv[1:]\n"
           "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
           "else:\n"
           "    sys.exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))\n")


def run(scenario: str, run_dir: Path, worker: str = "interrupted", forked: bool = False) -> tuple[int, list[str]]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).parent.parent))
    env.pop("XLA_FLAGS", None)
    args = [scenario] if scenario else []
    python = [sys.executable, "-c", _FORKED] if forked else [sys.executable]
    done = subprocess.run([*python, str(WORKERS / f"{worker}.py"), *args, str(run_dir)], env=env,
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout.splitlines()


@pytest.mark.parametrize("where", ["wait", "save", "close"])
def test_ctrl_c_inside_a_call_leaves_the_save_going_on_and_the_next_call_waits_for_it(tmp_path, where):
    code, lines = run(where, tmp_path / "run")
    assert code == 0, lines
    assert f"interrupted {where}" in lines  # the Ctrl-C landed while the save was in flight
    assert any("the save goes on" in line for line in lines)
    events = [line for line in lines if line.split()[0] in ("enter", "leave")]
    steps = [1, 2] if where != "close" else [1]
    assert events == [f"{e} {s}" for s in steps for e in ("enter", "leave")]  # one save at a time, in order
    assert lines.index("leave 1") < lines.index("done")  # the call again waited for it
    assert zarrckpt.all_steps(str(tmp_path / "run")) == steps


def test_ctrl_c_twice_in_a_with_block_leaves_the_save_to_the_exit_which_commits_it(tmp_path):
    code, lines = run("with", tmp_path / "run")
    assert code == 0, lines
    assert lines.index("interrupted with") < lines.index("done") < lines.index("leave 1")
    assert zarrckpt.all_steps(str(tmp_path / "run")) == [1]


@pytest.mark.parametrize("forked", [False, True], ids=["fresh", "forked after the import"])
def test_a_script_that_never_closes_its_manager_commits_its_last_save_at_exit(tmp_path, forked):
    code, lines = run("exit", tmp_path / "run", forked=forked)
    assert code == 0, lines
    assert any(line.startswith("log exiting while") and "0000000001" in line for line in lines)
    assert lines[-1] == "leave 1" and zarrckpt.all_steps(str(tmp_path / "run")) == [1]


def test_sigterm_to_a_one_process_loop_saves_the_next_step_stops_it_and_the_restart_resumes_there(tmp_path):
    """SIGTERM after step 25 of a loop saving every 10 steps: step 26 is saved,
    `reached_preemption(26)` stops the loop, exit 0, nothing lost; the restart resumes
    at 26 and finishes."""
    code, lines = run("", tmp_path / "run", worker="preempted")
    assert code == 0, lines
    assert lines == ["resumed 0", "stopped 26"], lines
    assert zarrckpt.all_steps(str(tmp_path / "run")) == [10, 20, 26]
    code, lines = run("", tmp_path / "run", worker="preempted")
    assert code == 0 and lines == ["resumed 26", "finished"], lines
    assert zarrckpt.all_steps(str(tmp_path / "run")) == [10, 20, 26, 30, 40]


def test_a_background_save_lets_the_state_go_before_it_says_it_is_done(tmp_path):
    """Once a save says it is done, `wait` and `close` return and the program may exit
    at once: the save's thread must hold nothing of the state by then. Before the fix,
    the thread's arguments held the job (and so the state) until after it said so; a
    jax array freed by a daemon thread that the interpreter's exit stops aborted the
    process (`FATAL: exception not rethrown`, exit 134, 3 runs of the quickstart on 8
    devices in 30)."""
    import threading
    import weakref

    import jax.numpy as jnp

    from zarrckpt import _storage
    from zarrckpt._options import SaveOptions
    from zarrckpt._save import BackgroundSave, SaveJob

    state = {"w": jnp.arange(4096.0)}
    loc = _storage.resolve(str(tmp_path / "ckpt"))
    job = SaveJob.create(loc, state, SaveOptions())
    seen: list[tuple[str, bool]] = []
    save = BackgroundSave(job, "zarrckpt-save-test", on_commit=lambda: None, on_failure=lambda e: None)
    weakref.finalize(state["w"], lambda: seen.append((threading.current_thread().name, save.done)))
    del job, state
    save.start()
    assert save.join(60)
    assert seen == [("zarrckpt-save-test", False)]  # freed by the save's thread, before it was done


@pytest.mark.parametrize(("where", "async_save"), [
    ("comparing", True),  # planning: the fingerprints of the leaves reuse compares, before the save starts
    ("copying", True),  # dispatching the copies off the devices: the snapshot is not whole
    ("writing", False),  # a save run on the calling thread
])
def test_ctrl_c_that_stops_a_save_says_the_step_is_lost_and_the_step_saves_again(tmp_path, caplog, monkeypatch,
                                                                                    where, async_save):
    """A Ctrl-C that lands in `save` before the save is under way on its own thread stops
    that save: the log says which step was not saved (its traceback alone does not),
    nothing of it is committed, and saving the same step again saves it."""
    import jax.numpy as jnp

    from zarrckpt._run import lineage as _lineage
    from zarrckpt._save import protocol, transfer

    owner, name = {"comparing": (_lineage.Lineage, "mark"), "copying": (transfer, "start"),
                   "writing": (protocol, "_write_all")}[where]
    original = getattr(owner, name)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    state = {"w": jnp.arange(4096.0), "frozen": jnp.ones(4096)}
    run = str(tmp_path / "run")
    with zarrckpt.CheckpointManager(run, async_save=async_save) as mgr:
        assert mgr.save(1, state)
        monkeypatch.setattr(owner, name, interrupted)
        with caplog.at_level("WARNING", logger="zarrckpt"), pytest.raises(KeyboardInterrupt):
            mgr.save(2, {**state, "w": state["w"] + 1})
        monkeypatch.setattr(owner, name, original)
        lost = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(lost) == 1 and "0000000002" in lost[0] and "KeyboardInterrupt" in lost[0], lost
        mgr.wait()  # no error left behind for the next call
        assert zarrckpt.all_steps(run) == [1]
        assert mgr.save(2, {**state, "w": state["w"] + 1})
    assert zarrckpt.all_steps(run) == [1, 2]
    restored = zarrckpt.load_checkpoint(run, 2)
    assert (restored["w"] == jnp.arange(4096.0) + 1).all() and (restored["frozen"] == 1).all()


def test_ctrl_c_in_the_retention_after_a_commit_does_not_say_the_step_is_lost(tmp_path, caplog, monkeypatch):
    """With `async_save=False` the retention a commit triggers runs in `save`: a Ctrl-C
    there stops it, but the step has committed, and no warning says it was not saved."""
    from zarrckpt._run import retention as _retention

    apply = _retention.apply

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    run = str(tmp_path / "run")
    with zarrckpt.CheckpointManager(run, async_save=False, keep_last=1) as mgr:
        assert mgr.save(1, {"a": 1})
        monkeypatch.setattr(_retention, "apply", interrupted)
        with caplog.at_level("WARNING", logger="zarrckpt"), pytest.raises(KeyboardInterrupt):
            mgr.save(2, {"a": 2})
        monkeypatch.setattr(_retention, "apply", apply)
        assert not [r for r in caplog.records if "not saved" in r.getMessage()]
        assert 2 in zarrckpt.all_steps(run) and not mgr.save(2, {"a": 2})  # committed: not saved again


def test_ctrl_c_while_a_local_copy_is_made_names_that_copy(tmp_path, caplog, monkeypatch):
    """A step due only in the local tier: a Ctrl-C while its copy is made names the copy
    lost, not the persistent step (never due)."""
    from zarrckpt._tier import tier as _tiers

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    run, local = str(tmp_path / "run"), str(tmp_path / "local")
    with zarrckpt.CheckpointManager(run, save_interval_steps=10, local_directory=local,
                                    local_save_interval_steps=1) as mgr:
        monkeypatch.setattr(_tiers.LocalTier, "save", interrupted)
        with caplog.at_level("WARNING", logger="zarrckpt"), pytest.raises(KeyboardInterrupt):
            mgr.save(3, {"a": 3})
    lost = [r.getMessage() for r in caplog.records if "not saved" in r.getMessage()]
    assert len(lost) == 1 and "local copy of step 3" in lost[0] and "0000000003" not in lost[0], lost


def test_ctrl_c_while_the_manager_takes_its_lease_gives_it_back(tmp_path, monkeypatch):
    """A Ctrl-C that lands once the lease is taken but before the constructor returns
    (a notebook's interrupt) leaves no manager to close: the lease is given back, and
    the directory opens again at once, here and in another process."""
    from zarrckpt._run import lease as _lease

    take = _lease.Lease._take

    def taken_then_interrupted(self, number):
        take(self, number)
        raise KeyboardInterrupt

    run = str(tmp_path / "run")
    monkeypatch.setattr(_lease.Lease, "_take", taken_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        zarrckpt.CheckpointManager(run)
    monkeypatch.setattr(_lease.Lease, "_take", take)
    with zarrckpt.CheckpointManager(run) as mgr:
        assert mgr.save(1, {"a": 1})
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    other = subprocess.run([sys.executable, "-c", "import sys, zarrckpt\nwith zarrckpt.CheckpointManager(sys.argv[1]) "
                            "as mgr: mgr.save(2, {'a': 2})", run], env=env, capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr
    assert zarrckpt.all_steps(run) == [1, 2]


# `_concurrency` alone (it imports nothing of zarrckpt's, and so no JAX: a second to start,
# not three), in a process where no thread can start, as at the interpreter's exit.
_NO_THREAD_CAN_START = """
import concurrent.futures, importlib.util, sys
spec = importlib.util.spec_from_file_location("_concurrency", sys.argv[1])
_concurrency = sys.modules["_concurrency"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(_concurrency)

def no_thread(self):
    raise RuntimeError("can't create new thread at interpreter shutdown")

concurrent.futures.ThreadPoolExecutor._adjust_thread_count = no_thread
"""


def _where_no_thread_can_start(script: str) -> str:
    """The last line `script` prints, run after `_NO_THREAD_CAN_START`. In a process of its
    own: a deadlock there holds a lock every executor of the process needs."""
    ran = subprocess.run([sys.executable, "-c", _NO_THREAD_CAN_START + script, zarrckpt._util.concurrency.__file__],
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    return ran.stdout.split("\n")[-2]


def test_an_operation_started_by_an_item_where_no_thread_can_start_runs_and_leaves_the_items_operation():
    """At the interpreter's exit no thread can start, and an operation runs its items on
    the thread that submits them (`_concurrency._Pool`). An item that starts an
    operation of its own (a write reading several small objects) must neither wait for
    ever on the executors' shared lock (it did: the item ran inside `submit`, which
    holds it) nor take its own operation away from itself (its writes would no longer
    see that the operation failed: `aborted`); the inner operation's items, part of
    the failed item, see it too."""
    assert _where_no_thread_can_start("""
seen = []

def outer_item():
    outer.fail(OSError("another write of the outer operation failed"))
    seen.append(_concurrency.run_all(lambda i: (i, _concurrency.aborted()), [1, 2], 2, "inner"))
    seen.append(_concurrency.aborted())

with _concurrency.Operation(2, "outer") as outer:
    outer.submit(outer_item).exception()
print(seen)
""") == "[[(1, True), (2, True)], True]"


def test_a_fan_out_that_may_add_workers_where_no_thread_can_start_runs_every_item_on_the_calling_thread():
    """A fan-out that starts with one worker and meets items of a MiB or more, which add
    workers, where no thread can start: its items run on the thread that submits its
    worker (`_concurrency._Pool`), which adds none (each would nest inside the last)
    and waits for no lock it holds."""
    assert _where_no_thread_can_start("""
with _concurrency.Operation(4, "write") as op:
    print(op.fan_out(range(8), lambda i: i * i, nbytes=lambda i: _concurrency._RAMP_BYTES, start=1))
""") == str([i * i for i in range(8)])
