"""Mixture-of-Experts layer on the GPU with no host round-trip (SPEC section 1, ``moe(b)``).

Reference: :func:`kdt.reference.ops.moe_route` (routing) and :class:`kdt.reference.model.MoE` (layer).

One forward for M tokens ``b[M, D]`` (``k = num_experts_per_tok``, ``P = M * k`` token-expert pairs):

1. :func:`router_logits`: ``logits[M, E] = b @ gate.weight^T`` (fp32 gate weights).
2. :func:`moe_router`: sigmoid, ``+ e_score_correction_bias``, group-limited top-k ->
   ``topk_idx[M, k]`` (descending ``s_choice``, ties to the lower expert index), ``topk_w[M, k]``.
3. :func:`moe_group`: one block, a counting sort of the P pairs by expert (by token index within an
   expert): ``counts[E]``, ``offsets[E+1]``, ``sorted_rows[P]`` (token m), ``sorted_slot[P]`` (k-slot),
   the inverse map ``pos_of[M, k]``, and the list of experts that got tokens, ``active[:n_active]``.
4. :func:`expert_gate_up` / :func:`expert_down`: grouped GEMMs. Block ``(x, j)`` handles output rows
   tile x of expert ``active[j]`` for *all* its tokens, so every routed weight row is streamed from
   memory once per forward. ``grid.y = min(E, P)``, not the (device-side) number of active experts:
   blocks with ``j >= n_active`` exit at once, so nothing depends on host-known counts and the
   whole layer can be captured in a CUDA graph (for a given M).
5. Shared experts (one dense MLP of width ``I * n_shared_experts``): the same kernels in dense mode
   (one expert, tokens 0..M-1), the down projection adding straight into ``out``.
6. :func:`moe_combine`: ``out[m] (+)= sum_slot topk_w[m, slot] * y_sorted[pos_of[m, slot]]`` in slot
   order: deterministic, no float atomics.

Weights: fp32 or bf16 (uint16 storage). The GEMM kernels read weights as ``uint64`` words (2 fp32 or
4 bf16 per 8-byte load, 256 bytes per warp instruction, coalesced along the input dimension) and
widen them in registers; accumulation is fp32. Each warp owns ``nr`` weight rows (gated: nr/2 gate
rows and the matching up rows) and a tile of ``tt`` tokens whose ``nr * tt`` accumulators live in
registers (every loop over them has compile-time bounds); lanes split the input dimension and the
sums are reduced with warp shuffles (shared memory under the simulator). (nr, tt) = (4, 8) for
fp32 and (8, 4) for bf16 weights (``_TILE``, measured on an H200).

The above is **version 1** (8 launches). **Version 2** (``VERSION`` / env ``KDT_MOE_VERSION``,
``moe_forward(..., version=)``; by default at every M whose M*k pairs fit ``V2_MAX_PAIRS``, where it
measured faster than version 1 on the H200 at the kernel and the engine level, see ``V2_MAX_M``)
computes the same layer in three launches:

A. router logits + the shared experts' gate_up + (in the logits blocks that take the last atomic
   ticket of a token tile, then of all tiles) the routing and the grouping of the M*k pairs, so the
   router's serial work hides behind the shared gate_up instead of costing three launches;
B. the routed experts' gate_up (grouped: block = row tile x active-expert slot) + the shared down;
C. the routed down: block = row tile of D x a chunk of active experts; the last block of each row tile
   (ticket) combines it, slot order, no float atomics, ``out (+)= y_shared + sum_slot w * y``.

Activations that version 2 reads as GEMM inputs are stored word-permuted (one 128-byte wavefront per
lane group instead of 4 strided loads per weight word), weights are loaded with the streaming cache
hint, and the tiles (``V2Tiles``, chosen by :func:`v2_tiles` from M alone, so CUDA graphs capture it)
are specialised for 1, <= 8, <= 16 and more tokens. M*k > ``V2_MAX_PAIRS`` runs version 1 (the engine runs
such forwards as version 2 in chunks, :func:`token_chunks`). Where
:func:`uses_tc` (from ``TC_MIN_M`` tokens and ``TC_MIN_LOAD`` tokens an expert, from ``TC_FO_MIN_M`` where the layer
keeps its experts in the tensor cores' fragment order, ``TC_FO``; bf16 weights) the GEMMs of kernels
A (shared gate_up), B and C run on tensor cores (kdt.kernels.tc; see "tensor cores" below); the router logits
stay on FMA tiles.

**The small-layer path** (version 3, the default for layers of small experts at M <= ``SMALL_MAX_M``, see
its section) drops the grouping: S1 routes and runs the gate_up of every expert for every token in one
launch, S2 the down of each token's chosen experts and the shared down, combined in the same warp.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

import numpy as np
from numba import boolean, cuda, float32, float64, int32, int64, uint16, uint64

from kdt.kernels import elementwise as ew
from kdt.kernels import tc, tc_tiled
from kdt.kernels.common import (
    IS_SIM,
    SYNC_COPIES,
    SYNC_LINE,
    WARP,
    allow_dynamic_shared,
    cdiv,
    f32_to_bf16_bits,
    grid_dependency_wait,
    ldcg2,
    ldcs3,
    register_ptx,
    sync_poll,
    sync_raise,
    sync_ticket,
)
from kdt.kernels.linear import linear

# kdt.kernels.tc's names that kernels A, B and C reach past their parameter ``tc`` (the tensor cores' token tiles)
_put_hilo, XL_NATURAL, XL_PERM, XL_HILO = tc.put_hilo, tc.XL_NATURAL, tc.XL_PERM, tc.XL_HILO
_row_groups = tc.row_groups

# ---- compile-time maxima --------------------------------------------------------------------------
E_MAX = 512  # routed experts (Kimi K2: 384)
G_MAX = 16  # expert groups (DeepSeek-V3: 8)
K_MAX = 16  # experts per token (DeepSeek-V3 / Kimi K2: 8)

_MM_WARPS = 4  # warps per block of the grouped GEMM
_TT = 8  # default tokens per register tile
_NR = 4  # default weight rows per warp (gated: half gate rows, half the matching up rows)
# (weight rows per warp, tokens per tile) by weight format, measured on an H200 (Moonlight / Kimi K2
# shapes, M 1..256): bf16 gains from more rows (bytes) in flight per warp, fp32 from longer tiles.
_TILE = {2: (4, 8), 4: (8, 4)}  # elements per 8-byte word (2 fp32, 4 bf16) -> (nr, tt)
_R_WARPS = 4  # tokens (one warp each) per block of the router
_GROUP_CHUNK = 1024  # topk_idx entries staged in shared memory per pass of moe_group
_COMBINE_THREADS = 128

_FULL = 0xFFFFFFFF
_U16 = np.uint64(16)
_U32 = np.uint64(32)
_M16 = np.uint64(0xFFFF)
_M32 = np.uint64(0xFFFFFFFF)


# ---- bit-level helpers ----------------------------------------------------------------------------
def _device(fn):
    """Device function decorator. Under the simulator a plain Python function: a simulated
    ``cuda.jit(device=True)`` call costs a module-global swap under locks, which dominated the
    simulated run time; the kernels' module globals are swapped for the whole launch anyway."""
    return fn if IS_SIM else cuda.jit(device=True, inline=True)(fn)


if IS_SIM:

    @_device
    def _f32_from_bits(u):
        """Low 32 bits of an integer -> float32 with that bit pattern (simulator path)."""
        return np.array([u], dtype=np.uint64).astype(np.uint32).view(np.float32)[0]

    @_device
    def _warp_allsum_vec(acc, nt, red, warp, lane):
        """acc[:] = sums of acc[:] over the 32 lanes of the warp, to every lane (shared-memory path,
        NumPy inside: this function only ever runs in the simulator)."""
        cuda.syncthreads()
        red[warp, :, lane] = acc
        cuda.syncthreads()
        acc[:] = red[warp].sum(axis=1, dtype=np.float32)

    @_device
    def _warp_argmax(v, i, red_v, red_i, warp, lane):
        """(max v, its index) over the warp, ties to the lower index, to every lane (shared path)."""
        cuda.syncthreads()
        red_v[warp, lane] = v
        red_i[warp, lane] = i
        cuda.syncthreads()
        vs = red_v[warp]
        best = vs.max()
        return best, red_i[warp][vs == best].min()

    @_device
    def _warp_sync():
        cuda.syncthreads()

    @_device
    def _match_any(key, red_i, warp, lane):
        """Bit j set for each lane j of the warp whose key equals this lane's (shared-memory path: every
        thread of the block calls it, it synchronises)."""
        cuda.syncthreads()
        red_i[warp, lane] = key
        cuda.syncthreads()
        peers = 0
        for j in range(WARP):
            if red_i[warp, j] == key:
                peers |= 1 << j
        cuda.syncthreads()
        return peers

    @_device
    def _group_sum(v, P, red, warp, lane):
        """Sum of v over the aligned group of P lanes (a power of two) holding ``lane``, to each of them
        (shared-memory path: red[warp, lane], float32 [>= warps, 32])."""
        cuda.syncthreads()
        red[warp, lane] = v
        cuda.syncthreads()
        base = lane - lane % P
        tot = red[warp, base:base + P].sum(dtype=np.float32)
        cuda.syncthreads()
        return tot

else:
    from kdt.kernels.common import f32_from_bits as _f32_from_bits  # (the simulator's own above: a plain function)

    @_device
    def _warp_allsum(v):
        """Sum of v over the 32 lanes of the warp, returned to every lane (butterfly shuffles)."""
        v += cuda.shfl_xor_sync(_FULL, v, 16)
        v += cuda.shfl_xor_sync(_FULL, v, 8)
        v += cuda.shfl_xor_sync(_FULL, v, 4)
        v += cuda.shfl_xor_sync(_FULL, v, 2)
        v += cuda.shfl_xor_sync(_FULL, v, 1)
        return v

    @_device
    def _warp_argmax(v, i, red_v, red_i, warp, lane):
        """(max v, its index) over the warp, ties to the lower index, to every lane."""
        for off in (16, 8, 4, 2, 1):
            ov = cuda.shfl_xor_sync(_FULL, v, off)
            oi = cuda.shfl_xor_sync(_FULL, i, off)
            if ov > v or (ov == v and oi < i):
                v = ov
                i = oi
        return v, i

    @_device
    def _warp_sync():
        cuda.syncwarp(_FULL)

    @_device
    def _match_any(key, red_i, warp, lane):
        """Bit j set for each lane j of the warp whose key equals this lane's (match.any.sync; red_i unused)."""
        return cuda.match_any_sync(_FULL, key)

    @_device
    def _group_sum(v, P, red, warp, lane):
        """Sum of v over the aligned group of P lanes (a power of two) holding ``lane``, to each of them
        (butterfly shuffles within the group; P is the same in every lane, ``red`` unused)."""
        off = P // 2
        while off >= 1:
            v += cuda.shfl_xor_sync(_FULL, v, off)
            off //= 2
        return v


@_device
def _unpack_f32(w, j):
    """Element j (0..1) of a uint64 word holding 2 float32 (little endian)."""
    return _f32_from_bits((w >> uint64(32 * j)) & _M32)


@_device
def _unpack_bf16(w, j):
    """Element j (0..3) of a uint64 word holding 4 bf16, widened to float32."""
    return _f32_from_bits(((w >> uint64(16 * j)) & _M16) << _U16)


def _elems_per_word(dtype) -> int:
    dt = np.dtype(dtype)
    if dt == np.float32:
        return 2
    if dt == np.uint16:
        return 4
    raise TypeError(f"unsupported weight dtype {dt}: MoE kernels take float32 or bf16 (stored as uint16)")


def _unpacker(epw: int):
    return _unpack_f32 if epw == 2 else _unpack_bf16


def _words(w):
    """Device weight array [..., K] (float32 or uint16) -> (uint64 view [..., K/epw], epw)."""
    epw = _elems_per_word(w.dtype)
    K = tuple(w.shape)[len(w.shape) - 1]
    if K % epw:
        raise ValueError(f"weight rows of length {K} are not a multiple of {epw} elements")
    return w.view(np.uint64), epw


_DUMMY: dict[str, object] = {}


def _dummy_i32():
    """A 1-element int32 device array for the unused index arguments of the dense GEMM mode."""
    if "i32" not in _DUMMY:
        _DUMMY["i32"] = cuda.to_device(np.zeros(1, dtype=np.int32))
    return _DUMMY["i32"]


# ---- grouped / dense GEMM over weight rows --------------------------------------------------------
_MM_CACHE: dict[tuple, object] = {}


