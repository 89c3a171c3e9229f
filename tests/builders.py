"""What many tests build: device meshes and small training states."""

from __future__ import annotations

from pathlib import Path

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


def one_state(mib: int, step: int) -> dict:
    """A host state of `mib` MiB (1 MiB per row) whose values are its step."""
    return {"w": np.full((mib, 2**18), step, np.float32), "step": step}


def copies(persistent: str | Path, local: str | Path, process: int = 0) -> Path:
    """Where `process` keeps its local-tier copies of the run saved in `persistent`
    (`<local>/run-<run identity>/process<i>`, see zarrckpt._tier.tier)."""
    run = (Path(persistent) / "zarrckpt.run").read_text().strip()
    return Path(local) / f"run-{run}" / f"process{process}"


def flip_bit(chunk: Path) -> None:
    """Flips one bit of a chunk's data: its size and metadata stay right, its checksum
    does not."""
    data = bytearray(chunk.read_bytes())
    data[len(data) // 3] ^= 0x10
    chunk.write_bytes(bytes(data))


def logged_bytes(text: str) -> float:
    """A byte count as zarrckpt logs it ("512 B", "1.5 MiB") in bytes."""
    value, unit = text.split()
    return float(value) * 1024 ** ("B", "KiB", "MiB", "GiB", "TiB").index(unit)
