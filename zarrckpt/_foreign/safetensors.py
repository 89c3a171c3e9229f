"""Hugging Face safetensors files, restored like a checkpoint: `load_safetensors`.

A `.safetensors` file, or a sharded set (`model.safetensors.index.json` beside its
files), opens as a `Checkpoint` whose leaves are its tensors, nested on '.', each read
in parts of whole rows, one range request each (`_format.safetensors.TensorCodec`).
Everything after that is the checkpoint's read path: matching a target, each process
reading only the parts its devices need, the byte budget, progress, sharing replicated
leaves over the device network. Without a target every tensor lands in host memory
whole, and the file is read as it lies instead (`_load_on_host`): in runs of adjacent
tensors, one request each, which for a model of many small tensors is most of the cost.

Every file is untrusted input: its header is checked against the file before anything
else is read (`_format.safetensors`), an index is read under the cap a header is, and
the index and the headers must agree (a tensor in one file, and in the file the index
names).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from .. import _options, _storage
from .._format import safetensors as _format
from .._format.tree import KeyPath
from .._options import LoadOptions
from .._restore import checkpoint as _reader
from .._restore.load import load_opened
from .._storage import Location
from .._util import concurrency as _concurrency, progress as _progress
from ..errors import CheckpointCorruptError, CheckpointNotFoundError

# The first read of a file: its header is usually inside, so one request serves it.
_FIRST_READ = 64 * 2**10
log = logging.getLogger("zarrckpt")


def load_safetensors(
    url: str,
    target: Any = None,
    *,
    storage_options: dict[str, Any] | None = None,
    partial: bool = False,
    allow_dtype_cast: bool = False,
    donate_target: bool = False,
    load_and_broadcast: bool = True,
    max_inflight_bytes: int = _options.DEFAULT_MAX_INFLIGHT_BYTES,
    max_workers: int | None = None,
    progress: bool | None = None,
) -> Any:
    """Restores the tensors of a Hugging Face safetensors file or sharded set.

    Tensor names nest on '.': `model.layers.0.mlp.up_proj.weight` is
    `["model"]["layers"]["0"]["mlp"]["up_proj"]["weight"]`. bfloat16 and float8 (E4M3,
    E5M2) come back exactly. Every header is checked against its file, and the index
    against the headers, before any tensor is read. Collective exactly as
    `load_pytree` is.

    Args:
      url: a `.safetensors` file, or a directory (any fsspec URL) holding one such
        file or a sharded set with its `model.safetensors.index.json`.
      target: a pytree whose key paths, joined by '.', are the tensor names, with leaves
        as for `load_pytree`; each tensor lands on its target's sharding, each process
        reading only the rows its devices hold. None: nested dicts of numpy arrays.
      storage_options, partial, allow_dtype_cast, donate_target: as for `load_pytree`.
      load_and_broadcast, max_inflight_bytes, max_workers, progress: as for `load_pytree`.

    Returns:
      The restored pytree.

    Raises:
      CheckpointNotFoundError: no safetensors file or set at `url`.
      CheckpointCorruptError: a file or index that is not what the format says (tensors
        that overlap or leave bytes unused, a key named twice, an impossible shape, an
        index too large or disagreeing with the files), named with the tensor at
        fault; or a file cut short or removed while it was read.
      CheckpointMismatchError: the target does not match; lists every missing and
        unexpected key path and every shape and dtype difference. Nothing was read.
      TypeError, ValueError: an option of the wrong type or value (named).
    """
    options = LoadOptions(allow_dtype_cast=allow_dtype_cast, donate_target=donate_target, partial=partial,
                          load_and_broadcast=load_and_broadcast, max_inflight_bytes=max_inflight_bytes,
                          max_workers=max_workers, progress=progress)
    opened = _open(*locate(url, storage_options))
    if target is None:
        return _load_on_host(opened, options)
    return load_opened(_checkpoint(opened), target, options)


def locate(url: str, storage_options: dict[str, Any] | None = None, *,
           option: str = "storage_options") -> tuple[Location, str | None]:
    """Where the safetensors at `url` are: the folder, and the file's name in it (None
    for a set, or whatever `.safetensors` files the folder holds). `option`: the
    caller's keyword for `storage_options`, for errors."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"url must be a non-empty string, got {url!r:.100}")
    single = url.rstrip("/").endswith(_format.EXTENSION)
    folder, _, name = url.rstrip("/").rpartition("/") if single else (url, "", "")
    return _storage.resolve(folder or ".", storage_options, option=option), name or None


