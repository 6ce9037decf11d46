"""DP-SGD (Abadi et al. 2016) as a gradient transformation, plus Poisson sampling.

``dp_sgd`` takes PER-EXAMPLE gradients (every leaf ``(B, *param_shape)``),
clips each example to L2 norm ``C`` over the whole pytree, sums, adds
``N(0, (sigma * C)^2)`` noise and divides by the expected batch size. It is a
torchopt-style ``GradientTransformation``, so it chains with any optimizer::

    >>> import torch
    >>> from torchfn import random
    >>> from torchfn.transforms import dp_sgd
    >>> dp = dp_sgd(l2_norm_clip=1.0, noise_multiplier=1.1, expected_batch_size=4,
    ...             key=random.key(0))
    >>> params = {"w": torch.zeros(3)}
    >>> state = dp.init(params)
    >>> per_example = {"w": torch.ones(4, 3)}            # (B, 3)
    >>> noisy_mean, state = dp.update(per_example, state, params)
    >>> noisy_mean["w"].shape
    torch.Size([3])

With an optimizer: ``optim.chain(dp_sgd(...), optim.sgd(0.1))``, or
:func:`make_dp_step` which also computes the per-example gradients.

Randomness: the noise of update ``t`` comes from ``fold_in(key, t)`` where the
step counter ``t`` lives in the state, so updates are pure and a resumed run
draws the same noise as an uninterrupted one.

Variable batch sizes (Poisson sampling)
---------------------------------------
The privacy analysis (:func:`rdp_epsilon`) assumes each example joins each
batch independently with probability ``q`` (:func:`poisson_sample`), so the
batch size varies (it may even be 0). The sum is divided by the EXPECTED batch
size ``q * N``, never the actual one (which would leak the batch size), and an
empty batch still gets its noise. In eager mode just pass the variable-size
batch. For a compiled step, whose shapes should stay fixed, pad the batch with
:func:`pad_batch` to a ``max_batch_size`` and pass the ``mask``: padded rows
get zero gradient and so contribute nothing (norm 0, clipped sum 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch.func import grad
from torchopt.base import GradientTransformation

from torchfn import random, tree
from torchfn.transforms._ghost import ghost_clip_grads
from torchfn.transforms._per_sample import (
    _vmap_call,
    clip_coefficients,
    per_sample_grad_norms,
    per_sample_grads,
)

__all__ = [
    "DPSGDState",
    "DPStep",
    "dp_sgd",
    "dp_noise",
    "make_dp_step",
    "poisson_sample",
    "pad_batch",
    "clip_and_sum",
]

PyTree = Any


class DPSGDState(NamedTuple):
    """State of :func:`dp_sgd` / :func:`dp_noise`: the base key and the update counter."""

    key: torch.Tensor  # (2,) base key, never changed
    step: torch.Tensor  # () int64, number of updates so far


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_dp_args(l2_norm_clip: float, noise_multiplier: float, expected_batch_size: float, key):
    if not _is_number(l2_norm_clip) or not math.isfinite(l2_norm_clip) or l2_norm_clip <= 0:
        raise ValueError(f"l2_norm_clip must be a finite number > 0, got {l2_norm_clip!r}")
    if (
        not _is_number(noise_multiplier)
        or not math.isfinite(noise_multiplier)
        or (noise_multiplier < 0)
    ):
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
    if (
        not _is_number(expected_batch_size)
        or not math.isfinite(expected_batch_size)
        or expected_batch_size < 1
    ):
        raise ValueError(f"expected_batch_size must be a number >= 1, got {expected_batch_size!r}")
    if not isinstance(key, torch.Tensor):
        raise TypeError(f"key must be a PRNG key tensor from torchfn.random.key, got {type(key)}")


def _batch_size(grads: PyTree, params: PyTree | None) -> int:
    """Leading batch size shared by every leaf; errors name the first offending leaf."""
    names = tree.paths(grads)
    leaves = tree.leaves(grads)
    if not leaves:
        raise ValueError("grads has no leaves")
    if params is not None:
        p_leaves = tree.leaves(params)
        if len(p_leaves) != len(leaves):
            raise ValueError(
                f"grads has {len(leaves)} leaves but params has {len(p_leaves)}: they must match"
            )
        for name, g, p in zip(names, leaves, p_leaves):
            if tuple(g.shape[1:]) != tuple(p.shape) or g.ndim != p.ndim + 1:
                want = "(" + ", ".join(["B", *map(str, p.shape)]) + ")"
                raise ValueError(
                    f"dp_sgd expects per-example grads with a leading batch dim: grads[{name!r}] "
                    f"must have shape {want}, got {tuple(g.shape)}"
                )
    b = None
    for name, g in zip(names, leaves):
        if g.ndim == 0:
            raise ValueError(
                f"dp_sgd expects per-example grads with a leading batch dim, grads[{name!r}] is a "
                "scalar"
            )
        if b is None:
            b = g.shape[0]
        elif g.shape[0] != b:
            raise ValueError(
                f"per-example grads must share the leading batch dim: {names[0]!r} has {b}, "
                f"{name!r} has {g.shape[0]}"
            )
    return int(b)


def clip_and_sum(per_example_grads: PyTree, l2_norm_clip: float) -> tuple[PyTree, torch.Tensor]:
    """Clip each example's gradient to global L2 norm ``C`` and sum over the batch.

    Args:
        per_example_grads: pytree of ``(B, *shape)`` leaves.
        l2_norm_clip: ``C``; example ``n`` is scaled by ``min(1, C / (||g_n|| + 1e-6))``.

    Returns:
        ``(clipped_sum, norms)``: leaves ``(*shape)`` and the unclipped norms ``(B,)``.

    Example::

        >>> import torch
        >>> from torchfn.transforms import clip_and_sum
        >>> grads = {"w": torch.tensor([[3.0, 4.0], [0.0, 0.5]])}   # (B, 2)
        >>> summed, norms = clip_and_sum(grads, l2_norm_clip=1.0)
        >>> norms.tolist()                                         # (B,), before clipping
        [5.0, 0.5]
        >>> [round(v, 4) for v in summed["w"].tolist()]            # [0.6, 0.8] + [0, 0.5]
        [0.6, 1.3]
    """
    leaves = tree.leaves(per_example_grads)
    acc = torch.float64 if any(g.dtype == torch.float64 for g in leaves) else torch.float32
    sq = sum(g.to(acc).pow(2).flatten(1).sum(1) if g.ndim > 1 else g.to(acc).pow(2)
             for g in leaves)  # (B,)
    norms = sq.sqrt()
    coef = clip_coefficients(norms, l2_norm_clip)  # (B,)
    # tree.map (not flatten/unflatten) keeps this traceable by torch.compile
    summed = tree.map(lambda g: torch.tensordot(coef.to(g.dtype), g, dims=1), per_example_grads)
    return summed, norms  # leaves (*shape), (B,)


def _noisy_mean(
    summed: PyTree, state: DPSGDState, std: float, expected_batch_size: float
) -> tuple[PyTree, DPSGDState]:
    # optree directly (as torchfn.tree does): tree.unflatten's type check and tree.map's
    # dict order both differ under torch.compile, and the noise must not depend on that
    leaves, spec = optree.tree_flatten(summed)
    if std == 0:  # noise_multiplier=0: no draw (not private; for debugging and tests)
        out = [s / expected_batch_size for s in leaves]
        return optree.tree_unflatten(spec, out), DPSGDState(state.key, state.step + 1)
    sizes = [s.numel() for s in leaves]
    dtype = torch.float64 if any(s.dtype == torch.float64 for s in leaves) else torch.float32
    # one draw for all leaves: a single threefry call (and kernel under torch.compile)
    flat = random.normal(random.fold_in(state.key, state.step), (sum(sizes),), dtype=dtype)
    noisy = [
        (s + std * n.reshape(s.shape).to(device=s.device, dtype=s.dtype)) / expected_batch_size
        for s, n in zip(leaves, torch.split(flat, sizes))
    ]
    return optree.tree_unflatten(spec, noisy), DPSGDState(state.key, state.step + 1)


def _init(key: torch.Tensor) -> Callable[[PyTree], DPSGDState]:
    def init(params: PyTree) -> DPSGDState:
        del params
        return DPSGDState(key, torch.zeros((), dtype=torch.int64, device=key.device))

    return init


def dp_sgd(
    l2_norm_clip: float,
    noise_multiplier: float,
    expected_batch_size: float,
    key: torch.Tensor,
) -> GradientTransformation:
    """DP-SGD aggregation of per-example gradients.

    ``update(per_example_grads, state, params=None)`` with leaves ``(B, *shape)``
    returns ``(sum_n clip(g_n) + N(0, (sigma C)^2)) / expected_batch_size`` with
    leaves ``(*shape)``. Pass ``params`` to ``update`` for a full shape check.

    Args:
        l2_norm_clip: ``C > 0``, the per-example L2 bound.
        noise_multiplier: ``sigma >= 0``; noise std is ``sigma * C``.
        expected_batch_size: ``q * N >= 1``, the denominator (see module docs).
        key: PRNG key; update ``t`` uses ``fold_in(key, t)``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.transforms import dp_sgd
        >>> dp = dp_sgd(l2_norm_clip=1.0, noise_multiplier=0.0, expected_batch_size=2,
        ...             key=random.key(0))             # sigma = 0: no noise, to show the clip
        >>> params = {"w": torch.zeros(2)}
        >>> state = dp.init(params)
        >>> per_example = {"w": torch.tensor([[3.0, 4.0], [0.0, 0.5]])}   # (B, 2)
        >>> mean, state = dp.update(per_example, state, params)           # leaves (2,)
        >>> [round(v, 4) for v in mean["w"].tolist()]   # ([0.6, 0.8] + [0, 0.5]) / 2
        [0.3, 0.65]
        >>> int(state.step)
        1
    """
    _check_dp_args(l2_norm_clip, noise_multiplier, expected_batch_size, key)
    std = noise_multiplier * l2_norm_clip

    def update(grads, state, params=None, inplace=None):  # inplace: torchopt's chain passes it
        del inplace
        _batch_size(grads, params)
        summed, _ = clip_and_sum(grads, l2_norm_clip)
        return _noisy_mean(summed, state, std, expected_batch_size)

    return GradientTransformation(_init(key), update)


def dp_noise(
    l2_norm_clip: float,
    noise_multiplier: float,
    expected_batch_size: float,
    key: torch.Tensor,
) -> GradientTransformation:
    """The noise half of :func:`dp_sgd`, for gradients that are ALREADY clipped sums.

    ``update(clipped_sum, state)`` (leaves ``(*shape)``, e.g. from
    :func:`ghost_clip_grads` with the same ``C``) returns
    ``(clipped_sum + N(0, (sigma C)^2)) / expected_batch_size``. The caller is
    responsible for the clipping: the guarantee holds only if each example's
    contribution to the sum has norm <= ``l2_norm_clip``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.transforms import dp_noise
        >>> dp = dp_noise(l2_norm_clip=1.0, noise_multiplier=1.1, expected_batch_size=4,
        ...               key=random.key(0))
        >>> params = {"w": torch.zeros(3)}
        >>> clipped_sum = {"w": torch.ones(3)}                     # shaped like params
        >>> noisy, state = dp.update(clipped_sum, dp.init(params), params)
        >>> noisy["w"].shape
        torch.Size([3])
        >>> again, _ = dp.update(clipped_sum, dp.init(params), params)   # same key and step
        >>> bool(torch.equal(noisy["w"], again["w"]))
        True
    """
    _check_dp_args(l2_norm_clip, noise_multiplier, expected_batch_size, key)
    std = noise_multiplier * l2_norm_clip

    def update(grads, state, params=None, inplace=None):
        del inplace
        if params is not None:
            for name, g, p in zip(tree.paths(grads), tree.leaves(grads), tree.leaves(params)):
                if tuple(g.shape) != tuple(p.shape):
                    raise ValueError(
                        f"dp_noise expects clipped sums shaped like params: grads[{name!r}] must "
                        f"have shape {tuple(p.shape)}, got {tuple(g.shape)}"
                    )
        return _noisy_mean(grads, state, std, expected_batch_size)

    return GradientTransformation(_init(key), update)


def _check_rate(sample_rate: float) -> None:
    if not _is_number(sample_rate) or not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")


def poisson_sample(key: torch.Tensor, n: int, sample_rate: float) -> torch.Tensor:
    """Poisson sampling: each of ``n`` examples joins the batch independently w.p. ``q``.

    Returns:
        ``indices: (b,)`` int64, sorted, with ``b ~ Binomial(n, q)`` (possibly 0).

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.transforms import poisson_sample
        >>> x, y = random.normal(random.key(1), (100, 3)), torch.arange(100)   # N = 100
        >>> idx = poisson_sample(random.fold_in(random.key(0), 0), len(x), 0.1)   # step 0
        >>> xb, yb = x[idx], y[idx]                                # about 10 rows
        >>> idx.dtype, bool((idx[1:] > idx[:-1]).all())            # sorted, no repeats
        (torch.int64, True)
        >>> poisson_sample(random.key(1), 5, 1.0).tolist()         # q = 1: everyone
        [0, 1, 2, 3, 4]
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    _check_rate(sample_rate)
    mask = random.bernoulli(key, sample_rate, (n,))  # (n,)
    return mask.nonzero().squeeze(1).to(torch.int64)


