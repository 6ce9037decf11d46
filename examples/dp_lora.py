"""Private fine-tuning with LoRA: DP-SGD on low-rank adapters against DP-SGD on every
weight, at the same privacy budget.

A classifier is trained, without privacy, on a public half of the 8x8 digits. The
private half comes from another domain: each image transposed (a reflection across the
diagonal), on which the public model is poor. Both private runs then adapt it with
DP-SGD at the same (epsilon, delta), on the same Poisson batches and noise scale:

* ``full``: every weight of the MLP is trained (its per-example gradients have all the
  model's dimensions, and so does the noise);
* ``lora``: only rank-r adapters on each Linear layer (``models.with_lora``); the
  per-example gradients are ``vmap(grad)`` over the adapters alone, and the noise is
  added to those dimensions only. ``--freeze-a`` trains B alone and keeps A at its
  random init (FFA-LoRA, Sun et al. 2024): noise then enters the update linearly.

    python examples/dp_lora.py                   # epsilon = 2, rank 16
    python examples/dp_lora.py --freeze-a --lr-lora 0.3

On this toy, full fine-tuning is the one to beat (bench/RESULTS.md): LoRA's advantage
under DP grows with the model, and an MLP of 85k weights is far from that regime.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import torchfn
from torchfn import models, optim, random
from torchfn.data import load_digits, train_test_split
from torchfn.transforms import make_dp_step, noise_multiplier_for, poisson_sample, rdp_epsilon


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epsilon", type=float, default=2.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--freeze-a", action="store_true", help="train B only (FFA-LoRA)")
    p.add_argument("--steps", type=int, default=300, help="private steps")
    p.add_argument("--batch-size", type=int, default=64, help="expected Poisson batch")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--lr-full", type=float, default=0.1)
    p.add_argument("--lr-lora", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def transpose_images(x: torch.Tensor) -> torch.Tensor:
    """(N, 64) row-major 8x8 images -> the same images transposed."""
    return x.reshape(-1, 8, 8).transpose(1, 2).reshape(-1, 64)


def accuracy(model, params, x, y) -> float:
    with torch.no_grad():
        return float((model.apply(params, x).argmax(-1) == y).float().mean())


def pretrain(model, key, x, y, steps: int = 600) -> dict:
    """Non-private Adam on the public half (full batch)."""
    params = model.init(key)
    tx = optim.adam(3e-3)
    state = tx.init(params)
    grad = torch.func.grad(lambda p: F.cross_entropy(model.apply(p, x), y))
    for _ in range(steps):
        updates, state = tx.update(grad(params), state, params)
        params = optim.apply_updates(params, updates)
    return params


def dp_finetune(loss_fn, trainable, args, sigma, keys, x, y, lr) -> dict:
    """DP-SGD (momentum 0.5) on ``trainable`` for ``args.steps`` Poisson batches."""
    n, q = len(x), args.batch_size / len(x)
    dp = make_dp_step(loss_fn, optim.sgd(lr, momentum=0.5), l2_norm_clip=args.clip,
                      noise_multiplier=sigma, expected_batch_size=args.batch_size,
                      key=keys[1])
    state = dp.init(trainable)
    for step in range(args.steps):
        idx = poisson_sample(random.fold_in(keys[0], step), n, q)
        trainable, state, _ = dp.step(trainable, state, x[idx], y[idx])
    return trainable


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    k_split, k_half, k_init, k_lora, k_sample, k_noise = random.split(random.key(args.seed), 6)
    x, y = load_digits()
    (x_tr, y_tr), (x_te, y_te) = train_test_split(k_split, x, y, test_fraction=0.2)
    (x_pub, y_pub), (x_priv, y_priv) = train_test_split(k_half, x_tr, y_tr, test_fraction=0.5)
    x_priv, x_te = transpose_images(x_priv), transpose_images(x_te)  # the private domain

    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                        nn.Linear(256, 10))
    model = torchfn.Model(net)
    start = time.perf_counter()
    public = pretrain(model, k_init, x_pub, y_pub)
    q = args.batch_size / len(x_priv)
    sigma = noise_multiplier_for(args.epsilon, q, args.steps, args.delta)
    eps = rdp_epsilon(sigma, q, args.steps, args.delta)
    keys = (k_sample, k_noise)  # the same batches and noise keys for both runs
    print(f"public model: {accuracy(model, public, transpose_images(x_pub), y_pub):.3f} on "
          f"transposed public digits, {accuracy(model, public, x_te, y_te):.3f} on the "
          f"private test set; private N={len(x_priv)}, sigma={sigma:.3f}, "
          f"({eps:.2f}, {args.delta:g})-DP")

    # full: every weight, per-example grads over all of them
    def full_loss(params, x, y):  # ONE example
        return F.cross_entropy(model.apply(params, x), y)

    full = dp_finetune(full_loss, public, args, sigma, keys, x_priv, y_priv, args.lr_full)

    # lora: the public weights frozen, rank-r adapters on every Linear
    lora_net = models.with_lora(net, rank=args.rank)
    lora_model = torchfn.Model(lora_net)
    frozen, adapters = models.split_lora(lora_model.init(k_lora))
    frozen = {**frozen, **public}  # the public weights under their own names
    if args.freeze_a:  # A joins the frozen params; B (zeros) is all that trains
        frozen.update({k: v for k, v in adapters.items() if k.endswith("lora_A")})
        adapters = {k: v for k, v in adapters.items() if k.endswith("lora_B")}

    def lora_loss(adapters, x, y):  # ONE example; gradients for the adapters only
        return F.cross_entropy(lora_model.apply({**frozen, **adapters}, x), y)

    adapters = dp_finetune(lora_loss, adapters, args, sigma, keys, x_priv, y_priv,
                           args.lr_lora)
    merged = models.merge_lora(lora_net, {**frozen, **adapters})  # plain params for `net`

    n_full = sum(v.numel() for v in public.values())
    n_lora = sum(v.numel() for v in adapters.values())
    result = {
        "epsilon": eps,
        "public_accuracy": accuracy(model, public, x_te, y_te),
        "full_accuracy": accuracy(model, full, x_te, y_te),
        "lora_accuracy": accuracy(model, merged, x_te, y_te),
        "full_params": n_full,
        "lora_params": n_lora,
        "seconds": time.perf_counter() - start,
    }
    print(f"private test accuracy at ({eps:.2f}, {args.delta:g})-DP: full fine-tuning "
          f"{result['full_accuracy']:.3f} ({n_full:,} params), LoRA rank {args.rank}"
          f"{' (A frozen)' if args.freeze_a else ''} "
          f"{result['lora_accuracy']:.3f} ({n_lora:,} params); public model "
          f"{result['public_accuracy']:.3f}; {result['seconds']:.0f} s")
    return result


if __name__ == "__main__":
    main()
