"""The shortcuts ``attention`` takes in plain eager mode, held to the full path.

Without anything to differentiate (no input requiring grad, no transform, no forward-mode
AD) ``attention`` calls the forward op without its ``autograd.Function``; in plain eager
mode the Functions call the ops' Python bodies without the dispatcher. Where something
records or transforms the call, both must step aside.
"""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import jvp
from torch.fx.experimental.proxy_tensor import make_fx

from torchfn.kernels import _autograd, attention, reference_attention


def _qkv(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 4, 9, 8, generator=g, dtype=dtype) for _ in range(3))


def _count_function_calls(monkeypatch):
    calls = []
    apply = _autograd._Attention.apply
    monkeypatch.setattr(_autograd._Attention, "apply",
                        lambda *a, **kw: (calls.append(1), apply(*a, **kw))[1])
    return calls


@pytest.mark.parametrize("mode", ["no_grad", "inputs_need_no_grad", "inference_mode"])
def test_inference_skips_the_function_and_gives_the_same_output(mode, monkeypatch):
    q, k, v = _qkv()
    want = reference_attention(q, k, v, causal=True)
    calls = _count_function_calls(monkeypatch)
    if mode == "no_grad":
        with torch.no_grad():
            o = attention(*(x.requires_grad_() for x in (q, k, v)), causal=True)
    elif mode == "inference_mode":
        with torch.inference_mode():
            o = attention(q, k, v, causal=True)
    else:
        o = attention(q, k, v, causal=True)
    assert not calls and o.grad_fn is None and not o.requires_grad
    assert (o - want).abs().max() <= 1e-12


def test_an_input_that_requires_grad_takes_the_function(monkeypatch):
    q, k, v = _qkv()
    calls = _count_function_calls(monkeypatch)
    o = attention(q, k.requires_grad_(), v, causal=True)
    assert calls and o.grad_fn is not None
    (dk,) = torch.autograd.grad(o.sum(), k)
    (want,) = torch.autograd.grad(reference_attention(q, k, v, causal=True).sum(), k)
    assert (dk - want).abs().max() <= 1e-12


def test_forward_mode_ad_takes_the_function():
    """Dual tensors (``torch.autograd.forward_ad``, not a ``torch.func`` transform) need
    the Function's jvp: the shortcut would drop the tangent."""
    q, k, v = _qkv()
    tangents = _qkv(seed=1)
    _, want = jvp(lambda q, k, v: reference_attention(q, k, v, causal=True), (q, k, v), tangents)
    with fwAD.dual_level():
        duals = [fwAD.make_dual(x, t) for x, t in zip((q, k, v), tangents)]
        tangent = fwAD.unpack_dual(attention(*duals, causal=True)).tangent
    assert tangent is not None and (tangent - want).abs().max() <= 1e-12


def test_tracing_records_the_custom_op():
    """make_fx (a dispatch mode) must see the custom op, not the ops of its body."""
    q, k, v = _qkv(dtype=torch.float32)
    graph = make_fx(lambda q, k, v: attention(q, k, v, causal=True))(q, k, v).graph
    targets = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    assert "torchfn.attention_fwd.default" in targets, targets


def test_call_uses_the_body_only_in_plain_eager_mode(monkeypatch):
    """``_call`` runs the op's Python function for plain tensors, else the op itself."""
    seen = []
    body = _autograd._BODIES[_autograd.attention_fwd]
    monkeypatch.setitem(_autograd._BODIES, _autograd.attention_fwd,
                        lambda *a: (seen.append("body"), body(*a))[1])
    q, k, v = _qkv(dtype=torch.float32)
    args = (q, k, v, None, True, 0.3, "torch")
    o, lse = _autograd._call(_autograd.attention_fwd, *args)
    assert seen == ["body"]
    o_meta, lse_meta = _autograd._call(_autograd.attention_fwd,
                                       *(x.to("meta") for x in (q, k, v)), *args[3:])
    assert seen == ["body"] and o_meta.device.type == "meta"  # meta: the op's fake impl
    o_op, lse_op = _autograd.attention_fwd(*args)
    assert torch.equal(o, o_op) and torch.equal(lse, lse_op)


def test_the_backward_is_differentiable_only_when_asked(monkeypatch):
    """A plain backward runs the op; with ``create_graph`` it runs ``_AttentionBackward``,
    whose own derivative must equal the reference's (grad-of-grad)."""
    calls = []
    apply = _autograd._AttentionBackward.apply
    monkeypatch.setattr(_autograd._AttentionBackward, "apply",
                        lambda *a, **kw: (calls.append(1), apply(*a, **kw))[1])
    q, k, v = (x.requires_grad_() for x in _qkv())
    w = _qkv(seed=2)[0]
    loss = lambda fn: (fn(q, k, v, causal=True) * w).sum()  # noqa: E731
    plain = torch.autograd.grad(loss(attention), (q, k, v))
    assert not calls
    grads = torch.autograd.grad(loss(attention), (q, k, v), create_graph=True)
    assert calls
    ref = torch.autograd.grad(loss(reference_attention), (q, k, v), create_graph=True)
    for a, b, c in zip(plain, grads, ref):
        assert (a - c).abs().max() <= 1e-12 and (b - c).abs().max() <= 1e-12
    gg = torch.autograd.grad(sum((g * g).sum() for g in grads), (q, k, v))
    gg_ref = torch.autograd.grad(sum((g * g).sum() for g in ref), (q, k, v))
    for a, b in zip(gg, gg_ref):
        assert (a - b).abs().max() <= 1e-10
