"""Preference losses: token and sequence log-probabilities against a float64 loop; DPO's
variants against their formulas; DPO's minimiser is the closed form ``pi_ref exp(r /
beta)`` under Bradley-Terry preferences; robust DPO is unbiased under label flips;
SimPO is DPO without a reference; KTO and ORPO against their formulas."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from torchfn import losses, optim, random


def test_token_and_sequence_log_probs_equal_a_loop():
    logits = random.normal(random.key(0), (3, 5, 7), dtype=torch.float64)
    targets = random.randint(random.key(1), (3, 5), 0, 7)
    mask = random.bernoulli(random.key(2), 0.6, (3, 5))
    got = losses.token_log_probs(logits, targets)
    for b in range(3):
        for n in range(5):
            want = F.log_softmax(logits[b, n], -1)[targets[b, n]]
            torch.testing.assert_close(got[b, n], want, rtol=1e-12, atol=1e-12)
    total = losses.sequence_log_probs(logits, targets, mask)
    mean = losses.sequence_log_probs(logits, targets, mask, average=True)
    for b in range(3):
        picked = [got[b, n] for n in range(5) if mask[b, n]]
        torch.testing.assert_close(total[b], sum(picked, torch.tensor(0.0, dtype=torch.float64)))
        torch.testing.assert_close(mean[b], total[b] / max(len(picked), 1))
    torch.testing.assert_close(losses.sequence_log_probs(logits, targets), got.sum(-1))
    # bf16 logits are taken in float32
    assert losses.token_log_probs(logits.bfloat16(), targets).dtype == torch.float32


def _dpo_formula(kind, z, beta, e):
    s = lambda x: -math.log1p(math.exp(-x)) if x > -30 else x  # noqa: E731 (log sigmoid)
    if kind == "sigmoid":
        return -(1 - e) * s(beta * z) - e * s(-beta * z)
    if kind == "robust":
        return (-(1 - e) * s(beta * z) + e * s(-beta * z)) / (1 - 2 * e)
    if kind == "hinge":
        return max(0.0, 1 - beta * z)
    return (z - 1 / (2 * beta)) ** 2


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["sigmoid", "robust", "hinge", "ipo"]),
       beta=st.floats(0.05, 3.0), smooth=st.floats(0.0, 0.45), seed=st.integers(0, 10**6))
def test_dpo_kinds_equal_their_formulas(kind, beta, smooth, seed):
    e = smooth if kind in ("sigmoid", "robust") else 0.0
    c, r, rc, rr = 2 * random.normal(random.key(seed), (4, 6), dtype=torch.float64)
    got = losses.dpo(c, r, rc, rr, beta=beta, kind=kind, label_smoothing=e, reduction="none")
    for i in range(6):
        z = float((c[i] - rc[i]) - (r[i] - rr[i]))
        assert got[i].item() == pytest.approx(_dpo_formula(kind, z, beta, e), rel=1e-9,
                                              abs=1e-12)
    torch.testing.assert_close(losses.dpo(c, r, rc, rr, beta=beta, kind=kind,
                                          label_smoothing=e), got.mean())


def test_dpo_gradient_is_the_papers():
    """``d loss / d chosen = -beta sigmoid(-beta z)`` and ``d / d rejected`` its negative
    (Rafailov et al., section 4): the pair is pushed by how wrong the implicit reward is."""
    c, r, rc, rr = random.normal(random.key(3), (4, 5), dtype=torch.float64)
    c.requires_grad_(True)
    r.requires_grad_(True)
    gc, gr = torch.autograd.grad(losses.dpo(c, r, rc, rr, beta=0.5, reduction="sum"), (c, r))
    z = ((c - rc) - (r - rr)).detach()
    torch.testing.assert_close(gc, -0.5 * torch.sigmoid(-0.5 * z))
    torch.testing.assert_close(gr, 0.5 * torch.sigmoid(-0.5 * z))


def test_robust_dpo_is_unbiased_under_label_flips():
    """Each label flipped with probability e: the expected robust loss is clean DPO's."""
    c, r, rc, rr = random.normal(random.key(4), (4, 8), dtype=torch.float64)
    for e in (0.1, 0.3, 0.45):
        kept = losses.dpo(c, r, rc, rr, kind="robust", label_smoothing=e, reduction="none")
        flipped = losses.dpo(r, c, rr, rc, kind="robust", label_smoothing=e, reduction="none")
        torch.testing.assert_close((1 - e) * kept + e * flipped,
                                   losses.dpo(c, r, rc, rr, reduction="none"))
    torch.testing.assert_close(losses.dpo(c, r, rc, rr, kind="robust"), losses.dpo(c, r, rc, rr))


