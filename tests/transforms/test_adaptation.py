"""The warm-up's schedule is Stan's windowed adaptation, transition for transition: the
windows of ``windows(n)`` equal those of a replay of Stan's ``windowed_adaptation``
counters (its C++ logic, step by step) for every warm-up length up to 1500 (that the
learned mass is right is ``test_hmc``'s and ``test_nuts``'s to show); Stan's step-size
search lands where one step's acceptance crosses 0.8."""

from __future__ import annotations

import pytest
import torch
from torch.func import vmap

from torchfn import random
from torchfn.transforms._adaptation import windows


def _stan_windows(num_warmup: int) -> tuple[list[int], list[int]]:
    """Stan's counters replayed: the transitions whose draws enter the variance
    estimator, and those that end a window."""
    if num_warmup < 20:
        return [], []
    init, term, base = 75, 50, 25
    if init + base + term > num_warmup:
        init, term = int(0.15 * num_warmup), int(0.1 * num_warmup)
        base = num_warmup - (init + term)
    size, next_end = base, init + base - 1
    added, ended = [], []
    for counter in range(num_warmup):
        if init <= counter < num_warmup - term and counter != num_warmup:
            added.append(counter)
        if counter == next_end and counter != num_warmup:
            ended.append(counter)
            if next_end != num_warmup - term - 1:  # compute_next_window
                size *= 2
                next_end = counter + size
                if next_end != num_warmup - term - 1 and \
                        next_end + 2 * size >= num_warmup - term:
                    next_end = num_warmup - term - 1
    return added, ended


def test_windows_are_stans_for_every_warmup_length():
    for n in range(0, 1501):
        first, ends = windows(n)
        added, ended = _stan_windows(n)
        assert ends == ended, n
        assert (list(range(first, ends[-1] + 1)) if ends else []) == added, n
    assert windows(500) == (75, [99, 149, 249, 449])  # Stan's default: 25, 50, 100, 200


@pytest.mark.parametrize("n", [0, 5, 19])
def test_short_warmups_adapt_only_the_step_size(n):
    assert windows(n) == (n, [])


def test_the_step_size_search_lands_where_one_step_accepts_about_08():
    """Stan's ``init_stepsize`` on a 100-d standard Gaussian, from 1e-4 (doubling) and
    from 100 (halving): both land within a factor of 2 of the step where one leapfrog
    step's mean ``min(1, exp(H0 - H))`` crosses 0.8 (found here by a scan); under
    ``vmap`` (every search runs all its 24 masked steps) each chain's step is the eager one."""
    from torchfn.transforms._adaptation import search_step_size
    from torchfn.transforms._flat import Flat
    from torchfn.transforms._hmc import _energy_change, _Target
    from torchfn.transforms._metric import Metric

    x = random.normal(random.key(1), (100,), dtype=torch.float64)
    target = _Target(lambda v: -0.5 * (v ** 2).sum(), Flat(x, "t", "x"), "t")
    g, logp = target.grad_and_value(x)
    ones = Metric(torch.ones_like(x), dense=False)

    def change(state, j, eps, inv_mass):
        return _energy_change(target, *state, random.fold_in(random.key(2), j), eps,
                              inv_mass)

    def mean_accept(eps):
        return torch.stack([change((x, logp, g), 1000 + j, torch.tensor(eps), ones)
                            for j in range(100)]).clamp(max=0).exp().mean().item()

    grid = [2 ** (k / 4) for k in range(-12, 8)]
    crossing = next(e for e in grid if mean_accept(e) < 0.8)
    for start in (1e-4, 100.0):
        eps = search_step_size(change, (x, logp, g), torch.tensor(start, dtype=x.dtype),
                               ones, 0).item()
        assert crossing / 2 <= eps <= 2 * crossing, (start, eps, crossing)
    starts = torch.tensor([1e-4, 100.0, 0.3], dtype=torch.float64)
    batched = vmap(lambda e: search_step_size(change, (x, logp, g), e, ones, 0))(starts)
    for e, b in zip(starts, batched):
        assert b.item() == search_step_size(change, (x, logp, g), e, ones, 0).item()
