"""Lyapunov spectrum of a GRU's dynamics by forward-mode AD, the torchfn way.

A GRU left to run on zero input, h_{t+1} = F(h_t), is ordered (nearby states converge)
when its recurrent weights are small and chaotic (they diverge) when they are large.
The Lyapunov exponents measure it: the mean log growth rates of k orthonormal
perturbations carried along the trajectory by the Jacobian J_t = dF/dh, re-orthonormalised
by QR every step (Benettin et al. 1980; for RNNs, Engelken et al. 2020). The largest
crosses 0 at the edge of chaos.

Each step needs J_t Q for k directions: k Jacobian-vector products, which is what
forward mode computes (``vmap`` over ``torch.func.jvp``). ``nn.GRU`` has no forward-mode
derivative on the CPU; ``models.GRU`` (the same function as a ``scan``) does. As a check,
the script recomputes one spectrum from full reverse-mode Jacobians of ``nn.GRU`` with the
same weights.

    python examples/gru_lyapunov.py                       # about 15 s on 2 CPU cores
    python examples/gru_lyapunov.py --hidden 16 --steps 100 --out /tmp/lyap_smoke

Writes <out>/metrics.json and <out>/lyapunov.png (the exponents against the gain).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn
from torch.func import jacrev, jvp, vmap

import torchfn
from torchfn import random
from torchfn.models import GRU


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=64, help="GRU width H")
    p.add_argument("--k", type=int, default=8, help="exponents to compute")
    p.add_argument("--steps", type=int, default=500, help="steps averaged over")
    p.add_argument("--warmup", type=int, default=200, help="steps to reach the attractor")
    p.add_argument("--gains", type=str, default="0.5,1,2,3,4,6,8",
                   help="recurrent weight scales g: W_hh ~ N(0, g^2 / H)")
    p.add_argument("--check-steps", type=int, default=100,
                   help="steps of the reverse-mode check against nn.GRU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=str, default="runs/gru_lyapunov")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    return p.parse_args(argv)


def spectrum(jac_times, step, h, Q, steps, warmup):
    """Mean log growth of the k columns of ``Q`` (H, k) along ``h_{t+1} = step(h_t)``.

    ``jac_times(h, Q)`` returns ``J(h) Q``. Returns the k exponents, largest first."""
    logs = torch.zeros(Q.shape[1], dtype=Q.dtype)
    for t in range(warmup + steps):
        JQ = jac_times(h, Q)  # (H, k)
        h = step(h)
        Q, R = torch.linalg.qr(JQ)
        if t >= warmup:
            logs += R.diagonal().abs().log()
    return (logs / steps).sort(descending=True).values


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    H, k = args.hidden, args.k
    gains = [float(g) for g in args.gains.split(",")]
    key = random.key(args.seed)
    k_init, k_w, k_h, k_q = random.split(key, 4)

    model = torchfn.Model(GRU(1, H).double())
    base = model.init(k_init)  # biases and input weights as nn.GRU initialises them
    w = random.normal(k_w, (3 * H, H), torch.float64) / H**0.5  # (3H, H), unit gain
    x = torch.zeros(1, 1, 1, dtype=torch.float64)  # one step of zero input, (T, B, F)
    h0 = 0.5 * random.normal(k_h, (H,), torch.float64)
    Q0 = torch.linalg.qr(random.normal(k_q, (H, k), torch.float64))[0]  # (H, k)

    def dynamics(g):
        params = {**base, "weight_hh_l0": g * w}
        return lambda h: model.apply(params, x, h[None, None])[1][0, 0]  # (H,) -> (H,)

    def forward_mode(step):  # J Q as k JVPs
        return lambda h, Q: vmap(lambda q: jvp(step, (h,), (q,))[1], in_dims=1, out_dims=1)(Q)

    exponents, seconds = {}, {}
    for g in gains:
        step = dynamics(g)
        t0 = time.perf_counter()
        exponents[g] = spectrum(forward_mode(step), step, h0, Q0, args.steps, args.warmup)
        seconds[g] = round(time.perf_counter() - t0, 2)
        print(f"g={g:<4} largest exponents {[round(v, 4) for v in exponents[g][:3].tolist()]}")

    # check: the same spectrum from nn.GRU's full reverse-mode Jacobians, same weights
    g = gains[0]  # ordered: the trajectories stay together (chaos would amplify rounding)
    torch_gru = nn.GRU(1, H).double()
    torch_gru.load_state_dict({**base, "weight_hh_l0": g * w})
    torch_step = lambda h: torch_gru(x, h[None, None])[1][0, 0]  # noqa: E731
    t0 = time.perf_counter()
    with torch.no_grad():
        check = spectrum(lambda h, Q: jacrev(torch_step)(h) @ Q, torch_step, h0, Q0,
                         args.check_steps, 0)
    check_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours_short = spectrum(forward_mode(dynamics(g)), dynamics(g), h0, Q0, args.check_steps, 0)
    ours_seconds = time.perf_counter() - t0

    largest = {g: float(e[0]) for g, e in exponents.items()}
    chaotic = [g for g in gains if largest[g] > 0]
    metrics = {
        "config": vars(args),
        "lyapunov_exponents": {str(g): e.tolist() for g, e in exponents.items()},
        "largest_exponent": {str(g): v for g, v in largest.items()},
        "first_chaotic_gain": chaotic[0] if chaotic else None,
        "check_vs_nn_gru_reverse_mode": {
            "gain": g,
            "max_abs_difference": float((ours_short - check).abs().max()),
            "seconds_forward_mode_torchfn": round(ours_seconds, 2),
            "seconds_reverse_mode_nn_gru": round(check_seconds, 2),
        },
        "seconds_per_gain": {str(g): s for g, s in seconds.items()},
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if not args.no_plot:
        plot(out / "lyapunov.png", gains, exponents)
    print(json.dumps({k: v for k, v in metrics.items()
                      if k not in ("config", "lyapunov_exponents")}, indent=2))
    png = "" if args.no_plot else f" and {out / 'lyapunov.png'}"
    print(f"wrote {out / 'metrics.json'}{png}")
    return metrics


def plot(path, gains, exponents):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    spectra = torch.stack([exponents[g] for g in gains])  # (gains, k)
    for i in range(spectra.shape[1]):
        ax.plot(gains, spectra[:, i].numpy(), "o-", ms=3, alpha=1.0 if i == 0 else 0.4,
                label="largest" if i == 0 else None)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set(xscale="log", xlabel="recurrent gain g", ylabel="Lyapunov exponent (per step)",
           title="GRU on zero input: ordered to chaotic")
    ax.set_xticks(gains, [f"{g:g}" for g in gains])
    ax.minorticks_off()
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
