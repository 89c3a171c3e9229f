"""Multi-process two-tier worker (4 processes x 2 devices: processes 0 and 2 hold one
data-parallel replica of the same shards, 1 and 3 the other's):

    save PERSISTENT:LOCAL ...               for each pair in turn, steps 1..150: local
                                            copies every 50 steps (keeping 1),
                                            persistent every 100
    restore PERSISTENT:LOCAL ...            for each pair in turn, a fresh manager
                                            restores (every shard is checked, the
                                            seconds it took reported) and saves the
                                            next step to the persistent tier (all
                                            processes train on together)
    hold PERSISTENT LOCAL                   opens a manager, says "open", and holds it
                                            until killed
    die PERSISTENT LOCAL STEP PROCESS       restores, trains on to STEP, and PROCESS
                                            (not 0, which hosts the coordination service)
                                            dies (SIGKILL) in the middle of its local save
"""

from __future__ import annotations

import os
import signal
import time

from common import Said, exit_job, expected, init, report, restore_target, say

args = init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import zarrckpt  # noqa: E402
from zarrckpt._save import protocol  # noqa: E402

SHAPES = {"w": ((64, 32), P("model"), np.float32), "v": ((8, 16), P(None, "model"), jnp.bfloat16),
          "r": ((4,), P(), np.float32), "keydata": ((2,), P(), np.uint32)}


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))


def state_at(step: int) -> dict:
    """The state after `step` steps: every value is known from the step alone."""
    def array(name: str) -> jax.Array:
        shape, spec, dtype = SHAPES[name]
        host = (expected(name, shape, np.float64) + step).astype(dtype)
        return jax.make_array_from_callback(shape, NamedSharding(mesh(), spec), lambda index: host[index])

    return {"w": array("w"), "v": array("v"), "r": array("r"), "key": jax.random.wrap_key_data(array("keydata")),
            "count": np.int64(step), "lr": step / 1000, "name": f"run at {step}"}


def manager(persistent: str, local: str, **kwargs) -> zarrckpt.CheckpointManager:
    return zarrckpt.CheckpointManager(persistent, save_interval_steps=100, local_directory=local,
                                      local_save_interval_steps=50, local_keep_last=1, **kwargs)


def train(mgr: zarrckpt.CheckpointManager, first: int, last: int) -> None:
    for step in range(first, last + 1):
        if step % 50 == 0:
            mgr.save(step, state_at(step))


def checked(state: dict, step: int) -> int:
    """Checks every shard on this process against the state after `step`; returns how many."""
    want = state_at(step)
    count = 0
    for name in ("w", "v", "r", "key"):
        got = jax.random.key_data(state[name]) if name == "key" else state[name]
        full = (expected("keydata" if name == "key" else name, got.shape, np.float64) + step).astype(got.dtype)
        for shard in got.addressable_shards:
            if not np.array_equal(np.asarray(shard.data), full[shard.index]):
                raise AssertionError(f"{name} shard {shard.index} on {shard.device} differs from step {step}")
            count += 1
    for name in ("count", "lr", "name"):
        if state[name] != want[name] or type(state[name]) is not type(want[name]):
            raise AssertionError(f"{name} is {state[name]!r}, step {step} saved {want[name]!r}")
        count += 1
    return count


def restore(pairs: list[str]) -> None:
    said = Said()
    results = []
    for pair in pairs:
        persistent, local = pair.split(":")
        said.lines.clear()
        try:  # a process left waiting for the others would fail in a minute, not hang
            mgr = manager(persistent, local, timeout_s=60)
        except zarrckpt.CheckpointLocationError as e:  # raised on every process alike
            results.append({"refused": str(e), "kind": type(e).__name__})
            continue
        with mgr:
            started = time.monotonic()
            state, step = mgr.restore(restore_target(state_at(0)))
            seconds = time.monotonic() - started
            results.append({"step": step, "tier": mgr.restored_tier, "checked": checked(state, step),
                            "seconds": seconds, "said": list(said.lines)})
            mgr.save(step + 1, state_at(step + 1), force=True)
    report(results=results)


def hold(persistent: str, local: str) -> None:
    mgr = manager(persistent, local, heartbeat_s=0.2)
    say("open")
    time.sleep(300)
    mgr.close()


def die(persistent: str, local: str, last: str, victim: str) -> None:
    with manager(persistent, local, timeout_s=10) as mgr:
        state, step = mgr.restore(restore_target(state_at(0)))
        checked(state, step)
        if jax.process_index() == int(victim):
            write = protocol._write_one

            def write_then_die(loc, plan, unit, *rest):  # one chunk of the local copy on disk, then killed
                write(loc, plan, unit, *rest)
                if f"/process{victim}/{int(last):010d}" in loc.url:
                    os.kill(os.getpid(), signal.SIGKILL)

            protocol._write_one = write_then_die
        report(restored=step)
        train(mgr, step + 1, int(last))
        mgr.wait()  # the others: their local save times out, a warning
        # As a scheduler tears down a job that lost a process (no shutdown barrier to hang
        # in), process 0, which hosts the coordination service, last (see exit_job).
        exit_job(0)


def save(pairs: list[str]) -> None:
    for pair in pairs:
        with manager(*pair.split(":")) as mgr:
            train(mgr, 1, 150)
    report(done=True)


mode, *rest = args
{"save": lambda: save(rest), "restore": lambda: restore(rest), "hold": lambda: hold(*rest),
 "die": lambda: die(*rest)}[mode]()
