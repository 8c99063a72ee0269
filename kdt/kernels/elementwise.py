"""Small memory-bound kernels around the projections: embedding gather, RMSNorm, SiLU-and-multiply,
residual add and the row-wise argmax of the logits.

All activations are float32; tables/weights may be float32 or bf16 stored as uint16 (widened with
:func:`kdt.kernels.common.bf16_to_f32`). Every wrapper takes device arrays and preallocated outputs,
launches on ``stream`` and returns without synchronising.

Block reductions (RMSNorm's sum of squares, argmax's (value, index) pairs) use warp shuffles plus one
shared-memory exchange between warps on the GPU and a shared-memory tree in the simulator, which
has no shuffles (chosen with ``IS_SIM`` at import). NumPy references: :mod:`kdt.reference.ops`
(``rmsnorm``, ``silu``) and plain NumPy (``embed[tokens]``, ``x + y``, ``np.argmax(logits, -1)``).
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
from numba import cuda, float32, float64, int32, int64, uint16

from kdt.kernels import tc
from kdt.kernels.common import IS_SIM, WARP, cdiv, grid_dependency_wait, ldcg2, register_ptx, weight_loader

__all__ = ["embedding", "rmsnorm", "silu_mul", "add", "argmax_rows"]

# threads per block. Smaller in the simulator (every thread is a Python thread there); the kernels are
# the same code for any power-of-two block size >= 32.
EW_THREADS = 32 if IS_SIM else 256  # elementwise kernels: one block covers EW_THREADS columns of a row
NORM_THREADS = 32 if IS_SIM else 512  # rmsnorm: one block per row
ARGMAX_THREADS = 32 if IS_SIM else 1024  # argmax: one block per row
# the split argmax (argmax_split_kernel): blocks of ARGMAX_SPLIT_THREADS threads, ARGMAX_CHUNK logits each. One
# 1024-thread block per row scanned Moonlight's 163840 logits in 29.6 us (session 23's AR step profile, H200):
# one SM's share of the bandwidth. Split in 40 blocks of 4096 (two passes of 8 loads a thread), then the row's
# last block reduces the 40 partials. Predicted: ~4 us.
ARGMAX_SPLIT_THREADS = 32 if IS_SIM else 256
ARGMAX_CHUNK = 4096
ARGMAX_UNROLL = 8  # logits loaded per thread before they are compared (loads in flight)
_INT32_MAX = 2**31 - 1

# ---- block reductions ------------------------------------------------------------------------------
if IS_SIM:

    @cuda.jit(device=True)
    def _block_sum(v, red):
        """Sum of v over the block (every thread gets it). red: shared float32[blockDim.x]."""
        tid = cuda.threadIdx.x
        red[tid] = v
        cuda.syncthreads()
        s = cuda.blockDim.x // 2
        while s > 0:
            if tid < s:
                red[tid] += red[tid + s]
            cuda.syncthreads()
            s //= 2
        tot = red[0]
        cuda.syncthreads()
        return tot

else:

    @cuda.jit(device=True, inline=True)
    def _warp_sum(v):
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 16)
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 8)
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 4)
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 2)
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 1)
        return v

    @cuda.jit(device=True, inline=True)
    def _block_sum(v, red):
        """Sum of v over the block (every thread gets it). red: shared float32[>= blockDim.x / 32]."""
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        v = _warp_sum(v)
        if lane == 0:
            red[warp] = v
        cuda.syncthreads()
        if warp == 0:
            v = red[lane] if lane < cuda.blockDim.x // WARP else float32(0.0)
            v = _warp_sum(v)
            if lane == 0:
                red[0] = v
        cuda.syncthreads()
        tot = red[0]
        cuda.syncthreads()
        return tot


@cuda.jit(device=True, inline=True)
def _better(a, ia, b, ib):
    """(a, ia) beats (b, ib) under np.argmax order: NaN is largest; equal values -> lower index."""
    if a != a:
        return b == b or ia < ib
    if b != b:
        return False
    return a > b or (a == b and ia < ib)


if IS_SIM:

    @cuda.jit(device=True)
    def _block_argmax(v, i, redv, redi):
        """Index of the best (v, i) of the block. redv/redi: shared float32/int32[blockDim.x]."""
        tid = cuda.threadIdx.x
        redv[tid] = v
        redi[tid] = i
        cuda.syncthreads()
        s = cuda.blockDim.x // 2
        while s > 0:
            if tid < s and _better(redv[tid + s], redi[tid + s], redv[tid], redi[tid]):
                redv[tid] = redv[tid + s]
                redi[tid] = redi[tid + s]
            cuda.syncthreads()
            s //= 2
        return redi[0]

else:

    @cuda.jit(device=True, inline=True)
    def _warp_argmax(v, i):
        for o in (16, 8, 4, 2, 1):
            ov = cuda.shfl_xor_sync(0xFFFFFFFF, v, o)
            oi = cuda.shfl_xor_sync(0xFFFFFFFF, i, o)
            if _better(ov, oi, v, i):
                v = ov
                i = oi
        return v, i

    @cuda.jit(device=True, inline=True)
    def _block_argmax(v, i, redv, redi):
        """Index of the best (v, i) of the block. redv/redi: shared float32/int32[>= blockDim.x / 32]."""
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        v, i = _warp_argmax(v, i)
        if lane == 0:
            redv[warp] = v
            redi[warp] = i
        cuda.syncthreads()
        if warp == 0:
            if lane < cuda.blockDim.x // WARP:
                v = redv[lane]
                i = redi[lane]
            else:
                v = float32(-np.inf)
                i = int32(_INT32_MAX)
            v, i = _warp_argmax(v, i)
            if lane == 0:
                redi[0] = i
        cuda.syncthreads()
        return redi[0]


# ---- embedding --------------------------------------------------------------------------------------
@cache
def _embedding_kernel(dtype):
    load = weight_loader(dtype)

    @cuda.jit
    def embedding_kernel(tokens, embed, x):
        """tokens[M] int64, embed[V, D] f32|uint16(bf16), x[M, D] f32: x[m] = embed[tokens[m]].

        grid = (cdiv(D, EW_THREADS), M)."""
        grid_dependency_wait()
        m = cuda.blockIdx.y
        d = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if d < x.shape[1]:
            x[m, d] = load(embed[tokens[m], d])

    return embedding_kernel


def embedding(tokens, embed, x, stream=0) -> None:
    """x[M, D] = embed[tokens[M], :] (float32 out; embed float32 or bf16-as-uint16 [V, D]).

    Token ids must lie in [0, V) (not checked on the device)."""
    (M,) = tokens.shape
    V, D = embed.shape
    if tuple(x.shape) != (M, D):
        raise ValueError(f"embedding: tokens {tuple(tokens.shape)}, embed {tuple(embed.shape)}, "
                         f"x {tuple(x.shape)}")
    if M == 0:
        return
    _embedding_kernel(np.dtype(embed.dtype))[(cdiv(D, EW_THREADS), M), EW_THREADS, stream](tokens, embed, x)


# ---- rmsnorm ----------------------------------------------------------------------------------------
@cache
def _rmsnorm_kernel(dtype, hilo: bool = False, both: bool = False):
    """The norm's kernel ``(x, w, eps, y, ncols)``; ``both``: ``(x, w, eps, y, ncols, y_hl)``, y float32 and y_hl its
    hi / lo layout (uint16 [M, 2 ncols]) written from the same values."""
    load = weight_loader(dtype)
    RED = NORM_THREADS if IS_SIM else WARP
    HILO, BOTH = hilo, both

    def body(x, w, eps, y, ncols, y_hl):
        """x[M, >= ncols] f32, w[ncols] f32|uint16(bf16), y[M, >= ncols] f32:
        y[m, :ncols] = x[m, :ncols] / sqrt(mean(x[m, :ncols]^2) + eps) * w. grid = M blocks (one per row).
        ``hilo``: y is uint16 [M, 2 ncols], the tensor cores' hi / lo layout (kdt.kernels.tc.put_hilo); ``both``:
        y float32 and y_hl the hi / lo layout of the same values. (The kernel waits for its grid dependency first.)
        """
        red = cuda.shared.array(RED, float32)
        m = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        # sum of squares, 4 independent loads / partial sums in flight per thread
        s0 = float32(0.0)
        s1 = float32(0.0)
        s2 = float32(0.0)
        s3 = float32(0.0)
        j = tid
        while j + 3 * nt < ncols:
            v0 = x[m, j]
            v1 = x[m, j + nt]
            v2 = x[m, j + 2 * nt]
            v3 = x[m, j + 3 * nt]
            s0 += v0 * v0
            s1 += v1 * v1
            s2 += v2 * v2
            s3 += v3 * v3
            j += 4 * nt
        while j < ncols:
            v0 = x[m, j]
            s0 += v0 * v0
            j += nt
        ss = _block_sum((s0 + s1) + (s2 + s3), red)
        inv = float32(1.0) / math.sqrt(ss / float32(ncols) + float32(eps))
        for j in range(tid, ncols, nt):
            if HILO:
                tc.put_hilo(y, m, j, x[m, j] * inv * load(w[j]))
            else:
                v = x[m, j] * inv * load(w[j])
                y[m, j] = v
                if BOTH:
                    tc.put_hilo(y_hl, m, j, v)

    body = cuda.jit(device=True, inline=True)(body)
    if both:
        def rmsnorm_kernel(x, w, eps, y, ncols, y_hl):
            grid_dependency_wait()  # (the kernel's own call: PDL launches kernels that make it, common.waits_for_grid)
            body(x, w, eps, y, ncols, y_hl)
    else:
        def rmsnorm_kernel(x, w, eps, y, ncols):
            grid_dependency_wait()
            body(x, w, eps, y, ncols, y)  # (y_hl: never written)
    rmsnorm_kernel.__name__ = f"rmsnorm_kernel{'_hilo' if hilo else ''}{'_both' if both else ''}"
    return cuda.jit(rmsnorm_kernel)


def rmsnorm(x, w, eps: float, y, ncols: int | None = None, stream=0, hilo: bool = False, y_hl=None) -> None:
    """RMSNorm of the first ``ncols`` columns of each row: y[m, :ncols] = x[m, :ncols] * rsqrt(mean(x[m,
    :ncols]^2) + eps) * w[:ncols].

    x: float32 [M, Nx] (Nx >= ncols; e.g. the [M, Rkv + dr] output of kv_a_proj_with_mqa with
    ncols = Rkv); w: float32 or bf16-as-uint16 [ncols]; y: float32 [M, Ny] (Ny >= ncols; columns
    >= ncols untouched). ``ncols`` defaults to ``x.shape[1]``. x and y may also be non-contiguous views
    (e.g. ``buf[:, :Rkv]``) and y may be x (in place).

    ``hilo``: y is uint16 [M, 2 ncols] (not x), the normalised rows in the tensor cores' hi / lo layout
    (kdt.kernels.tc.XL_HILO: bf16 hi and lo; ncols a multiple of 4), which ``linear_tc`` reads as uint64.
    ``y_hl`` (not with ``hilo``): uint16 [M, 2 ncols], also written with y's rows in that layout (the MoE's router
    reads float32 y, its shared experts' and routed gate_up's tensor cores the hi / lo, ``moe_forward(..., b_hl)``).
    """
    M, Nx = x.shape
    ncols = Nx if ncols is None else int(ncols)
    if not (0 < ncols <= Nx and ncols <= y.shape[1] and y.shape[0] == M and tuple(w.shape) == (ncols,)):
        raise ValueError(f"rmsnorm: x {tuple(x.shape)}, w {tuple(w.shape)}, y {tuple(y.shape)}, "
                         f"ncols {ncols}")
    if hilo and (ncols % 4 or y.shape[1] != 2 * ncols or np.dtype(y.dtype) != np.uint16):
        raise ValueError(f"rmsnorm: the hi / lo layout needs y uint16 [M, 2 ncols], ncols % 4 == 0: y {y.dtype} "
                         f"{tuple(y.shape)}, ncols {ncols}")
    if y_hl is not None and (hilo or ncols % 4 or tuple(y_hl.shape) != (M, 2 * ncols)
                             or np.dtype(y_hl.dtype) != np.uint16):
        raise ValueError(f"rmsnorm: y_hl must be uint16 [M, 2 ncols] beside a float32 y, ncols % 4 == 0: y_hl "
                         f"{y_hl.dtype} {tuple(y_hl.shape)}, ncols {ncols}, hilo {hilo}")
    if M == 0:
        return
    args = (x, w, float(eps), y, ncols) + (() if y_hl is None else (y_hl,))
    _rmsnorm_kernel(np.dtype(w.dtype), bool(hilo), y_hl is not None)[M, NORM_THREADS, stream](*args)


# ---- silu_mul ---------------------------------------------------------------------------------------
@cuda.jit
def silu_mul_kernel(g, u, out):
    """g[M, I], u[M, I], out[M, I] f32: out = silu(g) * u = g / (1 + exp(-g)) * u. grid = (cdiv(I, EW), M)."""
    grid_dependency_wait()
    m = cuda.blockIdx.y
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < out.shape[1]:
        gv = g[m, i]
        out[m, i] = gv / (float32(1.0) + math.exp(-gv)) * u[m, i]


def silu_mul(g, u, out, stream=0) -> None:
    """out[M, I] = silu(g[M, I]) * u[M, I] (float32; out may be g or u; g and u may be column slices, e.g.
    the two halves of one [M, 2I] buffer)."""
    if not (tuple(g.shape) == tuple(u.shape) == tuple(out.shape) and len(out.shape) == 2):
        raise ValueError(f"silu_mul: g {tuple(g.shape)}, u {tuple(u.shape)}, out {tuple(out.shape)}")
    M, I = out.shape
    if M == 0 or I == 0:
        return
    silu_mul_kernel[(cdiv(I, EW_THREADS), M), EW_THREADS, stream](g, u, out)


# ---- add ----------------------------------------------------------------------------------------------
@cuda.jit
def add_kernel(x, y, out):
    """x[M, N], y[M, N], out[M, N] f32: out = x + y. grid = (cdiv(N, EW), M)."""
    grid_dependency_wait()
    m = cuda.blockIdx.y
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < out.shape[1]:
        out[m, i] = x[m, i] + y[m, i]


def add(x, y, out, stream=0) -> None:
    """out = x + y for float32 [M, N] (or [N]) arrays; ``add(x, y, x)`` is the in-place residual add."""
    if not (tuple(x.shape) == tuple(y.shape) == tuple(out.shape)):
        raise ValueError(f"add: x {tuple(x.shape)}, y {tuple(y.shape)}, out {tuple(out.shape)}")
    if len(out.shape) == 1:
        x, y, out = x.reshape(1, -1), y.reshape(1, -1), out.reshape(1, -1)
    M, N = out.shape
    if M == 0 or N == 0:
        return
    add_kernel[(cdiv(N, EW_THREADS), M), EW_THREADS, stream](x, y, out)


@cuda.jit
def copy_kernel(x, out):
    """x[M, N], out[M, N] f32: out = x. grid = (cdiv(N, EW), M)."""
    grid_dependency_wait()
    m = cuda.blockIdx.y
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < out.shape[1]:
        out[m, i] = x[m, i]


def copy(x, out, stream=0) -> None:
    """out[M, N] = x[M, N] (float32) as a kernel: unlike a memcpy it can be captured in a CUDA graph
    through Numba's launch (the engine records hidden states for the learned drafter this way)."""
    if tuple(x.shape) != tuple(out.shape) or len(out.shape) != 2:
        raise ValueError(f"copy: x {tuple(x.shape)}, out {tuple(out.shape)}")
    M, N = out.shape
    if M == 0 or N == 0:
        return
    copy_kernel[(cdiv(N, EW_THREADS), M), EW_THREADS, stream](x, out)


