"""The Laplace approximation: exact for Bayesian linear regression (precision and
predictive equal the closed-form posterior); for a small classifier the full GGN equals
a loop of ``Jᵀ (diag p - p pᵀ) J`` over the examples, the diagonal structure its
diagonal, and the low-rank structure at rank P the full one; the linearised predictive
covariance equals ``J H⁻¹ Jᵀ`` formed densely; far from the data a ReLU net's Laplace
confidence stays bounded where its MAP's goes to 1."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.functional as AF
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad

import torchfn
from torchfn import optim, random
from torchfn.transforms import (
    laplace,
    laplace_log_marginal,
    laplace_optimize_prior,
    laplace_predict,
)


def test_bayesian_linear_regression_is_exact():
    X = random.normal(random.key(0), (40, 4), dtype=torch.float64)
    w = random.normal(random.key(1), (4,), dtype=torch.float64)
    sigma, delta = 0.3, 2.0

    def f(params, x):
        return (x @ params["w"] + params["b"])[None]

    params = {"w": w, "b": torch.tensor(0.5, dtype=torch.float64)}
    post = laplace(f, params, X, likelihood="regression", prior_precision=delta,
                   sigma=sigma)
    Xb = torch.cat([torch.ones(40, 1, dtype=torch.float64), X], 1)  # optree order: b, w
    H = Xb.T @ Xb / sigma ** 2 + delta * torch.eye(5, dtype=torch.float64)
    torch.testing.assert_close(post.precision, H)
    x_new = random.normal(random.key(2), (3, 4), dtype=torch.float64)
    mean, cov = laplace_predict(post, f, x_new)
    xb = torch.cat([torch.ones(3, 1, dtype=torch.float64), x_new], 1)
    torch.testing.assert_close(mean[:, 0], x_new @ w + 0.5)
    want = (xb @ torch.linalg.solve(H, xb.T)).diagonal() + sigma ** 2
    torch.testing.assert_close(cov[:, 0, 0], want)


@pytest.mark.parametrize("delta", [0.1, 1.0, 10.0])
def test_log_marginal_is_the_exact_evidence_of_bayesian_linear_regression(delta):
    """At the posterior mean, the Laplace evidence is ``log N(y; 0, σ² I + X Xᵀ / δ)``."""
    X = random.normal(random.key(10), (30, 3), dtype=torch.float64)
    y = X @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.4 * random.normal(
        random.key(11), (30,), dtype=torch.float64)
    sigma = 0.4
    A = X.T @ X / sigma ** 2 + delta * torch.eye(3, dtype=torch.float64)
    w = torch.linalg.solve(A, X.T @ y / sigma ** 2)  # the MAP for this prior

    def f(w, x):
        return (x @ w)[None]

    log_lik = torch.distributions.Normal(X @ w, sigma).log_prob(y).sum()
    exact = torch.distributions.MultivariateNormal(
        torch.zeros(30, dtype=torch.float64),
        sigma ** 2 * torch.eye(30, dtype=torch.float64) + X @ X.T / delta).log_prob(y)
    for structure in ("full", "lowrank"):
        post = laplace(f, w, X, likelihood="regression", structure=structure, sigma=sigma,
                       prior_precision=delta, rank=3, key=random.key(12))
        torch.testing.assert_close(laplace_log_marginal(post, log_lik), exact)
    # fitted at another prior, evaluated at this one (θ* kept): the same formula
    other = laplace(f, w, X, likelihood="regression", sigma=sigma, prior_precision=3.0)
    torch.testing.assert_close(laplace_log_marginal(other, log_lik, delta), exact)
    d = torch.tensor(delta, dtype=torch.float64, requires_grad=True)
    g, = torch.autograd.grad(laplace_log_marginal(other, log_lik, d), d)
    assert torch.isfinite(g)


def _classifier(trained=False):
    """A 2-5-3 ReLU MLP (keyed init) and 12 inputs; ``trained``: fit by Adam to three
    Gaussian blobs first (the MAP the approximation sits at)."""
    net = nn.Sequential(nn.Linear(2, 5), nn.ReLU(), nn.Linear(5, 3))
    params = torchfn.tree.map(lambda t: t.double(), torchfn.Model(net).init(random.key(9)))
    net = net.double()
    centres = torch.tensor([[2.0, 0.0], [-1.0, 1.7], [-1.0, -1.7]], dtype=torch.float64)
    labels = torch.arange(12) % 3
    x = centres[labels] + 0.5 * random.normal(random.key(3), (12, 2), dtype=torch.float64)

    def f(p, x_one):
        return functional_call(net, p, (x_one,))

    if trained:
        tx = optim.adam(0.05)
        state = tx.init(params)

        def loss(p):
            return F.cross_entropy(functional_call(net, p, (x,)), labels) + 1e-3 * sum(
                (v ** 2).sum() for v in p.values())

        for _ in range(300):
            g = grad(loss)(params)
            updates, state = tx.update(g, state)
            params = optim.apply_updates(params, updates)
    return f, params, x


def _flat(params):
    return torch.cat([params[k].reshape(-1) for k in sorted(params)])


def _unflat(vec, like):
    out, i = {}, 0
    for k in sorted(like):
        out[k] = vec[i:i + like[k].numel()].reshape(like[k].shape)
        i += like[k].numel()
    return out


def test_full_ggn_equals_a_loop_over_examples():
    f, params, x = _classifier()
    post = laplace(f, params, x, structure="full", prior_precision=0.5)
    theta = _flat(params)
    P = theta.numel()
    H = 0.5 * torch.eye(P, dtype=torch.float64)
    for n in range(len(x)):
        J = AF.jacobian(lambda t, xn=x[n]: f(_unflat(t, params), xn), theta)  # (3, P)
        p = f(params, x[n]).softmax(-1)
        H += J.T @ (torch.diag(p) - torch.outer(p, p)) @ J
    torch.testing.assert_close(post.precision, H)
    diag = laplace(f, params, x, structure="diag", prior_precision=0.5)
    torch.testing.assert_close(diag.precision, H.diagonal())


def test_lowrank_at_full_rank_and_the_predictive_equal_dense_algebra():
    f, params, x = _classifier()
    full = laplace(f, params, x, structure="full")
    P = full.precision.shape[0]
    low = laplace(f, params, x, structure="lowrank", rank=P, key=random.key(4))
    x_new = random.normal(random.key(5), (4, 2), dtype=torch.float64) * 3
    probs_full, cov_full = laplace_predict(full, f, x_new)
    probs_low, cov_low = laplace_predict(low, f, x_new)
    torch.testing.assert_close(cov_low, cov_full, rtol=1e-6, atol=1e-9)
    theta = _flat(params)
    for m in range(4):
        J = AF.jacobian(lambda t, xm=x_new[m]: f(_unflat(t, params), xm), theta)
        torch.testing.assert_close(cov_full[m], J @ torch.linalg.solve(full.precision, J.T))
    torch.testing.assert_close(probs_full.sum(-1), torch.ones(4, dtype=torch.float64))
    # a low rank keeps the largest curvature: the predictive is never narrower than full
    small = laplace(f, params, x, structure="lowrank", rank=5, key=random.key(4))
    _, cov_small = laplace_predict(small, f, x_new)
    assert (cov_small.diagonal(dim1=-2, dim2=-1) >=
            cov_full.diagonal(dim1=-2, dim2=-1) - 1e-9).all()


def test_far_from_the_data_a_relu_nets_confidence_stays_bounded():
    """Kristiadi et al. (2020): scaling an input up, a ReLU net's MAP confidence goes to
    1, while the linearised Laplace predictive's stays bounded below 1."""
    f, params, x = _classifier(trained=True)
    post = laplace(f, params, x, prior_precision=1.0)
    for scale in (20.0, 100.0):
        probs, _ = laplace_predict(post, f, scale * x[:4])
        map_probs = torch.stack([f(params, scale * xi).softmax(-1) for xi in x[:4]])
        assert map_probs.max(-1).values.min() > 1 - 1e-6
        assert probs.max(-1).values.max() < 0.95


