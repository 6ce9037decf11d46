"""Sharpness-aware minimisation (Foret et al. 2021), as a transform of a gradient
function, so it composes with ``vmap`` (m-sharpness), ``compile`` and any optimizer.

    g = grad L(p)
    e = rho g / ||g||                      (ASAM, ``adaptive=True``: rho p^2 g / ||p g||)
    sam gradient = grad L(p + e)

The update is then any optimizer's step on the SAM gradient, as the usual
``SAM(base_optimizer)`` wrapper does in two half-steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

__all__ = ["sam"]


def sam(grad_fn: Callable[..., Any], rho: float = 0.05, *, adaptive: bool = False,
        has_aux: bool = False) -> Callable[..., Any]:
    """``grad_fn(params, *args)`` -> the same gradient taken at SAM's perturbed params.

    Args:
        grad_fn: ``params, *args -> grads`` (e.g. ``torch.func.grad(loss_fn)``), or
            ``-> (grads, aux)`` with ``has_aux=True``; ``params`` is its first argument.
        rho: radius of the perturbation (>= 0; 0 gives ``grad_fn`` back).
        adaptive: ASAM (Kwon et al. 2021): the perturbation scaled by ``|p|``, so it
            does not depend on how the weights are scaled.
        has_aux: ``grad_fn`` returns ``(grads, aux)``; the aux of the perturbed call
            is returned.

    The norm is over all leaves together, as the reference implementation. Under
    ``vmap`` over chunks of the batch each chunk gets its own perturbation, which is
    m-sharpness (the paper's m-SAM).

    Example:
        >>> import torch
        >>> from torchfn import transforms
        >>> loss = lambda p, x: ((p["w"] * x) ** 2).sum()
        >>> g = transforms.sam(torch.func.grad(loss), rho=0.1)
        >>> p = {"w": torch.tensor([1.0, 0.0])}
        >>> g(p, torch.tensor([1.0, 1.0]))["w"]  # the gradient at w + 0.1 * g / |g|
        tensor([2.2000, 0.0000])
    """
    if not callable(grad_fn):
        raise TypeError(f"grad_fn must be callable (params, *args) -> grads, got {grad_fn!r}")
    if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not rho >= 0:
        raise ValueError(f"rho must be a number >= 0, got {rho!r}")

    def sam_grad(params: Any, *args: Any, **kwargs: Any) -> Any:
        out = grad_fn(params, *args, **kwargs)
        g = out[0] if has_aux else out
        p_leaves, spec = optree.tree_flatten(params)
        g_leaves = optree.tree_leaves(g)
        if len(g_leaves) != len(p_leaves):
            raise ValueError(
                f"sam: grad_fn returned {len(g_leaves)} leaves for {len(p_leaves)} params; "
                "it must return gradients with the params' structure"
                + ("" if has_aux else " (pass has_aux=True if it returns (grads, aux))")
            )
        if adaptive:
            scaled = [p.abs() * gi for p, gi in zip(p_leaves, g_leaves)]
        else:
            scaled = g_leaves
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(s) for s in scaled]))
        scale = rho / (norm + 1e-12)
        if adaptive:
            e = [p * p * gi * scale for p, gi in zip(p_leaves, g_leaves)]
        else:
            e = [gi * scale for gi in g_leaves]
        perturbed = optree.tree_unflatten(spec, [p + d.detach() for p, d in zip(p_leaves, e)])
        return grad_fn(perturbed, *args, **kwargs)

    return sam_grad
