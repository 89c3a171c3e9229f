"""Save/restore throughput of zarrckpt against Orbax and the raw ceiling.

Every contender checkpoints the same sharded pytree on the devices JAX has (8
simulated CPU devices without an accelerator; `--platform` chooses), ``--repeats``
times, each round into a fresh directory that is deleted afterwards, and each save
of a new state (computed on the devices, never copied to the host: a state copied
once is cached there and flatters everyone). Throughput is the tree's logical bytes
(each global array counted once, however many replicas it has) / 1e9 / seconds.
Peak host memory is the resident set above the baseline during the save, and during
the restore (the restored state included: on the CPU platform its arrays are host
memory, so a restore holding nothing else reads 1.0x the state's bytes).

The raw ceiling writes each shard's bytes to a file with as many threads as zarrckpt
writes with, no format and no metadata: on an accelerator after one batched copy
into pinned host memory, on the CPU straight from the device buffers; it restores
with as many threads of `np.fromfile` and a `device_put` per shard.

    python benchmarks/save_restore.py --size-gib 0.25 --repeats 1
    python benchmarks/save_restore.py --only zarrckpt,raw --json results.json
    python benchmarks/save_restore.py --restore-probe     # pageable vs pinned placement
"""

import argparse
import concurrent.futures
import contextlib
import functools
import gc
import importlib
import importlib.metadata
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

