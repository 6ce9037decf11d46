"""The public ``attention``: validation, mask normalisation and the choice of backend."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from typing import NamedTuple

import torch
from torch import Tensor

from . import _autograd, _dropout

BACKENDS = ("torch", "triton")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_triton_found: list[bool] = []  # cache of "is the triton package installed"


class AttentionBackendError(RuntimeError):
    """The requested attention backend cannot run here (no triton, or no interpreter on CPU)."""


class _Args(NamedTuple):
    mask: Tensor | None  # bool or additive, 4-D, broadcastable to (B, H, Nq, Nk), not expanded
    causal: bool
    scale: float
    backend: str
    window: tuple[int, int]  # (left, right); -1: unbounded (or bounded by causal)
    segments: tuple[Tensor, Tensor] | None  # (q ids (B, Nq), kv ids (B, Nk)), int64
    softcap: float  # 0.0: none
    dropout: float  # 0.0: none
    seeds: Tensor | None  # (B, H, 2) int32 per-head dropout keys; None: no dropout
    slopes: Tensor | None  # (B, H) ALiBi slopes, float32 (float64 for float64 q); None: none


def _triton_available() -> bool:
    if not _triton_found:
        _triton_found.append(importlib.util.find_spec("triton") is not None)
    return _triton_found[0]


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            want = {"q": "(B, H, Nq, D)", "k": "(B, Hkv, Nk, D)", "v": "(B, Hkv, Nk, Dv)"}[name]
            raise ValueError(f"{name} must be 4-D {want}, got shape {tuple(x.shape)}")
        if x.dtype not in _FLOATS:
            raise TypeError(
                f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}"
            )
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}.dtype must equal q.dtype ({q.dtype}), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {x.device}")
    B, H, Nq, D = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"v must have k's (B, Hkv, Nk) = {tuple(k.shape[:3])} (any head dim Dv), "
            f"got shape {tuple(v.shape)}"
        )
    if k.shape[0] != B:
        raise ValueError(f"k must have batch size B = {B} (from q), got {k.shape[0]}")
    if k.shape[3] != D:
        raise ValueError(f"k must have head dim D = {D} (from q), got {k.shape[3]}")
    for name, d in (("D", D), ("Dv", v.shape[3])):
        if not 1 <= d <= 256:
            raise ValueError(f"head dim {name} must be in 1..256, got {d}")
    Hkv = k.shape[1]
    if Hkv == 0 or H % Hkv:
        raise ValueError(
            f"q's heads H = {H} must be a multiple of k's heads Hkv (GQA/MQA), got Hkv = {Hkv}"
        )
    if 0 in q.shape or 0 in k.shape:
        raise ValueError(
            f"q and k must have no empty dim, got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )


def _normalize_mask(
    mask: Tensor | None, key_padding_mask: Tensor | None, q: Tensor, k: Tensor
) -> Tensor | None:
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    full = (B, H, Nq, Nk)
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool and mask.dtype not in (q.dtype, torch.float32):
            raise TypeError(
                f"mask must be bool (True = attend) or an additive float mask of q's dtype "
                f"({q.dtype}) or float32, got {mask.dtype}"
            )
        if mask.dtype != torch.bool and mask.requires_grad:
            raise ValueError(
                "mask must not require grad: masks are constants and no gradient flows "
                "into them; detach it, or use reference_attention to differentiate a bias"
            )
        if mask.device != q.device:
            raise ValueError(f"mask must be on q's device ({q.device}), got {mask.device}")
        shape = tuple(mask.shape)
        if len(shape) > 4 or any(m not in (1, f) for m, f in zip(shape[::-1], full[::-1])):
            raise ValueError(
                f"mask must broadcast to (B, H, Nq, Nk) = {full}, got shape {shape}"
            )
        mask = mask[(None,) * (4 - len(shape))]  # 4-D view
    if key_padding_mask is not None:
        kp = key_padding_mask
        if not isinstance(kp, Tensor) or kp.dtype != torch.bool:
            got = kp.dtype if isinstance(kp, Tensor) else type(kp).__name__
            raise TypeError(f"key_padding_mask must be a bool tensor (True = attend), got {got}")
        if tuple(kp.shape) != (B, Nk):
            raise ValueError(
                f"key_padding_mask must have shape (B, Nk) = {(B, Nk)}, got {tuple(kp.shape)}"
            )
        if kp.device != q.device:
            raise ValueError(
                f"key_padding_mask must be on q's device ({q.device}), got {kp.device}"
            )
        kp = kp[:, None, None, :]  # (B, 1, 1, Nk)
        if mask is None:
            mask = kp
        elif mask.dtype == torch.bool:
            mask = mask & kp
        else:
            mask = mask.masked_fill(~kp, float("-inf"))
    return mask


def _normalize_window(window, causal: bool, nq: int, nk: int) -> tuple[int, int]:
    """``window`` (None, an int ``w`` = (w, w), or (left, right) with None = unbounded) as
    (left, right) ints, -1 for a side that excludes no key here: a right side under
    ``causal`` (which is tighter), ``left >= Nk - 1`` or ``right >= Nq - 1``."""
    if window is None:
        return (-1, -1)
    if isinstance(window, (int, torch.SymInt)) and not isinstance(window, bool):
        sides = (window, window)
    elif isinstance(window, (tuple, list)) and len(window) == 2:
        sides = tuple(window)
    else:
        raise TypeError(
            "window must be None, an int w >= 0 (w keys each side) or a pair (left, right) "
            f"of ints >= 0 or None (unbounded), got {window!r}"
        )
    for name, w in zip(("left", "right"), sides):
        if w is None:
            continue
        if isinstance(w, bool) or not isinstance(w, (int, torch.SymInt)):
            raise TypeError(f"window's {name} side must be an int >= 0 or None, got {w!r}")
        if w < 0:
            raise ValueError(f"window's {name} side must be >= 0 (None: unbounded), got {w}")
    left = -1 if sides[0] is None or sides[0] >= nk - 1 else int(sides[0])
    right = -1 if causal or sides[1] is None or sides[1] >= nq - 1 else int(sides[1])
    return (left, right)


_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _normalize_segments(segment_ids, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor] | None:
    """``segment_ids`` ((B, N) ids for self-attention, or (q ids (B, Nq), kv ids (B, Nk)))
    as a pair of int64 tensors."""
    if segment_ids is None:
        return None
    B, Nq, Nk = q.shape[0], q.shape[2], k.shape[2]
    if isinstance(segment_ids, Tensor):
        if Nq != Nk:
            raise ValueError(
                f"segment_ids as one (B, N) tensor needs Nq == Nk (self-attention), got "
                f"Nq = {Nq} and Nk = {Nk}: pass a pair (q_ids (B, Nq), kv_ids (B, Nk))"
            )
        pair = (segment_ids, segment_ids)
    elif isinstance(segment_ids, (tuple, list)) and len(segment_ids) == 2:
        pair = tuple(segment_ids)
    else:
        raise TypeError(
            "segment_ids must be None, a (B, N) integer tensor or a pair (q_ids (B, Nq), "
            f"kv_ids (B, Nk)), got {type(segment_ids).__name__}"
        )
    out = []
    for name, ids, n, label in (("q_ids", pair[0], Nq, "Nq"), ("kv_ids", pair[1], Nk, "Nk")):
        if not isinstance(ids, Tensor) or ids.dtype not in _INTS:
            got = ids.dtype if isinstance(ids, Tensor) else type(ids).__name__
            raise TypeError(f"segment_ids' {name} must be an integer tensor, got {got}")
        if tuple(ids.shape) != (B, n):
            raise ValueError(
                f"segment_ids' {name} must have shape (B, {label}) = {(B, n)}, got "
                f"{tuple(ids.shape)}"
            )
        if ids.device != q.device:
            raise ValueError(
                f"segment_ids' {name} must be on q's device ({q.device}), got {ids.device}"
            )
        out.append(ids.to(torch.int64))
    return out[0], out[1]


def _dropout_seeds(dropout, key, q: Tensor) -> tuple[float, Tensor | None]:
    """Validate ``dropout`` / ``key``; (rate, (B, H, 2) seeds on q's device), or (0.0, None)
    when nothing is dropped."""
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"dropout must be a float in [0, 1), got {type(dropout).__name__}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if key is not None:
        if not isinstance(key, Tensor) or key.dtype != torch.int32 or tuple(key.shape) != (2,):
            got = (f"{key.dtype} tensor of shape {tuple(key.shape)}" if isinstance(key, Tensor)
                   else type(key).__name__)
            raise TypeError(f"key must be a torchfn.random key ((2,) int32 tensor), got {got}")
    if _dropout.threshold(dropout) == 0:  # rounds to no dropout
        return 0.0, None
    if key is None:
        raise ValueError(
            f"key: dropout = {dropout} needs a torchfn.random key (attention(..., "
            "dropout=p, key=k)); pass dropout=0.0 at evaluation"
        )
    return float(dropout), _dropout.seeds(key.to(q.device), q.shape[0], q.shape[1])


def _normalize_slopes(slopes, q: Tensor) -> Tensor | None:
    """``alibi_slopes`` ((H,) or (B, H) float) as a contiguous (B, H) tensor in float32
    (float64 for float64 inputs)."""
    if slopes is None:
        return None
    B, H = q.shape[:2]
    if not isinstance(slopes, Tensor) or not slopes.is_floating_point():
        got = slopes.dtype if isinstance(slopes, Tensor) else type(slopes).__name__
        raise TypeError(f"alibi_slopes must be a float tensor of shape (H,) or (B, H), got {got}")
    if tuple(slopes.shape) not in ((H,), (B, H)):
        raise ValueError(
            f"alibi_slopes must have shape (H,) = {(H,)} or (B, H) = {(B, H)}, got "
            f"{tuple(slopes.shape)}"
        )
    if slopes.device != q.device:
        raise ValueError(f"alibi_slopes must be on q's device ({q.device}), got {slopes.device}")
    if slopes.requires_grad:
        raise ValueError(
            "alibi_slopes must not require grad: the slopes are constants; detach them, or "
            "use reference_attention to differentiate them"
        )
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return slopes.to(dtype).expand(B, H).contiguous()


def _ensure_interpreter() -> None:
    """Triton on CPU runs under ``TRITON_INTERPRET=1``, which must be set before
    ``triton.language`` is imported (its ``@triton.jit`` helpers are made then)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton.language" in sys.modules:
        raise AttentionBackendError(
            "backend='triton' on CPU runs the Triton interpreter, which must be switched on "
            "before triton.language is imported (torch.compile and torch._dynamo import it), "
            f"but TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} and triton.language "
            "is already loaded. Set TRITON_INTERPRET=1 before starting Python, or use "
            "backend='torch'"
        )
    os.environ["TRITON_INTERPRET"] = "1"


def _resolve_backend(backend: str | None, q: Tensor) -> str:
    if backend is None:
        on_gpu = q.device.type == "cuda" and q.dtype != torch.float64
        return "triton" if on_gpu and _triton_available() else "torch"
    if backend == "torch":
        return backend
    if backend != "triton":
        raise ValueError(f"backend must be one of None, 'torch', 'triton', got {backend!r}")
    if q.dtype == torch.float64:
        raise TypeError(
            "backend='triton' supports float16, bfloat16 and float32, got float64; "
            "use backend='torch' for float64"
        )
    if not _triton_available():
        raise AttentionBackendError(
            "backend='triton' needs the triton package (pip install 'torchfn[gpu]'); "
            "use backend='torch' or backend=None"
        )
    if q.device.type == "cpu":
        _ensure_interpreter()
    elif q.device.type != "cuda":
        raise AttentionBackendError(
            f"backend='triton' runs on cuda (or on cpu under the interpreter), got {q.device}"
        )
    return backend


def _prepare(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    key_padding_mask: Tensor | None,
    causal: bool,
    scale: float | None,
    backend: str | None,
    window=None,
    segment_ids=None,
    softcap=None,
    dropout=0.0,
    key=None,
    alibi_slopes=None,
) -> _Args:
    """Validate the arguments and normalise the mask and window; ``backend="reference"``
    skips the choice of backend."""
    _check_qkv(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    window = _normalize_window(window, causal, q.shape[2], k.shape[2])
    segments = _normalize_segments(segment_ids, q, k)
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not 0 < softcap < math.inf):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    elif not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    mask = _normalize_mask(mask, key_padding_mask, q, k)
    dropout, seeds = _dropout_seeds(dropout, key, q)
    slopes = _normalize_slopes(alibi_slopes, q)
    if backend != "reference":
        backend = _resolve_backend(backend, q)
    return _Args(mask, causal, float(scale), backend, window, segments, float(softcap or 0.0),
                 dropout, seeds, slopes)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    segment_ids: Tensor | tuple[Tensor, Tensor] | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    key: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    scale: float | None = None,
    backend: str | None = None,
    deterministic: bool = True,
    return_lse: bool = False,
    sinks: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Fused softmax attention that composes with ``grad``, ``vmap``, ``jvp`` and ``compile``.

    ``softmax(scale * q k^T + mask) v`` computed blockwise (FlashAttention-2): the
    (Nq, Nk) score matrix is never stored, the backward recomputes it.

    Args:
        q: (B, H, Nq, D) queries; float16, bfloat16, float32 (float64: torch backend).
        k: (B, Hkv, Nk, D) keys, q's dtype and device. ``H % Hkv == 0`` (GQA / MQA):
            query head ``h`` reads kv head ``h // (H // Hkv)``. D <= 256.
        v: (B, Hkv, Nk, Dv) values, as k but with its own head dim Dv <= 256 (as SDPA
            and FlexAttention allow; MLA uses D = 192, Dv = 128). Dv != D zero-pads
            the narrower of the two to the wider before the kernels: exact (the padded
            products are 0), every option and transform included, at the FLOPs of
            the wider head dim.
        mask: bool (True = attend, as in SDPA) or additive float (q's dtype or float32),
            broadcastable to (B, H, Nq, Nk) by the usual right-aligned rules, so a
            2-D mask is (Nq, Nk). Never materialised. A constant: it must not require
            grad, and its ``jvp`` tangent is ignored.
        key_padding_mask: (B, Nk) bool, True = a real key; combined with ``mask``. For
            a KV cache padded after each sequence's length (decoding, Nq = 1), pass
            ``segment_ids=(zeros(B, Nq), (arange(Nk) >= lens[:, None]).long())``
            instead: the same result, and the kernels skip the padding's key blocks.
        causal: query ``i`` attends key ``j`` iff ``j <= i + Nk - Nq``: aligned
            bottom-right as FlashAttention-2 (the queries are the *last* Nq
            positions). SDPA's ``is_causal`` aligns top-left; they agree iff Nq == Nk.
        window: local (sliding-window) attention. ``(left, right)``: query ``i``, at
            position ``p = i + Nk - Nq`` (aligned as ``causal``), sees keys
            ``p - left ..= p + right``; ``None`` on a side leaves it unbounded, an int
            ``w`` means ``(w, w)``. With ``causal=True`` only ``left`` matters: a
            Mistral-style window of W keys is ``causal=True, window=(W - 1, None)``.
            Key blocks outside the band are skipped, so the cost is O(Nq * width), and
            it combines with ``mask`` (FlashAttention's ``window_size``, with None for -1).
        segment_ids: document masking for packed sequences (FlashAttention's varlen):
            query ``i`` sees key ``j`` only if they carry the same id. A (B, N) integer
            tensor for self-attention, or a pair ``(q_ids (B, Nq), kv_ids (B, Nk))``.
            O(N) memory where the equivalent ``mask`` is O(N^2), and with contiguous
            segments only the key blocks of a query block's segments are visited.
            Combines with ``causal`` (causal within each document), ``window`` and
            ``mask``. Integer constants: they get no gradient.
        softcap: logit soft-capping (Gemma 2, Grok): the scaled scores ``s`` become
            ``softcap * tanh(s / softcap)`` before the mask is added, as FlashAttention's
            ``softcap``. None (default): no cap.
        dropout: attention dropout rate in [0, 1): each probability is dropped with
            probability ``dropout`` and the kept ones are scaled up (after the softmax,
            as SDPA's ``dropout_p``). The mask comes from ``key`` and the (batch, head,
            query, key) position alone, so it is never stored: the backward and the JVP
            recompute it, both backends draw the same mask, and ``vmap`` over keys gives
            each example its own. The rate is rounded to a multiple of 2^-16. Pass 0.0
            (default) at evaluation.
        key: a ``torchfn.random`` key; required when ``dropout > 0``.
        alibi_slopes: ALiBi (Press et al.), as FlashAttention's: (H,) or (B, H) float
            slopes; ``-slope * |i + Nk - Nq - j|`` is added to the score of query ``i``
            and key ``j`` (with the mask, after ``softcap``), computed in the kernels,
            so the O(H * Nq * Nk) bias is never stored. Constants: no gradient.
        scale: score scale, default ``1 / sqrt(D)``.
        backend: ``None`` picks Triton for CUDA tensors when triton is installed
            (else the PyTorch path) and the PyTorch path on CPU; ``"torch"`` forces
            the PyTorch path; ``"triton"`` forces the Triton kernels, on CPU through
            the Triton interpreter (slow; meant for tests). The interpreter must be
            on before ``triton.language`` is imported: if ``TRITON_INTERPRET`` is not
            ``"1"`` and triton.language is not loaded yet, this sets
            ``TRITON_INTERPRET=1`` for the process (later GPU Triton launches are then
            interpreted too), otherwise it raises :class:`AttentionBackendError`.
        deterministic: ``True`` (default): bitwise-identical gradients on every run.
            The Triton backward either recomputes for a separate dQ kernel (7 matmuls
            per tile pair, no atomics) or, on sm_90+ where the tuner timed it faster,
            adds dQ inside the dK/dV kernel in a fixed order (FlashAttention-3's
            deterministic mode, 5 matmuls; atomics only as counters, never for the
            sums; ``TORCHFN_TRITON_ORDERED_DQ``). ``False`` lets the Triton backward
            add dQ with float32 atomics (FlashAttention-2's scheme: 5 matmuls per tile
            pair instead of 7), so ``dq`` may differ in the last bits between runs.
            On an H200, forward+backward with atomics ran at 0.79-0.95x the speed of the
            deterministic one (there the atomics cost more than the two matmuls they
            save), so it is only worth trying on other GPUs. The PyTorch path is
            always deterministic.
        return_lse: also return each row's logsumexp of the scaled, capped, masked
            scores (before dropout), differentiable like the output: what merges
            attention over parts of the keys (``o = sum_p exp(lse_p - lse) o_p`` with
            ``lse = logsumexp_p lse_p``, as ring attention and KV-cache chunks do) with
            exact gradients and tangents.
        sinks: attention sinks (gpt-oss; FlashAttention-3's ``learnable_sink``): one
            logit per head, (H,) float, that joins every row's softmax as a key with no
            value, so a row may put weight on nothing: ``o_sink = o * sigmoid(lse -
            sink)``. Computed that way from the kernels' ``o`` and ``lse``, so every
            backend, option and transform takes it, and it gets its own gradient (a
            learned parameter). With ``return_lse`` the lse includes the sink.

    Returns:
        (B, H, Nq, Dv) in q's dtype. A row with no allowed key returns 0 (never NaN)
        and gets zero gradients. With ``return_lse``: ``(o, lse)``, lse (B, H, Nq) in
        float32 (float64 for float64 inputs), -inf on a row with no allowed key.

    Derivatives: reverse mode (``grad``, ``vjp``, ``jacrev``) runs the fused backward,
    forward mode (``jvp``, ``jacfwd``) a fused JVP, ``vmap`` folds the mapped dim into
    the batch. Second order (grad-of-grad, Hessian-vector products ``jvp(grad(f))``,
    ``hessian``) differentiates the materialised backward formula a block of query
    rows at a time, each block at most 2^22 scores (2^26 on a GPU): O(B * H * rows * Nk)
    memory, not O(B * H * Nq * Nk). Third order works in every pairing; a forward level
    over two with forward mode among them (``jacfwd(hessian)``) runs materialised, in
    plain torch ops. Under ``torch.compile`` forward mode is unavailable.

    >>> import torch
    >>> q = torch.ones(2, 4, 8, 16)
    >>> k = v = torch.ones(2, 2, 8, 16)  # GQA: 2 kv heads for 4 query heads
    >>> attention(q, k, v, causal=True).shape
    torch.Size([2, 4, 8, 16])
    >>> attention(q, k, torch.ones(2, 2, 8, 12)).shape  # values with their own head dim
    torch.Size([2, 4, 8, 12])
    """
    args = _prepare(q, k, v, mask, key_padding_mask, causal, scale, backend, window,
                    segment_ids, softcap, dropout, key, alibi_slopes)
    for name, flag in (("deterministic", deterministic), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if sinks is not None:
        _check_sinks(sinks, q)
    want_lse, return_lse = return_lse, return_lse or sinks is not None
    if args.causal and q.shape[2] == 1:  # one query, the last position: it sees every key
        args = args._replace(causal=False)
    shape = q.shape  # (B, H, Nq, D)
    groups = _decode_groups(q, k, args)
    if groups > 1:  # one query row: each kv head's query heads become its rows
        q = q.reshape(shape[0], k.shape[1], groups, shape[3])  # (B, Hkv, G, D)
    dv = v.shape[-1]
    q, k, v = _pad_head_dims(q, k, v)
    out = _autograd.attention(q, k, v, args.mask, args.causal, args.scale, args.backend,
                              deterministic, args.window, args.segments, args.softcap,
                              args.dropout, args.seeds, return_lse, args.slopes)
    o = out[0] if return_lse else out  # (B, H, Nq, max(D, Dv))
    if o.shape[-1] != dv:
        o = o[..., :dv]  # (B, H, Nq, Dv)
    if groups > 1:
        o = o.reshape(*shape[:3], dv)  # (B, H, 1, Dv)
    if not return_lse:
        return o
    lse = out[1] if groups == 1 else out[1].reshape(shape[:3])  # (B, H, Nq)
    if sinks is not None:  # the share of each row's weight that its keys keep
        sink = sinks.to(lse.dtype)[:, None]  # (H, 1)
        o = o * torch.sigmoid(lse - sink)[..., None].to(o.dtype)  # (B, H, Nq, Dv)
        lse = torch.logaddexp(lse, sink)
    return (o, lse) if want_lse else o


def _check_sinks(sinks: Tensor, q: Tensor) -> None:
    """``sinks``: (H,) floating point, on q's device."""
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point() \
            or tuple(sinks.shape) != (q.shape[1],) or sinks.device != q.device:
        raise ValueError(f"sinks must be a floating-point tensor (H,) = ({q.shape[1]},) on "
                         f"{q.device}, got "
                         + (f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}"
                            if isinstance(sinks, Tensor) else type(sinks).__name__))


def _decode_groups(q: Tensor, k: Tensor, args: _Args) -> int:
    """``H // Hkv`` where one query row may fold its heads into rows of the kv heads'
    attention, else 1. Exact when nothing tells the rows apart: no causal band, window,
    segments, ALiBi slopes, dropout or a mask that varies over heads or queries. It
    spares the torch path the copies of K and V that GQA otherwise makes per head."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1 or q.shape[2] != 1 or args.causal or max(args.window) >= 0 \
            or args.segments is not None or args.slopes is not None or args.seeds is not None:
        return 1
    if args.mask is not None and (args.mask.shape[1] != 1 or args.mask.shape[2] != 1):
        return 1
    return groups


def _pad_head_dims(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Zero-pad the narrower of D (q, k) and Dv (v) to the wider; the caller crops o back
    to Dv. Exact: the padded columns add products that are exactly 0 to the scores,
    and o's padded columns (D > Dv) are 0 and cut off, so their cotangents are 0 too.

    >>> q = k = torch.ones(1, 1, 2, 4)
    >>> [t.shape[-1] for t in _pad_head_dims(q, k, torch.ones(1, 1, 2, 3))]
    [4, 4, 4]
    """
    d, dv = q.shape[-1], v.shape[-1]
    if dv < d:
        v = torch.nn.functional.pad(v, (0, d - dv))
    elif d < dv:
        q, k = (torch.nn.functional.pad(x, (0, dv - d)) for x in (q, k))
    return q, k, v
