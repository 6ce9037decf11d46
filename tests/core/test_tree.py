"""torchfn.tree: structure round trips, dict paths, ensembles, arithmetic, partition."""

from collections import OrderedDict
from typing import NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from torchfn import tree


class AdamLike(NamedTuple):
    mu: object
    nu: object
    count: object


def _tensor(draw_seed: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(draw_seed)
    return torch.rand(shape, generator=g) + 0.5  # never zero


leaf_st = st.builds(
    _tensor,
    st.integers(0, 2**31 - 1),
    st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple),
)
key_st = st.text(alphabet="abcxyz_", min_size=1, max_size=4)
tree_st = st.recursive(
    leaf_st | st.none(),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(key_st, children, max_size=3),
        st.tuples(children, children, children).map(lambda t: AdamLike(*t)),
    ),
    max_leaves=8,
)


def _equal(a, b) -> bool:
    if tree.structure(a) != tree.structure(b):
        return False
    return all(torch.equal(x, y) for x, y in zip(tree.leaves(a), tree.leaves(b)))


@given(tree_st)
def test_flatten_unflatten_round_trip(t):
    leaves, treedef = tree.flatten(t)
    assert _equal(tree.unflatten(treedef, leaves), t)
    assert leaves == tree.leaves(t) or all(x is y for x, y in zip(leaves, tree.leaves(t)))
    assert tree.structure(t) == treedef


@given(tree_st)
def test_partition_combine_is_identity(t):
    sel, rest = tree.partition(t, lambda path, x: x.numel() % 2 == 0 or "a" in path)
    assert _equal(tree.combine(sel, rest), t)
    n = len(tree.leaves(t))
    assert len(tree.leaves(sel)) + len(tree.leaves(rest)) == n
    # None placeholders keep both halves in t's shape
    assert tree.structure(sel, is_leaf=lambda x: x is None) == tree.structure(
        rest, is_leaf=lambda x: x is None
    )


@given(tree_st)
def test_flatten_dict_matches_paths_and_leaves(t):
    flat = tree.flatten_dict(t)
    assert sorted(flat) == sorted(tree.paths(t))
    by_path = dict(zip(tree.paths(t), tree.leaves(t)))
    assert all(flat[k] is by_path[k] for k in flat)


@given(tree_st, tree_st)
def test_stack_unstack(t, _unused):
    trees = [t, tree.scale(t, 2.0), tree.scale(t, -3.0)]
    stacked = tree.stack(trees)
    for x, y in zip(tree.leaves(stacked), tree.leaves(t)):
        assert x.shape == (3, *y.shape)
    if tree.leaves(t):
        back = tree.unstack(stacked)
        assert len(back) == 3
        assert all(_equal(a, b) for a, b in zip(back, trees))


def test_flatten_dict_equals_state_dict_names():
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Sequential(nn.Linear(4, 2)))
    sd = module.state_dict()
    nested = tree.unflatten_dict(sd)
    assert nested["0"]["weight"] is sd["0.weight"]
    assert nested["2"]["0"]["bias"] is sd["2.0.bias"]
    flat = tree.flatten_dict(nested)
    assert list(flat) == list(sd)  # same names, same (insertion) order
    assert all(flat[k] is sd[k] for k in sd)
    # a flat dict passes through unchanged
    assert list(tree.flatten_dict(dict(sd))) == list(sd)
    # lists and NamedTuples use indices and field names
    names = list(tree.flatten_dict({"h": [1, AdamLike(2, None, 3)]}))
    assert names == ["h.0", "h.1.mu", "h.1.count"]
    # an OrderedDict (a state_dict itself) is a tree too
    assert list(tree.flatten_dict(OrderedDict(a={"b": 1}))) == ["a.b"]


def test_flatten_dict_collision_and_unflatten_conflicts():
    with pytest.raises(ValueError, match="'a.b'"):
        tree.flatten_dict({"a.b": 1, "a": {"b": 2}})
    with pytest.raises(ValueError, match="'a.b'.*'a'"):
        tree.unflatten_dict({"a": 1, "a.b": 2})
    with pytest.raises(ValueError, match="both a leaf and a prefix"):
        tree.unflatten_dict({"a.b": 1, "a": 2})
    with pytest.raises(TypeError, match="keys must be str"):
        tree.unflatten_dict({1: 2})
    with pytest.raises(TypeError, match="flat must be a mapping"):
        tree.unflatten_dict([("a", 1)])
    with pytest.raises(ValueError, match="sep must be"):
        tree.flatten_dict({"a": 1}, sep="")


def test_map_multi_tree_and_is_leaf():
    a = {"x": torch.ones(2), "y": (torch.ones(1), None)}
    b = {"x": torch.full((2,), 2.0), "y": (torch.full((1,), 3.0), None)}
    out = tree.map(lambda u, v: u * v, a, b)
    assert torch.equal(out["x"], torch.full((2,), 2.0)) and out["y"][1] is None
    pairs = {"p": (1, 2), "q": (3, 4)}
    summed = tree.map(lambda t: t[0] + t[1], pairs, is_leaf=lambda t: isinstance(t, tuple))
    assert summed == {"p": 3, "q": 7}


