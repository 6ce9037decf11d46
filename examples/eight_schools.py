"""Eight schools by NUTS, centred against non-centred: divergences show the funnel.

Rubin's eight schools (Gelman et al., *BDA3* 5.5): the effect of coaching in school
``j`` is ``theta_j ~ N(mu, tau)``, its estimate ``y_j ~ N(theta_j, sigma_j)``; priors
``mu ~ N(0, 5)``, ``tau ~ HalfCauchy(5)``. Written with ``theta`` as a parameter (centred),
the posterior is a funnel in ``(log tau, theta)`` whose neck no single step size fits:
NUTS reports divergent trajectories and undersamples small ``tau``. Written with
``theta = mu + tau * eta``, ``eta ~ N(0, 1)`` (non-centred), the same posterior is easy.

``transforms.nuts`` runs ``--chains`` chains in lockstep; ``transforms.print_summary``
gives the table, ``transforms.bfmi`` Stan's energy diagnostic. ``theta`` integrates out
in closed form (``y_j ~ N(mu, sigma_j^2 + tau^2)``), so the exact posterior means of
``mu`` and ``tau`` come from a 2-d quadrature over ``(mu, log tau)``: the reference
both runs are read against.

    python examples/eight_schools.py
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from torchfn import random
from torchfn.transforms import bfmi, nuts, print_summary

Y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0], dtype=torch.float64)
SIGMA = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0], dtype=torch.float64)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chains", type=int, default=4)
    p.add_argument("--samples", type=int, default=1000, help="draws per chain")
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--target-accept", type=float, default=0.8)
    p.add_argument("--only", choices=["centred", "non_centred"], default=None,
                   help="run one parametrisation")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _normal(x: torch.Tensor, mean, sd) -> torch.Tensor:  # log N(x; mean, sd), summed
    return (-0.5 * ((x - mean) / sd) ** 2 - torch.log(sd * math.sqrt(2 * math.pi))).sum()


def _priors(mu: torch.Tensor, log_tau: torch.Tensor) -> torch.Tensor:
    """log p(mu) + log p(tau) + log |d tau / d log tau| (HalfCauchy(5) on tau)."""
    tau = log_tau.exp()
    five = torch.tensor(5.0, dtype=mu.dtype)
    return _normal(mu, 0.0, five) + math.log(2 / (math.pi * 5)) - \
        torch.log1p((tau / 5) ** 2) + log_tau


def centred(p: dict) -> torch.Tensor:
    """``{"mu": (), "log_tau": (), "theta": (8,)} -> ()``."""
    return _priors(p["mu"], p["log_tau"]) + _normal(p["theta"], p["mu"], p["log_tau"].exp()) \
        + _normal(Y, p["theta"], SIGMA)


def non_centred(p: dict) -> torch.Tensor:
    """``{"mu": (), "log_tau": (), "eta": (8,)} -> ()``; ``theta = mu + tau * eta``."""
    theta = p["mu"] + p["log_tau"].exp() * p["eta"]
    one = torch.ones((), dtype=p["eta"].dtype)
    return _priors(p["mu"], p["log_tau"]) + _normal(p["eta"], 0.0, one) + \
        _normal(Y, theta, SIGMA)


def exact_means(points: int = 800) -> dict[str, float]:
    """``E[mu]`` and ``E[tau]`` under the exact marginal posterior of ``(mu, log tau)``,
    by quadrature on a grid (``theta`` integrated out analytically)."""
    mu = torch.linspace(-40.0, 50.0, points, dtype=torch.float64)
    log_tau = torch.linspace(-12.0, 7.0, points, dtype=torch.float64)
    m, lt = torch.meshgrid(mu, log_tau, indexing="ij")  # (P, P)
    tau = lt.exp()
    var = SIGMA ** 2 + tau[..., None] ** 2  # (P, P, 8)
    log_lik = (-0.5 * (Y - m[..., None]) ** 2 / var - 0.5 * torch.log(2 * math.pi * var)).sum(-1)
    log_post = log_lik - 0.5 * (m / 5) ** 2 - torch.log1p((tau / 5) ** 2) + lt
    w = torch.softmax(log_post.flatten(), 0).reshape(log_post.shape)
    return {"mu": float((w * m).sum()), "tau": float((w * tau).sum())}


def run(logdensity, init: dict, key: torch.Tensor, args) -> dict:
    t0 = time.perf_counter()
    draws, info, _ = nuts(logdensity, init, key, num_samples=args.samples,
                          num_warmup=args.warmup, num_chains=args.chains,
                          target_accept=args.target_accept)
    return {"draws": draws, "info": info, "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    k_init, k_c, k_nc = random.split(random.key(args.seed), 3)
    start = random.normal(k_init, (args.chains, 10), dtype=torch.float64)
    base = {"mu": start[:, 0], "log_tau": start[:, 1]}
    exact = exact_means()
    results = {}
    for name, fn, init, key in (
            ("centred", centred, {**base, "theta": start[:, 2:]}, k_c),
            ("non_centred", non_centred, {**base, "eta": start[:, 2:]}, k_nc)):
        if args.only not in (None, name):
            continue
        out = run(fn, init, key, args)
        draws, info = out["draws"], out["info"]  # (chains, samples, ...)
        tau = draws["log_tau"].exp()
        theta = draws["theta"] if name == "centred" else \
            draws["mu"][..., None] + tau[..., None] * draws["eta"]
        e_bfmi = bfmi(info.energy)  # (chains,)
        print(f"\n{name}: {args.chains} chains x {args.samples} draws in "
              f"{out['seconds']:.0f} s; {int(info.diverging.sum())} divergent; "
              f"{info.num_steps.double().mean():.1f} leapfrog steps per draw; E-BFMI "
              f"{', '.join(f'{v:.2f}' for v in e_bfmi.tolist())}")
        print_summary({"mu": draws["mu"], "tau": tau, "theta": theta})
        results[name] = {
            "divergent": int(info.diverging.sum()),
            "mu_mean": float(draws["mu"].mean()),
            "tau_mean": float(tau.mean()),
            "log_tau_min": float(draws["log_tau"].min()),
            "bfmi_min": float(e_bfmi.min()),
            "seconds": out["seconds"],
        }
    runs = "; ".join(f"{name} {r['mu_mean']:.3f}, {r['tau_mean']:.3f}"
                     for name, r in results.items())
    print(f"\nposterior means of mu, tau: exact (quadrature) {exact['mu']:.3f}, "
          f"{exact['tau']:.3f}; {runs}")
    return {"exact": exact, **results}


if __name__ == "__main__":
    main()
