"""Hugging Face's safetensors format, read as untrusted input (pure: bytes in, checked
descriptions out).

A `.safetensors` file is an 8-byte little-endian header length N, N bytes of JSON
(`{name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}`), then the tensors' bytes, each C-order little-endian at
`8 + N + begin`. A sharded set has `model.safetensors.index.json` beside its files:
`{"metadata": {...}, "weight_map": {name: file name}}`. Tensor names nest on '.'
(`model.layers.0.mlp.up_proj.weight`).

What a file says is checked against what it is, as Hugging Face's own reader checks it:
the tensors tile the data section exactly (every byte one tensor's, none past the end),
each tensor's bytes are exactly its shape's, its shape is one numpy can hold, and no
JSON object names a key twice. A file that passes describes no more bytes than it has:
a 1 MiB file cannot load as 256 MiB. Names are cut to 100 characters in messages.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, ClassVar, NamedTuple

import ml_dtypes
import numpy as np

from .._util.regions import Region
from . import tree as _tree, zarrjson as _zarrjson
from .chunks import Damage

LAYOUT = "safetensors"  # a Checkpoint's `layout` when it is a safetensors file or set
PREFIX_BYTES = 8
# More header than any real file has (a few hundred bytes per tensor): a larger
# length is damage, or a file that would make a reader allocate without bound.
MAX_HEADER_BYTES = 100 * 2**20
# The most dimensions a numpy array has (NPY_MAXDIMS); a tensor of more cannot be read.
MAX_RANK = 64
# Each dimension is below this: numpy's shapes are int64, and a zero-size tensor's other
# dimensions are bound by nothing else (a [2**64, 0] tensor would be written by an
# import that nothing can then read back).
MAX_DIMENSION = 2**63
INDEX_NAME = "model.safetensors.index.json"
# Where a checkpoint imported from safetensors keeps the source's `__metadata__` (in its
# `zarrckpt` attribute), for an export to write back.
METADATA_KEY = "safetensors_metadata"
EXTENSION = ".safetensors"
DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32), "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}


class Malformed(ValueError):
    """What is wrong with a file or index (its message); the reader names the file."""


class Tensor(NamedTuple):
    """One tensor of a file: its name, dtype and shape, and where its bytes are in the
    file (`start`, from the file's first byte; `nbytes` of them). A tuple: a header
    describes up to millions, each made in a few microseconds."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


# Tensors are read in parts of whole rows of at most this size, one range request
# each. A part is a power of two of rows, so that it ends where a shard of a tensor of
# 2**k rows cut over 2**j devices does, and a process reads only its devices' rows; a
# shard boundary inside a part costs at most that part again.
PART_BYTES = 4 * 2**20


@dataclasses.dataclass(frozen=True)
class TensorCodec:
    """How a tensor's parts are read: one range of its file each. A part is `shape`
    (whole rows of the tensor; the tensor's shape for a 0-d one), and the read path
    treats parts as it treats a checkpoint's chunks."""

    checksum: ClassVar[bool] = False
    part: ClassVar[str] = "file"  # what `key` names, in errors

    array: str  # the tensor's name
    file: str  # the key of the file holding it, beside the others of its set
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # of the tensor's bytes in the file
    rows: int  # of the tensor (1 for a 0-d one)

    @classmethod
    def of(cls, tensor: Tensor, file: str) -> TensorCodec:
        if not tensor.shape:
            return cls(tensor.name, file, tensor.dtype, (), tensor.start, 1)
        if not tensor.nbytes:  # no element, so no part is ever read; a part is never empty
            return cls(tensor.name, file, tensor.dtype, tuple(max(1, d) for d in tensor.shape), tensor.start,
                       tensor.shape[0])
        rows = tensor.shape[0]
        row_bytes = max(1, math.prod(tensor.shape[1:]) * tensor.dtype.itemsize)
        part = (min(rows, 1 << max(0, (PART_BYTES // row_bytes).bit_length() - 1)), *tensor.shape[1:])
        return cls(tensor.name, file, tensor.dtype, part, tensor.start, rows)

    @property
    def data_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def key(self, chunk: Region) -> str:
        return self.file

    def read(self, source: Any, chunk: Region, out: np.ndarray | None, expect: int | None = None) -> np.ndarray:
        """As `ChunkCodec.read`: the part covering `chunk` (its rows, in a buffer of the
        part's shape), one range request, straight into `out` when given (a file records
        no chunk: `expect` is None)."""
        start, nbytes = self.span(chunk)
        values = out if out is not None else np.empty(self.shape, self.dtype)
        done = source.read_range(self.file, start, values.reshape(-1).view(np.uint8)[:nbytes].data)
        if done != nbytes:
            raise Damage(f"ends before the bytes of tensor {self.array!r} (bytes {start:,} to {start + nbytes:,})")
        return values

    def span(self, chunk: Region) -> tuple[int, int]:
        """Where the part covering `chunk` is in the file: its first byte, and its size
        (a tensor's last part may hold fewer rows)."""
        if not self.shape:
            return self.start, self.data_bytes
        per_row = self.data_bytes // self.shape[0]
        first = chunk[0][0] // self.shape[0] * self.shape[0]
        return self.start + first * per_row, (min(first + self.shape[0], self.rows) - first) * per_row


def header_length(prefix: bytes, file_size: int) -> int:
    """The JSON header's length, from the file's first 8 bytes; Malformed if it cannot
    be one of a file of `file_size` bytes."""
    if len(prefix) < PREFIX_BYTES:
        raise Malformed(f"is {file_size} bytes long, too short for a safetensors file")
    length = int.from_bytes(prefix[:PREFIX_BYTES], "little")
    if not 2 <= length <= min(MAX_HEADER_BYTES, file_size - PREFIX_BYTES):
        raise Malformed(f"declares a header of {length:,} bytes in a file of {file_size:,}: not a safetensors file")
    return length


def parse_header(raw: bytes, file_size: int) -> tuple[list[Tensor], dict[str, str]]:
    """The tensors the header `raw` of a file of `file_size` bytes describes, in file
    order, and its `__metadata__`. Malformed naming the first thing that is not as the
    format says: a key twice in one object (a tensor listed twice), a tensor of a dtype
    zarrckpt does not read, of a shape no numpy array has, or whose bytes are not its
    shape's; tensors that do not tile the data section exactly."""
    try:
        header = _zarrjson.decode(raw, unique_keys=True)
    except _zarrjson.DuplicateKey as e:
        raise Malformed(f"has a header naming {e.key!r:.100} twice in one object (a reader keeping the first "
                        "would read another file than one keeping the last)") from None
    except ValueError as e:
        raise Malformed(f"has a header that is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise Malformed("has a header that is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise Malformed(f"has __metadata__ {metadata!r:.100}, not a map of strings")
    base = PREFIX_BYTES + len(raw)
    tensors = [_tensor(name, entry, base, file_size - base) for name, entry in header.items()]
    tensors.sort(key=operator.attrgetter("start", "nbytes"))  # an empty tensor first of those starting there
    _check_tiling(tensors, base, file_size)
    return tensors, metadata


def _tensor(name: str, entry: Any, base: int, data: int) -> Tensor:
    """The header's `entry` for tensor `name`, whose offsets count from byte `base` of the
    file, in a data section of `data` bytes. Called for each of up to millions of
    tensors: the common case costs a few checks."""
    if not name or type(entry) is not dict:
        raise Malformed(f"has a tensor {name!r:.100} described by {entry!r:.100}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if type(dtype) is not str or dtype not in DTYPES:
        raise Malformed(f"has tensor {name!r:.100} of dtype {dtype!r:.40}, which zarrckpt does not read (it reads "
                        f"{', '.join(DTYPES)})")
    if type(shape) is not list or not all(type(d) is int and 0 <= d < MAX_DIMENSION for d in shape):
        raise Malformed(f"has tensor {name!r:.100} of shape {shape!r:.100}, not a list of ints from 0 to 2**63 - 1")
    if len(shape) > MAX_RANK:
        raise Malformed(f"has tensor {name!r:.100} of {len(shape)} dimensions, more than an array has ({MAX_RANK})")
    if 0 in shape and math.prod(d for d in shape if d) * DTYPES[dtype].itemsize >= MAX_DIMENSION:
        # numpy sizes an empty array as if its zero dimensions were not there
        raise Malformed(f"has tensor {name!r:.100} of shape {shape!r:.100}: its other dimensions span 2**63 bytes or "
                        "more, more than an array has")
    if type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int or type(offsets[1]) is not int:
        raise Malformed(f"has tensor {name!r:.100} at data_offsets {offsets!r:.100}, not two ints")
    begin, end = offsets
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if not 0 <= begin <= end <= data or end - begin != nbytes:
        raise Malformed(f"has tensor {name!r:.100} of {nbytes:,} bytes ({dtype} {shape}) at bytes {offsets} of a data "
                        f"section of {data:,}")
    return Tensor(name, DTYPES[dtype], tuple(shape), base + begin, nbytes)


def _check_tiling(tensors: list[Tensor], base: int, file_size: int) -> None:
    """Malformed unless `tensors` (in file order) cover the data section, bytes `base` to
    `file_size`, exactly: each byte one tensor's. Tensors sharing bytes would make a
    small file load as a large one (256 tensors over one MiB: 256 MiB), and bytes no
    tensor holds are damage, or data hidden from a reader that checks."""
    at = base
    for i, tensor in enumerate(tensors):
        if tensor.start != at:
            raise Malformed(_tiling_fault(tensors, i, at, base))
        at += tensor.nbytes
    if at != file_size:
        raise Malformed(f"has {file_size - at:,} bytes after its last tensor {tensors[-1].name!r:.100} that no tensor "
                        "holds" if tensors else f"has {file_size - at:,} bytes of data and no tensor")


def _tiling_fault(tensors: list[Tensor], i: int, at: int, base: int) -> str:
    """Why tensor `i` (in file order) does not start where the ones before it end, `at`."""
    tensor = tensors[i]

    def where(t: Tensor) -> str:
        return f"{t.name!r:.100} (bytes [{t.start - base:,}, {t.start - base + t.nbytes:,}])"

    if tensor.start > at:
        before = f"between tensors {tensors[i - 1].name!r:.100} and" if i else "before its first tensor"
        return f"has {tensor.start - at:,} bytes {before} {tensor.name!r:.100} that no tensor holds"
    other = next(t for t in reversed(tensors[:i]) if t.start <= tensor.start < t.start + t.nbytes)
    return f"has tensors {where(other)} and {where(tensor)} over the same bytes: a byte is one tensor's"


def parse_index(raw: bytes) -> dict[str, str]:
    """The file holding each tensor, from a sharded set's index; Malformed if it is not
    one, lists a tensor twice, or names a file anywhere but beside it."""
    if len(raw) > MAX_HEADER_BYTES:
        raise Malformed(f"is over {MAX_HEADER_BYTES:,} bytes, more than any index needs (a few hundred per tensor)")
    try:
        index = _zarrjson.decode(raw, unique_keys=True)
    except _zarrjson.DuplicateKey as e:
        raise Malformed(f"lists {e.key!r:.100} twice") from None
    except ValueError as e:
        raise Malformed(f"is not JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise Malformed("has no weight_map of tensor names to files")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file.endswith(EXTENSION) or "/" in file or "\\" in file \
                or file.startswith("."):
            raise Malformed(f"maps tensor {name!r:.100} to {file!r:.100}, not a .safetensors file beside it")
    return weight_map


def nested(names: list[str]) -> dict[str, Any]:
    """Tensors named `names` as dicts nested on '.', each leaf its tensor's name.
    Malformed if one name is a prefix of another's path (`a.b` and `a.b.c`), which no
    tree can hold, has an empty part, or nests deeper than a tree zarrckpt saves."""
    root: dict[str, Any] = {}
    for name in names:
        node, parts = root, name.split(".")
        if len(parts) > _tree.MAX_DEPTH:  # every reader of the tree recurses: a stray RecursionError
            raise Malformed(f"has tensor {name!r:.100} of {len(parts):,} parts between dots, deeper than a tree "
                            f"zarrckpt saves ({_tree.MAX_DEPTH})")
        for i, part in enumerate(parts):
            if not part:
                raise Malformed(f"has tensor {name!r:.100}, with an empty part between dots")
            last = i == len(parts) - 1
            found = node.get(part)
            if isinstance(found, str) or (found is not None and last):
                other = found if isinstance(found, str) else f"{'.'.join(parts)}.*"
                raise Malformed(f"has tensors {other!r:.100} and {name!r:.100}: one is inside the other")
            node = node.setdefault(part, name if last else {})
    return root


def tree_record(node: dict[str, Any]) -> dict[str, Any]:
    """The tree record (see `tree`) of tensors nested as `nested` nests them; each leaf's
    array name is its tensor's name."""
    keys = sorted(node)
    return {"kind": "dict", "keys": keys,
            "children": [{"kind": "leaf", "name": node[k]} if isinstance(node[k], str) else tree_record(node[k])
                         for k in keys]}
