"""A process to SIGKILL at a random moment: `saves DIR START ATTEMPT` or `manager DIR
ATTEMPT`.

Each step's state holds `common.distinct_values` of its step and of the attempt (the
test's count of launches), so a restore shows which step, and which attempt at it, it
read, and a chunk in the wrong place shows too. Says `ready` once imports are done,
then `committed N` after each commit (see common.say).
"""

from __future__ import annotations

import sys

from common import distinct_values, init, say

args = init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import zarrckpt  # noqa: E402

SHAPE = (256, 1024)  # 1 MiB per leaf (uint32)


def state(step: int, attempt: int) -> dict:
    mesh = Mesh(np.array(jax.devices()).reshape(jax.process_count(), -1), ("p", "d"))

    def leaf(i: int) -> jax.Array:
        host = distinct_values(i, step, attempt, SHAPE)
        return jax.make_array_from_callback(SHAPE, NamedSharding(mesh, P(None, "d") if i % 2 else P()),
                                            lambda index: host[index])

    return {f"leaf{i}": leaf(i) for i in range(6)}


def saves(directory: str, start: str, attempt: str) -> None:
    say("ready")
    for step in range(int(start), 10**6):
        # Small chunks: many writes per save, so a kill lands mid-write most of the time.
        zarrckpt.save_checkpoint(directory, step, state(step, int(attempt)), max_chunk_bytes=64 * 1024, timeout_s=10)
        say(f"committed {step}")


def manager(directory: str, attempt: str) -> None:
    with zarrckpt.CheckpointManager(directory, keep_last=1, heartbeat_s=0.2, timeout_s=10) as mgr:
        _, step = mgr.restore(state(0, int(attempt)))
        say("ready")
        while True:
            step += 1
            mgr.save(step, state(step, int(attempt)), force=True)
            mgr.wait()
            say(f"committed {step}")


{"saves": saves, "manager": manager}[args[0]](*args[1:])
sys.exit(0)
