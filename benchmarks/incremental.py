"""Writing only what changed: a LoRA-shaped fine-tune saved every step by a
CheckpointManager, with `reuse_unchanged` on and off, side by side in one run.

    python benchmarks/incremental.py                        # 512 MiB base; local disk and S3 (moto)
    python benchmarks/incremental.py --base-mib 2048 --targets local --saves 20

The state: a bf16 base of about --base-mib (an embedding and --layers layers of q, k, v,
o and a 4x MLP, each matrix sharded by rows over every device), frozen; rank-8 adapters
on q and v of every layer (f32) with their adam state, changed at every step. Each run
trains --saves steps and saves each step's state twice, side by side: by a manager with
reuse on and by one with it off, taking turns to go first (so that a shared machine's
slow spells fall on both). Two ways to keep the base frozen:
  same     the step returns only the adapters: the base stays the same arrays;
  rebuilt  the base comes back from the jitted step as new arrays with the same values
           (`base + 0`, as `optax.apply_updates` makes a frozen weight's zero update):
           reuse needs the fingerprints, and starts at the third save.
Measured per save (saves 3 on), best / median, and the ratio on / off both of the
medians and step by step (the median of each step's ratio):
  - bytes written: local, the bytes of the step's files that no other step links; S3,
    the bytes of the request bodies moto's server received;
  - a sync save (async_save=False) to the local disk: how long `save` takes;
  - an async save: how long `save` blocks training (then `wait`, not counted);
  - a training loop that saves every step asynchronously (a real LoRA step: a forward
    and backward pass of --batch tokens through the base and the adapters), with reuse
    on, off and no saves, taking turns round by round: how long `save` blocks per step,
    waiting for the save before it included, and how much longer a step takes than
    without saves;
  - a full fine-tune (every leaf changes at every step): the sync save's time;
  - restoring the newest step: a step saved with reuse against one saved whole.
Targets (issue 36): bytes <= 0.06x a full save; async blocking <= 0.1x and a sync save
<= 0.15x reuse turned off; a full fine-tune within 5% of reuse turned off; a restore as
fast as a whole step's.

Users' fine-tunes (issue 68; --targets nnx,processes,small), each with reuse on and off
side by side, per save (saves 2 on), best / median: the bytes written against the bytes
of the leaves that changed and a full save's, a sync save's time and an async `save`'s
blocking time:
  nnx        a flax NNX LoRA fine-tune (tests/nnx_lora.py): --nnx-blocks GPT-width decoder
             blocks (d=768), the bf16 base sharded by rows over every device,
             `nnx.LoRALinear` on q and v, an `nnx.Optimizer` over the LoRA parameters
             alone, an `nnx.jit` train step (which rebuilds every parameter), saved every
             step; target: bytes written <= 2x the bytes that changed;
  processes  the same fine-tune saved by --processes processes (jax.distributed on
             localhost, gloo, the devices split among them) and by one process; target:
             bytes within 1.1x of one process's;
  small      a frozen base of 64 leaves of 256 KiB rebuilt every step (`+ 0`) and a
             changing adapter; target: bytes <= 0.15x a full save.
The full fine-tune's row of the local disk (--targets local) is the fourth case: save
time with reuse on within 5% of reuse off.
"""

from __future__ import annotations

import argparse
import contextlib
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
    parser.add_argument("--saves", type=int, default=12,
                        help="saves per run (default 12; the first 2 not counted)")
    parser.add_argument("--restores", type=int, default=10, help="rounds of the restore comparison (default 10)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of the training loop, the first not counted (default 5; 0 skips it)")
    parser.add_argument("--loop-steps", type=int, default=8, help="steps of a round of the training loop (default 8)")
    parser.add_argument("--batch", type=int, default=64,
                        help="tokens of a step of the training loop (default 64)")
    parser.add_argument("--targets", default="local,s3,nnx,processes,small",
                        help="any of local, s3, nnx, processes, small (default all)")
    parser.add_argument("--nnx-blocks", type=int, default=4,
                        help="decoder blocks of the NNX fine-tune, d=768 (default 4)")
    parser.add_argument("--processes", type=int, default=4,
                        help="processes of the multi-process case (default 4; they share the devices)")
    parser.add_argument("--dir", default="/dev/shm",
                        help="where local runs write: in a new directory made there and removed at the end, "
                             "nothing else in it touched (default /dev/shm; a real disk for the disk's figures)")
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


