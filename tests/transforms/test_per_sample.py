"""per_sample_grads / per_sample_grad_norms == a Python loop of torch.autograd.grad."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

from torchfn.transforms import per_sample_grad_norms, per_sample_grads


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _params(module, dtype, seed=0):
    """Random params from a seeded generator (no global RNG), scaled by fan-in."""
    g = _gen(seed)
    out = {}
    for k, v in module.named_parameters():
        fan_in = v[0].numel() if v.ndim > 1 else v.numel()
        out[k] = (torch.randn(v.shape, generator=g) / fan_in**0.5 + 0.01).to(dtype)
    return out


class CNN(nn.Module):
    def __init__(self, c=3, k=3, side=6, classes=4):
        super().__init__()
        self.conv1 = nn.Conv2d(1, c, k, padding=1)
        self.conv2 = nn.Conv2d(c, 2 * c, k, padding=1)
        self.head = nn.Linear(2 * c * (side // 2) ** 2, classes)

    def forward(self, x):  # x: (1, H, W) or (B, 1, H, W)
        h = F.max_pool2d(torch.tanh(self.conv2(torch.tanh(self.conv1(x)))), 2)
        return self.head(h.flatten(-3))


class Encoder(nn.Module):
    def __init__(self, d=8, heads=2, classes=3):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, classes)

    def forward(self, x):  # x: (T, d) or (B, T, d)
        return self.head(self.layer(x).mean(-2))


def _mlp(d, h, classes):
    return nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, h), nn.GELU(),
                         nn.Linear(h, classes))


def _loss_fn(module):
    def loss_fn(params, x, y):  # one example: x (*feature), y ()
        logits = functional_call(module, params, (x.unsqueeze(0),))[0]
        return F.cross_entropy(logits, y)

    return loss_fn


def _loop(loss_fn, params, x, y):
    out = {k: [] for k in params}
    for i in range(x.shape[0]):
        p = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        gs = torch.autograd.grad(loss_fn(p, x[i], y[i]), list(p.values()))
        for k, g in zip(p, gs):
            out[k].append(g)
    return {k: torch.stack(v) for k, v in out.items()}


def _assert_match(got, want, dtype):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].shape == want[k].shape, k
        if dtype == torch.float64:  # 1e-10 relative to the leaf's scale
            err = (got[k] - want[k]).abs().max()
            assert err <= 1e-10 * want[k].abs().max().clamp(min=1e-30), (k, err)
        else:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-4)


def _data(seed, b, feat, classes, dtype):
    g = _gen(seed)
    x = (torch.randn(b, *feat, generator=g) + 0.1).to(dtype)
    y = torch.randint(0, classes, (b,), generator=g)
    return x, y


dtypes = st.sampled_from([torch.float32, torch.float64])


@given(b=st.integers(1, 5), d=st.integers(1, 6), h=st.integers(1, 8), c=st.integers(2, 4),
       dtype=dtypes, seed=st.integers(0, 2**16))
def test_mlp_matches_loop(b, d, h, c, dtype, seed):
    module = _mlp(d, h, c).to(dtype)
    params = _params(module, dtype, seed)
    x, y = _data(seed, b, (d,), c, dtype)
    fn = _loss_fn(module)
    _assert_match(per_sample_grads(fn)(params, x, y), _loop(fn, params, x, y), dtype)


@given(b=st.integers(1, 3), side=st.sampled_from([4, 6]), ch=st.integers(1, 3), dtype=dtypes,
       seed=st.integers(0, 2**16))
def test_cnn_matches_loop(b, side, ch, dtype, seed):
    module = CNN(c=ch, side=side).to(dtype)
    params = _params(module, dtype, seed)
    x, y = _data(seed, b, (1, side, side), 4, dtype)
    fn = _loss_fn(module)
    _assert_match(per_sample_grads(fn)(params, x, y), _loop(fn, params, x, y), dtype)


# SDPA has no vmap batching rule: vmap falls back to a per-example loop (correct, warns)
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@given(b=st.integers(1, 3), t=st.integers(1, 4), dtype=dtypes, seed=st.integers(0, 2**16))
def test_transformer_encoder_matches_loop(b, t, dtype, seed):
    module = Encoder().to(dtype)
    params = _params(module, dtype, seed)
    x, y = _data(seed, b, (t, 8), 3, dtype)
    fn = _loss_fn(module)
    _assert_match(per_sample_grads(fn)(params, x, y), _loop(fn, params, x, y), dtype)


def _linear_setup(seed=0, b=7, d=5):
    g = _gen(seed)
    w = torch.randn(d, generator=g, dtype=torch.float64)
    x = torch.randn(b, d, generator=g, dtype=torch.float64)
    y = torch.randn(b, generator=g, dtype=torch.float64)
    return w, x, y


def sq_loss(w, x, y):
    return (x @ w - y) ** 2


def test_chunk_size_gives_same_grads_and_norms():
    w, x, y = _linear_setup(b=10)
    full = per_sample_grads(sq_loss)(w, x, y)
    for k in (1, 3, 10, 64):
        torch.testing.assert_close(per_sample_grads(sq_loss, chunk_size=k)(w, x, y), full,
                                   rtol=1e-12, atol=0)
        torch.testing.assert_close(per_sample_grad_norms(sq_loss, chunk_size=k)(w, x, y),
                                   full.norm(dim=1), rtol=1e-12, atol=0)


def test_closed_form_linear_regression():
    w, x, y = _linear_setup()
    want = 2 * (x @ w - y)[:, None] * x  # d/dw (x.w - y)^2
    torch.testing.assert_close(per_sample_grads(sq_loss)(w, x, y), want, rtol=1e-12, atol=0)


def test_norms_are_global_over_the_pytree():
    module = _mlp(4, 6, 3).double()
    params = _params(module, torch.float64)
    x, y = _data(1, 5, (4,), 3, torch.float64)
    fn = _loss_fn(module)
    grads = _loop(fn, params, x, y)
    want = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
    torch.testing.assert_close(per_sample_grad_norms(fn)(params, x, y), want, rtol=1e-10, atol=0)


def test_has_aux_return_value_and_argnums():
    w, x, y = _linear_setup()

    def loss_aux(w, x, y):
        r = x @ w - y
        return r**2, r

    grads, aux = per_sample_grads(loss_aux, has_aux=True)(w, x, y)
    torch.testing.assert_close(aux, x @ w - y)
    torch.testing.assert_close(grads, 2 * aux[:, None] * x)
    grads2, (loss, aux2) = per_sample_grads(loss_aux, has_aux=True, return_value=True)(w, x, y)
    torch.testing.assert_close(loss, aux**2)
    torch.testing.assert_close(grads2, grads)
    norms, aux3 = per_sample_grad_norms(loss_aux, has_aux=True)(w, x, y)
    torch.testing.assert_close(norms, grads.norm(dim=1))
    torch.testing.assert_close(aux3, aux)

    def loss2(scale, w, x, y):
        return scale * (x @ w - y) ** 2

    s = torch.tensor(1.5, dtype=torch.float64)
    gs, gw = per_sample_grads(loss2, argnums=(0, 1))(s, w, x, y)
    torch.testing.assert_close(gs, (x @ w - y) ** 2)
    torch.testing.assert_close(gw, 1.5 * grads)


def test_in_dims_shares_a_model_state():
    w, x, y = _linear_setup()
    state = {"shift": torch.tensor([0.5], dtype=torch.float64)}

    def loss_fn(w, state, x, y):  # state is shared by every example
        return (x @ w + state["shift"][0] - y) ** 2

    got = per_sample_grads(loss_fn, in_dims=(None, None, 0, 0))(w, state, x, y)
    torch.testing.assert_close(got, 2 * (x @ w + 0.5 - y)[:, None] * x)


def test_bad_arguments():
    w, x, y = _linear_setup()
    with pytest.raises(ValueError, match="chunk_size"):
        per_sample_grads(sq_loss, chunk_size=0)
    with pytest.raises(TypeError, match="argnums"):
        per_sample_grads(sq_loss, argnums=-1)
    with pytest.raises(ValueError, match="at least one batched"):
        per_sample_grads(sq_loss)(w)
    with pytest.raises(ValueError, match="argnums"):
        per_sample_grads(sq_loss, argnums=3)(w, x, y)
    with pytest.raises(ValueError, match="in_dims must have one entry"):
        per_sample_grads(sq_loss, in_dims=(None, 0))(w, x, y)
    with pytest.raises(ValueError, match=r"in_dims\[0\] must be None"):
        per_sample_grads(sq_loss, in_dims=(0, 0, 0))(w, x, y)
    with pytest.raises(ValueError):  # mismatched batch sizes (vmap's own message)
        per_sample_grads(sq_loss)(w, x, y[:3])


def test_empty_batch_gives_empty_leading_dim():
    w, x, y = _linear_setup()
    grads = per_sample_grads(sq_loss)(w, x[:0], y[:0])
    assert grads.shape == (0, 5)
    assert per_sample_grad_norms(sq_loss)(w, x[:0], y[:0]).shape == (0,)
