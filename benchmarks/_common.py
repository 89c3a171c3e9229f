"""What the benchmarks share: the platform, the states, fresh copies of a state, the
host-memory probes and the statistics.

Import this module before jax (it sets the platform up): `setup_platform` must run
first. Every benchmark runs on whatever platform JAX has (an accelerator when there is
one) unless `--platform` says otherwise; on the CPU it simulates 8 devices.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import json
import os
import statistics
import subprocess
import time

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
DEFAULT_CPU_DEVICES = 8


def add_platform_arguments(parser) -> None:
    parser.add_argument("--platform", default=None,
                        help="JAX platform to run on (cpu, gpu, tpu; default: what JAX finds, an "
                             "accelerator when there is one)")
    parser.add_argument("--devices", type=int, default=None,
                        help=f"CPU devices to simulate (default {DEFAULT_CPU_DEVICES}, or the count "
                             "already in XLA_FLAGS); ignored on an accelerator")


def setup_platform(platform: str | None, devices: int | None) -> None:
    """Chooses the platform and the simulated CPU device count; before jax is imported."""
    if platform:
        os.environ["JAX_PLATFORMS"] = platform
    flags = os.environ.get("XLA_FLAGS", "").split()
    if devices is None and any(f.startswith(DEVICE_COUNT_FLAG) for f in flags):
        return  # the caller's own XLA_FLAGS already chose a count
    flags = [f for f in flags if not f.startswith(DEVICE_COUNT_FLAG)]
    flags.append(f"{DEVICE_COUNT_FLAG}={devices or DEFAULT_CPU_DEVICES}")  # the CPU backend's only
    os.environ["XLA_FLAGS"] = " ".join(flags)


def describe_platform() -> str:
    import jax

    device = jax.devices()[0]
    return f"{jax.device_count()} x {device.platform} ({device.device_kind})"


def writer_threads() -> int:
    """As many threads as zarrckpt's writers on a local disk, for the raw ceilings."""
    from zarrckpt import _storage

    return _storage.LOCAL_CONCURRENCY


# -- states --------------------------------------------------------------------------------


