"""A training script interrupted as a person interrupts one: `SCENARIO RUN_DIR`.

The commit of step 1 is held (a stand-in for a slow store), so that a Ctrl-C (SIGINT)
surely lands while the save is in flight: sent once the commit is reached and the main
thread is in the call under test, and the commit let go a second after the interrupt
was caught. Prints one line per event: `interrupted <where>`, `enter <step>` and
`leave <step>` around each commit, `done`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import numpy as np

import zarrckpt
from zarrckpt import _commit

scenario, run_dir = sys.argv[1:3]
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="log %(message)s")
in_call = threading.Event()  # the main thread is about to block in the call under test
release = threading.Event()
commit = _commit.commit


def after(seconds: float, action) -> None:
    """`action` after `seconds`, on a daemon thread: nothing waits for it."""
    threading.Thread(target=lambda: (time.sleep(seconds), action()), daemon=True).start()


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def held_commit(loc, document):
    step = int(loc.url.rstrip("/").rsplit("/", 1)[-1])
    print(f"enter {step}", flush=True)
    if step == 1:
        if scenario != "exit":
            in_call.wait()
            after(0.3, ctrl_c)
        release.wait()
    commit(loc, document)
    print(f"leave {step}", flush=True)


class SecondCtrlC(logging.Handler):
    """Ctrl-C again once the manager says it waits before leaving the `with` block."""

    def emit(self, record: logging.LogRecord) -> None:
        if "before leaving" in record.getMessage():
            after(0.3, ctrl_c)


_commit.commit = held_commit
# A script run from a terminal takes Ctrl-C, whatever the process that started this one
# ignores (a background job of a shell without job control ignores SIGINT).
signal.signal(signal.SIGINT, signal.default_int_handler)


def state(step: int) -> dict:
    return {"w": np.full((64, 64), step, np.float32), "step": step}


mgr = zarrckpt.CheckpointManager(run_dir)
if scenario == "exit":  # let go once the script has ended (no thread can be started then)
    after(1.0, release.set)
mgr.save(1, state(1))
calls = {"wait": mgr.wait, "save": lambda: mgr.save(2, state(2)), "close": mgr.close}
if scenario in calls:  # Ctrl-C in the call (save(2) waits for save 1), then the call again: it waits
    try:
        in_call.set()
        calls[scenario]()
    except KeyboardInterrupt:
        print(f"interrupted {scenario}", flush=True)
        after(1.0, release.set)
    calls[scenario]()
    if scenario == "wait":  # the next save follows the first
        mgr.save(2, state(2))
    mgr.close()
elif scenario == "with":  # Ctrl-C in a with block's body, then again while leaving it: the exit waits
    logging.getLogger("zarrckpt").addHandler(SecondCtrlC())
    try:
        with mgr:
            in_call.set()
            time.sleep(30)
    except KeyboardInterrupt:
        print("interrupted with", flush=True)
        after(1.0, release.set)
print("done", flush=True)
