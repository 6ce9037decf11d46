"""Influence functions (Koh & Liang, 2017): which training digits a test prediction rests
on, predicted without retraining and checked by retraining.

A multinomial logistic regression with an L2 penalty (strictly convex) is fit to the
training digits by Newton's method: each step solves ``H d = ∇L`` with ``transforms.cg``
on ``transforms.hessian_operator`` (the Hessian is never formed). For the test digit with
the highest loss, ``s = H⁻¹ ∇ℓ_test`` is one more ``cg`` solve, and the change of its
loss when training digit ``i`` is left out is predicted for all of them at once from
the per-example gradients (``vmap(grad)``): ``Δ_i ≈ s · ∇ℓ_i / n``.

The same prediction with EK-FAC curvature (``transforms.ekfac``, ``transforms.influence``:
the Kronecker-factored eigenbasis with eigenvalues refitted to the per-example
gradients, as kronfluence) is compared with the exact one over all training digits
and with the refits.

The check: leave out each of the ``--retrain`` training digits with the largest
predicted effect (and as many drawn at random), refit (Newton from the full fit), and
compare the actual change of the test loss with the prediction. The report gives their
Pearson correlation (Koh & Liang's Figure 2 shows about 0.99 for this model), and the
labels of the most helpful and most harmful training digits.

    python examples/influence_digits.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

import torchfn
from torchfn import random
from torchfn.data import load_digits, train_test_split
from torchfn.transforms import cg, ekfac, hessian_operator, influence


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--l2", type=float, default=1e-2, help="the penalty (l2 / 2) |params|^2")
    p.add_argument("--retrain", type=int, default=20,
                   help="leave-one-out refits of the most influential digits (and as many "
                        "random ones)")
    p.add_argument("--newton-steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def example_loss(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One digit's cross entropy: ``x (64,)``, ``y ()``."""
    return F.cross_entropy(x @ params["w"] + params["b"], y)


def objective(params: dict, x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor,
              l2: float) -> torch.Tensor:
    """The weighted mean loss (weight 0 leaves a digit out) plus the penalty."""
    losses = vmap(example_loss, in_dims=(None, 0, 0))(params, x, y)  # (n,)
    penalty = (params["w"] ** 2).sum() + (params["b"] ** 2).sum()
    return (weights * losses).sum() / weights.sum() + 0.5 * l2 * penalty


def newton(params: dict, x, y, weights, l2: float, steps: int) -> dict:
    """Newton's method: ``params - H⁻¹ ∇f``, each step one ``cg`` solve."""
    for _ in range(steps):
        def f(p):
            return objective(p, x, y, weights, l2)

        g = grad(f)(params)
        step = cg(hessian_operator(f, params), g, tol=1e-10, atol=1e-13)
        params = {k: params[k] - step[k] for k in params}
    return params


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    k_split, k_pick = random.split(random.key(args.seed))
    x, y = load_digits()  # (1797, 64), (1797,)
    (x_tr, y_tr), (x_te, y_te) = train_test_split(k_split, x, y, test_fraction=0.2)
    x_tr, x_te = x_tr.double(), x_te.double()  # float64: the differences are small
    n = len(x_tr)
    ones = torch.ones(n, dtype=torch.float64)
    t0 = time.perf_counter()
    init = {"w": torch.zeros(64, 10, dtype=torch.float64),
            "b": torch.zeros(10, dtype=torch.float64)}
    params = newton(init, x_tr, y_tr, ones, args.l2, args.newton_steps)
    g_norm = max(v.abs().max().item() for v in grad(
        lambda p: objective(p, x_tr, y_tr, ones, args.l2))(params).values())
    test_losses = vmap(example_loss, in_dims=(None, 0, 0))(params, x_te, y_te)
    accuracy = ((x_te @ params["w"] + params["b"]).argmax(-1) == y_te).double().mean().item()
    j = int(test_losses.argmax())  # the test digit the model gets most wrong
    x_j, y_j = x_te[j], y_te[j]

    # s = H⁻¹ ∇ℓ_test, then Δ_i ≈ s · ∇ℓ_i / n for every training digit at once
    def f(p):
        return objective(p, x_tr, y_tr, ones, args.l2)

    s = cg(hessian_operator(f, params), grad(example_loss)(params, x_j, y_j), tol=1e-10)
    per_example = vmap(grad(example_loss), in_dims=(None, 0, 0))(params, x_tr, y_tr)
    predicted = sum((per_example[k] * s[k]).flatten(1).sum(1) for k in s) / n  # (n,)

    # the same prediction with EK-FAC curvature (transforms.ekfac, transforms.influence):
    # the model as an nn.Linear, the penalty l2 as the damping of the mean Hessian
    linear = torchfn.Model(nn.Linear(64, 10).double())
    lin_params = {"weight": params["w"].T, "bias": params["b"]}
    factors = ekfac(linear, lin_params, x_tr)
    scores = influence(linear, lin_params, factors, (x_tr, y_tr), (x_j[None], y_j[None]),
                       lambda out, t: F.cross_entropy(out, t, reduction="none"),
                       damping=args.l2)[0]  # (n,)
    ekfac_predicted = scores / n
    r_ekfac = torch.corrcoef(torch.stack([ekfac_predicted, predicted]))[0, 1].item()

    top = predicted.abs().argsort(descending=True)[:args.retrain]
    others = random.permutation(k_pick, n)
    others = others[~torch.isin(others, top)][:args.retrain]
    chosen = torch.cat([top, others])
    actual = []
    for i in chosen.tolist():
        weights = ones.clone()
        weights[i] = 0.0
        refit = newton(params, x_tr, y_tr, weights, args.l2, 3)
        actual.append((example_loss(refit, x_j, y_j) - test_losses[j]).item())
    actual = torch.tensor(actual, dtype=torch.float64)
    pred = predicted[chosen]
    r = torch.corrcoef(torch.stack([pred, actual]))[0, 1].item()
    r_ekfac_actual = torch.corrcoef(torch.stack([ekfac_predicted[chosen], actual]))[0, 1].item()
    helpful = predicted.argsort(descending=True)[:5]  # leaving them out hurts most
    harmful = predicted.argsort()[:5]
    metrics = {
        "test_accuracy": accuracy,
        "fit_gradient_max": g_norm,
        "test_index": j,
        "test_label": int(y_j),
        "test_prediction": int((x_j @ params["w"] + params["b"]).argmax()),
        "test_loss": test_losses[j].item(),
        "pearson": r,
        "pearson_ekfac_vs_exact": r_ekfac,
        "pearson_ekfac_vs_actual": r_ekfac_actual,
        "predicted": pred.tolist(),
        "actual": actual.tolist(),
        "helpful_labels": y_tr[helpful].tolist(),
        "harmful_labels": y_tr[harmful].tolist(),
        "seconds": time.perf_counter() - t0,
    }
    print(f"fit: test accuracy {accuracy:.3f}, |grad| {g_norm:.1e}; test digit {j}: a "
          f"{metrics['test_label']} read as {metrics['test_prediction']} (loss "
          f"{metrics['test_loss']:.2f})")
    print(f"leave-one-out on {len(chosen)} training digits: predicted vs actual change, "
          f"Pearson r = {r:.4f}")
    print(f"EK-FAC curvature instead of the exact Hessian: Pearson r = {r_ekfac:.4f} with "
          f"the exact predictions over all {n} digits, {r_ekfac_actual:.4f} with the refits")
    print(f"most helpful training labels {metrics['helpful_labels']}, most harmful "
          f"{metrics['harmful_labels']} ({metrics['seconds']:.0f} s)")
    return metrics


if __name__ == "__main__":
    main()
