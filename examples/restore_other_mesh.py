"""Save a sharded state on an 8-device mesh; restore it on 4 devices and on another mesh shape.

    python examples/restore_other_mesh.py [--checkpoint URL]

A checkpoint stores whole arrays (chunked along the saving mesh's shard boundaries),
not the saving mesh: a restore target says where each leaf goes, and each device
reads just the chunks its shard covers. Two ways to build a target are shown:
- the live state's structure with new shardings (for a job that already has its state);
- `zarrckpt.metadata(url).tree`, the saved shapes and dtypes, plus shardings (for a job
  that starts from the checkpoint alone, e.g. an evaluation on fewer devices).

On a CPU-only machine the example asks XLA for 8 fake devices.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import zarrckpt  # noqa: E402


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def describe(x: jax.Array) -> str:
    return f"{x.shape} as {len(x.sharding.device_set)} shards of {x.sharding.shard_shape(x.shape)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="checkpoints/restore_other_mesh", help="local path or fsspec URL")
    args = parser.parse_args()
    if len(jax.devices()) < 8:
        raise SystemExit(f"this example needs 8 devices, found {len(jax.devices())}")

    # Saved from a 4x2 mesh: embeddings split both ways, the dense layer by columns.
    mesh8 = make_mesh((4, 2), ("data", "model"))
    specs = {"embed": P("data", "model"), "dense": P(None, "model"), "bias": P()}
    values = {"embed": np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 100,
              "dense": np.ones((32, 16), np.float32) * np.arange(16), "bias": np.linspace(0, 1, 16, dtype=np.float32)}
    state = {
        "params": {k: jax.device_put(v, NamedSharding(mesh8, specs[k])) for k, v in values.items()},
        "step": jnp.array(1000, jnp.int32),
    }
    zarrckpt.save_pytree(args.checkpoint, state, overwrite=True)
    print(f"saved from 8 devices: params.embed {describe(state['params']['embed'])}")

    # 1. Four devices, the same axis names and partitioning on a 2x2 mesh.
    mesh4 = make_mesh((2, 2), ("data", "model"))
    target = {"params": {k: NamedSharding(mesh4, specs[k]) for k in specs}, "step": NamedSharding(mesh4, P())}
    on4 = zarrckpt.load_pytree(args.checkpoint, target)
    print(f"restored on 4 devices: params.embed {describe(on4['params']['embed'])}")

    # 2. All 8 devices as a 2x4 mesh with other axis names, built from the checkpoint alone.
    mesh24 = make_mesh((2, 4), ("replica", "fsdp"))
    saved = zarrckpt.metadata(args.checkpoint).tree  # jax.ShapeDtypeStruct leaves
    new_specs = {"embed": P("fsdp"), "dense": P("fsdp", "replica"), "bias": P("fsdp")}
    target = {"params": {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh24, new_specs[k]))
                         for k, s in saved["params"].items()},
              "step": jax.ShapeDtypeStruct(saved["step"].shape, saved["step"].dtype,
                                           sharding=NamedSharding(mesh24, P()))}
    on24 = zarrckpt.load_pytree(args.checkpoint, target)
    print(f"restored on a 2x4 mesh: params.embed {describe(on24['params']['embed'])}")

    for restored in (on4, on24):
        for name, expected in values.items():
            np.testing.assert_array_equal(np.asarray(restored["params"][name]), expected)
        assert int(restored["step"]) == 1000
    print("every restored value matches the saved state")


if __name__ == "__main__":
    main()
