"""Whether a save holds NaN or infinities: asked of the devices as the save starts.

A diverging run saves NaN weights as readily as good ones, and retention would then
rotate the last good step out. The manager dispatches one reduction per set of this
process's devices over the state's largest floating-point jax.Array leaves
(`MAX_CHECKED`; on CPU devices, the first `CPU_SAMPLE` elements of one shard of each),
but those unchanged since the step it checked last (what it found there holds),
when `save` is called (the runtime orders a later donation of their buffers after it,
as it does the copies), and the save waits for its few bytes of answer in the
background, before it writes; process 0's answer is recorded. A reduction not yet
compiled (a run's first save) is compiled on the save's own thread and run there, on
the leaves the caller has not donated meanwhile. A step holding
non-finite values records their leaves in its metadata (`NON_FINITE`), and retention
keeps the newest step that records none (see `_retention`).

Host leaves (numpy, Python numbers) are not looked at: they would be read on the
training thread, where `save` must return quickly.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence, Set as AbstractSet
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._format.tree import Leaf, describe_path
from ._util import devices as _devices
from ._util.programs import Key, Programs

log = logging.getLogger("zarrckpt")

NON_FINITE = "non_finite"  # metadata key: the leaves (their key paths) holding NaN or an infinity
# The largest floating-point leaves are looked at, no more: each costs the save's caller
# microseconds of dispatch, and its first save a compilation, and a diverged run's NaN
# reaches its weights and their optimizer moments within a step.
MAX_CHECKED = 32
# On CPU devices the check would run on the cores that write the save and train (it
# doubled the time an async save of 1 GiB blocked on 2 cores): there, the first elements
# of each leaf's first shard alone are looked at, where a diverged run's NaN is as well
# as anywhere.
CPU_SAMPLE = 2**16


class Findings(NamedTuple):
    """What a check found: the leaves (their array names, `Leaf.name`) it looked at, and
    the key paths of those holding NaN or an infinity in this process's shards, by
    name, in tree order."""

    checked: frozenset[str]
    bad: dict[str, str]


def start(leaves: Sequence[Leaf], programs: Programs, *, before: Findings | None = None,
          unchanged: AbstractSet[str] = frozenset()) -> Callable[[], Findings]:
    """Dispatches the check of the largest `MAX_CHECKED` of `leaves`' floating-point
    jax.Arrays in device memory; returns a call that waits for it and says what it
    found (process 0's answer is the one recorded: a diverged run's NaN is in every
    shard). Not collective.

    Each set of devices is checked by a program of `programs`: where it is not compiled
    yet (a run's first save), the call compiles it and checks those leaves then, on
    its own thread, where they are still there (a leaf donated since is not looked at).

    The leaves `unchanged` (by name) since the step `before` says what was found in are
    not looked at again where `before` looked at them: what was found then holds. A
    frozen base, larger than what trains, would otherwise crowd the leaves that can
    diverge out of the check."""
    kept = unchanged & before.checked if before is not None else frozenset()
    order = [leaf.name for leaf in leaves]
    floats = [leaf for leaf in leaves
              if leaf.name not in kept and isinstance(x := leaf.value, jax.Array) and x.size
              and _inexact(x.dtype) and x.sharding.memory_kind in (None, "device")]
    chosen = sorted(range(len(floats)), key=lambda i: -floats[i].value.nbytes)[:MAX_CHECKED]
    # One reduction per sharding (a computation cannot mix device orders), over this
    # process's devices alone: an array spanning processes is looked at shard by
    # shard, so that a save never waits on a collective with another host.
    groups: dict[Any, list[tuple[int, jax.Array]]] = {}
    for i in sorted(chosen):  # in tree order: the same computations on every process
        x = floats[i].value
        if _on_cpu(x):  # a sample: the start of one shard
            first = x.addressable_data(0)
            parts = [(first.sharding, first)]
        elif x.is_fully_addressable:
            parts = [(x.sharding, x)]
        else:
            parts = [(shard.data.sharding, shard.data) for shard in x.addressable_shards]
        for sharding, part in parts:
            groups.setdefault(sharding, []).append((i, part))
    named = [(leaf.name, leaf.path) for leaf in floats]
    pending: list[tuple[list[int], Any]] = []  # the flags of each group dispatched
    # The groups whose program is not compiled yet: their key, program, leaves and shards.
    later: list[tuple[Key, Callable[[], Any], list[int], tuple[jax.Array, ...]]] = []
    for group in groups.values():
        xs = tuple(part for _, part in group)
        sample = CPU_SAMPLE if _on_cpu(xs[0]) else None
        layouts = tuple((x.shape, x.dtype, x.sharding) for x in xs)
        key = ("finite", layouts, sample)
        program = programs.get(key, compile := functools.partial(_compile, layouts, sample))
        if program is None:
            later.append((key, compile, [i for i, _ in group], xs))
        else:
            pending.append(([i for i, _ in group], _dispatch(program, xs)))
    del groups

    def result() -> Findings:
        nonlocal later
        programs.compile_pending([key for key, _, _, _ in later])
        for key, compile, indices, xs in later:
            program = programs.get(key, compile)
            if program is not None and not any(x.is_deleted() for x in xs):
                pending.append((indices, _dispatch(program, xs)))
        later = []  # the answer holds no array: the state may go
        bad: set[int] = set()
        checked: set[int] = set()
        for indices, flags in pending:
            if flags is None:
                continue
            try:
                bad.update(i for i, ok in zip(indices, np.asarray(flags)) if not ok)
                checked.update(indices)
            except Exception as e:
                log.debug("could not check %d leaves for NaN: %s", len(indices), e)
        found = {named[i][0]: describe_path(named[i][1]) for i in bad}
        if before is not None:
            found.update((name, where) for name, where in before.bad.items() if name in kept)
        return Findings(frozenset(named[i][0] for i in checked) | kept,
                        {name: found[name] for name in order if name in found})

    return result


def _compile(layouts: tuple[tuple[tuple[int, ...], np.dtype, jax.sharding.Sharding], ...], sample: int | None
             ) -> Callable[..., Any]:
    """`_finite_flags` compiled for arrays of `layouts` (shape, dtype, sharding: a
    program kept for later never holds an array)."""
    shapes = tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype, sharding in layouts)
    with _devices.outside_callers_mesh():
        return _finite_flags.lower(shapes, sample).compile()


def _dispatch(program: Callable[..., Any], xs: tuple[jax.Array, ...]) -> Any:
    """Starts `program` on `xs`; None where it cannot run (a leaf donated meanwhile, the
    device out of memory): a check that only annotates a step never fails its save."""
    try:
        with _devices.outside_callers_mesh():
            return program(xs)
    except Exception as e:
        log.debug("could not check %d leaves for NaN: %s", len(xs), e)
        return None


@functools.lru_cache(maxsize=64)
def _inexact(dtype: np.dtype) -> bool:  # asked of every leaf at every save: once per dtype
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def _on_cpu(x: jax.Array) -> bool:
    return next(iter(x.devices())).platform == "cpu"


@functools.partial(jax.jit, static_argnums=1)
def _finite_flags(xs: tuple[jax.Array, ...], sample: int | None) -> jax.Array:
    return jnp.stack([jnp.isfinite(x if sample is None else x.reshape(-1)[:sample]).all() for x in xs])
