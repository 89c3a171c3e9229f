"""How long an async CheckpointManager.save blocks training, side by side with the
whole save and with a bare device-to-host copy of the same state.

    python benchmarks/async_save.py --size-gib 1 --repeats 5

Per round: the bare copy (every shard this process would write, copied into new
host memory: the least any true snapshot must do), then `mgr.save` (the time it
blocks) and `mgr.wait` (until committed). Peak host memory is the largest resident
set size above the pre-save baseline, sampled every millisecond during the save.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

# Before jax is imported (by the shared module below): 8 host devices, unless the
# caller's environment already chose a platform or a device count.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import save_restore as common  # noqa: E402  (the same tree as the main benchmark)


def release_free_memory() -> None:
    """Hands memory freed by earlier rounds back to the OS, so that the next round's
    peak is measured from a true baseline rather than hidden in reused heap."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the peak may then read low
        pass


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Samples the resident set size on a thread; `peak` is the largest seen."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def bare_copy(tree) -> float:
    import jax
    import numpy as np

    started = time.perf_counter()
    copies = [np.array(shard.data) for leaf in jax.tree.leaves(tree)
              for shard in leaf.addressable_shards if shard.replica_id == 0]
    seconds = time.perf_counter() - started
    del copies
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    import jax

    import zarrckpt

    base = args.dir or tempfile.mkdtemp(prefix="zarrckpt-async-")
    tree = common.build_tree(args.size_gib, common.make_mesh())
    nbytes = common.tree_nbytes(tree)
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].platform}; "
          f"tree {nbytes / 2**30:.3f} GiB in {len(jax.tree.leaves(tree))} leaves", flush=True)
    rows = {"bare copy": [], "save blocked": [], "save total": [], "peak host MiB": []}
    try:
        with zarrckpt.CheckpointManager(base, async_save=True, keep_last=1) as mgr:
            for step in range(args.repeats + 1):  # step 0 warms up
                copy_s = bare_copy(tree)
                gc.collect()
                release_free_memory()
                baseline = rss_bytes()
                with PeakMemory() as memory:
                    started = time.perf_counter()
                    mgr.save(step, tree, force=True)
                    blocked = time.perf_counter() - started
                    mgr.wait()
                    total = time.perf_counter() - started
                print(f"  step {step}: bare copy {copy_s:.3f}s, save blocked {blocked:.3f}s, "
                      f"total {total:.3f}s, peak host +{(memory.peak - baseline) / 2**20:.0f} MiB", flush=True)
                if step:
                    for key, value in zip(rows, (copy_s, blocked, total, (memory.peak - baseline) / 2**20)):
                        rows[key].append(value)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    medians = {key: statistics.median(values) for key, values in rows.items()}
    print(f"\nmedian of {args.repeats}: bare copy {medians['bare copy']:.3f}s, save blocked "
          f"{medians['save blocked']:.3f}s, save total {medians['save total']:.3f}s, "
          f"peak host memory +{medians['peak host MiB']:.0f} MiB (state {nbytes / 2**20:.0f} MiB)")
    print(f"blocked / bare copy: {medians['save blocked'] / medians['bare copy']:.2f} (target <= 1.5); "
          f"blocked / total save: {medians['save blocked'] / medians['save total']:.2f}")


if __name__ == "__main__":
    main()
