"""EK-FAC and influence scores.

EK-FAC's eigenvalues are the curvature block's diagonal in the K-FAC eigenbasis, for
the GGN (exact), the empirical Fisher, and a convolution at many positions. Influence
scores equal dense algebra on the same blocks with per-example gradients from
``vmap(grad)``, for an MLP and a CNN; for a linear regression EK-FAC is the exact
Hessian, so the scores are Koh & Liang's ``∇ℓ_qᵀ (H + λ I)⁻¹ ∇ℓ_i``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

import torchfn
from torchfn import random
from torchfn.transforms import ekfac, influence, kfac

D = torch.float64


def _model(net, seed=0):
    net = net.to(D)
    model = torchfn.Model(net)
    params = model.init(random.key(seed))
    net.load_state_dict(params)
    return net.requires_grad_(False), model, params


def _block(tree, f, lead):
    """``tree``'s entries of a layer as ``(*lead, out (fan_in + 1))``."""
    w = tree[f.weight].reshape(*lead, f.QG.shape[0], -1)
    if f.bias is not None:
        w = torch.cat([w, tree[f.bias].reshape(*lead, -1, 1)], -1)
    return w.reshape(*lead, -1)


def _nets():
    mlp = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4))
    cnn = nn.Sequential(nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.Tanh(), nn.Flatten(),
                        nn.Linear(27, 4))
    return {"mlp": (mlp, (3,)), "cnn": (cnn, (2, 6, 6))}


@pytest.mark.parametrize("net_name", ["mlp", "cnn"])
@pytest.mark.parametrize("fisher", ["exact", "empirical"])
def test_eigenvalues_are_the_blocks_diagonal_in_the_kfac_basis(net_name, fisher):
    net, shape = _nets()[net_name]
    net, model, params = _model(net)
    x = random.normal(random.key(1), (9, *shape), dtype=D)
    y = torch.arange(9) % 4
    factors = ekfac(model, params, x, fisher=fisher, y=y)
    if fisher == "exact":  # Σ_n J_nᵀ Λ_n J_n
        J = vmap(jacrev(lambda p, xn: functional_call(net, p, (xn[None],))[0]),
                 in_dims=(None, 0))(params, x)  # {name: (N, O, ...)}
        p = net(x).softmax(-1)
        lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]  # (N, O, O)
    else:  # Σ_n ∇ℓ_n ∇ℓ_nᵀ
        J = vmap(grad(lambda p, xn, yn: F.cross_entropy(
            functional_call(net, p, (xn[None],)), yn[None])), in_dims=(None, 0, 0))(
            params, x, y)
    kron = kfac(model, params, x, fisher=fisher, y=y)
    for name, f in factors.items():
        Q = torch.kron(f.QG, f.QA)
        if fisher == "exact":
            Jb = _block(J, f, (9, 4))  # (N, O, P_layer)
            block = torch.einsum("nop,noq,nqr->pr", Jb, lam, Jb)
        else:
            g = _block(J, f, (9,))
            block = g.T @ g
        torch.testing.assert_close(f.eigenvalues.reshape(-1), (Q.T @ block @ Q).diagonal())
        assert f.num_examples == 9
        # the basis is K-FAC's: it diagonalises G ⊗ A
        KQ = Q.T @ torch.kron(kron[name].G, kron[name].A) @ Q
        torch.testing.assert_close(KQ - torch.diag(KQ.diagonal()), torch.zeros_like(KQ),
                                   atol=1e-10, rtol=0)


@pytest.mark.parametrize("net_name", ["mlp", "cnn"])
@pytest.mark.parametrize("damping", [None, 0.05])
def test_scores_equal_dense_algebra(net_name, damping):
    net, shape = _nets()[net_name]
    net, model, params = _model(net)
    x = random.normal(random.key(2), (12, *shape), dtype=D)
    y = torch.arange(12) % 4
    factors = ekfac(model, params, x)

    def loss_fn(out, y):
        return F.cross_entropy(out, y, reduction="none")

    scores = influence(model, params, factors, (x, y), (x[:3], y[:3]), loss_fn,
                       damping=damping, batch_size=5)
    g = vmap(grad(lambda p, xn, yn: loss_fn(functional_call(net, p, (xn[None],)),
                                            yn[None])[0]), in_dims=(None, 0, 0))(params, x, y)
    want = torch.zeros(3, 12, dtype=D)
    for f in factors.values():
        mean = f.eigenvalues / 12
        lam = 0.1 * mean.mean() if damping is None else damping
        Q = torch.kron(f.QG, f.QA)
        H = Q @ torch.diag(mean.reshape(-1) + lam) @ Q.T
        gb = _block(g, f, (12,))  # (N, P_layer)
        want += gb[:3] @ torch.linalg.solve(H, gb.T)
    torch.testing.assert_close(scores, want)


