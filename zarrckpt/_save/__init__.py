"""Saving checkpoints: see `protocol` for the write path, module by module."""

from .background import BackgroundSave
from .compression import Compressor
from .protocol import PER_PROCESS, SHARED, Commit, SaveJob, save, save_pytree, stage
from .unchanged import Unchanged

__all__ = ["PER_PROCESS", "SHARED", "BackgroundSave", "Commit", "Compressor", "SaveJob", "Unchanged", "save",
           "save_pytree", "stage"]
