"""VAE ELBO: equals the manual reparameterised formula with the same key; the KL closed
form agrees with a Monte Carlo estimate; gradients reach the encoder through z."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributions import Bernoulli, Normal, kl_divergence

import torchfn
from torchfn import random
from torchfn.losses import gaussian_kl, vae_elbo
from torchfn.models import MLPVAE

D, Z = 5, 2


def make_params(seed, d=D, z=Z):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) / s[-1] ** 0.5  # noqa: E731
    return {"we": r(2 * z, d), "be": r(2 * z), "wd": r(2 * d, z), "bd": r(2 * d)}


def encode(p, x):  # (B, D) -> (B, Z), (B, Z)
    h = x @ p["we"].T + p["be"]
    return h[:, :Z], h[:, Z:]


def decode(p, z):  # (B, Z) -> logits / mean (B, D)
    return (z @ p["wd"].T + p["bd"])[:, :D]


def decode_mean_logvar(p, z):
    h = z @ p["wd"].T + p["bd"]
    return h[:, :D], h[:, D:]


def manual_elbo(p, x, key, likelihood, beta, dec):
    mean, logvar = encode(p, x)
    eps = random.normal(key, mean.shape, dtype=mean.dtype)
    z = mean + (0.5 * logvar).exp() * eps
    out = dec(p, z)
    if likelihood == "bernoulli":
        ll = Bernoulli(logits=out, validate_args=False).log_prob(x).sum(-1)  # x in [0, 1]
    elif isinstance(out, tuple):
        ll = Normal(out[0], (0.5 * out[1]).exp()).log_prob(x).sum(-1)
    else:
        ll = Normal(out, 1.0).log_prob(x).sum(-1)
    kl = kl_divergence(Normal(mean, (0.5 * logvar).exp()), Normal(0.0, 1.0)).sum(-1)
    return (ll - beta * kl).mean()


@given(
    seed=st.integers(0, 2**16),
    b=st.integers(1, 5),
    case=st.sampled_from(["bernoulli", "gaussian", "gaussian_logvar"]),
    beta=st.sampled_from([0.0, 0.5, 1.0, 4.0]),
)
def test_elbo_equals_manual_formula(seed, b, case, beta):
    p = make_params(seed)
    x = torch.rand(b, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    key = random.key(seed)
    lik = "bernoulli" if case == "bernoulli" else "gaussian"
    dec = decode_mean_logvar if case == "gaussian_logvar" else decode
    ours = vae_elbo(encode, dec, p, x, key, likelihood=lik, beta=beta)
    torch.testing.assert_close(ours, manual_elbo(p, x, key, lik, beta, dec), rtol=1e-10, atol=1e-10)


def test_gradient_flows_through_reparameterisation_and_matches_autograd():
    p = make_params(0)
    x = torch.rand(4, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    key = random.key(3)
    g = torch.func.grad(lambda p: -vae_elbo(encode, decode, p, x, key))(p)
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    (-manual_elbo(leaves, x, key, "bernoulli", 1.0, decode)).backward()
    for k in p:
        torch.testing.assert_close(g[k], leaves[k].grad)
    assert g["we"].abs().sum() > 0  # the encoder gets a gradient through z


def test_parts_and_vmap_over_keys_equal_loop():
    p = make_params(1)
    x = torch.rand(3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    elbo, (ll, kl) = vae_elbo(encode, decode, p, x, random.key(0), beta=2.0, reduction="none",
                              return_parts=True)
    torch.testing.assert_close(elbo, ll - 2.0 * kl)
    keys = random.split(random.key(5), 4)
    batched = torch.func.vmap(lambda k: vae_elbo(encode, decode, p, x, k))(keys)
    looped = torch.stack([vae_elbo(encode, decode, p, x, k) for k in keys])
    torch.testing.assert_close(batched, looped)
    assert batched.std() > 0  # different keys, different noise


@given(seed=st.integers(0, 2**16), general_prior=st.booleans())
def test_kl_closed_form_equals_monte_carlo(seed, general_prior):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(3, generator=g, dtype=torch.float64)
    logvar = 0.5 * torch.randn(3, generator=g, dtype=torch.float64)
    pm, plv = (0.0, 0.0)
    if general_prior:
        pm, plv = torch.randn(3, generator=g, dtype=torch.float64), 0.3
    n = 20_000
    eps = torch.randn(n, 3, generator=g, dtype=torch.float64)  # seeded test noise (fast)
    z = mean + (0.5 * logvar).exp() * eps  # (n, 3) ~ q
    q = Normal(mean, (0.5 * logvar).exp())
    prior = Normal(torch.as_tensor(pm, dtype=torch.float64), torch.tensor(plv).mul(0.5).exp())
    log_ratio = (q.log_prob(z) - prior.log_prob(z)).sum(-1)  # (n,)
    closed = gaussian_kl(mean, logvar, pm, plv)
    tol = 5 * log_ratio.std() / n**0.5
    assert (closed - log_ratio.mean()).abs() < tol, (closed, log_ratio.mean(), tol)


def test_kl_batched_shape_and_torch_distributions():
    g = torch.Generator().manual_seed(0)
    mean, logvar = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    ref = kl_divergence(Normal(mean, (0.5 * logvar).exp()), Normal(0.0, 1.0)).sum(-1)
    torch.testing.assert_close(gaussian_kl(mean, logvar), ref)


def test_with_mlpvae_model():
    model = torchfn.Model(MLPVAE(in_dim=6, hidden=(8,), latent_dim=2))
    params = model.init(random.key(0))
    x = torch.rand(4, 6, generator=torch.Generator().manual_seed(0))
    enc = lambda p, x: model.apply(p, x)  # noqa: E731
    dec = lambda p, z: model.apply(p, z=z)  # noqa: E731
    grads = torch.func.grad(lambda p: -vae_elbo(enc, dec, p, x, random.key(1)))(params)
    assert set(grads) == set(params)
    assert all(torch.isfinite(v).all() and v.abs().sum() > 0 for v in grads.values())


def test_bad_input():
    p = make_params(0)
    x = torch.rand(2, D, dtype=torch.float64)
    k = random.key(0)
    with pytest.raises(ValueError, match="likelihood must be one of .* got 'poisson'"):
        vae_elbo(encode, decode, p, x, k, likelihood="poisson")
    with pytest.raises(ValueError, match="beta must be >= 0, got -1"):
        vae_elbo(encode, decode, p, x, k, beta=-1)
    with pytest.raises(ValueError, match=r"decode_fn output \(logits\) must have x's shape"):
        vae_elbo(encode, lambda p, z: decode(p, z)[:, :2], p, x, k)
    with pytest.raises(TypeError, match="Bernoulli logits"):
        vae_elbo(encode, decode_mean_logvar, p, x, k)
    with pytest.raises(TypeError, match="encode_fn must return a pair"):
        vae_elbo(lambda p, x: x, decode, p, x, k)
    with pytest.raises(ValueError, match="x must be a batch"):
        vae_elbo(encode, decode, p, x[0], k)
    with pytest.raises(ValueError, match="mean and logvar must share a shape"):
        gaussian_kl(torch.zeros(2, 3), torch.zeros(2, 2))