def open_safetensors(loc: Location, name: str | None) -> _reader.Checkpoint:
    """The safetensors file `name` in folder `loc`, or the set there (see `locate`), as
    a Checkpoint (see `load_safetensors`)."""
    return _checkpoint(_open(loc, name))


@dataclasses.dataclass(frozen=True)
class _Opened:
    """A safetensors file or set, its headers read and checked: the folder the user named
    (`loc`), where its files are read from (`src`, each file by its key there), each
    file's tensors in file order, and the tensors nested on '.' (`_format.nested`)."""

    loc: Location
    src: Location
    keys: dict[str, str]
    tensors: dict[str, list[_format.Tensor]]
    tree: dict[str, Any]
    url: str  # the file or the folder, as messages name it
    metadata: dict[str, str]  # the files' `__metadata__` ({"format": "pt"} from transformers)


def _open(loc: Location, name: str | None) -> _Opened:
    """The safetensors file `name` in folder `loc`, or the set there, its headers read and
    checked against the files and the index (see `load_safetensors` for what it raises)."""
    shown = loc.child(name).url if name is not None else loc.url
    listed = {e.name: e.size for e in loc.list_dir() if e.type != "dir"}  # a link or a FIFO: refused when read
    if name is not None:
        if name not in listed:
            raise CheckpointNotFoundError(f"no safetensors file at {shown}")
        files: list[str] = [name]
    else:
        files = ([_format.INDEX_NAME] if _format.INDEX_NAME in listed else
                 [f for f in listed if f.endswith(_format.EXTENSION)])
    src, keys, sizes = _sources(loc, files, listed)
    weight_map = None
    if name is None:
        files, weight_map = _files(loc, src, keys, list(listed))
        if weight_map is not None:
            src, keys, sizes = _sources(loc, files, listed)
    # On a local disk a header is a read from the page cache: threads would cost more.
    headers = _concurrency.run_all(lambda file: _header(src, keys[file], sizes[file], loc.child(file).url), files,
                                   src.concurrency if src.requests_wait else 1)
    metadata = {k: v for _, found in headers for k, v in found.items()}  # a set's files all say the same
    tensors = [found for found, _ in headers]
    held = _held(loc, files, tensors, weight_map)
    try:
        tree = _format.nested(list(held))
    except _format.Malformed as e:
        raise CheckpointCorruptError(f"{shown} {e}") from None
    return _Opened(loc, src, keys, dict(zip(files, tensors)), tree, shown, metadata)


def _held(loc: Location, files: list[str], headers: list[list[_format.Tensor]],
          weight_map: dict[str, str] | None) -> dict[str, str]:
    """The file holding each tensor. CheckpointCorruptError if a tensor is in two files,
    or the index of the set at `loc` puts it in another, or names one in none."""
    held: dict[str, str] = {}
    for name, tensors in zip(files, headers):
        for tensor in tensors:
            if held.setdefault(tensor.name, name) != name:
                raise CheckpointCorruptError(f"tensor {tensor.name!r:.100} is in two files of {loc.url}: "
                                             f"{held[tensor.name]!r} and {name!r}")
            if weight_map is not None and weight_map.get(tensor.name, name) != name:
                raise CheckpointCorruptError(f"tensor {tensor.name!r:.100} is in {name!r}, but the index of {loc.url} "
                                             f"puts it in {weight_map[tensor.name]!r}")
    lost = sorted(set(weight_map or ()) - set(held))
    if lost:
        raise CheckpointCorruptError(f"the index of {loc.url} names tensors that are in no file: "
                                     f"{', '.join(f'{n!r:.100}' for n in lost[:5])}{' ...' if len(lost) > 5 else ''}")
    return held


@contextlib.contextmanager
def _without_cyclic_gc() -> Iterator[None]:
    """Holds Python's cyclic garbage collector off inside (no I/O is), then turns it back
    on if it was on before the first of the threads inside came in: parsing a header of
    a million tensors, and making their arrays and dicts, makes millions of objects and
    no cycle, and the collector, walking them again and again as they are made, took
    1.5x the time of the parse itself. Any thread's collection only waits until then."""
    global _gc_holders, _gc_was_enabled
    with _gc_lock:
        if _gc_holders == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holders += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holders -= 1
            if _gc_holders == 0 and _gc_was_enabled:
                gc.enable()


