"""``rotary_embedding`` against the complex-number form of RoPE, and its relative-position
property."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchfn import random
from torchfn.models import rotary_embedding


def complex_rope(x: torch.Tensor, positions: torch.Tensor, base: float, rot: int) -> torch.Tensor:
    """RoPE as the paper writes it: each pair (x_2i, x_2i+1) is a complex number multiplied
    by exp(i m theta_i), theta_i = base^(-2i / rot); float64 throughout."""
    theta = base ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)  # (rot/2,)
    pos = positions.double()
    if pos.dim() > 1:
        pos = pos[:, None]  # (B, 1, N)
    z = torch.view_as_complex(x[..., :rot].double().reshape(*x.shape[:-1], rot // 2, 2))
    z = z * torch.polar(torch.ones_like(pos[..., None] * theta), pos[..., None] * theta)
    return torch.cat((torch.view_as_real(z).flatten(-2), x[..., rot:].double()), dim=-1)


shapes = st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 9),
                   st.sampled_from([2, 4, 6, 8, 16]))


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**20), base=st.sampled_from([100.0, 1e4, 5e5]),
       offset=st.integers(0, 5000), per_row=st.booleans(), partial=st.booleans())
def test_interleaved_equals_complex_multiplication(shape, seed, base, offset, per_row, partial):
    b, h, n, d = shape
    rot = max(2, d // 2 // 2 * 2) if partial else d
    x = random.normal(random.key(seed), shape, torch.float64)
    if per_row:
        positions = random.randint(random.key(seed + 1), (b, n), 0, 8000)
    else:
        positions = torch.arange(offset, offset + n)
    out = rotary_embedding(x, positions, base=base, rotary_dim=rot, interleaved=True)
    torch.testing.assert_close(out, complex_rope(x, positions, base, rot), rtol=0, atol=1e-12)


@settings(max_examples=20, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**20))
def test_half_convention_is_the_interleaved_one_on_permuted_features(shape, seed):
    """GPT-NeoX pairs (i, i + D/2); GPT-J pairs (2i, 2i + 1): the same rotation after the
    permutation that moves one layout to the other."""
    d = shape[-1]
    x = random.normal(random.key(seed), shape, torch.float64)
    positions = torch.arange(shape[2]) * 37
    perm = torch.stack((torch.arange(d // 2), torch.arange(d // 2) + d // 2), -1).flatten()
    half = rotary_embedding(x, positions)
    inter = rotary_embedding(x[..., perm], positions, interleaved=True)
    torch.testing.assert_close(half[..., perm], inter, rtol=0, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**20), shift=st.integers(-300, 3000), n=st.integers(1, 8),
       interleaved=st.booleans())
def test_scores_depend_only_on_relative_position(seed, shift, n, interleaved):
    q = random.normal(random.key(seed), (2, 3, n, 8), torch.float64)
    k = random.normal(random.key(seed + 1), (2, 3, n, 8), torch.float64)
    pos = torch.arange(n) + 300

    def scores(p):
        rq = rotary_embedding(q, p, interleaved=interleaved)
        return rq @ rotary_embedding(k, p, interleaved=interleaved).mT  # (B, H, N, N)

    torch.testing.assert_close(scores(pos + shift), scores(pos), rtol=0, atol=1e-10)
    # the rotation keeps each vector's norm, and position 0 is the identity
    torch.testing.assert_close(rotary_embedding(q, pos).norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(rotary_embedding(q, torch.zeros(n)), q, rtol=0, atol=0)


def test_partial_rotary_leaves_the_other_features_and_low_precision_is_close():
    x = random.normal(random.key(0), (2, 4, 64, 32))
    pos = torch.arange(4000, 4064)
    out = rotary_embedding(x, pos, rotary_dim=8)
    assert torch.equal(out[..., 8:], x[..., 8:])
    torch.testing.assert_close(out[..., :8], rotary_embedding(x[..., :8], pos))
    exact = rotary_embedding(x.double(), pos)
    scale = x.abs().max().item()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        low = rotary_embedding(x.to(dtype), pos)
        assert low.dtype == dtype
        # float64 angles at position 4000: only the input's and output's rounding is left,
        # where float32 angles would be off by ~2e-4 rad
        err = (low.double() - rotary_embedding(x.to(dtype).double(), pos)).abs().max().item()
        assert err <= 4 * torch.finfo(dtype).eps * scale, (dtype, err)
    assert (rotary_embedding(x, pos).double() - exact).abs().max().item() < 1e-5


def test_per_row_positions_equal_one_row_at_a_time_and_compose_with_transforms():
    x = random.normal(random.key(1), (3, 2, 5, 8))
    pos = random.randint(random.key(2), (3, 5), 0, 100)
    out = rotary_embedding(x, pos)
    for i in range(3):
        torch.testing.assert_close(out[i:i + 1], rotary_embedding(x[i:i + 1], pos[i]))
    per = torch.vmap(rotary_embedding)(x, pos)  # one example (H, N, D) with (N,) positions
    torch.testing.assert_close(per, out)
    # linear in x: its jvp is itself applied to the tangent
    t = random.normal(random.key(3), x.shape)
    _, tangent = torch.func.jvp(lambda y: rotary_embedding(y, pos), (x,), (t,))
    torch.testing.assert_close(tangent, rotary_embedding(t, pos))


@pytest.mark.parametrize("args, kw, match", [
    ((torch.zeros(2, 3, 4, 5), torch.arange(4)), {}, r"rotary_dim must be an even int in 2..D = 5"),
    ((torch.zeros(2, 3, 4, 8), torch.arange(4)), {"rotary_dim": 10}, r"rotary_dim .* got 10"),
    ((torch.zeros(2, 3, 4, 8), torch.arange(5)), {},
     r"positions must have shape \(4,\) or \(2, 4\)"),
    ((torch.zeros(2, 3, 4, 8), torch.arange(4)), {"base": 0.0}, r"base must be a number > 0"),
    ((torch.zeros(2, 3, 4, 8, dtype=torch.long), torch.arange(4)), {}, r"x must be a float"),
])
def test_bad_input_is_named(args, kw, match):
    with pytest.raises(ValueError, match=match):
        rotary_embedding(*args, **kw)
    with pytest.raises(TypeError, match="positions must be an int or float tensor"):
        rotary_embedding(torch.zeros(1, 2, 3, 4), torch.ones(3, dtype=torch.bool))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_eager_buffer_path_equals_the_differentiable_path(interleaved, rotary_dim, dtype):
    """Without anything to differentiate, the rotation is written into one buffer (out=
    ops); with grad it runs in functional ops. Both give the same rotation."""
    x = random.normal(random.key(4), (2, 3, 7, 10), dtype)
    pos = random.randint(random.key(5), (2, 7), 0, 3000)
    kw = dict(rotary_dim=rotary_dim, interleaved=interleaved)
    fast = rotary_embedding(x, pos, **kw)
    traced = rotary_embedding(x.clone().requires_grad_(), pos, **kw).detach()
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    torch.testing.assert_close(fast, traced, rtol=0, atol=tol)
