"""Multi-host scale on one machine: what each process costs as processes are added, and
10,000 small leaves against Orbax.

Part 1 runs 1, 2, 4, 8 and 16 JAX processes on localhost (jax.distributed, gloo, one CPU
device each), each holding a small data-parallel state (every leaf replicated on every
process, as data-parallel replicas hold it), and measures per process count: save and
restore time, coordination-service calls per process, store requests and bytes read per
process, and the store bytes read by all processes over the checkpoint's bytes. The
counts come from zarrckpt._util.stats. The state is small so that 16 processes on 2 cores
measure coordination and traffic, not CPU.

Part 2 saves and restores 10,000 leaves of 4 KiB, each sharded over 8 CPU devices in one
process, with zarrckpt and with Orbax's StandardCheckpointer in the same run, and
counts the files each writes.

    python benchmarks/multihost_scale.py                       # both parts
    python benchmarks/multihost_scale.py --processes 1,2,4 --rounds 3 --no-leaves
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _common as common  # noqa: E402  (the job launcher; it imports no jax)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", default="1,2,4,8,16", help="process counts (default 1,2,4,8,16)")
    parser.add_argument("--rounds", type=int, default=3, help="timed save+restore rounds per count (default 3)")
    parser.add_argument("--leaves", type=int, default=10_000, help="leaves of part 2 (default 10000)")
    parser.add_argument("--leaf-rounds", type=int, default=3, help="timed rounds of part 2 (default 3)")
    parser.add_argument("--no-leaves", action="store_true", help="skip part 2")
    parser.add_argument("--no-scale", action="store_true", help="skip part 1")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    return parser.parse_args(argv)


def child_env(devices):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    return env


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- part 1: a worker of a multi-process job ------------------------------------------


def start_time(pid):
    """When process `pid` started (field 22 of /proc/<pid>/stat: with the pid, one process
    even if the pid is reused); None once it has exited: gone, or a zombie not yet reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ", which may hold spaces
    return None if fields[0] in ("Z", "X", "x") else fields[19]  # fields[0] is field 3, the state


def leave_job(count, pid, pids):
    """os._exit, with process 0, which hosts the coordination service, last: the
    coordination client of a process still running when the service goes away aborts it
    (SIGABRT), so the others leave at once and process 0 waits (60 s at most) until each
    of them has exited. JAX's own shutdown barrier is skipped: 16 JAX processes on 2 cores
    can miss heartbeats in it, and the measurements are in."""
    sys.stdout.flush()
    sys.stderr.flush()
    if pid == 0:
        deadline = time.monotonic() + 60
        for other in range(1, count):
            with open(os.path.join(pids, str(other))) as f:
                other_pid, started = f.read().split()
            while start_time(int(other_pid)) == started and time.monotonic() < deadline:
                time.sleep(0.02)
    os._exit(0)


