"""Consistency losses. Discrete (iCT / distillation): the exact consistency function of
data at one point has loss 0, the levels are drawn with iCT's log-normal masses, and
distillation's loss at the exact function shrinks with the teacher's step as Heun's
local error. Continuous (sCM): ``g`` is ``cos(t)`` times the total derivative of the
consistency function, the exact network with the exact teacher has zero loss and zero
gradient on Gaussian data, and the loss's gradient through a Transformer with torchfn
attention (a ``jvp``, which SDPA cannot take) equals the materialised attention's."""

import math

import pytest
import torch
from torch.func import grad, jacfwd, vmap

from torchfn import losses, random
from torchfn.losses._scm import _tangent
from torchfn.transforms import diffusion as D

C, M, S, SD, LO = 3.0, 0.4, 0.3, 0.5, 0.002


def point_exact(x, sigma):
    """Data at C: every trajectory is C + (x - C) sigma' / sigma, so f = C + (x - C) LO /
    sigma."""
    return C + (x - C) * (LO / sigma)[:, None]


@pytest.mark.parametrize("distance", ["pseudo_huber", "squared"])
@pytest.mark.parametrize("teacher", [None, "heun", "euler"])
def test_the_exact_function_of_a_point_has_zero_loss(distance, teacher):
    x0 = torch.full((256, 4), C, dtype=torch.float64)
    kwargs = {} if teacher is None else dict(
        teacher_fn=lambda x, sigma: torch.full_like(x, C), solver=teacher)
    for k in (0, 500, 999):
        loss = losses.consistency_loss(point_exact, x0, random.key(k),
                                       D.consistency_levels(k, 1000), distance=distance,
                                       **kwargs)
        assert loss.item() < 1e-12
    wrong = lambda x, sigma: point_exact(x, sigma) + 0.01 * x  # noqa: E731
    assert losses.consistency_loss(wrong, x0, random.key(0), D.consistency_levels(0, 1000),
                                   distance=distance, **kwargs).item() > 1e-4


def test_levels_are_drawn_with_icts_lognormal_masses():
    levels = D.consistency_levels(0, 1000)  # 11 levels, 10 pairs
    seen = []

    def f(x, sigma):
        seen.append(sigma)
        return x

    x0 = torch.zeros(40_000, 1, dtype=torch.float64)
    losses.consistency_loss(f, x0, random.key(1), levels)
    hi = seen[0]  # the online call's levels: s_{i+1}
    cdf = [math.erf((math.log(s) + 1.1) / (math.sqrt(2) * 2.0)) for s in levels.tolist()]
    p = torch.tensor([b - a for a, b in zip(cdf[:-1], cdf[1:])], dtype=torch.float64)
    p = p / p.sum()
    counts = torch.stack([(hi == s).sum() for s in levels[1:].tolist()]).double()
    assert counts.sum() == len(x0)
    expected = p * len(x0)
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 27.9  # the 0.999 quantile with 9 degrees of freedom


def test_distillation_error_shrinks_as_heuns_local_error():
    """Gaussian data, the exact teacher and the exact consistency function: the only
    error is one ODE step of the teacher, O(h^3) for Heun and O(h^2) for Euler, so the
    unweighted squared loss falls by about h^6 and h^4 when the grid gets finer."""

    def f(x, sigma):
        return M + (x - M) * math.sqrt(S * S + LO * LO) / (S * S + sigma[:, None] ** 2).sqrt()

    def teacher(x, sigma):  # E[x0 | x]
        s2 = sigma[:, None] ** 2
        return M + (x - M) * S * S / (S * S + s2)

    x0 = M + S * random.normal(random.key(2), (4096, 2), dtype=torch.float64)

    def loss(n, solver):
        levels = D.consistency_levels(0, 10, s0=n, s1=n)
        return losses.consistency_loss(f, x0, random.key(3), levels, teacher_fn=teacher,
                                       solver=solver, distance="squared", weighting=False,
                                       level_sampling="uniform").item()

    heun = loss(20, "heun") / loss(160, "heun")
    euler = loss(20, "euler") / loss(160, "euler")
    assert heun > 8**5 and 8**3 < euler < 8**5


def trig_var(t):
    return (t.cos() * S) ** 2 + (t.sin() * SD) ** 2


def trig_f(x, t):  # the exact TrigFlow consistency function of N(M, S^2) data
    return M + S * (x - t.cos() * M) / trig_var(t).sqrt()


def cm_net(x_in, t):  # its raw network: f = cos(t) x - sin(t) SD F
    x, c = SD * x_in, t.view(-1, 1)
    return (c.cos() * x - trig_f(x, c)) / (c.sin() * SD)


def teacher_net(x_in, t):  # the exact velocity / SD
    x, c = SD * x_in, t.view(-1, 1)
    v = c.sin() * c.cos() * (SD * SD - S * S) * (x - c.cos() * M) / trig_var(c) - c.sin() * M
    return v / SD


