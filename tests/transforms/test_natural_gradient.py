"""K-FAC as an optimizer: one undamped step solves linear least squares (Gauss-Newton is
Newton there, and K-FAC is exact for one layer); the preconditioned gradient equals the
damped Kronecker product's solve formed densely, with Martens & Grosse's π; the running
averages and the inverse schedule follow their definitions; nothing is mutated."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchfn
from torchfn import random
from torchfn.transforms import kfac, kfac_curvature, kfac_precondition

D = torch.float64


def test_one_undamped_step_solves_least_squares():
    model = torchfn.Model(nn.Linear(4, 2).to(D))
    params = model.init(random.key(0))
    x = random.normal(random.key(1), (30, 4), dtype=D) * torch.tensor([10.0, 1, 0.1, 1],
                                                                      dtype=D)
    y = random.normal(random.key(2), (30, 2), dtype=D)

    def loss(p):
        return 0.5 * ((model(p, x) - y) ** 2).sum(-1).mean()

    state = kfac_curvature(None, model, params, x, likelihood="regression", fisher="exact",
                           damping=0.0)
    step = kfac_precondition(state, torch.func.grad(loss)(params))
    new = {k: params[k] - step[k] for k in params}
    xb = torch.cat([x, torch.ones(30, 1, dtype=D)], 1)
    sol = torch.linalg.lstsq(xb, y).solution  # (5, 2)
    torch.testing.assert_close(new["weight"], sol[:4].T)
    torch.testing.assert_close(new["bias"], sol[4])


def test_preconditioning_is_the_damped_kronecker_solve():
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.LayerNorm(5), nn.Linear(5, 4)).to(D)
    model = torchfn.Model(net)
    params = model.init(random.key(3))
    x = random.normal(random.key(4), (16, 3), dtype=D)
    damping = 0.05
    state = kfac_curvature(None, model, params, x, key=random.key(5), damping=damping)
    grads = {k: random.normal(random.fold_in(random.key(6), i), tuple(v.shape), dtype=D)
             for i, (k, v) in enumerate(sorted(params.items()))}
    before = {k: v.clone() for k, v in grads.items()}
    step = kfac_precondition(state, grads)
    batch = kfac(model, params, x, fisher="mc", key=random.key(5))
    for f in batch.values():
        A, G = f.A, f.G / 16
        pi = ((A.trace() / len(A)) / (G.trace() / len(G))).sqrt()
        Ad = A + pi * damping ** 0.5 * torch.eye(len(A), dtype=D)
        Gd = G + damping ** 0.5 / pi * torch.eye(len(G), dtype=D)
        g = torch.cat([grads[f.weight], grads[f.bias][:, None]], 1).reshape(-1)
        want = torch.linalg.solve(torch.kron(Gd, Ad), g).reshape(len(G), -1)
        torch.testing.assert_close(step[f.weight], want[:, :-1])
        torch.testing.assert_close(step[f.bias], want[:, -1])
    for n in ("2.weight", "2.bias"):  # the LayerNorm keeps its gradient
        assert step[n] is grads[n]
    for k in grads:
        assert torch.equal(grads[k], before[k])


def test_running_averages_and_the_inverse_schedule():
    model = torchfn.Model(nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 2)).to(D))
    params = model.init(random.key(7))
    xs = [random.normal(random.key(10 + i), (8, 2), dtype=D) for i in range(3)]
    kw = dict(fisher="exact", decay=0.9, damping=0.01, inverse_every=2)
    s1 = kfac_curvature(None, model, params, xs[0], **kw)
    s2 = kfac_curvature(s1, model, params, xs[1], **kw)
    s3 = kfac_curvature(s2, model, params, xs[2], **kw)
    assert [int(s.count) for s in (s1, s2, s3)] == [1, 2, 3]
    f1, f2 = (kfac(model, params, x, fisher="exact") for x in xs[:2])
    for n in f1:
        torch.testing.assert_close(s2.factors[n].A, 0.9 * f1[n].A + 0.1 * f2[n].A)
        torch.testing.assert_close(s2.factors[n].G, (0.9 * f1[n].G + 0.1 * f2[n].G) / 8)
        assert s2.inverses[n] is s1.inverses[n]  # not due: the stale inverses
        fresh = kfac_curvature(None, model, params, xs[0], **kw)  # s1's inputs again
        torch.testing.assert_close(s1.factors[n].A, fresh.factors[n].A)
        A, G = s3.factors[n].A, s3.factors[n].G  # due again: inverted from s3's averages
        pi = ((A.trace() / len(A)) / (G.trace() / len(G))).sqrt()
        torch.testing.assert_close(s3.inverses[n][1],
                                   torch.linalg.inv(A + pi * 0.1 * torch.eye(len(A), dtype=D)))
        torch.testing.assert_close(s3.inverses[n][0],
                                   torch.linalg.inv(G + 0.1 / pi * torch.eye(len(G), dtype=D)))


def test_kfac_with_sgd_learns_a_classifier():
    """A few K-FAC-preconditioned SGD steps (MC Fisher, keyed) fit separable blobs."""
    from torchfn import optim

    model = torchfn.Model(nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 3)))
    params = model.init(random.key(20))
    centres = torch.tensor([[3.0, 0.0], [-1.5, 2.6], [-1.5, -2.6]])
    y = torch.arange(90) % 3
    x = centres[y] + 0.5 * random.normal(random.key(21), (90, 2))

    def loss(p):
        return F.cross_entropy(model(p, x), y)

    tx = optim.sgd(0.5, momentum=0.9)
    opt = tx.init(params)
    state, start = None, float(loss(params))
    for step in range(15):
        state = kfac_curvature(state, model, params, x, key=random.fold_in(random.key(22),
                                                                            step))
        updates, opt = tx.update(kfac_precondition(state, torch.func.grad(loss)(params)),
                                 opt, params)
        params = optim.apply_updates(params, updates)
    assert float(loss(params)) < 0.05 * start
    assert (model(params, x).argmax(-1) == y).all()


@pytest.mark.parametrize("call, match", [
    (lambda m, p, x: kfac_curvature(3, m, p, x, key=random.key(0)),
     "state must be a KFACState or None"),
    (lambda m, p, x: kfac_curvature(None, m, p, x, key=random.key(0), decay=1.0),
     r"decay must be a float in \[0, 1\), got 1.0"),
    (lambda m, p, x: kfac_curvature(None, m, p, x, key=random.key(0), damping=-1.0),
     "damping must be a float >= 0"),
    (lambda m, p, x: kfac_curvature(None, m, p, x, key=random.key(0), inverse_every=0),
     "inverse_every must be a positive int"),
    (lambda m, p, x: kfac_curvature(None, m, p, x), "fisher='mc' needs a key"),
    (lambda m, p, x: kfac_precondition(p, p), "state must be a KFACState"),
    (lambda m, p, x: kfac_precondition(kfac_curvature(None, m, p, x, key=random.key(0)),
                                       {"0.weight": p["0.weight"]}),
     r"grads lack \['0.bias'\] of layer '0'"),
])
def test_bad_input_is_named(call, match):
    model = torchfn.Model(nn.Sequential(nn.Linear(2, 3)))
    params = model.init(random.key(0))
    x = random.normal(random.key(1), (4, 2))
    with pytest.raises((TypeError, ValueError), match=match):
        call(model, params, x)
