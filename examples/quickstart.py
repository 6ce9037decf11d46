"""Quickstart: a digits classifier in the torchfn style.

Everything is explicit: the model is a pure function of a parameter dict, the
randomness comes from one key, the optimizer state is data, and the loss is
written for ONE example -- ``per_sample_grads`` (``vmap(grad(loss))``) turns it
into per-example gradients for the whole batch.

    python examples/quickstart.py --steps 300 --seed 0
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import torchfn
from torchfn import optim, random, tree
from torchfn.data import load_digits, train_test_split
from torchfn.transforms import per_sample_grads


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    key = random.key(args.seed)
    init_key, split_key, batch_key = random.split(key, 3)

    # data: 1797 8x8 digits, x: (N, 64) in [0, 1], y: (N,)
    x, y = load_digits()
    (x_tr, y_tr), (x_te, y_te) = train_test_split(split_key, x, y, test_fraction=0.2)

    # model: any nn.Module becomes pure init(key) / apply(params, x)
    model = torchfn.Model(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    params = model.init(init_key)  # {'0.weight': (128, 64), '0.bias': (128,), ...}

    def loss_fn(params, x, y):  # ONE example: x (64,), y ()
        logits = model.apply(params, x)  # (10,)
        return F.cross_entropy(logits, y)

    grads_fn = per_sample_grads(loss_fn, return_value=True)  # leaves (B, *shape), losses (B,)
    opt = optim.adam(args.lr)
    opt_state = opt.init(params)

    history = []
    pbar = tqdm(range(args.steps), desc="quickstart", mininterval=0.5)
    for step in pbar:
        idx = random.randint(random.fold_in(batch_key, step), (args.batch_size,), 0, len(x_tr))
        grads, losses = grads_fn(params, x_tr[idx], y_tr[idx])  # per-example
        norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in tree.leaves(grads)))  # (B,)
        mean_grads = tree.map(lambda g: g.mean(0), grads)  # == the usual batch gradient
        updates, opt_state = opt.update(mean_grads, opt_state, params)
        params = optim.apply_updates(params, updates)

        loss = float(losses.mean())
        history.append(loss)
        pbar.set_postfix(loss=f"{loss:.3f}", grad_norm=f"{float(norms.median()):.2f}")
        if step % args.log_every == 0 or step == args.steps - 1:
            tqdm.write(f"step {step:4d}  loss {loss:.4f}  per-example grad norm "
                       f"median {float(norms.median()):.3f} max {float(norms.max()):.3f}")

    with torch.no_grad():
        accuracy = float((model.apply(params, x_te).argmax(-1) == y_te).float().mean())
    k = max(1, min(20, len(history) // 5))
    first, last = sum(history[:k]) / k, sum(history[-k:]) / k
    print(f"loss {first:.4f} -> {last:.4f}; test accuracy {accuracy:.4f} "
          f"({len(x_te)} held-out digits)")
    return {"loss_first": first, "loss_last": last, "test_accuracy": accuracy,
            "losses": history}


if __name__ == "__main__":
    main()