def test_dpo_minimiser_is_the_closed_form_policy():
    """A one-step policy over 5 answers, preferences drawn from Bradley-Terry with rewards
    ``r``: the expected DPO loss over every pair is minimised by ``pi_ref exp(r / beta)``,
    normalised (the RLHF objective's optimum, which DPO reparameterises)."""
    beta = 0.5
    reward = torch.tensor([1.0, 0.3, -0.5, 0.0, 0.8], dtype=torch.float64)
    ref = torch.log_softmax(torch.tensor([0.2, -0.1, 0.5, 0.0, -0.4], dtype=torch.float64), 0)
    i, j = torch.triu_indices(5, 5, 1)  # each unordered pair, both orders weighted by BT
    p_ij = torch.sigmoid(reward[i] - reward[j])

    def expected_loss(params):
        logp = torch.log_softmax(params["theta"], 0)
        forward = losses.dpo(logp[i], logp[j], ref[i], ref[j], beta=beta, reduction="none")
        backward = losses.dpo(logp[j], logp[i], ref[j], ref[i], beta=beta, reduction="none")
        return (p_ij * forward + (1 - p_ij) * backward).mean()

    params = {"theta": torch.zeros(5, dtype=torch.float64)}
    opt = optim.lbfgs()
    state = opt.init(params)
    for _ in range(50):
        grad, value = torch.func.grad_and_value(expected_loss)(params)
        updates, state = opt.update(grad, state, params, value=value, grad=grad,
                                    value_fn=expected_loss)
        params = optim.apply_updates(params, updates)
    want = torch.softmax(ref + reward / beta, 0)
    torch.testing.assert_close(torch.softmax(params["theta"], 0), want, rtol=1e-6, atol=1e-8)


def test_ipo_and_hinge_stop_at_their_margins():
    c = torch.tensor([0.0, 1.0], dtype=torch.float64, requires_grad=True)
    zero = torch.zeros(2, dtype=torch.float64)
    beta = 0.25  # IPO's target margin 1 / (2 beta) = 2; the hinge's 1 / beta = 4
    at = torch.tensor([2.0, 4.0], dtype=torch.float64)
    ipo = losses.dpo(at[:1], zero[:1], zero[:1], zero[:1], beta=beta, kind="ipo")
    hinge = losses.dpo(at[1:], zero[:1], zero[:1], zero[:1], beta=beta, kind="hinge")
    assert ipo.item() == 0.0 and hinge.item() == 0.0
    grad, = torch.autograd.grad(losses.dpo(c, zero, zero, zero, beta=beta, kind="ipo"), c)
    assert (grad < 0).all()  # below the target margin: pushed up


def test_simpo_is_dpo_without_a_reference_and_a_margin():
    c, r = random.normal(random.key(5), (2, 6), dtype=torch.float64)
    zero = torch.zeros(6, dtype=torch.float64)
    torch.testing.assert_close(losses.simpo(c, r, beta=2.0, gamma=0.0),
                               losses.dpo(c, r, zero, zero, beta=2.0))
    want = -F.logsigmoid(2.0 * (c - r) - 1.0)
    torch.testing.assert_close(losses.simpo(c, r, beta=2.0, gamma=1.0, reduction="none"), want)
    smooth = losses.simpo(c, r, beta=2.0, gamma=1.0, label_smoothing=0.2, reduction="none")
    torch.testing.assert_close(smooth, 0.8 * want + 0.2 * -F.logsigmoid(-(2.0 * (c - r) - 1.0)))


