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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import boolean, cuda, float32, int32, int64, uint64

from kdt.kernels.common import IS_SIM, WARP, cdiv, f32_to_bf16_bits, register_ptx

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

else:
    from numba.cuda import libdevice

    @_device
    def _f32_from_bits(u):
        """Low 32 bits of an integer -> float32 with that bit pattern."""
        return libdevice.int_as_float(int32(u))

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


def dense_mlp(x, w_gate_up, w_down, h, out, M: int | None = None, accumulate: bool = True, stream=0) -> None:
    """out[M, D] (+)= down(silu(gate(x)) * up(x)) for x[M, D]: the shared experts (one MLP of width
    Is = moe_intermediate_size * n_shared_experts) through the same kernels in dense mode.

    w_gate_up[(1,) 2Is, D], w_down[(1,) D, Is] f32 or bf16 (uint16), as from :func:`pack_experts`;
    h[>= M, Is] f32 scratch.
    """
    M = x.shape[0] if M is None else int(M)
    Wgu, epw = _words(_as3(w_gate_up))
    Wd, epw2 = _words(_as3(w_down))
    Is, D = Wgu.shape[1] // 2, Wd.shape[1]
    _launch_mm(x, Wgu, epw, h, Is, M, gated=True, grouped=False, gather=False, stream=stream)
    _launch_mm(h, Wd, epw2, out, D, M, gated=False, grouped=False, gather=False, accumulate=accumulate,
               stream=stream)


# ---- routing --------------------------------------------------------------------------------------
_R_RED = (_R_WARPS, WARP) if IS_SIM else (1, 1)
_NEG_INF = float32(-np.inf)
_EPS_NORM = float32(1e-20)


@cuda.jit
def _moe_router_kernel(logits, bias, M, n_group, topk_group, top_k, norm, scale, topk_idx, topk_w):
    """One warp per token m < M: logits[M, E] f32, bias[E] f32 -> topk_idx[M, k] int32, topk_w[M, k] f32.

    s = sigmoid(logits), c = s + bias; with n_group > 1 the groups outside the best topk_group by
    (sum of their top-2 c) get c = -inf (ties: lower group); then top_k rounds of warp argmax over c
    (ties: lower expert) -- the order of a stable descending argsort. Weights are s of the chosen
    experts, / (sum + 1e-20) if norm, * scale.
    """
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
    off = 1
    while off < nth:  # Hillis-Steele inclusive scans of counts and of (count > 0)
        tv = 0
        ta = 0
        if tid >= off and tid < E_MAX:
            tv = sc[tid - off]
            ta = sa[tid - off]
        cuda.syncthreads()
        if tid < E_MAX:
            sc[tid] += tv
            sa[tid] += ta
        cuda.syncthreads()
        off *= 2
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
                   h_shared=f32(M_max, I * cfg.n_shared_experts) if cfg.n_shared_experts else None)


def moe_forward(b, layer: MoEWeights, scratch: MoEScratch, out, M: int | None = None,
                accumulate: bool = True, stream=0) -> None:
    """out[M, D] (+)= moe(b[M, D]) (SPEC section 1) entirely on the GPU, no host synchronisation.

    Launch sequence: router_logits -> moe_router -> moe_group -> expert_gate_up -> expert_down ->
    (shared experts: dense gate_up, dense down into out) -> moe_combine. Grids depend only on M and
    the config, so the sequence can be captured in a CUDA graph per M. b[>= M, D] f32, out[>= M, D] f32.
    """
    M = b.shape[0] if M is None else int(M)
    if M > scratch.M_max:
        raise ValueError(f"moe_forward: M={M} > scratch.M_max={scratch.M_max}")
    if M <= 0:
        return
    L, S = layer, scratch
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


_register()