def test_linear_regression_scores_are_koh_and_liang():
    """One Linear layer, squared error: EK-FAC is the exact (mean) Hessian."""
    net, model, params = _model(nn.Linear(3, 2))
    x = random.normal(random.key(3), (20, 3), dtype=D)
    y = random.normal(random.key(4), (20, 2), dtype=D)
    sigma, lam = 0.5, 0.01

    def loss_fn(out, y):
        return 0.5 * ((out - y) ** 2).sum(-1) / sigma ** 2

    factors = ekfac(model, params, x, likelihood="regression", sigma=sigma)
    scores = influence(model, params, factors, (x, y), (x[:4], y[:4]), loss_fn, damping=lam)
    xb = torch.cat([x, torch.ones(20, 1, dtype=D)], 1)  # [W | b] row-major: (o, i)
    H = torch.kron(torch.eye(2, dtype=D), xb.T @ xb) / sigma ** 2 / 20
    resid = (net(x) - y) / sigma ** 2  # (N, O)
    g = (resid[:, :, None] * xb[:, None, :]).reshape(20, -1)  # ∇ℓ_n of vec([W | b])
    want = g[:4] @ torch.linalg.solve(H + lam * torch.eye(8, dtype=D), g.T)
    torch.testing.assert_close(scores, want)


def test_mc_eigenvalues_average_to_the_exact_ones():
    _, model, params = _model(nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)))
    x = random.normal(random.key(5), (8, 2), dtype=D)
    exact = ekfac(model, params, x)
    mc = ekfac(model, params, x, fisher="mc", key=random.key(6), mc_samples=4000)
    for name in exact:
        # the basis comes from the MC K-FAC: compare the basis-free total curvature
        torch.testing.assert_close(mc[name].eigenvalues.sum(), exact[name].eigenvalues.sum(),
                                   rtol=0.05, atol=0)


@pytest.mark.parametrize("call, match", [
    (lambda m, p, f, x, y: influence(lambda q, x: x, p, f, (x, y), (x, y), _ce),
     "model must be a torchfn.Model"),
    (lambda m, p, f, x, y: influence(m, p, kfac(m, p, x), (x, y), (x, y), _ce),
     "factors must be the dict of EKFACFactor"),
    (lambda m, p, f, x, y: influence(m, p, f, (x, y[:2]), (x, y), _ce),
     r"train must be a pair \(x \(n, ...\), y \(n, ...\)\) of tensors with the same "
     r"non-zero n, got \[\(4, 2\), \(2,\)\]"),
    (lambda m, p, f, x, y: influence(m, p, f, (x, y), x, _ce), "query must be a pair"),
    (lambda m, p, f, x, y: influence(m, p, f, (x, y), (x, y), 3), "loss_fn must be callable"),
    (lambda m, p, f, x, y: influence(m, p, f, (x, y), (x, y), _ce, damping=-1.0),
     "damping must be a float >= 0 or None"),
    (lambda m, p, f, x, y: influence(m, p, f, (x, y), (x, y), _ce, batch_size=0),
     "batch_size must be a positive int"),
    (lambda m, p, f, x, y: influence(m, p, f, (x, y), (x, y),
                                     lambda o, t: F.cross_entropy(o, t)),
     r"loss_fn must return one loss per example, shape \(4,\), got \(\)"),
    (lambda m, p, f, x, y: influence(m, p, {"7": f["0"]}, (x, y), (x, y), _ce),
     r"factors name layers \['7'\]"),
    (lambda m, p, f, x, y: ekfac(m, p, x, fisher="mc"), "fisher='mc' needs a key"),
])
def test_bad_input_is_named(call, match):
    _, model, params = _model(nn.Sequential(nn.Linear(2, 3)))
    x = random.normal(random.key(7), (4, 2), dtype=D)
    y = torch.arange(4) % 3
    factors = ekfac(model, params, x)
    with pytest.raises((TypeError, ValueError), match=match):
        call(model, params, factors, x, y)


def _ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def test_batch_not_first_is_named():
    class SeqFirst(nn.Module):  # runs its Linear on (T, n, d)
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 3)

        def forward(self, x):  # (n, T, 2) -> (n, 3)
            return self.fc(x.transpose(0, 1)).mean(0)

    _, model, params = _model(SeqFirst())
    x = random.normal(random.key(8), (4, 5, 2), dtype=D)
    with pytest.raises(ValueError, match=r"layer 'fc' ran on an input of shape \(5, 4, 2\); "
                                         r"per-example gradients need the batch \(4\) first"):
        ekfac(model, params, x)
