"""The items of an Orbax step that hold no pytree of arrays, read for an import (see
`orbax.open_step`): `JsonSave` items, grain's iterator positions and the step's metrics.

- A `JsonSave` item (its one file, `metadata`) comes as a str leaf: its JSON text as
  Orbax wrote it, whatever JSON value it holds (`json.loads` gives the value back), so
  that a restore target stands for it with any str (`""`) and need not know its keys.
- A grain iterator's position (`grain.checkpoint.CheckpointSave`: one
  `process_<i>-of-<n>.json` per process) comes as `PerProcess(<its JSON value>)`, the
  leaf zarrckpt saves a data loader's position as, where one process wrote it; the
  positions of several processes are left out (an import is a job of one process).
- The step's metrics (CheckpointManager's `metrics` item, what `best_fn` ranks; else
  the `metrics` of `_CHECKPOINT_METADATA`) are kept where a manager keeps a step's
  metrics, so that `keep_best` ranks the step: its real numbers, NaN and infinities
  as a manager keeps them; other values are left out.

Everything read is untrusted: no file is read past `MAX_JSON`, a file that is not JSON
is a CheckpointCorruptError naming it, and only regular files are read.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from .._format import tree as _tree, zarrjson as _zarrjson
from .._storage import Location
from ..errors import CheckpointCorruptError

# Larger metadata than any tree Orbax saves has (10,000 leaves: about 3 MB); parsing
# takes about 8 times the file's size.
MAX_JSON = 64 * 2**20
METRICS_ITEM = "metrics"  # CheckpointManager's item of a step's metrics
_JSON_FILE = "metadata"  # JsonSave's file (JsonCheckpointHandler's default name)
_COMMIT_FILE = "commit_success.txt"  # what Orbax writes last in an item on an object store
_STEP_METADATA = "_CHECKPOINT_METADATA"
_POSITION_FILE = re.compile(r"process_(\d{1,9})-of-(\d{1,9})\.json")  # grain's, one per process


@dataclasses.dataclass(frozen=True)
class Items:
    """What an import brings of a step's items that hold no pytree of arrays: the leaves
    of the tree by item name, the step's metrics (None if it has none) and what was left
    out, with why."""

    tree: dict[str, Any]
    metrics: dict[str, Any] | None
    skipped: dict[str, str]


def read_items(step: Location, names: list[str]) -> Items:
    """The items `names` of the Orbax step at `step`, none of which holds `_METADATA`
    (see the module's docstring). CheckpointCorruptError, naming the file, for a file
    that is not JSON or larger than `MAX_JSON`, or grain files that are not one per
    process of one job."""
    tree: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    metrics: dict[str, Any] | None = None
    for name in names:
        item = step.child(name)
        entries = item.list_dir()
        files = {e.name for e in entries if e.type == "file"} - {_COMMIT_FILE}
        odd = [e.name for e in entries if e.type != "file"]
        if odd:
            skipped[name] = f"an item that is no pytree of arrays, JSON or grain position (it holds {odd[0]!r:.80})"
        elif name == METRICS_ITEM and files == {METRICS_ITEM}:
            metrics = _metrics(read_json(item, METRICS_ITEM)[1], item.child(METRICS_ITEM).url, skipped)
        elif files == {_JSON_FILE}:
            tree[name] = _text(item, _JSON_FILE)
        elif files and all(_POSITION_FILE.fullmatch(f) for f in files):
            position = _position(item, files)
            if isinstance(position, str):
                skipped[name] = position
            else:
                tree[name] = position
        else:
            skipped[name] = "an item that is no pytree of arrays (no _METADATA), JSON (JsonSave) or grain position"
    if metrics is None and _STEP_METADATA in {e.name for e in step.list_dir() if e.type == "file"}:
        found = read_json(step, _STEP_METADATA)[1]
        kept = found.get("metrics") if isinstance(found, dict) else None
        if isinstance(kept, dict) and kept:
            metrics = _metrics(kept, step.child(_STEP_METADATA).url, skipped)
    return Items(tree, metrics, skipped)


def read_json(loc: Location, key: str) -> tuple[bytes, Any]:
    """The file `key` below `loc`, as read and as JSON; CheckpointCorruptError, naming
    it, if it is missing, larger than `MAX_JSON` (no more than that is read) or not JSON."""
    try:
        raw = loc.read(key, limit=MAX_JSON + 1)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{loc.child(key).url} is missing") from None
    if len(raw) > MAX_JSON:
        raise CheckpointCorruptError(f"{loc.child(key).url} is larger than any Orbax checkpoint's metadata")
    try:
        return raw, _zarrjson.decode(raw)
    except ValueError as e:
        raise CheckpointCorruptError(f"{loc.child(key).url} is not JSON: {e}") from None


def _text(item: Location, key: str) -> str:
    """A JsonSave item's JSON text, checked to be JSON."""
    raw = read_json(item, key)[0]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointCorruptError(f"{item.child(key).url} is not UTF-8 text: {e}") from None


def _position(item: Location, files: set[str]) -> _tree.PerProcess | str:
    """A grain iterator's position, written by one process, as `PerProcess`; or why it
    is left out (the positions of several processes)."""
    found = {(int(m[1]), int(m[2])) for f in files if (m := _POSITION_FILE.fullmatch(f))}
    counts = {n for _, n in found}
    count = next(iter(counts))
    if len(counts) > 1 or {i for i, _ in found} != set(range(count)):
        raise CheckpointCorruptError(f"{item.url} holds grain positions {', '.join(sorted(files)):.200} that are not "
                                     "one per process of one job (process_<i>-of-<n>.json, i from 0 to n-1)")
    if count > 1:
        return (f"grain iterator positions of {count} processes: an import is a job of one process; restore each "
                f"process's position from its process_<i>-of-{count}.json")
    return _tree.PerProcess(read_json(item, "process_0-of-1.json")[1])


def _metrics(found: Any, url: str, skipped: dict[str, str]) -> dict[str, Any] | None:
    """The real numbers of a step's metrics, NaN and infinities as a manager keeps them
    (`zarrjson.NON_FINITE`); what else it holds is added to `skipped`."""
    if not isinstance(found, dict):
        skipped[METRICS_ITEM] = f"{url} holds no dict of named metrics"
        return None
    metrics = {}
    for name, value in found.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            skipped[f"{METRICS_ITEM}.{name}"] = (f"a metric that is no number ({type(value).__name__}): keep_best "
                                                 "ranks numbers")
        else:
            metrics[name] = value if math.isfinite(value) else _zarrjson.NON_FINITE[str(value)]
    return metrics
