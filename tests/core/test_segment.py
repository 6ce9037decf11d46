"""segment_sum / segment_mean / segment_max / segment_min / segment_softmax: each equals
a loop over the segments, in float64, and under grad, vmap (over data, ids or both), jvp
and torch.compile."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad, jvp, vmap

from torchfn import (
    random,
    segment_max,
    segment_mean,
    segment_min,
    segment_softmax,
    segment_sum,
)


def _draw(seed, E, S, trailing=(3,)):
    k1, k2 = random.split(random.key(seed))
    data = random.normal(k1, (E, *trailing), torch.float64)  # (E, ...)
    ids = random.randint(k2, (E,), 0, S)  # (E,)
    return data, ids


def _loop(reduce, empty, data, ids, S):
    """The reference: one reduction per segment, in Python."""
    rows = [data[ids == s] for s in range(S)]
    return torch.stack([reduce(r) if len(r) else torch.full(data.shape[1:], empty, dtype=data.dtype)
                        for r in rows])


def _loop_softmax(logits, ids, S):
    out = torch.zeros_like(logits)
    for s in range(S):
        if (ids == s).any():
            out[ids == s] = logits[ids == s].softmax(0)
    return out


shapes = dict(seed=st.integers(0, 2**16), E=st.integers(0, 12), S=st.integers(1, 6),
              trailing=st.sampled_from([(), (3,), (2, 2)]))


@given(**shapes)
def test_segment_sum_is_the_loop(seed, E, S, trailing):
    data, ids = _draw(seed, E, S, trailing)
    want = _loop(lambda r: r.sum(0), 0.0, data, ids, S)
    assert torch.allclose(segment_sum(data, ids, S), want, atol=1e-12)


@given(**shapes)
def test_segment_max_is_the_loop_with_minus_inf_for_empty_segments(seed, E, S, trailing):
    data, ids = _draw(seed, E, S, trailing)
    want = _loop(lambda r: r.amax(0), -torch.inf, data, ids, S)
    assert torch.equal(segment_max(data, ids, S), want)


@given(**shapes)
def test_segment_mean_and_min_are_the_loop(seed, E, S, trailing):
    data, ids = _draw(seed, E, S, trailing)
    mean = _loop(lambda r: r.mean(0), 0.0, data, ids, S)
    assert torch.allclose(segment_mean(data, ids, S), mean, atol=1e-12)
    least = _loop(lambda r: r.amin(0), torch.inf, data, ids, S)
    assert torch.equal(segment_min(data, ids, S), least)


@given(**shapes)
def test_segment_softmax_is_the_loop(seed, E, S, trailing):
    logits, ids = _draw(seed, E, S, trailing)
    assert torch.allclose(segment_softmax(logits, ids, S), _loop_softmax(logits, ids, S),
                          atol=1e-12)


@given(seed=st.integers(0, 2**16), E=st.integers(1, 10), S=st.integers(1, 4))
def test_gradients_equal_the_loops(seed, E, S):
    data, ids = _draw(seed, E, S)
    w = random.normal(random.key(seed + 1), (S, 3), torch.float64)
    for ours, ref in [
        (lambda d: segment_sum(d, ids, S), lambda d: _loop(lambda r: r.sum(0), 0.0, d, ids, S)),
        (lambda d: segment_mean(d, ids, S), lambda d: _loop(lambda r: r.mean(0), 0.0, d, ids, S)),
        (lambda d: segment_max(d, ids, S),  # empty segments (-inf) drop out of the loss
         lambda d: _loop(lambda r: r.amax(0), -torch.inf, d, ids, S)),
        (lambda d: segment_min(d, ids, S),
         lambda d: _loop(lambda r: r.amin(0), torch.inf, d, ids, S)),
    ]:
        loss = lambda d, f=ours: (f(d).nan_to_num(neginf=0.0, posinf=0.0) * w).sum()  # noqa: E731
        want = lambda d, f=ref: (f(d).nan_to_num(neginf=0.0, posinf=0.0) * w).sum()  # noqa: E731
        assert torch.allclose(grad(loss)(data), grad(want)(data), atol=1e-12)
    v = random.normal(random.key(seed + 2), (E, 3), torch.float64)
    g = grad(lambda d: (segment_softmax(d, ids, S) * v).sum())(data)
    assert torch.allclose(g, grad(lambda d: (_loop_softmax(d, ids, S) * v).sum())(data),
                          atol=1e-12)


def test_softmax_does_not_overflow_and_an_all_masked_segment_gets_zeros():
    logits = torch.tensor([1000.0, 1001.0, -torch.inf, -torch.inf, 5.0])
    ids = torch.tensor([0, 0, 1, 1, 2])
    p = segment_softmax(logits, ids, 3)
    assert torch.isfinite(p).all()
    want = torch.cat([torch.tensor([1000.0, 1001.0]).softmax(0), torch.zeros(2), torch.ones(1)])
    assert torch.allclose(p, want)
    g = grad(lambda x: segment_softmax(x, ids, 3)[1])(logits)
    assert torch.isfinite(g).all()


def test_vmap_over_data_ids_or_both_equals_the_loop():
    data, _ = _draw(0, 8, 4)
    datas = torch.stack([data, 2 * data, -data])  # (3, E, 3)
    idss = torch.stack([random.randint(random.key(i), (8,), 0, 4) for i in range(3)])
    for f in (segment_sum, segment_mean, segment_max, segment_min, segment_softmax):
        want = torch.stack([f(datas[b], idss[b], 4) for b in range(3)])
        assert torch.allclose(vmap(f, in_dims=(0, 0, None))(datas, idss, 4), want)
        assert torch.allclose(vmap(f, in_dims=(None, 0, None))(data, idss, 4),
                              torch.stack([f(data, idss[b], 4) for b in range(3)]))
        assert torch.allclose(vmap(f, in_dims=(0, None, None))(datas, idss[0], 4),
                              torch.stack([f(datas[b], idss[0], 4) for b in range(3)]))


def test_jvp_equals_the_directional_derivative_of_the_loop():
    data, ids = _draw(1, 9, 3)
    t = random.normal(random.key(7), data.shape, torch.float64)
    for f, ref in [(segment_sum, lambda d: _loop(lambda r: r.sum(0), 0.0, d, ids, 3)),
                   (segment_softmax, lambda d: _loop_softmax(d, ids, 3))]:
        _, got = jvp(lambda d, f=f: f(d, ids, 3), (data,), (t,))
        _, want = torch.autograd.functional.jvp(ref, data, t)
        assert torch.allclose(got, want, atol=1e-12)


def test_compiled_equals_eager():
    data, ids = _draw(2, 10, 4)
    f = lambda d, i: segment_softmax(d, i, 4) + segment_sum(d, i, 4).index_select(0, i)  # noqa: E731
    assert torch.allclose(torch.compile(f, fullgraph=True)(data, ids), f(data, ids))


@pytest.mark.parametrize(
    "data, ids, S, match",
    [
        (torch.zeros(3), torch.tensor([0, 1, 3]), 3, r"in \[0, 3\).*from 0 to 3"),
        (torch.zeros(3), torch.tensor([0, -1, 2]), 3, "from -1 to 2"),
        (torch.zeros(3), torch.tensor([0.0, 1.0, 2.0]), 3, "int64 or int32 tensor"),
        (torch.zeros(3), torch.tensor([[0, 1, 2]]), 3, "int64 or int32 tensor"),
        (torch.zeros(3), torch.tensor([0, 1]), 3, "2 ids for 3 rows"),
        (torch.zeros(3), torch.tensor([0, 1, 2]), -1, "num_segments must be an int >= 0"),
        (torch.zeros(3), torch.tensor([0, 1, 2]), True, "num_segments must be an int >= 0"),
        (torch.tensor(1.0), torch.tensor([0]), 3, "data must be a tensor"),
    ],
)
@pytest.mark.parametrize("f", [segment_sum, segment_mean, segment_max, segment_min,
                               segment_softmax])
def test_bad_input_gets_a_clear_error(f, data, ids, S, match):
    with pytest.raises(ValueError, match=match):
        f(data, ids, S)


def test_integer_data_is_refused_where_it_makes_no_sense():
    ids = torch.tensor([0, 1])
    assert torch.equal(segment_sum(torch.tensor([1, 2]), ids, 2), torch.tensor([1, 2]))
    for f in (segment_mean, segment_max, segment_min):
        with pytest.raises(ValueError, match="data must be floating point, got torch.int64"):
            f(torch.tensor([1, 2]), ids, 2)
    with pytest.raises(ValueError, match="logits must be floating point"):
        segment_softmax(torch.tensor([1, 2]), ids, 2)
