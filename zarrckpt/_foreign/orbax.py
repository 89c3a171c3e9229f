"""Orbax checkpoints, read for an import (see `_import`): the tree of one step, its
arrays read a box at a time.

Orbax (0.5 on) writes a run as one directory per step (named by its number), a step as
one directory per item (`default` for a single one), and an item as `_METADATA` (every
leaf's key path and what it was: an array, a scalar, an empty node), `_strings.json`
(its str leaves), `array_metadatas/` (a typed PRNG key's implementation) and the arrays
themselves, zarr (v2 or v3) in an OCDBT database or one directory per array, which
TensorStore reads. Only TensorStore is needed, not orbax-checkpoint.

Everything read is untrusted: metadata that is not what Orbax writes is a
CheckpointCorruptError naming the file, no file is read past `orbax_items.MAX_JSON`, and a key
never names a path outside the item. The step's other items (JSON, grain positions,
metrics) are `orbax_items`' business.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .._format import chunks as _chunks, tree as _tree
from .._restore import checkpoint as _reader
from .._storage import Location
from .._util import progress as _progress
from .._util.regions import Region, region_shape, region_slices
from ..errors import CheckpointCorruptError, CheckpointNotFoundError, UnsupportedLeafError
from . import orbax_items as _items

log = logging.getLogger("zarrckpt")

# What Orbax writes at the top of an item or a step, which no zarrckpt directory holds.
MARKERS = ("_CHECKPOINT_METADATA", "commit_success.txt", "_METADATA", "manifest.ocdbt")
EXTRA = "pip install 'zarrckpt[orbax]'"
# Orbax's key kinds in `_METADATA` (its KeyType): a sequence index, a dict key.
_SEQUENCE, _DICT = 1, 2
# Empty nodes, as Orbax restores them without a target (an empty NamedTuple, optax's
# EmptyState, as None: what Orbax's metadata says of it unless rich types are on).
_EMPTY: dict[str, Callable[[], Any]] = {"None": lambda: None, "NamedTuple": lambda: None, "Dict": dict,
                                        "List": list, "Tuple": tuple}
_LEAF = ("", 0)  # a key no entry has (kinds are 1 and 2): marks a leaf's value in `_put`'s dicts
# TensorStore's error codes that say the data is not what it should be; others (denied,
# unavailable...) are failures to read it.
_DAMAGE = frozenset({"NOT_FOUND", "DATA_LOSS", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "OUT_OF_RANGE"})
_TENSORSTORE_DRIVERS = {"gs": "gcs", "gcs": "gcs", "s3": "s3", "s3a": "s3"}  # by fsspec's names


@dataclasses.dataclass
class Step:
    """One step of an Orbax run (or one item): its number, if it has one, and its tree,
    each array a `_tree.Deferred` leaf; `skipped` says what was left out, and why;
    `metrics` are the step's metrics (see `orbax_items`), or None."""

    step: int | None
    tree: Any
    skipped: dict[str, str]
    metrics: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class Found:
    """What an Orbax checkpoint at a place is (see `find`)."""

    kind: str  # "item", "step" or "run"
    steps: dict[int, str]  # a run's step directories, by number
    newest: int | None  # a run's newest finished step


def is_orbax(loc: Location) -> bool:
    """Whether `loc` holds an Orbax item, step or run (see `find`)."""
    return find(loc) is not None


