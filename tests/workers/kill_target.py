"""A process to SIGKILL at a random moment: `saves DIR START ATTEMPT` or `manager DIR
ATTEMPT`; or at a chosen one, inside a save that makes unchanged chunks from the step
before: `linking DIR GO` (and `relink DIR STEP`, which saves that step again after it).

Each step's state holds `common.distinct_values` of its step and of the attempt (the
test's count of launches), so a restore shows which step, and which attempt at it, it
read, and a chunk in the wrong place shows too. Says `ready` once imports are done,
then `committed N` after each commit (see common.say).
"""

from __future__ import annotations

import sys
import threading

from common import STORAGE_OPTIONS, distinct_values, init, report, restore_target, say

args = init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import zarrckpt  # noqa: E402
from zarrckpt import _storage  # noqa: E402

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


# A LoRA-shaped state for `linking` and `relink`: a frozen base (the same array at every
# step, so that each save makes its chunks from the step before), in 64 chunks, and an
# adapter that changes at every step. At most 4 writers: the save pauses with most of
# the base's chunks still to make.
BASE_SHAPE, ADAPTER_SHAPE, CHUNK = (1024, 1024), (64, 1024), 64 * 1024
LORA_OPTIONS = {"max_chunk_bytes": CHUNK, "min_chunk_bytes": CHUNK, "max_workers": 4, "heartbeat_s": 0.5,
                "storage_options": STORAGE_OPTIONS}


def lora(step: int, attempt: int, base: jax.Array | None = None) -> dict:
    fsdp = NamedSharding(Mesh(np.array(jax.devices()), ("fsdp",)), P("fsdp"))

    def put(host: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(host.shape, fsdp, lambda index: host[index])

    return {"base": put(distinct_values(0, 0, 0, BASE_SHAPE)) if base is None else base,
            "adapter": put(distinct_values(1, step, attempt, ADAPTER_SHAPE)), "step": step}


def linking(directory: str, go: str) -> None:
    """Saves steps 1 and 2 (attempt 0), then waits for a line on the pipe `go`, then
    saves step 3, whose base is made from step 2's chunks: each copy of a chunk
    (`Location.copy_new`) says `linked` once made, and never returns."""
    with zarrckpt.CheckpointManager(directory, **LORA_OPTIONS) as mgr:
        say("ready")
        state = lora(1, 0)
        for step in (1, 2):
            state = lora(step, 0, state["base"])
            mgr.save(step, state)
            mgr.wait()
            say(f"committed {step}")
        with open(go) as pipe:
            pipe.readline()
        made = _storage.Location.copy_new

        def paused(self, key, source, **kwargs):
            made(self, key, source, **kwargs)
            say("linked")
            threading.Event().wait()  # until the kill

        _storage.Location.copy_new = paused
        mgr.save(3, lora(3, 0, state["base"]))
        mgr.wait()
    raise AssertionError("the save of step 3 made no chunk from step 2")


def relink(directory: str, step: str) -> None:
    """A new manager restores the newest step, and saves `step` (attempt 1) from it."""
    with zarrckpt.CheckpointManager(directory, **LORA_OPTIONS) as mgr:
        state, restored = mgr.restore(restore_target(lora(0, 0)))
        mgr.save(int(step), {**state, "adapter": lora(int(step), 1)["adapter"], "step": int(step)})
        mgr.wait()
    report(restored=restored)


{"saves": saves, "manager": manager, "linking": linking, "relink": relink}[args[0]](*args[1:])
sys.exit(0)
