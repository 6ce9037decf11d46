"""Mixed precision: a dtype ``Policy`` and loss scaling as pure pytrees.

    policy = Policy.from_string("params=float32,compute=bfloat16,output=float32")
    ls = DynamicLossScale()                       # 2**16, like torch.amp.GradScaler
    grads = ls.unscale(grad(lambda p: ls.scale(loss(policy.cast_to_compute(p), x)))(params))
    finite = all_finite(grads)                    # () bool tensor; skip the step if False
    ls = ls.adjust(finite)                        # same scale sequence as GradScaler.update()
    params = select_tree(finite, apply_updates(params, updates), params)

Loss scales are NamedTuples of 0-d tensors (config included), so they compile,
vmap and checkpoint with the rest of the train state; ``adjust`` uses
``torch.where`` only (no host sync).
"""

from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim._tree import tree_where

__all__ = [
    "Policy",
    "DynamicLossScale",
    "NoOpLossScale",
    "select_tree",
]

_DTYPES = {
    "float32": torch.float32, "f32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "f16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "f64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}  # fmt: skip
_KEYS = {
    "params": "param_dtype", "param": "param_dtype", "p": "param_dtype",
    "compute": "compute_dtype", "c": "compute_dtype",
    "output": "output_dtype", "o": "output_dtype",
}  # fmt: skip
_PRESETS = {
    "mixed_bfloat16": (torch.float32, torch.bfloat16, torch.float32),
    "mixed_float16": (torch.float32, torch.float16, torch.float32),
}


def _dtype(name: str, value: Any) -> torch.dtype:
    if isinstance(value, str):
        if value.strip().lower() not in _DTYPES:
            raise ValueError(f"{name}: unknown dtype {value!r}; expected one of {sorted(_DTYPES)}")
        value = _DTYPES[value.strip().lower()]
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(f"{name} must be a floating torch.dtype, got {value!r}")
    return value


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return optree.tree_map(cast, tree)


@dataclass(frozen=True)
class Policy:
    """Dtypes for parameters (storage), computation, and outputs.

    Only floating-point tensor leaves are cast; integers, bools and non-tensors pass.

    Example:
        >>> import torch
        >>> from torchfn.optim import Policy
        >>> policy = Policy.from_string("params=float32,compute=bfloat16,output=float32")
        >>> tree = {"w": torch.ones(2), "idx": torch.arange(2)}
        >>> cast = policy.cast_to_compute(tree)
        >>> cast["w"].dtype, cast["idx"].dtype
        (torch.bfloat16, torch.int64)
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, name, _dtype(name, getattr(self, name)))

    @classmethod
    def from_string(cls, spec: str) -> Policy:
        """``"params=float32,compute=bfloat16,output=float32"`` (keys p/c/o also work),
        a single dtype for all three (``"bf16"``), or a preset ``"mixed_bfloat16"`` /
        ``"mixed_float16"`` (float32 params and outputs)."""
        if not isinstance(spec, str):
            raise TypeError(f"spec must be a str, got {spec!r}")
        text = spec.strip().lower()
        if text in _PRESETS:
            return cls(*_PRESETS[text])
        if "=" not in text:
            dtype = _dtype("spec", text)
            return cls(dtype, dtype, dtype)
        fields: dict[str, torch.dtype] = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in _KEYS:
                raise ValueError(
                    f"spec: expected 'params=...,compute=...,output=...', got {spec!r} "
                    f"(bad part {part.strip()!r})"
                )
            fields[_KEYS[key]] = _dtype(key, value)
        return cls(**fields)

    def cast_to_param(self, tree: Any) -> Any:
        return _cast(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        return _cast(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        return _cast(tree, self.output_dtype)


def select_tree(pred: Tensor, on_true: Any, on_false: Any) -> Any:
    """Leafwise ``torch.where(pred, a, b)`` for a 0-d bool ``pred`` (no host sync)."""
    if optree.tree_structure(on_true) != optree.tree_structure(on_false):
        raise ValueError(
            f"on_true and on_false have different tree structures:\n"
            f"  on_true: {optree.tree_structure(on_true)}\n"
            f"  on_false: {optree.tree_structure(on_false)}"
        )
    return tree_where(torch.as_tensor(pred, dtype=torch.bool), on_true, on_false)


def _scale_tree(tree: Any, factor: Tensor) -> Any:
    return optree.tree_map(
        lambda x: x * factor if isinstance(x, Tensor) and x.is_floating_point() else x, tree
    )


class _DynamicFields(NamedTuple):
    loss_scale: Tensor  # () float32
    growth_factor: Tensor  # () float64
    backoff_factor: Tensor  # () float64
    growth_interval: Tensor  # () int32
    counter: Tensor  # () int32, finite steps since the last change


def _number(name: str, value: Any, ok: Any, expected: str) -> None:
    if isinstance(value, Tensor):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not ok(value):
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _new_dynamic(
    cls: type,
    init_scale: Any = 2.0**16,
    growth_factor: Any = 2.0,
    backoff_factor: Any = 0.5,
    growth_interval: Any = 2000,
    *,
    device: Any = None,
) -> Any:
    _number("init_scale", init_scale, lambda v: v > 0, "> 0")
    _number("growth_factor", growth_factor, lambda v: v > 1, "> 1")
    _number("backoff_factor", backoff_factor, lambda v: 0 < v < 1, "in (0, 1)")
    if not isinstance(growth_interval, Tensor) and (
        isinstance(growth_interval, bool)
        or not isinstance(growth_interval, numbers.Integral)
        or growth_interval < 1
    ):
        raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")

    def t(v: Any, dtype: torch.dtype) -> Tensor:
        return v if isinstance(v, Tensor) else torch.tensor(v, dtype=dtype, device=device)

    return tuple.__new__(
        cls,
        (
            t(init_scale, torch.float32),
            t(growth_factor, torch.float64),
            t(backoff_factor, torch.float64),
            t(growth_interval, torch.int32),
            torch.zeros((), dtype=torch.int32, device=device),
        ),
    )


class DynamicLossScale(_DynamicFields):
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s rule, as a pytree.

    After ``growth_interval`` finite steps in a row the scale is multiplied by
    ``growth_factor`` (if the result is finite); a non-finite step multiplies it by
    ``backoff_factor`` and restarts the count. ``device=`` places its tensors
    (e.g. with the params on the GPU, so ``adjust`` never syncs).

    Example:
        >>> import torch
        >>> from torchfn.optim import DynamicLossScale
        >>> ls = DynamicLossScale(init_scale=4.0, growth_interval=2)
        >>> ls = ls.adjust(torch.tensor(True)).adjust(torch.tensor(True))
        >>> float(ls.loss_scale)
        8.0
        >>> float(ls.adjust(torch.tensor(False)).loss_scale)
        4.0
    """

    __slots__ = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> DynamicLossScale:
        if len(args) == len(cls._fields) and not kwargs:
            # Rebuilt by a pytree library (optree, torch.utils._pytree, vmap's in_dims):
            # keep the leaves as given.
            return tuple.__new__(cls, args)
        return _new_dynamic(cls, *args, **kwargs)

    def _replace(self, **changes: Any) -> DynamicLossScale:
        # NamedTuple._replace is mis-traced by torch.compile for classes with a custom __new__.
        return self._make([changes.pop(f, v) for f, v in zip(self._fields, self)])

    def scale(self, tree: Any) -> Any:
        """Multiply floating leaves (e.g. the loss) by the loss scale."""
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: Any) -> Any:
        """Multiply floating leaves (e.g. grads) by ``1 / loss_scale`` (GradScaler's inverse)."""
        inv = self.loss_scale.double().reciprocal().float()
        return _scale_tree(tree, inv)

    def adjust(self, grads_finite: Any) -> DynamicLossScale:
        """The next loss scale after a step whose unscaled grads were finite or not."""
        finite = torch.as_tensor(grads_finite, dtype=torch.bool)
        successful = self.counter + 1
        grow = finite & (successful >= self.growth_interval)
        grown = (self.loss_scale.double() * self.growth_factor).float()
        backed = (self.loss_scale.double() * self.backoff_factor).float()
        scale = torch.where(grow & torch.isfinite(grown), grown, self.loss_scale)
        scale = torch.where(finite, scale, backed)
        counter = torch.where(finite & ~grow, successful, 0).to(torch.int32)
        return self._make(
            (scale, self.growth_factor, self.backoff_factor, self.growth_interval, counter)
        )


class NoOpLossScale(NamedTuple):
    """No loss scaling (the float32 / bfloat16 default): every method is the identity.

    Example:
        >>> import torch
        >>> from torchfn.optim import NoOpLossScale
        >>> NoOpLossScale().scale(torch.tensor(2.0))
        tensor(2.)
    """

    @property
    def loss_scale(self) -> Tensor:
        return torch.ones(())

    def scale(self, tree: Any) -> Any:
        return tree

    def unscale(self, tree: Any) -> Any:
        return tree

    def adjust(self, grads_finite: Any) -> NoOpLossScale:
        return self


DynamicLossScale.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    list(inspect.signature(_new_dynamic).parameters.values())[1:]
)