def open_step(loc: Location, found: Found, step: int | None) -> Step:
    """The tree of the Orbax item or step at `loc`, or of a run's newest finished step
    (`step`, if given), as `find` found it. CheckpointNotFoundError if a run has no
    finished step `step`."""
    kind = found.kind
    if kind == "run":
        if step is None:
            step = found.newest
        elif step not in found.steps or not _finished(loc, found.steps[step]):
            raise CheckpointNotFoundError(f"the Orbax run {loc.url} has no finished step {step} (its newest: "
                                          f"{', '.join(map(str, sorted(found.steps)[-5:]))})")
        assert step is not None
        loc, kind = loc.child(found.steps[step]), "step"
    elif kind == "step" and step is None:
        step = _number(loc.url.rstrip("/").rsplit("/", 1)[-1])
    if kind == "item":
        return Step(step, _item_tree(loc, ""), {})
    items: list[str] = []
    others: list[str] = []
    for entry in loc.list_dir():
        if entry.type != "dir" or entry.name.startswith("."):
            continue
        (items if "_METADATA" in {e.name for e in loc.list_dir(entry.name)} else others).append(entry.name)
    read = _items.read_items(loc, others)
    if not items and not read.tree:
        raise CheckpointNotFoundError(f"the Orbax step {loc.url} holds no item to import")
    if items == ["default"] and not read.tree:  # CheckpointManager's single item: the tree itself, as Orbax restores it
        return Step(step, _item_tree(loc.child("default"), ""), read.skipped, read.metrics)
    tree = {name: _item_tree(loc.child(name), f"{name}.") for name in items} | read.tree
    return Step(step, {name: tree[name] for name in sorted(tree)}, read.skipped, read.metrics)


def find(loc: Location) -> Found | None:
    """What `loc` is, or None if it is no Orbax checkpoint (one listing; a run's newest
    steps are listed until one is finished)."""
    entries = loc.list_dir()
    names = {e.name for e in entries}
    if "_METADATA" in names:
        return Found("item", {}, None)
    if names & {"_CHECKPOINT_METADATA", "commit_success.txt"}:
        return Found("step", {}, None)
    steps = {number: e.name for e in entries if e.type == "dir" and (number := _number(e.name)) is not None}
    newest = next((n for n in sorted(steps, reverse=True) if _finished(loc, steps[n])), None)
    return Found("run", steps, newest) if newest is not None else None


def _finished(run: Location, name: str) -> bool:
    """Whether Orbax finished writing the step directory `name`. On an object store it
    writes the step in place and `commit_success.txt` last; on a local disk it renames a
    finished step into place (its `_CHECKPOINT_METADATA` is there from the start)."""
    names = {e.name for e in run.list_dir(name)}
    return "commit_success.txt" in names or (run.has_directories and "_CHECKPOINT_METADATA" in names)


def _number(name: str) -> int | None:
    """A step directory's number (Orbax may pad it with zeros)."""
    return int(name) if name.isascii() and name.isdigit() else None


def _item_tree(item: Location, prefix: str) -> Any:
    """The tree of one item, its arrays deferred (opened now, concurrently, for their
    shapes and dtypes). `prefix` names the item in errors.

    What the item claims is checked against what it holds before anything is read:
    only regular files, no symbolic link (TensorStore would follow one out of the
    item), and every chunk of every array, unless Orbax wrote the item sparse."""
    ts = _tensorstore()
    files = _regular_files(item)
    metadata = item.child("_METADATA").url
    meta = _json(item, "_METADATA")
    entries = meta.get("tree_metadata") if isinstance(meta, dict) else None
    if not isinstance(entries, dict):
        raise CheckpointCorruptError(f"{metadata} has no tree_metadata")
    ocdbt = "manifest.ocdbt" in files  # else one directory per array
    leaves = [(_key_path(entry, metadata, key, ocdbt), _value_metadata(entry, metadata, key))
              for key, entry in entries.items()]
    strings = _json(item, "_strings.json") if any(v["value_type"] == "string" for _, v in leaves) else {}
    impls = _prng_impls(item)
    driver = "zarr3" if meta.get("use_zarr3") is True else "zarr"
    # An older Orbax left out chunks equal to the fill value; a newer one writes every
    # chunk and says so, and then a missing one is damage, not zeros.
    sparse = meta.get("store_array_data_equal_to_fill_value") is not True
    context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    base = _kvstore(item)
    arrays = [".".join(k for k, _ in keys) for keys, value in leaves
              if value["value_type"] in ("jax.Array", "np.ndarray", "scalar")]
    opening = {name: ts.open({"driver": driver, "fill_missing_data_reads": sparse,
                              "kvstore": {"driver": "ocdbt", "base": base, "path": name} if ocdbt
                              else {**base, "path": f"{base['path']}{name}/"}}, read=True, open=True, context=context)
               for name in arrays}
    opened = {name: _answer(future, item, f"opening array {prefix}{name} of the Orbax checkpoint {item.url}")
              for name, future in opening.items()}
    if ocdbt:
        listing = f"listing the arrays of the Orbax checkpoint {item.url}"
        kvstore = _answer(ts.KvStore.open({"driver": "ocdbt", "base": base}, context=context), item, listing)
        keys = sorted(k.decode("utf-8", "replace") for k in _answer(kvstore.list(), item, listing))
    else:
        keys = sorted(files)
    _check_claims(opened, keys, sparse, sum(files.values()), prefix, item.url)
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
            impl = impls.get(name)
            leaf = _deferred(opened[name], kind, impl, f"{prefix}{name}", item)
            if impl is not None and (problem := _reader.key_data_problem(impl, leaf.shape, leaf.dtype)) is not None:
                raise CheckpointCorruptError(f"{item.child('array_metadatas/process_0').url} says array "
                                             f"{prefix}{name} holds PRNG keys, but {problem}")
        else:
            raise UnsupportedLeafError(f"leaf {prefix}{name} of the Orbax checkpoint {item.url} is a "
                                       f"{kind!r:.80}, which zarrckpt cannot import")
        _put(built, keys, leaf, metadata)
    return _sequences(built, metadata)


