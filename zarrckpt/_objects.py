"""What a checkpoint owns: the objects its metadata records, and nothing else.

`copy_checkpoint` copies exactly these, and a save or copy that replaces a checkpoint
(`overwrite`) deletes exactly these: a place that holds anything else (a run directory
with its steps and notes, someone's files) is refused, naming what is there, so that a
mistyped URL never costs anyone their files. Leftovers of a save, copy or deletion cut
short (uncommitted, so without metadata to trust) are judged by their names alone. A
symbolic link is deleted itself, never followed (see `_local`).
"""

from __future__ import annotations

import dataclasses
import re

from . import _commit, _seqax
from ._format import chunks as _chunks
from ._regions import chunks_touching
from ._restore import checkpoint as _reader
from ._storage import Location
from .errors import CheckpointError, CheckpointExistsError

# Every object a checkpoint (ours or seqax's) can hold, and the temporary files of an
# interrupted atomic write: anything else at a URL means it is not a checkpoint.
_TEMPORARY = r"(\.[0-9a-f]{32}\.tmp)?"
_CHECKPOINT_OBJECT = re.compile(
    rf"((zarr\.json|PINNED|[^/]+/zarr\.json|{_seqax.OBJECT_NAMES}){_TEMPORARY})"
    rf"|[^/]+/{_chunks.NAME.pattern}")
# Beside what a committed checkpoint records: its pin, and temporary files of atomic writes.
_BESIDE_RECORDED = re.compile(r"PINNED|.*\.[0-9a-f]{32}\.tmp")


@dataclasses.dataclass(frozen=True)
class Owned:
    """One object of a checkpoint: its key, about how large it is (exact for zarrckpt's
    chunks, the decoded size for seqax's, 0 for small metadata), and for a chunk of
    zarrckpt's layout, the codec that checks its size and checksum."""

    key: str
    nbytes: int = 0
    codec: _chunks.ChunkCodec | None = None


def owned(ckpt: _reader.Checkpoint) -> list[Owned]:
    """Every object `ckpt` records, its group metadata (with the commit marker) last.
    Raises CheckpointCorruptError (or MissingObject) if metadata it needs is damaged."""
    if ckpt.layout == _seqax.LAYOUT:
        grids = [(leaf.path, leaf.codec, leaf.shape) for leaf in ckpt.leaves.values()]
        return [Owned(key, nbytes) for key, nbytes in _seqax.objects(ckpt.loc, grids)]  # type: ignore[arg-type]
    out = []
    for leaf in ckpt.leaves.values():
        if leaf.processes is None:
            arrays = [leaf]
        else:
            arrays = [_reader.read_own_array(ckpt.loc, leaf, p)[0] for p in range(leaf.processes)]
        for array in arrays:
            out.append(Owned(f"{array.name}/zarr.json"))
            full = tuple((0, n) for n in array.shape)
            codec = array.codec
            assert isinstance(codec, _chunks.ChunkCodec)  # zarrckpt's layout
            out += [Owned(codec.key(chunk), codec.stored_bytes, codec)
                    for chunk in chunks_touching(full, array.chunks, array.shape)]
    return out + [Owned("zarr.json")]


def make_way(loc: Location, *, overwrite: bool) -> None:
    """Clears `loc` for a new checkpoint: a committed one is replaced only with
    `overwrite`, and only when `loc` holds nothing else; leftovers of a save, copy or
    deletion cut short are removed; anything that is not a checkpoint is refused
    (CheckpointExistsError naming it)."""
    if _commit.head(loc).state is _commit.State.COMMITTED:
        if not overwrite:
            raise CheckpointExistsError(
                f"{loc.url} already holds a committed checkpoint; pass overwrite=True to replace it")
        foreign = _foreign_beside_committed(loc)
        if foreign:
            raise CheckpointExistsError(
                f"{loc.url} holds a committed checkpoint and also {_some(foreign)}, which is not the checkpoint's; "
                "refusing to delete it: save somewhere else, or move that away first")
        _commit.remove(loc)
    elif loc.exists():
        remove_leftover(loc)


def remove_leftover(loc: Location) -> None:
    """Removes what an interrupted save or deletion left at `loc`, marker first.

    Refuses, with CheckpointExistsError, when `loc` holds anything a checkpoint would
    not: a mistyped URL must never cost someone their files.
    """
    foreign = not_ours(loc, committed=False)
    if foreign:
        raise CheckpointExistsError(f"{loc.url} is not empty and not a checkpoint (it holds {_some(foreign)}); "
                                    "refusing to delete it: save somewhere else")
    _commit.remove(loc)


def not_ours(loc: Location, *, committed: bool) -> list[str]:
    """What `loc` holds that a checkpoint would not: beside a committed checkpoint's own
    objects, or in an uncommitted leftover, any name a checkpoint never has, and a
    directory where its group metadata should be (named 'zarr.json/'): such a step is
    not what it claims, and is left alone rather than half deleted."""
    misshapen = [f"{e.name}/" for e in loc.list_dir()
                 if e.name in _commit.GROUP_METADATA_FILES and e.type not in ("file", "link")]
    if committed:
        return misshapen + _foreign_beside_committed(loc)
    return misshapen + [entry.name for entry in loc.walk() if not _CHECKPOINT_OBJECT.fullmatch(entry.name)]


def _foreign_beside_committed(loc: Location) -> list[str]:
    """What `loc` holds beside the committed checkpoint's own objects (a link at one of
    their keys is the checkpoint's, deleted itself, never followed)."""
    try:
        recorded = {o.key for o in owned(_reader.open_checkpoint(loc))}
    except CheckpointError:  # metadata too damaged to say: judge by names alone
        return [e.name for e in loc.walk() if not _CHECKPOINT_OBJECT.fullmatch(e.name)]
    return [e.name for e in loc.walk() if e.name not in recorded and not _BESIDE_RECORDED.fullmatch(e.name)]


def _some(keys: list[str]) -> str:
    """`keys` for a message: each top-level entry once (a directory as 'name/')."""
    entries = sorted({key.split("/", 1)[0] + ("/" if "/" in key else "") for key in keys})
    return ", ".join(map(repr, entries[:5])) + (", ..." if len(entries) > 5 else "")
