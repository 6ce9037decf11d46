"""An energy-based model on a 2-D toy distribution, trained with Langevin negatives.

p(x) ~ exp(-E(x)) with E an MLP (on Fourier features of x). Each step contrasts data x+
with negatives x- drawn by Langevin dynamics, x' = x - eta grad E(x) + sqrt(2 eta) z, that
continue persistent chains kept in a replay buffer (5% restarted from uniform noise) -- Du &
Mordatch (2019). The chains live in a box around the data (clamped), so the model is a
density on that box. The loss is contrastive divergence, mean E(x+) - mean E(x-), plus a
small L2 penalty on the energies.

    python examples/ebm_2d.py                        # about 1-2 min on 2 CPU cores
    python examples/ebm_2d.py --steps 100 --out /tmp/ebm_smoke

Writes <out>/ebm_2d.png (energy landscape, samples vs data, loss) and <out>/metrics.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

import torchfn
from torchfn import data, optim, random
from torchfn.losses import ebm_loss
from torchfn.models import MLPEnergy
from torchfn.transforms import langevin, replay_init, replay_push, replay_sample

TOYS = {
    "eight_gaussians": data.eight_gaussians,
    "two_moons": data.two_moons,
    "swiss_roll": data.swiss_roll,
    "rings": data.rings,
    "checkerboard": data.checkerboard,
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", choices=sorted(TOYS), default="eight_gaussians")
    p.add_argument("--steps", type=int, default=1500, help="training steps")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--alpha", type=float, default=0.03, help="L2 energy penalty")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--fourier", type=int, default=6, help="Fourier input features (0: off)")
    p.add_argument("--max-freq", type=float, default=6.0, help="highest Fourier frequency")
    p.add_argument(
        "--langevin-steps", type=int, default=30, help="Langevin steps per training step"
    )
    p.add_argument("--step-size", type=float, default=0.005, help="Langevin eta")
    p.add_argument("--buffer", type=int, default=10_000, help="replay buffer capacity")
    p.add_argument("--samples", type=int, default=2000, help="samples for the metrics")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=str, default="runs/ebm_2d")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    return p.parse_args(argv)


BOX = 2.5  # chains live in [-BOX, BOX]^2, restarts are uniform there (data has unit variance)


def uniform_init(key, n):  # (n, 2): where restarted chains begin
    return random.uniform(key, (n, 2), minval=-BOX, maxval=BOX)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    key = random.key(args.seed)
    k_train_data, k_test_data, k_ref_data, k_init, k_buf, k_train, k_eval = random.split(key, 7)
    toy = TOYS[args.data]

    # ---- data in unit-variance coordinates; held-out sets for the metrics
    train = toy(k_train_data, 20_000)  # (N, 2)
    scale = train.std()
    train = train / scale
    test = toy(k_test_data, args.samples)  # (n, 2)
    reference = toy(k_ref_data, args.samples)  # (n, 2): the data-vs-data baseline

    # ---- energy model E(x): (2,) -> (), optimizer, replay buffer
    model = torchfn.Model(
        MLPEnergy(2, hidden=args.hidden, depth=2, fourier=args.fourier, max_freq=args.max_freq)
    )
    params = model.init(k_init)
    tx = optim.adam(args.lr, betas=(0.0, 0.999))  # beta1 = 0 as in IGEBM
    opt_state = tx.init(params)
    buffer = replay_init(k_buf, args.buffer, uniform_init)  # data: (capacity, 2)

    def loss_fn(params, x_pos, x_neg):  # (B, 2), (B, 2)
        energy = torch.func.vmap(lambda x: model.apply(params, x))  # one example -> batch
        return ebm_loss(energy(x_pos), energy(x_neg), alpha=args.alpha)

    grad_fn = torch.func.grad_and_value(loss_fn)

    # ---- train
    losses = []
    t0 = time.perf_counter()
    bar = tqdm(range(args.steps), desc="train", dynamic_ncols=True)
    for step in bar:
        k_batch, k_buffer, k_langevin = random.split(random.fold_in(k_train, step), 3)
        x_pos = train[random.randint(k_batch, (args.batch,), 0, train.shape[0])]  # (B, 2)

        # negatives: continue persistent chains from the buffer under the current energy
        x_neg, idx = replay_sample(buffer, k_buffer, args.batch, init_fn=uniform_init)
        energy_fn = partial(model.apply, params)  # x: (2,) -> E(x): ()
        x_neg = langevin(
            energy_fn,
            x_neg,
            k_langevin,
            steps=args.langevin_steps,
            step_size=args.step_size,
            clamp=(-BOX, BOX),
        )  # (B, 2), detached
        buffer = replay_push(buffer, x_neg, idx)

        grads, loss = grad_fn(params, x_pos, x_neg)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optim.apply_updates(params, updates)
        losses.append(loss.item())
        if step % 25 == 0:
            bar.set_postfix(loss=f"{loss.item():+.4f}")
    train_seconds = time.perf_counter() - t0

    # ---- evaluate: the persistent chains, and fresh long-run chains from uniform noise
    energy_fn = lambda x: model.apply(params, x)
    k_pick, k_noise, k_run = random.split(k_eval, 3)
    chains = buffer.data[random.permutation(k_pick, args.buffer)[: args.samples]] * scale
    fresh = (
        langevin(
            energy_fn,
            uniform_init(k_noise, args.samples),
            k_run,
            steps=500,
            step_size=args.step_size,
            clamp=(-BOX, BOX),
        )
        * scale
    )
    metrics = {
        "config": vars(args),
        "final_loss": sum(losses[-100:]) / len(losses[-100:]),
        "energy_distance": {
            "replay_buffer": data.energy_distance(chains, test).item(),
            "fresh_langevin_500": data.energy_distance(fresh, test).item(),
            "data_baseline": data.energy_distance(reference, test).item(),
        },
        "train_seconds": round(train_seconds, 1),
    }
    if args.data == "eight_gaussians":
        centers, radius = data.eight_gaussians_centers(), 3 * math.sqrt(2) / 4
        named = (("replay_buffer", chains), ("fresh_langevin_500", fresh), ("data", reference))
        metrics["modes_covered"] = {
            name: data.modes_covered(x, centers, radius=radius) for name, x in named
        }
        metrics["share_within_3_std_of_a_mode"] = {
            name: data.mode_shares(x, centers, radius=radius).sum().item() for name, x in named
        }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if not args.no_plot:
        plot(out / "ebm_2d.png", energy_fn, scale, test, chains, fresh, losses)

    print(json.dumps({k: v for k, v in metrics.items() if k != "config"}, indent=2))
    print(f"wrote {out / 'metrics.json'}" + ("" if args.no_plot else f" and {out / 'ebm_2d.png'}"))
    return metrics


def plot(path, energy_fn, scale, test, chains, fresh, losses):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lim = float(BOX * scale)
    g = torch.linspace(-lim, lim, 200)
    grid = torch.stack(torch.meshgrid(g, g, indexing="xy"), dim=-1).reshape(-1, 2)  # (200^2, 2)
    with torch.no_grad():
        e = torch.func.vmap(energy_fn)(grid / scale).reshape(200, 200)
    density = torch.exp(-(e - e.min()))  # unnormalised model density

    fig, axes = plt.subplots(1, 5, figsize=(20, 4))
    axes[0].imshow(density.numpy(), origin="lower", extent=(-lim, lim, -lim, lim), cmap="viridis")
    axes[0].set(title="exp(-E(x))")
    for ax, pts, title in zip(
        axes[1:4], (test, chains, fresh), ("held-out data", "replay buffer", "fresh Langevin (500)")
    ):
        ax.scatter(pts[:, 0].numpy(), pts[:, 1].numpy(), s=2, alpha=0.5)
        ax.set(title=title, xlim=(-lim, lim), ylim=(-lim, lim), aspect="equal")
    axes[4].plot(losses, lw=0.5)
    axes[4].set(title="loss: E(x+) - E(x-) + alpha L2", xlabel="step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
