"""Orbax checkpoints, read for an import (see `_import`): the tree of one step, its
arrays read a box at a time.

Orbax (0.5 on) writes a run as one directory per step (named by its number), a step as
one directory per item (`default` for a single one), and an item as `_METADATA` (every
leaf's key path and what it was: an array, a scalar, an empty node), `_strings.json`
(its str leaves), `array_metadatas/` (a typed PRNG key's implementation) and the arrays
themselves, zarr (v2 or v3) in an OCDBT database or one directory per array, which
TensorStore reads. Only TensorStore is needed, not orbax-checkpoint.

Everything read is untrusted: metadata that is not what Orbax writes is a
CheckpointCorruptError naming the file, and no file is read whole past `_MAX_JSON`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from .._format import tree as _tree, zarrjson as _zarrjson
from .._storage import Location
from ..errors import CheckpointCorruptError, CheckpointNotFoundError

# What Orbax writes at the top of an item or a step, which no zarrckpt directory holds.
MARKERS = ("_CHECKPOINT_METADATA", "commit_success.txt", "_METADATA", "manifest.ocdbt")
EXTRA = "pip install 'zarrckpt[orbax]'"
# Orbax's key kinds in `_METADATA` (its KeyType): a sequence index, a dict key.
_SEQUENCE, _DICT = 1, 2
_EMPTY: dict[str, Callable[[], Any]] = {"None": lambda: None, "Dict": dict, "List": list, "Tuple": tuple}
# Larger metadata than any tree Orbax can save has (10,000 leaves: about 3 MB).
_MAX_JSON = 256 * 2**20
_LEAF = ("", 0)  # a key no entry has (kinds are 1 and 2): marks a leaf's value in `_put`'s dicts
_PYTHON_KINDS = {"b": "bool", "i": "int", "f": "float", "c": "complex"}


@dataclasses.dataclass
class Step:
    """One step of an Orbax run (or one item): its number, if it has one, and its tree,
    each array a `_tree.Deferred` leaf; `skipped` says what was left out, and why."""

    step: int | None
    tree: Any
    skipped: dict[str, str]


def is_orbax(loc: Location) -> bool:
    """Whether `loc` holds an Orbax item, step or run (one listing; two for a run)."""
    return _find(loc) is not None


def open_step(loc: Location, step: int | None) -> Step:
    """The tree of the Orbax item or step at `loc`, or of a run's newest step (`step`,
    if given). CheckpointNotFoundError if `loc` holds none of them, or not that step."""
    found = _find(loc)
    if found is None:
        raise CheckpointNotFoundError(f"no Orbax checkpoint at {loc.url}")
    what, numbered = found
    if what == "run":
        if step is None:
            step = next(n for n in sorted(numbered, reverse=True) if _finished(loc, numbered[n]))
        elif step not in numbered or not _finished(loc, numbered[step]):
            raise CheckpointNotFoundError(f"the Orbax run {loc.url} has no finished step {step} (its newest: "
                                          f"{', '.join(map(str, sorted(numbered)[-5:]))})")
        loc, what = loc.child(numbered[step]), "step"
    elif what == "step" and step is None:
        step = _number(loc.url.rstrip("/").rsplit("/", 1)[-1])
    if what == "item":
        return Step(step, _item_tree(loc, ""), {})
    skipped, items = {}, []
    for entry in loc.list_dir():
        if entry.type != "dir" or entry.name.startswith("."):
            continue
        if "_METADATA" in {e.name for e in loc.list_dir(entry.name)}:
            items.append(entry.name)
        else:
            skipped[entry.name] = "an item that is no pytree of arrays (no _METADATA)"
    if not items:
        raise CheckpointNotFoundError(f"the Orbax step {loc.url} holds no pytree item")
    if len(items) == 1:  # CheckpointManager's single item ("default"), restored as the tree itself
        return Step(step, _item_tree(loc.child(items[0]), ""), skipped)
    return Step(step, {name: _item_tree(loc.child(name), f"{name}.") for name in sorted(items)}, skipped)


def _find(loc: Location) -> tuple[str, dict[int, str]] | None:
    """What `loc` is ("item", "step" or "run", with a run's step directories by
    number), or None if it is no Orbax checkpoint. One listing; a run's newest steps
    are listed until one is finished."""
    entries = loc.list_dir()
    names = {e.name for e in entries}
    if "_METADATA" in names:
        return "item", {}
    if names & {"_CHECKPOINT_METADATA", "commit_success.txt"}:
        return "step", {}
    numbered = {number: e.name for e in entries if e.type == "dir" and (number := _number(e.name)) is not None}
    if any(_finished(loc, numbered[n]) for n in sorted(numbered, reverse=True)):
        return "run", numbered
    return None


def _finished(run: Location, name: str) -> bool:
    """Whether Orbax finished the step directory `name`: it writes these once every item
    is written (a step in progress has a temporary name on a local disk, and lacks them
    anywhere)."""
    return bool({"_CHECKPOINT_METADATA", "commit_success.txt"} & {e.name for e in run.list_dir(name)})


def _number(name: str) -> int | None:
    return int(name) if name.isascii() and name.isdigit() else None


def _item_tree(item: Location, prefix: str) -> Any:
    """The tree of one item, its arrays deferred (opened now, concurrently, for their
    shapes and dtypes). `prefix` names the item in errors."""
    ts = _tensorstore()
    meta = _json(item, "_METADATA")
    entries = meta.get("tree_metadata") if isinstance(meta, dict) else None
    if not isinstance(entries, dict):
        raise CheckpointCorruptError(f"{item.child('_METADATA').url} has no tree_metadata")
    ocdbt = "manifest.ocdbt" in {e.name for e in item.list_dir()}  # else one directory per array
    leaves: list[tuple[list[tuple[str, int]], dict[str, Any]]] = []
    for key, entry in entries.items():
        leaves.append((_key_path(entry, item, key), _value_metadata(entry, item, key)))
    strings = _json(item, "_strings.json") if any(v["value_type"] == "string" for _, v in leaves) else {}
    impls = _prng_impls(item)
    driver = "zarr3" if meta.get("use_zarr3") is True else "zarr"
    base = (f"file://{os.path.abspath(item.path)}" if item.is_local else item.url).rstrip("/") + "/"
    context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    arrays = [".".join(k for k, _ in keys) for keys, value in leaves
              if value["value_type"] in ("jax.Array", "np.ndarray", "scalar")]
    opening = {name: ts.open({"driver": driver, "kvstore": {"driver": "ocdbt", "base": base, "path": name} if ocdbt
                              else f"{base}{name}/"}, read=True, open=True, context=context)
               for name in arrays}
    opened = {}
    for name, future in opening.items():
        try:
            opened[name] = future.result()
        except Exception as e:  # TensorStore's own error kinds, all of them a bad or missing array
            raise CheckpointCorruptError(f"array {prefix}{name} of the Orbax checkpoint {item.url} cannot be "
                                         f"opened: {e}") from None
    built: dict[tuple[str, int], Any] = {}
    for keys, value in leaves:
        name = ".".join(k for k, _ in keys)
        kind = value["value_type"]
        if kind in _EMPTY:
            leaf = _EMPTY[kind]()
        elif kind == "string":
            leaf = strings.get(name) if isinstance(strings, dict) else None
            if not isinstance(leaf, str):
                raise CheckpointCorruptError(f"{item.child('_strings.json').url} lacks the str leaf {prefix}{name}")
        elif name in opened:
            leaf = _deferred(opened[name], kind, impls.get(name), f"{prefix}{name}")
        else:
            raise CheckpointCorruptError(f"leaf {prefix}{name} of {item.child('_METADATA').url} is of a kind "
                                         f"zarrckpt does not know: {kind!r:.80}")
        _put(built, keys, leaf, item)
    return _sequences(built, item)


def _deferred(array: Any, value_type: str, prng_impl: str | None, shown: str) -> _tree.Deferred:
    dtype = np.dtype(array.dtype.numpy_dtype)

    def read(box: tuple[tuple[int, int], ...]) -> np.ndarray:
        try:
            return np.asarray(array[tuple(slice(a, b) for a, b in box)].read().result())
        except Exception as e:  # TensorStore's own error kinds: a chunk missing or unreadable
            raise CheckpointCorruptError(f"reading array {shown} of an Orbax checkpoint: {e}") from None

    if value_type == "scalar" and array.shape == ():
        python = _PYTHON_KINDS.get(dtype.kind)
        kind = python if python is not None and dtype == _tree.PYTHON_DTYPES[python] else "numpy_scalar"
    elif prng_impl is not None:
        kind = "prng_key"
    else:
        kind = "numpy" if value_type == "np.ndarray" else "jax"
    chunks = array.chunk_layout.read_chunk.shape
    return _tree.Deferred(tuple(array.shape), dtype, read, kind, prng_impl,
                          tuple(min(c, n) for c, n in zip(chunks, array.shape)) if chunks is not None else None)


def _key_path(entry: Any, item: Location, key: str) -> list[tuple[str, int]]:
    keys = entry.get("key_metadata") if isinstance(entry, dict) else None
    if not isinstance(keys, list) or not keys or len(keys) > _tree.MAX_DEPTH:
        raise CheckpointCorruptError(f"{item.child('_METADATA').url}: the entry {key!r:.80} has no usable key path")
    out = []
    for k in keys:
        if not isinstance(k, dict) or not isinstance(k.get("key"), str) or k.get("key_type") not in (_SEQUENCE,
                                                                                                       _DICT):
            raise CheckpointCorruptError(f"{item.child('_METADATA').url}: the entry {key!r:.80} has a malformed key")
        out.append((k["key"], k["key_type"]))
    return out


def _value_metadata(entry: dict[str, Any], item: Location, key: str) -> dict[str, Any]:
    value = entry.get("value_metadata")
    if not isinstance(value, dict) or not isinstance(value.get("value_type"), str):
        raise CheckpointCorruptError(f"{item.child('_METADATA').url}: the entry {key!r:.80} says no value type")
    return value


def _put(built: dict[tuple[str, int], Any], keys: list[tuple[str, int]], leaf: Any, item: Location) -> None:
    """Puts `leaf` at `keys` in nested dicts (keyed by (key, kind), made lists later)."""
    node = built
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict) or _LEAF in node:
            raise CheckpointCorruptError(f"{item.child('_METADATA').url}: a leaf is also a subtree at "
                                         f"{'.'.join(k for k, _ in keys)!r:.200}")
    if keys[-1] in node:
        raise CheckpointCorruptError(f"{item.child('_METADATA').url}: two entries for "
                                     f"{'.'.join(k for k, _ in keys)!r:.200}")
    node[keys[-1]] = {_LEAF: leaf}


def _sequences(node: dict[Any, Any], item: Location) -> Any:
    """The nested (key, kind) dicts as Orbax restores them: lists where every key is a
    sequence index, 0 to n-1; dicts elsewhere."""
    if _LEAF in node:
        return node[_LEAF]
    children = {key: _sequences(child, item) for key, child in node.items()}
    if children and all(kind == _SEQUENCE for _, kind in children):
        indices = sorted(int(k) if k.isascii() and k.isdigit() else -1 for k, _ in children)
        if indices != list(range(len(indices))):
            raise CheckpointCorruptError(f"{item.child('_METADATA').url}: a sequence's indices are not 0 to "
                                         f"{len(indices) - 1}")
        return [children[(str(i), _SEQUENCE)] for i in range(len(indices))]
    out = {}
    for key, _ in children:
        if key in out:
            raise CheckpointCorruptError(f"{item.child('_METADATA').url}: the key {key!r:.80} is both a sequence "
                                         "index and a dict key")
        out[key] = children[(key, _DICT)] if (key, _DICT) in children else children[(key, _SEQUENCE)]
    return out


def _prng_impls(item: Location) -> dict[str, str]:
    """The implementation of each typed PRNG key array, by its name, from what process 0
    wrote to `array_metadatas/` (every process writes the same of a global array)."""
    if "process_0" not in {e.name for e in item.list_dir("array_metadatas")}:
        return {}
    doc = _json(item, "array_metadatas/process_0")
    found = {}
    for entry in doc.get("array_metadatas", []) if isinstance(doc, dict) else []:
        meta = entry.get("array_metadata") if isinstance(entry, dict) else None
        ext = meta.get("ext_metadata") if isinstance(meta, dict) else None
        impl = ext.get("random_key_impl") if isinstance(ext, dict) else None
        if isinstance(impl, str) and isinstance(meta.get("param_name"), str):  # type: ignore[union-attr]
            found[meta["param_name"]] = impl  # type: ignore[index]
    return found


def _json(item: Location, key: str) -> Any:
    try:
        raw = item.read(key, limit=_MAX_JSON + 1)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{item.child(key).url} is missing") from None
    if len(raw) > _MAX_JSON:
        raise CheckpointCorruptError(f"{item.child(key).url} is larger than any Orbax checkpoint's metadata")
    try:
        return _zarrjson.decode(raw)
    except ValueError as e:
        raise CheckpointCorruptError(f"{item.child(key).url} is not JSON: {e}") from None


def _tensorstore() -> Any:
    try:
        import tensorstore
    except ModuleNotFoundError:
        raise ModuleNotFoundError(f"reading an Orbax checkpoint needs TensorStore: {EXTRA}") from None
    return tensorstore
