"""Federated averaging (McMahan et al. 2017): clients train locally from the global
parameters, all at once under ``vmap``, and the server takes their weighted mean."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch import Tensor
from torch.func import vmap

from torchfn import random, tree
from torchfn.transforms._ensemble import ensemble_size

__all__ = ["fedavg", "local_train", "federated_round"]


def _inspectable(t: Tensor) -> bool:
    """Eager, outside torch.func transforms and torch.compile: values may be read."""
    return not (
        torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(t)
    )


def _check_weights(weights: Any, n: int) -> Tensor | None:
    if weights is None:
        return None
    w = torch.as_tensor(weights)
    if not (w.dtype.is_floating_point or w.dtype in (torch.int32, torch.int64)):
        raise TypeError(f"weights must be real numbers, got dtype {w.dtype}")
    if w.shape != (n,):
        raise ValueError(f"weights must have shape ({n},), one per client, got {tuple(w.shape)}")
    if _inspectable(w):
        if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
            raise ValueError(f"weights must be finite and non-negative, got {w.tolist()}")
        if not float(w.sum()) > 0:
            raise ValueError(f"weights must sum to > 0, got {w.tolist()} (sum {float(w.sum())})")
    return w


def fedavg(client_params: Any, weights: Any = None) -> Any:
    """The weighted mean ``sum_c w_c p_c / sum_c w_c`` of client parameter trees.

    Args:
        client_params: a stacked pytree (leaves ``(C, ...)``, e.g. from
            :func:`local_train`) or a list of ``C`` same-structure pytrees.
        weights: ``(C,)`` non-negative with a positive sum (typically each client's
            number of examples), or ``None`` for the plain mean.

    Returns:
        One pytree with the clients' structure (leaves without the ``C`` dim), in
        the leaves' dtypes.

    Example::

        >>> clients = [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 6.0])}]
        >>> fedavg(clients, weights=[1, 3])
        {'w': tensor([2.5000, 5.0000])}
    """
    if isinstance(client_params, (list, tuple)) and not hasattr(client_params, "_fields"):
        if len(client_params) == 0:
            raise ValueError("client_params must hold at least one client, got an empty list")
        client_params = tree.stack(list(client_params))
    n = ensemble_size(client_params, name="client_params")
    w = _check_weights(weights, n)

    def mean(leaf: Tensor) -> Tensor:
        if not leaf.is_floating_point():
            raise TypeError(f"client_params must have floating-point leaves, got {leaf.dtype}")
        if w is None:
            return leaf.mean(0)
        wl = w.to(dtype=leaf.dtype, device=leaf.device)
        return torch.tensordot(wl / wl.sum(), leaf, dims=1)

    return optree.tree_map(mean, client_params)


def local_train(
    local_step: Callable[[Any, Any, Tensor], Any],
    global_params: Any,
    client_data: Any,
    key: Tensor,
    local_steps: int,
) -> Any:
    """Run ``local_steps`` of ``local_step`` on every client from ``global_params``,
    vmapped over clients: returns the clients' parameters stacked ``(C, ...)``.

    Client ``c`` runs ``p <- local_step(p, data_c, fold_in(key_c, s))`` for
    ``s = 0 .. local_steps - 1``, with ``key_c = random.split(key, C)[c]`` and
    ``data_c`` the ``c``-th slice of every ``client_data`` leaf. ``local_step`` gets
    the client's whole data set and a fresh key, so it can draw its own mini-batch
    (e.g. ``random.randint(k, (b,), 0, n)``). Clients need equally shaped data (pad,
    and weight by the true sizes in :func:`fedavg`).

    Args:
        local_step: ``(params, data, key) -> params``, one client's SGD step, written
            with ``torch.func.grad`` (it runs inside ``vmap``).
        global_params: the server's parameter pytree.
        client_data: pytree whose leaves are ``(C, ...)``.
        key: a ``torchfn.random`` key.
        local_steps: ``>= 1``.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.transforms import local_train
        >>> def local_step(p, data, k):                     # data: (x (n, 3), y (n,))
        ...     x, y = data
        ...     g = torch.func.grad(lambda p: ((x @ p["w"] - y) ** 2).mean())(p)
        ...     return {"w": p["w"] - 0.1 * g["w"]}
        >>> kx, ky = torchfn.random.split(torchfn.random.key(1))
        >>> data = (torchfn.random.normal(kx, (4, 10, 3)),      # 4 clients, 10 examples each
        ...         torchfn.random.normal(ky, (4, 10)))
        >>> clients = local_train(local_step, {"w": torch.zeros(3)}, data,
        ...                       torchfn.random.key(0), local_steps=5)
        >>> clients["w"].shape                                # (C, 3)
        torch.Size([4, 3])
    """
    if not callable(local_step):
        raise TypeError(f"local_step must be callable, got {type(local_step).__name__}")
    if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
        raise ValueError(f"local_steps must be an int >= 1, got {local_steps!r}")
    n = ensemble_size(client_data, name="client_data")  # C
    keys = random.split(key, n)  # (C, 2)

    def client(data: Any, k: Tensor) -> Any:
        p = global_params
        for s in range(local_steps):
            p = local_step(p, data, random.fold_in(k, s))
        return p

    return vmap(client)(client_data, keys)


def federated_round(
    local_step: Callable[[Any, Any, Tensor], Any],
    global_params: Any,
    client_data: Any,
    key: Tensor,
    local_steps: int,
    weights: Sequence[float] | Tensor | None = None,
) -> Any:
    """One FedAvg round: :func:`local_train` on every client, then :func:`fedavg`.

    Returns the new global parameters. Arguments as in :func:`local_train` and
    :func:`fedavg`.

    Example::

        >>> import torchfn
        >>> def local_step(p, data, k):                        # data: (x (n, 3), y (n,))
        ...     x, y = data
        ...     g = torch.func.grad(lambda p: ((x @ p["w"] - y) ** 2).mean())(p)
        ...     return {"w": p["w"] - 0.1 * g["w"]}
        >>> kx, ky = torchfn.random.split(torchfn.random.key(1))
        >>> data = (torchfn.random.normal(kx, (4, 10, 3)),      # 4 clients, 10 examples each
        ...         torchfn.random.normal(ky, (4, 10)))
        >>> params = federated_round(local_step, {"w": torch.zeros(3)}, data,
        ...                          torchfn.random.key(0), local_steps=5)
    """
    if weights is not None:  # fail before the (long) local training
        _check_weights(weights, ensemble_size(client_data, name="client_data"))
    return fedavg(local_train(local_step, global_params, client_data, key, local_steps), weights)
