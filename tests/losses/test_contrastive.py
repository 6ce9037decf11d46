"""Contrastive losses against float64 loops over their papers' formulas; InfoNCE's closed
form for orthogonal embeddings; invariance to reordering the batch; a learnable
temperature gets a gradient; vmap over a leading dim equals a loop."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad, vmap

from torchfn import losses, random


def _embeddings(seed, B, D):
    a, b = random.normal(random.key(seed), (2, B, D), dtype=torch.float64)
    return a, a + 0.7 * b


def _unit(v):
    n = math.sqrt(sum(x * x for x in v))
    return [x / n for x in v]


def _cos(u, v):
    u, v = _unit(u), _unit(v)
    return sum(x * y for x, y in zip(u, v))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), B=st.integers(1, 5), D=st.integers(1, 4),
       tau=st.floats(0.05, 2.0), symmetric=st.booleans())
def test_info_nce_equals_a_loop(seed, B, D, tau, symmetric):
    x, y = _embeddings(seed, B, D)
    X, Y = x.tolist(), y.tolist()
    got = losses.info_nce(x, y, temperature=tau, symmetric=symmetric, reduction="none")
    for i in range(B):
        row = [_cos(X[i], Y[j]) / tau for j in range(B)]
        col = [_cos(X[j], Y[i]) / tau for j in range(B)]
        x_to_y = -row[i] + math.log(sum(math.exp(s) for s in row))
        y_to_x = -col[i] + math.log(sum(math.exp(s) for s in col))
        want = (x_to_y + y_to_x) / 2 if symmetric else x_to_y
        assert got[i].item() == pytest.approx(want, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(losses.info_nce(x, y, temperature=tau, symmetric=symmetric),
                               got.mean())


def test_info_nce_of_orthogonal_pairs_is_its_closed_form():
    """Matched rows equal, the rest orthogonal: ``log(1 + (B - 1) exp(-1 / tau))``."""
    B, tau = 6, 0.3
    eye = torch.eye(B, dtype=torch.float64)
    want = math.log(1 + (B - 1) * math.exp(-1 / tau))
    assert losses.info_nce(eye, 3 * eye, temperature=tau).item() == pytest.approx(want)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), B=st.integers(1, 5), tau=st.floats(0.05, 2.0),
       normalize=st.booleans())
def test_ntxent_equals_simclrs_formula(seed, B, tau, normalize):
    z1, z2 = _embeddings(seed, B, 3)
    z = torch.cat([z1, z2]).tolist()
    sim = _cos if normalize else (lambda u, v: sum(a * b for a, b in zip(u, v)))
    got = losses.ntxent(z1, z2, temperature=tau, normalize=normalize, reduction="none")

    def view_loss(k):
        partner = (k + B) % (2 * B)
        others = [math.exp(sim(z[k], z[m]) / tau) for m in range(2 * B) if m != k]
        return -sim(z[k], z[partner]) / tau + math.log(sum(others))

    for i in range(B):
        want = (view_loss(i) + view_loss(i + B)) / 2
        assert got[i].item() == pytest.approx(want, rel=1e-9, abs=1e-12)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), N=st.integers(1, 7), groups=st.integers(1, 4),
       tau=st.floats(0.05, 2.0))
def test_ntxent_with_labels_equals_optaxs_formula(seed, N, groups, tau):
    """Each ordered positive pair ``(i, j)``: ``-log(e^s_ij / (e^s_ij + sum over i's
    negatives))``, averaged over the pairs (optax's ``ntxent``, pytorch-metric-learning's
    ``NTXentLoss``); groups of any size, rows alone in theirs included."""
    z, _ = _embeddings(seed, N, 3)
    labels = random.randint(random.key(seed + 1), (N,), 0, groups)
    Z, L = z.tolist(), labels.tolist()
    got = losses.ntxent(z, labels=labels, temperature=tau, reduction="none")
    total, pairs = 0.0, 0
    for i in range(N):
        negatives = [math.exp(_cos(Z[i], Z[k]) / tau) for k in range(N) if L[k] != L[i]]
        for j in range(N):
            if j == i or L[j] != L[i]:
                assert got[i, j].item() == 0.0
                continue
            s = _cos(Z[i], Z[j]) / tau
            want = -s + math.log(math.exp(s) + sum(negatives))
            assert got[i, j].item() == pytest.approx(want, rel=1e-9, abs=1e-12)
            total, pairs = total + want, pairs + 1
    mean = losses.ntxent(z, labels=labels, temperature=tau)
    assert mean.item() == pytest.approx(total / max(pairs, 1), rel=1e-9, abs=1e-12)


def test_two_views_are_labels_pairing_them():
    z1, z2 = _embeddings(8, 5, 4)
    both = torch.cat([z1, z2])
    torch.testing.assert_close(losses.ntxent(both, labels=torch.arange(5).repeat(2)),
                               losses.ntxent(z1, z2))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), B=st.integers(1, 5), t=st.floats(0.5, 20.0),
       b=st.floats(-12.0, 2.0))
def test_siglip_equals_the_papers_formula(seed, B, t, b):
    x, y = _embeddings(seed, B, 3)
    X, Y = x.tolist(), y.tolist()

    def log_sigmoid(v):
        return -math.log1p(math.exp(-v)) if v > -30 else v

    total = 0.0
    for i in range(B):
        for j in range(B):
            z = 1.0 if i == j else -1.0
            total -= log_sigmoid(z * (t * _cos(X[i], Y[j]) + b))
    got = losses.siglip(x, y, scale=t, bias=b)
    assert got.item() == pytest.approx(total / B, rel=1e-9)
    assert losses.siglip(x, y, scale=t, bias=b, reduction="sum").item() == pytest.approx(
        total, rel=1e-9)


@pytest.mark.parametrize("loss", [losses.info_nce, losses.ntxent, losses.siglip])
def test_reordering_the_batch_leaves_the_loss_alone(loss):
    x, y = _embeddings(1, 5, 4)
    perm = torch.tensor([3, 0, 4, 1, 2])
    torch.testing.assert_close(loss(x[perm], y[perm]), loss(x, y))
    torch.testing.assert_close(loss(x[perm], y[perm], reduction="none"),
                               loss(x, y, reduction="none")[perm])
    # mismatching the pairs makes it worse
    assert loss(x, y[perm]) > loss(x, y)


def test_a_learnable_temperature_gets_the_analytic_gradient():
    """CLIP learns ``s = log(1 / tau)``: ``d loss / d s`` is the expected similarity under
    the softmax minus the matched one, averaged over the rows (and columns)."""
    x, y = _embeddings(2, 4, 3)
    s0 = torch.tensor(1.2, dtype=torch.float64)
    g = grad(lambda s: losses.info_nce(x, y, temperature=1 / s.exp(), symmetric=False))(s0)
    sims = torch.nn.functional.normalize(x, dim=-1) @ torch.nn.functional.normalize(
        y, dim=-1).T
    p = (s0.exp() * sims).softmax(-1)
    want = (s0.exp() * ((p * sims).sum(-1) - sims.diagonal())).mean()
    torch.testing.assert_close(g, want)


@pytest.mark.parametrize("loss", [losses.info_nce, losses.ntxent, losses.siglip])
def test_vmap_over_groups_equals_a_loop(loss):
    x, y = random.normal(random.key(6), (2, 3, 4, 5), dtype=torch.float64)  # (G, B, D)
    got = vmap(loss)(x, y)
    for g in range(3):
        torch.testing.assert_close(got[g], loss(x[g], y[g]))


@pytest.mark.parametrize("call, match", [
    (lambda x: losses.info_nce(x[0], x[0]), r"x must have shape \(B, D\)"),
    (lambda x: losses.info_nce(x, x[:2]), r"y must have x's shape \(3, 4\), got \(2, 4\)"),
    (lambda x: losses.ntxent(x, x.long()), "z2 must be a floating-point Tensor"),
    (lambda x: losses.info_nce(x, x, temperature=0.0), "temperature must be a positive"),
    (lambda x: losses.info_nce(x, x, temperature=torch.ones(2)), "temperature must be a "
     "float or a 0-d tensor"),
    (lambda x: losses.siglip(x, x, bias=torch.zeros(3)), "bias must be a float or a 0-d"),
    (lambda x: losses.siglip(x, x, scale=-1.0), "scale must be a positive float"),
    (lambda x: losses.ntxent(x, x, reduction="mean_pairs"), "reduction must be one of"),
    (lambda x: losses.ntxent(x), "exactly one of them; got neither"),
    (lambda x: losses.ntxent(x, x, labels=torch.arange(3)), "got both"),
    (lambda x: losses.ntxent(x, labels=torch.ones(3)), r"labels must be an integer tensor "
     r"of shape \(3,\)"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(random.normal(random.key(0), (3, 4)))
