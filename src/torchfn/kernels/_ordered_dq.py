"""The ordered dQ's schedule, in Python: which key block a ticket gets, where it starts,
and its turn in each query block's sum (the kernel's ``_triton_ordered_dq`` mirrors it).

The deterministic backward used to need a separate dQ kernel that recomputes ``S`` and
``dP``: 7 matmuls per tile pair where FlashAttention's atomic backward has 5. The
ordered dQ adds dQ inside the dK/dV kernel, as the atomic one does, but in a fixed
order (FlashAttention-3's deterministic mode), so it keeps the 5 matmuls and stays
bitwise reproducible.

Why nobody waits, in lockstep (every program one tile per step):

* causal: key block ``kb`` visits query blocks ``mb_lo(kb), mb_lo(kb) + 1, ...`` and
  ``kb + 1`` starts ``BLOCK_N / BLOCK_M`` blocks later on the diagonal, so it reaches any
  query block ``mb`` that many steps *earlier*. Adding from the highest key block down
  makes each program's predecessor one that got there first. Tickets go to the highest
  key block first, so a program only waits for programs that started before it.
* non-causal: every key block visits every query block. Program ``a`` of a wave (the
  ``R`` programs of one head that run at once) starts at query block ``a`` and wraps, so
  at each step the wave's programs are on different blocks, and block ``mb``'s turns go
  to whoever reaches it first. Programs of earlier waves (F of them) come before. A
  wave must run at once: it is at most as many programs as the GPU holds.

>>> [turn(mb, kb=2, n_kb=4, shift=0, block_m=64, block_n=64, causal=True) for mb in (2, 3)]
[0, 1]
>>> [turn(mb, a=1, R=3, F=0, causal=False) for mb in range(4)]  # 3 programs, a = 0, 1, 2
[2, 0, 1, 1]

``TORCHFN_TRITON_ORDERED_DQ``: "auto" (default: on sm_90+, with Nq >= Nk, the tuner
times the ordered backward against the 7-matmul one once per shape class and keeps the
faster; for ``deterministic=False``, the same bulk reduces without the locks against
element atomics), "0" (never), "1" (always where it applies; the only way the
interpreter uses it).
"""

from __future__ import annotations

import os

import torch


def mode() -> str:
    """``TORCHFN_TRITON_ORDERED_DQ`` parsed: "auto", "0" or "1"."""
    value = os.environ.get("TORCHFN_TRITON_ORDERED_DQ", "auto").strip() or "auto"
    if value not in ("auto", "0", "1"):
        raise ValueError("TORCHFN_TRITON_ORDERED_DQ must be 'auto', '0' (never) or '1' "
                         f"(always where it applies), got {value!r}")
    return value


def key_block(ticket: int, n_kb: int, causal: bool) -> tuple[int, int]:
    """(batch x kv head, key block) of the program holding ``ticket``: causal, the
    highest key block of a head comes first."""
    bh, j = divmod(ticket, n_kb)
    return bh, (n_kb - 1 - j if causal else j)


def wave_slot(ticket: int, head_first: int, n_kb: int, wave: int) -> tuple[int, int, int]:
    """(R, F, a): of a head's ``n_kb`` programs (tickets from ``head_first``), R run in
    this ticket's wave of ``wave`` tickets, F in earlier waves; this one is the a-th."""
    w0 = ticket // wave * wave
    lo, hi = max(head_first, w0), min(head_first + n_kb, w0 + wave)
    return hi - lo, max(w0 - head_first, 0), ticket - lo


def turn(mb: int, *, kb: int = 0, n_kb: int = 1, shift: int = 0, block_m: int = 1,
         block_n: int = 1, R: int = 1, F: int = 0, a: int = 0, causal: bool) -> int:
    """How many tiles precede this program's in query block ``mb``'s sum (the kernel's
    ``_dq_turn``). Causal: key block ``kb`` of ``n_kb``, ``shift`` = Nk - Nq. Non-causal:
    program ``a`` of a wave of ``R``, after ``F`` earlier ones."""
    if causal:
        return min(n_kb - 1, ((mb + 1) * block_m - 1 + shift) // block_n) - kb
    first = min(R, mb + 1)
    return (first - 1 - a if a <= mb else first + R - 1 - a) + F


def first_block(kb: int, n_m: int, shift: int, block_m: int, block_n: int, causal: bool,
                a: int = 0) -> int:
    """The first query block a program visits (it then goes up, and non-causal wraps)."""
    if causal:
        return max(kb * block_n - shift, 0) // block_m
    return a % n_m


def schedule(n_q: int, n_k: int, block_m: int, block_n: int, causal: bool, heads: int = 1,
             group: int = 1, wave: int = 1) -> list[list[tuple[int, int, int]]]:
    """Per ticket, the (query head, query block, turn) tiles its program adds, in order:
    the whole schedule of one launch with ``heads`` kv heads of ``group`` query heads."""
    n_m, n_kb = -(-n_q // block_m), -(-n_k // block_n)
    shift, out = n_k - n_q, []
    for ticket in range(heads * n_kb):
        bh, kb = key_block(ticket, n_kb, causal)
        R, F, a = wave_slot(ticket, bh * n_kb, n_kb, wave) if not causal else (1, 0, 0)
        start = first_block(kb, n_m, shift, block_m, block_n, causal, a)
        blocks = list(range(start, n_m)) + ([] if causal else list(range(start)))
        out.append([(bh * group + g, mb, turn(mb, kb=kb, n_kb=n_kb, shift=shift,
                                               block_m=block_m, block_n=block_n, R=R, F=F,
                                               a=a, causal=causal))
                    for g in range(group) for mb in blocks])
    return out


def wave_size(device: torch.device, n_regs: int, shared: int, warps: int, n_m: int,
              n_kb: int) -> int:
    """Tickets that rotate together (non-causal): as many programs as the GPU runs at
    once (SMs x blocks per SM, from the compiled kernel's registers and shared memory,
    rounded down). A head's programs in one wave start at distinct query blocks, so
    there may be no more of them than the ``n_m`` query blocks: with more key blocks
    than that (``n_kb``), the wave is cut to ``n_m``."""
    props = torch.cuda.get_device_properties(device)
    regs_per_warp = -(-n_regs * 32 // 256) * 256  # allocated per warp in units of 256
    per_sm = min(props.max_threads_per_multi_processor // (32 * warps),
                 65536 // max(regs_per_warp * warps, 1),
                 props.shared_memory_per_multiprocessor // (shared + 1024), 32)
    return wave_cap(max(per_sm, 1) * props.multi_processor_count, n_m, n_kb)


def wave_cap(wave: int, n_m: int, n_kb: int) -> int:
    """``wave`` cut so that no head has more programs in it than query blocks."""
    return max(1, wave if n_kb <= n_m else min(wave, n_m))
