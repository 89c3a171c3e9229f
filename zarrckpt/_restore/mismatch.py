"""The report of a target that does not match its checkpoint: every problem, grouped
by subtree where a whole subtree has the same one, capped in length, and what can
help (a subtree present under another name, the `rename=` that maps the target's names
onto the checkpoint's, `partial=True`, `fallback=True`).

Pure: key paths and texts in, the message out.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Mapping, Sequence

from .._format import tree as _tree

MISSING = "in the target but not in the checkpoint"
RENAMED_MISSING = "not in the checkpoint"  # under the name `rename=` gave it
RENAMED_AWAY = "not from the checkpoint (rename gave None for it)"
EXTRA = "in the checkpoint but not in the target"
# Reports of up to this many problems list each one; longer ones group, then cut, the listing.
LISTED = 20

Problem = tuple[_tree.KeyPath, str]  # a leaf's key path, and what is wrong with it
# Rounds of one renamed path component each that a suggested `rename=` may take.
_SUGGESTED_ROUNDS = 3


Shaped = tuple[str, "tuple[int, ...] | None"]  # a leaf's name, and its shape where known


@dataclasses.dataclass(frozen=True)
class Names:
    """The names (as `zarrckpt info` shows them) and shapes of the target's leaves the
    checkpoint lacks, as looked up, and of the checkpoint's leaves the target lacks, by
    key path as `_tree.describe_path` writes it; `renamed`: the names looked up are
    those a `rename=` gave, so a suggested rename applies after it."""

    missing: Mapping[str, Shaped] = dataclasses.field(default_factory=dict)
    extra: Mapping[str, Shaped] = dataclasses.field(default_factory=dict)
    renamed: bool = False


def _is_missing(text: str) -> bool:
    return text.startswith((MISSING, RENAMED_MISSING, RENAMED_AWAY))


def report(url: str, problems: Sequence[Problem], target: Sequence[_tree.KeyPath],
           extra: Sequence[_tree.KeyPath], saved: Sequence[_tree.KeyPath], partial: bool, *,
           labels: Mapping[str, tuple[str, str]] | None = None, names: Names | None = None,
           fallback_helps: bool = False) -> str:
    """The message of a CheckpointMismatchError: `problems` of target leaves (of key
    paths `target`), and the checkpoint's leaves the target lacks (`extra`, of key
    paths `saved`), problems themselves unless `partial`. `labels` gives the renamed
    target leaves the checkpoint lacks (by key path as written) their own names and the
    names they were renamed to; `names` gives the names
    a suggested `rename=` maps; `fallback_helps`: every target leaf the checkpoint lacks
    is a value `fallback=True` would keep."""
    labels = labels or {}
    names = names or Names()
    listed = list(problems) + ([] if partial else [(path, EXTRA) for path in extra])
    missing = [path for path, text in problems if _is_missing(text)]
    renamed = _renamed(_grouped([(p, MISSING) for p in missing], target), _grouped([(p, EXTRA) for p in extra], saved),
                       target, saved)
    if len(listed) <= LISTED:
        lines = [f"{f'{labels[where][0]} (renamed to {labels[where][1]})' if where in labels else where}: {text}"
                 for path, text in listed
                 for where in [_tree.describe_path(path)]]
    else:
        groups = _grouped(problems, target) + ([] if partial else _grouped([(p, EXTRA) for p in extra], saved))
        lines = [f"{_tree.describe_path(path)}{f' ({count} leaves)' if count > 1 else ''}: {text}"
                 + _renamed_example(path, text, problems, labels) for path, text, count in groups]
        if len(lines) > LISTED:
            lines = lines[:LISTED] + [f"... and {len(lines) - LISTED} more"]
    hints = [f"the target's {_tree.describe_path(t)} and the checkpoint's {_tree.describe_path(c)} hold the same "
             f"{count} key paths below them: a renamed subtree? put it at {_tree.describe_path(c)} in the target "
             "to restore it" for t, c, count in renamed]
    unexplained_extra = [p for p in extra if not any(_under(p, c) for _, c, _ in renamed)]
    unexplained_missing = [p for p in missing if not any(_under(p, t) for t, _, _ in renamed)]
    if unexplained_extra and not partial:
        hints.append("pass partial=True to restore only the target's leaves and skip the checkpoint's others"
                     + ("; the target's leaves the checkpoint lacks must still leave the target" if unexplained_missing
                        else "") + (_FALLBACK if unexplained_missing and fallback_helps else ""))
    elif unexplained_missing:
        hints.append("the target's leaves the checkpoint lacks cannot be restored, with partial=True or without: "
                     "leave them out of the target and make them after the restore"
                     + (_FALLBACK if fallback_helps else ""))
    if unexplained_missing and unexplained_extra:
        hints += _rename_hint(
            [names.missing[w] for p in unexplained_missing if (w := _tree.describe_path(p)) in names.missing],
            [names.extra[w] for p in unexplained_extra if (w := _tree.describe_path(p)) in names.extra],
            names.renamed)
    return (f"checkpoint {url} does not match the target ({len(listed)} problem(s)):\n  " + "\n  ".join(lines)
            + "".join(f"\n({hint})" for hint in hints))


def _renamed_example(subtree: _tree.KeyPath, text: str, problems: Sequence[Problem],
                     labels: Mapping[str, tuple[str, str]]) -> str:
    """For a group of renamed leaves the checkpoint lacks: the first one's names."""
    if not text.startswith(RENAMED_MISSING):
        return ""
    first = next(where for path, t in problems if t == text and _under(path, subtree)
                 for where in [_tree.describe_path(path)] if where in labels)
    return f" ({labels[first][0]} renamed to {labels[first][1]}, and the others alike)"


