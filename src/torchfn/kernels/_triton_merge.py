"""Triton kernel that merges the split-KV forward's partial results (one launch).

``_split_kv.merge`` in one kernel instead of a handful of torch launches, which would
cost as much as the split saves on short decodes. One program per query row:

    lse = log sum_s exp(lse_s),    o = sum_s exp(lse_s - lse) o_s

over the S partial rows ``o_s`` (float32, each normalised by its own row sum) and
``lse_s`` (-inf for a split that saw no key of the row). A row no split saw gets
o = 0, lse = -inf.

Import this module only through ``_triton_ops``.
"""

import triton
import triton.language as tl


@triton.jit
def _merge_splits(
    O_PART, LSE_PART, O, LSE,  # (B, H, S, Nq, D), (B, H, S, Nq) float32 -> (B, H, Nq, *)
    S, Nq, H, sob, soh, som,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # over B * H * Nq
    bh = row // Nq
    m = row % Nq
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    part = (bh * S + offs_s) * Nq + m  # (S,) the partial rows
    lse = tl.load(LSE_PART + part, mask=offs_s < S, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no split saw the row: weights 0
    w = tl.exp(lse - top)  # (S,)
    total = tl.sum(w, 0)
    ok = (offs_s[:, None] < S) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], mask=ok, other=0.0)
    empty = total == 0.0
    safe = tl.where(empty, 1.0, total)
    o = tl.sum(w[:, None] * o, 0) / safe  # (D,)
    out = O + (bh // H) * sob + (bh % H) * soh + m * som
    tl.store(out + offs_d, o.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)
    tl.store(LSE + bh * Nq + m, tl.where(empty, float("-inf"), top + tl.log(safe)))