def test_g_is_cos_t_times_the_total_derivative():
    """Along x(t) = cos(t) x0 + sin(t) z (sCT's dx/dt), g = cos(t) d/dt f(x(t), t) at
    r = 1, for any network; r scales the jvp part."""
    g0 = torch.Generator().manual_seed(0)
    x0, z = (torch.randn(5, 3, generator=g0, dtype=torch.float64) for _ in range(2))
    t = torch.tensor([0.1, 0.5, 0.9, 1.3, 1.5], dtype=torch.float64)

    def F(x_in, t):
        return torch.tanh(x_in * (1 + t[:, None])) + t[:, None] ** 2 * x_in.roll(1, -1)

    def f_along(tt, a, b):  # one example's f(x(t), t)
        x = tt.cos() * a + tt.sin() * b
        return tt.cos() * x - tt.sin() * SD * F((x / SD)[None], tt[None])[0]

    want = t.cos()[:, None] * vmap(jacfwd(f_along))(t, x0, SD * z)
    x_t = t.cos()[:, None] * x0 + t.sin()[:, None] * SD * z
    dxdt = t.cos()[:, None] * SD * z - t.sin()[:, None] * x0
    _, g = _tangent(F, x_t, t, dxdt, SD, 1.0)
    torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)
    _, g_half = _tangent(F, x_t, t, dxdt, SD, 0.5)
    _, g_none = _tangent(F, x_t, t, dxdt, SD, 0.0)
    torch.testing.assert_close(g_half, 0.5 * (g + g_none), rtol=1e-10, atol=1e-12)


def test_scd_with_the_exact_network_and_teacher_has_zero_gradient():
    x0 = M + S * random.normal(random.key(4), (512, 2), dtype=torch.float64)

    def loss(theta):
        return losses.scm_loss(lambda x_in, t: theta * cm_net(x_in, t), x0, random.key(5),
                               sigma_data=SD, teacher_fn=teacher_net)

    one = torch.tensor(1.0, dtype=torch.float64)
    assert loss(one).item() < 1e-20
    assert grad(loss)(one).abs().item() < 1e-10
    assert grad(loss)(1.1 * one).abs().item() > 1e-3


def test_weighting_is_the_papers():
    x0 = random.normal(random.key(6), (8, 3), dtype=torch.float64)
    F = lambda x_in, t: torch.sin(x_in) * t[:, None]  # noqa: E731
    plain = losses.scm_loss(F, x0, random.key(7))
    w0 = 0.3
    weighted = losses.scm_loss(F, x0, random.key(7),
                               weight_fn=lambda t: torch.full_like(t, w0))
    torch.testing.assert_close(weighted, math.exp(w0) * plain - w0)


def test_scm_trains_through_a_transformer_with_torchfn_attention(grad_matches_materialised):
    """sCM's loss takes a jvp of the network (the paper had to write a JVP kernel for
    FlashAttention); grad of it runs reverse mode over the jvp's primal. Both go
    through models.TransformerEncoder's attention, and the gradient equals the same
    model's with the materialised reference attention (plain torch ops)."""
    grad_matches_materialised(lambda net, x0: losses.scm_loss(
        lambda x_in, t: net(x_in + t[:, None, None]), x0, random.key(9), time_scale=2.0))


def test_vmap_per_example_losses_equal_a_loop():
    x0 = random.normal(random.key(10), (5, 3))
    keys = random.split(random.key(11), 5)
    F = lambda x_in, t: torch.sin(x_in) * t[:, None]  # noqa: E731
    f = D.consistency_function(lambda x_in, c: torch.sin(x_in) * c[:, None])
    levels = D.consistency_levels(0, 100)

    def one(x, k):
        return torch.stack([losses.scm_loss(F, x[None], k),
                            losses.consistency_loss(f, x[None], k, levels)])

    torch.testing.assert_close(vmap(one)(x0, keys),
                               torch.stack([one(x0[i], keys[i]) for i in range(5)]))


def test_bad_input():
    x0, key, levels = torch.ones(4, 2), random.key(0), D.consistency_levels(0, 10)
    f = lambda x, s: x  # noqa: E731
    with pytest.raises(ValueError, match="levels must be a 1-D float Tensor"):
        losses.consistency_loss(f, x0, key, levels.flip(0))
    with pytest.raises(ValueError, match="distance must be one of"):
        losses.consistency_loss(f, x0, key, levels, distance="lpips")
    with pytest.raises(ValueError, match="solver must be one of"):
        losses.consistency_loss(f, x0, key, levels, teacher_fn=f, solver="rk4")
    with pytest.raises(ValueError, match=r"consistency_fn\(x, sigma\) must return"):
        losses.consistency_loss(lambda x, s: x[:, :1], x0, key, levels)
    with pytest.raises(ValueError, match=r"tangent_warmup must lie in \[0, 1\]"):
        losses.scm_loss(f, x0, key, tangent_warmup=2.0)
    with pytest.raises(ValueError, match=r"net_fn\(x_in, c_noise\) must return"):
        losses.scm_loss(lambda x, t: x.sum(1), x0, key)
    with pytest.raises(ValueError, match=r"teacher_fn\(x_in, c_noise\) must return"):
        losses.scm_loss(f, x0, key, teacher_fn=lambda x, t: x[:, :1])
    with pytest.raises(ValueError, match=r"weight_fn\(t\) must return shape"):
        losses.scm_loss(f, x0, key, weight_fn=lambda t: t[:2])
    with pytest.raises(TypeError, match="net_fn must be callable"):
        losses.scm_loss(None, x0, key)
