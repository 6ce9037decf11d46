"""flow_log_likelihood: the exact velocity of Gaussian data gives the Gaussian's own
log-density (exact trace and Hutchinson's, which is exact for this diagonal Jacobian),
and its gradient in the model's parameters is the density's."""

import math

import pytest
import torch
from torch.func import grad

from torchfn import random
from torchfn.transforms import diffusion as D


def velocity(x, t, mu, s):
    """E[eps - x0 | x_sigma] for x0 ~ N(mu, s^2 I); mu, s as model arguments."""
    sigma = t[:, None]
    var = (1 - sigma) ** 2 * s**2 + sigma**2
    return (sigma - (1 - sigma) * s**2) / var * (x - (1 - sigma) * mu) - mu


def gaussian_log_density(x, mu, s):
    d = x.shape[1]
    return (-0.5 * ((x - mu) / s).pow(2).sum(1) - d * math.log(s)
            - 0.5 * d * math.log(2 * math.pi))


MU, S = torch.tensor(0.7, dtype=torch.float64), torch.tensor(0.4, dtype=torch.float64)


@pytest.mark.parametrize("with_key", [False, True])
def test_the_exact_field_gives_the_gaussian_density(with_key):
    x = MU + S * random.normal(random.key(0), (16, 3), dtype=torch.float64) * 1.5
    key = random.key(1) if with_key else None
    ll = D.flow_log_likelihood(velocity, x, MU, S, key=key, rtol=1e-8, atol=1e-8)
    assert ll.shape == (16,)
    torch.testing.assert_close(ll, gaussian_log_density(x, MU, S), rtol=1e-6, atol=1e-6)


def test_time_scale_reaches_the_model():
    x = MU + S * random.normal(random.key(2), (4, 2), dtype=torch.float64)
    scaled = lambda x, t, mu, s: velocity(x, t / 1000.0, mu, s)  # noqa: E731
    a = D.flow_log_likelihood(scaled, x, MU, S, time_scale=1000.0, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(a, gaussian_log_density(x, MU, S), rtol=1e-6, atol=1e-6)


def test_gradient_in_the_model_parameters_is_the_density_gradient():
    x = MU + S * random.normal(random.key(3), (8, 2), dtype=torch.float64)

    def total(params):
        return D.flow_log_likelihood(velocity, x, params["mu"], params["s"],
                                     rtol=1e-9, atol=1e-9).sum()

    g = grad(total)({"mu": MU, "s": S})
    want_mu = ((x - MU) / S**2).sum()
    want_s = (((x - MU) ** 2).sum(1) / S**3 - x.shape[1] / S).sum()
    assert g["mu"].item() == pytest.approx(want_mu.item(), rel=1e-5)
    assert g["s"].item() == pytest.approx(want_s.item(), rel=1e-5)


def test_bad_input():
    x = torch.ones(4, 2)
    with pytest.raises(TypeError, match="velocity_fn must be callable"):
        D.flow_log_likelihood(None, x)
    with pytest.raises(TypeError, match="x must be a floating-point Tensor"):
        D.flow_log_likelihood(lambda x, t: x, torch.ones(4, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="samples must be an int >= 1"):
        D.flow_log_likelihood(lambda x, t: x, x, key=random.key(0), samples=0)
    with pytest.raises(ValueError, match=r"must return x's shape \(4, 2\), got \(4,\)"):
        D.flow_log_likelihood(lambda x, t: x.sum(1), x)
