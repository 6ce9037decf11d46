"""Training: train state, pure train step, fit loop, metrics, batch-size search.

* :class:`TrainState` -- params, model state, optimizer state, loss scale,
  step and key as one pytree.
* :func:`make_train_step` -- a pure ``step(state, batch) -> (state, metrics)``
  with accumulation, clipping, mixed precision and loss scaling.
* :func:`fit` -- the loop: progress bar, metrics history (JSON lines),
  evaluation, atomic checkpoints, best checkpoint, exact resume.
* :class:`Batches` -- keyed shuffled batches addressed by step (resumable).
* :mod:`torchfn.train.metrics` -- pure metric accumulators.
* :func:`find_batch_size` -- halve the batch size on out-of-memory.
* :class:`PeakMemory` -- peak tensor memory of a block (CPU included).

Rematerialisation lives in :func:`torchfn.remat` (``torchfn.core.remat``).
"""

from torchfn.train import metrics
from torchfn.train._batch_size import find_batch_size, is_out_of_memory
from torchfn.train._data import Batches
from torchfn.train._fit import fit
from torchfn.train._memory import PeakMemory
from torchfn.train._state import TrainState
from torchfn.train._step import NonFiniteLossError, make_train_step

__all__ = [
    "TrainState",
    "make_train_step",
    "NonFiniteLossError",
    "fit",
    "Batches",
    "metrics",
    "find_batch_size",
    "is_out_of_memory",
    "PeakMemory",
]
