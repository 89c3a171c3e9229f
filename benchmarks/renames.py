"""What `rename=` costs a restore of many leaves: the same checkpoint restored onto a
target named as the checkpoint (no rename) and onto one whose every name differs in a
module and a layer name (`rename=` pairs that map each back), taking turns.

    python benchmarks/renames.py                      # 10,000 leaves of 1 KiB, 5 rounds
    python benchmarks/renames.py --leaves 2000 --rounds 3

Figures: each restore's seconds, best and median of the rounds, and the ratio of the
medians. Both read the same bytes (the log's figures say so).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as common  # noqa: E402  (sets the platform up before jax)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leaves", type=int, default=10_000, help="leaves of the state (default 10,000)")
    parser.add_argument("--leaf-kib", type=float, default=1.0, help="each leaf's size (default 1 KiB)")
    parser.add_argument("--rounds", type=int, default=5, help="restores of each kind, after one (default 5)")
    common.add_platform_arguments(parser)
    args = parser.parse_args()
    common.setup_platform(args.platform, args.devices)

    import jax
    import numpy as np

    import zarrckpt

    per_layer = 2
    layers = args.leaves // per_layer
    size = max(1, int(args.leaf_kib * 1024 / 4))
    values = np.arange(size, dtype=np.float32)
    state = {"params": {"encoder": {f"Dense_{i}": {"kernel": jax.numpy.asarray(values + i),
                                                   "bias": jax.numpy.asarray(values - i)}
                                    for i in range(layers)}}}
    target_same = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    target_renamed = {"params": {"backbone": {f"fc_{i}": layer for i, layer in
                                              enumerate(target_same["params"]["encoder"].values())}}}
    rename = [(r"^params\.backbone\.", "params.encoder."), (r"\.fc_(\d+)\.", r".Dense_\1.")]
    parent = tempfile.mkdtemp(prefix="zarrckpt-renames-")
    try:
        run = os.path.join(parent, "run")
        zarrckpt.save_checkpoint(run, 1, state)
        times: dict[str, list[float]] = {"no rename": [], "rename=": []}
        kinds = [("no rename", target_same, None), ("rename=", target_renamed, rename)]
        for r in range(args.rounds + 1):
            for name, target, how in kinds[:: 1 if r % 2 else -1]:  # taking turns at going first
                started = time.perf_counter()
                jax.block_until_ready(zarrckpt.load_checkpoint(run, 1, target, rename=how))
                if r:
                    times[name].append(time.perf_counter() - started)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    print(f"{common.describe_platform()}; {args.leaves} leaves of {args.leaf_kib:g} KiB, {args.rounds} rounds")
    for name, seconds in times.items():
        print(f"  {name:10} best {min(seconds):7.3f} s   median {statistics.median(seconds):7.3f} s")
    ratio = statistics.median(times["rename="]) / statistics.median(times["no rename"])
    print(f"  rename= / no rename (medians): {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
