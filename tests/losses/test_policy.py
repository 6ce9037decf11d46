"""GRPO: the per-token clipped surrogate and its three normalisations against a float64
loop; on fresh samples its gradient is the policy gradient; the clip stops the gradient
where the ratio left its range in the advantage's direction; the KL term's expectation
under the policy is the exact KL; group advantages are centred (and scaled)."""

from __future__ import annotations

import pytest
import torch

from torchfn import losses, random


def _loop(logps, old, ref, adv, mask, beta, lo, hi, normalize, max_length):
    """The same loss token by token, in Python floats."""
    import math

    b, n = logps.shape
    per, count = [], 0
    for i in range(b):
        row = []
        for t in range(n):
            if not mask[i, t]:
                continue
            rho = math.exp(logps[i, t] - old[i, t])
            a = float(adv[i])
            value = -min(rho * a, min(max(rho, 1 - lo), 1 + hi) * a)
            if beta:
                d = float(ref[i, t] - logps[i, t])
                value += beta * (math.exp(d) - d - 1)
            row.append(value)
        per.append(row)
        count += len(row)
    if normalize == "grpo":
        return sum(sum(r) / max(len(r), 1) for r in per) / b
    if normalize == "dapo":
        return sum(sum(r) for r in per) / max(count, 1)
    return sum(sum(r) for r in per) / (b * (max_length or n))


@pytest.mark.parametrize("normalize, max_length", [("grpo", None), ("dapo", None),
                                                   ("dr_grpo", None), ("dr_grpo", 12)])
@pytest.mark.parametrize("beta, high", [(0.0, None), (0.04, 0.28)])
def test_grpo_equals_a_loop(normalize, max_length, beta, high):
    keys = random.split(random.key(0), 5)
    logps = -random.uniform(keys[0], (6, 7), dtype=torch.float64) * 3
    old = logps + 0.4 * random.normal(keys[1], (6, 7), dtype=torch.float64)  # ratios 0.4..2.5
    ref = logps + 0.3 * random.normal(keys[2], (6, 7), dtype=torch.float64)
    adv = random.normal(keys[3], (6,), dtype=torch.float64)
    mask = random.bernoulli(keys[4], 0.7, (6, 7))
    mask[0] = False  # an empty completion counts as 0
    got = losses.grpo(logps, adv, mask, old_logps=old, ref_logps=ref, beta=beta,
                      epsilon=0.2, epsilon_high=high, normalize=normalize,
                      max_length=max_length)
    want = _loop(logps, old, ref, adv, mask, beta, 0.2, 0.2 if high is None else high,
                 normalize, max_length)
    assert got.item() == pytest.approx(want, rel=1e-12)


def test_on_fresh_samples_the_gradient_is_the_policy_gradient():
    """``old_logps=None``: ``d loss / d logp = (-A + beta (1 - exp(ref - logp))) / (len *
    B)`` on each completion's tokens, 0 elsewhere."""
    logps = -random.uniform(random.key(1), (4, 5), dtype=torch.float64) * 2
    ref = logps + 0.2 * random.normal(random.key(2), (4, 5), dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0, 0.0], dtype=torch.float64)
    mask = torch.arange(5)[None] < torch.tensor([5, 3, 1, 4])[:, None]  # lengths
    logps.requires_grad_(True)
    g, = torch.autograd.grad(losses.grpo(logps, adv, mask, ref_logps=ref, beta=0.1), logps)
    lengths = mask.sum(1, keepdim=True)
    want = (-adv[:, None] + 0.1 * (1 - torch.exp(ref - logps.detach()))) / (lengths * 4)
    torch.testing.assert_close(g, torch.where(mask, want, 0.0))


def test_the_clip_stops_the_gradient_past_its_range():
    """A > 0: no gradient once the ratio is above 1 + epsilon_high; A < 0: none below
    1 - epsilon; inside the range (or past it against the advantage) the ratio's
    gradient ``-A rho``."""
    old = torch.zeros(2, 4, dtype=torch.float64)
    rho = torch.tensor([0.7, 0.9, 1.25, 1.4], dtype=torch.float64)  # 1.25: in [1.2, 1.3]
    logps = torch.log(rho).expand(2, -1).clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.bool)
    g, = torch.autograd.grad(losses.grpo(logps, adv, mask, old_logps=old, epsilon=0.2,
                                         epsilon_high=0.3, normalize="dapo"), logps)
    free = -adv[:, None] * rho / 8  # d(-A rho)/d logp over 8 tokens
    want = torch.stack((free[0] * torch.tensor([1, 1, 1, 0]),   # 1.4 > 1.3: clipped
                        free[1] * torch.tensor([0, 1, 1, 1])))  # 0.7 < 0.8: clipped
    torch.testing.assert_close(g, want.to(torch.float64))


