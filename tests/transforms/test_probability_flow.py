"""The probability-flow ODE with the exact noise model of Gaussian data: its likelihood
equals the true density at ``t_min`` (exactly; the trace by Hutchinson without bias),
its samples have the data's covariance, and the likelihood differentiates in the
model's parameters as the closed form does."""

import math

import torch
from torch.func import grad, vmap

from torchfn import random
from torchfn.transforms import diffusion

F64 = torch.float64
T_MIN = 1e-3
TOL = dict(rtol=1e-8, atol=1e-8)


def covariance(c):  # a rotated diag(c, 2.0), zero mean: p_1 is N(0, I) up to ~1e-5
    rot = torch.tensor([[0.8, -0.6], [0.6, 0.8]], dtype=F64)
    return rot @ torch.diag(torch.stack([c, torch.tensor(2.0, dtype=F64)])) @ rot.T


def marginal_cov(cov, t):
    ab = diffusion.vp_alpha_bar(torch.as_tensor(t, dtype=F64))
    return ab * cov + (1 - ab) * torch.eye(2, dtype=F64)


def eps_exact(x, labels, c):
    """The noise model of N(0, cov) data: eps = sigma V_t^-1 x (score = -V_t^-1 x)."""
    t = labels[0] / 999.0
    ab = diffusion.vp_alpha_bar(t)
    v = marginal_cov(covariance(c), t)
    return torch.sqrt(1 - ab) * torch.linalg.solve(v, x.T).T


C = torch.tensor(0.25, dtype=F64)


def true_log_density(x, c):
    v = marginal_cov(covariance(c), T_MIN)
    return torch.distributions.MultivariateNormal(torch.zeros(2, dtype=F64), v).log_prob(x)


def test_exact_likelihood_equals_the_density():
    x = random.normal(random.key(0), (6, 2), dtype=F64) @ torch.linalg.cholesky(
        covariance(C)).T
    ll = diffusion.probability_flow_log_likelihood(eps_exact, x, C, t_min=T_MIN, **TOL)
    torch.testing.assert_close(ll, true_log_density(x, C), rtol=0, atol=2e-4)


def test_hutchinson_likelihood_is_unbiased():
    x = torch.tensor([[0.3, -0.4]], dtype=F64)
    keys = random.split(random.key(1), 24)
    lls = torch.stack([diffusion.probability_flow_log_likelihood(
        eps_exact, x, C, key=k, t_min=T_MIN, **TOL)[0] for k in keys])
    exact = true_log_density(x, C)[0]
    assert abs(float(lls.mean() - exact)) < 5 * float(lls.std()) / math.sqrt(len(keys)) + 2e-4
    assert float(lls.std()) > 0


def test_samples_have_the_data_covariance():
    xs = diffusion.probability_flow_sample(eps_exact, (4000, 2), random.key(2), C,
                                           dtype=F64, t_min=T_MIN, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cov(xs.T), marginal_cov(covariance(C), T_MIN),
                               rtol=0.08, atol=0.03)
    again = diffusion.probability_flow_sample(eps_exact, (4000, 2), random.key(2), C,
                                              dtype=F64, t_min=T_MIN, rtol=1e-6, atol=1e-6)
    assert torch.equal(xs, again)  # deterministic given the key


def test_likelihood_gradient_in_the_model_parameter():
    x = torch.tensor([[0.3, -0.4], [1.0, 0.5]], dtype=F64)
    g = grad(lambda c: diffusion.probability_flow_log_likelihood(
        eps_exact, x, c, t_min=T_MIN, **TOL).sum())(C)
    want = grad(lambda c: true_log_density(x, c).sum())(C)
    torch.testing.assert_close(g, want, rtol=1e-3, atol=1e-3)


def test_vp_alpha_bar_matches_the_linear_schedule_limit():
    """abar(t) is the limit of linear_schedule(N)'s cumulative product at t = i / N."""
    s = diffusion.linear_schedule(1000)
    i = torch.tensor([0, 249, 499, 999])
    ours = diffusion.vp_alpha_bar((i + 1).to(F64) / 1000)
    torch.testing.assert_close(ours, s.alphas_cumprod[i].to(F64), rtol=0.02, atol=1e-5)
    assert vmap(diffusion.vp_alpha_bar)(torch.zeros(3, dtype=F64)).eq(1).all()


def test_reverse_sde_samples_have_the_data_covariance():
    xs = diffusion.reverse_sde_sample(eps_exact, (4000, 2), random.key(3), C, dt=2e-3,
                                      dtype=F64, t_min=T_MIN)
    torch.testing.assert_close(torch.cov(xs.T), marginal_cov(covariance(C), T_MIN),
                               rtol=0.08, atol=0.04)
    assert abs(float(xs.mean())) < 0.06