def _keys(path: _tree.KeyPath) -> tuple[str, ...]:
    return tuple(_tree.describe_path((entry,)) for entry in path)


def _under(path: _tree.KeyPath, subtree: _tree.KeyPath) -> bool:
    return _keys(path)[:len(subtree)] == _keys(subtree)


def _grouped(problems: Sequence[Problem], side: Sequence[_tree.KeyPath]) -> list[tuple[_tree.KeyPath, str, int]]:
    """(subtree, text, leaves) in the order of `problems`: each problem in the largest
    subtree below the root all of whose leaves on its side (key paths `side`) have
    that same problem, with the number of those leaves."""
    leaves = collections.Counter(k[:n] for path in side for k in [_keys(path)] for n in range(1, len(k) + 1))
    same = collections.Counter((k[:n], text) for path, text in problems for k in [_keys(path)]
                               for n in range(1, len(k) + 1))
    groups: dict[tuple[tuple[str, ...], str], tuple[_tree.KeyPath, int]] = {}
    for path, text in problems:
        k = _keys(path)
        n = next((n for n in range(1, len(k) + 1) if same[(k[:n], text)] == leaves[k[:n]]), len(k))
        groups.setdefault((k[:n], text), (tuple(path[:n]), max(leaves[k[:n]], 1)))
    return [(subtree, text, count) for (_, text), (subtree, count) in groups.items()]


def _renamed(missing: list[tuple[_tree.KeyPath, str, int]], extra: list[tuple[_tree.KeyPath, str, int]],
             target: Sequence[_tree.KeyPath], saved: Sequence[_tree.KeyPath]
             ) -> list[tuple[_tree.KeyPath, _tree.KeyPath, int]]:
    """(the target's subtree, the checkpoint's, leaves): whole subtrees of several leaves,
    one missing from the checkpoint and one from the target, with the same key paths
    below them, where no other such subtree has those."""

    def below(subtree: _tree.KeyPath, side: Sequence[_tree.KeyPath]) -> frozenset[tuple[str, ...]]:
        k = _keys(subtree)
        return frozenset(_keys(path)[len(k):] for path in side if _keys(path)[:len(k)] == k)

    theirs = collections.defaultdict(list)
    for subtree, _, count in extra:
        if count > 1:
            theirs[below(subtree, saved)].append(subtree)
    ours = collections.defaultdict(list)
    for subtree, _, count in missing:
        if count > 1:
            ours[below(subtree, target)].append(subtree)
    return [(t[0], theirs[shape][0], len(shape)) for shape, t in ours.items()
            if len(t) == 1 and len(theirs.get(shape, ())) == 1]


