"""A physics-informed network (PINN) for a Poisson problem: Adam, then L-BFGS.

Solve ``-u''(x) = pi^2 sin(pi x) + 4 pi^2 sin(2 pi x)`` on [0, 1] with u(0) = u(1) = 0,
whose solution is ``u(x) = sin(pi x) + sin(2 pi x)``. The network ``u_theta(x)`` is an
MLP of one input; the loss is the mean squared PDE residual at collocation points plus
the squared boundary values. ``u''`` at each point is ``vmap`` of ``hessian`` of the
network written for one scalar input: no autograd graph over the batch, no
``create_graph``.

The usual recipe trains with Adam first and finishes with L-BFGS, which the residual's
smooth, full-batch loss suits: here ``optim.lbfgs`` (a pure transformation whose line
search calls the loss) with ``optim.value_and_grad_from_state``, so each iteration
costs about one forward and backward. The relative L2 error against the exact solution
is reported after each phase.

    python examples/pinn_poisson.py                   # about 15 s on 2 CPU cores
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch.func import functional_call, hessian, vmap

import torchfn
from torchfn import optim, random
from torchfn.models import MLP


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--adam-steps", type=int, default=1000)
    p.add_argument("--lbfgs-steps", type=int, default=1000)
    p.add_argument("--points", type=int, default=128, help="collocation points")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def exact(x):
    return torch.sin(math.pi * x) + torch.sin(2 * math.pi * x)


def source(x):  # f = -u''
    return math.pi**2 * torch.sin(math.pi * x) + 4 * math.pi**2 * torch.sin(2 * math.pi * x)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    k_init, k_points = random.split(random.key(args.seed))
    net = MLP(1, [args.hidden] * 3, 1, activation="tanh")
    model = torchfn.Model(net)
    # float64: L-BFGS takes the loss below what float32 resolves
    params = {k: v.double() for k, v in model.init(k_init).items()}
    # collocation points: a stratified draw, one per cell of an even grid
    cells = torch.arange(args.points, dtype=torch.float64)
    x = (cells + random.uniform(k_points, (args.points,), dtype=torch.float64)) / args.points
    x_test = torch.linspace(0, 1, 1001, dtype=torch.float64)

    def u(params, xi):  # one scalar input -> one scalar
        return functional_call(net, params, (xi.reshape(1, 1),)).reshape(())

    u_xx = vmap(hessian(u, argnums=1), in_dims=(None, 0))  # (N,) second derivatives

    def loss(params):
        residual = -u_xx(params, x) - source(x)  # (N,)
        ends = vmap(u, in_dims=(None, 0))(params, torch.tensor([0.0, 1.0], dtype=x.dtype))
        return residual.square().mean() + ends.square().sum()

    def l2_error(params):
        pred = vmap(u, in_dims=(None, 0))(params, x_test)
        return float(torch.linalg.norm(pred - exact(x_test)) / torch.linalg.norm(exact(x_test)))

    start = time.perf_counter()
    adam = optim.adam(optim.warmup_cosine(args.lr, 50, args.adam_steps, args.lr / 10))
    state = adam.init(params)
    grad_and_value = torch.func.grad_and_value(loss)
    for _ in range(args.adam_steps):
        g, value = grad_and_value(params)
        updates, state = adam.update(g, state, params)
        params = optim.apply_updates(params, updates)
    adam_loss, adam_error = float(loss(params)), l2_error(params)
    print(f"after {args.adam_steps} Adam steps: loss {adam_loss:.3e}, "
          f"relative L2 error {adam_error:.3e}")

    lbfgs = optim.lbfgs()  # the strong-Wolfe zoom search
    value_and_grad = optim.value_and_grad_from_state(loss)
    state = lbfgs.init(params)
    for _ in range(args.lbfgs_steps):
        value, g = value_and_grad(params, state=state)
        updates, state = lbfgs.update(g, state, params, value=value, grad=g, value_fn=loss)
        params = optim.apply_updates(params, updates)
    final_loss, final_error = float(loss(params)), l2_error(params)
    seconds = time.perf_counter() - start
    print(f"after {args.lbfgs_steps} L-BFGS steps: loss {final_loss:.3e}, "
          f"relative L2 error {final_error:.3e} ({seconds:.1f} s)")
    return {"adam_loss": adam_loss, "adam_error": adam_error, "final_loss": final_loss,
            "final_error": final_error, "seconds": seconds}


if __name__ == "__main__":
    main()
