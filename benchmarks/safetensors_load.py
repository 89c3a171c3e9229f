"""Hugging Face safetensors onto a mesh and into host memory: zarrckpt.load_safetensors
against `safetensors.numpy.load_file` (+ `jax.device_put`) and, for a large file, Orbax's
safetensors loading (`orbax.checkpoint.v1` with the SAFETENSORS layout), side by side.

Three cases (--cases), each written once in --dir:
- large: one file of --size-gib of bfloat16 matrices, as a language model's, onto every
  device of this process, each matrix's rows cut over all of them (FSDP);
- small: a small model as transformers saves one, two files and their index (27
  tensors, about 80 MiB, bfloat16 matrices and float32 norms), onto every device, rows
  cut where they divide: what a call costs beyond moving the bytes;
- many: one file of --tensors one-byte tensors, into host memory (no target): what
  each tensor costs.
Each round loads twice and waits until every array is ready: cold, after freed memory
went back to the OS (a process's first load: every page is new), then warm, at once
(a later load: the allocator still holds the pages). Best / median of --repeats rounds
after a warm-up one that checks every contender's values against the file, each
contender's peak resident memory above what the process held before its cold load
(VmHWM, reset before each), and zarrckpt's time over each other contender's (below 1:
zarrckpt is faster).

    python benchmarks/safetensors_load.py                   # all three, 8 CPU devices, /dev/shm
    python benchmarks/safetensors_load.py --cases small,many --tensors 1000000
    python benchmarks/safetensors_load.py --cases large --size-gib 8 --dir /local_ssd/bench   # on a GPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as common  # noqa: E402

CASES = ("large", "small", "many")
CONTENDERS = ("zarrckpt", "safetensors+device_put", "safetensors", "orbax")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {CASES}")
    parser.add_argument("--size-gib", type=float, default=1.0, help="the large file's size (default 1.0)")
    parser.add_argument("--tensors", type=int, default=10**5, help="the many case's tensors (default 100000)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--dir", default="/dev/shm", help="where the files go (default /dev/shm)")
    parser.add_argument("--only", default=",".join(CONTENDERS), help=f"comma-separated subset of {CONTENDERS}")
    common.add_platform_arguments(parser)
    return parser.parse_args(argv)


def write_file(path: str, size_gib: float, rows: int) -> dict[str, tuple[int, int]]:
    """Matrices of `rows` x 4096 bfloat16 (an 8B model's), about `size_gib` in all."""
    import ml_dtypes
    import numpy as np
    import safetensors.numpy

    count = max(1, int(size_gib * 2**30) // (rows * 4096 * 2))
    rng = np.random.default_rng(0)
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": rng.standard_normal((rows, 4096), np.float32).astype(
        ml_dtypes.bfloat16) for i in range(count)}
    safetensors.numpy.save_file(tensors, path)
    return {name: x.shape for name, x in tensors.items()}


def write_small_set(folder: str) -> dict[str, tuple]:
    """A 3-layer model of hidden size 1024 in two files and their index, as transformers
    writes a sharded one: 27 tensors, about 80 MiB. Its (shape, dtype) by name."""
    import ml_dtypes
    import numpy as np
    import safetensors.numpy

    hidden, mlp, vocab = 1024, 2304, 4096
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.norm.weight": (hidden,)}
    for layer in range(3):
        prefix = f"model.layers.{layer}."
        shapes.update({f"{prefix}self_attn.{p}_proj.weight": (hidden, hidden) for p in "qkvo"})
        shapes.update({f"{prefix}mlp.gate_proj.weight": (mlp, hidden), f"{prefix}mlp.up_proj.weight": (mlp, hidden),
                       f"{prefix}mlp.down_proj.weight": (hidden, mlp), f"{prefix}input_layernorm.weight": (hidden,)})
    rng = np.random.default_rng(0)
    tensors = {name: rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16 if len(shape) == 2 else
                                                                   np.float32) for name, shape in shapes.items()}
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in files.items():
        safetensors.numpy.save_file({n: tensors[n] for n in part}, os.path.join(folder, file))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: file for file, part in files.items() for n in part}}, f)
    return {name: (x.shape, x.dtype) for name, x in tensors.items()}


