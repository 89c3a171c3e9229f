"""Renames: which checkpoint leaf each target leaf restores from, by name.

A restore's `rename=` maps each target leaf's name (the dotted name `zarrckpt info`
shows, `params.backbone.fc_in.kernel`) to the checkpoint's name, or to None: not from
the checkpoint. It is given as `(regex, replacement)` pairs, applied in order with
`re.sub` (compiled once, here, and checked), or as a function.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

Rename = Callable[[str], "str | None"]
# What a restore call's `rename=` takes.
Given = Sequence[tuple["str | re.Pattern[str]", str]] | Callable[[str], "str | None"] | None


def unchanged(name: str) -> str | None:
    """No rename: each target leaf restores from the checkpoint's leaf of its own name."""
    return name


class Rules:
    """`(regex, replacement)` pairs applied in order with `re.sub` to each name."""

    def __init__(self, rules: Sequence[tuple[re.Pattern[str], str]]) -> None:
        self._rules = tuple(rules)

    def __call__(self, name: str) -> str:
        for pattern, replacement in self._rules:
            name = pattern.sub(replacement, name)
        return name


class Function:
    """A function from name to name, or to None; anything else it returns is a TypeError."""

    def __init__(self, function: Callable[[str], Any]) -> None:
        self._function = function

    def __call__(self, name: str) -> str | None:
        renamed = self._function(name)
        if renamed is not None and not isinstance(renamed, str):
            raise TypeError(f"rename returned {renamed!r} for {name}: it must return a str (the checkpoint's name) "
                            "or None (not from the checkpoint)")
        return renamed


def parse(rename: Any) -> Rename | None:
    """`rename` as a restore call got it, checked: None (no rename), a function, or a
    sequence of `(regex, replacement)` pairs (each regex a str or compiled pattern).
    Raises TypeError (of the wrong type) or ValueError (a regex that does not compile, a
    replacement that refers to a group the regex lacks), naming `rename` and the pair."""
    if rename is None:
        return None
    if callable(rename):
        return Function(rename)
    if isinstance(rename, (str, bytes)) or not isinstance(rename, Sequence):
        raise TypeError(f"rename must be None, a function from name to name, or a sequence of (regex, replacement) "
                        f"pairs, got {rename!r}")
    if len(rename) == 2 and all(isinstance(part, (str, re.Pattern)) for part in rename):
        raise TypeError(f"rename must be a sequence of (regex, replacement) pairs, got one pair {tuple(rename)!r}: "
                        f"put it in a list, rename=[{tuple(rename)!r}]")
    rules = []
    for i, pair in enumerate(rename):
        if (isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2
                or not isinstance(pair[0], (str, re.Pattern)) or not isinstance(pair[1], str)):
            raise TypeError(f"rename pair {i} must be a (regex, replacement) pair of str, got {pair!r}")
        try:
            pattern = re.compile(pair[0])
        except re.error as e:
            raise ValueError(f"rename pair {i} {tuple(pair)!r}: regex {pair[0]!r} does not compile: {e}") from None
        try:
            pattern.sub(pair[1], "")  # checks the replacement's group references
        except (re.error, IndexError) as e:
            raise ValueError(f"rename pair {i} {tuple(pair)!r}: replacement {pair[1]!r} is invalid: {e}") from None
        if not isinstance(pattern.pattern, str):
            raise TypeError(f"rename pair {i} must be a (regex, replacement) pair of str, got {pair!r}")
        rules.append((pattern, pair[1]))
    return Rules(rules)
