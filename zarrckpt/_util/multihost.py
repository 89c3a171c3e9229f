"""Agreement between processes through the JAX coordination service.

Not device collectives: these calls may run on a background thread while training
computations are in flight, and a coordination-service wait can time out and say
which processes never arrived, where a hung collective cannot.

Two agreements, each costing every process a constant number of calls to the
service whatever the process count (none with a single process):
- `Agreement.decide`: process 0 runs a step (choose a step, clear the way, commit)
  and publishes its outcome under one key; every other process reads that key
  (one blocking read). Its result, or its error, comes out on every process.
- `Agreement.check`: every process runs its part (write its chunks); a process
  whose part failed publishes the failure under a key of its own; all meet at a
  barrier with a timeout, then read the (normally empty) directory of failures.
  Every failure is raised on every process. Each process also marks its arrival
  before the barrier, so that a timeout names the processes that never came.
  `Agreement.gather` is the same, with every process's result published too and
  read back by all (what each process's local tier holds, say); `Agreement.failures`
  the same again, with each process's own error passed in and every process's
  returned, not raised (which processes' local copies failed a read).

A third use is a board, where whoever gets there first decides: `Agreement.offer` sets
a key unless it is set (the service picks the one winner; `claim` also says whether it
was this call), `Agreement.post` sets one outright, `Agreement.look` waits a while for
one, and `Agreement.meet` is a barrier where each process may leave a note for all (a
restore's fast process taking over a slow one's reads, `_restore.relief`).

Each `Agreement` is one operation with its own key namespace; when it is closed,
every process counts itself out, and the last one deletes the namespace.

Contract: every process makes the same sequence of calls with the same channel,
as with any collective.
"""

from __future__ import annotations

import collections
import itertools
import json
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from .. import errors
from ..errors import CheckpointError, CoordinationTimeoutError
from . import stats as _stats

DEFAULT_TIMEOUT_S = 600.0
_T = TypeVar("_T")
_counters: dict[str, itertools.count] = collections.defaultdict(itertools.count)
_lock = threading.Lock()


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def coordinated() -> bool:
    """Whether this process belongs to a `jax.distributed` job (has a coordination client)."""
    from jax._src import distributed  # the coordination client has no public handle

    return distributed.global_state.client is not None


def _client() -> Any:
    from jax._src import distributed  # the coordination client has no public handle

    if not coordinated():
        raise RuntimeError(
            f"{process_count()} JAX processes but no coordination service: "
            "call jax.distributed.initialize() in every process first"
        )
    return _Counted(distributed.global_state.client)