def test_mismatched_structures_name_both():
    a = {"w": torch.ones(2), "b": torch.ones(1)}
    b = {"w": torch.ones(2), "c": torch.ones(1)}
    for fn in (tree.add, tree.sub, tree.dot, lambda x, y: tree.map(torch.add, x, y)):
        with pytest.raises(ValueError, match=r"tree 0 is .*'b'.*tree 1 is .*'c'"):
            fn(a, b)
    with pytest.raises(ValueError, match="tree structures differ"):
        tree.stack([a, b])
    with pytest.raises(ValueError, match="structures differ at '<root>'"):
        tree.combine({"a": 1}, [1])
    with pytest.raises(ValueError, match="structures differ at 'a'"):
        tree.combine({"a": (1, None)}, {"a": (None, 2, 3)})


def test_stack_errors():
    with pytest.raises(ValueError, match="'w' has different shapes"):
        tree.stack([{"w": torch.ones(2)}, {"w": torch.ones(3)}])
    with pytest.raises(ValueError, match="at least one tree"):
        tree.stack([])
    with pytest.raises(TypeError, match="trees must be a list"):
        tree.stack({"w": torch.ones(2)})
    with pytest.raises(ValueError, match="differ in size along dim 0"):
        tree.unstack({"a": torch.ones(2, 1), "b": torch.ones(3)})
    with pytest.raises(ValueError, match="without leaves"):
        tree.unstack({"a": None})
    with pytest.raises(ValueError, match="'a' must be a tensor with at least one"):
        tree.unstack({"a": torch.tensor(1.0)})


def test_unflatten_errors():
    _, treedef = tree.flatten({"a": 1, "b": 2})
    with pytest.raises(ValueError, match="expects 2 leaves, got 3"):
        tree.unflatten(treedef, [1, 2, 3])
    with pytest.raises(TypeError, match="treedef must be a PyTreeSpec"):
        tree.unflatten("x", [1])


@given(tree_st, st.floats(-3, 3, allow_nan=False))
def test_arithmetic_equals_float64_reference(t, s):
    u = tree.map(lambda x: x * 0.5 + 1.0, t)
    flat_t = [x.double().flatten() for x in tree.leaves(t)]
    flat_u = [x.double().flatten() for x in tree.leaves(u)]
    cat_t = torch.cat(flat_t) if flat_t else torch.zeros(0, dtype=torch.float64)
    cat_u = torch.cat(flat_u) if flat_u else torch.zeros(0, dtype=torch.float64)
    assert torch.allclose(tree.global_norm(t).double(), cat_t.norm(), rtol=1e-5)
    assert torch.allclose(tree.dot(t, u).double(), (cat_t * cat_u).sum(), rtol=1e-5)
    back = tree.sub(tree.add(t, u), u)
    assert tree.structure(back) == tree.structure(t)
    assert all(torch.allclose(x, y) for x, y in zip(tree.leaves(back), tree.leaves(t)))
    for x, y in zip(tree.leaves(tree.scale(t, s)), tree.leaves(t)):
        assert torch.equal(x, s * y)
    for z, y in zip(tree.leaves(tree.zeros_like(t)), tree.leaves(t)):
        assert z.shape == y.shape and z.dtype == y.dtype and not z.any()


def test_global_norm_half_precision_and_grad():
    x = {"a": torch.full((1000,), 300.0, dtype=torch.float16)}  # sum of squares overflows fp16
    n = tree.global_norm(x)
    assert n.dtype == torch.float16 and torch.isfinite(n)
    assert torch.allclose(n.float(), torch.tensor(300.0 * 1000**0.5), rtol=1e-3)
    p = {"w": torch.tensor([3.0, 4.0])}
    g = torch.func.grad(lambda q: tree.global_norm(q))(p)
    assert torch.allclose(g["w"], torch.tensor([0.6, 0.8]))


def test_vmap_over_stacked_trees():
    g = torch.Generator().manual_seed(0)
    trees = [{"w": torch.rand(3, generator=g) + 0.5, "b": (torch.rand(1, generator=g) + 0.5,)}
             for _ in range(4)]
    norms = torch.func.vmap(tree.global_norm)(tree.stack(trees))
    assert torch.allclose(norms, torch.stack([tree.global_norm(t) for t in trees]))


def test_partition_freeze_backbone_train_head():
    params = {"backbone.w": torch.ones(2), "head.w": torch.ones(2), "head.b": torch.ones(1)}
    head, body = tree.partition(params, lambda path, x: path.startswith("head."))
    assert body["head.w"] is None and head["backbone.w"] is None
    trainable = {k: v for k, v in head.items() if v is not None}  # torch.func rejects None
    loss = lambda h: sum((v * v).sum() for v in tree.leaves(tree.combine(h, body)))
    grads = torch.func.grad(loss)(trainable)
    assert set(grads) == {"head.w", "head.b"}
    assert torch.equal(grads["head.w"], 2 * params["head.w"])
    assert list(tree.combine(trainable, body)) == list(params)
    with pytest.raises(ValueError, match="must not overlap"):
        tree.combine(params, params)
    with pytest.raises(TypeError, match="predicate must be callable"):
        tree.partition(params, "head")
    with pytest.raises(ValueError, match="at least one tree"):
        tree.combine()


def test_partition_paths_are_namedtuple_fields():
    state = {"opt": AdamLike(mu={"w": 1}, nu={"w": 2}, count=3)}
    seen = []
    tree.partition(state, lambda path, x: seen.append(path) or False)
    assert sorted(seen) == ["opt.count", "opt.mu.w", "opt.nu.w"]
