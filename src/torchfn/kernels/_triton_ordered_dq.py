"""Triton helpers of the ordered dQ (``DQ_ORDERED``): dQ added inside the dK/dV kernel,
in a fixed order, so the 5-matmul backward stays bitwise reproducible.

FlashAttention-3's deterministic backward, in Triton. Each dK/dV program computes the
(BLOCK_M, D) float32 tile ``dS K`` of every query block it visits and adds it into a
float32 dQ buffer with one TMA bulk reduce (``desc.atomic_add``, sm_90). Every
(batch, head, query block) has an int32 lock counting the tiles already added; a program
waits until the count equals its turn (``_dq_turn``), adds its tile, and releases the
lock (+1) once the reduce has landed. The sum order is then fixed, whatever the timing.

The order is chosen so that in lockstep nobody waits (``_ordered_dq`` has the Python
mirror and the reasoning): causal, the key blocks add from the diagonal down (the
highest key block first), and their programs start in that order; non-causal, the
programs of one wave rotate their first query block, FA3's shift scheduler. A program
learns which key block it is from a ticket (``atomic_add`` on a counter) rather than its
program id: tickets are handed out in the order programs actually start, so a program
only ever waits for programs that started before it or in its own wave, which is what
rules out a deadlock.

A lock's release waits for the completion of the previous tile's reduce (not only for
its read of shared memory), and is issued one step late, inside the next tile's
matmuls, so the wait costs nothing in the common case.

The interpreter has no bulk reduce: there ``TMA_REDUCE`` is off and the tile is read,
added and written back through the same descriptor, which the locks make exclusive.
A wait gives up after ``spin_limit`` polls (or once another program has): it sets the
error flag ``ERR`` and adds anyway. On a GPU the bulk reduce is atomic, so the sum stays
right and only its order (the last bits) may change; the launcher checks the flag where
it syncs anyway (tuning, tests).
"""

import triton
import triton.language as tl


@triton.jit
def _wave_slot(ticket, head_first, n_blocks, wave):
    """(R, F, a) of a non-causal program: of its head's ``n_blocks`` key-block programs
    (tickets ``head_first`` ...), R run in this ticket's wave of ``wave`` tickets, F ran
    in earlier waves, and this one is the a-th of its wave's."""
    w0 = (ticket // wave) * wave
    lo = tl.maximum(head_first, w0)
    hi = tl.minimum(head_first + n_blocks, w0 + wave)
    return hi - lo, tl.maximum(w0 - head_first, 0), ticket - lo


@triton.jit
def _dq_turn(mb, kb, n_kb, shift, R, F, a, IS_CAUSAL: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """How many tiles precede this program's in query block ``mb``'s sum.

    Causal: the key blocks that reach ``mb`` add from the last (the diagonal) down, so
    key block ``kb`` follows the ``n_max - kb`` above it. Non-causal: program ``a`` of a
    wave starts at query block ``a`` and wraps; ``mb`` is reached first by program
    ``min(mb, R - 1)``, then by the ones below it, then (wrapping) by the ones above;
    the F programs of earlier waves came before all of them."""
    if IS_CAUSAL:
        n_max = tl.minimum(n_kb - 1, ((mb + 1) * BLOCK_M - 1 + shift) // BLOCK_N)
        turn = n_max - kb
    else:
        first = tl.minimum(R, mb + 1)  # the programs that start at or before mb
        turn = tl.where(a <= mb, first - 1 - a, first + R - 1 - a) + F
    return turn


@triton.jit
def _release(LOCKS, idx, GPU: tl.constexpr):
    """Count the tile added under lock ``idx`` (of ``LOCKS + 2``) as done. On a GPU,
    first wait until this thread's bulk reduces have completed (the writes landed, not
    only the shared-memory reads Triton waits for before reusing the buffer), then a
    barrier, so the lock moves after every thread's wait. Both in inline PTX: Triton's
    own barrier op would stop the pipelining of the key loop around it."""
    if GPU:
        tl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tbar.sync 0;\n\t"
                                  "mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)
    tl.atomic_add(LOCKS + 2 + idx, 1, sem="release")


@triton.jit
def _wait_turn(LOCKS, idx, seen, turn, spin_limit, ASM_SPIN: tl.constexpr):
    """Spin until lock ``idx`` has counted ``turn`` tiles. ``seen``: its value polled
    earlier in the step (a relaxed load whose latency hid behind the matmuls). Gives up
    after ``spin_limit`` polls, or once another program gave up (``ERR``, ``LOCKS[1]``),
    and then sets ``ERR``.

    ``ASM_SPIN`` (GPU): the loop is one inline-PTX block, so the key loop around it has
    no nested loop and Triton still software-pipelines it; the interpreter runs the same
    loop in Triton."""
    lock = LOCKS + 2 + idx
    if ASM_SPIN:
        seen = tl.inline_asm_elementwise(
            """{
            .reg .pred %p<3>;
            .reg .b32 %n, %e;
            mov.b32 %n, 0;
            mov.b32 $0, $3;
            SPIN${:uid}:
            setp.eq.s32 %p0, $0, $4;
            @%p0 bra DONE${:uid};
            ld.acquire.gpu.global.b32 $0, [$1];
            ld.volatile.global.b32 %e, [$2];
            add.s32 %n, %n, 1;
            setp.lt.s32 %p1, %n, $5;
            setp.eq.s32 %p2, %e, 0;
            and.pred %p1, %p1, %p2;
            @%p1 bra SPIN${:uid};
            DONE${:uid}:
            }""",
            "=r,l,l,r,r,r", [lock, LOCKS + 1, seen, turn, spin_limit], dtype=tl.int32,
            is_pure=False, pack=1)
    else:
        polls = 0
        err = 0
        while (seen != turn) & (err == 0) & (polls < spin_limit):
            seen = tl.atomic_add(lock, 0, sem="acquire")
            err = tl.load(LOCKS + 1, volatile=True)
            polls += 1
    if seen != turn:  # gave up: flag it, and add anyway (the bulk reduce is atomic)
        tl.atomic_xchg(LOCKS + 1, 1)


@triton.jit
def _add_tile(desc_dq, off_b, off_h, start_m, dq, BLOCK_M: tl.constexpr,
              BLOCK_D: tl.constexpr, TMA_REDUCE: tl.constexpr):
    """dQ[b, h, start_m:start_m + BLOCK_M] += dq (float32 (BLOCK_M, BLOCK_D)) through the
    4-D descriptor ``desc_dq``; rows past Nq and dims past D are clipped by its bounds."""
    at = [off_b.to(tl.int32), off_h.to(tl.int32), start_m, 0]
    tile = tl.reshape(dq, [1, 1, BLOCK_M, BLOCK_D])
    if TMA_REDUCE:
        desc_dq.atomic_add(at, tile)
    else:  # (interpreter) the lock makes the read-modify-write exclusive
        desc_dq.store(at, desc_dq.load(at) + tile)
