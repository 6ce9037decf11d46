"""The warm-up shared by :func:`hmc` and :func:`nuts`: dual averaging of the step size
(Hoffman & Gelman, 2014, algorithm 5) and one window of draws for a diagonal mass
matrix (Stan's regularised variance estimate).

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


def warmup(transition: Transition, state: Any, position: Callable[[Any], Tensor],
           log_eps: Tensor, num_warmup: int, target_accept: float, adapt_mass: bool
           ) -> tuple[Any, Tensor, Tensor]:
    """``num_warmup`` transitions that tune ``log_eps`` to make the mean acceptance
    ``target_accept`` (constants ``gamma=0.05, t0=10, kappa=0.75``); with ``adapt_mass``,
    the positions of the middle of warm-up (15% to 75%) give the inverse mass (their
    variance, shrunk towards 1e-3) and dual averaging restarts there.

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
    window = (int(0.15 * num_warmup), int(0.75 * num_warmup))
    count, mean, m2 = 0, torch.zeros_like(x), torch.zeros_like(x)  # Welford
    for i in range(num_warmup):
        state, accept_prob = transition(state, i, log_eps.exp(), inv_mass)
        t += 1
        eta = 1.0 / (t + 10)
        h_bar = (1 - eta) * h_bar + eta * (target_accept - accept_prob)
        log_eps = mu - t ** 0.5 / 0.05 * h_bar
        weight = t ** -0.75
        log_eps_bar = weight * log_eps + (1 - weight) * log_eps_bar
        if adapt_mass and window[0] <= i < window[1]:
            x = position(state)
            count += 1
            delta = x - mean
            mean = mean + delta / count
            m2 = m2 + delta * (x - mean)
            if i == window[1] - 1 and count >= 2:
                var = m2 / (count - 1)
                inv_mass = (count / (count + 5.0)) * var + 1e-3 * (5.0 / (count + 5.0))
                mu, h_bar, log_eps_bar, t = restart(log_eps)
    step_size = log_eps_bar.exp() if num_warmup else log_eps.exp()
    return state, step_size, inv_mass
