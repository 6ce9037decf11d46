"""DP-SGD for graph classification: each graph is one example, clipped on its own.

    python examples/dp_graphs.py                       # sigma = 1.0, 300 steps
    python examples/dp_graphs.py --epsilon 2.0         # pick sigma for a target epsilon

The task needs the edges: every graph has 24 nodes with a noisy +-1 signal in their
first feature. In "community" graphs (label 1) the nodes come in two blocks of 12,
each block's sign is its nodes' sign, and edges fall mostly within blocks (a
stochastic block model), so neighbours agree. In "mixed" graphs (label 0) the same
signs are shuffled over an Erdos-Renyi graph of the same expected degree. The features
alone are distributed alike in both classes; only message passing tells them apart,
which ``--no-edges`` (each node sees itself only) shows.

Each graph is its own edge list, padded to one length with weight-0 edges, so the
per-graph loss is written for ONE graph and ``make_dp_step`` takes its per-example
gradients with ``vmap(grad)``: PyTorch Geometric's ``GCNConv`` fails under ``vmap``
over edge lists, and Opacus has no hooks for graph layers. Writes
``<out>/metrics.json`` and ``<out>/curves.png`` (default ``out/dp_graphs``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

import torchfn
from torchfn import optim, random
from torchfn.models import GraphConv
from torchfn.transforms import make_dp_step, noise_multiplier_for, poisson_sample, rdp_epsilon


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graphs", type=int, default=2000, help="training graphs")
    p.add_argument("--test-graphs", type=int, default=500)
    p.add_argument("--nodes", type=int, default=24)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64, help="EXPECTED batch size q*N")
    p.add_argument("--clip", type=float, default=1.0, help="per-graph L2 clip C")
    p.add_argument("--noise-multiplier", type=float, default=1.0, help="sigma")
    p.add_argument("--epsilon", type=float, default=None, help="target epsilon (sets sigma)")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--no-edges", action="store_true", help="drop every edge (ablation)")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/dp_graphs"))
    return p.parse_args(argv)


def make_graphs(key: Tensor, n: int, N: int, p_in: float = 0.3, p_out: float = 0.05,
                features: int = 4, signal: float = 1.0):
    """``n`` keyed graphs of ``N`` nodes: features ``(n, N, F)``, padded edge lists
    ``(n, 2, E)`` with their weights ``(n, E)`` (1 for an edge, 0 for padding) and
    labels ``(n,)`` (1: community graph, 0: mixed)."""
    k_label, k_block, k_er, k_shuffle, k_noise = random.split(key, 5)
    y = random.bernoulli(k_label, 0.5, (n,))  # (n,)
    block = torch.arange(N) < N // 2  # (N,): two blocks
    same = block[:, None] == block[None, :]  # (N, N)
    p_er = (p_in * (N // 2 - 1) + p_out * (N - N // 2)) / (N - 1)  # same expected degree
    prob = torch.where(y[:, None, None], torch.where(same, p_in, p_out), p_er)  # (n, N, N)
    upper = torch.ones(N, N, dtype=torch.bool).triu(1)
    adj = (random.uniform(k_er, (n, N, N)) < prob) & upper
    adj = adj | adj.transpose(1, 2)  # (n, N, N) undirected, no self loops
    sign = block.float() * 2 - 1  # (N,): the block's sign
    perms = torch.func.vmap(lambda k: random.permutation(k, N))(random.split(k_shuffle, n))
    shuffled = sign[perms]  # (n, N): the same signs, in a random order per graph
    s = torch.where(y[:, None], sign, shuffled)  # (n, N)
    x = random.normal(k_noise, (n, N, features))  # (n, N, F)
    x[..., 0] += signal * s
    # adj[g, i, j] (edge j -> i) as padded (source, target) lists: edges first, then
    # padding, which points 0 -> 0 with weight 0
    flat = adj.reshape(n, N * N)
    E = int(flat.sum(1).max())
    order = torch.argsort(flat.to(torch.int8), dim=1, descending=True, stable=True)[:, :E]
    weight = torch.gather(flat, 1, order).float()  # (n, E)
    order = order * weight.long()
    edges = torch.stack([order % N, order // N], dim=1)  # (n, 2, E)
    return x, edges, weight, y.long()


class GCNClassifier(nn.Module):
    """Two graph convolutions, a mean over the nodes, a linear read-out: ONE graph
    ``x: (N, F)``, ``edges: (2, E)``, ``weight: (E,)`` -> logits ``(2,)``."""

    def __init__(self, features: int, hidden: int):
        super().__init__()
        self.conv1, self.conv2 = GraphConv(features, hidden), GraphConv(hidden, hidden)
        self.head = nn.Linear(hidden, 2)

    def forward(self, x: Tensor, edges: Tensor, weight: Tensor) -> Tensor:
        h = self.conv1(x, edges=edges, edge_weight=weight).relu()  # (N, hidden)
        h = self.conv2(h, edges=edges, edge_weight=weight).relu()  # (N, hidden)
        return self.head(h.mean(-2))  # (2,)


def accuracy(model, params, x, edges, weight, y) -> float:
    with torch.no_grad():
        logits = torch.func.vmap(model.apply, in_dims=(None, 0, 0, 0))(params, x, edges, weight)
        return float((logits.argmax(-1) == y).float().mean())


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
    data_key, test_key, init_key, sample_key, noise_key = random.split(random.key(args.seed), 5)
    train = make_graphs(data_key, args.graphs, args.nodes)
    test = make_graphs(test_key, args.test_graphs, args.nodes)
    if args.no_edges:  # every edge weighs 0: each node sees itself only
        train, test = [(x, e, torch.zeros_like(w), y) for x, e, w, y in (train, test)]
    n = args.graphs
    q = args.batch_size / n  # Poisson sampling rate
    sigma = args.noise_multiplier
    if args.epsilon is not None:
        sigma = noise_multiplier_for(args.epsilon, q, args.steps, args.delta)
    print(f"graphs={n}  nodes={args.nodes}  padded edges={train[1].shape[-1]}  q={q:.4f}  "
          f"sigma={sigma:.3f}  C={args.clip}  steps={args.steps}")

    model = torchfn.Model(GCNClassifier(train[0].shape[-1], args.hidden))
    params = model.init(init_key)

    def loss_fn(params, x, edges, weight, y):  # ONE graph
        return F.cross_entropy(model.apply(params, x, edges, weight), y)

    dp = make_dp_step(loss_fn, optim.sgd(args.lr, momentum=args.momentum),
                      l2_norm_clip=args.clip, noise_multiplier=sigma,
                      expected_batch_size=args.batch_size, key=noise_key)
    opt_state = dp.init(params)

    hist = {"step": [], "loss": [], "eval_step": [], "test_accuracy": [], "epsilon": []}
    t0 = time.perf_counter()
    pbar = tqdm(range(args.steps), desc="dp-sgd (graphs)", mininterval=0.5)
    for step in pbar:
        idx = poisson_sample(random.fold_in(sample_key, step), n, q)  # (b,), b ~ Bin(n, q)
        params, opt_state, loss = dp.step(params, opt_state, *(t[idx] for t in train))
        hist["step"].append(step)
        hist["loss"].append(float(loss))  # nan for an (unlikely) empty batch
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            acc = accuracy(model, params, *test)
            eps = rdp_epsilon(sigma, q, step + 1, args.delta)
            hist["eval_step"].append(step + 1)
            hist["test_accuracy"].append(acc)
            hist["epsilon"].append(eps)
            pbar.set_postfix(loss=f"{float(loss):.3f}", acc=f"{acc:.3f}", eps=f"{eps:.2f}")

    losses = [v for v in hist["loss"] if not math.isnan(v)]
    k = max(1, min(25, len(losses) // 5))
    metrics = {
        "test_accuracy": hist["test_accuracy"][-1],
        "train_accuracy": accuracy(model, params, *train),
        "epsilon": hist["epsilon"][-1],
        "delta": args.delta,
        "noise_multiplier": sigma,
        "l2_norm_clip": args.clip,
        "sample_rate": q,
        "steps": args.steps,
        "no_edges": args.no_edges,
        "loss_first": sum(losses[:k]) / k,
        "loss_last": sum(losses[-k:]) / k,
        "seconds": time.perf_counter() - t0,
        "seed": args.seed,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    title = (f"DP-SGD on graphs: ({metrics['epsilon']:.2f}, {args.delta:g})-DP, "
             f"sigma={sigma:.2f}, C={args.clip}" + (", no edges" if args.no_edges else ""))
    save_plot(args.out / "curves.png", hist, title)
    print(f"test accuracy {metrics['test_accuracy']:.4f} at ({metrics['epsilon']:.2f}, "
          f"{args.delta:g})-DP; loss {metrics['loss_first']:.3f} -> {metrics['loss_last']:.3f}; "
          f"wrote {args.out}/metrics.json and curves.png")
    return metrics


if __name__ == "__main__":
    main()
