"""The exceptions zarrckpt raises. Every message names the URL, step or leaf at fault."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error zarrckpt raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint (or no committed checkpoint) exists where one was asked for."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A save, copy or import would replace a committed checkpoint and `overwrite=True`
    was not given, or its destination holds something that is no checkpoint's (which is
    never deleted)."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The restore target does not match the saved tree; lists every mismatched leaf."""


class UnsupportedLeafError(CheckpointError, TypeError):
    """A pytree leaf (or dict key) of a type that cannot be saved; names its key path."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint, or a source being imported or loaded, is missing data or metadata
    it declares, or holds damaged bytes (a chunk failing its checksum, a malformed
    header); names the object at fault."""


class CheckpointWriteError(CheckpointError):
    """A save failed on at least one process; nothing was committed.

    Raised on every process, with the failures of all processes in the message.
    """


class SourceReadError(CheckpointError, OSError):
    """Another library's checkpoint being imported could not be read as its arrays were
    written (denied, unavailable, no answer in time); names the source and the array.
    Nothing was committed. (A source found damaged is a CheckpointCorruptError.)"""


class CoordinationTimeoutError(CheckpointError, TimeoutError):
    """Processes did not all reach a synchronisation point in time; names the missing ones."""


class CheckpointLocationError(CheckpointError, ValueError):
    """A URL is the wrong kind of place for the call: a checkpoint where a directory of
    steps was expected, or a directory of another library's checkpoints. Says what it
    is and what to pass instead."""


class DirectoryInUseError(CheckpointLocationError):
    """Another live job holds the directory: another CheckpointManager (or import) the
    checkpoint directory, or a job of the same run the `local_directory`; or a save
    with overwrite (`save_pytree`, `save_checkpoint`), `cp` or `import` would replace a
    step of a directory a live manager holds. Names the holder."""
