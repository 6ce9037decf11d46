"""LSTM / GRU: ``torchfn.models`` (a scan of plain ops) vs ``nn.LSTM`` / ``nn.GRU``
(torch's fused kernels), same weights, same run.

Run (about a minute):
    .venv/bin/pytest bench/test_bench_rnn.py --benchmark-only -q -p no:randomly \\
        --benchmark-columns=min,median,mean

Groups:

- ``*-fwd-bwd``: forward and backward of ``out.pow(2).mean()``, T=32, B=32, F=32, H=128;
  ``torchfn compiled`` is ``torch.compile`` of our module (it unrolls the 32 steps).
- ``lstm-per-sample``: per-example gradients, ``vmap(grad)`` over 16 sequences (T=16,
  F=16, H=32), both as a ``torchfn.Model``.
- ``lstm-jvp``: a Jacobian-vector product of the outputs in the input (T=32, B=8, F=16,
  H=64). ``torch.func.jvp`` through ours; ``nn.LSTM`` has no forward-mode derivative,
  so its entry is ``torch.autograd.functional.jvp`` (two reverse passes, the
  double-backward trick).
"""

import pytest
import torch
from torch import nn
from torch.func import grad, jvp, vmap

import torchfn
from torchfn import random
from torchfn.models import GRU, LSTM

IMPLS = ["torchfn", "torch"]


def _pair(kind, *args, **kw):
    theirs = {"lstm": nn.LSTM, "gru": nn.GRU}[kind](*args, **kw)
    ours = {"lstm": LSTM, "gru": GRU}[kind](*args, **kw)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("impl", [*IMPLS, "torchfn compiled"])
def test_fwd_bwd(benchmark, kind, impl):
    benchmark.group = f"{kind}-fwd-bwd"
    ours, theirs = _pair(kind, 32, 128)
    m = theirs if impl == "torch" else ours
    run = torch.compile(m) if impl.endswith("compiled") else m  # compiles in warmup (~20 s)
    x = random.normal(random.key(0), (32, 32, 32))  # (T, B, F)

    def step():
        m.zero_grad(set_to_none=True)
        run(x)[0].pow(2).mean().backward()
        return m.weight_hh_l0.grad

    g = benchmark.pedantic(step, rounds=20, warmup_rounds=2)
    other = ours if impl == "torch" else theirs
    other.zero_grad(set_to_none=True)
    other(x)[0].pow(2).mean().backward()
    assert torch.allclose(g, other.weight_hh_l0.grad, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_per_sample_grads(benchmark, impl):
    benchmark.group = "lstm-per-sample"
    ours, theirs = _pair("lstm", 16, 32, batch_first=True)
    model = torchfn.Model(ours if impl == "torchfn" else theirs)
    params = {k: v.detach() for k, v in theirs.state_dict().items()}
    xs = random.normal(random.key(0), (16, 16, 16))  # (B, T, F)

    def loss(p, x):  # ONE sequence, as a batch of one
        return model.apply(p, x[None])[0][0, -1].pow(2).sum()

    per = vmap(grad(loss), in_dims=(None, 0))
    g = benchmark.pedantic(per, args=(params, xs), rounds=10, warmup_rounds=1)
    assert torch.allclose(g["weight_hh_l0"][3], grad(loss)(params, xs[3])["weight_hh_l0"],
                          atol=1e-5)


@pytest.mark.parametrize("impl", ["torchfn (torch.func.jvp)",
                                  "torch (autograd.functional.jvp, double backward)"])
def test_jvp(benchmark, impl):
    benchmark.group = "lstm-jvp"
    ours, theirs = _pair("lstm", 16, 64)
    x = random.normal(random.key(0), (32, 8, 16))
    v = random.normal(random.key(1), (32, 8, 16))
    if impl.startswith("torchfn"):
        run = lambda: jvp(lambda x: ours(x)[0], (x,), (v,))[1]  # noqa: E731
    else:
        run = lambda: torch.autograd.functional.jvp(lambda x: theirs(x)[0], x, v)[1]  # noqa: E731
    out = benchmark.pedantic(run, rounds=10, warmup_rounds=1)
    want = torch.autograd.functional.jvp(lambda x: theirs(x)[0], x, v)[1]
    assert torch.allclose(out, want, atol=1e-5)


class _Classifier(nn.Module):
    """A sequence classifier: the last hidden state -> 10 classes."""

    def __init__(self, rnn, hidden):
        super().__init__()
        self.rnn, self.head = rnn, nn.Linear(hidden, 10)

    def forward(self, x):  # (B, T, F)
        return self.head(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("impl", ["torchfn per_sample_grads", "opacus DPLSTM hooks"])
def test_per_sample_grads_vs_opacus(benchmark, impl):
    """What DP-SGD on an LSTM needs: per-example gradients of a batch of 32 sequences
    (T=16, F=16, H=64). Opacus cannot hook inside nn.LSTM and brings its own DPLSTM."""
    from opacus import GradSampleModule
    from opacus.layers import DPLSTM
    from torch.func import functional_call

    from torchfn.transforms import per_sample_grads

    benchmark.group = "lstm-per-sample-dp"
    ours = _Classifier(LSTM(16, 64, batch_first=True), 64)
    x = random.normal(random.key(0), (32, 16, 16))
    y = random.randint(random.key(1), (32,), 0, 10)
    params = {k: v.detach() for k, v in ours.named_parameters()}
    if impl.startswith("torchfn"):
        loss = lambda p, x, y: nn.functional.cross_entropy(  # noqa: E731  ONE sequence
            functional_call(ours, p, (x[None],)), y[None])
        run = lambda: per_sample_grads(loss)(params, x, y)  # noqa: E731
    else:
        theirs = _Classifier(DPLSTM(16, 64, batch_first=True), 64)
        named = dict(theirs.named_parameters())
        with torch.no_grad():
            for k, v in params.items():
                named[k].copy_(v)
        gsm = GradSampleModule(theirs, loss_reduction="sum")

        def run():
            for p in gsm.parameters():
                p.grad, p.grad_sample = None, None
            nn.functional.cross_entropy(gsm(x), y, reduction="sum").backward()
            return {k: p.grad_sample for k, p in theirs.named_parameters()}

    out = benchmark.pedantic(run, rounds=10, warmup_rounds=1)
    assert out["rnn.weight_hh_l0"].shape == (32, 256, 64)
