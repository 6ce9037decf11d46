"""``Model``: any ``torch.nn.Module`` as a pure ``init(key)`` / ``apply(params, ...)`` pair.

    >>> import torch
    >>> from torch import nn
    >>> import torchfn
    >>> from torchfn import random
    >>> model = torchfn.Model(nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.1), nn.Linear(8, 1)))
    >>> params = model.init(random.key(0))           # {'0.weight': (8, 3), ...}
    >>> x = torch.ones(5, 3)
    >>> model.apply(params, x).shape                 # eval mode: deterministic
    torch.Size([5, 1])
    >>> loss = lambda p: model.apply(p, x, key=random.key(1), train=True)[0].square().mean()
    >>> grads = torch.func.grad(loss)(params)        # same names as params

Parameters are a flat dict keyed by ``state_dict`` names; buffers (BatchNorm
running statistics) are a separate ``state`` dict from :meth:`Model.init_state`.
Nothing is mutated: ``apply`` returns the new state instead.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from torchfn.core import _keyed_init
from torchfn.core._dropout import KeyedRandomness, forward_ad_active
from torchfn.core._swap import Slots

__all__ = ["Model"]

Params = dict[str, torch.Tensor]
State = dict[str, torch.Tensor]


def _meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers live on the meta
    device (no data is copied; ties between tensors are kept)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


class Model:
    """A pure view of an ``nn.Module``: ``init(key) -> params``, ``apply(params, *inputs)``.

    Args:
        module: any ``torch.nn.Module``. It is never mutated; ``Model`` keeps a
            private skeleton of it on the meta device (plus copies of the few
            tensors that ``init`` cannot recreate, see below).

    Parameters (``params``) are a flat dict ``{state_dict name: tensor}``.
    Tied parameters (one tensor under two names, e.g. an embedding shared
    with the output layer) appear ONCE, under their first name as in
    ``module.named_parameters()``; :attr:`tied` maps each other name to it and
    :meth:`state_dict` expands them again for ``module.load_state_dict``.

    Buffers are ``state``: a dict of the persistent buffers (the ones in
    ``state_dict``; empty when the module has none). Non-persistent buffers
    (causal masks, rotary tables) are constants held by the ``Model``, copied
    from the module as given.

    ``init(key)`` runs each submodule's ``reset_parameters`` (or
    ``_reset_parameters``, as ``nn.MultiheadAttention`` has) children first, on
    a CPU copy, with every random draw taken from a ``torch.Generator`` seeded
    from ``key`` -- so it follows the module's own init scheme, is
    deterministic in the key, and never touches torch's global RNG. The result
    is moved to the device and dtype of the original tensors. Tensors that no
    ``reset_parameters`` writes (a ``nn.Parameter`` created directly in a
    user's ``__init__``) are copied from the module as given, the same for
    every key; a warning at construction names such parameters
    (:attr:`copied` lists all of them). Give their module a
    ``reset_parameters`` to have them drawn from the key. ``init`` uses Python
    control flow and ``.item()``: for an ensemble, stack a loop
    (``tree.stack([model.init(k) for k in random.split(key, n)])``), do not
    ``vmap`` it.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> import torchfn
        >>> from torchfn import random
        >>> model = torchfn.Model(nn.Linear(3, 2))
        >>> params = model.init(random.key(0))             # {'weight': (2, 3), 'bias': (2,)}
        >>> sorted(params)
        ['bias', 'weight']
        >>> model.apply(params, torch.ones(5, 3)).shape    # (B, 2)
        torch.Size([5, 2])
        >>> bool(torch.equal(model.init(random.key(0))["weight"], params["weight"]))
        True
    """

    def __init__(self, module: nn.Module):
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if isinstance(t, nn.parameter.UninitializedTensorMixin):
                raise ValueError(
                    f"module: {name!r} is an uninitialized lazy tensor; run one forward "
                    "pass (or build the module with explicit sizes) before Model(module)"
                )
        self._module_type = type(module).__name__
        skeleton = _meta_copy(module)
        # two skeletons, so apply never flips .training on a shared module
        self._train_skeleton = copy.deepcopy(skeleton).train()
        self._eval_skeleton = copy.deepcopy(skeleton).eval()
        self._skeleton = skeleton

        self._param_names = [n for n, _ in module.named_parameters()]
        canonical = {id(p): n for n, p in module.named_parameters()}
        self.tied: dict[str, str] = {
            n: canonical[id(p)]
            for n, p in module.named_parameters(remove_duplicate=False)
            if canonical[id(p)] != n
        }
        sd_names = set(module.state_dict().keys())
        self._state_names = [n for n, _ in module.named_buffers() if n in sd_names]
        self._const_names = [n for n, _ in module.named_buffers() if n not in sd_names]
        self._meta = {
            n: (tuple(t.shape), t.dtype, t.device if t.device.type != "meta" else None)
            for n, t in [*module.named_parameters(), *module.named_buffers()]
        }
        self._rnn_dropout = [
            n for n, m in module.named_modules() if isinstance(m, nn.RNNBase) and m.dropout > 0
        ]

        # Which tensors does reset_parameters write? Dry run on the meta skeleton.
        self._writes = self._dry_run(skeleton)
        covered = set().union(*self._writes) if self._writes else set()
        named = dict(module.named_parameters())
        named.update(module.named_buffers())
        self.copied: tuple[str, ...] = tuple(n for n in named if n not in covered)
        for n in self.copied:
            if named[n].device.type == "meta":
                raise ValueError(
                    f"module: {n!r} lives on the meta device and no reset_parameters "
                    "initialises it, so Model.init has no values for it"
                )
        # snapshot what init cannot recreate, and the constant buffers
        keep = set(self.copied) | set(self._const_names)
        self._fixed = {n: named[n].detach().clone() for n in named if n in keep}
        self._consts = {n: self._fixed[n] for n in self._const_names}
        self._train_slots, self._eval_slots = (
            _slots(s, self._param_names, self.tied, self._state_names, self._const_names)
            for s in (self._train_skeleton, self._eval_skeleton))
        uncovered_params = [n for n in self._param_names if n in self.copied]
        if uncovered_params:
            warnings.warn(
                f"Model({self._module_type}): parameters {uncovered_params} are not set by any "
                "reset_parameters; init(key) copies them from the module as given (the same "
                "for every key). Define reset_parameters on their module to draw them from "
                "the key.",
                stacklevel=2,
            )

    # ------------------------------------------------------------------ init

    @staticmethod
    def _dry_run(skeleton: nn.Module) -> list[set[str]]:
        """Per reset call (children first): the names it writes, found on meta."""
        probe = copy.deepcopy(skeleton)
        writes = []
        try:
            with torch.no_grad(), _keyed_init.SeededRandom(0):
                for _, fn in _keyed_init.reset_calls(probe):
                    before = _keyed_init.tensor_versions(probe)
                    fn()
                    writes.append(_keyed_init.written_names(before, probe))
            return writes
        except Exception:  # a reset that needs real data: probe on CPU instead
            probe = copy.deepcopy(skeleton).to_empty(device="cpu")
            writes = []
            with torch.no_grad(), _keyed_init.SeededRandom(0):
                for _, fn in _keyed_init.reset_calls(probe):
                    before = _keyed_init.tensor_versions(probe)
                    fn()
                    writes.append(_keyed_init.written_names(before, probe))
            return writes

    def _materialize(self, only_buffers: bool = False) -> nn.Module:
        """A CPU copy with constants filled in, after running the resets under the
        active seeded-random mode (all of them, or only those writing buffers)."""
        module = copy.deepcopy(self._skeleton)
        calls = _keyed_init.reset_calls(module)
        if only_buffers:
            buffer_names = set(self._state_names) | set(self._const_names)
            chosen = [i for i, w in enumerate(self._writes) if w & buffer_names]
            for i in chosen:
                module.get_submodule(calls[i][0]).to_empty(device="cpu")
            calls = [calls[i] for i in chosen]
        else:
            module.to_empty(device="cpu")
        with torch.no_grad():
            for _, fn in calls:
                fn()
        return module

    def _finish(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if name in self._fixed:
            return self._fixed[name].clone()
        _, dtype, device = self._meta[name]
        return t.detach().to(device=device or "cpu", dtype=dtype)

    def init(self, key: torch.Tensor) -> Params:
        """Fresh parameters ``{name: tensor}`` drawn with the module's own init scheme.

        Deterministic in ``key``; different keys give different parameters.
        """
        key = _check_key(key, "init")
        if torch._C._functorch.is_functorch_wrapped_tensor(key):
            raise ValueError(
                "Model.init reads its key to seed the module's own initialisers, so it cannot "
                "run under vmap (or another torch.func transform): for a stack of "
                "initialisations use transforms.ensemble_init(model, key, n), or a loop and "
                "torchfn.tree.stack"
            )
        seed = _keyed_init.seed_from_key(key)
        with _keyed_init.SeededRandom(seed):
            module = self._materialize()
        named = dict(module.named_parameters())
        return {n: self._finish(n, named[n]) for n in self._param_names}

    def init_state(self) -> State:
        """Fresh persistent buffers ``{name: tensor}`` (``{}`` when there are none),
        e.g. BatchNorm's ``running_mean`` zeros, ``running_var`` ones."""
        if not self._state_names:
            return {}
        with _keyed_init.SeededRandom(0):
            module = self._materialize(only_buffers=True)
        named = dict(module.named_buffers())
        return {n: self._finish(n, named[n]) for n in self._state_names}

    def extract(self, module: nn.Module) -> tuple[Params, State]:
        """``(params, state)``: detached copies of a module's current tensors (for
        example a pretrained one of the same architecture), in this model's format."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        named = dict(module.named_parameters())
        named.update(module.named_buffers())
        expected = self._param_names + self._state_names
        missing = [n for n in expected if n not in named]
        if missing:
            raise ValueError(f"module: lacks tensors {missing} that the model has")
        for n in expected:
            if tuple(named[n].shape) != self._meta[n][0]:
                raise ValueError(
                    f"module: {n!r} has shape {tuple(named[n].shape)}, "
                    f"expected {self._meta[n][0]}"
                )
        params = {n: named[n].detach().clone() for n in self._param_names}
        state = {n: named[n].detach().clone() for n in self._state_names}
        return params, state

    def state_dict(self, params: Params, state: State | None = None) -> dict[str, torch.Tensor]:
        """``params`` and ``state`` as one dict with every ``module.state_dict()``
        name (tied names included), ready for ``module.load_state_dict``."""
        self._check_params(params)
        state = self._check_state(state, train=False, required=True)
        out = dict(params)
        for alias, name in self.tied.items():
            out[alias] = params[name]
        out.update(state)
        return out

    # ----------------------------------------------------------------- apply

    def apply(
        self,
        params: Params,
        *inputs: Any,
        state: State | None = None,
        key: torch.Tensor | None = None,
        train: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Run the module's forward with ``params`` (and ``state``) as its tensors.

        Args:
            params: ``{name: tensor}`` from :meth:`init` (or a transformed copy).
            *inputs, **kwargs: passed to the module's ``forward``.
            state: persistent buffers from :meth:`init_state`; required when the
                module has any.
            key: a ``torchfn.random`` key for dropout (and attention dropout);
                the ``i``-th stochastic call uses ``fold_in(key, i)``. Needed when
                ``train=True`` and the module has active dropout.
            train: train-mode semantics (``module.train()``): dropout on,
                BatchNorm uses batch statistics and updates its running ones.

        Returns:
            ``out`` when ``train=False``; ``(out, new_state)`` when ``train=True``.
            ``state`` itself is never modified (BatchNorm's in-place updates go
            to clones, returned as ``new_state``).

        Works under ``grad``, ``vmap``, ``jacrev``, ``jvp`` and ``torch.compile``.
        ``vmap`` over data with unbatched BatchNorm state in train mode fails
        (BatchNorm would write per-example statistics into one buffer); use
        eval mode, or ``vmap`` over state too.
        """
        if not isinstance(train, bool):
            raise TypeError(f"train must be a bool, got {train!r}")
        self._check_params(params)
        state = self._check_state(state, train=train, required=True)
        if key is not None:
            _check_key(key, "apply")
        if train and self._rnn_dropout:
            raise ValueError(
                f"train: RNN modules {self._rnn_dropout} have dropout > 0 between layers, which "
                "torch draws from its global RNG inside the fused kernel; torchfn cannot key "
                "it. Use dropout=0 in the RNN and an nn.Dropout between single-layer RNNs"
            )
        skeleton = self._train_skeleton if train else self._eval_skeleton
        new_state = {n: t.clone() for n, t in state.items()}  # functional_call writes in place
        tensors = {**params, **new_state, **self._consts}
        slots = self._train_slots if train else self._eval_slots
        if slots is None or torch.compiler.is_compiling():  # dynamo traces functional_call
            def run():
                return torch.func.functional_call(skeleton, tensors, inputs, kwargs,
                                                  strict=False)
        else:  # the same swaps, looked up once (functional_call: ~0.37 ms a call)
            def run():
                return slots.call(skeleton, tensors, inputs, kwargs)
        jvp = forward_ad_active()
        if train or key is not None or jvp:
            with KeyedRandomness(key, math_attention=jvp):
                out = run()
        else:
            out = run()
        return (out, new_state) if train else out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.apply(*args, **kwargs)

    # ---------------------------------------------------------------- checks

    def _check_params(self, params: Any) -> None:
        if not isinstance(params, Mapping):
            raise TypeError(
                f"params must be a dict {{name: tensor}} from Model.init, got "
                f"{type(params).__name__}"
            )
        if params.keys() != set(self._param_names):
            missing = [n for n in self._param_names if n not in params]
            extra = [n for n in params if n not in self._meta or n in self._state_names]
            tied = [n for n in params if n in self.tied]
            hint = f"; tied names {tied} must be left out" if tied else ""
            raise ValueError(
                f"params: names do not match the {self._module_type}'s parameters: "
                f"missing {missing}, unexpected {extra}{hint}"
            )
        self._check_entries("params", params, self._param_names)

    def _check_entries(self, what: str, tree: Mapping, names: list[str]) -> None:
        """Every ``tree[name]`` is a tensor of the module's shape for that name."""
        for n in names:
            t = tree[n]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what}[{n!r}] must be a tensor, got {type(t).__name__}")
            if tuple(t.shape) != self._meta[n][0]:
                raise ValueError(
                    f"{what}[{n!r}] has shape {tuple(t.shape)}, expected {self._meta[n][0]}"
                )

    def _check_state(self, state: Any, *, train: bool, required: bool) -> State:
        if state is None:
            if self._state_names and required:
                raise ValueError(
                    f"state: the {self._module_type} has buffers {self._state_names[:4]}"
                    f"{' ...' if len(self._state_names) > 4 else ''}; pass "
                    "state=model.init_state() (or the new_state of a train step)"
                )
            return {}
        if not isinstance(state, Mapping):
            raise TypeError(
                f"state must be a dict {{name: tensor}} from Model.init_state, got "
                f"{type(state).__name__}"
            )
        if state.keys() != set(self._state_names):
            missing = [n for n in self._state_names if n not in state]
            extra = [n for n in state if n not in self._state_names]
            raise ValueError(
                f"state: names do not match the {self._module_type}'s buffers: "
                f"missing {missing}, unexpected {extra}"
            )
        self._check_entries("state", state, self._state_names)
        return dict(state)

    def __repr__(self) -> str:
        n = sum(torch.Size(self._meta[k][0]).numel() for k in self._param_names)
        return f"Model({self._module_type}, {len(self._param_names)} tensors, {n} parameters)"


