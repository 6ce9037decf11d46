"""Higher-order compositions through ``attention`` equal the float64 reference: every
order-2 pairing of forward and reverse mode and every order-3 one. The fused rules serve
all but a forward level over two levels with forward mode among them, which would see
none of the ops the inner rules run with ``torch.func`` (zeros): those calls take plain
ops (``_autograd.past_the_rules``), and without that the rules raise, never answer
wrongly."""

import importlib.util
from functools import partial

import pytest
import torch
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

from torchfn.kernels import _autograd, attention, reference_attention

HAS_TRITON = all(importlib.util.find_spec(m) for m in ("triton", "torchfn.kernels._triton_ops"))
BACKENDS = [
    pytest.param(("torch", 4), id="torch-blockwise"),  # Nq != Nk
    pytest.param(("torch", 5), id="torch-sdpa"),  # Nq == Nk: SDPA's kernels forward
    pytest.param(("triton", 4), id="triton",
                 marks=pytest.mark.skipif(not HAS_TRITON, reason="triton is missing")),
]


@pytest.fixture
def scalars(request):
    """(ours, reference): x (3,) -> a scalar through causal GQA attention."""
    backend, nq = request.param
    g = torch.Generator().manual_seed(3)
    dtype = torch.float64 if backend == "torch" else torch.float32
    q = torch.randn(1, 2, nq, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 1, 5, 4, generator=g, dtype=torch.float64) for _ in range(2))

    def make(attn, dt):
        def f(x):
            x = x.to(dt)
            o = attn(q.to(dt) * x[0] + x[1], k.to(dt) * x[2], v.to(dt))
            return (o * o).sum()
        return f

    ours = make(lambda q, k, v: attention(q, k, v, causal=True, backend=backend), dtype)
    ref = make(lambda q, k, v: reference_attention(q, k, v, causal=True), torch.float64)
    tol = 1e-10 if backend == "torch" else 2e-4
    return ours, ref, torch.tensor([1.1, 0.2, 0.9], dtype=dtype), tol


ONES = torch.ones(3, dtype=torch.float64)
WORKS = {
    "jacfwd(jacfwd)": lambda f, x: jacfwd(jacfwd(f))(x),
    "jvp(jvp)": lambda f, x: jvp(lambda y: jvp(f, (y,), (ONES.to(y.dtype),))[1], (x,),
                                 (torch.arange(3.0, dtype=x.dtype),))[1],
    "vmap(jacfwd(jacfwd))": lambda f, x: vmap(jacfwd(jacfwd(f)))(torch.stack([x, 0.5 * x])),
    "jacrev(jacfwd)": lambda f, x: jacrev(jacfwd(f))(x),
    "hessian": lambda f, x: hessian(f)(x),
    "jacrev(jacfwd(jacfwd))": lambda f, x: jacrev(jacfwd(jacfwd(f)))(x),
    "jacrev(hessian)": lambda f, x: jacrev(hessian(f))(x),
    "jacrev(jacrev(jacrev))": lambda f, x: jacrev(jacrev(jacrev(f)))(x),
    "jacfwd(jacrev(jacrev))": lambda f, x: jacfwd(jacrev(jacrev(f)))(x),
    "jvp(grad(grad))": lambda f, x: jvp(lambda y: grad(lambda z: grad(f)(z).sum())(y), (x,),
                                        (ONES.to(x.dtype),))[1],
    "jacrev(jacrev(jacfwd))": lambda f, x: jacrev(jacrev(jacfwd(f)))(x),
    # a forward level over forward mode: plain ops
    "jacfwd(jacfwd(jacfwd))": lambda f, x: jacfwd(jacfwd(jacfwd(f)))(x),
    "jacfwd(jacrev(jacfwd))": lambda f, x: jacfwd(jacrev(jacfwd(f)))(x),
    "jacfwd(hessian)": lambda f, x: jacfwd(hessian(f))(x),
    "jacfwd(jacrev(jacrev(jacrev)))": lambda f, x: jacfwd(jacrev(jacrev(jacrev(f))))(x),
    "jacrev(jacrev(jacrev(jacfwd)))": lambda f, x: jacrev(jacrev(jacrev(jacfwd(f))))(x),
    "vmap(jacfwd(hessian))": lambda f, x: vmap(jacfwd(hessian(f)))(torch.stack([x, 0.5 * x])),
}
REFUSED = {  # what the rules alone would be asked, with the plain-op path switched off
    "jacfwd(jacfwd(jacfwd))": lambda f, x: jacfwd(jacfwd(jacfwd(f)))(x),
    "jacfwd(jacrev(jacfwd))": lambda f, x: jacfwd(jacrev(jacfwd(f)))(x),
    "jacfwd(hessian)": lambda f, x: jacfwd(hessian(f))(x),
}


