"""Flow-matching and EDM losses: with the exact model on Gaussian data each equals its
closed form (the velocity's conditional variance averaged over the levels; EDM's is 1),
the exact model is where the gradient vanishes, and vmap over examples equals a loop."""

import math

import pytest
import torch
from torch.func import grad, vmap

from torchfn import losses, random

integrate = pytest.importorskip("scipy.integrate", reason="scipy integrates the closed form")


def gaussian_velocity(mu, s):
    """E[eps - x0 | x_sigma] for x0 ~ N(mu, s^2 I), per example (t: (B,) = sigma)."""

    def v(x, t):
        sigma = t[:, None]
        var = (1 - sigma) ** 2 * s**2 + sigma**2
        return (sigma - (1 - sigma) * s**2) / var * (x - (1 - sigma) * mu) - mu

    return v


def residual_variance(sigma, s):
    """Var(eps - x0 | x_sigma) per coordinate: what the exact velocity cannot explain."""
    c = sigma - (1 - sigma) * s**2
    return 1 + s**2 - c * c / ((1 - sigma) ** 2 * s**2 + sigma**2)


def expected_flow_loss(s, sampling, shift, weighting, m=0.0, std=1.0):
    def integrand(u):
        sigma = shift * u / (1 + (shift - 1) * u)
        w = 2 / (math.pi * (1 - 2 * sigma + 2 * sigma**2)) if weighting == "cosmap" else 1.0
        if sampling == "uniform":
            p = 1.0
        else:
            z = math.log(u / (1 - u))
            p = math.exp(-0.5 * ((z - m) / std) ** 2) / (std * math.sqrt(2 * math.pi) * u * (1 - u))
        return w * residual_variance(sigma, s) * p

    return integrate.quad(integrand, 0, 1, limit=200)[0]


@pytest.mark.parametrize("sampling, shift, weighting", [
    ("uniform", 1.0, None), ("uniform", 3.0, None), ("logit_normal", 1.0, None),
    ("logit_normal", 3.0, "cosmap"), ("uniform", 1.0, "cosmap"),
])
def test_flow_loss_of_the_exact_field_is_its_closed_form(sampling, shift, weighting):
    mu, s = 0.6, 0.8
    x0 = mu + s * random.normal(random.key(1), (100_000, 4), dtype=torch.float64)
    got = losses.flow_matching_loss(gaussian_velocity(mu, s), x0, random.key(2),
                                    time_sampling=sampling, shift=shift, weighting=weighting)
    assert got.dtype == torch.float64
    want = expected_flow_loss(s, sampling, shift, weighting)
    assert got.item() == pytest.approx(want, rel=0.01)


def test_flow_loss_gradient_vanishes_at_the_exact_field():
    """d loss / d mu_hat: zero (up to noise) at the data's mean, clearly positive past it;
    the same draws for both (one key)."""
    mu, s = 0.6, 0.8
    x0 = mu + s * random.normal(random.key(3), (50_000, 2), dtype=torch.float64)

    def loss(mu_hat):
        return losses.flow_matching_loss(gaussian_velocity(mu_hat, s), x0, random.key(4))

    at_truth = grad(loss)(torch.tensor(mu, dtype=torch.float64)).item()
    past = grad(loss)(torch.tensor(mu + 0.5, dtype=torch.float64)).item()
    assert past > 0.1 and abs(at_truth) < 0.05 * past


def test_flow_loss_sends_sigma_times_time_scale():
    seen = []

    def v(x, t):
        seen.append(t)
        return torch.zeros_like(x)

    losses.flow_matching_loss(v, torch.ones(512, 2), random.key(0), time_scale=1000.0, shift=3.0)
    t = seen[0]
    assert t.shape == (512,) and 0 <= t.min() and t.max() < 1000
    assert (t > 500).float().mean() > 0.7  # shift 3 moves 3/4 of the levels above 1/2


@pytest.mark.parametrize("p_mean, p_std, sigma_data", [(-1.2, 1.2, 0.5), (0.0, 2.0, 1.3)])
def test_edm_loss_of_the_exact_denoiser_is_one(p_mean, p_std, sigma_data):
    mu = 0.3
    x0 = mu + sigma_data * random.normal(random.key(5), (100_000, 4), dtype=torch.float64)

    def best(x, sigma):
        return mu + (sigma_data**2 / (sigma**2 + sigma_data**2))[:, None] * (x - mu)

    got = losses.edm_loss(best, x0, random.key(6), p_mean=p_mean, p_std=p_std,
                          sigma_data=sigma_data)
    assert got.item() == pytest.approx(1.0, abs=0.01)  # standard error 0.0016


