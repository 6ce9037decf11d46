"""``transforms.sdeint``: each method converges to the exact solution at its strong order
(on the same keyed Brownian path, which ``sdeint`` itself reproduces), moments and
pathwise gradients equal closed forms, and keys alone decide the paths."""

import math

import pytest
import torch
from torch.func import grad, vmap

from torchfn import random, transforms

F64 = torch.float64
MU, SIGMA = 0.5, 0.8
T01 = torch.tensor([0.0, 1.0], dtype=F64)


def brownian(key, dt):
    """W(1) on the path sdeint draws from ``key`` at step ``dt``: the SDE dW = 1 dW."""
    return transforms.sdeint(lambda y, s: 0 * y, lambda y, s: torch.ones_like(y),
                             torch.zeros((), dtype=F64), T01, key, dt=dt)[-1]


def gbm(key, dt, method):
    return transforms.sdeint(lambda y, s: MU * y, lambda y, s: SIGMA * y,
                             torch.ones((), dtype=F64), T01, key, dt=dt, method=method)[-1]


def exact_gbm(w, method):
    """Ito: exp((mu - sigma^2 / 2) + sigma W); Stratonovich (heun): exp(mu + sigma W)."""
    drift = MU if method == "heun" else MU - SIGMA**2 / 2
    return torch.exp(drift + SIGMA * w)


@pytest.mark.parametrize("method,order", [("euler", 0.5), ("milstein", 1.0), ("heun", 1.0)])
def test_strong_order_on_the_same_path(method, order):
    keys = random.split(random.key(0), 1000)
    errors = []
    for dt in (0.1, 0.025):
        err = vmap(lambda k, dt=dt: (gbm(k, dt, method) - exact_gbm(brownian(k, dt), method))
                   .abs())
        errors.append(float(err(keys).mean()))
    ratio = errors[0] / errors[1]  # dt / 4: the error shrinks by 4 ** order
    assert 4**order * 0.75 < ratio < 4**order * 1.33, (errors, ratio)


def test_ornstein_uhlenbeck_moments():
    theta, m, s = 2.0, 1.0, 0.5

    def ou(k):
        return transforms.sdeint(lambda y, t: theta * (m - y), lambda y, t: s * torch.ones_like(y),
                                 torch.zeros((), dtype=F64), T01, k, dt=0.005)[-1]

    ys = vmap(ou)(random.split(random.key(1), 4000))
    mean, var = m * (1 - math.exp(-theta)), s**2 / (2 * theta) * (1 - math.exp(-2 * theta))
    assert abs(float(ys.mean()) - mean) < 5 * math.sqrt(var / len(ys))
    assert abs(float(ys.var()) - var) < 5 * var * math.sqrt(2 / len(ys))


def test_general_noise_covariance():
    g = torch.tensor([[1.0, 0.5, 0.0], [0.0, 0.3, 2.0]], dtype=F64)  # (2, m=3)

    def walk(k):
        return transforms.sdeint(lambda y, t: torch.zeros_like(y), lambda y, t: g,
                                 torch.zeros(2, dtype=F64), T01, k, dt=0.1)[-1]

    ys = vmap(walk)(random.split(random.key(2), 20000))
    torch.testing.assert_close(torch.cov(ys.T), g @ g.T, rtol=0.05, atol=0.03)


def test_pathwise_gradient_of_the_mean():
    def mean_at_one(mu, k):  # E[X_1] = exp(mu) for dX = mu X dt + sigma X dW
        return transforms.sdeint(lambda y, s, mu: mu * y, lambda y, s, mu: SIGMA * y,
                                 torch.ones((), dtype=F64), T01, k, mu, dt=0.01)[-1]

    mu = torch.tensor(MU, dtype=F64)
    g = vmap(grad(mean_at_one), in_dims=(None, 0))(mu, random.split(random.key(3), 4000))
    assert abs(float(g.mean()) - math.exp(MU)) < 5 * float(g.std()) / math.sqrt(len(g))


def test_keys_decide_the_paths():
    k1, k2 = random.split(random.key(4))
    t = torch.linspace(0, 1, 6, dtype=F64)

    def path(k, sigma=1.0):
        return transforms.sdeint(lambda y, s: -y, lambda y, s: sigma * torch.ones_like(y),
                                 torch.zeros(3, dtype=F64), t, k, dt=0.05)

    assert torch.equal(path(k1), path(k1))
    assert not torch.allclose(path(k1), path(k2))
    batched = vmap(path)(torch.stack([k1, k2]))
    torch.testing.assert_close(batched, torch.stack([path(k1), path(k2)]))
    # the noise is the same whatever the SDE: sigma scales this linear SDE's path exactly
    torch.testing.assert_close(path(k1, 2.0), 2 * path(k1))


def test_bad_input_gets_clear_errors():
    key, y0 = random.key(0), torch.zeros(2)
    ok = (lambda y, t: y, lambda y, t: y)
    with pytest.raises(ValueError, match="dt must be a positive number, got 0"):
        transforms.sdeint(*ok, y0, T01.float(), key, dt=0)
    with pytest.raises(ValueError, match="t must be strictly increasing"):
        transforms.sdeint(*ok, y0, T01.flip(0).float(), key, dt=0.1)
    with pytest.raises(ValueError, match="method must be one of"):
        transforms.sdeint(*ok, y0, T01.float(), key, dt=0.1, method="srk")
    with pytest.raises(ValueError, match=r"diffusion returned shape \(3,\); expected y's shape "
                                         r"\(2,\) or \(2,\) \+ \(m,\)"):
        transforms.sdeint(ok[0], lambda y, t: torch.ones(3), y0, T01.float(), key, dt=0.1)
    with pytest.raises(ValueError, match="milstein' needs diagonal noise"):
        transforms.sdeint(ok[0], lambda y, t: torch.ones(2, 3), y0, T01.float(), key, dt=0.1,
                          method="milstein")
    with pytest.raises(TypeError, match="y0 must be a floating-point tensor"):
        transforms.sdeint(*ok, torch.zeros(2, dtype=torch.long), T01.float(), key, dt=0.1)
