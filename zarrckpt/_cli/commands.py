"""The commands of `zarrckpt` (see zarrckpt/_cli/__init__.py): each runs the library's
call of its name on the parsed command line and prints the result; `run` runs the one
named, and turns the library's errors into one line on stderr and an exit status."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .. import _commit, _copy, _import, _metadata, _seqax, _storage, _verify
from .._foreign import export as _export, orbax as _orbax
from .._format import naming as _naming
from .._metadata import metadata
from .._run import lease as _lease, retention as _retention, steps as _steps
from .._tier import tier as _tiers
from .._tier.from_copies import peers_of
from .._util import concurrency as _concurrency, progress as _progress
from ..errors import CheckpointError, CheckpointNotFoundError, DirectoryInUseError
from . import EXIT_DAMAGED, EXIT_ERROR

_SHOWN_PROBLEMS = 100  # verify lists at most this many; --json lists all
_SHOWN_STEPS = 10  # a missing checkpoint's message names at most this many of the run's steps
_SHOWN_RUNS = 20  # `ls` of a directory of runs lists at most this many
# What `info` says of each format version (docs/pytree-zarr-checkpoint.md): a save writes
# the lowest version that holds its leaves, so that an older zarrckpt reads what it can.
_FORMAT_VERSIONS = {1: "chunks without CRC-32C", 2: "arrays only: no str, bytes or per-process leaves",
                    3: "with str, bytes or per-process leaves"}

def run(args: argparse.Namespace) -> int:
    """Runs the command `args` parsed (`args.command`); returns the exit status."""
    if "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")
    if args.debug:
        # zarrckpt's own log only: other libraries' debug logs (botocore's) quote request
        # headers, credentials among them.
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
        logging.getLogger("zarrckpt").setLevel(logging.DEBUG)
    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:
        # The reader of stdout went away (`zarrckpt ls DIR | head`): not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except (CheckpointError, OSError, ValueError, ImportError) as e:
        if args.debug:
            raise
        print(f"zarrckpt: error: {_describe(e)}{_elsewhere(args, e)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


# The library's messages name its keyword arguments; the command line's flags instead.
_FLAGS = (("overwrite=True", "--overwrite"), ("allow_uncommitted=True", "--allow-uncommitted"),
          ("format='npz' or format='safetensors'", "--format npz or --format safetensors"),
          ("max_inflight_bytes", "--max-inflight-bytes"), ("src_storage_options", "--src-storage-option"),
          ("dst_storage_options", "--dst-storage-option"), ("storage_options", "--storage-option"),
          ("max_shard_bytes", "--max-shard-bytes"))


def _describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    notes = getattr(e, "__notes__", None)
    text = f"{text} ({'; '.join(notes)})" if notes else text
    for keyword, flag in _FLAGS:  # whole words: storage_options is not src_storage_options
        text = re.sub(rf"(?<![\w-]){re.escape(keyword)}(?!\w)", flag, text)
    return text


def _elsewhere(args: argparse.Namespace, e: BaseException) -> str:
    """What to add to the error `e` of a command that found no checkpoint where its
    argument named one: the committed steps of the run it would be a step of, and, for
    `cp`, that a live job's retention deletes them. "" where there is nothing to add,
    or asking fails (the error itself is what matters)."""
    if args.checkpoint is None or not isinstance(e, (CheckpointNotFoundError, FileNotFoundError)):
        return ""
    try:
        url = getattr(args, args.checkpoint)
        loc = _storage.resolve(url, _options(args.storage_option) if args.checkpoint != "src" else
                               _side(url, args.storage_option, args.src_storage_option))
        run = loc.parent()
        committed = [] if run is None else _steps.scan(run)[1]
        if run is None or not committed or _commit.head(loc).state is _commit.State.COMMITTED:
            return ""
        shown = ", ".join(map(str, committed[-_SHOWN_STEPS:]))
        older = f"{len(committed) - _SHOWN_STEPS} older and " if len(committed) > _SHOWN_STEPS else ""
        name = url.rstrip("/").rpartition("/")[2]
        meant = run.step(int(name)).url if name.isascii() and name.isdigit() and int(name) in committed else None
        text = (f" ({run.url} holds {_many(len(committed), 'committed step')}: {older}{shown}; "
                + (f"did you mean {meant}?)" if meant and meant != loc.url and meant not in str(e) else
                   f"the newest is {run.step(committed[-1]).url})"))
        if args.command == "cp" and not args.pin and _naming.step_of_url(loc.url) is not None:
            try:
                _lease.live_holder(run, "zarrckpt cp")
            except DirectoryInUseError:
                text += (f"; a live job holds {run.url}, and its retention deletes older steps: "
                         "--pin holds a step while it is copied")
        return text
    except Exception:
        return ""


def _options(*lists: list[tuple[str, Any]]) -> dict[str, Any] | None:
    merged = dict(pair for pairs in lists for pair in pairs)
    return merged or None


def _side(url: str, common: list[tuple[str, Any]], own: list[tuple[str, Any]]) -> dict[str, Any] | None:
    """One side's options in a command of two URLs: -o is meant for the remote one (a
    local side takes none), the side's own flag for that side alone."""
    return _options(common if _storage.takes_options(url) else [], own)


