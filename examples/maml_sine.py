"""MAML on few-shot sine regression (Finn et al. 2017), differentiating through torchopt.

Each task is a sine wave ``y = A sin(x - phase)``; the model sees K points of a
new wave, takes a few inner optimizer steps, and is scored on fresh points of the
same wave. The meta-gradient flows through the inner updates: they are
torchopt's functional (differentiable) optimizers called with ``inplace=False``
on a graph built with ``create_graph=True``. Tasks are batched by giving every
task its own copy of the parameters (a leading task axis, ``(T, ...)``): the
per-task inner gradients come from one backward of the summed task losses. The
outer loop is ``torchfn.optim.adam``.

    python examples/maml_sine.py                 # 1000 meta-steps, ~10 s of CPU
    python examples/maml_sine.py --inner adam    # differentiate through torchopt.adam
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch
import torchopt
from torch import Tensor

from torchfn import optim, random

Params = dict[str, Tensor]


def init_mlp(key: Tensor, sizes: tuple[int, ...] = (1, 40, 40, 1), dtype=torch.float32) -> Params:
    """nn.Linear's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    params: Params = {}
    keys = random.split(key, 2 * (len(sizes) - 1))
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        bound = 1.0 / math.sqrt(n_in)
        params[f"w{i}"] = random.uniform(keys[2 * i], (n_in, n_out), dtype, -bound, bound)
        params[f"b{i}"] = random.uniform(keys[2 * i + 1], (n_out,), dtype, -bound, bound)
    return params


def mlp(params: Params, x: Tensor) -> Tensor:
    """x: (T, N, 1) -> (T, N, 1); params shared (w: (in, out)) or per task (w: (T, in, out))."""
    n = len(params) // 2
    for i in range(n):
        x = x @ params[f"w{i}"] + params[f"b{i}"].unsqueeze(-2)
        if i < n - 1:
            x = torch.relu(x)
    return x


def task_losses(params: Params, x: Tensor, y: Tensor) -> Tensor:
    """Mean squared error of each task: (T,)."""
    return ((mlp(params, x) - y) ** 2).mean(dim=(1, 2))


def sample_tasks(key: Tensor, n_tasks: int, k_shot: int, k_query: int, dtype=torch.float32):
    """Support and query sets: xs, ys: (T, K, 1); xq, yq: (T, Q, 1)."""
    k_amp, k_phase, k_xs, k_xq = random.split(key, 4)
    amp = random.uniform(k_amp, (n_tasks, 1, 1), dtype, 0.1, 5.0)
    phase = random.uniform(k_phase, (n_tasks, 1, 1), dtype, 0.0, math.pi)
    xs = random.uniform(k_xs, (n_tasks, k_shot, 1), dtype, -5.0, 5.0)
    xq = random.uniform(k_xq, (n_tasks, k_query, 1), dtype, -5.0, 5.0)
    return xs, amp * torch.sin(xs - phase), xq, amp * torch.sin(xq - phase)


def make_inner(name: str, lr: float) -> Any:
    if name == "sgd":
        return torchopt.sgd(lr)
    if name == "adam":
        # eps_root > 0 keeps d sqrt(v)/dv finite where a gradient is exactly 0 (dead ReLU)
        return torchopt.adam(lr, eps_root=1e-10)
    raise ValueError(f"inner must be 'sgd' or 'adam', got {name!r}")


def adapt(params: Params, x: Tensor, y: Tensor, inner: Any, steps: int) -> Params:
    """``steps`` differentiable torchopt updates on each task's support set.

    params: shared, leaves (...); returns per-task params, leaves (T, ...), still
    differentiable w.r.t. the shared params.
    """
    n_tasks = x.shape[0]
    task_params = {k: v.expand(n_tasks, *v.shape) for k, v in params.items()}
    state = inner.init(task_params)
    for _ in range(steps):
        loss = task_losses(task_params, x, y).sum()  # tasks are independent: grad of the sum
        g = torch.autograd.grad(loss, list(task_params.values()), create_graph=True)
        grads = dict(zip(task_params, g))
        updates, state = inner.update(grads, state, params=task_params, inplace=False)
        task_params = torchopt.apply_updates(task_params, updates, inplace=False)
    return task_params


def meta_loss(params: Params, tasks: tuple[Tensor, ...], inner: Any, steps: int) -> Tensor:
    """Mean query loss after adaptation, over a batch of tasks."""
    xs, ys, xq, yq = tasks
    return task_losses(adapt(params, xs, ys, inner, steps), xq, yq).mean()


def meta_grad(params: Params, tasks: tuple[Tensor, ...], inner: Any, steps: int):
    """(grads, loss): the gradient of ``meta_loss`` through the inner loop."""
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    loss = meta_loss(leaves, tasks, inner, steps)
    g = torch.autograd.grad(loss, list(leaves.values()))
    return dict(zip(leaves, g)), loss.detach()


def train(
    steps: int = 1000,
    meta_batch: int = 10,
    k_shot: int = 10,
    inner: str = "sgd",
    inner_lr: float = 0.01,
    inner_steps: int = 1,
    outer_lr: float = 3e-3,
    seed: int = 0,
    log_every: int = 200,
    verbose: bool = True,
) -> list[float]:
    """Meta-train; returns the meta-loss of every step."""
    key = random.key(seed)
    params = init_mlp(random.fold_in(key, 0))
    inner_opt = make_inner(inner, inner_lr)
    outer = optim.adam(outer_lr)
    state = outer.init(params)
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(steps):
        task_key = random.fold_in(random.fold_in(key, 1), step)
        tasks = sample_tasks(task_key, meta_batch, k_shot, k_shot)
        grads, loss = meta_grad(params, tasks, inner_opt, inner_steps)
        updates, state = outer.update(grads, state)
        params = optim.apply_updates(params, updates)
        losses.append(float(loss))
        if verbose and (step + 1) % log_every == 0:
            recent = sum(losses[-log_every:]) / log_every
            elapsed = time.perf_counter() - start
            print(f"step {step + 1:5d}  meta-loss {recent:.3f}  ({elapsed:.1f}s)")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--meta-batch", type=int, default=10)
    parser.add_argument("--inner", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--inner-steps", type=int, default=1)
    parser.add_argument("--inner-lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="tiny model: 1 thread is fastest")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    losses = train(args.steps, args.meta_batch, inner=args.inner, inner_lr=args.inner_lr,
                   inner_steps=args.inner_steps, seed=args.seed)
    first, last = sum(losses[:100]) / 100, sum(losses[-100:]) / 100
    print(f"meta-loss: first 100 steps {first:.3f} -> last 100 steps {last:.3f}")


if __name__ == "__main__":
    main()
