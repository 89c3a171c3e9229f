"""The `zarrckpt` command: look into, check, prune, copy, export and import checkpoints.

    zarrckpt ls DIR                  steps under a checkpoint directory
    zarrckpt info URL                one checkpoint's leaves: shapes, dtypes, chunks, sizes
    zarrckpt verify URL              is it whole? (exit 0 only when it is)
    zarrckpt gc DIR --keep-last N    retention by hand (--keep-every, --keep-best)
    zarrckpt cp SRC DST              copy one checkpoint anywhere, commit marker last
    zarrckpt export URL OUT          to .npz or .safetensors
    zarrckpt import SRC DST          from safetensors or Orbax, as a committed checkpoint

Each command is the library's call of the same name (`_metadata`, `_verify`, `_copy`,
`_export`, `_import`, `_retention`) with its flags parsed and its result printed; what
this module reads itself is only what `ls` and `info` show (step states, the local
tier's owners, naming). It never touches an accelerator: JAX is held to the CPU unless
JAX_PLATFORMS says otherwise, so the command works on a host whose devices a training
job holds.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from . import __version__, _commit, _copy, _import, _metadata, _seqax, _storage, _verify
from ._foreign import export as _export, orbax as _orbax
from ._format import naming as _naming, zarrjson as _zarrjson
from ._metadata import metadata
from ._run import lease as _lease, retention as _retention, steps as _steps
from ._tier import tier as _tiers
from ._tier.from_copies import peers_of
from ._util import concurrency as _concurrency, progress as _progress
from .errors import CheckpointError, CheckpointNotFoundError, DirectoryInUseError

EXIT_ERROR = 1  # the command could not do its job (message on stderr)
EXIT_USAGE = 2  # the command line is wrong (argparse's status)
EXIT_DAMAGED = 3  # verify: the checkpoint was read and is not whole
_SHOWN_PROBLEMS = 100  # verify lists at most this many; --json lists all
_SHOWN_STEPS = 10  # a missing checkpoint's message names at most this many of the run's steps
_SHOWN_RUNS = 20  # `ls` of a directory of runs lists at most this many
# What `info` says of each format version (docs/pytree-zarr-checkpoint.md): a save writes
# the lowest version that holds its leaves, so that an older zarrckpt reads what it can.
_FORMAT_VERSIONS = {1: "chunks without CRC-32C", 2: "arrays only: no str, bytes or per-process leaves",
                    3: "with str, bytes or per-process leaves"}

_EPILOG = """\
storage options:
  -o/--storage-option KEY=VALUE applies to the command's URL (repeatable; VALUE is
  parsed as JSON when it parses, e.g. anon=true, else taken as a string); a local path
  takes none but request_timeout_s. cp and import apply -o to each side that is not a
  local path, and take --src-storage-option and --dst-storage-option for one side, on
  top of -o.
  The usual environment variables of the storage libraries work as well:
  AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE, AWS_ENDPOINT_URL (s3fs),
  GOOGLE_APPLICATION_CREDENTIALS (gcsfs), and fsspec's FSSPEC_<PROTOCOL>_<OPTION>,
  e.g. FSSPEC_S3_ENDPOINT_URL.

exit status: 0 success; 1 error (one line on stderr; --debug for the traceback);
  2 bad command line; 3 verify found damage.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line `argv` (default: sys.argv[1:]); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except _BadCommandLine as e:
        return _bad_command_line(parser, e, argv)
    if "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")
    if args.debug:
        # zarrckpt's own log only: other libraries' debug logs (botocore's) quote request
        # headers, credentials among them.
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
        logging.getLogger("zarrckpt").setLevel(logging.DEBUG)
    try:
        return args.run(args)
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
        if args.run is _cp and not args.pin and _naming.step_of_url(loc.url) is not None:
            try:
                _lease.live_holder(run, "zarrckpt cp")
            except DirectoryInUseError:
                text += (f"; a live job holds {run.url}, and its retention deletes older steps: "
                         "--pin holds a step while it is copied")
        return text
    except Exception:
        return ""


# -- the command line ----------------------------------------------------------


