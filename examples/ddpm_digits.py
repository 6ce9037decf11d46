"""Class-conditional DDPM (or flow matching) on the 8x8 digits with a U-Net, the torchfn way.

``models.UNet`` (class-conditional) learns the noise in x_t = sqrt(abar_t) x_0 +
sqrt(1 - abar_t) eps (Ho et al. 2020) on the training digits; DDIM then draws samples
of each digit. To judge them, a small MLP classifier is trained on the same training
digits: the share of samples it labels with the class they were drawn for measures how
well the model follows its condition (its accuracy on held-out real digits is the
ceiling). Everything is a pure function of explicit PRNG keys, so a seed fixes the run.

``--objective flow`` trains the same U-Net by flow matching instead (it predicts the
velocity ``eps - x0`` of ``x_s = (1 - s) x0 + s eps``, its time input ``s T``) and
samples with as many Euler steps as DDIM takes.

``--p-uncond 0.1`` trains with each label replaced by a null class 10% of the time
(``diffusion.drop_condition``), so that ``--guidance 1 2 4`` can sample with
classifier-free guidance at each weight (``diffusion.classifier_free_guidance``).

    python examples/ddpm_digits.py                              # about 3 min on 2 CPU cores
    python examples/ddpm_digits.py --objective flow
    python examples/ddpm_digits.py --steps 200 --out /tmp/ddpm_digits_smoke

Writes <out>/samples.png (a row of samples per digit, the loss curve) and
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
from torchfn.losses import diffusion_loss, flow_matching_loss
from torchfn.models import MLP, UNet
from torchfn.transforms import diffusion


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1000, help="training steps")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--timesteps", type=int, default=200, help="diffusion steps T")
    p.add_argument("--channels", type=int, default=32, help="U-Net width")
    p.add_argument("--per-class", type=int, default=20, help="samples per digit")
    p.add_argument("--objective", choices=["ddpm", "flow"], default="ddpm")
    p.add_argument("--p-uncond", type=float, default=0.0,
                   help="label dropout for classifier-free guidance")
    p.add_argument("--guidance", type=float, nargs="+", default=[1.0],
                   help="guidance weights to sample at (1: none; others need --p-uncond)")
    p.add_argument("--ddim-steps", type=int, default=50,
                   help="sampling steps: DDIM's, or Euler's with --objective flow")
    p.add_argument("--classifier-steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=str, default="runs/ddpm_digits")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    return p.parse_args(argv)


def train_classifier(x, y, key, steps):
    """A 64-128-10 MLP on flattened digits in [0, 1]; returns ``predict(images) -> labels``."""
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
    k_split, k_init, k_train, k_clf, k_sample = random.split(key, 5)

    # ---- data: digits as (N, 1, 8, 8) images in [-1, 1]; a held-out part for the classifier
    x, y = load_digits()  # (1797, 64) in [0, 1], (1797,)
    (x_train, y_train), (x_test, y_test) = train_test_split(k_split, x, y, test_fraction=0.2)
    images = (x_train * 2 - 1).reshape(-1, 1, 8, 8)  # (N, 1, 8, 8)

    # ---- model, noise schedule, optimizer
    guided = args.p_uncond > 0  # class 10 is then the null condition
    if not guided and any(w != 1.0 for w in args.guidance):
        raise SystemExit("--guidance other than 1 needs a model trained with --p-uncond > 0")
    null = torch.tensor([10])
    model = torchfn.Model(UNet(1, channels=args.channels, mults=(1, 2),
                               num_classes=11 if guided else 10))
    params = model.init(k_init)
    schedule = diffusion.cosine_schedule(args.timesteps)
    tx = optim.adam(optim.warmup_cosine(args.lr, args.steps // 20, args.steps, args.lr / 20))
    opt_state = tx.init(params)

    def loss_fn(params, x0, labels, key):  # x0: (B, 1, 8, 8), labels: (B,)
        if guided:
            k_drop, key = random.split(key)
            labels = diffusion.drop_condition(k_drop, labels, null, args.p_uncond)
        net = lambda x_t, t: model.apply(params, x_t, t, labels)  # noqa: E731
        if args.objective == "flow":  # the U-Net sees s T, in DDPM's range of timesteps
            return flow_matching_loss(net, x0, key, time_scale=float(args.timesteps))
        return diffusion_loss(net, schedule, x0, key)

    grad_fn = torch.func.grad_and_value(loss_fn)

    # ---- train: shuffle each epoch, one key per step via fold_in
    losses = []
    n_train, per_epoch = images.shape[0], images.shape[0] // args.batch
    t0 = time.perf_counter()
    bar = tqdm(range(args.steps), desc="train", dynamic_ncols=True)
    for step in bar:
        epoch, i = divmod(step, per_epoch)
        if i == 0:
            order = random.permutation(random.fold_in(k_train, 2 * epoch), n_train)  # (N,)
        idx = order[i * args.batch : (i + 1) * args.batch]  # (B,)
        grads, loss = grad_fn(params, images[idx], y_train[idx],
                              random.fold_in(k_train, 2 * step + 1))
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optim.apply_updates(params, updates)
        losses.append(loss.item())
        if step % 50 == 0:
            bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.4f}")
    train_seconds = time.perf_counter() - t0

    # ---- sample each digit with DDIM (or Euler on the flow), at each guidance weight
    labels = torch.arange(10).repeat_interleave(args.per_class)  # (10 n,)
    shape = (labels.shape[0], 1, 8, 8)
    by_guidance = {}
    t0 = time.perf_counter()
    for w in args.guidance:
        net = diffusion.classifier_free_guidance(
            lambda x_t, t, y: model.apply(params, x_t, t, y), labels, null, w)
        with torch.no_grad():
            if args.objective == "flow":
                x = diffusion.flow_sample(net, shape, k_sample, steps=args.ddim_steps,
                                          time_scale=float(args.timesteps), progress=True)
            else:
                x = diffusion.ddim_sample(net, schedule, shape, k_sample,
                                          steps=args.ddim_steps, clip_x0=1.0, progress=True)
        by_guidance[w] = (x.clamp(-1, 1) + 1) / 2  # (10 n, 1, 8, 8) in [0, 1]
    samples = by_guidance[args.guidance[0]]
    sample_seconds = time.perf_counter() - t0

    # ---- judge: a classifier trained on the real training digits reads the samples
    predict = train_classifier(x_train, y_train, k_clf, args.classifier_steps)
    metrics = {
        "config": vars(args),
        "final_loss": sum(losses[-100:]) / len(losses[-100:]),
        "samples_classified_as_their_condition": (predict(samples) == labels)
        .float().mean().item(),
        "classifier_accuracy_on_real_test_digits": (predict(x_test) == y_test)
        .float().mean().item(),
        "within_class_spread_vs_real": class_spread(samples.flatten(1), labels, x_train,
                                                    y_train).item(),
        "by_guidance": {
            str(w): {"classified_as_condition": (predict(x) == labels).float().mean().item(),
                     "within_class_spread_vs_real": class_spread(x.flatten(1), labels,
                                                                 x_train, y_train).item()}
            for w, x in by_guidance.items()},
        "train_seconds": round(train_seconds, 1),
        "sample_seconds": round(sample_seconds, 1),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if not args.no_plot:
        plot(out / "samples.png", samples, args.per_class, losses)
    print(json.dumps({k: v for k, v in metrics.items() if k != "config"}, indent=2))
    print(f"wrote {out / 'metrics.json'}" + ("" if args.no_plot else f" and {out / 'samples.png'}"))
    return metrics


def plot(path, samples, per_class, losses):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(per_class, 10)
    grid = samples.reshape(10, per_class, 8, 8)[:, :cols]  # (10, cols, 8, 8)
    grid = grid.permute(0, 2, 1, 3).reshape(10 * 8, cols * 8)  # (80, 8 cols)
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 5), width_ratios=(cols, 8))
    ax0.imshow(grid.numpy(), cmap="gray_r", vmin=0, vmax=1)
    ax0.set(title="samples, one row per digit 0-9", xticks=[], yticks=[])
    k = max(1, len(losses) // 100)
    smooth = [sum(losses[i : i + k]) / len(losses[i : i + k]) for i in range(0, len(losses), k)]
    ax1.plot(range(0, len(losses), k), smooth)
    ax1.set(title="training loss", xlabel="step", yscale="log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
