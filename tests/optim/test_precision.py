"""Mixed precision: Policy casts, loss scaling equal to torch.amp.GradScaler."""

import optree
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from torchfn import optim


def test_policy_from_string_and_casts_only_floating_leaves():
    policy = optim.Policy.from_string("params=float32,compute=bfloat16,output=float16")
    assert policy == optim.Policy(torch.float32, torch.bfloat16, torch.float16)
    assert optim.Policy.from_string("p=f32,c=bf16,o=f32") == optim.Policy.from_string(
        "mixed_bfloat16"
    )
    assert optim.Policy.from_string("fp16") == optim.Policy(*[torch.float16] * 3)
    assert optim.Policy("float32", "float16", "float32") == optim.Policy.from_string(
        "mixed_float16"
    )
    tree = {"w": torch.randn(2, 3), "idx": torch.arange(3), "mask": torch.ones(2, dtype=torch.bool),
            "n": 3, "d": torch.randn(2, dtype=torch.float64)}
    c = policy.cast_to_compute(tree)
    assert c["w"].dtype == torch.bfloat16 and c["d"].dtype == torch.bfloat16
    assert c["idx"].dtype == torch.int64 and c["mask"].dtype == torch.bool and c["n"] == 3
    assert policy.cast_to_output(c)["w"].dtype == torch.float16
    back = policy.cast_to_param(c)
    assert back["w"].dtype == torch.float32
    torch.testing.assert_close(back["w"], tree["w"], rtol=1e-2, atol=1e-2)
    assert tree["w"].dtype == torch.float32  # input untouched


@pytest.mark.parametrize(
    "spec,exc,match",
    [
        ("params=float32,compute=int8", ValueError, "compute: unknown dtype 'int8'"),
        ("weights=float32", ValueError, "expected 'params=...,compute=...,output=...'"),
        ("float8", ValueError, "spec: unknown dtype 'float8'"),
        (3, TypeError, "spec must be a str"),
    ],
)
def test_policy_bad_input(spec, exc, match):
    with pytest.raises(exc, match=match):
        optim.Policy.from_string(spec)


def test_policy_rejects_integer_dtype():
    with pytest.raises(TypeError, match="compute_dtype must be a floating torch.dtype"):
        optim.Policy(torch.float32, torch.int32, torch.float32)


def test_all_finite():
    assert bool(optim.all_finite({"a": torch.ones(3), "b": [torch.zeros(2)]}))
    bad = {"a": torch.ones(3), "b": [torch.tensor([1.0, -float("inf")])]}
    assert not bool(optim.all_finite(bad))
    assert not bool(optim.all_finite([torch.tensor(float("nan"))]))
    assert optim.all_finite({}).dtype == torch.bool


@example(  # growth to 2**128 overflows: GradScaler keeps 2**127
    pattern=[True, True, True], init_scale=2.0**126, growth_factor=2.0, backoff_factor=0.5,
    growth_interval=1,
)
@given(
    pattern=st.lists(st.booleans(), min_size=1, max_size=25),
    init_scale=st.sampled_from([1.0, 2.0**16, 2.0**126]),
    growth_factor=st.sampled_from([2.0, 1.5, 3.0]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.7]),
    growth_interval=st.integers(1, 4),
)
def test_dynamic_loss_scale_equals_grad_scaler(
    pattern, init_scale, growth_factor, backoff_factor, growth_interval
):
    kw = dict(init_scale=init_scale, growth_factor=growth_factor,
              backoff_factor=backoff_factor, growth_interval=growth_interval)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, generator=gen).requires_grad_(True)
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", **kw)
    ls = optim.DynamicLossScale(**kw)
    params = {"w": w.detach().clone()}
    for finite in pattern:
        x = torch.rand(4, generator=gen) * 0.5 + 0.1  # |grad| < 1: 2**126 scales stay finite
        if not finite:
            x[1] = float("inf")
        # torch
        opt.zero_grad()
        before = w.detach().clone()
        scaler.scale((w * x).sum()).backward()
        scaler.step(opt)
        scaler.update()
        torch_skipped = torch.equal(before, w.detach())
        # ours
        scaled = torch.func.grad(lambda p, ls=ls, x=x: ls.scale((p["w"] * x).sum()))(params)
        grads = ls.unscale(scaled)
        ok = optim.all_finite(grads)
        new = optim.apply_updates(params, optree.tree_map(lambda g: -0.1 * g, grads))
        params = optim.select_tree(ok, new, params)
        ls = ls.adjust(ok)
        assert bool(ok) == (not torch_skipped)
        assert finite or not bool(ok)
        assert float(ls.loss_scale) == scaler.get_scale()
        torch.testing.assert_close(params["w"], w.detach(), rtol=1e-6, atol=1e-6)


def test_dynamic_loss_scale_is_a_pytree_that_compiles_and_vmaps():
    ls = optim.DynamicLossScale(init_scale=8.0, growth_interval=2)
    leaves, spec = optree.tree_flatten(ls)
    assert all(isinstance(x, torch.Tensor) for x in leaves)
    assert optree.tree_unflatten(spec, leaves) == ls
    step = torch.compile(lambda s, ok: s.adjust(ok), fullgraph=True, backend="eager")
    seq_c, seq_e = ls, ls
    for ok in [True, True, False, True, True, True]:
        seq_c = step(seq_c, torch.tensor(ok))
        seq_e = seq_e.adjust(ok)
        assert isinstance(seq_c, optim.DynamicLossScale) and len(seq_c) == 5
        assert float(seq_c.loss_scale) == float(seq_e.loss_scale)
        assert int(seq_c.counter) == int(seq_e.counter)
    stacked = optree.tree_map(lambda *x: torch.stack(x), ls, optim.DynamicLossScale(4.0))
    out = torch.vmap(lambda s, ok: s.adjust(ok))(stacked, torch.tensor([True, False]))
    assert out.loss_scale.tolist() == [8.0, 2.0] and out.counter.tolist() == [1, 0]
    assert ls._replace(counter=torch.tensor(1, dtype=torch.int32)).counter == 1
    assert int(optim.DynamicLossScale().growth_interval) == 2000


def test_noop_loss_scale():
    g = {"w": torch.tensor([256.0, 512.0]), "i": torch.tensor([3])}
    n = optim.NoOpLossScale()
    assert n.scale(g) is g and n.unscale(g) is g and n.adjust(False) is n
    assert float(n.loss_scale) == 1.0


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(init_scale=0.0), "init_scale must be > 0"),
        (dict(growth_factor=1.0), "growth_factor must be > 1"),
        (dict(backoff_factor=1.0), r"backoff_factor must be in \(0, 1\)"),
        (dict(growth_interval=0), "growth_interval must be an int >= 1, got 0"),
    ],
)
def test_loss_scale_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        optim.DynamicLossScale(**kw)


def test_select_tree_structure_mismatch():
    with pytest.raises(ValueError, match="on_true and on_false have different tree structures"):
        optim.select_tree(torch.tensor(True), {"a": torch.ones(1)}, {"b": torch.ones(1)})
