"""Saving checkpoints: see `protocol` for the write path, module by module."""

from .protocol import SaveJob, save, save_pytree, stage

__all__ = ["SaveJob", "save", "save_pytree", "stage"]
