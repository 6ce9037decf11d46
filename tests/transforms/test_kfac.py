"""K-FAC and the Kronecker-factored Laplace approximation.

For one example K-FAC is the exact GGN block (``G ⊗ A`` = ``Σ_c (g_c ⊗ ā)(g_c ⊗ ā)ᵀ``),
for a Linear and for a Conv2d whose kernel covers its input; for a layer at many
positions its factors equal ``Σ ā āᵀ / N T`` and ``Σ g gᵀ`` built from patches cut by
hand and output gradients from ``jacrev`` of the rest of the network; for a
regression network's last layer it is exact for any N. The MC Fisher's ``G`` averages
to the exact one; batching changes nothing. The ``"kron"`` posterior's solves,
log-determinant and predictive equal dense algebra on the same block matrix, and for
Bayesian linear regression it is the exact posterior and evidence. A ``subset``
posterior (laplace-torch's last layer) is the corresponding block of the whole one;
posterior draws of every structure have the posterior's mean and covariance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev

import torchfn
from torchfn import random
from torchfn.transforms import (
    kfac,
    laplace,
    laplace_log_marginal,
    laplace_predict,
    laplace_sample,
)

D = torch.float64


def _model(net, seed=0):
    net = net.to(D)
    model = torchfn.Model(net)
    params = model.init(random.key(seed))
    net.load_state_dict(params)  # the module holds the same values, for the references
    return net.requires_grad_(False), model, params


def _lam(likelihood, out, sigma=1.0):
    if likelihood == "regression":
        return torch.eye(out.shape[-1], dtype=D) / sigma ** 2
    p = out.softmax(-1)
    return torch.diag(p) - torch.outer(p, p)


def _block(J, f):
    """The columns of the Jacobian ``J {name: (O, *shape)}`` for ``vec([W | b])``."""
    w = J[f.weight].reshape(J[f.weight].shape[0], J[f.weight].shape[1], -1)  # (O, out, fan_in)
    if f.bias is not None:
        w = torch.cat([w, J[f.bias][..., None]], -1)
    return w.reshape(w.shape[0], -1)  # (O, out (fan_in + 1))


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_one_example_is_the_exact_ggn_block(likelihood):
    net, model, params = _model(nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4),
                                              nn.Softplus(), nn.Linear(4, 3, bias=False)))
    x = random.normal(random.key(1), (1, 3), dtype=D)
    factors = kfac(model, params, x, likelihood=likelihood, sigma=0.7)
    assert list(factors) == ["0", "2", "4"] and factors["4"].bias is None
    J = jacrev(lambda p: functional_call(net, p, (x,))[0])(params)
    lam = _lam(likelihood, net(x)[0].detach(), 0.7)
    for f in factors.values():
        Jb = _block(J, f)
        torch.testing.assert_close(torch.kron(f.G, f.A), Jb.T @ lam @ Jb)


def test_conv_whose_kernel_covers_the_input_is_exact_for_one_example():
    net, model, params = _model(nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten(),
                                              nn.Tanh(), nn.Linear(4, 3)))
    x = random.normal(random.key(2), (1, 2, 3, 3), dtype=D)
    f = kfac(model, params, x)["0"]
    J = jacrev(lambda p: functional_call(net, p, (x,))[0])(params)
    Jb = _block(J, f)
    torch.testing.assert_close(torch.kron(f.G, f.A), Jb.T @ _lam("c", net(x)[0].detach()) @ Jb)


def test_conv_at_many_positions_is_k_fac_expand():
    """Factors from patches cut by hand and from ``jacrev`` of the network after the
    convolution (stride 2, padding 1: 9 positions per example)."""
    conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
    rest = nn.Sequential(nn.ReLU(), nn.Flatten(), nn.Linear(27, 4))
    net, model, params = _model(nn.Sequential(conv, *rest))
    rest = rest.to(D)
    x = random.normal(random.key(3), (5, 2, 6, 6), dtype=D)
    f = kfac(model, params, x)["0"]
    padded = F.pad(x, (1, 1, 1, 1))
    patches = torch.stack([padded[:, :, i:i + 3, j:j + 3].reshape(5, -1)
                           for i in range(0, 6, 2) for j in range(0, 6, 2)], 1)  # (5, 9, 18)
    a = torch.cat([patches, torch.ones(5, 9, 1, dtype=D)], -1).reshape(45, 19)
    torch.testing.assert_close(f.A, a.T @ a / 45)
    G = torch.zeros(3, 3, dtype=D)
    s = net[0](x).detach()  # (5, 3, 3, 3)
    for n in range(5):
        out = rest(s[n:n + 1])[0].detach()
        J = jacrev(lambda t: rest(t[None])[0])(s[n])  # (O, 3, 3, 3)
        w, V = torch.linalg.eigh(_lam("c", out))  # any square root of Λ: V √w
        cols = V * w.clamp(min=0).sqrt()  # (O, O)
        g = torch.einsum("okhw,oc->chwk", J, cols).reshape(-1, 3)  # (O · 9 positions, out)
        G += g.T @ g
    torch.testing.assert_close(f.G, G)


def test_regression_last_layer_is_exact_for_many_examples():
    net, model, params = _model(nn.Sequential(nn.Linear(3, 5), nn.GELU(), nn.Linear(5, 2)))
    x = random.normal(random.key(4), (30, 3), dtype=D)
    f = kfac(model, params, x, likelihood="regression", sigma=0.5)["2"]
    J = torch.func.vmap(jacrev(lambda p, xn: functional_call(net, p, (xn,))),
                        in_dims=(None, 0))(params, x)
    Jb = torch.stack([_block({k: v[n] for k, v in J.items()}, f) for n in range(30)])
    torch.testing.assert_close(torch.kron(f.G, f.A),
                               torch.einsum("nop,noq->pq", Jb, Jb) / 0.25)


def test_mc_fisher_averages_to_the_exact_factor_and_batching_changes_nothing():
    net, model, params = _model(nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)))
    x = random.normal(random.key(5), (8, 2), dtype=D)
    exact = kfac(model, params, x)
    mc = kfac(model, params, x, fisher="mc", key=random.key(6), mc_samples=3000)
    again = kfac(model, params, x, fisher="mc", key=random.key(6), mc_samples=3000)
    chunked = kfac(model, params, x, batch_size=3)
    for name in exact:
        torch.testing.assert_close(mc[name].A, exact[name].A)
        torch.testing.assert_close(mc[name].G, again[name].G, rtol=0, atol=0)
        scale = exact[name].G.abs().max()
        assert (mc[name].G - exact[name].G).abs().max() < 0.08 * scale
        torch.testing.assert_close(chunked[name].A, exact[name].A)
        torch.testing.assert_close(chunked[name].G, exact[name].G)
    one = kfac(model, params, x, fisher="mc", key=random.key(7))
    assert (one["2"].G - exact["2"].G).abs().max() > 1e-3 * scale  # a real sample


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_empirical_fisher_of_one_example_is_its_gradients_outer_product(likelihood):
    net, model, params = _model(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)))
    x = random.normal(random.key(30), (1, 3), dtype=D)
    y = (torch.tensor([2]) if likelihood == "classification" else
         random.normal(random.key(31), (1, 3), dtype=D))

    def loss(p):
        out = functional_call(net, p, (x,))
        if likelihood == "classification":
            return F.cross_entropy(out, y, reduction="sum")
        return 0.5 * ((out - y) ** 2).sum() / 0.3 ** 2

    g = torch.func.grad(loss)(params)
    for f in kfac(model, params, x, likelihood=likelihood, sigma=0.3, fisher="empirical",
                  y=y).values():
        v = torch.cat([g[f.weight], g[f.bias][:, None]], 1).reshape(-1)
        torch.testing.assert_close(torch.kron(f.G, f.A), torch.outer(v, v))


def test_separate_bias_splits_the_joint_block():
    net, model, params = _model(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    x = random.normal(random.key(8), (6, 3), dtype=D)
    joint = kfac(model, params, x)
    split = kfac(model, params, x, separate_bias=True)
    assert list(split) == ["0", "0.bias", "2", "2.bias"]
    for name in joint:
        torch.testing.assert_close(split[name].A, joint[name].A[:-1, :-1])
        torch.testing.assert_close(split[name + ".bias"].G, joint[name].G)
        torch.testing.assert_close(split[name + ".bias"].A, torch.ones(1, 1, dtype=D))


def _prior_diag(prior, params):
    """``(P,)``: each param's prior precision (one, or ``{name: δ}``), in name order."""
    return torch.cat([torch.full((params[n].numel(),), prior[n] if isinstance(prior, dict)
                                 else prior, dtype=D) for n in sorted(params)])