# ---- argmax -----------------------------------------------------------------------------------------
@cuda.jit(device=True, inline=True)
def _scan_argmax(logits, m, lo, hi, tid, nt):
    """(value, index) of this thread's best logits[m, k], k = lo + tid, lo + tid + nt, .. < hi, scanned in
    increasing order with ARGMAX_UNROLL loads in flight; (-inf, INT32_MAX) when it has none."""
    bv = float32(-np.inf)
    bi = int32(_INT32_MAX)  # loses every tie against a real index
    base = lo
    while base + (ARGMAX_UNROLL - 1) * nt + tid < hi:  # full groups: loads first, then compares
        v0 = logits[m, base + tid]
        v1 = logits[m, base + nt + tid]
        v2 = logits[m, base + 2 * nt + tid]
        v3 = logits[m, base + 3 * nt + tid]
        v4 = logits[m, base + 4 * nt + tid]
        v5 = logits[m, base + 5 * nt + tid]
        v6 = logits[m, base + 6 * nt + tid]
        v7 = logits[m, base + 7 * nt + tid]
        j = int32(base + tid)
        if _better(v0, j, bv, bi):
            bv, bi = v0, j
        if _better(v1, j + nt, bv, bi):
            bv, bi = v1, int32(j + nt)
        if _better(v2, j + 2 * nt, bv, bi):
            bv, bi = v2, int32(j + 2 * nt)
        if _better(v3, j + 3 * nt, bv, bi):
            bv, bi = v3, int32(j + 3 * nt)
        if _better(v4, j + 4 * nt, bv, bi):
            bv, bi = v4, int32(j + 4 * nt)
        if _better(v5, j + 5 * nt, bv, bi):
            bv, bi = v5, int32(j + 5 * nt)
        if _better(v6, j + 6 * nt, bv, bi):
            bv, bi = v6, int32(j + 6 * nt)
        if _better(v7, j + 7 * nt, bv, bi):
            bv, bi = v7, int32(j + 7 * nt)
        base += ARGMAX_UNROLL * nt
    for k in range(base + tid, hi, nt):  # tail
        v = logits[m, k]
        if _better(v, int32(k), bv, bi):
            bv, bi = v, int32(k)
    return bv, bi


