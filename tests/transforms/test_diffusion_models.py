"""The MLP denoiser and its time embedding, as pure torchfn models."""

import math

import pytest
import torch

import torchfn
from torchfn import random
from torchfn.models import MLPDenoiser, MLPEnergy, timestep_embedding


def test_timestep_embedding_formula():
    t = torch.tensor([0, 3, 999])
    emb = timestep_embedding(t, 8)
    assert emb.shape == (3, 8)
    freqs = [10000 ** (-i / 4) for i in range(4)]
    for b, tb in enumerate(t.tolist()):
        expect = [math.cos(tb * f) for f in freqs] + [math.sin(tb * f) for f in freqs]
        torch.testing.assert_close(emb[b], torch.tensor(expect), rtol=1e-5, atol=1e-5)
    assert timestep_embedding(t, 7).shape == (3, 7)
    assert timestep_embedding(t[0], 6).shape == (6,)


def test_denoiser_is_a_pure_model_that_vmaps():
    model = torchfn.Model(MLPDenoiser(3, hidden=32, depth=2, time_dim=16))
    params = model.init(random.key(0))
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0, 1, 10, 100, 999])
    out = model.apply(params, x, t)
    assert out.shape == (5, 3)
    # written for a batch, it also runs per example under vmap with the same result
    per_ex = torch.func.vmap(lambda xi, ti: model.apply(params, xi[None], ti[None])[0])(x, t)
    torch.testing.assert_close(per_ex, out, rtol=1e-5, atol=1e-6)
    # t matters
    assert not torch.allclose(out, model.apply(params, x, t.flip(0)))
    # without the Fourier input features too
    plain = torchfn.Model(MLPDenoiser(3, hidden=8, depth=1, fourier=0))
    assert plain.apply(plain.init(random.key(0)), x, t).shape == (5, 3)
    # gradients flow to every parameter
    g = torch.func.grad(lambda p: model.apply(p, x, t).pow(2).sum())(params)
    assert set(g) == set(params) and all(torch.isfinite(v).all() for v in g.values())


def test_denoiser_with_two_times_reads_the_interval():
    """times=2 (MeanFlow's u(z, r, t)): the output depends on r, jvp goes through both
    times, and r is required exactly then."""
    model = torchfn.Model(MLPDenoiser(2, hidden=16, depth=1, time_dim=8, times=2))
    params = model.init(random.key(2))
    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(1))
    t, r = torch.tensor([0.9, 0.5, 0.3, 1.0]) * 1000, torch.tensor([0.1, 0.5, 0.0, 0.2]) * 1000
    out = model.apply(params, x, t, r)
    assert out.shape == (4, 2) and not torch.allclose(out, model.apply(params, x, t, t))
    _, dt = torch.func.jvp(lambda t, r: model.apply(params, x, t, r), (t, r),
                           (torch.ones_like(t), torch.zeros_like(r)))
    assert dt.abs().max() > 0
    with pytest.raises(ValueError, match="pass r exactly when times=2"):
        model.apply(params, x, t)
    with pytest.raises(ValueError, match="times must be 1 or 2"):
        MLPDenoiser(2, times=3)


def test_energy_is_scalar_per_example():
    model = torchfn.Model(MLPEnergy(2, hidden=16))
    params = model.init(random.key(1))
    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(0))
    assert model.apply(params, x[0]).shape == ()
    torch.testing.assert_close(
        torch.func.vmap(lambda xi: model.apply(params, xi))(x), model.apply(params, x)
    )


def test_bad_input():
    with pytest.raises(ValueError, match="dim, hidden, depth and time_dim must be >= 1"):
        MLPDenoiser(2, depth=0)
    with pytest.raises(ValueError, match="fourier must be >= 0 and max_freq >= 1"):
        MLPDenoiser(2, fourier=-1)
    with pytest.raises(ValueError, match="dim, hidden and depth must be >= 1"):
        MLPEnergy(0)
    with pytest.raises(ValueError, match="dim must be >= 1"):
        timestep_embedding(torch.tensor([1]), 0)
