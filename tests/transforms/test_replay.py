"""Replay buffer: pure state, keyed sampling, re-initialisation rate, push/sample round trip."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchfn import random
from torchfn.transforms import ReplayBuffer, replay_init, replay_push, replay_sample

FRESH = 100.0  # init_fn's fill value: a fresh sample is recognisable


def init_fn(key, n):
    return random.uniform(key, (n, 2), minval=-1.0, maxval=1.0)


def marked_init(key, n):
    return torch.full((n, 2), FRESH)


def test_init_shape_and_keys():
    buf = replay_init(random.key(0), 50, init_fn)
    assert isinstance(buf, ReplayBuffer) and buf.capacity == 50 and buf.data.shape == (50, 2)
    assert torch.equal(buf.data, replay_init(random.key(0), 50, init_fn).data)
    assert not torch.equal(buf.data, replay_init(random.key(1), 50, init_fn).data)


@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 40), p=st.sampled_from([0.0, 0.3]))
def test_sample_push_roundtrip_and_purity(seed, batch, p):
    buf = replay_init(random.key(seed), 40, init_fn)
    before = buf.data.clone()
    x, idx = replay_sample(buf, random.key(seed + 1), batch, init_fn=marked_init, reinit_prob=p)
    assert x.shape == (batch, 2) and idx.shape == (batch,) and idx.dtype == torch.int64
    assert idx.unique().numel() == batch and 0 <= idx.min() and idx.max() < 40
    fresh = (x == FRESH).all(1)
    torch.testing.assert_close(x[~fresh], buf.data[idx[~fresh]], rtol=0, atol=0)
    if p == 0.0:
        assert not fresh.any()
    x = x + 1.0  # "continue the chains"
    new = replay_push(buf, x, idx)
    assert torch.equal(buf.data, before)  # the input buffer is unchanged
    assert torch.equal(new.data[idx], x)
    keep = torch.ones(40, dtype=torch.bool)
    keep[idx] = False
    assert torch.equal(new.data[keep], before[keep])
    # same key -> same draw
    y, jdx = replay_sample(buf, random.key(seed + 1), batch, init_fn=marked_init, reinit_prob=p)
    assert torch.equal(jdx, idx) and torch.equal(y + 1.0, x)


def test_reinit_fraction_is_five_percent():
    buf = replay_init(random.key(0), 10_000, init_fn)
    x, _ = replay_sample(buf, random.key(1), 10_000, init_fn=marked_init)  # default 0.05
    frac = (x == FRESH).all(1).double().mean().item()
    sd = math.sqrt(0.05 * 0.95 / 10_000)
    assert abs(frac - 0.05) < 4 * sd, frac


def test_index_draw_is_uniform():
    buf = ReplayBuffer(torch.arange(10.0)[:, None])
    counts = torch.zeros(10)
    for i in range(200):
        _, idx = replay_sample(buf, random.key(i), 3, init_fn=init_fn, reinit_prob=0.0)
        counts += torch.bincount(idx, minlength=10)
    # 600 draws over 10 slots: each ~ Binomial(600, 0.1), sd 7.3
    assert (counts - 60).abs().max() < 30, counts


def test_bad_input():
    buf = replay_init(random.key(0), 8, init_fn)
    with pytest.raises(ValueError, match="capacity must be an int >= 1, got 0"):
        replay_init(random.key(0), 0, init_fn)
    with pytest.raises(
        ValueError, match=r"init_fn\(key, n\) must return a Tensor of shape \(n, ...\)"
    ):
        replay_init(random.key(0), 8, lambda k, n: torch.zeros(n + 1, 2))
    with pytest.raises(
        ValueError, match=r"batch_size must lie in \[1, capacity\] = \[1, 8\], got 9"
    ):
        replay_sample(buf, random.key(1), 9, init_fn=init_fn)
    with pytest.raises(ValueError, match="reinit_prob must lie in"):
        replay_sample(buf, random.key(1), 4, init_fn=init_fn, reinit_prob=1.5)
    with pytest.raises(ValueError, match="must return samples like the buffer's"):
        replay_sample(
            buf, random.key(1), 4, init_fn=lambda k, n: torch.zeros(n, 3), reinit_prob=0.5
        )
    with pytest.raises(ValueError, match=r"indices must lie in \[0, capacity-1\] = \[0, 7\]"):
        replay_push(buf, torch.zeros(2, 2), torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="indices must be distinct"):
        replay_push(buf, torch.zeros(2, 2), torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="samples must have shape"):
        replay_push(buf, torch.zeros(2, 3), torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="buffer must be a ReplayBuffer"):
        replay_push(buf.data, torch.zeros(2, 2), torch.tensor([0, 1]))
