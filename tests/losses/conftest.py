import pytest
import torch
from torch.func import grad

import torchfn
from torchfn import random


@pytest.fixture
def grad_matches_materialised():
    """``check(loss_of)``: the gradient of ``loss_of(net, x0)`` in the parameters of a
    small ``models.TransformerEncoder`` (``net(x)`` applies it) is the same with torchfn
    attention as with the materialised reference attention (plain torch ops), and not
    trivially 0. ``x0``: (B, N, D) = (4, 5, 8) float64 tokens."""
    from torchfn.kernels import reference_attention

    def model(attend):
        return torchfn.Model(torchfn.models.TransformerEncoder(dim=8, heads=2, depth=1,
                                                               mlp_ratio=2, attend=attend))

    def check(loss_of):
        ours, ref = model(None), model(reference_attention)
        params = torchfn.tree.map(lambda p: p.double(), ours.init(random.key(7)))
        x0 = random.normal(random.key(8), (4, 5, 8), dtype=torch.float64)

        def loss(enc, params):
            return loss_of(lambda x: enc.apply(params, x), x0)

        g = grad(lambda p: loss(ours, p))(params)
        want = grad(lambda p: loss(ref, p))(params)
        for name in params:
            torch.testing.assert_close(g[name], want[name], rtol=1e-9, atol=1e-11)
        assert max(x.abs().max().item() for x in g.values()) > 1e-3

    return check
