"""DDPM on a 2-D toy distribution (8 Gaussians), the torchfn way.

An MLP denoiser learns to predict the noise in x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps
(Ho et al. 2020); we then draw samples with ancestral DDPM (all T steps), with DDIM
(50 steps) and with DPM-Solver++(2M) (10 steps, diffusers' default sampler).
Everything is a pure function of explicit PRNG keys, so a seed fixes the run.

    python examples/ddpm_2d.py                          # about 1-2 min on 2 CPU cores
    python examples/ddpm_2d.py --steps 300 --out /tmp/ddpm_smoke

Writes <out>/ddpm_2d.png (data vs samples, loss curve) and <out>/metrics.json with the
energy distance of the samples to held-out data (next to the data-vs-data baseline) and
the fraction of the 8 modes the samples cover.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

import torchfn
from torchfn import data, optim, random
from torchfn.losses import diffusion_loss
from torchfn.models import MLPDenoiser
from torchfn.transforms import diffusion


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3000, help="training steps")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--timesteps", type=int, default=1000, help="diffusion steps T")
    p.add_argument("--schedule", choices=["linear", "cosine"], default="linear")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--samples", type=int, default=2000, help="samples per sampler")
    p.add_argument("--ddim-steps", type=int, default=50)
    p.add_argument("--dpm-steps", type=int, default=10, help="DPM-Solver++(2M) steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=str, default="runs/ddpm_2d")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    key = random.key(args.seed)
    k_train_data, k_test_data, k_ref_data, k_init, k_train, k_ddpm, k_ddim = random.split(key, 7)

    # ---- data: a fixed training set, a held-out set and a second held-out set as the baseline
    train = data.eight_gaussians(k_train_data, 20_000)  # (N, 2)
    test = data.eight_gaussians(k_test_data, args.samples)  # (n, 2)
    reference = data.eight_gaussians(k_ref_data, args.samples)  # (n, 2): data vs data
    scale = train.std()  # work in unit-variance coordinates: x = data / scale

    # ---- model, noise schedule, optimizer
    model = torchfn.Model(MLPDenoiser(2, hidden=args.hidden, depth=args.depth))
    params = model.init(k_init)  # {name: tensor}
    schedule = {"linear": diffusion.linear_schedule, "cosine": diffusion.cosine_schedule}[
        args.schedule
    ](args.timesteps)
    tx = optim.adam(optim.warmup_cosine(args.lr, args.steps // 20, args.steps, args.lr / 20))
    opt_state = tx.init(params)

    def loss_fn(params, x0, key):  # x0: (B, 2)
        eps_fn = lambda x_t, t: model.apply(params, x_t, t)  # (B, 2), (B,) -> (B, 2)
        return diffusion_loss(eps_fn, schedule, x0, key)

    grad_fn = torch.func.grad_and_value(loss_fn)

    # ---- train: shuffle the training set each epoch, one key per step via fold_in
    losses = []
    n_train, per_epoch = train.shape[0], train.shape[0] // args.batch
    t0 = time.perf_counter()
    bar = tqdm(range(args.steps), desc="train", dynamic_ncols=True)
    for step in bar:
        epoch, i = divmod(step, per_epoch)
        if i == 0:
            order = random.permutation(random.fold_in(k_train, 2 * epoch), n_train)  # (N,)
        x0 = train[order[i * args.batch : (i + 1) * args.batch]] / scale  # (B, 2)
        grads, loss = grad_fn(params, x0, random.fold_in(k_train, 2 * step + 1))
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optim.apply_updates(params, updates)
        losses.append(loss.item())
        if step % 50 == 0:
            bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.4f}")
    train_seconds = time.perf_counter() - t0

    # ---- sample: ancestral DDPM over all T steps; DDIM and DPM-Solver++ on subsets
    k_dpm = random.fold_in(k_ddim, 1)
    eps_fn = lambda x_t, t: model.apply(params, x_t, t)
    shape = (args.samples, 2)
    t0 = time.perf_counter()
    with torch.no_grad():
        ddpm = diffusion.ddpm_sample(eps_fn, schedule, shape, k_ddpm, progress=True) * scale
        ddim = (
            diffusion.ddim_sample(
                eps_fn, schedule, shape, k_ddim, steps=args.ddim_steps, progress=True
            )
            * scale
        )
        dpm = diffusion.dpm_solver_sample(eps_fn, schedule, shape, k_dpm,
                                          steps=args.dpm_steps) * scale
    sample_seconds = time.perf_counter() - t0

    # ---- held-out log-likelihood by the probability-flow ODE (the linear schedule's
    # continuous limit, the VP SDE with beta from 0.1 to 20: T = 1000 only)
    nll = None
    if args.schedule == "linear" and args.timesteps == 1000:
        with torch.no_grad():
            ll = diffusion.probability_flow_log_likelihood(eps_fn, test[:500] / scale)
        nll = float(-ll.mean() + 2 * torch.log(scale))  # back to data coordinates (nats)

    # ---- metrics: energy distance to held-out data, modes covered
    centers = data.eight_gaussians_centers()  # (8, 2)
    radius = 3 * math.sqrt(2) / 4  # 3 standard deviations of a mode
    metrics = {
        "config": vars(args),
        "final_loss": sum(losses[-100:]) / len(losses[-100:]),
        "energy_distance": {
            "ddpm": data.energy_distance(ddpm, test).item(),
            f"ddim{args.ddim_steps}": data.energy_distance(ddim, test).item(),
            f"dpm_solver{args.dpm_steps}": data.energy_distance(dpm, test).item(),
            "data_baseline": data.energy_distance(reference, test).item(),
        },
        "modes_covered": {
            "ddpm": data.modes_covered(ddpm, centers, radius=radius),
            f"ddim{args.ddim_steps}": data.modes_covered(ddim, centers, radius=radius),
            f"dpm_solver{args.dpm_steps}": data.modes_covered(dpm, centers, radius=radius),
            "data": data.modes_covered(reference, centers, radius=radius),
        },
        "share_within_3_std_of_a_mode": {
            "ddpm": data.mode_shares(ddpm, centers, radius=radius).sum().item(),
            f"ddim{args.ddim_steps}": data.mode_shares(ddim, centers, radius=radius).sum().item(),
            f"dpm_solver{args.dpm_steps}": data.mode_shares(dpm, centers,
                                                            radius=radius).sum().item(),
            "data": data.mode_shares(reference, centers, radius=radius).sum().item(),
        },
        "test_nll_probability_flow": nll,
        "train_seconds": round(train_seconds, 1),
        "sample_seconds": round(sample_seconds, 1),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if not args.no_plot:
        plot(out / "ddpm_2d.png", test, ddpm, ddim, losses, args.ddim_steps)

    print(json.dumps({k: v for k, v in metrics.items() if k != "config"}, indent=2))
    print(f"wrote {out / 'metrics.json'}" + ("" if args.no_plot else f" and {out / 'ddpm_2d.png'}"))
    return metrics


def plot(path, test, ddpm, ddim, losses, ddim_steps):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    for ax, pts, title in zip(
        axes,
        (test, ddpm, ddim),
        ("held-out data", "DDPM (ancestral)", f"DDIM ({ddim_steps} steps)"),
    ):
        ax.scatter(pts[:, 0].numpy(), pts[:, 1].numpy(), s=2, alpha=0.5)
        ax.set(title=title, xlim=(-4.5, 4.5), ylim=(-4.5, 4.5), aspect="equal")
    k = max(1, len(losses) // 100)
    smooth = [sum(losses[i : i + k]) / len(losses[i : i + k]) for i in range(0, len(losses), k)]
    axes[3].plot(range(0, len(losses), k), smooth)
    axes[3].set(title="training loss (eps MSE)", xlabel="step", yscale="log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