# -- commands ------------------------------------------------------------------


def _ls(args: argparse.Namespace) -> int:
    root = _storage.resolve(args.dir, _options(args.storage_option))
    if not root.exists():
        raise FileNotFoundError(f"{root.url} does not exist")
    steps: list[tuple[tuple[str, int] | None, _storage.Location, int]] = [
        (None, root, s) for s in _steps.candidate_steps(root)]
    tier = [] if steps else _tiers.copy_directories(root)  # a local tier: every process's copies
    steps += [((run, process), loc, step) for run, process, loc in tier for step in _steps.candidate_steps(loc)]
    rows = _concurrency.run_all(lambda found: _describe_step(found[1], found[2], found[0]), steps,
                                root.concurrency)
    itself = not rows and _commit.head(root).state is not _commit.State.ABSENT
    zarr_group = itself and _commit.someone_elses(_commit.read_group(root))
    if not rows and not itself and _orbax.is_orbax(root):
        _steps.check_directory_of_steps(root)  # Orbax's checkpoints: an error saying how to import them
    if args.json:
        _print_json(rows)
    elif not rows:
        runs = [] if itself else _runs_below(root)
        print(f"no step directories under {root.url}"
              + (" (it is a zarr group that zarrckpt did not write)" if zarr_group else
                 f" (it is a checkpoint itself: see `zarrckpt info {root.url}`)" if itself else
                 "; directories of steps below it (`zarrckpt ls` one of them):" if runs else ""))
        if runs:
            _print_table(["directory", "steps", "newest"], runs, right={1, 2})
    else:
        first = ["run", "process", "peers"] if tier else []  # whose copy (and peer copies), in a local tier
        table = [([r["run"][:8] or "-", r["process"], ",".join(map(str, r["peers_of"])) or "-"] if tier else [])
                 + [r["step"], r["state"], "pinned" if r["pinned"] else "", _size(r["nbytes"]),
                    _or_dash(r["leaves"]), _or_dash(r["created_at"])]
                 for r in rows]
        _print_table(first + ["step", "state", "pinned", "size", "leaves", "written"], table,
                     right={*(i for i, name in enumerate(first) if name == "process"),
                            *(i + len(first) for i in (0, 3, 4))})
    return 0


def _runs_below(root: _storage.Location) -> list[list[Any]]:
    """The directories of steps just below `root` (at most _SHOWN_RUNS, by name): `ls`
    of a directory of runs points at them. Each row: its URL, its step directories, the
    newest of them."""
    below = [root.child(entry.name.rstrip("/")) for entry in root.list_dir() if entry.type == "dir"]
    found = _concurrency.run_all(_steps.candidate_steps, below, root.concurrency)
    runs = sorted((loc.url, len(steps), steps[-1]) for loc, steps in zip(below, found) if steps)
    return [list(run) for run in runs[:_SHOWN_RUNS]]