def make_mesh():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = jax.devices()
    # A 2-row mesh like a real data x model split; 1 row when the device count is odd.
    rows = 2 if len(devices) % 2 == 0 else 1
    return Mesh(np.array(devices).reshape(rows, len(devices) // rows), ("data", "model"))


# (name, share of the total bytes, column count, PartitionSpec entries): most bytes in a
# few big matrices with assorted layouts, ~10% fully replicated, as in a transformer.
MATRICES = (
    ("embed", 0.20, 1024, (None, "model")),                # column-sharded
    ("attn_qkv", 0.15, 3072, ("data", "model")),           # both axes
    ("attn_out", 0.10, 2048, ("model", "data")),           # both, transposed
    ("mlp_up", 0.20, 4096, ("data", None)),                # rows; model replicas
    ("mlp_down", 0.15, 1024, (("data", "model"), None)),   # rows over all devices
    ("lm_head", 0.10, 2048, (None, "data")),               # columns; replicas
    ("rope_table", 0.06, 512, ()),                         # fully replicated
    ("norm_stats", 0.04, 256, ()),                         # fully replicated
)
SMALL_LAYERS = 24  # each has a bias and a scale: 48 small leaves, and a step
SMALL_LEN = 1024


def _round_up(value: int, multiple: int) -> int:
    return max(multiple, -(-value // multiple) * multiple)


@functools.cache  # leaves share shapes: compile once each
def _random_fn(shape, dtype, sharding):
    import jax

    # Generated already sharded, so that no single device ever holds a whole leaf.
    return jax.jit(lambda key: jax.random.normal(key, shape, dtype), out_shardings=sharding)


def build_tree(size_gib: float, mesh):
    """A transformer-like pytree of about `size_gib` of float32, and an int32 step."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    n = mesh.size  # dims are multiples of n, so every spec divides
    total = int(size_gib * 2**30)
    key, counter = jax.random.key(0), itertools.count()

    def leaf(shape, spec):
        generate = _random_fn(shape, jnp.float32, NamedSharding(mesh, P(*spec)))
        return generate(jax.random.fold_in(key, next(counter)))

    params = {}
    for name, share, cols, spec in MATRICES:
        cols = _round_up(cols, n)
        params[name] = leaf((_round_up(int(total * share) // (4 * cols), n), cols), spec)
    length = _round_up(SMALL_LEN, n)
    params["layers"] = {f"layer_{i:02d}": {"bias": leaf((length,), ("model",)), "scale": leaf((length,), ())}
                        for i in range(SMALL_LAYERS)}
    step = jax.device_put(np.int32(1000), NamedSharding(mesh, P()))
    return jax.block_until_ready({"params": params, "step": step})


def many_leaf_tree(leaves: int, size_mib: float, mesh):
    """A model of many small leaves (a 600-leaf NNX model, say): `leaves` float32 leaves of
    about `size_mib` together, a third sharded over the model axis, the rest replicated."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    n = mesh.size
    length = _round_up(int(size_mib * 2**20 / 4 / leaves), n)
    key = jax.random.key(1)
    out = {}
    for i in range(leaves):
        spec = ("model",) if i % 3 == 0 else ()
        out[f"block_{i // 6:03d}"] = out.get(f"block_{i // 6:03d}", {})
        generate = _random_fn((length,), jnp.float32, NamedSharding(mesh, P(*spec)))
        out[f"block_{i // 6:03d}"][f"w{i % 6}"] = generate(jax.random.fold_in(key, i))
    return jax.block_until_ready(out)


@functools.cache
def _plus(treedef, shardings):
    import jax
    import jax.numpy as jnp

    def add(step, *xs):
        return tuple(x + step.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.number) else x for x in xs)

    return jax.jit(add, out_shardings=shardings)


def fresh(tree, step: int = 0):
    """A new state, as a train step leaves it: computed on the devices and never copied
    to the host (a state copied once is cached there and flatters everyone). With
    `step`, every number plus `step`, as training changes every value: a state equal to
    the one a manager saved last is made from that step's chunks (`reuse_unchanged`),
    not written, and would time a save that writes nothing."""
    import jax
    import numpy as np

    leaves, treedef = jax.tree.flatten(tree)
    out = _plus(treedef, tuple(x.sharding for x in leaves))(np.int32(step), *leaves)
    return jax.block_until_ready(jax.tree.unflatten(treedef, out))


def tree_nbytes(tree) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def replicated_nbytes(tree) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if x.sharding.is_fully_replicated)


# -- what a copy off the devices costs --------------------------------------------------------


def written_shards(tree):
    """The shards a save writes: one replica of each (the bytes of the state, once)."""
    import jax

    return [shard.data for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards
            if shard.replica_id == 0]


def bare_copy(tree) -> float:
    """Seconds to copy every written shard into new host memory with `np.array`: what a
    snapshot through pageable memory costs."""
    import numpy as np

    shards = written_shards(tree)
    started = time.perf_counter()
    copies = [np.array(shard) for shard in shards]
    seconds = time.perf_counter() - started
    del copies
    return seconds


def pinned_copy(tree, *, wait: bool = True):
    """Copies every written shard into the devices' pinned host memory in one batched
    `device_put`; returns (seconds until dispatched, seconds until complete or None
    without `wait`, the copies)."""
    import jax

    shards = written_shards(tree)
    shardings = [jax.sharding.SingleDeviceSharding(next(iter(s.devices())), memory_kind="pinned_host")
                 for s in shards]
    started = time.perf_counter()
    copies = jax.device_put(shards, shardings)
    dispatched = time.perf_counter() - started
    if not wait:
        return dispatched, None, copies
    jax.block_until_ready(copies)
    return dispatched, time.perf_counter() - started, copies


# -- host memory -------------------------------------------------------------------------------


def release_free_memory() -> None:
    """Hands memory freed by earlier rounds back to the OS, so that the next peak is
    measured from a true baseline rather than hidden in reused heap."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: peaks may then read low
        pass


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Starts the peak resident size (VmHWM) again from the current one (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    """The resident size's peak since `reset_peak_rss` (VmHWM)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


_SAMPLER = """
import select, sys
path, peak = f"/proc/{sys.argv[1]}/statm", 0
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0.001)[0]:
    with open(path) as f:
        peak = max(peak, int(f.read().split()[1]))
print(peak, flush=True)
"""


class PeakMemory:
    """The resident set size's peak while inside, sampled every millisecond by another
    process (a sampling thread here would compete for the GIL with what is measured);
    `above` is the peak over the baseline taken on entry, after freed memory went back
    to the OS."""

    def __init__(self) -> None:
        self.peak = 0
        self.baseline = 0
        self._sampler = None

    @property
    def above(self) -> int:
        return max(0, self.peak - self.baseline)

    def __enter__(self) -> PeakMemory:
        import gc
        import subprocess
        import sys

        gc.collect()
        release_free_memory()
        self.baseline = rss_bytes()
        self._sampler = subprocess.Popen([sys.executable, "-c", _SAMPLER, str(os.getpid())], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
        self._sampler.stdout.readline()  # sampling has begun
        return self

    def __exit__(self, *exc) -> None:
        out, _ = self._sampler.communicate("stop\n")
        self.peak = max(int(out.split()[-1]) * os.sysconf("SC_PAGE_SIZE"), rss_bytes())


# -- statistics --------------------------------------------------------------------------------


def timed_restore(mgr, target, *, step: int, tier: str) -> float:
    """Seconds for `mgr.restore(target)` until every array is ready; checks that it
    restored `step` from `tier`."""
    import jax

    started = time.perf_counter()
    restored, got = mgr.restore(target)
    jax.block_until_ready(restored)
    seconds = time.perf_counter() - started
    assert (got, mgr.restored_tier) == (step, tier), (got, mgr.restored_tier)
    return seconds


def best_median(values, higher_is_better: bool = False) -> tuple[float, float]:
    best = max(values) if higher_is_better else min(values)
    return best, statistics.median(values)


def fmt(values, unit: str = "s", digits: int = 3) -> str:
    """'best / median' of a series of timings."""
    best, median = best_median(values)
    return f"{best:.{digits}f} / {median:.{digits}f} {unit}".rstrip()


def run_job(commands, env, timeout):
    """Starts one process per command together (a JAX job's processes) and returns, in
    order, what each printed last on a `RESULT <json>` line; SystemExit with the end of
    its output where a process failed or printed none."""
    procs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for command in commands]
    results = []
    for pid, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=timeout)
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise SystemExit(f"process {pid} of {len(procs)} failed:\n{out[-4000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results