_FALLBACK = ", or pass fallback=True to keep the target's own values for them"


def _rename_hint(missing: Sequence[Shaped], extra: Sequence[Shaped], renamed: bool) -> list[str]:
    """The hint of the `rename=` that maps `missing` (the target's names the checkpoint
    lacks) onto `extra` (the checkpoint's names the target lacks), where their names
    differ by renamed path components; none where no such rename restores any. With
    `renamed`, `missing` are the names a given `rename=` looked up, and the pairs go
    after its own."""
    rules = suggest_rename(missing, extra)
    if not rules:
        return []
    saved = {name for name, _ in extra}
    found = sum(_apply(rules, name) in saved for name, _ in missing)
    shown = ", ".join(f'(r"{pattern}", {"r" if chr(92) in replacement else ""}"{replacement}")'
                      for pattern, replacement in rules)
    if renamed:
        return [f"the names rename= gave and the checkpoint's differ by renamed path components: the pairs [{shown}] "
                f"applied after it find {found} of the {len(missing)} target leaves the checkpoint lacks"]
    return [f"the target's names and the checkpoint's differ by renamed path components: rename=[{shown}] "
            f"finds {found} of the {len(missing)} target leaves the checkpoint lacks"]


def _apply(rules: Sequence[tuple[str, str]], name: str) -> str:
    for pattern, replacement in rules:
        name = re.sub(pattern, replacement, name)
    return name


def suggest_rename(missing: Sequence[Shaped], extra: Sequence[Shaped]) -> list[tuple[str, str]]:
    """`(regex, replacement)` pairs, target name to checkpoint name, that map names of
    `missing` onto names of `extra` where the two differ in one path component (a
    renamed module, layer or prefix) and the shapes agree (where both are known; they
    tell renamed siblings apart), in up to `_SUGGESTED_ROUNDS` rounds (a name with
    two renamed components takes two). A component renamed under one prefix is replaced
    under it (`^params\\.encoder\\.`); one renamed under several, wherever it is."""
    saved = dict(extra)
    rules: list[tuple[str, str]] = []
    for _ in range(_SUGGESTED_ROUNDS):
        pending = [(n, shape) for name, shape in missing if (n := _apply(rules, name)) not in saved]
        if not pending:
            break
        taken = {_apply(rules, name) for name, _ in missing}
        options: dict[tuple[int, tuple[str, ...], tuple[str, ...]], dict[str, tuple[int, ...] | None]] = \
            collections.defaultdict(dict)
        for name, shape in saved.items():
            if name not in taken:
                parts = tuple(name.split("."))
                for i in range(len(parts)):
                    options[(i, parts[:i], parts[i + 1:])][parts[i]] = shape
        renames: dict[tuple[str, str, bool], set[tuple[str, ...]]] = collections.defaultdict(set)
        for name, shape in pending:
            parts = tuple(name.split("."))
            found = [(i, new) for i in range(len(parts))
                     for new, theirs in options.get((i, parts[:i], parts[i + 1:]), {}).items()
                     if new != parts[i] and (shape is None or theirs is None or shape == theirs)]
            if len(found) == 1:
                i, new = found[0]
                renames[(parts[i], new, i == len(parts) - 1)].add(parts[:i])
        if not renames:
            break
        for (old, new, last), prefixes in renames.items():
            end, tail = ("$", "") if last else (r"\.", ".")
            if len(prefixes) == 1:
                (prefix,) = prefixes
                before = "".join(f"{part}." for part in prefix)
                rules.append(("^" + re.escape(before + old) + end, before + new + tail))
            else:
                rules.append((r"(^|\.)" + re.escape(old) + end, r"\1" + new + tail))
    return rules
