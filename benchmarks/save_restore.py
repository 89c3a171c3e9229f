"""Save/restore throughput of zarrckpt against Orbax and a raw numpy ceiling.

Every contender checkpoints the same sharded pytree on 8 host (CPU) devices,
``--repeats`` times, each round into a fresh directory that is deleted
afterwards. Throughput is the tree's logical bytes (each global array counted
once, however many replicas it has) / 1e9 / seconds.

    python benchmarks/save_restore.py --size-gib 0.25 --repeats 1
    python benchmarks/save_restore.py --only zarrckpt,raw --json results.json
"""

import argparse
import concurrent.futures
import contextlib
import functools
import gc
import importlib
import importlib.metadata
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np

CONTENDERS = ("zarrckpt", "orbax", "raw")
# Not run by default: zarrckpt with its per-chunk CRC-32C turned off, to measure what
# checksums cost (`--only zarrckpt,zarrckpt-nocrc`).
EXTRA_CONTENDERS = ("zarrckpt-nocrc",)
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
DEFAULT_DEVICES = 8
RAW_WORKERS = 8


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0,
                        help="total logical size of the pytree (default 1.0)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed save+restore rounds per contender, after "
                             "one untimed warm-up round (default 5)")
    parser.add_argument("--dir", default=None,
                        help="where checkpoints are written (default: a new "
                             "temporary directory under /tmp)")
    parser.add_argument("--only", default=",".join(CONTENDERS),
                        help="comma list of contenders (default: all of "
                             f"{','.join(CONTENDERS)})")
    parser.add_argument("--devices", type=int, default=None,
                        help=f"host devices to simulate (default "
                             f"{DEFAULT_DEVICES}, or the count already in "
                             f"XLA_FLAGS)")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(args.only) - set(CONTENDERS) - set(EXTRA_CONTENDERS))
    if unknown:
        parser.error(f"--only: unknown contender(s) {unknown}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def configure_jax_env(devices):
    """Point jax at N host devices; XLA reads these flags only once."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "").split()
    has_count = any(f.startswith(DEVICE_COUNT_FLAG) for f in flags)
    if devices is None and has_count:
        return  # the user's own XLA_FLAGS already chose a count
    flags = [f for f in flags if not f.startswith(DEVICE_COUNT_FLAG)]
    flags.append(f"{DEVICE_COUNT_FLAG}={devices or DEFAULT_DEVICES}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


# The environment has to be in place before jax is first imported.
ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    configure_jax_env(ARGS.devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402


# --------------------------------------------------------------------------
# The benchmark pytree
# --------------------------------------------------------------------------

# (name, share of the total bytes, column count, PartitionSpec). The shares
# mimic a transformer: most bytes in a few big matrices with assorted
# layouts, ~10% fully replicated.
MATRICES = (
    ("embed", 0.20, 1024, P(None, "model")),              # column-sharded
    ("attn_qkv", 0.15, 3072, P("data", "model")),         # both axes
    ("attn_out", 0.10, 2048, P("model", "data")),         # both, transposed
    ("mlp_up", 0.20, 4096, P("data", None)),              # rows; model replicas
    ("mlp_down", 0.15, 1024, P(("data", "model"), None)),  # rows over all 8
    ("lm_head", 0.10, 2048, P(None, "data")),             # columns; replicas
    ("rope_table", 0.06, 512, P()),                       # fully replicated
    ("norm_stats", 0.04, 256, P()),                       # fully replicated
)
SMALL_LAYERS = 24  # each has a bias and a scale: 48 small leaves + step
SMALL_LEN = 1024


def round_up(value, multiple):
    return max(multiple, -(-value // multiple) * multiple)


def make_mesh():
    devices = jax.devices()
    # Keep a 2-row mesh like a real data x model split; fall back to 1 row
    # when the device count is odd.
    rows = 2 if len(devices) % 2 == 0 else 1
    grid = np.array(devices).reshape(rows, len(devices) // rows)
    return Mesh(grid, ("data", "model"))


@functools.cache  # the 48 small leaves share two shapes: compile once each
def random_fn(shape, dtype, sharding):
    # Generated already sharded so no single device ever holds a whole leaf.
    return jax.jit(lambda key: jax.random.normal(key, shape, dtype),
                   out_shardings=sharding)


def build_tree(size_gib, mesh):
    """A pytree of ~size_gib float32, plus an int32 step, sharded on mesh."""
    n = mesh.size  # dims are multiples of n so every PartitionSpec divides
    total = int(size_gib * 2**30)
    key = jax.random.key(0)
    counter = itertools.count()

    def leaf(shape, spec):
        generate = random_fn(shape, jnp.float32, NamedSharding(mesh, spec))
        return generate(jax.random.fold_in(key, next(counter)))

    params = {}
    for name, share, cols, spec in MATRICES:
        cols = round_up(cols, n)
        rows = round_up(int(total * share) // (4 * cols), n)
        params[name] = leaf((rows, cols), spec)
    bias_len = round_up(SMALL_LEN, n)
    params["layers"] = {
        f"layer_{i:02d}": {"bias": leaf((bias_len,), P("model")),
                           "scale": leaf((bias_len,), P())}
        for i in range(SMALL_LAYERS)
    }
    step = jax.device_put(np.int32(1000), NamedSharding(mesh, P()))
    return jax.block_until_ready({"params": params, "step": step})


def tree_nbytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def replicated_nbytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)
               if x.sharding.is_fully_replicated)


# --------------------------------------------------------------------------
# Contenders: each is a context manager yielding (save, restore) callables.
# restore must return the restored pytree; the caller blocks on it.
# --------------------------------------------------------------------------

class Unavailable(Exception):
    """The contender cannot run in this environment; shown in its row."""


@contextlib.contextmanager
def zarrckpt_contender(tree, checksums=True):
    try:
        import zarrckpt
        save_pytree, load_pytree = zarrckpt.save_pytree, zarrckpt.load_pytree
    except Exception as exc:  # a half-written package fails in many ways
        raise Unavailable(f"not importable ({type(exc).__name__}: {exc})")

    def save(path, tree):
        save_pytree(path, tree, checksums=checksums)

    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)

    def restore(path, tree):
        # The same abstract target Orbax restores from; the source tree stays live
        # for verification, as it does for every contender.
        return load_pytree(path, target=abstract)

    yield save, restore


@contextlib.contextmanager
def orbax_contender(tree):
    try:
        import orbax.checkpoint as ocp
    except Exception as exc:
        raise Unavailable(f"n/a ({type(exc).__name__}: {exc})")

    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        tree)
    checkpointer = ocp.StandardCheckpointer()

    def save(path, tree):
        checkpointer.save(path, tree)
        # save() returns once the data is copied off the devices; the files
        # are written in the background, so the save is timed until durable.
        checkpointer.wait_until_finished()

    def restore(path, tree):
        return checkpointer.restore(path, abstract)

    try:
        yield save, restore
    finally:
        checkpointer.close()


def normalized_index(index, shape):
    return tuple(s.indices(dim)[:2] for s, dim in zip(index, shape))


def shard_filename(directory, leaf_number, index, shape):
    bounds = "".join(f"_{start}-{stop}"
                     for start, stop in normalized_index(index, shape))
    return os.path.join(directory, f"{leaf_number:03d}{bounds}.bin")


@contextlib.contextmanager
def raw_contender(tree):
    """Upper bound: shard bytes straight to files, no format, no metadata."""
    pool = concurrent.futures.ThreadPoolExecutor(RAW_WORKERS)

    def save(path, tree):
        os.makedirs(path)
        jobs = []
        for number, array in enumerate(jax.tree.leaves(tree)):
            for shard in array.addressable_shards:
                if shard.replica_id == 0:
                    name = shard_filename(path, number, shard.index,
                                          array.shape)
                    jobs.append(pool.submit(_write_shard, shard.data, name))
        for job in jobs:
            job.result()

    def restore(path, tree):
        leaves, treedef = jax.tree.flatten(tree)
        pending = [_submit_leaf_reads(pool, path, number, array)
                   for number, array in enumerate(leaves)]
        restored = []
        for array, jobs in zip(leaves, pending):
            pieces = [piece for job in jobs for piece in job.result()]
            restored.append(jax.make_array_from_single_device_arrays(
                array.shape, array.sharding, pieces))
        return jax.tree.unflatten(treedef, restored)

    try:
        yield save, restore
    finally:
        pool.shutdown()


def _write_shard(data, name):
    np.asarray(data).tofile(name)


def _submit_leaf_reads(pool, path, number, target):
    """Read each distinct shard once and put it on all of its replicas."""
    replicas = {}
    for device, index in target.sharding.addressable_devices_indices_map(
            target.shape).items():
        key = normalized_index(index, target.shape)
        replicas.setdefault(key, (index, []))[1].append(device)
    return [pool.submit(_read_shard, shard_filename(path, number, index,
                                                    target.shape),
                        target.dtype, devices, target.shape, index)
            for index, devices in replicas.values()]


def _read_shard(name, dtype, devices, shape, index):
    shard_shape = tuple(stop - start
                        for start, stop in normalized_index(index, shape))
    data = np.fromfile(name, dtype=dtype).reshape(shard_shape)
    return [jax.device_put(data, device) for device in devices]


CONTENDER_FACTORIES = {
    "zarrckpt": zarrckpt_contender,
    "zarrckpt-nocrc": functools.partial(zarrckpt_contender, checksums=False),
    "orbax": orbax_contender,
    "raw": raw_contender,
}


# --------------------------------------------------------------------------
# Running and reporting
# --------------------------------------------------------------------------

def verify(restored, original):
    """Fail loudly rather than report a throughput for a wrong restore."""
    restored_leaves, restored_def = jax.tree.flatten_with_path(restored)
    original_leaves, original_def = jax.tree.flatten_with_path(original)
    if restored_def != original_def:
        raise AssertionError(f"tree structure differs: {restored_def} "
                             f"!= {original_def}")
    for (path, got), (_, want) in zip(restored_leaves, original_leaves):
        where = jax.tree_util.keystr(path)
        if got.dtype != want.dtype or got.shape != want.shape:
            raise AssertionError(f"{where}: got {got.dtype}{got.shape}, "
                                 f"want {want.dtype}{want.shape}")
        if not got.sharding.is_equivalent_to(want.sharding, want.ndim):
            raise AssertionError(f"{where}: sharding {got.sharding} != "
                                 f"{want.sharding}")
        if not np.array_equal(np.asarray(got), np.asarray(want)):
            raise AssertionError(f"{where}: values differ")


def run_round(name, save, restore, tree, base_dir, label, check=False):
    """One save + restore into a fresh directory; returns the wall seconds of the save
    and the restore, then the CPU seconds (this process, all threads) of each."""
    path = os.path.join(base_dir, f"{name}-{label}")
    start, start_cpu = time.perf_counter(), time.process_time()
    save(path, tree)
    saved, saved_cpu = time.perf_counter(), time.process_time()
    restored = jax.block_until_ready(restore(path, tree))
    restored_at, restored_cpu = time.perf_counter(), time.process_time()
    if check:
        verify(restored, tree)
    del restored
    shutil.rmtree(path)
    gc.collect()
    print(f"  {name} {label}: save {saved - start:.3f}s ({saved_cpu - start_cpu:.3f}s CPU), "
          f"restore {restored_at - saved:.3f}s ({restored_cpu - saved_cpu:.3f}s CPU)", flush=True)
    return saved - start, restored_at - saved, saved_cpu - start_cpu, restored_cpu - saved_cpu


def run_all(names, tree, base_dir, repeats):
    """Seconds per round for each contender, rounds interleaved across contenders.

    Each contender first runs one untimed, verified warm-up round (Orbax, for one,
    pays ~2 s of first-use compilation); then round r of every contender runs before
    round r+1 of any, so the machine's drifting load falls on all of them alike.
    """
    results, active = {}, {}
    with contextlib.ExitStack() as stack:
        for name in names:
            try:
                save, restore = stack.enter_context(CONTENDER_FACTORIES[name](tree))
                run_round(name, save, restore, tree, base_dir, "warm-up", check=True)
                active[name] = (save, restore)
                results[name] = ([], [], [], [])
            except Unavailable as exc:
                results[name] = {"error": str(exc)}
                print(f"  {name}: {exc}", flush=True)
            except Exception as exc:  # report it and still bench the rest
                traceback.print_exc()
                results[name] = {"error": f"FAILED ({type(exc).__name__}: {exc})"}
        for round_number in range(repeats):
            for name, (save, restore) in active.items():
                measured = run_round(name, save, restore, tree, base_dir, f"round {round_number + 1}/{repeats}")
                for series, value in zip(results[name], measured):
                    series.append(value)
    return results


def summarize(seconds, cpu_seconds, nbytes):
    rates = [nbytes / 1e9 / s for s in seconds]
    return {"seconds": seconds, "best_gbps": max(rates),
            "median_gbps": statistics.median(rates),
            "cpu_seconds": cpu_seconds, "median_cpu_seconds": statistics.median(cpu_seconds)}


def package_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:  # e.g. zarrckpt used from a checkout through PYTHONPATH
        return f"{importlib.import_module(name).__version__} (not installed)"
    except Exception:
        return "n/a"


def versions():
    packages = ("jax", "jaxlib", "numpy", "zarr", "orbax-checkpoint",
                "tensorstore", "zarrckpt")
    return {"python": sys.version.split()[0],
            **{name: package_version(name) for name in packages}}


def ratio(results, numerator, denominator, phase, stat):
    try:
        return (results[numerator][phase][stat]
                / results[denominator][phase][stat])
    except KeyError:  # either side did not run
        return None


def ratios(results):
    out = {}
    for other in ("orbax", "raw"):
        for phase in ("save", "restore"):
            for stat in ("best_gbps", "median_gbps"):
                out[f"zarrckpt/{other} {phase} {stat.split('_')[0]}"] = \
                    ratio(results, "zarrckpt", other, phase, stat)
    return out


def print_table(results):
    print(f"\n{'contender':<14} | {'save GB/s best':>14} {'median':>7} {'CPU s':>6} | "
          f"{'restore GB/s best':>17} {'median':>7} {'CPU s':>6}")
    print("-" * 84)
    for name, result in results.items():
        if "error" in result:
            print(f"{name:<14} | {result['error']}")
            continue
        save, restore = result["save"], result["restore"]
        print(f"{name:<14} | {save['best_gbps']:>14.3f} {save['median_gbps']:>7.3f} "
              f"{save['median_cpu_seconds']:>6.3f} | {restore['best_gbps']:>17.3f} "
              f"{restore['median_gbps']:>7.3f} {restore['median_cpu_seconds']:>6.3f}")


def checksum_cost(results):
    """What CRC-32C costs: zarrckpt's time over zarrckpt-nocrc's, minus one, by wall
    time (best and median rounds) and by median CPU time (which other tenants of a
    shared machine disturb far less)."""
    try:
        on, off = results["zarrckpt"], results["zarrckpt-nocrc"]
        return {f"{phase} {stat}": (off[phase][f"{stat}_gbps"] / on[phase][f"{stat}_gbps"] - 1)
                for phase in ("save", "restore") for stat in ("best", "median")} | {
                f"{phase} cpu": on[phase]["median_cpu_seconds"] / off[phase]["median_cpu_seconds"] - 1
                for phase in ("save", "restore")}
    except KeyError:  # either side did not run
        return None


def print_checksum_cost(cost):
    if cost is not None:
        print("\nchecksum cost (zarrckpt over zarrckpt-nocrc):")
        for phase in ("save", "restore"):
            print(f"  {phase:<7}: wall best {cost[phase + ' best']:+.1%}, median {cost[phase + ' median']:+.1%}; "
                  f"CPU median {cost[phase + ' cpu']:+.1%}")


def print_ratios(ratio_values):
    print("\nratios (>1 means zarrckpt is faster):")
    for other in ("orbax", "raw"):
        for phase in ("save", "restore"):
            cells = []
            for stat in ("best", "median"):
                value = ratio_values[f"zarrckpt/{other} {phase} {stat}"]
                cells.append(f"{stat} " + ("n/a" if value is None
                                           else f"{value:.2f}"))
            print(f"  zarrckpt/{other:<5} {phase:<7}: {', '.join(cells)}")


def main(args):
    owns_dir = args.dir is None
    base_dir = tempfile.mkdtemp(prefix="zarrckpt-bench-") if owns_dir \
        else args.dir
    os.makedirs(base_dir, exist_ok=True)

    mesh = make_mesh()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()),
          flush=True)
    print(f"building a {args.size_gib} GiB tree ...", flush=True)
    tree = build_tree(args.size_gib, mesh)
    nbytes = tree_nbytes(tree)
    summary = {
        "leaves": len(jax.tree.leaves(tree)),
        "bytes": nbytes,
        "replicated_bytes": replicated_nbytes(tree),
        "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
        "mesh": dict(mesh.shape),
    }
    print(f"tree: {summary['leaves']} leaves, {nbytes:,} bytes "
          f"({nbytes / 2**30:.3f} GiB, "
          f"{summary['replicated_bytes'] / nbytes:.0%} fully replicated), "
          f"devices {summary['devices']}, mesh {summary['mesh']}", flush=True)
    print(f"checkpoints under {base_dir}; {args.repeats} round(s) each",
          flush=True)
    print("durability: this benchmark adds no fsync for any contender and "
          "never drops the page cache, so timings end when the data reaches "
          "the page cache; a library's own fsyncs stay in (Orbax's "
          "tensorstore file driver fsyncs its files by default, the raw "
          "ceiling never does)", flush=True)

    try:
        raw_results = run_all(args.only, tree, base_dir, args.repeats)
    finally:
        if owns_dir:
            shutil.rmtree(base_dir, ignore_errors=True)
    results = {name: r if isinstance(r, dict) else {"save": summarize(r[0], r[2], nbytes),
                                                     "restore": summarize(r[1], r[3], nbytes)}
               for name, r in raw_results.items()}

    print_table(results)
    ratio_values = ratios(results)
    print_ratios(ratio_values)
    print_checksum_cost(checksum_cost(results))
    sys.stdout.flush()

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": versions(), "tree": summary,
                       "size_gib": args.size_gib, "repeats": args.repeats,
                       "results": results, "ratios": ratio_values,
                       "checksum_cost": checksum_cost(results)},
                      f, indent=2)


if __name__ == "__main__":
    main(ARGS)
