"""Dense projection ``y[M, N] = x[M, K] @ W[N, K]^T`` (+ ``y`` with ``accumulate``), every linear layer.

x float32; W float32 or bf16 stored as uint16 (``W[out, in]`` as in checkpoints); fp32 accumulation.
:func:`linear` picks one of two kernels by the number of tokens M:

- **skinny** (decode / small verification batches, ``M <= SKINNY_MAX_M``): a block of 4 or 8 warps;
  each warp owns ``NR`` consecutive output rows n and streams ``W[n, :]`` once per tile of ``TM``
  tokens (the re-read for the next token tile is immediate and comes from L1/L2). The block stages
  ``x[m0:m0+TM, chunk]`` in shared memory (``XS_FLOATS`` floats per chunk of K) and all its warps
  read it from there. Lanes read consecutive 32-bit words of a weight row: one float32, or, for bf16
  with even K, a *pair* of bf16 (W viewed as int32, so one warp load moves 128 bytes either way);
  ``U`` words per row per lane are loaded before any is used. The ``TM x NR`` per-thread
  accumulators are scalar registers (the kernel source is generated with every compile-time loop
  written out); the 32 lane partial sums are combined with a transposed warp-shuffle reduction
  (GPU) or through shared memory (simulator). (TM, NR, warps) by M: (1, 2, 8) for M = 1, (4, 2, *)
  for M <= 4, (8, 4, *) above; * = 8 warps when N >= 4096, else 4.
- **wide** (prefill / large trees, ``M > SKINNY_MAX_M``): a classic shared-memory tiled GEMM,
  ``WIDE_BM x WIDE_BN`` output tile per block of 256 threads, ``WIDE_BK``-wide K tiles,
  ``WIDE_RM x WIDE_RN`` outputs per thread in registers; edges bounds-checked, so any M, N, K works.

Measured on one H200 (numba-cuda 0.30.4, bf16 weights, kernel time without launch overhead; copy
bandwidth there ~3.0-3.4 TB/s read+write): M = 1 streams W at 2.2 TB/s (7168 x 8192) to 2.9 TB/s
(lm_head 163840 x 2048, 232 us); M = 16 on 7168 x 8192 takes 346 us, M = 32 688 us; the tiled
GEMM reaches ~12 TFLOP/s (fp32 CUDA cores, no tensor cores) for M >= 128. Reading x straight from
L1 instead of staging it was 1.5-2x slower and was dropped.

The NumPy reference is :func:`linear_ref` (= :func:`kdt.reference.ops.linear`).
"""

from __future__ import annotations

import linecache
from functools import cache

import numpy as np
from numba import cuda, float32, int32, int64, uint16

from kdt.kernels.common import IS_SIM, WARP, bf16_to_f32, cdiv, register_ptx
from kdt.reference.ops import linear as linear_ref  # noqa: F401  (re-exported for tests / callers)

__all__ = ["linear", "linear_ref", "SKINNY_MAX_M"]

# ---- tuning constants ------------------------------------------------------------------------------
SKINNY_MAX_M = 48  # M <= this -> skinny kernel, else the tiled GEMM (crossover measured on the H200)
SKINNY_WORDS_IN_FLIGHT = 8  # U * NR: 32-bit weight words each lane loads before using them
# floats of x staged per block and K-chunk (16 KiB). Small in the simulator so that the tiny test
# shapes span several chunks and exercise the chunk loop.
XS_FLOATS = 256 if IS_SIM else 4096

WIDE_BM, WIDE_BN, WIDE_BK = 64, 64, 16  # output tile (tokens x rows) and K tile of the GEMM
WIDE_RM, WIDE_RN = 4, 4  # outputs per thread
_WIDE_PAD = 1  # shared-memory row padding (bank conflicts of the transposed tile stores)


