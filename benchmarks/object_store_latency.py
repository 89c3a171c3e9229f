"""zarrckpt on a slow store: a fixed latency per request and a bounded bandwidth.

    python benchmarks/object_store_latency.py                      # 20 ms, 1 GB/s, 1000 leaves and 1 GiB
    python benchmarks/object_store_latency.py --latency-ms 50 --size-mib 256 --target local

The store is fsspec's memory file system (or a local directory, --target local)
behind a wrapper file system, `latency://`, that holds every request for
--latency-ms, and moves its bytes over one shared link of --bandwidth-mb-s (a
request waits for the link while others use it; one zarrckpt gives up is cancelled
and frees the link of the bytes it had left), counting requests and bytes.
zarrckpt sees it as any other remote store (its default object-store concurrency).

Two trees, each saved and restored (onto the same shardings) --repeats times:
  - --leaves small arrays (1 KiB each, replicated: one chunk per leaf);
  - the --size-mib tree of benchmarks/save_restore.py (big sharded matrices).
For each: time, requests made, round-trip times taken (seconds / latency), the
time through the same wrapper with no latency and no bandwidth bound (host-only: the
device transfers, copies and bookkeeping that no store can hide), and the ideal

    ideal = bytes moved / bandwidth + minimal round trips x latency

where the minimal round trips, with C requests in flight (zarrckpt's default for the
store), are: save, 1 (is something committed there?) + ceil(objects written / C) +
1 (the commit); restore, 1 (the group's metadata, which holds every array's) +
ceil(chunks read / C). Targets: within 2x of the ideal, and a --leaves restore in
under 20 round trips.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import math
import os
import statistics
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as common  # noqa: E402  (the big tree of the main benchmark)

# Before jax is imported: the store is what is measured here, so the CPU with 8
# devices, unless the caller's environment already chose a platform or a device count.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
common.setup_platform(None, None)

import fsspec  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import (
    NamedSharding,  # noqa: E402
    PartitionSpec as P,
)

import zarrckpt  # noqa: E402
from zarrckpt import _storage
from zarrckpt._util import concurrency as _concurrency  # noqa: E402

SMALL_LEAF_LEN = 256  # float32: 1 KiB
RESTORE_TARGET_RTTS = 20
TARGET_RATIO = 2.0


class LatencyFileSystem(fsspec.AbstractFileSystem):
    """A far-away store in front of a near one: every request waits `latency_s`, and
    its bytes cross one link of `bandwidth` bytes/s shared by all requests."""

    protocol = "latency"

    def __init__(self, latency_s: float = 0.02, bandwidth: float = 1e9, target_protocol: str = "memory",
                 target_root: str = "", **kwargs):
        super().__init__(**kwargs)
        self.latency_s, self.bandwidth, self.target_root = latency_s, bandwidth, target_root
        self.target = fsspec.filesystem(target_protocol, **({"auto_mkdir": True} if target_protocol == "file" else {}))
        self.requests: collections.Counter[str] = collections.Counter()
        self.bytes = 0
        self._lock = threading.Lock()
        self._link_free_at = 0.0

    def _request(self, kind: str, nbytes: int = 0) -> None:
        with self._lock:
            self.requests[kind] += 1
            self.bytes += nbytes
            done = time.perf_counter() + self.latency_s
            if nbytes:
                done = self._link_free_at = max(done, self._link_free_at) + nbytes / self.bandwidth
        # A request zarrckpt gives up (another process read its part) is cancelled, as an
        # asynchronous client's is: the bytes it had still to move free the link for the
        # requests made after it.
        gone = _concurrency.given_up()
        if gone is None:
            time.sleep(max(0.0, done - time.perf_counter()))
            return
        try:
            gone.result(timeout=max(0.0, done - time.perf_counter()))
        except concurrent.futures.TimeoutError:
            return
        with self._lock:
            self._link_free_at -= min(max(0.0, done - time.perf_counter()), nbytes / self.bandwidth)
        raise OSError(f"{kind} request cancelled")

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.bytes = 0

    def _t(self, path: str) -> str:
        return f"{self.target_root}/{self._strip_protocol(path)}" if self.target_root else self._strip_protocol(path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        try:
            data = self.target.cat_file(self._t(path), start=start, end=end)
        except FileNotFoundError:
            self._request("read")
            raise
        self._request("read", len(data))
        return data

    def pipe_file(self, path, value, **kwargs):
        self._request("write", len(value))
        self.target.pipe_file(self._t(path), value)

    def ls(self, path, detail=True, **kwargs):
        self._request("list")
        return self.target.ls(self._t(path), detail=detail)

    def info(self, path, **kwargs):
        self._request("head")
        return self.target.info(self._t(path))

    def rm_file(self, path):
        self._request("delete")
        self.target.rm_file(self._t(path))

    def rm(self, path, recursive=False, maxdepth=None):
        # As an object store does it: one listing, then deletes of up to 1000 keys.
        self._request("list")
        found = self.target.find(self._t(path)) if recursive else [self._t(path)]
        for _ in range(math.ceil(len(found) / 1000)):
            self._request("delete")
        self.target.rm(self._t(path), recursive=recursive)


fsspec.register_implementation("latency", LatencyFileSystem, clobber=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency-ms", type=float, default=20.0, help="per request (default 20)")
    parser.add_argument("--bandwidth-mb-s", type=float, default=1000.0,
                        help="the store's bandwidth, shared by all requests (default 1000 MB/s)")
    parser.add_argument("--leaves", type=int, default=1000, help="leaves of the small tree (default 1000)")
    parser.add_argument("--size-mib", type=float, default=1024.0, help="size of the big tree (default 1024)")
    parser.add_argument("--repeats", type=int, default=1, help="timed rounds, after one warm-up (default 1)")
    parser.add_argument("--target", choices=("memory", "local"), default="memory",
                        help="the store behind the latency: fsspec's memory file system or a local directory")
    parser.add_argument("--dir", default="/tmp", help="parent directory for --target local (default /tmp)")
    parser.add_argument("--no-checksums", action="store_true",
                        help="save without CRC-32C, to see what checksums cost over a slow store")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    return parser.parse_args(argv)


def small_tree(leaves: int, mesh) -> dict:
    replicated = NamedSharding(mesh, P())
    return {f"leaf_{i:05d}": jax.device_put(np.full(SMALL_LEAF_LEN, i, np.float32), replicated)
            for i in range(leaves)}


def save_and_restore(tree, target, options: dict, checksums: bool) -> tuple[float, dict, int, float, dict, int, int]:
    """One round on a fresh URL: seconds, requests by kind and bytes moved, for the
    save then the restore; and the checkpoint's chunk count."""
    url = f"latency://zarrckpt-bench/{uuid.uuid4().hex}"
    loc = _storage.resolve(url, options)
    fs = loc.store.fs
    fs.reset()
    started = time.perf_counter()
    zarrckpt.save_pytree(url, tree, storage_options=options, checksums=checksums)
    save_s = time.perf_counter() - started
    save_requests, save_bytes = dict(fs.requests), fs.bytes
    fs.reset()
    started = time.perf_counter()
    restored = jax.block_until_ready(zarrckpt.load_pytree(url, target, storage_options=options))
    restore_s = time.perf_counter() - started
    restore_requests, restore_bytes = dict(fs.requests), fs.bytes
    del restored
    chunks = sum(math.prod(-(-n // c) for n, c in zip(leaf.shape, leaf.chunks))
                 for leaf in zarrckpt.metadata(url, storage_options=options).leaves)
    fs.target.rm(fs._t(loc.path), recursive=True)
    return save_s, save_requests, save_bytes, restore_s, restore_requests, restore_bytes, chunks


def measure(name: str, tree, args, options: dict) -> dict:
    """Saves and restores `tree` through the slow store, and through the same wrapper
    with neither latency nor a bandwidth bound (what the host alone needs)."""
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    host_only = {**options, "latency_s": 0.0, "bandwidth": float("inf")}
    slow, fast = [], []
    for _ in range(args.repeats + 1):  # the first round warms up (compiles, allocates)
        slow.append(save_and_restore(tree, target, options, not args.no_checksums))
        fast.append(save_and_restore(tree, target, host_only, not args.no_checksums))
    slow, fast = slow[1:], fast[1:]
    _, save_requests, save_bytes, _, restore_requests, restore_bytes, chunks = slow[-1]
    concurrency = _storage.resolve("latency://zarrckpt-bench", options).concurrency
    latency, bandwidth = args.latency_ms / 1000, args.bandwidth_mb_s * 1e6
    leaves = len(jax.tree.leaves(tree))
    # Before the commit: the group, every array's metadata and every chunk.
    save_rtts = 1 + math.ceil((1 + leaves + chunks) / concurrency) + 1
    restore_rtts = 1 + math.ceil(chunks / concurrency)
    result = {"tree": name, "leaves": leaves, "chunks": chunks, "concurrency": concurrency}
    for op, seconds_at, requests, nbytes, rtts in (("save", 0, save_requests, save_bytes, save_rtts),
                                                   ("restore", 3, restore_requests, restore_bytes, restore_rtts)):
        seconds = statistics.median(r[seconds_at] for r in slow)
        ideal = nbytes / bandwidth + rtts * latency
        result[op] = {"seconds": seconds, "requests": requests, "bytes": nbytes, "ideal_seconds": ideal,
                      "ideal_round_trips": rtts, "ratio": seconds / ideal, "round_trips": seconds / latency,
                      "host_only_seconds": statistics.median(r[seconds_at] for r in fast)}
    return result


def report(result: dict) -> list[str]:
    """Prints one tree's figures; returns the targets it missed."""
    missed = []
    print(f"\n{result['tree']}: {result['leaves']} leaves, {result['chunks']} chunks, "
          f"{result['concurrency']} requests in flight")
    print(f"  {'':8} {'seconds':>8} {'requests':>9} {'MB':>8} {'ideal s':>8} {'ideal RTTs':>10} {'ratio':>6} "
          f"{'RTTs':>6} {'host-only s':>11}  requests by kind")
    for op in ("save", "restore"):
        r = result[op]
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["requests"].items()))
        print(f"  {op:8} {r['seconds']:8.3f} {sum(r['requests'].values()):9d} {r['bytes'] / 1e6:8.1f} "
              f"{r['ideal_seconds']:8.3f} {r['ideal_round_trips']:10d} {r['ratio']:6.2f} {r['round_trips']:6.1f} "
              f"{r['host_only_seconds']:11.3f}  {kinds}")
        if r["ratio"] > TARGET_RATIO:
            missed.append(f"{result['tree']} {op}: {r['ratio']:.2f}x the ideal (target {TARGET_RATIO:g}x)")
    if result["tree"] == "small" and result["restore"]["round_trips"] >= RESTORE_TARGET_RTTS:
        missed.append(f"small restore: {result['restore']['round_trips']:.1f} round-trip times "
                      f"(target < {RESTORE_TARGET_RTTS})")
    return missed


def main() -> int:
    args = parse_args()
    options = {"latency_s": args.latency_ms / 1000, "bandwidth": args.bandwidth_mb_s * 1e6,
               "target_protocol": "memory" if args.target == "memory" else "file"}
    if args.target == "local":
        options["target_root"] = os.path.join(os.path.abspath(args.dir), f"zarrckpt-latency-{uuid.uuid4().hex}")
    mesh = common.make_mesh()
    print(f"latency {args.latency_ms:g} ms per request, bandwidth {args.bandwidth_mb_s:g} MB/s, "
          f"store: {args.target}, {len(jax.devices())} devices, zarr {__import__('zarr').__version__}")
    results, missed = [], []
    for name, make in (("small", lambda: small_tree(args.leaves, mesh)),
                       (f"{args.size_mib:g} MiB", lambda: common.build_tree(args.size_mib / 1024, mesh))):
        tree = make()
        result = measure(name, tree, args, options)
        del tree
        results.append(result)
        missed += report(result)
    print("\n" + ("all targets met" if not missed else "missed: " + "; ".join(missed)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
