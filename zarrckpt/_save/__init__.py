"""Saving checkpoints: see `protocol` for the write path, module by module."""

from .background import BackgroundSave
from .compression import Compressor
from .plan_cache import PlanCache
from .protocol import PER_PROCESS, SHARED, Commit, SaveJob, save, save_pytree, stage, write

__all__ = ["PER_PROCESS", "SHARED", "BackgroundSave", "Commit", "Compressor", "PlanCache", "SaveJob", "save",
           "save_pytree", "stage", "write"]
