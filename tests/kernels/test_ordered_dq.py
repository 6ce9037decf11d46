"""The ordered dQ (``DQ_ORDERED``): the 5-matmul backward that stays bitwise reproducible.

The schedule is a protocol between programs that run at once, which the interpreter
(one program after another) cannot exercise. So it is checked in three parts:

* the protocol itself, in ``_ordered_dq``'s Python mirror: a simulated GPU runs the
  programs of a launch in any interleaving, with as many slots as the wave needs, and
  must always finish, each query block's tiles added in a fixed order (the turns form
  0, 1, 2, ...); in lockstep nobody waits, the property the order was chosen for;
* the kernel's turn arithmetic against the mirror, in the interpreter;
* the kernel end to end in the interpreter, against the float64 reference and the
  7-matmul backward, with every lock counting exactly the tiles the mirror says.

The bulk reduce and the inline-PTX spin run only on a GPU (``test_triton_gpu.py``); the
sm_90 build is checked in ``test_aot_sm90.py``.
"""

import importlib.util
import random as pyrandom
from collections import defaultdict

import pytest
import torch
from _budget import interpreter_examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchfn.kernels import _ordered_dq, reference_attention

HAS_TRITON = all(importlib.util.find_spec(m) for m in ("triton", "torchfn.kernels._triton_ops"))
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton or _triton_ops is missing")
SETTINGS = dict(deadline=None,  # derandomized by the ci profile, random in dev / stress
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def launches(draw):
    """(n_q, n_k, block_m, block_n, causal, heads, group, wave) of one launch."""
    n_q, n_k = draw(st.integers(1, 200)), draw(st.integers(1, 200))
    bm, bn = draw(st.sampled_from([16, 32, 64])), draw(st.sampled_from([16, 32, 64]))
    causal = draw(st.booleans())
    wave = _ordered_dq.wave_cap(draw(st.integers(1, 8)), -(-n_q // bm), -(-n_k // bn))
    return n_q, n_k, bm, bn, causal, draw(st.integers(1, 3)), draw(st.integers(1, 3)), wave


def _simulate(sched, slots, pick):
    """Run ``sched`` (per ticket, its (head, block, turn) tiles) on ``slots`` slots,
    tickets handed out in order as slots free up; ``pick(runnable)`` chooses who moves.
    Returns each (head, block)'s turns in the order their tiles were added, or raises
    on a deadlock."""
    count, added = defaultdict(int), defaultdict(list)
    pos, resident, next_ticket = [0] * len(sched), [], 0
    while True:
        while len(resident) < slots and next_ticket < len(sched):
            resident.append(next_ticket)
            next_ticket += 1
        if not resident:
            return added
        runnable = [t for t in resident if count[sched[t][pos[t]][:2]] == sched[t][pos[t]][2]]
        if not runnable:
            raise AssertionError(f"deadlock: {[(t, sched[t][pos[t]]) for t in resident]}")
        for t in pick(runnable):
            head, mb, turn = sched[t][pos[t]]
            added[head, mb].append(turn)
            count[head, mb] += 1
            pos[t] += 1
            if pos[t] == len(sched[t]):
                resident.remove(t)


def _contributors(n_q, n_k, bm, bn, causal, heads, group):
    """(query head, block) -> how many key blocks add a tile to it (from the mask)."""
    n_m, n_kb, shift = -(-n_q // bm), -(-n_k // bn), n_k - n_q
    out = {}
    for h in range(heads * group):
        for mb in range(n_m):
            rows_hi = min((mb + 1) * bm, n_q) - 1  # the block's last query row
            out[h, mb] = (sum(1 for kb in range(n_kb)
                              if max(kb * bn - shift, 0) // bm <= mb) if causal else n_kb)
            if causal and rows_hi + shift < 0:  # (no key reaches the block)
                assert out[h, mb] == 0
    return out


@settings(max_examples=200, **SETTINGS)
@given(launch=launches(), extra_slots=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_any_interleaving_finishes_and_adds_each_block_in_a_fixed_order(launch, extra_slots,
                                                                       seed):
    n_q, n_k, bm, bn, causal, heads, group, wave = launch
    sched = _ordered_dq.schedule(n_q, n_k, bm, bn, causal, heads, group, wave)
    rng = pyrandom.Random(seed)
    added = _simulate(sched, wave + extra_slots, lambda run: [rng.choice(run)])
    want = _contributors(n_q, n_k, bm, bn, causal, heads, group)
    assert {k: n for k, n in want.items() if n} == {k: len(v) for k, v in added.items()}
    assert all(turns == list(range(len(turns))) for turns in added.values())


@settings(max_examples=200, **SETTINGS)
@given(launch=launches())
def test_in_lockstep_nobody_waits(launch):
    """Every resident program moves one tile per step if its turn has come (all at once:
    the counts are those at the start of the step). Causal with BLOCK_M <= BLOCK_N (every
    tuned dK/dV tile) and Nk <= Nq: the predecessor was always there first. (With more
    keys than queries, the key blocks before the first query all start at query block
    0 and queue there; auto mode leaves those shapes to the 7-matmul backward.)
    Non-causal, one wave per head: the rotation keeps the wave's programs on different
    query blocks."""
    n_q, n_k, bm, bn, causal, heads, group, wave = launch
    n_kb = -(-n_k // bn)
    if causal:
        bm, n_k = min(bm, bn), min(n_k, n_q)
    else:  # at most as many key blocks as query blocks, all in one wave
        n_k = min(n_k, -(-n_q // bm) * bn)
        n_kb = -(-n_k // bn)
        wave = heads * n_kb
    sched = _ordered_dq.schedule(n_q, n_k, bm, bn, causal, heads, group, wave)
    pos = [0] * len(sched)
    count = defaultdict(int)
    while any(p < len(s) for p, s in zip(pos, sched)):
        moves = [t for t, s in enumerate(sched) if pos[t] < len(s)]
        for t in moves:  # all in this step, against the counts at its start
            assert count[sched[t][pos[t]][:2]] == sched[t][pos[t]][2], (t, pos[t], n_kb)
        for t in moves:
            count[sched[t][pos[t]][:2]] += 1
            pos[t] += 1


def test_a_wave_larger_than_the_gpu_holds_can_deadlock():
    """Why the wave is sized from the GPU's capacity: with fewer slots than a wave, the
    first programs wait for ones that never start."""
    sched = _ordered_dq.schedule(256, 256, 64, 64, False, heads=1, wave=4)
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate(sched, 2, lambda run: run[:1])


@pytest.mark.parametrize("value, want", [("auto", "auto"), ("", "auto"), ("0", "0"),
                                         (" 1 ", "1")])
def test_mode_reads_the_environment(value, want, monkeypatch):
    monkeypatch.setenv("TORCHFN_TRITON_ORDERED_DQ", value)
    assert _ordered_dq.mode() == want


def test_bad_mode_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("TORCHFN_TRITON_ORDERED_DQ", "yes")
    with pytest.raises(ValueError, match="TORCHFN_TRITON_ORDERED_DQ.*'yes'"):
        _ordered_dq.mode()


if HAS_TRITON:  # (a kernel's globals are its module's)
    import triton
    import triton.language as tl

    from torchfn.kernels._triton_ordered_dq import _dq_turn, _wave_slot

    @triton.jit
    def _turn_probe(ARGS, OUT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr):
        """OUT[i] = the kernel's turn for ARGS[i] = (block, ticket, key blocks, Nk - Nq,
        wave), keyed as ``_attn_bwd_dkdv`` keys it."""
        i = tl.program_id(0)
        mb = tl.load(ARGS + 5 * i)
        ticket = tl.load(ARGS + 5 * i + 1)
        n_kb = tl.load(ARGS + 5 * i + 2)
        shift = tl.load(ARGS + 5 * i + 3)
        wave = tl.load(ARGS + 5 * i + 4)
        head_first = ticket // n_kb * n_kb
        R, F, a = _wave_slot(ticket, head_first, n_kb, wave)
        kb = ticket - head_first
        if CAUSAL:
            kb = n_kb - 1 - kb
        tl.store(OUT + i, _dq_turn(mb, kb, n_kb, shift, R, F, a, CAUSAL, BLOCK_M, BLOCK_N))


@needs_triton
def test_kernel_turns_are_the_python_schedule():
    """``_dq_turn`` / ``_wave_slot`` (Triton, the interpreter) against the mirror."""
    rng = pyrandom.Random(0)
    for causal in (False, True):
        rows, want = [], []
        for _ in range(64):
            n_kb, n_m = rng.randint(1, 9), rng.randint(1, 9)
            ticket, wave = rng.randrange(3 * n_kb), rng.randint(1, n_m)
            shift = rng.randint(-40, 40) if causal else 0
            bh, kb = _ordered_dq.key_block(ticket, n_kb, causal)
            R, F, a = _ordered_dq.wave_slot(ticket, bh * n_kb, n_kb, wave)
            # a block this program visits (a causal key block's, or any)
            first = _ordered_dq.first_block(kb, n_m, shift, 16, 32, causal, a)
            if causal and first >= n_m:
                continue
            mb = rng.randrange(first, n_m) if causal else rng.randrange(n_m)
            rows.append([mb, ticket, n_kb, shift, wave])
            want.append(_ordered_dq.turn(mb, kb=kb, n_kb=n_kb, shift=shift, block_m=16,
                                         block_n=32, R=R, F=F, a=a, causal=causal))
        args = torch.tensor(rows, dtype=torch.int32)
        out = torch.zeros(len(rows), dtype=torch.int32)
        _turn_probe[(len(rows),)](args, out, BLOCK_M=16, BLOCK_N=32, CAUSAL=causal)
        assert out.tolist() == want


@st.composite
def shapes(draw):
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    Nq, Nk = draw(st.integers(1, 90)), draw(st.integers(1, 90))
    blocks = draw(st.sampled_from([(16, 32), (32, 16), (16, 16), (32, 64)]))
    mask = draw(st.sampled_from([None, "bool", "additive"]))
    return B, Hkv * G, Hkv, Nq, Nk, draw(st.sampled_from([16, 20])), draw(st.booleans()), \
        blocks, mask


@needs_triton
@settings(max_examples=interpreter_examples(16), **SETTINGS)  # ~1.6 s each in the interpreter
@given(shape=shapes(), seed=st.integers(0, 2**16))
def test_ordered_backward_is_the_reference_and_counts_every_tile(shape, seed, rel_err):
    """fp32 within 1e-5 of float64; bitwise the same on a second run; the 7-matmul
    backward's dk, dv, dq to rounding; every ticket taken, no wait timed out (in the
    interpreter a wrong turn would), and each lock counts its block's key blocks. And
    ``deterministic=False``'s bulk reduces without locks, against float64."""
    with pytest.MonkeyPatch.context() as mp:
        _check_ordered(shape, seed, mp, rel_err)


def _check_ordered(shape, seed, monkeypatch, rel_err):
    from torchfn.kernels import _triton_configs, _triton_ops, _triton_ordered_bwd

    B, H, Hkv, Nq, Nk, D, causal, (bm, bn), mask_kind = shape
    g = torch.Generator().manual_seed(seed)
    q64 = torch.randn(B, H, Nq, D, generator=g, dtype=torch.float64)
    k64, v64 = (torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64) for _ in "kv")
    do64 = torch.randn(B, H, Nq, D, generator=g, dtype=torch.float64)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, H, Nq, Nk, generator=g) < 0.8
    elif mask_kind == "additive":
        mask = torch.randn(B, H, Nq, Nk, generator=g, dtype=torch.float64)
    scale = D ** -0.5
    q, k, v, do = (x.float() for x in (q64, k64, v64, do64))
    m32 = mask.float() if mask is not None and mask.is_floating_point() else mask
    monkeypatch.setitem(_triton_configs._INTERP_CONFIGS, "dkdv_ordered", (bm, bn, 4, 1))
    o, lse = _triton_ops.fwd(q, k, v, m32, causal, scale)
    monkeypatch.setenv("TORCHFN_TRITON_ORDERED_DQ", "1")
    got = _triton_ops.bwd(q, k, v, o, lse, do, m32, causal, scale)
    locks = _triton_ordered_bwd._LAST_LOCKS[0]
    again = _triton_ops.bwd(q, k, v, o, lse, do, m32, causal, scale)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    # deterministic=False: the same bulk reduces without the locks
    unordered = _triton_ops.bwd(q, k, v, o, lse, do, m32, causal, scale, False)
    assert not _triton_ordered_bwd._LAST_LOCKS[0][2:].any()  # no lock was counted
    monkeypatch.setenv("TORCHFN_TRITON_ORDERED_DQ", "0")
    plain = _triton_ops.bwd(q, k, v, o, lse, do, m32, causal, scale)

    def loss(q, k, v):
        o = reference_attention(q, k, v, mask=mask, causal=causal, scale=scale)
        return (o * do64).sum()

    ref = torch.func.grad(loss, argnums=(0, 1, 2))(q64, k64, v64)
    for name, a, b, c, u in zip("qkv", got, ref, plain, unordered):
        assert rel_err(a, b) <= 1e-5, name
        assert rel_err(a, c) <= 1e-5, name
        assert rel_err(u, b) <= 1e-5, name
    n_kb, n_m = -(-Nk // bn), -(-Nq // bm)
    assert locks[0].item() == B * Hkv * n_kb and locks[1].item() == 0
    want = _contributors(Nq, Nk, bm, bn, causal, B * Hkv, H // Hkv)
    counted = locks[2:2 + B * H * n_m].view(B * H, n_m)
    assert counted.tolist() == [[want[h, mb] for mb in range(n_m)] for h in range(B * H)]


@needs_triton
@pytest.mark.parametrize("t_ord, t_plain, off, want", [(1.0, 2.0, 0.0, True),
                                                       (2.0, 1.0, 0.0, False),
                                                       (1.0, 2.0, 0.5, False)],
                         ids=["ordered-faster", "plain-faster", "ordered-wrong"])
def test_the_tuner_keeps_the_ordered_dq_only_where_it_is_faster_and_right(t_ord, t_plain,
                                                                          off, want,
                                                                          monkeypatch):
    """On a GPU, auto mode times the two deterministic backwards once per shape class (a
    fake clock here) and keeps the faster; one whose results differ by more than rounding
    is never used, and says so. Without the tuner, or with an explicit config, the
    7-matmul backward stays; "1" forces the ordered one."""
    import triton.testing

    from torchfn.kernels import _triton_ordered_bwd

    monkeypatch.setattr(_triton_ordered_bwd, "_ORDER_PICKS", {})
    monkeypatch.setattr(_triton_ordered_bwd, "_LAST_LOCKS", [])
    monkeypatch.delenv("TORCHFN_TRITON_ORDERED_DQ", raising=False)
    monkeypatch.delenv("TORCHFN_TRITON_AUTOTUNE", raising=False)
    grads = tuple(torch.randn(2, 3, 5, 8) for _ in range(3))
    calls = []
    ordered = lambda: (calls.append("o"), tuple(x + off for x in grads))[1]  # noqa: E731
    plain = lambda: (calls.append("p"), grads)[1]  # noqa: E731
    clock = {ordered: t_ord, plain: t_plain}
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: clock[fn])
    cuda = torch.device("cuda")
    if off:
        with pytest.warns(RuntimeWarning, match="ordered-dQ .* not used"):
            assert _triton_ordered_bwd.wins((True, "k"), cuda, None, ordered, plain) is want
    else:
        assert _triton_ordered_bwd.wins((True, "k"), cuda, None, ordered, plain) is want
    n = len(calls)
    assert _triton_ordered_bwd.wins((True, "k"), cuda, None, ordered, plain) is want  # kept
    assert len(calls) == n
    assert _triton_ordered_bwd.wins((True, "k2"), cuda, ((32, 64, 4, 3),) * 2, ordered,
                                     plain) is False
    monkeypatch.setenv("TORCHFN_TRITON_AUTOTUNE", "0")
    assert _triton_ordered_bwd.wins((True, "k3"), cuda, None, ordered, plain) is False
    monkeypatch.setenv("TORCHFN_TRITON_ORDERED_DQ", "1")
    assert _triton_ordered_bwd.wins((True, "k4"), cuda, None, ordered, plain) is True


def test_every_listed_ordered_config_has_block_m_at_most_block_n():
    """The causal no-wait property above needs BLOCK_M <= BLOCK_N: the tables keep to it."""
    from torchfn.kernels import _triton_configs as C

    listed = [c for table in (C._GPU_CONFIGS, C._GPU_TMA_CONFIGS)
              for cfgs in table["dkdv_ordered"].values() for c in cfgs]
    listed.append(C._INTERP_CONFIGS["dkdv_ordered"])
    assert listed and all(bm <= bn for bm, bn, *_ in listed), listed


@needs_triton
def test_per_sample_gradients_through_the_ordered_dq_equal_the_loop(monkeypatch, rel_err):
    """``vmap(grad)`` through ``attention`` folds the vmapped dim into the batch: the
    ordered dQ then runs over B x H heads at once, and must give each example's own
    gradients (a lock or a ticket shared across examples would mix them)."""
    from torchfn.kernels import _triton_ordered_bwd, attention

    monkeypatch.setenv("TORCHFN_TRITON_ORDERED_DQ", "1")
    monkeypatch.setattr(_triton_ordered_bwd, "_LAST_LOCKS", [])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 40, 16, generator=g)
    k, v = (torch.randn(3, 1, 50, 16, generator=g) for _ in "kv")

    def loss(q, k, v):
        o = attention(q[None], k[None], v[None], causal=True, backend="triton")
        return (o * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum()

    grad = torch.func.grad(loss, argnums=(0, 1, 2))
    per_sample = torch.func.vmap(grad)(q, k, v)
    locks = _triton_ordered_bwd._LAST_LOCKS
    assert locks and locks[0][0].item() > 0  # it ran
    loop = [grad(q[i], k[i], v[i]) for i in range(3)]
    for got, want in zip(per_sample, zip(*loop)):
        assert rel_err(got, torch.stack(want)) <= 1e-6
