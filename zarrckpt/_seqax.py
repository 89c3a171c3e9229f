"""seqax's checkpoint layout, read only: every detail of it is here.

A seqax checkpoint is a zarr v2 group (`.zgroup`) whose `.zattrs` carries the commit
marker `write_completed: true`, with one array per leaf named by
`jax.tree_util.keystr` of its key path (`['params']['w']`), chunked by shard.
zarrckpt reads it without zarr: each array's `.zarray` is checked against what
seqax's zarr writes (C order, no filters, plain numeric dtypes), and each chunk is
decoded only by a codec of a known list (blosc, zlib, gzip, or none) and never to more
than the chunk's declared size, so a hostile chunk (1 MB that inflates to 1 GiB)
costs no more memory than a chunk. Every object goes through the `Location`, so a
symbolic link inside is never followed.
"""

from __future__ import annotations

import dataclasses
import math
import re
import struct
import zlib
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import numcodecs.blosc
import numpy as np

from ._format import dtypes as _dtypes, zarrjson as _zarrjson
from ._format.chunks import MAX_GRID, Damage, canonical_ints, grid
from ._storage import GROUP_BYTES, Location
from ._util import concurrency as _concurrency
from ._util.regions import Region

LAYOUT = "seqax"  # a Checkpoint's `layout` when it is this one
GROUP = ".zgroup"
MARKER = ".zattrs"  # the group's attributes: where the commit marker lives
ARRAY = ".zarray"
# Every name an object of this layout has, relative to the checkpoint (beside zarr's
# v2 chunk keys of other writers): for telling a leftover from someone's files.
OBJECT_NAMES = r"\.zattrs|\.zgroup|\.zmetadata|[^/]+/(\.zarray|\.zattrs|\d+(\.\d+)*|c(/\d+)+|\d+(/\d+)*)"
COMPRESSORS = ("blosc", "zlib", "gzip")  # and none
_tu = jax.tree_util
_BLOSC_HEADER = struct.Struct("<4B3I")  # version, versionlz, flags, typesize; nbytes, blocksize, cbytes
# One key entry of jax.tree_util.keystr: ['str'] / ["str"], [int], or .attr
_KEYSTR_TOKEN = re.compile(r"""\['((?:[^'\\]|\\.)*)'\]|\["((?:[^"\\]|\\.)*)"\]|\[(-?\d+)\]|\.([A-Za-z_]\w*)""")



@dataclasses.dataclass(frozen=True)
class Codec:
    """How the chunks of one seqax array are named and decoded."""

    array: str  # the array's name: one path component
    dtype: np.dtype
    shape: tuple[int, ...]  # the chunk shape
    compressor: str | None
    separator: str  # between chunk coordinates: "." or "/"
    checksum: bool = False  # seqax stores none
    part: ClassVar[str] = "chunk"  # what `key` names, in errors

    @property
    def data_bytes(self) -> int:
        return _dtypes.nbytes(self.shape, self.dtype)

    def coords(self, chunk: Region) -> list[int]:
        return [start // size for (start, _), size in zip(chunk, self.shape)]

    def key(self, chunk: Region) -> str:
        return self.key_at(self.coords(chunk))

    def key_at(self, coords: Sequence[int]) -> str:
        """The object key of the chunk at grid coordinates `coords`."""
        return f"{self.array}/{self.separator.join(map(str, coords)) or '0'}"

    def coords_of(self, name: str) -> tuple[int, ...] | None:
        """The grid coordinates of the chunk whose object is named `name` inside the
        array's directory (`0.1`, or `0/1`; `0` for a 0-d array), or None."""
        if not self.shape:
            return () if name == "0" else None
        parts = name.split(self.separator)
        return canonical_ints(parts) if len(parts) == len(self.shape) else None

    def read(self, source: Any, chunk: Region, out: np.ndarray | None, expect: int | None = None) -> np.ndarray:
        """As `ChunkCodec.read`: a seqax chunk, often compressed, is decoded from the whole
        object, then copied into `out` (seqax's commit records no chunk: `expect` is None)."""
        values = self.decode(source.read(self.key(chunk), cap=None))  # a chunk: seqax records no size
        if out is None:
            return values
        out[...] = values
        return out

    def decode(self, raw: bytes) -> np.ndarray:
        """The chunk's values in the chunk shape, from its stored bytes; Damage (naming
        the codec) if they do not decode to exactly one chunk."""
        try:
            data = self._decode(raw)
        except ValueError as e:
            raise Damage(f"cannot be decoded ({self.compressor or 'no compressor'}): {e}") from None
        return np.frombuffer(data, self.dtype).reshape(self.shape)

    def _decode(self, raw: bytes) -> bytes | np.ndarray:
        expected = self.data_bytes
        if self.compressor is None:
            if len(raw) != expected:
                raise ValueError(f"{len(raw)} bytes, expected {expected}")
            return raw
        if self.compressor == "blosc":
            if len(raw) < _BLOSC_HEADER.size:
                raise ValueError(f"{len(raw)} bytes: shorter than a blosc header")
            *_, nbytes, _, cbytes = _BLOSC_HEADER.unpack_from(raw)
            if nbytes != expected or cbytes != len(raw):
                raise ValueError(f"its header declares {nbytes} bytes in {cbytes}; expected {expected} in "
                                 f"{len(raw)}")
            out = np.empty(expected, np.uint8)
            numcodecs.blosc.decompress(raw, out)
            return out
        # zlib or gzip: inflate no further than one chunk and one byte.
        stream = zlib.decompressobj(zlib.MAX_WBITS | (16 if self.compressor == "gzip" else 0))
        data = stream.decompress(raw, expected + 1)
        if len(data) > expected:
            raise ValueError(f"it inflates to more than its {expected} bytes")
        if len(data) < expected or not stream.eof or stream.unused_data:
            raise ValueError(f"it inflates to {len(data)} bytes (complete: {stream.eof}), expected {expected}")
        return data


def read_group(loc: Location) -> tuple[bytes | None, bool]:
    """The group's attributes (the commit marker's object) as stored, or None, and
    whether the group is there at all: the two objects asked for together. TooLarge
    for either larger than GROUP_BYTES."""
    attributes, group = loc.read_if_present([MARKER, GROUP], cap=GROUP_BYTES)
    return attributes, attributes is not None or group is not None


def read_arrays(loc: Location) -> list[tuple[_tu.KeyPath, Codec, tuple[int, ...]]]:
    """Every array of the seqax checkpoint at `loc`: its key path, codec and shape.
    Raises ValueError (naming the array) for metadata seqax's zarr does not write, and
    an OSError for a link or an unreadable object."""
    names = [e.name for e in loc.list_dir() if e.type in ("dir", "link")]
    found = _concurrency.run_all(lambda name: _read_if_present(loc, f"{name}/{ARRAY}"), names, loc.concurrency)
    arrays = []
    for name, raw in zip(names, found):
        if raw is None:
            continue  # a directory that is no array (zarr would see a subgroup)
        path = parse_keystr(name)
        if path is None:
            raise ValueError(f"array {name!r}: not a jax.tree_util.keystr name")
        try:
            arrays.append((path, *_array(name, _zarrjson.decode(raw))))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"array {name!r}: {ARRAY} {e}") from None
    return arrays


