"""Counters of what this process asked of the store and of the coordination service.

Always on (an increment per request); `benchmarks/multihost_scale.py` and the scale
tests read them to show that per-process costs stay flat as processes are added.
"""

from __future__ import annotations

import collections
import threading

_lock = threading.Lock()
_counts: collections.Counter[str] = collections.Counter()


def add(name: str, amount: int = 1) -> None:
    with _lock:
        _counts[name] += amount


def snapshot() -> dict[str, int]:
    """Every counter: `store_<action>` requests (read, write, list, delete, check),
    `store_bytes_read`, `store_bytes_written`, `coordination_calls`; of a restore's
    relief (`_restore.relief`), `relief_bytes_read` (a late process's part, read again
    by its buddy) and `reads_given_up` (the late process's own reads of it)."""
    with _lock:
        return dict(_counts)


def reset() -> None:
    with _lock:
        _counts.clear()
