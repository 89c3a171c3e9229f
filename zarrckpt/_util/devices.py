"""zarrckpt's own programs on the devices run outside any mesh the caller set.

The fingerprints, the NaN check, a shard's part sliced for a copy, a restore's
broadcast and the peer copies name their devices and shardings themselves. Under a
mesh the caller set (`jax.set_mesh`, around a training loop or for a whole program),
jit and shard_map hold every argument to that mesh: an array on one device, or on
another mesh, was refused, and the NaN check and the reuse of unchanged leaves were
silently off.
"""

from __future__ import annotations

import contextlib

import jax


def outside_callers_mesh() -> contextlib.AbstractContextManager[object]:
    """A context in which no mesh is set, whatever the caller set (in this thread or
    for the whole program)."""
    return jax.set_mesh(None)