def scale_worker(coordinator, count, pid, directory, rounds):
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Each process's pid, for process 0 to wait on when leaving (leave_job); written
    # before joining, so once the job is up every process's file is there.
    pids = directory + ".pids"
    with open(os.path.join(pids, f"{pid}.tmp"), "w") as f:
        f.write(f"{os.getpid()} {start_time(os.getpid())}")
    os.replace(os.path.join(pids, f"{pid}.tmp"), os.path.join(pids, str(pid)))
    if count > 1:
        jax.distributed.initialize(coordinator, num_processes=count, process_id=pid)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import zarrckpt
    from zarrckpt._util import stats as _stats

    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, P())

    def leaf(shape, seed):
        host = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
        return jax.make_array_from_callback(shape, replicated, lambda index: host[index])

    # Data-parallel state: 4 MiB of params and optimizer state (8 leaves of 512 KiB) and
    # 32 small leaves (biases, norms) of 4 KiB, all replicated on every process.
    state = {"params": {f"w{i}": leaf((256, 512), i) for i in range(8)},
             "small": {f"b{i}": leaf((1024,), 100 + i) for i in range(32)}, "step": 0}
    target = jax.tree.map(lambda x: x.sharding if isinstance(x, jax.Array) else x, state)
    checkpoint_bytes = sum(x.nbytes for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
    rows = []
    for r in range(rounds + 1):  # the first round warms up (compilation, imports)
        row = {}
        for what in ("save", "restore"):
            multihost_utils.sync_global_devices(f"{what}-{r}")
            _stats.reset()
            started = time.perf_counter()
            if what == "save":
                zarrckpt.save_checkpoint(directory, r + 1, {**state, "step": r + 1})
            else:
                restored, step = zarrckpt.load_checkpoint_if_it_exists(directory, target)
                jax.block_until_ready(restored)
                assert step == r + 1
            row[f"{what}_s"] = time.perf_counter() - started
            counts = _stats.snapshot()
            row[f"{what}_calls"] = counts.get("coordination_calls", 0)
            row[f"{what}_requests"] = sum(v for k, v in counts.items() if k.startswith("store_")
                                          and not k.startswith("store_bytes"))
            row[f"{what}_bytes_read"] = counts.get("store_bytes_read", 0)
        if r:
            rows.append(row)
    medians = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    print("RESULT " + json.dumps({"pid": pid, "checkpoint_bytes": checkpoint_bytes, **medians}), flush=True)
    multihost_utils.sync_global_devices("reported")
    leave_job(count, pid, pids)


def run_scale(count, rounds, parent):
    directory = os.path.join(parent, f"p{count}")
    os.makedirs(directory + ".pids")  # see leave_job
    port = free_port()
    results = common.run_job([[sys.executable, __file__, "--worker", f"127.0.0.1:{port}", str(count), str(pid),
                               directory, str(rounds)] for pid in range(count)], child_env(1), 1800)
    shutil.rmtree(directory, ignore_errors=True)
    shutil.rmtree(directory + ".pids", ignore_errors=True)
    checkpoint = results[0]["checkpoint_bytes"]

    def worst(key):
        return max(r[key] for r in results)

    return {"processes": count, "save_s": worst("save_s"), "restore_s": worst("restore_s"),
            "save_calls": worst("save_calls"), "restore_calls": worst("restore_calls"),
            "save_requests": worst("save_requests"), "restore_requests": worst("restore_requests"),
            "bytes_read_per_process": worst("restore_bytes_read"),
            "read_over_checkpoint": sum(r["restore_bytes_read"] for r in results) / checkpoint,
            "checkpoint_bytes": checkpoint}


def print_scale(rows):
    print("\npart 1: data-parallel state (every leaf on every process), 1 CPU device per process, "
          "median of rounds, worst process")
    header = ("procs", "save s", "restore s", "coord calls/proc save", "coord calls/proc restore",
              "store req/proc save", "store req/proc restore", "MB read/proc", "read / checkpoint")
    print(" | ".join(header))
    for r in rows:
        print(" | ".join([f"{r['processes']:5d}", f"{r['save_s']:6.3f}", f"{r['restore_s']:9.3f}",
                          f"{r['save_calls']:21.0f}", f"{r['restore_calls']:24.0f}", f"{r['save_requests']:19.0f}",
                          f"{r['restore_requests']:22.0f}", f"{r['bytes_read_per_process'] / 1e6:12.3f}",
                          f"{r['read_over_checkpoint']:17.2f}"]))
    print(f"checkpoint: {rows[0]['checkpoint_bytes'] / 1e6:.2f} MB, 41 leaves")


# -- part 2: 10,000 small leaves, zarrckpt against Orbax ------------------------------------


def leaves_worker(count, rounds, parent):
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import zarrckpt

    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    host = np.arange(1024, dtype=np.float32)
    tree = {f"layer{i:05d}": jax.make_array_from_callback((1024,), sharding, lambda index: host[index])
            for i in range(count)}
    targets = {k: v.sharding for k, v in tree.items()}
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in tree.items()}

    def files(path):
        return sum(len(names) for _, _, names in os.walk(path))

    results = {}
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    contenders = {
        "zarrckpt": (lambda path: zarrckpt.save_pytree(path, tree), lambda path: zarrckpt.load_pytree(path, targets)),
        "orbax": (lambda path: (checkpointer.save(path, tree), checkpointer.wait_until_finished()),
                  lambda path: checkpointer.restore(path, abstract)),
    }
    for r in range(rounds + 1):  # round 0 warms up
        for name, (save, restore) in contenders.items():
            path = os.path.join(parent, f"{name}-{r}")
            started = time.perf_counter()
            save(path)
            saved = time.perf_counter() - started
            started = time.perf_counter()
            jax.block_until_ready(restore(path))
            restored = time.perf_counter() - started
            entry = results.setdefault(name, {"save": [], "restore": [], "files": files(path)})
            if r:
                entry["save"].append(saved)
                entry["restore"].append(restored)
            print(f"  {name} round {r}/{rounds}: save {saved:.2f}s, restore {restored:.2f}s", flush=True)
    checkpointer.close()
    # Deleted only now: ext4 without a journal (this development machine's disk) skips
    # inodes freed in the last minutes when it makes files: 20,000 files deleted between
    # rounds made the next save of as many files spend 13 s in the kernel instead of 2.
    for r in range(rounds + 1):
        for name in contenders:
            shutil.rmtree(os.path.join(parent, f"{name}-{r}"), ignore_errors=True)
    print("RESULT " + json.dumps(results), flush=True)