CONTENDERS = ("zarrckpt", "orbax", "raw")
# Not run by default: zarrckpt with its per-chunk CRC-32C turned off, to measure what
# checksums cost (`--only zarrckpt,zarrckpt-nocrc`).
EXTRA_CONTENDERS = ("zarrckpt-nocrc",)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0,
                        help="total logical size of the pytree (default 1.0)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed save+restore rounds per contender, after "
                             "one untimed warm-up round (default 5)")
    parser.add_argument("--dir", default=None,
                        help="where checkpoints are written: in a new directory "
                             "made there and removed at the end, nothing else in "
                             "it touched (default: the system's temporary "
                             "directory)")
    parser.add_argument("--only", default=",".join(CONTENDERS),
                        help="comma list of contenders (default: all of "
                             f"{','.join(CONTENDERS)})")
    parser.add_argument("--restore-probe", action="store_true",
                        help="also time two ways of putting host data on the devices, per leaf size: "
                             "device_put from pageable memory, and through pinned host memory")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the results as JSON to PATH")
    _common.add_platform_arguments(parser)
    args = parser.parse_args(argv)
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(args.only) - set(CONTENDERS) - set(EXTRA_CONTENDERS))
    if unknown:
        parser.error(f"--only: unknown contender(s) {unknown}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


# The environment has to be in place before jax is first imported.
ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    _common.setup_platform(ARGS.platform, ARGS.devices)

import jax  # noqa: E402

build_tree, make_mesh, tree_nbytes, replicated_nbytes = (_common.build_tree, _common.make_mesh,
                                                         _common.tree_nbytes, _common.replicated_nbytes)


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
        raise Unavailable(f"not importable ({type(exc).__name__}: {exc})") from exc

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
        raise Unavailable(f"n/a ({type(exc).__name__}: {exc})") from exc

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
    pool = concurrent.futures.ThreadPoolExecutor(_common.writer_threads())

    def save(path, tree):
        os.makedirs(path)
        names, shards = [], []
        for number, array in enumerate(jax.tree.leaves(tree)):
            for shard in array.addressable_shards:
                if shard.replica_id == 0:
                    names.append(shard_filename(path, number, shard.index, array.shape))
                    shards.append(shard.data)
        if jax.devices()[0].platform != "cpu":  # one batched DMA into pinned host memory
            shards = _common.pinned_copy({"shards": shards}, wait=False)[2]
        for job in [pool.submit(_write_shard, data, name) for data, name in zip(shards, names)]:
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
    # Durable, as zarrckpt's and Orbax's saves are: on stable storage before it counts.
    with open(name, "wb") as f:
        np.asarray(data).tofile(f)
        f.flush()
        os.fdatasync(f.fileno())


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
    """One save of a new state + restore into a fresh directory; returns the wall
    seconds of the save and the restore, the CPU seconds (this process, all threads)
    of each, and the peak host memory above the baseline during each (the restore's
    with the restored state in it, the source tree being in both baselines)."""
    path = os.path.join(base_dir, f"{name}-{label}")
    state = _common.fresh(tree)
    with _common.PeakMemory() as memory:
        start, start_cpu = time.perf_counter(), time.process_time()
        save(path, state)
        saved, saved_cpu = time.perf_counter(), time.process_time()
    del state
    with _common.PeakMemory() as restore_memory:
        restoring, restoring_cpu = time.perf_counter(), time.process_time()
        restored = jax.block_until_ready(restore(path, tree))
        restored_at, restored_cpu = time.perf_counter(), time.process_time()
    if check:
        verify(restored, tree)
    del restored
    shutil.rmtree(path)
    gc.collect()
    print(f"  {name} {label}: save {saved - start:.3f}s ({saved_cpu - start_cpu:.3f}s CPU, "
          f"+{memory.above / 2**20:.0f} MiB), restore {restored_at - restoring:.3f}s "
          f"({restored_cpu - restoring_cpu:.3f}s CPU, +{restore_memory.above / 2**20:.0f} MiB)", flush=True)
    return (saved - start, restored_at - restoring, saved_cpu - start_cpu, restored_cpu - restoring_cpu,
            memory.above, restore_memory.above)


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
                results[name] = ([], [], [], [], [], [])
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


def summarize(seconds, cpu_seconds, nbytes, peak):
    """Rates and CPU seconds of a phase's rounds, and its peak host memory above the
    baseline: each round's, and the median's ratio to the state's bytes."""
    rates = [nbytes / 1e9 / s for s in seconds]
    return {"seconds": seconds, "best_gbps": max(rates),
            "median_gbps": statistics.median(rates),
            "cpu_seconds": cpu_seconds, "median_cpu_seconds": statistics.median(cpu_seconds),
            "peak_host_bytes": peak, "peak_ratio": statistics.median(peak) / nbytes}


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
    """One row per contender; peak is the median round's host memory above the baseline,
    in MiB and as a multiple of the state's bytes."""
    print(f"\n{'contender':<14} | {'save GB/s best':>14} {'median':>7} {'CPU s':>6} {'peak MiB':>9} {'x':>5} | "
          f"{'restore GB/s best':>17} {'median':>7} {'CPU s':>6} {'peak MiB':>9} {'x':>5}")
    print("-" * 122)
    for name, result in results.items():
        if "error" in result:
            print(f"{name:<14} | {result['error']}")
            continue
        cells = []
        for phase, width in (("save", 14), ("restore", 17)):
            p = result[phase]
            cells.append(f"{p['best_gbps']:>{width}.3f} {p['median_gbps']:>7.3f} {p['median_cpu_seconds']:>6.3f} "
                         f"{statistics.median(p['peak_host_bytes']) / 2**20:>9.0f} {p['peak_ratio']:>5.2f}")
        print(f"{name:<14} | {cells[0]} | {cells[1]}")


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


PROBE_MIB = (1, 16, 64, 256)


def restore_probe(base_dir, repeats):
    """Per leaf size: seconds to read a file and put it on one device, from pageable
    memory (`device_put` of the numpy array) and through pinned host memory (a
    `device_put` into it, then one onto the device)."""
    device = jax.devices()[0]
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    on_device = jax.sharding.SingleDeviceSharding(device, memory_kind=device.default_memory().kind)
    print(f"\nrestore probe on {device.platform}: read + place one leaf, best / median of {repeats}", flush=True)
    results = {}
    for mib in PROBE_MIB:
        path = os.path.join(base_dir, f"probe-{mib}.bin")
        np.random.default_rng(0).standard_normal(mib * 2**18).astype(np.float32).tofile(path)
        rows = {"pageable": [], "pinned": []}
        for r in range(repeats + 1):  # the first round warms up
            for how, series in rows.items():
                start = time.perf_counter()
                host = np.fromfile(path, np.float32)
                placed = jax.device_put(jax.device_put(host, pinned) if how == "pinned" else host, on_device)
                placed.block_until_ready()
                if r:
                    series.append(time.perf_counter() - start)
                del placed, host
        os.remove(path)
        results[mib] = rows
        print(f"  {mib:4d} MiB: pageable {_common.fmt(rows['pageable'], 's', 4)}; "
              f"pinned {_common.fmt(rows['pinned'], 's', 4)}", flush=True)
    return results


def main(args):
    if args.dir is not None:
        os.makedirs(args.dir, exist_ok=True)
    base_dir = tempfile.mkdtemp(prefix="zarrckpt-bench-", dir=args.dir)

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
        "devices": _common.describe_platform(),
        "mesh": dict(mesh.shape),
    }
    print(f"tree: {summary['leaves']} leaves, {nbytes:,} bytes "
          f"({nbytes / 2**30:.3f} GiB, "
          f"{summary['replicated_bytes'] / nbytes:.0%} fully replicated), "
          f"devices {summary['devices']}, mesh {summary['mesh']}", flush=True)
    print(f"checkpoints under {base_dir}; {args.repeats} round(s) each",
          flush=True)
    print("durability: every contender's save ends with its data on stable "
          "storage (zarrckpt and the raw ceiling sync each file, Orbax's "
          "tensorstore file driver does by default); on tmpfs a sync costs "
          "nothing", flush=True)

    try:
        raw_results = run_all(args.only, tree, base_dir, args.repeats)
        probe = restore_probe(base_dir, args.repeats) if args.restore_probe else None
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)
    results = {name: r if isinstance(r, dict) else {"save": summarize(r[0], r[2], nbytes, r[4]),
                                                     "restore": summarize(r[1], r[3], nbytes, r[5])}
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
                       "results": results, "ratios": ratio_values, "restore_probe": probe,
                       "checksum_cost": checksum_cost(results)},
                      f, indent=2)


if __name__ == "__main__":
    main(ARGS)
