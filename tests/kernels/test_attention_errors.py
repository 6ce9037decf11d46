"""Bad input to ``attention``: errors that name the argument, the expectation and the value."""

import os
import sys

import pytest
import torch

from torchfn.kernels import AttentionBackendError, _dispatch, attention, reference_attention


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(2, 4, 5, 8, generator=g),
        torch.randn(2, 2, 6, 8, generator=g),
        torch.randn(2, 2, 6, 8, generator=g),
    )


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda q, k, v: ([1.0], k, v), TypeError, r"q must be a torch.Tensor, got list"),
        (
            lambda q, k, v: (q[0], k, v),
            ValueError,
            r"q must be 4-D \(B, H, Nq, D\), got shape \(4, 5, 8\)",
        ),
        (
            lambda q, k, v: (q, k[None], v),
            ValueError,
            r"k must be 4-D \(B, Hkv, Nk, D\), got shape",
        ),
        (lambda q, k, v: (q.long(), k, v), TypeError, r"q must be float16, .* got torch.int64"),
        (
            lambda q, k, v: (q, k.double(), v),
            TypeError,
            r"k.dtype must equal q.dtype \(torch.float32\), got torch.float64",
        ),
        (lambda q, k, v: (q, k, v.half()), TypeError, r"v.dtype must equal q.dtype"),
        (
            lambda q, k, v: (q, k, v.to("meta")),
            ValueError,
            r"v must be on q's device \(cpu\), got meta",
        ),
        (
            lambda q, k, v: (q, k, v[:, :, :5]),
            ValueError,
            r"v must have k's \(B, Hkv, Nk\) = \(2, 2, 6\) \(any head dim Dv\), "
            r"got shape \(2, 2, 5, 8\)",
        ),
        (
            lambda q, k, v: (q, k, v[0]),
            ValueError,
            r"v must be 4-D \(B, Hkv, Nk, Dv\), got shape \(2, 6, 8\)",
        ),
        (
            lambda q, k, v: (q, k, torch.ones(2, 2, 6, 257)),
            ValueError,
            r"head dim Dv must be in 1..256, got 257",
        ),
        (
            lambda q, k, v: (q, k[:1], v[:1]),
            ValueError,
            r"k must have batch size B = 2 \(from q\), got 1",
        ),
        (
            lambda q, k, v: (q, k[..., :4], v[..., :4]),
            ValueError,
            r"k must have head dim D = 8 \(from q\), got 4",
        ),
        (
            lambda q, k, v: (q[:, :3], k, v),
            ValueError,
            r"H = 3 must be a multiple of k's heads Hkv .* got Hkv = 2",
        ),
        (lambda q, k, v: (q[:, :, :0], k, v), ValueError, r"q and k must have no empty dim"),
        (
            lambda q, k, v: (
                torch.ones(1, 1, 2, 257),
                torch.ones(1, 1, 2, 257),
                torch.ones(1, 1, 2, 257),
            ),
            ValueError,
            r"head dim D must be in 1..256, got 257",
        ),
    ],
)
def test_bad_qkv(qkv, change, error, match):
    with pytest.raises(error, match=match):
        attention(*change(*qkv))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(mask=torch.ones(5, 7, dtype=torch.bool)),
            ValueError,
            r"mask must broadcast to \(B, H, Nq, Nk\) = \(2, 4, 5, 6\), got shape \(5, 7\)",
        ),
        (
            dict(mask=torch.ones(3, 4, 5, 6, dtype=torch.bool)),
            ValueError,
            r"mask must broadcast .* got shape \(3, 4, 5, 6\)",
        ),
        (
            dict(mask=torch.ones(1, 2, 4, 5, 6, dtype=torch.bool)),
            ValueError,
            r"mask must broadcast",
        ),
        (
            dict(mask=torch.ones(5, 6, dtype=torch.int32)),
            TypeError,
            r"mask must be bool .* got torch.int32",
        ),
        (
            dict(mask=torch.zeros(5, 6, dtype=torch.float16)),
            TypeError,
            r"additive float mask of q's dtype \(torch.float32\) or float32, got torch.float16",
        ),
        (
            dict(mask=torch.zeros(5, 6, requires_grad=True)),
            ValueError,
            r"mask must not require grad",
        ),
        (dict(mask=[[True]]), TypeError, r"mask must be a torch.Tensor or None, got list"),
        (
            dict(mask=torch.zeros(5, 6, device="meta")),
            ValueError,
            r"mask must be on q's device \(cpu\), got meta",
        ),
        (
            dict(key_padding_mask=torch.ones(2, 5, dtype=torch.bool)),
            ValueError,
            r"key_padding_mask must have shape \(B, Nk\) = \(2, 6\), got \(2, 5\)",
        ),
        (
            dict(key_padding_mask=torch.ones(2, 6)),
            TypeError,
            r"key_padding_mask must be a bool tensor \(True = attend\), got torch.float32",
        ),
        (dict(causal=1), TypeError, r"causal must be a bool, got int"),
        (dict(deterministic=None), TypeError, r"deterministic must be a bool, got NoneType"),
        (dict(scale="0.1"), TypeError, r"scale must be a float or None, got str"),
        (dict(scale=float("inf")), ValueError, r"scale must be finite, got inf"),
        (
            dict(backend="cuda"),
            ValueError,
            r"backend must be one of None, 'torch', 'triton', got 'cuda'",
        ),
    ],
)
def test_bad_options(qkv, kwargs, error, match):
    with pytest.raises(error, match=match):
        attention(*qkv, **kwargs)


