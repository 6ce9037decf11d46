"""Split-KV (FlashDecoding): the split heuristic, the merge identity, and the Triton
forward and dQ with their keys split equal to the unsplit ones and to float64."""

import importlib.util
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchfn import random
from torchfn.kernels import _split_kv, attention, reference_attention

HAS_TRITON = all(importlib.util.find_spec(m) for m in ("triton", "torchfn.kernels._triton_ops"))
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton or _triton_ops is missing")


# ------------------------------------------------------------------ the heuristic
@settings(max_examples=300, deadline=None)
@given(programs=st.integers(1, 600), n_sms=st.integers(1, 200), n_blocks=st.integers(1, 600))
def test_num_splits_is_fa2s_wave_rule(programs, n_sms, n_blocks):
    """No split once 80% of the SMs are busy; else the fewest splits (of those that
    shorten the runs, each >= 2 key blocks) within 85% of the best wave efficiency."""
    s = _split_kv.num_splits(programs, n_sms, n_blocks)
    top = min(64, n_sms, n_blocks // 2)
    if programs >= 0.8 * n_sms or top <= 1:
        assert s == 1
        return
    assert 1 <= s <= top

    def eff(n):
        waves = programs * n / n_sms
        return waves / math.ceil(waves)

    def distinct(n):
        return n == 1 or math.ceil(n_blocks / n) != math.ceil(n_blocks / (n - 1))

    best = max(eff(n) for n in range(1, top + 1) if distinct(n))
    assert distinct(s) and eff(s) >= 0.85 * best
    assert all(eff(n) < 0.85 * best for n in range(1, s) if distinct(n))


@given(nk=st.integers(1, 5000), splits=st.integers(1, 70), align=st.sampled_from([16, 64, 128]))
def test_split_len_covers_the_keys_in_aligned_runs(nk, splits, align):
    length, n = _split_kv.split_len(nk, splits, align)
    assert length % align == 0 and 1 <= n <= splits
    assert (n - 1) * length < nk <= n * length  # every run but the last is full; none empty


@pytest.mark.parametrize("value, want", [("auto", "auto"), ("", "auto"), ("0", 0), ("4", 4)])
def test_mode_reads_the_environment(value, want, monkeypatch):
    monkeypatch.setenv("TORCHFN_TRITON_SPLIT_KV", value)
    assert _split_kv.mode() == want


@pytest.mark.parametrize("value", ["yes", "-1", "2.5"])
def test_bad_mode_is_an_error_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv("TORCHFN_TRITON_SPLIT_KV", value)
    with pytest.raises(ValueError, match=f"TORCHFN_TRITON_SPLIT_KV.*got '{value}'"):
        _split_kv.mode()


# ------------------------------------------------------------------ the merge
@pytest.mark.parametrize("cuts", [(0, 7, 19, 40), (0, 1, 40), (0, 40)])
def test_merge_of_key_runs_is_attention_over_all_keys(cuts, rel_err):
    """Partial (o, lse) over runs of keys merge to the whole; with a causal mask the
    first rows see nothing in the later runs (lse -inf there), and a fully masked row
    stays o = 0, lse = -inf, without NaN."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 16, generator=g, dtype=torch.float64) for n in (9, 40, 40))
    causal = torch.ones(9, 40, dtype=torch.bool).tril(40 - 9)  # bottom-right, as attention's
    mask = (torch.rand(9, 40, generator=g) < 0.8) & causal
    mask[4] = False  # a fully masked row
    parts = [reference_attention(q, k[:, :, a:b], v[:, :, a:b], mask[:, a:b], return_lse=True)
             for a, b in zip(cuts, cuts[1:])]
    o = torch.stack([p[0] for p in parts], 2).float()  # (B, H, S, Nq, D)
    lse = torch.stack([p[1] for p in parts], 2).float()  # (B, H, S, Nq)
    got_o, got_lse = _split_kv.merge(o, lse, torch.float32)
    want_o, want_lse = reference_attention(q, k, v, mask, return_lse=True)
    assert rel_err(got_o, want_o) <= 1e-6
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(got_lse), fin) and not fin[:, :, 4].any()
    assert rel_err(got_lse[fin], want_lse[fin]) <= 1e-6
    assert torch.equal(got_o[:, :, 4], torch.zeros_like(got_o[:, :, 4]))


# ------------------------------------------------------------------ the Triton forward
def _decode_case(B=2, H=4, Hkv=2, Nq=3, Nk=300, D=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, n, D, generator=g) for h, n in ((H, Nq), (Hkv, Nk), (Hkv, Nk)))


OPTIONS = {
    "plain": {},
    "causal": {"causal": True},
    "window-causal": {"causal": True, "window": (90, None)},
    "mask-alibi-softcap": {"mask": "bool", "alibi_slopes": torch.tensor([0.1, 0.2, 0.3, 0.4]),
                           "softcap": 5.0},
    "segments": {"segment_ids": "docs"},
    "dropout": {"dropout": 0.3, "key": random.key(3)},
}


@needs_triton
@pytest.mark.parametrize("name, splits", [(n, 3) for n in OPTIONS]
                         + [("causal", 2), ("causal", 5)])
def test_split_forward_equals_the_unsplit_forward(name, splits, monkeypatch, rel_err):
    """Nq = 3 queries against 300 keys: o and lse with the keys in 2, 3 or 5 runs equal
    the unsplit kernel's to rounding, and the float64 reference; with causal, so do the
    gradients (dQ split the same way, dK/dV from the merged lse). Every option with every
    split count and block shape: ``test_attention_combinations``."""
    q, k, v = _decode_case()
    kw = dict(OPTIONS[name])
    if kw.get("mask") == "bool":
        g = torch.Generator().manual_seed(1)
        kw["mask"] = torch.rand(q.shape[2], k.shape[2], generator=g) < 0.7
    if kw.get("segment_ids") == "docs":
        ids = (torch.arange(k.shape[2]) // 70).expand(2, -1)
        kw["segment_ids"] = (ids[:, -q.shape[2]:], ids)

    def run(env, q, k, v):
        monkeypatch.setenv("TORCHFN_TRITON_SPLIT_KV", env)
        return attention(q, k, v, backend="triton", return_lse=True, **kw)

    whole, split = run("0", q, k, v), run(str(splits), q, k, v)
    ref = reference_attention(q.double(), k.double(), v.double(), return_lse=True, **{
        n: (x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
        for n, x in kw.items()})
    assert rel_err(split[0], whole[0]) <= 1e-6 and rel_err(split[1], whole[1]) <= 1e-6
    assert rel_err(split[0], ref[0]) <= 1e-5 and rel_err(split[1], ref[1]) <= 1e-5
    if name != "causal":
        return
    do = torch.randn_like(q)
    grads = [torch.autograd.grad((run(env, *x)[0] * do).sum(), x)
             for env, x in (("0", [t.clone().requires_grad_() for t in (q, k, v)]),
                            (str(splits), [t.clone().requires_grad_() for t in (q, k, v)]))]
    for a, b in zip(*grads):
        assert rel_err(b, a) <= 1e-6


@needs_triton
def test_one_query_against_many_keys_in_many_splits(monkeypatch, rel_err):
    """Decoding: Nq = 1, 64 splits of 16 keys with a 16-wide key block."""
    from torchfn.kernels import _triton_configs, _triton_ops

    monkeypatch.setattr(_triton_configs, "_INTERP_CONFIGS",
                        dict(_triton_configs._INTERP_CONFIGS, fwd=(16, 16, 4, 1)))
    monkeypatch.setenv("TORCHFN_TRITON_SPLIT_KV", "64")
    q, k, v = _decode_case(B=1, H=2, Hkv=1, Nq=1, Nk=1000, D=16, seed=4)
    assert _triton_ops._splits(2, 1, 1000, q.device, None) == (63, 16)
    o, lse = attention(q, k, v, causal=True, backend="triton", return_lse=True)
    want = reference_attention(q.double(), k.double(), v.double(), causal=True,
                               return_lse=True)
    assert rel_err(o, want[0]) <= 1e-5 and rel_err(lse, want[1]) <= 1e-5


@needs_triton
def test_interpreter_and_cpu_never_split_by_themselves(monkeypatch):
    from torchfn.kernels import _triton_ops

    monkeypatch.delenv("TORCHFN_TRITON_SPLIT_KV", raising=False)
    assert _triton_ops._splits(1, 1, 100_000, torch.device("cpu"), None) == (1, 100_000)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_merge_kernel_is_the_torch_merge(dtype, rel_err):
    """The one-launch Triton merge equals ``_split_kv.merge``, empty rows included
    (a row no split saw, a row only some splits saw), at a non-power-of-two S and D."""
    from torchfn.kernels import _triton_ops

    g = torch.Generator().manual_seed(0)
    o, lse = torch.randn(2, 3, 5, 4, 20, generator=g), torch.randn(2, 3, 5, 4, generator=g)
    lse[0, 0, :, 1] = float("-inf")  # no split saw it
    lse[1, 2, 2:, 3] = float("-inf")  # only splits 0 and 1 did
    got, want = _triton_ops._merge(o, lse, dtype), _split_kv.merge(o, lse, dtype)
    assert got[0].dtype == dtype and rel_err(got[0], want[0]) <= 1e-6
    assert torch.equal(got[1].isinf(), want[1].isinf()) and got[1][0, 0, 1] == float("-inf")
    fin = want[1].isfinite()
    assert rel_err(got[1][fin], want[1][fin]) <= 1e-6
    assert torch.equal(got[0][0, 0, 1], torch.zeros(20, dtype=dtype))


@needs_triton
@pytest.mark.parametrize("t_split, t_whole, off, want", [(1.0, 2.0, 0.0, True),
                                                         (2.0, 1.0, 0.0, False),
                                                         (1.0, 2.0, 0.5, False)],
                         ids=["split-faster", "whole-faster", "split-wrong"])
def test_the_tuner_keeps_the_split_only_where_it_is_faster_and_right(t_split, t_whole, off,
                                                                     want, monkeypatch):
    """On a GPU, auto mode times the split forward against the unsplit one once per shape
    class (a fake clock here) and keeps the faster; a split whose results differ from the
    unsplit ones by more than rounding is never used, and says so."""
    import triton.testing

    from torchfn.kernels import _triton_ops

    monkeypatch.setattr(_triton_ops, "_SPLIT_PICKS", {})
    monkeypatch.delenv("TORCHFN_TRITON_SPLIT_KV", raising=False)
    monkeypatch.delenv("TORCHFN_TRITON_AUTOTUNE", raising=False)
    o, lse = torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1)
    calls = []
    split = lambda: (calls.append("split"), (o + off, lse))[1]  # noqa: E731
    whole = lambda: (calls.append("whole"), (o, lse))[1]  # noqa: E731
    clock = {split: t_split, whole: t_whole}
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: clock[fn])
    cuda = torch.device("cuda")
    if off:
        with pytest.warns(RuntimeWarning, match="split-KV .* not used"):
            assert _triton_ops._split_wins(("k",), cuda, None, split, whole) is want
    else:
        assert _triton_ops._split_wins(("k",), cuda, None, split, whole) is want
    n = len(calls)
    assert _triton_ops._split_wins(("k",), cuda, None, split, whole) is want  # remembered
    assert len(calls) == n
    # a forced count, an explicit config or the tuner off: the heuristic's split stands
    monkeypatch.setenv("TORCHFN_TRITON_AUTOTUNE", "0")
    assert _triton_ops._split_wins(("other",), cuda, None, split, whole) is True


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_ragged_cache_as_segment_ids_is_the_key_padding_mask(backend, monkeypatch, rel_err):
    """The README's recipe for a KV cache of per-sequence lengths: ids 0 for the queries
    and the valid keys, 1 for the padding, give the key padding mask's result (and let
    the kernels skip the padding blocks); with the keys split in 3 on Triton."""
    monkeypatch.setenv("TORCHFN_TRITON_SPLIT_KV", "3")
    q, k, v = _decode_case(B=3, H=4, Hkv=2, Nq=1, Nk=300, seed=5)
    lens = torch.tensor([300, 17, 160])
    pad = torch.arange(300) >= lens[:, None]  # (B, Nk) True = padding
    ids = (torch.zeros(3, 1, dtype=torch.long), pad.long())
    got = attention(q, k, v, segment_ids=ids, backend=backend, return_lse=True)
    want = attention(q, k, v, key_padding_mask=~pad, backend=backend, return_lse=True)
    assert rel_err(got[0], want[0]) <= 1e-6 and rel_err(got[1], want[1]) <= 1e-6