class _BadCommandLine(Exception):
    """argparse's complaint, and the (sub)parser that made it."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser, self.message = parser, message


class _Parser(argparse.ArgumentParser):
    """Complaints come back to `main` (`_bad_command_line`), which knows the command
    line and can say what a mistyped flag was meant to be."""

    commands: Mapping[str, _Parser]

    def error(self, message: str) -> Any:
        raise _BadCommandLine(self, message)


def _bad_command_line(parser: _Parser, e: _BadCommandLine, argv: list[str]) -> int:
    """The usage of the command the user ran (argparse gives the top level's for a flag
    it does not know), the complaint, and for each unknown flag the one it resembles
    (`--keep_last` for `--keep-last`, `--dryrun` for `--dry-run`)."""
    used = e.parser
    if used is parser:
        used = next((parser.commands[a] for a in argv if a in parser.commands), parser)
    known = [flag for action in used._actions for flag in action.option_strings]
    hints = []
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            close = difflib.get_close_matches(flag.replace("_", "-"), known, n=1, cutoff=0.75)
            hints.append(f"{flag} is not an option of {used.prog}" + (f": did you mean {close[0]}?" if close else ""))
    used.print_usage(sys.stderr)
    print(f"{used.prog}: error: {e.message}" + "".join(f"\n  {hint}" for hint in hints), file=sys.stderr)
    return EXIT_USAGE


def _parser() -> _Parser:
    common = _Parser(add_help=False)
    common.add_argument("-o", "--storage-option", metavar="KEY=VALUE", action="append", type=_option,
                        default=[], help="fsspec storage option for every URL (repeatable)")
    common.add_argument("--debug", action="store_true", help="show tracebacks and zarrckpt's log")
    as_json = _Parser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON for scripts")
    progress = _Parser(add_help=False)
    progress.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                          help="show a progress bar (default: when stderr is a terminal)")

    parser = _Parser(
        prog="zarrckpt", description="Inspect, check, prune, copy, export and import zarrckpt checkpoints "
        "on any fsspec URL (local path, s3://, gs://, ...).",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"zarrckpt {__version__}")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    parser.commands = commands.choices

    def command(name: str, run: Callable[[argparse.Namespace], int], help: str, *parents: _Parser,
                checkpoint: str | None = None) -> _Parser:
        """A subcommand; `checkpoint`: the argument naming the checkpoint (or directory of
        steps) it reads, whose run's steps an error that finds none there lists."""
        sub = commands.add_parser(name, help=help, description=help, parents=[common, *parents],
                                  epilog="storage options, environment variables and exit statuses: zarrckpt --help")
        sub.set_defaults(run=run, checkpoint=checkpoint)
        return sub

    sub = command("ls", _ls, "list the step directories under a checkpoint directory (or, in a local tier's "
                  "directory, under each process's), newest last; a step's state is committed (whole: it restores), "
                  "uncommitted (a save in flight or cut short: never restored) or absent (a directory without group "
                  "metadata: a save that has not reached its commit on S3 or GCS, or one cut short)", as_json,
                  checkpoint="dir")
    sub.add_argument("dir", metavar="DIR", help="checkpoint directory: one subdirectory per step")
    sub = command("info", _info, "show one checkpoint's leaves: shape, dtype, chunk shape, size (the totals "
                  "first)", as_json, checkpoint="url")
    sub.add_argument("url", metavar="URL", help="one checkpoint, e.g. DIR/0000001000")
    sub.add_argument("--select", metavar="SUBTREE", help="only this subtree's leaves (params, params.encoder)")
    sub.add_argument("--summary", action="store_true", help="one line per subtree with its leaves and size, as "
                     "du -d1 (below --select's subtree, if given)")
    sub = command("verify", _verify_command, "check that a checkpoint is committed and whole: metadata, "
                  "every chunk present with its exact size, every checksum matching; exit 0 only if so",
                  as_json, progress, checkpoint="url")
    sub.add_argument("url", metavar="URL", help="one checkpoint, e.g. DIR/0000001000")
    sub.add_argument("--quick", action="store_true",
                     help="skip the checksums: read metadata and listings only (two requests per array), no "
                     "chunk data; much faster for large leaves, little for many small ones")
    sub = command("gc", _gc, "delete old steps by the manager's retention rules (the newest committed "
                  "step and pinned steps are always kept)", as_json)
    sub.add_argument("dir", metavar="DIR", help="checkpoint directory: one subdirectory per step")
    sub.add_argument("--keep-last", metavar="N", type=_positive, help="keep the newest N committed steps")
    sub.add_argument("--keep-every", metavar="K", type=_positive,
                     help="keep every step divisible by K (alone: those and the newest)")
    sub.add_argument("--keep-best", metavar="N", type=_positive,
                     help="keep the N best steps by --best-metric, as the manager's keep_best does")
    sub.add_argument("--best-metric", metavar="NAME", help="the metric saved with each step to rank by")
    sub.add_argument("--best-mode", choices=("min", "max"), default="min",
                     help="whether the lowest (default) or the highest value is best")
    sub.add_argument("--dry-run", action="store_true", help="say what would be deleted; delete nothing")
    sub = command("cp", _cp, "copy one checkpoint to another URL; the commit marker is written last",
                  progress, checkpoint="src")
    sub.add_argument("src", metavar="SRC", help="one checkpoint, e.g. DIR/0000001000")
    sub.add_argument("dst", metavar="DST", help="where the copy goes: nothing there yet, or a checkpoint; an "
                     "existing directory that holds none gets the copy inside it, under SRC's name (as cp -r)")
    sub.add_argument("--src-storage-option", metavar="KEY=VALUE", action="append", type=_option, default=[],
                     help="storage option for SRC only (repeatable)")
    sub.add_argument("--dst-storage-option", metavar="KEY=VALUE", action="append", type=_option, default=[],
                     help="storage option for DST only (repeatable)")
    sub.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at DST")
    sub.add_argument("--allow-uncommitted", action="store_true",
                     help="copy an uncommitted SRC (the copy is uncommitted too)")
    sub.add_argument("--workers", metavar="N", type=_positive, help="objects copied at once")
    sub.add_argument("--pin", action="store_true",
                     help="pin SRC, a step of a run, while it is copied (its PINNED file, which retention and gc "
                     "honour), so that a live job's retention cannot delete it meanwhile; unpinned after, unless "
                     "it was pinned before")
    sub = command("export", _export_command, "write every leaf to one .npz or .safetensors file (or set), arrays "
                  "named as `info` lists them", progress,
                  checkpoint="url")
    sub.add_argument("url", metavar="URL", help="one checkpoint, e.g. DIR/0000001000")
    sub.add_argument("out", metavar="OUT", help="local file, *.npz or *.safetensors")
    sub.add_argument("--format", choices=_export.FORMATS, help="default: from OUT's extension")
    sub.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    sub.add_argument("--select", metavar="SUBTREE", help="only this subtree, named as `info` lists it (params, "
                     "params.encoder); arrays are named inside it")
    sub.add_argument("--max-shard-bytes", metavar="SIZE", type=_bytes,
                     help="a .safetensors export larger than SIZE is a set as transformers writes one: "
                     "OUT's name -00001-of-0000K.safetensors files and OUT.index.json. " + _SIZES)
    sub = command("import", _import_command, "write a Hugging Face .safetensors file or set, or an Orbax "
                  "checkpoint, as a committed zarrckpt checkpoint", progress)
    sub.add_argument("src", metavar="SRC", help="a .safetensors file, a directory holding a sharded set and its "
                     "index, or an Orbax run directory, step or item")
    sub.add_argument("dst", metavar="DST", help="a checkpoint directory: an Orbax run's step lands as "
                     "DST/<step, 10 digits>, where a CheckpointManager(DST) resumes from it; anything else at DST "
                     "itself, unless --step is given")
    sub.add_argument("--step", metavar="N", type=_step, help="of an Orbax run, the step to import (default: its "
                     "newest); of anything else, the step it lands as (DST/<N, 10 digits>)")
    sub.add_argument("--src-storage-option", metavar="KEY=VALUE", action="append", type=_option, default=[],
                     help="storage option for a safetensors SRC only (repeatable; TensorStore reads a remote Orbax "
                     "SRC with its environment's credentials)")
    sub.add_argument("--dst-storage-option", metavar="KEY=VALUE", action="append", type=_option, default=[],
                     help="storage option for DST only (repeatable)")
    sub.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint where it lands")
    sub.add_argument("--prefix", metavar="KEY", help="nest the imported tree under this dotted key path, where a "
                     "training state keeps its weights (params)")
    sub.add_argument("--max-inflight-bytes", metavar="SIZE", type=_bytes,
                     default=_concurrency.DEFAULT_MAX_INFLIGHT_BYTES,
                     help="source bytes held at once (default: 2GiB); a source chunk is read whole. " + _SIZES)
    return parser


def _step(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"expected a step number (0 or more), got {text!r}")
    return int(text)


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, _zarrjson.decode(value)
    except _zarrjson.TooDeep as e:
        raise argparse.ArgumentTypeError(f"the value of {key!r} is {e}") from None
    except ValueError:
        return key, value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


_SIZES = "SIZE: bytes, or with a unit: KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
_UNITS = {"": 1, "b": 1, **{prefix + "b": 1000 ** power for power, prefix in enumerate("kmgt", 1)},
          **{prefix + "ib": 1024 ** power for power, prefix in enumerate("kmgt", 1)}}


def _bytes(text: str) -> int:
    """A positive byte count: digits, or a number with a unit of _UNITS (100KB, 1.5GiB)."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", text)
    unit = found and _UNITS.get(found[2].lower())
    value = int(float(found[1]) * unit) if found and unit else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size (100000, 100KB, 2GiB), got {text!r}")
    return value


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
