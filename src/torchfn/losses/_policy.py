"""Policy-gradient losses for language models: GRPO (DeepSeekMath), with DAPO's and Dr.
GRPO's normalisations, the group-relative advantages it reads, and PPO's clipped value
loss for per-token advantages from a critic (:func:`torchfn.transforms.gae`)."""

from __future__ import annotations

import torch
from torch import Tensor

from torchfn.losses._classification import _check_float

__all__ = ["group_advantages", "grpo", "ppo", "value_loss", "kl_estimate",
           "completion_mask"]

_NORMALIZE = ("grpo", "dapo", "dr_grpo")


def group_advantages(rewards: Tensor, *, scale: bool = True, eps: float = 1e-4,
                     leave_one_out: bool = False) -> Tensor:
    """GRPO's advantages: each completion's reward against its group's (the completions of
    one prompt), ``(r - mean) / (std + eps)`` over the last dim; ``scale=False``: ``r -
    mean`` (Dr. GRPO, which drops the std's bias toward too easy or too hard prompts).
    The std is the sample std (``n - 1``), as TRL's. ``leave_one_out=True``: the baseline
    is the mean of the group's other rewards, ``r - (sum - r) / (G - 1)`` (RLOO, Ahmadian
    et al. 2024; with ``scale=False``), an unbiased baseline.

    Args:
        rewards: ``(..., G)``: ``G >= 2`` completions per prompt, e.g. ``(P, G)``.
        scale: divide by the group's std.
        eps: added to the std.
        leave_one_out: RLOO's baseline instead of the group mean.

    Returns:
        ``(..., G)``; a group whose rewards are all equal gets 0.

    Example::

        >>> import torch
        >>> from torchfn import losses
        >>> losses.group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
        tensor([[ 0.8659, -0.8659, -0.8659,  0.8659]])
    """
    _check_float("rewards", rewards)
    if rewards.dim() < 1 or rewards.shape[-1] < 2:
        raise ValueError(f"rewards must be (..., G) with G >= 2 completions per group, got "
                         f"{tuple(rewards.shape)}")
    g = rewards.shape[-1]
    if leave_one_out:
        centred = rewards - (rewards.sum(-1, keepdim=True) - rewards) / (g - 1)
    else:
        centred = rewards - rewards.mean(-1, keepdim=True)
    return centred / (rewards.std(-1, keepdim=True) + eps) if scale else centred


