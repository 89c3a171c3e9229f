"""A job that holds a run, saves step 1, then saves a second step through a proxy that
may stop it mid-save: `python paused_holder.py RUN OUT STEP KEEP_LAST`.

It saves with one write at a time (so that a stop mid-save leaves most of the step
unwritten), a heartbeat of 0.5 s, and values of its own (each leaf full of 100 + the
step). OUT gets, as JSON, the second save's outcome: "committed", or "failed" with
the error's type and message. Storage options come as JSON in
ZARRCKPT_TEST_STORAGE_OPTIONS.
"""

import json
import os
import sys

import numpy as np

import zarrckpt

run, out, step, keep_last = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
options = json.loads(os.environ["ZARRCKPT_TEST_STORAGE_OPTIONS"])


def tree(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full((64, 64), value, np.float32), "b": np.full(5, value)}


mgr = zarrckpt.CheckpointManager(run, storage_options=options, heartbeat_s=0.5, async_save=False, max_workers=1,
                                 max_chunk_bytes=1024, keep_last=keep_last)
mgr.save(1, tree(101.0))
print("saved 1", flush=True)
try:
    mgr.save(step, tree(100.0 + step))
    outcome = {"outcome": "committed"}
except Exception as e:
    outcome = {"outcome": "failed", "error": type(e).__name__, "message": str(e)}
try:
    mgr.close()
except Exception as e:  # the save's error, said above
    outcome.setdefault("close", f"{type(e).__name__}: {e}")
with open(out, "w") as f:
    json.dump(outcome, f)
