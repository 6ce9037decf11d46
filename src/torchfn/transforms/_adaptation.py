"""The warm-up shared by :func:`hmc` and :func:`nuts`: dual averaging of the step size
(Hoffman & Gelman, 2014, algorithm 5) and Stan's windowed adaptation of a diagonal mass
matrix (its regularised variance estimate): a fast initial buffer (75 transitions), slow
windows that double from 25 and each end in a new mass and a restart of dual averaging,
and a fast terminal buffer (50) for the final step size; short warm-ups scale the
buffers to 15% and 10% with one window between, as Stan does.

Everything is elementwise over leading chain dims: ``log_eps`` is ``()`` for one chain
or ``(C,)`` for ``C`` chains, each adapting on its own, exactly as if run alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

# Transition(state, i, step_size (...), inverse_mass (..., n)) -> (state, accept_prob (...))
Transition = Callable[[Any, int, Tensor, Tensor], tuple[Any, Tensor]]


def windows(num_warmup: int) -> tuple[int, list[int]]:
    """Stan's slow windows: ``(first, ends)``, the first transition of the first window
    and the last transition of each (inclusive); no window below 20 transitions."""
    if num_warmup < 20:
        return num_warmup, []
    init, term, base = 75, 50, 25
    if init + base + term > num_warmup:
        init, term = int(0.15 * num_warmup), int(0.1 * num_warmup)
        base = num_warmup - (init + term)
    last = num_warmup - term - 1
    ends, size, end = [], base, init + base - 1
    while True:
        ends.append(end)
        if end >= last:
            return init, ends
        size *= 2
        end = end + size
        if end + 2 * size >= last + 1:  # the next one would not fit: stretch this one
            end = last


def warmup(transition: Transition, state: Any, position: Callable[[Any], Tensor],
           log_eps: Tensor, num_warmup: int, target_accept: float, adapt_mass: bool
           ) -> tuple[Any, Tensor, Tensor]:
    """``num_warmup`` transitions that tune ``log_eps`` to make the mean acceptance
    ``target_accept`` (constants ``gamma=0.05, t0=10, kappa=0.75``); with ``adapt_mass``,
    the positions of each of Stan's slow windows give the inverse mass (their variance,
    shrunk towards 1e-3), and dual averaging restarts at each window's end.

    Returns ``(state, step_size, inverse_mass)``: the step size is the averaged one
    (``log_eps.exp()`` as given when ``num_warmup`` is 0).
    """
    x = position(state)  # (..., n)
    inv_mass = torch.ones_like(x)
    ten = torch.log(torch.tensor(10.0, dtype=x.dtype, device=x.device))

    def restart(log_eps: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
        zeros = torch.zeros_like(log_eps)
        return log_eps + ten, zeros, zeros, 0

    mu, h_bar, log_eps_bar, t = restart(log_eps)
    first, ends = windows(num_warmup) if adapt_mass else (num_warmup, [])
    count, mean, m2 = 0, torch.zeros_like(x), torch.zeros_like(x)  # Welford
    for i in range(num_warmup):
        state, accept_prob = transition(state, i, log_eps.exp(), inv_mass)
        t += 1
        eta = 1.0 / (t + 10)
        h_bar = (1 - eta) * h_bar + eta * (target_accept - accept_prob)
        log_eps = mu - t ** 0.5 / 0.05 * h_bar
        weight = t ** -0.75
        log_eps_bar = weight * log_eps + (1 - weight) * log_eps_bar
        if ends and first <= i <= ends[-1]:
            x = position(state)
            count += 1
            delta = x - mean
            mean = mean + delta / count
            m2 = m2 + delta * (x - mean)
            if i in ends:
                var = m2 / (count - 1)
                inv_mass = (count / (count + 5.0)) * var + 1e-3 * (5.0 / (count + 5.0))
                count, mean, m2 = 0, torch.zeros_like(x), torch.zeros_like(x)
                mu, h_bar, log_eps_bar, t = restart(log_eps)
    step_size = log_eps_bar.exp() if num_warmup else log_eps.exp()
    return state, step_size, inv_mass
