"""Device programs compiled off the training thread: `Programs`.

A manager's save runs small programs of its own on the devices (the NaN check, the
fingerprints of unchanged leaves), one for each layout of the leaves it looks at.
Compiling one takes tens to hundreds of milliseconds, which the first save of a run
would otherwise spend on the thread that called it. A save asks `Programs` for each
program it would run there: one compiled before is run at once; one not yet compiled
is left out of this save (each part says what it does instead) and compiled later on
the save's own thread (`compile_pending`), for the saves after it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Hashable
from typing import Any

log = logging.getLogger("zarrckpt")

Program = Callable[..., Any]


class Programs:
    """The programs of one manager's saves, by key (what the program is, and the
    shapes, dtypes and shardings it takes). Thread-safe."""

    def __init__(self) -> None:
        self._compiled: dict[Hashable, Program | None] = {}  # None: its compilation failed
        self._pending: dict[Hashable, Callable[[], Program]] = {}
        self._compiling: set[Hashable] = set()
        self._lock = threading.Lock()

    def get(self, key: Hashable, compile: Callable[[], Program]) -> Program | None:
        """The program of `key` if it has been compiled; else None, and `compile` (which
        returns it compiled, e.g. `jax.jit(f).lower(...).compile`) is kept for
        `compile_pending`. Never compiles: this is asked on the training thread. A
        program whose compilation failed stays None."""
        with self._lock:
            if key in self._compiled:
                return self._compiled[key]
            if key not in self._compiling:
                self._pending.setdefault(key, compile)
            return None

    def compile_pending(self, keys: Collection[Hashable] | None = None) -> None:
        """Compiles, on the calling thread, the programs asked for and not yet compiled
        (those of `keys` alone, where given). A compilation that fails is logged, and its
        program is left out of every later save: what it was for is done without it."""
        with self._lock:
            todo = [(key, self._pending.pop(key)) for key in list(self._pending) if keys is None or key in keys]
            self._compiling.update(key for key, _ in todo)
        for key, compile in todo:
            try:
                program: Program | None = compile()
            except Exception as e:
                log.debug("could not compile a save's program %r: %s", key, e)
                program = None
            with self._lock:
                self._compiled[key] = program
                self._compiling.discard(key)
