"""Multi-head Latent Attention kernels, absorb form (SPEC section 1).

For M query tokens of one layer against that layer's latent cache ``c_kv_cache[max_len, Rkv]``,
``k_pe_cache[max_len, dr]`` (float32; 2-D views ``cache[layer]`` of stacked arrays are fine):

1. :func:`kv_latent_write`  c[M, Rkv+dr] -> c_kv_cache[L+m] = rmsnorm(c[m, :Rkv]),
                            k_pe_cache[L+m] = rope(c[m, Rkv:]) (and, given the pre-split cache
                            kv_hl[max_len, Rkv+dr] uint32, kv_hl[L+m] = their bf16 hi / lo words: :func:`kv_hl_np`).
2. :func:`q_absorb`         q[M, H*(dn+dr)] -> q_abs[M, H, Rkv] = q_nope @ W_uk[h], q_pe[M, H, dr] = rope.
   (:func:`latent_write_and_absorb`: 1 and 2, in one launch with ``FUSE_KV``.)
3. :func:`mla_attention`    (q_abs, q_pe) x cache slots [0, L+M) -> o_lat[M, H, Rkv]; fp32 online softmax,
                            flash-decoding splits + :func:`mla_combine` for long prefixes (version 2 from
                            kdt.kernels.attn_tc.TC_MIN_M tokens: on tensor cores, kdt.kernels.attn_tc).
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

Versions (llm.c style, side by side): q_absorb, mla_attention (+ its combine and
:func:`mla_num_splits`) and uv_project take ``version=1|2``; the default is :data:`VERSION`
(env ``KDT_MLA_VERSION``, default 2). v1 is sections 2-4; v2 is section 6 (why v1 is slow at small
M, the v2 design and its predicted times are there). Both compute the same sums up to fp32
reassociation.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
from numba import boolean, cuda, float32, int32, int64, uint8, uint16, uint32, uint64

from kdt.kernels import tc
from kdt.kernels.common import (
    IS_SIM,
    SYNC_COPIES,
    SYNC_LINE,
    Src,
    cdiv,
    device_scalar,
    grid_dependency_wait,
    jit_source,
    ldcg1,
    register_ptx,
    sync_poll,
    sync_raise,
    sync_ticket,
    weight_loader,
)

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
# threads per block (power of two: tree reduction). q_absorb2's block (32 lanes x 8 warps at dn % 8 == 0): the
# latent writes inside its launch (FUSE_KV) then sum the squares in the same order as this kernel's, so both
# paths write the same bits (with 128 here, the H200 showed 1-ulp differences in ~3-12% of c_kv)
_KV_NT = 8 if IS_SIM else 256


@functools.cache
def _kv_write_token(norm_dtype: str, NT: int):
    """Device function ``kv_write(c, kv_a_layernorm, eps, positions, cos_tab, sin_tab, L_dev, c_kv_cache,
    k_pe_cache, interleave, m, tid, red)``: token m's latent into cache slot L + m, by the NT threads of a
    block (NT a power of two, red a shared float32[NT]; every thread of the block calls it)."""
    load = weight_loader(np.dtype(norm_dtype))

    @cuda.jit(device=True, inline=True)
    def kv_write(c, kv_a_layernorm, eps, positions, cos_tab, sin_tab, L_dev, c_kv_cache, k_pe_cache, interleave,
                 m, tid, red):
        Rkv = c_kv_cache.shape[1]
        dr = k_pe_cache.shape[1]
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

    return kv_write


@cuda.jit(device=True, inline=True)
def _kv_hl_write(c_kv_cache, k_pe_cache, kv_hl, slot, tid, NT):
    """kv_hl[slot, :F] = the bf16 hi / lo words of x = [c_kv_cache[slot] | k_pe_cache[slot]] (F = Rkv + dr, both
    even; :func:`kv_hl_np`'s layout: word w < F/2 the hi pair of x[2w], x[2w+1], word F/2 + w its lo pair) by the NT
    threads of a block. It reads the row back from the caches, so the split sees their exact bits: the block writes
    the row, then passes a barrier, then calls it."""
    Rkv = c_kv_cache.shape[1]
    half = (Rkv + k_pe_cache.shape[1]) // 2
    for w in range(tid, half, NT):
        f = 2 * w
        if f < Rkv:
            x0 = c_kv_cache[slot, f]
            x1 = c_kv_cache[slot, f + 1]
        else:
            x0 = k_pe_cache[slot, f - Rkv]
            x1 = k_pe_cache[slot, f - Rkv + 1]
        hi, lo = tc.split_bf16x2(x0, x1)
        kv_hl[slot, w] = hi
        kv_hl[slot, half + w] = lo


def _emit_kv_write(s: Src, m: str, hl: bool) -> None:
    """The source lines by which a block writes token ``m``'s latent into cache slot L + m (``kv_write`` of
    :func:`_kv_write_token`, names of kv_latent_write's arguments, ``tid`` and ``NT`` in scope); with ``hl`` then its
    pre-split row kv_hl[L + m] (:func:`_kv_hl_write`)."""
    s("redkv = cuda.shared.array(NT, float32)")
    s("kv_write(c, kv_a_layernorm, eps, positions, cos_tab, sin_tab, L_dev, c_kv_cache, k_pe_cache, interleave,")
    s(f"         {m}, tid, redkv)")
    if hl:
        s("cuda.syncthreads()  # the row just written, read back by the whole block")
        s(f"kv_hl_write(c_kv_cache, k_pe_cache, kv_hl, L_dev[0] + {m}, tid, NT)")


@functools.cache
def _kv_latent_write_kernel(norm_dtype: str, NT: int = _KV_NT, hl: bool = False):
    """The latent write (grid (M,), block (NT,)); with ``hl`` it takes ``kv_hl`` last and also writes its rows."""
    s = Src()
    with s.block("def kv_latent_write_kernel(c, kv_a_layernorm, eps, positions, cos_tab, sin_tab, L_dev, c_kv_cache, "
                 f"k_pe_cache, interleave{', kv_hl' if hl else ''}):"):
        s('"""c[M, Rkv+dr] f32, kv_a_layernorm[Rkv] (f32|bf16), positions[M] i64, cos/sin_tab[P, dr/2],')
        s("L_dev[1] i64 -> c_kv_cache[L+m, :Rkv] = rmsnorm(c[m, :Rkv]), k_pe_cache[L+m, :dr] = rope(c[m, Rkv:])")
        if hl:
            s("and kv_hl[L+m, :Rkv+dr] (uint32) = their bf16 hi / lo words (kv_hl_np).")
        s('Grid (M,), block (NT,)."""')
        s("grid_dependency_wait()")
        s("tid = cuda.threadIdx.x")
        _emit_kv_write(s, "cuda.blockIdx.x", hl)
    ns = dict(cuda=cuda, float32=float32, NT=NT, kv_write=_kv_write_token(norm_dtype, NT), kv_hl_write=_kv_hl_write)
    return jit_source(s.text(), "kv_latent_write_kernel", ns, __name__)


def kv_hl_np(c_kv: np.ndarray, k_pe: np.ndarray) -> np.ndarray:
    """The pre-split cache on the host: for keys [..., Rkv] / [..., dr] (float32) the uint32 words [..., F]
    (F = Rkv + dr) of x = [c_kv | k_pe] as bf16 pairs: words [0, F/2) the hi planes (bf16 of x, feature 2w in the
    low half of word w), [F/2, F) the lo planes (bf16 of x - hi), kdt.kernels.tc.split_bf16x2's words. The tensor-
    core attention copies a key tile of it into shared memory as is (kdt.kernels.attn_tc)."""
    hi, lo = tc.split_np(np.concatenate([c_kv, k_pe], axis=-1))
    return np.ascontiguousarray(np.concatenate([hi, lo], axis=-1)).view(np.uint32)


def _check_kv_hl(kv_hl, c_kv_cache, k_pe_cache) -> tuple:
    """() without the pre-split cache, else (kv_hl,) after checking it is uint32 [max_len, Rkv + dr], Rkv, dr even."""
    if kv_hl is None:
        return ()
    (n, Rkv), dr = c_kv_cache.shape, k_pe_cache.shape[1]
    if tuple(kv_hl.shape) != (n, Rkv + dr) or np.dtype(kv_hl.dtype) != np.uint32 or Rkv % 2 or dr % 2:
        raise ValueError(f"kv_hl must be uint32 [{n}, {Rkv + dr}] (Rkv, dr even), got {np.dtype(kv_hl.dtype)} "
                         f"{tuple(kv_hl.shape)} for Rkv {Rkv}, dr {dr}")
    return (kv_hl,)


def kv_latent_write(c, kv_a_layernorm, eps, positions, cos_tab, sin_tab, L, c_kv_cache, k_pe_cache,
                    interleave: bool = True, stream=0, kv_hl=None) -> None:
    """Write the M new latents into cache slots [L, L+M).

    c[M, Rkv+dr] f32 (kv_a_proj_with_mqa output); kv_a_layernorm[Rkv] f32 or bf16 (uint16);
    positions[M] int64; cos_tab, sin_tab[max_pos, dr/2] f32; c_kv_cache[max_len, Rkv] f32,
    k_pe_cache[max_len, dr] f32 (written at rows L..L+M-1 only). ``L``: an int, or an int64 device
    array of one element (read by the kernel: what a CUDA graph needs). ``kv_hl``: None, or the pre-split cache
    uint32 [max_len, Rkv + dr] whose rows L..L+M-1 get :func:`kv_hl_np` of the rows written (Rkv, dr even).
    """
    M = c.shape[0]
    hl = _check_kv_hl(kv_hl, c_kv_cache, k_pe_cache)
    if M == 0:
        return
    k = _kv_latent_write_kernel(np.dtype(kv_a_layernorm.dtype).name, _KV_NT, bool(hl))
    k[M, _KV_NT, stream](c, kv_a_layernorm, np.float32(eps), positions, cos_tab, sin_tab, device_scalar(L),
                         c_kv_cache, k_pe_cache, np.int32(1 if interleave else 0), *hl)


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
        grid_dependency_wait()
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


def q_absorb(q, kv_b, positions, cos_tab, sin_tab, interleave: bool, q_abs, q_pe, stream=0,
             version: int | None = None, tc_abs=None) -> None:
    """q_abs[m,h,r] = sum_{d<dn} q[m, h*(dn+dr)+d] * kv_b[h*(dn+dv)+d, r];  q_pe[m,h] = rope(q[m,h,dn:]).

    q[M, H*(dn+dr)] f32; kv_b[H*(dn+dv), Rkv] f32 or bf16 (uint16); positions[M] int64;
    cos_tab, sin_tab[max_pos, dr/2] f32; outputs q_abs[M, H, Rkv] f32, q_pe[M, H, dr] f32.
    The softmax scale is not applied here (mla_attention takes it). ``version``: 1 or 2 (default
    :data:`VERSION`, env ``KDT_MLA_VERSION``). ``tc_abs`` (version 2): (W_uk^T, q_hl) of :func:`absorb_tc_weights`
    and :func:`absorb_tc_scratch`, the absorb then on tensor cores where :func:`absorb_uses_tc`.
    """
    M, H, Rkv = q_abs.shape
    dr = q_pe.shape[2]
    if M == 0:
        return
    if _version(version) == 2:
        _q_absorb_v2(q, kv_b, positions, cos_tab, sin_tab, interleave, q_abs, q_pe, stream=stream, tc_abs=tc_abs)
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
        grid_dependency_wait()
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
    grid_dependency_wait()
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


def mla_num_splits(L: int, M: int, H: int, Rkv: int = 512, dr: int = 64, version: int | None = None) -> int:
    """Splits of the key range [0, L+M) the wrapper uses by default. v1: enough blocks for about two
    waves on the device, at least MIN_KEYS_PER_SPLIT keys per split, at most MAX_SPLITS. v2: about
    BLOCKS_PER_SM_V2 blocks per SM, at least MIN_KEYS_PER_SPLIT_V2 keys per split, at most
    MAX_SPLITS_V2 (the engine passes max_len as L: splits past the device L stay empty)."""
    if _version(version) == 2:
        from kdt.kernels import attn_tc  # (it builds on this module)

        if attn_tc.uses_tc(M, H, Rkv, dr) or attn_tc.shares_tc(M, H, Rkv, dr, L):
            return attn_tc.num_splits(L, M, H)
        return _fma_splits(L, M, H, Rkv, dr)
    _, A, NW, _ = _attn_params(H, Rkv, dr)
    base = cdiv(H, NW * A) * M
    T = L + M
    want = cdiv(2 * _num_sms(), max(base, 1))
    return int(max(1, min(want, cdiv(T, MIN_KEYS_PER_SPLIT), MAX_SPLITS)))


def _fma_splits(L: int, M: int, H: int, Rkv: int, dr: int) -> int:
    """Version 2's FMA kernel's splits of [0, L + M) (mla_num_splits)."""
    _, A2, NW2, _, _ = _attn2_params(H, Rkv, dr)
    # whole waves: as many splits as fit beside each other (M=64 on 264 slots: 4 splits, 256
    # blocks, not 5 = 320 blocks = a second wave of 56); BLOCKS_PER_SM_V2 counts 4-warp blocks
    want = (_attn2_blocks_per_sm(NW2) * _num_sms()) // max(1, cdiv(H, NW2 * A2) * M)
    return int(max(1, min(want, cdiv(L + M, MIN_KEYS_PER_SPLIT_V2), MAX_SPLITS_V2)))


def mla_scratch_size(M: int, H: int, Rkv: int, n_splits: int) -> int:
    """float32 elements of the split scratch (0 when n_splits == 1)."""
    return 0 if n_splits <= 1 else M * H * n_splits * (Rkv + 2)


def mla_attention(q_abs, q_pe, c_kv_cache, k_pe_cache, L, vis, scale, o_lat, scratch=None,
                  n_splits: int | None = None, stream=0, version: int | None = None, kv_hl=None,
                  max_len: int | None = None, sync=None) -> None:
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

    ``version``: 1 or 2 (default :data:`VERSION`, env ``KDT_MLA_VERSION``); ``n_splits`` should come
    from :func:`mla_num_splits` of the same version (v1 takes at most MAX_SPLITS, v2 MAX_SPLITS_V2).

    ``kv_hl``: None, or the pre-split cache uint32 [max_len, Rkv + dr] (:func:`kv_hl_np` of the two caches, rows
    [0, L+M) written): version 2 on tensor cores reads it (kdt.kernels.attn_tc), the FMA kernels ignore it.
    ``max_len`` (with L on the device): the longest prefix it may hold, as ``n_splits`` came from (None: any).
    ``sync``: None, or int32 [ATTN_SYNC_WORDS], zero, for the combine in the attention's launch (version 2,
    :func:`combine_in_launch`; None: one kept by this module, for one stream at a time).
    """
    M, H, Rkv = q_abs.shape
    dr = q_pe.shape[2]
    if M == 0:
        return
    if _version(version) == 2:
        _mla_attention_v2(q_abs, q_pe, c_kv_cache, k_pe_cache, L, vis, scale, o_lat, scratch, n_splits, stream,
                          kv_hl=kv_hl, max_len=max_len, sync=sync)
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
        grid_dependency_wait()
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


def uv_project(o_lat, kv_b, o, stream=0, version: int | None = None) -> None:
    """o[m, h*dv+v] = sum_r kv_b[h*(dn+dv)+dn+v, r] * o_lat[m, h, r]   (W_uv[h] @ o_lat[m, h]).

    o_lat[M, H, Rkv] f32; kv_b[H*(dn+dv), Rkv] f32 or bf16 (uint16); o[M, H*dv] f32 out, or uint64 [M, H*dv/2]:
    o in the hi / lo layout (kdt.kernels.tc.XL_HILO) that linear_tc reads as it is, the bits it would split o into
    (o_proj's x; tensor cores only: :func:`uv_uses_tc`, version 2, o_lat contiguous).
    ``version``: 1 or 2 (default :data:`VERSION`; v2 = one output row per warp at M <= 2, or at any M
    for a small W_uv: :data:`UV_ROW_PER_WARP_ELEMS`).
    """
    M, H, Rkv = o_lat.shape
    if M == 0:
        return
    hilo = np.dtype(o.dtype) == np.uint64
    dv = o.shape[1] * (2 if hilo else 1) // H
    if _version(version) == 2 and uv_uses_tc(M, kv_b, H, dv) and o_lat.is_c_contiguous():
        rt, nt, u, nw = _uv_tc_plan(M)
        N = kv_b.shape[0]
        k = tc.gemm_kernel(rt, nt, u, nw, heads=True, yl=tc.XL_HILO if hilo else tc.XL_NATURAL)
        k[(cdiv(M, 8 * nt), cdiv(dv, 16 * rt), H), nw * 32, stream](
            o_lat.reshape(M * H, Rkv), kv_b.view(np.uint64).reshape(1, N, Rkv // 4), 0,
            o.view(np.uint16) if hilo else o, False)
        return
    if hilo:
        raise ValueError("uv_project: o in the hi / lo layout needs the tensor-core path (uv_uses_tc, version 2, "
                         "o_lat contiguous)")
    if _version(version) == 2:
        G, NW, RPW, TM = _uv2_params(Rkv, M, H, dv)
    else:
        G, NW, RPW = _uv_params(Rkv)
        TM = _uv_tm(M)
    k = _uv_project_kernel(np.dtype(kv_b.dtype).name, Rkv, G, NW, RPW, TM)
    grid = (cdiv(dv, NW * RPW), H, cdiv(M, TM))
    k[grid, NW * G, stream](o_lat, kv_b, o)


# ---- 6. v2 kernels (KDT_MLA_VERSION=2, the default) --------------------------------------------------
# Why v1 is slow at small M (H200, Moonlight H=16): its attention block holds all 16 heads of a token
# and walks its key range serially, 16 keys per tile, and the splits keep >= MIN_KEYS_PER_SPLIT = 256
# keys each, so at M=1 the grid is 3 blocks (L=512) to 33 blocks (L=8192) of one 8-warp block per SM:
# ~100-250 serial tiles of a latency-bound loop (2 heads per warp: 18 shared loads + 10 dependent
# shuffles per key for 36 FMAs) on a handful of SMs, hence ~95 us whatever L. uv_project gives each
# warp 8 output rows one after the other (64 blocks: 8 dependent rounds of loads), q_absorb each thread
# a 128-long serial walk over d (64 blocks).
#
# v2 attention (generated source, every compile-time loop written out, all per-thread state in
# scalar registers; :func:`_attn2_source`): a block of NW warps (NW*G threads) owns R = NW*A heads of
# one token and a split of the keys, walked in tiles of BT = G*VPL/A keys staged in shared memory
# ([c_kv | k_pe | 0 pad]; default PF=2: the next tile's global loads are issued before the p @ c_kv
# phase and stored into the other half of a double buffer after it).
# - scores: warp w owns rows w*A .. w*A+A-1 with q (scale folded in) in registers, lane j features
#   j + G*k; per key a lane does QE = (Rkv+dr)/G shared loads and A*QE FMAs (4 FMAs per load, no
#   broadcast), then ONE transposed shuffle reduce-scatter of the A*BT partial dots (G-1 shuffles
#   per tile, ~4 per key instead of v1's 10 per key) leaves lane j with VPL full scores of one row;
# - online softmax on those lanes (a row's BT scores live on GS = G/A lanes: 2x log2(GS) shuffles);
#   p goes to shared memory with the per-row rescale factor;
# - p @ c_kv: the block's R x Rkv accumulator is tiled RPT rows x CPT columns per thread (8 x 8 for
#   H>=16): per key RPT broadcast loads of p + CPT loads of c_kv for RPT*CPT FMAs (4 FMAs per load).
# (A, NW, BT) = (4, 4, 8) on the GPU: 128 threads, 16 heads, 255 registers (ptxas: no spills) ->
# 2 blocks (8 warps) per SM; ~1150 instructions per warp per 8-key tile (1088 of them FMA or shared
# loads). Splits (:func:`mla_num_splits`): as many as fit in one wave of 2 blocks per SM, >= 16 keys
# each, <= MAX_SPLITS_V2. A split the device L leaves empty exits at once and is never read: the
# combine derives the number of non-empty splits from L the same way, and spreads (head, column
# chunk) x groups of splits over its warps (:func:`_combine2_source`), so many splits stay cheap.
# Predicted (H200, Moonlight H=16, kdt.kernels.bench's splits; v1 measured in brackets):
#   M=1:  L=512 ~7 us (33 splits of 16 keys + combine) [97], L=8192 ~10 us (257 of 32) [147];
#   M=16: L=512 ~8 us [99], L=8192 ~90 us [537];  M=64: L=512 ~30 us [210], L=8192 ~350 us [2433];
#   Kimi H=64 M=1 L=512 ~8 us [130]. Past M=1 the tile loop is issue-bound: 8 warps x 1150
#   instructions per tile per SM / 4 schedulers, ~580 cycles per 8 keys of 16 heads.
# v2 q_absorb: block = (32 latent columns, head, TM tokens), 8 warps split d (16 rows each, all loads
# issued before use), one shared-memory sum: 256 blocks at M=1 (~3-4 us [9.5]). v2 uv_project at
# M <= 2: v1's kernel with one output row per warp (RPW=1, 8 warps): 2048 independent warps at H=16
# (~3-5 us [22.4]); M > 2 keeps v1's tiling (x reuse over 8 rows per warp).
# v2 is the default: predicted 5-15x faster on every measured attention shape, 2-5x on the others.
VERSION = int(os.environ.get("KDT_MLA_VERSION", "2"))
MAX_SPLITS_V2 = 512  # splits per (token, head group) at most (shared weights of the v2 combine)
MIN_KEYS_PER_SPLIT_V2 = 16  # two tiles of 8 keys
# resident attention blocks per SM the v2 splits aim at (128 threads x 255 registers: 2 fit)
BLOCKS_PER_SM_V2 = int(os.environ.get("KDT_MLA_BLOCKS_PER_SM", "2"))
SPLITS_BY_WARPS = os.environ.get("KDT_MLA_SPLITS_BY_WARPS", "1") == "1"  # 0: session 10's splits (A/B)
# the fewest keys a v2 split takes (0: none; kps below): the engine launches S = mla_num_splits(max_len, M) splits so
# that its CUDA graphs never change, and at a short prefix each split gets one tile of BT keys, every one loading all
# R heads' queries and writing R partials for the combine to read (M = 1, L = 512: 65 splits); with a floor, a
# short prefix takes fewer, longer splits (kdt.kernels.mla section 6's kps = max(cdiv(L + M, S), SPLIT_KEYS)). Off:
# measured slower (session 31's s31d, Moonlight, attention + combine at M = 1, L = 176 / 512 / 2048: 13.5 / 14.3 / 16.9
# us without a floor, 14.6 / 15.1 / 17.6 with 16 keys, 17.0 / 17.7 / 18.6 with 32, 35-36 with 128; ties at M = 16 / 64
# up to 32): a block's walk over more tiles costs more than the queries it reloads and the partials it writes
SPLIT_KEYS = int(os.environ.get("KDT_MLA_SPLIT_KEYS", "0"))
# The combine in the launch (session 36; KDT_MLA_COMBINE_IN_M: at M <= this, 0: off, the default: measured slower,
# below). At one token the attention and its combine take ~13.5 us at any prefix up to 512 keys for < 1 MB (session 31:
# their launches' latency, not bytes), and the combine's launch is ~4.6 us + ~1 us of graph gap a layer. With it on, the
# attention's launch holds NP = H * M * Rkv / (G * CI) more blocks, combine workers: a block's role is its ticket
# (kdt.kernels.common: blocks that wait), the first NS = cdiv(H, R) * M * S tickets the splits, which count themselves
# done once their partials are written (an empty split at once), the last of them raising a flag; each worker waits for
# the flag, then combines its (column chunk, head, token) with mla_combine2's code (_emit_combine2), reading the
# partials through L2. The last worker to pass puts the launch's sync words back to zero. A worker has the attention's
# NW warps (mla_combine2 at M = 1: 16), so its sums take the same terms in another order (~1e-7 apart; bit for bit in
# the simulator, whose geometries agree). Prediction (Moonlight, M = 1): ~3 us a layer, ~80 us of the 2.9 ms AR step.
# Measured slower, so off (H200, session 39, s39a): the attention with its combine in / apart, us, Moonlight (16
# heads) at L = 176 / 512 / 2048 / 8192 14.1 / 13.7, 14.5 / 14.2, 18.0 / 16.7, 25.6 / 24.5; Kimi-K2 (64 heads) 27.6 /
# 17.8 .. 66.3 / 58.5 (`scripts/bench_mla.py --kernels attention --combine-in --M 1`); Moonlight's AR step in its
# graph 3084.0 us against 2886.7 apart (`scripts/profile_graphs.py --combine-in-ab`).
COMBINE_IN_MAX_M = int(os.environ.get("KDT_MLA_COMBINE_IN_M", "0"))
COMBINE_IN_CPC = 1  # a worker lane's columns: H * 16 workers of 32 columns at Rkv = 512 (the combine's M = 1 chunks)
_CI_TICKET, _CI_DONE, _CI_PASSED = 0, 1, 2  # line 0: role tickets, splits done, workers passed
_CI_FLAG = SYNC_LINE  # the splits-done flag's copies: lines 1 .. SYNC_COPIES
ATTN_SYNC_WORDS = SYNC_LINE * (1 + SYNC_COPIES)  # the sync array of the combine in the launch: int32, zero between


def combine_in_launch(M: int, S: int) -> bool:
    """Whether the FMA attention of M tokens in S splits combines in its own launch (COMBINE_IN_MAX_M)."""
    return S > 1 and M <= COMBINE_IN_MAX_M


def _attn2_blocks_per_sm(NW: int) -> int:
    """Resident v2 attention blocks of NW warps per SM: the registers of BLOCKS_PER_SM_V2 4-warp blocks
    (H <= 12, e.g. model_code's H = 4: one-warp blocks, 8 per SM; before, 2, so at M = 17 each block
    walked two or more key tiles in sequence where one-tile splits still fit one wave)."""
    return max(1, BLOCKS_PER_SM_V2 * 4 // NW) if SPLITS_BY_WARPS else BLOCKS_PER_SM_V2


def _version(version) -> int:
    v = VERSION if version is None else int(version)
    if v not in (1, 2):
        raise ValueError(f"unknown MLA kernel version {v} (1 or 2)")
    return v




def _pow2_le(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def _attn2_params(H: int, Rkv: int, dr: int) -> tuple[int, int, int, int, int]:
    """(G lanes per warp, A heads per warp in the score phase, NW warps, VPL scores per lane after
    the reduce-scatter, CG column groups of the p @ c_kv phase). Keys per tile BT = G*VPL/A."""
    if IS_SIM:  # small lane groups: every simulated thread is a Python thread
        G = 4 if Rkv % 4 == 0 else (2 if Rkv % 2 == 0 else 1)
        A, NW, VPL = min(2, G), 2, 1
    else:
        G = 32
        if Rkv % G:
            raise ValueError(f"mla_attention v2 needs kv_lora_rank % 32 == 0 (got {Rkv})")
        A, VPL = 4, 1
        NW = min(4, cdiv(H, A))
    return G, A, NW, VPL, _attn2_cg(Rkv, G, NW)


def _attn2_cg(Rkv: int, G: int, NW: int) -> int:
    """Column groups of the p @ c_kv phase: the split of NW warps into RG x CG that minimises the
    loads per key (RPT + CPT) with whole lane-strided columns (Rkv % (G*CG) == 0)."""
    best = None
    cg = 1
    while cg <= NW:
        if NW % cg == 0 and Rkv % (G * cg) == 0:
            cost = NW // cg + Rkv // (G * cg)  # proportional to RPT + CPT
            if best is None or cost < best[0]:
                best = (cost, cg)
        cg *= 2
    return best[1]


def _attn2_geometry(Rkv, dr, G, A, NW, VPL, CG) -> dict:
    F = Rkv + dr
    if G & (G - 1) or A & (A - 1) or VPL & (VPL - 1) or (G * VPL) % A:
        raise ValueError(f"bad v2 attention geometry G={G} A={A} VPL={VPL}")
    BT = G * VPL // A
    QE = cdiv(F, G)
    FP = QE * G
    NT = NW * G
    R = NW * A
    RG = NW // CG
    if NW % CG or Rkv % (G * CG):
        raise ValueError(f"bad column groups CG={CG} for NW={NW}, Rkv={Rkv}, G={G}")
    return dict(Rkv=Rkv, dr=dr, F=F, G=G, A=A, NW=NW, VPL=VPL, CG=CG, BT=BT, QE=QE, FP=FP, NT=NT, R=R,
                RG=RG, RPT=R // RG, CW=Rkv // CG, CPT=Rkv // (G * CG), GS=BT // VPL, V=A * BT,
                PEP=FP - Rkv, NLC=cdiv(BT * Rkv, NT), NLP=cdiv(BT * (FP - Rkv), NT),
                LOGG=int(round(math.log2(G))), XB=NT if IS_SIM else 1)


def _split_keys(s, KM: int, BT: str = "BT") -> None:
    """Emit ``kps``, the keys of a split, as the v2 attention and its combine both derive it from T = L + M and
    the S splits: cdiv(T, S), at least KM (0: no floor), rounded up to whole key tiles of ``BT`` keys."""
    s("kps = (T + S - 1) // S")
    if KM:
        s(f"kps = max(kps, {KM})")
    s(f"kps = (kps + {BT} - 1) // {BT} * {BT}")


def online_softmax(s, scores: list[str], span: int, shfl) -> None:
    """Emit one key tile's online-softmax step (fp32) of a row whose scores (masked: NEG_INF) ``span`` lanes hold,
    ``scores`` each (``shfl(v, off)``: the source of lane ^ off's v): the tile's row max ``mx``, ``m_new``, the rescale
    ``alpha`` of the running sums, ``p_i = exp(score_i - m_new)`` (zeros while every key so far is masked) and their row
    sum ``ps``; updates ``l_run`` and ``m_run`` (version 2's attention and kdt.kernels.attn_tc)."""
    offs = [1 << i for i in reversed(range(span.bit_length() - 1))]
    s("mx = " + (f"max({', '.join(scores)})" if len(scores) > 1 else scores[0]))
    for off in offs:
        s(f"mx = max(mx, {shfl('mx', off)})")
    s("m_new = max(m_run, mx)")
    s("alpha = float32(1.0)")
    for i in range(len(scores)):
        s(f"p_{i} = float32(0.0)")
    with s.block("if m_new != NEG_INF:"):
        s("alpha = math.exp(m_run - m_new)  # exp(-inf) = 0 on the first visible tile")
        for i, v in enumerate(scores):
            s(f"p_{i} = math.exp({v} - m_new)")
    s("ps = " + " + ".join(f"p_{i}" for i in range(len(scores))))
    for off in offs:
        s(f"ps += {shfl('ps', off)}")
    s("l_run = l_run * alpha + ps")
    s("m_run = m_new")


def _attn2_source(Rkv, dr, F, G, A, NW, VPL, CG, BT, QE, FP, NT, R, RG, RPT, CW, CPT, GS, V, PEP, NLC,
                  NLP, LOGG, PF, KM=0, LMAX=0, SOWN=0, CI=0, **_) -> str:
    """Python source of the v2 attention kernel (see the section comment), loops written out.

    PF (how the next key tile's global loads overlap this tile's compute): 0 = none (loads at the top
    of the tile loop); 1 = into registers right after this tile is staged (live through both phases);
    2 = into registers between the score and the p @ c_kv phases (live through the second only),
    stored to the other half of a double-buffered tile, one barrier fewer per tile.

    LMAX > 0 (attn_tc.shares_tc): prefixes L >= LMAX are the tensor-core kernel's (it returns at once), and below
    it takes SOWN of the launch's splits (its own count; the combine told the same by L).

    CI > 0: the combine in the same launch (see COMBINE_IN_MAX_M), its workers on CI columns a lane."""
    s = Src()
    B = "bf, " if PF == 2 else ""  # tile buffer index of sK

    def kref(tt, col) -> str:
        return f"sK[{B}{tt}, {col}]"

    # Fast staging when the block's threads tile the rows evenly: row and column indices unsigned
    # (no wrap-around selects), one row address per key, constant column offsets.
    fast_c = Rkv % NT == 0
    fast_p = NT % PEP == 0 and (BT * PEP) % NT == 0

    def load_tile(t: str) -> None:  # this thread's share of tile [t, t+BT) -> pc_i, pp_i
        if fast_c:
            per = Rkv // NT
            for tt in range(BT):
                s(f"rw = uint64(min({t} + {tt}, t_hi - 1))")
                for i in range(tt * per, (tt + 1) * per):
                    s(f"pc_{i} = c_kv[rw, tidu + U{NT * (i % per)}]")
        else:
            for i in range(NLC):
                s(f"e = tid + {NT * i}")
                s("tt = e // Rkv")
                s(f"pc_{i} = c_kv[min({t} + tt, t_hi - 1), e - tt * Rkv] if tt < BT else float32(0.0)")
        for i in range(NLP):
            if fast_p:  # thread tid: key ptt + (NT // PEP) * i, column pcol (< DR, or a zero pad)
                row = f"uint64(min({t} + ptt + {(NT // PEP) * i}, t_hi - 1))"
                if PEP == dr:
                    s(f"pp_{i} = k_pe[{row}, pcol]")
                else:
                    s(f"pp_{i} = k_pe[{row}, pcol] if pcol < UDR else float32(0.0)")
            else:
                s(f"e = tid + {NT * i}")
                s(f"tt = e // {PEP}")
                s(f"f = e - tt * {PEP}")
                s(f"pp_{i} = k_pe[min({t} + tt, t_hi - 1), f] if (tt < BT and f < DR) else float32(0.0)")

    def store_tile() -> None:
        for i in range(NLC):
            if Rkv % NT == 0:
                per = Rkv // NT
                s(f"{kref(i // per, f'tidu + U{NT * (i % per)}')} = pc_{i}")
            else:
                s(f"e = tid + {NT * i}")
                s("tt = e // Rkv")
                with s.block("if tt < BT:"):
                    s(f"{kref('tt', 'e - tt * Rkv')} = pc_{i}")
        for i in range(NLP):
            if fast_p:
                s(f"{kref(f'pttu + U{(NT // PEP) * i}', 'URKV + pcol')} = pp_{i}")
            else:
                s(f"e = tid + {NT * i}")
                s(f"tt = e // {PEP}")
                with s.block("if tt < BT:"):
                    s(f"{kref('tt', f'Rkv + e - tt * {PEP}')} = pp_{i}")

    def split_done() -> None:  # CI: this split's partials are written (or it has none): count it
        s("cuda.threadfence()")
        s("cuda.syncthreads()")
        with s.block("if tid == 0 and cuda.atomic.add(sync, CI_DONE, 1) == NS - 1:  # the last split: workers go"):
            s("cuda.threadfence()")
            s("sync_raise(sync, CI_FLAG)")

    args = "q_abs, q_pe, c_kv, k_pe, L_dev, vis, scale, o_lat, part" + (", sync, S" if CI else "")
    with s.block(f"def mla_attention2({args}):"):
        s('"""v2 MLA attention (kdt.kernels.mla section 6). Grid (cdiv(H, R), M, S), block (NT,): block')
        s("(x, m, sp) = heads x*R .. x*R+R-1 of token m, keys [sp*kps, (sp+1)*kps) (kps = cdiv(L+M, S)")
        s("rounded up to BT; an empty split returns at once). S == 1: o_lat[m, h] = acc / l; else")
        s("part[((m*H+h)*S+sp)*(Rkv+2) + ..] = (acc[Rkv], running max, running sum). With the combine in the")
        s("launch (CI): grid (NS + NP,), a block's ticket its role: NS splits (x, m, sp), then NP combine workers")
        s('(cb, h, m) that wait for every split (kdt.kernels.common: blocks that wait)."""')
        s("grid_dependency_wait()  # first (kdt.kernels.common, PDL)")
        s("tid = cuda.threadIdx.x")
        s("w = tid // G")
        s("j = tid - w * G")
        s("M = q_abs.shape[0]")
        s("H = q_abs.shape[1]")
        if CI:
            s("NX = (H + R - 1) // R")
            s("NS = NX * M * S")
            s("role = sync_ticket(sync, CI_TICKET)")
            with s.block("if role >= NS:  # a combine worker"):
                s("wr = role - NS")
                s(f"cb = wr % {Rkv // (G * CI)}")
                s(f"h = (wr // {Rkv // (G * CI)}) % H")
                s(f"m = wr // ({Rkv // (G * CI)} * H)")
                with s.block("if tid == 0:"):
                    s("sync_poll(sync, CI_FLAG + (wr % SYNC_COPIES) * SYNC_LINE)")
                    s("cuda.threadfence()")
                    with s.block(f"if cuda.atomic.add(sync, CI_PASSED, 1) == {Rkv // (G * CI)} * H * M - 1:"):
                        s("# every ticket is taken and every flag read: zero for the next launch")
                        s("sync[CI_TICKET] = 0")
                        s("sync[CI_DONE] = 0")
                        s("sync[CI_PASSED] = 0")
                        with s.block("for c in range(SYNC_COPIES):"):
                            s("sync[CI_FLAG + c * SYNC_LINE] = 0")
                s("cuda.syncthreads()")
                _emit_combine2(s, G, NW, CI, max(1, (2 if IS_SIM else 16) // CI), KM,
                               ld=lambda i: f"ldcg1(part, {i})")
                s("return")
            s("bx = role % NX")
            s("m = (role // NX) % M")
            s("sp = role // (NX * M)")
        else:
            s("bx = cuda.blockIdx.x")
            s("m = cuda.blockIdx.y")
            s("sp = cuda.blockIdx.z")
        if LMAX:
            s(f"S = {SOWN}  # of the launch's splits (later ones stay empty)")
        elif not CI:  # (CI: an argument)
            s("S = cuda.gridDim.z")
        s("L = L_dev[0]")
        if LMAX:  # prefixes from LMAX are the tensor-core kernel's (attn_tc.shares_tc)
            with s.block(f"if L >= {LMAX}:"):
                s("return")
        s("T = L + M")
        _split_keys(s, KM)
        s("t_lo = sp * kps")
        with s.block("if t_lo >= T:"):
            if CI:
                split_done()
            s("return")
        s("t_hi = min(t_lo + kps, T)")
        s("sK = cuda.shared.array(SK_SHAPE, float32)  # key tile [c_kv | k_pe | 0 pad]")
        s("sP = cuda.shared.array(SP_SHAPE, float32)  # sP[tt, row] = p")
        s("sAl = cuda.shared.array(R, float32)  # per-row rescale of this tile")
        s("sMl = cuda.shared.array(SML_SHAPE, float32)  # final running max / sum per row")
        s("xbuf = cuda.shared.array(XB, float32)")
        s("h0 = bx * R")
        s("# q rows w*A + a (clamped to H-1: rows past H are computed, never stored), features j + G*k")
        for a in range(A):
            s(f"hq = min(h0 + w * {A} + {a}, H - 1)")
            for k in range(QE):
                f0 = G * k
                if f0 + G <= Rkv:
                    s(f"q_{a}_{k} = q_abs[m, hq, j + {f0}] * scale")
                elif f0 >= Rkv and f0 + G <= F:
                    s(f"q_{a}_{k} = q_pe[m, hq, j + {f0 - Rkv}] * scale")
                else:
                    s(f"f = j + {f0}")
                    s(f"q_{a}_{k} = (q_abs[m, hq, f] if f < Rkv else (q_pe[m, hq, f - Rkv] if f < F "
                      "else float32(0.0))) * scale")
        s("# p @ c_kv role: rows r0 .. r0+RPT-1, columns c0 + G*c")
        s("rg = w // CG")
        s("r0 = rg * RPT")
        s("c0 = (w - rg * CG) * CW + j")
        s("# unsigned copies for shared-memory indices: no negative-index wrap-around, so every")
        s("# constant offset folds into the load's immediate (one address register, not one per load)")
        s("ju = uint64(j)")
        s("tidu = uint64(tid)")
        if fast_p:
            s(f"ptt = tid // {PEP}")
            s(f"pcol = uint64(tid - ptt * {PEP})")
            s("pttu = uint64(ptt)")
        s("r0u = uint64(r0)")
        s("c0u = uint64(c0)")
        for r in range(RPT):
            s(" = ".join(f"acc_{r}_{c}" for c in range(CPT)) + " = float32(0.0)")
        s("# softmax role after the reduce-scatter: row w*A + j // GS, keys (j % GS)*VPL + i of a tile")
        s("jj = j % GS")
        s("row_me = w * A + j // GS")
        s("m_run = NEG_INF")
        s("l_run = float32(0.0)")
        if PF == 2:
            s("bf = 0")
            load_tile("t_lo")
            store_tile()
        elif PF == 1:
            load_tile("t_lo")
        with s.block("for t0 in range(t_lo, t_hi, BT):"):
            if PF == 0:
                load_tile("t0")
            if PF == 2:
                s("cuda.syncthreads()  # tile bf staged; everyone is done with sP of the previous tile")
            else:
                s("cuda.syncthreads()  # everyone is done with the previous tile")
                store_tile()
                s("cuda.syncthreads()")
            if PF == 1:
                with s.block("if t0 + BT < t_hi:  # prefetch the next tile into registers"):
                    load_tile("t0 + BT")
            s("# ---- partial scores v[a*BT + tt] over this lane's features")
            for k in range(QE):
                for tt in range(BT):
                    s(f"kv = {kref(tt, f'ju + U{G * k}')}")
                    for a in range(A):
                        op = "=" if k == 0 else "+="
                        s(f"v_{a * BT + tt} {op} q_{a}_{k} * kv")
            s("# ---- transposed reduce-scatter: lane j ends with v index j*VPL + i, full sums")
            vals = [f"v_{i}" for i in range(V)]
            off = G // 2
            while off >= 1:
                half = len(vals) // 2
                s(f"up = (j & {off}) != 0")
                for i in range(half):
                    lo, hi = vals[i], vals[i + half]
                    s(f"snd = {lo} if up else {hi}")
                    s(f"kp = {hi} if up else {lo}")
                    s(f"{lo} = kp + shfl(xbuf, tid, snd, {off})")
                vals = vals[:half]
                off //= 2
            s("# ---- online softmax of row row_me over its GS lanes")
            for i in range(VPL):
                s(f"t = t0 + jj * {VPL} + {i}")
                s(f"s_{i} = {vals[i]} if (t < t_hi and (t < L or vis[m, t - L] != 0)) else NEG_INF")
            online_softmax(s, [f"s_{i}" for i in range(VPL)], GS, lambda v, off: f"shfl(xbuf, tid, {v}, {off})")
            for i in range(VPL):
                s(f"sP[jj * {VPL} + {i}, row_me] = p_{i}")
            with s.block("if jj == 0:"):
                s("sAl[row_me] = alpha")
            s("cuda.syncthreads()")
            if PF == 2:
                with s.block("if t0 + BT < t_hi:  # the next tile's loads, in flight during p @ c_kv"):
                    load_tile("t0 + BT")
            s("# ---- acc = acc * alpha + p @ c_kv")
            for r in range(RPT):
                s(f"al = sAl[r0u + U{r}]")
                for c in range(CPT):
                    s(f"acc_{r}_{c} *= al")
            for tt in range(BT):
                for c in range(CPT):
                    s(f"kc_{c} = {kref(tt, f'c0u + U{G * c}')}")
                for r in range(RPT):
                    s(f"pr = sP[{tt}, r0u + U{r}]")
                    for c in range(CPT):
                        s(f"acc_{r}_{c} += pr * kc_{c}")
            if PF == 2:
                with s.block("if t0 + BT < t_hi:"):
                    s("bf = 1 - bf")
                    store_tile()
        with s.block("if jj == 0:"):
            s("sMl[0, row_me] = m_run")
            s("sMl[1, row_me] = l_run")
        s("cuda.syncthreads()")
        with s.block(f"if {'cuda.gridDim.z' if LMAX else 'S'} == 1:  # no combine follows"):
            for r in range(RPT):
                s(f"h = h0 + r0 + {r}")
                with s.block("if h < H:"):
                    s(f"inv = float32(1.0) / sMl[1, r0 + {r}]")
                    for c in range(CPT):
                        s(f"o_lat[m, h, c0 + {G * c}] = acc_{r}_{c} * inv")
        with s.block("else:"):
            for r in range(RPT):
                s(f"h = h0 + r0 + {r}")
                with s.block("if h < H:"):
                    s("base = ((m * H + h) * S + sp) * RS")
                    for c in range(CPT):
                        s(f"part[base + c0 + {G * c}] = acc_{r}_{c}")
            with s.block("for r in range(tid, R, NT):"):
                s("h = h0 + r")
                with s.block("if h < H:"):
                    s("base = ((m * H + h) * S + sp) * RS")
                    s("part[base + Rkv] = sMl[0, r]")
                    s("part[base + Rkv + 1] = sMl[1, r]")
        if CI:
            split_done()
    return s.text()


@functools.cache
def _attention2_kernel(Rkv: int, dr: int, G: int, A: int, NW: int, VPL: int, CG: int, PF: int = 2, KM: int = 0,
                       LMAX: int = 0, SOWN: int = 0, CI: int = 0):
    """The v2 attention kernel (cached per geometry; KM: the split keys' floor, ``split_keys``; LMAX > 0: it returns
    at once for prefixes L >= LMAX and takes SOWN splits below, for sharing a launch with the tensor-core kernel;
    CI > 0: the combine in the launch, CI columns a worker's lane); ``.geom`` holds its constants."""
    g = _attn2_geometry(Rkv, dr, G, A, NW, VPL, CG)
    sk = (2, g["BT"], g["FP"]) if PF == 2 else (g["BT"], g["FP"])
    ns = dict(g, cuda=cuda, float32=float32, uint64=uint64, math=math, NEG_INF=NEG_INF, shfl=_shfl_xor, DR=dr,
              RS=Rkv + 2, UDR=np.uint64(dr), URKV=np.uint64(Rkv), SK_SHAPE=sk, SP_SHAPE=(g["BT"], g["R"] + 1),
              SML_SHAPE=(2, g["R"]))
    ns.update({f"U{i}": np.uint64(i) for i in range(max(g["FP"], g["R"]) + 1)})
    if LMAX and SOWN < 1:
        raise ValueError(f"a launch shared by prefix needs the FMA kernel's own splits (SOWN={SOWN})")
    if CI:
        if LMAX or Rkv % (G * CI) or g["NT"] & (g["NT"] - 1):
            raise ValueError(f"the combine in the launch needs a launch of its own, Rkv % (G * CI) == 0 and a power "
                             f"of two threads (CI={CI}, NT={g['NT']})")
        ns.update(tree_reduce=_tree_reduce, ldcg1=ldcg1, sync_ticket=sync_ticket, sync_raise=sync_raise,
                  sync_poll=sync_poll, SYNC_COPIES=SYNC_COPIES, SYNC_LINE=SYNC_LINE, CI_TICKET=_CI_TICKET,
                  CI_DONE=_CI_DONE, CI_PASSED=_CI_PASSED, CI_FLAG=_CI_FLAG)
    k = jit_source(_attn2_source(PF=PF, KM=KM, LMAX=LMAX, SOWN=SOWN, CI=CI, **g), "mla_attention2", ns, __name__)
    k.geom = g
    k.workers = (lambda H, M: Rkv // (G * CI) * H * M) if CI else None  # NP of a launch
    return k


def _emit_combine2(s, G, NWC, CPC, US, KM=0, LMAX=0, SOWN=0, BTO=0, ld=None) -> None:
    """Emit the v2 combine of one (column chunk cb, head h, token m) into ``s``: o_lat[m, h, cb*CW .. +CW) from the
    partials of the ne non-empty splits of S (ne from L_dev exactly as the attention derives it; LMAX > 0: a launch
    shared by prefix (attn_tc.shares_tc), below LMAX the FMA kernel's SOWN splits of BTO-key tiles, from LMAX the
    tensor-core kernel's S of BT). Expects tid, w (of NWC warps), j (of G lanes), cb, h, m, M, H, S, Rkv and RS in
    scope; lane j owns columns cb*CW + j + G*c, warp w the splits w, w + NWC, ..; ``ld(i)``: the load of part[i]."""
    ld = ld or (lambda i: f"part[{i}]")
    NT, CW = NWC * G, G * CPC
    s("T = L_dev[0] + M")
    if LMAX:
        with s.block(f"if L_dev[0] < {LMAX}:"):
            s(f"S = {SOWN}")
            _split_keys(s, KM, str(BTO))
        with s.block("else:"):
            _split_keys(s, KM)
    else:
        _split_keys(s, KM)
    s("ne = (T + kps - 1) // kps")
    s("base0 = (m * H + h) * S * RS")
    s(f"wts = cuda.shared.array({MAX_SPLITS_V2}, float32)")
    s(f"red = cuda.shared.array({NT}, float32)")
    s(f"red2 = cuda.shared.array(({NWC}, {CW}), float32)")
    s("mx = NEG_INF")
    with s.block(f"for sx in range(tid, ne, {NT}):"):
        s(f"mx = max(mx, {ld('base0 + sx * RS + Rkv')})")
    s("red[tid] = mx")
    s(f"mx = tree_reduce(red, tid, {NT}, True)")
    s("cuda.syncthreads()")
    s("ls = float32(0.0)")
    with s.block(f"for sx in range(tid, ne, {NT}):"):
        s(f"ms = {ld('base0 + sx * RS + Rkv')}")
        s("wv = float32(0.0)")
        with s.block("if ms != NEG_INF:"):
            s("wv = math.exp(ms - mx)")
        s("wts[sx] = wv")
        s(f"ls += wv * {ld('base0 + sx * RS + Rkv + 1')}")
    s("red[tid] = ls")
    s(f"inv = float32(1.0) / tree_reduce(red, tid, {NT}, False)  # its barriers publish wts too")
    s(f"col0 = base0 + cb * {CW} + j")
    for u in range(US):
        s(" = ".join(f"a_{u}_{c}" for c in range(CPC)) + " = float32(0.0)")
    s("sx = w")
    with s.block(f"while sx + {(US - 1) * NWC} < ne:"):
        for u in range(US):
            s(f"wv_{u} = wts[sx + {u * NWC}]")
            s(f"b_{u} = col0 + (sx + {u * NWC}) * RS")
        for u in range(US):
            for c in range(CPC):
                s(f"a_{u}_{c} += wv_{u} * {ld(f'b_{u} + {G * c}')}")
        s(f"sx += {US * NWC}")
    with s.block("while sx < ne:"):
        s("wv_0 = wts[sx]")
        s("b_0 = col0 + sx * RS")
        for c in range(CPC):
            s(f"a_0_{c} += wv_0 * {ld(f'b_0 + {G * c}')}")
        s(f"sx += {NWC}")
    for c in range(CPC):
        s(f"red2[w, j + {G * c}] = " + " + ".join(f"a_{u}_{c}" for u in range(US)))
    s("cuda.syncthreads()")
    with s.block(f"for cc in range(tid, {CW}, {NT}):"):
        s("tot = red2[0, cc]")
        for ww in range(1, NWC):
            s(f"tot += red2[{ww}, cc]")
        s(f"o_lat[m, h, cb * {CW} + cc] = tot * inv")


def _combine2_source(G, NWC, CPC, US, KM=0, LMAX=0, SOWN=0, BTO=0, **_) -> str:
    """The v2 combine kernel: one block a (column chunk, head, token) (:func:`_emit_combine2`)."""
    s = Src()
    with s.block("def mla_combine2(part, S, L_dev, o_lat):"):
        s('"""v2 flash-decoding combine. part as written by the v2 attention (only its ne non-empty')
        s("splits are read; ne from L_dev exactly as the attention derives it). Grid (Rkv // CW, H, M),")
        s("block (NWC*G,): lane j owns columns cb*CW + j + G*c, warp w the splits w, w + NWC, ..;")
        s('partials summed in shared memory."""')
        s("grid_dependency_wait()  # first (kdt.kernels.common, PDL)")
        s("tid = cuda.threadIdx.x")
        s("w = tid // G")
        s("j = tid - w * G")
        s("cb = cuda.blockIdx.x")
        s("h = cuda.blockIdx.y")
        s("m = cuda.blockIdx.z")
        s("M = o_lat.shape[0]")
        s("H = o_lat.shape[1]")
        s("Rkv = o_lat.shape[2]")
        s("RS = Rkv + 2")
        _emit_combine2(s, G, NWC, CPC, US, KM, LMAX, SOWN, BTO)
    return s.text()


@functools.cache
def _combine2_kernel(BT: int, G: int, NWC: int, CPC: int, KM: int = 0, shared: tuple[int, int, int] | None = None):
    US = 2 if IS_SIM else max(1, 8 // CPC)  # splits in flight per lane (x CPC columns)
    NT, CW = NWC * G, G * CPC
    if NT & (NT - 1):
        raise ValueError(f"combine block {NT} must be a power of two")
    ns = dict(cuda=cuda, float32=float32, math=math, NEG_INF=NEG_INF, tree_reduce=_tree_reduce, BT=BT, G=G)
    LMAX, SOWN, BTO = shared or (0, 0, 0)
    k = jit_source(_combine2_source(G=G, NWC=NWC, CPC=CPC, US=US, KM=KM, LMAX=LMAX, SOWN=SOWN, BTO=BTO), "mla_combine2",
                   ns, __name__)
    k.threads, k.cols = NT, CW
    return k


def _combine2_config(S: int, M: int, H: int, Rkv: int) -> tuple[int, int, int]:
    """(G, NWC warps, CPC columns per lane) of the v2 combine for S splits: ~8+ splits per warp
    (4..16 warps), and column chunks as fine as keeps the grid <= ~2048 blocks."""
    if IS_SIM:  # two warps, two column chunks when possible: both loops of the kernel run
        G = 4 if Rkv % 4 == 0 else 1
        return G, 2, (2 if (Rkv // G) % 2 == 0 else 1)
    G = 32
    NWC = min(16, max(4, _pow2_le(S // 8)))
    nch = Rkv // G
    chunks = 1
    for d in range(nch, 0, -1):
        if nch % d == 0 and (H * M * d <= 2048 or d == 1):
            chunks = d
            break
    return G, NWC, nch // chunks


def _mla_combine_v2(part, S: int, L_dev, o_lat, BT: int, stream=0, km: int = 0,
                    shared: tuple[int, int, int] | None = None) -> None:
    """The v2 combine of S splits of BT-key tiles; ``shared`` (LMAX, SOWN, BTO): below prefix LMAX, SOWN of BTO."""
    M, H, Rkv = o_lat.shape
    if not 1 <= S <= MAX_SPLITS_V2:
        raise ValueError(f"n_splits={S} outside [1, {MAX_SPLITS_V2}]")
    G, NWC, CPC = _combine2_config(S, M, H, Rkv)
    k = _combine2_kernel(BT, G, NWC, CPC, km, shared)
    k[(Rkv // k.cols, H, M), k.threads, stream](part, np.int64(S), L_dev, o_lat)


@functools.lru_cache(maxsize=1)
def _attn_sync():
    """The sync words of the combine in the launch where the caller passes none (zero between launches)."""
    return cuda.to_device(np.zeros(ATTN_SYNC_WORDS, dtype=np.int32))


def _mla_attention_v2(q_abs, q_pe, c_kv_cache, k_pe_cache, L, vis, scale, o_lat, scratch, n_splits, stream,
                      params=None, split_keys: int | None = None, on_tc: bool | None = None, kv_hl=None,
                      max_len: int | None = None, sync=None, combine_in: bool | None = None) -> None:
    """Version 2's attention: on tensor cores (kdt.kernels.attn_tc) where ``on_tc`` (default attn_tc.uses_tc, when
    no other geometry or split-keys floor is asked for), else the FMA kernel of this section. Token counts that the
    two kernels share by prefix (attn_tc.shares_tc) take the tensor cores from attn_tc.long_l(M) keys on: an L on
    the host picks one, an L on the device (a CUDA graph; ``max_len``: the longest prefix it may be) launches both,
    each returning at once outside its prefixes, into the same partials (the FMA kernel in its own count of them, the
    combine told which by L).
    ``kv_hl`` (None or the pre-split cache uint32 [max_len, Rkv + dr]) goes to the tensor-core kernel; the FMA kernel
    ignores it. The FMA kernel alone combines in its own launch where ``combine_in`` (default
    :func:`combine_in_launch`), with ``sync`` (int32 [ATTN_SYNC_WORDS], zero; None: one kept by this module)."""
    from kdt.kernels import attn_tc  # (it builds on this module)

    M, H, Rkv = q_abs.shape
    dr = q_pe.shape[2]
    km = SPLIT_KEYS if split_keys is None else int(split_keys)
    prm = params or _attn2_params(H, Rkv, dr)
    both = False  # both kernels, split by the device's L
    host_L = isinstance(L, (int, np.integer))
    if on_tc is None:
        on_tc = params is None and km == 0 and attn_tc.uses_tc(M, H, Rkv, dr)
        if not on_tc and params is None and km == 0 and attn_tc.shares_tc(M, H, Rkv, dr, int(L) if host_L else max_len):
            if host_L:
                on_tc = True
            else:
                both = True
    if host_L:
        T = int(L) + M
        S = mla_num_splits(int(L), M, H, Rkv, dr, version=2) if n_splits is None else int(n_splits)
        S = max(1, min(S, MAX_SPLITS_V2, T))
    elif n_splits is None:
        raise ValueError("mla_attention with L on the device needs n_splits")
    else:
        S = max(1, min(int(n_splits), MAX_SPLITS_V2))
    L_dev = device_scalar(L)
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
    shared = None  # both: (LMAX, the FMA kernel's splits below it, its key tile)
    if on_tc or both:
        BT = attn_tc.attention(q_abs, q_pe, c_kv_cache, k_pe_cache, L_dev, vis, scale, o_lat, part, S, stream=stream,
                               kv_hl=kv_hl, LMIN=attn_tc.long_l(M) if both else 0)
    ci = False  # the combine in the FMA kernel's launch
    if not on_tc:
        LX = attn_tc.long_l(M) if both else 0
        sown = min(S, _fma_splits(LX, M, H, Rkv, dr)) if both else 0  # its own splits below LX
        nt = prm[0] * prm[2]  # the block's threads: the workers' tree reductions need a power of two
        ci = S > 1 and not both and not nt & (nt - 1) and (combine_in_launch(M, S) if combine_in is None else
                                                          combine_in)
        k = _attention2_kernel(Rkv, dr, *prm, KM=km, LMAX=LX, SOWN=sown, CI=COMBINE_IN_CPC if ci else 0)
        args = (q_abs, q_pe, c_kv_cache, k_pe_cache, L_dev, vis, np.float32(scale), o_lat, part)
        if ci:
            sync = _attn_sync() if sync is None else sync
            if sync.size < ATTN_SYNC_WORDS:
                raise ValueError(f"mla_attention sync holds {sync.size} words, {ATTN_SYNC_WORDS} needed")
            k[cdiv(H, k.geom["R"]) * M * S + k.workers(H, M), k.geom["NT"], stream](*args, sync, np.int64(S))
        else:
            k[(cdiv(H, k.geom["R"]), M, S), k.geom["NT"], stream](*args)
        if both:
            shared = (LX, sown, k.geom["BT"])
        else:
            BT = k.geom["BT"]
    if S > 1 and not ci:
        _mla_combine_v2(part, S, L_dev, o_lat, BT, stream=stream, km=0 if on_tc else km, shared=shared)


# v2 q_absorb ------------------------------------------------------------------------------------------
def _q_absorb2_params(M: int, dn: int) -> tuple[int, int, int]:
    """(TM tokens per block, G lanes = latent columns per block, NWD warps splitting d)."""
    if IS_SIM:
        return (1 if M <= 1 else 2), 4, 2
    TM = 1 if M <= 1 else (4 if M <= 4 else 8)
    NWD = 8
    while dn % NWD:
        NWD //= 2
    return TM, 32, NWD


def _q_absorb2_source(TM: int, DPW: int, NWD: int, KV: bool = False, HL: bool = False, ABS: bool = True) -> str:
    """The v2 q_absorb kernel's source; ``ABS`` False: no absorb, its blocks write q_pe and q_nope in the hi / lo
    layout for the absorb on tensor cores (:func:`_absorb_tc`), as ``q_hl`` (the layout's uint16 view [M H, 2 dn])
    in q_abs's place, no kv_b."""
    s = Src()
    kv_args = (", c, kv_a_layernorm, eps, L_dev, c_kv_cache, k_pe_cache" + (", kv_hl" if HL else "")) if KV else ""
    head = "q, kv_b, positions, cos_tab, sin_tab, interleave, q_abs, q_pe" if ABS else \
        "q, positions, cos_tab, sin_tab, interleave, q_hl, q_pe"
    with s.block(f"def {'q_absorb2_kernel' if ABS else 'q_rope_hl_kernel'}({head}{kv_args}):"):
        if ABS:
            s('"""q[M, H*(dn+dr)] f32, kv_b[H*(dn+dv), Rkv] f32|bf16 -> q_abs[M, H, Rkv] = q_nope @ W_uk[h],')
            s("q_pe[M, H, dr] = rope(q[.., dn:]). Grid (cdiv(Rkv, G), H, cdiv(M, TM)), block (NWD*G,): warp w")
            s("sums d in [w*DPW, (w+1)*DPW) for latent column cb*G + lane (its DPW weight loads issued before")
            s("any is used); the NWD warp partials are summed in shared memory.")
        else:
            s('"""q[M, H*(dn+dr)] f32 -> q_pe[M, H, dr] = rope(q[.., dn:]) and q_hl row m H + h = q[m, h, :dn] in')
            s("the hi / lo layout (kdt.kernels.tc.put_hilo; the absorb runs on tensor cores).")
            s("Grid (1, H, cdiv(M, TM)), block (NWD*G,).")
        if KV:
            s("With the latent write (kv_latent_write's arguments after q_pe): grid z has cdiv(M, gx * gy)")
            s("more slices, whose blocks each write one token's latent into the cache" + (" and kv_hl." if HL else "."))
        s('"""')
        s("grid_dependency_wait()  # first (kdt.kernels.common, PDL)")
        s("tid = cuda.threadIdx.x")
        s("M = q.shape[0]")
        if KV:
            s("nqz = (M + TM - 1) // TM")
            with s.block("if cuda.blockIdx.z >= nqz:  # a latent-write block (one token)"):
                s("m = ((cuda.blockIdx.z - nqz) * cuda.gridDim.y + cuda.blockIdx.y) * cuda.gridDim.x + cuda.blockIdx.x")
                with s.block("if m < M:"):
                    _emit_kv_write(s, "m", HL)
                s("return")
        s("cb = cuda.blockIdx.x")
        s("h = cuda.blockIdx.y")
        s("m0 = cuda.blockIdx.z * TM")
        s("H = q_pe.shape[1]")
        s("dr = q_pe.shape[2]")
        s("dh = DN + dr")
        if ABS:
            s("w = tid // G")
            s("j = tid - w * G")
            s("Rkv = q_abs.shape[2]")
            s("dnv = kv_b.shape[0] // H")
            s("sq = cuda.shared.array(SQ_SHAPE, float32)")
            s("red = cuda.shared.array(RED_SHAPE, float32)")
            with s.block("for idx in range(tid, TM * DN, NT):"):
                s("i = idx // DN")
                s("d = idx - i * DN")
                s("sq[i, d] = q[m0 + i, h * dh + d] if m0 + i < M else float32(0.0)")
        else:
            with s.block("for idx in range(tid, TM * DN, NT):"):
                s("i = idx // DN")
                s("d = idx - i * DN")
                with s.block("if m0 + i < M:"):
                    s("put_hilo(q_hl, (m0 + i) * H + h, d, q[m0 + i, h * dh + d])")
        with s.block("if cb == 0:"):
            s("half = dr // 2")
            with s.block("for idx in range(tid, TM * dr, NT):"):
                s("i = idx // dr")
                s("jr = idx - i * dr")
                with s.block("if m0 + i < M:"):
                    s("q_pe[m0 + i, h, jr] = rope_elem(q, m0 + i, h * dh + DN, jr, half, interleave, cos_tab, "
                      "sin_tab, positions[m0 + i])")
        if not ABS:
            return s.text()
        s("r = min(cb * G + j, Rkv - 1)")
        s("row0 = h * dnv + w * DPW")
        for dd in range(DPW):
            s(f"w_{dd} = load(kv_b[row0 + {dd}, r])")
        s("cuda.syncthreads()")
        s("d0 = uint64(w * DPW)")
        for i in range(TM):
            for dd in range(DPW):
                s(f"a_{i} {'=' if dd == 0 else '+='} sq[{i}, d0 + U{dd}] * w_{dd}")
            s(f"red[w, {i}, j] = a_{i}")
        s("cuda.syncthreads()")
        with s.block("for idx in range(tid, TM * G, NT):"):
            s("i = idx // G")
            s("jc = idx - i * G")
            s("tot = red[0, i, jc]")
            for ww in range(1, NWD):
                s(f"tot += red[{ww}, i, jc]")
            s("col = cb * G + jc")
            with s.block("if m0 + i < M and col < Rkv:"):
                s("q_abs[m0 + i, h, col] = tot")
    return s.text()


@functools.cache
def _q_absorb2_kernel(wdtype: str, dn: int, TM: int, G: int, NWD: int, kv_norm_dtype: str | None = None,
                      hl: bool = False, absorb: bool = True):
    """The v2 q_absorb kernel; with ``kv_norm_dtype`` (the kv_a_layernorm weight's dtype) it also writes
    the latents (see :func:`latent_write_and_absorb`), with ``hl`` too their pre-split rows (``kv_hl`` last);
    ``absorb`` False: rope and q_nope's hi / lo rows for the absorb on tensor cores (``wdtype`` not read)."""
    if dn % NWD:
        raise ValueError(f"q_absorb v2: dn={dn} not a multiple of {NWD} warps")
    DPW = dn // NWD
    NT = G * NWD
    ns = dict(cuda=cuda, float32=float32, uint64=uint64, rope_elem=_rope_elem, put_hilo=tc.put_hilo, TM=TM, G=G,
              NT=NT, DN=dn, DPW=DPW, SQ_SHAPE=(TM, dn), RED_SHAPE=(NWD, TM, G))
    if absorb:
        ns["load"] = weight_loader(np.dtype(wdtype))
    ns.update({f"U{i}": np.uint64(i) for i in range(DPW)})
    kv = kv_norm_dtype is not None
    if kv:
        ns.update(kv_write=_kv_write_token(kv_norm_dtype, NT), kv_hl_write=_kv_hl_write)
    k = jit_source(_q_absorb2_source(TM, DPW, NWD, kv, kv and hl, absorb),
                   "q_absorb2_kernel" if absorb else "q_rope_hl_kernel", ns, __name__)
    k.threads = NT
    return k


def _q_absorb_v2(q, kv_b, positions, cos_tab, sin_tab, interleave, q_abs, q_pe, stream=0, kv=None,
                 tc_abs=None) -> None:
    """``kv`` = (c, kv_a_layernorm, eps, L, c_kv_cache, k_pe_cache, kv_hl): kv_latent_write in the same launch
    (kv_hl None: without the pre-split cache). ``tc_abs`` = (W_uk^T, q_hl) (:func:`absorb_tc_weights`,
    :func:`absorb_tc_scratch`): the absorb on tensor cores where :func:`absorb_uses_tc` (this launch then writes
    q_nope's hi / lo rows for it instead)."""
    M, H, Rkv = q_abs.shape
    dr = q_pe.shape[2]
    dn = q.shape[1] // H - dr
    TM, G, NWD = _q_absorb2_params(M, dn)
    on_tc = absorb_uses_tc(M, tc_abs)
    gx, nqz = (1 if on_tc else cdiv(Rkv, G)), cdiv(M, TM)
    il = np.int32(1 if interleave else 0)
    wdt = np.dtype(kv_b.dtype).name
    head = (q, positions, cos_tab, sin_tab, il, tc_abs[1][: M * H].view(np.uint16), q_pe) if on_tc else \
        (q, kv_b, positions, cos_tab, sin_tab, il, q_abs, q_pe)
    if kv is None:
        k = _q_absorb2_kernel(wdt, dn, TM, G, NWD, absorb=not on_tc)
        k[(gx, H, nqz), k.threads, stream](*head)
    else:
        c, gw, eps, L, c_kv_cache, k_pe_cache, kv_hl = kv
        hl = _check_kv_hl(kv_hl, c_kv_cache, k_pe_cache)
        k = _q_absorb2_kernel(wdt, dn, TM, G, NWD, np.dtype(gw.dtype).name, bool(hl), absorb=not on_tc)
        k[(gx, H, nqz + cdiv(M, gx * H)), k.threads, stream](*head, c, gw, np.float32(eps), device_scalar(L),
                                                              c_kv_cache, k_pe_cache, *hl)
    if on_tc:
        _absorb_tc(tc_abs, q_abs, stream)


# q_absorb on tensor cores (session 42): q_abs[m, h] = W_uk[h]^T q_nope[m, h] as kdt.kernels.tc.gemm_kernel a head (16
# latent columns x 8 tokens a mma), from QABS_TC_MIN_M tokens, where the engine keeps W_uk transposed a head
# (``absorb_tc_weights``: bf16, dn % 4 == 0, more than UV_ROW_PER_WARP_ELEMS elements; Moonlight's 16 x 128 x 512,
# 2 MB a layer) and q_absorb2's launch, without its absorb, writes q_nope in the hi / lo layout for it
# (``absorb_tc_scratch``). Measured (H100, s42b, `scripts/bench_mla.py --kernels q_absorb --tc`, Moonlight, the
# engine's launch with the latent write, FMA / tensor cores in us): 14.5 / 11.5 at 32 tokens, 26.2 / 17.0 at 65, 82.0 /
# 34.3 at 256, 634.5 / 201.6 at 2048; at 16 (s42a) 9.0 / 10.1, the rope launch's ~5 us beside a 5 us GEMM. So from 32.
# H200, one process (s42c, `scripts/profile_graphs.py --absorb-tc-ab`): the budget-64 oracle step -289 us (-1.7%).
# Env KDT_MLA_QABS_TC_M=0: never.
QABS_TC_MIN_M = int(os.environ.get("KDT_MLA_QABS_TC_M", "32"))


def uk_transposed_np(kv_b: np.ndarray, H: int, dn: int) -> np.ndarray:
    """W_uk^T a head on the host: [H Rkv, dn], row h Rkv + r = W_uk[h][:, r] = kv_b[h (dn + dv) + d, r] over d < dn
    (kv_b [H (dn + dv), Rkv], any dtype)."""
    Rkv = kv_b.shape[1]
    return np.ascontiguousarray(kv_b.reshape(H, -1, Rkv)[:, :dn].transpose(0, 2, 1).reshape(H * Rkv, dn))


def absorb_tc_weights(kv_b, H: int, dn: int):
    """W_uk^T a head for the absorb on tensor cores, uint64 [1, H Rkv, dn / 4] (:func:`uk_transposed_np`'s bf16
    viewed as words), from kv_b (device or host, bf16 as uint16); None where it stays on FMA tiles: float32 weights,
    dn % 4, a small W_uk (at most UV_ROW_PER_WARP_ELEMS elements, the tiny fixture's and drafters': latency-bound),
    or QABS_TC_MIN_M = 0."""
    Rkv = kv_b.shape[1]
    if QABS_TC_MIN_M <= 0 or np.dtype(kv_b.dtype) != np.uint16 or dn % 4 or H * dn * Rkv <= UV_ROW_PER_WARP_ELEMS:
        return None
    host = kv_b.copy_to_host() if hasattr(kv_b, "copy_to_host") else np.asarray(kv_b)
    return cuda.to_device(uk_transposed_np(host, H, dn).view(np.uint64).reshape(1, H * Rkv, dn // 4))


def absorb_tc_scratch(M_max: int, H: int, dn: int):
    """q_nope's hi / lo rows for the absorb on tensor cores: uint64 [M_max H, dn / 2] (kdt.kernels.tc.XL_HILO)."""
    return cuda.device_array((M_max * H, dn // 2), np.uint64)


def absorb_uses_tc(M: int, tc_abs) -> bool:
    """q_absorb (v2) of M tokens runs its absorb on tensor cores: ``tc_abs`` = (W_uk^T, q_hl) given (the weights
    qualified: :func:`absorb_tc_weights`) and M >= QABS_TC_MIN_M."""
    return tc_abs is not None and tc_abs[0] is not None and 0 < QABS_TC_MIN_M <= M


def _absorb_tc_plan(M: int) -> tuple[int, int, int, int, int]:
    """(rt, nt, u, nw, kw) of kdt.kernels.tc.gemm_kernel for the absorb (K = dn = 128 at Moonlight: 8 groups of 4
    words): 4 warps, 4 groups in flight; to 128 tokens in 2 row groups (64 latent columns a block, a warp's 4 groups
    one step), past it in 4 (128 columns, each warp all of dn); token tiles as uv_project's (:func:`_uv_tc_plan`).
    Measured (H100, s42a, the GEMM alone in us, all 4 warps splitting dn / row groups of 1 / of 2): 12.5 / 13.1 /
    **11.0** at 65 tokens, 25.6 / **23.0** / 23.3 at 256, 178.2 / **138.2** / 149.8 at 2048."""
    return 2, _uv_tc_plan(M)[1], 4, 4, 2 if M <= 128 else 1


def _absorb_tc(tc_abs, q_abs, stream=0, plan: tuple | None = None) -> None:
    """q_abs[M, H, Rkv] = W_uk^T q_nope a head on tensor cores from q_nope's hi / lo rows (tc_abs = (W, q_hl)), on
    :func:`_absorb_tc_plan` or ``plan``."""
    W, q_hl = tc_abs
    M, H, Rkv = q_abs.shape
    rt, nt, u, nw, kw = plan or _absorb_tc_plan(M)
    R = tc.MMA_ROWS * rt * tc.row_groups(nw, kw)[2]  # latent columns a block
    tc.gemm_kernel(rt, nt, u, nw, tc.XL_HILO, kw, heads=True)[(cdiv(M, 8 * nt), cdiv(Rkv, R), H), nw * 32, stream](
        q_hl[: M * H], W, 0, q_abs.reshape(M, H * Rkv), False)


# One launch for kv_latent_write and q_absorb (v2) per layer instead of two (``latent_write_and_absorb``; env
# KDT_MLA_FUSE_KV=0 runs the two launches). Both read disjoint columns of the same [q | c] projection and nothing
# of each other, so the latent-write blocks (one token each) simply join q_absorb's grid. Measured (H200,
# session 11, the drafter table on and off in one run): model_code AR +4.6% (5158 -> 5395 tok/s), learned chain
# +4.9%, budget 16 +5.0% (predicted ~5% and ~3%).
FUSE_KV = os.environ.get("KDT_MLA_FUSE_KV", "1") == "1"


def latent_write_and_absorb(c, kv_a_layernorm, eps, L, c_kv_cache, k_pe_cache, q, kv_b, positions, cos_tab, sin_tab,
                            interleave: bool, q_abs, q_pe, stream=0, fuse: bool | None = None, kv_hl=None,
                            tc_abs=None) -> None:
    """:func:`kv_latent_write` then :func:`q_absorb` (their arguments; ``kv_hl``: None or the pre-split cache
    uint32 [max_len, Rkv + dr], also written at rows [L, L+M)), in one launch with ``fuse`` (default ``FUSE_KV``)
    and the v2 kernels, else in two; ``tc_abs``: q_absorb's."""
    if (FUSE_KV if fuse is None else fuse) and _version(None) == 2 and q_abs.shape[0] > 0:
        _q_absorb_v2(q, kv_b, positions, cos_tab, sin_tab, interleave, q_abs, q_pe, stream=stream,
                     kv=(c, kv_a_layernorm, eps, L, c_kv_cache, k_pe_cache, kv_hl), tc_abs=tc_abs)
        return
    kv_latent_write(c, kv_a_layernorm, eps, positions, cos_tab, sin_tab, L, c_kv_cache, k_pe_cache, interleave,
                    stream=stream, kv_hl=kv_hl)
    q_absorb(q, kv_b, positions, cos_tab, sin_tab, interleave, q_abs, q_pe, stream=stream, tc_abs=tc_abs)


# v2 uv_project -----------------------------------------------------------------------------------------
# W_uv of at most this many elements (H * dv * Rkv; model_code: 4 x 32 x 64 = 8 Ki) stays with one output
# row per warp and one token per block at any M: it sits in L2, so re-reading it per token costs little,
# while v1's tiling (8 rows per warp in sequence, 4 tokens per block) left model_code's M = 17 with 20
# blocks of 8 dependent rounds (3.7 us against 0.95 at M = 1). Moonlight's W_uv: 16 x 128 x 512 = 1 Mi.
UV_ROW_PER_WARP_ELEMS = int(os.environ.get("KDT_MLA_UV_ROW_ELEMS", str(1 << 16)))  # 0: session 10's rule (A/B)


# ... and from UV_TC_MIN_M tokens a large bf16 W_uv (more than UV_ROW_PER_WARP_ELEMS elements) runs on tensor cores
# (kdt.kernels.tc.gemm_kernel with heads: a GEMM a head, 16 outputs x 8 tokens a mma). s26a (H200, the budget-63 step
# launch by launch, Moonlight at M = 64): uv_project 34.5 us a launch for ~2 MB of W_uv and 134 MFLOP (~0.5 us of
# bytes). Measured (s28c, `scripts/bench_mla.py --kernels uv_project`, FMA tiles / tensor cores, us): Moonlight (H =
# 16) 10.6 / 5.3 at M = 16, 35.5 / 8.3 at M = 64; Kimi-K2 (H = 64) 35.6 / 8.9, 133.2 / 21.6.
# Env KDT_MLA_UV_TC_M=0: never.
UV_TC_MIN_M = int(os.environ.get("KDT_MLA_UV_TC_M", "16"))


def _uv_tc_plan(M: int) -> tuple[int, int, int, int]:
    """(rt, nt, u, nw) of uv_project on tensor cores: 32 outputs of a head a block, up to 4 token tiles of 8 (one to
    16 tokens, two to 64: at Moonlight's M = 64, 4 x 4 x 16 = 256 blocks; past 64 three where they pad M less,
    :func:`kdt.kernels.tc.token_tiles`), 4 words in flight, 4 warps splitting Rkv."""
    return 2, 1 if M <= 16 else 2 if M <= 64 else tc.token_tiles(M, 4), 4, 4


def uv_uses_tc(M: int, kv_b, H: int, dv: int) -> bool:
    """uv_project runs :func:`kdt.kernels.tc.gemm_kernel` a head (version 2; see UV_TC_MIN_M)."""
    Rkv = kv_b.shape[1]
    return (0 < UV_TC_MIN_M <= M and np.dtype(kv_b.dtype) == np.uint16 and Rkv % 4 == 0 and kv_b.is_c_contiguous()
            and H * dv * Rkv > UV_ROW_PER_WARP_ELEMS)


def uv_writes_hilo(M: int, kv_b, H: int, dv: int) -> bool:
    """uv_project can write o in the hi / lo layout (:func:`uv_project`'s uint64 o): its tensor-core path."""
    return _version(None) == 2 and uv_uses_tc(M, kv_b, H, dv)


def _uv2_params(Rkv: int, M: int, H: int, dv: int) -> tuple[int, int, int, int]:
    """(G, NW, RPW, TM): at M <= 2, or any M for a small W_uv (``UV_ROW_PER_WARP_ELEMS``), one output row
    per warp, 8 warps per block (2048 independent warps at H=16); above, v1's tiling (x reuse over 8 rows
    per warp matters there)."""
    G, NW, RPW = _uv_params(Rkv)
    if M <= 2 or H * dv * Rkv <= UV_ROW_PER_WARP_ELEMS:
        return G, (NW if IS_SIM else 8), 1, 1
    return G, NW, RPW, _uv_tm(M)


# ---- 5. sm_90 compile check signatures (DeepSeek-V3 / Kimi K2 / Moonlight dims) ----------------------
def _register() -> None:
    f32_1, f32_2, f32_3 = float32[::1], float32[:, ::1], float32[:, :, ::1]
    u16_1, u16_2 = uint16[::1], uint16[:, ::1]
    i64_1, u8_2 = int64[::1], uint8[:, ::1]
    dn, dr, Rkv = 128, 64, 512
    f32_2a = float32[:, :]  # a column slice of the engine's stacked [q_a | c] buffer
    hls = ((False, (), ""), (True, (uint32[:, ::1],), ",hl"))  # without / with kv_hl (a layer's view of the stack)
    for wdt, w1 in (("float32", f32_1), ("uint16", u16_1)):
        for c_t, lay in ((f32_2, "C"), (f32_2a, "A")):
            for hl, hl_t, tag in hls:
                register_ptx(_kv_latent_write_kernel(wdt, _KV_NT, hl),
                             (c_t, w1, float32, i64_1, f32_2, f32_2, i64_1, f32_2, f32_2, int32, *hl_t),
                             name=f"kv_latent_write_kernel[{wdt},{lay}{tag}]")
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
    # v2 (explicit GPU geometry: the simulator's _attn2_params differ)
    for wdt, w2 in (("float32", f32_2), ("uint16", u16_2)):
        for TM in (1, 8):
            register_ptx(_q_absorb2_kernel(wdt, dn, TM, 32, 8), (f32_2, w2, i64_1, f32_2, f32_2, int32, f32_3, f32_3),
                         name=f"q_absorb2_kernel[{wdt},TM={TM}]")
        # q a column slice of the stacked [q | c] buffer (models without q LoRA: Moonlight)
        register_ptx(_q_absorb2_kernel(wdt, dn, 1, 32, 8), (f32_2a, w2, i64_1, f32_2, f32_2, int32, f32_3, f32_3),
                     name=f"q_absorb2_kernel[{wdt},TM=1,A]")
        for TM, q_t in ((1, f32_2a), (8, f32_2)):  # with the latent write (FUSE_KV; the engine's norms are
            # float32), c a column slice of the stacked [q_a | c] buffer
            for hl, hl_t, tag in hls:
                register_ptx(_q_absorb2_kernel(wdt, dn, TM, 32, 8, "float32", hl),
                             (q_t, w2, i64_1, f32_2, f32_2, int32, f32_3, f32_3, f32_2a, f32_1, float32, i64_1, f32_2,
                              f32_2, *hl_t), name=f"q_absorb2_kernel[{wdt},TM={TM},kv{tag}]")
        register_ptx(_uv_project_kernel(wdt, Rkv, 32, 8, 1, 1), (f32_3, w2, f32_2),
                     name=f"uv_project_kernel[{wdt},RPW=1]")
    for M in (16, 64, 65, 256):  # on tensor cores (uv_uses_tc), o float32 or hi / lo (o_proj's x)
        register_ptx(tc.gemm_kernel(*_uv_tc_plan(M), heads=True), (f32_2, uint64[:, :, ::1], int64, f32_2, boolean))
        register_ptx(tc.gemm_kernel(*_uv_tc_plan(M), heads=True, yl=tc.XL_HILO),
                     (f32_2, uint64[:, :, ::1], int64, uint16[:, ::1], boolean))
    for M in (64, 65, 128, 256):  # the absorb's (absorb_uses_tc)
        rt, nt, u, nw, kw = _absorb_tc_plan(M)
        register_ptx(tc.gemm_kernel(rt, nt, u, nw, tc.XL_HILO, kw, heads=True),
                     (uint64[:, ::1], uint64[:, :, ::1], int64, f32_2, boolean))
    for TM, q_t in ((8, f32_2), (8, f32_2a)):  # the absorb's rope + q_nope hi / lo launch, with the latent write
        for hl, hl_t, tag in hls:
            register_ptx(_q_absorb2_kernel("uint16", dn, TM, 32, 8, "float32", hl, absorb=False),
                         (q_t, i64_1, f32_2, f32_2, int32, u16_2, f32_3, f32_2a, f32_1, float32, i64_1, f32_2, f32_2,
                          *hl_t), name=f"q_rope_hl_kernel[TM={TM},{'A' if q_t is f32_2a else 'C'}{tag}]")
    # Moonlight / Kimi (H >= 16; the prefetch modes), H = 4 at Rkv 512 and the tiny fixture (one warp)
    for rkv, d_r, NW, PFs in ((Rkv, dr, 4, (0, 1, 2)), (Rkv, dr, 1, (2,)), (64, 16, 1, (2,))):
        for PF in PFs:
            register_ptx(_attention2_kernel(rkv, d_r, 32, 4, NW, 1, _attn2_cg(rkv, 32, NW), PF),
                         (f32_3, f32_3, f32_2, f32_2, i64_1, u8_2, float32, f32_3, f32_1),
                         name=f"mla_attention2[Rkv={rkv},NW={NW},PF={int(PF)}]")
    # the combine in the launch (COMBINE_IN_MAX_M): Moonlight / Kimi (4 warps) and the tiny fixture (one warp)
    for rkv, d_r, NW in ((Rkv, dr, 4), (64, 16, 1)):
        register_ptx(_attention2_kernel(rkv, d_r, 32, 4, NW, 1, _attn2_cg(rkv, 32, NW), 2, CI=COMBINE_IN_CPC),
                     (f32_3, f32_3, f32_2, f32_2, i64_1, u8_2, float32, f32_3, f32_1, int32[::1], int64),
                     name=f"mla_attention2[Rkv={rkv},NW={NW},PF=2,CI]")
    # below attn_tc's shared prefixes, as the engine's graphs launch it beside the tensor-core kernel (shares_tc)
    register_ptx(_attention2_kernel(Rkv, dr, 32, 4, 4, 1, _attn2_cg(Rkv, 32, 4), 2, LMAX=1024, SOWN=4),
                 (f32_3, f32_3, f32_2, f32_2, i64_1, u8_2, float32, f32_3, f32_1),
                 name=f"mla_attention2[Rkv={Rkv},NW=4,PF=2,LMAX=1024]")
    for NWC, CPC, shared in ((16, 1, None), (4, 4, None), (4, 16, None), (4, 16, (1024, 4, 8))):
        register_ptx(_combine2_kernel(8 if shared is None else 16, 32, NWC, CPC, shared=shared),
                     (f32_1, int64, i64_1, f32_3), name=f"mla_combine2[NWC={NWC},CPC={CPC}{',shared' * bool(shared)}]")


_register()
