"""The storage interface: the few operations zarrckpt asks of any store, on keys below
the store's root (`a/b/c`, '' for the root itself).

One class per kind of storage implements it (`local.LocalDisk`, `remote.Fsspec` and its kinds);
`guard.Guarded` wraps every request of either with what all of them need (deadline,
retries, the abort check, counting, errors as zarrckpt raises them). A backend raises
what its storage raises, as OSError subclasses (FileNotFoundError for what is absent),
`NotAFile` for a symbolic link it will not follow or a special file it will not read,
and `DeadlinePassed` for a request it abandoned.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import errno
from collections.abc import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class Entry:
    """One entry of a listing, on any store: its name relative to what was listed, its
    type ("file", "dir", "link": a symbolic link, never followed; "other") and size,
    and, where the store says, what tells this version of an object from any other
    made at its key (`version`: a local file's modification time and size; an object's
    ETag or generation)."""

    name: str
    type: str
    size: int = 0
    version: str | None = None


def size_of(version: str) -> int | None:
    """The size in bytes that `version` (an `Entry.version`; every store ends one with
    ":<size>") says its object has, or None where it says none."""
    size = version.rpartition(":")[2]
    return int(size) if size.isdigit() else None


class NotAFile(OSError):
    """A symbolic link, or what is neither a regular file nor a directory (a FIFO, a
    socket, a device), where zarrckpt expected a file or directory of a checkpoint (a
    backend's error; `guard` makes it a CheckpointCorruptError naming its URL)."""

    def __init__(self, path: str, what: str = "a symbolic link") -> None:
        why = "never followed inside a checkpoint" if what == "a symbolic link" else "not a regular file: never read"
        super().__init__(errno.ELOOP, f"{path} is {what} ({why})")
        self.what = what


# What is wrong with the bytes a read answered, or None (a chunk codec's `damage`):
# where a store may choose between answers (a hedged read, see `hedge`), a good one wins.
Check = Callable[[bytes], "str | None"]


class SourceChanged(FileNotFoundError):
    """The object a copy was to be made from is no longer the version it was asked to
    be made from (`Store.copy`'s `expect`): rewritten or deleted since. Nothing is
    made at the copy's key."""


class Larger(OSError):
    """An object holding more than the `most` bytes a read takes (`Store.read`): not
    read whole (`guard` makes it a TooLarge naming its URL)."""

    def __init__(self, path: str, most: int) -> None:
        super().__init__(errno.EFBIG, f"{path} holds more than {most:,} bytes")
        self.most = most


class DeadlinePassed(TimeoutError):
    """A request abandoned at its deadline (`Store` methods' `timeout`)."""


class Store(abc.ABC):
    """One kind of storage, rooted at a place the user named.

    `timeout` (seconds, or None) is how long a request may take before it is
    abandoned, where the backend can abandon one (a request to a remote store); a
    backend that cannot (a system call on the local disk) runs it to its end.
    """

    root: str  # what the keys are below: a local path, or a path in the remote store
    concurrency: int  # requests kept in flight by default (save's and restore's pools)
    local: bool = False  # this machine's own disk
    # What the store can do, each asked where that is what matters (see `Location`'s
    # properties of the same names); a remote store's values here, a local disk's its own.
    # A request mostly waits for its answer (a round trip), so more in flight hide that.
    requests_wait: bool = True
    # A request is abandoned at its deadline (`timeout`), where a system call runs to its end.
    abandons: bool = True
    # Directories are things of their own, there when empty (not prefixes of objects).
    has_directories: bool = False
    # A name may be a symbolic link to another (`followed`).
    has_links: bool = False
    # The store can fill up, as a disk does (`free_bytes` says how far).
    can_fill: bool = False
    # The store is reached through a client that takes fsspec's storage options
    # (credentials, an endpoint).
    takes_options: bool = True
    # `write`, `create` and `copy` return the version of the object made (from the store's
    # answer, or asked at once where it says none); else they return None, and `version`
    # asks where a caller needs it.
    says_versions: bool = True

    @abc.abstractmethod
    def list_dir(self, key: str, *, timeout: float | None) -> list[Entry]:
        """The entries directly below `key`, sorted by name (FileNotFoundError if none)."""

    @abc.abstractmethod
    def walk(self, key: str, *, timeout: float | None, empty_directories: bool = False) -> list[Entry]:
        """Every object below `key` at any depth, by key relative to it, sorted; with
        `empty_directories`, each directory that holds nothing too (a `dir` entry),
        where the store has directories."""

    @abc.abstractmethod
    def write(self, key: str, parts: Sequence[object], *, atomic: bool, durable: bool,
              timeout: float | None) -> str | None:
        """Writes the object `key`, the concatenation of `parts` (see `Location.write`).
        Returns the version of the object made (`Entry.version`): from the store's
        answer where it names one (a local file's, S3's ETag, GCS's generation); else,
        where `says_versions`, asked of the store at once; else None (`version` asks
        for it). So do `create` and `copy`."""

    @abc.abstractmethod
    def create(self, key: str, parts: Sequence[object], *, timeout: float | None) -> str | None:
        """Writes the object `key`, the concatenation of `parts`, durably, only if nothing
        is there (FileExistsError if something is): of two creates of one key, whenever
        made, at most one succeeds, where `exclusive` says the store guarantees it."""

    @abc.abstractmethod
    def copy(self, key: str, source: str, *, size: int, exclusive: bool, expect: str,
             timeout: float | None) -> str | None:
        """Makes the object `key` a copy of the object `source` (`size` bytes), durably,
        without its bytes passing through this process where the store can (see
        `Location.copy_new`), only if `source` is the version `expect` (`Entry.version`):
        else SourceChanged, and nothing made. With `exclusive`, only if nothing is at
        `key` (FileExistsError), as `create`."""

    def version(self, key: str, *, timeout: float | None) -> str | None:
        """The version of the object `key` (`Entry.version`) as the store says it now, one
        request; None where it says none, or the request fails. Asked only of a store
        whose writes do not say the version made (`says_versions` false): None here."""
        return None

    def write_batch(self) -> contextlib.AbstractContextManager[Store]:
        """This store, for writes made together (see `Location.write_batch`)."""
        return contextlib.nullcontext(self)

    @property
    def exclusive(self) -> bool:
        """Whether `create` is exclusive against every other writer, in any process."""
        return True

    @property
    def needs_probe(self) -> bool:
        """Whether `probe` asks the store anything: where zarrckpt trusts the store to
        check a condition it sends (S3, GCS), not where it checks them itself."""
        return False

    def probe(self, key: str, *, timeout: float | None) -> None:
        """Asks the store, with objects made and deleted below `key`, whether it honours
        the conditions zarrckpt sends where it trusts the store to check them (see
        `Location.probe`); nothing where zarrckpt checks them itself."""
        return None

    @property
    def late(self) -> bool:
        """Whether a request this store was sent can still be applied after it was
        abandoned (a remote store: the deadline bounds the wait, not the landing)."""
        return False

    @abc.abstractmethod
    def read(self, key: str, limit: int | None, *, timeout: float | None,
             check: Check | None = None, most: int | None = None) -> bytes:
        """The object `key`: its first `limit` bytes with a limit (a read of about that
        many); with `most` instead, the whole object, or `Larger` if it holds more than
        `most` bytes, of which no more than `most` + 1 were read. `check`: what is wrong
        with an answer, or None, where a store may choose between answers (a hedged
        read, see `hedge`)."""

    @abc.abstractmethod
    def read_into(self, key: str, buffers: Sequence[memoryview], *, timeout: float | None,
                  check: Check | None = None) -> tuple[int, int]:
        """Reads object `key` into `buffers` in turn; its size and the bytes read.
        `check`: as for `read`, of the whole object."""

    @abc.abstractmethod
    def read_range(self, key: str, start: int, buffer: memoryview, *, timeout: float | None) -> int:
        """Reads bytes `start` on of object `key` into `buffer`; how many there were."""

    @abc.abstractmethod
    def exists(self, key: str, *, timeout: float | None) -> bool:
        """Whether anything is at `key`."""

    @abc.abstractmethod
    def remove_file(self, key: str, *, timeout: float | None) -> None:
        """Deletes the object `key` (FileNotFoundError if absent)."""

    @abc.abstractmethod
    def remove_tree(self, key: str, *, timeout: float | None) -> None:
        """Deletes everything below `key`, and `key` (FileNotFoundError if nothing)."""

    @abc.abstractmethod
    def place(self, key: str) -> tuple[str, str]:
        """Where `key` really is: the store's identity and its path with every other
        spelling undone, so that two Locations can be compared."""

    def canonical(self, key: str) -> str | None:
        """One name for `key` however it was spelled, where the store can tell (a local
        path with every symbolic link resolved); None where it cannot."""
        return None

    def file_path(self, key: str) -> str | None:
        """`key` as a path another program on this machine can open; None where it is
        no file of this machine."""
        return None

    @abc.abstractmethod
    def moved(self, root: str) -> Store:
        """The same store, rooted at `root` (a path as this store spells one)."""

    def bucket(self) -> str | None:
        """The bucket (S3) or container the root is in, where the store has such; None."""
        return None

    def private_directory(self, key: str) -> None:
        """Makes `key` a directory only this user can change (see `local`)."""
        raise OSError(errno.EXDEV, f"{self.root} is not on this machine's own disk")

    def free_bytes(self, key: str) -> int:
        """The bytes free on the disk holding `key`."""
        raise OSError(errno.EXDEV, f"{self.root} is not on this machine's own disk")

    def followed(self, key: str, names: Sequence[str]) -> tuple[str, dict[str, str], dict[str, int]]:
        """Where the files `names` of folder `key` really are, every symbolic link on the
        way followed: their common folder (a root for `moved`), each one's key there and
        its size. FileNotFoundError (its filename: the name) for a link to nothing."""
        raise OSError(errno.EXDEV, f"{self.root} is not on this machine's own disk")
