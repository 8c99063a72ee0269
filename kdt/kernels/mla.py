"""Multi-head Latent Attention kernels, absorb form (SPEC section 1).

For M query tokens of one layer against that layer's latent cache ``c_kv_cache[max_len, Rkv]``,
``k_pe_cache[max_len, dr]`` (float32; 2-D views ``cache[layer]`` of stacked arrays are fine):

1. :func:`kv_latent_write`  c[M, Rkv+dr] -> c_kv_cache[L+m] = rmsnorm(c[m, :Rkv]),
                            k_pe_cache[L+m] = rope(c[m, Rkv:]).
2. :func:`q_absorb`         q[M, H*(dn+dr)] -> q_abs[M, H, Rkv] = q_nope @ W_uk[h], q_pe[M, H, dr] = rope.
3. :func:`mla_attention`    (q_abs, q_pe) x cache slots [0, L+M) -> o_lat[M, H, Rkv]; fp32 online softmax,
                            flash-decoding splits + :func:`mla_combine` for long prefixes.
4. :func:`uv_project`       o_lat[M, H, Rkv] -> o[M, H*dv] = W_uv[h] @ o_lat[m, h].

``kv_b`` is ``kv_b_proj.weight[H*(dn+dv), Rkv]`` (float32, or bf16 stored as uint16);
``W_uk[h] = kv_b[h*(dn+dv) : h*(dn+dv)+dn]``, ``W_uv[h] = kv_b[h*(dn+dv)+dn : (h+1)*(dn+dv)]``.

RoPE reads host-precomputed tables ``cos_tab, sin_tab[max_pos, dr/2]`` (float32, attention factor
folded in; :func:`rope_tables`) at ``positions[m]`` (int64 device array) and follows
:func:`kdt.reference.ops.apply_rope`: ``interleave`` pairs (2i, 2i+1) and writes [rot evens | rot odds],
otherwise NeoX halves (i, i+dr/2).

All wrappers take device arrays and preallocated outputs plus ``stream=0``, launch, and return None
(no host sync). Lane-group reductions use warp shuffles on the GPU and a shared-memory emulation of
``shfl_xor`` under the simulator (``IS_SIM``), with the same code path otherwise.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, int64, uint8, uint16

from kdt.kernels.common import IS_SIM, cdiv, device_scalar, register_ptx, weight_loader

NEG_INF = float32(-np.inf)
MAX_SPLITS = 128  # flash-decoding splits per (token, head) at most (shared weights of the combine)
MIN_KEYS_PER_SPLIT = 256  # the wrapper never splits the prefix finer than this by itself


# ---- small device helpers -------------------------------------------------------------------------
if IS_SIM:

    @cuda.jit(device=True)
    def _shfl_xor(buf, tid, v, mask):
        """Value of ``v`` held by thread ``tid ^ mask`` (simulator: through shared ``buf[NT]``; every
        thread of the block must call it, as with the real shuffle in a full warp)."""
        buf[tid] = v
        cuda.syncthreads()
        r = buf[tid ^ mask]
        cuda.syncthreads()
        return r

    @cuda.jit(device=True)
    def _group_sync():
        cuda.syncthreads()

else:

    @cuda.jit(device=True, inline=True)
    def _shfl_xor(buf, tid, v, mask):
        """Value of ``v`` held by lane ``lane ^ mask`` (warp shuffle; ``buf``/``tid`` unused)."""
        return cuda.shfl_xor_sync(0xFFFFFFFF, v, mask)

    @cuda.jit(device=True, inline=True)
    def _group_sync():
        cuda.syncwarp()


@cuda.jit(device=True, inline=True)
def _tree_reduce(red, tid, n, take_max):
    """Sum (or max, with ``take_max``) of red[0:n] over the block, n a power of two; every thread of
    the block calls it after writing red[tid] and gets the result (left in red[0])."""
    cuda.syncthreads()
    st = n // 2
    while st > 0:
        if tid < st:
            red[tid] = max(red[tid], red[tid + st]) if take_max else red[tid] + red[tid + st]
        cuda.syncthreads()
        st //= 2
    return red[0]


@cuda.jit(device=True, inline=True)
def _rope_elem(src, row, off, j, half, interleave, cos_tab, sin_tab, pos):
    """Element j of rope(src[row, off:off+2*half]) at position ``pos`` (ops.apply_rope semantics).

    j < half: x1*c - x2*s; j >= half: x2*c + x1*s with (x1, x2) the pair i = j mod half:
    (x[2i], x[2i+1]) when ``interleave`` else (x[i], x[i+half]).
    """
    i = j if j < half else j - half
    if interleave != 0:
        x1 = src[row, off + 2 * i]
        x2 = src[row, off + 2 * i + 1]
    else:
        x1 = src[row, off + i]
        x2 = src[row, off + i + half]
    c = cos_tab[pos, i]
    s = sin_tab[pos, i]
    if j < half:
        return x1 * c - x2 * s
    return x2 * c + x1 * s


def rope_tables(cfg, max_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """Host RoPE tables cos, sin [max_pos, dr/2] float32 (YaRN attention factor folded in), from
    :func:`kdt.reference.ops.rope_cos_sin` computed in float64 and rounded once."""
    from kdt.reference import ops

    cos, sin = ops.rope_cos_sin(cfg, np.arange(int(max_pos), dtype=np.int64), np.float64)
    return np.ascontiguousarray(cos, dtype=np.float32), np.ascontiguousarray(sin, dtype=np.float32)


# ---- 1. latent write -------------------------------------------------------------------------------
_KV_NT = 8 if IS_SIM else 128  # threads per block (power of two: tree reduction)


@functools.cache
def _kv_latent_write_kernel(norm_dtype: str, NT: int = _KV_NT):
    load = weight_loader(np.dtype(norm_dtype))

    @cuda.jit
    def kv_latent_write_kernel(c, kv_a_layernorm, eps, positions, cos_tab, sin_tab, L_dev, c_kv_cache,
                               k_pe_cache, interleave):
        """c[M, Rkv+dr] f32, kv_a_layernorm[Rkv] (f32|bf16), positions[M] i64, cos/sin_tab[P, dr/2],
        L_dev[1] i64 -> c_kv_cache[L+m, :Rkv] = rmsnorm(c[m, :Rkv]), k_pe_cache[L+m, :dr] = rope(c[m, Rkv:]).
        Grid (M,), block (NT,)."""
        m = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        Rkv = c_kv_cache.shape[1]
        dr = k_pe_cache.shape[1]
        red = cuda.shared.array(NT, float32)
        ss = float32(0)
        for r in range(tid, Rkv, NT):
            x = c[m, r]
            ss += x * x
        red[tid] = ss
        rstd = float32(1) / math.sqrt(_tree_reduce(red, tid, NT, False) / float32(Rkv) + eps)
        slot = L_dev[0] + m
        for r in range(tid, Rkv, NT):
            c_kv_cache[slot, r] = c[m, r] * rstd * load(kv_a_layernorm[r])
        pos = positions[m]
        half = dr // 2
        for j in range(tid, dr, NT):
            k_pe_cache[slot, j] = _rope_elem(c, m, Rkv, j, half, interleave, cos_tab, sin_tab, pos)

    return kv_latent_write_kernel


def kv_latent_write(c, kv_a_layernorm, eps, positions, cos_tab, sin_tab, L, c_kv_cache, k_pe_cache,
                    interleave: bool = True, stream=0) -> None:
    """Write the M new latents into cache slots [L, L+M).

    c[M, Rkv+dr] f32 (kv_a_proj_with_mqa output); kv_a_layernorm[Rkv] f32 or bf16 (uint16);
    positions[M] int64; cos_tab, sin_tab[max_pos, dr/2] f32; c_kv_cache[max_len, Rkv] f32,
    k_pe_cache[max_len, dr] f32 (written at rows L..L+M-1 only). ``L``: an int, or an int64 device
    array of one element (read by the kernel: what a CUDA graph needs).
    """
    M = c.shape[0]
    if M == 0:
        return
    k = _kv_latent_write_kernel(np.dtype(kv_a_layernorm.dtype).name)
    k[M, _KV_NT, stream](c, kv_a_layernorm, np.float32(eps), positions, cos_tab, sin_tab, device_scalar(L),
                         c_kv_cache, k_pe_cache, np.int32(1 if interleave else 0))


# ---- 2. q absorb -----------------------------------------------------------------------------------
_QA_NT = 8 if IS_SIM else 128  # threads per block = latent columns per block (one column each)


def _q_absorb_tm(M: int) -> int:
    return 1 if M <= 2 else 8


@functools.cache
def _q_absorb_kernel(wdtype: str, dn: int, TM: int, NT: int = _QA_NT):
    load = weight_loader(np.dtype(wdtype))

    @cuda.jit
    def q_absorb_kernel(q, kv_b, positions, cos_tab, sin_tab, interleave, q_abs, q_pe):
        """q[M, H*(dn+dr)] f32, kv_b[H*(dn+dv), Rkv] f32|bf16 -> q_abs[M, H, Rkv] = q_nope @ W_uk[h],
        q_pe[M, H, dr] = rope(q[.., dn:]). Grid (cdiv(Rkv, NT), H, cdiv(M, TM)), block (NT,): thread
        owns latent column r for TM tokens; kv_b row reads coalesced along r."""
        cb = cuda.blockIdx.x
        h = cuda.blockIdx.y
        m0 = cuda.blockIdx.z * TM
        tid = cuda.threadIdx.x
        M = q.shape[0]
        H = q_abs.shape[1]
        Rkv = q_abs.shape[2]
        dr = q_pe.shape[2]
        dh = dn + dr  # q head stride
        dnv = kv_b.shape[0] // H  # dn + dv: kv_b head stride
        sq = cuda.shared.array((TM, dn), float32)
        for idx in range(tid, TM * dn, NT):
            i = idx // dn
            d = idx - i * dn
            m = m0 + i
            v = float32(0)
            if m < M:
                v = q[m, h * dh + d]
            sq[i, d] = v
        if cb == 0:
            half = dr // 2
            for idx in range(tid, TM * dr, NT):
                i = idx // dr
                j = idx - i * dr
                m = m0 + i
                if m < M:
                    q_pe[m, h, j] = _rope_elem(q, m, h * dh + dn, j, half, interleave, cos_tab, sin_tab,
                                               positions[m])
        cuda.syncthreads()
        r = cb * NT + tid
        if r < Rkv:
            acc = cuda.local.array(TM, float32)
            for i in range(TM):
                acc[i] = float32(0)
            row0 = h * dnv
            for d in range(dn):
                w = load(kv_b[row0 + d, r])
                for i in range(TM):
                    acc[i] += sq[i, d] * w
            for i in range(TM):
                m = m0 + i
                if m < M:
                    q_abs[m, h, r] = acc[i]

    return q_absorb_kernel


def q_absorb(q, kv_b, positions, cos_tab, sin_tab, interleave: bool, q_abs, q_pe, stream=0) -> None:
    """q_abs[m,h,r] = sum_{d<dn} q[m, h*(dn+dr)+d] * kv_b[h*(dn+dv)+d, r];  q_pe[m,h] = rope(q[m,h,dn:]).

    q[M, H*(dn+dr)] f32; kv_b[H*(dn+dv), Rkv] f32 or bf16 (uint16); positions[M] int64;
    cos_tab, sin_tab[max_pos, dr/2] f32; outputs q_abs[M, H, Rkv] f32, q_pe[M, H, dr] f32.
    The softmax scale is not applied here (mla_attention takes it).
    """
    M, H, Rkv = q_abs.shape
    dr = q_pe.shape[2]
    if M == 0:
        return
    dn = q.shape[1] // H - dr
    TM = _q_absorb_tm(M)
    k = _q_absorb_kernel(np.dtype(kv_b.dtype).name, dn, TM)
    grid = (cdiv(Rkv, _QA_NT), H, cdiv(M, TM))
    k[grid, _QA_NT, stream](q, kv_b, positions, cos_tab, sin_tab, np.int32(1 if interleave else 0), q_abs,
                            q_pe)


# ---- 3. attention over the latent cache ------------------------------------------------------------
def _attn_params(H: int, Rkv: int, dr: int) -> tuple[int, int, int, int]:
    """(G lanes per head group, A heads per lane group, NW lane groups per block, BT keys per tile)."""
    if IS_SIM:
        G = 4 if Rkv % 4 == 0 else 1
        return G, 1, 2, 4
    G = 32
    if Rkv % G:
        raise ValueError(f"mla_attention needs kv_lora_rank % 32 == 0 (got {Rkv})")
    A = 4 if H >= 32 else 2
    NW = max(1, min(8, cdiv(H, A)))
    while NW > 1 and Rkv % (NW * G):  # tile columns are tid + NT*c
        NW -= 1
    BT = 8 if A == 4 else 16  # the register prefetch of a tile costs BT*Rkv/(32*NW) registers
    return G, A, NW, BT


@functools.cache
def _attention_kernel(Rkv: int, dr: int, G: int, A: int, NW: int, BT: int):
    if Rkv % G:
        raise ValueError(f"Rkv={Rkv} must be a multiple of the lane group {G}")
    F = Rkv + dr
    QE = cdiv(F, G)  # features (latent | rope) per lane
    FP = QE * G  # padded tile row
    RE = Rkv // G  # latent outputs per lane
    NT = NW * G
    HB = NW * A  # heads per block
    PEP = FP - Rkv  # rope + pad columns of a tile row
    if Rkv % NT:
        raise ValueError(f"Rkv={Rkv} must be a multiple of the block size {NT}")
    CPR = Rkv // NT  # c_kv elements per thread per tile row: columns tid + NT*c (constant offsets)
    NLC = BT * CPR  # c_kv elements per thread per tile (prefetched in registers)
    NLP = cdiv(BT * PEP, NT)  # k_pe (+ pad) elements per thread per tile
    NPAIR = cdiv(A * BT, G)
    XB = NT if IS_SIM else 1
    LOGG = int(round(math.log2(G)))
    if 1 << LOGG != G:
        raise ValueError(f"lane group {G} must be a power of two")

    @cuda.jit(device=True, inline="always")
    def load_tile(pc, pp, c_kv, k_pe, t0, t_hi, tid):
        """This thread's share of the key tile [t0, t0+BT) into registers: c_kv columns tid + NT*c
        (pc[NLC]) and k_pe (+ pad) elements (pp[NLP]); rows past t_hi clamp to t_hi-1 (masked later)."""
        for i in range(NLC):
            pc[i] = c_kv[min(t0 + i // CPR, t_hi - 1), tid + NT * (i % CPR)]
        for i in range(NLP):
            idx = tid + NT * i
            tt = idx // PEP
            f = idx - tt * PEP
            v = float32(0)
            if tt < BT and f < dr:
                v = k_pe[min(t0 + tt, t_hi - 1), f]
            pp[i] = v

    @cuda.jit
    def mla_attention_kernel(q_abs, q_pe, c_kv, k_pe, L_dev, vis, scale, o_lat, part):
        """q_abs[M, H, Rkv], q_pe[M, H, dr] f32; c_kv[max_len, Rkv], k_pe[max_len, dr] f32;
        L_dev[1] i64 (L); vis[M, M] u8; keys t in [0, L+M): t < L visible, t = L+j visible iff vis[m, j].
        Grid (cdiv(H, HB), M, n_splits), block (NW*G,). Block = token m, heads HB, keys
        [s*kps, (s+1)*kps), kps = cdiv(L+M, n_splits) rounded up to whole tiles (splits past L+M are
        empty: running max -inf, sum 0, weight 0 in the combine). Lane group w (G lanes) owns heads
        w*A..w*A+A-1: lane j holds q features j + G*k in registers (scale folded in) and accumulators
        o[r = j + G*k]; a tile of BT keys of (c_kv | k_pe) is staged in shared memory once and serves
        all HB heads (scores: per-lane partial dots + xor all-reduce; then online softmax, then
        p @ c_kv). The next tile's global loads are issued into registers before the current tile is
        computed (software prefetch).
        n_splits == 1: writes o_lat[m, h] = acc / l. Else part[((m*H+h)*n_splits+s)*(Rkv+2) + ...] =
        (acc[Rkv], running max, running sum) for mla_combine."""
        hg = cuda.blockIdx.x
        m = cuda.blockIdx.y
        sp = cuda.blockIdx.z
        n_splits = cuda.gridDim.z
        tid = cuda.threadIdx.x
        w = tid // G
        j = tid - w * G
        M = q_abs.shape[0]
        H = q_abs.shape[1]
        L = L_dev[0]
        T = L + M
        kps = (T + n_splits - 1) // n_splits
        kps = (kps + BT - 1) // BT * BT

        sK = cuda.shared.array((BT, FP), float32)  # key tile: [c_kv | k_pe | 0 pad]
        sS = cuda.shared.array((NW, A, BT), float32)  # scores, then probabilities
        sMx = cuda.shared.array((NW, A), float32)  # running max after the tile
        xbuf = cuda.shared.array(XB, float32)

        q = cuda.local.array((A, QE), float32)
        acc = cuda.local.array((A, RE), float32)
        m_run = cuda.local.array(A, float32)
        l_run = cuda.local.array(A, float32)
        part_s = cuda.local.array(A, float32)
        mt = cuda.local.array(A, float32)
        pa = cuda.local.array(A, float32)

        h_base = hg * HB + w * A
        for a in range(A):
            hc = min(h_base + a, H - 1)  # heads past H compute a copy of the last head, never stored
            for k in range(QE):
                f = j + G * k
                v = float32(0)
                if f < Rkv:
                    v = q_abs[m, hc, f]
                elif f < F:
                    v = q_pe[m, hc, f - Rkv]
                q[a, k] = v * scale
            for k in range(RE):
                acc[a, k] = float32(0)
            m_run[a] = NEG_INF
            l_run[a] = float32(0)

        t_lo = sp * kps
        t_hi = min(t_lo + kps, T)
        # Tiles are prefetched into registers one tile ahead (loads in flight during the compute of the
        # previous tile). Rows past t_hi are clamped to row t_hi-1 (finite) and masked out below.
        pc = cuda.local.array(NLC, float32)
        pp = cuda.local.array(NLP, float32)
        if t_lo < t_hi:
            load_tile(pc, pp, c_kv, k_pe, t_lo, t_hi, tid)
        for t0 in range(t_lo, t_hi, BT):
            # ---- registers -> shared tile [c_kv | k_pe | 0 pad]; then prefetch the next tile ----
            cuda.syncthreads()
            for i in range(NLC):
                sK[i // CPR, tid + NT * (i % CPR)] = pc[i]
            for i in range(NLP):
                idx = tid + NT * i
                tt = idx // PEP
                if tt < BT:
                    sK[tt, Rkv + idx - tt * PEP] = pp[i]
            cuda.syncthreads()
            t1 = t0 + BT
            if t1 < t_hi:
                load_tile(pc, pp, c_kv, k_pe, t1, t_hi, tid)
            # ---- scores s[a, tt] (all lanes of the group get the full dot) ----
            for a in range(A):
                mt[a] = NEG_INF
            for tt in range(BT):
                for a in range(A):
                    part_s[a] = float32(0)
                for k in range(QE):
                    kv = sK[tt, j + G * k]
                    for a in range(A):
                        part_s[a] += q[a, k] * kv
                t = t0 + tt
                visible = t < L or (t < t_hi and vis[m, t - L] != 0)
                for a in range(A):
                    s = part_s[a]
                    for st in range(LOGG):
                        s += _shfl_xor(xbuf, tid, s, G >> (st + 1))
                    if not visible:
                        s = NEG_INF
                    mt[a] = max(mt[a], s)
                    if j == 0:
                        sS[w, a, tt] = s
            # ---- online softmax: new running max, rescale accumulators ----
            for a in range(A):
                m_new = max(m_run[a], mt[a])
                if m_new != NEG_INF:
                    alpha = math.exp(m_run[a] - m_new)  # exp(-inf) = 0 on the first visible tile
                    l_run[a] *= alpha
                    for k in range(RE):
                        acc[a, k] *= alpha
                m_run[a] = m_new
                if j == 0:
                    sMx[w, a] = m_new
            _group_sync()
            for i in range(NPAIR):
                idx = j + G * i
                if idx < A * BT:
                    a = idx // BT
                    tt = idx - a * BT
                    s = sS[w, a, tt]
                    p = float32(0)
                    if s != NEG_INF:
                        p = math.exp(s - sMx[w, a])
                    sS[w, a, tt] = p
            _group_sync()
            # ---- acc[a, r] += p[a, t] * c_kv[t, r] ----
            for tt in range(BT):
                for a in range(A):
                    pa[a] = sS[w, a, tt]
                    l_run[a] += pa[a]
                for k in range(RE):
                    v = sK[tt, j + G * k]
                    for a in range(A):
                        acc[a, k] += pa[a] * v

        for a in range(A):
            h = h_base + a
            if h < H:
                if n_splits == 1:
                    inv = float32(1) / l_run[a]
                    for k in range(RE):
                        o_lat[m, h, j + G * k] = acc[a, k] * inv
                else:
                    base = ((m * H + h) * n_splits + sp) * (Rkv + 2)
                    for k in range(RE):
                        part[base + j + G * k] = acc[a, k]
                    if j == 0:
                        part[base + Rkv] = m_run[a]
                        part[base + Rkv + 1] = l_run[a]

    mla_attention_kernel.heads_per_block = HB
    mla_attention_kernel.threads = NT
    return mla_attention_kernel


_CB_NT = 8 if IS_SIM else 128


@cuda.jit
def mla_combine_kernel(part, S, o_lat):
    """Flash-decoding combine. part[M*H*S*(Rkv+2)] f32 (per (m, h, split): acc[Rkv], max, sum)
    -> o_lat[m, h, r] = sum_s e^(max_s - max) acc_s[r] / sum_s e^(max_s - max) sum_s.
    Grid (H, M), block (_CB_NT,)."""
    h = cuda.blockIdx.x
    m = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    H = o_lat.shape[1]
    Rkv = o_lat.shape[2]
    RS = Rkv + 2
    base0 = (m * H + h) * S * RS
    wts = cuda.shared.array(MAX_SPLITS, float32)
    red = cuda.shared.array(_CB_NT, float32)
    mx = NEG_INF
    for s in range(tid, S, _CB_NT):
        mx = max(mx, part[base0 + s * RS + Rkv])
    red[tid] = mx
    mx = _tree_reduce(red, tid, _CB_NT, True)
    cuda.syncthreads()
    ls = float32(0)
    for s in range(tid, S, _CB_NT):
        ms = part[base0 + s * RS + Rkv]
        wv = float32(0)
        if ms != NEG_INF:
            wv = math.exp(ms - mx)
        wts[s] = wv
        ls += wv * part[base0 + s * RS + Rkv + 1]
    red[tid] = ls
    inv = float32(1) / _tree_reduce(red, tid, _CB_NT, False)
    S4 = S - S % 4
    for r in range(tid, Rkv, _CB_NT):
        a0 = float32(0)
        a1 = float32(0)
        a2 = float32(0)
        a3 = float32(0)
        for s in range(0, S4, 4):  # four independent loads in flight
            b = base0 + s * RS + r
            a0 += wts[s] * part[b]
            a1 += wts[s + 1] * part[b + RS]
            a2 += wts[s + 2] * part[b + 2 * RS]
            a3 += wts[s + 3] * part[b + 3 * RS]
        for s in range(S4, S):
            a0 += wts[s] * part[base0 + s * RS + r]
        o_lat[m, h, r] = ((a0 + a1) + (a2 + a3)) * inv


@functools.lru_cache(maxsize=1)
def _num_sms() -> int:
    if IS_SIM:
        return 132
    try:
        return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    except Exception:  # noqa: BLE001 - no context yet / no device: the H200 count
        return 132


def mla_num_splits(L: int, M: int, H: int, Rkv: int = 512, dr: int = 64) -> int:
    """Splits of the key range [0, L+M) the wrapper uses by default: enough blocks for about two
    waves on the device, at least MIN_KEYS_PER_SPLIT keys per split, at most MAX_SPLITS."""
    _, A, NW, _ = _attn_params(H, Rkv, dr)
    base = cdiv(H, NW * A) * M
    T = L + M
    want = cdiv(2 * _num_sms(), max(base, 1))
    return int(max(1, min(want, cdiv(T, MIN_KEYS_PER_SPLIT), MAX_SPLITS)))


def mla_scratch_size(M: int, H: int, Rkv: int, n_splits: int) -> int:
    """float32 elements of the split scratch (0 when n_splits == 1)."""
    return 0 if n_splits <= 1 else M * H * n_splits * (Rkv + 2)


def mla_attention(q_abs, q_pe, c_kv_cache, k_pe_cache, L, vis, scale, o_lat, scratch=None,
                  n_splits: int | None = None, stream=0) -> None:
    """o_lat[m,h] = sum_t softmax_t(s[m,h,t]) c_kv[t] over cache slots t in [0, L+M).

    s[m,h,t] = (q_abs[m,h] . c_kv[t] + q_pe[m,h] . k_pe[t]) * scale; slots t < L are visible, slot
    L+j is visible to row m iff vis[m, j] != 0 (every row must see at least one slot, e.g. itself).
    q_abs[M, H, Rkv], q_pe[M, H, dr] f32; c_kv_cache[max_len, Rkv], k_pe_cache[max_len, dr] f32 (the new
    latents already written at [L, L+M)); vis[M, M] uint8; o_lat[M, H, Rkv] f32 out.

    ``n_splits`` (default :func:`mla_num_splits`) splits the key range over blocks (flash-decoding);
    then ``scratch`` (float32 device array of >= :func:`mla_scratch_size` elements) receives the
    partials and :func:`mla_combine` reduces them. Without ``scratch`` one is allocated (not
    graph-capture safe: pass one for CUDA graphs).

    ``L``: an int, or an int64 device array of one element read by the kernel (CUDA graphs: the
    launch then never depends on L; ``n_splits`` must be given, e.g. ``mla_num_splits(max_len, ...)``,
    and splits past L+M simply stay empty).
    """
    M, H, Rkv = q_abs.shape
    dr = q_pe.shape[2]
    if M == 0:
        return
    G, A, NW, BT = _attn_params(H, Rkv, dr)
    if isinstance(L, (int, np.integer)):
        T = int(L) + M
        S = mla_num_splits(int(L), M, H, Rkv, dr) if n_splits is None else int(n_splits)
        S = max(1, min(S, MAX_SPLITS, T))
        S = cdiv(T, cdiv(cdiv(T, S), BT) * BT)  # no split left empty
    elif n_splits is None:
        raise ValueError("mla_attention with L on the device needs n_splits")
    else:
        S = max(1, min(int(n_splits), MAX_SPLITS))
    if S > 1:
        need = mla_scratch_size(M, H, Rkv, S)
        if scratch is None:
            scratch = cuda.device_array(need, dtype=np.float32, stream=stream)
        elif scratch.size < need:
            raise ValueError(f"mla_attention scratch holds {scratch.size} floats, {need} needed "
                             f"(M={M}, H={H}, Rkv={Rkv}, n_splits={S})")
        part = scratch
    else:
        part = _dummy_part()
    k = _attention_kernel(Rkv, dr, G, A, NW, BT)
    grid = (cdiv(H, NW * A), M, S)
    k[grid, NW * G, stream](q_abs, q_pe, c_kv_cache, k_pe_cache, device_scalar(L), vis, np.float32(scale),
                            o_lat, part)
    if S > 1:
        mla_combine(part, S, o_lat, stream=stream)


@functools.lru_cache(maxsize=1)
def _dummy_part():
    return cuda.device_array(1, dtype=np.float32)


def mla_combine(part, n_splits: int, o_lat, stream=0) -> None:
    """Reduce the split partials part[M*H*n_splits*(Rkv+2)] (written by mla_attention) into
    o_lat[M, H, Rkv]."""
    M, H, _ = o_lat.shape
    if not 1 <= n_splits <= MAX_SPLITS:
        raise ValueError(f"n_splits={n_splits} outside [1, {MAX_SPLITS}]")
    mla_combine_kernel[(H, M), _CB_NT, stream](part, np.int64(n_splits), o_lat)


# ---- 4. W_uv projection ----------------------------------------------------------------------------
def _uv_params(Rkv: int) -> tuple[int, int, int]:
    """(G lanes per row group, NW row groups per block, RPW rows per group)."""
    if IS_SIM:
        return (4 if Rkv % 4 == 0 else 1), 2, 2
    if Rkv % 32:
        raise ValueError(f"uv_project needs kv_lora_rank % 32 == 0 (got {Rkv})")
    return 32, 4, 8


def _uv_tm(M: int) -> int:
    return 1 if M <= 2 else 4


@functools.cache
def _uv_project_kernel(wdtype: str, Rkv: int, G: int, NW: int, RPW: int, TM: int):
    load = weight_loader(np.dtype(wdtype))
    RE = Rkv // G
    NT = NW * G
    RB = NW * RPW  # output rows (v) per block
    XB = NT if IS_SIM else 1
    LOGG = int(round(math.log2(G)))
    if Rkv % G or (1 << LOGG) != G:
        raise ValueError(f"bad uv_project lane group G={G} for Rkv={Rkv}")

    @cuda.jit
    def uv_project_kernel(o_lat, kv_b, o):
        """o_lat[M, H, Rkv] f32, kv_b[H*(dn+dv), Rkv] f32|bf16 -> o[M, H*dv] f32,
        o[m, h*dv+v] = sum_r kv_b[h*(dn+dv)+dn+v, r] o_lat[m, h, r].
        Grid (cdiv(dv, RB), H, cdiv(M, TM)), block (NW*G,): lane j holds o_lat[m0+i, h, j+G*k] in
        registers; a lane group reads weight rows coalesced along r and all-reduces TM dots."""
        vb = cuda.blockIdx.x
        h = cuda.blockIdx.y
        m0 = cuda.blockIdx.z * TM
        tid = cuda.threadIdx.x
        w = tid // G
        j = tid - w * G
        M = o_lat.shape[0]
        H = o_lat.shape[1]
        dv = o.shape[1] // H
        dnv = kv_b.shape[0] // H
        dn = dnv - dv
        xbuf = cuda.shared.array(XB, float32)
        x = cuda.local.array((TM, RE), float32)
        acc = cuda.local.array(TM, float32)
        for i in range(TM):
            mi = min(m0 + i, M - 1)
            for k in range(RE):
                x[i, k] = o_lat[mi, h, j + G * k]
        for rr in range(RPW):
            v = vb * RB + rr * NW + w
            vc = min(v, dv - 1)
            row = h * dnv + dn + vc
            for i in range(TM):
                acc[i] = float32(0)
            for k in range(RE):
                wv = load(kv_b[row, j + G * k])
                for i in range(TM):
                    acc[i] += wv * x[i, k]
            for i in range(TM):
                s = acc[i]
                for st in range(LOGG):
                    s += _shfl_xor(xbuf, tid, s, G >> (st + 1))
                if j == 0 and v < dv and m0 + i < M:
                    o[m0 + i, h * dv + v] = s

    uv_project_kernel.rows_per_block = RB
    uv_project_kernel.threads = NT
    return uv_project_kernel


def uv_project(o_lat, kv_b, o, stream=0) -> None:
    """o[m, h*dv+v] = sum_r kv_b[h*(dn+dv)+dn+v, r] * o_lat[m, h, r]   (W_uv[h] @ o_lat[m, h]).

    o_lat[M, H, Rkv] f32; kv_b[H*(dn+dv), Rkv] f32 or bf16 (uint16); o[M, H*dv] f32 out.
    """
    M, H, Rkv = o_lat.shape
    if M == 0:
        return
    dv = o.shape[1] // H
    G, NW, RPW = _uv_params(Rkv)
    TM = _uv_tm(M)
    k = _uv_project_kernel(np.dtype(kv_b.dtype).name, Rkv, G, NW, RPW, TM)
    grid = (cdiv(dv, NW * RPW), H, cdiv(M, TM))
    k[grid, NW * G, stream](o_lat, kv_b, o)


# ---- 5. sm_90 compile check signatures (DeepSeek-V3 / Kimi K2 / Moonlight dims) ----------------------
def _register() -> None:
    f32_1, f32_2, f32_3 = float32[::1], float32[:, ::1], float32[:, :, ::1]
    u16_1, u16_2 = uint16[::1], uint16[:, ::1]
    i64_1, u8_2 = int64[::1], uint8[:, ::1]
    dn, dr, Rkv = 128, 64, 512
    for wdt, w1 in (("float32", f32_1), ("uint16", u16_1)):
        register_ptx(_kv_latent_write_kernel(wdt, 128),
                     (f32_2, w1, float32, i64_1, f32_2, f32_2, i64_1, f32_2, f32_2, int32),
                     name=f"kv_latent_write_kernel[{wdt}]")
    for wdt, w2 in (("float32", f32_2), ("uint16", u16_2)):
        for TM in (1, 8):
            register_ptx(_q_absorb_kernel(wdt, dn, TM, 128),
                         (f32_2, w2, i64_1, f32_2, f32_2, int32, f32_3, f32_3),
                         name=f"q_absorb_kernel[{wdt},TM={TM}]")
        for TM in (1, 4):
            register_ptx(_uv_project_kernel(wdt, Rkv, 32, 4, 8, TM), (f32_3, w2, f32_2),
                         name=f"uv_project_kernel[{wdt},TM={TM}]")
    for H in (64, 16):  # H >= 32 (Kimi K2, DeepSeek-V3: A = 4), H = 16 (Moonlight: A = 2)
        G, A, NW, BT = _attn_params(H, Rkv, dr) if not IS_SIM else (32, 4 if H >= 32 else 2, 8, 8)
        register_ptx(_attention_kernel(Rkv, dr, G, A, NW, BT),
                     (f32_3, f32_3, f32_2, f32_2, i64_1, u8_2, float32, f32_3, f32_1),
                     name=f"mla_attention_kernel[A={A},NW={NW}]")
    register_ptx(mla_combine_kernel, (f32_1, int64, f32_3))


_register()
