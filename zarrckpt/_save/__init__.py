"""Saving checkpoints: see `protocol` for the write path, module by module."""

from .background import BackgroundSave
from .protocol import PER_PROCESS, SHARED, Commit, SaveJob, save, save_pytree, stage
from .unchanged import Unchanged

__all__ = ["PER_PROCESS", "SHARED", "BackgroundSave", "Commit", "SaveJob", "Unchanged", "save", "save_pytree", "stage"]
