"""Gradient descent at the edge of stability (Cohen et al., 2021), one run per learning
rate, all trained at once under ``vmap``.

Full-batch gradient descent on a tanh MLP (squared error on one-hot digits) with step
size ``lr``: the sharpness (the top eigenvalue of the loss's Hessian) rises during
training ("progressive sharpening") until it reaches ``2 / lr``, the largest sharpness at
which gradient descent on a quadratic is stable, and then hovers there while the loss
keeps going down, though no longer monotonically.

The runs share the initial params and differ only in ``lr``: their params are stacked
on a leading dim and one ``vmap``-ed step trains all of them; one ``vmap``-ed
``transforms.eigsh`` on ``transforms.hessian_operator`` gives every run's sharpness
(20 Lanczos steps each). The report gives each run's ``sharpness * lr / 2`` (1 at the
edge) at the start and over the last third of training.

    python examples/edge_of_stability.py                  # about 20 s on 2 cores
    python examples/edge_of_stability.py --plot out/eos.png
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.func import grad, vmap

import torchfn
from torchfn import random
from torchfn.data import load_digits
from torchfn.transforms import eigsh, hessian_operator


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--lrs", type=float, nargs="+", default=[0.4, 0.2, 0.1, 0.05])
    p.add_argument("--examples", type=int, default=500, help="the full batch")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--every", type=int, default=100, help="steps between sharpness reads")
    p.add_argument("--lanczos-steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write the curves to this PNG")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    k_init, k_lanczos = random.split(random.key(args.seed))
    x, y = load_digits()  # (1797, 64), (1797,)
    x, targets = x[:args.examples], nn.functional.one_hot(y[:args.examples], 10).float()
    model = torchfn.Model(nn.Sequential(
        nn.Linear(64, args.width), nn.Tanh(), nn.Linear(args.width, args.width), nn.Tanh(),
        nn.Linear(args.width, 10)))
    lrs = torch.tensor(args.lrs)  # (R,)
    runs = len(args.lrs)
    params = {k: v.expand(runs, *v.shape).clone()  # (R, ...): the same start for each
              for k, v in model.init(k_init).items()}

    def loss(p):  # one run's full-batch loss
        return 0.5 * ((model.apply(p, x) - targets) ** 2).sum(-1).mean()

    def sharpness(p):  # one run's top Hessian eigenvalue
        values, _ = eigsh(hessian_operator(loss, p), p, k_lanczos, steps=args.lanczos_steps)
        return values[0]

    def gd_step(p, lr):
        return {k: p[k] - lr * g for k, g in grad(loss)(p).items()}

    step, read, losses = vmap(gd_step), vmap(sharpness), vmap(loss)
    history: dict[str, list] = {"step": [], "sharpness": [], "loss": []}
    t0 = time.perf_counter()
    for it in range(args.steps + 1):
        if it % args.every == 0:
            history["step"].append(it)
            history["sharpness"].append(read(params))  # (R,)
            history["loss"].append(losses(params))  # (R,)
        if it < args.steps:
            params = step(params, lrs)
    sharp = torch.stack(history["sharpness"])  # (reads, R)
    loss_curve = torch.stack(history["loss"])  # (reads, R)
    edge = sharp * lrs / 2  # 1 at the edge of stability
    tail = edge[-max(1, len(edge) // 3):]
    metrics = {
        "lrs": args.lrs,
        "edge_start": edge[0].tolist(),
        "edge_last_third_mean": tail.mean(0).tolist(),
        "edge_last_third_max": tail.max(0).values.tolist(),
        "loss_start": loss_curve[0].tolist(),
        "loss_end": loss_curve[-1].tolist(),
        "seconds": time.perf_counter() - t0,
    }
    for r, lr in enumerate(args.lrs):
        print(f"lr {lr:g}: sharpness x lr / 2 {metrics['edge_start'][r]:.2f} -> "
              f"{metrics['edge_last_third_mean'][r]:.2f} (last third), loss "
              f"{metrics['loss_start'][r]:.4f} -> {metrics['loss_end'][r]:.4f}")
    print(f"{runs} runs, {args.steps} steps, {len(edge)} sharpness reads "
          f"({metrics['seconds']:.0f} s)")
    if args.plot:
        _plot(args.plot, history["step"], sharp, loss_curve, args.lrs)
    return metrics


def _plot(path: str, steps: list[int], sharp: torch.Tensor, loss: torch.Tensor,
          lrs: list[float]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are an optional extra (pip install torchfn[plots])
        print("matplotlib not installed: skipping the PNG")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for r, lr in enumerate(lrs):
        line, = ax1.plot(steps, sharp[:, r], label=f"lr {lr:g}")
        ax1.axhline(2 / lr, color=line.get_color(), ls=":", lw=1)
        ax2.plot(steps, loss[:, r], color=line.get_color())
    ax1.set(xlabel="step", ylabel="sharpness (dotted: 2 / lr)", yscale="log")
    ax2.set(xlabel="step", ylabel="train loss", yscale="log")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
