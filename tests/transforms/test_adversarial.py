"""FGSM / PGD / adversarial training: equal to manual autograd loops, inside the eps-ball,
deterministic per key, PGD at least as strong as FGSM, gradient stopped through the attack."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import torchfn
from torchfn import random
from torchfn.models import MLP
from torchfn.transforms import adversarial_loss, fgsm, pgd

D, C = 4, 3
MODEL = torchfn.Model(MLP(D, (8,), C, activation="tanh"))


def mlp_loss(p, x, y):
    return F.cross_entropy(MODEL.apply(p, x), y)


def linear_loss(p, x, y):  # convex in x: FGSM provably increases it
    return F.cross_entropy(x @ p["w"].T + p["b"], y)


def batch(seed, b, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(b, D, generator=g, dtype=dtype)
    y = torch.randint(0, C, (b,), generator=g)
    return x, y


def mlp_params(seed):
    return {k: v.double() for k, v in MODEL.init(random.key(seed)).items()}


def linear_params(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(C, D, generator=g, dtype=torch.float64),
            "b": torch.randn(C, generator=g, dtype=torch.float64)}


@given(seed=st.integers(0, 2**16), b=st.integers(1, 5), eps=st.floats(0.0, 0.5),
       clamp=st.sampled_from([None, (0.0, 1.0)]))
def test_fgsm_equals_manual_autograd_and_increases_convex_loss(seed, b, eps, clamp):
    x, y = batch(seed, b)
    p = mlp_params(seed)
    rows = []  # a manual loop: one example's loss and autograd.grad at a time
    for i in range(b):
        xi = x[i:i + 1].clone().requires_grad_()
        (gi,) = torch.autograd.grad(mlp_loss(p, xi, y[i:i + 1]), xi)
        rows.append(x[i:i + 1] + eps * gi.sign())
    expect = torch.cat(rows)
    expect = expect if clamp is None else expect.clamp(*clamp)
    torch.testing.assert_close(fgsm(mlp_loss, p, x, y, eps=eps, clamp=clamp), expect,
                               rtol=0, atol=0)
    lp = linear_params(seed)
    x_adv = fgsm(linear_loss, lp, x, y, eps=eps)
    per = lambda xx: F.cross_entropy(xx @ lp["w"].T + lp["b"], y, reduction="none")  # noqa: E731
    assert (per(x_adv) >= per(x) - 1e-12).all()  # each example's loss goes up (convexity)
    if eps >= 1e-3:  # a smaller step can vanish in float64 rounding (x + eps == x)
        assert linear_loss(lp, x_adv, y) > linear_loss(lp, x, y)


@given(seed=st.integers(0, 2**16), norm=st.sampled_from(["linf", "l2"]),
       eps=st.floats(0.0, 1.0), steps=st.integers(1, 4), clamp=st.sampled_from([None, (0.0, 1.0)]),
       random_start=st.booleans())
def test_pgd_stays_in_eps_ball_and_is_deterministic_per_key(seed, norm, eps, steps, clamp,
                                                             random_start):
    x, y = batch(seed, 3)
    p = mlp_params(seed)
    kw = dict(eps=eps, step_size=0.3, steps=steps, norm=norm, clamp=clamp,
              random_start=random_start)
    x_adv = pgd(mlp_loss, p, x, y, random.key(seed), **kw)
    delta = (x_adv - x).flatten(1)
    size = delta.abs().amax(1) if norm == "linf" else delta.norm(dim=1)
    assert (size <= eps * (1 + 1e-9) + 1e-12).all(), (size, eps)
    if clamp is not None:
        assert x_adv.min() >= 0 and x_adv.max() <= 1
    assert torch.equal(x_adv, pgd(mlp_loss, p, x, y, random.key(seed), **kw))


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_pgd_with_zero_eps_returns_x(norm):
    # the eps-ball is a point: the random start and every projected step stay at x
    x, y = batch(3, 4)
    out = pgd(mlp_loss, mlp_params(3), x, y, random.key(0), eps=0.0, step_size=0.1, steps=2,
              norm=norm)
    assert torch.equal(out, x)


def test_pgd_random_start_differs_across_keys_and_vmap_over_keys_equals_loop():
    x, y = batch(0, 4)
    p = mlp_params(0)
    kw = dict(eps=0.2, step_size=0.05, steps=2, norm="l2")
    keys = random.split(random.key(1), 3)
    looped = torch.stack([pgd(mlp_loss, p, x, y, k, **kw) for k in keys])
    batched = torch.func.vmap(lambda k: pgd(mlp_loss, p, x, y, k, **kw))(keys)
    torch.testing.assert_close(batched, looped, rtol=1e-12, atol=1e-12)
    assert not torch.equal(looped[0], looped[1])


def test_one_step_pgd_without_random_start_is_fgsm():
    x, y = batch(2, 5)
    p = mlp_params(2)
    out = pgd(mlp_loss, p, x, y, None, eps=0.1, step_size=0.1, steps=1, random_start=False)
    torch.testing.assert_close(out, fgsm(mlp_loss, p, x, y, eps=0.1), rtol=0, atol=0)


def test_pgd_at_least_as_strong_as_fgsm_on_a_trained_model():
    # three Gaussian blobs in 4-D, a small trained MLP
    g = torch.Generator().manual_seed(0)
    centers = 1.5 * torch.randn(C, D, generator=g)
    y = torch.randint(0, C, (240,), generator=g)
    x = centers[y] + 0.6 * torch.randn(240, D, generator=g)
    params = MODEL.init(random.key(0))
    opt = torchfn.optim.adam(0.05)
    state = opt.init(params)
    for _ in range(60):
        grads = torch.func.grad(mlp_loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        params = torchfn.optim.apply_updates(params, updates)
    clean = (MODEL.apply(params, x).argmax(-1) == y).float().mean()
    assert clean > 0.9  # it is trained
    eps = 0.5
    x_f = fgsm(mlp_loss, params, x, y, eps=eps)
    x_p = pgd(mlp_loss, params, x, y, random.key(1), eps=eps, step_size=eps / 4, steps=10)
    loss_f, loss_p = mlp_loss(params, x_f, y), mlp_loss(params, x_p, y)
    acc_f = (MODEL.apply(params, x_f).argmax(-1) == y).float().mean()
    acc_p = (MODEL.apply(params, x_p).argmax(-1) == y).float().mean()
    assert loss_p >= loss_f > mlp_loss(params, x, y)
    assert acc_p <= acc_f < clean


@pytest.mark.parametrize("attack", ["fgsm", "pgd"])
def test_adversarial_loss_mixes_and_stops_gradient_through_attack(attack):
    x, y = batch(3, 4)
    p = mlp_params(3)
    key = random.key(7)
    kw = dict(eps=0.2, attack=attack, steps=3, mix=0.3)
    if attack == "fgsm":
        x_adv = fgsm(mlp_loss, p, x, y, eps=0.2)
    else:
        x_adv = pgd(mlp_loss, p, x, y, key, eps=0.2, step_size=2.5 * 0.2 / 3, steps=3)
    manual = lambda q: 0.7 * mlp_loss(q, x, y) + 0.3 * mlp_loss(q, x_adv, y)  # noqa: E731
    torch.testing.assert_close(adversarial_loss(mlp_loss, p, x, y, key, **kw), manual(p))
    # d/dparams with x_adv held constant (no gradient through the attack)
    ours = torch.func.grad(lambda q: adversarial_loss(mlp_loss, q, x, y, key, **kw))(p)
    ref = torch.func.grad(manual)(p)
    for k in p:
        torch.testing.assert_close(ours[k], ref[k], rtol=1e-10, atol=1e-12)


def test_per_example_loss_vector_is_accepted():
    x, y = batch(4, 3)
    p = mlp_params(4)
    per = lambda q, xx, yy: F.cross_entropy(MODEL.apply(q, xx), yy, reduction="none")  # noqa: E731
    torch.testing.assert_close(fgsm(per, p, x, y, eps=0.1), fgsm(mlp_loss, p, x, y, eps=0.1))


def test_bad_input():
    x, y = batch(0, 2)
    p = mlp_params(0)
    k = random.key(0)
    with pytest.raises(ValueError, match="eps must be >= 0, got -0.1"):
        fgsm(mlp_loss, p, x, y, eps=-0.1)
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        pgd(mlp_loss, p, x, y, k, eps=0.1, step_size=0.1, steps=0)
    with pytest.raises(ValueError, match="step_size must be > 0, got 0"):
        pgd(mlp_loss, p, x, y, k, eps=0.1, step_size=0, steps=1)
    with pytest.raises(ValueError, match="norm must be one of .* got 'l1'"):
        pgd(mlp_loss, p, x, y, k, eps=0.1, step_size=0.1, steps=1, norm="l1")
    with pytest.raises(ValueError, match="key must be a torchfn.random key when random_start"):
        pgd(mlp_loss, p, x, y, None, eps=0.1, step_size=0.1, steps=1)
    with pytest.raises(ValueError, match=r"clamp must be None or \(lo, hi\) with lo < hi"):
        fgsm(mlp_loss, p, x, y, eps=0.1, clamp=(1.0, 0.0))
    with pytest.raises(ValueError, match="mix must be a number in \\[0, 1\\], got 1.5"):
        adversarial_loss(mlp_loss, p, x, y, k, eps=0.1, mix=1.5)
    with pytest.raises(ValueError, match="attack must be one of .* got 'cw'"):
        adversarial_loss(mlp_loss, p, x, y, k, eps=0.1, attack="cw")
    with pytest.raises(ValueError, match=r"must return a scalar or per-example losses \(B,\)"):
        fgsm(lambda q, xx, yy: xx.sum(0), p, x, y, eps=0.1)
    with pytest.raises(TypeError, match="x must be a floating-point Tensor"):
        fgsm(mlp_loss, p, y, y, eps=0.1)
