"""Flow matching, OT flow matching, EDM, MeanFlow and consistency models on a 2-D toy
(8 Gaussians), at equal budgets.

Copies of one MLP learn the same data by six objectives:

* ``flow``: rectified flow (``losses.flow_matching_loss``), noise paired with data at random;
* ``flow_ot``: the same, with each batch's noise paired by exact optimal transport
  (``coupling="ot"``), which straightens the paths;
* ``edm``: Karras et al.'s preconditioned denoiser (``losses.edm_loss``);
* ``mean_flow``: the average velocity over an interval (``losses.mean_flow_loss``,
  whose target takes a ``jvp`` of the network), for one-step sampling; its MLP also
  embeds the interval's start (``MLPDenoiser(times=2)``);
* ``ict``: consistency training as iCT (``losses.consistency_loss`` on
  ``diffusion.consistency_levels``' doubling curriculum), for one-step sampling;
* ``scm``: continuous-time consistency training on the TrigFlow path
  (``losses.scm_loss``: a ``jvp`` of the network, with tangent warm-up).

Then each is sampled with few model calls (``flow_sample`` with Euler, ``edm_sample``
with Heun, ``mean_flow_sample`` with one call per interval, ``consistency_sample`` /
``trigflow_sample`` with one call per level), and the samples are
scored by their energy distance to held-out data, next to a second held-out set (the
data-vs-data floor). The two flows are also continuous normalizing flows, so their
held-out log-likelihood is exact (``diffusion.flow_log_likelihood``).

    python examples/flow_matching_2d.py                  # about 3.5 min on 2 cores
    python examples/flow_matching_2d.py --steps 300 --out /tmp/fm_smoke

Writes <out>/metrics.json (and <out>/flow_matching_2d.png unless --no-plot).

With the defaults (3.5 min on 2 cores), at 2 model calls OT pairing's energy distance is
0.002 against 1.8 for random pairing; at 32 calls the three are within 0.0005-0.004
of the data (bench/RESULTS.md has the table). iCT and sCM get 0.004 and 0.002 in one
call. EDM's Heun sampler needs its usual 16+ steps: with fewer, its levels from
sigma = 80 are too far apart.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

import torchfn
from torchfn import data, losses, optim, random
from torchfn.models import MLPDenoiser
from torchfn.transforms import diffusion

OBJECTIVES = ("flow", "flow_ot", "edm", "mean_flow", "ict", "scm")
# sCM's c_noise = 10 t for TrigFlow's t in [0, pi/2]. sCM found that a large time scale
# (EDM's 1000x) destabilises continuous-time training, as dF/dt grows with it; here 1000 /
# (pi / 2) gave a one-step energy distance of 1.99, 100 gave 0.031, 10 gave 0.0019 and
# 1 gave 0.0028 (bench/RESULTS.md).
TRIG_SCALE = 10.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2500, help="training steps per objective")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--calls", type=int, nargs="+", default=[2, 4, 8, 16, 32],
                   help="model calls per sample to compare at")
    p.add_argument("--nll-points", type=int, default=500,
                   help="held-out points for the flows' exact log-likelihood (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=str, default="runs/flow_matching_2d")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    return p.parse_args(argv)


def make_loss(objective: str, model: torchfn.Model, total_steps: int):
    """``loss(params, x0, key, step)`` for one objective; the model sees time in [0, 1000]."""
    if objective == "mean_flow":
        def loss(params, x0, key, step):  # the model reads (z, t, r); u_fn is u(z, r, t)
            u = lambda z, r, t: model.apply(params, z, t, r)  # noqa: E731
            return losses.mean_flow_loss(u, x0, key, time_scale=1000.0)
        return loss
    if objective in ("edm", "ict"):
        def loss(params, x0, key, step):  # c_noise = log(sigma) / 4 in about [-1.6, 1.1]
            net = lambda x_in, c_noise: model.apply(params, x_in, 250.0 * c_noise)  # noqa: E731
            if objective == "edm":
                return losses.edm_loss(diffusion.edm_denoiser(net, sigma_data=1.0), x0, key,
                                       sigma_data=1.0)
            f = diffusion.consistency_function(net, sigma_data=1.0)
            levels = diffusion.consistency_levels(step, total_steps)
            return losses.consistency_loss(f, x0, key, levels)
        return loss
    if objective == "scm":
        warmup = max(1, total_steps // 10)

        def loss(params, x0, key, step):
            F = lambda x_in, t: model.apply(params, x_in, t)  # noqa: E731
            return losses.scm_loss(F, x0, key, sigma_data=1.0, time_scale=TRIG_SCALE,
                                   tangent_warmup=min(1.0, step / warmup))
        return loss
    coupling = "ot" if objective == "flow_ot" else "independent"

    def loss(params, x0, key, step):
        v = lambda x, t: model.apply(params, x, t)  # noqa: E731
        return losses.flow_matching_loss(v, x0, key, coupling=coupling, time_scale=1000.0)
    return loss


def sample(objective: str, model, params, shape, key, calls: int) -> tuple[str, torch.Tensor]:
    """Samples at a budget of ``calls`` model calls: Euler for the flows (one per step),
    Heun for EDM (2 steps - 1 calls, so steps = (calls + 1) // 2), one interval per call
    for MeanFlow, one level per call for the consistency models (the first ``calls`` of
    ``calls + 1`` Karras levels from sigma = 80; TrigFlow's ``t = arctan(sigma)``)."""
    if objective == "mean_flow":
        u = lambda z, r, t: model.apply(params, z, t, r)  # noqa: E731
        return f"mean_flow{calls}", diffusion.mean_flow_sample(u, shape, key, steps=calls,
                                                               time_scale=1000.0)
    levels = diffusion.edm_sigmas(calls + 1, sigma_max=80.0)[:calls]
    if objective == "ict":
        net = lambda x_in, c_noise: model.apply(params, x_in, 250.0 * c_noise)  # noqa: E731
        f = diffusion.consistency_function(net, sigma_data=1.0)
        return f"cm{calls}", diffusion.consistency_sample(f, shape, key, sigmas=levels)
    if objective == "scm":
        F = lambda x_in, t: model.apply(params, x_in, t)  # noqa: E731
        f = diffusion.trigflow_consistency(F, sigma_data=1.0, time_scale=TRIG_SCALE)
        return f"scm{calls}", diffusion.trigflow_sample(f, shape, key, times=levels.atan(),
                                                        sigma_data=1.0)
    if objective == "edm":
        net = lambda x_in, c_noise: model.apply(params, x_in, 250.0 * c_noise)  # noqa: E731
        steps = max(1, (calls + 1) // 2)
        x = diffusion.edm_sample(diffusion.edm_denoiser(net, sigma_data=1.0), shape, key,
                                 steps=steps, method="heun", sigma_max=80.0)
        return f"heun{steps}", x
    v = lambda x, t: model.apply(params, x, t)  # noqa: E731
    return f"euler{calls}", diffusion.flow_sample(v, shape, key, steps=calls, time_scale=1000.0)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    key = random.key(args.seed)
    k_train_data, k_test, k_ref, k_init, k_train, k_sample = random.split(key, 6)

    train = data.eight_gaussians(k_train_data, 20_000)  # (N, 2)
    test = data.eight_gaussians(k_test, args.samples)  # (n, 2)
    reference = data.eight_gaussians(k_ref, args.samples)  # (n, 2): the data-vs-data floor
    scale = train.std()  # unit-variance coordinates, so sigma_data = 1

    models = {name: torchfn.Model(MLPDenoiser(2, hidden=args.hidden, depth=args.depth,
                                              times=2 if name == "mean_flow" else 1))
              for name in OBJECTIVES}
    tx = optim.adam(optim.warmup_cosine(args.lr, max(1, args.steps // 20), args.steps,
                                        args.lr / 20))
    metrics: dict = {"config": vars(args), "final_loss": {}, "train_seconds": {},
                     "energy_distance": {}, "test_nll": {}, "samples": {}}
    shape = (args.samples, 2)
    n_train, per_epoch = train.shape[0], train.shape[0] // args.batch
    for objective in OBJECTIVES:
        model = models[objective]
        params = model.init(k_init)  # the same start for every objective (but MeanFlow's)
        opt_state = tx.init(params)
        grad_fn = torch.func.grad_and_value(make_loss(objective, model, args.steps))
        history = []
        t0 = time.perf_counter()
        for step in tqdm(range(args.steps), desc=objective, dynamic_ncols=True, leave=False):
            epoch, i = divmod(step, per_epoch)
            if i == 0:
                order = random.permutation(random.fold_in(k_train, 2 * epoch), n_train)
            x0 = train[order[i * args.batch:(i + 1) * args.batch]] / scale  # (B, 2)
            grads, loss = grad_fn(params, x0, random.fold_in(k_train, 2 * step + 1), step)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optim.apply_updates(params, updates)
            history.append(loss.item())
        metrics["train_seconds"][objective] = round(time.perf_counter() - t0, 1)
        metrics["final_loss"][objective] = sum(history[-100:]) / len(history[-100:])

        scores = {}
        with torch.no_grad():
            for calls in args.calls:
                name, x = sample(objective, model, params, shape, k_sample, calls)
                x = x * scale  # (n, 2)
                scores[f"{calls}_calls ({name})"] = data.energy_distance(x, test).item()
                if calls == max(args.calls):
                    metrics["samples"][objective] = x
        metrics["energy_distance"][objective] = scores
        if objective in ("flow", "flow_ot") and args.nll_points > 0:  # exact densities
            v = lambda x, t, p=params, m=model: m.apply(p, x, t)  # noqa: E731
            with torch.no_grad():
                ll = diffusion.flow_log_likelihood(v, test[:args.nll_points] / scale,
                                                   time_scale=1000.0, rtol=1e-4, atol=1e-4)
            metrics["test_nll"][objective] = float(-ll.mean() + 2 * torch.log(scale))
    metrics["energy_distance"]["data_baseline"] = data.energy_distance(reference, test).item()
    if args.nll_points > 0:  # the best single Gaussian: the training data's mean and covariance
        gauss = torch.distributions.MultivariateNormal(train.mean(0), torch.cov(train.T))
        metrics["test_nll"]["single_gaussian"] = float(-gauss.log_prob(
            test[:args.nll_points]).mean())

    samples = metrics.pop("samples")
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if not args.no_plot:
        plot(out / "flow_matching_2d.png", test, samples)
    print(json.dumps({k: v for k, v in metrics.items() if k != "config"}, indent=2))
    return metrics


def plot(path, test, samples):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + len(samples), figsize=(4 * (1 + len(samples)), 4))
    for ax, (title, pts) in zip(axes, [("held-out data", test), *samples.items()]):
        ax.scatter(pts[:, 0].numpy(), pts[:, 1].numpy(), s=2, alpha=0.5)
        ax.set(title=title, xlim=(-4.5, 4.5), ylim=(-4.5, 4.5), aspect="equal")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
