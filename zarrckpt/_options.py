"""The options of a save and of a restore, checked where the caller gives them.

Public functions take their options as keyword arguments and gather them here at
once, so that a wrong type or value is a TypeError or ValueError raised by the call
that got it, naming the option, never later on a background thread.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from ._concurrency import DEFAULT_MAX_INFLIGHT_BYTES
from ._multihost import DEFAULT_TIMEOUT_S

DEFAULT_MAX_CHUNK_BYTES = 64 * 2**20
# Shards smaller than this are merged, side by side, into chunks of at least this size
# where one process holds them all: fewer, larger objects (each is a request on S3/GCS).
DEFAULT_MIN_CHUNK_BYTES = 2**20

_O = TypeVar("_O")


def check_settings(**settings: tuple[Any, Any]) -> None:
    """Checks each `name=(value, kind)`: kind is bool, int or float (a positive
    number), optionally `| None`. Raises TypeError or ValueError naming the setting."""
    for name, (value, kind) in settings.items():
        _check_one(name, value, str(kind))


def _check(options: Any) -> None:
    """Checks every field of a dataclass of options against its annotation."""
    for field in dataclasses.fields(options):
        _check_one(field.name, getattr(options, field.name), str(field.type))


def _check_one(name: str, value: Any, kind: str) -> None:
    # `kind` is an annotation as text: "bool", "int | None", "float"...
    kind = kind.replace("<class '", "").replace("'>", "")
    if value is None and kind.endswith("None"):
        return
    if kind.startswith("bool"):
        if not isinstance(value, bool):
            raise TypeError(f"option {name} must be True or False, got {value!r}")
        return
    number = int if kind.startswith("int") else (int, float)
    if isinstance(value, bool) or not isinstance(value, number):
        expected = "an int" if number is int else "a number"
        raise TypeError(f"option {name} must be {expected}, got {value!r}")
    if not value > 0:
        raise ValueError(f"option {name} must be positive, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """How a save writes (see `save_pytree` for what each does)."""

    overwrite: bool = False
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
    min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES
    max_workers: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    progress: bool | None = None
    checksums: bool = True

    def __post_init__(self) -> None:
        _check(self)


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """How a restore reads (see `load_pytree` for what each does)."""

    allow_dtype_cast: bool = False
    donate_target: bool = False
    partial: bool = False
    load_and_broadcast: bool = True
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES
    max_workers: int | None = None
    progress: bool | None = None

    def __post_init__(self) -> None:
        _check(self)


def gather(kind: type[_O], call: str, given: dict[str, Any]) -> _O:
    """`kind(**given)`, with an unknown option reported as the TypeError of `call`,
    naming it and the options there are."""
    names = [field.name for field in dataclasses.fields(kind)]  # type: ignore[arg-type]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise TypeError(f"{call}() got unknown option(s) {', '.join(map(repr, unknown))}; "
                        f"its options are: {', '.join(names)}")
    return kind(**given)