def pad_batch(indices: torch.Tensor, max_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad variable-size batch indices to a fixed size (for compiled steps).

    Returns:
        ``(indices (M,), mask (M,) bool)``: the real indices first, then index 0
        with ``mask=False``. Raises if the batch is larger than ``max_batch_size``
        (truncating it would break the privacy analysis).

    Example::

        >>> import torch
        >>> from torchfn.transforms import pad_batch
        >>> idx, mask = pad_batch(torch.tensor([3, 7, 9]), max_batch_size=5)
        >>> idx.tolist(), mask.tolist()                            # (M,), (M,)
        ([3, 7, 9, 0, 0], [True, True, True, False, False])
    """
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
    if indices.ndim != 1:
        raise ValueError(f"indices must be 1-D (b,), got shape {tuple(indices.shape)}")
    b = indices.shape[0]
    if b > max_batch_size:
        raise ValueError(
            f"the sampled batch has {b} examples, more than max_batch_size={max_batch_size}; "
            "raise max_batch_size (e.g. q*N + 5*sqrt(q*N))"
        )
    pad = max_batch_size - b
    idx = torch.cat([indices, indices.new_zeros(pad)])
    mask = torch.arange(max_batch_size, device=indices.device) < b
    return idx, mask


# Ghost clipping runs eagerly even inside torch.compile(step): it needs torch.autograd.grad
# and a TorchFunctionMode, which dynamo would break the graph on; the noise and the
# optimizer around it still compile.
_ghost_eager = torch._disable_dynamo(ghost_clip_grads)  # lazy: no dynamo import here


class DPStep(NamedTuple):
    """``init(params) -> opt_state``; ``step(params, opt_state, *batch, mask=None)
    -> (params, opt_state, loss)`` with ``loss`` the mean per-example loss."""

    init: Callable[[PyTree], Any]
    step: Callable[..., tuple[PyTree, Any, torch.Tensor]]


def _masked_mean(losses: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return losses.mean()
    m = mask.to(losses.dtype)
    return (losses * m).sum() / m.sum().clamp(min=1)


def make_dp_step(
    loss_fn: Callable[..., torch.Tensor],
    optimizer: GradientTransformation,
    *,
    l2_norm_clip: float,
    noise_multiplier: float,
    expected_batch_size: float,
    key: torch.Tensor,
    method: str = "vmap",
    chunk_size: int | None = None,
    in_dims: Sequence[Any] | None = None,
) -> DPStep:
    """A pure DP-SGD train step: per-example grads -> clip -> noise -> ``optimizer``.

    Three ways to get the clipped sum, all equal up to float rounding (and
    drawing the same noise from the same key):

    - ``"vmap"``: materialise per-example grads with :func:`per_sample_grads`,
      then :func:`dp_sgd`. Any model; memory ``B x #params``.
    - ``"two_pass"``: per-example NORMS with :func:`per_sample_grad_norms`,
      then one reweighted backward ``grad(sum_n c_n l_n)`` (``c_n`` the clip
      factors), then :func:`dp_noise`. Any model. Under ``torch.compile`` the
      norms fuse without materialising the gradients: the fastest compiled
      path for general models (about 20x the compiled ``"vmap"`` step on the
      784-512-256-10 MLP, see ``bench/test_bench_dp.py``).
    - ``"ghost"``: :func:`ghost_clip_grads` (Linear-only models), then
      :func:`dp_noise`; about the cost of a non-private step. Ghost clipping
      runs eagerly inside ``torch.compile(step)``; the noise and optimizer compile.

    Args:
        loss_fn: for ``"vmap"``/``"two_pass"``, ``loss_fn(params, *example) ->
            scalar`` for ONE example; for ``"ghost"``, ``loss_fn(params, *batch)
            -> (B,)`` per-example losses of a batched forward.
        optimizer: the non-private optimizer applied to the noisy mean gradient.
        l2_norm_clip, noise_multiplier, expected_batch_size, key: as in :func:`dp_sgd`.
        method: ``"vmap"``, ``"two_pass"`` or ``"ghost"``.
        chunk_size, in_dims: passed to :func:`per_sample_grads` (not for ``"ghost"``).

    The returned ``step(params, opt_state, *batch, mask=None)`` takes an
    optional ``(B,)`` bool ``mask`` (from :func:`pad_batch`): rows with
    ``False`` contribute nothing.

    Example::

        >>> import torch
        >>> from torchfn import optim, random
        >>> from torchfn.transforms import make_dp_step
        >>> def loss_fn(params, x, y):                       # one example: x (3,), y ()
        ...     return (x @ params["w"] - y) ** 2
        >>> dp = make_dp_step(loss_fn, optim.sgd(0.1), l2_norm_clip=1.0, noise_multiplier=1.1,
        ...                   expected_batch_size=8, key=random.key(0))
        >>> params = {"w": torch.zeros(3)}
        >>> opt_state = dp.init(params)
        >>> x, y = torch.ones(8, 3), torch.ones(8)            # x: (B, 3), y: (B,)
        >>> params, opt_state, loss = dp.step(params, opt_state, x, y)
        >>> params["w"].shape, loss.item()                    # loss before the update
        (torch.Size([3]), 1.0)

    ``torch.compile(dp.step)`` gives the same results, faster.
    """
    from torchfn import optim

    if method not in ("vmap", "two_pass", "ghost"):
        raise ValueError(f"method must be 'vmap', 'two_pass' or 'ghost', got {method!r}")
    if method == "ghost" and (chunk_size is not None or in_dims is not None):
        raise ValueError("chunk_size and in_dims do not apply to method='ghost'")
    if method == "vmap":
        dp = dp_sgd(l2_norm_clip, noise_multiplier, expected_batch_size, key)
        grads_fn = per_sample_grads(
            loss_fn, chunk_size=chunk_size, in_dims=in_dims, return_value=True
        )
    else:
        dp = dp_noise(l2_norm_clip, noise_multiplier, expected_batch_size, key)
    if method == "two_pass":
        norms_fn = per_sample_grad_norms(loss_fn, chunk_size=chunk_size, in_dims=in_dims)
    opt = optim.chain(dp, optimizer)

    def clipped_sum_two_pass(params, batch, mask):
        norms = norms_fn(params, *batch)  # (B,)
        coef = clip_coefficients(norms, l2_norm_clip).detach()  # (B,)
        if mask is not None:
            coef = coef * mask.to(coef.dtype)
        dims = in_dims if in_dims is not None else (None,) + (0,) * len(batch)

        def weighted(p):  # sum_n c_n l_n(p): its gradient is the clipped sum
            losses = _vmap_call(loss_fn, tuple(dims), chunk_size, (p, *batch))  # (B,)
            return (coef.to(losses.dtype) * losses).sum(), losses

        return grad(weighted, has_aux=True)(params)

    def step(params, opt_state, *batch, mask=None):
        if method == "vmap":
            grads, losses = grads_fn(params, *batch)  # leaves (B, *shape), (B,)
            if mask is not None:
                grads = tree.map(
                    lambda g: g * mask.to(g.dtype).reshape(-1, *([1] * (g.ndim - 1))), grads
                )
        elif method == "two_pass":
            grads, losses = clipped_sum_two_pass(params, batch, mask)  # leaves (*shape)
        else:
            grads, _, losses = _ghost_eager(
                loss_fn, params, *batch, l2_norm_clip=l2_norm_clip, weights=mask
            )
        updates, opt_state = opt.update(grads, opt_state, params=params)
        params = optim.apply_updates(params, updates)
        return params, opt_state, _masked_mean(losses.detach(), mask)

    return DPStep(opt.init, step)
