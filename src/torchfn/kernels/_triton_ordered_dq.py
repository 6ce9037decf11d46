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
matmuls, so the wait costs nothing in the common case. Release, poll, wait and add
pass opaque zeros along (each takes the previous one's as an input): Triton orders
these side-effecting ops by their data only, and moved the add before the wait until
they did (a test reads the order back from the sm_90 PTX).

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
def _release(LOCKS, idx, pending, GPU: tl.constexpr):
    """If ``pending`` != 0, count the tile added under lock ``idx`` (of ``LOCKS + 2``) as
    done; returns an opaque 0 (what comes after it takes it as an input, so no pass
    reorders them).

    On a GPU one inline-PTX block, predicated rather than under an ``if`` (Triton
    hoisted the ``if`` to the top of the loop, where the previous tile's reduce has had
    no time to land): wait until this thread's bulk reduces have completed (the writes
    landed, not only the shared-memory reads Triton waits for before reusing the
    buffer), a barrier, so the lock moves after every thread's wait, then thread 0's
    release add. In PTX because Triton reacts to its own ops here: a barrier op in the
    key loop stops its software pipelining, and a global atomic after the bulk reduce
    makes it wait for the reduce to complete right away, every step."""
    if GPU:
        zero = tl.inline_asm_elementwise(
            """{
            .reg .pred %p<2>;
            .reg .b32 %t;
            setp.ne.s32 %p0, $2, 0;
            @!%p0 bra SKIP${:uid};
            cp.async.bulk.wait_group 0;
            bar.sync 0;
            mov.u32 %t, %tid.x;
            setp.eq.u32 %p1, %t, 0;
            @%p1 red.release.gpu.global.add.u32 [$1], 1;
            SKIP${:uid}:
            mov.u32 $0, 0;
            }""",
            "=r,l,r", [LOCKS + 2 + idx, pending], dtype=tl.int32, is_pure=False, pack=1)
    else:
        if pending != 0:
            tl.atomic_add(LOCKS + 2 + idx, 1, sem="release")
        zero = tl.full([], 0, tl.int32)
    return zero


@triton.jit
def _poll(LOCKS, idx, GPU: tl.constexpr):
    """Lock ``idx``'s count now (relaxed): issued early in a step, its latency hides
    behind the matmuls, and in the common case it already shows this program's turn."""
    if GPU:
        seen = tl.inline_asm_elementwise("ld.relaxed.gpu.global.b32 $0, [$1];", "=r,l",
                                         [LOCKS + 2 + idx], dtype=tl.int32, is_pure=False,
                                         pack=1)
    else:
        seen = tl.load(LOCKS + 2 + idx, volatile=True)
    return seen


@triton.jit
def _wait_turn(LOCKS, idx, seen, turn, spin_limit, GPU: tl.constexpr):
    """Spin until lock ``idx`` has counted ``turn`` tiles; returns (the count seen, an
    opaque 0 for the add to take as an input, so it cannot move before the wait).
    ``seen``: ``_poll``'s earlier value. Gives up after ``spin_limit`` polls, or once
    another program gave up (``ERR``, ``LOCKS[1]``), and then sets ``ERR``.

    In the common case ``seen`` already equals ``turn`` and nothing is polled: the add
    that follows is issued only after that value came back (it takes the 0 as an
    input), and the lock moved only after the previous tile's reduce had completed.
    On a GPU the loop is one inline-PTX block (acquire loads): a Triton loop here would
    stop the software pipelining of the key loop around it."""
    lock = LOCKS + 2 + idx
    if GPU:
        seen, zero = tl.inline_asm_elementwise(
            """{
            .reg .pred %p<4>;
            .reg .b32 %n, %e;
            mov.b32 %n, 0;
            mov.b32 $0, $4;
            SPIN${:uid}:
            setp.eq.s32 %p0, $0, $5;
            @%p0 bra DONE${:uid};
            ld.acquire.gpu.global.b32 $0, [$2];
            ld.relaxed.gpu.global.b32 %e, [$3];
            add.s32 %n, %n, 1;
            setp.lt.s32 %p1, %n, $6;
            setp.eq.s32 %p2, %e, 0;
            and.pred %p1, %p1, %p2;
            @%p1 bra SPIN${:uid};
            setp.ne.s32 %p3, $0, $5;
            @%p3 red.relaxed.gpu.global.or.b32 [$3], 1;
            DONE${:uid}:
            mov.u32 $1, 0;
            }""",
            "=r,=r,l,l,r,r,r", [lock, LOCKS + 1, seen, turn, spin_limit],
            dtype=(tl.int32, tl.int32), is_pure=False, pack=1)
    else:
        polls = 0
        err = 0
        while (seen != turn) & (err == 0) & (polls < spin_limit):
            seen = tl.atomic_add(lock, 0, sem="acquire")
            err = tl.load(LOCKS + 1, volatile=True)
            polls += 1
        if seen != turn:  # gave up: flag it, and add anyway
            tl.atomic_xchg(LOCKS + 1, 1)
        zero = tl.full([], 0, tl.int32)
    return seen, zero


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