def _describe_step(root: _storage.Location, step: int, owner: tuple[str, int] | None) -> dict[str, Any]:
    """One `ls` row from the step's group metadata alone: one read for zarrckpt's layout.
    `owner`: whose local copy it is (run, process), in a local tier's directory."""
    loc = root.step(step)
    group = _commit.read_group(loc)
    state = _commit.state(loc, group)
    summary = _metadata.summarize(loc, group)
    return {**({"run": owner[0], "process": owner[1], "peers_of": peers_of(group)} if owner is not None
               else {}),
            "step": step, "url": loc.url, "state": state.value, "committed": state is _commit.State.COMMITTED,
            "pinned": _retention.is_pinned(loc), "nbytes": summary.nbytes, "leaves": summary.leaves,
            "created_at": summary.created_at}


def _info(args: argparse.Namespace) -> int:
    described = metadata(args.url, storage_options=_options(args.storage_option))
    if args.json:
        _print_json({
            "url": described.url, "layout": described.layout, "committed": described.committed,
            "format_version": described.format_version, "created_at": described.created_at,
            "nbytes": described.nbytes,
            "leaves": [{"name": leaf.name, "key_path": leaf.key_path, "shape": list(leaf.shape),
                        "dtype": leaf.dtype.name, "chunks": list(leaf.chunks), "kind": leaf.kind,
                        "prng_impl": leaf.prng_impl, "nbytes": leaf.nbytes} for leaf in described.leaves],
        })
        return 0
    state = "committed" if described.committed else "NOT COMMITTED"
    version = described.format_version
    layout = (f"zarrckpt format {version}" + (f" ({_FORMAT_VERSIONS[version]})" if version in _FORMAT_VERSIONS else "")
              if described.layout == "zarrckpt" else f"{described.layout} layout")
    written = f", written {described.created_at}" if described.created_at else ""
    print(f"{described.url}: {state}, {layout}{written}, {_many(len(described.leaves), 'leaf')}, "
          f"{_size(described.nbytes)}")
    leaves = list(described.leaves)
    if args.select is not None:
        inside = _naming.subtree((leaf.name for leaf in leaves), args.select, described.url)
        leaves = [leaf for leaf in leaves if leaf.name in inside]
    if args.summary:  # as `du -d1`: one line per subtree below the one shown
        depth = 0 if args.select is None else args.select.count(".") + 1
        groups: dict[str, list[Any]] = {}
        for leaf in leaves:
            groups.setdefault(".".join(leaf.name.split(".")[:depth + 1]), []).append(leaf)
        _print_table(["subtree", "leaves", "size"],
                     [[name, str(len(group)), _size(sum(leaf.nbytes or 0 for leaf in group))]
                      for name, group in sorted(groups.items())], right={1, 2})
    else:
        _print_table(["leaf", "shape", "dtype", "chunks", "size"],
                     [[leaf.name, _shape(leaf.shape), _type_of(leaf), _shape(leaf.chunks), _size(leaf.nbytes)]
                      for leaf in leaves], right={4})
    if args.select is not None:
        print(f"{args.select}: {_many(len(leaves), 'leaf')}, {_size(sum(leaf.nbytes or 0 for leaf in leaves))}")
    return 0


def _verify_command(args: argparse.Namespace) -> int:
    report = _verify.verify(args.url, storage_options=_options(args.storage_option), checksums=not args.quick,
                            progress=args.progress)
    if args.json:
        _print_json({"url": report.url, "ok": report.ok, "layout": report.layout, "committed": report.committed,
                     "leaves": report.leaves, "chunks_checked": report.chunks_checked,
                     "checksums_checked": report.checksums_checked,
                     "problems": [{"key": p.key, "leaf": p.leaf, "message": p.message} for p in report.problems]})
    elif report.ok:
        print(f"OK: {report.url}: committed, {_many(report.leaves, 'leaf')}, metadata consistent, "
              f"{_chunks_checked(report, args.quick)}")
    else:
        for problem in report.problems[:_SHOWN_PROBLEMS]:
            print(f"  {problem}")
        if len(report.problems) > _SHOWN_PROBLEMS:
            print(f"  ... and {len(report.problems) - _SHOWN_PROBLEMS} more (--json lists all)")
        print(f"DAMAGED: {report.url}: {_many(len(report.problems), 'problem')}")
    return 0 if report.ok else EXIT_DAMAGED


