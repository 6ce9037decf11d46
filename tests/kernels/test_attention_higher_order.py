"""Higher-order compositions through ``attention`` equal the float64 reference: every
order-2 pairing of forward and reverse mode, and order 3 wherever the outer level is
reverse mode or sits over two reverse levels. An outer forward level over a forward
rule that differentiates with ``torch.func`` inside would see none of its ops (zeros):
those raise, never answer wrongly."""

import importlib.util

import pytest
import torch
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

from torchfn.kernels import attention, reference_attention

HAS_TRITON = all(importlib.util.find_spec(m) for m in ("triton", "torchfn.kernels._triton_ops"))
BACKENDS = [
    pytest.param(("torch", 4), id="torch-blockwise"),  # Nq != Nk
    pytest.param(("torch", 5), id="torch-sdpa"),  # Nq == Nk: SDPA's kernels forward
    pytest.param(("triton", 4), id="triton",
                 marks=pytest.mark.skipif(not HAS_TRITON, reason="triton is missing")),
]


@pytest.fixture(params=BACKENDS)
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
}
REFUSED = {
    "jacfwd(jacfwd(jacfwd))": lambda f, x: jacfwd(jacfwd(jacfwd(f)))(x),
    "jacfwd(jacrev(jacfwd))": lambda f, x: jacfwd(jacrev(jacfwd(f)))(x),
    "jacfwd(hessian)": lambda f, x: jacfwd(hessian(f))(x),
}


@pytest.mark.parametrize("name", list(WORKS))
def test_composition_equals_the_reference(scalars, name):
    ours, ref, x, tol = scalars
    got, want = WORKS[name](ours, x), WORKS[name](ref, x.double())
    assert want.abs().max() > 0.1  # a derivative that is not trivially 0
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err <= tol, err


@pytest.mark.parametrize("name", list(REFUSED))
def test_forward_mode_over_third_order_is_refused(scalars, name):
    ours, _, x, _ = scalars
    with pytest.raises(NotImplementedError, match="take the outer derivative in reverse"):
        REFUSED[name](ours, x)
