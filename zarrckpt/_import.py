"""Importing another library's checkpoint as a committed zarrckpt checkpoint:
`import_checkpoint`, `zarrckpt import`.

The source opens as a tree whose arrays are `_tree.Deferred` leaves (`_restore.foreign`:
a safetensors file or set, or an Orbax step), and the save path writes it as it writes
any tree: each chunk is read from the source by the writer that writes it, holding its
bytes of the save's budget until it is written, so an import holds the chunks
`max_inflight_bytes` admits (and its readers' and writers' working copies of them),
never the whole state. Each source chunk is read once: a large one whole, shared by the
parts it is written as (`_save.plan.SourceChunk`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import jax

from . import _deprecated, _options, _storage
from ._foreign.sources import open_source
from ._format import naming as _naming, tree as _tree
from ._options import SaveOptions
from ._run import lease as _lease, retention as _retention
from ._save import protocol as _save
from ._util import multihost as _multihost, progress as _progress
from .errors import CheckpointCorruptError, CheckpointWriteError, SourceReadError

log = logging.getLogger("zarrckpt")


@dataclasses.dataclass(frozen=True)
class ImportResult:
    """What `import_checkpoint` wrote: the checkpoint's URL, its step (None where it is
    no step of a directory), its leaves and bytes, the source's format ("safetensors" or
    "orbax"), what was left out of the source, with why, and whether the step is pinned."""

    url: str
    step: int | None
    format: str
    leaves: int
    nbytes: int
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    pinned: bool = False


def import_checkpoint(src: str, dst: str, *, step: int | None = None, prefix: str | None = None,
                      overwrite: bool = False, src_storage_options: dict[str, Any] | None = None,
                      dst_storage_options: dict[str, Any] | None = None,
                      storage_options: dict[str, Any] | None = None,
                      max_inflight_bytes: int = _options.DEFAULT_MAX_INFLIGHT_BYTES,
                      progress: bool | None = None) -> ImportResult:
    """Writes another library's checkpoint at `src` as a committed zarrckpt checkpoint under `dst`.

    Not collective: call it in a job of one process (as `zarrckpt import` runs). The
    source is checked before anything is written, then read a chunk at a time: memory
    holds what `max_inflight_bytes` admits and working copies of it, never the whole
    source. Leaves keep their dtypes (bfloat16 and float8 exactly) and kinds (typed
    PRNG keys, str, empty nodes); an Orbax scalar of dtype int64, float64, bool or
    complex128 comes back as a Python scalar. `verify` vouches for the copy written,
    not for the source.

    Args:
      src: a `.safetensors` file; a directory holding a sharded set and its
        `model.safetensors.index.json` (tensor names nest on '.'); or an Orbax run
        directory, one step of it, or one item. An Orbax step's `default` item is its
        tree; named items (`ocp.args.Composite`) become a dict by name: a pytree
        item as its tree, a `JsonSave` item as a str leaf (its JSON text), a grain
        iterator's position written by one process as `PerProcess(<its JSON value>)`.
        The step's metrics (what `best_fn` ranks) are kept as a manager keeps a
        step's metrics, so that `keep_best` ranks the step. What is left out (other
        items, the grain positions of several processes, metrics that are no
        numbers) is listed in `ImportResult.skipped`.
      dst: where it lands: an Orbax run's step as `dst/<step, zero-padded>` (so
        `CheckpointManager(dst)` and `load_checkpoint_if_it_exists(dst, ...)` resume
        from it); any other source at `dst` itself, or as `dst/<step>` given `step`.
      step: the Orbax run's step to import (default: its newest finished step); for
        any other source, the step number it lands as.
      prefix: a dotted key path ("params") the tree lands under.
      overwrite: replace a committed checkpoint where it lands.
      src_storage_options: fsspec options of a safetensors source. A remote Orbax
        source is read by TensorStore with the credentials of its environment.
      dst_storage_options: fsspec options of `dst`. `storage_options` is a deprecated
        alias (DeprecationWarning).
      max_inflight_bytes: bound on source bytes read and not yet written.
      progress: show a progress bar (default: when stderr is a terminal).

    Returns:
      An `ImportResult`. Safetensors weights landing as a step are pinned (a `PINNED`
      file written after the commit: retention and `zarrckpt gc` keep the step),
      except on a local disk where a top-level tensor is named `PINNED` (a warning,
      `pinned` False). An Orbax run's step is not pinned.

    Raises:
      CheckpointNotFoundError: nothing at `src` is a safetensors file or set or an Orbax
        checkpoint, or an Orbax run has no finished step `step`.
      CheckpointCorruptError: the source's metadata is not what its format writes (an
        Orbax JSON file that is not JSON, larger than 64 MiB, or grain files that are
        not one per process of one job: named), an
        array is missing or damaged or claims chunks the source does not hold, a
        safetensors header does not tile its file, or the source holds a symbolic
        link or a special file. Nothing was committed; an uncommitted group may be
        left where it was to land, cleared by the next save or import there.
      SourceReadError: the source could not be read (denied, unavailable, no answer in
        time); nothing was committed.
      UnsupportedLeafError: an Orbax leaf of a kind zarrckpt does not know.
      CheckpointExistsError: a committed checkpoint is where it lands and `overwrite`
        is False.
      DirectoryInUseError: a live job's manager holds the directory it lands in.
      CheckpointWriteError: a write failed, or the arrays would not fit a local
        destination's free space (then before anything is written); nothing was committed.
      ModuleNotFoundError: an Orbax source without TensorStore installed
        (`pip install 'zarrckpt[orbax]'`).
      TypeError, ValueError: an option of the wrong type or value (named); both
        `dst_storage_options` and `storage_options`; `src_storage_options` for a
        remote Orbax source; a source chunk larger than `max_inflight_bytes`; a job
        of several processes.
    """
    if step is not None:
        _naming.step_dir_name(step)  # a bad step is an error before anything is read
    if prefix is not None and (not isinstance(prefix, str) or not all(prefix.split("."))):
        raise ValueError(f"prefix must be a dotted key path such as 'params' or 'model.params', got {prefix!r:.100}")
    if _multihost.process_count() > 1:
        raise ValueError("import_checkpoint runs in a job of one process (it reads the whole source itself); "
                         "run `zarrckpt import` before the job starts")
    dst_storage_options, dst_option = _deprecated.argument("import_checkpoint", "dst_storage_options",
                                                           dst_storage_options, "storage_options", storage_options)
    options = SaveOptions(overwrite=overwrite, max_inflight_bytes=max_inflight_bytes, progress=progress)
    source = open_source(src, src_storage_options, option="src_storage_options", step=step)
    tree, step = source.tree, source.step
    for key in reversed(prefix.split(".") if prefix else []):
        tree = {key: tree}
    loc = _storage.resolve(dst, dst_storage_options, option=dst_option)
    if step is not None:
        loc = loc.step(step)
    _check_claims(tree, source.url, loc, options.max_inflight_bytes)
    _lease.refuse_if_held(loc, "zarrckpt import")
    try:
        job = _save.save(loc, tree, options, extra_metadata=source.metadata)
    except (CheckpointCorruptError, SourceReadError) as e:  # the source's failure, as a writer met it
        raise type(e)(f"{e}; nothing was committed at {loc.url}") from e
    pinned = False
    if step is not None and source.format == "safetensors":  # a fine-tune's base weights, not a run's step
        pinned = _retention.pin(loc)
        if not pinned:
            log.warning("%s is imported but not pinned: a tensor is named %r, the pin file's name; retention may "
                        "delete it (import it with a prefix to pin it)", loc.url, _retention.PIN_FILE)
    return ImportResult(loc.url, step, source.format, len(job.plans), job.nbytes, source.skipped, pinned)


def _check_claims(tree: Any, src: str, loc: _storage.Location, budget: int) -> None:
    """Refuses, before anything is written, a source whose arrays cannot be written
    within the byte budget (a source chunk is read whole: one over the budget would be
    held beside it, or abort the process when it cannot be allocated) or whose bytes
    do not fit the local disk they land on."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    deferred = [(_tree.name_of(path), leaf) for path, leaf in leaves if isinstance(leaf, _tree.Deferred)]
    size = _progress.size
    for name, leaf in deferred:
        chunk = math.prod(leaf.chunks or ()) * leaf.dtype.itemsize
        if leaf.chunks is not None and chunk > budget:
            raise ValueError(f"array {name} of {src} is stored in chunks of {size(chunk)} {leaf.chunks}, each read "
                             f"whole, more than max_inflight_bytes ({size(budget)}): give max_inflight_bytes of at "
                             f"least {chunk} to import it")
    if loc.can_fill:
        needed = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for _, leaf in deferred)
        if needed > (free := loc.free_bytes()):
            raise CheckpointWriteError(f"{src} holds {size(needed)} of arrays, more than the {size(free)} free where "
                                       f"it would land ({loc.url}); nothing was written")