assert ARGMAX_UNROLL == 8  # _scan_argmax's body is written out for 8


@cuda.jit
def argmax_rows_kernel(logits, out):
    """logits[M, V] f32, out[M] int64: out[m] = np.argmax(logits[m]) (first maximum; a NaN counts as
    the maximum, like NumPy). grid = M blocks (one per row) of ARGMAX_THREADS threads."""
    grid_dependency_wait()
    red_v = cuda.shared.array(ARGMAX_THREADS, float32)
    red_i = cuda.shared.array(ARGMAX_THREADS, int32)
    m = cuda.blockIdx.x
    bv, bi = _scan_argmax(logits, m, 0, logits.shape[1], cuda.threadIdx.x, cuda.blockDim.x)
    best = _block_argmax(bv, bi, red_v, red_i)
    if cuda.threadIdx.x == 0:
        out[m] = int64(best)


@cuda.jit
def argmax_split_kernel(logits, out, part_v, part_i, tickets, chunk):
    """The same result with each row split over the grid's x: grid = (S, M) blocks of ARGMAX_SPLIT_THREADS,
    S = cdiv(V, chunk) <= ARGMAX_SPLIT_THREADS. Block (s, m) scans logits[m, s*chunk : (s+1)*chunk) into
    part_v / part_i[m, s]; the block that takes row m's last ticket (tickets[m], back to 0 after) reduces
    the S partials in the same order (value, then the lower index) and writes out[m]."""
    grid_dependency_wait()
    red_v = cuda.shared.array(ARGMAX_SPLIT_THREADS, float32)
    red_i = cuda.shared.array(ARGMAX_SPLIT_THREADS, int32)
    flag = cuda.shared.array(1, int32)
    s = cuda.blockIdx.x
    m = cuda.blockIdx.y
    S = cuda.gridDim.x
    tid = cuda.threadIdx.x
    lo = s * chunk
    bv, bi = _scan_argmax(logits, m, lo, min(logits.shape[1], lo + chunk), tid, cuda.blockDim.x)
    best = _block_argmax(bv, bi, red_v, red_i)
    if tid == 0:
        part_i[m, s] = best
        part_v[m, s] = logits[m, best]
        cuda.threadfence()
        flag[0] = 1 if cuda.atomic.add(tickets, m, 1) == S - 1 else 0
    cuda.syncthreads()
    if flag[0] == 0:
        return
    cuda.threadfence()
    bv = float32(-np.inf)
    bi = int32(_INT32_MAX)
    if tid < S:
        bv = ldcg2(part_v, m, tid)
        bi = ldcg2(part_i, m, tid)
    best = _block_argmax(bv, bi, red_v, red_i)
    if tid == 0:
        out[m] = int64(best)
        tickets[m] = 0  # every ticket of the row is taken: ready for the next launch


