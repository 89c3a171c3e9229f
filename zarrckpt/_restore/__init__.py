"""Restoring checkpoints: see `load` for the read path, module by module."""

from .checkpoint import Checkpoint, MissingObject, StoredLeaf, open_checkpoint
from .load import load, load_opened, load_pytree

__all__ = ["Checkpoint", "MissingObject", "StoredLeaf", "load", "load_opened", "load_pytree", "open_checkpoint"]
