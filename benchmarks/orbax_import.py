"""An Orbax run moved to zarrckpt: `zarrckpt.import_checkpoint` against the route that
needs no import (Orbax's restore onto the devices, then `zarrckpt.save_pytree`) and
against copying the run's files (the disk's ceiling), side by side in one run.

The run (one step of --size-gib of float32 matrices, each sharded over every device, as
`ocp.CheckpointManager` saves it) is written once in --dir; each round moves it to a new
directory there. Best / median of --repeats rounds after a warm-up one, and each
contender's peak resident memory above what the process held before it (VmHWM, reset
before each one): an import holds about its byte budget, the restore route the state.

    python benchmarks/orbax_import.py                   # 1 GiB, 8 CPU devices, /dev/shm
    python benchmarks/orbax_import.py --size-gib 8 --dir /local_ssd/bench   # on a GPU host
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as common  # noqa: E402

CONTENDERS = ("zarrckpt import", "orbax restore + save_pytree", "copy files")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="the state's size (default 1.0)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--dir", default="/dev/shm", help="where the runs go (default /dev/shm)")
    parser.add_argument("--max-inflight-mib", type=int, default=256, help="the import's byte budget (default 256)")
    common.add_platform_arguments(parser)
    return parser.parse_args(argv)


def resident() -> tuple[int, int]:
    """This process's resident bytes now and at their peak since `reset_peak`."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: the peak resident size starts again from the current one


def main(argv=None) -> int:
    args = parse_args(argv)
    common.setup_platform(args.platform, args.devices)
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import zarrckpt

    folder = tempfile.mkdtemp(prefix="orbax-import-", dir=args.dir)
    try:
        rows = NamedSharding(Mesh(np.array(jax.devices()), ("fsdp",)), P("fsdp"))
        count = max(1, int(args.size_gib * 2**30) // (1024 * len(jax.devices()) * 4096 * 4))
        # Random values: Orbax compresses its chunks, and constant ones would cost nothing to read.
        keys = jax.random.split(jax.random.key(0), count)
        state = {"params": {f"layer_{i}": jax.device_put(jax.random.normal(keys[i], (1024 * len(jax.devices()), 4096)),
                                                         rows) for i in range(count)}, "step": 1000}
        want = {name: np.asarray(x) for name, x in state["params"].items()}
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state["params"]))
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                if isinstance(x, jax.Array) else x, state)
        run = os.path.join(folder, "orbax")
        with ocp.CheckpointManager(run) as mgr:
            mgr.save(1000, args=ocp.args.StandardSave(state))
            mgr.wait_until_finished()
        del state

        def imported(dst: str) -> None:
            zarrckpt.import_checkpoint(run, dst, max_inflight_bytes=args.max_inflight_mib * 2**20)

        def restored_and_saved(dst: str) -> None:
            with ocp.CheckpointManager(run) as mgr:
                restored = mgr.restore(1000, args=ocp.args.StandardRestore(abstract))
            zarrckpt.save_checkpoint(dst, 1000, restored)

        def copied(dst: str) -> None:
            shutil.copytree(run, dst)

        runs = {"zarrckpt import": imported, "orbax restore + save_pytree": restored_and_saved, "copy files": copied}
        times: dict[str, list[float]] = {c: [] for c in CONTENDERS}
        peaks: dict[str, list[int]] = {c: [] for c in CONTENDERS}
        for r in range(args.repeats + 1):
            for name in CONTENDERS:
                dst = os.path.join(folder, f"dst-{r}-{CONTENDERS.index(name)}")
                common.release_free_memory()
                before, _ = resident()
                reset_peak()
                started = time.perf_counter()
                runs[name](dst)
                seconds = time.perf_counter() - started
                peak = resident()[1] - before
                if r == 0 and name != "copy files":  # the warm-up round checks the values
                    back = zarrckpt.load_checkpoint_if_it_exists(dst, abstract)[0]
                    assert back["step"] == 1000
                    for key, x in back["params"].items():
                        assert np.array_equal(np.asarray(x), want[key]), key
                    del back
                elif r > 0:
                    times[name].append(seconds)
                    peaks[name].append(peak)
                shutil.rmtree(dst)
        print(f"# an Orbax run of {nbytes / 2**30:.2f} GiB ({count} float32 matrices, rows over every device) in "
              f"{args.dir}, {common.describe_platform()}; import budget {args.max_inflight_mib} MiB; "
              f"best / median of {args.repeats} rounds")
        for name in CONTENDERS:
            best, median = min(times[name]), statistics.median(times[name])
            print(f"{name:28s} {best:.3f} / {median:.3f} s  ({nbytes / 1e9 / best:.2f} GB/s best), "
                  f"peak memory +{max(peaks[name]) / 2**20:.0f} MiB")
        for name in CONTENDERS[1:]:
            print(f"zarrckpt import vs {name:28s} {min(times[name]) / min(times[CONTENDERS[0]]):.2f}x (best), "
                  f"{statistics.median(times[name]) / statistics.median(times[CONTENDERS[0]]):.2f}x (median)")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
