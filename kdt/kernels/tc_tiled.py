"""A block-tiled tensor-core GEMM for many tokens: ``y[M, N] (+)= X[M, K] W[N, K]^T`` (bf16 W, x as bf16 hi + lo,
fp32 sums), beside :mod:`kdt.kernels.tc`'s warp tile (session 36; built, tested, off until the H200 times it).

Why. kdt.kernels.tc's warp tile loads each weight fragment from global memory into registers and uses it for the
token tiles of one pass; its warps share nothing they load. That suits a DDTree verify's few tokens an expert. At
64 or more tokens of one matrix it spends ~24 instructions a mma (session 30's Nsight Compute). Examples: the lm_head
of a 65-token verify, a 256-token verify or prefill chunk. There it is far above its bytes: the lm_head at 64 / 256
tokens takes 609 / 2296 us for 158 us of bytes (s28a).

How. A block of WN x WM warps takes a tile of BN = 16 RT WN weight rows by BM = 8 TT WM tokens. Each k step of 32,
its threads copy the step's [BN x 32] weight tile and [BM x 32] x tile into shared memory by cp.async, ST steps in
flight (a ring of ST stages: the copies of step k + ST - 1 are issued while step k computes). Warp (wn, wm) then
computes RT row tiles by TT token tiles from the stage: each 8-byte weight word it loads feeds TT token tiles (two
mma each, x's hi and lo), and each x word RT row tiles. That is about RT + TT shared loads for 2 RT TT mma.

Fragments, in kdt.kernels.tc's k order (lane (g, t) holds the 8-byte weight word w = 4 kb + t, bf16 elements 4 w ..
4 w + 3, of rows g and g + 8: the low half is a0 / a1, the high half a2 / a3; token g's x elements of the same word are
b0 / b1):

- W_s[stage, kb, row, t] (uint64): the weight word t of k group kb (16 elements) of the tile's row. A half warp's
  8-byte loads (rows g .. g + 3, words t) read 128 contiguous bytes: no bank conflicts.
- X_s[stage, kb, token, t, 0 .. 1] (uint64): 16 bytes a (token, word). With x in the hi / lo layout
  (kdt.kernels.tc.XL_HILO: the rmsnorm before the lm_head and [q_a | kv_a] writes it), that is the hi word then the lo
  word. With float32 x (XL_NATURAL), it is the word's four floats, split into hi / lo as the fragment is loaded.
  A quarter warp's 16-byte loads (tokens g, g + 1, all t) read 128 contiguous bytes.

All in one dynamic shared array (uint64). K must be a multiple of 32 (every step whole); rows past N and tokens
past M are copied as zeros (and never stored). Under the simulator the copies are synchronous and the mma is
emulated (kdt.kernels.tc).

Two kernels share the steps (:func:`_emit_steps`): :func:`tiled_gemm_kernel` (kdt.kernels.linear's projections,
``linear.TILED_MIN_M``) and :func:`tiled_gate_up_kernel`, the MoE's routed gate_up: an active expert's tokens
gathered as their x tiles are copied, its gate rows and the matching up rows in one stage, silu(gate) * up out
(``moe.TILED_MIN_M``).
"""

from __future__ import annotations

import math
import os

import numpy as np
from numba import cuda, float32, int32, int64, uint16, uint32, uint64

from kdt.kernels.common import IS_SIM, Src, cdiv, f32_from_bits, jit_source, register_ptx
from kdt.kernels.tc import (
    XL_HILO,
    XL_NATURAL,
    cp_async16,
    cp_async_commit,
    cp_async_wait,
    frag_shape,
    mma_bf16,
    put_hilo,
    split_bf16x2,
)

BK = 32  # k elements a step (two mma k groups)
_CACHE: dict = {}
_LO = uint64(0xFFFFFFFF)
_S32 = uint64(32)


def tile_shape(wn: int, wm: int, rt: int, tt: int) -> tuple[int, int]:
    """(BN weight rows, BM tokens) of a block."""
    return 16 * rt * wn, 8 * tt * wm