def _dense_kron(post, params):
    """The ``"kron"`` posterior's precision as a dense ``(P, P)`` matrix."""
    names = sorted(params)
    start = dict(zip(names, torch.tensor([0] + [params[n].numel() for n in names]).cumsum(0)
                     .tolist()))
    H = torch.diag(_prior_diag(post.prior_precision, params))
    for f in post.precision.factors.values():
        out = f.G.shape[0]
        idx = torch.arange(start[f.weight], start[f.weight] + params[f.weight].numel())
        idx = idx.reshape(out, -1)
        if f.bias is not None:
            idx = torch.cat([idx, torch.arange(start[f.bias], start[f.bias] + out)[:, None]], 1)
        idx = idx.reshape(-1)
        H[idx[:, None], idx[None, :]] += torch.kron(f.G, f.A)
    for n, d in post.precision.diag.items():
        i = torch.arange(start[n], start[n] + d.numel())
        H[i, i] += d
    return H


# a prior precision per param tensor: the joint [W | b] blocks need one per layer
LAYERWISE = {"0.weight": 0.3, "0.bias": 0.3, "2.weight": 2.0, "2.bias": 5.0,
             "3.weight": 1.5, "3.bias": 1.5}


@pytest.mark.parametrize("separate_bias, prior", [
    (False, 0.7), (True, 0.7), (False, LAYERWISE),
    (True, dict(LAYERWISE, **{"0.bias": 4.0, "3.bias": 0.2}))])
