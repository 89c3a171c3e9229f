"""Writing only what changed: a LoRA-shaped fine-tune saved every step by a
CheckpointManager, with `reuse_unchanged` on and off, side by side in one run.

    python benchmarks/incremental.py                        # 512 MiB base; local disk and S3 (moto)
    python benchmarks/incremental.py --base-mib 2048 --targets local --saves 8

The state: a bf16 base of about --base-mib (an embedding and --layers layers of q, k, v,
o and a 4x MLP, each matrix sharded by rows over every device), frozen; rank-8 adapters
on q and v of every layer (f32) with their adam state, changed at every step. Each run
trains one step between saves and saves every step, --saves saves. Two ways to keep the
base frozen:
  same     the step returns only the adapters: the base stays the same arrays;
  rebuilt  the base comes back from the jitted step as new arrays with the same values
           (`base + 0`, as `optax.apply_updates` makes a frozen weight's zero update):
           reuse needs the fingerprints, and starts at the third save.
Measured per save (saves 3 on), best / median:
  - bytes written: local, the bytes of the step's files that no other step links; S3,
    the bytes of the request bodies moto's server received;
  - a sync save (async_save=False) to the local disk: how long `save` takes;
  - an async save: how long `save` blocks training (then `wait`, not counted);
  - a full fine-tune (every leaf changes at every step): the sync save's time;
  - restoring the newest step: a step saved with reuse against one saved whole.
Targets (issue 36): bytes <= 0.06x a full save; async blocking <= 0.1x and a sync save
<= 0.15x reuse turned off; a full fine-tune within 5% of reuse turned off; a restore as
fast as a whole step's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-mib", type=float, default=512, help="size of the frozen base (default 512)")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers of the base (default 4)")
    parser.add_argument("--saves", type=int, default=6, help="saves per run (default 6; the first 2 not counted)")
    parser.add_argument("--restores", type=int, default=5, help="rounds of the restore comparison (default 5)")
    parser.add_argument("--targets", default="local,s3", help="local, s3 or both (default local,s3)")
    parser.add_argument("--dir", default=None, help="where local runs write (default: a new directory on /dev/shm)")
    _common.add_platform_arguments(parser)
    return parser.parse_args(argv)


def lora_state(base_mib: float, layers: int):
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = jax.devices()
    rows = NamedSharding(Mesh(devices, ("fsdp",)), P("fsdp", None))
    # Per layer 4 d*d + 8 d*d bf16 parameters, plus an embedding of 4 d rows: solve for d.
    d = int(((base_mib * 2**20 / 2) / (12 * layers + 4)) ** 0.5) // (8 * len(devices)) * (8 * len(devices))
    key = iter(jax.random.split(jax.random.key(0), 8 * layers + 2))

    def matrix(shape):
        make = jax.jit(lambda k: (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(jnp.bfloat16),
                       out_shardings=rows)
        return make(next(key))

    base = {"embed": matrix((4 * d, d)),
            "layers": [{"q": matrix((d, d)), "k": matrix((d, d)), "v": matrix((d, d)), "o": matrix((d, d)),
                        "up": matrix((d, 4 * d)), "down": matrix((4 * d, d))} for _ in range(layers)]}
    adapters = [{name: {"a": jax.random.normal(next(key), (d, 8)) * 0.01, "b": jnp.zeros((8, d))}
                 for name in ("q", "v")} for _ in range(layers)]
    optimizer = optax.adam(1e-3)
    return base, adapters, optimizer.init(adapters), optimizer


def nbytes(tree) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(tree))


def trainer(optimizer, rebuilt: bool, full: bool):
    """One step: new adapters and their optimizer state; the base as given, rebuilt
    with the same values, or (a full fine-tune) changed."""
    import jax
    import optax

    @jax.jit
    def step(base, adapters, opt_state, seed):
        grads = jax.tree.map(lambda a: jax.random.normal(jax.random.key(seed), a.shape, a.dtype), adapters)
        updates, opt_state = optimizer.update(grads, opt_state, adapters)
        adapters = optax.apply_updates(adapters, updates)
        if full:
            base = jax.tree.map(lambda w: w + (jax.random.uniform(jax.random.key(seed), w.shape) < 0.5).astype(w.dtype)
                                * w.dtype.type(1e-2), base)
        else:  # a jitted function's outputs are new arrays: `base + 0` or not, the values are the same
            base = jax.tree.map(lambda w: w + w.dtype.type(0), base)
        return base, adapters, opt_state

    if rebuilt or full:
        return step

    def keeping_the_base(base, adapters, opt_state, seed):  # the step's base output is dropped
        return (base, *step(base, adapters, opt_state, seed)[1:])

    return keeping_the_base


def new_bytes(step_dir: Path) -> int:
    """Bytes of the files of `step_dir` that no other step links (the step before is
    still there when this runs)."""
    return sum(info.st_size for path in step_dir.rglob("*") if path.is_file()
               and (info := path.stat()).st_nlink == 1)


def run(url: str, state, optimizer, *, reuse: bool, mode: str, saves: int, asynchronous: bool,
        storage_options=None, server=None) -> dict[str, list[float]]:
    import jax

    import zarrckpt

    base, adapters, opt_state = state
    step_fn = trainer(optimizer, rebuilt=mode == "rebuilt", full=mode == "full")
    out: dict[str, list[float]] = {"blocked": [], "bytes": []}
    with zarrckpt.CheckpointManager(url, reuse_unchanged=reuse, async_save=asynchronous,
                                    storage_options=storage_options) as mgr:
        for step in range(1, saves + 1):
            base, adapters, opt_state = step_fn(base, adapters, opt_state, step)
            jax.block_until_ready((base, adapters, opt_state))
            if server is not None:
                server.recorder.reset()
            started = time.perf_counter()
            mgr.save(step, {"base": base, "adapters": adapters, "opt_state": opt_state})
            blocked = time.perf_counter() - started
            mgr.wait()
            written = server.recorder.bytes_received if server is not None else new_bytes(Path(url) / f"{step:010d}")
            if step > 2:
                out["blocked"].append(blocked)
                out["bytes"].append(written)
            if step > 2:  # as retention would, out of the timed part: memory holds a few steps only
                older = f"{url.rstrip('/')}/{step - 2:010d}"
                if server is None:
                    shutil.rmtree(older)
                else:
                    import fsspec
                    fsspec.filesystem("s3", **storage_options).rm(older, recursive=True)
    return out


def best_median(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f}"


def main(argv=None) -> None:
    args = parse_args(argv)
    _common.setup_platform(args.platform, args.devices)
    import jax

    import zarrckpt

    base, adapters, opt_state, optimizer = lora_state(args.base_mib, args.layers)
    frozen, changing = nbytes(base), nbytes(adapters) + nbytes(opt_state)
    print(f"{_common.describe_platform()}; base {frozen / 2**20:.0f} MiB bf16 ({len(jax.tree.leaves(base))} "
          f"matrices), changing {changing / 2**20:.2f} MiB ({100 * frozen / (frozen + changing):.1f}% frozen); "
          f"zarrckpt {zarrckpt.__version__}, jax {jax.__version__}")
    root = Path(args.dir or tempfile.mkdtemp(prefix="zarrckpt-incremental-", dir="/dev/shm"))
    full_save = frozen + changing
    try:
        if "local" in args.targets:
            results = {}
            for mode in ("same", "rebuilt", "full"):
                for reuse in (True, False):
                    for asynchronous in ((False, True) if mode != "full" else (False,)):
                        url = str(root / f"{mode}-{reuse}-{asynchronous}")
                        results[mode, reuse, asynchronous] = run(
                            url, (base, adapters, opt_state), optimizer, reuse=reuse, mode=mode,
                            saves=args.saves, asynchronous=asynchronous)
            print("\nlocal disk (per save, best / median):")
            print("| base | | reuse on | reuse off | ratio (median) |")
            print("|---|---|---|---|---|")
            for mode in ("same", "rebuilt"):
                on, off = results[mode, True, False], results[mode, False, False]
                print(f"| {mode} | bytes written (x a full save) | {best_median([b / full_save for b in on['bytes']])} "
                      f"| {best_median([b / full_save for b in off['bytes']])} | "
                      f"{statistics.median(on['bytes']) / statistics.median(off['bytes']):.4f} |")
                print(f"| {mode} | sync save, s | {best_median(on['blocked'])} | {best_median(off['blocked'])} | "
                      f"{statistics.median(on['blocked']) / statistics.median(off['blocked']):.3f} |")
                on, off = results[mode, True, True], results[mode, False, True]
                print(f"| {mode} | async save blocks, s | {best_median(on['blocked'])} | "
                      f"{best_median(off['blocked'])} | "
                      f"{statistics.median(on['blocked']) / statistics.median(off['blocked']):.3f} |")
            on, off = results["full", True, False], results["full", False, False]
            print(f"| full fine-tune | sync save, s | {best_median(on['blocked'])} | {best_median(off['blocked'])} | "
                  f"{statistics.median(on['blocked']) / statistics.median(off['blocked']):.3f} |")
            restore(root / "same-True-False", root / "same-False-False", args.saves, args.restores,
                    (base, adapters, opt_state))
        if "s3" in args.targets:
            s3(root, (base, adapters, opt_state), optimizer, args.saves, full_save)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def restore(reused: Path, whole: Path, step: int, rounds: int, state) -> None:
    import jax

    import zarrckpt

    target = {"base": state[0], "adapters": state[1], "opt_state": state[2]}
    times: dict[str, list[float]] = {"reused": [], "whole": []}
    for _ in range(rounds):
        for name, url in (("reused", reused), ("whole", whole)):
            started = time.perf_counter()
            jax.block_until_ready(zarrckpt.load_checkpoint(str(url), step, target))
            times[name].append(time.perf_counter() - started)
    ratio = statistics.median(times["reused"]) / statistics.median(times["whole"])
    print(f"\nrestore of the newest step, s: saved with reuse {best_median(times['reused'])}, saved whole "
          f"{best_median(times['whole'])} (ratio of medians {ratio:.3f})")


def s3(root: Path, state, optimizer, saves: int, full_save: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from object_store_servers import S3Server

    server = S3Server()
    try:
        results = {}
        for reuse in (True, False):
            url = f"s3://{server.new_bucket()}/run"
            results[reuse] = run(url, state, optimizer, reuse=reuse, mode="same", saves=saves, asynchronous=False,
                                 storage_options=server.options(), server=server)
        on, off = results[True], results[False]
        share = {reuse: best_median([b / full_save for b in results[reuse]["bytes"]]) for reuse in results}
        print(f"\nS3 (moto on loopback), bytes the server received per save (x a full save): reuse on "
              f"{share[True]}, off {share[False]}; sync save, s: on {best_median(on['blocked'])}, "
              f"off {best_median(off['blocked'])}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
