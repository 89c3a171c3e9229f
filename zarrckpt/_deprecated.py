"""Names of the public API that changed: the old name keeps working, with a
DeprecationWarning that says the new one, and is never dropped silently.
"""

from __future__ import annotations

import warnings
from typing import Any, TypeVar

_T = TypeVar("_T")


def argument(call: str, new: str, new_value: _T | None, old: str, old_value: _T | None) -> tuple[_T | None, str]:
    """The value of keyword `new` of `call` (None: not given), or of its old name `old`
    if that was given instead, with a DeprecationWarning at the caller's line; with the
    keyword it came by, for errors to name. TypeError if both were given."""
    if old_value is None:
        return new_value, new
    if new_value is not None:
        raise TypeError(f"{call} takes {new}, or {old} (its old name), not both")
    warnings.warn(f"{call}({old}=...) is now {new}=...", DeprecationWarning, stacklevel=3)
    return old_value, old


def renamed(new: str, old: str, owner: str) -> property:
    """A read-only attribute `old` of class `owner`, now `new`: returns it, with a
    DeprecationWarning."""
    def get(self: Any) -> Any:
        warnings.warn(f"{owner}.{old} is now {owner}.{new}", DeprecationWarning, stacklevel=2)
        return getattr(self, new)

    return property(get, doc=f"Deprecated: `{new}`.")