def grpo(logps: Tensor, advantages: Tensor, mask: Tensor, *, old_logps: Tensor | None = None,
         ref_logps: Tensor | None = None, beta: float = 0.0, epsilon: float = 0.2,
         epsilon_high: float | None = None, normalize: str = "grpo",
         max_length: int | None = None, ratio: str = "token") -> Tensor:
    """Group Relative Policy Optimization's clipped surrogate loss (Shao et al. 2024), per
    token, as TRL's ``GRPOTrainer`` computes it.

    Per completion token ``t`` with ratio ``rho = exp(logps - old_logps)`` and the
    completion's advantage ``A``: ``-min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high)
    A)``, plus ``beta`` times the KL estimate to the reference ``exp(ref - logp) - (ref -
    logp) - 1`` (Schulman's k3, unbiased and >= 0). Then over the masked tokens:

    * ``"grpo"``: each completion's mean, then the mean over completions;
    * ``"dapo"``: the mean over all the batch's tokens (DAPO's token-level loss; TRL's
      ``"bnpo"`` on one process);
    * ``"dr_grpo"``: the sum over all tokens divided by ``B * max_length`` (Dr. GRPO: no
      length bias).

    ``ratio="sequence"`` is GSPO (Zheng et al. 2025, Qwen3's RL): one ratio per completion,
    ``exp(mean over its tokens of (logps - old_logps))``, clipped as a whole (TRL's
    ``importance_sampling_level="sequence"``); it suits mixtures of experts, whose token
    ratios swing with the routing.

    ``old_logps=None`` is the first update on fresh samples: the ratio is 1 with the
    gradient of ``logps`` (``old_logps = logps.detach()``), so the loss's gradient is the
    policy gradient ``-A grad log pi`` (plus the KL's).

    Args:
        logps: ``(B, N)`` the current policy's log-probabilities of the sampled tokens
            (:func:`token_log_probs`).
        advantages: ``(B,)`` each completion's advantage (:func:`group_advantages`,
            flattened), or ``(B, N)`` each token's (PPO with a critic:
            :func:`torchfn.transforms.gae`); constant.
        mask: ``(B, N)`` bool, True on the completion's tokens.
        old_logps: ``(B, N)`` the sampling policy's, constant; None: ``logps.detach()``.
        ref_logps: ``(B, N)`` the reference policy's, needed when ``beta > 0``.
        beta: the KL penalty's weight (>= 0; DeepSeekMath: 0.04; recent work: 0).
        epsilon, epsilon_high: the clip range ``[1 - epsilon, 1 + epsilon_high]``
            (``epsilon_high=None``: ``epsilon``; DAPO's "clip-higher": 0.28).
        normalize: ``"grpo"``, ``"dapo"`` or ``"dr_grpo"``.
        max_length: ``"dr_grpo"``'s length (default ``N``).
        ratio: ``"token"`` (GRPO, PPO) or ``"sequence"`` (GSPO).

    Returns:
        A scalar.

    Example::

        >>> import torch
        >>> from torchfn import losses
        >>> logps = torch.log(torch.tensor([[0.5, 0.5], [0.25, 0.25]])).requires_grad_()
        >>> mask = torch.ones(2, 2, dtype=torch.bool)
        >>> loss = losses.grpo(logps, torch.tensor([1.0, -1.0]), mask)
        >>> torch.autograd.grad(loss, logps)[0]        # -A / (2 tokens * 2 completions)
        tensor([[-0.2500, -0.2500],
                [ 0.2500,  0.2500]])
    """
    _check_float("logps", logps)
    if logps.dim() != 2:
        raise ValueError(f"logps must be (B, N), got {tuple(logps.shape)}")
    b, n = logps.shape
    for name, t in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if t is not None and (not isinstance(t, Tensor) or tuple(t.shape) != (b, n)):
            raise ValueError(f"{name} must be (B, N) = {(b, n)} like logps, got "
                             f"{getattr(t, 'shape', t)}")
    if not isinstance(mask, Tensor) or tuple(mask.shape) != (b, n):
        raise ValueError(f"mask must be (B, N) = {(b, n)}, got {getattr(mask, 'shape', mask)}")
    if not isinstance(advantages, Tensor) or tuple(advantages.shape) not in ((b,), (b, n)):
        raise ValueError(f"advantages must be (B,) = ({b},), one per completion, or (B, N) = "
                         f"{(b, n)}, one per token, got "
                         f"{getattr(advantages, 'shape', advantages)}")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta >= 0:
        raise ValueError(f"beta must be a number >= 0, got {beta!r}")
    if beta > 0 and ref_logps is None:
        raise ValueError("grpo: beta > 0 needs ref_logps (the reference policy's)")
    high = epsilon if epsilon_high is None else epsilon_high
    for name, value in (("epsilon", epsilon), ("epsilon_high", high)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    if normalize not in _NORMALIZE:
        raise ValueError(f"normalize must be one of {_NORMALIZE}, got {normalize!r}")
    if max_length is not None and (normalize != "dr_grpo" or isinstance(max_length, bool)
                                   or not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length is an int >= 1 for normalize='dr_grpo', got "
                         f"max_length={max_length!r}, normalize={normalize!r}")
    if ratio not in ("token", "sequence"):
        raise ValueError(f"ratio must be 'token' or 'sequence', got {ratio!r}")
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old  # (B, N)
    if ratio == "sequence":  # GSPO: the completion's mean log-ratio, for each of its tokens
        keep = mask.to(torch.bool)
        log_ratio = (torch.where(keep, log_ratio, 0.0).sum(-1, keepdim=True)
                     / keep.sum(-1, keepdim=True).clamp_min(1)).expand(b, n)
    rho = torch.exp(log_ratio)  # (B, N)
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).to(logps.dtype)
    loss = -torch.minimum(rho * adv, rho.clamp(1 - epsilon, 1 + high) * adv)
    if beta > 0:
        diff = ref_logps - logps
        loss = loss + beta * (torch.exp(diff) - diff - 1)
    mask = mask.to(torch.bool)
    loss = torch.where(mask, loss, 0.0)  # (B, N)
    if normalize == "grpo":
        return (loss.sum(-1) / mask.sum(-1).clamp_min(1)).mean()
    if normalize == "dapo":
        return loss.sum() / mask.sum().clamp_min(1)
    return loss.sum() / (b * (n if max_length is None else max_length))