class ArgmaxScratch:
    """The split argmax's partials and tickets for up to M_max rows of V logits: part_v / part_i [M_max, S],
    tickets [M_max] (zero between launches). ``chunk``: logits per block (ARGMAX_CHUNK, or more where V
    would need more than ARGMAX_SPLIT_THREADS blocks a row)."""

    def __init__(self, M_max: int, V: int, chunk: int | None = None, stream=0):
        self.V = V
        self.chunk = max(chunk or ARGMAX_CHUNK, cdiv(V, ARGMAX_SPLIT_THREADS))
        self.S = cdiv(V, self.chunk)
        self.part_v = cuda.device_array((M_max, self.S), np.float32, stream=stream)
        self.part_i = cuda.device_array((M_max, self.S), np.int32, stream=stream)
        self.tickets = cuda.to_device(np.zeros(M_max, np.int32), stream=stream)


def argmax_rows(logits, out, stream=0, scratch: ArgmaxScratch | None = None) -> None:
    """out[m] = argmax(logits[m, :]) as int64, exactly np.argmax (ties -> lowest index, NaN wins).

    logits: float32 [M, V] (V < 2^31); out: int64 [M]. With ``scratch`` (an :class:`ArgmaxScratch` for V
    and at least M rows) a row longer than one chunk is split over blocks (:func:`argmax_split_kernel`);
    without, or for a short row, one block a row scans it all."""
    M, V = logits.shape
    if tuple(out.shape) != (M,) or V == 0:
        raise ValueError(f"argmax_rows: logits {tuple(logits.shape)}, out {tuple(out.shape)}")
    if M == 0:
        return
    if scratch is not None and scratch.S > 1:
        if scratch.V != V or scratch.part_v.shape[0] < M:
            raise ValueError(f"argmax_rows: scratch for {scratch.part_v.shape[0]} rows of {scratch.V}, "
                             f"logits {tuple(logits.shape)}")
        argmax_split_kernel[(scratch.S, M), ARGMAX_SPLIT_THREADS, stream](
            logits, out, scratch.part_v, scratch.part_i, scratch.tickets, scratch.chunk)
        return
    argmax_rows_kernel[M, ARGMAX_THREADS, stream](logits, out)


