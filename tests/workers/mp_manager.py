"""Multi-process CheckpointManager worker: `train DIR`, `timeout DIR`, `late DIR TIMEOUT_S HOLD_S`,
`preempted DIR`, `preempted_sometimes DIR`, `frozen DIR`, `staging_fails DIR`, and `optax_save DIR`
then `optax_resume DIR` (a job of its own each)."""

from __future__ import annotations

import os
import signal
import time

from common import init, report

args = init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
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


def late(directory: str, timeout_s: str, hold_s: str) -> None:
    """One save with `timeout_s`. Process 0 clears the way only `hold_s` after process 1
    has begun waiting for it, and never commits (it fails once process 1 has given up,
    so nothing races process 1's timeout). Process 1 records each coordination wait:
    its key, the timeout it was given and how long it took."""
    from jax._src import distributed

    from zarrckpt import _commit, _objects
    from zarrckpt._util import multihost as _multihost

    client = distributed.global_state.client
    if jax.process_index() == 0:
        clear = _objects.make_way

        def late_make_way(*args, **kwargs):
            client.blocking_key_value_get("test/waiting", 60_000)
            time.sleep(float(hold_s))  # process 1 waits at least this long for the way to be cleared
            return clear(*args, **kwargs)

        def never_commit(*args, **kwargs):
            client.blocking_key_value_get("test/gave-up", 60_000)
            raise OSError("process 0 never commits")

        _objects.make_way, _commit.commit = late_make_way, never_commit
        try:
            zarrckpt.save_checkpoint(directory, 1, {"w": np.ones(4)}, timeout_s=float(timeout_s))
        except zarrckpt.CheckpointError as e:
            report(error=type(e).__name__)
        return

    waits = []
    real_client = _multihost._client

    class Timed:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            call = getattr(self._inner, name)
            if name not in ("blocking_key_value_get", "wait_at_barrier"):
                return call

            def timed(key, timeout_ms):
                started, timed_out = time.monotonic(), True  # before process 0 can begin its hold
                if key.endswith("/prepare"):
                    client.key_value_set("test/waiting", "")
                try:
                    result = call(key, timeout_ms)
                    timed_out = False
                    return result
                finally:
                    waits.append({"key": key, "timeout_ms": timeout_ms, "waited_s": time.monotonic() - started,
                                  "timed_out": timed_out})
            return timed

    _multihost._client = lambda: Timed(real_client())
    try:
        zarrckpt.save_checkpoint(directory, 1, {"w": np.ones(4)}, timeout_s=float(timeout_s))
        report(error=None, waits=waits)
    except zarrckpt.CheckpointError as e:
        report(error=type(e).__name__, waits=waits)
    finally:
        client.key_value_set("test/gave-up", "")


