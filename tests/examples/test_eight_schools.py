"""examples/eight_schools.py: the two parametrisations are one posterior (the densities
differ by exactly the Jacobian ``8 log tau``), and NUTS on the non-centred one gives the
exact posterior means of ``mu`` and ``tau`` (a quadrature with ``theta`` integrated out)
within a few Monte Carlo standard errors."""

import pytest
import torch


def test_parametrisations_differ_by_the_jacobian(example):
    es = example("eight_schools")
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        mu, log_tau = torch.randn(2, generator=g, dtype=torch.float64) * 2
        eta = torch.randn(8, generator=g, dtype=torch.float64)
        theta = mu + log_tau.exp() * eta
        nc = es.non_centred({"mu": mu, "log_tau": log_tau, "eta": eta})
        c = es.centred({"mu": mu, "log_tau": log_tau, "theta": theta})
        assert float(nc - c) == pytest.approx(8 * float(log_tau), abs=1e-9)


def test_non_centred_nuts_finds_the_exact_posterior_means(example):
    es = example("eight_schools")
    m = es.main(["--only", "non_centred", "--chains", "2", "--samples", "150",
                 "--warmup", "150"])
    # posterior sd: mu 3.3, tau 3.2; ESS of 300 draws >= 150 here: 5 standard errors
    assert abs(m["non_centred"]["mu_mean"] - m["exact"]["mu"]) < 5 * 3.3 / 150 ** 0.5
    assert abs(m["non_centred"]["tau_mean"] - m["exact"]["tau"]) < 5 * 3.2 / 150 ** 0.5
    finer = es.exact_means(points=1200)  # the quadrature has converged
    assert abs(finer["mu"] - m["exact"]["mu"]) < 1e-6
    assert abs(finer["tau"] - m["exact"]["tau"]) < 1e-6
