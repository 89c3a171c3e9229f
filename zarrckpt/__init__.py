"""zarrckpt: checkpoints of JAX pytrees as zarr v3 groups on any fsspec URL.

    save_pytree / load_pytree            one checkpoint at one URL
    save_checkpoint / load_checkpoint_if_it_exists / all_steps / latest_step
                                         numbered steps under a checkpoint directory
    load_checkpoint / checkpoints_iterator
                                         an evaluator following a training run
    PerProcess                           a leaf each process saves for itself (data loader state)
    metadata                             what a checkpoint holds, without reading data
    verify / copy_checkpoint             is a checkpoint whole; copy one anywhere, commit last
    export_checkpoint                    a checkpoint's arrays (or a subtree's) to .safetensors or .npz
    import_checkpoint                    a safetensors file or set, or an Orbax run, as a checkpoint
    CheckpointManager                    save policies, async saves, retention
    load_safetensors                     Hugging Face safetensors files onto a mesh

The on-disk format is specified in docs/pytree-zarr-checkpoint.md; docs/architecture.md
draws the modules: the write path in `_save/`, the read path in `_restore/`, the
format's pure pieces in `_format/`, storage at the bottom.
"""

import importlib as _importlib
import importlib.metadata as _importlib_metadata
import typing as _typing

from ._format import dtypes as _dtypes

if _typing.TYPE_CHECKING:  # what type checkers and the API reference see; at run time, __getattr__ below
    from ._copy import CopyResult, copy_checkpoint
    from ._foreign.export import ExportResult, export_checkpoint
    from ._foreign.safetensors import load_safetensors
    from ._format.naming import FORMAT_VERSION
    from ._format.tree import PerProcess
    from ._import import ImportResult, import_checkpoint
    from ._manager import CheckpointManager
    from ._metadata import CheckpointMetadata, LeafMetadata, metadata
    from ._restore import load_pytree
    from ._run.checkpoints import (
        all_steps,
        checkpoints_iterator,
        latest_step,
        load_checkpoint,
        load_checkpoint_if_it_exists,
        save_checkpoint,
        save_pytree,
    )
    from ._verify import Problem, VerifyReport, verify
    from .errors import (
        CheckpointCorruptError,
        CheckpointError,
        CheckpointExistsError,
        CheckpointLocationError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        CheckpointWriteError,
        CoordinationTimeoutError,
        DirectoryInUseError,
        SourceReadError,
        UnsupportedLeafError,
    )

_dtypes.register()  # bfloat16 and float8 must be known to zarr before any array is opened

try:
    __version__ = _importlib_metadata.version("zarrckpt")
except _importlib_metadata.PackageNotFoundError:  # a source tree on the path, never installed
    __version__ = "0+unknown"

# The module that defines each public name, imported at the name's first use (PEP 562):
# `import zarrckpt` and `zarrckpt --version` import no JAX.
_DEFINED_IN = {
    "._copy": ("CopyResult", "copy_checkpoint"),
    "._foreign.export": ("ExportResult", "export_checkpoint"),
    "._foreign.safetensors": ("load_safetensors",),
    "._format.naming": ("FORMAT_VERSION",),
    "._format.tree": ("PerProcess",),
    "._import": ("ImportResult", "import_checkpoint"),
    "._manager": ("CheckpointManager",),
    "._metadata": ("CheckpointMetadata", "LeafMetadata", "metadata"),
    "._restore": ("load_pytree",),
    "._run.checkpoints": ("all_steps", "checkpoints_iterator", "latest_step", "load_checkpoint",
                          "load_checkpoint_if_it_exists", "save_checkpoint", "save_pytree"),
    "._verify": ("Problem", "VerifyReport", "verify"),
    ".errors": ("CheckpointCorruptError", "CheckpointError", "CheckpointExistsError", "CheckpointLocationError",
                "CheckpointMismatchError", "CheckpointNotFoundError", "CheckpointWriteError",
                "CoordinationTimeoutError", "DirectoryInUseError", "SourceReadError", "UnsupportedLeafError"),
}
_MODULE_OF = {name: module for module, names in _DEFINED_IN.items() for name in names}


def __getattr__(name: str) -> _typing.Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value  # later uses find it without calling here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "FORMAT_VERSION",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointExistsError",
    "CheckpointLocationError",
    "CheckpointMetadata",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CoordinationTimeoutError",
    "CopyResult",
    "DirectoryInUseError",
    "ExportResult",
    "ImportResult",
    "LeafMetadata",
    "PerProcess",
    "Problem",
    "SourceReadError",
    "UnsupportedLeafError",
    "VerifyReport",
    "all_steps",
    "checkpoints_iterator",
    "copy_checkpoint",
    "export_checkpoint",
    "import_checkpoint",
    "latest_step",
    "load_checkpoint",
    "load_checkpoint_if_it_exists",
    "load_pytree",
    "load_safetensors",
    "metadata",
    "save_checkpoint",
    "save_pytree",
    "verify",
]
