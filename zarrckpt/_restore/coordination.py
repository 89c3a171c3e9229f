"""How the processes of a restore read together: what the read loop (`load._read_all`)
asks of the others, in one interface, whatever the restore.

- `ALONE`: every process reads its part, and nothing else is asked (one process, or a
  restore that shares no leaf).
- `relief.Relief`: a slow process's part of the leaves shared by load and broadcast
  is read by its buddy once it is late (see `relief`).
- `Gated`: the local tier's reads, whose copies may be damaged: every process passes
  the tier's gate before each sharing, so that a read that failed on one process is
  raised on all of them there, never left waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from .._util.regions import Region
from . import checkpoint as _reader
from .match import Request

# Called with what this process's reads raised (None: nothing) before each sharing and
# once at the end; raises GateClosed on every process if any process's reads failed.
Gate = Callable[[BaseException | None], None]


class Coordination(Protocol):
    """What one process's read loop asks of the others."""

    @property
    def abandon(self) -> Callable[[Request], bool] | None:
        """What tells that a read of this process's was made for it by another (then
        given up: `_concurrency.Operation.window`'s `abandon`); None where none is."""

    def fetch(self, request: Request, box: Region, places: Any) -> list[Any]:
        """This process's read of `box` of `request`, or `_concurrency.ABANDONED`."""

    def began(self, request: Request) -> None:
        """A read of `request` by this process starts."""

    def ended(self, request: Request) -> None:
        """This process's last read of `request` is in."""

    def settle(self, group: list[Request], done: dict[str, Any]) -> list[Request]:
        """Before `group` is shared (collective): the group to share, with what others
        read for whom."""

    def close(self, error: BaseException | None = None) -> None:
        """The reads ended, with `error` where this process's failed."""


class _Reader:
    """Reads its own part of `ckpt`, asking nothing of the others."""

    abandon = None

    def __init__(self, ckpt: _reader.Checkpoint) -> None:
        self._ckpt = ckpt

    def fetch(self, request: Request, box: Region, places: Any) -> list[Any]:
        return request.form.fetch(self._ckpt, request.stored, box, places)

    def began(self, request: Request) -> None:
        pass

    def ended(self, request: Request) -> None:
        pass

    def settle(self, group: list[Request], done: dict[str, Any]) -> list[Request]:
        return group

    def close(self, error: BaseException | None = None) -> None:
        pass


def alone(ckpt: _reader.Checkpoint) -> Coordination:
    """Every process reads its own part of `ckpt`."""
    return _Reader(ckpt)


class Gated(_Reader):
    """Reads its own part, passing `gate` before each sharing."""

    def __init__(self, ckpt: _reader.Checkpoint, gate: Gate) -> None:
        super().__init__(ckpt)
        self._gate = gate

    def settle(self, group: list[Request], done: dict[str, Any]) -> list[Request]:
        self._gate(None)  # every process has read its part of these leaves
        return group
