"""dp_sgd: clipping == loop, noise std == sigma*C/B, zero noise == clipped mean, keys reproduce."""

import math

import pytest
import torch
import torch.nn.functional as F
import torchopt
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

from torchfn import random
from torchfn.transforms import (
    DPSGDState,
    clip_and_sum,
    dp_noise,
    dp_sgd,
    make_dp_step,
    pad_batch,
    per_sample_grads,
    poisson_sample,
)


def _grads(seed, b, shapes=((3, 4), (4,)), dtype=torch.float64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": scale * (torch.randn(b, *s, generator=g, dtype=dtype) + 0.1)
            for i, s in enumerate(shapes)}


def _params_like(grads):
    return {k: torch.zeros(v.shape[1:], dtype=v.dtype) + 0.5 for k, v in grads.items()}


def _loop_clipped_sum(grads, clip):
    b = next(iter(grads.values())).shape[0]
    out = {k: torch.zeros_like(v[0]) for k, v in grads.items()}
    for n in range(b):
        norm = math.sqrt(sum(float(v[n].pow(2).sum()) for v in grads.values()))
        coef = min(1.0, clip / (norm + 1e-6))
        for k, v in grads.items():
            out[k] += coef * v[n]
    return out


@given(b=st.integers(1, 8), clip=st.floats(0.01, 10.0), scale=st.floats(0.01, 10.0),
       seed=st.integers(0, 2**16))
def test_clip_and_sum_matches_loop(b, clip, scale, seed):
    grads = _grads(seed, b, scale=scale)
    summed, norms = clip_and_sum(grads, clip)
    want = _loop_clipped_sum(grads, clip)
    for k in want:
        torch.testing.assert_close(summed[k], want[k], rtol=1e-12, atol=1e-14)
    want_norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in grads.values()))
    torch.testing.assert_close(norms, want_norms, rtol=1e-12, atol=0)


@given(b=st.integers(1, 8), ebs=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_zero_noise_is_clipped_sum_over_expected_batch(b, ebs, seed):
    grads = _grads(seed, b, scale=3.0)
    params = _params_like(grads)
    dp = dp_sgd(l2_norm_clip=0.7, noise_multiplier=0.0, expected_batch_size=ebs,
                key=random.key(seed))
    state = dp.init(params)
    before = {k: v.clone() for k, v in grads.items()}
    upd, state = dp.update(grads, state, params)
    want = _loop_clipped_sum(grads, 0.7)
    for k in want:
        torch.testing.assert_close(upd[k], want[k] / ebs, rtol=1e-12, atol=1e-14)
        assert torch.equal(grads[k], before[k])  # inputs untouched
    assert int(state.step) == 1


def test_noise_std_matches_sigma_c_over_b():
    clip, sigma, ebs = 0.5, 1.3, 16.0
    grads = {"w": _grads(0, 4, shapes=((100, 100),))["p0"],
             "b": _grads(1, 4, shapes=((100,),))["p0"]}
    params = _params_like(grads)
    dp = dp_sgd(clip, sigma, ebs, key=random.key(3))
    state = dp.init(params)
    mean = {k: v / ebs for k, v in _loop_clipped_sum(grads, clip).items()}
    residuals = []
    for _ in range(2):  # two steps: fresh noise each step
        upd, state = dp.update(grads, state, params)
        residuals.append(torch.cat([(upd[k] - mean[k]).flatten() for k in grads]))
    r = torch.stack(residuals)  # (2, n)
    z = r / (sigma * clip / ebs)  # should be iid N(0, 1)
    n = z.numel()
    assert abs(float(z.mean())) < 4 / math.sqrt(n)
    assert abs(float(z.std()) - 1.0) < 4 / math.sqrt(2 * n)
    corr = float((z[0] * z[1]).mean())  # steps are independent
    assert abs(corr) < 4 / math.sqrt(n / 2)


def test_keys_reproduce_and_resume():
    grads = _grads(5, 3)
    params = _params_like(grads)

    def run(key, steps, state=None):
        dp = dp_sgd(1.0, 1.0, 3, key=key)
        state = dp.init(params) if state is None else state
        outs = []
        for _ in range(steps):
            u, state = dp.update(grads, state, params)
            outs.append(u)
        return outs, state

    a, _ = run(random.key(7), 3)
    b, _ = run(random.key(7), 3)
    c, _ = run(random.key(8), 3)
    first, mid = run(random.key(7), 1)
    rest, _ = run(random.key(7), 2, state=mid)  # resumed from the saved state
    for k in grads:
        assert torch.equal(a[2][k], b[2][k])
        assert not torch.equal(a[2][k], c[2][k])
        assert not torch.equal(a[0][k], a[1][k])
        assert torch.equal(rest[1][k], a[2][k])
    # the noise of step t is drawn from fold_in(key, t)
    dp = dp_sgd(1.0, 1.0, 3, key=random.key(7))
    s = DPSGDState(random.key(7), torch.tensor(2))
    u, _ = dp.update(grads, s, params)
    assert torch.equal(u["p0"], a[2]["p0"])


def test_dp_noise_equals_dp_sgd_on_clipped_sums():
    grads = _grads(2, 5, scale=2.0)
    params = _params_like(grads)
    kw = dict(l2_norm_clip=0.8, noise_multiplier=0.9, expected_batch_size=4, key=random.key(1))
    a, _ = dp_sgd(**kw).update(grads, dp_sgd(**kw).init(params), params)
    summed, _ = clip_and_sum(grads, 0.8)
    b, _ = dp_noise(**kw).update(summed, dp_noise(**kw).init(params), params)
    for k in grads:
        torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=1e-14)