def _chunks_checked(report: _verify.VerifyReport, quick: bool) -> str:
    if report.layout == _seqax.LAYOUT:
        return "chunks not checked in seqax's layout"
    one = report.chunks_checked == 1
    present = f"{_many(report.chunks_checked, 'chunk')} present with {'its exact size' if one else 'their exact sizes'}"
    unsummed = report.chunks_checked - report.checksums_checked
    if quick:
        return f"{present}; checksums not read (--quick)"
    if unsummed:
        return (f"{present}, {_matching(report.checksums_checked)} ({_many(unsummed, 'chunk')} "
                f"{'has' if unsummed == 1 else 'have'} no checksum: "
                "saved by zarrckpt before format version 2, or with checksums=False)")
    return f"{present}, {_matching(report.checksums_checked)}"


def _matching(checksums: int) -> str:
    return f"{_many(checksums, 'checksum')} match{'es' if checksums == 1 else ''}"


def _gc(args: argparse.Namespace) -> int:
    if args.keep_last is None and args.keep_every is None and args.keep_best is None:
        raise ValueError("say what to keep: --keep-last N, --keep-every K or --keep-best N (with --best-metric)")
    if (args.keep_best is None) != (args.best_metric is None):
        raise ValueError("--keep-best N and --best-metric NAME go together: keep the N best steps by the metric "
                         "NAME they were saved with")
    # --keep-every alone keeps those steps and the newest, which is always kept.
    keep_last = 1 if args.keep_last is None and args.keep_best is None else args.keep_last
    policy = _retention.Policy(keep_last=keep_last, keep_every=args.keep_every, keep_best=args.keep_best,
                               best_metric=args.best_metric, best_mode=args.best_mode)
    root = _storage.resolve(args.dir, _options(args.storage_option))
    committed = set(_steps.scan(root)[1])
    if not committed:
        _steps.check_directory_of_steps(root)  # a step itself, Orbax's checkpoints, a missing bucket: say so
        if root.has_directories and not root.exists():  # a mistyped DIR is no success with nothing to delete
            raise FileNotFoundError(f"{root.url} does not exist")
    metrics = _retention.load_metrics(root, committed) if args.keep_best is not None else {}
    # A job holding the run may be saving an older step than its newest (`force`): what
    # reads as a crash's leftover is left to that job's own retention (a lease left
    # unreleased is watched, as a claimant would).
    def leftovers_free() -> bool:
        try:
            _lease.live_holder(root, "zarrckpt gc")
        except DirectoryInUseError as e:
            print(f"zarrckpt: uncommitted steps under {root.url} are left alone, as a save may be writing them: {e}",
                  file=sys.stderr)
            return False
        return True

    deleted = _retention.apply(root, policy, metrics, dry_run=args.dry_run, leftovers_free=leftovers_free)
    kept = sorted(committed - set(deleted))
    if args.json:
        _print_json({"dry_run": args.dry_run, "deleted": deleted, "kept": kept})
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    for step in deleted:
        print(f"{verb} step {step}" + ("" if step in committed else " (uncommitted leftover)"))
    if not deleted:
        print("nothing to delete")
    print(f"committed steps kept: {', '.join(map(str, kept)) or 'none'}")
    return 0


def _cp(args: argparse.Namespace) -> int:
    src_options = _side(args.src, args.storage_option, args.src_storage_option)
    dst_options = _side(args.dst, args.storage_option, args.dst_storage_option)
    dst = args.dst
    into = _storage.resolve(dst, dst_options, option="dst_storage_options")
    if _commit.head(into).state is _commit.State.ABSENT and (dst.endswith("/") or into.exists()):
        # A directory that holds no checkpoint (an object store's exists only once something is
        # in it: the slash says it): as `cp -r`, the copy goes inside it.
        dst = f"{dst.rstrip('/')}/{args.src.rstrip('/').rpartition('/')[2]}"
    pinned = _pin(_storage.resolve(args.src, src_options, option="src_storage_options")) if args.pin else None
    try:
        result = _copy.copy_checkpoint(
            args.src, dst, src_storage_options=src_options, dst_storage_options=dst_options, overwrite=args.overwrite,
            allow_uncommitted=args.allow_uncommitted, max_workers=args.workers, progress=args.progress)
    finally:
        if pinned is not None:
            _retention.unpin(pinned)
    print(f"copied {_many(result.objects, 'object')} ({_size(result.nbytes)}) from {result.source} to "
          f"{result.url} in {result.seconds:.1f}s")
    return 0


