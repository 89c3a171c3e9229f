"""A manager's save makes every chunk whose bytes the step before holds from that step's
chunk (CRC-32C and size, as its commit records them), whatever the leaf's size, however
many processes write it and whether or not the arrays are the ones it saved: flax NNX's
rebuilt parameters, small frozen leaves, a process's small share of a leaf."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import fsspec
import jax
import jax.numpy as jnp
import multiprocess
import numpy as np
import pytest
from builders import mesh
from jax.sharding import NamedSharding, PartitionSpec as P
from nnx_lora import lora_fine_tune, state_of

import zarrckpt


def step_files(step_dir: Path) -> dict[str, os.stat_result]:
    return {str(p.relative_to(step_dir)): p.stat() for p in sorted(step_dir.rglob("*")) if p.is_file()}


def new_bytes(step_dir: Path) -> int:
    """The bytes of `step_dir`'s files that no other step links: those the save wrote."""
    return sum(info.st_size for info in step_files(step_dir).values() if info.st_nlink == 1)


def changed_bytes(before, after) -> int:
    """The bytes of the leaves of `after` whose values differ from `before`'s."""
    return sum(b.nbytes for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))
               if a.shape != b.shape or a.tobytes() != b.tobytes())


def as_numpy(tree):
    return jax.tree.map(np.asarray, tree)


def test_an_nnx_lora_fine_tune_saved_every_step_writes_at_most_twice_the_bytes_that_changed(tmp_path):
    model, optimizer, train = lora_fine_tune(mesh((8,), ("fsdp",)))
    before, changed, written = as_numpy(state_of(model, optimizer)), [], []
    with zarrckpt.CheckpointManager(str(tmp_path), keep_last=2) as mgr:
        for step in range(1, 6):
            train(model, optimizer, step)
            now = as_numpy(state_of(model, optimizer))
            mgr.save(step, state_of(model, optimizer))
            mgr.wait()
            changed.append(changed_bytes(before, now))
            written.append(new_bytes(tmp_path / f"{step:010d}"))
            before = now
    full = sum(leaf.nbytes for leaf in jax.tree.leaves(before))
    assert written[0] >= full  # the first save writes everything
    for step, (w, c) in enumerate(zip(written, changed), 1):
        if step > 1:
            assert w <= 2 * c, (step, written, changed)
    assert zarrckpt.all_steps(str(tmp_path)) == [4, 5]
    restored = zarrckpt.load_checkpoint(str(tmp_path), 5, state_of(model, optimizer))
    jax.tree.map(np.testing.assert_array_equal, as_numpy(restored), before)


def test_an_nnx_lora_fine_tune_over_two_processes_links_each_process_s_unchanged_chunks(tmp_path):
    """Each process's chunks of the base (576 KiB of a 1.1 MiB matrix, 2.3 MiB of a 4.5 MiB
    one) are linked from the step before at every save; what each step writes stays
    within twice what changed; the newest step restores exactly once the others are
    deleted."""
    results = multiprocess.run("mp_reuse", "nnx_lora", str(tmp_path / "run"), timeout=300)
    inodes = {int(step): files for step, files in results[0]["inodes"].items()}
    base = {name for name in inodes[1] if "kernel" in name and "lora" not in name and "/c." in name}
    assert {name.rsplit("/", 1)[1].split(".")[1] for name in base} >= {"0", "1"}, base  # both
    for step in (2, 3, 4):
        assert all(inodes[step][name] == inodes[1][name] for name in base), step
    for step, (w, c) in enumerate(zip(results[0]["written"], results[0]["changed"]), 1):
        if step > 1:
            assert w <= 2 * c, (results[0]["written"], results[0]["changed"])
    for r in results:
        assert r["step"] == 4 and r["exact"], r