def write_many(path: str, count: int) -> None:
    """`count` one-byte tensors, a thousand to a group (`group.7.123`)."""
    import numpy as np
    import safetensors.numpy

    safetensors.numpy.save_file({f"group.{i // 1000}.{i % 1000}": np.array([i % 256], np.uint8)
                                 for i in range(count)}, path)


def nested(flat: dict):
    """`flat`, its names nested on '.'."""
    out: dict = {}
    for name, leaf in flat.items():
        node = out
        *outer, last = name.split(".")
        for part in outer:
            node = node.setdefault(part, {})
        node[last] = leaf
    return out


def _at(tree, name: str):
    for part in name.split("."):
        tree = tree[part]
    return tree


def large_case(args, folder: str):
    """The large case's description and contenders: each (load, flat view of its result)."""
    import jax
    import ml_dtypes
    import numpy as np
    import safetensors.numpy
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import zarrckpt

    path = os.path.join(folder, "model.safetensors")
    shapes = write_file(path, args.size_gib, rows=1024 * len(jax.devices()))
    rows = NamedSharding(Mesh(np.array(jax.devices()), ("fsdp",)), P("fsdp"))
    flat = {name: jax.ShapeDtypeStruct(shape, ml_dtypes.bfloat16, sharding=rows) for name, shape in shapes.items()}
    target = nested(flat)

    def orbax():
        from orbax.checkpoint import v1 as ocp

        with ocp.Context(checkpoint_layout=ocp.options.CheckpointLayout.SAFETENSORS):
            return jax.block_until_ready(ocp.load(path, abstract_state=flat))

    contenders = {
        "zarrckpt": (lambda: jax.block_until_ready(zarrckpt.load_safetensors(path, target)),
                     lambda loaded: {name: _at(loaded, name) for name in flat}),
        "safetensors+device_put": (lambda: jax.block_until_ready(
            {name: jax.device_put(x, rows) for name, x in safetensors.numpy.load_file(path).items()}), dict),
        "orbax": (orbax, dict),
    }
    described = (f"large: one {os.path.getsize(path) / 2**30:.2f} GiB file ({len(shapes)} bfloat16 matrices), onto "
                 f"{common.describe_platform()}, rows cut over every device")
    return described, contenders, lambda: safetensors.numpy.load_file(path)


def small_case(args, folder: str):
    """The small case's description and contenders (as `large_case`)."""
    import jax
    import numpy as np
    import safetensors.numpy
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import zarrckpt

    shapes = write_small_set(folder)
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))

    def sharding(shape):
        return NamedSharding(mesh, P("fsdp") if shape[0] % mesh.size == 0 else P())

    target = nested({name: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding(shape))
                     for name, (shape, dtype) in shapes.items()})

    def host():
        with open(os.path.join(folder, "model.safetensors.index.json")) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return {name: x for file in files
                for name, x in safetensors.numpy.load_file(os.path.join(folder, file)).items()}

    contenders = {
        "zarrckpt": (lambda: jax.block_until_ready(zarrckpt.load_safetensors(folder, target)),
                     lambda loaded: {name: _at(loaded, name) for name in shapes}),
        "safetensors+device_put": (lambda: jax.block_until_ready(
            {name: jax.device_put(x, sharding(x.shape)) for name, x in host().items()}), dict),
    }
    nbytes = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    described = (f"small: a set of 2 files and an index, {len(shapes)} tensors, {nbytes / 2**20:.1f} MiB (bfloat16 "
                 f"matrices, float32 norms), onto {common.describe_platform()}, rows cut where they divide")
    return described, contenders, host


