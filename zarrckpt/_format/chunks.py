"""The chunk format: one object per chunk, and everything about it in `ChunkCodec`.

A chunk object is zarr's `bytes` codec (C order, little-endian, padded with zeros to
the whole chunk shape at the array's edge), in an array saved with `compression="zstd"`
then zarr's `blosc` codec (zstd, bit-shuffled by the dtype's size: each chunk either
compressed or, where that does not pay, stored as it is behind blosc's 16-byte header),
followed in format version 2 by zarr's `crc32c` codec (the CRC-32C of all that, 4 bytes,
little-endian). Its key is `<array name>/c.<i>.<j>...` (zarr's "default" chunk key
encoding with "." as separator, so all of an array's chunks share one directory).

Save, restore, verify and copy all go through this module: it is the one place that
knows how a chunk is stored. It is bytes in, bytes out: the reader (`_restore.checkpoint`)
does the I/O.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import Any, ClassVar

import crc32c
import numcodecs.blosc
import numpy as np

from .._util.regions import Region
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


def _unvouched(found: int, expect: int) -> str:
    return (f"is not the chunk its commit records (its CRC-32C is {found:08x}, the commit's {expect:08x}): "
            "another writer put it there after the save made it")

# The one compression zarrckpt writes (`compression="zstd"`): zstd at its fastest level,
# on bytes bit-shuffled by the dtype's size (a float's sign and exponent bits, which
# trained weights share, end up side by side; bf16 weights come to about 0.76 of their
# size, f32 to about 0.88, where byte-shuffling gave 0.78 and 0.93, more slowly).
COMPRESSIONS = ("zstd",)
_ZSTD_LEVEL = 1
# blosc's header, its format's version bytes and flags (c-blosc's README_HEADER):
# bit-shuffled, compressed by zstd (code 4), and for a chunk stored as it is, "memcpyed".
BLOSC_HEADER = 16
_BLOSC_VERSION, _BLOSC_ZSTD_VERSION = 2, 1
_BITSHUFFLE, _MEMCPYED, _ZSTD = 0x4, 0x2, 4 << 5
# blosc compresses at most this much in one buffer; a larger chunk is never compressed.
_BLOSC_MAX_BYTES = 2**31 - 1 - BLOSC_HEADER
# Chunks smaller than this are never compressed: a few KiB saved cost a codec per read.
MIN_COMPRESSED_BYTES = 64 * 2**10



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
    # "zstd": its chunks go through blosc (see the module docstring); None: stored as they are.
    compression: str | None = None
    part: ClassVar[str] = "chunk"  # what `key` names, in errors

    @staticmethod
    def of(array: str, dtype: np.dtype, shape: tuple[int, ...], checksum: bool = True,
           compression: str | None = None) -> ChunkCodec:
        """The codec a save gives an array whose chunks are of `shape`: `compression`
        only where chunks are large enough to gain from it and small enough for blosc."""
        fits = ChunkCodec(array, dtype, shape, checksum, compression).compression_problem() is None
        return ChunkCodec(array, dtype, shape, checksum, compression if fits else None)

    def compression_problem(self) -> str | None:
        """Why this codec's chunks cannot be compressed, or None: too small to gain,
        too large for blosc, or of a dtype wider than blosc shuffles. A reader refuses
        what zarrckpt never writes."""
        if self.compression is None:
            return None
        if not MIN_COMPRESSED_BYTES <= self.data_bytes <= _BLOSC_MAX_BYTES:
            return (f"compressed chunks of {self.data_bytes:,} bytes (zarrckpt compresses chunks of "
                    f"{MIN_COMPRESSED_BYTES:,} to {_BLOSC_MAX_BYTES:,})")
        if self.dtype.itemsize > 255:
            return f"compressed chunks of a {self.dtype.itemsize}-byte dtype (blosc shuffles at most 255)"
        return None

    def codecs(self) -> list[dict[str, Any]]:
        """The `codecs` entry of the array's `zarr.json`."""
        bytes_codec: dict[str, Any] = {"name": "bytes"}
        if self.dtype.itemsize > 1:
            bytes_codec["configuration"] = {"endian": "little"}
        codecs = [bytes_codec]
        if self.compression is not None:
            codecs.append({"name": "blosc", "configuration": {
                "typesize": self.dtype.itemsize, "cname": self.compression, "clevel": _ZSTD_LEVEL,
                "shuffle": "bitshuffle", "blocksize": 0}})
        return [*codecs, CRC32C_CODEC] if self.checksum else codecs

    @property
    def data_bytes(self) -> int:
        return _dtypes.nbytes(self.shape, self.dtype)

    @property
    def stored_bytes(self) -> int:
        """The size of a stored chunk object, at most (exactly, uncompressed): its data
        (compressed, after blosc's header), then its checksum if any."""
        return (self.data_bytes + (BLOSC_HEADER if self.compression else 0)
                + (CHECKSUM_BYTES if self.checksum else 0))

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
        """What is wrong with a chunk object of `size` bytes, or None: uncompressed, every
        chunk object has exactly `stored_bytes`; compressed, at least blosc's header and
        at most `stored_bytes`."""
        least = self.stored_bytes if self.compression is None else self.stored_bytes - self.data_bytes
        if least <= size <= self.stored_bytes:
            return None
        expected = self.stored_bytes if self.compression is None else f"{least} to {self.stored_bytes}"
        return f"has {size} bytes, expected {expected}"

    def _framed(self, size: int) -> int:
        """How many of a chunk object's `size` bytes come before its checksum."""
        return size - (CHECKSUM_BYTES if self.checksum else 0)

    def encode(self, data: np.ndarray) -> tuple[Any, ...]:
        """The parts of a chunk object (written one after the other) for `data`, the
        chunk's values, which may stop short of the chunk shape at the array's edge;
        never compressed (see `frame`)."""
        return self.frame(self.payload(data))

    def frame(self, payload: np.ndarray, compressed: bytes | None = None) -> tuple[Any, ...]:
        """The parts of a chunk object holding `payload` (see `payload`): in an array of
        a compressed codec, blosc's `compressed` bytes of it (see `compress`), or without
        them, `payload` as it is behind blosc's header (neither copied nor compressed);
        then its checksum. Compressed bytes no smaller than that, or whose header a
        reader would refuse (a blosc that writes another format), are not used: a chunk
        of exactly the most bytes is always one stored as it is (see `read`)."""
        if self.compression is None:
            assert compressed is None
            parts: tuple[Any, ...] = (payload,)
        elif compressed is not None and len(compressed) < payload.nbytes + BLOSC_HEADER and \
                self._header_damage(compressed[:BLOSC_HEADER], len(compressed)) is None:
            parts = (compressed,)
        else:
            parts = (_blosc_header(self.dtype.itemsize, payload.nbytes, payload.nbytes + BLOSC_HEADER, _MEMCPYED),
                     payload)
        return (*parts, _crc(*parts)) if self.checksum else parts

    def payload(self, data: np.ndarray) -> np.ndarray:
        """The bytes of zarr's `bytes` codec for `data` (see `encode`), a view where it can."""
        data = np.asarray(data)
        little = data.dtype.newbyteorder("<") if data.dtype.byteorder == ">" else data.dtype
        if tuple(data.shape) != self.shape:
            padded = np.zeros(self.shape, dtype=little)
            padded[tuple(slice(0, n) for n in data.shape)] = data
            data = padded
        return np.ascontiguousarray(data, dtype=little).reshape(-1).view(np.uint8)

    def compress(self, payload: np.ndarray) -> bytes:
        """`payload` (or any part of it) through blosc as this codec's `codecs` say.
        Called on the writers' threads: blosc then runs single-threaded, each call with
        its own context, as numcodecs does off the main thread."""
        assert self.compression is not None
        items = payload.view(np.dtype((np.void, self.dtype.itemsize)))  # blosc shuffles by the buffer's item size
        return numcodecs.blosc.compress(items, self.compression.encode(), _ZSTD_LEVEL,
                                        numcodecs.blosc.BITSHUFFLE)

    def crc_of(self, parts: Sequence[Any]) -> int | None:
        """The CRC-32C that a chunk framed as `parts` (`frame`) carries, or None without a
        checksum: what its commit records of it (see `_format.vouched`)."""
        return int.from_bytes(parts[-1], "little") if self.checksum else None

    def damage(self, stored: bytes | memoryview, expect: int | None = None) -> str | None:
        """What is wrong with the stored bytes of a chunk object, or None: its size, and
        with a checksum, its CRC-32C, which must be `expect` where the commit records
        one; compressed, blosc's header, which must say that the chunk holds exactly its
        data's size (a header that lies is refused before blosc reads any further)."""
        if (wrong_size := self.size_damage(len(stored))) is not None:
            return wrong_size
        framed = self._framed(len(stored))
        if self.checksum and _crc(memoryview(stored)[:framed]) != bytes(stored[framed:]):
            return _CRC_DAMAGE
        if self.checksum and expect is not None and (found := int.from_bytes(stored[framed:], "little")) != expect:
            return _unvouched(found, expect)
        if self.compression is not None:
            return self._header_damage(stored[:BLOSC_HEADER], framed)
        return None

    def _header_damage(self, header: bytes | bytearray | memoryview, framed: int) -> str | None:
        """What is wrong with blosc's `header` of a frame of `framed` bytes, or None."""
        version, _, flags, typesize = header[:4]
        nbytes, _, cbytes = np.frombuffer(header, "<u4", count=3, offset=4).tolist()
        if (version, typesize, nbytes, cbytes) != (_BLOSC_VERSION, self.dtype.itemsize, self.data_bytes, framed):
            return (f"has a blosc header that does not describe it (version {version}, item size {typesize}, "
                    f"{nbytes} bytes in {cbytes}; expected version {_BLOSC_VERSION}, item size "
                    f"{self.dtype.itemsize}, {self.data_bytes} bytes in {framed})")
        if flags & _MEMCPYED:
            return None if framed == self.data_bytes + BLOSC_HEADER else "is stored whole but has the wrong size"
        if flags & 0xE0 != _ZSTD:
            return f"is compressed with blosc's compressor {flags >> 5}, not zstd"
        return None

    def decode(self, stored: bytes | memoryview, out: np.ndarray | None = None,
               expect: int | None = None) -> np.ndarray:
        """The chunk's values, in the chunk shape, from its stored bytes (a view of
        them, uncompressed; with `out`, C-contiguous of the chunk shape, in it); Damage if
        their size, checksum (or its CRC-32C is not `expect`) or header is wrong, or blosc
        cannot decompress them."""
        if (damage := self.damage(stored, expect)) is not None:
            raise Damage(damage)
        if self.compression is None:
            values = np.frombuffer(stored, np.uint8, count=self.data_bytes).view(self.dtype).reshape(self.shape)
        else:
            values = np.empty(self.shape, self.dtype) if out is None else out
            try:
                numcodecs.blosc.decompress(memoryview(stored)[:self._framed(len(stored))],
                                           values.reshape(-1).view(np.uint8))
            except (RuntimeError, ValueError) as e:  # numcodecs's word for a frame it cannot take
                raise Damage(f"cannot be decompressed: {e}") from None
            return values
        if out is not None:
            out[...] = values
            return out
        return values

    def read(self, source: Any, chunk: Region, out: np.ndarray | None, expect: int | None = None) -> np.ndarray:
        """The chunk covering `chunk` read from `source` (a `Location`) and checked, in
        the chunk shape: with `out` (C-contiguous, of the chunk shape), into it, a chunk
        stored as it is (uncompressed, or behind blosc's header) read straight there, a
        compressed one decoded there. FileNotFoundError if it is absent, Damage if its
        size, checksum or header is wrong, or its CRC-32C is not `expect`, the one its
        commit records (every codec's `read` says the same)."""
        key = self.key(chunk)
        check = functools.partial(self.damage, expect=expect)
        if out is None:
            # Never more than a chunk can hold (a compressed one's size is known only once read).
            stored = source.read(key, limit=self.stored_bytes + 1, check=check)
            if len(stored) > self.stored_bytes:
                raise Damage(f"has more than the {self.stored_bytes} bytes it can hold")
            return self.decode(stored, expect=expect)
        header = bytearray(BLOSC_HEADER if self.compression is not None else 0)
        payload = out.reshape(-1).view(np.uint8)
        trailer = bytearray(CHECKSUM_BYTES if self.checksum else 0)
        size = source.read_into(key, memoryview(header), payload.data, memoryview(trailer),
                                check=check)
        if (wrong_size := self.size_damage(size)) is not None:
            raise Damage(wrong_size)
        if size < self.stored_bytes or (self.compression is not None and not header[2] & _MEMCPYED):
            # Compressed: its frame, read into `out`, is decoded from a copy.
            return self.decode(b"".join([header, payload[:size - len(header)].tobytes(), trailer])[:size], out,
                               expect)
        if self.checksum and _crc(header, payload) != bytes(trailer):
            raise Damage(_CRC_DAMAGE)
        if self.checksum and expect is not None and (found := int.from_bytes(trailer, "little")) != expect:
            raise Damage(_unvouched(found, expect))
        if self.compression is not None and (damage := self._header_damage(header, size - len(trailer))) is not None:
            raise Damage(damage)
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


def _crc(*parts: Any) -> bytes:
    # crc32c (hardware CRC instructions) lets go of the GIL, so chunk writers checksum
    # on every core at once; google_crc32c holds it and cost a third of a save.
    value = 0
    for part in parts:
        value = crc32c.crc32c(part, value)
    return value.to_bytes(CHECKSUM_BYTES, "little")


def _blosc_header(typesize: int, nbytes: int, cbytes: int, flags: int) -> bytes:
    """blosc's header of a buffer of `nbytes` stored in `cbytes` (header included)."""
    return bytes([_BLOSC_VERSION, _BLOSC_ZSTD_VERSION, _BITSHUFFLE | _ZSTD | flags, typesize]) + \
        np.array([nbytes, nbytes, cbytes], "<u4").tobytes()
