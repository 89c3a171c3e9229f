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
# What a program is (its name first), and the shapes, dtypes and shardings it takes.
Key = tuple[Hashable, ...]


class Programs:
    """The programs of one manager's saves, by key (what the program is, and the
    shapes, dtypes and shardings it takes). Thread-safe."""

    def __init__(self) -> None:
        self._compiled: dict[Key, Program] = {}
        self._pending: dict[Key, Callable[[], Program]] = {}
        self._compiling: set[Key] = set()
        self._lock = threading.Lock()

    def get(self, key: Key, compile: Callable[[], Program]) -> Program | None:
        """The program of `key` if it has been compiled; else None, and `compile` (which
        returns it compiled, e.g. `jax.jit(f).lower(...).compile`; it holds no array) is
        kept for `compile_pending`. Never compiles: this is asked on the training thread."""
        with self._lock:
            if key in self._compiled:
                return self._compiled[key]
            if key not in self._compiling:
                self._pending.setdefault(key, compile)
            return None

    def compile_pending(self, keys: Collection[Key] | None = None) -> None:
        """Compiles, on the calling thread, the programs asked for and not yet compiled
        (those of `keys` alone, where given). A compilation that fails (a device short of
        memory as it tunes) is logged, and tried again once a later save asks for it:
        what the program is for is done without it meanwhile."""
        with self._lock:
            todo = [(key, self._pending.pop(key)) for key in list(self._pending) if keys is None or key in keys]
            self._compiling.update(key for key, _ in todo)
        for key, compile in todo:
            try:
                program = compile()
            except Exception as e:
                log.warning("could not compile a program that saves run on the devices (%s): %s; "
                            "it is tried again at the next save", key[0], e)
                with self._lock:
                    self._compiling.discard(key)
                continue
            with self._lock:
                self._compiled[key] = program
                self._compiling.discard(key)
