"""Multi-process save / restore worker: `save DIR STEP`, `restore DIR MESH [MESH...]` (one
restore onto each mesh in turn, in one job), `fail DIR PROCESS [DIR PROCESS...]` (each in
turn), `unchanged DIR`."""

from __future__ import annotations

from common import STORAGE_OPTIONS, check_shards, expected, init, report

args = init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import zarrckpt  # noqa: E402
from zarrckpt._format import tree as _tree  # noqa: E402
from zarrckpt._save import plan as _planning

SHAPES = {"rows": (16, 8), "cols": (8, 16), "both": (16, 16), "replicated": (1024, 512), "host": (5, 3)}
SAVE_SPECS = {"rows": P("data"), "cols": P(None, "model"), "both": P("data", "model"), "replicated": P()}
# Restore layouts: mesh shape and axis names, and each leaf's spec on it.
RESTORE_MESHES = {
    "flat8": ((8,), ("x",), {"rows": P("x"), "cols": P(None, "x"), "both": P(None, "x"), "replicated": P("x")}),
    "4x2": ((4, 2), ("a", "b"), {"rows": P("b", "a"), "cols": P(), "both": P("a"), "replicated": P(None, "b")}),
    "2x2": ((2, 2), ("a", "b"), {"rows": P("a"), "cols": P("b", "a"), "both": P("a", "b"), "replicated": P()}),
    "single": ((1,), ("x",), {"rows": P(), "cols": P(), "both": P(), "replicated": P()}),
}


def global_array(name: str, sharding, offset: float = 0.0) -> jax.Array:
    full = expected(name, SHAPES[name]) + np.float32(offset)
    return jax.make_array_from_callback(full.shape, sharding, lambda idx: full[idx])


def state_tree(offset: float = 0.0) -> dict:
    """The state `check_shards` expects, every value raised by `offset`."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
    tree = {name: global_array(name, NamedSharding(mesh, spec), offset) for name, spec in SAVE_SPECS.items()}
    tree["host"] = expected("host", SHAPES["host"]) + np.float32(offset)
    tree["step"] = 7
    return tree


def save(directory: str, step: str) -> None:
    tree = state_tree()
    _, leaves = _tree.record(tree)
    writers = {leaf.name: len(_planning.plan_array(leaf, i, process=jax.process_index(),
                                                   processes=jax.process_count()).writes)
               for i, leaf in enumerate(leaves)}
    zarrckpt.save_checkpoint(directory, int(step), tree, storage_options=STORAGE_OPTIONS)
    report(writes=writers, latest=zarrckpt.latest_step(directory, storage_options=STORAGE_OPTIONS))


def restore(directory: str, *mesh_names: str) -> None:
    restored = []
    for mesh_name in mesh_names:
        shape, axes, specs = RESTORE_MESHES[mesh_name]
        devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
        mesh = Mesh(devices, axes)
        target = {name: NamedSharding(mesh, spec) for name, spec in specs.items()}
        target["host"] = np.zeros(SHAPES["host"], np.float32)
        target["step"] = 0
        state, step = zarrckpt.load_checkpoint_if_it_exists(directory, target, storage_options=STORAGE_OPTIONS)
        restored.append({"step": step, "checked": check_shards(state, SHAPES), "step_value": state["step"]})
    report(**restored[-1], restored=restored)


def fail(*runs: str) -> None:
    """`failed` in each of the directories `runs` names (DIR PROCESS pairs), in turn;
    reports what each found ("runs")."""
    report(runs=[failed(directory, failing) for directory, failing in zip(runs[::2], runs[1::2], strict=True)])


def failed(directory: str, failing: str) -> dict:
    """Step 1 saved, then a save of step 2 whose chunk writes of leaf `both` fail on
    process `failing`, then step 2 saved again: reports the failure, the newest step
    and step 2's commit state after it, and whether the save after it restores
    exactly (its own values, not the failed one's)."""
    from zarrckpt import _commit, _storage

    zarrckpt.save_checkpoint(directory, 1, state_tree(), storage_options=STORAGE_OPTIONS)
    original = _storage.Location.write_new  # every chunk a save writes goes through it

    def broken(self, key, *parts, **kwargs):
        if key.startswith("both/c."):
            raise OSError("injected write failure")
        return original(self, key, *parts, **kwargs)

    if jax.process_index() == int(failing):
        _storage.Location.write_new = broken
    try:
        # Other values than the save after it, so a chunk of this attempt left in
        # place and read back would show.
        zarrckpt.save_checkpoint(directory, 2, state_tree(offset=1000), storage_options=STORAGE_OPTIONS)
    except zarrckpt.CheckpointWriteError as e:
        error = str(e)
    else:
        return {"error": None}
    finally:
        _storage.Location.write_new = original
    latest = zarrckpt.latest_step(directory, storage_options=STORAGE_OPTIONS)
    state = _commit.head(_storage.resolve(directory, STORAGE_OPTIONS).step(2)).state.name
    # Before process 0 clears the way for the next save: every process has looked.
    multihost_utils.sync_global_devices("looked at the failed save")
    zarrckpt.save_checkpoint(directory, 2, state_tree(), storage_options=STORAGE_OPTIONS)
    target = {name: value.sharding for name, value in state_tree().items() if isinstance(value, jax.Array)}
    target["host"], target["step"] = np.zeros(SHAPES["host"], np.float32), 0
    restored = zarrckpt.load_checkpoint(directory, 2, target, storage_options=STORAGE_OPTIONS)
    return {"error": error, "latest": latest, "state": state, "checked": check_shards(restored, SHAPES),
            "latest_after": zarrckpt.latest_step(directory, storage_options=STORAGE_OPTIONS)}


def unchanged(directory: str) -> None:
    """A frozen base sharded over the devices of both processes, the same arrays at
    every step, beside a leaf that changes: three `save_checkpoint` calls, the second
    and third with `unchanged_since`; then steps 1 and 2 deleted and step 3 restored in
    a new state. Reports each step's base chunk files (name and inode) as this process
    sees them, and the values restored."""
    import pathlib
    import shutil

    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
    host = np.arange(2048 * 2048, dtype=np.float32).reshape(2048, 2048)
    base = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("data", "model")), lambda i: host[i])
    for step in (1, 2, 3):
        head = global_array("replicated", NamedSharding(mesh, P()), float(step))
        zarrckpt.save_checkpoint(directory, step, {"base": base, "head": head},
                                 unchanged_since=step - 1 if step > 1 else None)
    inodes = {step: sorted((p.name, p.stat().st_ino) for p in (pathlib.Path(directory) / f"{step:010d}" / "base")
                           .iterdir() if p.name != "zarr.json") for step in (1, 2, 3)}
    multihost_utils.sync_global_devices("listed")
    if jax.process_index() == 0:
        for step in (1, 2):
            shutil.rmtree(pathlib.Path(directory) / f"{step:010d}")
    multihost_utils.sync_global_devices("deleted")
    target = {"base": NamedSharding(mesh, P("data", "model")), "head": NamedSharding(mesh, P())}
    restored = zarrckpt.load_checkpoint(directory, 3, target)
    base_ok = all(np.array_equal(np.asarray(s.data), host[s.index]) for s in restored["base"].addressable_shards)
    head_ok = all(np.array_equal(np.asarray(s.data), expected("replicated", SHAPES["replicated"]) + np.float32(3))
                  for s in restored["head"].addressable_shards)
    report(inodes=inodes, base_ok=base_ok, head_ok=head_ok)


{"save": save, "restore": restore, "fail": fail, "unchanged": unchanged}[args[0]](*args[1:])
