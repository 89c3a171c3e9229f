"""Multi-process CheckpointManager worker: `train DIR` and `timeout DIR`."""

from __future__ import annotations

import time

from common import init, report

args = init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import zarrckpt  # noqa: E402


def state_on(mesh: Mesh, value: float) -> dict:
    # make_array_from_callback needs no other process (device_put checks with them).
    def full(shape, spec):
        host = np.full(shape, value, np.float32)
        return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda index: host[index])

    return {"w": full((16, 8), P("data", "model")), "r": full((4,), P())}


def train(directory: str) -> None:
    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
    update = jax.jit(lambda s: jax.tree_util.tree_map(lambda x: x + 1, s), donate_argnums=0)
    state = state_on(mesh, 0.0)
    with zarrckpt.CheckpointManager(directory, save_interval_steps=2, keep_last=2) as mgr:
        saved = []
        for step in range(1, 7):
            state = update(state)
            if mgr.save(step, state):
                saved.append(step)
    # Restore on another mesh, with a fresh manager.
    other = Mesh(np.array(jax.devices()).reshape(-1, 1), ("data", "model"))
    with zarrckpt.CheckpointManager(directory) as mgr:
        restored, step = mgr.restore(jax.tree_util.tree_map(lambda x: NamedSharding(other, P()), state))
    values = sorted({float(np.asarray(s.data).max()) for leaf in restored.values() for s in leaf.addressable_shards})
    report(saved=saved, step=step, values=values, steps=zarrckpt.all_steps(directory))


def timeout(directory: str) -> None:
    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
    mgr = zarrckpt.CheckpointManager(directory, timeout_s=3)
    if jax.process_index() == 1:
        time.sleep(8)  # never joins the save: process 0's background barrier must time out
        report(error=None)
        return
    started = time.monotonic()
    mgr.save(1, state_on(mesh, 1.0), force=True)
    try:
        mgr.wait()
    except zarrckpt.CoordinationTimeoutError as e:
        report(error=str(e), waited=time.monotonic() - started, steps=zarrckpt.all_steps(directory))
        return
    report(error="no timeout")


def late(directory: str) -> None:
    """Process 0's store is slow twice in one save (2 s before clearing the way, 2 s
    before the commit): process 1 waits 4 s in all for a save whose timeout is 3 s."""
    from zarrckpt import _commit, _objects

    if jax.process_index() == 0:
        for module, name in ((_objects, "make_way"), (_commit, "commit")):
            slow = getattr(module, name)
            setattr(module, name, lambda *a, _slow=slow, **k: (time.sleep(2), _slow(*a, **k))[1])
    started = time.monotonic()
    try:
        zarrckpt.save_checkpoint(directory, 1, {"w": np.ones(4)}, timeout_s=3)
        report(error=None, waited=time.monotonic() - started)
    except zarrckpt.CoordinationTimeoutError as e:
        report(error=str(e), waited=time.monotonic() - started)


{"train": train, "timeout": timeout, "late": late}[args[0]](*args[1:])
