"""A one-process training loop that forks children (tests/reliability/test_forks.py):

    python forked_children.py SCENARIO RUN_DIR

  process   after `reached_preemption`, a fork-started multiprocessing worker, then its
            `terminate()`: prints `worker exit <exitcode>`
  pool      after `reached_preemption`, a fork-started `Pool` of two busy with tasks,
            then its `terminate()`: prints `pool terminated`
  daemon    the README's loop, which starts a daemon evaluator (fork) after its first
            `reached_preemption`: prints `loop done`, and multiprocessing's exit hook
            terminates the evaluator and joins it
  os-fork   in a `with` block of a manager that saved step 1, an `os.fork` child leaves
            the block and exits (its exit hooks and finalizers run); the parent
            then asks another process to open a manager on RUN_DIR, and saves step 2:
            prints `child exit <code>`, `other <what it got>`, `saved 2`
  os-fork-save  the same, the child first saving step 2 (zeros) with the parent's
            manager: prints `child saved` or `child refused: <the error>` too

A child that does not end hangs the script: the test kills its process group.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import subprocess
import sys

import numpy as np

import zarrckpt

scenario, run_dir = sys.argv[1:]
fork = multiprocessing.get_context("fork")
state = {"w": np.arange(4, dtype=np.float32)}


def wait_for_work(ready, stop) -> None:
    """A worker that waits for work that never comes (a data loader, an evaluator)."""
    ready.set()
    stop.wait()


def started_worker(**kwargs) -> multiprocessing.Process:
    """A fork-started worker, running once this returns (a SIGTERM sent at its fork
    could come before the child is set up as Python forks it, and is then lost)."""
    ready, stop = fork.Event(), fork.Event()
    worker = fork.Process(target=wait_for_work, args=(ready, stop), **kwargs)
    worker.start()
    ready.wait()
    return worker


def work_forever(_: int) -> None:
    busy.release()
    stop.wait()


OTHER = """
import sys, zarrckpt
try:
    zarrckpt.CheckpointManager(sys.argv[1]).close()
    print("took it over")
except zarrckpt.DirectoryInUseError as e:
    print("refused:", e)
"""

if scenario == "process":
    with zarrckpt.CheckpointManager(run_dir) as mgr:
        mgr.save(1, state)
        assert not mgr.reached_preemption(1)
        worker = started_worker()
        worker.terminate()
        worker.join()
        print(f"worker exit {worker.exitcode}", flush=True)
elif scenario == "pool":
    with zarrckpt.CheckpointManager(run_dir) as mgr:
        mgr.save(1, state)
        assert not mgr.reached_preemption(1)
        # Inherited by the pool's workers (a task cannot take them as arguments).
        busy, stop = fork.Semaphore(0), fork.Event()
        pool = fork.Pool(2)
        pool.map_async(work_forever, range(2), chunksize=1)
        for _ in range(2):  # each worker busy with a task (an idle one ends at the pool's sentinel anyway)
            busy.acquire()
        pool.terminate()
        print("pool terminated", flush=True)
elif scenario == "daemon":
    evaluator = None
    with zarrckpt.CheckpointManager(run_dir) as mgr:
        for step in range(1, 4):
            state = {"w": state["w"] + 1}
            mgr.save(step, state)
            if mgr.reached_preemption(step):
                break
            if evaluator is None:
                evaluator = started_worker(daemon=True)
    print("loop done", flush=True)
elif scenario in ("os-fork", "os-fork-save"):
    with zarrckpt.CheckpointManager(run_dir, heartbeat_s=30) as mgr:
        mgr.save(1, state)
        mgr.wait()
        child = os.fork()
        if child == 0:
            if scenario == "os-fork-save":
                try:
                    mgr.save(2, {"w": np.zeros(4, np.float32)})
                    mgr.wait()
                    print("child saved", flush=True)
                except RuntimeError as e:
                    print(f"child refused: {e}", flush=True)
        else:
            print(f"child exit {os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])}", flush=True)
            other = subprocess.run([sys.executable, "-c", OTHER, run_dir], capture_output=True, text=True)
            print(f"other {other.stdout.strip() or other.stderr}", flush=True)
            mgr.save(2, state)
    if child == 0:
        # The exit hooks (the finalizers' among them), as a normal exit runs them; not the
        # interpreter's teardown after, where JAX's runtime, forked without its threads,
        # can hang (JAX warns at the fork).
        atexit._run_exitfuncs()
        os._exit(0)
    print("saved 2", flush=True)
else:
    raise SystemExit(f"unknown scenario {scenario!r}")