# Loads in several threads at once share one switching off of the collector: the last
# one out turns it back on, if the first one in found it on.
_gc_lock = threading.Lock()
_gc_holders = 0
_gc_was_enabled = False


def _checkpoint(opened: _Opened) -> _reader.Checkpoint:
    """The opened file or set as a Checkpoint, each tensor a leaf read in parts of whole
    rows (`_format.TensorCodec`)."""
    leaves: dict[str, _reader.StoredLeaf] = {}
    for name, tensors in opened.tensors.items():
        for tensor in tensors:
            path = tuple(jax.tree_util.DictKey(part) for part in tensor.name.split("."))
            leaves[tensor.name] = _reader.StoredLeaf(path, tensor.name, tensor.shape, tensor.dtype, "numpy",
                                                     _format.TensorCodec.of(tensor, opened.keys[name]))
    return _reader.Checkpoint(opened.src, _format.LAYOUT, True, _format.tree_record(opened.tree), leaves, _name_of,
                              {_format.METADATA_KEY: opened.metadata}, shown=opened.url)


def _load_on_host(opened: _Opened, options: LoadOptions) -> dict[str, Any]:
    """Every tensor of `opened` as a numpy array of its own, in dicts nested on '.' (as
    `load_opened` returns them without a target), read as the files lie (`_runs`).

    The checkpoint's read path costs tens of microseconds a tensor (a pool task, a
    request and a read plan each), which a model of many small tensors feels: 118 s for
    a million one-byte tensors, where `safetensors.numpy.load_file` takes 7.5 s."""
    started = time.perf_counter()
    arrays: dict[str, np.ndarray] = {}
    runs: list[_Run] = []
    with _without_cyclic_gc():
        for name, tensors in opened.tensors.items():
            made = [np.empty(tensor.shape, tensor.dtype) for tensor in tensors]
            arrays.update(zip([tensor.name for tensor in tensors], made))
            runs += _runs(opened.keys[name], opened.loc.child(name).url, tensors, made)
    total = sum(run.nbytes for run in runs)
    with _progress.bar(f"restoring {opened.url}", total, options.progress) as advance:
        def read(run: _Run) -> None:
            _read_run(opened.src, run)
            advance(run.nbytes)

        _concurrency.run_all(read, runs, options.max_workers or opened.src.concurrency, "read")
    with _without_cyclic_gc():
        loaded = _filled(opened.tree, arrays)
    log.info("restored %s: %d leaves, %s", opened.url, len(arrays),
             _progress.rate(total, time.perf_counter() - started))
    return loaded


