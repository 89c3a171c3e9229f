"""A Hugging Face safetensors file onto a mesh: zarrckpt.load_safetensors against
`safetensors.numpy.load_file` + `jax.device_put` and against Orbax's safetensors
loading (`orbax.checkpoint.v1` with the SAFETENSORS layout), side by side in one run.

The file (--size-gib of bfloat16 matrices, as a language model's, in --dir) is written
once; each round loads it onto every device of this process, each matrix's rows cut over
all of them (FSDP), and waits until every array is ready. Best / median of --repeats
rounds after a warm-up one; every contender's result is checked against the file once.

    python benchmarks/safetensors_load.py                   # 1 GiB, 8 CPU devices, /dev/shm
    python benchmarks/safetensors_load.py --size-gib 8 --dir /local_ssd/bench   # on a GPU
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

CONTENDERS = ("zarrckpt", "safetensors+device_put", "orbax")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="the file's size (default 1.0)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--dir", default="/dev/shm", help="where the file goes (default /dev/shm)")
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


def main(argv=None) -> int:
    args = parse_args(argv)
    common.setup_platform(args.platform, args.devices)
    import jax
    import numpy as np
    import safetensors.numpy
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import zarrckpt

    only = [c for c in args.only.split(",") if c]
    folder = tempfile.mkdtemp(prefix="st-", dir=args.dir)
    path = os.path.join(folder, "model.safetensors")
    try:
        shapes = write_file(path, args.size_gib, rows=1024 * len(jax.devices()))
        rows = NamedSharding(Mesh(np.array(jax.devices()), ("fsdp",)), P("fsdp"))
        import ml_dtypes

        flat = {name: jax.ShapeDtypeStruct(shape, ml_dtypes.bfloat16, sharding=rows) for name, shape in shapes.items()}
        nested: dict = {}
        for name, leaf in flat.items():
            node = nested
            *outer, last = name.split(".")
            for part in outer:
                node = node.setdefault(part, {})
            node[last] = leaf

        def ours():
            loaded = zarrckpt.load_safetensors(path, nested)
            return {name: _at(loaded, name) for name in flat}

        def plain():
            host = safetensors.numpy.load_file(path)
            return {name: jax.device_put(host[name], rows) for name in flat}

        def orbax():
            from orbax.checkpoint import v1 as ocp

            with ocp.Context(checkpoint_layout=ocp.options.CheckpointLayout.SAFETENSORS):
                return ocp.load(path, abstract_state=flat)

        runs = {"zarrckpt": ours, "safetensors+device_put": plain, "orbax": orbax}
        host = safetensors.numpy.load_file(path)
        times: dict[str, list[float]] = {c: [] for c in only}
        for r in range(args.repeats + 1):
            for name in only:
                common.release_free_memory()
                started = time.perf_counter()
                loaded = jax.block_until_ready(runs[name]())
                seconds = time.perf_counter() - started
                if r == 0:  # the warm-up round checks every value
                    for tensor, want in host.items():
                        got = np.asarray(loaded[tensor])
                        assert got.dtype == want.dtype and np.array_equal(got.view(np.uint16), want.view(np.uint16))
                else:
                    times[name].append(seconds)
                del loaded
        nbytes = os.path.getsize(path)
        print(f"# {nbytes / 2**30:.2f} GiB safetensors file ({len(shapes)} bfloat16 matrices) in {args.dir} onto "
              f"{common.describe_platform()}, rows cut over every device; best / median of {args.repeats} rounds")
        for name in only:
            best, median = min(times[name]), statistics.median(times[name])
            print(f"{name:24s} {best:.3f} / {median:.3f} s  ({nbytes / 1e9 / best:.2f} GB/s best)")
        if "zarrckpt" in only:
            for name in only:
                if name != "zarrckpt":
                    print(f"zarrckpt vs {name:24s} {min(times[name]) / min(times['zarrckpt']):.2f}x (best), "
                          f"{statistics.median(times[name]) / statistics.median(times['zarrckpt']):.2f}x (median)")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def _at(tree, name: str):
    for part in name.split("."):
        tree = tree[part]
    return tree


if __name__ == "__main__":
    sys.exit(main())
