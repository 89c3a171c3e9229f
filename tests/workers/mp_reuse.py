"""Multi-process worker of the reuse of unchanged chunks: `nnx_lora DIR`."""

from __future__ import annotations

import pathlib
import sys

from common import init, report

args = init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import zarrckpt  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from nnx_lora import lora_fine_tune, state_of  # noqa: E402


def local_values(state) -> list[bytes]:
    """The bytes of every shard this process holds, leaf by leaf."""
    return [b"".join(np.asarray(shard.data).tobytes() for shard in leaf.addressable_shards)
            for leaf in jax.tree.leaves(state)]


def nnx_lora(directory: str) -> None:
    """An NNX LoRA fine-tune whose base is sharded over the devices of every process,
    saved at each of four steps. Reports the inode of every file of each step, the
    bytes each step's new files hold and the bytes of the leaves that changed (the
    whole job's, from process 0's view of the files), and whether the newest step
    restores to the state in memory once the others are deleted."""
    model, optimizer, train = lora_fine_tune(Mesh(np.array(jax.devices()), ("fsdp",)))
    root = pathlib.Path(directory)
    gather = multihost_utils.process_allgather
    before = [np.asarray(gather(leaf, tiled=True)) for leaf in jax.tree.leaves(state_of(model, optimizer))]
    inodes, written, changed = {}, [], []
    with zarrckpt.CheckpointManager(directory) as mgr:
        for step in range(1, 5):
            train(model, optimizer, step)
            now = [np.asarray(gather(leaf, tiled=True)) for leaf in jax.tree.leaves(state_of(model, optimizer))]
            mgr.save(step, state_of(model, optimizer))
            mgr.wait()
            files = {str(p.relative_to(root / f"{step:010d}")): p.stat() for p in (root / f"{step:010d}").rglob("*")
                     if p.is_file()}
            inodes[step] = {name: info.st_ino for name, info in files.items()}
            written.append(sum(info.st_size for info in files.values() if info.st_nlink == 1))
            changed.append(sum(b.nbytes for a, b in zip(before, now) if a.tobytes() != b.tobytes()))
            before = now
        multihost_utils.sync_global_devices("listed")
        for step in (1, 2, 3):
            mgr.delete(step)
        expected = local_values(state_of(model, optimizer))
        restored, step = mgr.restore(state_of(model, optimizer))
    report(inodes=inodes, written=written, changed=changed, step=step, exact=local_values(restored) == expected)


{"nnx_lora": nnx_lora}[args[0]](*args[1:])