@pytest.mark.parametrize("call, match", [
    (lambda f, p, x: laplace(3, p, x), "apply_fn must be callable"),
    (lambda f, p, x: laplace(f, p, x, likelihood="poisson"), "likelihood must be one of"),
    (lambda f, p, x: laplace(f, p, x, structure="block"), "structure must be one of"),
    (lambda f, p, x: laplace(f, p, x, prior_precision=0.0), "prior_precision must be a "
     "positive float"),
    (lambda f, p, x: laplace(f, p, x, structure="lowrank"), "needs a key"),
    (lambda f, p, x: laplace(lambda q, x: f(q, x)[None], p, x), r"apply_fn must return "
     r"one example's output of shape \(O,\), got \(1, 3\)"),
    (lambda f, p, x: laplace_predict(p, f, x), "posterior must be a LaplacePosterior"),
    (lambda f, p, x: laplace_log_marginal(laplace(f, p, x), torch.zeros(2)),
     "log_likelihood must be a 0-d tensor"),
    (lambda f, p, x: laplace_log_marginal(laplace(f, p, x), torch.tensor(0.0), -1.0),
     "prior_precision must be a positive float, a 0-d tensor or a dict"),
    # a prior precision per param tensor
    (lambda f, p, x: laplace(f, p, x, prior_precision={"0.weight": 1.0}),
     r"must name each of the posterior's params \['0.bias', '0.weight', '2.bias', "
     r"'2.weight'\]; unknown \[\], missing \['0.bias', '2.bias', '2.weight'\]"),
    (lambda f, p, x: laplace(f, p, x, prior_precision=dict.fromkeys([*p, "fc.w"], 1.0)),
     r"unknown \['fc.w'\], missing \[\]"),
    (lambda f, p, x: laplace(f, p, x, prior_precision=dict(dict.fromkeys(p, 1.0),
                                                         **{"2.bias": 0})),
     r"prior_precision\['2.bias'\] must be a positive float, got 0"),
    (lambda f, p, x: laplace(f, p, x, structure="lowrank", key=random.key(0),
                             prior_precision=dict.fromkeys(p, 1.0)),
     "structure='lowrank' takes one prior_precision"),
    (lambda f, p, x: laplace_optimize_prior(laplace(f, p, x, structure="lowrank", rank=3,
                                                    key=random.key(0)), layerwise=True),
     "a 'lowrank' posterior has one prior precision"),
    (lambda f, p, x: laplace_optimize_prior(laplace(f, p, x), layerwise=1),
     "layerwise must be a bool, got 1"),
])
def test_bad_input_is_named(call, match):
    f, params, x = _classifier()
    with pytest.raises((TypeError, ValueError), match=match):
        call(f, params, x)


