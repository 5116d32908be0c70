"""Model batching: N models of one architecture as one module (see ``BatchModule``)."""

from __future__ import annotations

from fold.batched_ops.core import AbstractBatchModule as AbstractBatchModule
from fold.batched_ops.core import register_batch_module as register_batch_module
from fold.batched_ops.functional import batch_loss as batch_loss
from fold.batched_ops.functional import batch_topk as batch_topk
from fold.batched_ops.module import BatchModule as BatchModule
from fold.batched_ops.module import VmapFallback as VmapFallback

__all__ = [
    "AbstractBatchModule",
    "BatchModule",
    "VmapFallback",
    "batch_loss",
    "batch_topk",
    "register_batch_module",
]