# Triton compositions of 12-14 s each on 2 cores, kept for -m slow: the same compositions
# on the torch backends (the same rules) and Triton's other order-3 and order-4 ones
# (the same kernels under vmap and forward mode) cover what they would find
SLOW_ON_TRITON = {"jacrev(jacfwd(jacfwd))", "jacrev(jacrev(jacrev(jacfwd)))"}


def _each_backend(names, slow=frozenset()):
    """(scalars, name) params: every name on every backend, the fixture fed indirectly."""
    return [pytest.param(b.values[0], name, id=f"{b.id}-{name}", marks=[
        *b.marks, *([pytest.mark.slow] if b.id == "triton" and name in slow else [])])
        for b in BACKENDS for name in names]


@pytest.mark.parametrize("scalars, name", _each_backend(WORKS, SLOW_ON_TRITON),
                         indirect=["scalars"])
def test_composition_equals_the_reference(scalars, name):
    ours, ref, x, tol = scalars
    got, want = WORKS[name](ours, x), WORKS[name](ref, x.double())
    assert want.abs().max() > 0.1  # a derivative that is not trivially 0
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err <= tol, err


@pytest.mark.parametrize("scalars, name", _each_backend(REFUSED), indirect=["scalars"])
def test_the_rules_refuse_what_they_cannot_give(scalars, name, monkeypatch):
    ours, _, x, _ = scalars
    monkeypatch.setattr(_autograd, "past_the_rules", lambda: False)
    with pytest.raises(NotImplementedError, match="take the outer derivative in reverse"):
        REFUSED[name](ours, x)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not HAS_TRITON, reason="triton is missing"))])
def test_plain_op_path_keeps_every_option(backend):
    """``jacfwd(hessian)`` through the plain-op path with a mask that empties a row,
    a window, segments, softcap, ALiBi, dropout and lse equals the reference's."""
    from torchfn import random

    g = torch.Generator().manual_seed(5)
    dtype = torch.float64 if backend == "torch" else torch.float32
    q = torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 1, 6, 8, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1] = False  # query 1 sees no key
    opts = dict(mask=mask, window=(3, None), causal=True, segment_ids=(
        torch.tensor([[0, 0, 1, 1]]), torch.tensor([[0, 0, 0, 1, 1, 1]])), softcap=5.0,
        alibi_slopes=torch.tensor([0.5, 0.25]), dropout=0.25, key=random.key(1),
        return_lse=True)

    def make(attn, dt):
        def f(x):
            x = x.to(dt)
            o, lse = attn(q.to(dt) * x[0], k.to(dt) * x[1], v.to(dt) * x[0], **opts)
            return (o * o).sum() + lse.where(lse.isfinite(), 0).sum()
        return f

    x = torch.tensor([1.1, 0.9], dtype=dtype)
    got = jacfwd(hessian(make(partial(attention, backend=backend), dtype)))(x)
    want = jacfwd(hessian(make(reference_attention, torch.float64)))(x.double())
    assert want.abs().max() > 0.1 and got.isfinite().all()
    tol = 1e-10 if backend == "torch" else 2e-4
    assert ((got.double() - want).abs().max() / want.abs().max()).item() <= tol
