"""Saving checkpoints: see `protocol` for the write path, module by module."""

from .background import BackgroundSave
from .protocol import PER_PROCESS, SHARED, Commit, SaveJob, save, save_pytree, stage

__all__ = ["PER_PROCESS", "SHARED", "BackgroundSave", "Commit", "SaveJob", "save", "save_pytree", "stage"]
