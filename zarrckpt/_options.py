"""Every option's default and its check, stated once.

Public calls spell their options out as keyword arguments (what `help()` and an IDE
show), with the defaults here, and build `SaveOptions` / `LoadOptions` by keyword at
once: a wrong type or value is a TypeError or ValueError raised by the call that got
it, naming the option, never later on a background thread. `check` is the one check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

from ._format.chunks import COMPRESSIONS
from ._util.concurrency import DEFAULT_MAX_INFLIGHT_BYTES
from ._util.multihost import DEFAULT_TIMEOUT_S

DEFAULT_MAX_CHUNK_BYTES = 64 * 2**20
# Shards smaller than this are merged, side by side, into chunks of at least this size
# where one process holds them all: fewer, larger objects (each is a request on S3/GCS).
DEFAULT_MIN_CHUNK_BYTES = 2**20

# What each check accepts; `?` also accepts None.
FLAG = "flag"  # True or False
COUNT = "count"  # a positive int
COUNT_OR_ZERO = "count or zero"  # an int, 0 or more
NUMBER = "number"  # a positive int or float (seconds, bytes per second...)
COMPRESSION = "compression"  # one of `COMPRESSIONS` (a str)
CALLABLE = "callable"  # a function (checked further where it is made)


def check(name: str, value: Any, kind: str) -> None:
    """The one check of an option: raises TypeError (a value of the wrong type) or
    ValueError (of the right type, out of range), naming the option as the caller
    spelled it. `kind` is FLAG, COUNT, COUNT_OR_ZERO, NUMBER, COMPRESSION or CALLABLE, with `?` if
    None is allowed."""
    if value is None and kind.endswith("?"):
        return
    kind = kind.rstrip("?")
    if kind == CALLABLE:
        if not callable(value):
            raise TypeError(f"option {name} must be None or a function, got {value!r}")
        return
    if kind == COMPRESSION:
        if not isinstance(value, str):
            raise TypeError(f"option {name} must be None or a str, got {value!r}")
        if value not in COMPRESSIONS:
            raise ValueError(f"option {name} must be None or one of {', '.join(map(repr, COMPRESSIONS))}, "
                             f"got {value!r}")
        return
    if kind == FLAG:
        if not isinstance(value, bool):
            raise TypeError(f"option {name} must be True or False, got {value!r}")
        return
    number = (int, float) if kind == NUMBER else int
    if isinstance(value, bool) or not isinstance(value, number):
        expected = "a number" if kind == NUMBER else "an int"
        raise TypeError(f"option {name} must be {expected}, got {value!r}")
    if kind == COUNT_OR_ZERO and value < 0:
        raise ValueError(f"option {name} must be 0 or more, got {value!r}")
    if kind != COUNT_OR_ZERO and not value > 0:
        raise ValueError(f"option {name} must be positive, got {value!r}")


def _option(default: Any, kind: str) -> Any:
    return dataclasses.field(default=default, metadata={"check": kind})


class _Checked:
    """Options checked field by field, each by the kind its field declares."""

    # Declared, never set here: every subclass is a dataclass, which sets it.
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check(field.name, getattr(self, field.name), field.metadata["check"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class SaveOptions(_Checked):
    """How a save writes (`save_pytree` says what each does)."""

    overwrite: bool = _option(False, FLAG)
    max_chunk_bytes: int = _option(DEFAULT_MAX_CHUNK_BYTES, COUNT)
    min_chunk_bytes: int = _option(DEFAULT_MIN_CHUNK_BYTES, COUNT)
    max_inflight_bytes: int = _option(DEFAULT_MAX_INFLIGHT_BYTES, COUNT)
    max_workers: int | None = _option(None, COUNT + "?")
    timeout_s: float = _option(DEFAULT_TIMEOUT_S, NUMBER)
    progress: bool | None = _option(None, FLAG + "?")
    checksums: bool = _option(True, FLAG)
    compression: str | None = _option(None, COMPRESSION + "?")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadOptions(_Checked):
    """How a restore reads (`load_pytree` says what each does)."""

    allow_dtype_cast: bool = _option(False, FLAG)
    donate_target: bool = _option(False, FLAG)
    partial: bool = _option(False, FLAG)
    load_and_broadcast: bool = _option(True, FLAG)
    max_inflight_bytes: int = _option(DEFAULT_MAX_INFLIGHT_BYTES, COUNT)
    max_workers: int | None = _option(None, COUNT + "?")
    progress: bool | None = _option(None, FLAG + "?")
    # The checkpoint's name of each target leaf's, or None (see `_restore.renames`).
    rename: Callable[[str], str | None] | None = _option(None, CALLABLE + "?")
    fallback: bool = _option(False, FLAG)

    def onto(self, target: Any) -> LoadOptions:
        """These options, for a restore onto `target`; ValueError where they ask what
        only a target's leaves take (`rename`, `fallback`) and `target` is None."""
        if target is None and (self.rename is not None or self.fallback):
            raise ValueError("rename= and fallback=True apply to a target's leaves: with target None every leaf is "
                             "read as saved, under its own name; pass a target")
        return self
