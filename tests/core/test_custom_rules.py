"""``torchfn.custom_vjp`` / ``custom_jvp``: the user's rule is what every transform uses.

Two kinds of property:
- a rule that IS the derivative: every transform (grad, vmap(grad), jacrev, jacfwd, jvp,
  hessian, grad-of-grad, loss.backward with create_graph) equals autodiff of the plain
  function in float64, also with pytree arguments and outputs;
- a rule that is NOT autodiff's (gradient reversal, straight-through rounding, a stable
  softplus): each transform gives the rule's closed form, so a transform that silently
  fell back to autodiff would fail.
"""

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

import torchfn
from torchfn import random

F64 = torch.float64


def normal(seed, *shape):
    return random.normal(random.key(seed), shape, dtype=F64)


# -- a rule equal to the derivative, pytrees in and out ---------------------------------

def plain(params, x, scale):
    """params: {'w': (D, D), 'b': (D,)}, x: (D,), scale: float -> ((D,), ())"""
    h = torch.tanh(params["w"] @ x + params["b"]) * scale
    return {"h": h, "norm": (h * h).sum()}


@torchfn.custom_vjp
def layer_vjp(params, x, scale):
    return plain(params, x, scale)


def _layer_fwd(params, x, scale):
    out = plain(params, x, scale)
    return out, (params["w"], x, out["h"] / scale, scale)


def _layer_bwd(res, g):
    w, x, t, scale = res  # t = tanh(w x + b)
    gh = g["h"] + 2 * g["norm"] * t * scale  # d/dh of the norm, h = t * scale
    gz = gh * scale * (1 - t * t)  # (D,)
    return {"w": torch.outer(gz, x), "b": gz}, w.T @ gz, None


layer_vjp.defvjp(_layer_fwd, _layer_bwd)


@torchfn.custom_jvp
def layer_jvp(params, x, scale):
    return plain(params, x, scale)


@layer_jvp.defjvp
def _layer_rule(primals, tangents):
    params, x, scale = primals
    tp, tx, _ = tangents
    t = torch.tanh(params["w"] @ x + params["b"])
    tz = tp["w"] @ x + params["w"] @ tx + tp["b"]
    th = scale * (1 - t * t) * tz
    h = t * scale
    return None, {"h": th, "norm": 2 * (h * th).sum()}


def scalar_of(f):
    return lambda p, x: f(p, x, 0.7)["h"].sum() + f(p, x, 0.7)["norm"]


@pytest.fixture(params=["vjp", "jvp"])
def layer(request):
    return layer_vjp if request.param == "vjp" else layer_jvp


def inputs(seed=0, d=3, b=4):
    params = {"w": normal(seed, d, d) / 2, "b": normal(seed + 1, d)}
    return params, normal(seed + 2, b, d)