def test_chains_with_torchopt():
    grads = _grads(3, 4)
    params = _params_like(grads)
    opt = torchopt.chain(dp_sgd(1.0, 0.0, 4, key=random.key(0)), torchopt.sgd(0.1))
    upd, _ = opt.update(grads, opt.init(params), params=params, inplace=False)
    want = _loop_clipped_sum(grads, 1.0)
    for k in grads:
        torch.testing.assert_close(upd[k], -0.1 * want[k] / 4, rtol=1e-12, atol=1e-14)


def test_poisson_sample_rates_and_keys():
    n, q = 2000, 0.05
    counts = torch.zeros(n)
    sizes = []
    for t in range(40):
        idx = poisson_sample(random.fold_in(random.key(0), t), n, q)
        assert idx.dtype == torch.int64 and (idx.diff() > 0).all()
        counts[idx] += 1
        sizes.append(len(idx))
    mean, sd = n * q, math.sqrt(n * q * (1 - q))
    assert abs(sum(sizes) / 40 - mean) < 4 * sd / math.sqrt(40)
    assert torch.equal(poisson_sample(random.key(3), n, q), poisson_sample(random.key(3), n, q))
    assert abs(float(counts.mean()) / 40 - q) < 4 * math.sqrt(q * (1 - q) / (40 * n))
    assert torch.equal(poisson_sample(random.key(1), 10, 1.0), torch.arange(10))


def test_pad_batch():
    idx, mask = pad_batch(torch.tensor([3, 5, 9]), 5)
    assert idx.tolist() == [3, 5, 9, 0, 0] and mask.tolist() == [True] * 3 + [False] * 2
    with pytest.raises(ValueError, match="max_batch_size"):
        pad_batch(torch.arange(6), 5)


def _mlp_setup(seed=0, b=6):
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    g = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(v.shape, generator=g, dtype=torch.float64) * 0.5
              for k, v in module.named_parameters()}
    x = torch.randn(b, 4, generator=g, dtype=torch.float64) + 0.1
    y = torch.randint(0, 3, (b,), generator=g)

    def batched(params, x, y):  # (B,) losses
        return F.cross_entropy(functional_call(module, params, (x,)), y, reduction="none")

    def single(params, x, y):
        return batched(params, x[None], y[None])[0]

    return params, x, y, single, batched


def test_make_dp_step_methods_agree_and_mask_pads():
    from torchfn import optim

    params, x, y, single, batched = _mlp_setup()
    kw = dict(l2_norm_clip=0.5, noise_multiplier=0.7, expected_batch_size=5.0, key=random.key(4))
    steps = {
        "vmap": make_dp_step(single, optim.sgd(0.2), **kw),
        "two_pass": make_dp_step(single, optim.sgd(0.2), method="two_pass", **kw),
        "ghost": make_dp_step(batched, optim.sgd(0.2), method="ghost", **kw),
    }
    p1, _, l1 = steps["vmap"].step(params, steps["vmap"].init(params), x, y)
    torch.testing.assert_close(l1, batched(params, x, y).mean())
    for name in ("two_pass", "ghost"):
        p2, s2, l2 = steps[name].step(params, steps[name].init(params), x, y)
        torch.testing.assert_close(l2, l1)
        assert int(s2[0].step) == 1
        for k in params:  # same key -> same noise; the clipped sums agree to rounding
            torch.testing.assert_close(p2[k], p1[k], rtol=1e-10, atol=1e-12)

    # zero noise: params - lr * clipped_sum / expected_batch_size
    zero = make_dp_step(single, optim.sgd(0.2), **{**kw, "noise_multiplier": 0.0})
    p3, _, _ = zero.step(params, zero.init(params), x, y)
    summed, _ = clip_and_sum(per_sample_grads(single)(params, x, y), 0.5)
    for k in params:
        torch.testing.assert_close(p3[k], params[k] - 0.2 * summed[k] / 5.0, rtol=1e-12,
                                   atol=1e-14)

    # padding rows with mask=False changes nothing (fixed shapes for compiled steps)
    idx, mask = pad_batch(torch.arange(4), 6)
    for step in steps.values():
        pa, _, la = step.step(params, step.init(params), x[:4], y[:4])
        pb, _, lb = step.step(params, step.init(params), x[idx], y[idx], mask=mask)
        torch.testing.assert_close(la, lb)
        for k in params:
            torch.testing.assert_close(pa[k], pb[k], rtol=1e-10, atol=1e-12)