def frozen_base_and_adapter():
    base = {f"w{i}": jax.device_put(jnp.full((256, 256), i, jnp.float32),
                                    NamedSharding(mesh((8,), ("fsdp",)), P("fsdp"))) for i in range(64)}
    return {"base": base, "adapter": jnp.zeros((256, 8))}


@jax.jit
def rebuilt(state, seed):
    """A step: the base as new arrays with the same values, the adapter changed."""
    return {"base": jax.tree.map(lambda w: w + 0, state["base"]),
            "adapter": jax.random.normal(jax.random.key(seed), state["adapter"].shape)}


def test_a_frozen_base_of_64_small_leaves_rebuilt_every_step_is_linked_from_the_second_save(tmp_path):
    state = frozen_base_and_adapter()
    full = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    written = []
    with zarrckpt.CheckpointManager(str(tmp_path), keep_last=2) as mgr:
        for step in range(1, 5):
            state = rebuilt(state, step)
            mgr.save(step, state)
            mgr.wait()
            written.append(new_bytes(tmp_path / f"{step:010d}"))
    assert written[0] >= full and all(w <= 0.15 * full for w in written[1:]), (written, full)
    restored = zarrckpt.load_checkpoint(str(tmp_path), 4, state)
    jax.tree.map(np.testing.assert_array_equal, as_numpy(restored), as_numpy(state))


@pytest.mark.parametrize("flat_index, bit", [(0, 0), (3000, 31), (8191, 17)], ids=["first", "sign", "last"])
def test_a_single_changed_bit_in_a_small_leaf_is_written_and_the_other_leaves_linked(tmp_path, flat_index, bit):
    """Eight leaves of 32 KiB, rebuilt by the step: one bit flipped in one of them is
    written, the other leaves' chunks are linked, and the step restores the flipped
    value once the step before is deleted."""
    host = {f"w{i}": np.random.default_rng(i).standard_normal((64, 128)).astype(np.float32) for i in range(8)}
    flipped = {name: values.copy() for name, values in host.items()}
    flipped["w5"].view(np.uint32).reshape(-1)[flat_index] ^= np.uint32(1 << bit)
    sharding = NamedSharding(mesh((8,), ("fsdp",)), P("fsdp"))
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        for step, values in ((1, host), (2, flipped)):
            mgr.save(step, jax.device_put(values, sharding))
            mgr.wait()
    one, two = (step_files(tmp_path / f"{step:010d}") for step in (1, 2))
    chunks = [name for name in one if "/c" in name]
    rewritten = [name for name in chunks if one[name].st_ino != two[name].st_ino]
    assert len(chunks) >= 8 and rewritten and all(name.startswith("w5/") for name in rewritten), rewritten
    shutil.rmtree(tmp_path / "0000000001")
    restored = zarrckpt.load_checkpoint(str(tmp_path), 2)
    for name, values in flipped.items():
        np.testing.assert_array_equal(np.asarray(restored[name]).view(np.uint32), values.view(np.uint32))


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_on_an_object_store_a_rebuilt_state_s_second_save_puts_a_fraction_of_a_full_save(new_store, kind):
    """64 small leaves rebuilt by the step and an adapter: the second save's chunks of the
    base are copies inside the store, not bodies sent to it."""
    store = new_store(kind)
    state = frozen_base_and_adapter()
    full = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    received = []
    with zarrckpt.CheckpointManager(store.url, storage_options=store.options) as mgr:
        for step in (1, 2):
            state = rebuilt(state, step)
            store.server.recorder.reset()
            mgr.save(step, state)
            mgr.wait()
            received.append(store.server.recorder.bytes_received)
    assert received[0] >= full and received[1] < 0.15 * full, (received, full)
    fsspec.filesystem(kind, **store.options).rm(f"{store.url}/0000000001", recursive=True)
    restored = zarrckpt.load_checkpoint(store.url, 2, state, storage_options=store.options)
    jax.tree.map(np.testing.assert_array_equal, as_numpy(restored), as_numpy(state))