def test_reference_validates_too(qkv):
    q, k, v = qkv
    with pytest.raises(
        ValueError, match=r"H = 4 must be a multiple of k's heads Hkv .* got Hkv = 3"
    ):
        reference_attention(q, k[:, :1].expand(2, 3, 6, 8), v[:, :1].expand(2, 3, 6, 8))


def test_triton_rejects_float64(qkv):
    with pytest.raises(TypeError, match=r"backend='triton' supports .* got float64"):
        attention(*(x.double() for x in qkv), backend="triton")


def test_triton_missing_package(qkv, monkeypatch):
    monkeypatch.setattr(_dispatch, "_triton_found", [False])
    with pytest.raises(AttentionBackendError, match=r"backend='triton' needs the triton package"):
        attention(*qkv, backend="triton")
    assert attention(*qkv).shape == qkv[0].shape  # backend=None never needs it


def test_triton_on_cpu_needs_interpreter_before_triton_language(qkv, monkeypatch):
    """Too late to switch the interpreter on: a clear error. Early enough: it is switched on."""
    monkeypatch.setattr(_dispatch, "_triton_found", [True])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(sys.modules, "triton.language", sys.modules.get("triton.language", os))
    with pytest.raises(AttentionBackendError, match=r"TRITON_INTERPRET=None .* already loaded"):
        attention(*qkv, backend="triton")
    monkeypatch.delitem(sys.modules, "triton.language")
    assert _dispatch._resolve_backend("triton", qkv[0]) == "triton"
    assert os.environ["TRITON_INTERPRET"] == "1"


@pytest.mark.parametrize(
    "window, error, match",
    [
        (-1, ValueError, r"window's left side must be >= 0 \(None: unbounded\), got -1"),
        ((3, -2), ValueError, r"window's right side must be >= 0 .*got -2"),
        (1.5, TypeError, r"window must be None, an int w >= 0 .* got 1.5"),
        ((1, 2, 3), TypeError, r"window must be None, an int .*pair .* got \(1, 2, 3\)"),
        (True, TypeError, r"window must be None, an int .* got True"),
        ((2, 0.5), TypeError, r"window's right side must be an int >= 0 or None, got 0.5"),
        (("a", None), TypeError, r"window's left side must be an int >= 0 or None, got 'a'"),
    ],
)
@pytest.mark.parametrize("fn", [attention, reference_attention], ids=["attention", "reference"])
def test_bad_window(qkv, window, error, match, fn):
    with pytest.raises(error, match=match):
        fn(*qkv, window=window)


def test_window_that_excludes_nothing_is_no_window(qkv):
    # a side at least as wide as the sequence drops out (the fast paths stay in use)
    q, k, _ = qkv  # Nq = 5, Nk = 6
    norm = lambda w, causal=False: _dispatch._normalize_window(w, causal, 5, 6)  # noqa: E731
    assert norm(None) == norm(5) == norm((None, None)) == norm((7, 4)) == (-1, -1)
    assert norm((4, 3)) == (4, 3) and norm(0) == (0, 0)
    assert norm((2, 0), causal=True) == (2, -1)  # causal is the tighter right side


@pytest.mark.parametrize(
    "ids, error, match",
    [
        (lambda B, Nq, Nk: torch.zeros(B, Nq, dtype=torch.long), ValueError,
         r"segment_ids as one \(B, N\) tensor needs Nq == Nk .*Nq = 5 and Nk = 6"),
        (lambda B, Nq, Nk: (torch.zeros(B, Nq), torch.zeros(B, Nk, dtype=torch.long)),
         TypeError, r"segment_ids' q_ids must be an integer tensor, got torch.float32"),
        (lambda B, Nq, Nk: (torch.zeros(B, Nq, dtype=torch.long),
                            torch.zeros(B, Nk + 1, dtype=torch.long)),
         ValueError, r"segment_ids' kv_ids must have shape \(B, Nk\) = \(2, 6\), got \(2, 7\)"),
        (lambda B, Nq, Nk: [0, 1], TypeError,
         r"segment_ids' q_ids must be an integer tensor, got int"),
        (lambda B, Nq, Nk: "doc", TypeError,
         r"segment_ids must be None, a \(B, N\) integer tensor"),
        (lambda B, Nq, Nk: (torch.zeros(B, Nq, dtype=torch.long),
                            torch.zeros(B, Nk, dtype=torch.long, device="meta")),
         ValueError, r"segment_ids' kv_ids must be on q's device \(cpu\), got meta"),
    ],
)
@pytest.mark.parametrize("fn", [attention, reference_attention], ids=["attention", "reference"])
def test_bad_segment_ids(qkv, ids, error, match, fn):
    q, k, _ = qkv
    with pytest.raises(error, match=match):
        fn(*qkv, segment_ids=ids(q.shape[0], q.shape[2], k.shape[2]))


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("inf"), float("nan"), True, "30"])
@pytest.mark.parametrize("fn", [attention, reference_attention], ids=["attention", "reference"])
def test_bad_softcap(qkv, softcap, fn):
    with pytest.raises(ValueError, match=r"softcap must be None or a finite number > 0, got"):
        fn(*qkv, softcap=softcap)
