"""Fused attention that composes with ``grad``, ``vmap``, ``jvp`` and ``torch.compile``.

``attention`` dispatches to Triton kernels on CUDA and to the PyTorch path on CPU
(SDPA's fused CPU kernels where their semantics fit, else blockwise torch ops), both
behind custom ops with vmap rules and derivatives; ``reference_attention`` is the
materialised float64 oracle. ``gated_delta_rule`` (Gated DeltaNet) and
``gated_linear_attention`` (Mamba-2's SSD) are linear attention with a decaying state,
chunked; ``selective_scan`` is Mamba's, whose state decays per channel and entry;
``mlstm`` is xLSTM's matrix memory (exponential input gates, a normaliser).
Importing this package needs only torch: triton is imported lazily.
"""

from ._dispatch import AttentionBackendError, attention
from ._linear_attention import gated_delta_rule, gated_linear_attention
from ._mlstm import mlstm
from ._reference import reference_attention
from ._selective_scan import selective_scan

__all__ = ["AttentionBackendError", "attention", "gated_delta_rule", "gated_linear_attention",
           "mlstm", "reference_attention", "selective_scan"]
