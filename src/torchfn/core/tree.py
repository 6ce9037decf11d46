"""Pytrees: nested dicts, lists, tuples and NamedTuples of tensors (on optree).

A pytree is any nesting of ``dict``, ``list``, ``tuple``, ``NamedTuple`` (e.g.
torchopt optimizer states) and ``None`` whose other values are *leaves*
(tensors, numbers, ...). ``None`` is an empty subtree, not a leaf, as in JAX:
it holds places in :func:`partition` results and optional state fields.

Paths name a leaf by joining its keys with ``'.'``: dict keys, list/tuple
indices and NamedTuple field names, so a nested dict built from a module has
exactly its ``nn.Module.state_dict()`` names::

    >>> import torch
    >>> from torchfn import tree
    >>> params = {"encoder": {"weight": torch.ones(2, 2)}, "head": [torch.zeros(2)]}
    >>> sorted(tree.flatten_dict(params))
    ['encoder.weight', 'head.0']
    >>> head, body = tree.partition(params, lambda path, x: path.startswith("head"))
    >>> tree.combine(head, body)["encoder"]["weight"].shape
    torch.Size([2, 2])

Dict leaves are visited in sorted key order (optree's convention), so two
dicts with the same keys in a different insertion order have the same
structure. :func:`flatten_dict` keeps insertion order.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optree
import torch

__all__ = [
    "map",
    "leaves",
    "structure",
    "flatten",
    "unflatten",
    "stack",
    "unstack",
    "flatten_dict",
    "unflatten_dict",
    "global_norm",
    "add",
    "sub",
    "scale",
    "zeros_like",
    "dot",
    "partition",
    "combine",
    "paths",
]

PyTree = Any
PyTreeDef = optree.PyTreeSpec

_MAX_SPEC_CHARS = 400


def _short(spec: Any) -> str:
    text = repr(spec)
    if len(text) > _MAX_SPEC_CHARS:
        text = text[: _MAX_SPEC_CHARS - 5] + " ...)"
    return text


def _structure_error(what: str, trees: Sequence[PyTree], cause: Exception) -> ValueError:
    """A ValueError naming the structure of the first tree and of the first that differs."""
    first = optree.tree_structure(trees[0])
    for i, other in enumerate(trees[1:], start=1):
        spec = optree.tree_structure(other)
        if spec != first:
            return ValueError(
                f"{what}: tree structures differ: tree 0 is {_short(first)}, "
                f"tree {i} is {_short(spec)} ({cause})"
            )
    return ValueError(f"{what}: tree structures differ: {cause}")


def _check_same_structure(what: str, trees: Sequence[PyTree]) -> PyTreeDef:
    first = optree.tree_structure(trees[0])
    for i, other in enumerate(trees[1:], start=1):
        spec = optree.tree_structure(other)
        if spec != first:
            raise ValueError(
                f"{what}: tree structures differ: tree 0 is {_short(first)}, "
                f"tree {i} is {_short(spec)}"
            )
    return first


# ---------------------------------------------------------------------------
# Structure


def map(
    f: Callable[..., Any],
    tree: PyTree,
    *rest: PyTree,
    is_leaf: Callable[[Any], bool] | None = None,
) -> PyTree:
    """Apply ``f`` leafwise: ``f(x, *ys)`` for each leaf ``x`` of ``tree`` and the
    matching leaves ``ys`` of ``rest`` (same structure, or ``tree`` a prefix).

    >>> map(lambda x, y: x + y, {"a": 1, "b": (2,)}, {"a": 10, "b": (20,)})
    {'a': 11, 'b': (22,)}
    """
    try:
        return optree.tree_map(f, tree, *rest, is_leaf=is_leaf)
    except ValueError as e:
        if rest:
            raise _structure_error("tree.map", (tree, *rest), e) from e
        raise


def leaves(tree: PyTree, *, is_leaf: Callable[[Any], bool] | None = None) -> list[Any]:
    """The leaves of ``tree`` in traversal order (dicts by sorted key).

    Example::

        >>> from torchfn import tree
        >>> tree.leaves({"b": [1, 2], "a": 3, "c": None})    # None is an empty subtree
        [3, 1, 2]
    """
    return optree.tree_leaves(tree, is_leaf=is_leaf)


def structure(tree: PyTree, *, is_leaf: Callable[[Any], bool] | None = None) -> PyTreeDef:
    """The treedef of ``tree`` (an ``optree.PyTreeSpec``); compare with ``==``.

    Example::

        >>> import torch
        >>> from torchfn import tree
        >>> params = {"w": torch.ones(2, 3), "b": torch.zeros(2)}
        >>> tree.structure(params) == tree.structure({"b": 0.0, "w": 1.0})   # leaves ignored
        True
        >>> tree.structure(params).num_leaves
        2
    """
    return optree.tree_structure(tree, is_leaf=is_leaf)


def flatten(
    tree: PyTree, *, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[Any], PyTreeDef]:
    """``(leaves, treedef)``; :func:`unflatten` inverts it.

    Example::

        >>> from torchfn import tree
        >>> leaves, treedef = tree.flatten({"b": (2, 3), "a": 1})
        >>> leaves
        [1, 2, 3]
        >>> tree.unflatten(treedef, leaves) == {"b": (2, 3), "a": 1}
        True
    """
    return optree.tree_flatten(tree, is_leaf=is_leaf)


def unflatten(treedef: PyTreeDef, leaves: Sequence[Any]) -> PyTree:
    """Rebuild a tree from ``treedef`` and a sequence of leaves (as many as it has).

    Example::

        >>> import torch
        >>> from torchfn import tree
        >>> leaves, treedef = tree.flatten({"w": torch.ones(2, 3), "b": torch.ones(2)})
        >>> doubled = tree.unflatten(treedef, [2 * x for x in leaves])
        >>> doubled["b"].tolist()
        [2.0, 2.0]
    """
    if not isinstance(treedef, optree.PyTreeSpec):
        raise TypeError(f"treedef must be a PyTreeSpec, got {type(treedef).__name__}")
    leaves = list(leaves)
    if len(leaves) != treedef.num_leaves:
        raise ValueError(
            f"leaves: treedef {_short(treedef)} expects {treedef.num_leaves} leaves, "
            f"got {len(leaves)}"
        )
    return optree.tree_unflatten(treedef, leaves)


# ---------------------------------------------------------------------------
# Paths


def _entry_str(entry: Any) -> str:
    if isinstance(entry, optree.NamedTupleEntry):
        return str(entry.field)
    return str(entry.entry)


def _path_str(accessor: Any, sep: str = ".") -> str:
    return sep.join(_entry_str(e) for e in accessor)


def paths(tree: PyTree, *, is_leaf: Callable[[Any], bool] | None = None) -> list[str]:
    """The '.'-joined path of every leaf, in :func:`leaves` order.

    >>> paths({"b": [1, 2], "a": 3})
    ['a', 'b.0', 'b.1']
    """
    return [_path_str(a) for a in optree.tree_accessors(tree, is_leaf=is_leaf)]


def _walk(node: Any, prefix: tuple[str, ...], is_leaf, out: list[tuple[tuple[str, ...], Any]]):
    """Depth-first (path, leaf) pairs in insertion order for dicts."""
    if node is None:
        return
    if is_leaf is not None and is_leaf(node):
        out.append((prefix, node))
    elif type(node) is dict:
        for k, v in node.items():
            _walk(v, (*prefix, str(k)), is_leaf, out)
    elif isinstance(node, tuple) and hasattr(node, "_fields"):  # NamedTuple
        for name, v in zip(node._fields, node):
            _walk(v, (*prefix, name), is_leaf, out)
    elif type(node) in (list, tuple):
        for i, v in enumerate(node):
            _walk(v, (*prefix, str(i)), is_leaf, out)
    elif optree.tree_is_leaf(node):
        out.append((prefix, node))
    else:  # any other registered node type (OrderedDict, defaultdict, deque, custom)
        one = optree.tree_flatten_one_level(node)
        for entry, child in zip(one.entries, one.children):
            _walk(child, (*prefix, str(entry)), is_leaf, out)


def flatten_dict(
    tree: PyTree, *, sep: str = ".", is_leaf: Callable[[Any], bool] | None = None
) -> dict[str, Any]:
    """A flat ``{path: leaf}`` dict, paths joined with ``sep`` (insertion order).

    For a nested dict of a module's parameters the keys are its ``state_dict``
    names; a flat dict passes through unchanged. ``None`` subtrees are dropped.

    >>> flatten_dict({"layers": [{"weight": 1, "bias": 2}], "head": {"w": 3}})
    {'layers.0.weight': 1, 'layers.0.bias': 2, 'head.w': 3}
    """
    if not isinstance(sep, str) or not sep:
        raise ValueError(f"sep must be a non-empty string, got {sep!r}")
    pairs: list[tuple[tuple[str, ...], Any]] = []
    _walk(tree, (), is_leaf, pairs)
    flat: dict[str, Any] = {}
    for path, leaf in pairs:
        name = sep.join(path)
        if name in flat:
            raise ValueError(
                f"tree: two leaves have the same flattened path {name!r} "
                f"(a key containing {sep!r} collides with a nested key)"
            )
        flat[name] = leaf
    return flat


def unflatten_dict(flat: Mapping[str, Any], *, sep: str = ".") -> dict[str, Any]:
    """Nested dicts from a flat ``{path: leaf}`` dict: ``'a.b'`` -> ``{'a': {'b': ...}}``.

    Keys stay strings (``'layers.0.weight'`` -> ``{'layers': {'0': {'weight': ...}}}``),
    so it inverts :func:`flatten_dict` for nested dicts with string keys.

    >>> unflatten_dict({"a.b": 1, "a.c": 2, "d": 3})
    {'a': {'b': 1, 'c': 2}, 'd': 3}
    """
    if not isinstance(flat, Mapping):
        raise TypeError(f"flat must be a mapping of str paths, got {type(flat).__name__}")
    if not isinstance(sep, str) or not sep:
        raise ValueError(f"sep must be a non-empty string, got {sep!r}")
    out: dict[str, Any] = {}
    for name, leaf in flat.items():
        if not isinstance(name, str):
            raise TypeError(f"flat: keys must be str paths, got {name!r}")
        parts = name.split(sep)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(
                    f"flat: path {name!r} goes through {sep.join(parts[: i + 1])!r}, "
                    "which is a leaf"
                )
            node = child
        if parts[-1] in node:
            raise ValueError(f"flat: path {name!r} is both a leaf and a prefix of another path")
        node[parts[-1]] = leaf
    return out


# ---------------------------------------------------------------------------
# Ensembles


def stack(trees: Sequence[PyTree], dim: int = 0) -> PyTree:
    """Stack a sequence of same-structure trees into one tree with a new ``dim``.

    ``stack([p_1, ..., p_n])`` turns ``n`` parameter trees into one whose leaves
    have shape ``(n, *leaf.shape)``: the input of ``vmap`` for an ensemble.
    Python numbers become tensors.

    Example::

        >>> import torch
        >>> from torchfn import tree
        >>> members = [{"w": torch.ones(2, 3), "b": torch.zeros(2)} for _ in range(4)]
        >>> stacked = tree.stack(members)
        >>> stacked["w"].shape, stacked["b"].shape           # (n, *leaf.shape)
        (torch.Size([4, 2, 3]), torch.Size([4, 2]))
    """
    if isinstance(trees, (str, bytes)) or not isinstance(trees, Sequence):
        raise TypeError(f"trees must be a list or tuple of trees, got {type(trees).__name__}")
    if len(trees) == 0:
        raise ValueError("trees must hold at least one tree, got an empty sequence")
    spec = _check_same_structure("tree.stack", trees)
    columns = zip(*(optree.tree_leaves(t) for t in trees))
    names = paths(trees[0])
    stacked = []
    for name, column in zip(names, columns):
        column = [torch.as_tensor(x) for x in column]
        shapes = {tuple(x.shape) for x in column}
        if len(shapes) != 1:
            raise ValueError(
                f"tree.stack: leaf {name!r} has different shapes across trees: "
                f"{sorted(shapes)}"
            )
        stacked.append(torch.stack(column, dim=dim))
    return optree.tree_unflatten(spec, stacked)


def unstack(tree: PyTree, dim: int = 0) -> list[PyTree]:
    """Split every leaf along ``dim``: the inverse of :func:`stack`.

    Example::

        >>> import torch
        >>> from torchfn import tree
        >>> members = tree.unstack({"w": torch.arange(6.0).reshape(3, 2)})   # w: (3, 2)
        >>> len(members), members[1]["w"].tolist()
        (3, [2.0, 3.0])
    """
    flat, spec = optree.tree_flatten(tree)
    if not flat:
        raise ValueError("tree: cannot unstack a tree without leaves (the count is unknown)")
    names = paths(tree)
    sizes = {}
    for name, x in zip(names, flat):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise ValueError(
                f"tree.unstack: leaf {name!r} must be a tensor with at least one dimension, "
                f"got {x!r}"[:200]
            )
        sizes[name] = x.shape[dim]
    if len(set(sizes.values())) != 1:
        raise ValueError(f"tree.unstack: leaves differ in size along dim {dim}: {sizes}")
    columns = [torch.unbind(x, dim=dim) for x in flat]
    return [optree.tree_unflatten(spec, list(row)) for row in zip(*columns)]


# ---------------------------------------------------------------------------
# Arithmetic


def add(a: PyTree, b: PyTree) -> PyTree:
    """Leafwise ``a + b``.

    Example::

        >>> import torch
        >>> from torchfn import tree
        >>> out = tree.add({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([10.0, 20.0])})
        >>> out["w"].tolist()
        [11.0, 22.0]
    """
    return map(lambda x, y: x + y, a, b)


def sub(a: PyTree, b: PyTree) -> PyTree:
    """Leafwise ``a - b``.

    Example::

        >>> import torch
        >>> from torchfn import tree
        >>> out = tree.sub({"w": torch.tensor([10.0, 20.0])}, {"w": torch.tensor([1.0, 2.0])})
        >>> out["w"].tolist()
        [9.0, 18.0]
    """
    return map(lambda x, y: x - y, a, b)


def scale(tree: PyTree, s: float | torch.Tensor) -> PyTree:
    """Leafwise ``s * x`` for a scalar (number or 0-d tensor) ``s``.

    Example::

        >>> import torch
        >>> from torchfn import tree
        >>> tree.scale({"w": torch.tensor([1.0, 2.0]), "b": [torch.tensor(4.0)]}, 0.5)["w"].tolist()
        [0.5, 1.0]
    """
    return map(lambda x: s * x, tree)


def zeros_like(tree: PyTree) -> PyTree:
    """A tree of zeros with the shapes and dtypes of ``tree``'s tensor leaves.

    Example::

        >>> import torch
        >>> from torchfn import tree
        >>> z = tree.zeros_like({"w": torch.ones(2, 3, dtype=torch.float64)})
        >>> z["w"].shape, z["w"].dtype, bool((z["w"] == 0).all())
        (torch.Size([2, 3]), torch.float64, True)
    """
    return map(torch.zeros_like, tree)


def dot(a: PyTree, b: PyTree) -> torch.Tensor:
    """``sum_i <a_i, b_i>`` over all leaves: a 0-d tensor (0. for empty trees).

    Example::

        >>> import torch
        >>> from torchfn import tree
        >>> a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor(3.0)}
        >>> b = {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor(2.0)}
        >>> tree.dot(a, b).item()                            # 1*3 + 2*4 + 3*2
        17.0
    """
    _check_same_structure("tree.dot", (a, b))
    terms = [torch.sum(x * y) for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b))]
    if not terms:
        return torch.tensor(0.0)
    return builtins.sum(terms[1:], terms[0])


def global_norm(tree: PyTree) -> torch.Tensor:
    """The L2 norm of all leaves together, ``sqrt(sum_i ||x_i||^2)``: a 0-d tensor.

    Half-precision leaves are accumulated in float32; the result has the
    promoted dtype of the leaves (float32 for an empty tree).

    Example::

        >>> import torch
        >>> from torchfn import tree
        >>> tree.global_norm({"a": torch.tensor([3.0]), "b": [torch.tensor([4.0])]}).item()
        5.0
    """
    flat = [torch.as_tensor(x) for x in optree.tree_leaves(tree)]
    if not flat:
        return torch.tensor(0.0)
    dtype = flat[0].dtype
    for x in flat[1:]:
        dtype = torch.promote_types(dtype, x.dtype)
    if not dtype.is_floating_point and not dtype.is_complex:
        dtype = torch.get_default_dtype()
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    norms = [torch.linalg.vector_norm(x, dtype=acc) for x in flat]
    return torch.linalg.vector_norm(torch.stack(norms)).to(dtype)


# ---------------------------------------------------------------------------
# Partition / combine


def partition(
    tree: PyTree,
    predicate: Callable[[str, Any], bool],
    *,
    is_leaf: Callable[[Any], bool] | None = None,
) -> tuple[PyTree, PyTree]:
    """Split ``tree`` into ``(selected, rest)`` by ``predicate(path, leaf)``.

    Both halves keep ``tree``'s structure with ``None`` where the other half
    holds the leaf; :func:`combine` puts them back together. ``path`` is the
    '.'-joined path of the leaf (``'head.weight'``).

    >>> head, backbone = partition({"body": 1, "head": 2}, lambda p, x: p.startswith("head"))
    >>> head, backbone
    ({'body': None, 'head': 2}, {'body': 1, 'head': None})
    """
    if not callable(predicate):
        raise TypeError(f"predicate must be callable (path, leaf) -> bool, got {predicate!r}")
    accessors, flat, spec = optree.tree_flatten_with_accessor(tree, is_leaf=is_leaf)
    picks = [bool(predicate(_path_str(a), x)) for a, x in zip(accessors, flat)]
    selected = [x if p else None for p, x in zip(picks, flat)]
    rest = [None if p else x for p, x in zip(picks, flat)]
    return optree.tree_unflatten(spec, selected), optree.tree_unflatten(spec, rest)


def combine(*trees: PyTree) -> PyTree:
    """Merge trees where each leaf is set (not ``None``) in at most one of them.

    The inverse of :func:`partition`: ``combine(*partition(t, pred)) == t``.
    A dict key missing from a tree counts as ``None`` there, so a half with
    its ``None`` entries dropped combines too. That is the form to
    differentiate: ``torch.func.grad``/``vmap`` reject ``None`` in their inputs
    (torch's own pytrees treat ``None`` as a leaf)::

        head, body = partition(params, lambda path, x: path.startswith("head."))
        head = {k: v for k, v in head.items() if v is not None}
        grads = torch.func.grad(lambda h: loss(combine(h, body), batch))(head)

    Example::

        >>> from torchfn import tree
        >>> params = {"body": 1, "head": 2}
        >>> head, body = tree.partition(params, lambda path, x: path == "head")
        >>> tree.combine(head, body)
        {'body': 1, 'head': 2}
        >>> tree.combine({"head": 5}, body)                  # a half with its None keys dropped
        {'body': 1, 'head': 5}
    """
    if not trees:
        raise ValueError("combine needs at least one tree, got none")
    return _combine(list(trees), ())


def _combine(nodes: list[Any], path: tuple[str, ...]) -> Any:
    where = ".".join(path) or "<root>"
    nodes = [x for x in nodes if x is not None]
    if not nodes:
        return None
    if len(nodes) == 1:
        return nodes[0]
    if all(type(x) is dict for x in nodes):
        # key order of the fullest dict (a partition half keeps all keys)
        keys = dict.fromkeys(k for x in sorted(nodes, key=len, reverse=True) for k in x)
        return {k: _combine([x.get(k) for x in nodes], (*path, str(k))) for k in keys}
    is_leaf = [optree.tree_is_leaf(x) for x in nodes]
    if all(is_leaf):
        raise ValueError(
            f"combine: leaf {where!r} is set in {len(nodes)} trees; partitions must not overlap"
        )
    levels = [optree.tree_flatten_one_level(x) for x in nodes if not optree.tree_is_leaf(x)]
    first = levels[0]
    if any(is_leaf) or any(
        type(x) is not type(nodes[0])
        or lv.metadata != first.metadata
        or len(lv.children) != len(first.children)
        for x, lv in zip(nodes, levels)
    ):
        kinds = ", ".join(_short(optree.tree_structure(x)) for x in nodes)
        raise ValueError(f"tree.combine: tree structures differ at {where!r}: {kinds}")
    children = [
        _combine([lv.children[i] for lv in levels], (*path, str(entry)))
        for i, entry in enumerate(first.entries)
    ]
    return first.unflatten_func(first.metadata, children)