def preempted(directory: str, save_every: int = 1, notice_after: int = 15) -> None:
    """Process 1 gets SIGTERM after step `notice_after` (as a scheduler sends it to one
    host): JAX's preemption service agrees on a step, both save it, and both loops stop
    there. The loop calls `save` every `save_every` steps (5: as a loop written around
    Orbax's `should_save` does) and `reached_preemption` at every step."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
    update = jax.jit(lambda s: jax.tree_util.tree_map(lambda x: x + 1, s), donate_argnums=0)
    state, stopped = state_on(mesh, 0.0), None
    with zarrckpt.CheckpointManager(directory, save_interval_steps=10) as mgr:
        for step in range(1, 200):
            state = update(state)
            if step % save_every == 0:
                mgr.save(step, state)
            if step == notice_after and jax.process_index() == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            if mgr.reached_preemption(step):
                stopped = step
                break
            time.sleep(0.02)
    report(stopped=stopped, steps=zarrckpt.all_steps(directory))


def frozen(directory: str) -> None:
    """A frozen base sharded over the devices of both processes, rebuilt as new arrays
    by every step (`base + 0`), beside a leaf that changes: four saves. Reports, on each
    process, the inode of every chunk file of the base in each step, and what the last
    step restores to after the others are deleted."""
    import pathlib

    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
    host = np.full((2048, 2048), 0.5, np.float32)  # 8 MiB written by each process: fingerprinted
    base = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("data", "model")), lambda i: host[i])
    state = {"base": base, "head": state_on(mesh, 0.0)["r"]}
    step_fn = jax.jit(lambda s: {"base": s["base"] + 0, "head": s["head"] + 1})
    with zarrckpt.CheckpointManager(directory) as mgr:
        for step in range(1, 5):
            state = step_fn(state)
            mgr.save(step, state)
        mgr.wait()
        inodes = {step: sorted((str(p.relative_to(directory)).split("/", 1)[1], p.stat().st_ino)
                               for p in (pathlib.Path(directory) / f"{step:010d}" / "base").iterdir()
                               if p.name != "zarr.json") for step in range(1, 5)}
        # Process 0 deletes (as `delete` does, with the others): not before every
        # process has listed the steps.
        multihost_utils.sync_global_devices("listed")
        for step in (1, 2, 3):
            mgr.delete(step)
        restored, step = mgr.restore(state)
    report(inodes=inodes, step=step, base=float(np.asarray(restored["base"].addressable_shards[0].data).max()),
           head=float(np.asarray(restored["head"].addressable_shards[0].data).max()))


def grown(directory: str) -> None:
    """The very same arrays saved at steps 1 and 2; at step 3 the tree gains leaves
    before them (an EMA, an optional leaf set), which moves the process that writes the
    replicated leaf's chunk. The same saves again with reuse off, in a directory of
    their own. Reports the steps committed, the values step 3 restores to, the inodes
    of each leaf's chunks at steps 2 and 3, and the steps each save listed whole, with
    reuse and without (the lease's listings of the run, timed by its heartbeat, not
    counted)."""
    from zarrckpt import _storage

    walked, walk = [], _storage.Location.walk

    def recorded(self, **kwargs):
        walked.append(self.url)
        return walk(self, **kwargs)

    _storage.Location.walk = recorded
    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharded = jax.make_array_from_callback((8192,), NamedSharding(mesh, P("x")),
                                           lambda i: np.arange(8192, dtype=np.float32)[i])
    replicated = jax.make_array_from_callback((4096,), NamedSharding(mesh, P()),
                                              lambda i: np.arange(4096, dtype=np.float32)[i])
    trees = {1: {"s": sharded, "w": replicated}, 2: {"s": sharded, "w": replicated},
             3: {"a": sharded, "b": sharded, "c": sharded, "d": sharded, "s": sharded, "w": replicated}}
    listings: dict[bool, list[int]] = {}
    for reuse in (True, False):
        listings[reuse] = []
        with zarrckpt.CheckpointManager(directory if reuse else f"{directory}_off", async_save=False,
                                        reuse_unchanged=reuse) as mgr:
            for step, tree in trees.items():
                walked.clear()
                mgr.save(step, tree)
                listings[reuse].append(len(walked))
    restored = zarrckpt.load_checkpoint(directory, 3)
    inodes = {step: {leaf: sorted(entry.stat().st_ino for entry in os.scandir(f"{directory}/{step:010d}/{leaf}")
                                  if entry.name.startswith("c")) for leaf in ("s", "w")} for step in (2, 3)}
    report(steps=zarrckpt.all_steps(directory), inodes=inodes, listings=listings[True], without=listings[False],
           exact=all(np.array_equal(np.asarray(restored[k]), np.arange(8192 if k != "w" else 4096)) for k in restored))


def staging_fails(directory: str) -> None:
    """Process 1's copies of step 1 off the devices fail (the runtime cannot allocate
    pinned host memory) before its staging has waited on anything; then both processes
    save step 2. Reports what each save and wait raised, and what step 2 restores to."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
    put, failed = jax.device_put, []

    def failing_put(*args, **kwargs):
        if jax.process_index() == 1 and not failed:
            failed.append(True)
            raise RuntimeError("RESOURCE_EXHAUSTED: could not allocate pinned host memory (injected)")
        return put(*args, **kwargs)

    jax.device_put = failing_put
    said = {}
    with zarrckpt.CheckpointManager(directory, timeout_s=20) as mgr:
        for step, call in ((1, "save"), (1, "wait"), (2, "save"), (2, "wait")):
            try:
                mgr.save(step, state_on(mesh, float(step))) if call == "save" else mgr.wait()
                said[f"{call} {step}"] = None
            except Exception as e:
                said[f"{call} {step}"] = f"{type(e).__name__}: {e}"
        restored, step = mgr.restore(state_on(mesh, 0.0))
    values = sorted({float(np.asarray(s.data).max()) for leaf in restored.values() for s in leaf.addressable_shards})
    report(said=said, step=step, values=values, steps=zarrckpt.all_steps(directory))


def _optax_training():
    """Params sharded over the global mesh, the optimizer state `jax.jit(tx.init)` makes of
    them (mu and nu uncommitted), and a jitted optax.adam step."""
    import jax.numpy as jnp
    import optax

    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))

    def full(shape, spec):
        host = np.ones(shape, np.float32)
        return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda index: host[index])

    tx = optax.adam(1e-2)
    params = {"big": full((512, 1024), P("data", "model")),  # 2 MiB: read as a large leaf
              "small": full((16, 4), P("data"))}

    @jax.jit
    def step(params, opt_state):
        updates, opt_state = tx.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return params, jax.jit(tx.init)(params), step


def optax_save(directory: str) -> None:
    params, opt_state, step = _optax_training()
    params, opt_state = step(params, opt_state)
    with zarrckpt.CheckpointManager(directory) as mgr:
        mgr.save(1, {"params": params, "opt_state": opt_state})
    report(committed=[leaf.committed for leaf in jax.tree.leaves(opt_state)])


def optax_resume(directory: str) -> None:
    """A new job resumes with a target built as the one that saved, then trains a step."""
    params, opt_state, step = _optax_training()
    target = {"params": params, "opt_state": opt_state}
    with zarrckpt.CheckpointManager(directory) as mgr:
        restored, at = mgr.restore(target)
    same = [got.committed == want.committed and got.sharding == want.sharding
            for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target))]
    try:
        params, opt_state = step(restored["params"], restored["opt_state"])
        error = None
    except Exception as e:  # "Received incompatible devices for jitted computation"
        error = f"{type(e).__name__}: {e}"
    count = int(np.asarray(multihost_utils.process_allgather(opt_state[0].count, tiled=True)))
    report(step=at, same=same, error=error, count=count,
           target_committed=[leaf.committed for leaf in jax.tree.leaves(target["opt_state"])])


{"train": train, "timeout": timeout, "late": late, "preempted": preempted,
 "preempted_sometimes": lambda directory: preempted(directory, save_every=5, notice_after=17), "frozen": frozen,
 "grown": grown, "staging_fails": staging_fails, "optax_save": optax_save,
 "optax_resume": optax_resume}[args[0]](*args[1:])
