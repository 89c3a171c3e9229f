"""Target shardings on an `AbstractMesh`, put on a concrete mesh of the same axes.

`jax.eval_shape` and `flax.nnx.eval_shape` under `jax.set_mesh` give target leaves
whose `NamedSharding` lives on an `AbstractMesh`: axis names and sizes, no devices. A
restore needs devices, so such a sharding is rebuilt, with the same spec, on the
concrete mesh of the same axis names and sizes: the one `jax.set_mesh` makes current,
else one made of all of `jax.devices()` (by `jax.make_mesh`, with the abstract mesh's
axis types) where their number is the abstract mesh's size.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from ..errors import UnsupportedLeafError


def concrete_leaf(leaf: Any, where: str) -> Any:
    """`leaf` with its sharding on a concrete mesh, when it is a `NamedSharding` on an
    `AbstractMesh` or a `jax.ShapeDtypeStruct` with one; any other leaf as it is.

    Raises:
      UnsupportedLeafError: no concrete mesh of the abstract mesh's axis names and sizes
        is current (`jax.set_mesh`) and `jax.device_count()` is not its size; names the
        leaf (`where`), the axes, and the fix.
    """
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = leaf.sharding
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, AbstractMesh):
            return leaf.update(sharding=_on_concrete_mesh(sharding, where))
        return leaf
    if isinstance(leaf, NamedSharding) and isinstance(leaf.mesh, AbstractMesh):
        return _on_concrete_mesh(leaf, where)
    return leaf


def _on_concrete_mesh(sharding: NamedSharding, where: str) -> NamedSharding:
    abstract = sharding.mesh
    assert isinstance(abstract, AbstractMesh)
    current = jax.sharding.get_mesh()
    if not current.empty and _same_axes(current, abstract):
        mesh = current
    elif (built := _from_devices(abstract)) is not None:
        mesh = built
    else:
        raise UnsupportedLeafError(_no_mesh(where, abstract, current))
    return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def _same_axes(mesh: Mesh, abstract: AbstractMesh) -> bool:
    return tuple(mesh.axis_names) == tuple(abstract.axis_names) and \
        tuple(mesh.axis_sizes) == tuple(abstract.axis_sizes)


@functools.cache
def _from_devices(abstract: AbstractMesh) -> Mesh | None:
    """A mesh of all of `jax.devices()` with `abstract`'s axes, or None where their
    number is not its size. One per abstract mesh, so every leaf on it lands on the
    same devices in the same order, on every process alike."""
    if math.prod(abstract.axis_sizes) != jax.device_count():
        return None
    return jax.make_mesh(tuple(abstract.axis_sizes), tuple(abstract.axis_names),
                         axis_types=tuple(abstract.axis_types))


def _no_mesh(where: str, abstract: AbstractMesh, current: Mesh) -> str:
    axes = ", ".join(f"{name!r}: {size}" for name, size in zip(abstract.axis_names, abstract.axis_sizes))
    held = (f"the current mesh (jax.set_mesh) has axes "
            f"{', '.join(f'{n!r}: {s}' for n, s in zip(current.axis_names, current.axis_sizes))}"
            if not current.empty else "no mesh is current (jax.set_mesh)")
    return (f"target leaf {where}: its NamedSharding is on an AbstractMesh ({axes}), which holds no devices, and "
            f"no concrete mesh of those axes is at hand: {held}, and the {jax.device_count()} devices of "
            f"jax.devices() are not the {math.prod(abstract.axis_sizes)} such a mesh holds. Restore under "
            "`with jax.set_mesh(mesh):` with a jax.sharding.Mesh of these axis names and sizes, or give the target "
            "NamedShardings on a concrete Mesh")