def _deferred(array: Any, value_type: str, prng_impl: str | None, shown: str, item: Location) -> _tree.Deferred:
    dtype = np.dtype(array.dtype.numpy_dtype)

    def read(box: Region) -> np.ndarray:
        return np.asarray(_answer(array[region_slices(box)].read(), item, f"reading array {shown} of the Orbax "
                                  f"checkpoint {item.url}", math.prod(region_shape(box)) * dtype.itemsize))

    if value_type == "scalar" and array.shape == ():
        # Orbax keeps no difference between 3 and np.int64(3): a Python scalar's dtype is
        # taken for one, any other for a numpy scalar.
        python = next((name for name, d in _tree.PYTHON_DTYPES.items() if d == dtype), None)
        kind = python or "numpy_scalar"
    elif prng_impl is not None:
        kind = "prng_key"
    else:
        kind = "numpy" if value_type == "np.ndarray" else "jax"
    chunks = array.chunk_layout.read_chunk.shape
    return _tree.Deferred(tuple(array.shape), dtype, read, kind, prng_impl,
                          tuple(min(c, n) for c, n in zip(chunks, array.shape)) if chunks is not None else None)


def _answer(future: Any, item: Location, what: str, nbytes: int = 0) -> Any:
    """What TensorStore's `future` (an operation on `item`, moving about `nbytes`) comes
    to, or its error as zarrckpt's (see `_read_error`). On an object store it is
    abandoned (cancelled) after the time any request there may take with all its
    retries (`Guarded.patience`), since TensorStore makes its requests and retries them
    inside it, as TimeoutError, an OSError. A local disk's have no deadline, as in
    `_storage.local`."""
    timeout = item.patience(nbytes)
    try:
        return future.result(timeout=timeout)
    except TimeoutError as e:
        if timeout is None or future.done():  # TensorStore's own deadline error, not ours
            raise _read_error(e, what) from None
        future.cancel()
        raise TimeoutError(f"{what}: no answer in {timeout:.0f} s (storage option request_timeout_s)") from None
    except Exception as e:  # TensorStore's own error kinds
        raise _read_error(e, what) from None


def _read_error(e: Exception, what: str) -> Exception:
    """A TensorStore error as zarrckpt's: damage (an array missing, or not what its
    metadata says) is a CheckpointCorruptError; anything else (denied, unavailable) an
    OSError."""
    text = str(e).split(" [tensorstore_spec=", 1)[0]  # the spec repeats what the message says, at length
    return (CheckpointCorruptError if text.split(":", 1)[0] in _DAMAGE else OSError)(f"{what}: {text}")


def _kvstore(item: Location) -> dict[str, Any]:
    """The item's place as TensorStore's JSON spec, its path as data: TensorStore would
    percent-decode a URL, so that a name holding '%', '#' or '?' (or a planted '%2F..')
    would name another place."""
    if (on_disk := item.file_path) is not None:
        return {"driver": "file", "path": f"{on_disk}/"}
    scheme, _, rest = item.url.partition("://")
    bucket, _, path = rest.partition("/")
    if scheme not in _TENSORSTORE_DRIVERS:
        raise ValueError(f"TensorStore cannot read the Orbax checkpoint {item.url}: it reads gs:// and s3:// URLs "
                         "and local paths")
    path = path.strip("/")
    return {"driver": _TENSORSTORE_DRIVERS[scheme], "bucket": bucket, "path": f"{path}/" if path else ""}


