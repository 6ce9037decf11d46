"""Ghost clipping == the materialised per_sample_grads path (norms and clipped sum)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

from torchfn.transforms import ghost_clip_grads, ghost_norms, per_sample_grads


def _params(module, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g, dtype=torch.float64) / v.shape[-1] ** 0.5 + 0.05
            for k, v in module.named_parameters()}


class SeqNet(nn.Module):
    """Linear layers on token sequences (B, T, d): exercises the Gram and materialised forms."""

    def __init__(self, d, h, classes):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.mix = nn.Linear(h, h, bias=False)
        self.head = nn.Linear(h, classes)

    def forward(self, x):  # x: (B, T, d)
        h = self.mix(torch.tanh(self.inp(x)))  # (B, T, h)
        return self.head(torch.relu(h).mean(-2))  # (B, classes)


def _batched_loss(module):
    def loss_fn(params, x, y):  # x: (B, ...), y: (B,) -> (B,)
        return F.cross_entropy(functional_call(module, params, (x,)), y, reduction="none")

    return loss_fn


def _single(batched):
    def loss_fn(params, x, y):  # one example
        return batched(params, x[None], y[None])[0]

    return loss_fn


def _reference(module, params, x, y, clip):
    grads = per_sample_grads(_single(_batched_loss(module)))(params, x, y)
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
    coef = (clip / (norms + 1e-6)).clamp(max=1.0)
    summed = {k: torch.tensordot(coef, g, dims=1) for k, g in grads.items()}
    return norms, summed


def _data(seed, shape, classes):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(shape, generator=g, dtype=torch.float64) + 0.1
    y = torch.randint(0, classes, shape[:1], generator=g)
    return x, y


def _check(module, params, x, y, clip):
    want_norms, want_sum = _reference(module, params, x, y, clip)
    loss_fn = _batched_loss(module)
    norms, losses = ghost_norms(loss_fn, params, x, y)
    torch.testing.assert_close(norms, want_norms, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(losses, loss_fn(params, x, y), rtol=1e-12, atol=0)
    res = ghost_clip_grads(loss_fn, params, x, y, l2_norm_clip=clip)
    torch.testing.assert_close(res.norms, want_norms, rtol=1e-10, atol=1e-12)
    assert res.grads.keys() == want_sum.keys()
    for k in want_sum:
        torch.testing.assert_close(res.grads[k], want_sum[k], rtol=1e-10, atol=1e-12)
    return want_norms


@given(b=st.integers(1, 6), d=st.integers(1, 7), h=st.integers(1, 9), bias=st.booleans(),
       clip=st.floats(0.05, 5.0), seed=st.integers(0, 2**16))
def test_mlp_matches_materialised(b, d, h, bias, clip, seed):
    module = nn.Sequential(nn.Linear(d, h, bias=bias), nn.Tanh(), nn.Linear(h, h), nn.ReLU(),
                           nn.Linear(h, 3, bias=bias)).double()
    params = _params(module, seed)
    x, y = _data(seed, (b, d), 3)
    _check(module, params, x, y, clip)


@given(b=st.integers(1, 4), t=st.integers(1, 5), d=st.integers(1, 5), h=st.integers(1, 6),
       clip=st.floats(0.05, 5.0), seed=st.integers(0, 2**16))
def test_sequence_gram_form_matches_materialised(b, t, d, h, clip, seed):
    module = SeqNet(d, h, 3).double()
    params = _params(module, seed)
    x, y = _data(seed, (b, t, d), 3)
    _check(module, params, x, y, clip)


def test_extra_token_dims_and_both_norm_forms():
    # T=6 tokens: with h=3 the token layers take the materialised form (2 T^2 = 72 > 2*3, 3*3),
    # with h=40 the Gram form (72 <= 2*40, 40*40); a (B, 2, 3, d) input flattens (2, 3) into
    # the token dim.
    x, y = _data(3, (4, 6, 2), 3)
    for h in (3, 40):
        module = SeqNet(2, h, 3).double()
        norms = _check(module, _params(module, 3), x, y, clip=0.5)
        assert (norms > 0.5).any() and (norms > 0).all()  # clipping is active
    x4, _ = _data(4, (3, 2, 3, 2), 3)
    module4 = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Flatten(1), nn.Linear(24, 3)).double()
    p4 = _params(module4, 5)
    _check(module4, p4, x4, y[:3], clip=1.0)


def test_weights_mask_padding_rows():
    module = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    params = _params(module, 0)
    x, y = _data(0, (6, 3), 2)
    mask = torch.tensor([1, 1, 0, 1, 0, 1], dtype=torch.bool)
    res = ghost_clip_grads(_batched_loss(module), params, x, y, l2_norm_clip=0.3, weights=mask)
    _, want = _reference(module, params, x[mask], y[mask], 0.3)
    for k in want:
        torch.testing.assert_close(res.grads[k], want[k], rtol=1e-10, atol=1e-12)
    assert (res.norms[~mask] == 0).all()


def test_params_are_not_modified_and_no_hooks_left():
    module = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    params = _params(module, 1)
    before = {k: v.clone() for k, v in params.items()}
    x, y = _data(1, (5, 3), 2)
    ghost_clip_grads(_batched_loss(module), params, x, y, l2_norm_clip=1.0)
    for k in params:
        assert torch.equal(params[k], before[k]) and not params[k].requires_grad
    for m in module.modules():
        assert not m._forward_hooks and not m._backward_hooks and not m._forward_pre_hooks


def test_unsupported_models_raise():
    x, y = _data(0, (4, 3), 2)
    conv = nn.Sequential(nn.Unflatten(1, (1, 3)), nn.Conv1d(1, 2, 2), nn.Flatten(1),
                         nn.Linear(4, 2)).double()
    with pytest.raises(ValueError, match="Linear"):
        ghost_norms(_batched_loss(conv), _params(conv, 0), x, y)

    lin = nn.Linear(3, 3).double()
    p = _params(lin, 0)

    def tied(params, x, y):  # the same weight twice
        h = F.linear(torch.tanh(F.linear(x, params["weight"])), params["weight"], params["bias"])
        return F.cross_entropy(h, y, reduction="none")

    with pytest.raises(ValueError, match="more than once"):
        ghost_norms(tied, p, x, y)

    def mean_loss(params, x, y):
        return _batched_loss(lin)(params, x, y).mean()

    with pytest.raises(ValueError, match=r"per-example losses of shape \(B,\)"):
        ghost_norms(mean_loss, p, x, y)

    def unbatched(params, x, y):  # the batch is folded away before the Linear
        h = F.linear(x.reshape(2, 2, 3).sum(0), params["weight"], params["bias"])  # (2, 3)
        return h.sum(1).repeat(2)  # (4,)

    with pytest.raises(ValueError, match="leading dim"):
        ghost_norms(unbatched, p, x, y)

    def unused(params, x, y):
        return F.cross_entropy(F.linear(x, params["weight"]), y, reduction="none")

    with pytest.raises(ValueError, match="not used"):
        ghost_norms(unused, p, x, y)
    with pytest.raises(ValueError, match="l2_norm_clip"):
        ghost_clip_grads(_batched_loss(lin), p, x, y, l2_norm_clip=0.0)
    with pytest.raises(ValueError, match="weights must have shape"):
        ghost_clip_grads(_batched_loss(lin), p, x, y, l2_norm_clip=1.0, weights=torch.ones(3))


def test_works_through_torchfn_model():
    import torchfn
    from torchfn import random

    model = torchfn.Model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double())
    params = model.init(random.key(0))
    x, y = _data(2, (5, 4), 3)

    def batched(p, x, y):
        return F.cross_entropy(model.apply(p, x), y, reduction="none")

    def single(p, x, y):
        return F.cross_entropy(model.apply(p, x), y)

    grads = per_sample_grads(single)(params, x, y)
    want = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
    norms, _ = ghost_norms(batched, params, x, y)
    torch.testing.assert_close(norms, want, rtol=1e-10, atol=1e-12)