def test_kron_posterior_equals_dense_algebra(separate_bias, prior):
    """Solves, the predictive and the evidence against the same block matrix formed
    densely; the LayerNorm's params (no factor) get the full GGN's diagonal. One prior
    precision, or one per param tensor."""
    net, model, params = _model(nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.LayerNorm(5),
                                              nn.Linear(5, 4)))
    x = random.normal(random.key(9), (20, 3), dtype=D)
    post = laplace(model, params, x, structure="kron", prior_precision=prior,
                   separate_bias=separate_bias)
    full = laplace(model, params, x, structure="full", prior_precision=prior)
    assert sorted(post.precision.diag) == ["2.bias", "2.weight"]
    H = _dense_kron(post, params)
    names = sorted(params)
    ln = torch.cat([torch.full((params[n].numel(),), n.startswith("2."), dtype=torch.bool)
                    for n in names])
    torch.testing.assert_close(H.diagonal()[ln], full.precision.diagonal()[ln])
    x_new = random.normal(random.key(10), (4, 3), dtype=D)
    probs, cov = laplace_predict(post, model, x_new)
    theta = torch.cat([params[n].reshape(-1) for n in names])

    def unflat(t):
        pieces = t.split([params[n].numel() for n in names])
        return {n: v.reshape(params[n].shape) for n, v in zip(names, pieces)}

    for m in range(4):
        J = jacrev(lambda t, xm=x_new[m]: functional_call(net, unflat(t), (xm[None],))[0])(
            theta)  # (O, P)
        torch.testing.assert_close(cov[m], J @ torch.linalg.solve(H, J.T))
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, dtype=D))
    ll = torch.tensor(-5.0, dtype=D)
    ggn = H - torch.diag(_prior_diag(prior, params))
    for delta in (prior, 3.0, {n: 0.5 + i for i, n in enumerate(LAYERWISE)}):
        if isinstance(delta, dict) and not separate_bias:  # one δ per [W | b] block
            delta = {n: delta[n.split(".")[0] + ".weight"] for n in delta}
        vec = _prior_diag(delta, params)
        want = (ll - 0.5 * (vec * theta.square()).sum() + 0.5 * vec.log().sum()
                - 0.5 * torch.linalg.slogdet(ggn + torch.diag(vec))[1])
        torch.testing.assert_close(laplace_log_marginal(post, ll, delta), want)