def ppo(logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor | None = None, *,
        epsilon: float = 0.2, epsilon_high: float | None = None) -> Tensor:
    """PPO's clipped surrogate (Schulman et al. 2017), ``-min(rho A, clip(rho, 1 -
    epsilon, 1 + epsilon_high) A)`` with ``rho = exp(logps - old_logps)``, averaged over
    the masked steps: :func:`grpo` with per-step advantages and ``normalize="dapo"``.

    Args:
        logps: ``(B, T)`` the policy's log-probabilities of the actions taken (or tokens).
        old_logps: ``(B, T)`` the behaviour policy's, constant.
        advantages: ``(B, T)`` (e.g. :func:`torchfn.transforms.gae`, normalised), constant.
        mask: ``(B, T)`` bool, the steps that count; None: all.
        epsilon, epsilon_high: the clip range (``epsilon_high=None``: ``epsilon``).

    Returns:
        A scalar.

    Example::

        >>> import torch
        >>> from torchfn import losses
        >>> logps = torch.log(torch.tensor([[0.5, 0.9]]))
        >>> old = torch.log(torch.tensor([[0.5, 0.5]]))     # ratios 1 and 1.8 (clipped to 1.2)
        >>> losses.ppo(logps, old, torch.ones(1, 2))
        tensor(-1.1000)
    """
    _check_float("logps", logps)
    if mask is None:
        mask = torch.ones(logps.shape, dtype=torch.bool, device=logps.device)
    if not isinstance(advantages, Tensor) or advantages.shape != logps.shape:
        raise ValueError(f"advantages must be (B, T) = {tuple(logps.shape)} like logps, got "
                         f"{getattr(advantages, 'shape', advantages)}")
    return grpo(logps, advantages, mask, old_logps=old_logps, epsilon=epsilon,
                epsilon_high=epsilon_high, normalize="dapo")


def value_loss(values: Tensor, returns: Tensor, mask: Tensor | None = None, *,
               old_values: Tensor | None = None, clip: float | None = None) -> Tensor:
    """A critic's loss, ``0.5 (V - R)^2`` averaged over the masked tokens; with
    ``old_values`` and ``clip``, PPO's clipped form ``0.5 max((V - R)^2, (V_clip - R)^2)``,
    ``V_clip = old + clip(V - old, -clip, clip)`` (as TRL's PPO and OpenAI's baselines).

    Args:
        values: ``(B, N)`` the critic's values now.
        returns: ``(B, N)`` the targets (``gae(...) + old values``), constant.
        mask: ``(B, N)`` bool, the tokens that count; None: all.
        old_values: ``(B, N)`` the values when the samples were drawn, constant.
        clip: how far the values may move from ``old_values`` before the loss stops
            pulling them (> 0); needs ``old_values``.

    Returns:
        A scalar.

    Example::

        >>> import torch
        >>> from torchfn import losses
        >>> losses.value_loss(torch.tensor([[1.0, 3.0]]), torch.tensor([[0.0, 1.0]]))
        tensor(1.2500)
    """
    _check_float("values", values)
    if values.dim() != 2:
        raise ValueError(f"values must be (B, N), got {tuple(values.shape)}")
    for name, t in (("returns", returns), ("mask", mask), ("old_values", old_values)):
        if t is not None and (not isinstance(t, Tensor) or t.shape != values.shape):
            raise ValueError(f"{name} must be (B, N) = {tuple(values.shape)} like values, got "
                             f"{getattr(t, 'shape', t)}")
    if (clip is None) != (old_values is None):
        raise ValueError("value_loss: clip and old_values go together (PPO's clipped loss), "
                         f"got clip={clip!r} and old_values "
                         f"{'given' if old_values is not None else 'None'}")
    loss = (values - returns) ** 2
    if clip is not None:
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0:
            raise ValueError(f"clip must be a number > 0, got {clip!r}")
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    if mask is None:
        return 0.5 * loss.mean()
    mask = mask.to(torch.bool)
    return 0.5 * torch.where(mask, loss, 0.0).sum() / mask.sum().clamp_min(1)


