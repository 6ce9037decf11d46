"""The tape behind ``remat(fn, policy=...)``: save some op outputs, replay them.

``remat``'s forward runs ``fn`` under ``Record``, a dispatch mode below autograd
and below every ``torch.func`` layer, so it sees the physical ops that run (a
``vmap``'s batch dim included). It notes every op in order and keeps the outputs
the policy asks for. The backward recomputes ``fn`` under ``Replay``: when the
op at position i is the one recorded there and was saved, its saved outputs are
returned instead of running its kernel. Autograd sits above the mode, so it
still records the op and its derivative formula; only the kernel is skipped.
This is how ``torch.utils.checkpoint``'s selective checkpointing works, without
the saved-tensor hooks that ``torch.func`` rejects.

If the recomputation ever takes another path than the forward (a different op at
a position, or a saved op with different input shapes), ``Replay`` stops reusing
and recomputes everything from there on, with a warning: slower, never wrong.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from torchfn.core.checkpoint_policies import checkpoint_name, policy_names

__all__ = ["Record", "Replay", "active_record"]


def _outputs(out: Any) -> tuple[torch.Tensor, ...] | None:
    """The op's outputs as a tuple, or None if any output is not a tensor."""
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    return outs if all(isinstance(o, torch.Tensor) for o in outs) else None


_REUSABLE: dict[Any, bool] = {}


def _reusable(func: torch._ops.OpOverload) -> bool:
    """Ops whose outputs are new tensors: no views (autograd tracks those, and adds
    its own ``detach``/``alias`` calls, which are not on the tape), no mutation."""
    known = _REUSABLE.get(func)
    if known is None:
        schema = func._schema
        known = not (func.is_view or schema.is_mutable
                     or any(r.alias_info for r in schema.returns))
        _REUSABLE[func] = known
    return known


def _arg_meta(args: tuple, kwargs: dict) -> tuple:
    leaves = pytree.tree_leaves((args, kwargs))
    return tuple((t.shape, t.dtype) for t in leaves if isinstance(t, torch.Tensor))


def _physical(t: torch.Tensor) -> torch.Tensor:
    """Peel the ``torch.func`` wrappers (grad, vmap, jvp levels) off ``t``."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Saved:
    """One saved op: its outputs, how they were packed, the shapes it took."""

    def __init__(self, outs, was_tuple, arg_meta):
        self.outs = outs  # tuple of tensors sharing storage with the forward's
        self.was_tuple = was_tuple
        self.arg_meta = arg_meta


class Record(TorchDispatchMode):
    """Run under this in the forward: notes each op, keeps what ``policy`` saves."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy
        self.uses_names, self.unsaved_names = policy_names(policy)
        self.ops: list[Any] = []  # every op, in order
        self.saved: dict[int, _Saved] = {}
        self._made: dict[int, tuple] = {}  # storage -> the op that allocated it
        self._named: list[tuple] = []
        self._unnamed: list[int] = []  # ops whose save a name undid
        self._writes: list[tuple[int, int]] = []  # (op index, storage written in place)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        i = len(self.ops)
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func._schema.is_mutable:  # written after op i - 1
            self._writes.extend((i, _storage(t)) for t in inputs if t.numel())
        if not _reusable(func):
            return out  # views, detach, in-place ops: not on the tape
        self.ops.append(func)
        outs = _outputs(out)
        if outs is None:
            return out  # .item() and other ops that return numbers
        was_tuple = isinstance(out, (tuple, list))
        meta = _arg_meta(args, kwargs)
        if self.policy(func, *args, **kwargs):
            self.saved[i] = _Saved(tuple(o.detach() for o in outs), was_tuple, meta)
        if not self.uses_names:
            return out
        # remember which op allocated each storage, in case a name asks for it later;
        # an output sharing an input's storage (``_unsafe_view``) allocated nothing
        taken = {_storage(t) for t in inputs if t.numel()}
        made = (i, [weakref.ref(o) for o in outs], was_tuple, meta,
                [(o.shape, o.stride(), o.storage_offset(), o.dtype) for o in outs])
        for o in outs:
            if o.numel() and _storage(o) not in taken:
                self._made[_storage(o)] = made
        return out

    def name(self, x: torch.Tensor, name: str) -> None:
        """``checkpoint_name(x, name)`` inside the forward: ask the policy about x."""
        if not self.uses_names:
            return
        p = _physical(x)
        made = self._made.get(_storage(p)) if p.numel() else None
        if made is None:
            return  # an input, or made outside fn: nothing to recompute
        if name in self.unsaved_names:
            self._unnamed.append(made[0])
        elif self.policy(checkpoint_name, x, name=name):
            self._named.append((p, *made))

    def finish(self) -> None:
        """After the forward: keep the named values; drop any value written in place
        after its op ran (the recomputation needs the value as the op made it)."""
        for p, i, refs, was_tuple, meta, layout in self._named:
            outs = [r() for r in refs]
            if len(outs) == 1 and outs[0] is None and p.dtype == layout[0][3]:
                outs = [p.as_strided(*layout[0][:3])]  # rebuilt from the named view
            if i not in self.saved and all(o is not None for o in outs):
                self.saved[i] = _Saved(tuple(o.detach() for o in outs), was_tuple, meta)
        for i in self._unnamed:
            self.saved.pop(i, None)
        written: dict[int, int] = {}  # storage -> last op that wrote it
        for i, ptr in self._writes:
            written[ptr] = i
        self.saved = {
            i: s for i, s in self.saved.items()
            if all(written.get(_storage(o), -1) <= i for o in s.outs if o.numel())
        }
        self._named.clear()
        self._unnamed.clear()
        self._made.clear()
        self._writes.clear()


class Replay(TorchDispatchMode):
    """Run under this in the recomputation: saved ops return their saved outputs."""

    def __init__(self, record: Record):
        super().__init__()
        self.ops = record.ops
        self.saved = record.saved
        self.i = 0
        self.diverged = False

    def _diverge(self, why: str) -> None:
        self.diverged = True
        warnings.warn(
            f"remat: the recomputation did not follow the forward ({why}); it recomputes "
            "from there on instead of reusing saved values (slower, still exact)",
            RuntimeWarning, stacklevel=2,
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.diverged or not _reusable(func):
            return func(*args, **kwargs)
        i = self.i
        self.i += 1
        if i >= len(self.ops) or self.ops[i] is not func:
            want = self.ops[i] if i < len(self.ops) else "nothing"
            self._diverge(f"op {i} was {want}, now {func}")
        elif (s := self.saved.get(i)) is not None:
            if _arg_meta(args, kwargs) == s.arg_meta:
                outs = tuple(o.detach() for o in s.outs)
                return outs if s.was_tuple else outs[0]
            self._diverge(f"op {i} ({func}) got inputs of other shapes")
        return func(*args, **kwargs)


def active_record() -> Record | None:
    """The innermost ``Record`` running now, if any."""
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, Record):
            return mode
    return None