def _skinny_config(M: int, N: int) -> tuple[int, int, int]:
    """(TM, NR, warps): tokens per tile, weight rows per warp and warps per block for M tokens, N rows.

    Measured on the H200 (bf16): 8 warps per block pay when there are enough rows to fill the GPU
    (fewer, longer-lived blocks share each staged x chunk among more rows)."""
    if IS_SIM:  # every simulated thread is a Python thread: 2 warps still exercise the shared x tile
        warps = 2
    else:
        warps = 8 if (M <= 1 or N >= 4096) else 4
    if M <= 1:
        return 1, 2, warps
    if M <= 4:
        return 4, 2, warps
    return 8, 4, warps


# ---- weight-word unpacking ---------------------------------------------------------------------------
# A "word" is what one lane loads at once: a float32 ("f32"), one bf16 as uint16 ("bf16", odd K or
# non-contiguous W) or two bf16 packed in an int32 ("bf16x2": low half = even k, high half = odd k).
if IS_SIM:

    @cuda.jit(device=True)
    def _bf16x2_unpack(w, p):
        """int32 holding bf16 pair -> float32 of element p (0 = low half, 1 = high half)."""
        bits = (int(w) << 16) & 0xFFFFFFFF if p == 0 else int(w) & 0xFFFF0000
        return np.uint32(bits).view(np.float32)

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _bf16x2_unpack(w, p):
        """int32 holding a bf16 pair -> float32 of element p (0 = low half, 1 = high half)."""
        if p == 0:
            return libdevice.int_as_float(int32(w << int32(16)))
        return libdevice.int_as_float(int32(w & int32(-65536)))


@cuda.jit(device=True, inline=True)
def _f32_unpack(w, p):
    return w


@cuda.jit(device=True, inline=True)
def _bf16_unpack(w, p):
    return bf16_to_f32(w)


# kind -> (unpack device function, elements per word, numba type of a word)
_KINDS = {
    "f32": (_f32_unpack, 1, float32),
    "bf16": (_bf16_unpack, 1, uint16),
    "bf16x2": (_bf16x2_unpack, 2, int32),
}


# ---- source generation ------------------------------------------------------------------------------
# The per-thread accumulators must stay in registers. Numba/NVVM do not reliably fully unroll nested
# ``for t in range(TM)`` loops once the nest is large (the accumulator array then lands in local memory;
# seen with numba-cuda 0.30 for TM x NR = 8), so the kernels are generated as Python source with every
# compile-time loop written out and every accumulator a scalar variable (acc_t_r), then cuda.jit-ed.
def _jit_source(src: str, name: str, namespace: dict):
    """exec the generated kernel source, make it visible to tracebacks, and cuda.jit it."""
    filename = f"<kdt.kernels.linear generated {name}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    ns = dict(namespace)
    exec(compile(src, filename, "exec"), ns)  # noqa: S102 - our own generated source
    return cuda.jit(ns[name])


class _Src:
    """Tiny indented-source builder."""

    def __init__(self):
        self.lines: list[str] = []
        self.depth = 0

    def __call__(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)

    def block(self, line: str):
        self(line)
        return self

    def __enter__(self):
        self.depth += 1

    def __exit__(self, *exc):
        self.depth -= 1

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