@pytest.mark.slow  # cold torch.compile: a minute or more on 2 loaded cores
@pytest.mark.parametrize("method", ["vmap", "two_pass", "ghost"])
def test_compiled_step_equals_eager(method):
    from torchfn import optim

    params, x, y, single, batched = _mlp_setup()
    kw = dict(l2_norm_clip=0.5, noise_multiplier=0.7, expected_batch_size=5.0, key=random.key(4))
    dp = make_dp_step(batched if method == "ghost" else single, optim.sgd(0.2), method=method,
                      **kw)
    state = dp.init(params)
    p1, s1, l1 = dp.step(params, state, x, y)
    p2, s2, l2 = torch.compile(dp.step)(params, state, x, y)
    torch.testing.assert_close(l2, l1)
    for k in params:
        torch.testing.assert_close(p2[k], p1[k], rtol=1e-10, atol=1e-12)


def test_bad_input():
    k = random.key(0)
    with pytest.raises(ValueError, match="l2_norm_clip must be"):
        dp_sgd(0.0, 1.0, 4, key=k)
    with pytest.raises(ValueError, match="l2_norm_clip must be"):
        dp_sgd(-1.0, 1.0, 4, key=k)
    with pytest.raises(ValueError, match="noise_multiplier must be"):
        dp_sgd(1.0, -0.1, 4, key=k)
    with pytest.raises(ValueError, match="expected_batch_size must be"):
        dp_sgd(1.0, 1.0, 0.5, key=k)
    with pytest.raises(ValueError, match="noise_multiplier must be"):
        dp_noise(1.0, -1.0, 4, key=k)
    with pytest.raises(TypeError, match="key"):
        dp_sgd(1.0, 1.0, 4, key=0)
    with pytest.raises(ValueError, match="sample_rate must be in"):
        poisson_sample(k, 10, 0.0)
    with pytest.raises(ValueError, match="sample_rate must be in"):
        poisson_sample(k, 10, 1.5)
    with pytest.raises(ValueError, match="n must be"):
        poisson_sample(k, 0, 0.5)
    with pytest.raises(ValueError, match="method"):
        make_dp_step(lambda p, x: x, None, l2_norm_clip=1.0, noise_multiplier=1.0,
                     expected_batch_size=1, key=k, method="loop")

    dp = dp_sgd(1.0, 1.0, 4, key=k)
    params = {"w": torch.ones(3, 2), "b": torch.ones(3)}
    state = dp.init(params)
    no_batch = r"batch dim: grads\['b'\] must have shape \(B, 3\), got \(3,\)"
    with pytest.raises(ValueError, match=no_batch):
        dp.update(params, state, params)  # batch-mean grads, no batch dim
    with pytest.raises(ValueError, match="scalar"):
        dp.update({"s": torch.tensor(1.0)}, state)
    with pytest.raises(ValueError, match="share the leading batch dim"):
        dp.update({"b": torch.ones(4, 3), "w": torch.ones(5, 3, 2)}, state)
    with pytest.raises(ValueError, match="shaped like params"):
        nz = dp_noise(1.0, 1.0, 4, key=k)
        nz.update({"b": torch.ones(4, 3), "w": torch.ones(4, 3, 2)}, nz.init(params), params)


def test_empty_poisson_batch_is_pure_noise():
    from torchfn import optim

    params, x, y, single, batched = _mlp_setup()
    kw = dict(l2_norm_clip=0.5, noise_multiplier=0.7, expected_batch_size=5.0, key=random.key(4))
    dp = dp_sgd(**kw)
    noise, _ = dp.update({k: v[None] * 0 for k, v in params.items()}, dp.init(params), params)
    for method, fn in (("vmap", single), ("two_pass", single), ("ghost", batched)):
        step = make_dp_step(fn, optim.sgd(1.0), method=method, **kw)
        new, state, loss = step.step(params, step.init(params), x[:0], y[:0])
        assert int(state[0].step) == 1 and torch.isnan(loss)
        for k in params:  # the update is the noise alone: N(0, (sigma C)^2) / expected B
            torch.testing.assert_close(new[k], params[k] - noise[k], rtol=1e-12, atol=1e-14)
