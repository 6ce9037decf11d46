"""diffusion_loss: the formula on the drawn (t, noise), min-SNR-gamma equivalences, keys, grad."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchfn import random
from torchfn.losses import diffusion_loss, min_snr_weight
from torchfn.transforms import diffusion as D


class Recorder:
    """A model_fn that records what the loss fed it and answers with a fixed function."""

    def __init__(self, answer):
        self.answer, self.seen = answer, None

    def __call__(self, x_t, t):
        self.seen = (x_t, t)
        return self.answer(x_t, t)


def data(seed, shape=(16, 3), dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) + 0.5


@given(
    seed=st.integers(0, 2**31 - 1),
    prediction=st.sampled_from(["eps", "x0", "v"]),
    gamma=st.sampled_from([None, 1.0, 5.0]),
)
def test_loss_is_the_formula_on_the_drawn_timesteps(seed, prediction, gamma):
    s = D.cosine_schedule(100)
    x0 = data(seed)
    model = Recorder(lambda x, t: 0.3 * x - 0.1)
    loss = diffusion_loss(
        model, s, x0, random.key(seed), prediction=prediction, min_snr_gamma=gamma
    )
    x_t, t = model.seen
    assert t.dtype == torch.int64 and t.shape == (16,) and 0 <= t.min() and t.max() < 100
    a = s.alphas_cumprod[t][:, None]
    noise = (x_t - a.sqrt() * x0) / (1 - a).sqrt()  # recover the drawn noise
    target = {"eps": noise, "x0": x0, "v": a.sqrt() * noise - (1 - a).sqrt() * x0}[prediction]
    per_ex = ((0.3 * x_t - 0.1 - target) ** 2).mean(1)
    snr = a[:, 0] / (1 - a[:, 0])
    w = torch.ones_like(snr)
    if gamma is not None:
        m = snr.clamp(max=gamma)
        w = {"eps": m / snr, "x0": m, "v": m / (snr + 1)}[prediction]
    torch.testing.assert_close(loss, (w * per_ex).mean(), rtol=1e-6, atol=1e-9)
    # the drawn noise is standard normal-ish and t varies
    assert 0.5 < noise.std() < 1.5 and t.unique().numel() > 1


@given(seed=st.integers(0, 2**31 - 1), gamma=st.sampled_from([None, 0.5, 5.0]))
def test_min_snr_weights_make_parameterisations_agree(seed, gamma):
    # One denoiser expressed as eps-, x0- and v-predictions: with min-SNR weights all three
    # losses equal the x0-MSE weighted by min(snr, gamma). Without gamma they differ.
    s = D.linear_schedule(200)
    x0 = data(seed)
    x0_fn = lambda x, t: 0.8 * x + 0.05  # some x0 estimate

    def eps_fn(x, t):
        return D.predict_eps_from_x0(s, x, t, x0_fn(x, t))

    def v_fn(x, t):
        return D.velocity(s, x0_fn(x, t), t, eps_fn(x, t))

    key = random.key(seed)
    losses = {
        p: diffusion_loss(f, s, x0, key, prediction=p, min_snr_gamma=gamma or 1e9)
        for p, f in (("eps", eps_fn), ("x0", x0_fn), ("v", v_fn))
    }
    if gamma is not None:
        torch.testing.assert_close(losses["eps"], losses["x0"], rtol=1e-6, atol=0)
        torch.testing.assert_close(losses["v"], losses["x0"], rtol=1e-6, atol=0)
    plain = {
        p: diffusion_loss(f, s, x0, key, prediction=p)
        for p, f in (("eps", eps_fn), ("x0", x0_fn), ("v", v_fn))
    }
    assert not torch.allclose(plain["eps"], plain["x0"])


def test_perfect_model_has_zero_loss():
    s = D.linear_schedule(50)
    x0 = data(0)
    for p in ("eps", "x0", "v"):
        fn = {
            "eps": lambda x, t: D.predict_eps_from_x0(s, x, t, x0),
            "x0": lambda x, t: x0,
            "v": lambda x, t: D.velocity(s, x0, t, D.predict_eps_from_x0(s, x, t, x0)),
        }[p]
        assert diffusion_loss(fn, s, x0, random.key(1), prediction=p).item() < 1e-20


def test_keys_grad_and_dtype():
    s = D.linear_schedule(100)
    x0 = data(1, dtype=torch.float32)
    params = {"w": torch.tensor(0.5), "b": torch.tensor(0.1)}
    loss = lambda p, k: diffusion_loss(lambda x, t: p["w"] * x + p["b"], s, x0, k)
    a, b, c = loss(params, random.key(0)), loss(params, random.key(0)), loss(params, random.key(1))
    assert a.dtype == torch.float32 and a.dim() == 0
    assert torch.equal(a, b) and not torch.equal(a, c)
    g = torch.func.grad(loss)(params, random.key(0))
    eps = 1e-3
    fd = (
        loss({"w": params["w"] + eps, "b": params["b"]}, random.key(0))
        - loss({"w": params["w"] - eps, "b": params["b"]}, random.key(0))
    ) / (2 * eps)
    torch.testing.assert_close(g["w"], fd, rtol=2e-2, atol=1e-4)
    # vmap over keys equals the loop
    keys = random.split(random.key(3), 4)
    batched = torch.func.vmap(lambda k: loss(params, k))(keys)
    torch.testing.assert_close(batched, torch.stack([loss(params, k) for k in keys]))


def test_min_snr_weight_values():
    snr = torch.tensor([0.5, 5.0, 50.0], dtype=torch.float64)
    torch.testing.assert_close(
        min_snr_weight(snr, 5.0, "eps"), torch.tensor([1.0, 1.0, 0.1], dtype=torch.float64)
    )
    torch.testing.assert_close(
        min_snr_weight(snr, 5.0, "x0"), torch.tensor([0.5, 5.0, 5.0], dtype=torch.float64)
    )
    torch.testing.assert_close(
        min_snr_weight(snr, 5.0, "v"), torch.tensor([0.5 / 1.5, 5 / 6, 5 / 51], dtype=torch.float64)
    )
    assert torch.equal(min_snr_weight(snr, None, "v"), torch.ones_like(snr))


def test_bad_input():
    s = D.linear_schedule(10)
    x0, k = torch.ones(4, 2), random.key(0)
    f = lambda x, t: x
    with pytest.raises(ValueError, match="prediction must be one of"):
        diffusion_loss(f, s, x0, k, prediction="score")
    with pytest.raises(ValueError, match="min_snr_gamma must be None or > 0, got 0"):
        diffusion_loss(f, s, x0, k, min_snr_gamma=0)
    with pytest.raises(ValueError, match=r"must return x0's shape \(4, 2\), got \(4,\)"):
        diffusion_loss(lambda x, t: x.sum(1), s, x0, k)
    with pytest.raises(TypeError, match="schedule must be a Schedule"):
        diffusion_loss(f, s.betas, x0, k)
    with pytest.raises(TypeError, match="x0 must be a floating-point Tensor"):
        diffusion_loss(f, s, torch.ones(4, 2, dtype=torch.int64), k)