def assert_close(a, b):
    for x, y in zip(torchfn.tree.leaves(a), torchfn.tree.leaves(b), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


TRANSFORMS = {
    "grad": lambda f, p, x: grad(f, argnums=(0, 1))(p, x[0]),
    "vmap(grad)": lambda f, p, x: vmap(grad(f, argnums=(0, 1)), in_dims=(None, 0))(p, x),
    "jacrev": lambda f, p, x: jacrev(lambda p, x: f(p, x, 0.7), argnums=(0, 1))(p, x[0]),
    "jacfwd": lambda f, p, x: jacfwd(lambda p, x: f(p, x, 0.7), argnums=(0, 1))(p, x[0]),
    "jvp": lambda f, p, x: jvp(lambda p, x: f(p, x, 0.7), (p, x[0]),
                               ({k: v * 0.3 for k, v in p.items()}, x[1]))[1],
    "hessian": lambda f, p, x: hessian(f, argnums=1)(p, x[0]),
    "vmap(hessian)": lambda f, p, x: vmap(hessian(f, argnums=1), in_dims=(None, 0))(p, x),
    "grad-of-grad": lambda f, p, x: grad(lambda p: grad(f, argnums=1)(p, x[0]).sum())(p),
    "jacfwd(jacrev)": lambda f, p, x: jacfwd(jacrev(f, argnums=0), argnums=1)(p, x[0]),
}


@pytest.mark.parametrize("name", TRANSFORMS)
def test_transforms_equal_autodiff(layer, name):
    params, x = inputs()
    t = TRANSFORMS[name]
    f = scalar_of(layer) if name not in ("jacrev", "jacfwd", "jvp") else layer
    ref = scalar_of(plain) if name not in ("jacrev", "jacfwd", "jvp") else plain
    assert_close(t(f, params, x), t(ref, params, x))


def test_backward_with_create_graph_equals_autodiff(layer):
    params, x = inputs(3)
    grads = []
    for f in (scalar_of(layer), scalar_of(plain)):
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        xs = x[0].clone().requires_grad_()
        (gx,) = torch.autograd.grad(f(p, xs), xs, create_graph=True)
        (gx * gx).sum().backward()
        grads.append((gx.detach(), p["w"].grad, xs.grad))
    assert_close(*grads)


@given(seed=st.integers(0, 2**20), d=st.integers(1, 5), b=st.integers(1, 4))
def test_vmap_grad_equals_loop_over_shapes(seed, d, b):
    params, x = inputs(seed, d, b)
    for layer in (layer_vjp, layer_jvp):
        f = scalar_of(layer)
        batched = vmap(grad(f, argnums=(0, 1)), in_dims=(None, 0))(params, x)
        looped = [grad(f, argnums=(0, 1))(params, xi) for xi in x]
        assert_close(batched, torch.utils._pytree.tree_map(lambda *a: torch.stack(a), *looped))


# -- rules that are not autodiff's ---------------------------------------------------

@torchfn.custom_vjp
def reverse_gradient(x, lam):
    """DANN's gradient reversal layer: identity forward, -lam * g backward."""
    return x


reverse_gradient.defvjp(lambda x, lam: (x, lam), lambda lam, g: (-lam * g, None))


@torchfn.custom_vjp
def round_ste(x):
    """Straight-through rounding: round forward, identity backward."""
    return torch.round(x)


round_ste.defvjp(lambda x: (torch.round(x), None), lambda _, g: (g,))


@torchfn.custom_jvp
def softplus(x):
    return torch.log1p(torch.exp(-x.abs())) + x.clamp(min=0)


@softplus.defjvp
def _softplus_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return softplus(x), torch.sigmoid(x) * t  # JAX's idiom: the rule calls the function


@torchfn.custom_jvp
def softplus_fg(x):
    return torch.log1p(torch.exp(-x.abs())) + x.clamp(min=0)


@softplus_fg.defjvp
def _softplus_fg_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return softplus_fg.fun(x), torch.sigmoid(x) * t  # for torch.compile(fullgraph=True)


def test_gradient_reversal_in_every_mode():
    x = normal(5, 6)
    f = lambda x: (reverse_gradient(x * x, 0.5)).sum()  # noqa: E731
    torch.testing.assert_close(grad(f)(x), -0.5 * 2 * x)
    torch.testing.assert_close(vmap(grad(f))(x[:, None]), -0.5 * 2 * x[:, None])
    # forward mode is bwd's transpose: -lam * t
    torch.testing.assert_close(jvp(lambda x: reverse_gradient(x, 0.5), (x,), (x + 1,))[1],
                               -0.5 * (x + 1))
    torch.testing.assert_close(jacfwd(lambda x: reverse_gradient(x, 0.5))(x),
                               -0.5 * torch.eye(6, dtype=F64))
    torch.testing.assert_close(hessian(f)(x), -torch.eye(6, dtype=F64))  # d(-x)/dx


def test_straight_through_rounding():
    x = normal(6, 8) * 3
    assert torch.equal(round_ste(x), torch.round(x))
    w = normal(7, 8)
    g = grad(lambda x: (round_ste(x) * w).sum())(x)
    torch.testing.assert_close(g, w)  # autodiff of round would give zeros
    xr = x.clone().requires_grad_()
    (round_ste(xr) * w).sum().backward()
    torch.testing.assert_close(xr.grad, w)


def test_custom_jvp_rule_is_used_where_autodiff_overflows():
    x = torch.tensor([-1000.0, -30.0, 0.0, 30.0, 1000.0], dtype=F64)
    naive = lambda x: torch.log1p(torch.exp(x))  # noqa: E731
    assert not torch.isfinite(grad(lambda x: naive(x).sum())(x)).all()
    sig = torch.sigmoid(x)
    torch.testing.assert_close(grad(lambda x: softplus(x).sum())(x), sig)
    torch.testing.assert_close(jacrev(softplus)(x), torch.diag(sig))
    torch.testing.assert_close(jacfwd(softplus)(x), torch.diag(sig))
    torch.testing.assert_close(jvp(softplus, (x,), (x,))[1], sig * x)
    # second order differentiates the rule's ops: sigmoid' = s (1 - s)
    torch.testing.assert_close(hessian(lambda x: softplus(x).sum())(x), torch.diag(sig * (1 - sig)))


def test_defjvps_sums_per_argument_rules():
    @torchfn.custom_jvp
    def f(x, y):
        return torch.sin(x) * y

    f.defjvps(lambda tx, out, x, y: torch.cos(x) * tx * y, lambda ty, out, x, y: torch.sin(x) * ty)
    x, y = normal(8, 5), normal(9, 5)
    ref = lambda x, y: torch.sin(x) * y  # noqa: E731
    assert_close(jacfwd(f, argnums=(0, 1))(x, y), jacrev(ref, argnums=(0, 1))(x, y))
    assert_close(jacrev(f, argnums=(0, 1))(x, y), jacrev(ref, argnums=(0, 1))(x, y))


def test_nondiff_argnums_passes_static_values_first():
    @functools.partial(torchfn.custom_vjp, nondiff_argnums=(0,))
    def apply(fn, x):
        return fn(x)

    apply.defvjp(lambda fn, x: (fn(x), x), lambda fn, x, g: (g * 2 * x,))
    x = normal(10, 4)
    torch.testing.assert_close(grad(lambda x: apply(torch.square, x).sum())(x), 2 * x)

    @functools.partial(torchfn.custom_jvp, nondiff_argnums=(1,))
    def power(x, n):
        return x**n

    @power.defjvp
    def _(n, primals, tangents):
        (x,), (t,) = primals, tangents
        return None, n * x ** (n - 1) * t

    torch.testing.assert_close(grad(lambda x: power(x, 3).sum())(x), 3 * x**2)
    torch.testing.assert_close(jvp(lambda x: power(x, 3), (x,), (x,))[1], 3 * x**3)


def test_integer_leaves_and_outputs_carry_no_derivative():
    @torchfn.custom_vjp
    def pick(x, idx):
        return x[idx], idx + 1

    pick.defvjp(lambda x, idx: ((x[idx], idx + 1), (x, idx)),
                lambda res, g: (torch.zeros_like(res[0]).index_add(0, res[1], g[0]), None))
    x, idx = normal(11, 6), torch.tensor([0, 2, 2])
    want = torch.tensor([1.0, 0, 2, 0, 0, 0], dtype=F64)
    torch.testing.assert_close(grad(lambda x: pick(x, idx)[0].sum())(x), want)
    torch.testing.assert_close(jacfwd(lambda x: pick(x, idx)[0])(x).sum(0), want)
    assert torch.equal(pick(x, idx)[1], idx + 1)


def test_plain_eager_calls_fun_and_transforms_call_the_rules():
    calls = []

    @torchfn.custom_vjp
    def f(x):
        calls.append("fun")
        return x * 2

    def fwd(x):
        calls.append("fwd")
        return x * 2, None

    f.defvjp(fwd, lambda _, g: (g * 2,))
    x = normal(12, 3)
    f(x)
    assert calls == ["fun"]
    calls.clear()
    grad(lambda x: f(x).sum())(x)
    assert calls == ["fwd"]


# -- torch.compile ---------------------------------------------------------------------
# (aot_eager: the rules live in dynamo and AOT autograd; inductor adds only its C++ build)

@pytest.mark.parametrize("fullgraph", [False, True])
def test_compile_with_backward_uses_the_rules(fullgraph, fresh_dynamo):
    x = normal(13, 5)
    sp = softplus_fg if fullgraph else softplus
    for f, want in ((lambda x: reverse_gradient(x, 0.5).sum(), -0.5 * torch.ones_like(x)),
                    (lambda x: sp(x * 1000).sum(), 1000 * torch.sigmoid(1000 * x))):
        xr = x.clone().requires_grad_()
        torch.compile(f, fullgraph=fullgraph, backend="aot_eager")(xr).backward()
        torch.testing.assert_close(xr.grad, want)


@pytest.mark.parametrize("residuals", ["arguments", "fresh tensors"])
def test_fullgraph_compile_with_tensor_residuals(residuals, fresh_dynamo):
    """fwd saving its arguments, or tensors it makes, compiles with fullgraph=True; the
    gradients are the rule's (a rule that differs from autodiff: x2 on both)."""
    @torchfn.custom_vjp
    def bilinear(x, w):
        return (x @ w).sum()

    if residuals == "arguments":
        bilinear.defvjp(lambda x, w: ((x @ w).sum(), (x, w)),
                        lambda r, g: (2 * g * r[1].sum(1).expand_as(r[0]),
                                      2 * g * r[0].sum(0)[:, None].expand_as(r[1])))
    else:
        bilinear.defvjp(lambda x, w: ((x @ w).sum(), (w.sum(1), x.sum(0), x.shape)),
                        lambda r, g: (2 * g * r[0].expand(r[2]),
                                      2 * g * r[1][:, None].expand(r[1].shape[0], 2)))
    x, w = normal(40, 3, 4).clone().requires_grad_(), normal(41, 4, 2).clone().requires_grad_()
    out = torch.compile(bilinear, fullgraph=True, backend="aot_eager")(x, w)
    out.backward()
    torch.testing.assert_close(out.detach(), (x @ w).sum().detach())
    torch.testing.assert_close(x.grad, 2 * w.detach().sum(1).expand(3, 4))
    torch.testing.assert_close(w.grad, 2 * x.detach().sum(0)[:, None].expand(4, 2))
    with pytest.raises(TypeError, match="traceable_fwd must be a bool"):
        torchfn.custom_vjp(lambda x: x, traceable_fwd=1)


def test_compile_of_func_transforms_uses_the_rules(fresh_dynamo):
    """Dynamo drops an autograd.Function's backward and jvp inside torch.func transforms
    (pytorch#193279, #192985); the call then runs eagerly and stays right."""
    x = normal(14, 5)
    g = torch.compile(grad(lambda x: reverse_gradient(x, 0.5).sum()), backend="aot_eager")(x)
    torch.testing.assert_close(g, -0.5 * torch.ones_like(x))
    g = torch.compile(vmap(grad(lambda x: softplus(1000 * x).sum())), backend="aot_eager")(
        x[:, None])
    torch.testing.assert_close(g, 1000 * torch.sigmoid(1000 * x[:, None]))
    t = torch.compile(lambda x: jvp(lambda x: round_ste(x), (x,), (x,))[1],
                      backend="aot_eager")(x)
    torch.testing.assert_close(t, x)


# -- bad input -------------------------------------------------------------------------

def test_bwd_cotangent_with_the_wrong_shape_names_argument_and_leaf():
    @torchfn.custom_vjp
    def f(p, x):
        return (p["w"] * x).sum()

    f.defvjp(lambda p, x: (f.fun(p, x), (p, x)), lambda r, g: ({"w": g * r[1][:2]}, g * r[0]["w"]))
    with pytest.raises(ValueError, match=r"bwd gave shape \(2,\) for argument 'p' at \['w'\], "
                                         r"expected the primal's shape \(3,\)"):
        grad(f)({"w": normal(15, 3)}, normal(16, 3))


def test_bwd_with_the_wrong_number_of_cotangents():
    @torchfn.custom_vjp
    def f(x, y):
        return x * y

    f.defvjp(lambda x, y: (x * y, (x, y)), lambda r, g: (g * r[1],))
    with pytest.raises(TypeError, match=r"one entry per differentiable argument \(2: \['x', "
                                        r"'y'\]\), got a tuple of length 1"):
        grad(lambda x: f(x, x).sum())(normal(17, 3))


def test_bwd_with_the_wrong_structure():
    @torchfn.custom_vjp
    def f(p):
        return p["a"].sum()

    f.defvjp(lambda p: (p["a"].sum(), p), lambda r, g: ([g * torch.ones_like(r["a"])],))
    with pytest.raises(TypeError, match="must have the argument's structure"):
        grad(f)({"a": normal(18, 3)})


def test_jvp_rule_with_the_wrong_shape():
    @torchfn.custom_jvp
    def f(x):
        return x.sum(0)

    f.defjvp(lambda p, t: (None, t[0]))  # should be t[0].sum(0)
    with pytest.raises(ValueError, match=r"tangent_out gave shape \(3, 2\) for output leaf 0, "
                                         r"expected the output's shape \(2,\)"):
        jvp(f, (normal(19, 3, 2),), (normal(20, 3, 2),))


def test_misuse_gets_clear_errors():
    @torchfn.custom_vjp
    def f(x):
        return x

    with pytest.raises(TypeError, match=r"call f.defvjp\(fwd, bwd\) before calling it"):
        f(normal(21, 2))
    with pytest.raises(TypeError, match="fwd must be callable"):
        f.defvjp(None, lambda r, g: (g,))
    f.defvjp(lambda x: x, lambda r, g: (g,))  # fwd returns no residuals
    with pytest.raises(TypeError, match=r"fwd must return a pair \(out, residuals\)"):
        grad(lambda x: f(x).sum())(normal(22, 2))

    @functools.partial(torchfn.custom_vjp, nondiff_argnums=(1,))
    def g(x, w):
        return x * w

    g.defvjp(lambda x, w: (x * w, w), lambda w, r, gg: (gg * w,))
    with pytest.raises(TypeError, match=r"argument 1 \('w'\) is in nondiff_argnums but holds a "
                                        "tensor"):
        g(normal(23, 2), normal(24, 2))

    @torchfn.custom_jvp
    def h(x):
        return x

    with pytest.raises(TypeError, match="set a rule with @h.defjvp"):
        h(normal(25, 2))
    with pytest.raises(TypeError, match="nondiff_argnums must be an int or a sequence of ints"):
        torchfn.custom_jvp(lambda x: x, nondiff_argnums="0")


def test_closure_over_a_differentiated_tensor_is_refused():
    def make(w):
        @torchfn.custom_vjp
        def f(x):
            return x * w

        f.defvjp(lambda x: (x * w, None), lambda _, g: (g * w,))
        return f

    x, w = normal(26, 3), normal(27, 3)

    def outer(w):  # w is differentiated here, and f closes over it
        return grad(lambda x: make(w)(x).sum())(x).sum()

    with pytest.raises(ValueError, match="not one of its arguments"):
        grad(outer)(w)
    # a closure over a tensor that nothing differentiates is fine
    torch.testing.assert_close(grad(lambda x: make(w)(x).sum())(x), w)


def test_slices_of_an_argument_are_not_closures_under_autograd():
    """In plain autograd the forward runs under no_grad, where a view still has
    requires_grad: ``x[a:b]`` is the argument's own, not a captured tensor. A closure over
    another differentiated tensor is still refused."""
    @torchfn.custom_vjp
    def halves(x, v):
        return (x[:2] @ v).sum() + 2 * (x[2:] @ v).sum()

    def halves_bwd(res, g):
        x, v = res
        return (torch.cat((g * v.expand(2, 3), 2 * g * v.expand(3, 3))),
                g * (x[:2].sum(0) + 2 * x[2:].sum(0)))

    halves.defvjp(lambda x, v: (halves.fun(x, v), (x, v)), halves_bwd)
    x, v = normal(30, 5, 3).clone().requires_grad_(), normal(32, 3).clone().requires_grad_()
    halves(x.reshape(5, 3), v).backward()  # a view of x, then its slices inside
    torch.testing.assert_close(x.grad, torch.tensor([1.0, 1, 2, 2, 2], dtype=x.dtype)[:, None]
                               * v.detach())
    x = normal(33, 5).requires_grad_()
    w = normal(31, 5).requires_grad_()

    @torchfn.custom_vjp
    def leaky(x):
        return (x * w).sum()

    leaky.defvjp(lambda x: ((x * w).sum(), None), lambda _, g: (g * w,))
    with pytest.raises(ValueError, match="not one of its arguments"):
        leaky(x)


def test_a_residual_that_is_the_output_is_differentiated_by_the_rule():
    """fwd saves its own output (exp's derivative is exp): at second order the cotangent
    on that residual goes through bwd again, so every order equals autodiff of exp."""
    calls = []

    @torchfn.custom_vjp
    def exp(x):
        return torch.exp(x)

    def fwd(x):
        calls.append("fwd")
        y = torch.exp(x)
        return y, y

    exp.defvjp(fwd, lambda y, g: (g * y,))
    x = normal(28, 4)
    f = lambda x: exp(x).sum()  # noqa: E731
    ref = lambda x: torch.exp(x).sum()  # noqa: E731
    torch.testing.assert_close(hessian(f)(x), hessian(ref)(x))
    torch.testing.assert_close(jacrev(jacrev(f))(x), hessian(ref)(x))
    calls.clear()
    third = jacrev(jacrev(grad(f)))(x)
    torch.testing.assert_close(third, jacrev(jacrev(grad(ref)))(x))
    assert calls == ["fwd"]  # fwd is never re-run to differentiate its residuals