def test_kron_is_exact_for_bayesian_linear_regression():
    net, model, params = _model(nn.Linear(3, 1))
    X = random.normal(random.key(11), (40, 3), dtype=D)
    y = X @ torch.tensor([1.0, -2.0, 0.5], dtype=D) + 0.3 + 0.4 * random.normal(
        random.key(12), (40,), dtype=D)
    sigma, delta = 0.4, 2.0
    Xb = torch.cat([torch.ones(40, 1, dtype=D), X], 1)  # optree order: bias, weight
    A = Xb.T @ Xb / sigma ** 2 + delta * torch.eye(4, dtype=D)
    w = torch.linalg.solve(A, Xb.T @ y / sigma ** 2)
    params = {"bias": w[:1], "weight": w[1:][None]}
    post = laplace(model, params, X, likelihood="regression", structure="kron",
                   sigma=sigma, prior_precision=delta)
    x_new = random.normal(random.key(13), (3, 3), dtype=D)
    mean, cov = laplace_predict(post, model, x_new)
    xb = torch.cat([torch.ones(3, 1, dtype=D), x_new], 1)
    torch.testing.assert_close(mean[:, 0], xb @ w)
    torch.testing.assert_close(cov[:, 0, 0], (xb @ torch.linalg.solve(A, xb.T)).diagonal()
                               + sigma ** 2)
    log_lik = torch.distributions.Normal(Xb @ w, sigma).log_prob(y).sum()
    exact = torch.distributions.MultivariateNormal(
        torch.zeros(40, dtype=D),
        sigma ** 2 * torch.eye(40, dtype=D) + Xb @ Xb.T / delta).log_prob(y)
    torch.testing.assert_close(laplace_log_marginal(post, log_lik), exact)


def _index(params, names):
    """Positions of ``names``' entries in the flat vector (sorted-name order)."""
    out, start = [], 0
    for n in sorted(params):
        if n in names:
            out.append(torch.arange(start, start + params[n].numel()))
        start += params[n].numel()
    return torch.cat(out)


def test_a_subset_is_the_block_of_the_whole_posterior():
    net, model, params = _model(nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)))
    x = random.normal(random.key(20), (15, 3), dtype=D)
    last = ["2.bias", "2.weight"]
    whole = laplace(model, params, x, prior_precision=0.5)
    sub = laplace(model, params, x, prior_precision=0.5, subset=last)
    i = _index(params, last)
    torch.testing.assert_close(sub.precision, whole.precision[i[:, None], i[None, :]])
    assert sorted(sub.params) == last and sorted(sub.fixed) == ["0.bias", "0.weight"]
    x_new = random.normal(random.key(21), (3, 3), dtype=D)
    _, cov = laplace_predict(sub, model, x_new)
    theta = torch.cat([params[n].reshape(-1) for n in last])
    for m in range(3):
        J = jacrev(lambda t, xm=x_new[m]: functional_call(
            net, {**params, "2.bias": t[:4], "2.weight": t[4:].reshape(4, 5)},
            (xm[None],))[0])(theta)  # (O, 24)
        torch.testing.assert_close(cov[m], J @ torch.linalg.solve(sub.precision, J.T))
    ll = torch.tensor(-2.0, dtype=D)
    want = (ll - 0.25 * theta.square().sum() + 12 * torch.log(torch.tensor(0.5, dtype=D))
            - 0.5 * torch.linalg.slogdet(sub.precision)[1])
    torch.testing.assert_close(laplace_log_marginal(sub, ll), want)
    kron = laplace(model, params, x, structure="kron", subset=last)
    (name, f), = kron.precision.factors.items()
    g = kfac(model, params, x)["2"]
    assert name == "2" and not kron.precision.diag
    assert list(kfac(model, params, x, layers=["2"])) == ["2"]
    torch.testing.assert_close((f.A, f.G), (g.A, g.G))