def _regular_files(item: Location) -> dict[str, int]:
    """The size of every file below the item, by key; CheckpointCorruptError at a symbolic
    link or anything else that is not a regular file (a FIFO, a socket, a device), which
    no Orbax checkpoint holds and TensorStore would follow or block on. (Checked before
    TensorStore reads: what is swapped in between is the swapper's own doing.)"""
    files = {}
    for entry in item.walk():
        if entry.type != "file":
            raise CheckpointCorruptError(f"{item.child(entry.name).url} is "
                                         f"{'a symbolic link' if entry.type == 'link' else 'not a regular file'}: an "
                                         "Orbax checkpoint holds only regular files, and zarrckpt reads nothing "
                                         "outside it")
        files[entry.name] = entry.size
    return files


# The objects of a zarr array that are not chunks.
_ARRAY_METADATA = frozenset({".zarray", ".zattrs", "zarr.json"})
# What an item Orbax wrote sparse may leave out as fill values, beyond what it stores:
# a freshly initialised optimizer's moments are zeros twice the size of the weights.
_FILL_ALLOWANCE = (4, 2**30)  # times the stored bytes, plus bytes


def _check_claims(opened: dict[str, Any], keys: list[str], sparse: bool, stored_bytes: int, prefix: str,
                  url: str) -> None:
    """Refuses arrays whose metadata claims chunks the item does not hold (`keys`,
    sorted): a deleted chunk would read as zeros, and a claim of 32 GiB in a kilobyte of
    metadata would be written out as zeros. An item Orbax wrote sparse may lack chunks,
    up to `_FILL_ALLOWANCE`; that is said."""
    missing: dict[str, int] = {}
    for name, array in opened.items():
        grid = array.chunk_layout.write_chunk.shape or array.shape
        needed = math.prod(-(-n // max(c, 1)) for n, c in zip(array.shape, grid))
        if (lacking := needed - _chunks_stored(keys, name)) > 0:
            missing[name] = lacking * math.prod(grid) * np.dtype(array.dtype.numpy_dtype).itemsize
    if not missing:
        return
    first = next(iter(missing))
    others = f" (and {len(missing) - 1} other arrays lack chunks)" if len(missing) > 1 else ""
    if not sparse:
        raise CheckpointCorruptError(f"array {prefix}{first} of the Orbax checkpoint {url} lacks chunks of "
                                     f"{_progress.size(missing[first])}{others}")
    times, plus = _FILL_ALLOWANCE
    if (total := sum(missing.values())) > times * stored_bytes + plus:
        raise CheckpointCorruptError(f"the Orbax checkpoint {url} lacks chunks of {_progress.size(total)} (array "
                                     f"{prefix}{first}{others}), more than chunks of fill values left out could be "
                                     f"beside the {_progress.size(stored_bytes)} it holds ({times}x that, plus "
                                     f"{_progress.size(plus)})")
    log.warning("%s: %d arrays lack chunks of %s (%s): the Orbax that wrote it left out chunks equal to the fill "
                "value, so they are imported as the fill value (a deleted chunk cannot be told from one left out)",
                url, len(missing), _progress.size(total), ", ".join(sorted(prefix + n for n in missing)[:3]))


def _chunks_stored(keys: list[str], name: str) -> int:
    """How many chunk objects the array `name` has among the item's sorted `keys` (one
    directory per array, or OCDBT's keys: the same layout)."""
    first = bisect.bisect_left(keys, f"{name}/")
    end = bisect.bisect_left(keys, f"{name}0")  # '0' follows '/'
    return sum(1 for key in keys[first:end] if key.rsplit("/", 1)[-1] not in _ARRAY_METADATA)


def _key_path(entry: Any, metadata: str, key: str, ocdbt: bool) -> list[tuple[str, int]]:
    """An entry's key path; without OCDBT every array is a directory named by its keys,
    so a key that would name a path elsewhere is refused."""
    keys = entry.get("key_metadata") if isinstance(entry, dict) else None
    if not isinstance(keys, list) or not keys or len(keys) > _tree.MAX_DEPTH:
        raise CheckpointCorruptError(f"{metadata}: the entry {key!r:.80} has no usable key path")
    out = []
    for k in keys:
        if (not isinstance(k, dict) or not isinstance(k.get("key"), str) or k.get("key_type") not in (_SEQUENCE, _DICT)
                or (k["key_type"] == _SEQUENCE and _chunks.canonical_ints([k["key"]]) is None)
                or (not ocdbt and (k["key"] in ("", ".", "..") or "/" in k["key"] or "\\" in k["key"]))):
            raise CheckpointCorruptError(f"{metadata}: the entry {key!r:.80} has a malformed key")
        out.append((k["key"], k["key_type"]))
    return out


def _value_metadata(entry: dict[str, Any], metadata: str, key: str) -> dict[str, Any]:
    value = entry.get("value_metadata")
    if not isinstance(value, dict) or not isinstance(value.get("value_type"), str):
        raise CheckpointCorruptError(f"{metadata}: the entry {key!r:.80} says no value type")
    return value


def _put(built: dict[tuple[str, int], Any], keys: list[tuple[str, int]], leaf: Any, metadata: str) -> None:
    """Puts `leaf` at `keys` in nested dicts (keyed by (key, kind), made lists later)."""
    node = built
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if _LEAF in node:
            raise CheckpointCorruptError(f"{metadata}: a leaf is also a subtree at "
                                         f"{'.'.join(k for k, _ in keys)!r:.200}")
    if keys[-1] in node:
        raise CheckpointCorruptError(f"{metadata}: two entries for {'.'.join(k for k, _ in keys)!r:.200}")
    node[keys[-1]] = {_LEAF: leaf}


def _sequences(node: dict[Any, Any], metadata: str) -> Any:
    """The nested (key, kind) dicts as Orbax restores them: lists where every key is a
    sequence index, 0 to n-1 (written as Orbax writes them); dicts elsewhere."""
    if _LEAF in node:
        return node[_LEAF]
    children = {key: _sequences(child, metadata) for key, child in node.items()}
    if children and all(kind == _SEQUENCE for _, kind in children):
        indices = _chunks.canonical_ints([k for k, _ in children])
        if indices is None or sorted(indices) != list(range(len(indices))):
            raise CheckpointCorruptError(f"{metadata}: a sequence's indices are not 0 to {len(children) - 1}")
        return [children[(str(i), _SEQUENCE)] for i in range(len(indices))]
    out = {}
    for key, _ in children:
        if key in out:
            raise CheckpointCorruptError(f"{metadata}: the key {key!r:.80} is both a sequence index and a dict key")
        out[key] = children[(key, _DICT)] if (key, _DICT) in children else children[(key, _SEQUENCE)]
    return out


def _prng_impls(item: Location) -> dict[str, str]:
    """The implementation of each typed PRNG key array, by its name, from what process 0
    wrote to `array_metadatas/` (every process writes the same of a global array)."""
    if "process_0" not in {e.name for e in item.list_dir("array_metadatas")}:
        return {}
    doc = _json(item, "array_metadatas/process_0")
    entries = doc.get("array_metadatas") if isinstance(doc, dict) else None
    found: dict[str, str] = {}
    for entry in entries if isinstance(entries, list) else []:
        meta = entry.get("array_metadata") if isinstance(entry, dict) else None
        ext = meta.get("ext_metadata") if isinstance(meta, dict) else None
        impl = ext.get("random_key_impl") if isinstance(ext, dict) else None
        if isinstance(impl, str) and isinstance(meta, dict) and isinstance(name := meta.get("param_name"), str):
            found[name] = impl
    return found


def _json(item: Location, key: str) -> Any:
    return _items.read_json(item, key)[1]


def _tensorstore() -> Any:
    try:
        import tensorstore
    except ModuleNotFoundError:
        raise ModuleNotFoundError(f"reading an Orbax checkpoint needs TensorStore: {EXTRA}") from None
    return tensorstore
