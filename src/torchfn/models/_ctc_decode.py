"""Decoding a CTC model's per-frame outputs into label sequences: greedy (best path) or
prefix beam search (Hannun et al., 2014, without a language model)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["ctc_decode"]

_NEG = -math.inf


def _logaddexp(a: float, b: float) -> float:
    if a == _NEG:
        return b
    if b == _NEG:
        return a
    m = max(a, b)
    return m + math.log1p(math.exp(-abs(a - b)))


def _greedy(lp: list[list[float]], blank: int) -> tuple[list[int], float]:
    best = [max(range(len(row)), key=row.__getitem__) for row in lp]
    labels = [c for t, c in enumerate(best) if c != blank and (t == 0 or c != best[t - 1])]
    return labels, sum(row[c] for row, c in zip(lp, best))


def _add(beams: dict, prefix: tuple[int, ...], blank_lp: float = _NEG,
         label_lp: float = _NEG) -> None:
    b, n = beams.get(prefix, (_NEG, _NEG))
    beams[prefix] = (_logaddexp(b, blank_lp), _logaddexp(n, label_lp))


def _beam(lp: list[list[float]], blank: int, width: int) -> tuple[list[int], float]:
    # prefix -> (log p ending in blank, log p ending in its last label)
    beams: dict[tuple[int, ...], tuple[float, float]] = {(): (0.0, _NEG)}
    for row in lp:
        nxt: dict[tuple[int, ...], tuple[float, float]] = {}
        for prefix, (pb, pn) in beams.items():
            total = _logaddexp(pb, pn)
            _add(nxt, prefix, blank_lp=total + row[blank])
            for c, p in enumerate(row):
                if c == blank:
                    continue
                if prefix and prefix[-1] == c:  # a repeat needs a blank in between
                    _add(nxt, prefix + (c,), label_lp=pb + p)
                    _add(nxt, prefix, label_lp=pn + p)
                else:
                    _add(nxt, prefix + (c,), label_lp=total + p)
        ranked = sorted(nxt.items(), key=lambda kv: _logaddexp(*kv[1]), reverse=True)
        beams = dict(ranked[:width])
    prefix, (pb, pn) = max(beams.items(), key=lambda kv: _logaddexp(*kv[1]))
    return list(prefix), _logaddexp(pb, pn)


def ctc_decode(
    logits: Tensor,
    input_lengths: Tensor | None = None,
    *,
    blank: int = 0,
    beam_width: int = 1,
) -> list[tuple[list[int], float]]:
    """The most likely label sequence of each row of a CTC model's outputs.

    ``beam_width=1``: the best path (the argmax per frame, repeats merged, blanks
    dropped), scored by that path's log-probability. Otherwise prefix beam search: it
    sums over all the paths of each kept prefix, so its score is the prefix's
    log-probability ``-ctc_loss`` (exact for every prefix while no beam is pruned), and it
    finds sequences the best path misses when their probability is spread over paths.

    Args:
        logits: ``(B, T, C)`` (``log_softmax`` is applied over ``C``) or one ``(T, C)``.
        input_lengths: ``(B,)`` frames per row; None: all ``T``.
        blank: the blank class.
        beam_width: prefixes kept per frame (1: greedy).

    Returns:
        One ``(labels, log_probability)`` per row (a list of ``B``, or one pair for
        ``(T, C)``).

    Example::

        >>> import torch
        >>> # two frames, classes (blank, a): "a" has 0.6 * 0.4 * 2 + 0.4 * 0.4 = 0.64 > 0.36
        >>> probs = torch.tensor([[0.6, 0.4], [0.6, 0.4]])
        >>> ctc_decode(probs.log(), beam_width=1)[0]        # the best path is all blanks
        []
        >>> labels, score = ctc_decode(probs.log(), beam_width=4)
        >>> labels, round(score, 4) == round(float(torch.tensor(0.64).log()), 4)
        ([1], True)
    """
    if not isinstance(logits, Tensor) or not logits.dtype.is_floating_point or \
            logits.dim() not in (2, 3):
        got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"ctc_decode: logits must be a float (B, T, C) or (T, C) tensor, "
                         f"got {got}")
    single = logits.dim() == 2
    logits = logits.unsqueeze(0) if single else logits
    B, T, C = logits.shape
    if not isinstance(blank, int) or not 0 <= blank < C:
        raise ValueError(f"ctc_decode: blank must be a class index in [0, {C}), got {blank!r}")
    if not isinstance(beam_width, int) or isinstance(beam_width, bool) or beam_width < 1:
        raise ValueError(f"ctc_decode: beam_width must be an int >= 1, got {beam_width!r}")
    if input_lengths is None:
        lengths = [T] * B
    else:
        lengths = torch.as_tensor(input_lengths).reshape(-1).tolist()
        if len(lengths) != B or min(lengths) < 0 or max(lengths) > T:
            raise ValueError(f"ctc_decode: input_lengths must be {B} lengths in [0, {T}], "
                             f"got {lengths}")
    lp = torch.log_softmax(logits.detach().double(), -1).tolist()
    out = []
    for row, n in zip(lp, lengths):
        frames = row[:n]
        out.append(_greedy(frames, blank) if beam_width == 1 else
                   _beam(frames, blank, beam_width))
    return out[0] if single else out