@pytest.mark.parametrize("structure", ["full", "diag", "lowrank", "kron"])
def test_draws_have_the_posterior_mean_and_covariance(structure):
    net, model, params = _model(nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.LayerNorm(3),
                                              nn.Linear(3, 3)))
    x = random.normal(random.key(22), (10, 2), dtype=D)
    post = laplace(model, params, x, structure=structure, prior_precision=0.8, rank=6,
                   key=random.key(23))
    names = sorted(params)
    P = sum(params[n].numel() for n in names)
    if structure == "full":
        H = post.precision
    elif structure == "diag":
        H = torch.diag(post.precision)
    elif structure == "lowrank":
        U, lam = post.precision
        H = U @ torch.diag(lam) @ U.T + 0.8 * torch.eye(P, dtype=D)
    else:
        H = _dense_kron(post, params)
    draws = laplace_sample(post, random.key(24), 40000)
    assert {n: tuple(v.shape) for n, v in draws.items()} == {
        n: (40000, *params[n].shape) for n in names}
    flat = torch.cat([draws[n].reshape(40000, -1) for n in names], 1)  # (S, P)
    theta = torch.cat([params[n].reshape(-1) for n in names])
    C = torch.linalg.inv(H)
    scale = C.diagonal().max()
    assert ((flat.mean(0) - theta).abs() < 0.03 * scale.sqrt()).all()
    assert (torch.cov(flat.T) - C).abs().max() < 0.03 * scale


@pytest.mark.parametrize("call, match", [
    (lambda m, p, x: laplace(m, p, x, subset="2.weight"), "subset must be a list of param"),
    (lambda m, p, x: laplace(m, p, x, subset=["fc.weight"]), r"subset must name params "
     r"among \['0.bias', '0.weight'\], got \['fc.weight'\]"),
    (lambda m, p, x: laplace(m, p, x, subset=[]), "subset must name params"),
    (lambda m, p, x: laplace(m, list(p.values()), x, subset=["0.bias"]),
     "subset needs params to be a dict"),
    (lambda m, p, x: laplace(m, p, x, structure="kron", subset=["0.weight"]),
     r"subset holds \['0.weight'\] but not \['0.bias'\] of layer '0'"),
    (lambda m, p, x: laplace_sample(laplace(m, p, x), random.key(0), 0),
     "num_samples must be a positive int"),
    (lambda m, p, x: laplace_sample(p, random.key(0), 2), "posterior must be a LaplacePosterior"),
    (lambda m, p, x: kfac(lambda q, x: x, p, x), "model must be a torchfn.Model"),
    (lambda m, p, x: kfac(m, p, x, layers=["1"]), r"layers must name some of the model's "
     r"Linear/Conv2d layers \['0'\], got \['1'\]"),
    (lambda m, p, x: kfac(m, p, x, layers="0"), "layers must name"),
    (lambda m, p, x: kfac(m, p, x, likelihood="poisson"), "likelihood must be one of"),
    (lambda m, p, x: kfac(m, p, x, fisher="observed"), "fisher must be one of"),
    (lambda m, p, x: kfac(m, p, x, fisher="empirical"), r"fisher='empirical' needs the "
     r"targets y, one per example \(4\), got NoneType"),
    (lambda m, p, x: kfac(m, p, x, fisher="mc"), "fisher='mc' needs a key"),
    (lambda m, p, x: kfac(m, p, x, mc_samples=0), "mc_samples must be a positive int"),
    (lambda m, p, x: kfac(m, p, x, batch_size=1.5), "batch_size must be a positive int"),
    (lambda m, p, x: kfac(m, p, x[:0]), r"x must be a non-empty batch"),
    (lambda m, p, x: kfac(m, list(p.values()), x), "params must be the model's params dict"),
    (lambda m, p, x: kfac(torchfn.Model(nn.Tanh()), {}, x), "has no nn.Linear or nn.Conv2d"),
    (lambda m, p, x: kfac(torchfn.Model(nn.Conv2d(2, 2, 1, groups=2)), {}, x),
     r"Conv2d '' has groups=2"),
    (lambda m, p, x: kfac(torchfn.Model(nn.Sequential(nn.Linear(2, 3), nn.Flatten(0))),
                          None, x), "params must be"),
    (lambda m, p, x: laplace(lambda q, x1: m(q, x1[None])[0], p, x, structure="kron"),
     "structure='kron' needs apply_fn to be a torchfn.Model"),
])
def test_bad_input_is_named(call, match):
    _, model, params = _model(nn.Sequential(nn.Linear(2, 3)))
    x = random.normal(random.key(14), (4, 2), dtype=D)
    with pytest.raises((TypeError, ValueError), match=match):
        call(model, params, x)


