"""One of two jobs that open a CheckpointManager on one run at the same moment, round
after round: `python lease_race.py RUN ROUNDS BARRIER NAME OUT HEARTBEAT_S STALL_S`.

Each round both jobs pass a barrier of files, then open a manager; the one that gets
it saves step (round + 1) with values of its own, and closes only once the other has
tried. With STALL_S, every step of taking the lease (looking for the newest lease,
reading it, creating the next) first waits a random time up to STALL_S, as on a slow
NFS or a paused VM; renewals, on their own thread, are not stalled. OUT gets, as
JSON, each round's outcome ("ok" or "refused") and what was saved. Storage options
come as JSON in ZARRCKPT_TEST_STORAGE_OPTIONS.
"""

import json
import os
import random
import sys
import threading
import time

import numpy as np

import zarrckpt
from zarrckpt._run import lease as _lease

run, rounds, barrier, name, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
heartbeat_s, stall_s = float(sys.argv[6]), float(sys.argv[7])
options = json.loads(os.environ.get("ZARRCKPT_TEST_STORAGE_OPTIONS") or "null")
rng = random.Random(name)


def stalled(method):
    def call(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            time.sleep(rng.uniform(0, stall_s))
        return method(*args, **kwargs)
    return call


if stall_s:
    for method in ("_newest", "_read", "_take"):
        setattr(_lease.Lease, method, stalled(getattr(_lease.Lease, method)))


def meet(point: str) -> None:
    open(os.path.join(barrier, f"{point}.{name}"), "w").close()
    deadline = time.monotonic() + 120
    while not all(os.path.exists(os.path.join(barrier, f"{point}.{who}")) for who in ("a", "b")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the other job never reached {point}")
        time.sleep(0.001)


outcomes = []
for r in range(rounds):
    meet(f"start{r}")
    try:
        mgr = zarrckpt.CheckpointManager(run, storage_options=options, heartbeat_s=heartbeat_s)
    except zarrckpt.DirectoryInUseError:
        outcomes.append({"outcome": "refused"})
        meet(f"tried{r}")
    else:
        meet(f"tried{r}")
        value = float(r * 10 + (1 if name == "a" else 2))
        mgr.save(r + 1, {"w": np.full(256, value)}, force=True)
        mgr.close()
        outcomes.append({"outcome": "ok", "value": value})
    meet(f"end{r}")
with open(out, "w") as f:
    json.dump(outcomes, f)
