"""The local tier against the persistent one: the same state saved and restored by a
CheckpointManager to a local directory (a RAM disk by default) and to a far-away store
with a fixed latency per request (`latency://` of benchmarks/object_store_latency.py:
20 ms and 1 GB/s by default), side by side in one run, with the pinned-host copy
(what any save must at least do before training may go on) as the ceiling.

    python benchmarks/two_tiers.py                        # 1 GiB, 3 rounds, /dev/shm
    python benchmarks/two_tiers.py --size-gib 8 --local-dir /local_ssd/bench

Each round makes a fresh state on the devices (as a train step leaves it), then:
  - local save, sync (`async_save=False`), and async: how long `save` blocks training,
    and until the copy is committed;
  - persistent save, sync and async, through the slow store;
  - restore from the local tier, and from the persistent tier (a manager without one).
Best / median over --repeats rounds, after one warm-up round.
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
import _common as common  # noqa: E402
import jax  # noqa: E402
import object_store_latency  # noqa: E402, F401  (registers latency://, sets up the platform)

import zarrckpt  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="the state's size (default 1.0)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="per request of the persistent store")
    parser.add_argument("--bandwidth-mb-s", type=float, default=1000.0, help="of the persistent store")
    parser.add_argument("--local-dir", default="/dev/shm", help="where the local tier goes (default /dev/shm)")
    return parser.parse_args(argv)


def one_round(state, target, local_root: str, options: dict) -> dict[str, float]:
    persistent = f"latency://zarrckpt-tiers/{uuid.uuid4().hex}"
    local = tempfile.mkdtemp(prefix="tiers-", dir=local_root)
    times = {}
    try:
        _, copied, copies = common.pinned_copy(common.fresh(state))
        del copies
        times["pinned copy (ceiling)"] = copied
        tiers = dict(storage_options=options, local_directory=local, save_interval_steps=3,
                     local_save_interval_steps=1)
        with zarrckpt.CheckpointManager(persistent, async_save=False, **tiers) as mgr:
            fresh = common.fresh(state, 1)
            started = time.perf_counter()
            mgr.save(1, fresh)  # local only
            times["local save (sync)"] = time.perf_counter() - started
            fresh = common.fresh(state, 2)
            started = time.perf_counter()
            mgr.save(2, fresh)  # local only
            times["local save (sync, 2nd)"] = time.perf_counter() - started
        with zarrckpt.CheckpointManager(persistent, async_save=True, **tiers) as mgr:
            fresh = common.fresh(state, 3)
            started = time.perf_counter()
            mgr.save(4, fresh)  # local only
            times["local save (async): blocked"] = time.perf_counter() - started
            mgr.wait()
            times["local save (async): committed"] = time.perf_counter() - started
        with zarrckpt.CheckpointManager(persistent, async_save=False, storage_options=options) as mgr:
            fresh = common.fresh(state, 4)
            started = time.perf_counter()
            mgr.save(2, fresh, force=True)
            times["persistent save (sync)"] = time.perf_counter() - started
        with zarrckpt.CheckpointManager(persistent, async_save=True, storage_options=options) as mgr:
            fresh = common.fresh(state, 5)
            started = time.perf_counter()
            mgr.save(3, fresh, force=True)
            times["persistent save (async): blocked"] = time.perf_counter() - started
            mgr.wait()
            times["persistent save (async): committed"] = time.perf_counter() - started
        del fresh
        with zarrckpt.CheckpointManager(persistent, **tiers) as mgr:
            times["local restore"] = common.timed_restore(mgr, target, step=4, tier="local")  # newer than 3
        with zarrckpt.CheckpointManager(persistent, storage_options=options) as mgr:
            times["persistent restore"] = common.timed_restore(mgr, target, step=3, tier="persistent")
    finally:
        shutil.rmtree(local, ignore_errors=True)
    return times


def main(argv=None) -> int:
    args = parse_args(argv)
    options = {"latency_s": args.latency_ms / 1000, "bandwidth": args.bandwidth_mb_s * 1e6}
    mesh = common.make_mesh()
    state = common.build_tree(args.size_gib, mesh)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    print(f"# two tiers: {common.tree_nbytes(state) / 2**30:.2f} GiB in {len(jax.tree.leaves(state))} leaves on "
          f"{common.describe_platform()}; local tier in {args.local_dir}; persistent store {args.latency_ms:g} ms "
          f"per request, {args.bandwidth_mb_s:g} MB/s; best / median of {args.repeats} rounds after a warm-up")
    rounds = []
    for r in range(args.repeats + 1):
        times = one_round(state, target, args.local_dir, options)
        print(f"  {'warm-up' if r == 0 else f'round {r}'}: " + ", ".join(f"{k} {v:.3f}s" for k, v in times.items()),
              flush=True)  # a run cut short still says what it measured
        rounds += [times] if r else []
    for name in rounds[0]:
        print(f"{name:32s} {common.fmt([r[name] for r in rounds])}")
    local, persistent = ([r[f"{t} save (sync)"] for r in rounds] for t in ("local", "persistent"))
    print(f"{'persistent / local save':32s} {min(persistent) / min(local):.1f}x (best)")
    print(f"{'persistent / local restore':32s} "
          f"{min(r['persistent restore'] for r in rounds) / min(r['local restore'] for r in rounds):.1f}x (best)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