def kl_estimate(logps: Tensor, ref_logps: Tensor, kind: str = "k3") -> Tensor:
    """Per-sample estimates of ``KL(pi || pi_ref)`` from the log-probabilities of tokens
    drawn from ``pi`` (Schulman, "Approximating KL divergence", 2020), with ``log r =
    ref_logps - logps``: ``"k1"``: ``-log r`` (unbiased, can be negative); ``"k2"``:
    ``(log r)^2 / 2`` (biased, low variance); ``"k3"``: ``r - 1 - log r`` (unbiased and >=
    0; GRPO's). Use them as a loss term, or as a per-token reward penalty (TRL's PPO).

    Args:
        logps, ref_logps: ``(...)`` the sampled tokens' log-probabilities under the policy
            and the reference.
        kind: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        ``(...)``.

    Example::

        >>> import torch
        >>> from torchfn import losses
        >>> losses.kl_estimate(torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25])))
        tensor([0.1931])
    """
    _check_float("logps", logps)
    _check_float("ref_logps", ref_logps)
    if logps.shape != ref_logps.shape:
        raise ValueError(f"ref_logps must have logps' shape {tuple(logps.shape)}, got "
                         f"{tuple(ref_logps.shape)}")
    log_r = ref_logps - logps
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r ** 2
    if kind == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"kind must be 'k1', 'k2' or 'k3', got {kind!r}")


def completion_mask(tokens: Tensor, prompt_length: int, eos: int | None = None) -> Tensor:
    """Which tokens of ``tokens`` ``(B, N)`` (prompts of ``prompt_length``, then sampled
    completions, as :func:`torchfn.models.generate` returns them) are completion tokens
    that count: those after the prompt, up to and including the first ``eos``
    (:func:`generate` repeats ``eos`` after it). ``(B, N)`` bool; for targets ``tokens[:,
    1:]`` take ``mask[:, 1:]``.

    Example::

        >>> import torch
        >>> from torchfn import losses
        >>> seqs = torch.tensor([[5, 6, 7, 2, 2], [5, 6, 2, 2, 2]])    # eos = 2
        >>> losses.completion_mask(seqs, 2, eos=2).int()
        tensor([[0, 0, 1, 1, 0],
                [0, 0, 1, 0, 0]], dtype=torch.int32)
    """
    if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.is_floating_point():
        raise ValueError(f"completion_mask: tokens must be an int tensor (B, N), got "
                         f"{getattr(tokens, 'shape', type(tokens).__name__)}")
    n = tokens.shape[1]
    if isinstance(prompt_length, bool) or not isinstance(prompt_length, int) \
            or not 0 <= prompt_length <= n:
        raise ValueError(f"prompt_length must be an int in [0, {n}], got {prompt_length!r}")
    after = torch.arange(n, device=tokens.device) >= prompt_length  # (N,)
    mask = after.expand_as(tokens)
    if eos is None:
        return mask.clone()
    ended = (tokens == eos) & mask
    before = ended.long().cumsum(1) - ended.long()  # eos strictly before each position
    return mask & (before == 0)
