"""Per-process leaves saved by a multi-process job: `save URL` saves, as one checkpoint,
each process's own value {"process": i, "position": 10 * i} and a global array, then
restores it without a target (each process gets its own value back)."""

from __future__ import annotations

from common import init, report

args = init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import zarrckpt  # noqa: E402


def save(url: str) -> None:
    me = jax.process_index()
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
    w_host = np.arange(2.0 * len(jax.devices()), dtype=np.float32)
    w = jax.make_array_from_callback(w_host.shape, sharding, lambda index: w_host[index])
    zarrckpt.save_pytree(url, {"data": zarrckpt.PerProcess({"process": me, "position": 10 * me}), "w": w})
    back = zarrckpt.load_pytree(url)["data"]
    report(restored_type=type(back).__name__, restored=back.value)


{"save": save}[args[0]](*args[1:])