def run_leaves(count, rounds, parent):
    proc = subprocess.run([sys.executable, __file__, "--leaves-worker", str(count), str(rounds), parent],
                          env=child_env(8), capture_output=True, text=True, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"the 10,000-leaf run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("  ")))
    return json.loads(lines[-1][len("RESULT "):])


def print_leaves(results, count):
    print(f"\npart 2: {count:,} leaves of 4 KiB, each sharded over 8 CPU devices, one process; best / median")
    print("contender | save s            | restore s         | files written")
    for name, r in results.items():
        print(f"{name:9} | {min(r['save']):6.2f} / {statistics.median(r['save']):6.2f}   | "
              f"{min(r['restore']):6.2f} / {statistics.median(r['restore']):6.2f}   | {r['files']:,}")
    z, o = results["zarrckpt"], results["orbax"]
    print(f"zarrckpt/orbax speed-up: save best {min(o['save']) / min(z['save']):.1f}x, median "
          f"{statistics.median(o['save']) / statistics.median(z['save']):.1f}x; restore best "
          f"{min(o['restore']) / min(z['restore']):.1f}x, median "
          f"{statistics.median(o['restore']) / statistics.median(z['restore']):.1f}x")


def main():
    if sys.argv[1:2] == ["--worker"]:
        coordinator, count, pid, directory, rounds = sys.argv[2:]
        return scale_worker(coordinator, int(count), int(pid), directory, int(rounds))
    if sys.argv[1:2] == ["--leaves-worker"]:
        count, rounds, parent = sys.argv[2:]
        return leaves_worker(int(count), int(rounds), parent)
    args = parse_args()
    parent = tempfile.mkdtemp(prefix="zarrckpt-scale-", dir=args.dir)
    report = {}
    try:
        if not args.no_scale:
            rows = []
            for count in (int(n) for n in args.processes.split(",")):
                rows.append(run_scale(count, args.rounds, parent))
                print(f"  {count} process(es) done", flush=True)
            print_scale(rows)
            report["scale"] = rows
        if not args.no_leaves:
            report["leaves"] = run_leaves(args.leaves, args.leaf_rounds, parent)
            print_leaves(report["leaves"], args.leaves)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
