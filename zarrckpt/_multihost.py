"""Agreement between processes through the JAX coordination service's key-value store.

Not device collectives: these calls may run on a background thread while training
computations are in flight, and a key-value wait can time out and say which
processes never arrived, where a hung collective cannot.

Contract: every process makes the same sequence of calls with the same `what`
channel, as with any collective.
"""

from __future__ import annotations

import collections
import itertools
import json
import threading
import time
from typing import Any

import jax

from .errors import CoordinationTimeoutError

DEFAULT_TIMEOUT_S = 600.0
_counters: dict[str, itertools.count] = collections.defaultdict(itertools.count)
_lock = threading.Lock()
_stale_keys: dict[str, list[str]] = collections.defaultdict(list)


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def _client() -> Any:
    from jax._src import distributed  # the coordination client has no public handle

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            f"{process_count()} JAX processes but no coordination service: "
            "call jax.distributed.initialize() in every process first"
        )
    return client


class Collective:
    """One multi-process operation (a save, a step choice) with its own key namespace.

    `what` names the channel; a background thread uses its own channel so that its
    keys never interleave with the foreground's.
    """

    def __init__(self, what: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        with _lock:
            number = next(_counters[what])
        self._what = what
        self._prefix = f"zarrckpt/{what}/{number}"
        self._timeout_s = timeout_s
        self._mine: list[str] = []

    def all_gather(self, tag: str, value: Any) -> list[Any]:
        """Every process's JSON-able `value`, indexed by process. Collective."""
        count = process_count()
        if count == 1:
            return [value]
        client = _client()
        me = process_index()
        key = f"{self._prefix}/{tag}/{me}"
        client.key_value_set(key, json.dumps(value))
        self._mine.append(key)
        deadline = time.monotonic() + self._timeout_s
        values: list[Any] = []
        for pid in range(count):
            remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                raw = client.blocking_key_value_get(f"{self._prefix}/{tag}/{pid}", remaining_ms)
            except Exception as e:  # the client raises a runtime error on deadline
                missing = self._missing(client, tag, pid, count)
                raise CoordinationTimeoutError(
                    f"process {me} waited {self._timeout_s:.0f}s at '{self._what}/{tag}' "
                    f"but processes {missing} never arrived ({e})"
                ) from None
            values.append(json.loads(raw))
        self._forget_previous(client)
        return values

    def _missing(self, client: Any, tag: str, start: int, count: int) -> list[int]:
        missing = []
        for q in range(start, count):
            try:
                client.key_value_try_get(f"{self._prefix}/{tag}/{q}")
            except Exception:
                missing.append(q)
        return missing

    def _forget_previous(self, client: Any) -> None:
        # Everyone has now entered this operation, so all have finished reading the
        # previous one on this channel: its keys can go.
        with _lock:
            stale, _stale_keys[self._what] = _stale_keys[self._what], []
        for key in stale:
            try:
                client.key_value_delete(key)
            except Exception:
                pass  # a leftover key costs a few bytes; never fail a save for it

    def close(self) -> None:
        """Hands this operation's keys to the next one on the channel for deletion."""
        with _lock:
            _stale_keys[self._what].extend(self._mine)
        self._mine = []

    def broadcast(self, tag: str, value: Any) -> Any:
        """Process 0's `value`, on every process. Collective."""
        return self.all_gather(tag, value if process_index() == 0 else None)[0]

    def agree(self, tag: str, error: str | None) -> list[tuple[int, str]]:
        """The (process, error) pairs of every process that reported one. Collective."""
        return [(pid, e) for pid, e in enumerate(self.all_gather(tag, error)) if e is not None]