def _mm_kernel(epw: int, gated: bool, grouped: bool, gather: bool, ks: int, nr: int = _NR, tt: int = _TT):
    """Build (cached) the GEMM kernel for one weight format and mode.

    X[*, K] f32 (rows of activations), W[Ew, R, K/epw] uint64 words, out[*, n_out] f32.
    - ``gated``: W rows [0, n_out) are gate_proj and [n_out, 2 n_out) up_proj;
      out[p, n] = silu(X_p . W[n]) * (X_p . W[n_out + n]). Otherwise out[p, n] (+)= X_p . W[n].
    - ``grouped``: block y handles expert e = experts[y] (exit when y >= n_active[0]) over the
      positions p in [offsets[e], min(offsets[e+1], P)); otherwise e = 0 and p in [0, P).
    - ``gather``: the activation row of position p is rows[p] (tokens sorted by expert); otherwise p.
      Output row is always p.
    - ``ks``: warps of a block that split the input dimension of the same rows (reduced in shared
      memory, in a fixed order); the block holds _MM_WARPS // ks row groups.
    - ``nr`` weight rows per warp (gated: nr/2 gate rows and the matching up rows), ``tt`` tokens per
      register tile: a warp keeps nr * tt fp32 accumulators, every activation load feeds nr FMAs.
    """
    key = (epw, gated, grouped, gather, ks, nr, tt)
    if key in _MM_CACHE:
        return _MM_CACHE[key]
    unpack = _unpacker(epw)
    EPW, TT, NR, KS = epw, tt, nr, ks
    NO = NR // 2 if gated else NR  # outputs per warp
    RW = _MM_WARPS // KS
    NACC = NR * TT
    STRIDE = WARP * KS
    RED_SHAPE = (_MM_WARPS, NACC, WARP) if IS_SIM else (1, 1, 1)
    RED2_SHAPE = (RW, KS, NACC) if KS > 1 else (1, 1, 1)
    GATED, GROUPED, GATHER = gated, grouped, gather

    if IS_SIM:
        reduce_acc = _warp_allsum_vec
    else:

        @_device
        def reduce_acc(acc, nt, red, warp, lane):
            """acc[r*TT + t] = warp-wide sums for the nt valid tokens (every lane gets them)."""
            for t in range(TT):
                if t < nt:
                    for r in range(NR):
                        acc[r * TT + t] = _warp_allsum(acc[r * TT + t])

    @_device
    def fma_word(acc, xrow, nt, X, wbuf, wv, ww):
        """acc[r*TT + t] += W_r[word ww] . X[xrow[t], elements of word ww] for the NR rows, t < nt.
        (Reading X as uint64 pairs instead measured 1.6x slower on the H200 at M=64.)"""
        for jj in range(EPW):
            for r in range(NR):
                wv[r] = unpack(wbuf[r], jj)
            d = ww * EPW + jj
            for t in range(TT):
                if t < nt:
                    xv = X[xrow[t], d]
                    for r in range(NR):
                        acc[r * TT + t] += wv[r] * xv

    def kern(X, W, out, experts, n_active, offsets, rows, P, n_out, accumulate):
        grid_dependency_wait()
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        rg = warp // KS  # row group of this warp
        kq = warp % KS  # input-dimension slice of this warp
        red = cuda.shared.array(RED_SHAPE, float32)
        red2 = cuda.shared.array(RED2_SHAPE, float32)
        acc = cuda.local.array(NACC, float32)
        xrow = cuda.local.array(TT, int32)
        wr = cuda.local.array(NR, int64)
        wa = cuda.local.array(NR, uint64)
        wb = cuda.local.array(NR, uint64)
        wv = cuda.local.array(NR, float32)
        sel = cuda.local.array(NR, float32)
        if GROUPED:
            j = cuda.blockIdx.y
            if j >= n_active[0]:
                return
            e = int64(experts[j])
            start = int64(offsets[e])
            end = min(int64(offsets[e + 1]), int64(P))
        else:
            e = int64(0)
            start = int64(0)
            end = int64(P)
        obase = (cuda.blockIdx.x * RW + rg) * NO  # first output row of this warp
        for r in range(NO):
            wr[r] = min(obase + r, n_out - 1)  # rows past n_out are computed, never stored
            if GATED:
                wr[NO + r] = wr[r] + n_out
        Kw = W.shape[2]
        for p0 in range(start, end, TT):
            nt = min(TT, end - p0)
            for t in range(TT):
                if t < nt:
                    if GATHER:
                        xrow[t] = rows[p0 + t]
                    else:
                        xrow[t] = p0 + t
                else:
                    xrow[t] = 0
            for i in range(NACC):
                acc[i] = float32(0.0)
            # two words per row in flight per iteration; warps of a k-split interleave by 32 words
            for base in range(kq * WARP + lane, Kw, 2 * STRIDE):
                nxt = base + STRIDE
                for r in range(NR):
                    wa[r] = W[e, wr[r], base]
                if nxt < Kw:
                    for r in range(NR):
                        wb[r] = W[e, wr[r], nxt]
                fma_word(acc, xrow, nt, X, wa, wv, base)
                if nxt < Kw:
                    fma_word(acc, xrow, nt, X, wb, wv, nxt)
            reduce_acc(acc, nt, red, warp, lane)
            if KS > 1:
                cuda.syncthreads()
                if lane == 0:
                    for i in range(NACC):
                        red2[rg, kq, i] = acc[i]
                cuda.syncthreads()
                if kq == 0:
                    for i in range(NACC):
                        s = red2[rg, 0, i]
                        for q in range(1, KS):
                            s += red2[rg, q, i]
                        acc[i] = s
            if kq == 0 and lane < nt:
                # lane t stores token t: pick its sums with compile-time acc indices (registers)
                for i in range(NR * TT):  # one flat loop: fully unrolled, acc stays in registers
                    if lane == i % TT:
                        sel[i // TT] = acc[i]
                p = p0 + lane
                for r in range(NO):
                    o = obase + r
                    if o < n_out:
                        v = sel[r]
                        if GATED:
                            out[p, o] = v / (float32(1.0) + math.exp(-v)) * sel[NO + r]
                        else:
                            out[p, o] = (out[p, o] + v) if accumulate else v

    kern.__name__ = "moe_mm_{}_{}{}{}_ks{}_nr{}_tt{}".format(
        "f32" if epw == 2 else "bf16", "gated" if gated else "plain", "_grouped" if grouped else "_dense",
        "_gather" if gather else "", ks, nr, tt)
    k = cuda.jit(kern)
    _MM_CACHE[key] = k
    return k


_MM_SIG = (float32[:, ::1], uint64[:, :, ::1], float32[:, ::1], int32[::1], int32[::1], int32[::1],
           int32[::1], int64, int64, boolean)


def _launch_mm(X, Wwords, epw, out, n_out, P, *, gated, grouped, gather, ks=1, experts=None,
               n_active=None, offsets=None, rows=None, n_experts=1, accumulate=False, stream=0,
               nr=None, tt=None):
    if P <= 0:
        return
    if nr is None:
        nr, tt = _TILE[epw]
    k = _mm_kernel(epw, gated, grouped, gather, ks, nr, tt)
    groups = cdiv(n_out, nr // 2 if gated else nr)
    grid = (cdiv(groups, _MM_WARPS // ks), min(n_experts, P) if grouped else 1)
    d = _dummy_i32() if any(a is None for a in (experts, n_active, offsets, rows)) else None
    pick = lambda a: d if a is None else a  # noqa: E731
    k[grid, _MM_WARPS * WARP, stream](
        X, Wwords, out, pick(experts), pick(n_active), pick(offsets), pick(rows),
        int(P), int(n_out), bool(accumulate))


def _as3(w):
    """[R, K] -> [1, R, K] (one 'expert'); [E, R, K] unchanged."""
    return w.reshape(1, *tuple(w.shape)) if len(w.shape) == 2 else w


# ---- public wrappers: GEMMs -----------------------------------------------------------------------
def router_logits(b, gate_w, logits, M: int | None = None, stream=0) -> None:
    """logits[M, E] = b[M, D] @ gate_w[E, D]^T, fp32 (the router gate weights stay fp32).

    Dense GEMM, 4 warps split D for each pair of experts (E is small, so the input dimension is
    what gives the launch its parallelism).
    """
    M = b.shape[0] if M is None else int(M)
    if np.dtype(gate_w.dtype) != np.float32:
        raise TypeError("router gate weights must be float32")
    E = gate_w.shape[0]
    Ww, epw = _words(_as3(gate_w))
    _launch_mm(b, Ww, epw, logits, E, M, gated=False, grouped=False, gather=False, ks=4, stream=stream)


def expert_gate_up(b, w_gate_up, h, active, n_active, offsets, sorted_rows, n_rows: int, stream=0) -> None:
    """h[p, :I] = silu(b[sorted_rows[p]] @ gate_e^T) * (b[sorted_rows[p]] @ up_e^T) for every sorted
    position p of every expert e with tokens (p in [offsets[e], offsets[e+1]), p < n_rows = M * k).

    b[M, D] f32; w_gate_up[E, 2I, D] f32 or bf16 (uint16), rows [0, I) gate_proj, [I, 2I) up_proj;
    h[>= n_rows, I] f32; active[E], n_active[1], offsets[E+1], sorted_rows[>= n_rows] int32 (moe_group).
    """
    E, I2 = w_gate_up.shape[0], w_gate_up.shape[1]
    Ww, epw = _words(w_gate_up)
    _launch_mm(b, Ww, epw, h, I2 // 2, n_rows, gated=True, grouped=True, gather=True, experts=active,
               n_active=n_active, offsets=offsets, rows=sorted_rows, n_experts=E, stream=stream)


def expert_down(h, w_down, y, active, n_active, offsets, n_rows: int, stream=0) -> None:
    """y[p, :D] = h[p] @ down_e^T for every sorted position p < n_rows of every expert e with tokens.

    h[>= n_rows, I] f32; w_down[E, D, I] f32 or bf16 (uint16); y[>= n_rows, D] f32.
    """
    E, D = w_down.shape[0], w_down.shape[1]
    Ww, epw = _words(w_down)
    _launch_mm(h, Ww, epw, y, D, n_rows, gated=False, grouped=True, gather=False, experts=active,
               n_active=n_active, offsets=offsets, rows=_dummy_i32(), n_experts=E, stream=stream)


# dense MLP version (env KDT_DENSE_MLP_VERSION): 1 = the two GEMM launches above in dense mode; 2 = linear
# (kdt.kernels.linear's default, v2) for gate_up, silu_mul, linear for down (three launches; two with env
# KDT_LINEAR_FUSE_GLU=1, silu * up in the down projection's staging: off by default, see kdt.kernels.linear)
DENSE_MLP_VERSION = int(os.environ.get("KDT_DENSE_MLP_VERSION", "2"))


def dense_mlp_scratch_cols(Is: int) -> int:
    """Columns per token row of :func:`dense_mlp`'s scratch ``h`` (either version): 3 * Is."""
    return 3 * Is


def dense_mlp(x, w_gate_up, w_down, h, out, M: int | None = None, accumulate: bool = True, stream=0,
              version: int | None = None, norm=None) -> None:
    """out[M, D] (+)= down(silu(gate(x)) * up(x)) for x[M, D]: a dense layer's MLP or the shared experts
    (one MLP of width Is = moe_intermediate_size * n_shared_experts). ``norm = (gw, eps, a)``: of
    rmsnorm(x; gw, eps) instead (see :func:`kdt.kernels.linear.linear`; a[M, D] is written unless the
    normalisation is fused into the gate_up launch). x may be out when ``norm`` is given.

    w_gate_up[(1,) 2Is, D], w_down[(1,) D, Is] f32 or bf16 (uint16), as from :func:`pack_experts`;
    h f32 scratch, C-contiguous, at least M * 3Is elements (``[>= M, dense_mlp_scratch_cols(Is)]``).
    ``version`` (default ``DENSE_MLP_VERSION``):

    - 1: the grouped-GEMM kernels in dense mode, silu * up fused into the gate_up GEMM (2 launches);
    - 2: ``linear`` for gate_up into ``gu[M, 2Is]``, then ``linear(gu, .., glu=a)`` for down:
      :func:`kdt.kernels.elementwise.silu_mul` of its halves into ``a[M, Is]`` first (3 launches; gu and a
      are consecutive stretches of h), or, where :func:`kdt.kernels.linear.fuses_glu` (env
      KDT_LINEAR_FUSE_GLU=1), silu(gate) * up computed as the down projection stages gu (2 launches).
    """
    M = x.shape[0] if M is None else int(M)
    w_gate_up, w_down = _as3(w_gate_up), _as3(w_down)
    Is = w_gate_up.shape[1] // 2
    if h.size < M * dense_mlp_scratch_cols(Is):
        raise ValueError(f"dense_mlp: scratch of {h.size} elements < M * {dense_mlp_scratch_cols(Is)}")
    v2 = (DENSE_MLP_VERSION if version is None else version) == 2
    if norm is not None and not v2:
        gw, eps, xa = norm
        ew.rmsnorm(x[:M], gw, eps, xa[:M], stream=stream)
        x, norm = xa, None
    if v2:
        flat = h.reshape(h.size)
        gu = flat[: M * 2 * Is].reshape(M, 2 * Is)  # [gate | up]
        a = flat[M * 2 * Is: M * 3 * Is].reshape(M, Is)
        linear(x[:M], w_gate_up[0], gu, stream=stream,
               norm=None if norm is None else (norm[0], norm[1], norm[2][:M]))
        linear(gu, w_down[0], out[:M], accumulate=accumulate, stream=stream, glu=a)
        return
    Wgu, epw = _words(w_gate_up)
    Wd, epw2 = _words(w_down)
    D = Wd.shape[1]
    _launch_mm(x, Wgu, epw, h, Is, M, gated=True, grouped=False, gather=False, stream=stream)
    _launch_mm(h, Wd, epw2, out, D, M, gated=False, grouped=False, gather=False, accumulate=accumulate,
               stream=stream)


# ---- routing --------------------------------------------------------------------------------------
_R_RED = (_R_WARPS, WARP) if IS_SIM else (1, 1)
_NEG_INF = float32(-np.inf)
_EPS_NORM = float32(1e-20)


@_device
def _mask_groups(sh_c, sh_g, w, lane, E, n_group, topk_group):
    """Group-limited routing for warp w's token (both router versions): the score of group g is the sum
    of its two largest ``sh_c[w, e]``; all but the ``topk_group`` best groups (ties to the lower group)
    get their experts' choice scores set to -inf. Lane g handles group g."""
    gs = E // n_group
    if lane < n_group:
        b1 = _NEG_INF
        b2 = _NEG_INF
        for e in range(lane * gs, lane * gs + gs):
            v = sh_c[w, e]
            if v > b1:
                b2 = b1
                b1 = v
            elif v > b2:
                b2 = v
        sh_g[w, lane] = b1 + b2
    _warp_sync()
    if lane < n_group:
        mine = sh_g[w, lane]
        rank = 0
        for q in range(n_group):
            o = sh_g[w, q]
            if o > mine or (o == mine and q < lane):
                rank += 1
        if rank >= topk_group:
            for e in range(lane * gs, lane * gs + gs):
                sh_c[w, e] = _NEG_INF
    _warp_sync()


@_device
def _scan2(a, b, tid, n):
    """Inclusive Hillis-Steele scans of the shared int arrays ``a[:n]`` and ``b[:n]`` together (both
    grouping kernels: expert counts and "expert is active" flags). Thread ``tid < n`` owns entry tid;
    every thread of the block must call it (it synchronises)."""
    off = 1
    while off < n:
        ta = 0
        tb = 0
        if tid >= off and tid < n:
            ta = a[tid - off]
            tb = b[tid - off]
        cuda.syncthreads()
        if tid < n:
            a[tid] += ta
            b[tid] += tb
        cuda.syncthreads()
        off *= 2


# The grouping's last step, placing each pair at its sorted position: warp 0 takes 32 pairs a step with
# match.any.sync (``_place_pairs``; Moonlight's 65-token step: 13 steps for its 390 pairs). Before (session 50 and
# earlier; KDT_MOE_GROUP_MATCH=0): every thread one pair of a chunk of the block's size, counting the pairs of its
# expert before it in the chunk by a serial loop over the chunk in shared memory (4 chunks x 128 loop trips there).
# Both give the same positions (token order within an expert). Measured on an H100 (session 51; s51a: `scripts/
# bench_moe.py --presets moonlight-16b-a3b --M 8,65 --parts`, a process each way): kernel A's head at 65 tokens 43.2 ->
# 30.2 us, the layer 478.4 -> 465.9 us; at 8 tokens 17.3 -> 15.3. In the engine's graphs (s51c / s51d: `scripts/
# profile_graphs.py --preset moonlight-16b-a3b --drafter oracle --budget 64 --launches none --ab
# kdt.kernels.moe.GROUP_MATCH=0`, twice): the budget-64 oracle step 14460.5 / 14459.3 -> 13873.1 / 13869.1 us (-4.1%),
# the AR step 3376.5 / 3377.6 -> 3403.8 / 3404.8 (+0.8%: not the placement, which kernel AB's six pairs take in one
# step; with kernel AB on the serial loop, s51e, it was +44 us all the same; not explained).
GROUP_MATCH = os.environ.get("KDT_MOE_GROUP_MATCH", "1") != "0"


@_device
def _place_pairs(sh_idx, P, top_k, cur, sorted_rows, sorted_slot, pos_of, red_i, warp, lane):
    """Warp 0 puts pair i = m*top_k + s (expert e = sh_idx[i]) at position cur[e] + the number of e's pairs
    before i, so token order within an expert (cur[e] starts at offsets[e]; red_i: _match_any's shared
    stage in the simulator). 32 pairs a step: match.any.sync gives each lane the lanes of its expert, the
    highest of them moves cur[e] on. In the simulator every warp takes the steps (_match_any synchronises
    the block) and warp 0's alone write."""
    below = (1 << lane) - 1  # the lanes under this one
    if warp == 0 or IS_SIM:
        for c0 in range(0, P, WARP):
            i = c0 + lane
            mine = i < P and warp == 0
            e = sh_idx[i] if mine else E_MAX + lane  # (past P a key of no pair: the lane matches only itself)
            peers = _match_any(int32(e), red_i, warp, lane)
            pos = 0
            if mine:
                pos = cur[e] + cuda.popc(peers & below)
            _warp_sync()  # every lane has read cur[e] before the highest moves it
            if mine:
                m = i // top_k
                s = i % top_k
                sorted_rows[pos] = m
                sorted_slot[pos] = s
                pos_of[m, s] = pos
                if lane == WARP - 1 - cuda.clz(peers):
                    cur[e] = pos + 1
            _warp_sync()


@cuda.jit
def _moe_router_kernel(logits, bias, M, n_group, topk_group, top_k, norm, scale, topk_idx, topk_w):
    """One warp per token m < M: logits[M, E] f32, bias[E] f32 -> topk_idx[M, k] int32, topk_w[M, k] f32.

    s = sigmoid(logits), c = s + bias; with n_group > 1 the groups outside the best topk_group by
    (sum of their top-2 c) get c = -inf (ties: lower group); then top_k rounds of warp argmax over c
    (ties: lower expert) -- the order of a stable descending argsort. Weights are s of the chosen
    experts, / (sum + 1e-20) if norm, * scale.
    """
    grid_dependency_wait()
    tid = cuda.threadIdx.x
    lane = tid % WARP
    w = tid // WARP
    sh_s = cuda.shared.array((_R_WARPS, E_MAX), float32)
    sh_c = cuda.shared.array((_R_WARPS, E_MAX), float32)
    sh_g = cuda.shared.array((_R_WARPS, G_MAX), float32)
    red_v = cuda.shared.array(_R_RED, float32)
    red_i = cuda.shared.array(_R_RED, int32)
    m = cuda.blockIdx.x * _R_WARPS + w
    if m >= M:
        return
    E = logits.shape[1]
    one = float32(1.0)
    for e in range(lane, E, WARP):
        s = one / (one + math.exp(-logits[m, e]))
        sh_s[w, e] = s
        sh_c[w, e] = s + bias[e]
    _warp_sync()
    if n_group > 1:
        _mask_groups(sh_c, sh_g, w, lane, E, n_group, topk_group)
    taken = int32(0)  # bit i: expert lane + 32 i already chosen
    wsum = float32(0.0)
    for r in range(top_k):
        bv = _NEG_INF
        bi = int32(E_MAX)
        for i in range(E_MAX // WARP):
            e = lane + WARP * i
            if e < E and ((taken >> i) & 1) == 0:
                v = sh_c[w, e]
                if v > bv or (v == bv and bi == E_MAX):
                    bv = v
                    bi = int32(e)
        bv, bi = _warp_argmax(bv, bi, red_v, red_i, w, lane)
        if lane == bi % WARP:
            taken |= int32(1) << (bi // WARP)
        sv = sh_s[w, bi]
        wsum += sv
        if lane == 0:
            topk_idx[m, r] = bi
            topk_w[m, r] = sv
    if lane == 0:
        sc = float32(scale)
        for r in range(top_k):
            v = topk_w[m, r]
            if norm:
                v = v / (wsum + _EPS_NORM)
            topk_w[m, r] = v * sc


def moe_router(logits, bias, n_group: int, topk_group: int, top_k: int, norm_topk_prob: bool,
               routed_scaling_factor: float, topk_idx, topk_w, M: int | None = None, stream=0) -> None:
    """Group-limited sigmoid top-k routing of logits[M, E] f32 with bias[E] f32 (noaux_tc, as
    ops.moe_route) -> topk_idx[M, top_k] int32 (descending s_choice, ties to the lower expert),
    topk_w[M, top_k] f32. One warp per token, 4 tokens per block."""
    M = logits.shape[0] if M is None else int(M)
    E = logits.shape[1]
    if E > E_MAX or n_group > G_MAX or top_k > K_MAX or E % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"moe_router: E={E} (max {E_MAX}), n_group={n_group} (max {G_MAX}), "
                         f"topk_group={topk_group}, top_k={top_k} (max {K_MAX}) not supported")
    if n_group > 1 and E // n_group < 2:
        raise ValueError("moe_router: each group needs >= 2 experts")
    if M <= 0:
        return
    _moe_router_kernel[cdiv(M, _R_WARPS), _R_WARPS * WARP, stream](
        logits, bias, int(M), int(n_group), int(topk_group), int(top_k), bool(norm_topk_prob),
        float(routed_scaling_factor), topk_idx, topk_w)


@cuda.jit
def _moe_group_kernel(topk_idx, M, E, counts, offsets, sorted_rows, sorted_slot, pos_of, active, n_active):
    """Single block, blockDim >= E: counting sort of the P = M*k pairs (m, slot) by expert
    e = topk_idx[m, slot], by flat index m*k + slot (= token order) within an expert.

    topk_idx[M, k] int32 -> counts[E], offsets[E+1], sorted_rows[P], sorted_slot[P], pos_of[M, k],
    active[n_active] (experts with tokens, ascending), n_active[1]; all int32.
    """
    grid_dependency_wait()
    tid = cuda.threadIdx.x
    nth = cuda.blockDim.x
    K = topk_idx.shape[1]
    P = M * K
    cnt = cuda.shared.array(E_MAX, int32)
    sc = cuda.shared.array(E_MAX, int32)
    sa = cuda.shared.array(E_MAX, int32)
    stage = cuda.shared.array(_GROUP_CHUNK, int32)
    if tid < E_MAX:
        cnt[tid] = 0
    cuda.syncthreads()
    for i in range(tid, P, nth):
        cuda.atomic.add(cnt, topk_idx[i // K, i % K], 1)
    cuda.syncthreads()
    v = 0
    if tid < E:
        v = cnt[tid]
    a = 1 if v > 0 else 0
    if tid < E_MAX:
        sc[tid] = v
        sa[tid] = a
    cuda.syncthreads()
    _scan2(sc, sa, tid, nth)  # inclusive scans of counts and of (count > 0); nth <= E_MAX
    base = 0
    if tid < E:
        base = sc[tid] - v
        counts[tid] = v
        offsets[tid] = base
        if v > 0:
            active[sa[tid] - 1] = tid
    if tid == 0:
        offsets[E] = P
        n_active[0] = sa[E - 1]
    pos = base
    for c0 in range(0, P, _GROUP_CHUNK):
        nq = min(_GROUP_CHUNK, P - c0)
        cuda.syncthreads()
        for q in range(tid, nq, nth):
            i = c0 + q
            stage[q] = topk_idx[i // K, i % K]
        cuda.syncthreads()
        if tid < E and pos < base + v:
            for q in range(nq):
                if stage[q] == tid:
                    i = c0 + q
                    m = i // K
                    s = i % K
                    sorted_rows[pos] = m
                    sorted_slot[pos] = s
                    pos_of[m, s] = pos
                    pos += 1


def moe_group(topk_idx, E: int, counts, offsets, sorted_rows, sorted_slot, pos_of, active, n_active,
              M: int | None = None, stream=0) -> None:
    """Group the M*k (token, slot) pairs of topk_idx[M, k] int32 by expert on the GPU (one block).

    Outputs (int32): counts[E], offsets[E+1] (offsets[E] = M*k), sorted_rows[>= M*k] (token m of each
    sorted position), sorted_slot[>= M*k] (its k-slot), pos_of[>= M, k] (sorted position of (m, slot)),
    active[E] (active[:n_active] = experts with tokens, ascending), n_active[1]. Within an expert the
    pairs are in token order, so results are reproducible.
    """
    M = topk_idx.shape[0] if M is None else int(M)
    if E > E_MAX:
        raise ValueError(f"moe_group: E={E} > E_MAX={E_MAX}")
    nth = max(WARP, cdiv(E, WARP) * WARP)
    _moe_group_kernel[1, nth, stream](topk_idx, int(M), int(E), counts, offsets, sorted_rows, sorted_slot,
                                      pos_of, active, n_active)


@cuda.jit
def _moe_combine_kernel(y_sorted, pos_of, topk_w, out, accumulate):
    """out[m, d] (+)= sum_slot topk_w[m, slot] * y_sorted[pos_of[m, slot], d], slots in order.
    y_sorted[P, D], pos_of[M, k] int32, topk_w[M, k] f32, out[M, D]; grid (D tiles, M)."""
    grid_dependency_wait()
    m = cuda.blockIdx.y
    d = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if d >= out.shape[1]:
        return
    acc = float32(0.0)
    for s in range(pos_of.shape[1]):
        acc += topk_w[m, s] * y_sorted[pos_of[m, s], d]
    out[m, d] = (out[m, d] + acc) if accumulate else acc


def moe_combine(y_sorted, pos_of, topk_w, out, accumulate: bool = True, M: int | None = None,
                stream=0) -> None:
    """out[m] (+)= sum over its k slots of topk_w[m, slot] * y_sorted[pos_of[m, slot]] for m < M.

    y_sorted[>= M*k, D] f32 (expert outputs at sorted positions), pos_of[>= M, k] int32 (moe_group),
    topk_w[>= M, k] f32, out[>= M, D] f32. Deterministic: no atomics, slots summed in order."""
    M = out.shape[0] if M is None else int(M)
    if M <= 0:
        return
    D = out.shape[1]
    nth = min(_COMBINE_THREADS, cdiv(D, WARP) * WARP)
    _moe_combine_kernel[(cdiv(D, nth), M), nth, stream](
        y_sorted, pos_of, topk_w, out, bool(accumulate))


# ---- version 2: the layer in three launches --------------------------------------------------------
# A  route:   router logits (fp32 gate) + b permuted for B + the shared experts' gate_up (other blocks of
#             the same launch); per token tile, the logits block that finishes it last (atomic ticket)
#             routes its tokens, and the one that routes the last tile groups the M*k pairs by expert
#             (the old router + moe_group).
# B  gate_up: routed experts' gate_up, grouped (block = row tile x active-expert slot) + the shared
#             experts' down projection into y_shared (other blocks of the same launch).
# C  down:    block = NR_C rows of D for *every* active expert (equal work per block), then the
#             deterministic combine of those rows: out[m] (+)= y_shared[m] + sum_slot w * y[pos_of[m, slot]].
#             With a tee (moe_forward's tee=) the combine also stores each final out row there (the
#             engine's feature copy, without a launch of its own).
# Activations that a GEMM reads as X are kept "word-permuted" (b_perm, h, h_shared): element d of a row
# lies at (d % EPW) * (K / EPW) + d // EPW, so for each element jj of a weight word the 32 lanes read 32
# consecutive floats (one 128-byte wavefront) instead of 32 floats 8-16 bytes apart.
_V2_RWARPS = 4  # warps of the routing block that route tokens (one token each at a time)
_V2_P_TAIL = 2048  # pairs M*k the routing block can group (shared-memory stage); more -> version 1
V2_MAX_PAIRS = _V2_P_TAIL
# The default dispatch runs version 2 up to this many tokens. Measured on the H200 (scripts/bench_moe.py,
# bf16): session 3 (docs/perf/moe-v1-v2-2026-11-29-bf16.json) v2 / v1 1.32x (Moonlight) and 1.23x (Kimi)
# at M = 1, but 0.90x / 0.80x at M = 16 and 0.62x / 0.45x at M = 64; session 6, with _v2_mm's loads
# issued before their uses and kernel B's shared-down blocks first (docs/perf/moe-2026-11-30-bf16.json):
# M = 1 Moonlight 56.8 us (2.13x v1, was 90.7), Kimi 215 us (1.82x, 88% of copy); M = 8 with 2-token
# tiles 216 / 1141 us (1.53x / 1.52x v1). Session 7, same engine with KDT_MOE_V2_MAX_M=1024 (version 2
# at every M) against version 1 past M = 8 (scripts/h200_check.sh moe-wide and session 6's bench): Moonlight
# verify n = 16 / 64 / 256 at L = 512 16.7 / 49.9 / 181 -> 14.1 / 40.4 / 132 ms (L = 8192: 21.1 / 66.0 / 245 ->
# 18.3 / 56.7 / 196), prefill P = 128 93 -> 69 ms; model_code's learned drafter (verify of 16-257 nodes, same
# run) budget 16 / 64 / 256 5521 / 3704 / 1546 -> 5856 / 4182 / 1803 tok/s. So version 2 at every M (past
# V2_MAX_PAIRS pairs, e.g. long prefills, moe_forward still runs version 1).
V2_MAX_M = int(os.environ.get("KDT_MOE_V2_MAX_M", str(1 << 30)))
# (Tried in session 4: version 2 at every M for small, launch-bound layers (the tiny fixture's 1.5 MB
# of experts). Same-run A/B on the H200: tiny verify n = 1/4/16/64 0.293/0.347/0.465/0.808 ms with
# version 1 at M > 1, 0.303/0.336/0.477/0.850 with version 2; DDTree chain 16750 vs 17082 tok/s: no
# gain beyond run-to-run noise for 12 fewer launches per step, so the dispatch stays by M alone.)
_V2_NRL = 2  # router-gate rows per logits block (all its warps split D)
# Default version of moe_forward. Prediction (H200, bf16): 2 is faster at every M it takes. M=1
# Moonlight: 3 launches instead of 8, the router's latency hidden behind the shared gate_up, every
# GEMM with >= ~1000 warps in flight (v1's shared down had 256) -> ~45 us vs 121 us (138 MB at ~85% of
# copy + 3 launch gaps). M=16/64: X read as 128-byte wavefronts (v1: 4 strided loads per word), tiles of 8
# tokens at M=64 (~6 tokens per expert: each weight row once), one combine per down tile.
VERSION = int(os.environ.get("KDT_MOE_VERSION", "2"))

def _v2_mm(epw: int, nr: int, tt: int, u: int, perm: bool, ks: int, cs: bool):
    """Device function ``mm(W, e, wr, X, xrow, kq, lane, acc, wbuf, wv)``: per-lane partial sums
    acc[r*tt + t] = sum over this lane's words w of W[e, wr[r], w] . X[xrow[t], elements of w] for
    every t < tt (the callers reduce and write only the tile's first nt tokens; xrow[t >= nt] is a valid
    row, so the other sums are finite and never read). Lane words: kq*32 + lane + i*32*ks (ks warps
    split the row). Every step issues its u*nr weight loads first, then per word the epw*tt X values
    it needs, then their FMAs: no load waits behind another's use, and the full steps carry no bound
    checks (xrow holds valid rows for every t < tt; only the last, partial step checks w < Kw).
    Indices are unsigned (Numba adds a negative-index wrap-around to every signed one). ``perm``: X is
    word-permuted (see above), else natural [rows, K]. ``cs``: weight loads with the streaming hint.
    (Tried in session 6: the next step's words loaded before this step's FMAs: 154-158 registers
    instead of 72-87, and Moonlight M=1 108 us instead of 91.)"""
    unpack = _unpacker(epw)
    EPW, NR, TT, U, PERM, STRIDE, CS = epw, nr, tt, u, perm, WARP * ks, cs
    NX = EPW * TT

    @_device
    def step(W, e, wr, X, xrow, base, Kw, acc, wbuf, wv, xv, checked):
        for q in range(U):
            w = base + uint64(q * STRIDE)
            if not checked or w < Kw:
                for r in range(NR):
                    wbuf[q * NR + r] = ldcs3(W, e, wr[r], w) if CS else W[e, wr[r], w]
        for q in range(U):
            w = base + uint64(q * STRIDE)
            if not checked or w < Kw:
                for jj in range(EPW):
                    col = uint64(jj) * Kw + w if PERM else w * uint64(EPW) + uint64(jj)
                    for t in range(TT):
                        xv[jj * TT + t] = X[xrow[t], col]
                for jj in range(EPW):
                    for r in range(NR):
                        wv[r] = unpack(wbuf[q * NR + r], jj)
                    for t in range(TT):
                        for r in range(NR):
                            acc[r * TT + t] += wv[r] * xv[jj * TT + t]

    @_device
    def mm(W, e, wr, X, xrow, kq, lane, acc, wbuf, wv):
        Kw = uint64(W.shape[2])
        ue = uint64(e)
        xv = cuda.local.array(NX, float32)
        ur = cuda.local.array(NR, uint64)
        ux = cuda.local.array(TT, uint64)
        for r in range(NR):
            ur[r] = uint64(wr[r])
        for t in range(TT):
            ux[t] = uint64(xrow[t])
        for i in range(NR * TT):
            acc[i] = float32(0.0)
        base = uint64(kq * WARP + lane)
        span = uint64(U * STRIDE)
        while base + uint64((U - 1) * STRIDE) < Kw:  # every word of the step is in range
            step(W, ue, ur, X, ux, base, Kw, acc, wbuf, wv, xv, False)
            base += span
        if base < Kw:  # the rest: fewer than u words
            step(W, ue, ur, X, ux, base, Kw, acc, wbuf, wv, xv, True)

    return mm


def _v2_reduce(nr: int, tt: int):
    """Device function ``reduce(acc, nt, red, warp, lane)``: the warp sums of acc (t < nt) to every lane."""
    if IS_SIM:
        return _warp_allsum_vec
    NR, TT = nr, tt

    @_device
    def reduce(acc, nt, red, warp, lane):
        for t in range(TT):
            if t < nt:
                for r in range(NR):
                    acc[r * TT + t] = _warp_allsum(acc[r * TT + t])

    return reduce


def _v2_pick(nr: int, tt: int):
    """Device function ``pick(acc, sel, lane)``: sel[r] = acc[r*tt + lane] (lane < tt), with
    compile-time acc indices so that acc stays in registers."""
    NR, TT = nr, tt

    @_device
    def pick(acc, sel, lane):
        for i in range(NR * TT):
            if lane == i % TT:
                sel[i // TT] = acc[i]

    return pick


@_device
def _v2_route_token(logits, bias, m, valid, E, n_group, topk_group, top_k, norm, scale, sh_c, sh_s, sh_g,
                    red_v, red_i, w, lane, topk_idx, topk_w, sh_idx):
    """Route token m with warp w (the old router kernel's algorithm; logits read once, through L2:
    the sigmoids stay in shared memory sh_s[w], so the k rounds make no global round trips). Writes
    topk_idx[m], topk_w[m] and sh_idx[m*k + r] only when ``valid``."""
    one = float32(1.0)
    for e in range(lane, E, WARP):
        s = one / (one + math.exp(-ldcg2(logits, m, e)))
        sh_s[w, e] = s
        sh_c[w, e] = s + bias[e]
    _warp_sync()
    if n_group > 1:
        _mask_groups(sh_c, sh_g, w, lane, E, n_group, topk_group)
    taken = int32(0)  # bit i: expert lane + 32 i already chosen
    wsum = float32(0.0)
    n_sweep = (E + WARP - 1) // WARP
    for r in range(top_k):
        bv = _NEG_INF
        bi = int32(E_MAX)
        for i in range(n_sweep):  # runtime bound: not unrolled (registers)
            e = lane + WARP * i
            if e < E and ((taken >> i) & 1) == 0:
                v = sh_c[w, e]
                if v > bv or (v == bv and bi == E_MAX):
                    bv = v
                    bi = int32(e)
        bv, bi = _warp_argmax(bv, bi, red_v, red_i, w, lane)
        if lane == bi % WARP:
            taken |= int32(1) << (bi // WARP)
        wsum += sh_s[w, bi]
        if lane == r and valid:  # lane r keeps choice r (top_k <= K_MAX <= 32)
            topk_idx[m, r] = bi
            sh_idx[m * top_k + r] = bi
    if lane < top_k and valid:
        v = sh_s[w, sh_idx[m * top_k + lane]]
        if norm:
            v = v / (wsum + _EPS_NORM)
        topk_w[m, lane] = v * float32(scale)
    _warp_sync()  # sh_s[w] is read above: the warp's next token may overwrite it only after this


# ---- kernels A and B in one launch (kernel AB, ``V2Tiles.ab``: M <= AB_MAX_M) ---------------------------
# B's blocks need A's results: the routed gate_up the grouping (active, offsets, counts, sorted_rows) and b_perm,
# the shared down h_shared. Apart, B starts only when all of A has ended, after a launch gap and its own ramp.
# In one launch, B's blocks start as soon as A's last blocks are dispatched and wait, resident, on a flag: the
# grouping block raises the routed flag when the grouping is written (after its threadfence), the last shared
# gate_up block to finish (a count) the shared flag. No deadlock whatever order the hardware dispatches blocks
# in: a block's role is its ticket (kdt.kernels.common's section on blocks that wait, whose helpers these are), so
# every role block a waiter waits on has started and waits on nothing; ~1000 waiters of Moonlight's layer spread
# over SYNC_COPIES L2 lines. The last B block to pass resets every word the launch wrote (tickets, counts, flags).
# Prediction (H200, Moonlight M = 1, session 23's in-graph times A 14.8 + B 23.3 us):
# the routed gate_up (69 MB, ~16 us of bytes) starts when the routing ends (~12.4 us) and the shared experts'
# 23 MB run beside the routing: ~29-31 us, 5-8 us a layer, 130-200 us of the 2.86 ms AR step. Measured (session 24,
# scripts/bench_moe.py --previous, the layer A + B + C): 56.1 / 55.9 us against 57.1 / 57.1 apart (two runs): -1.1 us.
# Why so little: kernel AB takes kernel A's registers (128 a thread, A alone 126; B alone 79) and its 30 KB of routing
# arrays in shared memory, so its routed gate_up runs 4 blocks an SM where kernel B ran 6. Capped (``ab_regs``): 96
# registers 55.7 us (spills 120 bytes), 80 registers 61.0 us (spills 276 bytes). On by default (it is faster, and
# every gpu test of it passed: 64 forwards bit-identical to A and B apart, Moonlight and Kimi K2 against float64).
# Since then the routing block's one round at M = 1 (see _v2_route_body) and the reset of only the words a launch
# wrote (_ab_wait) took kernel AB to 95 registers, no spills: not measured on the H200 yet.
AB_MAX_M = int(os.environ.get("KDT_MOE_AB_M", "1"))  # kernel AB at M <= this (0: kernels A and B apart)
_SYNC_TICKET, _SYNC_SHARED, _SYNC_PASSED = 0, 1, 2  # line 0: role tickets, shared gate_up blocks done, B blocks passed
_SYNC_ROUTED = SYNC_LINE  # the routed flag's copies: lines 1 .. SYNC_COPIES
_SYNC_SHARED_DONE = SYNC_LINE * (1 + SYNC_COPIES)  # the shared flag's copies: the next SYNC_COPIES lines
SYNC_WORDS = SYNC_LINE * (1 + 2 * SYNC_COPIES)  # MoEScratch.sync: int32, zero between launches


@_device
def _ab_wait(sync, flag, copy, nb):
    """A B-role block of kernel AB: thread 0 waits for copy ``copy`` of ``flag``, then counts the block as
    passed; the last of the nb blocks to pass puts the words the launch wrote (line 0's three counters, the
    flags' copies) back to zero for the next launch. (A reset of all SYNC_WORDS by every thread of the block,
    a loop of runtime stride, cost B's role body 17 registers: 96 against 79, ptxas -v.)"""
    if cuda.threadIdx.x == 0:
        sync_poll(sync, flag + copy * SYNC_LINE)
        cuda.threadfence()
        if cuda.atomic.add(sync, _SYNC_PASSED, 1) == nb - 1:
            sync[_SYNC_TICKET] = 0
            sync[_SYNC_SHARED] = 0
            sync[_SYNC_PASSED] = 0
            for c in range(2 * SYNC_COPIES):
                sync[_SYNC_ROUTED + c * SYNC_LINE] = 0  # the routed flag's copies, then the shared flag's
    cuda.syncthreads()


_V2_CACHE: dict[tuple, object] = {}


def _v2_route_kernel(nw: int, epw_b: int, epw_s: int, nr_s: int, tt_s: int, u_s: int, u_l: int, cs_s: bool,
                     rt: bool = True, tc: int = 0, tc_split: bool = False, hilo: bool = False, xh: bool = False,
                     s_fo: bool = False):
    """Kernel A (see the section comment and :func:`_v2_route_body`): block b is role block b."""
    key = ("A", nw, epw_b, epw_s, nr_s, tt_s, u_s, u_l, cs_s, rt, tc, tc_split, hilo, xh, s_fo, GROUP_MATCH)
    if key in _V2_CACHE:
        return _V2_CACHE[key]
    body = _v2_route_body(nw, epw_b, epw_s, nr_s, tt_s, u_s, u_l, cs_s, rt, False, tc, tc_split, hilo, xh, s_fo)

    def kern(b, gate, bias, logits, b_perm, sgu, h_shared, topk_idx, topk_w, counts, offsets, sorted_rows,
             sorted_slot, pos_of, active, n_active, counter, M, n_group, topk_group, top_k, norm, scale, nlb):
        grid_dependency_wait()
        body(cuda.blockIdx.x, b, gate, bias, logits, b_perm, sgu, h_shared, topk_idx, topk_w, counts, offsets,
             sorted_rows, sorted_slot, pos_of, active, n_active, counter, M, n_group, topk_group, top_k, norm, scale,
             nlb, 0, counter)  # (no flags: the last two arguments are never read)

    kern.__name__ = (f"moe2_route_nw{nw}_b{epw_b}_s{epw_s}_nr{nr_s}_tt{tt_s}_u{u_s}_ul{u_l}{'_cs' if cs_s else ''}"
                     f"{'_rt' if rt else ''}{f'_tc{tc}' if tc else ''}{'_split' if tc_split else ''}"
                     f"{'_hilo' if hilo else ''}{'_xh' if xh else ''}{'_sfo' if s_fo else ''}")
    k = cuda.jit(kern)
    _V2_CACHE[key] = k
    return k


def _v2_route_body(nw: int, epw_b: int, epw_s: int, nr_s: int, tt_s: int, u_s: int, u_l: int, cs_s: bool,
                   rt: bool, sig: bool, tc: int = 0, tc_split: bool = False, hilo: bool = False, xh: bool = False,
                   s_fo: bool = False):
    """Kernel A's work as a device function of its role block ``bid`` (cached). Role blocks: nlb logits
    blocks (``_V2_NRL`` gate rows each, the nw warps split D), then the shared gate_up blocks (nw warps x
    nr_s/2 outputs each, all M tokens in tiles of tt_s). ``rt`` (route by token tile): nlb = n_eb
    gate-row blocks x n_tt token tiles of tt_s, each block one tile; the block that takes a tile's last
    ticket (counter[1 + tile]) routes the tile's tokens, and the one that routes the last tile
    (counter[0]) groups all M k pairs. Without ``rt``: nlb = n_eb blocks, each over all M tokens, and the
    last one routes all of them (M / 4 serial rounds of its 4 routing warps). ``sig`` (kernel AB): the
    grouping block raises the routed flag in ``sync`` when the grouping is written, and the last of the
    n_a - nlb shared gate_up blocks to finish raises the shared flag. ``tc`` (bf16 weights): the shared gate_up
    blocks on tensor cores (16 outputs a block, tc tiles of 8 tokens a pass; see "tensor cores" below), with
    ``tc_split`` one pass a block (cdiv(M, 8 tc) blocks an output tile); ``hilo`` (with ``tc``): b_perm and h_shared
    are written in the tensor cores' hi / lo layout (their uint16 views; see "tensor cores" below); ``xh`` (with
    ``hilo``): b_perm is the caller's hi / lo b (its uint64 view, ``moe_forward(..., b_hl)``), read, not written: the
    shared gate_up reads it (``s_fo``: sgu in fragment order) instead of splitting float32 b."""
    if (xh and not (tc and hilo)) or (s_fo and not xh):
        raise ValueError(f"kernel A: xh needs tc and hilo, s_fo needs xh (tc={tc}, hilo={hilo}, xh={xh}, s_fo={s_fo})")
    GM = GROUP_MATCH
    key = ("A body", nw, epw_b, epw_s, nr_s, tt_s, u_s, u_l, cs_s, rt, sig, tc, tc_split, hilo, xh, s_fo, GM)
    if key in _V2_CACHE:
        return _V2_CACHE[key]
    if IS_SIM and nw > _V2_RWARPS:
        raise ValueError("simulator: every warp of the routing block must route (barrier pairing)")
    NW, NT, EPWB, EPWS, NRS, TTS, RT, SIG = nw, nw * WARP, epw_b, epw_s, nr_s, tt_s, rt, sig
    NRL, TTL = _V2_NRL, tt_s
    NOS = NRS // 2
    NACCL, NACCS = NRL * TTL, NRS * TTS
    WBL, WBS = u_l * NRL, u_s * NRS
    RWP = min(NW, _V2_RWARPS)
    ONE_ROUND = RT and TTL <= RWP  # the routing block's tile fits its routing warps: one round
    EPT = max(1, E_MAX // NT)  # experts per thread in the scans
    SCAN_N = E_MAX // EPT  # threads that scan
    RED_L = (NW, NACCL, WARP) if IS_SIM else (1, 1, 1)
    RED_S = (NW, NACCS, WARP) if IS_SIM else (1, 1, 1)
    RRED = (_V2_RWARPS, WARP) if IS_SIM else (1, 1)
    mm_l = _v2_mm(2, NRL, TTL, u_l, False, NW, cs_s)
    red_l = _v2_reduce(NRL, TTL)
    mm_s = _v2_mm(EPWS, NRS, TTS, u_s, False, 1, cs_s)
    red_s = _v2_reduce(NRS, TTS)
    pick_s = _v2_pick(NRS, TTS)
    TCS, TSPLIT, PASS, HILO, XH = tc, tc_split, 8 * tc, hilo, xh
    gate_up_tc = _tc_gate_up(nw, tc, u_s, cs_s, False, XL_HILO if xh else XL_NATURAL, HILO, fo=s_fo) if tc else None

    def body(bid, b, gate, bias, logits, b_perm, sgu, h_shared, topk_idx, topk_w, counts, offsets, sorted_rows,
             sorted_slot, pos_of, active, n_active, counter, M, n_group, topk_group, top_k, norm, scale, nlb, n_a,
             sync):
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        xrow = cuda.local.array(TTL, int32)
        if bid < nlb:
            # ---- router logits[m, e0 .. e0+NRL) for all M tokens; the NW warps split D -------------
            redl = cuda.shared.array(RED_L, float32)
            red2 = cuda.shared.array((NW, NACCL), float32)
            flag = cuda.shared.array(1, int32)
            accl = cuda.local.array(NACCL, float32)
            wrl = cuda.local.array(NRL, int64)
            wbl = cuda.local.array(WBL, uint64)
            wvl = cuda.local.array(NRL, float32)
            E = gate.shape[1]
            n_eb = (E + NRL - 1) // NRL
            n_tt = nlb // n_eb if RT else 1  # token tiles (rt: one per block)
            tile = bid // n_eb if RT else 0
            m_lo = tile * TTL if RT else 0
            m_hi = min(M, m_lo + TTL) if RT else M
            e0 = (bid % n_eb) * NRL
            for r in range(NRL):
                wrl[r] = min(e0 + r, E - 1)
            for p0 in range(m_lo, m_hi, TTL):
                nt = min(TTL, m_hi - p0)
                for t in range(TTL):
                    xrow[t] = p0 + t if t < nt else 0
                mm_l(gate, 0, wrl, b, xrow, warp, lane, accl, wbl, wvl)
                red_l(accl, nt, redl, warp, lane)
                if lane == 0:
                    for i in range(NACCL):
                        red2[warp, i] = accl[i]
                cuda.syncthreads()
                if tid < NACCL:
                    r = tid // TTL
                    t = tid % TTL
                    if t < nt and e0 + r < E:
                        s = red2[0, tid]
                        for q in range(1, NW):
                            s += red2[q, tid]
                        logits[p0 + t, e0 + r] = s
                cuda.syncthreads()
            # ---- b -> b_perm (kernel B's activations), spread over the logits blocks (xh: given) ------
            D = b.shape[1]
            Kwb = D // EPWB
            for i in range(bid * NT + tid, 0 if XH else M * D, nlb * NT):
                m = i // D
                d = i % D
                if HILO:
                    _put_hilo(b_perm, m, d, b[m, d])
                else:
                    b_perm[m, (d % EPWB) * Kwb + d // EPWB] = b[m, d]
            # ---- ticket: the last logits block of the tile (rt) or of all (not rt) routes --------------
            cuda.threadfence()
            cuda.syncthreads()
            if tid == 0:
                if RT:
                    flag[0] = 1 if cuda.atomic.add(counter, 1 + tile, 1) == n_eb - 1 else 0
                else:
                    flag[0] = 1 if cuda.atomic.add(counter, 0, 1) == nlb - 1 else 0
            cuda.syncthreads()
            if flag[0] == 0:
                return
            cuda.threadfence()
            sh_c = cuda.shared.array((RWP, E_MAX), float32)
            sh_s = cuda.shared.array((RWP, E_MAX), float32)
            sh_g = cuda.shared.array((RWP, G_MAX), float32)
            red_v = cuda.shared.array(RRED, float32)
            red_i = cuda.shared.array(RRED, int32)
            sh_idx = cuda.shared.array(_V2_P_TAIL, int32)
            cnt = cuda.shared.array(E_MAX, int32)
            cur = cuda.shared.array(E_MAX, int32)
            scan_v = cuda.shared.array(SCAN_N, int32)
            scan_a = cuda.shared.array(SCAN_N, int32)
            P = M * top_k
            for i in range(tid, E_MAX, NT):
                cnt[i] = 0
            if warp < RWP:
                # a tile of at most RWP tokens takes one round, and the loop's end says so at compile time: with
                # m_hi as its end (the same one trip) kernel A took 126 registers, kernel AB 128; with lo + 1, 80
                # and 96 (ptxas -v, Moonlight's M = 1 shape, bf16; M = 8's kernel A 128 -> 108)
                for m0 in range(m_lo, m_lo + 1 if ONE_ROUND else m_hi, RWP):
                    m = m0 + warp
                    _v2_route_token(logits, bias, min(m, m_hi - 1), m < m_hi, E, n_group, topk_group, top_k,
                                    norm, scale, sh_c, sh_s, sh_g, red_v, red_i, warp, lane, topk_idx, topk_w,
                                    sh_idx)
            cuda.syncthreads()
            if RT:
                if tid == 0:
                    counter[1 + tile] = 0  # the tile's tickets are all taken: ready for the next launch
                if n_tt > 1:  # ---- the block that routes the last tile groups (its sh_idx: one tile) --
                    cuda.threadfence()
                    cuda.syncthreads()
                    if tid == 0:
                        flag[0] = 1 if cuda.atomic.add(counter, 0, 1) == n_tt - 1 else 0
                    cuda.syncthreads()
                    if flag[0] == 0:
                        return
                    cuda.threadfence()
                    for i in range(tid, P, NT):
                        sh_idx[i] = ldcg2(topk_idx, i // top_k, i % top_k)
                    cuda.syncthreads()
            # ---- group the P pairs by expert (counting sort, token order within an expert) ----------
            for i in range(tid, P, NT):
                cuda.atomic.add(cnt, sh_idx[i], 1)
            cuda.syncthreads()
            sv = 0
            sa = 0
            if tid < SCAN_N:
                for q in range(EPT):
                    c = cnt[tid * EPT + q]
                    sv += c
                    sa += 1 if c > 0 else 0
                scan_v[tid] = sv
                scan_a[tid] = sa
            cuda.syncthreads()
            _scan2(scan_v, scan_a, tid, SCAN_N)  # inclusive scans of per-thread counts / active experts
            if tid < SCAN_N:
                run_v = scan_v[tid] - sv
                run_a = scan_a[tid] - sa
                for q in range(EPT):
                    e = tid * EPT + q
                    c = cnt[e]
                    cur[e] = run_v
                    if e < E:
                        counts[e] = c
                        offsets[e] = run_v
                        if c > 0:
                            active[run_a] = e
                    run_v += c
                    run_a += 1 if c > 0 else 0
            if tid == 0:
                offsets[E] = P
                n_active[0] = scan_a[SCAN_N - 1]
            cuda.syncthreads()
            if GM:
                _place_pairs(sh_idx, P, top_k, cur, sorted_rows, sorted_slot, pos_of, red_i, warp, lane)
            for c0 in range(0, 0 if GM else P, NT):  # (GROUP_MATCH off) chunks of NT pairs in flat order
                i = c0 + tid
                c1 = min(c0 + NT, P)
                e = 0
                pos = 0
                last = False
                if i < P:
                    e = sh_idx[i]
                    before = 0
                    last = True
                    for q in range(c0, c1):
                        if sh_idx[q] == e:
                            if q < i:
                                before += 1
                            elif q > i:
                                last = False
                    pos = cur[e] + before
                    m = i // top_k
                    s = i % top_k
                    sorted_rows[pos] = m
                    sorted_slot[pos] = s
                    pos_of[m, s] = pos
                cuda.syncthreads()
                if last:
                    cur[e] = pos + 1
                cuda.syncthreads()
            if tid == 0:
                counter[0] = 0  # every ticket of this launch is taken: ready for the next launch
            if SIG:  # the grouping is written: kernel AB's routed gate_up blocks may go
                cuda.threadfence()
                cuda.syncthreads()
                if tid == 0:
                    sync_raise(sync, _SYNC_ROUTED)
        elif TCS:  # ---- the same on tensor cores: 16 outputs of Is a block, all M tokens or (split) one pass ----
            o, p0, p1 = _tc_shared_block(bid - nlb, sgu.shape[1] // 2, TC_ROWS, M, TSPLIT, PASS)
            if XH:
                gate_up_tc(o, sgu, 0, b_perm, p0, p1, counts, h_shared)  # (counts: not read)
            else:
                gate_up_tc(o, sgu, 0, b, p0, p1, counts, h_shared)
        else:
            # ---- shared experts' gate_up: h_shared[m, perm(o)] = silu(g . b_m) * (u . b_m) ------------
            reds = cuda.shared.array(RED_S, float32)
            accs = cuda.local.array(NACCS, float32)
            wrs = cuda.local.array(NRS, int64)
            wbs = cuda.local.array(WBS, uint64)
            wvs = cuda.local.array(NRS, float32)
            sel = cuda.local.array(NRS, float32)
            Is = sgu.shape[1] // 2
            Kws = Is // EPWS
            obase = ((bid - nlb) * NW + warp) * NOS
            for r in range(NOS):
                wrs[r] = min(obase + r, Is - 1)
                wrs[NOS + r] = wrs[r] + Is
            for p0 in range(0, M, TTS):
                nt = min(TTS, M - p0)
                for t in range(TTS):
                    xrow[t] = p0 + t if t < nt else 0
                mm_s(sgu, 0, wrs, b, xrow, 0, lane, accs, wbs, wvs)
                red_s(accs, nt, reds, warp, lane)
                if lane < nt:
                    pick_s(accs, sel, lane)
                    for r in range(NOS):
                        o = obase + r
                        if o < Is:
                            g = sel[r]
                            h_shared[p0 + lane, (o % EPWS) * Kws + o // EPWS] = \
                                g / (float32(1.0) + math.exp(-g)) * sel[NOS + r]
            if SIG:  # the last shared gate_up block to finish: kernel AB's shared down blocks may go
                cuda.threadfence()
                cuda.syncthreads()
                if tid == 0 and cuda.atomic.add(sync, _SYNC_SHARED, 1) == n_a - nlb - 1:
                    cuda.threadfence()
                    sync_raise(sync, _SYNC_SHARED_DONE)

    body = _device(body)
    _V2_CACHE[key] = body
    return body


# ---- tensor cores: the expert GEMMs at M >= TC_MIN_M (bf16 weights) -------------------------------------------------
# At a DDTree verify of 16 .. 256 tokens (Moonlight: ~1.5 .. 24 tokens an expert) the FMA tiles above are bound by
# fp32 FMA issue, not by the bytes (session 6; verify n = 64 at 6.2x its floor, n = 256 at 17.8x in session 24's
# `kdt bench`; session 26's budget-63 step, M = 64: kernels A / B / C 169 / 603 / 280 us a layer, 27.4 of its
# 35.4 ms). There the expert GEMMs run kdt.kernels.tc's warp tile (mma.sync m16n8k16: 16 weight rows x 8 tokens an
# instruction, x as bf16 hi + lo): a gate_up block (kernel A's shared, kernel B's routed) computes 16 outputs (its
# gate and its up rows: two row tiles), a down block (kernel B's shared, kernel C's routed) 16 tc_rt rows of D, for
# nt x 8 tokens a pass, the block's nw warps splitting the input dimension (sums added in warp order through
# shared memory). Prediction: the three launches at M = 64 from FMA issue (~1050 us a layer) to within ~2x of
# their bytes (~1.1 GB a layer at M = 64: ~260 us at the copy bandwidth).
# Measured on the H200 (s27a, `KDT_MOE_TC_M=16 scripts/bench_moe.py --presets moonlight-16b-a3b --M 16,64,256
# --sweep`, the Moonlight layer in us, FMA tiles / tensor cores with 1, 2, 4 token tiles a pass): M = 16: 399 / 448,
# 408, 591; M = 64: 1144 / 966, 643, 891; M = 256: 3563 / 3073, 1939, 1776. So they ran from 32 tokens where the
# tokens also gave the experts 3 tokens each on average. With a short pass on fewer token tiles and x hi / lo
# (``V2Tiles.tc_fit``, session 35's s35a) M = 16 takes 321.7 us on 2 tiles against the FMA tiles' 399.3: now from
# TC_MIN_M = 16 tokens (env KDT_MOE_TC_M; 0: never) where the experts get TC_MIN_LOAD = 1.5 tokens each on average
# (Moonlight: from 16, DeepSeek-V3's 256 experts of 8 from 48, Kimi-K2's 384 from 72; only Moonlight's measured),
# with :func:`_tc_tiles` token tiles a pass. Env KDT_MOE_TC_LOAD sets TC_MIN_LOAD (session 43's s43a times the tensor
# cores down to one token, with the experts in fragment order: KDT_MOE_TC_M=1 KDT_MOE_TC_LOAD=0).
TC_MIN_M = int(os.environ.get("KDT_MOE_TC_M", "16"))  # tensor cores at M >= this (0: never)
TC_MIN_LOAD = float(os.environ.get("KDT_MOE_TC_LOAD", "1.5"))  # ... and M top_k >= TC_MIN_LOAD E
TC_ROWS = tc.MMA_ROWS
# The tensor cores' GEMM inputs (b_perm, h, h_shared) written by their producers already split into bf16 hi and lo
# (``V2Tiles.tc_hilo``, kdt.kernels.tc.XL_HILO; kernel A's shared gate_up still splits its float32 b): the warp tile
# then loads two words a token tile and k group instead of four floats and ~50 integer instructions (s27c's Nsight
# Compute: ALU the busiest pipe of kernels B and C at M = 64, 46%). With it, the shared experts' GEMMs one token pass
# a block (``V2Tiles.tc_split``). Measured (H200, s28a, `scripts/bench_moe.py --presets moonlight-16b-a3b --M 64,256
# --sweep`, the Moonlight layer in us): M = 64: float32 x 657.4, hi / lo 713.9, hi / lo and one pass a block
# 593.5; M = 256: 1691.5, 1349.3, 1017.0. s28b (`--previous`, the shared GEMMs one pass a block in each; float32 x /
# hi / lo): M = 32 **483.6** / 508.4, M = 64 **571.4** / 594.6, M = 256 1450.8 / **1049.4** (all M tokens a block,
# float32: 507.7, 657.3, 1783.5). So hi / lo x with 4 token tiles a pass (``_tc_tiles``), where a token tile's x
# fragments serve 4x the mma; float32 x below. Env KDT_MOE_TC_HILO=0: never hi / lo; KDT_MOE_TC_SPLIT=0:
# the shared GEMMs over all M tokens a block.
TC_HILO = os.environ.get("KDT_MOE_TC_HILO", "1") != "0"
TC_SPLIT = os.environ.get("KDT_MOE_TC_SPLIT", "1") != "0"
# Short passes on fewer token tiles (``V2Tiles.tc_fit``), with x hi / lo at any token tiles a pass. Measured (H200,
# s35a, `scripts/bench_moe.py --presets moonlight-16b-a3b --M 16,32,65,128 --sweep`, the Moonlight layer in us;
# session 34's default: float32 x at 2 tiles, hi / lo at 4 / fit / fit, hi / lo): M = 32 486.1 / 481.3 / **460.8**;
# M = 65 575.1 / 560.8 / **537.3**; M = 128 (hi / lo) 709.2 / **696.7**; at M = 16 the FMA tiles 399.3, tensor
# cores on 2 tiles 409.0 / 334.7 / **321.7**. Env KDT_MOE_TC_FIT=0 with KDT_MOE_TC_M=32: session 34's tiles.
TC_FIT = os.environ.get("KDT_MOE_TC_FIT", "1") != "0"
# Kernel B's routed gate_up on the block-tiled GEMM (kdt.kernels.tc_tiled.tiled_gate_up_kernel, ``V2Tiles.tiled``;
# session 36) from TILED_MIN_M tokens, where the GEMMs take x hi / lo and D % 32 == 0: each block stages an expert's
# 64 gate and 64 up rows and its gathered tokens in shared memory, 8 warps on them; B keeps the shared down, in a
# launch of its own after it. At 256 tokens B's routed gate_up was 475 us for ~173 us of bytes (s30a). Env
# KDT_MOE_TILED_M; 0 (off): measured slower (H200, session 39's s36e, `scripts/bench_moe.py --presets moonlight-16b-a3b
# --M 65,128,256 --sweep --only "v2,v2 tc_tiled"`, the Moonlight layer in us, default / tiled): 510.6 / 660.3 at 65
# tokens, 679.9 / 907.8 at 128, 1056.5 / 1497.2 at 256.
TILED_MIN_M = int(os.environ.get("KDT_MOE_TILED_M", "0"))
# The routed experts' weights also kept in fragment order (kdt.kernels.tc's module docstring, ``V2Tiles.tc_fo``;
# session 43): kernels B's routed gate_up and C's routed down load a lane's A fragment as one 16-byte load where the
# natural order takes two 8-byte loads and ~6 register moves. sm_90 SASS of the warp tile's full step (rt 2, nt 4, u
# 2, x hi / lo): 243 instructions for 32 mma, 196 at raw addresses (``tc.TC_PTR``), 67 in fragment order; kernels B
# and C are bound by instructions a mma and L2 requests (session 30's Nsight Compute). It doubles the routed experts'
# device bytes (both orders are kept: the FMA tiles below the tensor cores' first M read the natural one).
# Measured (H200, session 44's s43a, `scripts/bench_moe.py --presets moonlight-16b-a3b --sweep`, the Moonlight layer in
# us, natural / fragment order): M = 16 310.2 / 246.9, 65 489.7 / 383.0, 256 1068.4 / 797.7 (PTR on: 501.8 / 394.6,
# 1018.2 / 794.4); below TC_MIN_M, the FMA tiles / tensor cores in fragment order: M = 1 56.4 / 64.9, 4 141.6 / 136.4,
# 8 206.8 / 174.4. The budget-64 oracle step in its graphs 16.28 -> 14.15 ms (s43b). So the copy is kept by default
# where it fits (``fo_fits``: the device keeps FO_RESERVE of its memory free after it; Moonlight's 26 layers: +29 GB),
# and a layer that has one takes the tensor cores from TC_FO_MIN_M tokens and TC_FO_MIN_LOAD tokens an expert (the
# lower of these and TC_MIN_M / TC_MIN_LOAD; Moonlight: from 8). Env KDT_MOE_TC_FO: auto (default), 1 (always, where
# the shapes allow), 0 (never: session 43's kernels).
TC_FO = os.environ.get("KDT_MOE_TC_FO", "auto")
FO_RESERVE = 0.25  # the fraction of the device's memory left free after a layer's fragment-ordered copy (auto)
TC_FO_MIN_M = int(os.environ.get("KDT_MOE_TC_FO_M", "8"))
TC_FO_MIN_LOAD = float(os.environ.get("KDT_MOE_TC_FO_LOAD", "0.75"))
# The shared experts in fragment order too (``V2Tiles.s_fo``; session 48): kernel B's shared down, and kernel A's
# shared gate_up where the caller gives b in the hi / lo layout (``moe_forward(..., b_hl)``: the engine's norm writes
# it beside float32 b, which the router keeps). Without b_hl, kernel A's shared gate_up reads float32 b in natural
# order and splits it (~50 integer instructions a k group) and its logits blocks write b_perm for kernel B; with it
# both read b_hl and the conversion is gone. Kernel A at 65 tokens was 65.8 us (s30d's Nsight Compute: DRAM 8%, issue
# 34%), ~61 in the budget-64 step (s45a) for ~23 MB of shared gate_up weights. The same fragments and the same split,
# so the same bits. Measured (session 49, s49b, H100, `scripts/profile_graphs.py --preset moonlight-16b-a3b --drafter
# oracle --budget 64 --ab kdt.kernels.moe.SHARED_FO=1,kdt.kernels.moe.B_HILO=1`, every program in its graph): the
# budget-64 oracle step 14913.8 -> 14581.3 us (-332; session 48 predicted ~-0.7 ms from the SASS). On by default. Env
# KDT_MOE_SHARED_FO=0: the shared experts in natural order; KDT_MOE_B_HILO=0: no b_hl from the engine
# (:func:`reads_b_hilo`).
SHARED_FO = os.environ.get("KDT_MOE_SHARED_FO", "1") != "0"
B_HILO = os.environ.get("KDT_MOE_B_HILO", "1") != "0"
# Kernel A's token tile (its logits blocks' tokens, each tile routed by its last block) where its shared gate_up runs
# on tensor cores (its FMA tiles, tt_s, are then unused); 0: by M (8 past 16 tokens). Measured on an H100 (session 51,
# s51b: `scripts/bench_moe.py --presets moonlight-16b-a3b --M 65 --parts --sweep --only "v2,v2 A_tiles4,v2
# A_tiles2"`): at 65 tokens tiles of 8 / 4 / 2 take kernel A's head 30.1 / 26.6 / 28.3 us, the layer 460.2 / 456.9 /
# 457.7, each with the default's bits (tiles of 4: the 4 routing warps route a tile in one round). Session 52 (s52a,
# H100): the MoE and engine gpu tests and kdt verify pass with tiles of 4, and the budget-64 oracle step in its graphs
# goes 13890.3 -> 13799.0 us (-0.7%; the AR step, no tensor cores, 3399.0 / 3398.7). Tiles of 4 by default; env
# KDT_MOE_A_TT=0: by M.
A_TT = int(os.environ.get("KDT_MOE_A_TT", "4"))


# Kernel C on tensor cores at 65 tokens ran at ~78% of copy where kernel B's routed gate_up ran at ~100% (s51b: 156 us
# for 64 experts' 369 MB of down weights; B's head 244 us for 738 MB). Two costs B does not have in the same measure:
# C's blocks are short (K = I: 11 steps of 2 groups a warp against B's 16), so more of an SM's time goes to a
# block's start and its end (the reduction over warps, the stores, the ticket); ptxas takes 98 registers, 4 blocks of
# 4 warps an SM. And the last block of each row tile combines M x R outputs, a thread's outputs one after another,
# each a chain of L1 and L2 loads (~12-15 us at 65 tokens); the last row tiles' combines are the launch's tail.
# C_REGS caps C's registers at 2 token tiles a pass in fragment order, one row group (80: no spill, 6 blocks an SM; at 4
# tiles ptxas takes 128 and spills below ~104; at 80 the natural order spills 164 bytes, the staged forms 108-248, 2 row
# groups 8), C_CMB keeps that many outputs of a thread in flight and C_KC compiles each one's slot loop for
# top_k (LLVM unrolls it: more of its loads in flight; at 80 registers ptxas issues a slot's loads for both outputs,
# uncapped both slots' of an unrolled pair). Session 53 (H100, Moonlight, 60 experts at 65 tokens,
# `scripts/bench_moe.py --parts`, kernel C's added time; s53a): 151.3 us before, capped at 96 / 80 146.3 / 146.4, 4
# outputs 149.6, kc 141.9, 2 outputs with kc 137.5, 4 with kc 143.6, **80 registers, 2 outputs with kc 132.0**; in the
# engine's graphs (s53b, one process): the budget-64 oracle step 13498.0 -> 13218.2 (2 outputs, kc) -> 13077.2 us (and
# capped), the AR step 3354.7 -> 3342.5.
C_REGS = int(os.environ.get("KDT_MOE_C_REGS", "80"))
C_CMB = int(os.environ.get("KDT_MOE_C_CMB", "2"))
C_KC = os.environ.get("KDT_MOE_C_KC", "1") != "0"  # ... and compiles its loop over a token's slots for top_k


def a_token_tiles(t: V2Tiles, tt: int) -> V2Tiles:
    """t with kernel A's logits blocks in tiles of tt tokens (``A_TT``): 4 words in flight a warp at 4 tokens or
    fewer (one routing round a tile), 2 at 8 (the accumulators of 8 tokens stay in registers)."""
    return replace(t, tt_s=tt, u_l=4 if tt <= 4 else 2)


def fo_fits(nbytes: int, free: int, total: int) -> bool:
    """KDT_MOE_TC_FO=auto's rule: a copy of nbytes fits where FO_RESERVE of the device's total memory stays free."""
    return free - nbytes >= FO_RESERVE * total


@cuda.jit(device=True, inline=True)
def _tc_shared_block(sb, n, rows, M, split, pass_tokens):
    """(first output row, first token, end token) of shared-expert GEMM block sb on tensor cores (kernel A's
    gate_up, B's down) over n output rows, ``rows`` a block: all M tokens, or with ``split`` one pass of
    ``pass_tokens`` (the output tiles of pass 0 first)."""
    if not split:
        return sb * rows, 0, M
    nob = (n + rows - 1) // rows
    p0 = (sb // nob) * pass_tokens
    return (sb % nob) * rows, p0, min(M, p0 + pass_tokens)


def _tc_passes(pass_fn, nt: int, fit: bool, st: int):
    """Device function ``run(p0, a0, W, e, X, end, rowsel, y, rows, xrows, acc, sm, frag, warp, lane, n, kwh)``: the
    pass of the tokens [p0, min(end, p0 + 8 nt)) by ``pass_fn(ntp)``, a device function of the same arguments on ntp
    token tiles: ntp = nt, or with ``fit`` the fewest of 1, 2 that hold the pass's tokens (:func:`_tc_gate_up`,
    :func:`_tc_down`; not staged, st = 0: kernels B and C drop fit there, ``_v2_kernels``)."""
    if fit and st:
        raise ValueError(f"short passes on fewer token tiles are not staged (tc_fit with tc_st={st})")
    pass_n = pass_fn(nt)
    FIT1, FIT2 = fit and nt > 1, fit and nt > 2
    pass_1 = pass_fn(1) if FIT1 else pass_n  # (unused ones: pass_n, never called)
    pass_2 = pass_fn(2) if FIT2 else pass_n

    def run(p0, a0, W, e, X, end, rowsel, y, rows, xrows, acc, sm, frag, warp, lane, n, kwh):
        if FIT1 and end - p0 <= 8:
            pass_1(p0, a0, W, e, X, end, rowsel, y, rows, xrows, acc, sm, frag, warp, lane, n, kwh)
        elif FIT2 and end - p0 <= 16:
            pass_2(p0, a0, W, e, X, end, rowsel, y, rows, xrows, acc, sm, frag, warp, lane, n, kwh)
        else:
            pass_n(p0, a0, W, e, X, end, rowsel, y, rows, xrows, acc, sm, frag, warp, lane, n, kwh)

    return _device(run)


def _tc_gate_up(nw: int, nt: int, u: int, cs: bool, gather: bool, xl: int, hilo: bool = False, kw: int = 0,
                st: int = 0, ot: int = 1, fit: bool = False, fo: bool = False):
    """Device function ``gate_up(o0, W, e, X, start, end, rowsel, h)``: on tensor cores, for the tokens p in
    [start, end) (X row ``rowsel[p]`` with ``gather``, else p; X in layout ``xl``, kdt.kernels.tc), outputs [o0,
    o0 + 16 ot nw / kw) of I = W.shape[1] / 2: h[p, o] = silu(gate) * up, h word-permuted (``hilo``: h is the uint16
    view of the hi / lo layout); nt x 8 tokens a pass, the block's nw warps in nw / kw row groups of 16 ot outputs
    (ot output tiles a warp: its row tiles the ot gate tiles, then the ot matching up tiles, all on each x fragment
    it loads), the kw warps of a group splitting the input dimension (kw = 0: one group of nw); st >= 2: the loads
    staged through shared memory, st stages of one group (kdt.kernels.tc.warp_mm_staged); ``fit`` (not staged): a
    pass of at most 8 (16) tokens takes 1 (2) token tiles, not nt (``V2Tiles.tc_fit``); ``fo``: W in fragment order
    (``V2Tiles.tc_fo``). Every thread of the block calls it (barriers)."""
    kw, KW, NRG = _row_groups(nw, kw)
    key = ("gate_up tc", nw, nt, u, cs, gather, xl, hilo, kw, st, ot, fit, fo)
    if key in _V2_CACHE:
        return _V2_CACHE[key]
    NW, NT, OT, GATHER, HILO = nw, nt, ot, gather, hilo
    NA, NG, NR, GR = 2 * ot * nt * 4, 2 * ot, 4 * ot, TC_ROWS * ot  # accumulators a lane (for nt tiles); NG gate
    # rows a lane (rows g and g + 8 of each gate tile), NR its rows; GR outputs a row group
    us = 1 if st else u  # (staged: one group a stage)
    FRAG, SM, SMT = tc.frag_shape(nw), tc.sm_shape(nw, 2 * ot, nt, st, us), tc.sm_dtype(st)
    total = tc.block_total_fn(st)

    def pass_fn(ntp: int):  # one pass of ntp <= nt token tiles (acc, sm and xrows sized for nt)
        NTP, NP = ntp, ot * ntp * 4  # NP gate (up) accumulators a lane
        bmm = tc.block_mm(2 * ot, ntp, us, xl, cs, nw, kw, st, fo)

        def one_pass(p0, o0, W, e, X, end, rowsel, h, rows, xrows, acc, sm, frag, warp, lane, I, Kwh):
            g, t = lane // 4, lane % 4
            for jt in range(NTP):
                p = min(p0 + 8 * jt + g, end - 1)
                xrows[jt] = rowsel[p] if GATHER else p
            bmm(W, e, rows, X, xrows, acc, sm, frag, warp, lane)
            for ix in range(warp, NP * NRG, NW):  # (gate: row tile 0; up: row tile 1, the same position)
                q, i = (0, ix) if NRG == 1 else (ix // NP, ix % NP)  # row group q, its accumulator i
                gs = total(sm, i, lane, q * KW, KW)
                ups = total(sm, NP + i, lane, q * KW, KW)
                p = p0 + tc.acc_col(i, NTP, t)
                o = o0 + q * GR + tc.acc_row(i, NTP, g)
                if p < end and o < I:
                    v = gs / (float32(1.0) + math.exp(-gs)) * ups
                    if HILO:
                        _put_hilo(h, p, o, v)
                    else:
                        h[p, (o % 4) * Kwh + o // 4] = v
            cuda.syncthreads()

        return _device(one_pass)

    run = _tc_passes(pass_fn, nt, fit, st)

    def gate_up(o0, W, e, X, start, end, rowsel, h):
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        g = lane // 4
        sm = cuda.shared.array(SM, SMT)
        frag = cuda.shared.array(FRAG, int64)
        acc = cuda.local.array(NA, float32)
        rows = cuda.local.array(NR, int64)
        xrows = cuda.local.array(NT, int64)
        I = W.shape[1] // 2
        Kwh = I // 4
        # the gate rows of this warp's row group's GR outputs, then the matching up rows
        tc.tile_rows(rows, o0 + (warp // KW) * GR if NRG > 1 else o0, I, g, OT)  # (one group: no division)
        for i in range(NG):
            rows[NG + i] = rows[i] + I
        for p0 in range(start, end, 8 * NT):
            run(p0, o0, W, e, X, end, rowsel, h, rows, xrows, acc, sm, frag, warp, lane, I, Kwh)

    gate_up = _device(gate_up)
    _V2_CACHE[key] = gate_up
    return gate_up


def _tc_down(nw: int, rt: int, nt: int, u: int, cs: bool, xl: int, kw: int = 0, st: int = 0, fit: bool = False,
             fo: bool = False):
    """Device function ``down(d0, W, e, X, start, end, y)``: on tensor cores, y[p, d] = sum_i W[e, d, i] X[p, i]
    for the rows d in [d0, d0 + 16 rt nw / kw) of D = W.shape[1] and the tokens p in [start, end) (X in layout
    ``xl``, kdt.kernels.tc), nt x 8 tokens a pass, the block's nw warps in nw / kw row groups of 16 rt rows, the kw
    warps of a group splitting I (kw = 0: one group of nw); st >= 2: the loads staged, ``fit`` a short pass on fewer
    token tiles, W in fragment order (``fo``) as :func:`_tc_gate_up`. Every thread of the block calls it (barriers)."""
    kw, KW, NRG = _row_groups(nw, kw)
    key = ("down tc", nw, rt, nt, u, cs, xl, kw, st, fit, fo)
    if key in _V2_CACHE:
        return _V2_CACHE[key]
    NW, RT, NT, NA, NB = nw, rt, nt, rt * nt * 4, 2 * rt
    us = 1 if st else u  # (staged: one group a stage)
    FRAG, SM, SMT = tc.frag_shape(nw), tc.sm_shape(nw, rt, nt, st, us), tc.sm_dtype(st)
    total = tc.block_total_fn(st)

    def pass_fn(ntp: int):  # one pass of ntp <= nt token tiles (acc, sm and xrows sized for nt)
        NTP, NAP = ntp, rt * ntp * 4
        bmm = tc.block_mm(rt, ntp, us, xl, cs, nw, kw, st, fo)

        def one_pass(p0, d0, W, e, X, end, rowsel, y, rows, xrows, acc, sm, frag, warp, lane, D, kwh):
            g, t = lane // 4, lane % 4
            for jt in range(NTP):
                xrows[jt] = min(p0 + 8 * jt + g, end - 1)
            bmm(W, e, rows, X, xrows, acc, sm, frag, warp, lane)
            for ix in range(warp, NAP * NRG, NW):
                q, i = (0, ix) if NRG == 1 else (ix // NAP, ix % NAP)  # row group q, its accumulator i
                p = p0 + tc.acc_col(i, NTP, t)
                d = d0 + q * TC_ROWS * RT + tc.acc_row(i, NTP, g)
                if p < end and d < D:
                    y[p, d] = total(sm, i, lane, q * KW, KW)
            cuda.syncthreads()

        return _device(one_pass)

    run = _tc_passes(pass_fn, nt, fit, st)

    def down(d0, W, e, X, start, end, y):
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        g = lane // 4
        sm = cuda.shared.array(SM, SMT)
        frag = cuda.shared.array(FRAG, int64)
        acc = cuda.local.array(NA, float32)
        rows = cuda.local.array(NB, int64)
        xrows = cuda.local.array(NT, int64)
        D = W.shape[1]
        if NRG == 1:
            tc.tile_rows(rows, d0, D, g, RT)
        else:  # this warp's row group's 16 rt rows
            tc.tile_rows(rows, d0 + (warp // KW) * TC_ROWS * RT, D, g, RT)
        for p0 in range(start, end, 8 * NT):  # (no row selection: xrows passes for it, and no word count)
            run(p0, d0, W, e, X, end, xrows, y, rows, xrows, acc, sm, frag, warp, lane, D, 0)

    down = _device(down)
    _V2_CACHE[key] = down
    return down


def gate_up_rows(nw: int, kw: int, ot: int) -> int:
    """Outputs of I a routed block of kernel B on tensor cores takes: nw / kw row groups of ot output tiles of 16."""
    return TC_ROWS * ot * _row_groups(nw, kw)[2]


def _tc_gate_up_body(nw: int, nt: int, rt: int, u: int, cs: bool, cs_s: bool, sd_first: bool, split: bool = False,
                     hilo: bool = False, kw: int = 0, st: int = 0, ot: int = 1, fit: bool = False, fo: bool = False,
                     s_fo: bool = False):
    """Kernel B on tensor cores, as :func:`_v2_gate_up_body` (same arguments): J * ntg routed blocks (slot j = rb //
    ntg, outputs [G x, G x + G) of I, x = rb % ntg, G = 16 ot nw / kw (``_tc_gate_up``'s row groups of ot output
    tiles; kw = 0: G = 16 ot); all the expert's tokens) and cdiv(D, 16 rt) shared-down blocks (rows [16 rt sb, 16 rt
    (sb + 1)) of D, all M tokens; with ``split`` cdiv(M, 8 nt) times as many blocks, one pass of 8 nt tokens each),
    after the routed ones or, with ``sd_first``, before them. ``hilo``: b_perm, h and h_shared in the hi / lo layout
    (b_perm and h_shared read as uint64, h written as uint16). st: the routed gate_up's loads staged
    (``_tc_gate_up``); fit: short passes on fewer token tiles (the routed gate_up and the shared down); fo: wgu in
    fragment order (the routed gate_up); s_fo: sdn in fragment order (the shared down; x hi / lo)."""
    key = ("B tc body", nw, nt, rt, u, cs, cs_s, sd_first, split, hilo, kw, st, ot, fit, fo, s_fo)
    if key in _V2_CACHE:
        return _V2_CACHE[key]
    SDF, RS, SPLIT, PASS, G = sd_first, TC_ROWS * rt, split, 8 * nt, gate_up_rows(nw, kw, ot)
    xl = XL_HILO if hilo else XL_PERM
    gate_up = _tc_gate_up(nw, nt, u, cs, True, xl, hilo, kw, st, ot, fit, fo)
    down = _tc_down(nw, rt, nt, u, cs_s, xl, fit=fit, fo=s_fo)

    def body(bid, b_perm, wgu, h, active, n_active, offsets, counts, sorted_rows, h_shared, sdn, y_shared, M, ntg,
             J, nb, sync):
        nsd = nb - J * ntg
        rb = bid - nsd if SDF else bid
        if 0 <= rb < J * ntg:
            j = rb // ntg
            if j < n_active[0]:
                e = int64(active[j])
                start = int64(offsets[e])
                gate_up((rb % ntg) * G, wgu, e, b_perm, start, start + counts[e], sorted_rows, h)
        else:
            d0, p0, p1 = _tc_shared_block(bid if SDF else bid - J * ntg, sdn.shape[1], RS, M, SPLIT, PASS)
            down(d0, sdn, 0, h_shared, p0, p1, y_shared)

    body = _device(body)
    _V2_CACHE[key] = body
    return body


def _v2_gate_up_kernel(nw: int, epw: int, nr: int, tt: int, tt_s: int, u: int, cs: bool, cs_s: bool,
                       sd_first: bool = False, tc: int = 0, tc_rt: int = 2, tc_split: bool = False,
                       hilo: bool = False, tc_kw: int = 0, tc_st: int = 0, tc_ot: int = 1, tc_fit: bool = False,
                       tc_fo: bool = False, tc_regs: int = 0, s_fo: bool = False):
    """Kernel B (see :func:`_v2_gate_up_body`, with ``tc`` :func:`_tc_gate_up_body`): block b is role block b;
    tc_regs: its register cap a thread on tensor cores (0: ptxas's choice, 128 with tc_ot > 1)."""
    tc_kw = _row_groups(nw, tc_kw)[0]
    regs = (tc_regs or (128 if tc_ot > 1 else 0)) if tc else 0
    tt_s = 0 if tc else tt_s  # (kernel A's token tile: only the FMA tiles' shared down reads it)
    key = ("B", nw, epw, nr, tt, tt_s, u, cs, cs_s, sd_first, tc, tc_rt, tc_split, hilo, tc_kw, tc_st, tc_ot, tc_fit,
           tc_fo, regs, s_fo)
    if key in _V2_CACHE:
        return _V2_CACHE[key]
    if tc:
        body = _tc_gate_up_body(nw, tc, tc_rt, u, cs, cs_s, sd_first, tc_split, hilo, tc_kw, tc_st, tc_ot, tc_fit,
                                tc_fo, s_fo)
    else:
        body = _v2_gate_up_body(nw, epw, nr, tt, tt_s, u, cs, cs_s, sd_first, False)

    def kern(b_perm, wgu, h, active, n_active, offsets, counts, sorted_rows, h_shared, sdn, y_shared, M, ntg, J):
        grid_dependency_wait()
        body(cuda.blockIdx.x, b_perm, wgu, h, active, n_active, offsets, counts, sorted_rows, h_shared, sdn,
             y_shared, M, ntg, J, cuda.gridDim.x, n_active)  # (no flags: the last argument is never read)

    kern.__name__ = (f"moe2_gate_up_nw{nw}_e{epw}_nr{nr}_tt{tt}{f'_tts{tt_s}' if tt_s else ''}_u{u}"
                     f"{'_cs' if cs else ''}{'_css' if cs_s else ''}{'_sdf' if sd_first else ''}"
                     f"{f'_tc{tc}r{tc_rt}' if tc else ''}"
                     f"{'_split' if tc_split else ''}{'_hilo' if hilo else ''}{f'_kw{tc_kw}' if tc_kw else ''}"
                     f"{f'_st{tc_st}' if tc_st else ''}{f'_ot{tc_ot}' if tc_ot != 1 else ''}{'_fit' if tc_fit else ''}"
                     f"{'_fo' if tc_fo else ''}{f'_r{tc_regs}' if tc and tc_regs else ''}{'_sfo' if s_fo else ''}")
    # 2 output tiles a warp: ptxas takes 130 registers (3 blocks an SM), at 128 (4 blocks) it spills 12 bytes
    k = cuda.jit(kern, max_registers=regs) if regs and not IS_SIM else cuda.jit(kern)
    _V2_CACHE[key] = k
    return k


def _v2_gate_up_body(nw: int, epw: int, nr: int, tt: int, tt_s: int, u: int, cs: bool, cs_s: bool, sd_first: bool,
                     wait: bool):
    """Kernel B's work as a device function of its role block ``bid`` of nb (cached). Role blocks: J * ntg
    routed blocks (routed block rb: slot j = rb // ntg of the active experts, output tile x = rb % ntg: nw
    warps x nr/2 outputs) and the shared-down blocks (nw warps x nr rows of D, all M tokens in tiles of
    tt_s), those after the routed ones, or before them with ``sd_first``. Routed blocks with j >= n_active
    exit at once (J = min(E, M k) is the host-known worst case). ``wait`` (kernel AB): a block first waits
    for its flag in ``sync`` (routed blocks: the grouping written; shared down: the shared gate_up)."""
    key = ("B body", nw, epw, nr, tt, tt_s, u, cs, cs_s, sd_first, wait)
    if key in _V2_CACHE:
        return _V2_CACHE[key]
    NW, EPW, NR, TT, TTS, WAIT = nw, epw, nr, tt, tt_s, wait
    NO = NR // 2
    TMAX = max(TT, TTS)
    WB, NACC, NACCS = u * NR, NR * TT, NR * TTS
    SDF = sd_first
    RED_R = (NW, NR * TT, WARP) if IS_SIM else (1, 1, 1)
    RED_S = (NW, NR * TTS, WARP) if IS_SIM else (1, 1, 1)
    mm_r = _v2_mm(EPW, NR, TT, u, True, 1, cs)
    red_r = _v2_reduce(NR, TT)
    pick_r = _v2_pick(NR, TT)
    mm_s = _v2_mm(EPW, NR, TTS, u, True, 1, cs_s)
    red_s = _v2_reduce(NR, TTS)
    pick_s = _v2_pick(NR, TTS)

    def body(bid, b_perm, wgu, h, active, n_active, offsets, counts, sorted_rows, h_shared, sdn, y_shared, M, ntg,
             J, nb, sync):
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        xrow = cuda.local.array(TMAX, int32)
        wr = cuda.local.array(NR, int64)
        wb = cuda.local.array(WB, uint64)
        wv = cuda.local.array(NR, float32)
        sel = cuda.local.array(NR, float32)
        nsd = nb - J * ntg  # shared-down blocks: first (sd_first) or last of the role blocks
        rb = bid - nsd if SDF else bid  # routed block index (< 0 or >= J * ntg: a shared-down block)
        sb = bid if SDF else bid - J * ntg
        if WAIT:
            routed = 0 <= rb < J * ntg
            _ab_wait(sync, _SYNC_ROUTED if routed else _SYNC_SHARED_DONE, bid % SYNC_COPIES, nb)
        if 0 <= rb < J * ntg:
            j = rb // ntg
            if j >= n_active[0]:
                return
            red = cuda.shared.array(RED_R, float32)
            acc = cuda.local.array(NACC, float32)
            e = int64(active[j])
            start = int64(offsets[e])
            end = start + counts[e]
            I = wgu.shape[1] // 2
            Kwh = I // EPW
            obase = ((rb % ntg) * NW + warp) * NO
            for r in range(NO):
                wr[r] = min(obase + r, I - 1)
                wr[NO + r] = wr[r] + I
            for p0 in range(start, end, TT):
                nt = min(TT, end - p0)
                for t in range(TT):
                    xrow[t] = sorted_rows[p0 + t] if t < nt else 0
                mm_r(wgu, e, wr, b_perm, xrow, 0, lane, acc, wb, wv)
                red_r(acc, nt, red, warp, lane)
                if lane < nt:
                    pick_r(acc, sel, lane)
                    for r in range(NO):
                        o = obase + r
                        if o < I:
                            g = sel[r]
                            h[p0 + lane, (o % EPW) * Kwh + o // EPW] = \
                                g / (float32(1.0) + math.exp(-g)) * sel[NO + r]
        else:
            reds = cuda.shared.array(RED_S, float32)
            accs = cuda.local.array(NACCS, float32)
            D = sdn.shape[1]
            obase = (sb * NW + warp) * NR
            for r in range(NR):
                wr[r] = min(obase + r, D - 1)
            for p0 in range(0, M, TTS):
                nt = min(TTS, M - p0)
                for t in range(TTS):
                    xrow[t] = p0 + t if t < nt else 0
                mm_s(sdn, 0, wr, h_shared, xrow, 0, lane, accs, wb, wv)
                red_s(accs, nt, reds, warp, lane)
                if lane < nt:
                    pick_s(accs, sel, lane)
                    for r in range(NR):
                        o = obase + r
                        if o < D:
                            y_shared[p0 + lane, o] = sel[r]

    body = _device(body)
    _V2_CACHE[key] = body
    return body


def _v2_ab_kernel(t: V2Tiles, epw: int):
    """Kernel AB: kernels A and B as one launch (see the section comment "kernels A and B in one launch").
    Role blocks by ticket: [0, n_a) kernel A's, the rest kernel B's, which wait on A's flags."""
    key = ("AB", t.nw, epw, t.nr, t.tt, t.tt_s, t.u, t.u_l, t.cs, t.cs_s, t.sd_first, t.rt, t.ab_regs, GROUP_MATCH)
    if key in _V2_CACHE:
        return _V2_CACHE[key]
    body_a = _v2_route_body(t.nw, epw, epw, t.nr, t.tt_s, t.u, t.u_l, t.cs_s, t.rt, True)
    body_b = _v2_gate_up_body(t.nw, epw, t.nr, t.tt, t.tt_s, t.u, t.cs, t.cs_s, t.sd_first, True)

    def kern(b, gate, bias, logits, b_perm, sgu, h_shared, topk_idx, topk_w, counts, offsets, sorted_rows,
             sorted_slot, pos_of, active, n_active, counter, M, n_group, topk_group, top_k, norm, scale, nlb, wgu, h,
             sdn, y_shared, ntg, J, n_a, sync):
        grid_dependency_wait()
        v = sync_ticket(sync, _SYNC_TICKET)
        if v < n_a:
            body_a(v, b, gate, bias, logits, b_perm, sgu, h_shared, topk_idx, topk_w, counts, offsets, sorted_rows,
                   sorted_slot, pos_of, active, n_active, counter, M, n_group, topk_group, top_k, norm, scale, nlb,
                   n_a, sync)
        else:
            body_b(v - n_a, b_perm, wgu, h, active, n_active, offsets, counts, sorted_rows, h_shared, sdn, y_shared,
                   M, ntg, J, cuda.gridDim.x - n_a, sync)

    kern.__name__ = (f"moe2_ab_nw{t.nw}_e{epw}_nr{t.nr}_tt{t.tt}_tts{t.tt_s}_u{t.u}_ul{t.u_l}{'_cs' if t.cs else ''}"
                     f"{'_css' if t.cs_s else ''}{'_sdf' if t.sd_first else ''}{'_rt' if t.rt else ''}"
                     f"{f'_r{t.ab_regs}' if t.ab_regs else ''}")
    k = cuda.jit(kern, max_registers=t.ab_regs) if t.ab_regs and not IS_SIM else cuda.jit(kern)
    _V2_CACHE[key] = k
    return k


def _v2_down_kernel(nw: int, epw: int, nr: int, tt: int, u: int, cs: bool, tc: int = 0, tc_rt: int = 2,
                    hilo: bool = False, tc_kw: int = 0, tc_st: int = 0, tc_fit: bool = False, tc_fo: bool = False,
                    tc_regs: int = 0, cmb: int = 1, kc: int = 0, fence1: bool = False):
    """Kernel C. Block b = x * n_chunks + c: rows [x*R, x*R + R) of D (R = nw * nr, nr per warp) for
    the active experts j in [c*jc, (c+1)*jc) (all their tokens, tiles of tt; the warps share each
    expert's activation rows through L1) -> y[p, rows]. The last block of row tile x (atomic ticket,
    tickets[x] back to 0 after) combines the tile for the M tokens in slot order (no float atomics):
    out[m, d] (+)= y_shared[m, d] + sum_slot topk_w[m, slot] * y[pos_of[m, slot], d], and with has_tee
    the same value into tee[m, d] (tee[>= M, D] f32; untouched without has_tee). ``tc`` (bf16 weights): the
    routed down on tensor cores (:func:`_tc_down`), tc tiles of 8 tokens a pass, R = 16 tc_rt nw / tc_kw rows a
    block (its row groups; tc_kw = 0: 16 tc_rt); with ``hilo`` h is the uint64 view of the hi / lo layout; tc_st:
    the routed down's loads staged, tc_fit: its short passes on fewer token tiles, tc_fo: wdn in fragment order
    (:func:`_tc_down`); tc_regs: its register cap a thread on tensor cores (0: ptxas's choice); cmb: the combine's
    outputs a thread in flight, kc: its slots a token (top_k, pos_of.shape[1]) known to the compiler, their loads
    unrolled (0: a loop over pos_of.shape[1]); the same sums in the same order either way. fence1: the ticket's fences
    by thread 0 alone, after the block's barrier (cooperative groups' grid sync does so; else every thread fences its
    own stores, then the barrier)."""
    tc_kw = _row_groups(nw, tc_kw)[0]
    regs = tc_regs if tc else 0
    key = ("C", nw, epw, nr, tt, u, cs, tc, tc_rt, hilo, tc_kw, tc_st, tc_fit, tc_fo, regs, cmb, kc, fence1)
    if key in _V2_CACHE:
        return _V2_CACHE[key]
    NW, NT, EPW, NR, TT, TC, CMB, KC, FENCE1 = nw, nw * WARP, epw, nr, tt, tc, cmb, kc, fence1
    R = TC_ROWS * tc_rt * _row_groups(nw, tc_kw)[2] if tc else nw * nr
    down_tc = (_tc_down(nw, tc_rt, tc, u, cs, XL_HILO if hilo else XL_PERM, tc_kw, tc_st, tc_fit, tc_fo)
               if tc else None)  # (rows [x R, x R + R))
    RED = (NW, NR * TT, WARP) if IS_SIM else (1, 1, 1)
    WB, NACC = u * NR, NR * TT
    mm = _v2_mm(EPW, NR, TT, u, True, 1, cs)
    red_f = _v2_reduce(NR, TT)
    pick = _v2_pick(NR, TT)

    def kern(h, wdn, y, active, n_active, offsets, counts, pos_of, topk_w, y_shared, out, tee, tickets, M, jc,
             n_chunks, accumulate, has_shared, has_tee):
        grid_dependency_wait()
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        red = cuda.shared.array(RED, float32)
        flag = cuda.shared.array(1, int32)
        cm = cuda.local.array(CMB, int64)  # the combine's outputs of this thread in flight: token, row, out[m, d],
        cd = cuda.local.array(CMB, int64)  # y_shared[m, d] and the slots' sum
        cout = cuda.local.array(CMB, float32)
        cys = cuda.local.array(CMB, float32)
        csum = cuda.local.array(CMB, float32)
        acc = cuda.local.array(NACC, float32)
        xrow = cuda.local.array(TT, int32)
        wr = cuda.local.array(NR, int64)
        wb = cuda.local.array(WB, uint64)
        wv = cuda.local.array(NR, float32)
        sel = cuda.local.array(NR, float32)
        D = wdn.shape[1]
        x = cuda.blockIdx.x // n_chunks
        c = cuda.blockIdx.x % n_chunks
        d0 = x * R + warp * NR
        for r in range(NR):
            wr[r] = min(d0 + r, D - 1)
        j_end = min((c + 1) * jc, int64(n_active[0]))
        if TC:
            for j in range(c * jc, j_end):
                e = int64(active[j])
                down_tc(x * R, wdn, e, h, int64(offsets[e]), int64(offsets[e]) + counts[e], y)
        else:
            for j in range(c * jc, j_end):
                e = int64(active[j])
                start = int64(offsets[e])
                end = start + counts[e]
                for p0 in range(start, end, TT):
                    nt = min(TT, end - p0)
                    for t in range(TT):
                        xrow[t] = p0 + t if t < nt else 0
                    mm(wdn, e, wr, h, xrow, 0, lane, acc, wb, wv)
                    red_f(acc, nt, red, warp, lane)
                    if lane < nt:
                        pick(acc, sel, lane)
                        for r in range(NR):
                            if d0 + r < D:
                                y[p0 + lane, d0 + r] = sel[r]
        if not FENCE1:
            cuda.threadfence()
        cuda.syncthreads()
        if tid == 0:  # (FENCE1: the barrier orders the block's stores before thread 0's fence, which releases them)
            if FENCE1:
                cuda.threadfence()
            flag[0] = 1 if cuda.atomic.add(tickets, x, 1) == n_chunks - 1 else 0
            if FENCE1 and flag[0] == 1:
                cuda.threadfence()
        cuda.syncthreads()
        if flag[0] == 0:
            return
        if not FENCE1:
            cuda.threadfence()
        k = pos_of.shape[1]
        n_out = M * R
        for i0 in range(tid, n_out, NT * CMB):  # CMB outputs a thread, their loads side by side (past the tile:
            for q in range(CMB):  # clamped, loaded, not stored)
                i = min(i0 + q * NT, n_out - 1)
                m = i // R
                d = min(x * R + i % R, D - 1)
                cm[q], cd[q] = m, d
                cout[q], cys[q] = out[m, d], y_shared[m, d]  # (y_shared: [M_max, D] with or without shared experts)
                csum[q] = float32(0.0)
            for s in range(KC if KC else k):  # (KC: a trip count the compiler knows)
                for q in range(CMB):
                    csum[q] += topk_w[cm[q], s] * ldcg2(y, pos_of[cm[q], s], cd[q])
            for q in range(CMB):
                i = i0 + q * NT
                m, d = cm[q], cd[q]
                if i < n_out and x * R + i % R < D:
                    v = cout[q] if accumulate else float32(0.0)
                    if has_shared:
                        v = v + cys[q]
                    v = v + csum[q]
                    out[m, d] = v
                    if has_tee:
                        tee[m, d] = v
        if tid == 0:
            tickets[x] = 0

    kern.__name__ = (f"moe2_down_nw{nw}_e{epw}_nr{nr}_tt{tt}_u{u}{'_cs' if cs else ''}"
                     f"{f'_tc{tc}r{tc_rt}' if tc else ''}{'_hilo' if hilo else ''}{f'_kw{tc_kw}' if tc_kw else ''}"
                     f"{f'_st{tc_st}' if tc_st else ''}{'_fit' if tc_fit else ''}{'_fo' if tc_fo else ''}"
                     f"{f'_r{regs}' if regs else ''}{f'_cmb{cmb}' if cmb != 1 else ''}{f'_k{kc}' if kc else ''}"
                     f"{'_f1' if fence1 else ''}")
    k = cuda.jit(kern, max_registers=regs) if regs and not IS_SIM else cuda.jit(kern)
    _V2_CACHE[key] = k
    return k


@dataclass(frozen=True)
class V2Tiles:
    """Launch shapes of version 2 (all host-known). nw: warps per block of kernels A and B; nr / u:
    weight rows per warp (gated: half gate, half up) / words per row per lane in flight, kernels A
    (shared gate_up) and B; tt: tokens per register tile of the routed experts (kernel B); tt_s: of the
    shared experts and the router logits (all M tokens); u_l: words in flight of the logits; nw_c / nr_c
    / tt_c / u_c: kernel C (nw_c * nr_c rows of D per block), jc: active experts per block of kernel C;
    cs: routed weights loaded with the streaming (evict-first) cache hint; cs_s: the same for the
    shared experts and the router gate, which are re-read once per token tile when M > tt_s (so
    v2_tiles sets it only when M <= tt_s); sd_first: kernel B's shared-down blocks come first in its
    grid (they do not wait for the routing; last, they ran as a tail after the routed blocks); rt: kernel
    A's logits blocks take one token tile each and route it (see ``_v2_route_body``); ab: kernels A and B
    in one launch (kernel AB, see its section; v2_tiles sets it at M <= ``AB_MAX_M``); ab_regs: kernel AB's
    register cap per thread (0: ptxas's choice); tc: the expert GEMMs (kernel A's shared gate_up, B, C) on tensor
    cores, tc tiles of 8 tokens a pass (0: the FMA tiles; bf16 weights only, v2_tiles sets it where :func:`uses_tc`),
    tc_rt: the row tiles of 16 a block of their down projections (kernel B's shared, kernel C's routed); tc_split:
    the shared experts' GEMMs on tensor cores (kernel A's gate_up, B's down) one pass of 8 tc tokens a block, not
    all M tokens (at M = 64, 4x the blocks: s27c's Nsight Compute had kernel A at 96 us with 432 blocks, ~7
    warps an SM, for ~6 us of bytes); tc_hilo: the tensor cores' GEMM inputs written in the hi / lo layout by their
    producers (kdt.kernels.tc.XL_HILO: kernel A writes b_perm and h_shared, B h), so the warp tile loads x fragments
    instead of splitting float32. v2_tiles sets tc_split, tc_hilo and tc_fit with tc (``TC_SPLIT``, ``TC_HILO``,
    ``TC_FIT``); tc_kw: the routed GEMMs on tensor cores (kernel B's gate_up, C's down) with their block's warps in row
    groups of tc_kw warps splitting K, each group its own 16 (C: 16 tc_rt) rows (0: one group, all warps splitting K;
    it must divide nw and nw_c). Each warp then streams nw / tc_kw times as much of K, and the block reduces over fewer
    warps (session 29; off: the Moonlight layer at 65 / 256 tokens 573 / 1021 us, tc_kw = 2 606 / 1166, tc_kw = 1 781 /
    1382, session 30's s30a); tc_st: those routed GEMMs' loads staged through shared memory by cp.async, tc_st stages of
    one 4-word group a warp (kdt.kernels.tc.warp_mm_staged; 0: off). It needs their x hi / lo (tc_hilo) and K a multiple
    of 8 (D and I), else it is dropped. Off: s27c's Nsight Compute had kernels B and C half their time waiting on loads,
    but at 65 tokens 2-5 stages (1-4 ahead) ran 602-677 us against 597 for the same hi / lo kernels unstaged and 575 for
    the default (session 30's s30b / s30c; that version issue-bound on its per-copy index arithmetic); its copies at
    precomputed offsets, 3 / 4 / 5 stages 581.5 / 563.8 / 577.2 us against 597.9 unstaged and 575.0 for the default
    (session 31's s31a): a warp's load depth alone does not help much. tc_ot: the routed gate_up's output tiles of 16 a
    warp (each a gate and an up row tile of 16, all on every x fragment the warp loads: 1 / ot the x loads, from L2, a
    weight byte; ``gate_up_rows``). Off: at 65 tokens 697.8 us (hi / lo x 664.9) against 574.4 for the default, at 128
    859.6 against 710.8 (session 31's s31b). tc_fit: a pass of kernel B's (routed gate_up, shared down) or C's (routed
    down) GEMMs with at most 8 (16) tokens takes 1 (2) token tiles instead of tc: at 65 tokens (tc = 2, ~6 tokens an
    expert) most passes' second tile is padding, its mma and x loads spent for nothing. The sums are the same bits (a
    token column's are its own). Not staged (tc_st). On with tc (``TC_FIT``: its comment has session 35's times).
    tiled: kernel B's routed gate_up on the block-tiled GEMM, a launch of its own before B's shared down (with
    tc_hilo; ``TILED_MIN_M``). tc_fo: the routed GEMMs on tensor cores (B's gate_up, C's down) read the layer's
    fragment-ordered copy of the experts (``MoEWeights.fragment_order``, ``TC_FO``); with tc_hilo, not staged.
    tc_regs: kernel B's register cap a thread on tensor cores (0: ptxas's choice). At 256 tokens (tc = 4) in fragment
    order ptxas takes 168 (3 blocks of 4 warps an SM); at 128 (4 blocks) it spills 28 bytes. Built, not timed:
    `scripts/bench_moe.py --sweep`'s tc_regs128. s_fo (with tc_fo): the shared experts' GEMMs on their fragment-ordered
    copy too (kernel B's shared down; kernel A's shared gate_up with xh; ``SHARED_FO``). xh (with tc_hilo; set by
    :func:`v2_launches` where the caller gives ``b_hl``): b arrives in the hi / lo layout too; kernel A's logits blocks
    write no b_perm, its shared gate_up and kernel B's routed gate_up read b_hl. c_regs: kernel C's register cap a
    thread on tensor cores in fragment order and one row group (tc_fo, tc_kw = 0; elsewhere dropped: 0, ptxas's
    choice; ``C_REGS``); cmb: the outputs a thread of kernel C's ticketed combine
    keeps in flight (``C_CMB``); kc: the top_k that combine's slot loop is compiled for, unrolled (0: the loop
    over the layer's; v2_tiles sets it with ``C_CMB``, _v2_plan drops it where the layer's top_k differs); c_fence1:
    kernel C's ticket fenced by thread 0 alone after the block's barrier (built in session 53, not timed; off).
    """

    nw: int = 4
    nr: int = 4
    u: int = 4
    tt: int = 1
    tt_s: int = 1
    u_l: int = 4
    nw_c: int = 4
    nr_c: int = 4
    tt_c: int = 1
    u_c: int = 4
    jc: int = 1
    cs: bool = True
    cs_s: bool = True
    sd_first: bool = False
    rt: bool = True
    ab: bool = False
    ab_regs: int = 0
    tc: int = 0
    tc_rt: int = 2
    tc_split: bool = False
    tc_hilo: bool = False
    tc_kw: int = 0
    tc_st: int = 0
    tc_ot: int = 1
    tc_fit: bool = False
    tiled: bool = False
    tc_fo: bool = False
    tc_regs: int = 0
    s_fo: bool = False
    xh: bool = False
    c_regs: int = 0
    cmb: int = 1
    kc: int = 0
    c_fence1: bool = False

    def hilo(self, epw: int = 4) -> bool:
        """The tensor cores' GEMM inputs are hi / lo (tc_hilo, on tensor cores: bf16 weights, epw = 4 a word)."""
        return bool(self.tc) and self.tc_hilo and epw == 4


# Kernel C takes one active expert per block (jc = 1) while its grid stays within about one wave of
# the H200 (132 SMs x 8 blocks of 4 warps): a block then makes one pass over its rows, not jc passes in
# sequence (model_code at M = 17: 16 row tiles x 8 experts = 128 blocks instead of 32 blocks of 4 passes).
_C_ONE_WAVE = 1024
# Kernel A's token tiles hold 2 tokens where the model is small (hidden size <= _SMALL_D) and 2 < M <=
# _TILES2_MAX_M: more logits blocks, each routing 2 tokens; re-reading the small shared expert and router gate
# per tile costs little there. H200, model_code's MoE layer, ``scripts/bench_moe.py --previous`` (session 11):
# M = 16 31.7 us (33.8 by M alone), M = 17 31.8 (35.8); at M = 65 it lost (73.5 against 65.5): 33 tiles.
_SMALL_D = 1024
_TILES2_MAX_M = 32


def v2_tiles(M: int, top_k: int, E: int | None = None, D: int | None = None, fo: bool = False) -> V2Tiles:
    """Default launch shapes for M tokens (predictions for the H200, see ``VERSION``).

    M = 1: one token per expert; 4 rows x 4 words in flight per warp (16 x 8 B per lane; at ~16-20
    warps per SM ~64-80 KB in flight, what HBM3e needs at ~1 us latency); kernel C one expert per
    block (Moonlight 128 row tiles x 6 experts = 768 blocks). M <= 8: ~1-2 tokens per expert, tiles
    of 2 (measured). M = 1 and M <= 8 put kernel B's shared-down blocks first (measured: -13 us at
    Moonlight M = 1). M <= 16: tiles of 4. Larger M: ~6 tokens per expert at Moonlight M=64, a tile
    of 8 tokens reads each routed weight row once per forward; 2 words in flight (the FMA work hides
    the latency) keep the tiles in registers (4 x 8 x 4 x 2 FMAs per unrolled step; 4 words spilled
    the accumulators to local memory). Given E and D, kernel C's jc drops to 1 where its grid then still
    fits ``_C_ONE_WAVE`` blocks, and kernel A's token tiles hold 2 tokens at 2 < M <= ``_TILES2_MAX_M``
    where D <= ``_SMALL_D`` (small models). At M <= ``AB_MAX_M`` kernels A and B run as one launch. Where
    :func:`uses_tc` the GEMMs run on tensor cores (``tc``: :func:`_tc_tiles` token tiles a pass), kernel C one expert
    a block, and kernel A's logits blocks take tiles of ``A_TT`` tokens."""
    t = replace(_v2_tiles_by_m(M, top_k), ab=M <= AB_MAX_M)
    if uses_tc(M, top_k, E, D, fo) and not IS_SIM:  # (the simulator's tests pass tensor-core tiles themselves)
        tiles = _tc_tiles(M)  # jc = 1: a block of kernel C is one expert's pass
        t = replace(t, tc=tiles, jc=1, tc_hilo=TC_HILO and (TC_FIT or tiles == 4), tc_split=TC_SPLIT, tc_fit=TC_FIT)
        t = replace(t, tiled=t.tc_hilo and 0 < TILED_MIN_M <= M, tc_fo=TC_FO != "0" and t.tc_hilo)
        t = replace(t, s_fo=SHARED_FO and t.tc_fo, c_regs=C_REGS if tiles == 2 else 0)
        if A_TT:
            t = a_token_tiles(t, A_TT)
    t = replace(t, cmb=C_CMB, kc=top_k if C_KC else 0)
    if E is not None and D is not None and not IS_SIM:
        if t.jc > 1 and cdiv(D, t.nw_c * t.nr_c) * min(E, M * top_k) <= _C_ONE_WAVE:
            t = replace(t, jc=1)
        if D <= _SMALL_D and t.tt_s > 2 and 2 < M <= _TILES2_MAX_M:
            t = replace(t, tt_s=2, cs_s=False)
    return t


def uses_tc(M: int, top_k: int, E: int | None = None, D: int | None = None, fo: bool = False) -> bool:
    """Version 2's expert GEMMs run on tensor cores at M tokens (bf16 weights; E, D None: by M alone; fo: the layer
    keeps its experts in fragment order, from TC_FO_MIN_M tokens). Small models (D <= ``_SMALL_D``, their own tile
    rules) keep the FMA tiles: tensor cores not timed there."""
    min_m, min_load = (min(TC_MIN_M, TC_FO_MIN_M), min(TC_MIN_LOAD, TC_FO_MIN_LOAD)) if fo else (TC_MIN_M, TC_MIN_LOAD)
    return (0 < TC_MIN_M and 0 < min_m <= M and (E is None or M * top_k >= min_load * E)
            and (D is None or D > _SMALL_D))


TC2_MAX_M = int(os.environ.get("KDT_MOE_TC2_M", "96"))  # 2 token tiles a tensor-core pass up to this M, then 4


def _tc_tiles(M: int) -> int:
    """Token tiles of 8 a pass of the tensor-core tiles at M tokens. Measured on Moonlight's layer: s27a (float32 x,
    1 / 2 / 4 tiles) M = 64 966 / **643** / 891 us, M = 256 3073 / 1939 / **1776**; s29a / s29b (the defaults' x: hi /
    lo with 4 tiles, float32 with 2): M = 65 622.3 / **558.6-567.1** (4 / 2 tiles), M = 128 **699.9** / 803.9, M = 192
    **882.3** / 1149.1. At ~6 tokens an expert a pass of 32 holds 4x the accumulators for nothing; at 12, 16-token
    passes read some experts twice. The boundary between 65 and 128 is not measured: 96 (9 an expert) is the guess
    (``TC2_MAX_M``, env KDT_MOE_TC2_M)."""
    return 2 if M <= TC2_MAX_M else 4


def _v2_tiles_by_m(M: int, top_k: int) -> V2Tiles:
    if IS_SIM:  # every simulated thread is a Python thread; small tiles exercise the tile loops
        return V2Tiles(nw=2, nr=4, u=2, tt=2, tt_s=2, u_l=2, nw_c=2, nr_c=2, tt_c=2, u_c=2, jc=2, cs_s=M <= 2)
    if M <= 1:
        return V2Tiles(nw=4, nr=4, u=4, tt=1, tt_s=1, u_l=4, nw_c=4, nr_c=4, tt_c=1, u_c=4, jc=1, sd_first=True)
    if M <= 8:  # measured at M = 8 (2-token tiles beat 4 there: 216 vs 251 us Moonlight, 1141 vs 1578 Kimi)
        return V2Tiles(nw=4, nr=4, u=4, tt=2, tt_s=4, u_l=4, nw_c=4, nr_c=4, tt_c=2, u_c=4, jc=1 if M <= 4 else 2,
                       cs_s=M <= 4, sd_first=True)
    if M <= 16:
        return V2Tiles(nw=4, nr=4, u=4, tt=4, tt_s=4, u_l=4, nw_c=4, nr_c=4, tt_c=4, u_c=4, jc=2, cs_s=False)
    return V2Tiles(nw=4, nr=4, u=2, tt=8, tt_s=8, u_l=2, nw_c=4, nr_c=4, tt_c=8, u_c=2, jc=4, cs_s=False)


@dataclass(frozen=True)
class V2Launch:
    """One of version 2's three launches: ``kernel[grid, threads, stream](*args)``. Its first
    ``head`` blocks are its first role (kernel A: the router logits and the routing tail; B: the
    routed experts' gate_up; C: all of it), so ``scripts/bench_moe.py --parts`` can time a role alone."""

    name: str
    kernel: object
    grid: int
    threads: int
    head: int
    args: tuple

    smem: int = 0  # bytes of dynamic shared memory

    def __call__(self, stream=0, grid: int | None = None) -> None:
        if self.smem:
            allow_dynamic_shared(self.kernel, self.args, self.smem)
        self.kernel[self.grid if grid is None else grid, self.threads, stream, self.smem](*self.args)


def _v2_kernels(t: V2Tiles, epw: int) -> tuple:
    """Kernels A, B and C of launch shape t for weight words of epw elements (with ``t.ab``, A and B
    are also compiled into kernel AB, :func:`_v2_ab_kernel`)."""
    tcn = t.tc if epw == 4 else 0
    split, hilo, kw, st = bool(tcn) and t.tc_split, t.hilo(epw), t.tc_kw if tcn else 0, t.tc_st if tcn else 0
    fit = bool(tcn) and t.tc_fit and not st  # (staged passes take all tc tiles)
    fo = bool(tcn) and t.tc_fo and hilo and not st
    xh, s_fo = hilo and t.xh, fo and t.s_fo
    return (_v2_route_kernel(t.nw, epw, epw, t.nr, t.tt_s, t.u, t.u_l, t.cs_s, t.rt, tcn, split, hilo, xh, xh and s_fo),
            _v2_gate_up_kernel(t.nw, epw, t.nr, t.tt, t.tt_s, t.u, t.cs, t.cs_s, t.sd_first, tcn, t.tc_rt, split, hilo,
                               kw, st, t.tc_ot if tcn else 1, fit, fo, t.tc_regs, s_fo),
            _v2_down_kernel(t.nw_c, epw, t.nr_c, t.tt_c, t.u_c, t.cs, tcn, t.tc_rt, hilo, kw, st, fit, fo,
                            t.c_regs if fo and not kw else 0, t.cmb, t.kc, t.c_fence1))


def _v2_plan(L, S, M: int, tiles: V2Tiles | None = None, b_hl: bool = False) -> V2Tiles:
    """The launch shape version 2 runs at M tokens: ``tiles`` (default :func:`v2_tiles`) less what the layer, the
    scratch or the caller cannot give it (b_hl: the caller gives b in the hi / lo layout too, ``V2Tiles.xh``)."""
    E, k, I, D = L.E, L.top_k, L.I, L.D
    t = tiles or v2_tiles(M, k, E, D, fo=L._gu_fo is not None and TC_FO != "0")
    if t.ab and S.sync is None:
        t = replace(t, ab=False)
    if t.tc and (L._epw != 4 or t.ab):  # tensor cores take bf16 weights (4 a word); not in kernel AB
        t = replace(t, tc=0)
    if t.tc_st and (not t.hilo(L._epw) or D % 8 or I % 8):  # staged loads copy 16-byte hi / lo words of x
        t = replace(t, tc_st=0)
    if t.tiled and (not t.hilo(L._epw) or D % tc_tiled.BK or t.ab):  # (its x tiles: hi / lo words of 32 elements)
        t = replace(t, tiled=False)
    if t.tc_fo and (L._gu_fo is None or not t.hilo(L._epw) or t.tc_st):  # (the layer kept no fragment-ordered copy)
        t = replace(t, tc_fo=False)
    if t.s_fo and (L._sgu_fo is None or not t.tc_fo):  # (no shared experts, or no copy of them)
        t = replace(t, s_fo=False)
    if t.kc and t.kc != k:  # (kernel C's combine compiled for another top_k)
        t = replace(t, kc=0)
    return replace(t, xh=bool(b_hl) and t.hilo(L._epw) and not t.ab)


def v2_launches(b, L, S, out, M: int, accumulate: bool, tiles: V2Tiles | None = None,
                tee=None, b_hl=None) -> list[V2Launch]:
    """Version 2's launches for M tokens, in order (see the "version 2" section): A, B, C, or AB, C
    (``V2Tiles.ab``, where the scratch has ``sync``). tee[>= M, D] f32: kernel C also writes the final out
    rows there (see :func:`moe_forward`). b_hl: b's hi / lo layout (uint64 [>= M, D / 2]), read where the plan's
    GEMM inputs are hi / lo (``V2Tiles.xh``), else not."""
    E, k, I, D = L.E, L.top_k, L.I, L.D
    t = _v2_plan(L, S, M, tiles, b_hl is not None)
    gu, dn = (L._gu_fo, L._dn_fo) if t.tc_fo else (L._gu, L._dn)
    ka, kb, kc = _v2_kernels(t, L._epw)
    if t.xh and (np.dtype(b_hl.dtype) != np.uint64 or b_hl.shape[0] < M or b_hl.shape[1] != D // 2):
        raise ValueError(f"v2_launches: b_hl must be uint64 [>= {M}, {D // 2}], got {b_hl.dtype} {tuple(b_hl.shape)}")
    J = min(E, M * k)
    has_shared = L._sgu is not None
    nlb = cdiv(E, _V2_NRL) * (cdiv(M, t.tt_s) if t.rt else 1)
    if has_shared:
        Is = L._sgu.shape[1] // 2
        passes = cdiv(M, 8 * t.tc) if t.tc and t.tc_split else 1  # shared GEMM blocks per output tile
        nsg = cdiv(Is, TC_ROWS) * passes if t.tc else cdiv(cdiv(Is, t.nr // 2), t.nw)
        sgu = L._sgu_fo if t.s_fo and t.xh else L._sgu  # (kernel A's fragment order wants b_hl's hi / lo)
        sdn = L._sdn_fo if t.s_fo else L._sdn
        nsd = cdiv(D, TC_ROWS * t.tc_rt) * passes if t.tc else cdiv(cdiv(D, t.nr), t.nw)
    else:
        nsg = nsd = 0
        sgu, sdn = L._gu, L._dn  # never read (no blocks use them), nor is hs below
    hilo = t.hilo()  # (t.tc is 0 unless the weights are bf16)
    hs = "h_shared" if has_shared else "b_perm"

    def x_out(name: str):  # a tensor-core GEMM input as its producer writes it (hi / lo: the uint16 view)
        return S.view(name, np.uint16) if hilo else getattr(S, name)

    def x_in(name: str):  # ... as the GEMM reads it (hi / lo: the uint64 view; b_perm: the caller's b_hl with xh)
        return b_hl if t.xh and name == "b_perm" else S.view(name, np.uint64) if hilo else getattr(S, name)

    a = V2Launch("A route+shared_gate_up", ka, nlb + nsg, t.nw * WARP, nlb, (
        b, L._gate, L.bias, S.logits, x_in("b_perm") if t.xh else x_out("b_perm"), sgu, x_out(hs), S.topk_idx,
        S.topk_w, S.counts, S.offsets, S.sorted_rows, S.sorted_slot, S.pos_of, S.active, S.n_active, S.counter,
        int(M), int(L.n_group), int(L.topk_group), int(k), bool(L.norm_topk_prob), float(L.routed_scaling_factor),
        int(nlb)))
    ntg = cdiv(I, gate_up_rows(t.nw, t.tc_kw, t.tc_ot)) if t.tc else cdiv(cdiv(I, t.nr // 2), t.nw)
    jb = 0 if t.tiled else J  # kernel B's routed slots (tiled: none, launch G below takes the routed gate_up)
    bb = V2Launch("B shared_down" if t.tiled else "B gate_up+shared_down", kb, jb * ntg + nsd, t.nw * WARP,
                  jb * ntg or nsd, (x_in("b_perm"), gu, x_out("h"), S.active, S.n_active, S.offsets, S.counts,
                                    S.sorted_rows, x_in(hs), sdn, S.y_shared, int(M), int(ntg), int(jb)))
    n_chunks = cdiv(J, t.jc)
    nc = cdiv(D, TC_ROWS * t.tc_rt * _row_groups(t.nw_c, t.tc_kw)[2] if t.tc else t.nw_c * t.nr_c) * n_chunks
    c = V2Launch("C down+combine", kc, nc, t.nw_c * WARP, nc, (
        x_in("h"), dn, S.y, S.active, S.n_active, S.offsets, S.counts, S.pos_of, S.topk_w, S.y_shared, out,
        out if tee is None else tee,  # (never written without a tee)
        S.tickets, int(M), int(t.jc), int(n_chunks), bool(accumulate), bool(has_shared), tee is not None))
    if t.tiled:  # the routed gate_up on the tiled GEMM, then B's shared down alone (if any)
        kg = tc_tiled.tiled_gate_up_kernel(*tc_tiled.gate_up_plan(M, k, E))
        ng = J * cdiv(I, kg.tile[0] // 2)
        g = V2Launch("G gate_up (tiled)", kg, ng, 32 * kg.plan[1] * kg.plan[2], ng, (
            x_in("b_perm"), L._gu, x_out("h"), S.active, S.n_active, S.offsets, S.counts, S.sorted_rows), kg.smem)
        return [a, g, bb, c] if nsd else [a, g, c]
    if t.ab:  # one grid: A's role blocks, then B's; no prefix of it runs alone (the last B block resets sync)
        ab = V2Launch("AB route+shared_gate_up+gate_up+shared_down", _v2_ab_kernel(t, L._epw), a.grid + bb.grid,
                      t.nw * WARP, a.grid + bb.grid, a.args + (L._gu, S.h, sdn, S.y_shared, int(ntg), int(J),
                                                                int(a.grid), S.sync))
        return [ab, c]
    return [a, bb, c]


def _moe_forward_v2(b, L, S, out, M: int, accumulate: bool, stream, tiles: V2Tiles | None, tee=None,
                    b_hl=None) -> None:
    for launch in v2_launches(b, L, S, out, M, accumulate, tiles, tee, b_hl):
        launch(stream)


# ---- the small-layer path: every expert for every token, two launches -------------------------------
# For a layer whose experts are small (kdt's demo and test models: model_code's 8 experts of 128 x 256 are
# 1.5 MB in bf16), version 2's time is its serial chain (logits -> ticket -> routing -> ticket -> grouping
# -> gate_up -> down -> ticket -> combine), not bytes. Here nothing waits on the routing but the combine:
# S1  one launch of three roles: route blocks (each warp one token: its E logits in one pass over D, P lanes
#     per expert, then the routing of version 2's router into topk_idx / topk_w), the gate_up of *every*
#     routed expert for every token (h_all[e*Mh + m] = silu(g_e . b_m) * (u_e . b_m); block = expert x row
#     tile x token tile), and the shared experts' gate_up (h_shared[m], natural layout);
# S2  one launch: block = row tile of D x token m; each warp sums its rows of the shared down and, with the
#     token's own routing weights, the down of its k chosen experts: out[m] (+)= shared + sum_slot w * y.
# E / k times the routed FLOPs of version 2 (no grouping), which costs nothing where every launch is latency.
# Taken by default for layers of at most SMALL_MAX_BYTES of routed experts at M <= SMALL_MAX_M (env
# KDT_MOE_SMALL=0: off); the scratch holds h_all only for such layers. Predicted for model_code's layer (bf16):
# ~10-15 us at M = 17, ~8-12 at M = 1. Measured (H200, scripts/bench_moe.py, one machine, session 14): version 2
# -> this path 32.5 -> 23.7 us at M = 17, 21.0 -> 17.1 at M = 1. S1 was most of it: 11.0 us a launch at M = 1,
# 17.3 at M = 17 (session 15's phase profile), against S2's 3.4 / 4.3. Its route warps read the gate's E rows
# one after another, each row a chain of D / 32 dependent loads (~64 round trips to L2 for model_code) and a
# warp sum; now all E logits come from one pass over D (P = 4 lanes per expert for E = 8, 8 loads in flight
# per lane: ~8 round trips). Predicted: S1 11.0 -> ~4-5 us at M = 1 and 17.3 -> ~6-8 at M = 17. Measured (the
# phase profile, s15a -> s15b): M = 17 17.3 -> 12.8 us, M = 8 (tiny's oracle chain) 16.2 -> 7.7, but M = 1
# 11.0 -> 10.7: at one token the route warp is not what S1 waits on (its tt = 1 variant: open).
SMALL_MAX_BYTES = 32 << 20  # routed expert bytes of a "small" layer, counted at 2 bytes a weight (E * 3 * I * D * 2)
SMALL_MAX_M = 32  # tokens per forward (the learned drafter's DDTree steps verify 16-17)
SMALL = os.environ.get("KDT_MOE_SMALL", "1") == "1"
_S_NW = 2 if IS_SIM else 4  # warps per block of both launches
_S_NR = 4  # weight rows per warp (S1: 2 gate + 2 up rows; S2: 4 rows of D)
_S_U = 2  # words per row per lane in flight
_S_CACHE: dict[tuple, object] = {}


def small_layer(cfg, wbytes: int = 2) -> bool:
    """The layer's routed experts fit the small-layer path (see the section comment)."""
    E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    return E * 3 * I * D * wbytes <= SMALL_MAX_BYTES and E <= E_MAX and cfg.num_experts_per_tok <= K_MAX \
        and cfg.n_group <= G_MAX


def small_tt(M: int) -> int:
    """Tokens per register tile of S1's gate_up blocks for M tokens (1, 2 or 4)."""
    return 1 if M <= 1 else 2 if M == 2 else 4


def _small_gate_up_kernel(epw: int, tt: int):
    """Kernel S1 (see the section comment). Grid: nrb route blocks (NW tokens each), then E * ntg * ntt
    routed blocks (expert, row tile of NW * NR/2 outputs, token tile of tt), then ntg_s * ntt shared
    blocks. h_all[E * Mh, I] and h_shared[>= M, Is] natural (row-major) float32."""
    key = ("S1", epw, tt)
    if key in _S_CACHE:
        return _S_CACHE[key]
    NW, NR, TT = _S_NW, _S_NR, tt
    NO = NR // 2
    NACC, WB = NR * TT, _S_U * NR
    RED = (NW, NR * TT, WARP) if IS_SIM else (1, 1, 1)
    RRED = (NW, WARP) if IS_SIM else (1, 1)
    NIDX = SMALL_MAX_M * K_MAX
    mm = _v2_mm(epw, NR, TT, _S_U, False, 1, False)
    red = _v2_reduce(NR, TT)
    pick = _v2_pick(NR, TT)

    def kern(b, gate, bias, logits, topk_idx, topk_w, wgu, h_all, sgu, h_shared, M, Mh, nrb, ntg, ntg_s, n_group,
             topk_group, top_k, norm, scale):
        grid_dependency_wait()
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        bid = cuda.blockIdx.x
        if bid < nrb:
            # ---- route: warp w takes token m (a warp past M repeats token M-1 and writes nothing) ----
            sh_c = cuda.shared.array((NW, E_MAX), float32)
            sh_s = cuda.shared.array((NW, E_MAX), float32)
            sh_g = cuda.shared.array((NW, G_MAX), float32)
            red_v = cuda.shared.array(RRED, float32)
            red_i = cuda.shared.array(RRED, int32)
            sh_idx = cuda.shared.array(NIDX, int32)
            m = bid * NW + warp
            valid = m < M
            mc = min(m, M - 1)
            E = gate.shape[0]
            D = gate.shape[1]
            # all E logits in one pass over D: P lanes per expert (a power of two, P * E <= 32), lane q of a
            # group sums d = q, q + P, .. with 8 independent products in flight, then the group's butterfly
            P = 1
            while 2 * P * E <= WARP:
                P *= 2
            q = lane % P
            for g in range(0, E, WARP // P):
                e = g + lane // P
                ec = min(e, E - 1)
                s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = float32(0.0)
                d = q
                while d + 7 * P < D:
                    s0 += gate[ec, d] * b[mc, d]
                    s1 += gate[ec, d + P] * b[mc, d + P]
                    s2 += gate[ec, d + 2 * P] * b[mc, d + 2 * P]
                    s3 += gate[ec, d + 3 * P] * b[mc, d + 3 * P]
                    s4 += gate[ec, d + 4 * P] * b[mc, d + 4 * P]
                    s5 += gate[ec, d + 5 * P] * b[mc, d + 5 * P]
                    s6 += gate[ec, d + 6 * P] * b[mc, d + 6 * P]
                    s7 += gate[ec, d + 7 * P] * b[mc, d + 7 * P]
                    d += 8 * P
                while d < D:
                    s0 += gate[ec, d] * b[mc, d]
                    d += P
                s = _group_sum(((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), P, red_v, warp, lane)
                if q == 0 and e < E:
                    logits[mc, e] = s
            _warp_sync()  # the routing below reads other lanes' logits (through L2)
            _v2_route_token(logits, bias, mc, valid, E, n_group, topk_group, top_k, norm, scale, sh_c, sh_s, sh_g,
                            red_v, red_i, warp, lane, topk_idx, topk_w, sh_idx)
            return
        redb = cuda.shared.array(RED, float32)
        acc = cuda.local.array(NACC, float32)
        xrow = cuda.local.array(TT, int32)
        wr = cuda.local.array(NR, int64)
        wb = cuda.local.array(WB, uint64)
        wv = cuda.local.array(NR, float32)
        sel = cuda.local.array(NR, float32)
        ntt = (M + TT - 1) // TT
        q = bid - nrb
        E = wgu.shape[0]
        routed = q < E * ntg * ntt
        if routed:  # (expert e, row tile x, token tile tk)
            e = q // (ntg * ntt)
            x = (q // ntt) % ntg
            W, I, h = wgu, wgu.shape[1] // 2, h_all
            hbase = e * Mh
        else:
            q -= E * ntg * ntt
            e = 0
            x = q // ntt
            W, I, h = sgu, sgu.shape[1] // 2, h_shared
            hbase = 0
        p0 = (q % ntt) * TT
        nt = min(TT, M - p0)
        for t in range(TT):
            xrow[t] = p0 + min(t, nt - 1)
        obase = (x * NW + warp) * NO
        for r in range(NO):
            wr[r] = min(obase + r, I - 1)
            wr[NO + r] = wr[r] + I
        mm(W, e, wr, b, xrow, 0, lane, acc, wb, wv)
        red(acc, nt, redb, warp, lane)
        if lane < nt:
            pick(acc, sel, lane)
            for r in range(NO):
                o = obase + r
                if o < I:
                    g = sel[r]
                    h[hbase + p0 + lane, o] = g / (float32(1.0) + math.exp(-g)) * sel[NO + r]

    kern.__name__ = f"moe_small_gate_up_e{epw}_tt{tt}"
    k = cuda.jit(kern)
    _S_CACHE[key] = k
    return k


def _small_down_kernel(epw: int):
    """Kernel S2 (see the section comment). Block b = m * n_x + x: token m, rows [x*R, x*R + R) of D (R =
    NW * NR). out[m, d] (+)= shared_down[d] . h_shared[m] + sum_slot topk_w[m, slot] *
    down[topk_idx[m, slot], d] . h_all[topk_idx[m, slot] * Mh + m]; with has_tee the same value into tee."""
    key = ("S2", epw)
    if key in _S_CACHE:
        return _S_CACHE[key]
    NW, NR = _S_NW, _S_NR
    WB = _S_U * NR
    RED = (NW, NR, WARP) if IS_SIM else (1, 1, 1)
    mm = _v2_mm(epw, NR, 1, _S_U, False, 1, False)
    red = _v2_reduce(NR, 1)

    def kern(wdn, h_all, sdn, h_shared, topk_idx, topk_w, out, tee, Mh, n_x, accumulate, has_shared, has_tee):
        grid_dependency_wait()
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        redb = cuda.shared.array(RED, float32)
        acc = cuda.local.array(NR, float32)
        tot = cuda.local.array(NR, float32)
        xrow = cuda.local.array(1, int32)
        wr = cuda.local.array(NR, int64)
        wb = cuda.local.array(WB, uint64)
        wv = cuda.local.array(NR, float32)
        D = wdn.shape[1]
        m = cuda.blockIdx.x // n_x
        d0 = ((cuda.blockIdx.x % n_x) * NW + warp) * NR
        for r in range(NR):
            wr[r] = min(d0 + r, D - 1)
            tot[r] = float32(0.0)
        for s in range(topk_idx.shape[1]):
            e = topk_idx[m, s]
            xrow[0] = e * Mh + m
            mm(wdn, e, wr, h_all, xrow, 0, lane, acc, wb, wv)
            red(acc, 1, redb, warp, lane)
            w = topk_w[m, s]
            for r in range(NR):
                tot[r] += w * acc[r]
        if has_shared:
            xrow[0] = m
            mm(sdn, 0, wr, h_shared, xrow, 0, lane, acc, wb, wv)
            red(acc, 1, redb, warp, lane)
        if lane < NR and d0 + lane < D:
            for r in range(NR):
                if r == lane:
                    d = d0 + r
                    v = out[m, d] if accumulate else float32(0.0)
                    if has_shared:
                        v = v + acc[r]
                    v = v + tot[r]
                    out[m, d] = v
                    if has_tee:
                        tee[m, d] = v

    kern.__name__ = f"moe_small_down_e{epw}"
    k = cuda.jit(kern)
    _S_CACHE[key] = k
    return k


def _small_supported(L: MoEWeights, S: MoEScratch, M: int) -> bool:
    """The small-layer path runs this layer at M tokens."""
    return S.h_all is not None and M <= S.h_all.shape[0] // L.E and _fits_fused_kernels(L)


def _moe_forward_small(b, L, S, out, M: int, accumulate: bool, stream, tee=None) -> None:
    E, k, I, D = L.E, L.top_k, L.I, L.D
    Mh = S.h_all.shape[0] // E
    tt = small_tt(M)
    nrb = cdiv(M, _S_NW)
    ntg = cdiv(I, _S_NW * (_S_NR // 2))
    ntt = cdiv(M, tt)
    has_shared = L._sgu is not None
    if has_shared:
        ntg_s = cdiv(L._sgu.shape[1] // 2, _S_NW * (_S_NR // 2))
        sgu, sdn, hs = L._sgu, L._sdn, S.h_shared
    else:
        ntg_s, sgu, sdn, hs = 0, L._gu, L._dn, S.h_all  # never read
    s1 = _small_gate_up_kernel(L._epw, tt)
    s1[nrb + (E * ntg + ntg_s) * ntt, _S_NW * WARP, stream](
        b, L.gate_w, L.bias, S.logits, S.topk_idx, S.topk_w, L._gu, S.h_all, sgu, hs, int(M), int(Mh), int(nrb),
        int(ntg), int(ntg_s), int(L.n_group), int(L.topk_group), int(k), bool(L.norm_topk_prob),
        float(L.routed_scaling_factor))
    n_x = cdiv(D, _S_NW * _S_NR)
    _small_down_kernel(L._epw)[M * n_x, _S_NW * WARP, stream](
        L._dn, S.h_all, sdn, hs, S.topk_idx, S.topk_w, out, out if tee is None else tee, int(Mh), int(n_x),
        bool(accumulate), has_shared, tee is not None)


# ---- host-side packing, weights and scratch -------------------------------------------------------
def _to_weight_dtype(a: np.ndarray, dtype) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt == np.float32:
        return np.ascontiguousarray(a, dtype=np.float32)
    if dt == np.uint16:
        a = np.asarray(a)
        return a if a.dtype == np.uint16 else f32_to_bf16_bits(np.asarray(a, dtype=np.float32))
    raise TypeError(f"unsupported weight dtype {dt}: float32 or bf16 (uint16)")


def pack_experts(experts, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Stack experts [(gate_proj[I, D], up_proj[I, D], down_proj[D, I]), ...] (host arrays) into
    w_gate_up[E, 2I, D] (rows [0, I) gate, [I, 2I) up) and w_down[E, D, I], as float32 or bf16 bits
    (``dtype=np.uint16``; float inputs are rounded to nearest even, uint16 inputs taken as bf16)."""
    experts = list(experts)
    E = len(experts)
    I, D = np.shape(experts[0][0])
    dt = np.dtype(dtype)
    gu = np.empty((E, 2 * I, D), dtype=dt)
    dn = np.empty((E, D, I), dtype=dt)
    for e, (g, u, d) in enumerate(experts):
        gu[e, :I] = _to_weight_dtype(g, dt)
        gu[e, I:] = _to_weight_dtype(u, dt)
        dn[e] = _to_weight_dtype(d, dt)
    return gu, dn


@dataclass
class MoEWeights:
    """Device weights of one MoE layer plus its routing config.

    gate_w[E, D] f32, bias[E] f32 (e_score_correction_bias), w_gate_up[E, 2I, D] / w_down[E, D, I]
    f32 or bf16 (uint16), shared_gate_up[1, 2Is, D] / shared_down[1, D, Is] (None without shared
    experts; Is = I * n_shared_experts)."""

    gate_w: object
    bias: object
    w_gate_up: object
    w_down: object
    shared_gate_up: object | None
    shared_down: object | None
    n_group: int
    topk_group: int
    top_k: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    def __post_init__(self):
        self._gu, self._epw = _words(self.w_gate_up)
        self._dn, _ = _words(self.w_down)
        self._sgu = _words(_as3(self.shared_gate_up))[0] if self.shared_gate_up is not None else None
        self._sdn = _words(_as3(self.shared_down))[0] if self.shared_down is not None else None
        self._gate = _words(_as3(self.gate_w))[0]
        self._gu_fo = self._dn_fo = self._sgu_fo = self._sdn_fo = None
        shared = 0 if self._sgu is None else self._sgu.nbytes + self._sdn.nbytes
        if TC_FO == "1" or (TC_FO == "auto" and self.D > _SMALL_D and not IS_SIM and fo_fits(
                self._gu.nbytes + self._dn.nbytes + shared, *cuda.current_context().get_memory_info())):
            self.fragment_order()

    def fragment_order(self, stream=0) -> bool:
        """Keep a fragment-ordered copy of the routed experts (kdt.kernels.tc, ``V2Tiles.tc_fo``) where they are bf16
        and their shapes allow it (I and D multiples of 16), and of the shared experts beside it where theirs do
        (``V2Tiles.s_fo``); True if the layer has the routed one."""
        if self._gu_fo is None and self._epw == 4 and self.I % TC_ROWS == 0 and self.D % TC_ROWS == 0:
            self._gu_fo, self._dn_fo = tc.to_fo(self._gu, stream), tc.to_fo(self._dn, stream)
            if self._sgu is not None and (self._sgu.shape[1] // 2) % TC_ROWS == 0:
                self._sgu_fo, self._sdn_fo = tc.to_fo(self._sgu, stream), tc.to_fo(self._sdn, stream)
        return self._gu_fo is not None

    @property
    def E(self) -> int:
        return self.w_gate_up.shape[0]

    @property
    def D(self) -> int:
        return self.w_gate_up.shape[2]

    @property
    def I(self) -> int:  # noqa: E743
        return self.w_gate_up.shape[1] // 2

    @classmethod
    def from_hf(cls, cfg, weights: dict, prefix: str, dtype=np.float32, stream=0) -> MoEWeights:
        """Upload the layer with HF names under ``prefix`` (e.g. ``"model.layers.3.mlp."``): router
        gate.weight / gate.e_score_correction_bias (kept fp32), experts.{e}.{gate,up,down}_proj.weight,
        shared_experts.* ; expert weights as ``dtype`` (np.float32 or np.uint16 = bf16)."""
        E = cfg.n_routed_experts

        def mlp(p):
            return tuple(weights[f"{p}{n}_proj.weight"] for n in ("gate", "up", "down"))

        gu, dn = pack_experts([mlp(f"{prefix}experts.{e}.") for e in range(E)], dtype)
        sgu = sdn = None
        if cfg.n_shared_experts:
            sgu, sdn = pack_experts([mlp(prefix + "shared_experts.")], dtype)
        up = lambda a: cuda.to_device(a, stream=stream) if a is not None else None  # noqa: E731
        return cls(
            gate_w=up(np.ascontiguousarray(weights[prefix + "gate.weight"], dtype=np.float32)),
            bias=up(np.ascontiguousarray(weights[prefix + "gate.e_score_correction_bias"], dtype=np.float32)),
            w_gate_up=up(gu), w_down=up(dn), shared_gate_up=up(sgu), shared_down=up(sdn),
            n_group=cfg.n_group, topk_group=cfg.topk_group, top_k=cfg.num_experts_per_tok,
            norm_topk_prob=bool(cfg.norm_topk_prob), routed_scaling_factor=float(cfg.routed_scaling_factor))


@dataclass
class MoEScratch:
    """Preallocated device buffers of :func:`moe_forward` for up to M_max tokens (P_max = M_max * k)."""

    M_max: int
    logits: object  # [M_max, E] f32
    topk_idx: object  # [M_max, k] int32
    topk_w: object  # [M_max, k] f32
    counts: object  # [E] int32
    offsets: object  # [E+1] int32
    sorted_rows: object  # [P_max] int32
    sorted_slot: object  # [P_max] int32
    pos_of: object  # [M_max, k] int32
    active: object  # [E] int32
    n_active: object  # [1] int32
    h: object  # [P_max, I] f32
    y: object  # [P_max, D] f32
    h_shared: object | None  # [M_max, I * n_shared] f32
    b_perm: object = None  # [M_max, D] f32 (version 2: b word-permuted)
    y_shared: object = None  # [M_max, D] f32 (version 2: the shared experts' output)
    counter: object = None  # [1 + M_max] int32, zero between launches (version 2: kernel A's tickets)
    tickets: object = None  # [D] int32, zero between launches (version 2: tickets per row tile of D)
    sync: object = None  # [SYNC_WORDS] int32, zero between launches (version 2: kernel AB's tickets and flags)
    h_all: object = None  # [E * Mh, I] f32, Mh = min(M_max, SMALL_MAX_M): small layers only (the small path)
    _views: dict = field(default_factory=dict, repr=False, compare=False)

    def view(self, name: str, dtype) -> object:
        """The float32 buffer ``name`` reinterpreted as ``dtype`` (made once): the tensor cores' hi / lo layout of
        b_perm, h, h_shared (kdt.kernels.tc.XL_HILO) is written through its uint16 view and read through its uint64
        one, in the same bytes."""
        key = (name, np.dtype(dtype).str)
        if key not in self._views:
            self._views[key] = getattr(self, name).view(dtype)
        return self._views[key]

    @classmethod
    def allocate(cls, cfg, M_max: int, stream=0) -> MoEScratch:
        E, k, D, I = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
        P = M_max * k

        def f32(*s):
            return cuda.device_array(s, dtype=np.float32, stream=stream)

        def i32(*s):
            return cuda.device_array(s, dtype=np.int32, stream=stream)

        return cls(M_max=int(M_max), logits=f32(M_max, E), topk_idx=i32(M_max, k), topk_w=f32(M_max, k),
                   counts=i32(E), offsets=i32(E + 1), sorted_rows=i32(P), sorted_slot=i32(P),
                   pos_of=i32(M_max, k), active=i32(E), n_active=i32(1), h=f32(P, I), y=f32(P, D),
                   h_shared=f32(M_max, I * cfg.n_shared_experts) if cfg.n_shared_experts else None,
                   b_perm=f32(M_max, D), y_shared=f32(M_max, D),
                   counter=cuda.to_device(np.zeros(1 + M_max, dtype=np.int32), stream=stream),
                   tickets=cuda.to_device(np.zeros(D, dtype=np.int32), stream=stream),
                   sync=cuda.to_device(np.zeros(SYNC_WORDS, dtype=np.int32), stream=stream),
                   h_all=f32(E * min(M_max, SMALL_MAX_M), I) if small_layer(cfg) else None)


def _fits_fused_kernels(L: MoEWeights) -> bool:
    """What version 2 and the small path both need of a layer: shared experts in the routed experts' weight
    dtype (one kernel reads both) and a router within the compile-time maxima."""
    same_dtype = L._sgu is None or np.dtype(L.shared_gate_up.dtype) == np.dtype(L.w_gate_up.dtype)
    return same_dtype and L.E <= E_MAX and L.top_k <= K_MAX and L.n_group <= G_MAX


def _path(L: MoEWeights, S: MoEScratch, M: int, version: int | None = None) -> int:
    """The version :func:`moe_forward` runs at M tokens: 3 (the small-layer path), 2 or 1."""
    use_small = version == 3 if version is not None else SMALL
    if use_small and _small_supported(L, S, M):
        return 3
    use_v2 = version in (2, 3) if version is not None else (VERSION == 2 and M <= V2_MAX_M)
    return 2 if use_v2 and _v2_supported(L, S, M) else 1


def reads_b_hilo(M: int, L: MoEWeights, S: MoEScratch) -> bool:
    """:func:`moe_forward`'s default at M tokens reads ``b_hl`` if given (``B_HILO``; version 2 with its GEMM inputs
    in the hi / lo layout): the engine's norm then writes it."""
    return B_HILO and _path(L, S, M) == 2 and _v2_plan(L, S, M, None, True).xh


def _v2_supported(L: MoEWeights, S: MoEScratch, M: int) -> bool:
    """Version 2 runs this layer at M tokens (else version 1 does)."""
    return (M * L.top_k <= V2_MAX_PAIRS and S.counter is not None and S.tickets is not None
            and _fits_fused_kernels(L))


def token_chunks(M: int, top_k: int) -> list[tuple[int, int]]:
    """(first token, tokens) of the fewest near-equal chunks of M tokens whose pairs each fit ``V2_MAX_PAIRS``.
    Each token's MoE is its own, so a forward of more tokens (a long prefill: 2048 tokens at Moonlight's k = 6)
    runs version 2 once per chunk instead of version 1 once (the engine's loop,
    :meth:`kdt.engine.cuda_model.DecoderStack._layers`)."""
    n = max(1, cdiv(M, max(1, V2_MAX_PAIRS // max(1, top_k))))
    sizes = [M // n + (c < M % n) for c in range(n)]
    return [(sum(sizes[:c]), m) for c, m in enumerate(sizes)]


def moe_forward(b, layer: MoEWeights, scratch: MoEScratch, out, M: int | None = None,
                accumulate: bool = True, stream=0, version: int | None = None,
                tiles: V2Tiles | None = None, tee=None, b_hl=None) -> None:
    """out[M, D] (+)= moe(b[M, D]) (SPEC section 1) entirely on the GPU, no host synchronisation.

    ``version`` (default: the small-layer path where it applies (``SMALL``, env ``KDT_MOE_SMALL``), else
    module ``VERSION``, env ``KDT_MOE_VERSION``):

    - 1: router_logits -> moe_router -> moe_group -> expert_gate_up -> expert_down -> (shared experts:
      dense gate_up, dense down into out) -> moe_combine (8 launches).
    - 2: three launches (route + shared gate_up | routed gate_up + shared down | routed down + combine,
      see the "version 2" section); M * k > ``V2_MAX_PAIRS`` falls back to version 1. ``tiles``
      overrides :func:`v2_tiles` (benchmarks).
    - 3: the small-layer path (two launches, every expert for every token, see its section), for layers
      whose scratch holds ``h_all`` (:func:`small_layer`) at M <= ``SMALL_MAX_M``; else version 2.

    Grids depend only on M and the config, so the sequence can be captured in a CUDA graph per M.
    b[>= M, D] f32, out[>= M, D] f32. tee[>= M, D] f32: also receives the final out rows (the engine's
    feature copy, in kernel C's launch); version 1 (and the v2 fallback) writes it with a copy launch
    after the layer. b_hl: b[:M] also in the tensor cores' hi / lo layout (uint64 [>= M, D / 2],
    ``kdt.kernels.elementwise.rmsnorm(..., y_hl=)``), read where version 2's GEMMs take hi / lo x
    (:func:`reads_b_hilo` says where; elsewhere unread).
    """
    M = b.shape[0] if M is None else int(M)
    if M > scratch.M_max:
        raise ValueError(f"moe_forward: M={M} > scratch.M_max={scratch.M_max}")
    if M <= 0:
        return
    if tee is not None and (len(tee.shape) != 2 or tee.shape[0] < M or tee.shape[1] != out.shape[1]):
        raise ValueError(f"moe_forward: tee {tuple(tee.shape)} for M={M}, D={out.shape[1]}")
    L, S = layer, scratch
    if L.n_group > 1 and (L.E % L.n_group or L.E // L.n_group < 2 or not 1 <= L.topk_group <= L.n_group):
        raise ValueError(f"moe_forward: E={L.E}, n_group={L.n_group}, topk_group={L.topk_group}")
    path = _path(L, S, M, version)
    if path == 3:
        _moe_forward_small(b, L, S, out, M, accumulate, stream, tee)
        return
    if path == 2:
        _moe_forward_v2(b, L, S, out, M, accumulate, stream, tiles, tee, b_hl)
        return
    E, k, I, D = L.E, L.top_k, L.I, L.D
    P = M * k
    _launch_mm(b, L._gate, 2, S.logits, E, M, gated=False, grouped=False, gather=False, ks=4,
               experts=S.active, n_active=S.n_active, offsets=S.offsets, rows=S.sorted_rows, stream=stream)
    moe_router(S.logits, L.bias, L.n_group, L.topk_group, k, L.norm_topk_prob, L.routed_scaling_factor,
               S.topk_idx, S.topk_w, M=M, stream=stream)
    moe_group(S.topk_idx, E, S.counts, S.offsets, S.sorted_rows, S.sorted_slot, S.pos_of, S.active,
              S.n_active, M=M, stream=stream)
    _launch_mm(b, L._gu, L._epw, S.h, I, P, gated=True, grouped=True, gather=True, experts=S.active,
               n_active=S.n_active, offsets=S.offsets, rows=S.sorted_rows, n_experts=E, stream=stream)
    _launch_mm(S.h, L._dn, L._epw, S.y, D, P, gated=False, grouped=True, gather=False, experts=S.active,
               n_active=S.n_active, offsets=S.offsets, rows=S.sorted_rows, n_experts=E, stream=stream)
    if L._sgu is not None:
        Is = L._sgu.shape[1] // 2
        idx = dict(experts=S.active, n_active=S.n_active, offsets=S.offsets, rows=S.sorted_rows)
        _launch_mm(b, L._sgu, L._epw, S.h_shared, Is, M, gated=True, grouped=False, gather=False,
                   stream=stream, **idx)
        _launch_mm(S.h_shared, L._sdn, L._epw, out, D, M, gated=False, grouped=False, gather=False,
                   accumulate=accumulate, stream=stream, **idx)
        accumulate = True
    moe_combine(S.y, S.pos_of, S.topk_w, out, accumulate=accumulate, M=M, stream=stream)
    if tee is not None:
        ew.copy(out[:M], tee[:M], stream=stream)


# ---- sm_90 compile check --------------------------------------------------------------------------
def _register() -> None:
    for epw in (2, 4):
        for gated, grouped, gather, ks in ((True, True, True, 1), (False, True, False, 1),
                                           (True, False, False, 1), (False, False, False, 1)):
            register_ptx(_mm_kernel(epw, gated, grouped, gather, ks, *_TILE[epw]), _MM_SIG)
    register_ptx(_mm_kernel(2, False, False, False, 4, *_TILE[2]), _MM_SIG)
    register_ptx(_moe_router_kernel, (float32[:, ::1], float32[::1], int64, int64, int64, int64, boolean,
                                      float32, int32[:, ::1], float32[:, ::1]))
    register_ptx(_moe_group_kernel, (int32[:, ::1], int64, int64, int32[::1], int32[::1], int32[::1],
                                     int32[::1], int32[:, ::1], int32[::1], int32[::1]))
    register_ptx(_moe_combine_kernel, (float32[:, ::1], int32[:, ::1], float32[:, ::1], float32[:, ::1],
                                       boolean))
    if IS_SIM:  # the GPU launch shapes below are not simulator shapes (see v2_tiles)
        return
    f2, i1, i2, u3 = float32[:, ::1], int32[::1], int32[:, ::1], uint64[:, :, ::1]
    sig_a = (f2, u3, float32[::1], f2, f2, u3, f2, i2, f2, i1, i1, i1, i1, i2, i1, i1, i1, int64, int64, int64,
             int64, boolean, float64, int64)
    sig_b = (f2, u3, f2, i1, i1, i1, i1, i1, f2, u3, f2, int64, int64, int64)
    sig_c = (f2, u3, f2, i1, i1, i1, i1, i2, f2, f2, f2, f2, i1, int64, int64, int64, boolean, boolean, boolean)
    f3 = float32[::1]
    for epw in (2, 4):
        for tt in (1, 2, 4):
            register_ptx(_small_gate_up_kernel(epw, tt), (f2, f2, f3, f2, i2, f2, u3, f2, u3, f2, int64, int64, int64,
                                                          int64, int64, int64, int64, int64, boolean, float64))
        register_ptx(_small_down_kernel(epw), (u3, f2, u3, f2, i2, f2, f2, f2, int64, int64, boolean, boolean, boolean))
    seen: set[int] = set()
    shapes = ([v2_tiles(M, 8) for M in (1, 4, 8, 16, 64, 256)] + [replace(v2_tiles(64, 8), rt=False)]  # + one router
              + [replace(_v2_tiles_by_m(M, 8), ab=M <= AB_MAX_M) for M in (64, 256)]  # FMA tiles (KDT_MOE_TC_M=0)
              + [replace(v2_tiles(64, 8), tc_split=False)]  # the shared GEMMs over all M tokens a block
              + [a_token_tiles(v2_tiles(64, 8), 8)]  # kernel A's token tiles by M (KDT_MOE_A_TT=0)
              + [replace(v2_tiles(M, 8), tc_hilo=False) for M in (64, 256)]  # x float32
              + [replace(v2_tiles(M, 8), tc_kw=kw) for M in (64, 256) for kw in (1, 2)]  # row groups (tc_kw)
              + [replace(v2_tiles(64, 8), tc_hilo=True, tc_st=st) for st in (2, 4)]  # staged loads (tc_st)
              + [replace(v2_tiles(64, 8), tc_ot=2), replace(v2_tiles(64, 8), tc_ot=2, tc_hilo=True, tc_st=3)]  # tc_ot
              + [replace(v2_tiles(M, 8), tc_fit=False) for M in (64, 256)]  # every pass on all tiles (session 34's)
              + [replace(v2_tiles(M, 8), tc_fo=False) for M in (16, 64, 256)]  # the natural order (no copy, tc_fo)
              + [v2_tiles(8, 8, fo=True)]  # the experts in fragment order from TC_FO_MIN_M tokens
              + [replace(_v2_tiles_by_m(1, 8), tc=2, jc=1, tc_hilo=True, tc_split=True, tc_fit=True, tc_fo=True)]
              # ... below it (s43a: KDT_MOE_TC_M=1 KDT_MOE_TC_LOAD=0)
              + [v2_tiles(M, 2, 8, 256) for M in (17, 65)]  # model_code (the small-model rules)
              + [replace(v2_tiles(M, 8), xh=True, s_fo=True) for M in (16, 64, 256)]  # b_hl from the norm (B_HILO)
              + [replace(v2_tiles(64, 8), xh=True, s_fo=False), replace(v2_tiles(64, 8), s_fo=True)]  # ... alone
              + [replace(v2_tiles(64, 8), c_regs=0, cmb=1, kc=0), replace(v2_tiles(64, 8), c_regs=0, cmb=4, kc=0),
                 replace(v2_tiles(64, 8), c_regs=96, cmb=4)]  # kernel C as before session 53, its combine's forms
              + [replace(v2_tiles(64, 8), nw_c=8, tc_kw=4), replace(v2_tiles(64, 8), c_fence1=True)])  # ... in
    # blocks of 8 warps (2 row groups), its ticket fenced by thread 0 alone
    sig_ab = sig_a + (u3, f2, u3, f2, int64, int64, int64, i1)
    h16, h64 = uint16[:, ::1], uint64[:, ::1]  # the hi / lo layout's views (tc_hilo)

    def put(sig, at):  # sig with its arguments at ``at`` (position: type) replaced
        return tuple(at.get(i, ty) for i, ty in enumerate(sig))

    sigs_hilo = (put(sig_a, {4: h16, 6: h16}), put(sig_b, {0: h64, 2: h16, 8: h64}), put(sig_c, {0: h64}))
    sigs_xh = (put(sig_a, {4: h64, 6: h16}),) + sigs_hilo[1:]  # (kernel A reads b_hl, uint64)
    for epw in (2, 4):
        for t in shapes:
            sigs = (sigs_xh if t.xh else sigs_hilo) if t.hilo(epw) else (sig_a, sig_b, sig_c)
            kernels = list(zip(_v2_kernels(t, epw), sigs, strict=True))
            for kern, sig in kernels + ([(_v2_ab_kernel(t, epw), sig_ab)] if t.ab else []):
                if id(kern) not in seen:  # the factories cache: one object per launch shape
                    seen.add(id(kern))
                    register_ptx(kern, sig)

_register()
