"""Run a module's ``reset_parameters`` with randomness from a key, not torch's global RNG.

Every random ATen op (``uniform_``, ``normal_``, ``randperm``, ...) takes an
optional ``generator``. :class:`SeededRandom` is a ``TorchDispatchMode`` that
fills that slot with a private ``torch.Generator`` seeded from the key, so
``nn.init`` code runs unchanged and the global RNG is never read or advanced.
A random op without a generator slot is an error, never a silent global draw.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from torchfn.core import random

# overload of a random op -> its overload that takes a generator
_GENERATOR_OVERLOAD = {
    "default": "generator",
    "low": "low_generator",
    "names": "generator_with_names",
    "out": "generator_out",
    "low_out": "low_generator_out",
}


def seed_from_key(key: torch.Tensor) -> int:
    """A 63-bit integer seed from a key (reads two 32-bit words of ``random.bits``)."""
    words = random.bits(key, (2,)).to(torch.int64).tolist()
    hi, lo = (w & 0xFFFFFFFF for w in words)
    return ((hi << 32) | lo) & ((1 << 63) - 1)


class SeededRandom(TorchDispatchMode):
    """Route every random ATen op through generators seeded with ``seed``."""

    def __init__(self, seed: int):
        super().__init__()
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # init never runs under torch.compile; without this torch wraps the handler in
        # dynamo.disable, importing torch._dynamo (seconds) on the first Model(...)
        return False

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self.generators:
            self.generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self.generators[device]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if torch.Tag.nondeterministic_seeded not in func.tags or kwargs.get("generator"):
            return func(*args, **kwargs)
        if not any(a.name == "generator" for a in func._schema.arguments):
            name = _GENERATOR_OVERLOAD.get(func._overloadname)
            seeded = getattr(func.overloadpacket, name, None) if name else None
            if seeded is None:
                raise RuntimeError(
                    f"Model.init: reset_parameters calls the random op {func} that has no "
                    "generator argument, so it cannot be seeded from the key"
                )
            func = seeded
        device = kwargs.get("device")
        if device is None:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            device = tensors[0].device if tensors else torch.device("cpu")
        kwargs["generator"] = self._generator(torch.device(device))
        return func(*args, **kwargs)


def reset_calls(module: nn.Module) -> list[tuple[str, Callable[[], None]]]:
    """``(module name, reset)`` for every submodule with ``reset_parameters``
    (or, like ``nn.MultiheadAttention`` and ``nn.Transformer``, only the private
    ``_reset_parameters``), children before parents: the order in which the
    constructors ran them, so a parent's scheme overrides its children's.
    """
    calls: list[tuple[str, Callable[[], None]]] = []

    def visit(name: str, mod: nn.Module) -> None:
        for child_name, child in mod.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        fn = getattr(mod, "reset_parameters", None) or getattr(mod, "_reset_parameters", None)
        if callable(fn):
            calls.append((name, fn))

    visit("", module)
    return calls


def tensor_versions(module: nn.Module) -> dict[str, tuple[int, int]]:
    """name -> (id, version) of every parameter and buffer (ties under every name)."""
    named = list(module.named_parameters(remove_duplicate=False))
    named += list(module.named_buffers(remove_duplicate=False))
    return {n: (id(t), t._version) for n, t in named}


def written_names(
    before: dict[str, tuple[int, int]], module: nn.Module
) -> set[str]:
    """Names whose tensor was written in place or replaced since ``before``."""
    after = tensor_versions(module)
    return {n for n, v in after.items() if before.get(n) != v}