# ---- sm_90 compile check ---------------------------------------------------------------------------
def _register() -> None:
    f1, f2, f2a = float32[::1], float32[:, ::1], float32[:, :]
    for wt, dt in ((float32, np.float32), (uint16, np.uint16)):
        register_ptx(_embedding_kernel(np.dtype(dt)), (int64[::1], wt[:, ::1], f2),
                     name=f"embedding_{dt.__name__}")
        register_ptx(_rmsnorm_kernel(np.dtype(dt)), (f2, wt[::1], float64, f2, int64),
                     name=f"rmsnorm_{dt.__name__}")
        register_ptx(_rmsnorm_kernel(np.dtype(dt), True), (f2, wt[::1], float64, uint16[:, ::1], int64),
                     name=f"rmsnorm_hilo_{dt.__name__}")  # linear's tensor cores after a norm (TC_HILO_X)
        register_ptx(_rmsnorm_kernel(np.dtype(dt), False, True), (f2, wt[::1], float64, f2, int64, uint16[:, ::1]),
                     name=f"rmsnorm_both_{dt.__name__}")  # the MoE's input, float32 and hi / lo (moe B_HILO)
    # rmsnorm of a column slice (buf[:, :Rkv]): non-contiguous 'A' layout arrays
    register_ptx(_rmsnorm_kernel(np.dtype(np.float32)), (f2a, f1, float64, f2a, int64),
                 name="rmsnorm_A_layout")
    register_ptx(_rmsnorm_kernel(np.dtype(np.float32)), (f2a, f1, float64, f2, int64),
                 name="rmsnorm_A_to_C")  # the engine's q_a_layernorm: [q_a | c] slice -> qa
    register_ptx(silu_mul_kernel, (f2, f2, f2))
    register_ptx(silu_mul_kernel, (f2a, f2a, f2), name="silu_mul_halves")  # dense_mlp v2: gu[:, :I], gu[:, I:]
    register_ptx(add_kernel, (f2, f2, f2))
    register_ptx(copy_kernel, (f2, f2))
    register_ptx(argmax_rows_kernel, (f2, int64[::1]))
    register_ptx(argmax_split_kernel, (f2, int64[::1], f2, int32[:, ::1], int32[::1], int64))


_register()
