"""Saving checkpoints: see `protocol` for the write path, module by module."""

from .background import BackgroundSave
from .collaborators import NO_REUSE, UNGUARDED, Guard, Reuse, Reused, Unguarded
from .compression import Compressor
from .plan_cache import PlanCache
from .protocol import PER_PROCESS, SHARED, Commit, SaveJob, save, stage, write

__all__ = ["NO_REUSE", "PER_PROCESS", "SHARED", "UNGUARDED", "BackgroundSave", "Commit", "Compressor", "Guard",
           "PlanCache", "Reuse", "Reused", "SaveJob", "Unguarded", "save", "stage", "write"]
