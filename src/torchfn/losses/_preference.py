"""Preference optimisation of language models: the log-probabilities of given sequences,
and the DPO family of losses on them (DPO, cDPO, robust DPO, IPO, SLiC's hinge, SimPO),
KTO's on unpaired examples, ORPO's odds ratio, and a reward model's Bradley-Terry loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from torchfn.losses._classification import _check_float, _check_reduction, _reduce

__all__ = ["token_log_probs", "sequence_log_probs", "dpo", "simpo", "kto", "orpo",
           "bradley_terry"]

_DPO_KINDS = ("sigmoid", "robust", "hinge", "ipo")


def token_log_probs(logits: Tensor, targets: Tensor) -> Tensor:
    """``log softmax(logits)[targets]``: each target's log-probability, ``(..., N)``.

    ``logits`` ``(..., N, V)`` are aligned with ``targets`` ``(..., N)``: for a causal LM's
    output on ``tokens``, pass ``logits[:, :-1]`` and ``tokens[:, 1:]``. Taken in float32 or
    wider.

    Example::

        >>> import torch
        >>> from torchfn import losses
        >>> logits = torch.zeros(1, 2, 4)                    # (B, N, V): uniform
        >>> losses.token_log_probs(logits, torch.tensor([[1, 3]]))
        tensor([[-1.3863, -1.3863]])
    """
    _check_float("logits", logits)
    if not isinstance(targets, Tensor) or targets.is_floating_point() \
            or logits.dim() < 2 or tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"token_log_probs: targets must be int (..., N) = "
                         f"{tuple(logits.shape[:-1])} (logits (..., N, V) = "
                         f"{tuple(logits.shape)}), got "
                         f"{getattr(targets, 'dtype', type(targets).__name__)} "
                         f"{tuple(getattr(targets, 'shape', ()))}")
    work = logits.to(torch.promote_types(logits.dtype, torch.float32))
    picked = work.gather(-1, targets.long()[..., None])[..., 0]  # (..., N)
    return picked - torch.logsumexp(work, -1)


def sequence_log_probs(logits: Tensor, targets: Tensor, mask: Tensor | None = None, *,
                       average: bool = False) -> Tensor:
    """``log p(targets)``: the sum over ``N`` of :func:`token_log_probs` where ``mask``,
    ``(...)``; ``average=True``: their mean over the masked tokens (SimPO's and IPO's
    length-normalised log-probability).

    Args:
        logits: ``(..., N, V)``, aligned with ``targets``.
        targets: ``(..., N)`` int.
        mask: ``(..., N)`` bool, True for the tokens that count (the completion, not the
            prompt or padding); None: all.
        average: divide by the count of masked tokens (at least 1).

    Example::

        >>> import torch
        >>> from torchfn import losses
        >>> logits = torch.zeros(2, 3, 4)
        >>> tokens = torch.tensor([[1, 2, 3], [0, 1, 2]])
        >>> completion = torch.tensor([[False, True, True], [False, False, True]])
        >>> losses.sequence_log_probs(logits, tokens, completion)   # 2 and 1 tokens of 1/4
        tensor([-2.7726, -1.3863])
    """
    logp = token_log_probs(logits, targets)  # (..., N)
    if mask is None:
        return logp.mean(-1) if average else logp.sum(-1)
    if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(targets.shape):
        raise ValueError(f"sequence_log_probs: mask must be (..., N) = "
                         f"{tuple(targets.shape)}, got {getattr(mask, 'shape', mask)}")
    mask = mask.to(torch.bool)
    total = torch.where(mask, logp, 0.0).sum(-1)
    return total / mask.sum(-1).clamp_min(1) if average else total


def _check_pairs(who: str, **tensors: Tensor) -> None:
    shapes = {name: tuple(getattr(t, "shape", ())) for name, t in tensors.items()}
    for name, t in tensors.items():
        _check_float(name, t)
    if len(set(shapes.values())) != 1:
        raise ValueError(f"{who}: the log-probabilities must share one shape (B,), got "
                         f"{shapes}")


def _check_smoothing(label_smoothing: float, top: float) -> None:
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0 <= label_smoothing < top:
        raise ValueError(f"label_smoothing must be a number in [0, {top}), got "
                         f"{label_smoothing!r}")


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


def dpo(chosen: Tensor, rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, *,
        beta: float = 0.1, kind: str = "sigmoid", label_smoothing: float = 0.0,
        reduction: str = "mean") -> Tensor:
    """Direct Preference Optimization (Rafailov et al. 2023) and its variants, on the
    log-probabilities of preferred and dispreferred completions.

    With ``z = (chosen - ref_chosen) - (rejected - ref_rejected)`` (the policy's log-ratio
    margin over the reference's; ``beta z`` is the difference of DPO's implicit rewards
    ``beta log(pi / pi_ref)``):

    * ``"sigmoid"``: ``-log sigmoid(beta z)`` (DPO); with ``label_smoothing = e``,
      ``-(1 - e) log sigmoid(beta z) - e log sigmoid(-beta z)`` (conservative DPO: a
      fraction ``e`` of the labels assumed flipped);
    * ``"robust"``: ``(-(1 - e) log sigmoid(beta z) + e log sigmoid(-beta z)) / (1 - 2e)``
      (Chowdhury et al. 2024: unbiased under label noise ``e < 1/2``);
    * ``"hinge"``: ``max(0, 1 - beta z)`` (SLiC / RSO);
    * ``"ipo"``: ``(z - 1 / (2 beta))^2`` (Azar et al. 2023: regresses the margin to a
      finite target, so it cannot overfit deterministic preferences; TRL passes
      length-averaged log-probabilities here, see :func:`sequence_log_probs`).

    Args:
        chosen, rejected: ``(B,)`` the policy's log-probabilities of each pair's preferred
            and dispreferred completion (:func:`sequence_log_probs`).
        ref_chosen, ref_rejected: ``(B,)`` the same under the frozen reference policy
            (detached: no gradient should reach it).
        beta: the KL penalty's inverse temperature (> 0).
        kind: ``"sigmoid"``, ``"robust"``, ``"hinge"`` or ``"ipo"``.
        label_smoothing: ``e``, for ``"sigmoid"`` in [0, 1) and ``"robust"`` in [0, 1/2).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` ``(B,)``.

    Example::

        >>> import torch
        >>> from torchfn import losses
        >>> zero = torch.zeros(3)
        >>> losses.dpo(zero, zero, zero, zero)     # no margin yet: log 2
        tensor(0.6931)
    """
    _check_pairs("dpo", chosen=chosen, rejected=rejected, ref_chosen=ref_chosen,
                 ref_rejected=ref_rejected)
    _positive("beta", beta)
    if kind not in _DPO_KINDS:
        raise ValueError(f"kind must be one of {_DPO_KINDS}, got {kind!r}")
    _check_reduction(reduction)
    if kind in ("sigmoid", "robust"):
        _check_smoothing(label_smoothing, 1.0 if kind == "sigmoid" else 0.5)
    elif label_smoothing:
        raise ValueError(f"label_smoothing goes with kind 'sigmoid' or 'robust', got "
                         f"kind={kind!r}, label_smoothing={label_smoothing!r}")
    z = (chosen - ref_chosen) - (rejected - ref_rejected)  # (B,)
    e = label_smoothing
    if kind == "sigmoid":
        loss = -(1 - e) * F.logsigmoid(beta * z) - e * F.logsigmoid(-beta * z)
    elif kind == "robust":
        loss = (-(1 - e) * F.logsigmoid(beta * z) + e * F.logsigmoid(-beta * z)) / (1 - 2 * e)
    elif kind == "hinge":
        loss = torch.relu(1 - beta * z)
    else:
        loss = (z - 1 / (2 * beta)) ** 2
    return _reduce(loss, reduction)


def simpo(chosen: Tensor, rejected: Tensor, *, beta: float = 2.0, gamma: float = 1.0,
          label_smoothing: float = 0.0, reduction: str = "mean") -> Tensor:
    """SimPO (Meng et al. 2024): DPO without a reference model, on length-normalised
    log-probabilities, with a target reward margin ``gamma``:
    ``-log sigmoid(beta (chosen - rejected) - gamma)`` (``label_smoothing`` as
    :func:`dpo`'s ``"sigmoid"``).

    Args:
        chosen, rejected: ``(B,)`` mean per-token log-probabilities of the completions
            (:func:`sequence_log_probs` with ``average=True``).
        beta: reward scale (> 0; the paper uses 2 to 2.5).
        gamma: the target margin (>= 0; the paper's ``gamma / beta`` is about 0.5).
        label_smoothing: in [0, 1).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` ``(B,)``.

    Example::

        >>> import torch
        >>> from torchfn import losses
        >>> losses.simpo(torch.tensor([-1.0]), torch.tensor([-2.0]), beta=2.0, gamma=2.0)
        tensor(0.6931)
    """
    _check_pairs("simpo", chosen=chosen, rejected=rejected)
    _positive("beta", beta)
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not gamma >= 0:
        raise ValueError(f"gamma must be a number >= 0, got {gamma!r}")
    _check_smoothing(label_smoothing, 1.0)
    _check_reduction(reduction)
    margin = beta * (chosen - rejected) - gamma
    e = label_smoothing
    loss = -(1 - e) * F.logsigmoid(margin) - e * F.logsigmoid(-margin)
    return _reduce(loss, reduction)


def kto(logps: Tensor, ref_logps: Tensor, desirable: Tensor, *, beta: float = 0.1,
        kl: Tensor | float = 0.0, desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0, reduction: str = "mean") -> Tensor:
    """KTO (Ethayarajh et al. 2024): preference tuning from unpaired examples, each marked
    desirable or not, with prospect theory's value function around a reference point.

    With ``r = logps - ref_logps`` and the reference point ``z0 = kl``: a desirable
    example's loss is ``w_d (1 - sigmoid(beta (r - z0)))``, an undesirable one's ``w_u (1 -
    sigmoid(beta (z0 - r)))``. ``z0`` is the policy's KL to the reference, estimated as
    TRL does on mismatched pairs (each completion scored after another example's prompt):
    ``(policy - reference).mean().clamp(min=0)`` of those log-probabilities; it is taken
    as a constant (no gradient flows into it).

    Args:
        logps, ref_logps: ``(B,)`` each completion's log-probability under the policy and
            under the frozen reference (:func:`sequence_log_probs`).
        desirable: ``(B,)`` bool.
        beta: > 0.
        kl: the reference point ``z0`` (a number or a scalar tensor, >= 0).
        desirable_weight, undesirable_weight: ``w_d``, ``w_u`` (> 0; the paper keeps
            ``w_d n_d / (w_u n_u)`` in [1, 4/3]).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` ``(B,)``.

    Example::

        >>> import torch
        >>> from torchfn import losses
        >>> zero = torch.zeros(2)
        >>> losses.kto(zero, zero, torch.tensor([True, False]))   # 1 - sigmoid(0) each
        tensor(0.5000)
    """
    _check_pairs("kto", logps=logps, ref_logps=ref_logps)
    if not isinstance(desirable, Tensor) or desirable.dtype != torch.bool \
            or desirable.shape != logps.shape:
        raise ValueError(f"kto: desirable must be a bool tensor of logps' shape "
                         f"{tuple(logps.shape)}, got {getattr(desirable, 'dtype', desirable)} "
                         f"{tuple(getattr(desirable, 'shape', ()))}")
    _positive("beta", beta)
    _positive("desirable_weight", desirable_weight)
    _positive("undesirable_weight", undesirable_weight)
    _check_reduction(reduction)
    z0 = kl.detach() if isinstance(kl, Tensor) else torch.tensor(float(kl))
    if z0.dim() != 0:
        raise ValueError(f"kl must be a number or a scalar tensor, got shape {tuple(z0.shape)}")
    r = logps - ref_logps
    z0 = z0.to(r)
    loss = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (r - z0))),
                       undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r))))
    return _reduce(loss, reduction)


def orpo(chosen: Tensor, rejected: Tensor, *, beta: float = 0.1,
         reduction: str = "mean") -> Tensor:
    """ORPO (Hong et al. 2024): supervised fine-tuning on the chosen completions plus an
    odds-ratio penalty on the rejected, with no reference model:
    ``-chosen - beta log sigmoid(log odds(chosen) - log odds(rejected))``, where
    ``odds(y) = p / (1 - p)`` and ``p = exp(mean token log-probability)``.

    Args:
        chosen, rejected: ``(B,)`` mean per-token log-probabilities of the completions
            (:func:`sequence_log_probs` with ``average=True``), < 0.
        beta: the odds-ratio term's weight ``lambda`` (> 0; TRL's default 0.1).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` ``(B,)``.

    Example::

        >>> import torch
        >>> from torchfn import losses
        >>> half = torch.log(torch.tensor([0.5]))     # p = 1/2: odds 1 on both sides
        >>> losses.orpo(half, half, beta=1.0)          # log 2 (NLL) + log 2 (log sigmoid(0))
        tensor(1.3863)
    """
    _check_pairs("orpo", chosen=chosen, rejected=rejected)
    _positive("beta", beta)
    _check_reduction(reduction)

    def log_odds(x: Tensor) -> Tensor:  # log p - log(1 - p), p = exp(x)
        return x - torch.log(-torch.expm1(x))

    ratio = F.logsigmoid(log_odds(chosen) - log_odds(rejected))
    return _reduce(-chosen - beta * ratio, reduction)


def bradley_terry(chosen: Tensor, rejected: Tensor, *, margin: Tensor | float = 0.0,
                  center: float = 0.0, reduction: str = "mean") -> Tensor:
    """A reward model's loss on preference pairs (Bradley-Terry; InstructGPT):
    ``-log sigmoid(r_chosen - r_rejected - margin)``, plus ``center`` times ``(r_chosen +
    r_rejected)^2`` (TRL's ``center_rewards_coefficient``: keeps the rewards near 0, which
    the pairwise loss alone leaves free).

    Args:
        chosen, rejected: ``(B,)`` the rewards of each pair's preferred and dispreferred
            completion (e.g. a ``TransformerEncoder(out_dim=1)``'s output at the last
            token).
        margin: ``(B,)`` or a number: how much better the chosen must score (Llama 2's
            margin from the annotators' preference strength); 0: none.
        center: the centring term's weight (>= 0; TRL suggests 0.01).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` ``(B,)``.

    Example::

        >>> import torch
        >>> from torchfn import losses
        >>> losses.bradley_terry(torch.tensor([1.0]), torch.tensor([1.0]))   # a tie: log 2
        tensor(0.6931)
    """
    _check_pairs("bradley_terry", chosen=chosen, rejected=rejected)
    if isinstance(margin, Tensor) and margin.shape not in ((), chosen.shape):
        raise ValueError(f"margin must be a number or (B,) = {tuple(chosen.shape)}, got "
                         f"{tuple(margin.shape)}")
    if isinstance(center, bool) or not isinstance(center, (int, float)) or not center >= 0:
        raise ValueError(f"center must be a number >= 0, got {center!r}")
    _check_reduction(reduction)
    loss = -F.logsigmoid(chosen - rejected - margin)
    if center:
        loss = loss + center * (chosen + rejected) ** 2
    return _reduce(loss, reduction)
