"""A training script interrupted as a person interrupts one: `SCENARIO RUN_DIR`.

The commit of every save is held until `RELEASE_S` after the script starts (a stand-in
for a slow store), so that a Ctrl-C (SIGINT, sent by a timer) lands while a save is
surely in flight. Prints one line per event: `interrupted <where>`, `enter <step>` and
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

RELEASE_S = 1.5
scenario, run_dir = sys.argv[1:3]
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="log %(message)s")
started = time.monotonic()
release = threading.Event()
commit = _commit.commit


def held_commit(loc, document):
    step = int(loc.url.rstrip("/").rsplit("/", 1)[-1])
    print(f"enter {step}", flush=True)
    release.wait()
    commit(loc, document)
    print(f"leave {step}", flush=True)


_commit.commit = held_commit


def later(seconds: float, action) -> None:
    """`action` after `seconds` from the start, on a daemon thread: nothing waits for it."""
    threading.Thread(target=lambda: (time.sleep(max(0.0, started + seconds - time.monotonic())), action()),
                     daemon=True).start()


def ctrl_c_at(seconds: float) -> None:
    later(seconds, lambda: os.kill(os.getpid(), signal.SIGINT))


def state(step: int) -> dict:
    return {"w": np.full((64, 64), step, np.float32), "step": step}


later(RELEASE_S, release.set)
mgr = zarrckpt.CheckpointManager(run_dir)
mgr.save(1, state(1))
calls = {"wait": mgr.wait, "save": lambda: mgr.save(2, state(2)), "close": mgr.close}
if scenario in calls:  # Ctrl-C in the call (save(2) waits for save 1), then the call again: it waits
    ctrl_c_at(0.5)
    try:
        calls[scenario]()
    except KeyboardInterrupt:
        print(f"interrupted {scenario}", flush=True)
    calls[scenario]()
    if scenario == "wait":  # the next save follows the first
        mgr.save(2, state(2))
    mgr.close()
elif scenario == "with":  # Ctrl-C in a with block's body, then again while leaving it: the exit waits
    ctrl_c_at(0.5)
    ctrl_c_at(0.9)
    try:
        with mgr:
            time.sleep(10)
    except KeyboardInterrupt:
        print("interrupted with", flush=True)
elif scenario == "exit":  # never closed
    pass
print("done", flush=True)
