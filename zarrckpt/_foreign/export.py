"""Exporting a checkpoint's arrays to one `.npz` or `.safetensors` file (or set), for use outside JAX.

Each leaf becomes one array named by its array name in the checkpoint, as `zarrckpt
info` lists it: `params.dense.kernel`, `opt_state.0.mu` (the dotted style of PyTorch
state dicts; `%XX` escapes only for characters outside `[A-Za-z0-9_-]` in keys), or,
with `select`, by its name inside the subtree selected (`dense.kernel` of `params`).
A typed PRNG key is exported as its raw key data (uint32), with a warning naming it;
`ExportResult.key_data` names those arrays and their implementations, as does the
`zarrckpt.key_data` entry of a `.safetensors` file's `__metadata__`. Leaves that are no array of
numbers are left out, never converted, and `skipped` says why: a str or bytes leaf (a
config, a tokenizer's text) and a per-process value (a data loader's position).

A dtype the file format cannot hold is widened to one that holds every value exactly:
ml_dtypes floats (bfloat16, float8_*) to float32 and 4-bit integers to int8/uint8 in
`.npz` (NumPy has none of them); in `.safetensors`, which has bfloat16, float8_e4m3fn
and float8_e5m2, only the others. Complex numbers cannot go to `.safetensors`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import secrets
import stat
import zipfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeGuard

import numpy as np

from .. import _deprecated, _options, _storage
from .._format import dtypes as _dtypes, naming as _naming, safetensors as _safetensors_format
from .._restore import checkpoint as _reader
from .._util import concurrency as _concurrency, progress as _progress
from . import EXPORT_FORMATS

log = logging.getLogger("zarrckpt")

KEY_DATA_METADATA = "zarrckpt.key_data"  # safetensors __metadata__: JSON {array name: PRNG implementation}
# What every safetensors release since 0.4 writes from NumPy arrays (later ones add a few).
_SAFETENSORS_DTYPES = frozenset({
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "bfloat16", "float8_e4m3fn", "float8_e5m2",
})
_WIDER: dict[str, np.dtype] = {"f": np.dtype(np.float32), "i": np.dtype(np.int8), "u": np.dtype(np.uint8)}


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What `export_checkpoint` wrote: the file (a sharded set's index) at `url`, its
    format, the leaves written and their bytes. `widened` maps each array name whose
    dtype the format lacks to (stored dtype, exported dtype); `skipped` maps each leaf
    left out (no array of numbers) to why; `key_data` maps each typed PRNG key's array
    name to its implementation (`threefry2x32`): the array holds the key's raw data.
    `path` and `arrays` are deprecated aliases of `url` and `leaves` (DeprecationWarning)."""

    url: str
    format: str
    leaves: int
    nbytes: int
    widened: dict[str, tuple[str, str]]
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    key_data: dict[str, str] = dataclasses.field(default_factory=dict)

    path = _deprecated.renamed("url", "path", "ExportResult")
    arrays = _deprecated.renamed("leaves", "arrays", "ExportResult")


def format_of(path: str) -> str:
    """The export format a file name asks for by its extension; ValueError if none."""
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    if extension not in EXPORT_FORMATS:
        raise ValueError(f"cannot tell the export format of {path!r} from its extension: "
                         f"name it *.npz or *.safetensors, or pass format='npz' or format='safetensors'")
    return extension


