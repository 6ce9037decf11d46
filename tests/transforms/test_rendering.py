"""volume_render: NeRF's quadrature against a loop and the closed form; stratified
depths; a NeRF field rendered ray by ray under vmap."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad, jacrev, vmap

import torchfn
from torchfn import random
from torchfn.models import NeRF
from torchfn.transforms import stratified_depths, volume_render


def _loop(sigma, color, t, far_delta):
    """The quadrature written out, one ray at a time, sample by sample (float64)."""
    out = []
    for s, c, tt in zip(sigma, color, t):
        acc, trans, depth, opacity = torch.zeros(c.shape[-1], dtype=s.dtype), 1.0, 0.0, 0.0
        for i in range(len(s)):
            delta = tt[i + 1] - tt[i] if i + 1 < len(s) else far_delta
            w = trans * (1 - math.exp(-float(s[i]) * float(delta)))
            acc, depth, opacity = acc + w * c[i], depth + w * float(tt[i]), opacity + w
            trans *= math.exp(-float(s[i]) * float(delta))
        out.append((acc, depth, opacity))
    return out


def _rays(seed, R, S, C=3):
    k1, k2, k3 = random.split(random.key(seed), 3)
    sigma = random.uniform(k1, (R, S), torch.float64, maxval=3.0)
    color = random.uniform(k2, (R, S, C), torch.float64)
    t = stratified_depths(k3, 0.5, 2.5, S, (R,)).double()
    return sigma, color, t


@given(seed=st.integers(0, 2**16), R=st.integers(1, 4), S=st.integers(1, 12),
       far=st.sampled_from([0.0, 0.3, 1e10]))
def test_volume_render_equals_the_loop(seed, R, S, far):
    sigma, color, t = _rays(seed, R, S)
    out = volume_render(sigma, color, t, far_delta=far)
    for r, (c, depth, opacity) in enumerate(_loop(sigma, color, t, far)):
        assert torch.allclose(out.color[r], c, atol=1e-12)
        assert math.isclose(float(out.depth[r]), depth, abs_tol=1e-12)
        assert math.isclose(float(out.opacity[r]), opacity, abs_tol=1e-12)
    assert torch.allclose(out.opacity, out.weights.sum(-1))


def test_constant_density_gives_the_closed_form():
    """Constant sigma and color on [0, L]: color c (1 - exp(-sigma L)), exactly."""
    sigma, L, c = 1.7, 2.0, torch.tensor([0.2, 0.5, 0.9], dtype=torch.float64)
    t = torch.linspace(0.0, L, 33, dtype=torch.float64)
    out = volume_render(torch.full((33,), sigma, dtype=torch.float64), c.expand(33, 3), t,
                        far_delta=0.0)
    assert torch.allclose(out.color, c * (1 - math.exp(-sigma * L)), atol=1e-14)
    # the mean depth of the exponential distribution truncated to the samples
    p = out.weights
    assert torch.allclose(out.depth, (p * t).sum())
    # NeRF's default far_delta: the last sample absorbs the rest, opacity 1
    full = volume_render(torch.full((33,), sigma, dtype=torch.float64), c.expand(33, 3), t)
    assert math.isclose(float(full.opacity), 1.0, abs_tol=1e-14)


def test_gradients_equal_the_loop():
    sigma, color, t = _rays(1, 2, 6)
    f = lambda s, c: volume_render(s, c, t).color.pow(2).sum()  # noqa: E731
    g_sigma, g_color = grad(f, argnums=(0, 1))(sigma, color)
    s_, c_ = sigma.clone().requires_grad_(), color.clone().requires_grad_()
    ref = sum(acc.pow(2).sum() for acc, _, _ in _loop_autograd(s_, c_, t))
    ref.backward()
    assert torch.allclose(g_sigma, s_.grad, atol=1e-12)
    assert torch.allclose(g_color, c_.grad, atol=1e-12)


def _loop_autograd(sigma, color, t, far_delta=1e10):
    out = []
    for s, c, tt in zip(sigma, color, t):
        acc, trans = torch.zeros(c.shape[-1], dtype=s.dtype), torch.ones((), dtype=s.dtype)
        for i in range(len(s)):
            delta = tt[i + 1] - tt[i] if i + 1 < len(s) else torch.tensor(far_delta)
            a = 1 - torch.exp(-s[i] * delta)
            acc = acc + trans * a * c[i]
            trans = trans * torch.exp(-s[i] * delta)
        out.append((acc, None, None))
    return out


def test_stratified_depths_fall_one_per_bin_and_are_keyed():
    t = stratified_depths(random.key(0), 2.0, 6.0, 8, (100,))  # (100, 8)
    bins = torch.linspace(2.0, 6.0, 9)
    assert bool(((t >= bins[:-1]) & (t < bins[1:])).all())
    assert torch.equal(t, stratified_depths(random.key(0), 2.0, 6.0, 8, (100,)))
    per_ray = vmap(lambda k: stratified_depths(k, 2.0, 6.0, 8))(random.split(random.key(1), 3))
    assert per_ray.shape == (3, 8) and not torch.equal(per_ray[0], per_ray[1])


def _field(seed=0):
    model = torchfn.Model(NeRF(pos_freqs=4, dir_freqs=2, hidden=16, depth=3, skip=1,
                               view_hidden=8).double())
    return model, model.init(random.key(seed))


def test_nerf_density_ignores_the_view_and_outputs_are_in_range():
    model, params = _field()
    x = random.normal(random.key(1), (5, 3), torch.float64)
    d = random.normal(random.key(2), (5, 3), torch.float64)
    rgb, sigma = model.apply(params, x, d)
    assert rgb.shape == (5, 3) and sigma.shape == (5,)
    assert bool(((rgb > 0) & (rgb < 1)).all()) and bool((sigma >= 0).all())
    d_sigma = jacrev(lambda d: model.apply(params, x, d)[1])(d)  # (5, 5, 3)
    assert not d_sigma.any()
    d_rgb = jacrev(lambda d: model.apply(params, x, d)[0])(d)
    assert d_rgb.abs().sum() > 0


def test_rendering_one_ray_at_a_time_equals_the_batch():
    model, params = _field()
    origins = random.normal(random.key(3), (4, 3), torch.float64)
    dirs = random.normal(random.key(4), (4, 3), torch.float64)
    t = stratified_depths(random.key(5), 0.5, 3.0, 16, (4,)).double()  # (R, S)

    def render(o, d, t):  # ONE ray: (3,), (3,), (S,)
        x = o + t[:, None] * d  # (S, 3)
        rgb, sigma = model.apply(params, x, d.expand_as(x))
        return volume_render(sigma, rgb, t).color  # (3,)

    batch_x = origins[:, None] + t[..., None] * dirs[:, None]  # (R, S, 3)
    rgb, sigma = model.apply(params, batch_x, dirs[:, None].expand_as(batch_x))
    batched = volume_render(sigma, rgb, t).color
    assert torch.allclose(vmap(render)(origins, dirs, t), batched, atol=1e-12)
    # and per-ray gradients of a photometric loss, as a per-ray loop
    loss = lambda p, o, d, t, target: (  # noqa: E731
        volume_render(*reversed(model.apply(p, o + t[:, None] * d,
                                            d.expand(t.shape[0], 3))), t).color
        - target).pow(2).sum()
    target = torch.full((4, 3), 0.5, dtype=torch.float64)
    per = vmap(grad(loss), in_dims=(None, 0, 0, 0, 0))(params, origins, dirs, t, target)
    g = grad(loss)(params, origins[2], dirs[2], t[2], target[2])
    assert all(torch.allclose(per[k][2], g[k], atol=1e-12) for k in g)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((torch.ones(2, 4), torch.ones(2, 4), torch.ones(2, 4)), {}, "channel dim"),
        ((torch.ones(2, 4), torch.ones(2, 4, 3), torch.ones(3)), {}, "does not broadcast"),
        ((torch.ones(2, 4), torch.ones(2, 4, 3), torch.ones(4)), {"far_delta": -1.0},
         "far_delta must be a number >= 0"),
    ],
)
def test_volume_render_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        volume_render(*args, **kwargs)


def test_nerf_bad_input():
    with pytest.raises(ValueError, match=r"skip must be an int in \[0, depth=3\)"):
        NeRF(depth=3, skip=3)
    model = NeRF(hidden=8, depth=2, skip=0, view_hidden=4)
    with pytest.raises(ValueError, match=r"d must be a float tensor \(\.\.\., 3\)"):
        model(torch.zeros(4, 3), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="x and d must have one shape"):
        model(torch.zeros(4, 3), torch.zeros(1, 3))
