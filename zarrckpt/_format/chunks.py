"""The chunk format: one object per chunk, and everything about it in `ChunkCodec`.

A chunk object is zarr's `bytes` codec (C order, little-endian, padded with zeros to
the whole chunk shape at the array's edge, never compressed), followed in format
version 2 by zarr's `crc32c` codec (the CRC-32C of those bytes, 4 bytes,
little-endian). Its key is `<array name>/c.<i>.<j>...` (zarr's "default" chunk key
encoding with "." as separator, so all of an array's chunks share one directory).

Save, restore, verify and copy all go through this module: it is the one place that
knows how a chunk is stored. It is bytes in, bytes out: the reader (`_restore.checkpoint`)
does the I/O.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, ClassVar

import crc32c
import numpy as np

from .._regions import Region
from ..errors import CheckpointCorruptError
from . import dtypes as _dtypes, naming as _naming

SEPARATOR = "."
CRC32C_CODEC = {"name": "crc32c"}
CHECKSUM_BYTES = 4
KEY_ENCODING = {"name": "default", "configuration": {"separator": SEPARATOR}}
# A chunk's name inside its array's directory.
NAME = re.compile(r"c(\.\d+)*")
# No array zarrckpt writes has a chunk grid this large (64 MiB chunks of a 4 PiB array):
# metadata that declares one is damaged or hostile, and every reader refuses it before
# anything is done per chunk.
MAX_GRID = 2**26
_CRC_DAMAGE = "fails its CRC-32C checksum: its bytes are damaged"



class DamagedChunk(CheckpointCorruptError):
    """A chunk object with the wrong size or checksum; `key` and `why` say which and how."""

    def __init__(self, key: str, url: str, why: str) -> None:
        super().__init__(f"chunk {key!r} of checkpoint {url} {why}")
        self.key, self.why = key, why


@dataclasses.dataclass(frozen=True)
class ChunkCodec:
    """How the chunks of one array are named, encoded, sized and checked."""

    array: str  # the array's name in the group: its chunks live in "<array>/"
    dtype: np.dtype
    shape: tuple[int, ...]  # the chunk shape
    checksum: bool = True
    part: ClassVar[str] = "chunk"  # what `key` names, in errors

    def codecs(self) -> list[dict[str, Any]]:
        """The `codecs` entry of the array's `zarr.json`."""
        bytes_codec: dict[str, Any] = {"name": "bytes"}
        if self.dtype.itemsize > 1:
            bytes_codec["configuration"] = {"endian": "little"}
        return [bytes_codec, CRC32C_CODEC] if self.checksum else [bytes_codec]

    @property
    def data_bytes(self) -> int:
        return _dtypes.nbytes(self.shape, self.dtype)

    @property
    def stored_bytes(self) -> int:
        """The size of every stored chunk object: its data, then its checksum if any."""
        return self.data_bytes + (CHECKSUM_BYTES if self.checksum else 0)

    def coords(self, chunk: Region) -> list[int]:
        """The grid coordinates of the chunk covering `chunk` (a region on the chunk grid)."""
        return [start // size for (start, _), size in zip(chunk, self.shape)]

    def key(self, chunk: Region) -> str:
        """The object key of the chunk covering `chunk`."""
        return self.key_at(self.coords(chunk))

    def coords_of(self, name: str) -> tuple[int, ...] | None:
        """The grid coordinates of the chunk whose object is named `name` inside the
        array's directory (`c.0.1`), or None if no chunk of this codec is named so (its
        bounds are the array's: see `grid`)."""
        parts = name.split(SEPARATOR)
        if parts[0] != "c" or len(parts) != len(self.shape) + 1:
            return None
        return canonical_ints(parts[1:])

    def key_at(self, coords: Sequence[int]) -> str:
        """The object key of the chunk at grid coordinates `coords`."""
        return _naming.object_key(self.array, SEPARATOR.join(["c", *map(str, coords)]))

    def object_problem(self, kind: str | None, size: int) -> str | None:
        """What is wrong with what a listing shows where a chunk object should be (`kind`:
        the entry's type, "file", "dir" or "link", None if absent; `size`: its size), or
        None: the one check of a chunk that is there whole, for `verify` and the local
        tier alike."""
        if kind is None:
            return "missing"
        if kind != "file":
            return SYMLINK if kind == "link" else "not a file"
        return self.size_damage(size)

    def size_damage(self, size: int) -> str | None:
        """What is wrong with a chunk object of `size` bytes, or None. zarrckpt never
        compresses, so every chunk object has exactly `stored_bytes`."""
        return None if size == self.stored_bytes else f"has {size} bytes, expected {self.stored_bytes}"

    def encode(self, data: np.ndarray) -> tuple[Any, ...]:
        """The parts of a chunk object (written one after the other) for `data`, the
        chunk's values, which may stop short of the chunk shape at the array's edge."""
        data = np.asarray(data)
        little = data.dtype.newbyteorder("<") if data.dtype.byteorder == ">" else data.dtype
        if tuple(data.shape) != self.shape:
            padded = np.zeros(self.shape, dtype=little)
            padded[tuple(slice(0, n) for n in data.shape)] = data
            data = padded
        payload = np.ascontiguousarray(data, dtype=little).reshape(-1).view(np.uint8)
        return (payload, _crc(payload)) if self.checksum else (payload,)

    def damage(self, stored: bytes | memoryview) -> str | None:
        """What is wrong with the stored bytes of a chunk object, or None: its size, and
        with a checksum, its CRC-32C."""
        if (wrong_size := self.size_damage(len(stored))) is not None:
            return wrong_size
        if self.checksum:
            payload = np.frombuffer(stored, np.uint8, count=self.data_bytes)
            if _crc(payload) != bytes(stored[self.data_bytes:]):
                return _CRC_DAMAGE
        return None

    def decode(self, stored: bytes | memoryview) -> np.ndarray:
        """The chunk's values, in the chunk shape, from its stored bytes (a view of
        them); Damage if their size or checksum is wrong."""
        if (damage := self.damage(stored)) is not None:
            raise Damage(damage)
        return np.frombuffer(stored, np.uint8, count=self.data_bytes).view(self.dtype).reshape(self.shape)

    def read(self, source: Any, chunk: Region, out: np.ndarray | None) -> np.ndarray:
        """The chunk covering `chunk` read from `source` (a `Location`) and checked, in
        the chunk shape: with `out` (C-contiguous, of the chunk shape), straight into it,
        the stored values being the chunk's bytes. FileNotFoundError if it is absent,
        Damage if its size or checksum is wrong (every codec's `read` says the same)."""
        if out is None:
            return self.decode(source.read(self.key(chunk)))
        trailer = bytearray(self.stored_bytes - self.data_bytes)
        payload = out.reshape(-1).view(np.uint8)
        size = source.read_into(self.key(chunk), memoryview(payload), memoryview(trailer))  # type: ignore[arg-type, unused-ignore]
        if (wrong_size := self.size_damage(size)) is not None:
            raise Damage(wrong_size)
        if self.checksum and _crc(payload) != bytes(trailer):
            raise Damage(_CRC_DAMAGE)
        return out


def grid(shape: Sequence[int], chunks: Sequence[int]) -> tuple[int, ...]:
    """How many chunks an array of `shape` in chunks of `chunks` has along each dimension."""
    return tuple(-(-d // c) for d, c in zip(shape, chunks))


def canonical_ints(parts: Sequence[str]) -> tuple[int, ...] | None:
    """`parts` as grid coordinates if each is written as zarr writes one (ASCII digits, no
    leading zero), else None: `c.01` is not the key of chunk 1."""
    if not all(p.isascii() and p.isdigit() and p == str(int(p)) for p in parts):
        return None
    return tuple(map(int, parts))


SYMLINK = "symlink: a symbolic link, never followed (zarrckpt writes none)"


class Damage(ValueError):
    """What is wrong with a chunk's bytes (its message); the reader names the chunk."""


def _crc(payload: np.ndarray) -> bytes:
    # crc32c (hardware CRC instructions) lets go of the GIL, so chunk writers checksum
    # on every core at once; google_crc32c holds it and cost a third of a save.
    return crc32c.crc32c(payload).to_bytes(CHECKSUM_BYTES, "little")  # type: ignore[arg-type, unused-ignore]
