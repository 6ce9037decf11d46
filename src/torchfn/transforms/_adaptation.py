"""The warm-up shared by :func:`hmc` and :func:`nuts`: dual averaging of the step size
(Hoffman & Gelman, 2014, algorithm 5) and Stan's windowed adaptation of a diagonal or dense mass
matrix (its regularised variance estimate): a fast initial buffer (75 transitions), slow
windows that double from 25 and each end in a new mass and a restart of dual averaging,
and a fast terminal buffer (50) for the final step size; short warm-ups scale the
buffers to 15% and 10% with one window between, as Stan does.

Everything is elementwise over leading chain dims: ``log_eps`` is ``()`` for one chain
or ``(C,)`` for ``C`` chains, each adapting on its own, exactly as if run alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from torchfn.core._lanes import all_lanes
from torchfn.transforms._metric import Metric

# Transition(state, i, step_size (...), metric) -> (state, accept_prob (...))
Transition = Callable[[Any, int, Tensor, Metric], tuple[Any, Tensor]]
# EnergyChange(state, j, step_size, metric) -> H0 - H (...) after one leapfrog step
# from ``state`` with the j-th fresh momentum (-inf for a NaN energy)
EnergyChange = Callable[[Any, int, Tensor, Metric], Tensor]

_LOG_08 = math.log(0.8)
_SEARCH_STEPS = 24  # doublings or halvings at most: 2**23 either way (Stan stops at 1e7)


def search_step_size(energy_change: EnergyChange, state: Any, eps: Tensor,
                     metric: Metric, first: int) -> Tensor:
    """Stan's ``init_stepsize`` heuristic: one leapfrog step with a fresh momentum; while
    ``exp(H0 - H)`` stays on the side of 0.8 it started on, double (above) or halve
    (below) the step. Per chain; a chain that has crossed keeps its step (a ``where``),
    and the loop ends once all have crossed, in every ``vmap`` lane (``core._lanes``;
    under ``torch.compile`` it runs all its steps). ``first`` numbers the momenta of
    this search."""
    up = energy_change(state, first, eps, metric) > _LOG_08
    done = torch.zeros_like(up)
    for j in range(1, _SEARCH_STEPS):
        if not torch.compiler.is_compiling() and all_lanes(done):
            break
        change = energy_change(state, first + j, eps, metric)
        done = done | torch.where(up, ~(change > _LOG_08), ~(change < _LOG_08))
        eps = torch.where(done, eps, torch.where(up, 2 * eps, 0.5 * eps))
    return eps


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


def warmup(transition: Transition, energy_change: EnergyChange, state: Any,
           position: Callable[[Any], Tensor], log_eps: Tensor, num_warmup: int,
           target_accept: float, adapt_mass: bool, dense: bool = False
           ) -> tuple[Any, Tensor, Metric]:
    """``num_warmup`` transitions that tune ``log_eps`` to make the mean acceptance
    ``target_accept`` (constants ``gamma=0.05, t0=10, kappa=0.75``); with ``adapt_mass``,
    the positions of each of Stan's slow windows give the inverse mass (their variance,
    or with ``dense`` their covariance, shrunk towards 1e-3 as Stan does). At the start
    and after each new mass, Stan's step-size search (:func:`search_step_size`) and a
    restart of dual averaging from it.

    Returns ``(state, step_size, metric)``: the step size is the averaged one
    (``log_eps.exp()`` as given when ``num_warmup`` is 0).
    """
    x = position(state)  # (..., n)
    metric = Metric.identity(x, dense)
    ten = torch.log(torch.tensor(10.0, dtype=x.dtype, device=x.device))

    def restart(log_eps: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
        zeros = torch.zeros_like(log_eps)
        return log_eps + ten, zeros, zeros, 0

    def search(log_eps: Tensor, metric: Metric, round_: int) -> Tensor:
        eps = search_step_size(energy_change, state, log_eps.exp(), metric,
                               round_ * _SEARCH_STEPS)
        return eps.log()

    if num_warmup:
        log_eps = search(log_eps, metric, 0)
    mu, h_bar, log_eps_bar, t = restart(log_eps)
    first, ends = windows(num_warmup) if adapt_mass else (num_warmup, [])
    count, mean, m2 = 0, torch.zeros_like(x), torch.zeros_like(metric.inv)  # Welford
    for i in range(num_warmup):
        state, accept_prob = transition(state, i, log_eps.exp(), metric)
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
            after = x - mean
            m2 = m2 + (delta[..., :, None] * after[..., None, :] if dense else delta * after)
            if i in ends:
                cov = m2 / (count - 1)
                shrink = 1e-3 * (5.0 / (count + 5.0))
                ridge = shrink * torch.eye(x.shape[-1], dtype=x.dtype, device=x.device) \
                    if dense else shrink
                metric = Metric((count / (count + 5.0)) * cov + ridge, dense)
                count, mean, m2 = 0, torch.zeros_like(x), torch.zeros_like(metric.inv)
                log_eps = search(log_eps, metric, 1 + ends.index(i))
                mu, h_bar, log_eps_bar, t = restart(log_eps)
    step_size = log_eps_bar.exp() if num_warmup else log_eps.exp()
    return state, step_size, metric
