"""The report of a target that does not match its checkpoint: every problem, grouped
by subtree where a whole subtree has the same one, capped in length, and what can
help (a subtree present under another name, `partial=True`).

Pure: key paths and texts in, the message out.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from .._format import tree as _tree

MISSING = "in the target but not in the checkpoint"
EXTRA = "in the checkpoint but not in the target"
# Reports of up to this many problems list each one; longer ones group, then cut, the listing.
LISTED = 20

Problem = tuple[_tree.KeyPath, str]  # a leaf's key path, and what is wrong with it


def report(url: str, problems: Sequence[Problem], target: Sequence[_tree.KeyPath],
           extra: Sequence[_tree.KeyPath], saved: Sequence[_tree.KeyPath], partial: bool) -> str:
    """The message of a CheckpointMismatchError: `problems` of target leaves (of key
    paths `target`), and the checkpoint's leaves the target lacks (`extra`, of key
    paths `saved`), problems themselves unless `partial`."""
    listed = list(problems) + ([] if partial else [(path, EXTRA) for path in extra])
    missing = [path for path, text in problems if text == MISSING]
    renamed = _renamed(_grouped([(p, MISSING) for p in missing], target), _grouped([(p, EXTRA) for p in extra], saved),
                       target, saved)
    if len(listed) <= LISTED:
        lines = [f"{_tree.describe_path(path)}: {text}" for path, text in listed]
    else:
        groups = _grouped(problems, target) + ([] if partial else _grouped([(p, EXTRA) for p in extra], saved))
        lines = [f"{_tree.describe_path(path)}{f' ({count} leaves)' if count > 1 else ''}: {text}"
                 for path, text, count in groups]
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
                        else ""))
    elif unexplained_missing:
        hints.append("the target's leaves the checkpoint lacks cannot be restored, with partial=True or without: "
                     "leave them out of the target and make them after the restore")
    return (f"checkpoint {url} does not match the target ({len(listed)} problem(s)):\n  " + "\n  ".join(lines)
            + "".join(f"\n({hint})" for hint in hints))


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