def _pin(step: _storage.Location) -> _storage.Location | None:
    """Pins `step`, a committed step of a run, for `cp --pin`; returns it if this pinned
    it (None where it was pinned already, or is not committed: the copy says so)."""
    if _naming.step_of_url(step.url) is None:
        raise ValueError(f"--pin holds a step of a run while it is copied: {step.url} is not a step directory "
                         "(DIR/<step, 10 digits>)")
    if _commit.head(step).state is not _commit.State.COMMITTED or _retention.is_pinned(step):
        return None
    if not _retention.pin(step):
        raise ValueError(f"{step.url} cannot be pinned: a leaf of it is named {_retention.PIN_FILE!r}")
    return step


def _export_command(args: argparse.Namespace) -> int:
    result = _export.export_checkpoint(args.url, args.out, select=args.select, format=args.format,
                                       overwrite=args.overwrite, max_shard_bytes=args.max_shard_bytes,
                                       storage_options=_options(args.storage_option), progress=args.progress)
    print(f"exported {_many(result.leaves, 'leaf')} ({_size(result.nbytes)}) to {result.url}")
    for name, (stored, exported) in sorted(result.widened.items()):
        print(f"  {name}: {stored} widened to {exported} ({result.format} has no {stored})")
    for name, why in sorted(result.skipped.items()):
        print(f"  {name}: left out ({why})")
    for name, impl in sorted(result.key_data.items()):
        print(f"  {name}: a typed PRNG key ({impl}), written as its raw key data (jax.random.wrap_key_data makes "
              "a key of it again)")
    return 0


def _import_command(args: argparse.Namespace) -> int:
    result = _import.import_checkpoint(
        args.src, args.dst, step=args.step, prefix=args.prefix, overwrite=args.overwrite,
        dst_storage_options=_side(args.dst, args.storage_option, args.dst_storage_option),
        src_storage_options=_side(args.src, args.storage_option, args.src_storage_option),
        max_inflight_bytes=args.max_inflight_bytes, progress=args.progress)
    pinned = " (pinned: retention and gc leave it; mgr.unpin(step), or deleting its PINNED file, lets them)"
    print(f"imported {_many(result.leaves, 'leaf')} ({_size(result.nbytes)}) from {result.format} "
          f"{'step ' + str(result.step) + ' ' if result.step is not None else ''}to {result.url}"
          f"{pinned if result.pinned else ''}")
    for name, why in sorted(result.skipped.items()):
        print(f"  {name}: left out ({why})")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "ls": _ls, "info": _info, "verify": _verify_command, "gc": _gc, "cp": _cp, "export": _export_command,
    "import": _import_command}


# -- output ----------------------------------------------------------------------


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2))


def _print_table(headers: list[str], rows: list[list[Any]], right: set[int]) -> None:
    """Columns padded to their widest cell; numbers (columns in `right`) right-aligned."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        print("  ".join(c.rjust(w) if i in right else c.ljust(w)
                        for i, (c, w) in enumerate(zip(row, widths))).rstrip())


def _many(count: int, noun: str) -> str:
    """`count` and `noun`, plural unless one: 1 leaf, 2 leaves, 0 chunks."""
    return f"{count} {noun if count == 1 else _PLURALS.get(noun, noun + 's')}"


_PLURALS = {"leaf": "leaves"}


def _size(nbytes: int | None) -> str:
    return "-" if nbytes is None else _progress.size(nbytes)


def _type_of(leaf: Any) -> str:
    """A leaf's dtype, or what it is when not an array: str, bytes, per-process."""
    if leaf.kind == "prng_key":
        return f"key<{leaf.prng_impl}> data ({leaf.dtype.name})"
    return {"str": "str (utf-8)", "bytes": "bytes", "per_process": "per-process"}.get(leaf.kind, leaf.dtype.name)


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)