@pytest.mark.parametrize("structure", ["full", "diag", "lowrank", "kron"])
def test_optimized_prior_is_the_evidence_maximum(structure):
    """The bisection's ``δ`` equals scipy's bounded maximisation of the evidence itself,
    and the returned posterior is the one fitted at that ``δ``."""
    import scipy.optimize

    net = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    model = torchfn.Model(net)
    params = model.init(random.key(30))
    x = random.normal(random.key(31), (25, 2), dtype=torch.float64)
    kw = dict(structure=structure, rank=6, key=random.key(32))
    post = laplace(model, params, x, prior_precision=3.0, **kw)
    best = laplace_optimize_prior(post)
    ll = torch.tensor(0.0, dtype=torch.float64)

    def neg(t):
        return -float(laplace_log_marginal(post, ll, float(torch.tensor(t).exp())))

    res = scipy.optimize.minimize_scalar(neg, bounds=(-12.0, 12.0), method="bounded",
                                         options={"xatol": 1e-9})
    assert abs(torch.tensor(best.prior_precision).log().item() - res.x) < 1e-4
    refit = laplace(model, params, x, prior_precision=best.prior_precision, **kw)
    if structure in ("full", "diag"):
        torch.testing.assert_close(best.precision, refit.precision)
    torch.testing.assert_close(laplace_log_marginal(best, ll), laplace_log_marginal(refit, ll))
    with pytest.raises(ValueError, match=r"bounds must be \(low, high\) with 0 < low < high"):
        laplace_optimize_prior(post, bounds=(1.0, 0.5))