def many_case(args, folder: str):
    """The many case's description and contenders (as `large_case`), into host memory."""
    import safetensors.numpy

    import zarrckpt

    path = os.path.join(folder, "many.safetensors")
    write_many(path, args.tensors)

    def flat(loaded):
        return {f"group.{group}.{i}": x for group, tensors in loaded.items() for i, x in tensors.items()}

    contenders = {
        "zarrckpt": (lambda: zarrckpt.load_safetensors(path), lambda loaded: flat(loaded["group"])),
        "safetensors": (lambda: safetensors.numpy.load_file(path), dict),
    }
    described = f"many: one file of {args.tensors:,} one-byte tensors ({os.path.getsize(path) / 2**20:.1f} MiB), " \
                "into host memory"
    return described, contenders, lambda: safetensors.numpy.load_file(path)


def measure(contenders: dict, want, repeats: int) -> tuple[dict, dict, dict[str, list[int]]]:
    """Each contender's cold and warm seconds and peak resident bytes (above the
    process's before its cold load) in each of `repeats` rounds, after a warm-up round
    that checks its values."""
    import numpy as np

    expected = want()
    cold: dict[str, list[float]] = {name: [] for name in contenders}
    warm: dict[str, list[float]] = {name: [] for name in contenders}
    peaks: dict[str, list[int]] = {name: [] for name in contenders}
    for r in range(repeats + 1):
        for name, (load, flat) in contenders.items():
            gc.collect()
            common.release_free_memory()
            before = common.rss_bytes()
            common.reset_peak_rss()
            started = time.perf_counter()
            loaded = load()
            seconds = time.perf_counter() - started
            peak = common.peak_rss_bytes() - before
            if r == 0:  # the warm-up round checks every value, bit for bit
                got = flat(loaded)
                assert got.keys() == expected.keys(), name
                for tensor, x in expected.items():
                    y = np.asarray(got[tensor])
                    assert y.dtype == x.dtype and y.shape == x.shape and y.tobytes() == x.tobytes(), (name, tensor)
                del got, loaded
                continue
            del loaded
            started = time.perf_counter()
            loaded = load()
            warm[name].append(time.perf_counter() - started)
            del loaded
            cold[name].append(seconds)
            peaks[name].append(peak)
    return cold, warm, peaks


def report(described: str, cold: dict[str, list[float]], warm: dict[str, list[float]], peaks: dict[str, list[int]],
           repeats: int) -> None:
    print(f"# {described}; best / median of {repeats} rounds, peak memory the highest")
    for name in cold:
        print(f"{name:24s} cold {common.fmt(cold[name])}   warm {common.fmt(warm[name])}   "
              f"peak memory +{max(peaks[name]) / 2**20:,.0f} MiB")
    for name in cold:
        if name != "zarrckpt" and "zarrckpt" in cold:
            print(f"zarrckpt / {name}: cold {ratios(cold['zarrckpt'], cold[name])}, "
                  f"warm {ratios(warm['zarrckpt'], warm[name])}")


def ratios(ours: list[float], theirs: list[float]) -> str:
    """Our times over theirs: 'best / median'."""
    return f"{min(ours) / min(theirs):.2f}x / {statistics.median(ours) / statistics.median(theirs):.2f}x"


def main(argv=None) -> int:
    args = parse_args(argv)
    common.setup_platform(args.platform, args.devices)
    only = [c for c in args.only.split(",") if c]
    builders = {"large": large_case, "small": small_case, "many": many_case}
    for case in (c for c in args.cases.split(",") if c):
        folder = tempfile.mkdtemp(prefix=f"st-{case}-", dir=args.dir)
        try:
            described, contenders, want = builders[case](args, folder)
            chosen = {name: contender for name, contender in contenders.items() if name in only}
            report(described, *measure(chosen, want, args.repeats), args.repeats)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
