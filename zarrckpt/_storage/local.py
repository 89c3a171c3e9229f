"""The local disk as a store (`LocalDisk`): never through a symbolic link, and durable
when asked.

A local store has a root: the path the user gave (a checkpoint, or a directory of
steps), followed as the operating system resolves it. Everything below the root is
reached one path component at a time from the root's directory, each opened with
O_NOFOLLOW: a symbolic link planted anywhere inside (a chunk, an array directory, a
step directory, a marker) is never followed by a read, a write or a deletion, so no
call reads, writes or deletes outside the root. Meeting one raises `NotAFile`, as
does reading or writing what is not a regular file (a FIFO, a socket, a device): it is
opened without blocking and refused before a byte moves, where opening a FIFO would
wait for its other end forever. Nor does a write go through a hard link: a file that
has other links (a chunk that several steps share) is replaced by a new file, never
written into, so a write changes no bytes that another name holds.

A durable write reaches stable storage before it returns, with every directory entry
leading to it: the file's data is synced (`fdatasync`) before it is closed, its
directory after it is created or renamed into place (an atomic write: a temporary
file renamed over the old one), and each directory it had to create, in its parent.
Writes made batch (`LocalDisk.write_batch`: a save's chunks and array documents) open
each directory from its parent, keep most open, and are synced batch when they end:
each directory they made entries in once (not once per entry), and, where the platform
offers it safely, everything by one `syncfs` of the file system in place of a sync per
file and per directory (see `WriteBatch`).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import functools
import os
import posixpath
import resource
import shutil
import stat
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence

from .._util import concurrency as _concurrency
from .store import Check, Entry, Larger, NotAFile, SourceChanged, Store

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SPECIAL = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device"}
# Without blocking (a FIFO would wait for its other end forever) or taking a terminal:
# what is opened is then refused unless it is a regular file.
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
# No O_TRUNC: a file with other hard links is replaced, never truncated (`_write_file`).
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_KINDS = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "link"}
# What `link` fails with where it cannot be made: another file system, none on this one
# (gcsfuse, Mountpoint for S3, blobfuse), too many links to one file.
_NO_LINKS = (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS)
_LINK_TRIES = 3  # a copy's: a leftover replaced, then a writer racing this one


# A local disk (or tmpfs) is kept busy by a thread per core: each write is a memory copy
# into the page cache, and the CRC before it runs at memory speed.
LOCAL_CONCURRENCY = max(8, min(32, os.cpu_count() or 8))


class LocalDisk(Store):
    """This machine's disk below `root`, the path the user gave. Its requests cannot be
    abandoned (they are system calls): `timeout` is not used."""

    local = True
    requests_wait = False  # a system call, mostly answered from the page cache
    abandons = False
    has_directories = True
    has_links = True
    can_fill = True
    takes_options = False  # zarrckpt reads and writes the disk itself

    def __init__(self, root: str, batch: WriteBatch | None = None) -> None:
        self.root = root
        self.concurrency = LOCAL_CONCURRENCY
        self._batch = batch

    @contextlib.contextmanager
    def write_batch(self) -> Iterator[LocalDisk]:
        with WriteBatch(self.root) as batch:
            yield LocalDisk(self.root, batch)

    def list_dir(self, key: str, *, timeout: float | None) -> list[Entry]:
        return sorted(list_dir(self.root, key), key=lambda e: e.name)

    def walk(self, key: str, *, timeout: float | None, empty_directories: bool = False) -> list[Entry]:
        return walk(self.root, key, empty_directories=empty_directories)

    def write(self, key: str, parts: Sequence[object], *, atomic: bool, durable: bool,
              timeout: float | None) -> str:
        return write(self.root, key, parts, atomic=atomic, durable=durable, batch=self._batch)

    def create(self, key: str, parts: Sequence[object], *, timeout: float | None) -> None:
        create(self.root, key, parts)

    def copy(self, key: str, source: str, *, size: int, exclusive: bool, expect: str,
             timeout: float | None) -> str | None:
        return copy(self.root, source, key, exclusive=exclusive, expect=expect, batch=self._batch)

    def read(self, key: str, limit: int | None, *, timeout: float | None,
             check: Check | None = None, most: int | None = None) -> bytes:
        return read(self.root, key, limit, most)

    def read_into(self, key: str, buffers: Sequence[memoryview], *, timeout: float | None,
                  check: Check | None = None) -> tuple[int, int]:
        return read_into(self.root, key, buffers)

    def read_range(self, key: str, start: int, buffer: memoryview, *, timeout: float | None) -> int:
        return read_range(self.root, key, start, buffer)

    def exists(self, key: str, *, timeout: float | None) -> bool:
        return exists(self.root, key)

    def remove_file(self, key: str, *, timeout: float | None) -> None:
        remove_file(self.root, key)

    def remove_tree(self, key: str, *, timeout: float | None) -> None:
        remove_tree(self.root, key)

    def place(self, key: str) -> tuple[str, str]:
        return "file", os.path.realpath(os.path.join(self.root, key))

    def canonical(self, key: str) -> str:
        return os.path.realpath(os.path.join(self.root, key))

    def file_path(self, key: str) -> str:
        return os.path.abspath(os.path.join(self.root, key))

    def moved(self, root: str) -> LocalDisk:
        return LocalDisk(root)

    def private_directory(self, key: str) -> None:
        private_directory(os.path.join(self.root, key))

    def followed(self, key: str, names: Sequence[str]) -> tuple[str, dict[str, str], dict[str, int]]:
        real = {name: os.path.realpath(os.path.join(self.root, key, name)) for name in names}
        root = os.path.commonpath([os.path.dirname(path) for path in real.values()])
        sizes = {}
        for name, path in real.items():
            try:
                sizes[name] = os.stat(path).st_size
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, f"a link to {path}, which does not exist", name) from None
        return root, {name: os.path.relpath(path, root) for name, path in real.items()}, sizes

    def free_bytes(self, key: str) -> int:
        path = os.path.join(self.root, key)
        while not os.path.isdir(path) and os.path.dirname(path) != path:  # not made yet: its disk is its parent's
            path = os.path.dirname(path)
        return shutil.disk_usage(path).free


def _parts(key: str) -> list[str]:
    return [part for part in key.split("/") if part]


def _open_root(root: str, create: bool, durable: bool) -> int:
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except NotADirectoryError:
        path = root
        while os.path.dirname(path) != path and not os.path.isfile(path):
            path = os.path.dirname(path)
        raise NotADirectoryError(f"{path} is a file, not a directory") from None
    except FileNotFoundError:
        if not create:
            raise
        os.makedirs(root, exist_ok=True)
        if durable:
            parent = os.open(os.path.dirname(os.path.abspath(root)), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(parent)
            finally:
                os.close(parent)
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _open_below(fd: int, name: str, flags: int, path: str, mode: int = 0o666) -> int:
    """Opens `name` in the directory `fd`, never through a symbolic link."""
    try:
        return os.open(name, flags, mode, dir_fd=fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK) and _mode(fd, name) == stat.S_IFLNK:
            raise NotAFile(path) from None
        # A socket cannot be opened, a FIFO without a reader cannot be for writing, a
        # device on a `nodev` mount cannot be at all.
        if e.errno in (errno.ENXIO, errno.EACCES) and (special := _SPECIAL.get(_mode(fd, name) or 0)):
            raise NotAFile(path, special) from None
        raise


def _not_regular(mode: int, path: str) -> NotAFile:
    """The error for `path`, opened and found to be of `mode`, not a regular file."""
    return NotAFile(path, _SPECIAL.get(stat.S_IFMT(mode), "a special file"))


def _mode(fd: int, name: str) -> int | None:
    """The file type of `name` in the directory `fd` (S_IFLNK for a link), if it is there."""
    try:
        return stat.S_IFMT(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return None


@contextlib.contextmanager
def directory(root: str, key: str, *, create: bool = False, durable: bool = False) -> Iterator[int]:
    """The directory `root/key`, reached through no symbolic link below `root`
    (creating missing ones with `create`; syncing each new one into its parent with
    `durable`)."""
    fd = _open_directory(root, key, create, durable)
    try:
        yield fd
    finally:
        os.close(fd)


_PROC_FD = "/proc/self/fd"
_HAS_PROC_FD = os.path.isdir(_PROC_FD)  # Linux: where an open descriptor leads


@functools.lru_cache(maxsize=256)
def _real(root: str) -> str:
    return os.path.realpath(root)


def _open_directory(root: str, key: str, create: bool, durable: bool) -> int:
    parts = _parts(key)
    if parts and _HAS_PROC_FD:
        # The common case in two calls: open the whole path, then ask the kernel where
        # it led; only a path that went through a link (or is missing) is walked.
        try:
            fd = os.open(os.path.join(root, *parts), _DIRECTORY)
        except OSError:
            fd = -1
        if fd >= 0:
            if os.readlink(f"{_PROC_FD}/{fd}") == os.path.join(_real(root), *parts):
                return fd
            os.close(fd)
    return _walk(root, parts, create, durable)


def _walk(root: str, parts: list[str], create: bool, durable: bool) -> int:
    """Opens root/parts one component at a time from the root, each with O_NOFOLLOW."""
    fd = _open_root(root, create, durable)
    try:
        path = root
        for name in parts:
            path = os.path.join(path, name)
            sync = functools.partial(os.fsync, fd) if durable else None
            child = _open_child(fd, name, path, create=create, sync=sync)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_child(fd: int, name: str, path: str, *, create: bool, sync: Callable[[], None] | None) -> int:
    """Opens the directory `name` in the directory `fd`, never through a link; made if
    missing, with `create`, then `sync()` (its entry in `fd` to stable storage, or
    noted to be)."""
    try:
        return _open_below(fd, name, _DIRECTORY, path)
    except FileNotFoundError:
        if not create:
            raise
    with contextlib.suppress(FileExistsError):  # another thread's or process's, made meanwhile
        os.mkdir(name, dir_fd=fd)
    if sync is not None:
        sync()
    return _open_below(fd, name, _DIRECTORY, path)


def _split(key: str) -> tuple[str, str]:
    parent, _, name = key.rstrip("/").rpartition("/")
    if not name:
        raise IsADirectoryError(errno.EISDIR, f"{key!r} names no file")
    return parent, name


@contextlib.contextmanager
def _opened(root: str, key: str, batch: WriteBatch | None = None) -> Iterator[tuple[int, int]]:
    """The file `root/key`, opened for reading through no link below `root`, and its size."""
    f = _open_file(root, key, batch)
    try:
        info = os.fstat(f)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(errno.EISDIR, f"{os.path.join(root, key)} is a directory")
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(info.st_mode, os.path.join(root, key))
        yield f, info.st_size
    finally:
        os.close(f)


def _open_file(root: str, key: str, batch: WriteBatch | None = None) -> int:
    if batch is not None:  # its directory is open already
        parent, name = _split(key)
        with _in_directory(root, parent, batch) as (fd, _):
            return _open_below(fd, name, _READ, os.path.join(root, key))
    if _HAS_PROC_FD:  # as `_open_directory`: open, then ask the kernel where it led
        try:
            f = os.open(os.path.join(root, key), _READ)
        except OSError:
            f = -1
        if f >= 0:
            if os.readlink(f"{_PROC_FD}/{f}") == os.path.join(_real(root), *_parts(key)):
                return f
            os.close(f)
    parent, name = _split(key)
    with directory(root, parent) as fd:
        return _open_below(fd, name, _READ, os.path.join(root, key))


def read(root: str, key: str, limit: int | None = None, most: int | None = None) -> bytes:
    """The file `root/key`: its first `limit` bytes with a limit; with `most`, Larger
    if it holds more than `most` bytes (none of them read)."""
    with _opened(root, key) as (f, size):
        if most is not None and size > most:
            raise Larger(os.path.join(root, key), most)
        wanted = size if limit is None else min(size, limit)  # a read allocates what it asks for
        data = os.read(f, wanted)
        if limit is None and most is None and len(data) < size:  # a short read: take the rest
            data += b"".join(iter(lambda: os.read(f, 1 << 20), b""))
        return data


def read_into(root: str, key: str, buffers: Sequence[memoryview]) -> tuple[int, int]:
    """Reads `root/key` into `buffers`, filling each in turn as far as the file goes;
    returns (the file's size, bytes read)."""
    with _opened(root, key) as (f, size):
        done = 0
        for buffer in buffers:
            filled = 0
            while filled < len(buffer) and (n := os.readv(f, [buffer[filled:]])):
                filled += n
            done += filled
        return size, done


def read_range(root: str, key: str, start: int, buffer: memoryview) -> int:
    """Reads `root/key` from byte `start` into `buffer`, as far as the file goes; returns
    the bytes read."""
    with _opened(root, key) as (f, _):
        filled = 0
        while filled < len(buffer) and (n := os.preadv(f, [buffer[filled:]], start + filled)):
            filled += n
        return filled


def write(root: str, key: str, parts: Sequence[object], *, atomic: bool, durable: bool,
          batch: WriteBatch | None = None) -> str:
    """Writes `root/key`, the concatenation of `parts`, creating directories as needed;
    returns the version of the file made (`version`). `atomic`: written aside and
    renamed over, so a reader sees the old file or the new one whole. `durable`: on
    stable storage (data, and with `atomic` the rename) before returning, or, in
    writes of a batch, before it ends."""
    parent, name = _split(key)
    with _in_directory(root, parent, batch, create=True, durable=durable) as (fd, synced):
        target = f"{name}.{uuid.uuid4().hex}.tmp" if atomic else name
        nbytes = sum(memoryview(part).nbytes for part in parts)  # type: ignore[arg-type, misc]
        # An atomic write is renamed over the old file: its bytes must be there first.
        made = _write_file(fd, target, _WRITE, parts, os.path.join(root, key),
                           durable=durable and (atomic or _synced_as_made(synced, nbytes)))
        if atomic:
            try:
                os.replace(target, name, src_dir_fd=fd, dst_dir_fd=fd)  # replaces a link itself, never its target
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(target, dir_fd=fd)
                raise
        if durable and synced is Synced.AS_MADE:
            os.fsync(fd)  # the file's entry in its directory
    return made


class Synced(enum.Enum):
    """When what a durable write makes in a directory reaches stable storage."""

    AS_MADE = "each file and each entry in the directory as it is made"
    ENTRIES_AT_END = "each file as it is made; the directory's new entries when the writes made batch end"
    AT_END = "by one sync of the file system when the writes made batch end (large files as made)"


@contextlib.contextmanager
def _in_directory(root: str, key: str, batch: WriteBatch | None, *, create: bool = False,
                  durable: bool = False) -> Iterator[tuple[int, Synced]]:
    """The directory `root/key` (made if missing, with `create`: then synced into its
    parent with `durable`, or, in a write batch, when they end), and when what
    a durable write makes there is synced. A directory opened with `create` and
    `durable` is where such a write makes entries."""
    if batch is None:
        with directory(root, key, create=create, durable=durable) as fd:
            yield fd, Synced.AS_MADE
    else:
        with batch.directory(key, create=create, durable=durable) as found:
            yield found


def _synced_as_made(synced: Synced, nbytes: int) -> bool:
    """Whether a file of `nbytes` that a durable write or copy makes is synced as it is
    made: unless the end of writes made batch syncs the whole file system; and a
    large one even then, so that its writeback overlaps what follows instead of all
    coming at the end."""
    return synced is not Synced.AT_END or nbytes >= _SYNCED_AS_WRITTEN


def create(root: str, key: str, parts: Sequence[object]) -> None:
    """Writes `root/key` durably if nothing is there, else FileExistsError: written
    aside, then hard-linked to its name, which fails if the name exists (a link
    included) on every POSIX file system, NFS too; a reader never sees it in part.
    Where hard links are not supported (gcsfuse, Mountpoint for S3, blobfuse), the
    file is created with O_EXCL and written in place (a reader may see it in part)."""
    parent, name = _split(key)
    aside = f"{name}.{uuid.uuid4().hex}.tmp"
    write(root, posixpath.join(parent, aside) if parent else aside, parts, atomic=False, durable=True)
    with directory(root, parent) as fd:
        try:
            os.link(aside, name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
        except OSError as e:
            if e.errno not in _NO_LINKS:
                raise
            _write_file(fd, name, _CREATE, parts, os.path.join(root, key), durable=True)
        finally:
            os.unlink(aside, dir_fd=fd)
        os.fsync(fd)


def copy(root: str, src: str, dst: str, *, exclusive: bool, expect: str, batch: WriteBatch | None = None) -> str:
    """Makes `root/dst` durably (in a write batch, by their end) the file
    `root/src` is, as a hard link (its bytes written nowhere), or, where links cannot
    be made (another file system, a file system without them), a copy made inside the
    kernel; only if `src` is the version `expect` (`version`), else SourceChanged and
    nothing left at `dst`. Returns the version of the file made (a link's is its
    source's). A symbolic link or special file at `src` is linked as itself, never
    followed, then removed again and refused: `dst` is never anything but a regular
    file. With `exclusive`, FileExistsError if anything is at `dst`; else what is there
    is replaced."""
    parent, name = _split(dst)
    source_parent, source_name = _split(src)
    with (_in_directory(root, source_parent, batch) as (source_fd, _),
          _in_directory(root, parent, batch, create=True, durable=True) as (fd, synced)):
        for _ in range(_LINK_TRIES):
            try:
                os.link(source_name, name, src_dir_fd=source_fd, dst_dir_fd=fd, follow_symlinks=False)
                break
            except FileExistsError:
                if exclusive:
                    raise
                os.unlink(name, dir_fd=fd)  # this save's own leftover: a link replaces it
            except OSError as e:
                if e.errno not in _NO_LINKS:
                    raise
                with _opened(root, src, batch) as (f, size):
                    # The open file is the one copied, whatever is renamed over it; one
                    # written into meanwhile is another version once the copy is made.
                    if version(os.fstat(f)) != expect:
                        raise SourceChanged(errno.ENOENT, f"{os.path.join(root, src)} is not the file it was") from None
                    copied = _copy_bytes(f, size, fd, name, os.path.join(root, dst), exclusive=exclusive,
                                         durable=_synced_as_made(synced, size))
                    if version(os.fstat(f)) != expect:
                        os.unlink(name, dir_fd=fd)
                        raise SourceChanged(errno.ENOENT, f"{os.path.join(root, src)} was written while copied") \
                            from None
                if synced is Synced.AS_MADE:
                    os.fsync(fd)
                return copied
        else:
            raise FileExistsError(errno.EEXIST, f"{os.path.join(root, dst)} keeps being made by another writer")
        made = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISREG(made.st_mode) or version(made) != expect:
            os.unlink(name, dir_fd=fd)
            path = os.path.join(root, src)
            if stat.S_ISLNK(made.st_mode):
                raise NotAFile(path)
            if not stat.S_ISREG(made.st_mode):
                raise _not_regular(made.st_mode, path)
            raise SourceChanged(errno.ENOENT, f"{path} is not the file it was")
        if synced is Synced.AS_MADE:
            os.fsync(fd)
    return version(made)


def _copy_bytes(f: int, size: int, fd: int, name: str, path: str, *, exclusive: bool, durable: bool) -> str:
    """Copies the open file `f` (`size` bytes) to `name` in the directory `fd`, in the
    kernel (`sendfile`: no byte through this process's memory); with `durable`, on
    stable storage before returning. Returns the version of the file made."""
    if not exclusive:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=fd)
    out = _open_below(fd, name, _CREATE, path)
    try:
        done = 0
        while done < size and (n := os.sendfile(out, f, done, size - done)):
            done += n
        if durable:
            os.fdatasync(out)
        return version(os.fstat(out))
    finally:
        os.close(out)


def _write_file(fd: int, name: str, flags: int, parts: Sequence[object], path: str, *, durable: bool) -> str:
    """Makes `name` in the directory `fd` and writes `parts` into it, as they are (no copy
    to join them); with `durable`, on stable storage before returning. A file there
    already is FileExistsError with `flags` of O_EXCL; else it is opened with `flags`
    and emptied first, unless it has other hard links (a chunk another step shares):
    then its name is unlinked and a new file made in its place, so that no write ever
    changes the bytes another step holds. Returns the version of the file written."""
    try:
        f = _open_below(fd, name, _CREATE, path)  # most writes make a new file: nothing there to look at
    except FileExistsError:
        if flags & os.O_EXCL:
            raise
        f = _emptied(fd, name, _open_below(fd, name, flags, path), path)
    try:
        for part in parts:
            view = memoryview(part).cast("B")  # type: ignore[arg-type]
            while view:
                view = view[os.write(f, view):]
        if durable:
            os.fdatasync(f)
        return version(os.fstat(f))
    finally:
        os.close(f)


def version(info: os.stat_result) -> str:
    """What tells this version of a file from any other made at its path (see
    `Entry.version`): its modification time and size. Not its inode: a FUSE file system
    (gcsfuse, sshfs) may number a file anew once the kernel forgets it, and a file
    another program writes at the path has its own modification time."""
    return f"{info.st_mtime_ns}:{info.st_size}"


def _emptied(fd: int, name: str, f: int, path: str) -> int:
    """The file `f`, found at `name` in the directory `fd`, to be written from its start:
    emptied, or, where other hard links share it (a chunk another step holds), a new
    file made in its place. Never a special file. Closes `f` on failure."""
    try:
        if not stat.S_ISREG((found := os.fstat(f)).st_mode):  # a planted FIFO or device: never written into
            raise _not_regular(found.st_mode, path)
        if found.st_nlink > 1:
            os.close(f)
            f = -1
            os.unlink(name, dir_fd=fd)
            return _open_below(fd, name, _CREATE, path)
        if found.st_size:
            os.ftruncate(f, 0)
        return f
    except BaseException:
        if f >= 0:
            os.close(f)
        raise


def remove_file(root: str, key: str) -> None:
    """Deletes the file (or symbolic link, itself) `root/key`."""
    parent, name = _split(key)
    with directory(root, parent) as fd:
        os.unlink(name, dir_fd=fd)


def remove_tree(root: str, key: str) -> None:
    """Deletes the directory `root/key` and everything in it, following no link (a link
    is deleted itself). With `key` "", the root's contents, then the root if it is empty."""
    if _parts(key):
        parent, name = _split(key)
        with directory(root, parent) as fd:
            _remove_entry(fd, name)
        return
    with directory(root, "") as fd:
        for name in os.listdir(fd):
            _remove_entry(fd, name)
    with contextlib.suppress(OSError):
        os.rmdir(root)


def _remove_entry(fd: int, name: str) -> None:
    if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
        shutil.rmtree(name, dir_fd=fd)  # fd by fd: a link inside is unlinked, never followed
    else:
        os.unlink(name, dir_fd=fd)


def list_dir(root: str, key: str) -> list[Entry]:
    """The entries of the directory `root/key`, links reported as links. An entry removed
    between the listing and its stat (a file written aside and renamed over, beside
    it) is left out: its FileNotFoundError would read as the directory missing."""
    with directory(root, key) as fd:
        entries = []
        with os.scandir(fd) as found:
            for item in found:
                try:
                    info = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                entries.append(Entry(item.name, _KINDS.get(stat.S_IFMT(info.st_mode), "other"), info.st_size,
                                     version(info)))
    return entries


def walk(root: str, key: str, *, empty_directories: bool = False) -> list[Entry]:
    """Every entry below the directory `root/key` at any depth except directories (but,
    with `empty_directories`, those that hold nothing), by path relative to it; links
    are reported, never followed. A directory removed while it is walked is left out."""
    out: list[Entry] = []
    todo = [""]
    while todo:
        below = todo.pop()
        try:
            entries = list_dir(root, os.path.join(key, below) if below else key)
        except FileNotFoundError:
            if not below:
                raise
            continue
        if not entries and below and empty_directories:
            out.append(Entry(below, "dir"))
        for entry in entries:
            name = f"{below}/{entry.name}" if below else entry.name
            if entry.type == "dir":
                todo.append(name)
            else:
                out.append(Entry(name, entry.type, entry.size, entry.version))
    return sorted(out, key=lambda e: e.name)


def exists(root: str, key: str) -> bool:
    """Whether anything (a link included) is at `root/key`."""
    if not _parts(key):
        return os.path.lexists(root)
    parent, name = _split(key)
    try:
        with directory(root, parent) as fd:
            os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


class WriteBatch:
    """Writes made batch below `root` (one save's chunks and array documents), for
    `LocalDisk.write_batch`: each directory is reached from its parent, and up to
    `_KEPT_DIRECTORIES` are kept open until the writes end. What they write is on
    stable storage when they end (`__exit__` returns only then): where one sync of the
    whole file system is as safe as a sync per file and per directory, by one `syncfs`
    then (files of 1 MiB or more synced as they are written all the same); elsewhere
    each file is synced as it is written, and each directory entries were made in (a
    file, a link, a directory) once at the end, not once per entry (an array's
    directory gets its document and each of its chunks).

    One `syncfs` is as safe on Linux 5.17 and later, where it fails with any writeback
    error of the file system since the descriptor it is given was opened (the first
    directory opened on it, kept open: opened before anything was written there) and
    with any error of the file system's own sync (its journal, log or transaction
    commit: before 5.17 those were not reported), on file systems whose sync commits
    their metadata too (`_WHOLE_SYNCS`; ext4 with its journal only); not on NFS, FUSE,
    overlay, ext4 without a journal, or an older kernel. What it costs: a `syncfs` also
    waits for what other programs have left to write on that file system.

    The descriptors are closed when the last call using one ends: a writer thread
    that outlives the block (its join cut short by a second Ctrl-C) never writes
    through a descriptor number since given to another file."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._open: dict[str, tuple[int, Synced]] = {}  # key: its descriptor; when what is made there is synced
        self._anchors: dict[int, int] = {}  # device: a descriptor opened there before anything was written
        self._whole: dict[int, bool] = {}  # device: `_syncs_whole`, asked once (device numbers are reused)
        self._entries: set[str] = set()  # directories whose new entries are synced at the end
        self._users = 0
        self._ended = False

    def __enter__(self) -> WriteBatch:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        try:
            if kind is None:  # a failed save is not committed: nothing to sync for it
                with self._lock:
                    entries = sorted(self._entries)
                _concurrency.run_all(self._sync_directory, entries, LOCAL_CONCURRENCY, "sync")
                for fd in list(self._anchors.values()):
                    _syncfs(fd, self.root)
        finally:
            with self._lock:
                self._ended = True
                if self._users == 0:
                    self._close()

    def _close(self) -> None:
        for fd in [*self._anchors.values(), *(fd for fd, _ in self._open.values())]:
            os.close(fd)
        self._anchors.clear()
        self._open.clear()

    @contextlib.contextmanager
    def directory(self, key: str, *, create: bool = True, durable: bool = False) -> Iterator[tuple[int, Synced]]:
        """The directory `root/key`, reached through no symbolic link (made if missing,
        with `create`), and when what a durable write makes in it is synced (never
        `Synced.AS_MADE`). With `create` and `durable`, a durable write makes entries
        in it: where those are synced at the end, so is it (and so is the parent of a
        directory made here). OSError once the writes have ended."""
        with self._lock:
            if self._ended:
                raise OSError(errno.EBADF, f"the writes made batch below {self.root} have ended")
            self._users += 1
            found = self._open.get(key)
        fd = -1  # a descriptor of this call's own, closed when it ends
        try:
            if found is None:
                fd = self._opened(key, create)
                device = os.fstat(fd).st_dev
                with self._lock:
                    if device not in self._whole:
                        self._whole[device] = _syncs_whole(device)
                    if device not in self._anchors and self._whole[device]:
                        self._anchors[device] = os.dup(fd)  # its sample of the file system's errors: taken now
                    found = self._open.get(key)  # another thread's, opened meanwhile
                    if found is None:
                        found = (fd, Synced.AT_END if device in self._anchors else Synced.ENTRIES_AT_END)
                        if len(self._open) < _KEPT_DIRECTORIES:
                            self._open[key], fd = found, -1
            if create and durable and found[1] is Synced.ENTRIES_AT_END:
                self._made_entries(key)
            yield found
        finally:
            if fd >= 0:
                os.close(fd)
            with self._lock:
                self._users -= 1
                if self._ended and self._users == 0:
                    self._close()

    def _opened(self, key: str, create: bool) -> int:
        """Opens `root/key` below its parent (made if missing, with `create`: then synced
        into it when the writes end), which is reached the same way: one call per
        directory where its parent is kept open."""
        if not _parts(key):
            return _open_root(self.root, create, True)
        parent, name = _split(key)
        with self.directory(parent, create=create) as (fd, synced):
            made = functools.partial(self._made_entries, parent) if synced is Synced.ENTRIES_AT_END else None
            return _open_child(fd, name, os.path.join(self.root, key), create=create, sync=made)

    def _made_entries(self, key: str) -> None:
        """Notes that entries were made in the directory `root/key`: synced at the end."""
        with self._lock:
            self._entries.add(key)

    def _sync_directory(self, key: str) -> None:
        """Syncs the directory `root/key`: the entries the writes made in it."""
        with self.directory(key, create=False) as (fd, _):
            os.fsync(fd)


# A file at least this large is synced as it is made, even in writes made batch.
_SYNCED_AS_WRITTEN = 1 << 20
# Directories a `WriteBatch` keeps open: at most a quarter of the descriptors the process
# may have.
_KEPT_DIRECTORIES = max(16, min(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4))
# File systems whose `syncfs` writes out their data and commits their metadata
# (journal, log, transaction), and reports both's errors from Linux 5.17 on: ext4 only
# with its journal (`_has_journal`).
_WHOLE_SYNCS = frozenset({"ext4", "xfs", "btrfs", "tmpfs"})


def _libc_syncfs() -> Callable[[int], int] | None:
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)
    except OSError:
        return None


_SYNCFS = _libc_syncfs()


def _kernel() -> tuple[int, ...]:
    release = os.uname().release.split("-")[0].split(".")
    return tuple(int(part) for part in release[:2] if part.isdigit())


def _syncs_whole(device: int) -> bool:
    """Whether one `syncfs` of the file system on `device` is as safe as syncing each
    file and directory written there."""
    if _SYNCFS is None or _kernel() < (5, 17):
        return False
    wanted = f"{os.major(device)}:{os.minor(device)}"
    try:
        with open("/proc/self/mountinfo") as mounts:
            for line in mounts:
                fields = line.split()
                if fields[2] == wanted:
                    kind = fields[fields.index("-") + 1]
                    return kind in _WHOLE_SYNCS and (kind != "ext4" or _has_journal(device))
    except (OSError, ValueError, IndexError):
        pass
    return False


def _has_journal(device: int) -> bool:
    """Whether the ext4 file system on `device` has a journal (its mount then shows a
    `data=` mode). Without one, ext4 keeps directory blocks and bitmaps in the block
    device's cache, and `syncfs` flushes the disk's own cache before it writes those
    out, so they may not be on stable storage when it returns; a sync of each file and
    directory flushes after them."""
    try:
        name = os.path.basename(os.readlink(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}"))
        with open(f"/proc/fs/ext4/{name}/options") as options:
            return any(option.startswith("data=") for option in options.read().split())
    except OSError:
        return False


def _syncfs(fd: int, root: str) -> None:
    if _SYNCFS is not None and _SYNCFS(fd) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"syncing the file system that holds {root}: {os.strerror(code)}")


class UnsafeDirectory(OSError):
    """A directory that another user could change under us (see `private_directory`)."""


def private_directory(path: str) -> None:
    """Makes `path` a directory that only this user can change: `path` must be this
    user's and writable by no one else, and every directory above it must be this
    user's or root's and writable by no one else unless sticky (as /tmp and /dev/shm
    are: others cannot rename or delete what is ours there). Missing components are
    created with mode 0700, only once what exists has passed. Raises UnsafeDirectory
    saying which directory fails and why: another user who can write there could
    plant or swap copies that we would restore (the rule ssh applies to a key file's
    directories)."""
    real = os.path.realpath(os.path.abspath(path))
    _check_private(real)  # before anything is made inside
    walked = "/"
    for name in _parts(real):
        walked = os.path.join(walked, name)
        if not os.path.lexists(walked):
            with contextlib.suppress(FileExistsError):  # one made at the same moment is checked below
                os.mkdir(walked, 0o700)
    _check_private(real)


def _check_private(real: str) -> None:
    me, walked = os.geteuid(), "/"
    for name in _parts(real):
        walked = os.path.join(walked, name)
        try:
            found = os.stat(walked)
        except FileNotFoundError:
            return  # nothing below it exists yet
        leaf = walked == real
        if not stat.S_ISDIR(found.st_mode):
            raise UnsafeDirectory(errno.ENOTDIR, f"{walked} is not a directory")
        if found.st_uid != me and (leaf or found.st_uid != 0):
            raise UnsafeDirectory(errno.EPERM, f"{walked} belongs to user id {found.st_uid}, not to this user "
                                               f"({me})")
        if found.st_mode & 0o022 and (leaf or not found.st_mode & stat.S_ISVTX):
            raise UnsafeDirectory(errno.EPERM, f"{walked} is writable by other users (mode "
                                               f"{stat.S_IMODE(found.st_mode):04o})")