def test_the_kl_term_is_unbiased():
    """Over one token drawn from ``pi``: E_pi[k3] = KL(pi || pi_ref), by enumeration."""
    pi = torch.softmax(random.normal(random.key(3), (6,), dtype=torch.float64), 0)
    ref = torch.softmax(random.normal(random.key(4), (6,), dtype=torch.float64), 0)
    mask = torch.ones(1, 1, dtype=torch.bool)
    zero = torch.zeros(1, dtype=torch.float64)
    k3 = torch.stack([losses.grpo(pi[v].log().reshape(1, 1), zero, mask,
                                  ref_logps=ref[v].log().reshape(1, 1), beta=1.0)
                      for v in range(6)])
    torch.testing.assert_close((pi * k3).sum(), (pi * (pi / ref).log()).sum())
    assert (k3 >= 0).all()


def test_group_advantages():
    rewards = random.normal(random.key(5), (3, 8), dtype=torch.float64)
    a = losses.group_advantages(rewards, eps=0.0)
    torch.testing.assert_close(a.mean(-1), torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(a.std(-1), torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(losses.group_advantages(rewards, scale=False),
                               rewards - rewards.mean(-1, keepdim=True))
    same = losses.group_advantages(torch.ones(2, 4))
    assert torch.equal(same, torch.zeros(2, 4))


def test_per_token_advantages_and_the_clipped_value_loss():
    """Per-token advantages (PPO with a critic) equal the loop; the value loss is half the
    masked mean square, and clipped it stops pulling a value that moved past ``clip``."""
    keys = random.split(random.key(6), 4)
    logps = -random.uniform(keys[0], (3, 5), dtype=torch.float64) * 3
    old = logps + 0.3 * random.normal(keys[1], (3, 5), dtype=torch.float64)
    adv = random.normal(keys[2], (3, 5), dtype=torch.float64)
    mask = random.bernoulli(keys[3], 0.8, (3, 5))
    got = losses.grpo(logps, adv, mask, old_logps=old, normalize="dapo")
    want = sum(-min(float((logps[i, t] - old[i, t]).exp()) * float(adv[i, t]),
                    min(max(float((logps[i, t] - old[i, t]).exp()), 0.8), 1.2)
                    * float(adv[i, t]))
               for i in range(3) for t in range(5) if mask[i, t]) / int(mask.sum())
    assert got.item() == pytest.approx(want, rel=1e-12)
    values = torch.tensor([[1.0, 2.0, 0.5]], dtype=torch.float64, requires_grad=True)
    returns = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)
    plain = losses.value_loss(values, returns, torch.tensor([[True, True, False]]))
    assert plain.item() == pytest.approx(0.5 * (1 + 4) / 2)
    old_values = torch.tensor([[1.5, 1.0, 0.0]], dtype=torch.float64)
    g, = torch.autograd.grad(losses.value_loss(values, returns, old_values=old_values,
                                               clip=0.2), values)
    # value 1 moved 0.5 toward its target, past the clip: the clipped error (1.3^2) is the
    # larger and flat in V, so no pull; values 2 and 3 moved away: the unclipped errors are
    # the larger and pull, (V - R) / 3 each
    torch.testing.assert_close(g, torch.tensor([[0.0, 2.0 / 3, 0.5 / 3]], dtype=torch.float64))
    pulled_back = torch.tensor([[0.0]], dtype=torch.float64, requires_grad=True)
    g, = torch.autograd.grad(losses.value_loss(pulled_back, torch.tensor([[1.0]],
                                               dtype=torch.float64),
                                               old_values=torch.tensor([[-1.0]],
                                                                       dtype=torch.float64),
                                               clip=0.5), pulled_back)
    assert g.item() == 0.0  # the clipped error (1.5^2) is larger, and flat in V


def test_gspo_clips_each_completions_mean_ratio():
    """``ratio="sequence"``: each completion's loss is ``-min(s A, clip(s) A)`` with ``s``
    the exp of its tokens' mean log-ratio, the same for each of its tokens; on fresh
    samples its gradient is GRPO's."""
    import math

    keys = random.split(random.key(7), 4)
    logps = -random.uniform(keys[0], (5, 6), dtype=torch.float64) * 3
    old = logps + 0.5 * random.normal(keys[1], (5, 6), dtype=torch.float64)
    adv = random.normal(keys[2], (5,), dtype=torch.float64)
    mask = random.bernoulli(keys[3], 0.7, (5, 6))
    mask[:, 0] = True
    got = losses.grpo(logps, adv, mask, old_logps=old, ratio="sequence")
    want = 0.0
    for i in range(5):
        lr = [float(logps[i, t] - old[i, t]) for t in range(6) if mask[i, t]]
        s_i = math.exp(sum(lr) / len(lr))
        want += -min(s_i * float(adv[i]), min(max(s_i, 0.8), 1.2) * float(adv[i])) / 5
    assert got.item() == pytest.approx(want, rel=1e-12)
    fresh = logps.clone().requires_grad_(True)
    g_seq, = torch.autograd.grad(losses.grpo(fresh, adv, mask, ratio="sequence"), fresh)
    g_tok, = torch.autograd.grad(losses.grpo(fresh, adv, mask), fresh)
    torch.testing.assert_close(g_seq, g_tok)


def test_ppo_is_grpo_per_step_with_the_token_mean():
    keys = random.split(random.key(9), 3)
    logps = -random.uniform(keys[0], (4, 6), dtype=torch.float64)
    old = logps + 0.3 * random.normal(keys[1], (4, 6), dtype=torch.float64)
    adv = random.normal(keys[2], (4, 6), dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.bool)
    torch.testing.assert_close(losses.ppo(logps, old, adv, epsilon=0.1),
                               losses.grpo(logps, adv, mask, old_logps=old, epsilon=0.1,
                                           normalize="dapo"))
    with pytest.raises(ValueError, match="advantages must be \\(B, T\\) = \\(4, 6\\)"):
        losses.ppo(logps, old, adv[:, 0])


def test_leave_one_out_advantages():
    rewards = random.normal(random.key(8), (3, 5), dtype=torch.float64)
    got = losses.group_advantages(rewards, scale=False, leave_one_out=True)
    for p in range(3):
        for i in range(5):
            others = torch.cat((rewards[p, :i], rewards[p, i + 1:]))
            assert got[p, i].item() == pytest.approx((rewards[p, i] - others.mean()).item(),
                                                     rel=1e-12)
    # RLOO's baseline is the group mean's, scaled by G / (G - 1)
    torch.testing.assert_close(got, 5 / 4 * losses.group_advantages(rewards, scale=False))


def test_kl_estimates_k1_and_k3_are_unbiased_and_k3_nonnegative():
    """Over tokens drawn from ``pi``, by enumeration: E[k1] = E[k3] = KL(pi || ref);
    k2 is the second-order approximation (within 10% for nearby distributions)."""
    pi = torch.softmax(random.normal(random.key(10), (7,), dtype=torch.float64), 0)
    ref = torch.softmax(pi.log() + 0.2 * random.normal(random.key(11), (7,),
                                                       dtype=torch.float64), 0)
    kl = (pi * (pi / ref).log()).sum()
    for kind in ("k1", "k3"):
        torch.testing.assert_close((pi * losses.kl_estimate(pi.log(), ref.log(), kind)).sum(),
                                   kl)
    assert (losses.kl_estimate(pi.log(), ref.log()) >= 0).all()
    k2 = (pi * losses.kl_estimate(pi.log(), ref.log(), "k2")).sum()
    assert abs(k2 / kl - 1) < 0.1


def test_completion_mask_stops_after_the_first_eos():
    seqs = torch.tensor([[2, 5, 6, 2, 7, 2],   # an eos in the prompt does not count
                         [1, 5, 6, 7, 8, 9],   # no eos: the whole completion
                         [1, 5, 2, 2, 2, 2]])
    got = losses.completion_mask(seqs, 2, eos=2)
    want = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0]],
                        dtype=torch.bool)
    assert torch.equal(got, want)
    assert torch.equal(losses.completion_mask(seqs, 2), torch.arange(6).expand(3, -1) >= 2)