def shared_words(wn: int, wm: int, rt: int, tt: int, st: int) -> int:
    """uint64 words of a block's dynamic shared memory: st stages of the weight and x tiles."""
    BN, BM = tile_shape(wn, wm, rt, tt)
    return st * (2 * BN * 4 + 2 * BM * 4 * 2)


def tiled_gemm_kernel(wn: int, wm: int, rt: int, tt: int, st: int, xl: int = XL_HILO, pre: bool | None = None):
    """The kernel ``(X, W, y, accumulate)``: X uint64 [M, K / 2] (``xl`` XL_HILO) or float32 [M, K] (XL_NATURAL),
    W uint64 [N, K / 4] (bf16 [N, K] viewed), y float32 [M, N]; grid (cdiv(M, BM), cdiv(N, BN)) (a weight tile's
    token blocks neighbours, so they meet its weights in L2), wn * wm warps, :func:`shared_words` x 8 bytes of
    dynamic shared memory (see the module docstring). ``pre`` (default ``PRE``): each thread's copy offsets computed
    once, before the k loop (:func:`_pre_copies`), not at every step."""
    pre = PRE if pre is None else bool(pre)
    if xl not in (XL_HILO, XL_NATURAL) or st < 2 or min(wn, wm, rt, tt) < 1:
        raise ValueError(f"tiled_gemm_kernel: bad plan wn={wn} wm={wm} rt={rt} tt={tt} st={st} xl={xl}")
    key = (wn, wm, rt, tt, st, xl, pre)
    if key in _CACHE:
        return _CACHE[key]
    WN, RT, TT, ST, HILO = wn, rt, tt, st, xl == XL_HILO
    NW = wn * wm
    NTH = 32 * NW
    BN, BM = tile_shape(wn, wm, rt, tt)
    XOFF = ST * 2 * BN * 4  # the x tiles after the stages' weight tiles (uint64 words)
    WCH, XCH = BN * 4, BM * 8  # 16-byte copies of a step: 4 a weight row (64 bytes), 8 a token (128 bytes)

    @cuda.jit(device=True, inline=True)
    def issue(sm, W, X, kt, slot, n0, m0, N, M, Kw, Kx, tid):
        """The copies of step kt into stage ``slot``."""
        for i in range(tid, WCH, NTH):
            r = i // 4
            c = i % 4  # words 2 c, 2 c + 1 of the row's 8: group c // 2, words 2 (c % 2) ..
            row = n0 + r
            doff = ((slot * 2 + c // 2) * BN + r) * 4 + 2 * (c % 2)
            cp_async16(sm, doff, W, min(row, N - 1) * Kw + kt * 8 + 2 * c, 16 if row < N else 0)
        for i in range(tid, XCH, NTH):
            tk = i // 8
            c = i % 8  # the token's word c of the step's 8: group c // 4, word c % 4
            m = m0 + tk
            doff = XOFF + (((slot * 2 + c // 4) * BM + tk) * 4 + c % 4) * 2
            soff = min(m, M - 1) * Kx + ((kt * 8 + c) * 2 if HILO else kt * BK + 4 * c)
            cp_async16(sm, doff, X, soff, 16 if m < M else 0)

    k = jit_source(_source(WN, RT, TT, ST, HILO, BN, BM, XOFF, NTH if pre else 0), "tiled_gemm",
                   _namespace(issue, ST, NW), __name__)
    k.plan, k.tile, k.smem = key, (BN, BM), shared_words(wn, wm, rt, tt, st) * 8
    _CACHE[key] = k
    return k


def _namespace(issue, ST: int, NW: int) -> dict:
    """The generated kernels' globals."""
    return dict(cuda=cuda, math=math, float32=float32, uint32=uint32, int64=int64, uint64=uint64, issue=issue,
                cp_async16=cp_async16,
                wait=cp_async_wait(ST - 2), commit=cp_async_commit, mma=mma_bf16, split=split_bf16x2,
                f32=f32_from_bits, put_hilo=put_hilo, LO=_LO, S32=_S32, FRAG=frag_shape(NW))


def tiled_gate_up_kernel(wn: int, wm: int, tt: int, st: int):
    """The MoE's routed gate_up on the tiled GEMM (kdt.kernels.moe's kernel B's routed role, ``V2Tiles.tiled``):
    ``(X, W, h, active, n_active, offsets, counts, rows)``, X = b_perm uint64 [rows, D / 2] (hi / lo), W = the
    gate_up weights uint64 [E, 2 I, D / 4] (gate rows, then up rows), h the uint16 view of the hi / lo h [P, I];
    grid J cdiv(I, BN / 2) blocks: block (j, x) takes the j-th active expert e (none past n_active) and its outputs
    [BN / 2 x, BN / 2 (x + 1)): a stage holds those gate rows, then their up rows (each warp's two row tiles: 16 gate
    rows and the same 16 up rows, so a lane holds gate and up of the same outputs), and the expert's pairs [offsets[e],
    offsets[e] + counts[e]) in passes of BM, each token's x row rows[p] gathered as its tile is copied."""
    key = ("gate_up", wn, wm, tt, st)
    if key in _CACHE:
        return _CACHE[key]
    WN, TT, ST = wn, tt, st
    NW = wn * wm
    NTH = 32 * NW
    BN, BM = tile_shape(wn, wm, 2, tt)
    HB = BN // 2
    XOFF = ST * 2 * BN * 4
    WCH, XCH = BN * 4, BM * 8

    @cuda.jit(device=True, inline=True)
    def issue(sm, W, X, rows, kt, slot, e, o0, I, p0, end, Kw, Kx, tid):
        """The copies of step kt into stage ``slot``: gate rows o0 .., then the same up rows, of expert e; the x rows
        of pairs p0 .. (rows[p]; zeros past end)."""
        for i in range(tid, WCH, NTH):
            r = i // 4
            c = i % 4
            o = o0 + r % HB
            row = min(o, I - 1) + (r // HB) * I
            doff = ((slot * 2 + c // 2) * BN + r) * 4 + 2 * (c % 2)
            cp_async16(sm, doff, W, (e * 2 * I + row) * Kw + kt * 8 + 2 * c, 16 if o < I else 0)
        for i in range(tid, XCH, NTH):
            tk = i // 8
            c = i % 8
            p = p0 + tk
            doff = XOFF + (((slot * 2 + c // 4) * BM + tk) * 4 + c % 4) * 2
            cp_async16(sm, doff, X, int64(rows[min(p, end - 1)]) * Kx + (kt * 8 + c) * 2, 16 if p < end else 0)

    k = jit_source(_gate_up_source(WN, TT, ST, BN, BM, XOFF), "tiled_gate_up", _namespace(issue, ST, NW), __name__)
    k.plan, k.tile, k.smem = key, (BN, BM), shared_words(wn, wm, 2, tt, st) * 8
    _CACHE[key] = k
    return k


def gate_up_plan(M: int, top_k: int, E: int) -> tuple[int, int, int, int]:
    """(wn, wm, tt, st) of :func:`tiled_gate_up_kernel` at M tokens: BM covers about twice an expert's mean load
    (M top_k / E), 16 to 128 tokens (the passes past it re-read the expert's rows); 8 warps, three stages.
    Simulator: 1 x 2 warps, one or two token tiles."""
    if IS_SIM:
        return 1, 2, min(2, max(1, cdiv(M * top_k, 8 * E))), 2
    return 4, 2, min(8, max(1, cdiv(2 * M * top_k, 16 * E))), 3


def _emit_steps(s, RT, TT, ST, HILO, BN, BM, XOFF, issue, row0) -> None:
    """Emit the accumulators c0 .. = 0 and the k loop: the ring's first ST - 1 copies, then each step's wait, next
    copies and mma from its stage (``issue(kt, slot)``: the issue's source, a line or a list of lines; ``row0(i)``:
    the block row of this warp's row tile i, an expression)."""
    for q in range(RT * TT * 4):
        s(f"c{q} = float32(0.0)")

    def emit_issue(kt: str, slot: str) -> None:
        code = issue(kt, slot)
        for line in [code] if isinstance(code, str) else code:
            s(line)

    with s.block(f"for kt0 in range({ST - 1}):  # the ring's first stages"):
        with s.block("if kt0 < nk:"):
            emit_issue("kt0", "kt0")
        s("commit()")
    with s.block("for kt in range(nk):"):
        s("wait()  # this thread's copies of step kt have landed")
        s("cuda.syncthreads()  # everyone's have, and everyone is done with the stage the next copies overwrite")
        with s.block(f"if kt + {ST - 1} < nk:"):
            emit_issue(f"kt + {ST - 1}", f"(kt + {ST - 1}) % {ST}")
        s("commit()")
        s(f"slot = kt % {ST}")
        for kb in range(2):  # (unsigned shared offsets: no negative-index wrap-around selects a load)
            s(f"xb = uint64({XOFF} + (((slot * 2 + {kb}) * {BM} + tk0 + g) * 4 + t) * 2)")
            for j in range(TT):
                s(f"v0 = sm[xb + uint64({64 * j})]  # token tile {j}: 8 tokens x 4 words x 2 apart")
                s(f"v1 = sm[xb + uint64({64 * j + 1})]")
                if HILO:  # the word's hi, then its lo
                    s(f"h0_{j} = uint32(v0 & LO)")
                    s(f"h1_{j} = uint32(v0 >> S32)")
                    s(f"l0_{j} = uint32(v1 & LO)")
                    s(f"l1_{j} = uint32(v1 >> S32)")
                else:  # four floats: split into hi / lo pairs
                    s(f"h0_{j}, l0_{j} = split(f32(v0 & LO), f32(v0 >> S32))")
                    s(f"h1_{j}, l1_{j} = split(f32(v1 & LO), f32(v1 >> S32))")
            for i in range(RT):
                s(f"wb = uint64(((slot * 2 + {kb}) * {BN} + {row0(i)} + g) * 4 + t)")
                s("w0 = sm[wb]  # rows g and g + 8 (8 rows x 4 words apart)")
                s("w1 = sm[wb + uint64(32)]")
                s("a0 = uint32(w0 & LO)")
                s("a2 = uint32(w0 >> S32)")
                s("a1 = uint32(w1 & LO)")
                s("a3 = uint32(w1 >> S32)")
                for j in range(TT):
                    q = (i * TT + j) * 4
                    c = f"c{q}, c{q + 1}, c{q + 2}, c{q + 3}"
                    s(f"{c} = mma(a0, a1, a2, a3, h0_{j}, h1_{j}, {c}, frag, warp, lane)")
                    s(f"{c} = mma(a0, a1, a2, a3, l0_{j}, l1_{j}, {c}, frag, warp, lane)")


def _emit_prologue(s, doc: str) -> None:
    s(f'"""{doc} (kdt.kernels.tc_tiled)."""')
    s("grid_dependency_wait()  # first (kdt.kernels.common, PDL)")
    s("tid = cuda.threadIdx.x")
    s("lane = tid % 32")
    s("warp = tid // 32")
    s("g = lane // 4")
    s("t = lane % 4")
    s("sm = cuda.shared.array(0, uint64)")
    if IS_SIM:
        s("frag = cuda.shared.array(FRAG, int64)  # the simulator's mma exchange")
    else:  # (no static shared memory beside the dynamic array: cp.async needs its 16-byte alignment at offset 0)
        s("frag = int64(0)")


def _pre_copies(s, HILO, BN, BM, XOFF, NTH) -> list[str]:
    """Emit, before the k loop, this thread's copy offsets (names p..., apart from the kernel's) of the GEMM's steps
    (``PRE``), and return the issue's lines for a step ``{kt}`` into stage ``{slot}`` (str.format fields). A thread's
    copies are fixed positions of the tile: weight copy q is row tid // 4 + q NTH / 4, 16 bytes c = tid % 4 of its 64;
    x copy q is token tid // 8 + q NTH / 8, 16 bytes c = tid % 8 of its 128. Its source offset moves by the step's
    words (8 a weight row; 16 a hi / lo token, 32 a float32 one), its destination by the stage's. The same copies as
    ``issue`` in the same order: the same bits."""
    lines = []
    for a, arr, per, first, bound, stride, col, dst, stage, step in (  # the weight tile's copies, then x's
            ("w", "W", 4, "n0", "N", "Kw", "2 * pcw", f"((pcw // 2) * {BN} + prw) * 4 + 2 * (pcw % 2)", 2 * BN * 4, 8),
            ("x", "X", 8, "m0", "M", "Kx", f"{2 if HILO else 4} * pcx",
             f"{XOFF} + (((pcx // 4) * {BM} + prx) * 4 + pcx % 4) * 2", 2 * BM * 8, 16 if HILO else BK)):
        n = (BN if a == "w" else BM) * per  # 16-byte copies a step
        s(f"pc{a} = tid % {per}")
        s(f"pr{a} = tid // {per}")
        s(f"p{a}d = {dst}  # the destination of copy 0 in stage 0")
        for q in range(cdiv(n, NTH)):
            s(f"p{a}r{q} = {first} + pr{a} + {q * NTH // per}")
            s(f"p{a}s{q} = int64(min(p{a}r{q}, {bound} - 1)) * {stride} + {col}")
            s(f"p{a}n{q} = 16 if p{a}r{q} < {bound} else 0")
            guard = "" if (q + 1) * NTH <= n else f"if tid < {n - q * NTH}: "
            lines.append(f"{guard}cp_async16(sm, {{slot}} * {stage} + p{a}d + {q * NTH}, {arr}, p{a}s{q} + {{kt}} * "
                         f"{step}, p{a}n{q})")
    return lines


def _source(WN, RT, TT, ST, HILO, BN, BM, XOFF, PRE_NTH: int = 0) -> str:
    """The GEMM kernel's source, every tile loop written out (Numba's unroller left the 8-token-tile plan's
    accumulators in local memory); PRE_NTH (the block's threads): the copies at offsets computed once
    (:func:`_pre_copies`), else by ``issue`` at every step."""
    s = Src()
    with s.block("def tiled_gemm(X, W, y, accumulate):"):
        _emit_prologue(s, "y[M, N] (+)= X W^T")
        s("M = y.shape[0]")
        s("N = y.shape[1]")
        s("Kw = W.shape[1]  # weight words a row (4 elements each)")
        s("Kx = X.shape[1]")
        s("nk = Kw // 8")
        s(f"m0 = cuda.blockIdx.x * {BM}")
        s(f"n0 = cuda.blockIdx.y * {BN}")
        s(f"wr0 = (warp % {WN}) * {16 * RT}  # this warp's first row and token in the block's tile")
        s(f"tk0 = (warp // {WN}) * {8 * TT}")
        if PRE_NTH:
            lines = _pre_copies(s, HILO, BN, BM, XOFF, PRE_NTH)
            issue = lambda kt, slot: [ln.format(kt=f"({kt})", slot=f"({slot})") for ln in lines]  # noqa: E731
        else:
            issue = lambda kt, slot: f"issue(sm, W, X, {kt}, {slot}, n0, m0, N, M, Kw, Kx, tid)"  # noqa: E731
        _emit_steps(s, RT, TT, ST, HILO, BN, BM, XOFF, issue, lambda i: f"wr0 + {16 * i}")
        for q, i, r, tk in _acc_places(RT, TT):
            s(f"row = n0 + wr0 + {16 * i + r} + g")
            s(f"m = m0 + tk0 + {tk} + 2 * t")
            with s.block("if row < N and m < M:"):
                s(f"y[m, row] = y[m, row] + c{q} if accumulate else c{q}")
    return s.text()


def _acc_places(RT: int, TT: int):
    """(q, i, r, tk) for each accumulator c{q} of a lane (g, t): row r + g of its row tile i (r = 0 or 8), token
    tk + 2 t of the warp's tokens (the mma's D fragment)."""
    for i in range(RT):
        for j in range(TT):
            for c in range(4):
                yield (i * TT + j) * 4 + c, i, 8 * (c // 2), 8 * j + c % 2


def _gate_up_source(WN, TT, ST, BN, BM, XOFF) -> str:
    """The MoE's routed gate_up (:func:`tiled_gate_up_kernel`), every tile loop written out."""
    s = Src()
    HB = BN // 2
    with s.block("def tiled_gate_up(X, W, h, active, n_active, offsets, counts, rows):"):
        _emit_prologue(s, "h[p, o] = silu(gate_e[o] . x_p) * (up_e[o] . x_p) for the pairs p of expert e")
        s("I = W.shape[1] // 2")
        s("Kw = W.shape[2]")
        s("Kx = X.shape[1]")
        s("nk = Kw // 8")
        s(f"nt = (I + {HB - 1}) // {HB}  # output tiles of {HB} an expert")
        s("jx = cuda.blockIdx.x // nt")
        with s.block("if jx >= n_active[0]:"):
            s("return")
        s("e = int64(active[jx])")
        s(f"o0 = (cuda.blockIdx.x % nt) * {HB}")
        s("start = int64(offsets[e])")
        s("end = start + counts[e]")
        s(f"wr0 = (warp % {WN}) * 16  # this warp's gate rows in the block's first half, its up rows in the second")
        s(f"tk0 = (warp // {WN}) * {8 * TT}")
        with s.block(f"for p0 in range(start, end, {BM}):"):
            s("cuda.syncthreads()  # (a second pass: everyone is done with the stages the first left)")
            _emit_steps(s, 2, TT, ST, True, BN, BM, XOFF,
                        lambda kt, slot: f"issue(sm, W, X, rows, {kt}, {slot}, e, o0, I, p0, end, Kw, Kx, tid)",
                        lambda i: f"{i * HB} + wr0")
            for q, _, r, tk in _acc_places(1, TT):  # gate sums in row tile 0, up in the same place of tile 1
                s(f"o = o0 + wr0 + {r} + g")
                s(f"p = p0 + tk0 + {tk} + 2 * t")
                with s.block("if o < I and p < end:"):
                    s(f"gs = c{q}")
                    s(f"put_hilo(h, p, o, gs / (float32(1.0) + math.exp(-gs)) * c{TT * 4 + q})")
    return s.text()


# Up to WIDE_MAX_M tokens (one block of 9 token tiles at most), :func:`plan` puts its 8 warps side by side on 256
# weight rows (wn = 8, wm = 1: a block's x tile is copied for half as many blocks as with 128 rows) with four stages
# in flight. Measured (s47a, H100, `scripts/bench_linear.py --presets moonlight-16b-a3b --M 64,65 --tiled --layers
# lm_head --tiled-plans ..`, the lm_head 163840 x 2048, hi / lo x, us): 65 tokens 668.5 with (4, 2, 2, 5, 3) ->
# 571.3 with (8, 1, 2, 9, 4); 64 tokens 654.2 -> 574.5; the 128-row plan with 4 / 6 / 8 stages 635.2 / 673.1 /
# 632.5 at 65; 4 warps of 128 rows by 72 tokens 708.2. Env KDT_TILED_WIDE_M (0: 128 rows at every M).
WIDE_MAX_M = int(os.environ.get("KDT_TILED_WIDE_M", "72"))
# Each thread's cp.async offsets computed once, before the k loop (:func:`_pre_copies`; session 48), not at every
# step from its thread index. sm_90 SASS of the (8, 1, 2, 9, 4) plan's k loop (`scripts/sass_loops.py tc_tiled`): 1130
# instructions for 72 HMMA, most of them the 8 copies' integer address work (~330 IMAD, 80 LEA, 60 ISETP, 40 SEL for 8
# LDGSTS): a warp issues about as much as its mma take, with two warps a scheduler (one block an SM at ~250 registers)
# to hide it. The same copies, so the same bits. Measured (session 49, s49b, H100, `scripts/profile_graphs.py ... --ab
# kdt.kernels.tc_tiled.PRE=1`): the budget-64 oracle step 14913.8 -> 14777.7 us (-136; predicted ~-0.15 ms). On by
# default; env KDT_TILED_PRE=0: the offsets from the thread index every step.
PRE = os.environ.get("KDT_TILED_PRE", "1") != "0"


def plan(M: int) -> tuple[int, int, int, int, int]:
    """(wn, wm, rt, tt, st) for M tokens: 8 warps; up to WIDE_MAX_M tokens 8 x 1 (BN = 256 rows, BM = 8 cdiv(M, 8)
    tokens) with four stages, past it 4 x 2 (BN = 128 rows), token tiles to cover M in one block up to 128 tokens
    (TT = cdiv(M, 16), at most 8), three stages (72 KB of shared memory at 128 tokens). Simulator: one warp by two,
    small tiles (every simulated thread is a Python thread)."""
    if IS_SIM:
        return 1, 2, 1, min(2, cdiv(M, 16)), 2
    if M <= min(WIDE_MAX_M, 72):  # (at most 9 token tiles: 72 accumulators a lane)
        return 8, 1, 2, cdiv(M, 8), 4
    return 4, 2, 2, min(8, cdiv(M, 16)), 3


def tiled_gemm(X, W, y, accumulate: bool = False, stream=0, plan_: tuple | None = None) -> None:
    """``y[M, N] (+)= X W^T`` on the tiled kernel: X uint64 [M, K / 2] (hi / lo) or float32 [M, K], W bf16 (uint16)
    [N, K] C-contiguous with K % 32 == 0, y float32 [M, N]; ``plan_`` overrides :func:`plan`
    ((wn, wm, rt, tt, st), or with a sixth element ``pre``)."""
    from kdt.kernels.common import allow_dynamic_shared

    M, N = y.shape
    K = W.shape[1]
    hilo = np.dtype(X.dtype) == np.uint64
    if K % BK or np.dtype(W.dtype) != np.uint16 or not W.is_c_contiguous() or not X.is_c_contiguous() \
            or X.shape[0] != M or W.shape[0] != N or X.shape[1] != (K // 2 if hilo else K):
        raise ValueError(f"tiled_gemm: bf16 W [N, K] with K % {BK} == 0 and X [M, K] (or hi / lo [M, K/2]), both "
                         f"contiguous, needed; got W {W.dtype} {tuple(W.shape)}, X {X.dtype} {tuple(X.shape)}, y "
                         f"{tuple(y.shape)}")
    if M == 0 or N == 0:
        return
    p = tuple(plan_ or plan(M))
    k = tiled_gemm_kernel(*p[:5], XL_HILO if hilo else XL_NATURAL, pre=bool(p[5]) if len(p) > 5 else None)
    BN, BM = k.tile
    args = (X, W.view(np.uint64).reshape(N, K // 4), y, bool(accumulate))
    allow_dynamic_shared(k, args, k.smem)
    k[(cdiv(M, BM), cdiv(N, BN)), 32 * k.plan[0] * k.plan[1], stream, k.smem](*args)


def _register() -> None:
    from numba import boolean

    f32_2 = float32[:, ::1]
    for p, xl, xt, pre in (((4, 2, 2, 1, 3), XL_HILO, uint64[:, ::1], False),
                           ((4, 2, 2, 4, 3), XL_HILO, uint64[:, ::1], False),
                           ((4, 2, 2, 8, 3), XL_HILO, uint64[:, ::1], False),
                           ((4, 2, 2, 4, 3), XL_NATURAL, f32_2, False),  # (float32 x at 8 token tiles: ~110 s)
                           ((8, 1, 2, 9, 4), XL_HILO, uint64[:, ::1], False),
                           ((8, 1, 2, 9, 4), XL_HILO, uint64[:, ::1], True),  # the copies' offsets once (PRE)
                           ((4, 2, 2, 8, 3), XL_HILO, uint64[:, ::1], True),
                           ((4, 2, 2, 4, 3), XL_NATURAL, f32_2, True)):
        register_ptx(tiled_gemm_kernel(*p, xl, pre), (xt, uint64[:, ::1], f32_2, boolean),
                     name="tc_tiled[wn={},wm={},rt={},tt={},st={}".format(*p)
                     + f"{',hilo' if xl == XL_HILO else ''}{',pre' if pre else ''}]")
    i32 = int32[::1]
    for tt in (1, 2, 3):  # the MoE's routed gate_up (Moonlight at 65 / 128 / 256 tokens: gate_up_plan)
        register_ptx(tiled_gate_up_kernel(4, 2, tt, 3), (uint64[:, ::1], uint64[:, :, ::1], uint16[:, ::1], i32, i32,
                                                         i32, i32, i32), name=f"tc_tiled_gate_up[tt={tt}]")


_register()