def test_a_prior_per_param_gives_the_exact_evidence_of_bayesian_linear_regression():
    """Two groups of weights with their own prior precisions: at the posterior mean the
    evidence is ``log N(y; 0, σ² I + X D⁻¹ Xᵀ)``, ``D`` the per-weight precisions."""
    X = random.normal(random.key(40), (30, 3), dtype=torch.float64)
    y = X @ torch.tensor([1.0, -2.0, 0.05], dtype=torch.float64) + 0.4 * random.normal(
        random.key(41), (30,), dtype=torch.float64)
    sigma, prior = 0.4, {"a": 0.2, "b": 30.0}
    d = torch.tensor([0.2, 0.2, 30.0], dtype=torch.float64)
    A = X.T @ X / sigma ** 2 + torch.diag(d)
    w = torch.linalg.solve(A, X.T @ y / sigma ** 2)  # the MAP for this prior

    def f(p, x):
        return (x[:2] @ p["a"] + x[2:] @ p["b"])[None]

    params = {"a": w[:2], "b": w[2:]}
    post = laplace(f, params, X, likelihood="regression", sigma=sigma, prior_precision=prior)
    torch.testing.assert_close(post.precision, A)
    log_lik = torch.distributions.Normal(X @ w, sigma).log_prob(y).sum()
    exact = torch.distributions.MultivariateNormal(
        torch.zeros(30, dtype=torch.float64),
        sigma ** 2 * torch.eye(30, dtype=torch.float64) + X @ torch.diag(1 / d) @ X.T)
    torch.testing.assert_close(laplace_log_marginal(post, log_lik), exact.log_prob(y))
    # fitted at one prior, evaluated at this one (θ* kept); and its diagonal structure
    other = laplace(f, params, X, likelihood="regression", sigma=sigma, prior_precision=1.0)
    torch.testing.assert_close(laplace_log_marginal(other, log_lik, prior), exact.log_prob(y))
    diag = laplace(f, params, X, likelihood="regression", sigma=sigma, prior_precision=prior,
                   structure="diag")
    torch.testing.assert_close(diag.precision, A.diagonal())


@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
def test_layerwise_prior_is_a_stationary_point_of_the_evidence(structure):
    """``layerwise=True``: the evidence's gradient in each ``log δ_l`` vanishes there (the
    joint blocks of ``"kron"`` move their weight's and bias's ``δ`` together), the
    evidence is at least the best single ``δ``'s, and the posterior is the one fitted at
    those precisions."""
    net = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    model = torchfn.Model(net)
    params = model.init(random.key(33))
    params = {n: v * (3.0 if n.startswith("2.") else 0.3) for n, v in params.items()}
    x = random.normal(random.key(34), (25, 2), dtype=torch.float64)
    post = laplace(model, params, x, prior_precision=3.0, structure=structure)
    best = laplace_optimize_prior(post, layerwise=True)
    one = laplace_optimize_prior(post)
    ll = torch.tensor(0.0, dtype=torch.float64)
    assert sorted(best.prior_precision) == sorted(params)
    assert best.prior_precision["0.weight"] > 5 * best.prior_precision["2.weight"]
    log_delta = {n: torch.tensor(best.prior_precision[n], dtype=torch.float64).log()
                 .requires_grad_() for n in ("0.weight", "0.bias", "2.weight", "2.bias")}
    if structure == "kron":  # a δ per [W | b] block
        log_delta["0.bias"], log_delta["2.bias"] = log_delta["0.weight"], log_delta["2.weight"]
        assert best.prior_precision["0.bias"] == best.prior_precision["0.weight"]
    delta = {n: v.exp() for n, v in log_delta.items()}
    if structure == "kron":
        delta["0.bias"], delta["2.bias"] = delta["0.weight"], delta["2.weight"]
    evidence = laplace_log_marginal(post, ll, delta)
    grads = torch.autograd.grad(evidence, list(dict.fromkeys(log_delta.values())))
    evidence = evidence.detach()
    assert max(float(g.abs()) for g in grads) < 1e-6
    assert float(evidence) >= float(laplace_log_marginal(one, ll)) - 1e-9
    refit = laplace(model, params, x, prior_precision=best.prior_precision,
                    structure=structure)
    if structure != "kron":
        torch.testing.assert_close(best.precision, refit.precision)
    torch.testing.assert_close(laplace_log_marginal(best, ll), laplace_log_marginal(refit, ll))