def test_errors_are_named():
    logps, mask, adv = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.zeros(2)
    with pytest.raises(ValueError, match="beta > 0 needs ref_logps"):
        losses.grpo(logps, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="advantages must be \\(B,\\) = \\(2,\\)"):
        losses.grpo(logps, torch.zeros(3), mask)
    with pytest.raises(ValueError, match="clip and old_values go together"):
        losses.value_loss(logps, logps, clip=0.2)
    with pytest.raises(ValueError, match="returns must be \\(B, N\\) = \\(2, 3\\)"):
        losses.value_loss(logps, torch.zeros(3))
    with pytest.raises(ValueError, match="mask must be \\(B, N\\) = \\(2, 3\\)"):
        losses.grpo(logps, adv, mask[:, :2])
    with pytest.raises(ValueError, match="old_logps must be \\(B, N\\) = \\(2, 3\\)"):
        losses.grpo(logps, adv, mask, old_logps=torch.zeros(3))
    with pytest.raises(ValueError, match="ratio must be 'token' or 'sequence'"):
        losses.grpo(logps, adv, mask, ratio="step")
    with pytest.raises(ValueError, match="kind must be 'k1', 'k2' or 'k3'"):
        losses.kl_estimate(logps, logps, "k4")
    with pytest.raises(ValueError, match="prompt_length must be an int in \\[0, 3\\]"):
        losses.completion_mask(torch.zeros(2, 3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="normalize must be one of"):
        losses.grpo(logps, adv, mask, normalize="ppo")
    with pytest.raises(ValueError, match="max_length is an int >= 1 for normalize='dr_grpo'"):
        losses.grpo(logps, adv, mask, max_length=4)
    with pytest.raises(ValueError, match="epsilon_high must be a number >= 0"):
        losses.grpo(logps, adv, mask, epsilon_high=-0.1)
    with pytest.raises(ValueError, match="G >= 2 completions per group"):
        losses.group_advantages(torch.zeros(3, 1))