def _check_key(key: Any, where: str) -> torch.Tensor:
    if not isinstance(key, torch.Tensor) or key.dtype != torch.int32:
        got = f"a {key.dtype} tensor" if isinstance(key, torch.Tensor) else type(key).__name__
        raise TypeError(
            f"key must be a torchfn.random key (int32 tensor of shape (2,)), got {got}"
        )
    if tuple(key.shape) != (2,):
        hint = (
            "; for an ensemble use tree.stack([model.init(k) for k in random.split(key, n)])"
            if where == "init"
            else "; for a batch of keys use torch.func.vmap"
        )
        raise ValueError(f"key must have shape (2,), got {tuple(key.shape)}{hint}")
    return key


def _slots(skeleton: nn.Module, params: list[str], tied: dict[str, str], state: list[str],
           consts: list[str]) -> Slots | None:
    """Where ``apply`` swaps each tensor in (tied names read their canonical tensor), or
    None (then ``functional_call``) for a module whose tensors are not all plain
    parameters and buffers."""
    names = {n: n for n in [*params, *state, *consts]}
    names.update(tied)
    canonical = {id(b): n for n, b in skeleton.named_buffers()}
    names.update({n: canonical[id(b)] for n, b in skeleton.named_buffers(remove_duplicate=False)
                  if n not in names and canonical[id(b)] in names})
    try:
        return Slots(skeleton, names)
    except (KeyError, AttributeError):
        return None
