"""Bench: ``optim.lbfgs`` against ``torch.optim.LBFGS``, CPU, float64.

Multinomial logistic regression on the 8x8 digits (1797 x 64, 10 classes, an L2
penalty of 1e-3), full batch, each solver run until the gradient's norm is below 1e-5 (at
most 300 iterations), from zero weights:

* ``single``: one problem. torchfn's L-BFGS (memory 10, the accepted trial's gradient
  reused, in a ``torchfn.while_loop``) with its strong-Wolfe zoom search (the default)
  or Armijo backtracking, against torch's (history 10, strong-Wolfe line search).
* ``bootstrap``: the same regression on 32 bootstrap resamples of the data (each
  example weighted by how often the resample draws it), as one ``vmap`` over
  torchfn's loop, against a Python loop of torch's LBFGS over the resamples.

Both reach the same minimum (the losses checked equal to 1e-6 before timing; the
weights are not pinned down that far along the penalty's flat directions).

Run: ``pytest bench/test_bench_lbfgs.py --benchmark-only --benchmark-columns=min,median``.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

import torchfn
from torchfn import data, optim, random

X, Y = data.load_digits()
X = (X / 16.0).double()  # (N, 64)
TOL, MAX_ITER = 1e-5, 300
LAM = 1e-3
RESAMPLES = 32


def loss_fn(lam, weights=None):
    def loss(p):  # p["w"]: (64, 10), p["b"]: (10,)
        logits = X @ p["w"] + p["b"]
        if weights is None:
            data = F.cross_entropy(logits, Y)
        else:  # a bootstrap resample: each example counted as often as it was drawn
            data = (weights * F.cross_entropy(logits, Y, reduction="none")).sum() / weights.sum()
        return data + lam * (p["w"] ** 2).sum()

    return loss


def bootstrap_weights(n_resamples):
    """(R, N) counts: how often each resample draws each example."""
    draws = random.randint(random.key(0), (n_resamples, X.shape[0]), 0, X.shape[0])
    return torch.zeros(n_resamples, X.shape[0], dtype=torch.float64).scatter_add_(
        1, draws, torch.ones_like(draws, dtype=torch.float64))


def zeros():
    return {"w": torch.zeros(64, 10, dtype=torch.float64),
            "b": torch.zeros(10, dtype=torch.float64)}


def torchfn_solve(weights=None, search="zoom"):
    """L-BFGS in a ``while_loop``: under ``vmap`` every problem stops at its own
    tolerance, and the loop runs until the last one has."""
    f = loss_fn(LAM, weights)
    if search == "zoom":  # the strong-Wolfe zoom search, as torch's (the default)
        tx = optim.lbfgs()
    else:
        tx = optim.lbfgs(linesearch=optim.scale_by_backtracking_linesearch(store_grad=True))
    value_and_grad = optim.value_and_grad_from_state(f)

    def norm(g):
        return torch.sqrt(sum((x ** 2).sum() for x in g.values()))

    def go(carry):
        params, state, gnorm, it = carry
        return (gnorm >= TOL) & (it < MAX_ITER)

    def step(carry):
        params, state, _, it = carry
        v, g = value_and_grad(params, state=state)
        u, state = tx.update(g, state, params, value=v, grad=g, value_fn=f)
        return optim.apply_updates(params, u), state, norm(g), it + 1

    params = zeros()
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    out = torchfn.while_loop(go, step, (params, tx.init(params), inf, torch.tensor(0)))
    return out[0]


def torch_solve(weights=None):
    f = loss_fn(LAM, weights)
    p = {k: v.requires_grad_() for k, v in zeros().items()}
    opt = torch.optim.LBFGS(list(p.values()), lr=1, max_iter=MAX_ITER, history_size=10,
                            line_search_fn="strong_wolfe", tolerance_grad=TOL / 10,
                            tolerance_change=0)

    def closure():
        opt.zero_grad()
        loss = f(p)
        loss.backward()
        return loss

    opt.step(closure)
    return {k: v.detach() for k, v in p.items()}


def torchfn_bootstrap(weights):
    return vmap(torchfn_solve)(weights)


def torch_bootstrap(weights):
    outs = [torch_solve(w) for w in weights]
    return {k: torch.stack([o[k] for o in outs]) for k in outs[0]}


SINGLE = {"torchfn_zoom": torchfn_solve,
          "torchfn_backtracking": lambda: torchfn_solve(search="backtracking"),
          "torch": torch_solve}


@pytest.mark.parametrize("impl", list(SINGLE))
def test_single(benchmark, impl):
    fn = SINGLE[impl]
    f = loss_fn(LAM)
    assert abs(float(f(fn())) - float(f(torch_solve()))) < 1e-6
    benchmark(fn)


@pytest.mark.parametrize("impl", ["torchfn_vmap", "torch_loop"])
def test_bootstrap(benchmark, impl):
    fn = torchfn_bootstrap if impl == "torchfn_vmap" else torch_bootstrap
    weights = bootstrap_weights(RESAMPLES)
    got, want = fn(weights[:3]), torch_bootstrap(weights[:3])
    for i in range(3):
        f = loss_fn(LAM, weights[i])
        pick = {k: v[i] for k, v in got.items()}
        assert abs(float(f(pick)) - float(f({k: v[i] for k, v in want.items()}))) < 1e-6
    benchmark.pedantic(fn, args=(weights,), rounds=3, iterations=1)
