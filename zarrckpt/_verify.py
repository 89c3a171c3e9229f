"""Checking that a checkpoint is whole: commit marker, metadata, every chunk, checksums.

What is checked (docs/pytree-zarr-checkpoint.md says why each must hold):
- the group's `zarr.json` carries the commit marker;
- the tree record agrees with the consolidated metadata (as `open_checkpoint` checks
  before any restore) and with each array's own `zarr.json`, which other zarr readers
  use;
- every chunk of every array's grid exists, with exactly the size of a whole chunk
  (a short chunk is a cut-off write), or, in an array saved with `compression`, a size
  blosc's framing allows (its header and at most the whole chunk);
- with `checksums`, every chunk's bytes match the CRC-32C stored after them (format
  version 2 on; older checkpoints have none to check), and a compressed one's blosc
  header describes it and it decompresses.

The first three read metadata and listings only: each array costs one listing of its
directory (which gives every chunk's size at once) and one read of its `zarr.json`,
so an object store sees two requests per array, not one per chunk. An array's
`zarr.json` holding exactly the bytes zarrckpt writes for its consolidated entry is
that entry, already checked by `open_checkpoint`: only other bytes are parsed and
compared field by field. Checksums then read every chunk once, concurrently, with a
bound on the bytes held in memory; without them (`zarrckpt verify --quick`) no chunk
is read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from . import _commit, _storage
from ._format import chunks as _chunks, naming as _naming, tree as _tree, vouched as _vouched, zarrjson as _zarrjson
from ._format.chunks import ChunkCodec, DamagedChunk
from ._restore import checkpoint as _reader
from ._storage import Location
from ._util import concurrency as _concurrency, progress as _progress
from ._util.regions import Region, first_absent, indices
from .errors import CheckpointCorruptError

_SHOWN = 10  # missing chunks named one by one per array; the rest are counted


def _not_a_file(e: _storage.NotAFileInCheckpoint) -> str:
    if e.what == "a symbolic link":
        return _chunks.SYMLINK
    return f"{e.what}, not a regular file: never read (zarrckpt writes none)"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint.

    `key` is the object at fault, relative to the checkpoint (`params.w/c.0.1`,
    `zarr.json`); `message` says what is wrong; `leaf` is the key path of the leaf it
    belongs to, when it does.
    """

    key: str
    message: str
    leaf: str | None = None

    def __str__(self) -> str:
        return f"{self.key}: {self.message}" + (f" (leaf {self.leaf})" if self.leaf else "")


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What `verify` found about the checkpoint at `url`; `ok` exactly when `problems` is empty."""

    url: str
    layout: str  # "zarrckpt", "seqax", or "unknown" when the metadata cannot be read
    committed: bool
    leaves: int
    chunks_checked: int  # present with a size they may have (seqax's compressed layout: none checked)
    checksums_checked: int  # chunks whose bytes were read and matched their CRC-32C (and decompressed)
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(url: str, *, storage_options: dict[str, Any] | None = None, checksums: bool = True,
           max_workers: int | None = None, max_inflight_bytes: int = _concurrency.DEFAULT_MAX_INFLIGHT_BYTES,
           progress: bool | None = None) -> VerifyReport:
    """Checks that the checkpoint at `url` is whole and, with `checksums`, undamaged. Not collective.

    Checks the commit marker, that the tree record agrees with the consolidated
    metadata and each array's `zarr.json`, and that every chunk exists with a size it
    may have. Damage is reported, not raised.

    Args:
      url: a local path or fsspec URL of one checkpoint; uncommitted ones are checked too.
      storage_options: passed to fsspec.
      checksums: also read every chunk once and check its CRC-32C (checkpoints of
        format version 2 or later) and, if compressed, that it decompresses. False
        reads no chunk.
      max_workers: requests in flight (default: the store's concurrency).
      max_inflight_bytes: bound on chunk bytes held at once while checksumming.
      progress: show a progress bar while checksumming (default: when stderr is a
        terminal).

    Returns:
      A `VerifyReport` listing every problem found.

    Raises:
      CheckpointNotFoundError: no checkpoint at `url`, or it was deleted or replaced
        while it was verified.
      OSError: the store cannot be read.
    """
    loc = _storage.resolve(url, storage_options)
    try:
        ckpt = _reader.open_checkpoint(loc, require_committed=False)
    except CheckpointCorruptError as e:
        # Without readable metadata nothing else can be checked.
        committed = _commit.head(loc).state is _commit.State.COMMITTED
        return VerifyReport(loc.url, "unknown", committed, 0, 0, 0,
                            (*_marker_problems(committed), Problem("zarr.json", str(e))))
    problems = _marker_problems(ckpt.committed)
    chunks, checksummed = 0, 0
    if ckpt.layout == "zarrckpt":
        records = {rec["name"]: (path, rec) for path, rec in _tree.recorded_leaves(ckpt.spec)}
        leaves = list(ckpt.leaves.values())
        # Which processes' values of per-process leaves are there: one listing, not a
        # request per process the metadata claims.
        top = {e.name for e in loc.list_dir()} if any(leaf.processes for leaf in leaves) else set()
        with _concurrency.Operation(max_workers or loc.concurrency, "verify") as op:
            whole: list[tuple[_reader.StoredLeaf, Region]] = []
            results = op.fan_out(leaves, lambda leaf: _check_leaf(loc, leaf, *records[leaf.name],
                                                                  ckpt.documents.get(leaf.name), top, checksums))
            for leaf_problems, expected, sized in results:
                problems += leaf_problems
                chunks += expected
                whole += sized
            with _progress.bar(f"verifying {loc.url}", sum(leaf.codec.data_bytes for leaf, _ in whole),
                               progress) as advance:
                def check(item: tuple[_reader.StoredLeaf, Region]) -> Problem | None:
                    problem = _checksum_problem(loc, *item, ckpt.vouched)
                    advance(item[0].codec.data_bytes)
                    return problem

                sums = op.fan_out(whole, check, budget=_concurrency.ByteBudget(max_inflight_bytes),
                                  nbytes=lambda item: item[0].codec.data_bytes)
            problems += [problem for problem in sums if problem is not None]
            checksummed = len(whole)
    if problems:
        # A step deleted (retention) or replaced while it was verified looks damaged: it is not.
        ckpt.check_unchanged()
    return VerifyReport(loc.url, ckpt.layout, ckpt.committed, len(ckpt.leaves), chunks, checksummed,
                        tuple(problems))


def _marker_problems(committed: bool) -> list[Problem]:
    if committed:
        return []
    return [Problem("zarr.json", f"not committed (no '{_naming.COMMIT_ATTR}: true'): "
                                 "the save did not finish, or is still running")]


def _check_leaf(loc: Location, leaf: _reader.StoredLeaf, path: _tree.KeyPath, record: dict[str, Any],
                document: Any, top: set[str], checksums: bool
                ) -> tuple[list[Problem], int, list[tuple[_reader.StoredLeaf, Region]]]:
    """The metadata and chunk-size problems of one leaf's arrays (one, with `document`
    its consolidated metadata, or one per process for a per-process leaf, `top` naming
    what the checkpoint's directory holds), how many chunks their grids have, and, with
    `checksums`, those present with the right size and a checksum to check."""
    if leaf.processes is None:
        arrays, problems = [leaf], _check_array_document(loc, leaf, path, record, document)
    else:
        arrays, problems = _per_process_arrays(loc, leaf, top)
    expected, sized = 0, []
    for array in arrays:
        array_problems, count, present = _check_chunks(loc, array, checksums and array.checksum)
        problems += array_problems
        expected += count
        sized += [(array, chunk) for chunk in present]
    return problems, expected, sized


def _per_process_arrays(loc: Location, leaf: _reader.StoredLeaf, top: set[str]
                        ) -> tuple[list[_reader.StoredLeaf], list[Problem]]:
    """The array of every process that saved the per-process `leaf`, from each one's
    own `zarr.json`, and the problems of those that cannot be read; only those `top`
    lists are read, and at most `_SHOWN` absent ones are named (the rest counted)."""
    processes = leaf.processes or 0
    there = _naming.processes_listed(leaf.name, processes, top)
    absent = processes - len(there)
    problems = [Problem(_naming.object_key(_naming.per_process_name(leaf.name, p), "zarr.json"),
                        f"missing (process {p}'s value)", leaf.where)
                for p in first_absent(range(processes), there, _SHOWN)]
    arrays = []
    for process in sorted(there):
        key = _naming.object_key(_naming.per_process_name(leaf.name, process), "zarr.json")
        try:
            arrays.append(_reader.read_own_array(loc, leaf, process)[0])
        except _reader.MissingObject:
            problems.append(Problem(key, f"missing (process {process}'s value)", leaf.where))
        except _storage.NotAFileInCheckpoint as e:
            problems.append(Problem(key, _not_a_file(e), leaf.where))
        except CheckpointCorruptError as e:
            problems.append(Problem(key, f"malformed: {e}", leaf.where))
    if absent > _SHOWN:
        problems.append(Problem(f"{leaf.name} (per process)", f"{absent - _SHOWN:,} more processes' values missing "
                                f"({absent:,} of {processes:,})", leaf.where))
    return arrays, problems


def _check_chunks(loc: Location, leaf: _reader.StoredLeaf, wanted: bool) -> tuple[list[Problem], int, list[Region]]:
    """The chunk-size problems of one array, how many chunks its grid has, and (if
    `wanted`, to be read next) those present with the right size. Work and memory
    follow the array's listing, not its declared grid (`open_checkpoint` bounds the grid
    by `MAX_GRID`); at most `_SHOWN` missing chunks are named, the rest counted in one
    problem."""
    problems: list[Problem] = []
    codec = leaf.codec
    assert isinstance(codec, ChunkCodec)  # verified: zarrckpt's layout only
    grid = _chunks.grid(leaf.shape, leaf.chunks)
    expected = math.prod(grid)  # none if no elements
    try:
        listed = loc.list_dir(_naming.object_key(leaf.name), missing_ok=False)
    except FileNotFoundError:
        if expected:
            problems.append(Problem(f"{leaf.name}/", f"the array's directory is missing (all {expected:,} "
                                                     "chunks)", leaf.where))
        return problems, expected, []
    except _storage.NotAFileInCheckpoint as e:
        return problems + [Problem(f"{leaf.name}/", _not_a_file(e), leaf.where)], expected, []
    sized, found = [], set()
    for entry in listed:
        coords = codec.coords_of(entry.name)
        if coords is None or not all(i < n for i, n in zip(coords, grid)):
            continue  # not a chunk of this array (what else is there is not verify's business)
        found.add(coords)
        key = _naming.object_key(leaf.name, entry.name)
        if (damage := codec.object_problem(entry.type, entry.size)) is not None:
            problems.append(Problem(key, damage, leaf.where))
        elif wanted:
            sized.append(tuple((i * c, min((i + 1) * c, n)) for i, c, n in zip(coords, leaf.chunks, leaf.shape)))
    if missing := expected - len(found):
        named = first_absent(indices(grid), found, _SHOWN)
        problems += [Problem(codec.key_at(coords), "missing", leaf.where) for coords in named]
        if missing > _SHOWN:
            problems.append(Problem(f"{leaf.name}/", f"{missing - _SHOWN:,} more chunks missing ({missing:,} of "
                                                     f"{expected:,})", leaf.where))
    return problems, expected, sized


def _check_array_document(loc: Location, leaf: _reader.StoredLeaf, path: _tree.KeyPath,
                          record: dict[str, Any], document: Any) -> list[Problem]:
    """The array's own `zarr.json` must describe what the tree record and the
    consolidated metadata (`document`, this array's entry) describe. The bytes that
    zarrckpt wrote for `document` are that document, already checked: only other
    bytes are parsed and compared field by field."""
    key = _naming.object_key(leaf.name, "zarr.json")
    try:
        raw = loc.read(key)
    except FileNotFoundError:
        return [Problem(key, "missing", leaf.where)]
    except _storage.NotAFileInCheckpoint as e:
        return [Problem(key, _not_a_file(e), leaf.where)]
    except _storage.TooLarge as e:
        return [Problem(key, e.reason, leaf.where)]
    if raw == _as_written(document):
        return []
    try:
        own = _reader.stored_leaf(path, record, _zarrjson.decode(raw))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return [Problem(key, f"does not match the tree record: {e}", leaf.where)]
    differing = [f.name for f in dataclasses.fields(leaf) if getattr(own, f.name) != getattr(leaf, f.name)]
    if differing:
        return [Problem(key, f"differs from the consolidated metadata in {', '.join(differing)}", leaf.where)]
    return []


def _as_written(document: Any) -> bytes | None:
    """`document` as zarrckpt writes a `zarr.json`, or None if it could not have
    written it (which decodes back to exactly `document`, types included: JSON has
    one spelling for 1, 1.0 and true each)."""
    try:
        return _zarrjson.encode_document(document) if isinstance(document, dict) else None
    except (ValueError, TypeError, RecursionError):
        return None


def _checksum_problem(loc: Location, leaf: _reader.StoredLeaf, chunk: Region,
                      vouched: _vouched.Record) -> Problem | None:
    """Reads one chunk and compares its bytes with the CRC-32C stored after them, and
    that with the one its commit records (`vouched`, where it records one)."""
    key = leaf.codec.key(chunk)
    try:
        _reader.read_chunk(loc, leaf.codec, chunk, expect=_vouched.recorded(vouched, key))
    except _reader.MissingObject:
        return Problem(key, "missing (deleted while being verified)", leaf.where)
    except DamagedChunk as e:
        return Problem(e.key, e.why, leaf.where)
    return None
