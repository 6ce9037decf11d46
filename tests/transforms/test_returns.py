"""Returns and advantages: ``discounted_returns``, ``gae`` and ``vtrace`` against the
backward loop in float64 (episodes ending inside the trajectory); GAE at lambda 1 is the
discounted return minus the values, at lambda 0 the TD error; on-policy V-trace is GAE;
batched dims and ``vmap`` agree."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchfn import random
from torchfn.transforms import discounted_returns, gae, vtrace


def loop_returns(r, d, boot):
    out, g = [], boot
    for t in reversed(range(len(r))):
        g = r[t] + d[t] * g
        out.append(g)
    return torch.stack(out[::-1])


def loop_gae(r, v, d, boot, lam):
    out, a = [], torch.zeros((), dtype=r.dtype)
    nxt = torch.cat((v[1:], boot[None]))
    for t in reversed(range(len(r))):
        a = r[t] + d[t] * nxt[t] - v[t] + d[t] * lam * a
        out.append(a)
    return torch.stack(out[::-1])


def trajectory(seed, shape):
    k = random.split(random.key(seed), 4)
    r = random.normal(k[0], shape, dtype=torch.float64)
    v = random.normal(k[1], shape, dtype=torch.float64)
    done = random.bernoulli(k[2], 0.2, shape)  # episodes end inside the trajectory
    d = torch.where(done, 0.0, 0.97).to(torch.float64)
    boot = random.normal(k[3], shape[:-1], dtype=torch.float64)
    return r, v, d, boot


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 40), lam=st.floats(0.0, 1.0), seed=st.integers(0, 10**6))
def test_gae_and_returns_equal_the_backward_loop(t, lam, seed):
    r, v, d, boot = trajectory(seed, (3, t))
    adv = gae(r, v, d, boot, lam=lam)
    ret = discounted_returns(r, d, boot)
    for b in range(3):
        torch.testing.assert_close(adv[b], loop_gae(r[b], v[b], d[b], boot[b], lam),
                                   rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(ret[b], loop_returns(r[b], d[b], boot[b]),
                                   rtol=1e-10, atol=1e-10)


def test_lambda_one_is_the_return_and_zero_the_td_error():
    r, v, d, boot = trajectory(1, (2, 17))
    torch.testing.assert_close(gae(r, v, d, boot, lam=1.0),
                               discounted_returns(r, d, boot) - v)
    nxt = torch.cat((v[:, 1:], boot[:, None]), 1)
    torch.testing.assert_close(gae(r, v, d, boot, lam=0.0), r + d * nxt - v)


def test_vmap_equals_the_batch_and_a_number_bootstraps_every_row():
    r, v, d, boot = trajectory(2, (4, 2, 9))
    batched = gae(r, v, d, boot, lam=0.9)
    mapped = torch.vmap(lambda r, v, d, b: gae(r, v, d, b, lam=0.9))(r, v, d, boot)
    torch.testing.assert_close(mapped, batched)
    torch.testing.assert_close(discounted_returns(r, d, 2.0),
                               discounted_returns(r, d, torch.full((4, 2), 2.0,
                                                                   dtype=torch.float64)))


def loop_vtrace(log_rhos, r, v, d, boot, lam, clip_rho, clip_c, clip_pg):
    """IMPALA's recursion written step by step, as the paper's Remark 1."""
    rho = log_rhos.exp()
    t_len = len(r)
    nxt = torch.cat((v[1:], boot[None]))
    vs = torch.empty_like(v)
    acc = torch.zeros((), dtype=v.dtype)  # vs[t + 1] - V[t + 1]
    for t in reversed(range(t_len)):
        delta = min(clip_rho, rho[t]) * (r[t] + d[t] * nxt[t] - v[t])
        acc = delta + d[t] * lam * min(clip_c, rho[t]) * acc
        vs[t] = v[t] + acc
    vs_next = torch.cat((vs[1:], boot[None]))
    adv = torch.stack([min(clip_pg, rho[t]) * (r[t] + d[t] * vs_next[t] - v[t])
                       for t in range(t_len)])
    return vs, adv


@settings(max_examples=20, deadline=None)
@given(t=st.integers(1, 30), lam=st.floats(0.0, 1.0), clip=st.floats(0.5, 2.0),
       seed=st.integers(0, 10**6))
def test_vtrace_equals_the_loop_and_is_gae_on_policy(t, lam, clip, seed):
    r, v, d, boot = trajectory(seed, (2, t))
    log_rhos = 0.7 * random.normal(random.key(seed + 1), (2, t), dtype=torch.float64)
    vs, adv = vtrace(log_rhos, r, v, d, boot, clip_rho=clip, clip_c=1.0, clip_pg_rho=clip,
                     lam=lam)
    for b in range(2):
        want_vs, want_adv = loop_vtrace(log_rhos[b], r[b], v[b], d[b], boot[b], lam, clip,
                                        1.0, clip)
        torch.testing.assert_close(vs[b], want_vs, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(adv[b], want_adv, rtol=1e-10, atol=1e-10)
    on_vs, on_adv = vtrace(torch.zeros_like(r), r, v, d, boot, lam=lam)
    torch.testing.assert_close(on_vs - v, gae(r, v, d, boot, lam=lam))
    if lam == 1.0:
        torch.testing.assert_close(on_adv, discounted_returns(r, d, boot) - v)


def test_errors_are_named():
    x = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="lam must be a number in \\[0, 1\\]"):
        gae(x, x, x, lam=1.5)
    with pytest.raises(ValueError, match="must share one shape"):
        gae(x, torch.zeros(2, 4), x)
    with pytest.raises(TypeError, match="rewards must be a floating-point tensor"):
        discounted_returns(torch.zeros(5, dtype=torch.long), torch.zeros(5))
    with pytest.raises(ValueError, match="clip_c must be a number > 0"):
        vtrace(x, x, x, x, clip_c=0)
    with pytest.raises(ValueError, match="bootstrap must be a number or \\(...\\) = \\(2,\\)"):
        discounted_returns(x, x, torch.zeros(3))
