"""Bench: Muon, Adafactor and NAdam updates against torch.optim's, CPU.

The parameters are a small transformer's matrices: 6 layers of q, k, v, o (256, 256)
and an MLP (1024, 256) + (256, 1024), 36 matrices of 3 shapes, 3.9M params; for
Adafactor and NAdam also a bias (256,) per layer. One call = one optimizer step that
leaves new params:

* ``torchfn``: ``update`` + ``apply_updates`` (pure, new tensors).
* ``torch``: ``torch.optim.X(...).step()`` in place (``foreach`` where torch has it).

Muon: torch orthogonalises one matrix at a time; torchfn stacks the matrices of one
shape and runs the Newton-Schulz iteration as batched matmuls, both in bf16.
Schedule-free AdamW: against the ``schedulefree`` package's ``AdamWScheduleFree``
(foreach, in place), the authors' code.
Prodigy: against the ``prodigyopt`` package (its authors'), which reads four numbers
back to the host per leaf per step; torchfn keeps them on the device.
Adafactor: torch reads rms(p), rms(u) and the step back to the host per leaf;
torchfn keeps them on the device.
AdaBelief, Adan, AdEMAMix, ADOPT: against ``pytorch_optimizer`` (foreach, in place).
SOAP: against ``pytorch_optimizer.SOAP`` (per leaf, in place); 10 rounds cover one
refresh of the bases (every 10 steps) in both.
LaProp, StableAdamW, C-Lion (``cautious(lion)`` + ``decay_weights``): against
``pytorch_optimizer`` (``foreach=True`` where it has that path).

Run: ``pytest bench/test_bench_optim_more.py --benchmark-only
--benchmark-columns=min,median``; ratios are median torchfn / median torch.
"""

import contextlib
import io

import pytest
import pytorch_optimizer as po
import schedulefree
import torch
from prodigyopt import Prodigy

from torchfn import optim

LAYERS, D = 6, 256


def make_tree(with_bias: bool):
    g = torch.Generator().manual_seed(0)
    params = {}
    for i in range(LAYERS):
        for name, shape in [("q", (D, D)), ("k", (D, D)), ("v", (D, D)), ("o", (D, D)),
                            ("up", (4 * D, D)), ("down", (D, 4 * D))]:
            params[f"{i}.{name}"] = torch.randn(shape, generator=g) * 0.02
        if with_bias:
            params[f"{i}.bias"] = torch.randn(D, generator=g) * 0.02
    grads = {k: torch.randn(v.shape, generator=g) * 1e-2 for k, v in params.items()}
    return params, grads


CASES = {
    "muon": (lambda: optim.muon(0.02), lambda ps: torch.optim.Muon(ps, lr=0.02), False),
    "adafactor": (lambda: optim.adafactor(), lambda ps: torch.optim.Adafactor(ps, foreach=True),
                  True),
    "adafactor_single": (lambda: optim.adafactor(),
                         lambda ps: torch.optim.Adafactor(ps, foreach=False), True),
    "nadam": (lambda: optim.nadam(), lambda ps: torch.optim.NAdam(ps, foreach=True), True),
    "schedule_free_adamw": (lambda: optim.schedule_free_adamw(),
                            lambda ps: _train_mode(schedulefree.AdamWScheduleFree(ps)), True),
    "prodigy": (lambda: optim.prodigy(), lambda ps: _quiet(Prodigy, ps), True),
    # the 2024 optimizers, against pytorch_optimizer 4.1 (foreach, in place)
    "adabelief": (lambda: optim.adabelief(1e-3, weight_decay=0.01),
                  lambda ps: po.AdaBelief(ps, weight_decay=0.01, foreach=True), True),
    "adan": (lambda: optim.adan(1e-3, weight_decay=0.01),
             lambda ps: po.Adan(ps, weight_decay=0.01, foreach=True), True),
    "ademamix": (lambda: optim.ademamix(1e-3, weight_decay=0.01),
                 lambda ps: po.AdEMAMix(ps, weight_decay=0.01, weight_decouple=True,
                                        foreach=True), True),
    "adopt": (lambda: optim.adopt(1e-3), lambda ps: po.ADOPT(ps, foreach=True), True),
    "soap": (lambda: optim.soap(), lambda ps: po.SOAP(ps), True),
    "laprop": (lambda: optim.laprop(1e-3, weight_decay=0.01),
               lambda ps: po.LaProp(ps, lr=1e-3, weight_decay=0.01, foreach=True), True),
    # pytorch_optimizer has no foreach path for StableAdamW's per-tensor RMS or for
    # cautious steps: both loop over the leaves
    "stable_adamw": (lambda: optim.stable_adamw(1e-3),
                     lambda ps: po.StableAdamW(ps, lr=1e-3, foreach=True), True),
    "c_lion": (lambda: optim.chain(optim.cautious(optim.lion(1e-4)),
                                   optim.decay_weights(1e-4, 0.01)),
               lambda ps: po.Lion(ps, lr=1e-4, weight_decay=0.01, cautious=True), True),
}


def _quiet(cls, ps):
    with contextlib.redirect_stdout(io.StringIO()):
        return cls(ps)


def _train_mode(opt):
    opt.train()
    return opt


def functional_step(make_tx, params, grads):
    tx = make_tx()
    carry = {"p": params, "s": tx.init(params)}

    def step():
        u, carry["s"] = tx.update(grads, carry["s"], carry["p"])
        carry["p"] = optim.apply_updates(carry["p"], u)

    return step


def module_step(make_opt, params, grads):
    leaves = [p.clone().requires_grad_(True) for p in params.values()]
    for p, g in zip(leaves, grads.values()):
        p.grad = g.clone()
    return make_opt(leaves).step


@pytest.mark.parametrize("impl", ["torchfn", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_update(benchmark, case, impl):
    benchmark.group = f"{case}_update"
    make_tx, make_opt, with_bias = CASES[case]
    params, grads = make_tree(with_bias)
    step = functional_step(make_tx, params, grads) if impl == "torchfn" else module_step(
        make_opt, params, grads)
    for _ in range(2):
        step()
    benchmark.pedantic(step, rounds=10, iterations=1, warmup_rounds=1)
