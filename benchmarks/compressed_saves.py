"""`compression="zstd"` against uncompressed, side by side: bytes stored, save and
restore time, on the local disk and over a slow store.

    python benchmarks/compressed_saves.py                       # 256 MiB, 3 rounds, 200 MB/s
    python benchmarks/compressed_saves.py --size-mib 512 --bandwidth-mb-s 100 --rounds 5

The tree is a model's weights: half bf16, half f32, each matrix sharded over 8 CPU
devices. No trained model ships in a package here, so its values are normally
distributed (as weights at initialisation are; trained weights have more alike
exponents and compress a little better). The slow store is
benchmarks/object_store_latency.py's `latency://` (memory behind a fixed latency per
request and one link of --bandwidth-mb-s shared by every request).

Each store gets one CheckpointManager per setting (uncompressed, "zstd"), the two saving
in turn every round (synchronously, nothing reused: every chunk is written), so that the compressed
manager's saves go on from what its earlier saves learned of the store's speed, as a
training run's do; then the newest step is restored. Figures: best / median of the
rounds; ratios of the medians (zstd / uncompressed). Target: on the local disk, never
more than 5% slower than uncompressed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as common  # noqa: E402

os.environ.setdefault("JAX_PLATFORMS", "cpu")
common.setup_platform(None, None)

import fsspec  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import object_store_latency  # noqa: E402, F401  (registers latency://)
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import zarrckpt  # noqa: E402

LOCAL_TARGET = 1.05


def weights(size_mib: float, mesh) -> dict:
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    rows = 8 * max(1, int(size_mib * 2**20 / 2 / 8 / 4096))
    tree = {}
    for i, dtype in enumerate((jnp.bfloat16, jnp.float32)):
        cols = 4096 // jnp.dtype(dtype).itemsize
        tree[jnp.dtype(dtype).name] = jax.device_put(
            jax.random.normal(jax.random.key(i), (rows, cols), dtype) * 0.02, sharding)
    return tree


def stored_bytes(url: str, options: dict | None) -> int:
    fs, path = fsspec.core.url_to_fs(url, **(options or {}))
    return sum(info["size"] for info in fs.find(path, detail=True).values())


def run(urls: dict, options: dict | None, tree, target, rounds: int) -> dict:
    """Both settings side by side, a round of each in turn, each first every other round
    (the disk and page cache see them alike): `urls` by setting."""
    results = {setting: {"save": [], "restore": []} for setting in urls}
    managers = {setting: zarrckpt.CheckpointManager(url, storage_options=options, async_save=False,
                                                    reuse_unchanged=False, compression=setting)
                for setting, url in urls.items()}
    try:
        order = list(managers.items())
        for step in range(rounds + 1):  # the first round warms up (compiles; learns the store's speed)
            for setting, manager in order[::-1] if step % 2 else order:  # neither always goes first
                started = time.perf_counter()
                manager.save(step, tree, force=True)
                if step:
                    results[setting]["save"].append(time.perf_counter() - started)
        for i in range(rounds):
            for setting, manager in order[::-1] if i % 2 else order:
                started = time.perf_counter()
                jax.block_until_ready(manager.restore(target, step=rounds))
                results[setting]["restore"].append(time.perf_counter() - started)
    finally:
        for manager in managers.values():
            manager.close()
    for setting, url in urls.items():
        results[setting]["bytes"] = stored_bytes(f"{url}/{rounds:010d}", options)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=float, default=256.0, help="the tree's size (default 256)")
    parser.add_argument("--rounds", type=int, default=3, help="timed saves and restores, after one (default 3)")
    parser.add_argument("--bandwidth-mb-s", type=float, default=200.0, help="the slow store's (default 200 MB/s)")
    parser.add_argument("--latency-ms", type=float, default=5.0, help="the slow store's, per request (default 5)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="parent of the local runs (default: tmp)")
    args = parser.parse_args()
    mesh = jax.make_mesh((8,), ("fsdp",))
    tree = weights(args.size_mib, mesh)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    size = common.tree_nbytes(tree)
    print(f"{size / 2**20:.0f} MiB (bf16 and f32, normally distributed), {common.describe_platform()}")
    stores = {"local disk": (lambda: os.path.join(args.dir, f"zarrckpt-compression-{uuid.uuid4().hex}"), None),
              f"{args.bandwidth_mb_s:g} MB/s store": (
                  lambda: f"latency://zarrckpt-bench/{uuid.uuid4().hex}",
                  {"latency_s": args.latency_ms / 1000, "bandwidth": args.bandwidth_mb_s * 1e6})}
    missed = []
    for store, (new_url, options) in stores.items():
        urls = {None: new_url(), "zstd": new_url()}
        try:
            results = run(urls, options, tree, target, args.rounds)
        finally:
            if options is None:
                for url in urls.values():
                    shutil.rmtree(url, ignore_errors=True)
        plain, zstd = results[None], results["zstd"]
        print(f"\n{store}:")
        print(f"  {'':14} {'uncompressed':>20} {'zstd':>20} {'ratio (medians)':>16}")
        print(f"  {'bytes stored':14} {plain['bytes'] / 2**20:17.1f} MiB {zstd['bytes'] / 2**20:17.1f} MiB "
              f"{zstd['bytes'] / plain['bytes']:16.3f}")
        for op in ("save", "restore"):
            a, b = common.best_median(plain[op]), common.best_median(zstd[op])
            print(f"  {op:14} {a[0]:8.3f} / {a[1]:7.3f} s {b[0]:8.3f} / {b[1]:7.3f} s {b[1] / a[1]:16.3f}")
            if options is None and b[1] / a[1] > LOCAL_TARGET:
                missed.append(f"local {op}: {b[1] / a[1]:.3f}x uncompressed (target <= {LOCAL_TARGET})")
    print("\n" + ("all targets met" if not missed else "missed: " + "; ".join(missed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