def lora_step(optimizer, batch: int):
    """A LoRA fine-tune's step: a forward and backward pass of `batch` tokens through the
    frozen base with the adapters on q and v; an adam update of the adapters only."""
    import jax
    import jax.numpy as jnp
    import optax

    def lora(h, weight, adapter):
        return h @ weight + (h @ adapter["a"]) @ adapter["b"]

    def loss(adapters, base, tokens):
        h = base["embed"][tokens].astype(jnp.float32)
        for layer, adapter in zip(base["layers"], adapters):
            q, v = lora(h, layer["q"], adapter["q"]), lora(h, layer["v"], adapter["v"])
            h = h + (jax.nn.silu(q * (h @ layer["k"])) * v) @ layer["o"]
            h = h + jax.nn.gelu(h @ layer["up"]) @ layer["down"]
        return jnp.mean(h ** 2)

    @jax.jit
    def step(base, adapters, opt_state, seed):
        tokens = jax.random.randint(jax.random.key(seed), (batch,), 0, base["embed"].shape[0])
        updates, opt_state = optimizer.update(jax.grad(loss)(adapters, base, tokens), opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state

    return step


def training_loop(root: Path, state, optimizer, *, batch: int, rounds: int, steps: int) -> None:
    """Trains with a save at every step, as a training loop does (no `wait`: a save waits
    for the one before it), by a manager with reuse on, one with it off, and with no
    saves, each for `steps` steps a round, taking turns to go first. Prints, per step,
    how long `save` blocked and the step's time (from one step's start to the next's)."""
    import jax

    import zarrckpt

    base, adapters, opt_state = state
    step_fn = lora_step(optimizer, batch)
    settings = ("reuse on", "reuse off", "no saves")
    blocked: dict[str, list[float]] = {name: [] for name in settings}
    per_step: dict[str, list[float]] = {name: [] for name in settings}
    with contextlib.ExitStack() as stack:
        managers = {name: stack.enter_context(zarrckpt.CheckpointManager(
            str(root / f"loop-{name.replace(' ', '-')}"), keep_last=2, reuse_unchanged=name == "reuse on"))
            for name in settings[:2]}
        jax.block_until_ready(step_fn(base, adapters, opt_state, 0))  # compiled
        step = 0
        for r in range(rounds):
            for name in settings[r % 3:] + settings[:r % 3]:
                in_save = 0.0
                started = time.perf_counter()
                for _ in range(steps):
                    adapters, opt_state = step_fn(base, adapters, opt_state, step := step + 1)
                    if name in managers:
                        called = time.perf_counter()
                        managers[name].save(step, {"base": base, "adapters": adapters, "opt_state": opt_state})
                        in_save += time.perf_counter() - called
                jax.block_until_ready((adapters, opt_state))
                took = time.perf_counter() - started
                if name in managers:
                    managers[name].wait()  # the round's last save, out of the timed part
                if r:
                    blocked[name].append(in_save / steps)
                    per_step[name].append(took / steps)
    lost = {name: [t - plain for t, plain in zip(per_step[name], per_step["no saves"])] for name in settings[:2]}
    print(f"\ntraining loop, a save at every step ({batch} tokens a step; per step, best / median of "
          f"{rounds - 1} rounds of {steps} steps; ratio of medians, and the median of each round's ratio):")
    print("| | reuse on | reuse off | no saves | ratio |")
    print("|---|---|---|---|---|")
    print(f"| step | {best_median(per_step['reuse on'])} | {best_median(per_step['reuse off'])} | "
          f"{best_median(per_step['no saves'])} | |")
    print(f"| `save` blocks | {best_median(blocked['reuse on'])} | {best_median(blocked['reuse off'])} | | "
          f"{ratios(blocked['reuse on'], blocked['reuse off'])} |")
    print(f"| step's time above no saves | {best_median(lost['reuse on'])} | {best_median(lost['reuse off'])} | | "
          f"{ratios(lost['reuse on'], lost['reuse off'])} |")


def new_bytes(step_dir: Path) -> int:
    """Bytes of the files of `step_dir` that no other step links (the step before is
    still there when this runs)."""
    return sum(info.st_size for path in step_dir.rglob("*") if path.is_file()
               and (info := path.stat()).st_nlink == 1)


def run(urls: dict[bool, str], state, optimizer, *, mode: str, saves: int, asynchronous: bool,
        storage_options=None, server=None) -> dict[bool, dict[str, list[float]]]:
    """Trains `saves` steps; each step's state is saved by two managers side by side,
    reuse on and off (`urls` by `reuse_unchanged`), taking turns to go first, so that
    both meet the same moments of a shared machine. Returns, per manager, how long each
    `save` blocked and the bytes each wrote (saves 3 on)."""
    import jax

    import zarrckpt

    base, adapters, opt_state = state
    step_fn = trainer(optimizer, rebuilt=mode == "rebuilt", full=mode == "full")
    out: dict[bool, dict[str, list[float]]] = {reuse: {"blocked": [], "bytes": []} for reuse in urls}
    with contextlib.ExitStack() as stack:
        managers = {reuse: stack.enter_context(zarrckpt.CheckpointManager(
            url, reuse_unchanged=reuse, async_save=asynchronous, storage_options=storage_options))
            for reuse, url in urls.items()}
        for step in range(1, saves + 1):
            base, adapters, opt_state = step_fn(base, adapters, opt_state, step)
            jax.block_until_ready((base, adapters, opt_state))
            for reuse in sorted(urls, reverse=step % 2 == 1):
                if server is not None:
                    server.recorder.reset()
                started = time.perf_counter()
                managers[reuse].save(step, {"base": base, "adapters": adapters, "opt_state": opt_state})
                blocked = time.perf_counter() - started
                managers[reuse].wait()  # never two saves at once
                url = urls[reuse]
                written = (server.recorder.bytes_received if server is not None
                           else new_bytes(Path(url) / f"{step:010d}"))
                if step > 2:
                    out[reuse]["blocked"].append(blocked)
                    out[reuse]["bytes"].append(written)
                    # As retention would, out of the timed part: memory holds a few steps only.
                    older = f"{url.rstrip('/')}/{step - 2:010d}"
                    if server is None:
                        shutil.rmtree(older)
                    else:
                        import fsspec
                        fsspec.filesystem("s3", **storage_options).rm(older, recursive=True)
    return out


def best_median(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f}"


def ratios(on: list[float], off: list[float]) -> str:
    """The ratio of the medians, and the median of each pair's ratio (a step's two
    saves, a round's two restores: run back to back, so that a shared machine's slow
    spells touch both)."""
    step_by_step = statistics.median(a / b for a, b in zip(on, off))
    return f"{statistics.median(on) / statistics.median(off):.4g} | {step_by_step:.4g}"


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
    root = Path(tempfile.mkdtemp(prefix="zarrckpt-incremental-", dir=args.dir))
    full_save = frozen + changing
    try:
        if "local" in args.targets:
            results = {}
            for mode in ("same", "rebuilt", "full"):
                for asynchronous in ((False, True) if mode != "full" else (False,)):
                    urls = {reuse: str(root / f"{mode}-{reuse}-{asynchronous}") for reuse in (True, False)}
                    paired = run(urls, (base, adapters, opt_state), optimizer, mode=mode, saves=args.saves,
                                 asynchronous=asynchronous)
                    for reuse in paired:
                        results[mode, reuse, asynchronous] = paired[reuse]
            print("\nlocal disk (per save, best / median; ratio of medians, and the median of each step's "
                  "ratio):")
            print("| base | | reuse on | reuse off | ratio | step by step |")
            print("|---|---|---|---|---|---|")
            rows = [(mode, what, asynchronous) for mode in ("same", "rebuilt")
                    for what, asynchronous in (("bytes written (x a full save)", False), ("sync save, s", False),
                                               ("async save blocks, s", True))]
            for mode, what, asynchronous in [*rows, ("full", "sync save, s", False)]:
                key = "bytes" if what.startswith("bytes") else "blocked"
                on, off = results[mode, True, asynchronous][key], results[mode, False, asynchronous][key]
                scale = full_save if key == "bytes" else 1
                print(f"| {mode} | {what} | {best_median([v / scale for v in on])} | "
                      f"{best_median([v / scale for v in off])} | {ratios(on, off)} |")
            restore(root / "same-True-False", root / "same-False-False", args.saves, args.restores,
                    (base, adapters, opt_state))
            if args.rounds:
                training_loop(root, (base, adapters, opt_state), optimizer, batch=args.batch, rounds=args.rounds,
                              steps=args.loop_steps)
        if "s3" in args.targets:
            s3(root, (base, adapters, opt_state), optimizer, args.saves, full_save)
        if "nnx" in args.targets:
            users_case("nnx: flax NNX LoRA, d=768", root / "nnx", nnx_lora_steps(args.nnx_blocks), args.saves)
        if "small" in args.targets:
            users_case("small: 64 frozen leaves of 256 KiB rebuilt, an adapter", root / "small", small_leaves_steps(),
                       args.saves)
        if "processes" in args.targets:
            processes(root / "processes", args.processes, args.nnx_blocks, args.saves)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def restore(reused: Path, whole: Path, step: int, rounds: int, state) -> None:
    import jax

    import zarrckpt

    target = {"base": state[0], "adapters": state[1], "opt_state": state[2]}
    times: dict[str, list[float]] = {"reused": [], "whole": []}
    for r in range(rounds):
        for name, url in (("reused", reused), ("whole", whole))[::1 if r % 2 else -1]:  # turns going first
            started = time.perf_counter()
            jax.block_until_ready(zarrckpt.load_checkpoint(str(url), step, target))
            times[name].append(time.perf_counter() - started)
    print(f"\nrestore of the newest step, s: saved with reuse {best_median(times['reused'])}, saved whole "
          f"{best_median(times['whole'])} (ratio of medians, step by step: {ratios(times['reused'], times['whole'])})")


def s3(root: Path, state, optimizer, saves: int, full_save: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from object_store_servers import S3Server

    server = S3Server()
    try:
        bucket = server.new_bucket()
        results = run({reuse: f"s3://{bucket}/run-{reuse}" for reuse in (True, False)}, state, optimizer,
                      mode="same", saves=saves, asynchronous=False, storage_options=server.options(), server=server)
        on, off = results[True], results[False]
        share = {reuse: best_median([b / full_save for b in results[reuse]["bytes"]]) for reuse in results}
        print(f"\nS3 (moto on loopback), bytes the server received per save (x a full save): reuse on "
              f"{share[True]}, off {share[False]}; sync save, s: on {best_median(on['blocked'])}, "
              f"off {best_median(off['blocked'])}")
    finally:
        server.stop()


# -- users' fine-tunes (issue 68) ------------------------------------------------------------

def nnx_lora_steps(blocks: int):
    """A function making a fresh NNX LoRA fine-tune's steps: each call of what it returns
    trains a step and gives the state to save (`nnx.state((model, optimizer))`)."""
    import jax

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from jax.sharding import Mesh
    from nnx_lora import lora_fine_tune, state_of

    def fresh():
        model, optimizer, train = lora_fine_tune(Mesh(jax.devices(), ("fsdp",)), blocks=blocks)

        def advance(step: int):
            train(model, optimizer, step)
            return state_of(model, optimizer)

        return advance

    return fresh


def small_leaves_steps():
    """A function making fresh steps of a frozen base of 64 leaves of 256 KiB (sharded over
    every device), rebuilt as new arrays by each step, beside an adapter that changes."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    rows = NamedSharding(Mesh(jax.devices(), ("fsdp",)), P("fsdp"))

    @jax.jit
    def step_fn(state, seed):
        return {"base": jax.tree.map(lambda w: w + 0, state["base"]),
                "adapter": jax.random.normal(jax.random.key(seed), state["adapter"].shape)}

    def fresh():
        state = {"base": {f"w{i:02d}": jax.device_put(jax.random.normal(jax.random.key(i), (256, 256)), rows)
                          for i in range(64)}, "adapter": jnp.zeros((256, 8))}

        def advance(step: int):
            nonlocal state
            state = step_fn(state, step)
            return state

        return advance

    return fresh


def changed_bytes(before, after) -> int:
    """The bytes of the leaves of host copies `after` that differ from `before`'s."""
    return sum(b.nbytes for a, b in zip(before, after) if a.tobytes() != b.tobytes())


def save_side_by_side(urls: dict[bool, str], advance, saves: int, asynchronous: bool
                      ) -> tuple[dict[bool, dict[str, list[float]]], list[int], int]:
    """Trains `saves` steps (`advance`); each step's state is saved by two managers side by
    side, reuse on and off (`urls` by `reuse_unchanged`), taking turns to go first.
    Returns, per manager, how long each `save` blocked and the bytes its step's new files
    hold (saves 2 on), the bytes of the leaves each step changed, and a full save's bytes."""
    import jax
    import numpy as np

    import zarrckpt

    out: dict[bool, dict[str, list[float]]] = {reuse: {"blocked": [], "bytes": []} for reuse in urls}
    changed: list[int] = []
    before = None
    with contextlib.ExitStack() as stack:
        managers = {reuse: stack.enter_context(zarrckpt.CheckpointManager(
            url, reuse_unchanged=reuse, async_save=asynchronous, keep_last=2)) for reuse, url in urls.items()}
        for step in range(1, saves + 1):
            state = advance(step)
            jax.block_until_ready(state)
            now = [np.asarray(leaf) for leaf in jax.tree.leaves(state)]
            for reuse in sorted(urls, reverse=step % 2 == 1):
                started = time.perf_counter()
                managers[reuse].save(step, state)
                blocked = time.perf_counter() - started
                managers[reuse].wait()  # never two saves at once
                if step > 1:
                    out[reuse]["blocked"].append(blocked)
                    out[reuse]["bytes"].append(new_bytes(Path(urls[reuse]) / f"{step:010d}"))
            if before is not None:
                changed.append(changed_bytes(before, now))
            before = now
    return out, changed, sum(leaf.nbytes for leaf in before or [])


def users_case(title: str, root: Path, fresh, saves: int) -> None:
    """One of issue 68's cases on the local disk: bytes and sync save time (sync saves),
    then the async `save`'s blocking time, with reuse on and off."""
    sync, changed, full = save_side_by_side({reuse: str(root / f"sync-{reuse}") for reuse in (True, False)},
                                            fresh(), saves, asynchronous=False)
    asynchronous, _, _ = save_side_by_side({reuse: str(root / f"async-{reuse}") for reuse in (True, False)},
                                           fresh(), saves, asynchronous=True)
    on, off = sync[True]["bytes"], sync[False]["bytes"]
    print(f"\n{title}: a full save {full / 2**20:.2f} MiB, changed per save {best_median([c / 2**20 for c in changed])}"
          " MiB (per save, best / median; ratio of medians, and the median of each step's ratio):")
    print("| | reuse on | reuse off | ratio | step by step |")
    print("|---|---|---|---|---|")
    print(f"| bytes written, MiB | {best_median([v / 2**20 for v in on])} | {best_median([v / 2**20 for v in off])} | "
          f"{ratios(on, off)} |")
    print(f"| bytes written (x the bytes changed) | {best_median([v / c for v, c in zip(on, changed)])} | "
          f"{best_median([v / c for v, c in zip(off, changed)])} | | |")
    print(f"| bytes written (x a full save) | {best_median([v / full for v in on])} | "
          f"{best_median([v / full for v in off])} | | |")
    print(f"| sync save, s | {best_median(sync[True]['blocked'])} | {best_median(sync[False]['blocked'])} | "
          f"{ratios(sync[True]['blocked'], sync[False]['blocked'])} |")
    print(f"| async save blocks, s | {best_median(asynchronous[True]['blocked'])} | "
          f"{best_median(asynchronous[False]['blocked'])} | "
          f"{ratios(asynchronous[True]['blocked'], asynchronous[False]['blocked'])} |")


def processes(root: Path, count: int, blocks: int, saves: int) -> None:
    """The NNX fine-tune saved with reuse on by `count` processes sharing the devices
    (jax.distributed on localhost, gloo) and by one process holding them all: bytes
    written per save and a sync save's time (process 0's), side by side."""
    import json
    import socket
    import subprocess

    import jax

    devices = jax.device_count()
    results = {}
    for n in (1, count):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        directory = root / f"{n}-processes"
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={devices // n}")
        procs = [subprocess.Popen([sys.executable, __file__, "--process-of", f"127.0.0.1:{port}", str(n), str(pid),
                                   str(directory), str(blocks), str(saves)], env=env) for pid in range(n)]
        if any(proc.wait() for proc in procs):
            raise RuntimeError(f"the {n}-process job failed: exit codes {[proc.returncode for proc in procs]}")
        results[n] = json.loads((directory / "result.json").read_text())
    one, many = results[1], results[count]
    print(f"\nprocesses: the NNX fine-tune ({blocks} blocks) saved with reuse on by {count} processes of "
          f"{devices // count} devices and by 1 of {devices} (per save, best / median; ratio of medians, and "
          "the median of each step's ratio):")
    print(f"| | {count} processes | 1 process | ratio | step by step |")
    print("|---|---|---|---|---|")
    print(f"| bytes written, MiB | {best_median([v / 2**20 for v in many['bytes']])} | "
          f"{best_median([v / 2**20 for v in one['bytes']])} | {ratios(many['bytes'], one['bytes'])} |")
    print(f"| sync save, s | {best_median(many['blocked'])} | {best_median(one['blocked'])} | "
          f"{ratios(many['blocked'], one['blocked'])} |")


def process_of(coordinator: str, count: str, pid: str, directory: str, blocks: str, saves: str) -> None:
    """One process of `processes`' job: trains and saves the NNX fine-tune with reuse on;
    process 0 writes the bytes of each step's new files and how long each `save` took
    (saves 2 on) to DIRECTORY/result.json."""
    import json

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if int(count) > 1:
        jax.distributed.initialize(coordinator, num_processes=int(count), process_id=int(pid))

    import zarrckpt

    advance = nnx_lora_steps(int(blocks))()
    out: dict[str, list[float]] = {"bytes": [], "blocked": []}
    with zarrckpt.CheckpointManager(directory, async_save=False, keep_last=2) as mgr:
        for step in range(1, int(saves) + 1):
            state = advance(step)
            jax.block_until_ready(state)
            started = time.perf_counter()
            mgr.save(step, state)
            if step > 1:
                out["blocked"].append(time.perf_counter() - started)
                out["bytes"].append(new_bytes(Path(directory) / f"{step:010d}"))
    if jax.process_index() == 0:
        Path(directory, "result.json").write_text(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--process-of"]:
        process_of(*sys.argv[2:])
    else:
        main()
