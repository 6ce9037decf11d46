"""A deep equilibrium (DEQ) classifier on the 8x8 digits, trained with implicit gradients.

One layer is iterated to its fixed point and the classifier reads the equilibrium:

    z* = tanh(W z* + U x + b)          (B, H)
    logits = z* V^T + c                (B, 10)

``transforms.fixed_point`` solves for z* (Anderson acceleration) and differentiates it
by the implicit function theorem, so training never backpropagates through the
solver's iterations. W is rescaled to Frobenius norm <= 0.9: its spectral norm is then
below 1 and, tanh being 1-Lipschitz, the layer is a contraction, so z* exists and is
unique for every input and every step of training.

The peer is the same layer unrolled ``--unroll`` times and backpropagated (a
weight-tied network of that depth). At the end the implicit gradient is compared with
autodiff through a long unrolled iteration at the trained weights.

    python examples/deq_digits.py                  # Anderson, 300 steps
    python examples/deq_digits.py --method iterate --hidden 256
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from torchfn import optim, random, transforms
from torchfn.data import load_digits, train_test_split


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--method", choices=["anderson", "iterate"], default="anderson")
    p.add_argument("--tol", type=float, default=1e-4, help="relative residual of the solves")
    p.add_argument("--max-iter", type=int, default=40)
    p.add_argument("--unroll", type=int, default=8, help="depth of the unrolled peer")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def init(key: torch.Tensor, hidden: int) -> dict[str, torch.Tensor]:
    k = random.split(key, 3)
    return {
        "W": random.normal(k[0], (hidden, hidden)) * 0.5 / hidden**0.5,
        "U": random.normal(k[1], (hidden, 64)) / 8.0,
        "b": torch.zeros(hidden),
        "V": random.normal(k[2], (10, hidden)) / hidden**0.5,
        "c": torch.zeros(10),
    }


def contractive(w: torch.Tensor, bound: float = 0.9) -> torch.Tensor:
    """W scaled to Frobenius norm <= bound (>= its spectral norm)."""
    return w * (bound / torch.linalg.matrix_norm(w).clamp_min(bound))


def layer(p: dict, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """z: (B, H), x: (B, 64) -> (B, H)"""
    return torch.tanh(z @ contractive(p["W"]).T + x @ p["U"].T + p["b"])


class Counter:
    """Counts the layer's evaluations in the forward solves (eager code, a side effect)."""

    def __init__(self):
        self.calls = 0

    def wrap(self, x):
        def f(p, z):
            self.calls += 1
            return layer(p, z, x)

        return f


def deq_logits(p, x, args, counter: Counter | None = None):
    f = counter.wrap(x) if counter is not None else (lambda p, z: layer(p, z, x))
    z0 = torch.zeros(x.shape[0], p["W"].shape[0])
    z = transforms.fixed_point(f, p, z0, method=args.method, tol=args.tol,
                               max_iter=args.max_iter)
    return z @ p["V"].T + p["c"]


def unrolled_logits(p, x, depth: int):
    z = torch.zeros(x.shape[0], p["W"].shape[0])
    for _ in range(depth):
        z = layer(p, z, x)
    return z @ p["V"].T + p["c"]


def train(logits_fn, params, args, key, x, y) -> tuple[dict, float]:
    tx = optim.adam(args.lr)
    state = tx.init(params)
    grad = torch.func.grad(lambda p, xb, yb: F.cross_entropy(logits_fn(p, xb), yb))
    start = time.perf_counter()
    for step in range(args.steps):
        idx = random.permutation(random.fold_in(key, step), len(x))[: args.batch_size]
        updates, state = tx.update(grad(params, x[idx], y[idx]), state, params)
        params = optim.apply_updates(params, updates)
    return params, time.perf_counter() - start


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(-1) == y).float().mean())


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    k_split, k_init, k_batches = random.split(random.key(args.seed), 3)
    x, y = load_digits()
    (x_tr, y_tr), (x_te, y_te) = train_test_split(k_split, x, y, test_fraction=0.2)
    params0 = init(k_init, args.hidden)

    counter = Counter()
    deq, t_deq = train(lambda p, xb: deq_logits(p, xb, args, counter), params0, args,
                       k_batches, x_tr, y_tr)
    calls_per_step = counter.calls / args.steps
    unrolled, t_unrolled = train(lambda p, xb: unrolled_logits(p, xb, args.unroll), params0,
                                 args, k_batches, x_tr, y_tr)

    with torch.no_grad():
        acc_deq = accuracy(deq_logits(deq, x_te, args), y_te)
        acc_unrolled = accuracy(unrolled_logits(unrolled, x_te, args.unroll), y_te)
        # the trained DEQ read at the unrolled peer's depth: is it still a DEQ?
        acc_deq_truncated = accuracy(unrolled_logits(deq, x_te, args.unroll), y_te)

    # the implicit gradient against autodiff through 200 iterations, at the trained weights
    xb, yb = x_te[:256], y_te[:256]
    tight = argparse.Namespace(**{**vars(args), "tol": 1e-7, "max_iter": 200})
    g_imp = torch.func.grad(lambda p: F.cross_entropy(deq_logits(p, xb, tight), yb))(deq)
    g_ref = torch.func.grad(lambda p: F.cross_entropy(unrolled_logits(p, xb, 200), yb))(deq)
    flat = lambda g: torch.cat([v.reshape(-1) for v in g.values()])  # noqa: E731
    cosine = float(F.cosine_similarity(flat(g_imp), flat(g_ref), dim=0))
    rel_err = float((flat(g_imp) - flat(g_ref)).norm() / flat(g_ref).norm())

    print(f"DEQ ({args.method}, tol {args.tol:g}): test accuracy {acc_deq:.3f}, "
          f"{calls_per_step:.1f} layer evaluations per training step "
          f"(forward solve), {t_deq:.1f} s")
    print(f"unrolled x{args.unroll}: test accuracy {acc_unrolled:.3f}, {t_unrolled:.1f} s")
    print(f"the trained DEQ read after {args.unroll} iterations only: {acc_deq_truncated:.3f}")
    print(f"implicit gradient vs autodiff through 200 iterations: cosine {cosine:.6f}, "
          f"relative error {rel_err:.2e}")
    return {"deq_accuracy": acc_deq, "unrolled_accuracy": acc_unrolled,
            "deq_truncated_accuracy": acc_deq_truncated, "calls_per_step": calls_per_step,
            "grad_cosine": cosine, "grad_rel_err": rel_err, "deq_seconds": t_deq,
            "unrolled_seconds": t_unrolled}


if __name__ == "__main__":
    main()
