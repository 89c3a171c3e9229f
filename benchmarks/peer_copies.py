"""Peer copies of the local tier (`local_peer_copies`): what they cost a save, and what
they save a restore after a lost host, on a fully sharded state (every leaf cut over all
devices, as FSDP does: no process holds a replica of another's shards).

Two JAX processes on this machine (jax.distributed, gloo; 4 CPU devices each, or the
accelerators of a real job), each with a local directory of its own. Each round, after a
warm-up one:
  - local save, async, without and with one peer copy: how long `save` blocks
    training, until the copy is committed, and the bytes each process writes and moves
    to its peer over the device network;
  - a restart with no host lost, from each process's own copy (what the device network
    adds below is the difference);
  - a lost host: process 1's local directory is deleted and the job restarts: restore
    from the peer copies (0 bytes from the persistent store), against a restore of the
    same state from a persistent store with --latency-ms per request (`latency://` of
    benchmarks/object_store_latency.py over a directory both processes share).
Times are the slowest process's; best / median over --repeats rounds.

    python benchmarks/peer_copies.py                        # 1 GiB, 3 rounds, /dev/shm
    python benchmarks/peer_copies.py --size-gib 4 --local-dir /local_ssd/bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PROCESSES, DEVICES = 2, 4


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="the state's size (default 1.0)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="per request of the persistent store")
    parser.add_argument("--bandwidth-mb-s", type=float, default=1000.0, help="of the persistent store, per process")
    parser.add_argument("--local-dir", default="/dev/shm", help="where the local tiers go (default /dev/shm)")
    parser.add_argument("--worker", nargs=4, metavar=("COORDINATOR", "PID", "DIRECTORY", "ARGS"),
                        help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def fsdp_tree(size_gib: float, mesh):
    """About `size_gib` of float32 in 8 matrices and 16 small vectors, every one cut by
    rows over all the mesh's devices."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    sys.path.insert(0, HERE)
    import _common as common

    n, cols = mesh.size, 1024
    rows = common._round_up(int(size_gib * 2**30) // (8 * 4 * cols), n)
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    key = jax.random.key(0)
    tree = {f"w{i}": common._random_fn((rows, cols), jnp.float32, sharding)(jax.random.fold_in(key, i))
            for i in range(8)}
    tree["small"] = {f"b{i}": common._random_fn((n * 128,), jnp.float32, sharding)(jax.random.fold_in(key, 100 + i))
                     for i in range(16)}
    return jax.block_until_ready(tree)


def size_of(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def worker(coordinator: str, pid: int, directory: str, args) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=PROCESSES, process_id=pid)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    sys.path.insert(0, HERE)
    import _common as common
    import object_store_latency  # noqa: F401  (registers latency://)

    import zarrckpt

    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    state = fsdp_tree(args.size_gib, mesh)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    store = {"latency_s": args.latency_ms / 1000, "bandwidth": args.bandwidth_mb_s * 1e6, "target_protocol": "file",
             "target_root": os.path.join(directory, "store")}
    rows = []
    for r in range(args.repeats + 1):  # the first round warms up (compilation)
        row: dict[str, float] = {}
        persistent = os.path.join(directory, f"p{r}")
        local = {peers: os.path.join(args.local_dir, os.path.basename(directory), f"l{r}-{peers}", f"host{pid}")
                 for peers in (0, 1)}
        for peers in (0, 1):
            multihost_utils.sync_global_devices(f"save-{r}-{peers}")
            with zarrckpt.CheckpointManager(persistent, save_interval_steps=1000, local_directory=local[peers],
                                            local_save_interval_steps=1, local_peer_copies=peers) as mgr:
                fresh = common.fresh(state)
                started = time.perf_counter()
                mgr.save(1, fresh)
                row[f"local save{' + 1 peer copy' if peers else ''}: blocked"] = time.perf_counter() - started
                mgr.wait()
                row[f"local save{' + 1 peer copy' if peers else ''}: committed"] = time.perf_counter() - started
                del fresh
            row[f"bytes written{' + 1 peer copy' if peers else ''}"] = size_of(local[peers])
        row["bytes moved to the peer"] = row["bytes written + 1 peer copy"] - row["bytes written"]
        shutil.rmtree(local[0])
        url = f"latency://{persistent}-store"
        with zarrckpt.CheckpointManager(url, storage_options=store, async_save=False) as mgr:
            mgr.save(1, state)  # the same step, to the slow persistent store
        multihost_utils.sync_global_devices(f"whole-{r}")
        with zarrckpt.CheckpointManager(persistent, local_directory=local[1], local_save_interval_steps=1,
                                        local_peer_copies=1) as mgr:
            row["restore, no host lost: own copies"] = common.timed_restore(mgr, target, step=1, tier="local")
        multihost_utils.sync_global_devices(f"lost-{r}")
        if pid == 1:
            shutil.rmtree(local[1])  # a replaced host: its disk is gone
        multihost_utils.sync_global_devices(f"restore-{r}")
        with zarrckpt.CheckpointManager(persistent, local_directory=local[1], local_save_interval_steps=1,
                                        local_peer_copies=1) as mgr:
            row["restore, lost host: from peers"] = common.timed_restore(mgr, target, step=1, tier="local")
        multihost_utils.sync_global_devices(f"store-{r}")
        with zarrckpt.CheckpointManager(url, storage_options=store) as mgr:
            row[f"restore from the store ({args.latency_ms:g} ms)"] = common.timed_restore(
                mgr, target, step=1, tier="persistent")
        shutil.rmtree(local[1], ignore_errors=True)
        if r:
            rows.append(row)
    print("RESULT " + json.dumps({"pid": pid, "rows": rows, "nbytes": common.tree_nbytes(state),
                                  "leaves": len(jax.tree.leaves(state)), "platform": common.describe_platform()}),
          flush=True)
    multihost_utils.sync_global_devices("reported")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        coordinator, pid, directory, _ = args.worker
        worker(coordinator, int(pid), directory, args)
        return 0
    sys.path.insert(0, HERE)
    import _common as common

    directory = tempfile.mkdtemp(prefix="peers-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}")
    rest = [a for a in (argv if argv is not None else sys.argv[1:])]
    try:
        results = common.run_job([[sys.executable, __file__, *rest, "--worker", f"127.0.0.1:{port}", str(pid),
                                   directory, "-"] for pid in range(PROCESSES)], env, 3600)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(os.path.join(args.local_dir, os.path.basename(directory)), ignore_errors=True)
    first = results[0]
    print(f"# peer copies: {first['nbytes'] / 2**30:.2f} GiB in {first['leaves']} leaves, every one sharded over "
          f"all devices, {PROCESSES} processes on {first['platform']}; local tiers in {args.local_dir}; "
          f"persistent store {args.latency_ms:g} ms per request, {args.bandwidth_mb_s:g} MB/s per process; "
          f"slowest process, best / median of {args.repeats} rounds after a warm-up")
    names = list(first["rows"][0])
    for name in names:
        values = [max(result["rows"][r][name] for result in results) for r in range(args.repeats)]
        print(f"{name:40s} " + (f"{min(values) / 2**20:.0f} MiB per process" if name.startswith("bytes")
                                 else common.fmt(values)))
    best = {name: min(max(result["rows"][r][name] for result in results) for r in range(args.repeats))
            for name in names}
    store = f"restore from the store ({args.latency_ms:g} ms)"
    print(f"{'store / peers restore':40s} {best[store] / best['restore, lost host: from peers']:.1f}x (best)")
    print(f"{'peer copy / local save, blocked':40s} "
          f"{best['local save + 1 peer copy: blocked'] / best['local save: blocked']:.2f}x (best)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
