"""``transforms.divergence``: the exact trace equals ``tr(jacrev(f))``; Hutchinson's estimate
equals its definition for the key's probes and is unbiased; both differentiate and vmap."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad, jacrev, vmap

from torchfn import random, transforms

F64 = torch.float64


def field(seed, shape):
    n = int(torch.tensor(shape).prod())
    w = random.normal(random.key(seed), (n, n), dtype=F64) / n**0.5
    return lambda x: torch.tanh(w @ x.reshape(-1) + 0.3).reshape(shape) * x.sum()


def exact_trace(f, x):
    n = x.numel()
    return torch.trace(jacrev(f)(x).reshape(n, n))


@given(seed=st.integers(0, 2**16), shape=st.sampled_from([(1,), (4,), (2, 3), (2, 2, 2)]))
def test_exact_equals_the_jacobian_trace(seed, shape):
    f = field(seed, shape)
    x = random.normal(random.key(seed + 1), shape, dtype=F64)
    torch.testing.assert_close(transforms.divergence(f, x), exact_trace(f, x))
    fx, div = transforms.divergence(f, x, return_value=True)
    torch.testing.assert_close(fx, f(x))
    torch.testing.assert_close(grad(lambda x: transforms.divergence(f, x))(x),
                               grad(lambda x: exact_trace(f, x))(x))


@pytest.mark.parametrize("probe", ["rademacher", "normal"])
def test_hutchinson_equals_its_definition_for_the_keys_probes(probe):
    f, x, key = field(1, (5,)), random.normal(random.key(2), (5,), dtype=F64), random.key(3)
    draw = random.rademacher if probe == "rademacher" else random.normal
    v = draw(key, (7, 5), dtype=F64)
    jac = jacrev(f)(x)
    want = torch.stack([vi @ jac @ vi for vi in v]).mean()
    torch.testing.assert_close(transforms.divergence(f, x, key=key, samples=7, probe=probe), want)


def test_hutchinson_is_unbiased():
    f, x = field(4, (6,)), random.normal(random.key(5), (6,), dtype=F64)
    exact = exact_trace(f, x)
    ests = vmap(lambda k: transforms.divergence(f, x, key=k))(random.split(random.key(6), 4000))
    stderr = ests.std() / len(ests) ** 0.5
    assert abs(float(ests.mean() - exact)) < 5 * float(stderr)
    assert float(ests.std()) > 0  # off-diagonal J: single probes do vary


def test_bad_input_gets_clear_errors():
    x = torch.ones(3)
    with pytest.raises(ValueError, match=r"f\(x\) must have x's shape \(3,\), got \(2,\)"):
        transforms.divergence(lambda x: x[:2], x)
    with pytest.raises(TypeError, match="x must be a floating-point tensor, got a tensor of "
                                        "dtype torch.int64"):
        transforms.divergence(lambda x: x, torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="probe must be one of"):
        transforms.divergence(lambda x: x, x, key=random.key(0), probe="sphere")
    with pytest.raises(ValueError, match="samples must be a positive int, got 0"):
        transforms.divergence(lambda x: x, x, key=random.key(0), samples=0)