def test_a_language_models_dpo_step_under_vmap_equals_the_batch():
    """The usual wiring: sequence log-probs of chosen and rejected completions from a
    pure model, the reference's detached; per-pair gradients by ``vmap(grad)`` sum to the
    batch gradient."""
    import torchfn
    from torchfn.models import TransformerEncoder

    model = torchfn.Model(TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=9,
                                             out_dim=9, causal=True).double())
    params = model.init(random.key(0))
    ref = {n: t.clone() for n, t in params.items()}
    chosen = random.randint(random.key(1), (4, 6), 0, 9)
    rejected = random.randint(random.key(2), (4, 6), 0, 9)
    completion = torch.arange(6) >= 3  # tokens 3.. are the answer

    def logp(p, seqs):  # (B, N) -> (B,)
        return losses.sequence_log_probs(model.apply(p, seqs)[:, :-1], seqs[:, 1:],
                                         completion[1:].expand(len(seqs), -1))

    def loss(p, c, r):
        return losses.dpo(logp(p, c), logp(p, r), logp(ref, c).detach(),
                          logp(ref, r).detach(), beta=0.1, reduction="sum")

    batch = torch.func.grad(loss)(params, chosen, rejected)
    per = torch.func.vmap(torch.func.grad(lambda p, c, r: loss(p, c[None], r[None])),
                          in_dims=(None, 0, 0))(params, chosen, rejected)
    for name in params:
        torch.testing.assert_close(per[name].sum(0), batch[name], rtol=1e-9, atol=1e-12)
    assert batch["head.weight"].abs().max() > 0


def test_kto_equals_its_formula_and_takes_the_reference_point_as_a_constant():
    logps, ref = random.normal(random.key(6), (2, 8), dtype=torch.float64)
    good = random.bernoulli(random.key(7), 0.5, (8,))
    assert good.any() and not good.all()
    kl = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    got = losses.kto(logps, ref, good, beta=0.5, kl=kl, desirable_weight=1.2,
                     undesirable_weight=0.8, reduction="none")
    for i in range(8):
        r = float(logps[i] - ref[i])
        want = 1.2 * (1 - 1 / (1 + math.exp(-0.5 * (r - 0.3)))) if good[i] else \
            0.8 * (1 - 1 / (1 + math.exp(-0.5 * (0.3 - r))))
        assert got[i].item() == pytest.approx(want, rel=1e-12)
    assert not got.requires_grad  # kl is detached; the log-probs here are constants
    logps.requires_grad_(True)
    g, = torch.autograd.grad(losses.kto(logps, ref, good, kl=kl, reduction="sum"), logps)
    assert (g[good] < 0).all() and (g[~good] > 0).all()  # desirable up, undesirable down


def test_orpo_is_sft_plus_the_log_odds_ratio():
    chosen, rejected = -random.uniform(random.key(8), (2, 6), dtype=torch.float64) * 3 - 0.01
    got = losses.orpo(chosen, rejected, beta=0.25, reduction="none")
    for i in range(6):
        pc, pr = math.exp(chosen[i]), math.exp(rejected[i])
        log_odds = math.log(pc / (1 - pc)) - math.log(pr / (1 - pr))
        want = -float(chosen[i]) + 0.25 * math.log1p(math.exp(-log_odds))
        assert got[i].item() == pytest.approx(want, rel=1e-10)
    c, r = chosen.clone().requires_grad_(True), rejected.clone().requires_grad_(True)
    gc, gr = torch.autograd.grad(losses.orpo(c, r, reduction="sum"), (c, r))
    assert (gc < 0).all() and (gr > 0).all()


