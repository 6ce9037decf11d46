"""Contrastive-divergence EBM loss."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchfn.losses import ebm_loss


@given(
    seed=st.integers(0, 2**31 - 1),
    n_pos=st.integers(1, 9),
    n_neg=st.integers(1, 9),
    alpha=st.sampled_from([0.0, 0.1, 1.0]),
)
def test_matches_formula_in_float64(seed, n_pos, n_neg, alpha):
    g = torch.Generator().manual_seed(seed)
    ep = torch.randn(n_pos, generator=g, dtype=torch.float64)
    en = torch.randn(n_neg, generator=g, dtype=torch.float64)
    expect = (
        sum(ep.tolist()) / n_pos
        - sum(en.tolist()) / n_neg
        + alpha
        * (sum(e * e for e in ep.tolist()) / n_pos + sum(e * e for e in en.tolist()) / n_neg)
    )
    torch.testing.assert_close(ebm_loss(ep, en, alpha=alpha).item(), expect, rtol=1e-12, atol=1e-12)


def test_gradient_lowers_data_energy_and_raises_negative_energy():
    # E_w(x) = w * x; data at x = 1, negatives at x = -1: descending the loss must lower the
    # energy of the data and raise that of the negatives.
    w = torch.tensor(0.0, requires_grad=True)
    xp, xn = torch.ones(8), -torch.ones(8)
    loss = ebm_loss(w * xp, w * xn, alpha=0.0)
    (g,) = torch.autograd.grad(loss, w)
    assert g.item() == pytest.approx(2.0)  # d/dw [mean(w) - mean(-w)]
    w2 = w.detach() - 0.1 * g
    assert (w2 * xp).mean() < (w * xp).mean() and (w2 * xn).mean() > (w * xn).mean()
    # the L2 term pulls energies towards 0: its gradient at w = 1 is positive
    w = torch.tensor(1.0, requires_grad=True)
    (g_reg,) = torch.autograd.grad(
        ebm_loss(w * xp, w * xn, alpha=1.0) - ebm_loss(w * xp, w * xn, alpha=0.0), w
    )
    assert g_reg.item() == pytest.approx(4.0)


def test_works_under_grad_and_vmap():
    params = torch.tensor([0.5, -1.0])
    xp, xn = torch.randn(6, 2, generator=torch.Generator().manual_seed(0)), torch.zeros(6, 2)
    energy = lambda p, x: (p * x).sum()  # one example
    loss = lambda p: ebm_loss(
        torch.func.vmap(energy, (None, 0))(p, xp),
        torch.func.vmap(energy, (None, 0))(p, xn),
        alpha=0.0,
    )
    torch.testing.assert_close(torch.func.grad(loss)(params), xp.mean(0) - xn.mean(0))


def test_bad_input():
    e = torch.ones(3)
    with pytest.raises(ValueError, match="alpha must be >= 0, got -1"):
        ebm_loss(e, e, alpha=-1.0)
    with pytest.raises(TypeError, match="energy_neg must be a floating-point Tensor"):
        ebm_loss(e, torch.ones(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="energy_pos must be a floating-point Tensor"):
        ebm_loss([1.0], e)
    with pytest.raises(ValueError, match="energy_pos must not be empty"):
        ebm_loss(torch.ones(0), e)
