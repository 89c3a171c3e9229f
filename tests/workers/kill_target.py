"""A process to SIGKILL at a random moment: `saves DIR START` or `manager DIR`.

Each step's state is filled with the step number, so a restore shows which step it is.
Says `ready` once imports are done, then `committed N` after each commit (see common.say).
"""

from __future__ import annotations

import sys

from common import init, say

args = init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import zarrckpt  # noqa: E402

SHAPE = (256, 1024)  # 1 MiB per leaf in float32


def state(step: int) -> dict:
    mesh = Mesh(np.array(jax.devices()).reshape(jax.process_count(), -1), ("p", "d"))
    host = np.full(SHAPE, step, np.float32)
    return {f"leaf{i}": jax.make_array_from_callback(SHAPE, NamedSharding(mesh, P(None, "d") if i % 2 else P()),
                                                     lambda index: host[index]) for i in range(6)}


def saves(directory: str, start: str) -> None:
    say("ready")
    for step in range(int(start), 10**6):
        # Small chunks: many writes per save, so a kill lands mid-write most of the time.
        zarrckpt.save_checkpoint(directory, step, state(step), max_chunk_bytes=64 * 1024, timeout_s=10)
        say(f"committed {step}")


def manager(directory: str) -> None:
    with zarrckpt.CheckpointManager(directory, keep_last=1, heartbeat_s=0.2, timeout_s=10) as mgr:
        _, step = mgr.restore(state(0))
        say("ready")
        while True:
            step += 1
            mgr.save(step, state(step), force=True)
            mgr.wait()
            say(f"committed {step}")


{"saves": saves, "manager": manager}[args[0]](*args[1:])
sys.exit(0)
