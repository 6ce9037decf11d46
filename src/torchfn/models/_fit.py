"""The checks every checkpoint loader and exporter makes: a state dict that is one, the
tensors a module has, no others, each of its shape; with errors that name what is
missing, unused or misshapen. And the reading they share: a checkpoint's tensors sorted into
the global ones and each layer's (:func:`read_state`), and pieces joined: the q, k and v
projections into ``qkv``, experts' matrices into one."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["check_fit", "check_known", "check_params_for", "check_state_dict", "join_pieces",
           "join_qkv", "read_state", "stack_experts"]


def check_fit(want: Mapping[str, tuple], got: Mapping[str, Tensor], what: str) -> None:
    """``got`` holds exactly the names of ``want`` (name -> shape), each of its shape, or a
    ValueError: ``{what} does not fit the config: missing [...], unused [...], (name, got,
    want) [...]``."""
    shapes = {n: tuple(t.shape) for n, t in got.items()}
    missing, extra = sorted(set(want) - set(shapes)), sorted(set(shapes) - set(want))
    wrong = [(n, shapes[n], want[n]) for n in want if n in shapes and shapes[n] != want[n]]
    if missing or extra or wrong:
        raise ValueError(f"{what} does not fit the config: missing {missing[:5]}, unused "
                         f"{extra[:5]}, (name, got, want) {wrong[:3]}")


def param_shapes(module: nn.Module) -> dict[str, tuple]:
    """``{name: shape}`` of a module's parameters."""
    return {n: tuple(p.shape) for n, p in module.named_parameters()}


def check_params_for(build: Any, kwargs: Mapping[str, Any], params: Any) -> None:
    """``params`` fit the module ``build(**kwargs)`` (built on the meta device: no memory),
    for an exporter."""
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict of tensors, got {type(params).__name__}")
    with torch.device("meta"):
        want = param_shapes(build(**kwargs))
    check_fit(want, params, "params")


def check_state_dict(state_dict: Any) -> None:
    """``state_dict`` is None or a mapping, or a TypeError."""
    if state_dict is not None and not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict of tensors, got {type(state_dict).__name__}")


def check_known(unknown: list[str], family: str) -> None:
    """No checkpoint tensor went unread, or a ValueError naming the first five."""
    if unknown:
        raise ValueError(f"state_dict has tensors a {family} does not: {unknown[:5]}"
                         + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""))


def join_qkv(params: dict[str, Tensor]) -> None:
    """Each block's ``attn.{q,k,v}_proj.{weight,bias}`` in ``params`` (as a loader reads
    them) replaced by their rows stacked, ``attn.qkv.*`` ``[q | k | v]``; a trio with a
    piece missing is left as it is, for :func:`check_fit` to report."""
    blocks = {n.rsplit("attn.", 1)[0] for n in params if ".attn.q_proj." in n}
    for at in blocks:
        for kind in ("weight", "bias"):
            names = [f"{at}attn.{p}_proj.{kind}" for p in "qkv"]
            if all(n in params for n in names):
                params[f"{at}attn.qkv.{kind}"] = torch.cat([params.pop(n) for n in names])


def stack_experts(params: dict[str, Tensor], pieces: Mapping[str, Mapping[int, Tensor]],
                  experts: int | None) -> None:
    """Each of ``pieces``' names (ours, e.g. ``blocks.1.mlp.gate``) whose experts
    ``0 .. experts - 1`` all came (a checkpoint's one matrix each) put in ``params`` as one
    ``(E, ...)`` tensor; a name lacking some is left out, for :func:`check_fit` to report
    missing."""
    for name, parts in pieces.items():
        if sorted(parts) == list(range(experts or 0)):
            params[name] = torch.stack([parts[j] for j in range(len(parts))])


def read_state(tensors: Iterable[tuple[str, Tensor]], family: str, params: dict[str, Tensor],
               *, globals_: Mapping[str, str], tied: bool,
               read_layer: Callable[[str, str, Tensor], bool], layers: str = "model.layers.",
               ignore: Callable[[str], bool] | None = None,
               head: Collection[str] = ("head.weight",)) -> None:
    """A checkpoint's ``(name, tensor)`` pairs read into ``params`` (ours), in their order.

    A name in ``globals_`` (the checkpoint's name -> ours) is put in ``params`` under ours,
    but the head's (ours in ``head``) when ``tied``. A name ``{layers}{i}.{rest}`` goes to
    ``read_layer(i, rest, tensor)``, ``i`` the layer's number as the name writes it: the
    family's reader stores the tensor (in ``params``, or aside to join later) and returns
    True, or returns False for a name it does not know. The names neither reads, but those
    ``ignore`` says True of, are reported by :func:`check_known` under ``family``."""
    layer = re.compile(re.escape(layers) + r"(\d+)\.(.+)")
    unknown = []
    for name, tensor in tensors:
        match = layer.fullmatch(name)
        if name in globals_:
            if not (tied and globals_[name] in head):
                params[globals_[name]] = tensor
        elif not (match and read_layer(match[1], match[2], tensor)) and not (
                ignore is not None and ignore(name)):
            unknown.append(name)
    check_known(unknown, family)


def join_pieces(params: dict[str, Tensor], pieces: Mapping[str, Mapping[Any, Tensor]],
                experts: int | None = None) -> None:
    """Each of ``pieces``' names (ours) whose parts all came put in ``params`` as one tensor:
    parts ``"q"``, ``"k"`` and ``"v"`` joined, rows ``[q | k | v]``; parts ``0 .. experts -
    1`` (expert j's matrix) stacked, ``(E, ...)``. A name lacking some is left out, for
    :func:`check_fit` to report missing."""
    for name, parts in pieces.items():
        if set(parts) == set("qkv"):
            params[name] = torch.cat([parts[p] for p in "qkv"])
        elif sorted(parts) == list(range(experts or 0)):
            params[name] = torch.stack([parts[j] for j in range(len(parts))])