def _read_if_present(loc: Location, key: str) -> bytes | None:
    try:
        return loc.read(key)
    except FileNotFoundError:
        return None


def _array(name: str, doc: Any) -> tuple[Codec, tuple[int, ...]]:
    if not isinstance(doc, dict) or doc.get("zarr_format") != 2:
        raise ValueError("is not zarr v2 array metadata")
    shape, chunks = _ints(doc["shape"]), _ints(doc["chunks"])
    if len(chunks) != len(shape) or not all(1 <= c for c in chunks) or any(d < 0 for d in shape) \
            or math.prod(shape) >= 2**62 or math.prod(chunks) >= 2**40 or math.prod(grid(shape, chunks)) > MAX_GRID:
        raise ValueError(f"has shape {list(shape)} with chunks {list(chunks)}")
    dtype = _dtype(doc["dtype"])
    if doc.get("order", "C") != "C" or doc.get("filters") not in (None, []):
        raise ValueError(f"has order {doc.get('order')!r} and filters {doc.get('filters')!r}: seqax writes C order "
                         "without filters")
    compressor = doc.get("compressor")
    name_of_compressor = None if compressor is None else compressor.get("id")
    if name_of_compressor is not None and name_of_compressor not in COMPRESSORS:
        raise ValueError(f"has compressor {name_of_compressor!r}: zarrckpt decodes seqax's layout with "
                         f"{', '.join(COMPRESSORS)} or none")
    separator = doc.get("dimension_separator") or "."
    if separator not in (".", "/"):
        raise ValueError(f"has dimension_separator {separator!r}")
    return Codec(name, dtype, chunks, name_of_compressor, separator), shape


def _ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in value):
        raise ValueError(f"{value!r} is not a list of ints")
    return tuple(value)


def _dtype(name: Any) -> np.dtype:
    if not isinstance(name, str):
        raise ValueError(f"has dtype {name!r}")
    return _dtypes.from_name(name)  # numpy's v2 names ("<f4") and TensorStore's ("bfloat16"); TypeError else


def parse_keystr(name: str) -> _tu.KeyPath | None:
    """The key path a `jax.tree_util.keystr` name stands for, or None."""
    path: list[Any] = []
    pos = 0
    while pos < len(name):
        m = _KEYSTR_TOKEN.match(name, pos)
        if m is None:
            return None
        single, double, index, attr = m.groups()
        if index is not None:
            path.append(_tu.SequenceKey(int(index)))
        elif attr is not None:
            path.append(_tu.GetAttrKey(attr))
        else:
            text = single if single is not None else double
            path.append(_tu.DictKey(re.sub(r"\\(.)", r"\1", text)))
        pos = m.end()
    return tuple(path)


def name_of(path: _tu.KeyPath) -> str:
    """The array name seqax gives the leaf at `path`."""
    return _tu.keystr(tuple(path))


def spec_from_paths(paths: list[tuple[_tu.KeyPath, str]]) -> dict[str, Any]:
    """A tree record for seqax's layout, which keeps only leaf names: dicts and lists."""
    if len(paths) == 1 and not paths[0][0]:
        return {"kind": "leaf", "name": paths[0][1], "type": "numpy"}
    root: dict[Any, Any] = {}
    for path, name in paths:
        node = root
        for entry in path[:-1]:
            node = node.setdefault(_key(entry), {})
        node[_key(path[-1])] = name
    return _to_spec(root)


def _to_spec(node: Any) -> dict[str, Any]:
    if isinstance(node, str):
        return {"kind": "leaf", "name": node, "type": "numpy"}
    keys = sorted(node, key=lambda k: (isinstance(k, str), k))
    if keys and all(isinstance(k, int) for k in keys):
        return {"kind": "list", "children": [_to_spec(node[k]) for k in keys]}
    return {"kind": "dict", "keys": keys, "children": [_to_spec(node[k]) for k in keys]}


def _key(entry: Any) -> Any:
    if isinstance(entry, _tu.SequenceKey):
        return entry.idx
    return entry.name if isinstance(entry, _tu.GetAttrKey) else entry.key
