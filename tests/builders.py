"""What many tests build: device meshes and small training states."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh


def mesh(shape: tuple[int, ...] = (2, 4), names: tuple[str, ...] = ("data", "model")) -> Mesh:
    """A mesh of the first prod(shape) devices of this process (8 CPU devices in tests)."""
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names[: len(shape)])


def train_state(value: float = 1.0) -> dict:
    """Parameters, an optimizer moment and a step, on the default device."""
    return {"params": {"w": jnp.full((4, 3), value), "b": jnp.zeros(3)},
            "opt_state": {"mu": jnp.ones((4, 3))}, "step": jnp.array(int(value))}
