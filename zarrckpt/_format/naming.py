"""Names in the on-disk format: leaf array names, step directory names, attribute keys.

The rules here are the format (docs/pytree-zarr-checkpoint.md); changing one changes
FORMAT_VERSION.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import re
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import CheckpointCorruptError

FORMAT_VERSION = 3  # the newest version this zarrckpt reads and writes (see `format_version`)
# 3: str, bytes and per-process leaves; 2: chunks carry a CRC-32C (version 1, without, still loads).
_VERSION_3_KINDS = frozenset({"str", "bytes", "per_process"})
COMMIT_ATTR = "write_completed"  # seqax's commit marker; its presence as `true` is the commit
META_ATTR = "zarrckpt"  # group attribute holding format_version and the tree record

ROOT_LEAF_NAME = "%root"  # the name of the only leaf of a tree that is a single array
EMPTY_COMPONENT = "%"  # an empty-string key; "%" alone is never produced by escaping
MAX_NAME_LENGTH = 200  # file systems refuse path components over 255 bytes
_HASHED_PREFIX_LENGTH = 160
_UNESCAPED = re.compile(r"[A-Za-z0-9_\-]")
_ALL_UNESCAPED = re.compile(r"[A-Za-z0-9_\-]+")
_STEP_DIR = re.compile(r"[0-9]{10,}")
# Every array name `leaf_name` can produce: escaped components joined by ".", or a
# hashed long name (a prefix of one, "~", 32 hex digits). Never "/", never a leading
# ".", so never "." or "..": a name always stays inside its checkpoint.
# A per-process leaf's arrays add ".%p<process>" (no escape makes "%p").
_ARRAY_NAME = re.compile(r"([A-Za-z0-9_%-]+(\.[A-Za-z0-9_%-]+)*"
                         rf"|[A-Za-z0-9_%-][A-Za-z0-9_%.-]{{0,{_HASHED_PREFIX_LENGTH - 1}}}~[0-9a-f]{{32}})"
                         r"(\.%p\d{1,9})?")


@functools.lru_cache(maxsize=65536)  # a save names every leaf: the same keys, save after save
def escape_component(text: str) -> str:
    """Percent-encodes every character outside [A-Za-z0-9_-], byte by byte in UTF-8.

    "." (the separator), "/", "%" and ".." therefore can never appear raw in a name,
    which is what makes names unambiguous and keeps them inside the group.
    """
    if text == "":
        return EMPTY_COMPONENT
    if _ALL_UNESCAPED.fullmatch(text):  # most names: one match, not one per character
        return text
    return "".join(
        c if _UNESCAPED.fullmatch(c) else "".join(f"%{b:02X}" for b in c.encode("utf-8"))
        for c in text
    )


def leaf_name(components: Sequence[str]) -> str:
    """Joins escaped key components with "." into an array name.

    Names longer than MAX_NAME_LENGTH keep a readable prefix and end in "~" plus a
    hash of the full name; "~" is escaped everywhere else, so these cannot collide
    with an ordinary name.
    """
    name = ".".join(components) if components else ROOT_LEAF_NAME
    if len(name) > MAX_NAME_LENGTH:
        digest = hashlib.sha256(name.encode("ascii")).hexdigest()[:32]
        name = f"{name[:_HASHED_PREFIX_LENGTH]}~{digest}"
    return name


def object_key(array: str, key: str = "") -> str:
    """The key, relative to the checkpoint, of object `key` of the array named `array`
    (`zarr.json`, a chunk `c.0.1`, or "" for the array's directory). The one place a
    leaf's array name becomes a key, on write and on read alike.

    Raises CheckpointCorruptError for a name that `leaf_name` cannot produce: names
    read from a checkpoint are never trusted to stay inside it.
    """
    if not isinstance(array, str) or len(array) > MAX_NAME_LENGTH + 12 or not _ARRAY_NAME.fullmatch(array):
        raise CheckpointCorruptError(f"array name {array!r} is not one zarrckpt writes: refusing to read it")
    return f"{array}/{key}" if key else array


def subtree(names: Iterable[str], select: str, where: str) -> dict[str, str]:
    """The array names inside the subtree `select` (named as `zarrckpt info` lists
    arrays: `params`, `params.encoder`), each with its name inside it (its last part,
    where `select` names an array itself). ValueError naming `where`'s top-level names
    if there is none."""
    names = list(names)
    inside = {name: name[len(select) + 1:] for name in names if name.startswith(select + ".")}
    if select in names:
        inside[select] = select.rsplit(".", 1)[-1]
    if not inside:
        tops = sorted({name.split(".", 1)[0] for name in names})
        raise ValueError(f"select {select!r} names no subtree of {where}; its top-level names are "
                         f"{', '.join(tops[:10])}{' ...' if len(tops) > 10 else ''}")
    return inside


def per_process_name(name: str, process: int) -> str:
    """The array holding process `process`'s value of the per-process leaf `name`."""
    return f"{name}{_PER_PROCESS}{process}"


_PER_PROCESS = ".%p"


def per_process_of(array: str) -> tuple[str, int] | None:
    """The per-process leaf and process whose value the array named `array` holds (see
    `per_process_name`), or None if it is no such array's name."""
    name, sep, number = array.rpartition(_PER_PROCESS)
    if not sep or not (number.isascii() and number.isdigit()) or number != str(int(number)):
        return None
    return name, int(number)


def processes_listed(name: str, processes: int, listed: Iterable[str]) -> set[int]:
    """The processes, of the `processes` that saved the per-process leaf `name`, whose
    value's array is among the names `listed` (work follows the listing, not the
    process count a checkpoint claims)."""
    found = (per_process_of(entry) for entry in listed)
    return {p for leaf, p in filter(None, found) if leaf == name and p < processes}



def format_version(leaf_kinds: set[str]) -> int:
    """The version a checkpoint with leaves of these kinds is written as: 3 only when it
    holds leaves a reader of version 2 would misread, so that older zarrckpt still
    reads every checkpoint it can."""
    return FORMAT_VERSION if leaf_kinds & _VERSION_3_KINDS else 2


def step_number(step: Any, what: str = "step") -> int:
    """`step` as an int: a Python or numpy integer, or a 0-d integer jax array (flax's
    `TrainState.step`), as `operator.index` takes them. TypeError for anything else (a
    bool, a float, a string), ValueError for a negative number; both name `what`."""
    try:
        if isinstance(step, bool):  # an int to Python, never a step
            raise TypeError
        number = operator.index(step)
    except TypeError:
        raise TypeError(f"{what} must be a non-negative int (a Python or numpy integer, or a 0-d integer jax "
                        f"array), got {type(step).__name__} {step!r:.100}") from None
    if number < 0:
        raise ValueError(f"{what} must be a non-negative int, got {number}")
    return number


def step_dir_name(step: int) -> str:
    """The directory name of a step: zero-padded to 10 digits, as seqax names them."""
    return str(step_number(step)).zfill(10)


def parse_step_dir_name(name: str) -> int | None:
    """The step a directory name stands for, or None if it is not exactly the name
    `step_dir_name` gives a step (ASCII digits, 10 or more, no extra leading zero)."""
    name = name.rstrip("/")
    if not _STEP_DIR.fullmatch(name):
        return None
    step = int(name)
    return step if step_dir_name(step) == name else None


def step_of_url(url: str) -> int | None:
    """The step the last component of `url` names (a step of a run), or None."""
    return parse_step_dir_name(url.rstrip("/").rpartition("/")[2])
