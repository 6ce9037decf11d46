"""``torchfn.cond`` / ``switch`` / ``while_loop`` / ``fori_loop``: under ``vmap`` they equal
the per-example Python control flow they replace, values and gradients, and they run no
more than the examples need."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad, jacfwd, vmap

import torchfn
from torchfn import random

F64 = torch.float64


def branchy(x):  # x: ()
    return torchfn.cond(x > 0, torch.sqrt, lambda x: -x * x, x)


def branchy_python(x):
    return torch.sqrt(x) if x > 0 else -x * x


@given(seed=st.integers(0, 2**16), n=st.integers(1, 12))
def test_cond_under_vmap_equals_python_if(seed, n):
    x = random.normal(random.key(seed), (n,), dtype=F64) * 3
    torch.testing.assert_close(vmap(branchy)(x), torch.stack([branchy_python(v) for v in x]))
    # gradients stay finite: sqrt's derivative at the negative examples never reaches them
    want = torch.stack([grad(branchy_python)(v) for v in x])
    torch.testing.assert_close(vmap(grad(branchy))(x), want)
    torch.testing.assert_close(vmap(jacfwd(branchy))(x), want)


def test_cond_runs_one_branch_when_all_examples_agree():
    calls = []

    def tracked(name, fn):
        def run(x):
            calls.append(name)
            return fn(x)
        return run

    def f(x):
        return torchfn.cond(x > 0, tracked("t", torch.sqrt), tracked("f", torch.neg), x)

    vmap(f)(torch.tensor([1.0, 4.0]))
    assert calls == ["t"]
    calls.clear()
    f(torch.tensor(-1.0))
    assert calls == ["f"]
    calls.clear()
    vmap(f)(torch.tensor([1.0, -4.0]))
    assert sorted(calls) == ["f", "t"]


def test_cond_with_pytrees_and_python_bools():
    ops = {"a": torch.ones(3), "b": torch.tensor(2.0)}
    out = torchfn.cond(True, lambda o: (o["a"] * o["b"], o["b"]), lambda o: (o["a"], -o["b"]),
                       ops)
    torch.testing.assert_close(out[0], torch.full((3,), 2.0))
    bs = torch.tensor([2.0, -1.0])
    out = vmap(lambda b: torchfn.cond(b > 0, lambda a, b: (a * b, b), lambda a, b: (a, -b),
                                      torch.ones(3), b))(bs)
    torch.testing.assert_close(out[0], torch.stack([torch.full((3,), 2.0), torch.ones(3)]))
    torch.testing.assert_close(out[1], torch.tensor([2.0, 1.0]))


def test_switch_clamps_and_selects_per_example():
    branches = [lambda x: x + 1, lambda x: x * 10, lambda x: -x]
    idx = torch.tensor([-5, 0, 1, 2, 7])
    x = torch.arange(5.0)
    out = vmap(lambda i, x: torchfn.switch(i, branches, x))(idx, x)
    want = torch.stack([branches[min(max(int(i), 0), 2)](v) for i, v in zip(idx, x)])
    torch.testing.assert_close(out, want)
    assert torchfn.switch(9, branches, torch.tensor(2.0)) == -2.0  # ints clamp too


def newton_sqrt(a):
    return torchfn.while_loop(lambda x: (x * x - a).abs() > 1e-12 * a,
                              lambda x: 0.5 * (x + a / x), a)


def test_while_loop_per_example_values_and_gradients():
    a = torch.tensor([0.25, 4.0, 9.0, 1e6], dtype=F64)
    torch.testing.assert_close(vmap(newton_sqrt)(a), a.sqrt())
    torch.testing.assert_close(vmap(grad(newton_sqrt))(a), 0.5 / a.sqrt())
    torch.testing.assert_close(vmap(jacfwd(newton_sqrt))(a), 0.5 / a.sqrt())


def collatz_steps(n):  # n: () int64
    def body(s):
        n, k = s
        return torch.where(n % 2 == 0, n // 2, 3 * n + 1), k + 1
    return torchfn.while_loop(lambda s: s[0] != 1, body, (n, torch.zeros_like(n)))[1]


def collatz_python(n):
    k = 0
    while n != 1:
        n, k = (n // 2 if n % 2 == 0 else 3 * n + 1), k + 1
    return k


def test_while_loop_runs_as_long_as_the_slowest_example():
    calls = []
    ns = torch.tensor([1, 6, 7, 27, 97])

    def counted(n):
        def body(s):
            calls.append(1)
            n, k = s
            return torch.where(n % 2 == 0, n // 2, 3 * n + 1), k + 1
        return torchfn.while_loop(lambda s: s[0] != 1, body, (n, torch.zeros_like(n)))[1]

    steps = vmap(counted)(ns)
    want = [collatz_python(int(n)) for n in ns]
    assert steps.tolist() == want
    assert len(calls) == max(want)
    # nested vmap: a (2, 2) grid of starting numbers
    grid = torch.tensor([[3, 6], [7, 9]])
    assert vmap(vmap(collatz_steps))(grid).tolist() == [[collatz_python(int(n)) for n in row]
                                                        for row in grid]


def test_fori_loop_equals_python_loop():
    def body(i, v):
        return v * 0.5 + i

    x = torch.tensor(3.0, dtype=F64)
    want = x
    for i in range(2, 7):
        want = body(i, want)
    torch.testing.assert_close(torchfn.fori_loop(2, 7, body, x), want)
    torch.testing.assert_close(grad(lambda x: torchfn.fori_loop(2, 7, body, x))(x),
                               torch.tensor(0.5**5, dtype=F64))


def test_compile_runs_them_eagerly(fresh_dynamo):
    a = torch.tensor([4.0, 9.0, 1e4])
    torch.testing.assert_close(torch.compile(vmap(newton_sqrt))(a), a.sqrt())
    torch.testing.assert_close(torch.compile(vmap(branchy))(torch.tensor([4.0, -2.0])),
                               torch.tensor([2.0, -4.0]))


def test_bad_input_gets_clear_errors():
    x = torch.tensor(1.0)
    with pytest.raises(TypeError, match=r"pred must be a bool or a 0-d bool tensor, got shape "
                                        r"\(2,\)"):
        torchfn.cond(torch.tensor([True, False]), torch.sin, torch.cos, x)
    with pytest.raises(TypeError, match=r"leaf 0 of branches\[1\] is \(\(2,\), torch.float32\), "
                                        r"of branches\[0\] \(\(3,\), torch.float32\)"):
        vmap(lambda v: torchfn.cond(v > 0, lambda v: v * torch.ones(2), lambda v: v * torch.ones(3),
                                    v))(torch.tensor([1.0, -1.0]))
    with pytest.raises(TypeError, match="index must be a 0-d integer tensor"):
        torchfn.switch(torch.tensor(1.0), [torch.sin], x)
    with pytest.raises(TypeError, match="branches must be a non-empty sequence"):
        torchfn.switch(0, [], x)
    with pytest.raises(TypeError, match="body_fun changed leaf 0 from"):
        torchfn.while_loop(lambda v: v.sum() < 3, lambda v: torch.cat([v, v]), torch.ones(1))
    with pytest.raises(TypeError, match="cond_fun's result must be a bool or a 0-d bool"):
        torchfn.while_loop(lambda v: v, lambda v: v, torch.ones(2))
    with pytest.raises(TypeError, match="changed the non-tensor leaf 1 from 1 to 2"):
        torchfn.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] + 1), (x, 1))
    with pytest.raises(TypeError, match="upper must be an int, got Tensor"):
        torchfn.fori_loop(0, torch.tensor(3), lambda i, v: v, x)