@dataclasses.dataclass(frozen=True)
class _Run:
    """One request of a host load: bytes of the file `key` (`shown` as the user named
    it) from byte `start`, filling `parts` in turn: each a tensor and a uint8 view of
    its array, or of a part of it."""

    key: str
    shown: str
    start: int
    parts: list[tuple[_format.Tensor, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(len(part) for _, part in self.parts)


def _runs(key: str, shown: str, tensors: list[_format.Tensor], arrays: list[np.ndarray]) -> list[_Run]:
    """The requests reading one file's `tensors` (in file order: they tile its data) into
    their `arrays`: a large tensor in parts of `PART_BYTES`, each read straight into its
    array; adjacent smaller ones together up to that size, read into one buffer and
    copied out (a request costs more than copying a small tensor)."""
    runs: list[_Run] = []
    parts: list[tuple[_format.Tensor, np.ndarray]] = []
    start = size = 0
    for tensor, array in zip(tensors, arrays):
        data = array.reshape(-1).view(np.uint8)
        for offset in range(0, tensor.nbytes, _format.PART_BYTES):
            part = data[offset:offset + _format.PART_BYTES]
            if parts and size + len(part) > _format.PART_BYTES:
                runs.append(_Run(key, shown, start, parts))
                parts, size = [], 0
            if not parts:
                start = tensor.start + offset
            parts.append((tensor, part))
            size += len(part)
    if parts:
        runs.append(_Run(key, shown, start, parts))
    return runs


def _read_run(src: Location, run: _Run) -> None:
    """Reads `run`: straight into its part if it has one, else into a buffer copied out
    to each. CheckpointCorruptError naming the tensor if the file ends before it does
    (cut short since it was opened), or naming the file if it is gone."""
    whole = run.parts[0][1] if len(run.parts) == 1 else np.empty(run.nbytes, np.uint8)
    try:
        done = src.read_range(run.key, run.start, whole.data)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{run.shown} was removed while it was being read") from None
    at = 0
    for tensor, part in run.parts:
        if at + len(part) > done:
            raise CheckpointCorruptError(f"{run.shown} ends at byte {run.start + done:,}, before the end of tensor "
                                         f"{tensor.name!r:.100} (byte {tensor.start + tensor.nbytes:,}): it was cut "
                                         "short after it was opened")
        if len(run.parts) > 1:
            part[...] = whole[at:at + len(part)]
        at += len(part)


def _filled(tree: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """`tree` (see `_format.nested`) with each tensor's array in place of its name, keys
    sorted as a checkpoint's tree record sorts them."""
    return {key: arrays[node] if isinstance(node, str) else _filled(node, arrays)
            for key, node in sorted(tree.items())}


def _sources(loc: Location, files: list[str], listed: dict[str, int]
             ) -> tuple[Location, dict[str, str], dict[str, int]]:
    """Where `files` (names in the folder `loc`) are read from, by key, and their sizes.
    On this machine's disk a file may be a link, as in a Hugging Face cache, whose
    snapshots link into its blobs: the files the user named are read where they
    really are, below their common folder. (Checkpoints never follow a link; these
    files are no checkpoint, and the user named them.)"""
    if not loc.has_links or not files:
        return loc, {f: f for f in files}, {f: listed[f] for f in files}
    try:
        return loc.followed(files)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"{loc.child(e.filename).url} is {e.strerror}") from None


def _files(loc: Location, src: Location, keys: dict[str, str], listed: list[str]
           ) -> tuple[list[str], dict[str, str] | None]:
    """The files of the set in the directory `loc` (read through `src`, by `keys`), and
    its index's weight map (None for a directory of one file)."""
    if _format.INDEX_NAME in keys:
        try:
            # Under the cap a header has: the index is untrusted too (a sparse file of
            # 3 GiB read whole took 6 GiB of memory before it was found not to be JSON).
            raw = src.read(keys[_format.INDEX_NAME], limit=_format.MAX_HEADER_BYTES + 1)
            weight_map = _format.parse_index(raw)
        except _format.Malformed as e:
            raise CheckpointCorruptError(f"{loc.child(_format.INDEX_NAME).url} {e}") from None
        files = sorted(set(weight_map.values()))
        if missing := [f for f in files if f not in listed]:
            raise CheckpointCorruptError(f"the index of {loc.url} names files that are not there: "
                                         f"{', '.join(map(repr, missing[:5]))}")
        return files, weight_map
    if len(keys) != 1:
        raise CheckpointNotFoundError(
            f"no safetensors file or set at {loc.url}: " + (
                f"{len(keys)} .safetensors files and no {_format.INDEX_NAME} to say how they go together"
                if keys else "no .safetensors file there"))
    return list(keys), None


def _header(loc: Location, name: str, size: int, shown: str) -> tuple[list[_format.Tensor], dict[str, str]]:
    """The tensors of the file `name` (`size` bytes, `shown` as the user named it) and
    its `__metadata__`: one read, two if its header is longer than the first read."""
    try:
        first = loc.read(name, limit=min(size, _FIRST_READ))
        length = _format.header_length(first, size)
        raw = first[_format.PREFIX_BYTES: _format.PREFIX_BYTES + length]
        if len(raw) < length:
            rest = bytearray(length - len(raw))
            loc.read_range(name, _format.PREFIX_BYTES + len(raw), memoryview(rest))
            raw += bytes(rest)
        with _without_cyclic_gc():
            return _format.parse_header(raw, size)
    except _format.Malformed as e:
        raise CheckpointCorruptError(f"{shown} {e}") from None


def _name_of(path: KeyPath) -> str:
    """The tensor name a target's key path asks for: its keys joined by '.'."""
    parts = []
    for entry in path:
        if isinstance(entry, jax.tree_util.DictKey):
            parts.append(str(entry.key))
        elif isinstance(entry, jax.tree_util.SequenceKey):
            parts.append(str(entry.idx))
        elif isinstance(entry, jax.tree_util.GetAttrKey):
            parts.append(entry.name)
        else:
            parts.append(str(getattr(entry, "key", entry)))
    return ".".join(parts)
