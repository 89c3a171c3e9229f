"""A restore of two processes when one of them reads 10x slower than the other (a noisy
neighbour, a throttled NIC), against both reading fast.

    python benchmarks/slow_host.py                   # 4 leaves of 64 MiB, 10 ms and 1 GB/s per process, 5 rounds
    python benchmarks/slow_host.py --slow-factor 5 --size-mib 128

Two JAX processes on localhost (jax.distributed, gloo, 4 CPU devices each) restore one
checkpoint through benchmarks/object_store_latency.py's `latency://` store (a local
directory behind a latency per request and a bandwidth of its own per process): each
process its own store, process 1's --slow-factor times slower in both (the same bytes
on disk). Two states, each restored --rounds times after one:
  - data-parallel (every leaf replicated on every process): with load and broadcast,
    each chunk is read by one process and sent to the other over the device network,
    so a slow process holds both for its share;
  - fully sharded (each process holds and reads its own half).
Figures: the worst process's restore time, median of the rounds, both fast against one
slow, and their ratio. In the data-parallel state the fast process reads the slow one's
part too once it is late, and sends it over the device network (`_restore.relief`); the
slow one gives up its own reads of it. A fully sharded state has no such part: each
process reads what only its own devices hold.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as common  # noqa: E402  (the job launcher)
import multihost_scale as scale  # noqa: E402  (its job helpers: ports, environment, leaving)


def worker(coordinator: str, pid: int, directory: str, args: argparse.Namespace) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    pids = directory + ".pids"
    with open(os.path.join(pids, f"{pid}.tmp"), "w") as f:
        f.write(f"{os.getpid()} {scale.start_time(os.getpid())}")
    os.replace(os.path.join(pids, f"{pid}.tmp"), os.path.join(pids, str(pid)))
    jax.distributed.initialize(coordinator, num_processes=2, process_id=pid)
    import numpy as np
    import object_store_latency  # noqa: F401  (registers latency://)
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import zarrckpt

    mesh = Mesh(np.array(jax.devices()), ("x",))
    rows = int(args.size_mib * 2**20 / 4 / 4096 / 8) * 8
    host = np.random.default_rng(0).standard_normal((rows, 4096)).astype(np.float32)
    shardings = {"data-parallel": NamedSharding(mesh, P()), "fully sharded": NamedSharding(mesh, P("x"))}
    results = {}
    for name, sharding in shardings.items():
        local = os.path.join(directory, name.replace(" ", "-"))
        state = {f"w{i}": jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
                 for i in range(4)}
        zarrckpt.save_checkpoint(os.path.join(local, "run"), 1, state)  # the same bytes behind either store
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        for setting, factor in (("both fast", 1.0), ("process 1 slow", args.slow_factor)):
            mine = factor if pid == 1 else 1.0
            options = {"latency_s": args.latency_ms / 1000 * mine, "bandwidth": args.bandwidth_mb_s * 1e6 / mine,
                       "target_protocol": "file", "target_root": local}
            times = []
            for r in range(args.rounds + 1):
                multihost_utils.sync_global_devices(f"{name}-{setting}-{r}")
                started = time.perf_counter()
                jax.block_until_ready(zarrckpt.load_checkpoint("latency://run", 1, target, storage_options=options))
                if r:
                    times.append(time.perf_counter() - started)
            results[f"{name}, {setting}"] = times
    print("RESULT " + json.dumps({"pid": pid, "results": results}), flush=True)
    multihost_utils.sync_global_devices("reported")
    scale.leave_job(2, pid, pids)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=float, default=64.0, help="each of a state's 4 leaves (default 64)")
    parser.add_argument("--latency-ms", type=float, default=10.0, help="a fast process's, per request (default 10)")
    parser.add_argument("--bandwidth-mb-s", type=float, default=1000.0, help="a fast process's (default 1000)")
    parser.add_argument("--slow-factor", type=float, default=10.0, help="how much slower process 1 is (default 10)")
    parser.add_argument("--rounds", type=int, default=5, help="restores, after one (default 5)")
    parser.add_argument("--worker", nargs=3, metavar=("COORDINATOR", "PID", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.worker[2], args)
        return 0
    parent = tempfile.mkdtemp(prefix="zarrckpt-slow-host-")
    directory = os.path.join(parent, "run")
    os.makedirs(directory + ".pids")
    try:
        coordinator = f"127.0.0.1:{scale.free_port()}"
        forwarded = [f"--size-mib={args.size_mib}", f"--latency-ms={args.latency_ms}",
                     f"--bandwidth-mb-s={args.bandwidth_mb_s}", f"--slow-factor={args.slow_factor}",
                     f"--rounds={args.rounds}"]
        env = scale.child_env(4)
        env["PYTHONPATH"] = os.pathsep.join([HERE, env["PYTHONPATH"]])
        outputs = [result["results"] for result in common.run_job(
            [[sys.executable, __file__, *forwarded, "--worker", coordinator, str(pid), directory] for pid in range(2)],
            env, 1800)]
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    print(f"2 processes x 4 CPU devices, 4 leaves of {args.size_mib:g} MiB; a fast process: {args.latency_ms:g} ms a "
          f"request, {args.bandwidth_mb_s:g} MB/s; process 1 slow: {args.slow_factor:g}x both")
    for state in ("data-parallel", "fully sharded"):
        fast, slow = (statistics.median(max(out[f"{state}, {setting}"][r] for out in outputs)
                                        for r in range(args.rounds)) for setting in ("both fast", "process 1 slow"))
        print(f"  {state:14} both fast {fast:7.3f} s   process 1 slow {slow:7.3f} s   ratio {slow / fast:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