def export_checkpoint(url: str, path: str, *, select: str | None = None, format: str | None = None,
                      overwrite: bool = False, max_shard_bytes: int | None = None,
                      storage_options: dict[str, Any] | None = None,
                      max_inflight_bytes: int = _concurrency.DEFAULT_MAX_INFLIGHT_BYTES,
                      progress: bool | None = None) -> ExportResult:
    """Writes the array leaves of the committed checkpoint at `url` to the local file `path`.

    Each leaf becomes one array named as `zarrckpt info` lists it (`params.dense.kernel`),
    a typed PRNG key as its raw key data (logged as a warning naming it; `key_data`).
    A dtype the format lacks is widened to one that holds every value exactly
    (`ExportResult.widened`); str, bytes and per-process leaves are left out
    (`ExportResult.skipped`).

    Not collective. Each file appears whole or not at all: it is written to a new file
    of a random name in the same folder, then renamed over its name (a link there is
    replaced, never written through). `.npz` is written one leaf at a time (about
    `max_inflight_bytes` in memory); `.safetensors` holds one whole file in memory.

    Args:
      url: a local path or fsspec URL of one checkpoint.
      path: the local file to write (or, with `max_shard_bytes`, to name the set by).
      select: a subtree by its name as `zarrckpt info` lists it (`params`,
        `params.encoder`): only its leaves are written, named inside it.
      format: "npz" or "safetensors" (default: from `path`'s extension).
      overwrite: replace existing files (checked for every file before any is written).
      max_shard_bytes: split a `.safetensors` export larger than this into a set as
        transformers writes one (`model-00001-of-00003.safetensors`... beside `path`,
        each at most this unless one array is larger, and
        `model.safetensors.index.json`, written last); `path` itself is then removed,
        not written. If a file of the set cannot be written, those written are removed.
      storage_options: passed to fsspec for `url`.
      max_inflight_bytes: bound on bytes read and not yet written.
      progress: show a progress bar (default: when stderr is a terminal).

    Returns:
      An `ExportResult`; its `url` is the index of a set. A `.safetensors` file carries
      the `__metadata__` of the safetensors the checkpoint was imported from, with
      `"format": "pt"` unless that says otherwise, and `zarrckpt.key_data` (JSON) where
      it holds typed PRNG keys' data.

    Raises:
      CheckpointNotFoundError: no committed checkpoint at `url`.
      CheckpointCorruptError: data the checkpoint declares is missing or damaged.
      FileExistsError: a file to write exists and `overwrite` is False.
      FileNotFoundError: the folder of `path` does not exist.
      IsADirectoryError: a file to write is a directory.
      ValueError: an unknown format, a file that would lie inside the checkpoint, a
        `select` that names no subtree, a dtype the format cannot hold, or
        `max_shard_bytes` with `.npz`.
      ModuleNotFoundError: `.safetensors` without `safetensors` installed
        (`pip install 'zarrckpt[export]'`).
      OSError: a file cannot be written.
    """
    format = format or format_of(path)
    if format not in EXPORT_FORMATS:
        raise ValueError(f"export format must be one of {', '.join(EXPORT_FORMATS)}, got {format!r}")
    if max_shard_bytes is not None:
        _options.check("max_shard_bytes", max_shard_bytes, _options.COUNT)
        if format != "safetensors":
            raise ValueError("max_shard_bytes splits a .safetensors export into a set; a .npz export is one file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {path}: the folder {folder} does not exist")
    ckpt = _reader.open_checkpoint(_storage.resolve(url, storage_options))
    named = _selected(ckpt, select)
    skipped = {named[leaf.name]: why for leaf in ckpt.leaves.values()
               if leaf.name in named and (why := _not_an_array(leaf)) is not None}
    leaves = [leaf for leaf in ckpt.leaves.values() if leaf.name in named and named[leaf.name] not in skipped]
    dtypes = {leaf.name: _exported_dtype(leaf, format) for leaf in leaves}
    widened = {named[leaf.name]: (leaf.dtype.name, dtypes[leaf.name].name) for leaf in leaves
               if dtypes[leaf.name] != leaf.dtype}
    total = sum(leaf.nbytes for leaf in leaves)
    sizes = [math.prod(leaf.shape) * dtypes[leaf.name].itemsize for leaf in leaves]
    files = _files(path, sizes, max_shard_bytes)
    index = None if len(files) == 1 else os.path.join(folder, f"{os.path.basename(path)}.index.json")
    # A set replaces a single file of `path`'s name too: transformers would load that first.
    targets = [name for name, _ in files] + ([index, path] if index else [])
    store, inside = ckpt.loc.place()
    for target in targets:  # never over the checkpoint's own files (its commit marker, a chunk)
        if store == "file" and (os.path.realpath(target) + "/").startswith(inside.rstrip("/") + "/"):
            raise ValueError(f"cannot export {ckpt.loc.url} to {target}: it lies inside the checkpoint")
    for target in targets:
        if os.path.isdir(target) and not os.path.islink(target):  # never replaced, overwrite or not
            raise IsADirectoryError(f"cannot export to {target}: it is a directory (name a file in it, such as "
                                    f"{os.path.join(target, 'model.' + format)})")
        if os.path.lexists(target) and not overwrite:
            raise FileExistsError(f"{target} already exists; pass overwrite=True to replace it")
    key_data = {named[leaf.name]: leaf.prng_impl for leaf in leaves if leaf.prng_impl is not None}
    if key_data:
        log.warning("exporting %s: typed PRNG keys are written as their raw key data (uint32), which loads as a "
                    "plain array (jax.random.wrap_key_data makes a key of it again): %s", ckpt.loc.url,
                    ", ".join(f"{name} ({impl})" for name, impl in sorted(key_data.items())))
    found = ckpt.meta.get(_safetensors_format.METADATA_KEY)
    metadata: dict[str, str] = {"format": "pt", **(found if _strings(found) else {})}
    if key_data:
        metadata[KEY_DATA_METADATA] = json.dumps(key_data, sort_keys=True)
    weight_map: dict[str, str] = {}
    with _progress.bar(f"exporting {ckpt.loc.url}", total, progress) as advance:
        arrays = ((named[leaf.name], array.astype(dtypes[leaf.name], copy=False))
                  for leaf, array in _read_leaves(ckpt, leaves, max_inflight_bytes, advance))
        if format == "npz":
            _write_aside(path, lambda fd, _: _write_npz(fd, arrays))
        if index is not None:  # no old index may name a mix of old and new files meanwhile
            for old in (index, path):
                if os.path.lexists(old):
                    os.remove(old)
        written = []
        try:
            for name, count in files if format == "safetensors" else []:
                part = list(itertools.islice(arrays, count))
                _write_aside(name, functools.partial(_write_safetensors, part, metadata))
                written.append(name)
                weight_map.update((tensor, os.path.basename(name)) for tensor, _ in part)
                del part  # a file's arrays at a time in memory
            if index is not None:
                document = json.dumps({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, indent=2)
                _write_aside(index, lambda fd, _: _write_bytes(fd, document.encode()))
        except BaseException:
            if index is not None:  # a set without its index is no set: none of it is left
                for name in written:
                    os.remove(name)
            raise
    return ExportResult(index or path, format, len(leaves), total, widened, skipped, key_data)


def _files(path: str, sizes: list[int], max_bytes: int | None) -> list[tuple[str, int]]:
    """Each file of the export and how many arrays (in order) go in it: `path` alone,
    or a set named as transformers names one, each at most `max_bytes` (an array larger
    than that alone in its file)."""
    counts = [0]
    filled = 0
    for size in sizes:
        if max_bytes is not None and counts[-1] and filled + size > max_bytes:
            counts.append(0)
            filled = 0
        counts[-1] += 1
        filled += size
    if len(counts) == 1:
        return [(path, counts[0])]
    stem = os.path.join(os.path.dirname(path), os.path.basename(path).removesuffix(".safetensors"))
    return [(f"{stem}-{i:05d}-of-{len(counts):05d}.safetensors", n) for i, n in enumerate(counts, 1)]


def _strings(value: Any) -> TypeGuard[dict[str, str]]:
    """Whether `value` is a map of strings to strings (safetensors' `__metadata__`)."""
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _write_aside(path: str, write: Callable[[int, str], object]) -> None:
    """Writes the file `path` whole or not at all: `write(fd, partial)` fills a new file
    (O_EXCL: never an existing one, nor through a link) of a name nobody could have
    planted, with the mode the user's umask gives any new file, renamed over `path`."""
    partial = os.path.join(os.path.dirname(os.path.abspath(path)),
                           f".{os.path.basename(path)}.{secrets.token_hex(8)}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        write(fd, partial)
        # A writer that makes the file anew at `partial` (safetensors: 0600) gets the umask's mode back.
        os.chmod(partial, mode)
        os.replace(partial, path)
    finally:
        os.close(fd)
        if os.path.lexists(partial):
            os.remove(partial)


def _selected(ckpt: _reader.Checkpoint, select: str | None) -> dict[str, str]:
    """The array name of each leaf `select` keeps, and its name in the file: inside the
    subtree (its last part, where `select` names a leaf). ValueError if none."""
    if select is None:
        return {name: name for name in ckpt.leaves}
    if not isinstance(select, str) or not select:
        raise ValueError(f"select must name a subtree as `zarrckpt info` lists it (params.encoder), got {select!r}")
    return _naming.subtree(ckpt.leaves, select, ckpt.loc.url)


def _not_an_array(leaf: _reader.StoredLeaf) -> str | None:
    """Why a leaf cannot be exported as an array of numbers, or None."""
    if leaf.processes is not None:
        return "a per-process value, not an array"
    if leaf.kind in ("str", "bytes"):
        return f"a {leaf.kind}, not an array of numbers"
    return None


def _exported_dtype(leaf: _reader.StoredLeaf, format: str) -> np.dtype:
    native = leaf.dtype.kind in "biufc" if format == "npz" else leaf.dtype.name in _SAFETENSORS_DTYPES
    if native:
        return leaf.dtype
    kind = _dtypes.number_kind(leaf.dtype)
    if kind not in _WIDER:
        raise ValueError(f"leaf {leaf.where} (array {leaf.name!r}) has dtype {leaf.dtype}, which {format} "
                         "cannot hold; export to .npz instead")
    return _WIDER[kind]


def _read_leaves(ckpt: _reader.Checkpoint, leaves: list[_reader.StoredLeaf], max_inflight_bytes: int,
                 advance: Callable[[int], None]) -> Iterator[tuple[_reader.StoredLeaf, np.ndarray]]:
    """Every leaf's whole array, in order; leaves are read concurrently, with at most
    about `max_inflight_bytes` read and not yet consumed."""
    budget = _concurrency.ByteBudget(max_inflight_bytes)
    with _concurrency.Operation(ckpt.loc.concurrency, "export") as op:
        for leaf, array, hold in op.window(leaves, lambda leaf: ckpt.read(leaf, tuple((0, n) for n in leaf.shape)),
                                           budget=budget, nbytes=lambda leaf: leaf.nbytes):
            yield leaf, array
            hold.release()  # written to the file
            advance(leaf.nbytes)


def _write_bytes(fd: int, data: bytes) -> None:
    with os.fdopen(os.dup(fd), "wb") as file:
        file.write(data)


def _write_npz(fd: int, arrays: Iterable[tuple[str, np.ndarray]]) -> None:
    """An uncompressed `.npz` as `numpy.savez` writes it, one array at a time, to the
    open file `fd`."""
    with os.fdopen(os.dup(fd), "wb") as file, \
            zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays:
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)


def _write_safetensors(arrays: list[tuple[str, np.ndarray]], metadata: dict[str, str], fd: int, path: str) -> None:
    """A `.safetensors` file at `path`, the new file `fd` is open on, of a name nobody
    else could have chosen (safetensors takes a name, not an open file)."""
    try:
        import safetensors.numpy
    except ModuleNotFoundError:
        raise ModuleNotFoundError("exporting to .safetensors needs the safetensors package: "
                                  "pip install 'zarrckpt[export]'") from None
    # safetensors reads each array's memory in place: they must stay alive and contiguous.
    safetensors.numpy.save_file({name: np.require(a, requirements="C") for name, a in arrays}, path,
                                metadata=metadata)
