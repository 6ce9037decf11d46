"""DP-SGD on the 8x8 digits: Poisson batches, per-example clipping, Gaussian noise,
and the privacy spent (epsilon at delta) from the RDP accountant.

    python examples/dp_sgd.py                          # sigma = 1.2, 400 steps
    python examples/dp_sgd.py --epsilon 3.0            # pick sigma for a target epsilon
    python examples/dp_sgd.py --method ghost           # ghost clipping, no per-example grads
    python examples/dp_sgd.py --method two_pass        # norms, then a reweighted backward

Writes ``<out>/metrics.json`` and ``<out>/curves.png`` (default ``out/dp_sgd``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import torchfn
from torchfn import optim, random
from torchfn.data import load_digits, train_test_split
from torchfn.transforms import make_dp_step, noise_multiplier_for, poisson_sample, rdp_epsilon


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=64, help="EXPECTED batch size q*N")
    p.add_argument("--clip", type=float, default=1.0, help="per-example L2 clip C")
    p.add_argument("--noise-multiplier", type=float, default=1.2, help="sigma")
    p.add_argument("--epsilon", type=float, default=None, help="target epsilon (sets sigma)")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--method", choices=["vmap", "two_pass", "ghost"], default="vmap")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/dp_sgd"))
    return p.parse_args(argv)


def accuracy(model, params, x, y) -> float:
    with torch.no_grad():
        return float((model.apply(params, x).argmax(-1) == y).float().mean())


def save_plot(path: Path, history: dict, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are an optional extra (pip install torchfn[plots])
        print("matplotlib not installed: skipping the PNG")
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot(history["step"], history["loss"], lw=0.8)
    ax1.set(xlabel="step", ylabel="train loss (Poisson batch)", title="loss")
    ax2.plot(history["eval_step"], history["test_accuracy"], marker="o", ms=3)
    ax2.set(xlabel="step", ylabel="test accuracy", title="accuracy", ylim=(0, 1))
    ax3 = ax2.twinx()
    ax3.plot(history["eval_step"], history["epsilon"], color="tab:red", lw=1)
    ax3.set_ylabel("epsilon spent", color="tab:red")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    key = random.key(args.seed)
    init_key, split_key, sample_key, noise_key = random.split(key, 4)

    x, y = load_digits()  # (1797, 64) in [0, 1], (1797,)
    (x_tr, y_tr), (x_te, y_te) = train_test_split(split_key, x, y, test_fraction=0.2)
    n = len(x_tr)
    q = args.batch_size / n  # Poisson sampling rate
    sigma = args.noise_multiplier
    if args.epsilon is not None:
        sigma = noise_multiplier_for(args.epsilon, q, args.steps, args.delta)
    print(f"N={n}  q={q:.4f}  sigma={sigma:.3f}  C={args.clip}  steps={args.steps}  "
          f"method={args.method}")

    model = torchfn.Model(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    params = model.init(init_key)

    if args.method != "ghost":
        def loss_fn(params, x, y):  # ONE example: x (64,), y ()
            return F.cross_entropy(model.apply(params, x), y)
    else:
        def loss_fn(params, x, y):  # batched, per-example losses: x (B, 64) -> (B,)
            return F.cross_entropy(model.apply(params, x), y, reduction="none")

    dp = make_dp_step(
        loss_fn, optim.sgd(args.lr, momentum=args.momentum),
        l2_norm_clip=args.clip, noise_multiplier=sigma, expected_batch_size=args.batch_size,
        key=noise_key, method=args.method,
    )
    opt_state = dp.init(params)

    hist = {"step": [], "loss": [], "batch_size": [], "eval_step": [], "test_accuracy": [],
            "epsilon": []}
    t0 = time.perf_counter()
    pbar = tqdm(range(args.steps), desc="dp-sgd", mininterval=0.5)
    for step in pbar:
        idx = poisson_sample(random.fold_in(sample_key, step), n, q)  # (b,), b ~ Bin(N, q)
        params, opt_state, loss = dp.step(params, opt_state, x_tr[idx], y_tr[idx])
        hist["step"].append(step)
        hist["loss"].append(float(loss))  # nan for an (unlikely) empty batch
        hist["batch_size"].append(len(idx))
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            acc = accuracy(model, params, x_te, y_te)
            eps = rdp_epsilon(sigma, q, step + 1, args.delta)
            hist["eval_step"].append(step + 1)
            hist["test_accuracy"].append(acc)
            hist["epsilon"].append(eps)
            pbar.set_postfix(loss=f"{float(loss):.3f}", acc=f"{acc:.3f}", eps=f"{eps:.2f}")

    losses = [v for v in hist["loss"] if not math.isnan(v)]
    k = max(1, min(25, len(losses) // 5))
    metrics = {
        "test_accuracy": hist["test_accuracy"][-1],
        "epsilon": hist["epsilon"][-1],
        "delta": args.delta,
        "noise_multiplier": sigma,
        "l2_norm_clip": args.clip,
        "sample_rate": q,
        "steps": args.steps,
        "epochs": args.steps * q,
        "method": args.method,
        "loss_first": sum(losses[:k]) / k,
        "loss_last": sum(losses[-k:]) / k,
        "mean_batch_size": sum(hist["batch_size"]) / len(hist["batch_size"]),
        "seconds": time.perf_counter() - t0,
        "seed": args.seed,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    title = (f"DP-SGD on digits: ({metrics['epsilon']:.2f}, {args.delta:g})-DP, "
             f"sigma={sigma:.2f}, C={args.clip}")
    save_plot(args.out / "curves.png", hist, title)
    print(f"test accuracy {metrics['test_accuracy']:.4f} at ({metrics['epsilon']:.2f}, "
          f"{args.delta:g})-DP; loss {metrics['loss_first']:.3f} -> {metrics['loss_last']:.3f}; "
          f"wrote {args.out}/metrics.json and curves.png")
    return metrics


if __name__ == "__main__":
    main()