@pytest.mark.parametrize("which", ["flow", "edm"])
def test_vmap_over_examples_equals_a_loop(which):
    x0 = random.normal(random.key(7), (6, 3))
    keys = random.split(random.key(8), 6)
    if which == "flow":
        def loss(x, k):
            return losses.flow_matching_loss(lambda y, t: 0.5 * y * t[:, None], x[None], k,
                                             time_sampling="logit_normal")
    else:
        def loss(x, k):
            return losses.edm_loss(lambda y, s: torch.tanh(y) / (1 + s[:, None]), x[None], k)
    looped = torch.stack([loss(x0[i], keys[i]) for i in range(6)])
    torch.testing.assert_close(vmap(loss)(x0, keys), looped)


def test_bad_arguments():
    x0, key = torch.ones(4, 2), random.key(0)
    v = lambda x, t: x  # noqa: E731
    with pytest.raises(ValueError, match="time_sampling must be one of"):
        losses.flow_matching_loss(v, x0, key, time_sampling="mode")
    with pytest.raises(ValueError, match="weighting must be one of"):
        losses.flow_matching_loss(v, x0, key, weighting="sigma_sqrt")
    with pytest.raises(ValueError, match="shift must be a float > 0"):
        losses.flow_matching_loss(v, x0, key, shift=-1.0)
    with pytest.raises(TypeError, match="x0 must be a floating-point Tensor"):
        losses.flow_matching_loss(v, torch.ones(4, 2, dtype=torch.int64), key)
    with pytest.raises(ValueError, match=r"must return x0's shape \(4, 2\), got \(4,\)"):
        losses.flow_matching_loss(lambda x, t: t, x0, key)
    with pytest.raises(ValueError, match=r"must return x0's shape \(4, 2\), got \(4,\)"):
        losses.edm_loss(lambda x, s: s, x0, key)
    with pytest.raises(ValueError, match="sigma_data must be a float > 0"):
        losses.edm_loss(v, x0, key, sigma_data=0)
    with pytest.raises(TypeError, match="denoiser_fn must be callable"):
        losses.edm_loss("D", x0, key)


def test_ot_pairing_is_the_cheapest_permutation():
    import itertools

    for seed in range(5):
        x0 = random.normal(random.key(seed), (6, 3), dtype=torch.float64)
        eps = random.normal(random.key(100 + seed), (6, 3), dtype=torch.float64)
        cost = torch.cdist(x0, eps).square()
        best = min(sum(cost[i, p[i]].item() for i in range(6))
                   for p in itertools.permutations(range(6)))
        p = losses.ot_pairing(x0, eps)
        assert sorted(p.tolist()) == list(range(6))
        assert sum(cost[i, p[i]].item() for i in range(6)) == pytest.approx(best, rel=1e-12)


def test_ot_coupling_keeps_the_noise_and_shortens_the_paths():
    """The loss sees the same noise vectors, permuted; the paths x0 -> eps are shorter: for
    x0 ~ N(0, 4 I), E|x0 - eps|^2 is 10 paired at random and W2^2 = 2 at the optimum."""
    x0 = 2.0 * random.normal(random.key(9), (256, 2), dtype=torch.float64)
    seen = {}

    def record(name):
        def v(x, t):
            seen[name] = (x, t)
            return torch.zeros_like(x)
        return v

    for c in ("independent", "ot"):
        losses.flow_matching_loss(record(c), x0, random.key(10), coupling=c)
    (x_ind, t), (x_ot, t_ot) = seen["independent"], seen["ot"]
    assert torch.equal(t, t_ot)
    s = t[:, None]
    eps_ind, eps_ot = (x_ind - (1 - s) * x0) / s, (x_ot - (1 - s) * x0) / s
    order = lambda e: e[torch.argsort(e[:, 0])]  # noqa: E731
    torch.testing.assert_close(order(eps_ind), order(eps_ot))
    assert (eps_ot - x0).square().sum(1).mean() < 0.4 * (eps_ind - x0).square().sum(1).mean()


def test_ot_coupling_under_grad_and_not_under_vmap():
    x0 = random.normal(random.key(12), (32, 2))

    def loss(w):
        return losses.flow_matching_loss(lambda x, t: w * x, x0, random.key(13), coupling="ot")

    g = grad(loss)(torch.tensor(0.3))
    eps = 1e-3
    fd = (loss(torch.tensor(0.3 + eps)) - loss(torch.tensor(0.3 - eps))) / (2 * eps)
    assert g.item() == pytest.approx(fd.item(), rel=1e-3)
    with pytest.raises(ValueError, match="ot_pairing pairs a whole batch: x0 must not be vmapped"):
        vmap(lambda x: losses.flow_matching_loss(lambda y, t: y, x, random.key(0),
                                                 coupling="ot"))(x0[None].repeat(2, 1, 1))
    with pytest.raises(ValueError, match="coupling must be one of"):
        losses.flow_matching_loss(lambda y, t: y, x0, random.key(0), coupling="sinkhorn")
