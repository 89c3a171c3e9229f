"""Another library's checkpoint opened as a tree to save (see `_import`): what `src`
is (an Orbax run, step or item; a safetensors file or set) is found once, from one
resolved place, and opened once.

Each array of the tree is a `_tree.Deferred` leaf, read by the writer that writes it; a
read that fails is the source's error, which the save raises as it is (see
`Deferred.values`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._format import safetensors as _safetensors_format, tree as _tree
from .._restore import checkpoint as _reader
from ..errors import CheckpointNotFoundError
from . import orbax as _orbax, safetensors as _safetensors


@dataclasses.dataclass(frozen=True)
class Source:
    """An opened source: its URL, its format ("orbax" or "safetensors"), its tree, the
    step it lands as (an Orbax run's or step's own; else the one asked for), what was
    left out of it, with why, and the metadata to keep beside it."""

    url: str
    format: str
    tree: Any
    step: int | None
    skipped: dict[str, str]
    metadata: dict[str, Any] | None


def open_source(src: str, storage_options: dict[str, Any] | None, *, option: str, step: int | None) -> Source:
    """Opens `src` (see `import_checkpoint`); `option` is the caller's keyword for
    `storage_options`, for errors. Checks every header and all metadata; reads no array."""
    folder, file = _safetensors.locate(src, storage_options, option=option)
    loc = folder.child(file) if file is not None else folder
    if not loc.exists():
        raise CheckpointNotFoundError(f"nothing to import: {loc.url} does not exist")
    found = _orbax.find(loc)
    if found is not None:
        if storage_options and loc.takes_options:
            raise ValueError(f"storage options for the source cannot reach {loc.url}: TensorStore reads Orbax's "
                             "arrays, with the credentials and endpoint of its environment (AWS_*, "
                             "GOOGLE_APPLICATION_CREDENTIALS)")
        opened = _orbax.open_step(loc, found, step)
        # Where a manager keeps a step's metrics, so that keep_best ranks the step.
        kept = {"metrics": opened.metrics} if opened.metrics is not None else None
        return Source(loc.url, "orbax", opened.tree, opened.step, opened.skipped, kept)
    try:
        ckpt = _safetensors.open_safetensors(folder, file)
    except CheckpointNotFoundError as e:
        raise CheckpointNotFoundError(f"{loc.url} is neither an Orbax checkpoint nor a safetensors file or "
                                      f"set: {e}") from None
    # Kept for an export to write back: transformers loads no file without its "format".
    kept = ckpt.meta.get(_safetensors_format.METADATA_KEY)
    return Source(loc.url, "safetensors", _deferred_tree(ckpt), step, {},
                  {_safetensors_format.METADATA_KEY: kept} if kept else None)


def _deferred_tree(ckpt: _reader.Checkpoint) -> Any:
    """The opened checkpoint's tree, each leaf read only as it is written."""
    def deferred(record: dict[str, Any]) -> _tree.Deferred:
        leaf = ckpt.leaves[record["name"]]
        return _tree.Deferred(leaf.shape, leaf.dtype, lambda box: ckpt.read(leaf, box), leaf.kind, leaf.prng_impl)

    return _tree.rebuild(ckpt.spec, deferred)
