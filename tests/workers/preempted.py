"""A one-process training loop sent SIGTERM (as a scheduler's preemption notice) by
itself after saving step `NOTICE_AFTER`, on its first run: `RUN_DIR`. Prints `resumed
<step>` and `stopped <step>` or `finished`."""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

import zarrckpt

NOTICE_AFTER = 25
run_dir = sys.argv[1]
with zarrckpt.CheckpointManager(run_dir, save_interval_steps=10) as mgr:
    state, start = mgr.restore({"w": np.zeros(4, np.float32), "step": 0})
    print(f"resumed {start}", flush=True)
    for step in range(start + 1, 41):
        state = {"w": state["w"] + 1, "step": step}
        mgr.save(step, state)
        if step == NOTICE_AFTER and start == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        if mgr.reached_preemption(step):
            print(f"stopped {step}", flush=True)
            break
    else:
        print("finished", flush=True)
