"""SAM / ASAM gradients equal their two-step formula in float64; under vmap over chunks
(m-sharpness) they equal a loop; the perturbation carries no gradient."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchfn import transforms


def _loss(params, x, y):
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return ((h @ params["w2"] - y) ** 2).mean()


def _problem(seed, n=16):
    gen = torch.Generator().manual_seed(seed)
    params = {"w1": torch.randn(5, 8, generator=gen, dtype=torch.float64),
              "b1": torch.randn(8, generator=gen, dtype=torch.float64),
              "w2": torch.randn(8, 2, generator=gen, dtype=torch.float64)}
    x = torch.randn(n, 5, generator=gen, dtype=torch.float64)
    y = torch.randn(n, 2, generator=gen, dtype=torch.float64)
    return params, x, y


def _reference(params, x, y, rho, adaptive):
    """The SAM optimizer's first_step as written (autograd, in place on copies)."""
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    _loss(leaves, x, y).backward()
    with torch.no_grad():
        weight = {k: (p.abs() if adaptive else 1.0) for k, p in leaves.items()}
        norm = torch.norm(torch.stack([(weight[k] * p.grad).norm(2) for k, p in leaves.items()]))
        scale = rho / (norm + 1e-12)
        for p in leaves.values():
            p.add_((p.pow(2) if adaptive else 1.0) * p.grad * scale)
            p.grad = None
    _loss(leaves, x, y).backward()
    return {k: p.grad for k, p in leaves.items()}


@given(seed=st.integers(0, 2**16), rho=st.floats(0.0, 0.5), adaptive=st.booleans())
def test_sam_equals_the_two_step_formula(seed, rho, adaptive):
    params, x, y = _problem(seed)
    ours = transforms.sam(torch.func.grad(_loss), rho, adaptive=adaptive)(params, x, y)
    ref = _reference(params, x, y, rho, adaptive)
    for k in params:
        torch.testing.assert_close(ours[k], ref[k], rtol=1e-10, atol=1e-12)
    if rho > 0.1:  # the perturbation changed the gradient
        plain = torch.func.grad(_loss)(params, x, y)
        assert not torch.allclose(ours["w1"], plain["w1"])


def test_m_sharpness_by_vmap_over_chunks_equals_a_loop():
    params, x, y = _problem(1, n=16)
    g = transforms.sam(torch.func.grad(_loss), 0.05)
    xs, ys = x.reshape(4, 4, 5), y.reshape(4, 4, 2)  # m = 4 examples per perturbation
    batched = torch.vmap(g, in_dims=(None, 0, 0))(params, xs, ys)
    for i in range(4):
        one = g(params, xs[i], ys[i])
        for k in params:
            torch.testing.assert_close(batched[k][i], one[k], rtol=1e-10, atol=1e-12)


def test_has_aux_and_compile():
    params, x, y = _problem(2)

    def grad_with_loss(p, x, y):
        return torch.func.grad_and_value(_loss)(p, x, y)

    g, loss = transforms.sam(grad_with_loss, 0.05, has_aux=True)(params, x, y)
    ref = _reference(params, x, y, 0.05, False)
    torch.testing.assert_close(g["w2"], ref["w2"], rtol=1e-10, atol=1e-12)
    assert float(loss) > float(_loss(params, x, y))  # SAM's point is uphill
    compiled = torch.compile(transforms.sam(torch.func.grad(_loss), 0.05), fullgraph=True,
                             backend="eager")
    torch.testing.assert_close(compiled(params, x, y)["w1"], ref["w1"], rtol=1e-10, atol=1e-12)


def test_bad_input():
    with pytest.raises(ValueError, match="rho must be a number >= 0, got -0.1"):
        transforms.sam(torch.func.grad(_loss), -0.1)
    with pytest.raises(TypeError, match="grad_fn must be callable"):
        transforms.sam(3)
    params, x, y = _problem(3)
    g = transforms.sam(torch.func.grad_and_value(_loss))
    with pytest.raises(ValueError, match="pass has_aux=True"):
        g(params, x, y)
