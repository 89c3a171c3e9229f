"""Multi-process peer-copy worker: a fully sharded state (every array leaf cut over all 8
devices, as FSDP does), so that no process holds a replica of another's shards; each
process has its own local directory, `<LOCAL>/host<i>` (its own disk).

    save PERSISTENT:LOCAL ...     for each pair in turn, steps 1..150: local copies every
                                  50 steps (keeping 1), each process's also kept by one
                                  peer (local_peer_copies=1), persistent every 100
    restore PERSISTENT:LOCAL ...  for each pair in turn, a fresh manager restores (every
                                  shard checked, what it said logged), then saves step
                                  +50 to both tiers (training goes on)
"""

from __future__ import annotations

from common import Said, expected, init, report, restore_target

args = init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import zarrckpt  # noqa: E402

SHAPES = {"w": ((64, 32), np.float32), "v": ((16, 8), jnp.bfloat16), "keydata": ((8, 2), np.uint32)}


def sharding() -> NamedSharding:
    return NamedSharding(Mesh(np.array(jax.devices()), ("fsdp",)), P("fsdp"))


def state_at(step: int) -> dict:
    """The state after `step` steps: every value is known from the step alone."""
    def array(name: str) -> jax.Array:
        shape, dtype = SHAPES[name]
        host = (expected(name, shape, np.float64) + step).astype(dtype)
        return jax.make_array_from_callback(shape, sharding(), lambda index: host[index])

    return {"w": array("w"), "v": array("v"), "key": jax.random.wrap_key_data(array("keydata")),
            "count": np.int64(step), "name": f"run at {step}"}


def checked(state: dict, step: int) -> int:
    """Checks every shard on this process against the state after `step`; returns how many."""
    count = 0
    for name in ("w", "v", "key"):
        got = jax.random.key_data(state[name]) if name == "key" else state[name]
        full = (expected("keydata" if name == "key" else name, got.shape, np.float64) + step).astype(got.dtype)
        for shard in got.addressable_shards:
            if not np.array_equal(np.asarray(shard.data), full[shard.index]):
                raise AssertionError(f"{name} shard {shard.index} on {shard.device} differs from step {step}")
            count += 1
    want = state_at(step)
    for name in ("count", "name"):
        if state[name] != want[name] or type(state[name]) is not type(want[name]):
            raise AssertionError(f"{name} is {state[name]!r}, step {step} saved {want[name]!r}")
        count += 1
    return count


def manager(persistent: str, local: str) -> zarrckpt.CheckpointManager:
    # Process 0 stages one write at a time, waiting for its writer each time, while the
    # others stage all of theirs at once and so reach each collective move of blocks
    # first: a staging that waited on its writer before the writer had started hung
    # every process here.
    return zarrckpt.CheckpointManager(persistent, save_interval_steps=100, local_directory=f"{local}/host"
                                      f"{jax.process_index()}", local_save_interval_steps=50, local_keep_last=1,
                                      local_peer_copies=1, timeout_s=60,
                                      max_inflight_bytes=1 if jax.process_index() == 0 else 2**30)


def save(pairs: list[str]) -> None:
    for pair in pairs:
        with manager(*pair.split(":")) as mgr:
            for step in range(1, 151):
                if step % 50 == 0:
                    mgr.save(step, state_at(step))
    report(done=True)


def restore(pairs: list[str]) -> None:
    said = Said()
    target = restore_target(state_at(0))
    results = []
    for pair in pairs:
        said.lines.clear()
        with manager(*pair.split(":")) as mgr:
            state, step = mgr.restore(target)
            results.append({"step": step, "tier": mgr.restored_tier, "checked": checked(state, step),
                            "said": list(said.lines)})
            mgr.save(step + 50, state_at(step + 50), force=True)  # training goes on, peer copies and all
    report(results=results)


mode, *rest = args
{"save": lambda: save(rest), "restore": lambda: restore(rest)}[mode]()
