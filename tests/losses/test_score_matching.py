"""``losses.score_matching``: the per-example loss is its formula, and its mean over Gaussian
data equals the closed-form expected loss (so it ranks models by Fisher divergence);
the sliced estimate is unbiased for it."""

import pytest
import torch
from torch.func import jacrev, vmap

from torchfn import losses, random

F64 = torch.float64


def gaussian(seed, n):
    ks = random.split(random.key(seed), 3)
    mu = random.normal(ks[0], (2,), dtype=F64)
    a = random.normal(ks[1], (2, 2), dtype=F64)
    cov = a @ a.T + 0.5 * torch.eye(2, dtype=F64)
    x = mu + random.normal(ks[2], (n, 2), dtype=F64) @ torch.linalg.cholesky(cov).T
    return mu, cov, x


def linear_score(x, p, m):  # the score of N(m, p^-1) for symmetric p: -p (x - m)
    return -p @ (x - m)


def expected_loss(p, m, mu, cov):
    """E[0.5 |p (x - m)|^2] - tr(p) for x ~ N(mu, cov)."""
    d = p @ (mu - m)
    return 0.5 * torch.trace(p @ cov @ p.T) + 0.5 * d @ d - torch.trace(p)


def test_the_loss_is_its_formula():
    _, _, x = gaussian(0, 3)
    f = lambda x: torch.tanh(x) * x.sum()  # noqa: E731
    for xi in x:
        s = f(xi)
        torch.testing.assert_close(losses.score_matching(f, xi),
                                   0.5 * s @ s + torch.trace(jacrev(f)(xi)))


@pytest.mark.parametrize("model", ["true", "shifted", "too_sharp"])
def test_mean_loss_equals_the_closed_form_expectation(model):
    mu, cov, x = gaussian(1, 20000)
    prec = torch.linalg.inv(cov)
    p, m = {"true": (prec, mu), "shifted": (prec, mu + 1.0),
            "too_sharp": (3 * prec, mu)}[model]
    per_example = vmap(lambda x: losses.score_matching(linear_score, x, p, m))(x)
    stderr = per_example.std() / len(x) ** 0.5
    assert abs(float(per_example.mean() - expected_loss(p, m, mu, cov))) < 5 * float(stderr)


def test_the_data_score_minimises_the_expected_loss():
    mu, cov, _ = gaussian(2, 1)
    prec = torch.linalg.inv(cov)
    best = expected_loss(prec, mu, mu, cov)
    for dp, dm in ((0.1, 0.0), (-0.1, 0.0), (0.0, 0.3)):
        assert expected_loss(prec * (1 + dp), mu + dm, mu, cov) > best


def test_sliced_is_unbiased():
    mu, cov, x = gaussian(3, 1)
    p = torch.linalg.inv(cov) + 0.3  # off-diagonal entries: single probes vary
    exact = losses.score_matching(linear_score, x[0], p, mu)
    keys = random.split(random.key(4), 4000)
    est = vmap(lambda k: losses.score_matching(linear_score, x[0], p, mu, key=k))(keys)
    assert abs(float(est.mean() - exact)) < 5 * float(est.std() / len(keys) ** 0.5)
    assert float(est.std()) > 0