def test_output_that_is_not_one_row_per_example_is_named():
    _, model, params = _model(nn.Sequential(nn.Linear(2, 3), nn.Flatten(0)))
    x = random.normal(random.key(15), (4, 2), dtype=D)
    with pytest.raises(ValueError, match=r"must return outputs of shape \(n, O\) for a "
                                         r"batch of n = 4, got \(12,\)"):
        kfac(model, params, x)


def test_batchnorm_state_is_threaded_through_in_eval_mode():
    """A CNN with BatchNorm (running statistics not the defaults): K-FAC of one example is
    the GGN block of the network evaluated with that state; the ``"kron"`` posterior's
    BatchNorm params get the full GGN's diagonal, the predictive runs with the state."""
    net = nn.Sequential(nn.Conv2d(2, 3, 4), nn.BatchNorm2d(3), nn.Tanh(), nn.Flatten(),
                        nn.Linear(3, 4)).to(D)  # the kernel covers the input: exact
    model = torchfn.Model(net)
    params = model.init(random.key(40))
    state = model.init_state()
    state["1.running_mean"] = random.normal(random.key(41), (3,), dtype=D)
    state["1.running_var"] = 0.5 + random.uniform(random.key(42), (3,), dtype=D)
    x = random.normal(random.key(43), (1, 2, 4, 4), dtype=D)
    net.eval()
    J = jacrev(lambda p: functional_call(net, {**p, **state}, (x,))[0])(params)
    lam = _lam("c", functional_call(net, {**params, **state}, (x,))[0].detach())
    for f in kfac(model, params, x, state=state).values():
        Jb = _block(J, f)
        torch.testing.assert_close(torch.kron(f.G, f.A), Jb.T @ lam @ Jb)
    xs = random.normal(random.key(44), (6, 2, 4, 4), dtype=D)
    post = laplace(model, params, xs, structure="kron", state=state)
    full = laplace(model, params, xs, structure="diag", state=state)
    i = _index(params, ["1.bias", "1.weight"])
    torch.testing.assert_close(torch.cat([post.precision.diag[n] for n in ("1.bias", "1.weight")]),
                               full.precision[i] - 1.0)
    probs, _ = laplace_predict(post, model, xs[:2], state=state)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, dtype=D))
    with pytest.raises(ValueError, match="state"):
        kfac(model, params, x)
    with pytest.raises(ValueError, match="state is for a torchfn.Model's buffers"):
        laplace(lambda p, x1: x1, params, xs, state=state)
