"""DeepSeek-V3's multi-token prediction module: one more block that predicts the token
after next from the model's hidden state and the next token's embedding."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torchfn.models._norm import make_norm

__all__ = ["MultiTokenPrediction"]


class MultiTokenPrediction(nn.Module):
    """One depth of DeepSeek-V3's multi-token prediction (MTP): ``(B, n, dim)`` hidden
    states and the embeddings of the tokens ``k`` places on ``(B, n, dim)`` -> ``(B, n,
    dim)``.

    ``h_k(t) = Block(W [enorm(E(x[t + k])) | hnorm(h_{k-1}(t))])``: the previous depth's
    state at ``t`` (the model's own, after its final norm, for ``k = 1``), normalised,
    joined to the normalised embedding of token ``t + k``, projected back to ``dim`` and
    run through a transformer ``block`` (causal over ``t``), so that ``head(norm(h_k(t)))``
    predicts token ``t + k + 1``. The embedding and the output head are the model's own;
    :class:`TransformerEncoder` ``(mtp=D)`` builds ``D`` of these (the block a copy of its
    last one's design) and returns their logits with ``return_mtp=True``.

    Params: ``enorm``, ``hnorm``, ``proj`` ``(dim, 2 dim)`` (no bias), ``block.*``,
    ``norm`` (before the shared head). The order ``[embedding | state]`` is DeepSeek's
    checkpoints' (as vLLM reads them).

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import TransformerEncoder
        >>> lm = TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=10, out_dim=10,
        ...                         causal=True, position_embedding="rotary", mtp=1)
        >>> model = torchfn.Model(lm)
        >>> params = model.init(torchfn.random.key(0))
        >>> logits, (after_next,) = model.apply(params, torch.tensor([[1, 2, 3, 4]]),
        ...                                     return_mtp=True)
        >>> logits.shape, after_next.shape      # position t: tokens t + 1 and t + 2
        (torch.Size([1, 4, 10]), torch.Size([1, 3, 10]))
    """

    def __init__(self, dim: int, block: nn.Module, *, norm: str = "layer", bias: bool = True,
                 eps: float | None = None) -> None:
        super().__init__()
        self.enorm = make_norm(norm, dim, bias, eps)
        self.hnorm = make_norm(norm, dim, bias, eps)
        self.proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = make_norm(norm, dim, bias, eps)

    def forward(self, hidden: Tensor, embedded: Tensor, key_padding_mask: Tensor | None = None,
                segment_ids: Tensor | None = None, positions: object = None,
                cache: object = None) -> Tensor | tuple:
        """``hidden`` ``(B, n, dim)``: the previous depth's states at ``t``; ``embedded``
        ``(B, n, dim)``: the embeddings of tokens ``t + k``; the masks and positions (or
        rotary table) of ``t``, as the block takes them. Returns ``h_k`` ``(B, n, dim)``,
        before :attr:`norm`, and with a ``cache`` (the block's), ``(h_k, cache)``."""
        joined = torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1)  # (B, n, 2dim)
        return self.block(self.proj(joined), key_padding_mask, segment_ids, positions, cache)