class _Counted:
    """The coordination client, counting each call (`_stats`: coordination_calls)."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        _stats.add("coordination_calls")
        return getattr(self._client, name)


class Agreement:
    """One multi-process operation (a save, a step choice) with its own key namespace.

    `channel` names it; a background thread uses its own channel so that its keys
    never interleave with the foreground's. A failure is raised on every process:
    with its own type and message when it is a single zarrckpt error (a refusal such
    as CheckpointExistsError), else as `error` with the message
    "<what> failed on K of N processes<; note>:" and one line per process ("<what>
    failed<; note>: <message>" with a single process).
    """

    def __init__(self, channel: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, what: str = "",
                 error: type[CheckpointError] = CheckpointError, note: str = "") -> None:
        with _lock:
            number = next(_counters[channel])
        self._channel = channel
        self._prefix = f"zarrckpt/{channel}/{number}"
        self._timeout_s = timeout_s
        self._waited = 0.0  # seconds this process has spent waiting in this operation
        self._what, self._error, self._note = what or channel, error, note
        self._used = False

    def decide(self, tag: str, step: Callable[[], _T], *, source: int = 0) -> _T:
        """Runs `step` on process `source` (0 unless said) and returns its JSON-able
        result on every process; if it raised, raises on every process. Agreement."""
        mine: BaseException | None = None
        outcome: dict[str, Any] = {}
        if process_index() == source:
            try:
                outcome = {"value": step()}
            except Exception as e:  # every process must learn of it
                mine, outcome = e, {"failure": _report(e)}
        if process_count() > 1:
            key = f"{self._prefix}/{tag}"
            self._used = True
            if process_index() == source:
                _client().key_value_set(key, json.dumps(outcome))
            else:
                outcome = json.loads(self._wait(tag, lambda c, ms: c.blocking_key_value_get(key, ms), [source]))
        if "failure" in outcome:
            self._raise({source: outcome["failure"]}, mine)
        return outcome["value"]

    def check(self, tag: str, step: Callable[[], object]) -> None:
        """Runs `step` on every process; if it raised anywhere, raises on every process.
        Agreement."""
        self._everyone(tag, step, gather=False)

    def gather(self, tag: str, step: Callable[[], _T], *, to: int | None = None) -> list[_T]:
        """Runs `step` on every process and returns every process's JSON-able result, in
        process order, on every process (with `to`, on that process alone: the others
        get []); if it raised anywhere, raises on every process. Agreement."""
        return self._everyone(tag, step, gather=True, to=to)

    def failures(self, tag: str, error: BaseException | None) -> dict[int, str]:
        """Every process reports `error` (None: it has none); returns, on every process,
        each failed process's message, by process (empty when none failed). For a caller
        that must learn which processes failed, not only that some did. Agreement."""
        failures = {process_index(): _report(error)} if error is not None else {}
        return {p: failure["message"] for p, failure in self._meet(tag, None, failures, gather=False)[0].items()}

    def offer(self, key: str, value: str) -> None:
        """Sets `key` to `value` unless some process set it first (then leaves it as it
        is, without saying so: one call). Needs a coordinated job."""
        self._used = True
        try:
            _client().key_value_set(f"{self._prefix}/{key}", value)
        except Exception as e:  # some versions refuse a second writer aloud, others silently
            if "ALREADY_EXISTS" not in str(e):
                raise

    def claim(self, key: str, value: str) -> bool:
        """`offer`, and whether this call is the one that set `key`. Needs a coordinated job."""
        self.offer(key, value)
        return _client().key_value_try_get(f"{self._prefix}/{key}") == value

    def post(self, key: str, value: str) -> None:
        """Sets `key` to `value`, over what it held. Needs a coordinated job."""
        self._used = True
        _client().key_value_set(f"{self._prefix}/{key}", value, allow_overwrite=True)

    def look(self, key: str, timeout_s: float) -> str | None:
        """What `key` holds, waiting up to `timeout_s` for it to be set; None if it was
        not by then (a wait that is part of the caller's plan, not counted against the
        operation's timeout). Needs a coordinated job."""
        self._used = True
        try:
            return _client().blocking_key_value_get(f"{self._prefix}/{key}", max(1, int(timeout_s * 1000)))
        except Exception as e:  # the client raises a runtime error on deadline, and on any other failure
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
            return None

    def meet(self, tag: str, note: str | None = None, error: BaseException | None = None) -> dict[int, str]:
        """Every process leaves `note` (None: nothing to say) or its `error`, and waits at
        a barrier for every other; returns every note left, by process. Raises on every
        process any process's error (as `check`). Two calls per process with nothing to
        say, whatever the process count; a timeout does not name who never came (no
        arrival marks: that would be a third call). Agreement."""
        if process_count() == 1:
            if error is not None:
                self._raise({0: _report(error)}, error)
            return {} if note is None else {0: note}
        client, base = _client(), f"{self._prefix}/{tag}"
        self._used = True
        if error is not None or note is not None:
            said = {"failure": _report(error)} if error is not None else {"note": note}
            client.key_value_set(f"{base}/{process_index()}", json.dumps(said))
        self._wait(tag, lambda c, ms: c.wait_at_barrier(base, ms), [])
        left = {int(key.rsplit("/", 1)[1]): json.loads(value) for key, value in client.key_value_dir_get(f"{base}/")}
        failures = {p: said["failure"] for p, said in left.items() if "failure" in said}
        if failures:
            self._raise(failures, error)
        return {p: said["note"] for p, said in left.items()}

    def _everyone(self, tag: str, step: Callable[[], _T], gather: bool, to: int | None = None) -> list[_T]:
        mine: BaseException | None = None
        failures: dict[int, dict[str, str]] = {}
        result: Any = None
        try:
            result = step()
        except Exception as e:  # reported to every process, then raised below
            mine = e
            failures[process_index()] = _report(e)
        failures, results = self._meet(tag, result, failures, gather, to)
        if failures:
            self._raise(failures, mine)
        return results

    def _meet(self, tag: str, result: Any, failures: dict[int, dict[str, str]],
              gather: bool, to: int | None = None) -> tuple[dict[int, dict[str, str]], list[Any]]:
        """Publishes this process's failure (or, to `gather`, its result), waits at a
        barrier for every process, and reads back every failure (and every result, on
        process `to` alone where given)."""
        results = [result]
        if process_count() > 1:
            client, me = _client(), process_index()
            base = f"{self._prefix}/{tag}"
            self._used = True
            if me in failures:
                client.key_value_set(f"{base}/failed/{me}", json.dumps(failures[me]))
            # The arrival mark carries the result to gather: one call either way.
            client.key_value_set(f"{base}/arrived/{me}", json.dumps(result) if gather and me not in failures else "")
            self._wait(tag, lambda c, ms: c.wait_at_barrier(base, ms), None)
            if gather and to in (None, me):  # every failure and every result, in one read
                found: dict[str, dict[int, str]] = {"failed": {}, "arrived": {}}
                for key, value in client.key_value_dir_get(f"{base}/"):
                    kind, process = key.rsplit("/", 2)[-2:]
                    if kind in found:
                        found[kind][int(process)] = value
                failures = {p: json.loads(value) for p, value in found["failed"].items()}
                results = [] if failures else [json.loads(found["arrived"][p]) for p in range(process_count())]
            else:
                failures = {int(key.rsplit("/", 1)[1]): json.loads(value)
                            for key, value in client.key_value_dir_get(f"{base}/failed/")}
                results = [] if gather else results
        return failures, results

    def __enter__(self) -> Agreement:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Counts this process out of the operation; the last one out deletes its keys.
        Every process must close what it opened, after its last call (leaving a `with`
        block closes it)."""
        if not self._used:
            return
        client = _client()
        try:
            if client.key_value_increment(f"{self._prefix}/closed", 1) == process_count():
                client.key_value_delete(f"{self._prefix}/")
        except Exception:
            pass  # a leftover key costs a few bytes; never fail a save for it

    def _wait(self, tag: str, call: Callable[[Any, int], Any], expected: list[int] | None) -> Any:
        """Runs a blocking coordination `call` with what is left of the operation's
        timeout (the time this process has already waited in it counts; its own work
        does not); on timeout, raises naming the processes that never arrived
        (`expected`, or those that did not mark their arrival at `tag`)."""
        client = _client()
        left = self._timeout_s - self._waited
        started = time.monotonic()
        try:
            return call(client, max(1, int(left * 1000)))
        except Exception as e:  # the client raises a runtime error on deadline
            if expected is None:
                arrived = {int(key.rsplit("/", 1)[1])
                           for key, _ in client.key_value_dir_get(f"{self._prefix}/{tag}/arrived/")}
                expected = [p for p in range(process_count()) if p not in arrived]
            who = f"processes {expected}" if expected else "some processes"
            raise CoordinationTimeoutError(
                f"process {process_index()} waited {self._timeout_s:.0f}s in all for '{self._channel}' (at "
                f"'{tag}') but {who} never arrived ({str(e).splitlines()[0]})"
            ) from None
        finally:
            self._waited += time.monotonic() - started

    def _raise(self, failures: dict[int, dict[str, str]], mine: BaseException | None) -> None:
        lines = "\n".join(f"  process {pid}: {failure['message']}" for pid, failure in sorted(failures.items()))
        kinds = {getattr(errors, failure["type"], None) for failure in failures.values()}
        kind = kinds.pop() if len(kinds) == 1 else None
        if isinstance(kind, type) and issubclass(kind, CheckpointError) and kind is not errors.CheckpointWriteError:
            # A refusal (CheckpointExistsError, DirectoryInUseError...) keeps its type everywhere,
            # whether one process met it or every one did.
            if len(failures) == 1 and mine is not None:
                raise mine
            raise kind(next(iter(failures.values()))["message"] if len(failures) == 1 else
                       f"{self._what} refused on {len(failures)} of {process_count()} processes:\n{lines}")
        note = f"; {self._note}" if self._note else ""
        if process_count() == 1:
            ((_, only),) = failures.items()
            raise self._error(f"{self._what} failed{note}: {only['message']}") from mine
        raise self._error(f"{self._what} failed on {len(failures)} of {process_count()} processes{note}:\n"
                          f"{lines}") from mine


def _report(e: BaseException) -> dict[str, str]:
    """A failure as it travels to the other processes: its type's name and its message
    (zarrckpt's own messages stand alone; others are prefixed by their type)."""
    name = type(e).__name__
    return {"type": name, "message": str(e) if isinstance(e, CheckpointError) else f"{name}: {e}"}
