"""Class-conditional WGAN-GP on the 8x8 digits, judged like ddpm_digits.py.

``models.ConvGenerator`` maps noise and a digit label to an image; ``models.ConvCritic``
(a projection critic) scores image-label pairs. The critic minimises
mean D(fake) - mean D(real) plus 10 times the gradient penalty, taken per example with
``vmap(grad)`` through the conditional critic (``gradient_penalty(..., cond=(labels,))``)
and differentiated again. Five critic steps per generator step, Adam(betas=(0.5, 0.9)),
the critic at a higher rate than the generator, as in wgan_2d.py.

The samples are judged as in ddpm_digits.py, with the same split of the data: a small
MLP classifier trained on the real training digits labels each sample, and the share
it labels with the digit the sample was drawn for measures how well the generator
follows its condition (the classifier's accuracy on held-out real digits is the ceiling).

    python examples/wgan_digits.py                              # about 2 min on 2 CPU cores
    python examples/wgan_digits.py --steps 100 --out /tmp/wgan_digits_smoke

Writes <out>/samples.png (a row of samples per digit, the critic loss) and
<out>/metrics.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import torchfn
from torchfn import optim, random
from torchfn.data import class_spread, load_digits, train_test_split
from torchfn.losses import gradient_penalty, wgan_losses
from torchfn.models import MLP, ConvCritic, ConvGenerator


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1500, help="generator steps")
    p.add_argument("--critic-steps", type=int, default=5, help="critic steps per generator step")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-4, help="generator learning rate")
    p.add_argument("--critic-lr", type=float, default=4e-4)
    p.add_argument("--gp", type=float, default=10.0, help="gradient penalty weight")
    p.add_argument("--latent", type=int, default=32)
    p.add_argument("--width", type=int, default=32, help="channels of the first stage")
    p.add_argument("--per-class", type=int, default=20, help="samples per digit")
    p.add_argument("--classifier-steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=str, default="runs/wgan_digits")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    return p.parse_args(argv)


def train_classifier(x, y, key, steps):
    """A 64-128-10 MLP on flattened digits in [0, 1] (as ddpm_digits.py's); returns
    ``predict(images) -> labels``."""
    model = torchfn.Model(MLP(64, (128,), 10))
    k_init, k_batch = random.split(key)
    params = model.init(k_init)
    tx = optim.adam(3e-3)
    state = tx.init(params)
    loss = lambda p, xb, yb: F.cross_entropy(model.apply(p, xb), yb)  # noqa: E731
    for step in range(steps):
        idx = random.randint(random.fold_in(k_batch, step), (128,), 0, x.shape[0])  # (128,)
        grads = torch.func.grad(loss)(params, x[idx], y[idx])
        updates, state = tx.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return lambda images: model.apply(params, images.reshape(-1, 64)).argmax(-1)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    key = random.key(args.seed)
    k_split, k_init, k_train, k_clf, k_sample = random.split(key, 5)  # as ddpm_digits.py

    # ---- data: digits as (N, 1, 8, 8) images in [-1, 1]; a held-out part for the classifier
    x, y = load_digits()  # (1797, 64) in [0, 1], (1797,)
    (x_train, y_train), (x_test, y_test) = train_test_split(k_split, x, y, test_fraction=0.2)
    images = (x_train * 2 - 1).reshape(-1, 1, 8, 8)  # (N, 1, 8, 8)

    # ---- the two players and their optimizers
    generator = torchfn.Model(ConvGenerator(args.latent, 8, 1, args.width, num_classes=10))
    critic = torchfn.Model(ConvCritic(8, 1, args.width, num_classes=10))
    k_g, k_d = random.split(k_init)
    g_params, d_params = generator.init(k_g), critic.init(k_d)
    g_tx = optim.adam(args.lr, betas=(0.5, 0.9))
    d_tx = optim.adam(args.critic_lr, betas=(0.5, 0.9))
    g_state, d_state = g_tx.init(g_params), d_tx.init(d_params)

    def critic_loss(d_params, g_params, real, labels, key):  # real: (B, 1, 8, 8)
        k_z, k_gp = random.split(key)
        z = random.normal(k_z, (real.shape[0], args.latent))  # (B, latent)
        fake = generator.apply(g_params, z, labels).detach()  # same labels as the real ones
        loss, _ = wgan_losses(critic.apply(d_params, real, labels),
                              critic.apply(d_params, fake, labels))
        penalty = gradient_penalty(critic.apply, d_params, real, fake, k_gp, cond=(labels,))
        return loss + args.gp * penalty

    def generator_loss(g_params, d_params, key):
        k_z, k_y = random.split(key)
        labels = random.randint(k_y, (args.batch,), 0, 10)  # (B,)
        fake = generator.apply(g_params, random.normal(k_z, (args.batch, args.latent)), labels)
        return -critic.apply(d_params, fake, labels).mean()

    d_grad = torch.func.grad_and_value(critic_loss)
    g_grad = torch.func.grad(generator_loss)

    # ---- train: shuffle each epoch, one key per step via fold_in
    n, per_epoch = images.shape[0], images.shape[0] // args.batch
    critic_losses, t0, batch_i = [], time.perf_counter(), 0
    bar = tqdm(range(args.steps), desc="train", dynamic_ncols=True)
    for step in bar:
        k_step = random.fold_in(k_train, step)
        for c in range(args.critic_steps):
            epoch, i = divmod(batch_i, per_epoch)
            if i == 0:
                order = random.permutation(random.fold_in(k_train, -1 - epoch), n)  # (N,)
            idx = order[i * args.batch : (i + 1) * args.batch]  # (B,)
            batch_i += 1
            grads, loss = d_grad(d_params, g_params, images[idx], y_train[idx],
                                 random.fold_in(k_step, c))
            updates, d_state = d_tx.update(grads, d_state, d_params)
            d_params = optim.apply_updates(d_params, updates)
            critic_losses.append(loss.item())
        grads = g_grad(g_params, d_params, random.fold_in(k_step, args.critic_steps))
        updates, g_state = g_tx.update(grads, g_state, g_params)
        g_params = optim.apply_updates(g_params, updates)
        if step % 50 == 0:
            recent = critic_losses[-50:]
            bar.set_postfix(critic=f"{sum(recent) / len(recent):.3f}")
    train_seconds = time.perf_counter() - t0

    # ---- sample each digit, then judge with a classifier trained on the real digits
    labels = torch.arange(10).repeat_interleave(args.per_class)  # (10 n,)
    with torch.no_grad():
        z = random.normal(k_sample, (labels.shape[0], args.latent))
        samples = (generator.apply(g_params, z, labels) + 1) / 2  # (10 n, 1, 8, 8) in [0, 1]
    predict = train_classifier(x_train, y_train, k_clf, args.classifier_steps)
    metrics = {
        "config": vars(args),
        "final_critic_loss": sum(critic_losses[-100:]) / len(critic_losses[-100:]),
        "samples_classified_as_their_condition": (predict(samples) == labels)
        .float().mean().item(),
        "classifier_accuracy_on_real_test_digits": (predict(x_test) == y_test)
        .float().mean().item(),
        "within_class_spread_vs_real": class_spread(samples.flatten(1), labels, x_train,
                                                    y_train).item(),
        "train_seconds": round(train_seconds, 1),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if not args.no_plot:
        plot(out / "samples.png", samples, args.per_class, critic_losses)
    print(json.dumps({k: v for k, v in metrics.items() if k != "config"}, indent=2))
    print(f"wrote {out / 'metrics.json'}" + ("" if args.no_plot else f" and {out / 'samples.png'}"))
    return metrics


def plot(path, samples, per_class, losses):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(12, 5.5))
    grid = fig.add_gridspec(1, 2, width_ratios=(2, 1))
    ax = fig.add_subplot(grid[0])
    shown = min(per_class, 12)
    tiles = samples.reshape(10, per_class, 8, 8)[:, :shown]  # (10, shown, 8, 8)
    ax.imshow(tiles.permute(0, 2, 1, 3).reshape(80, 8 * shown).numpy(), cmap="gray_r", vmin=0,
              vmax=1)
    ax.set(title="samples: one row per digit 0-9", xticks=[], yticks=[])
    ax = fig.add_subplot(grid[1])
    ax.plot(losses, lw=0.5)
    ax.set(xlabel="critic step", ylabel="critic loss", title="WGAN-GP critic loss")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