# ---- skinny kernel ---------------------------------------------------------------------------------
def _skinny_params(kind: str, TM: int, NR: int, warps: int) -> dict:
    _, PACK, _ = _KINDS[kind]
    U = max(1, SKINNY_WORDS_IN_FLIGHT // NR)  # words per row per lane per step
    STEP = WARP * U  # words of a row a warp consumes per step
    KCW = max(STEP, (XS_FLOATS // (TM * PACK)) // STEP * STEP)  # words per K-chunk (multiple of STEP)
    return dict(TM=TM, NR=NR, U=U, PACK=PACK, WARPS=warps, NT=warps * WARP, STEP=STEP,
                KCW=KCW, KCE=KCW * PACK, NV=TM * NR)


def _skinny_source(TM: int, NR: int, U: int, PACK: int, NV: int, **_) -> str:
    """Python source of the skinny kernel for one (TM, NR, U, PACK), every compile-time loop unrolled."""
    assert NV <= WARP and (NV & (NV - 1)) == 0, "TM * NR must be a power of two <= 32"
    T, R, Us, Ps = range(TM), range(NR), range(U), range(PACK)
    s = _Src()

    with s.block("def linear_skinny(x, W, y, accumulate):"):
        s('"""x[M, K] f32, W[N, Kw] weight words (Kw = K / PACK), y[M, N] f32: y = x @ W^T (+ y).')
        s("")
        s("grid = cdiv(N, WARPS * NR) blocks of WARPS warps; warp w of block b owns the NR rows")
        s("n0 = (b * WARPS + w) * NR ..; each lane accumulates acc_t_r over k = word lane, lane + 32, ..")
        s('"""')
        s("M, K = x.shape")
        s("N, Kw = W.shape")
        s("xs = cuda.shared.array(XS_SHAPE, float32)  # xs[p, t, i] = x[m0 + t, (c0 + i) * PACK + p]")
        if IS_SIM:
            s("red = cuda.shared.array(RED_SHAPE, float32)")
        s("tid = cuda.threadIdx.x")
        s("lane = tid % WARP")
        s("warp = tid // WARP")
        s("n0 = (cuda.blockIdx.x * WARPS + warp) * NR")
        for r in R:  # clamped rows: rows >= N are computed but never written
            s(f"n_{r} = min(n0 + {r}, N - 1)")
        with s.block("for m0 in range(0, M, TM):  # token tiles (uniform across the block)"):
            for t in T:
                s(" = ".join(f"acc_{t}_{r}" for r in R) + " = float32(0.0)")
            with s.block("for c0 in range(0, Kw, KCW):  # K-chunks, in words"):
                s("cw = min(KCW, Kw - c0)")
                s("ce = cw * PACK  # valid elements of the chunk")
                s("cp = (cw + STEP - 1) // STEP * STEP * PACK  # staged elements (zero past K)")
                s("cuda.syncthreads()  # everyone is done with the previous chunk")
                for t in T:  # stage x[m0 + t, chunk]; coalesced along k; zeros past K and past M
                    with s.block("for r in range(tid, cp, NT):"):
                        s(f"xs[r % PACK, {t}, r // PACK] = x[m0 + {t}, c0 * PACK + r] if (r < ce and m0 + {t} < M) "
                          "else float32(0.0)")
                s("cuda.syncthreads()")
                with s.block("if n0 < N:"):
                    with s.block("for i0 in range(0, cw, STEP):  # one STEP of words of the NR rows"):
                        for u in Us:  # issue all U * NR weight loads before using any
                            s(f"i_{u} = i0 + {u * WARP} + lane  # < KCW; xs is 0 past K")
                            for r in R:
                                s(f"w_{u}_{r} = W[n_{r}, c0 + i_{u}] if i_{u} < cw else WZERO")
                        for u in Us:
                            for p in Ps:
                                for r in R:
                                    s(f"f_{r} = unpack(w_{u}_{r}, {p})")
                                for t in T:
                                    s(f"xv = xs[{p}, {t}, i_{u}]")
                                    for r in R:
                                        s(f"acc_{t}_{r} += xv * f_{r}")
            # ---- reduce the 32 lane partials of each accumulator and write
            if IS_SIM:  # no shuffles in the simulator: through shared memory
                for t in T:
                    for r in R:
                        s(f"red[warp, lane, {t * NR + r}] = acc_{t}_{r}")
                s("cuda.syncthreads()")
                s("write = False")
                s("idx = 0")
                s("tot = float32(0.0)")
                with s.block("if lane < NV:"):
                    with s.block("for j in range(WARP):"):
                        s("tot += red[warp, j, lane]")
                    s("idx = lane")
                    s("write = True")
                s("cuda.syncthreads()")
            else:  # transposed shuffle reduction: NV - 1 + (5 - log2 NV) shuffles instead of 5 NV
                vals = [f"acc_{t}_{r}" for t in T for r in R]
                s("idx = 0")
                off = WARP // 2
                while off >= 1:
                    if len(vals) > 1:
                        half = len(vals) // 2
                        s(f"up = (lane & {off}) != 0")
                        s(f"idx += {half} if up else 0")
                        new = []
                        for j in range(half):
                            a, b = vals[j], vals[j + half]
                            s(f"snd = {a} if up else {b}")
                            s(f"kp = {b} if up else {a}")
                            s(f"red_{j} = kp + cuda.shfl_xor_sync(0xFFFFFFFF, snd, {off})")
                            new.append(f"red_{j}")
                        vals = new
                    else:
                        s(f"{vals[0]} += cuda.shfl_xor_sync(0xFFFFFFFF, {vals[0]}, {off})")
                    off //= 2
                s(f"tot = {vals[0]}")
                s(f"write = (lane & {WARP // NV - 1}) == 0  # one lane per output")
            with s.block("if write:"):
                s("t = idx // NR")
                s("n = n0 + idx % NR")
                with s.block("if m0 + t < M and n < N:"):
                    with s.block("if accumulate:"):
                        s("tot += y[m0 + t, n]")
                    s("y[m0 + t, n] = tot")
    return s.text()


@cache
def _skinny_kernel(kind: str, TM: int, NR: int, warps: int):
    """(kernel, rows per block, threads per block) for one weight kind and tile config."""
    unpack, PACK, WT = _KINDS[kind]
    prm = _skinny_params(kind, TM, NR, warps)
    ns = dict(prm, cuda=cuda, float32=float32, unpack=unpack, WARP=WARP, WZERO=WT(0),
              XS_SHAPE=(PACK, TM, prm["KCW"]), RED_SHAPE=(prm["WARPS"], WARP, prm["NV"]))
    kern = _jit_source(_skinny_source(**prm), "linear_skinny", ns)
    return kern, NR * prm["WARPS"], prm["NT"]


# ---- wide kernel (tiled GEMM) -------------------------------------------------------------------------
def _wide_source(BM, BN, BK, RM, RN, NT, **_) -> str:
    TX, TY = BN // RN, BM // RM
    s = _Src()
    with s.block("def linear_wide(x, W, y, accumulate):"):
        s('"""x[M, K] f32, W[N, K] f32|uint16(bf16), y[M, N] f32: y = x @ W^T (+ y).')
        s("")
        s("grid = (cdiv(N, BN), cdiv(M, BM)) blocks of TX * TY threads; thread (tx, ty) computes")
        s("acc_i_j = y[m0 + ty + TY * i, n0 + tx + TX * j] for i < RM, j < RN.")
        s('"""')
        s("M, K = x.shape")
        s("N = W.shape[0]")
        s("xs = cuda.shared.array(XS_SHAPE, float32)  # xs[kk, mm] = x[m0 + mm, k0 + kk]")
        s("ws = cuda.shared.array(WS_SHAPE, float32)  # ws[kk, nn] = W[n0 + nn, k0 + kk]")
        s("tid = cuda.threadIdx.x")
        s(f"tx = tid % {TX}")
        s(f"ty = tid // {TX}")
        s("n0 = cuda.blockIdx.x * BN")
        s("m0 = cuda.blockIdx.y * BM")
        for i in range(RM):
            s(" = ".join(f"acc_{i}_{j}" for j in range(RN)) + " = float32(0.0)")
        with s.block("for k0 in range(0, K, BK):"):
            for q in range(BM * BK // NT):  # BK consecutive k of a row per BK threads: coalesced
                s(f"e = tid + {q * NT}")
                s("mm = e // BK")
                s("kk = e % BK")
                s("xs[kk, mm] = x[m0 + mm, k0 + kk] if m0 + mm < M and k0 + kk < K else float32(0.0)")
            for q in range(BN * BK // NT):
                s(f"e = tid + {q * NT}")
                s("nn = e // BK")
                s("kk = e % BK")
                s("ws[kk, nn] = unpack(W[n0 + nn, k0 + kk], 0) if n0 + nn < N and k0 + kk < K "
                  "else float32(0.0)")
            s("cuda.syncthreads()")
            with s.block("for kk in range(BK):"):
                for i in range(RM):
                    s(f"a_{i} = xs[kk, ty + {TY * i}]")
                for j in range(RN):
                    s(f"b_{j} = ws[kk, tx + {TX * j}]")
                for i in range(RM):
                    for j in range(RN):
                        s(f"acc_{i}_{j} += a_{i} * b_{j}")
            s("cuda.syncthreads()")
        for i in range(RM):
            s(f"m = m0 + ty + {TY * i}")
            with s.block("if m < M:"):
                for j in range(RN):
                    s(f"n = n0 + tx + {TX * j}")
                    with s.block("if n < N:"):
                        s(f"tot = acc_{i}_{j}")
                        with s.block("if accumulate:"):
                            s("tot += y[m, n]")
                        s("y[m, n] = tot")
    return s.text()


@cache
def _wide_kernel(kind: str):
    """(kernel, threads per block) of the tiled GEMM for one weight kind (f32 or bf16)."""
    unpack, PACK, _ = _KINDS[kind]
    assert PACK == 1
    BM, BN, BK, RM, RN = WIDE_BM, WIDE_BN, WIDE_BK, WIDE_RM, WIDE_RN
    NT = (BN // RN) * (BM // RM)
    assert (BM * BK) % NT == 0 and (BN * BK) % NT == 0
    prm = dict(BM=BM, BN=BN, BK=BK, RM=RM, RN=RN, NT=NT)
    ns = dict(prm, cuda=cuda, float32=float32, unpack=unpack,
              XS_SHAPE=(BK, BM + _WIDE_PAD), WS_SHAPE=(BK, BN + _WIDE_PAD))
    return _jit_source(_wide_source(**prm), "linear_wide", ns), NT


# ---- wrapper ---------------------------------------------------------------------------------------
def _weight_kind(W) -> str:
    dt = np.dtype(W.dtype)
    if dt == np.float32:
        return "f32"
    if dt == np.uint16:
        return "bf16"
    raise TypeError(f"unsupported weight dtype {dt}: linear takes float32 or bf16 (stored as uint16)")


def linear(x, W, y, accumulate: bool = False, stream=0) -> None:
    """``y[M, N] = x[M, K] @ W[N, K]^T``, or ``y += x @ W^T`` with ``accumulate`` (fused residual add).

    x: float32 device array [M, K]; W: float32 or uint16 (bf16 bits) device array [N, K];
    y: float32 device array [M, N] (written; read too when ``accumulate``). y must not alias x.
    Launches on ``stream`` and returns without synchronising.
    """
    M, K = x.shape
    N, Kw = W.shape
    if Kw != K or tuple(y.shape) != (M, N):
        raise ValueError(f"linear: x {tuple(x.shape)}, W {tuple(W.shape)}, y {tuple(y.shape)} do not match")
    if np.dtype(x.dtype) != np.float32 or np.dtype(y.dtype) != np.float32:
        raise TypeError("linear: x and y must be float32")
    if M == 0 or N == 0:
        return
    kind = _weight_kind(W)
    acc = 1 if accumulate else 0
    if M <= SKINNY_MAX_M:
        if kind == "bf16" and K % 2 == 0 and W.is_c_contiguous():
            W, kind = W.view(np.int32), "bf16x2"  # two bf16 per 32-bit load
        kern, rows_per_block, nt = _skinny_kernel(kind, *_skinny_config(M, N))
        kern[cdiv(N, rows_per_block), nt, stream](x, W, y, acc)
    else:
        kern, nt = _wide_kernel(kind)
        kern[(cdiv(N, WIDE_BN), cdiv(M, WIDE_BM)), nt, stream](x, W, y, acc)


# ---- sm_90 compile check: both paths, every weight-word kind, every skinny tile config -----------------
def _register() -> None:
    x2 = float32[:, ::1]
    for kind, (_, _, wt) in _KINDS.items():
        for M, N in ((1, 2048), (4, 2048), (SKINNY_MAX_M, 4096)):
            TM, NR, warps = _skinny_config(M, N)
            kern, _, _ = _skinny_kernel(kind, TM, NR, warps)
            register_ptx(kern, (x2, wt[:, ::1], x2, int64), name=f"linear_skinny_{kind}_{TM}x{NR}_w{warps}")
        if kind != "bf16x2":
            register_ptx(_wide_kernel(kind)[0], (x2, wt[:, ::1], x2, int64), name=f"linear_wide_{kind}")


_register()