def test_bradley_terry_fits_the_rewards_that_made_the_preferences():
    """A linear reward model fit by the expected Bradley-Terry loss over every pair of 6
    answers, each pair labelled by BT itself from true rewards: it recovers the true
    rewards up to a constant, and the centring term picks the constant (mean 0)."""
    true = torch.tensor([1.0, -0.5, 0.3, 2.0, -1.2, 0.0], dtype=torch.float64)
    i, j = torch.triu_indices(6, 6, 1)
    p_ij = torch.sigmoid(true[i] - true[j])

    def expected_loss(params, center):
        r = params["r"]
        forward = losses.bradley_terry(r[i], r[j], center=center, reduction="none")
        backward = losses.bradley_terry(r[j], r[i], center=center, reduction="none")
        return (p_ij * forward + (1 - p_ij) * backward).mean()

    for center in (0.0, 1e-4):
        params = {"r": torch.full((6,), 3.0, dtype=torch.float64)}  # off-centre
        opt = optim.lbfgs()
        state = opt.init(params)
        f = lambda p, c=center: expected_loss(p, c)  # noqa: E731
        for _ in range(60):
            grad, value = torch.func.grad_and_value(f)(params)
            updates, state = opt.update(grad, state, params, value=value, grad=grad,
                                        value_fn=f)
            params = optim.apply_updates(params, updates)
        r = params["r"]
        tol = 1e-6 if center == 0 else 5e-3  # the centring term moves the optimum a little
        torch.testing.assert_close(r - r.mean(), true - true.mean(), rtol=0, atol=tol)
        # the pairwise loss leaves the mean where it started; the centring term moves it
        assert abs(r.mean().item() - (0.0 if center else 3.0)) < 1e-3
    got = losses.bradley_terry(true[:3], true[3:], margin=torch.tensor([0.5, 0.0, 1.0],
                                                                       dtype=torch.float64),
                               reduction="none")
    torch.testing.assert_close(got, -F.logsigmoid(true[:3] - true[3:] -
                                                  torch.tensor([0.5, 0.0, 1.0],
                                                               dtype=torch.float64)))


def test_errors_are_named():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="kind must be one of"):
        losses.dpo(x, x, x, x, kind="kto")
    with pytest.raises(ValueError, match="beta must be a number > 0"):
        losses.dpo(x, x, x, x, beta=0)
    with pytest.raises(ValueError, match="label_smoothing must be a number in \\[0, 0.5\\)"):
        losses.dpo(x, x, x, x, kind="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="label_smoothing goes with kind 'sigmoid' or 'robust'"):
        losses.dpo(x, x, x, x, kind="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="must share one shape"):
        losses.dpo(x, x, x, torch.zeros(4))
    with pytest.raises(TypeError, match="ref_rejected must be a floating-point Tensor"):
        losses.dpo(x, x, x, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="kto: desirable must be a bool tensor"):
        losses.kto(x, x, torch.ones(3))
    with pytest.raises(ValueError, match="kl must be a number or a scalar tensor"):
        losses.kto(x, x, torch.ones(3, dtype=torch.bool), kl=torch.zeros(2))
    with pytest.raises(ValueError, match="undesirable_weight must be a number > 0"):
        losses.kto(x, x, torch.ones(3, dtype=torch.bool), undesirable_weight=0)
    with pytest.raises(ValueError, match="orpo: the log-probabilities must share one shape"):
        losses.orpo(x, torch.zeros(2))
    with pytest.raises(ValueError, match="margin must be a number or \\(B,\\) = \\(3,\\)"):
        losses.bradley_terry(x, x, margin=torch.zeros(2))
    with pytest.raises(ValueError, match="center must be a number >= 0"):
        losses.bradley_terry(x, x, center=-1.0)
    with pytest.raises(ValueError, match="gamma must be a number >= 0"):
        losses.simpo(x, x, gamma=-1.0)
    with pytest.raises(ValueError, match="targets must be int \\(..., N\\) = \\(2, 3\\)"):
        losses.token_log_probs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="mask must be \\(..., N\\) = \\(2, 3\\)"):
        losses.sequence_log_probs(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long),
                                  torch.ones(2, 2, dtype=torch.bool))
