"""The `zarrckpt` command: look into, check, prune, copy, export and import checkpoints.

    zarrckpt ls DIR                  steps under a checkpoint directory
    zarrckpt info URL                one checkpoint's leaves: shapes, dtypes, chunks, sizes
    zarrckpt verify URL              is it whole? (exit 0 only when it is)
    zarrckpt gc DIR --keep-last N    retention by hand (--keep-every, --keep-best)
    zarrckpt cp SRC DST              copy one checkpoint anywhere, commit marker last
    zarrckpt export URL OUT          to .npz or .safetensors
    zarrckpt import SRC DST          from safetensors or Orbax, as a committed checkpoint

This module parses the command line, importing neither JAX nor the library, so that
`--version`, `--help` and a mistyped flag answer at once; `commands` runs the command.
Each command is the library's call of the same name (`_metadata`, `_verify`, `_copy`,
`_export`, `_import`, `_retention`) with its flags parsed and its result printed; what
`commands` reads itself is only what `ls` and `info` show (step states, the local
tier's owners, naming). It never touches an accelerator: JAX is held to the CPU unless
JAX_PLATFORMS says otherwise, so the command works on a host whose devices a training
job holds.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from .. import __version__
from .._foreign import EXPORT_FORMATS
from .._format import zarrjson as _zarrjson
from .._util import concurrency as _concurrency

EXIT_ERROR = 1  # the command could not do its job (message on stderr)
EXIT_USAGE = 2  # the command line is wrong (argparse's status)
EXIT_DAMAGED = 3  # verify: the checkpoint was read and is not whole

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
    from . import commands  # JAX and the library: only for a command line that parses

    return commands.run(args)


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
    commands = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")
    parser.commands = commands.choices

    def command(name: str, help: str, *parents: _Parser, checkpoint: str | None = None) -> _Parser:
        """A subcommand, run by `commands.COMMANDS[name]`; `checkpoint`: the argument naming
        the checkpoint (or directory of steps) it reads, whose run's steps an error that
        finds none there lists."""
        sub = commands.add_parser(name, help=help, description=help, parents=[common, *parents],
                                  epilog="storage options, environment variables and exit statuses: zarrckpt --help")
        sub.set_defaults(checkpoint=checkpoint)
        return sub

    sub = command("ls", "list the step directories under a checkpoint directory (or, in a local tier's "
                  "directory, under each process's), newest last; a step's state is committed (whole: it restores), "
                  "uncommitted (a save in flight or cut short: never restored) or absent (a directory without group "
                  "metadata: a save that has not reached its commit on S3 or GCS, or one cut short)", as_json,
                  checkpoint="dir")
    sub.add_argument("dir", metavar="DIR", help="checkpoint directory: one subdirectory per step")
    sub = command("info", "show one checkpoint's leaves: shape, dtype, chunk shape, size (the totals "
                  "first)", as_json, checkpoint="url")
    sub.add_argument("url", metavar="URL", help="one checkpoint, e.g. DIR/0000001000")
    sub.add_argument("--select", metavar="SUBTREE", help="only this subtree's leaves (params, params.encoder)")
    sub.add_argument("--summary", action="store_true", help="one line per subtree with its leaves and size, as "
                     "du -d1 (below --select's subtree, if given)")
    sub = command("verify", "check that a checkpoint is committed and whole: metadata, "
                  "every chunk present with its exact size, every checksum matching; exit 0 only if so",
                  as_json, progress, checkpoint="url")
    sub.add_argument("url", metavar="URL", help="one checkpoint, e.g. DIR/0000001000")
    sub.add_argument("--quick", action="store_true",
                     help="skip the checksums: read metadata and listings only (two requests per array), no "
                     "chunk data; much faster for large leaves, little for many small ones")
    sub = command("gc", "delete old steps by the manager's retention rules (the newest committed "
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
    sub = command("cp", "copy one checkpoint to another URL; the commit marker is written last",
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
    sub = command("export", "write every leaf to one .npz or .safetensors file (or set), arrays "
                  "named as `info` lists them", progress,
                  checkpoint="url")
    sub.add_argument("url", metavar="URL", help="one checkpoint, e.g. DIR/0000001000")
    sub.add_argument("out", metavar="OUT", help="local file, *.npz or *.safetensors")
    sub.add_argument("--format", choices=EXPORT_FORMATS, help="default: from OUT's extension")
    sub.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    sub.add_argument("--select", metavar="SUBTREE", help="only this subtree, named as `info` lists it (params, "
                     "params.encoder); arrays are named inside it")
    sub.add_argument("--max-shard-bytes", metavar="SIZE", type=_bytes,
                     help="a .safetensors export larger than SIZE is a set as transformers writes one: "
                     "OUT's name -00001-of-0000K.safetensors files and OUT.index.json. " + _SIZES)
    sub = command("import", "write a Hugging Face .safetensors file or set, or an Orbax "
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
