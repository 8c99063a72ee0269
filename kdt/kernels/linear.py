"""Dense projection ``y[M, N] = x[M, K] @ W[N, K]^T`` (+ ``y`` with ``accumulate``), every linear layer.

x float32; W float32 or bf16 stored as uint16 (``W[out, in]`` as in checkpoints); fp32 accumulation.
Two generations of kernels sit side by side (llm.c style); :func:`linear` picks by ``VERSION``
(env ``KDT_LINEAR_VERSION``, default "2") and M: v2 for ``V2_MIN_M <= M <= V2_MAX_M`` (env
``KDT_LINEAR_V2_MIN_M`` / ``_MAX_M``, default 1 .. unbounded: v2 won at every measured M, see
below), v1 otherwise. :func:`linear_v1` and
:func:`linear_v2` run one family directly (``scripts/bench_linear.py`` times both).

v1 picks one of two kernels by the number of tokens M:

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

Measured on one H200 (numba-cuda 0.30.4, bf16 weights, kernel time without launch overhead): M = 1
streams W at 66-71% of the copy bandwidth on the lm_head, but M = 16..64 runs at 0.7-8 TFLOP/s
(docs/PERF.md): each warp walks its K range as a chain of dependent load -> use round trips with
~1-2 blocks per SM, the staging of x costs ~50 integer instructions per element (Numba's signed
index wrap-around, 64-bit address arithmetic), and the wide kernel has 9-48 blocks for N <= 3072.

**v2** (any M; one kernel, generated per (weight kind, TM)): block (bx, by, s) of ``V2_WARPS`` warps
computes tokens ``bx*TM ..`` x rows ``by*32 ..`` over the K-split ``s``; each warp owns ``V2_NR`` = 8
rows, each lane a ``TM x 8`` register tile (TM = 1, 4, 8 or 16 by M) over the words lane, lane + 32,
.. of its range: per weight word (two bf16) it widens each half once and uses it for TM tokens, and
each x value it loads from shared memory (staged per block, K-chunks of up to ``V2_KCW`` words)
serves 8 rows, so the hot loop is ~70% FFMA for TM = 16 (SASS: 256 FFMA, 32 LDS, 8 LDG of 367
instructions per step). The next step's weight words are loaded before the current step's FMAs
(double-buffered registers), and hot-loop indices are uint32 over a flat W (no wrap-around code). x is
staged by unrolled loads, all in flight at once, also for a partial chunk (clamped, zeros past its end).
Small N would leave SMs idle (N = 576: 18 row blocks), so :func:`_v2_plan` splits K into S pieces by
a wave-quantisation model; each piece writes its partial sums to a cached scratch ``[S, M, N]``
(allocated on a shape's first call, kept: CUDA-graph safe), and the last block of each output tile
to finish (an atomic ticket per tile) adds them in split order in the same launch (no float
atomics: bitwise identical run to run; a separate reduce kernel cost Moonlight's decode step 83 of
its 486 launches). The 32 lane partials of each output are
reduced through shared memory (rotated reads, no bank conflicts), the same code in the simulator.
ptxas (sm_90): 76 / 108 / 128 / 255 registers for TM = 1 / 4 / 8 / 16, no spills; Numba compiles
each variant in ~4-15 s. Measured on the H200 (``scripts/bench_linear.py``, bf16, GPU-only, every
Moonlight / Kimi-K2 projection; docs/perf/linear-v1-v2-2026-11-29-bf16.json): v2 over v1 1.0-2.5x at
M = 1 (lm_head at 96-100% of the copy bandwidth), 1.6-4.1x at M = 4, 1.5-12x at M = 16, 2.2-23x at
M = 64, 1.7-3.0x at M = 512; 17-25 TFLOP/s from M = 64 (fp32 FMA, no tensor cores). Small matrices
(a small model's, fixtures/model_code.h5) are latency-bound: there :func:`_v2_plan` takes smaller token
tiles (``V2_SHRINK_TM``), 3.1-6.5 us a launch at M = 16-32 (docs/PERF.md, session 9).

The NumPy reference is :func:`linear_ref` (= :func:`kdt.reference.ops.linear`).
"""

from __future__ import annotations

import math
import os
from functools import cache

import numpy as np
from numba import boolean, cuda, float32, int32, int64, uint16, uint32, uint64

from kdt.kernels import elementwise as ew
from kdt.kernels import tc, tc_tiled
from kdt.kernels.common import IS_SIM, WARP, Src, bf16_to_f32, cdiv, jit_source, ldcg2, ldcg3, register_ptx
from kdt.reference.ops import linear as linear_ref  # noqa: F401  (re-exported for tests / callers)

__all__ = ["linear", "linear_v1", "linear_v2", "linear_tc", "linear_ref", "SKINNY_MAX_M"]

# ---- tuning constants ------------------------------------------------------------------------------
SKINNY_MAX_M = 48  # M <= this -> skinny kernel, else the tiled GEMM (crossover measured on the H200)
SKINNY_WORDS_IN_FLIGHT = 8  # U * NR: 32-bit weight words each lane loads before using them
# floats of x staged per block and K-chunk (16 KiB). Small in the simulator so that the tiny test
# shapes span several chunks and exercise the chunk loop.
XS_FLOATS = 256 if IS_SIM else 4096

WIDE_BM, WIDE_BN, WIDE_BK = 64, 64, 16  # output tile (tokens x rows) and K tile of the GEMM
WIDE_RM, WIDE_RN = 4, 4  # outputs per thread
_WIDE_PAD = 1  # shared-memory row padding (bank conflicts of the transposed tile stores)

# v2 (see the module docstring). Which kernel linear() runs: KDT_LINEAR_VERSION=1 -> v1 (skinny / wide)
# for every M; =2 (default) -> v2 for V2_MIN_M <= M <= V2_MAX_M, v1 outside. Module attributes, read at
# every call, so a script may also set them (scripts/bench_linear.py calls linear_v1 / linear_v2).
# Prediction behind the default (not yet measured): v2 is 4-10x faster at M = 16..64 (v1 there is
# latency-bound at 1-8 TFLOP/s; v2's hot loop is ~70% FFMA with the next weights in flight and fills
# the SMs by K-splits: expect ~25-30 TFLOP/s on large N, ~10 us for N = 576), ~2-3x at M = 2..8 (same
# weight bytes, shorter dependent-load chains), and faster than the tiled GEMM at every M > 48 (that
# one issues 2 FMAs per shared load and has 9-48 blocks for N <= 3072). M = 1 stays on v1 (the lm_head
# already streams at 66-71% of the copy bandwidth there), pending a measurement.
VERSION = os.environ.get("KDT_LINEAR_VERSION", "2")
V2_MIN_M = int(os.environ.get("KDT_LINEAR_V2_MIN_M", "1"))
V2_MAX_M = int(os.environ.get("KDT_LINEAR_V2_MAX_M", str(1 << 30)))
V2_NR = 8  # weight rows per warp (FMAs per shared-memory load of x)
# words per row per lane per step, by TM (2 * U * V2_NR weight words live per lane: double-buffered);
# U = 2 halves the loop overhead per FMA where registers allow (TM = 16 already needs ~255)
V2_U = {1: 2, 2: 2, 4: 2, 8: 2, 16: 1}
V2_WARPS = 2 if IS_SIM else 4  # warps per block (row groups sharing one staged x tile)
V2_KCW = 64 if IS_SIM else 256  # weight words per staged K-chunk (x chunk: TM x V2_KCW * PACK floats)
# Resident blocks per SM by TM (ptxas -v for sm_90, 4 warps: 76 / 80 / 110 / 128 / 255 registers per
# thread for TM = 1 / 2 / 4 / 8 / 16), the "slots" of one wave when choosing the K-split.
V2_BLOCKS_PER_SM = {1: 6, 2: 6, 4: 4, 8: 4, 16: 2}
V2_MIN_STEPS = 4  # at least this many steps per lane per K-split
V2_SPLIT_FIXED = 2  # per-block cost besides its steps (start-up latency, reduction), in steps
V2_SPLIT_REDUCE = 4  # cost of the reduce kernel, in steps
V2_MAX_SPLITS = 32
# Small-weight rule (env KDT_LINEAR_V2_SHRINK_TM, default "1"; "0" turns it off). A launch over a small
# matrix is bound by the latency of one block, and that grows with the token tile (x staging, 1-4
# reduction batches, more FMAs per step). So the tile halves (16 -> 8 -> 4) while the plan of the halved
# tile, K-split re-planned, still fits one wave of resident blocks and its token tiles together read at
# most V2_SHRINK_WORDS weight words (each tile streams the whole matrix; 12 MB: a small model's L2-resident
# weights, read in about a microsecond). Measured on the H200, fixtures/model_code.h5's 12 projections at
# M = 16 / 17 / 32 (scripts/bench_linear.py --fixture; docs/PERF.md, session 9): the _v2_tm tile took
# 3.7-13.0 us a launch, this rule's 3.1-6.5 (within 0.2 us of the best of 9 plans everywhere). Moonlight
# and Kimi-K2 projections are too large for two token tiles: their plans do not change.
V2_SHRINK_TM = os.environ.get("KDT_LINEAR_V2_SHRINK_TM", "1") == "1"
V2_SHRINK_WORDS = 3 << 20
# RMSNorm folded into linear_v2's staging of x (``linear(..., norm=...)``; env KDT_LINEAR_FUSE_NORM, "0" turns it
# off). Of the learned budget-16 step's 119 launches, 24 are rmsnorm (1.7-2 us each plus ~1.3 us of gap); the
# engine passes 13 of them (each layer's input norm, the dense layers' post-attention norm, the final norms)
# through ``norm``. Each fused launch first sums the squares of its token rows (one more pass over x, from L2).
# Predicted: the learned step ~5-8% faster, the AR step ~10%. Measured (H200, session 10, the drafter table on
# and off back to back on one machine, docs/perf/drafter-2026-11-30-model_code-cuda-{fused,unfused}-norm.json):
# AR 4873 -> 5099 tok/s (+4.6%), learned chain 9915 -> 10102 (+1.9%), budget 16 / 64 / 256 within 0.7%; kdt
# verify 15/15 (model_code bf16) and 12/12 (tiny fp32) with it on. Smaller than predicted: the squares pass
# costs part of what the launch saved. On by default, for small weights only (``fuses_norm``): every block
# of a fused launch first reads its token rows of x once more for the squares, which costs nothing where the
# launch itself is the cost (a small matrix) but doubles the x traffic of a large one at large M. Moonlight,
# scripts/ab_fused_norm.py all / rule, one machine, twice each: verify n = 16 / 64 / 256 at L = 512 fused
# everywhere 14.45 / 41.22 / 132.3 ms, by the rule (none of its projections) 13.65 / 39.10 / 124.5 ms.
FUSE_NORM = os.environ.get("KDT_LINEAR_FUSE_NORM", "1") == "1"
# ... and at M <= FUSE_NORM_MAX_M (env KDT_LINEAR_FUSE_NORM_M; 0: small weights only) for every matrix of at most
# FUSE_NORM_M_WORDS weight words. At one token the squares pass is one more 8 KB read per block, against a launch
# of one 512-thread block (the rmsnorm: 2.9 us in the graph) and its ~0.7 us gap. Session 23, the Moonlight AR
# step launch by launch (H200, docs/perf/profile-graphs-2026-12-02-moonlight-s23{a,c}.json): 55 rmsnorm launches,
# 160 us; 28 of them go through ``linear``. Predicted ~3 us a layer, ~80 us of the 2.94 ms step. With the block-wide
# squares prologue: [q | kv_a] 6.65 + 2.9 -> 8.3 us, the dense gate_up 26.0 + 2.9 -> 27.7, the AR step 2904 ->
# 2842 us (same machine, the fold off / on); but lm_head 153.5 + 2.9 -> 163.9: its 5120 blocks (~5 waves) each
# pay the prologue, so the vocabulary projection (168 M words) keeps the separate norm.
FUSE_NORM_MAX_M = int(os.environ.get("KDT_LINEAR_FUSE_NORM_M", "1"))
FUSE_NORM_M_WORDS = 1 << 26
# silu(gate) * up folded into linear_v2's staging of x (``linear(..., glu=a)``: the dense MLP's down projection
# reads gu[M, 2I] = [gate | up] itself): dense_mlp then takes 2 launches, not 3. Env KDT_LINEAR_FUSE_GLU, "1"
# turns it on; OFF by default. Predicted: silu_mul's ~1.3 us of kernel and ~1 us of graph gap less per dense
# layer and step. Measured (H200, session 18, issue 8's table alternated on one machine, docs/PERF.md): the
# learned budget-16 step lost 0.3-2.5% with it on (15995 / 15715 tok/s against 16048 / 16493 off), AR gained
# ~1% (5526 / 5551 against 5495 / 5455). Every row block and K-split of a token tile recomputes silu of the
# same elements (an IEEE divide and expf, ~20 instructions, per 32 FMAs that element feeds): at the drafter's
# 32 rows (4-row tiles, 8 row blocks, 4 K-splits) that costs what the launch saved. Also for small weights only
# (``fuses_glu``, the bound of ``fuses_norm``): a compute-bound launch would pay up to ~half its instructions
# (Moonlight's dense down, 2048 x 11264 at M = 512), where the separate silu_mul is cheap beside the GEMM.
FUSE_GLU = os.environ.get("KDT_LINEAR_FUSE_GLU", "0") == "1"
# The norm *after* a projection folded into it (``linear(..., post=(pw, eps, a, a_hl))``, linear_v2's POST; env
# KDT_LINEAR_POST_NORM_M: at M <= this, 0: off). The engine's o_proj at one token (x += o_proj(o)) writes the MoE's
# input a = rmsnorm(x) too: the block that finishes a token tile's last output tile (a second ticket after the
# split-K's) sums the squares of the row as elementwise.rmsnorm's 512-thread block does (each of its 128 threads in
# the place of 4; the same loads, partial sums and shuffles) and writes a, bit for bit the separate norm's. At M = 1
# the norm is a launch of one block (2.7 us alone in the AR step's graph, s52c) plus its ~2 us of graph gap, for 8 KB;
# the tail is ~1-1.5 us on o_proj's last tile (a fence, an atomic, 2048 floats through L2, a block sum). Predicted:
# ~3 us a MoE layer at one token, ~80 us of the Moonlight AR step (26 layers). Off until timed.
POST_NORM_MAX_M = int(os.environ.get("KDT_LINEAR_POST_NORM_M", "0"))
# Tensor cores (kdt.kernels.tc: mma.sync m16n8k16, bf16 weights, x as bf16 hi + lo, fp32 sums): at M >= TC_MIN_M a
# bf16 matrix of at least TC_MIN_WEIGHTS weights (K a multiple of 4) runs :func:`linear_tc` (session 26, on by
# default since session 27). v2's FMA tiles are bound by fp32 FMA issue from M = 16 (17-25 TFLOP/s at M = 64:
# Moonlight's lm_head 2.04 ms at M = 64 in session 26's budget-63 step, ~13x its bytes). Small matrices (a small
# model's, latency-bound, tuned in session 9) keep v2, as do the launches that fold a norm or silu * up into it.
# Measured (H200, s27a, `scripts/bench_linear.py --presets moonlight-16b-a3b --M 16,64,256 --tc ""`, v2 / tensor
# cores in us): lm_head 566 / 318, 2041 / 1005, 7792 / 3809 at M = 16 / 64 / 256; q_a + kv_a (3648 x 2048) 20.4 /
# 13.4, 56.7 / 36.7; o_proj 14.8 / 12.8, 30.2 / 19.8; the dense gate_up 87.9 / 65.2, 291.7 / 153.2; the dense down
# (2048 x 11264) 48.2 / 53.6 at M = 16 (v2 wins: 64 blocks, long K), 148.4 / 101.5 at M = 64. So on from M = 16
# (env KDT_LINEAR_TC_M; 0: never), except K > TC_LONG_K N below M = 32.
TC_MIN_M = int(os.environ.get("KDT_LINEAR_TC_M", "16"))
# The block-tiled tensor-core GEMM (kdt.kernels.tc_tiled, session 36: weight and x tiles staged in shared memory, a
# weight fragment on up to 8 token tiles) in place of the warp tile from TILED_MIN_M tokens, for a weight of at least
# TILED_MIN_N rows, where K % 32 == 0 and x is contiguous. Measured (H200, session 39's s36c, `scripts/bench_linear.py
# --presets moonlight-16b-a3b --M 16,32,64,65,128,256 --tiled`, hi / lo x, warp tile / tiled in us): the lm_head
# (163840 x 2048) 611.7 / 659.0 at 64 tokens, 764.5 / 685.3 at 65 (the warp tile's blocks of 32 tokens leave 31 of the
# third idle), 1162.3 / 1130.3 at 128, 2310.0 / 2228.9 at 256; every other Moonlight shape slower tiled at every M
# (the dense gate_up, 22528 rows, 325.1 / 364.9 at 256; qkv_a 32.1 / 71.7 at 65: too few blocks of 128 rows). So the
# lm_head's rows from 65 tokens (a budget-64 verify, a prefill chunk). Env KDT_LINEAR_TILED_M (0: never) and
# KDT_LINEAR_TILED_N.
TILED_MIN_M = int(os.environ.get("KDT_LINEAR_TILED_M", "65"))
TILED_MIN_N = int(os.environ.get("KDT_LINEAR_TILED_N", "65536"))
TC_LONG_K = 4
TC_MIN_WEIGHTS = 1 << 20
# The warps a block of linear_tc's warp tile where N <= 4096 and K <= 4096: 8 (all on K: more loads in flight for a
# small matrix) while the grid holds at most TC_WIDE_BLOCKS blocks, else 4 (a second wave of 8-warp blocks waits
# while 4-warp blocks share the SMs). 264: two 8-warp blocks on each of the H100 / H200's 132 SMs. Measured (s47a,
# H100, `scripts/bench_linear.py --presets moonlight-16b-a3b --M 64,65 --tc 64,65`, hi / lo x, 8 / 4 warps in us):
# qkv_a (3648 x 2048) at 65 tokens (3 blocks of 3 token tiles x 114 of 32 rows = 342 blocks) 30.6 / 23.6, at 64
# (228 blocks) 21.8 / 24.4; o_proj (2048 x 2048) at 65 (192 blocks) 17.3 / 19.6; the dense down (2048 x 11264, long
# K) 69.1 / 85.9 at 65. Env KDT_TC_WIDE_BLOCKS (0: 8 warps at any grid, session 46's rule).
TC_WIDE_BLOCKS = int(os.environ.get("KDT_TC_WIDE_BLOCKS", "264"))
# A tensor-core linear after a norm (``linear(..., norm=...)``: the lm_head, [q_a | kv_a]) has the norm write x
# already split into bf16 hi and lo (kdt.kernels.tc.XL_HILO, in the norm scratch's bytes): the warp tile then loads
# two words a token tile and k group, not four floats and the ~50 integer instructions that split them (at the
# lm_head's plan, 4 token tiles, ~200 a step of 16 mma). Measured (H200, s28a, `scripts/bench_linear.py --presets
# moonlight-16b-a3b --M 16,64,256 --tc ""`, float32 / hi / lo x in us): lm_head 343.9 / 218.3, 1003.1 / 608.8,
# 3810.8 / 2295.7 at M = 16 / 64 / 256; [q_a | kv_a] 12.6 / 10.7, 36.8 / 21.1, 118.3 / 69.5 (o_proj 19.9 / 14.9
# and the dense down 105.2 / 71.6 at M = 64 would gain as much, their producers still write float32).
# Env KDT_LINEAR_HILO_X=0: the norm writes float32.
TC_HILO_X = os.environ.get("KDT_LINEAR_HILO_X", "1") != "0"
# linear_tc reads the weights' fragment-ordered copy (``fo``) from FO_MIN_M tokens, where tc_plan's warps keep 2
# groups in flight; at 16 tokens (4 groups) it read slower (session 49, H100, `scripts/bench_linear.py --tc 0`: qkv_a
# 11.9 us natural / 12.7 fragment order, o_proj 10.5 / 11.9; at 65 tokens 23.6 / 22.4 and 17.2 / 13.7). Env
# KDT_LINEAR_FO_M.
FO_MIN_M = int(os.environ.get("KDT_LINEAR_FO_M", "33"))


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


# v2 widens weight words with expressions written into the generated source (on the GPU; the simulator
# calls these device functions): a Numba device function call either grows the kernel's Numba IR
# (inline="always") or needs a GPU to compile (so no CPU-only sm_90 check), and Numba's IR passes grow
# faster than linearly with the size of these large kernels.
if IS_SIM:

    @cuda.jit(device=True)
    def _v2_lo(w):
        return np.uint32((int(w) << 16) & 0xFFFFFFFF).view(np.float32)

    @cuda.jit(device=True)
    def _v2_hi(w):
        return np.uint32(int(w) & 0xFFFF0000).view(np.float32)

    @cuda.jit(device=True)
    def _v2_bf16(w):
        return np.uint32(int(w) << 16).view(np.float32)

    _V2_UNPACK_SIM = {"f32": ("{}",), "bf16": ("unpack_b({})",), "bf16x2": ("unpack_lo({})", "unpack_hi({})")}
_V2_UNPACK = {  # kind -> per element of the word: source expression of its float32 value
    "f32": ("{}",),
    "bf16": ("i2f(int32({}) << int32(16))",),
    "bf16x2": ("i2f(int32({} << int32(16)))", "i2f(int32({} & int32(-65536)))"),
}


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
    s = Src()

    with s.block("def linear_skinny(x, W, y, accumulate):"):
        s('"""x[M, K] f32, W[N, Kw] weight words (Kw = K / PACK), y[M, N] f32: y = x @ W^T (+ y).')
        s("")
        s("grid = cdiv(N, WARPS * NR) blocks of WARPS warps; warp w of block b owns the NR rows")
        s("n0 = (b * WARPS + w) * NR ..; each lane accumulates acc_t_r over k = word lane, lane + 32, ..")
        s('"""')
        s("grid_dependency_wait()  # first (kdt.kernels.common, PDL)")
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
    kern = jit_source(_skinny_source(**prm), "linear_skinny", ns, __name__)
    return kern, NR * prm["WARPS"], prm["NT"]


# ---- wide kernel (tiled GEMM) -------------------------------------------------------------------------
def _wide_source(BM, BN, BK, RM, RN, NT, **_) -> str:
    TX, TY = BN // RN, BM // RM
    s = Src()
    with s.block("def linear_wide(x, W, y, accumulate):"):
        s('"""x[M, K] f32, W[N, K] f32|uint16(bf16), y[M, N] f32: y = x @ W^T (+ y).')
        s("")
        s("grid = (cdiv(N, BN), cdiv(M, BM)) blocks of TX * TY threads; thread (tx, ty) computes")
        s("acc_i_j = y[m0 + ty + TY * i, n0 + tx + TX * j] for i < RM, j < RN.")
        s('"""')
        s("grid_dependency_wait()  # first (kdt.kernels.common, PDL)")
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
    return jit_source(_wide_source(**prm), "linear_wide", ns, __name__), NT


# ---- v2: register-tiled, split-K kernel (M = 2 .. V2_MAX_M) --------------------------------------------
def _v2_params(kind: str, TM: int, NR: int, U: int, warps: int) -> dict:
    _, PACK, _ = _KINDS[kind]
    NT = warps * WARP
    STEP = WARP * U  # words of a row a warp consumes per step
    NV = TM * NR
    assert NV & (NV - 1) == 0 and NR & (NR - 1) == 0, "TM * NR and NR must be powers of two"
    # words per staged K-chunk: V2_KCW, or less where the x tile and the reduction buffer
    # (warps x min(NV, 32) x 32 floats) would pass the 48 KiB of static shared memory
    red_floats = warps * min(NV, WARP) * WARP
    KCW = min(V2_KCW, (12288 - red_floats) // (PACK * TM) // STEP * STEP)
    assert KCW >= STEP and KCW % STEP == 0
    return dict(TM=TM, NR=NR, U=U, PACK=PACK, WARPS=warps, NT=NT, STEP=STEP, KCW=KCW, KCE=KCW * PACK, NV=NV)


def _emit_xor_sum(s: Src, v: str) -> None:
    """Emit a warp's all-reduce of float32 ``v`` by xor shuffles (every lane gets the sum; GPU only)."""
    for off in (16, 8, 4, 2, 1):
        s(f"{v} += cuda.shfl_xor_sync(0xFFFFFFFF, {v}, {off})")


def _emit_last_ticket(s: Src, flag: str, index: str, count: str, why: str) -> None:
    """Emit a block's ticket: after a fence (``why``: what it publishes), thread 0 takes one of
    ``tickets[index]``; shared ``flag[0]`` is 1 in the block that takes the last of ``count``, else 0."""
    s(f"{flag} = cuda.shared.array(1, int32)")
    s(f"cuda.threadfence()  # {why}")
    s("cuda.syncthreads()")
    with s.block("if tid == 0:"):
        s(f"{flag}[0] = 1 if cuda.atomic.add(tickets, {index}, 1) == {count} - 1 else 0")
    s("cuda.syncthreads()")


def _v2_source(TM: int, NR: int, U: int, PACK: int, NT: int, STEP: int, KCW: int, KCE: int, NV: int,
               UNPACK: tuple, WARPS: int, NORM: bool = False, GLU: bool = False, POST: bool = False, **_) -> str:
    """Python source of the v2 kernel for one (TM, NR, PACK), every compile-time loop unrolled.

    Hot-loop indices are uint32 (Numba adds a negative-index wrap-around to every signed index) and
    each weight row is a 1-D view taken once, so a step costs NR loads and next to no integer work.
    NORM: x is RMS-normalised as it is staged (y = rmsnorm(x; gw, eps) @ W^T): the block first sums the
    squares of every whole row of its token tile (each thread NT-strided columns), rstd lands in shared rs[t].
    GLU: x is [M, 2K] = [gate | up] and the staged value of column c is silu(x[m, c]) * x[m, c + K] (y =
    (silu(gate) * up) @ W^T), the expression of elementwise.silu_mul_kernel: the same float32 bits.
    POST: then a = rmsnorm(y; pw, peps), written by the block that finishes a token tile's last row tile (see
    :func:`_emit_post_norm`)."""
    assert not (NORM and GLU), "one prologue at a time"
    T, R, Us, Ps = range(TM), range(NR), range(U), range(PACK)
    fast = KCE % NT == 0  # full chunks are staged with compile-time offsets
    s = Src()

    def staged(load: str, c: str, rstd: str) -> str:
        """Source of the value staged for column c of a token row (``load``: the row's element load, "{}" for
        the column; ``rstd``: the row's rstd, NORM). GLU first emits ``g = `` the gate element."""
        if NORM:
            return f"{load.format(c)} * {rstd} * gw[{c}]"
        if GLU:
            s(f"g = {load.format(c)}")
            return f"g / (float32(1.0) + math.exp(-g)) * {load.format(f'{c} + Kg')}"
        return load.format(c)

    extra = (", gw, eps" if NORM else "") + (", pw, peps, a" if POST else "")
    with s.block(f"def linear_v2(x, W, Kw, y, part, tickets, ks, accumulate{extra}):"):
        s('"""x[M, K] f32, W[N * Kw] weight words (row-major [N, Kw], Kw = K / PACK, N * Kw < 2**32),')
        s("y[M, N] f32: y = x @ W^T (+ y), or,")
        s("with gridDim.z = S > 1, part[s, M, N] = the partial sum over words [s * ks, (s + 1) * ks), and")
        s("the block of a tile that takes its last ticket (tickets[tile], zero between launches) sums")
        s("the tile's S partials in split order (+ y): deterministic, and no second launch.")
        s("")
        s("grid (cdiv(M, TM), cdiv(N, WARPS * NR), S); block of WARPS warps. Block (bx, by, s) owns tokens")
        s("m0 = bx * TM .. and words [s * ks, ..); its warp w the NR rows n0 = (by * WARPS + w) * NR ..; each")
        s("lane accumulates acc_t_r (TM x NR registers) over words lane, lane + 32, .. of that range.")
        s('"""')
        s("grid_dependency_wait()  # first (kdt.kernels.common, PDL)")
        s("M = x.shape[0]")
        s("N = y.shape[1]")
        s("xs = cuda.shared.array(XS_SHAPE, float32)  # xs[p, t, i] = x[m0 + t, (c0 + i) * PACK + p]")
        s("red = cuda.shared.array(RED_SHAPE, float32)  # per warp: red[warp, j, lane], the reduction")
        s("tid = cuda.threadIdx.x")
        s("lane = tid % WARP")
        s("warp = tid // WARP")
        s("m0 = cuda.blockIdx.x * TM")
        s("n0 = (cuda.blockIdx.y * WARPS + warp) * NR")
        s("kbeg = cuda.blockIdx.z * ks")
        s("kend = uint32(min(kbeg + ks, Kw))")
        if GLU:
            s("Kg = uint32(x.shape[1] // 2)  # x = [gate | up]: the up element of column c is x[m, c + Kg]")
        for r in R:  # word offsets of the rows (clamped: rows >= N are loaded but never written)
            s(f"ro_{r} = uint32(min(n0 + {r}, N - 1) * Kw)")
        for t in T:
            s(" = ".join(f"acc_{t}_{r}" for r in R) + " = float32(0.0)")
        s("# the first step's weight words; every later step's are loaded one step ahead")
        s("klast = kend - uint32(1)")
        for u in Us:  # indices past the range end are clamped to its last word: those products meet x = 0
            s(f"j_{u} = min(uint32(kbeg + {u * WARP} + lane), klast)")
            for r in R:
                s(f"w_{u}_{r} = W[ro_{r} + j_{u}]")
        if NORM:  # rstd of each row of the token tile (whole rows: K-splits each compute it), every thread of
            # the block over every row: NT-strided columns, >= 4 loads in flight a thread (session 10's prologue,
            # one warp a row, made a TM = 1 launch wait on one warp's 64 dependent trips: Moonlight's [q | kv_a]
            # projection 6.7 -> 11.8 us at M = 1, session 23)
            UN = max(1, 4 // TM)
            s("rs = cuda.shared.array(TM, float32)")
            s("rsw = cuda.shared.array((WARPS, TM), float32)")
            s("K = x.shape[1]")
            for t in T:
                s(f"xr_{t} = x[min(m0 + {t}, M - 1)]")
            s(" = ".join(f"ss_{t}" for t in T) + " = float32(0.0)")
            with s.block(f"for k0 in range(tid, K, {NT * UN}):"):
                for q in range(UN):
                    s(f"k = min(k0 + {q * NT}, K - 1)")
                    for t in T:
                        s(f"v = xr_{t}[k] if k0 + {q * NT} < K else float32(0.0)")
                        s(f"ss_{t} += v * v")
            if IS_SIM:  # no shuffles in the simulator: through shared memory
                for t in T:
                    s(f"red[warp, {t}, lane] = ss_{t}")
                s("cuda.syncthreads()")
                with s.block("if lane == 0:"):
                    with s.block("for i in range(1, WARP):"):
                        for t in T:
                            s(f"ss_{t} += red[warp, {t}, i]")
            else:
                for t in T:
                    _emit_xor_sum(s, f"ss_{t}")
            with s.block("if lane == 0:"):
                for t in T:
                    s(f"rsw[warp, {t}] = ss_{t}")
            s("cuda.syncthreads()")
            with s.block("if tid < TM:"):
                s("ss = rsw[0, tid]")
                for w in range(1, WARPS):
                    s(f"ss += rsw[{w}, tid]")
                s("rs[tid] = float32(1.0) / math.sqrt(ss / float32(K) + eps)")
            s("cuda.syncthreads()")
            for t in T:
                s(f"nr_{t} = rs[{t}]")
        if fast:
            s(f"sp = uint32(tid % {PACK})")
            s(f"si = uint32(tid // {PACK})")
        with s.block("for c0 in range(kbeg, kend, KCW):  # K-chunks, in words"):
            s("cw = min(KCW, kend - c0)")
            s("cuda.syncthreads()  # everyone is done with the previous chunk")
            if fast:
                with s.block("if cw == KCW:  # a full chunk: each thread stages elements tid + q * NT"):
                    s("xk = uint32(c0 * PACK + tid)")
                    for t in T:  # rows past M are clamped to row M - 1: their sums are never written
                        s(f"xr = x[min(m0 + {t}, M - 1)]")
                        for off in range(0, KCE, NT):
                            v = staged("xr[{}]", f"xk + uint32({off})", f"nr_{t}")
                            s(f"xs[sp, {t}, si + uint32({off // PACK})] = {v}")
                # the last, partial chunk: the same unrolled loads (all in flight at once), their index
                # clamped, zeros past the range end. (A runtime loop here, one dependent load per trip,
                # was most of linear_v2's time at K <= 1024: 1-2 us a token tile at TM = 8-16.)
                with s.block("else:"):
                    s("xk = uint32(c0 * PACK + tid)")
                    s("xe = uint32(kend * PACK)")
                    for t in T:
                        s(f"xr = x[min(m0 + {t}, M - 1)]")
                        for off in range(0, KCE, NT):
                            s(f"c = min(xk + uint32({off}), xe - uint32(1))")
                            s("v = " + staged("xr[{}]", "c", f"nr_{t}"))
                            s(f"xs[sp, {t}, si + uint32({off // PACK})] = "
                              f"v if xk + uint32({off}) < xe else float32(0.0)")
            else:
                with s.block("if True:"):  # generic staging: a runtime loop (small code), once per block at most
                    s("ce = cw * PACK")
                    s("cp = (cw + STEP - 1) // STEP * STEP * PACK")
                    with s.block("for e in range(tid, TM * cp, NT):"):
                        s("t = e // cp")
                        s("r = e - t * cp")
                        s("c = c0 * PACK + min(r, ce - 1)")
                        v = staged("x[min(m0 + t, M - 1), {}]", "c", "rs[t]")
                        s(f"xs[r % PACK, t, r // PACK] = {v} if r < ce else float32(0.0)")
            s("cuda.syncthreads()")
            with s.block("if n0 < N:"):
                with s.block("for i0 in range(0, cw, STEP):"):
                    for u in Us:  # next step's words first (they are in flight during this step's FMAs)
                        s(f"j_{u} = min(uint32(c0 + i0 + {STEP + u * WARP} + lane), klast)")
                        for r in R:
                            s(f"v_{u}_{r} = W[ro_{r} + j_{u}]")
                    for u in Us:
                        s(f"i_{u} = uint32(i0 + {u * WARP} + lane)")
                        for p in Ps:
                            for r in R:
                                s(f"f_{r} = " + UNPACK[p].format(f"w_{u}_{r}"))
                            for t in T:
                                s(f"xv = xs[{p}, {t}, i_{u}]")
                                for r in R:
                                    s(f"acc_{t}_{r} += xv * f_{r}")
                    for u in Us:
                        for r in R:
                            s(f"w_{u}_{r} = v_{u}_{r}")
        # ---- reduce the 32 lane partials of each accumulator: per warp, through shared memory, in
        # batches of RB = min(NV, 32) values: every lane stores its RB partials as red[warp, j, lane],
        # then lane j < RB sums row j (reading lanes in the rotated order lane + i, so the 32 lanes
        # hit 32 different banks), i.e. value b * RB + lane of batch b: token b * RB / NR + lane // NR,
        # row lane % NR. A fixed order: the result is the same on every run.
        vals = [f"acc_{t}_{r}" for t in T for r in R]
        RB = min(NV, WARP)
        sync = "cuda.syncthreads()" if IS_SIM else "cuda.syncwarp()"  # the simulator has no syncwarp
        for b in range(NV // RB):
            for j in range(RB):
                s(f"red[warp, {j}, lane] = {vals[b * RB + j]}")
            s(sync)
            s(f"out_{b} = float32(0.0)")
            with s.block(f"if lane < {RB}:"):
                with s.block("for i in range(WARP):"):
                    s(f"out_{b} += red[warp, lane, (lane + i) & {WARP - 1}]")
            s(sync)
        s(f"n = n0 + lane % {NR}")
        s(f"tb = m0 + lane // {NR}")
        with s.block(f"if lane < {RB} and n < N:"):
            with s.block("if cuda.gridDim.z > 1:"):
                s("z = cuda.blockIdx.z")
                for b in range(NV // RB):
                    with s.block(f"if tb + {b * RB // NR} < M:"):
                        s(f"part[z, tb + {b * RB // NR}, n] = out_{b}")
            with s.block("else:"):
                for b in range(NV // RB):
                    with s.block(f"if tb + {b * RB // NR} < M:"):
                        s(f"tot = out_{b}")
                        with s.block("if accumulate:"):
                            s(f"tot += y[tb + {b * RB // NR}, n]")
                        s(f"y[tb + {b * RB // NR}, n] = tot")
        # ---- split-K: the last block of the tile (bx, by) to finish adds the S partials, in split order
        if POST:
            s("fin = True  # this block finished its tile's y (POST: the row ticket below)")
        with s.block("if cuda.gridDim.z > 1:"):
            s("tile = cuda.blockIdx.x * cuda.gridDim.y + cuda.blockIdx.y")
            _emit_last_ticket(s, "flag", "tile", "cuda.gridDim.z",
                              "this block's partials are visible before its ticket")
            with s.block("if flag[0] != 0:"):
                s("cuda.threadfence()")
                s("S = cuda.gridDim.z")
                s("nb = cuda.blockIdx.y * WARPS * NR")
                with s.block("for e in range(tid, TM * WARPS * NR, NT):"):
                    s("m = m0 + e // (WARPS * NR)")
                    s("n = nb + e % (WARPS * NR)")
                    with s.block("if m < M and n < N:"):
                        s("tot = ldcg3(part, 0, m, n)  # through L2: other blocks wrote them")
                        with s.block("for z in range(1, S):"):
                            s("tot += ldcg3(part, z, m, n)")
                        with s.block("if accumulate:"):
                            s("tot += y[m, n]")
                        s("y[m, n] = tot")
                with s.block("if tid == 0:"):
                    s("tickets[tile] = 0  # every ticket of this launch is taken: ready for the next")
            if POST:
                s("fin = flag[0] != 0")
        if POST:
            _emit_post_norm(s, TM, WARPS)
    return s.text()


def _emit_post_norm(s: Src, TM: int, WARPS: int) -> None:
    """POST's epilogue: a[m] = rmsnorm(y[m]; pw, peps) for the token tile's rows, by the block that finishes the
    tile's last row tile (a ticket a token tile, tickets[gridDim.x * gridDim.y + bx], after the split-K tickets;
    zero between launches). It sums the squares of a row as :func:`kdt.kernels.elementwise.rmsnorm`'s block of
    NTH = NORM_THREADS threads does, each thread in the place of NTH / NT of them (the simulator: thread tid < NTH
    of its own): their four partial sums, the same warp shuffles and the same sum over warps, so a is the separate
    norm's a, bit for bit. y is read through L2 (other blocks of the launch wrote it). The values of each virtual
    thread's first trip of four (v, v + NTH, v + 2 NTH, v + 3 NTH; clamped to the row) and their norm weights are
    loaded first, all at once, and a is written from them: a row of up to 4 NTH columns (Moonlight's 2048) costs
    one round trip to L2, not one a column (a first version, loads in loops: the norm 6 us slower than its launch)."""
    NT, NTH = WARPS * WARP, ew.NORM_THREADS
    if (NT < NTH) if IS_SIM else (NTH % NT or NTH // WARP > WARP):
        raise ValueError(f"post norm: {NT} threads cannot stand in for rmsnorm's {NTH}")
    Q, I4 = range(1 if IS_SIM else NTH // NT), range(4)
    with s.block("if fin:"):
        s(f"pn = cuda.shared.array({NTH if IS_SIM else NTH // WARP}, float32)  # the norm's partial sums")
        s("rsn = cuda.shared.array(1, float32)")
        s("rt = cuda.gridDim.x * cuda.gridDim.y + cuda.blockIdx.x")
        _emit_last_ticket(s, "rflag", "rt", "cuda.gridDim.y", "this tile's y is visible before the token tile's ticket")
        with s.block("if rflag[0] != 0:"):
            s("cuda.threadfence()")
            s("N = y.shape[1]")
            for t in range(TM):
                with s.block(f"if m0 + {t} < M:"):
                    s(f"m = m0 + {t}")
                    for q in Q:  # every first-trip value and its weight, in flight together
                        for i in I4:
                            s(f"c_{q}_{i} = min(tid + {q * NT + i * NTH}, N - 1)")
                            s(f"y_{q}_{i} = ldcg2(y, m, c_{q}_{i})")
                            s(f"g_{q}_{i} = pw[c_{q}_{i}]")
                    for q in Q:  # virtual thread v = tid + q NT: rmsnorm's loops, its first trip from registers
                        with s.block(f"if tid < {NTH}:" if IS_SIM else "if True:"):
                            s(f"j = tid + {q * NT}")
                            with s.block(f"if j + {3 * NTH} < N:"):
                                for i in I4:
                                    s(f"s{i} = y_{q}_{i} * y_{q}_{i}")
                                s(f"j += {4 * NTH}")
                                with s.block(f"while j + {3 * NTH} < N:"):
                                    for i in I4:
                                        s(f"v{i} = ldcg2(y, m, j + {i * NTH})")
                                    for i in I4:
                                        s(f"s{i} += v{i} * v{i}")
                                    s(f"j += {4 * NTH}")
                                with s.block("while j < N:"):
                                    s("v0 = ldcg2(y, m, j)")
                                    s("s0 += v0 * v0")
                                    s(f"j += {NTH}")
                            with s.block("else:  # (no trip of four: the leftover loop alone, at most three values)"):
                                s("s0 = s1 = s2 = s3 = float32(0.0)")
                                for i in range(3):
                                    with s.block(f"if j + {i * NTH} < N:"):
                                        s(f"s0 += y_{q}_{i} * y_{q}_{i}")
                            s("p = (s0 + s1) + (s2 + s3)")
                            if IS_SIM:  # rmsnorm's simulator sum: a tree in shared memory, in order below
                                s("pn[tid] = p")
                            else:
                                _emit_xor_sum(s, "p")
                                with s.block("if lane == 0:"):
                                    s(f"pn[warp + {q * WARPS}] = p")
                    s("cuda.syncthreads()")
                    if IS_SIM:
                        with s.block("if tid == 0:"):
                            s(f"h = {NTH // 2}")
                            with s.block("while h > 0:"):
                                with s.block("for i in range(h):"):
                                    s("pn[i] += pn[i + h]")
                                s("h //= 2")
                            s("rsn[0] = pn[0]")
                    else:
                        with s.block("if warp == 0:"):
                            s(f"p = pn[lane] if lane < {NTH // WARP} else float32(0.0)")
                            _emit_xor_sum(s, "p")
                            with s.block("if lane == 0:"):
                                s("rsn[0] = p")
                    s("cuda.syncthreads()")
                    s("inv = float32(1.0) / math.sqrt(rsn[0] / float32(N) + peps)")
                    # columns tid + k NT, k < 4 NTH / NT, are the registers' (column tid + q NT + i NTH: k = q + i
                    # NTH / NT; the simulator: threads tid < NTH, columns tid + i NTH); the rest (N > 4 NTH) loaded
                    # again
                    for q in Q:
                        for i in I4:
                            mine = f" and tid < {NTH}" if IS_SIM else ""
                            with s.block(f"if tid + {q * NT + i * NTH} < N{mine}:"):
                                s(f"a[m, tid + {q * NT + i * NTH}] = y_{q}_{i} * inv * g_{q}_{i}")
                    with s.block(f"for j in range(tid + {4 * NTH}, N, {NT}):"):
                        s("a[m, j] = ldcg2(y, m, j) * inv * pw[j]")
                    s("cuda.syncthreads()  # (pn and rsn: the next row's)")
            with s.block("if tid == 0:"):
                s("tickets[rt] = 0  # ready for the next launch")


@cache
def _v2_kernel(kind: str, TM: int, NR: int, U: int, warps: int, norm: bool = False, glu: bool = False,
               post: bool = False):
    """The v2 kernel for one weight kind and (TM, NR, U, warps); ``norm``: the RMS-normalising variant;
    ``glu``: the variant that stages silu(gate) * up of x = [gate | up]; ``post``: the variant that also writes
    rmsnorm(y) (``linear(..., post=...)``)."""
    _, PACK, _ = _KINDS[kind]
    prm = _v2_params(kind, TM, NR, U, warps)
    ns = dict(prm, cuda=cuda, float32=float32, int32=int32, uint32=uint32, math=math, WARP=WARP, ldcg2=ldcg2,
              ldcg3=ldcg3, XS_SHAPE=(PACK, TM, prm["KCW"]), RED_SHAPE=(warps, min(prm["NV"], WARP), WARP))
    if IS_SIM:
        ns.update(unpack_lo=_v2_lo, unpack_hi=_v2_hi, unpack_b=_v2_bf16)
    else:
        ns.update(i2f=libdevice.int_as_float)
    src = _v2_source(**prm, UNPACK=(_V2_UNPACK_SIM if IS_SIM else _V2_UNPACK)[kind], NORM=norm, GLU=glu, POST=post)
    return jit_source(src, "linear_v2", ns, __name__)


# ---- wrapper ---------------------------------------------------------------------------------------
def _weight_kind(W) -> str:
    dt = np.dtype(W.dtype)
    if dt == np.float32:
        return "f32"
    if dt == np.uint16:
        return "bf16"
    raise TypeError(f"unsupported weight dtype {dt}: linear takes float32 or bf16 (stored as uint16)")


def _check_args(x, W, y, glu: bool = False, hilo: bool = False) -> tuple[int, int, int]:
    """(M, K, N) of a valid call; ``glu``: x is [M, 2K] = [gate | up] for W[N, K]; ``hilo``: x is uint64
    [M, K / 2], the tensor cores' hi / lo layout (kdt.kernels.tc.XL_HILO)."""
    M, Kx = x.shape
    N, K = W.shape
    if glu and Kx != 2 * K:
        raise ValueError(f"linear: with glu, x [gate | up] must have 2K = {2 * K} columns for W {tuple(W.shape)}, "
                         f"got x {tuple(x.shape)}")
    if (2 * Kx if hilo else Kx) != (2 * K if glu else K) or tuple(y.shape) != (M, N):
        raise ValueError(f"linear: x {tuple(x.shape)}, W {tuple(W.shape)}, y {tuple(y.shape)} do not match")
    if np.dtype(x.dtype) != (np.uint64 if hilo else np.float32) or np.dtype(y.dtype) != np.float32:
        raise TypeError("linear: x and y must be float32 (x uint64 in the hi / lo layout)")
    _weight_kind(W)
    return M, K, N


def _pair_words(W, kind: str, K: int):
    """bf16 with even K and contiguous rows: view as int32 words of two bf16 (one 32-bit load each)."""
    if kind == "bf16" and K % 2 == 0 and W.is_c_contiguous():
        return W.view(np.int32), "bf16x2"
    return W, kind


def linear(x, W, y, accumulate: bool = False, stream=0, norm=None, glu=None, fo=None, post=None) -> None:
    """``y[M, N] = x[M, K] @ W[N, K]^T``, or ``y += x @ W^T`` with ``accumulate`` (fused residual add).

    x: float32 device array [M, K], or uint64 [M, K / 2] in the hi / lo layout where the tensor cores take W
    (:func:`uses_tc`; no norm, no glu); W: float32 or uint16 (bf16 bits) device array [N, K];
    y: float32 device array [M, N] (written; read too when ``accumulate``). y must not alias x.
    Launches on ``stream`` and returns without synchronising. Runs :func:`linear_v2` for
    ``V2_MIN_M <= M <= V2_MAX_M`` when ``VERSION == "2"``, else :func:`linear_v1`.

    ``norm = (gw, eps, a)``: y = rmsnorm(x; gw[K] float32, eps) @ W^T. With the v2 kernel and a small W
    (:func:`fuses_norm`) the normalisation happens as x is staged (one launch); else
    :func:`kdt.kernels.elementwise.rmsnorm` writes a[M, K] first (two launches).

    ``glu = a``, float32 scratch [M, K]: x is [M, 2K] = [gate | up] and y (+)= (silu(gate) * up) @ W^T (the
    dense MLP's down projection). With the v2 kernel and a small W (:func:`fuses_glu`) silu * up happens as x
    is staged (one launch); else :func:`kdt.kernels.elementwise.silu_mul` writes a first. Bitwise the same.

    ``fo``: W in the tensor cores' fragment order too (:func:`fragment_order`), read in W's place where the tensor
    cores take x in the hi / lo layout (:func:`linear_tc`); bitwise the same.

    ``post = (pw, eps, a, a_hl)``: then a[M, N] = rmsnorm(y; pw[N] float32, eps) (a_hl: also its hi / lo layout, or
    None), as :func:`kdt.kernels.elementwise.rmsnorm` writes it: in the same launch where :func:`fuses_post` (the
    same bits), else by that norm's launch after this one.
    """
    if post is not None:
        pw, peps, a, a_hl = post
        if fuses_post(x, W, a_hl, norm, glu):
            return linear_v2(x, W, y, accumulate, stream, post=(pw, peps, a))
        linear(x, W, y, accumulate, stream, norm, glu, fo)
        return ew.rmsnorm(y, pw, peps, a, stream=stream, y_hl=a_hl)
    M = x.shape[0]
    if np.dtype(x.dtype) == np.uint64:
        if norm is not None or glu is not None or not uses_tc(M, W):
            raise ValueError("linear: x in the hi / lo layout needs the tensor cores (uses_tc), without norm or glu")
        return linear_tc(x, W, y, accumulate, stream, fo=fo)
    v2 = VERSION == "2" and V2_MIN_M <= M <= V2_MAX_M
    if glu is not None:
        if norm is not None:
            raise ValueError("linear: norm and glu cannot be combined")
        _, K, _ = _check_args(x, W, y, glu=True)
        if tuple(glu.shape) != (M, K) or np.dtype(glu.dtype) != np.float32:
            raise ValueError(f"linear: the glu scratch must be float32 [{M}, {K}], got {glu.dtype} {tuple(glu.shape)}")
        if v2 and fuses_glu(*W.shape) and _v2_reads(W):
            return linear_v2(x, W, y, accumulate, stream, glu=True)
        ew.silu_mul(x[:, :K], x[:, K:], glu, stream=stream)
        x = glu
    if norm is not None:
        gw, eps, a = norm
        if v2 and fuses_norm(*W.shape, M) and _v2_reads(W):
            return linear_v2(x, W, y, accumulate, stream, norm=(gw, eps))
        if TC_HILO_X and uses_tc(M, W) and a.is_c_contiguous():  # the norm writes x as hi / lo (see TC_HILO_X)
            ew.rmsnorm(x, gw, eps, a.view(np.uint16), stream=stream, hilo=True)
            return linear_tc(a.view(np.uint64), W, y, accumulate, stream, fo=fo)
        ew.rmsnorm(x, gw, eps, a, stream=stream)
        x = a
    if uses_tc(M, W):
        linear_tc(x, W, y, accumulate, stream)
    elif v2:
        linear_v2(x, W, y, accumulate, stream)
    else:
        linear_v1(x, W, y, accumulate, stream)


def uses_tc(M: int, W) -> bool:
    """``linear`` runs the tensor-core kernel for M tokens and the weight W [N, K] (see TC_MIN_M)."""
    if not 0 < TC_MIN_M <= M:
        return False
    N, K = W.shape
    if M < 32 and K > TC_LONG_K * N:
        return False
    return N * K >= TC_MIN_WEIGHTS and K % 4 == 0 and np.dtype(W.dtype) == np.uint16 and W.is_c_contiguous()


def tc_plan(M: int, N: int, K: int) -> tuple[int, int, int, int, int]:
    """(rt, nt, u, nw, kw) of :func:`linear_tc`: 2 row tiles of 16 a warp, up to 4 token tiles of 8 a block (tokens
    beyond 32 take more blocks, neighbours in the grid that share the row tile's weights through L2), 4 weight
    words of 8 bytes in flight a lane and row, 8 warps splitting K where N is small (more warps in flight) unless
    the grid would pass TC_WIDE_BLOCKS blocks with K <= 4096, all of a block's warps on the same rows (kw = nw);
    past 32 tokens blocks of 3 token tiles where they pad M less (:func:`kdt.kernels.tc.token_tiles`: 65 tokens
    in 3 blocks of 24, not 32)."""
    nt = tc.token_tiles(M, 4)
    nw = 8 if N <= 4096 and not (0 < TC_WIDE_BLOCKS < cdiv(N, 32) * cdiv(M, 8 * nt) and K <= 4096) else 4
    return 2, nt, 4 if M <= 32 else 2, nw, nw


def linear_tc(x, W, y, accumulate: bool = False, stream=0, plan: tuple[int, int, int, int, int] | None = None,
              fo=None) -> None:
    """:func:`linear` on tensor cores (bf16 W [N, K], K % 4 == 0; :func:`kdt.kernels.tc.gemm_kernel`); x float32
    [M, K], or uint64 [M, K / 2] in the hi / lo layout (kdt.kernels.tc.XL_HILO, e.g. from rmsnorm's ``hilo``);
    ``plan`` = (rt, nt, u, nw, kw) overrides :func:`tc_plan` (sweeps). ``fo``: :func:`fragment_order` of W, which
    the warp tile reads instead of W where x is hi / lo from FO_MIN_M tokens (or with a ``plan``; one 16-byte load a
    lane for a group's A fragments; the same fragments, so the same bits); the tiled GEMM and float32 x read W."""
    hilo = np.dtype(x.dtype) == np.uint64
    M, K, N = _check_args(x, W, y, hilo=hilo)
    if _weight_kind(W) != "bf16" or K % 4 or not W.is_c_contiguous():
        raise ValueError(f"linear_tc: needs bf16 weights, contiguous, K a multiple of 4 (got {W.dtype} K={K})")
    if fo is not None and (tuple(fo.shape) != (1, N, K // 4) or np.dtype(fo.dtype) != np.uint64):
        raise ValueError(f"linear_tc: fo must be W's fragment order, uint64 [1, {N}, {K // 4}], got {fo.dtype} "
                         f"{tuple(fo.shape)}")
    if M == 0 or N == 0:
        return
    if plan is None and 0 < TILED_MIN_M <= M and N >= TILED_MIN_N and K % tc_tiled.BK == 0 and x.is_c_contiguous():
        tc_tiled.tiled_gemm(x, W, y, accumulate, stream)
        return
    rt, nt, u, nw, kw = plan or tc_plan(M, N, K)
    fo = fo if hilo and (plan is not None or M >= FO_MIN_M) else None
    kern = tc.gemm_kernel(rt, nt, u, nw, tc.XL_HILO if hilo else tc.XL_NATURAL, kw, fo=fo is not None)
    rows = 16 * rt * (nw // kw)
    Wk = W.view(np.uint64).reshape(1, N, K // 4) if fo is None else fo
    kern[(cdiv(M, 8 * nt), cdiv(N, rows)), nw * WARP, stream](x, Wk, 0, y, bool(accumulate))


def fragment_order(W, stream=0):
    """A fragment-ordered copy of bf16 W [N, K] for :func:`linear`'s ``fo`` (uint64 [1, N, K / 4];
    kdt.kernels.tc.to_fo), or None where W is not bf16 or its shape does not take the order (N % 16, K % 16)."""
    N, K = W.shape
    if np.dtype(W.dtype) != np.uint16 or K % 4 or not W.is_c_contiguous() or not tc.fits_fo(N, K // 4):
        return None
    return tc.to_fo(W.view(np.uint64).reshape(1, N, K // 4), stream)


def fuses_norm(N: int, Kw: int, M: int | None = None) -> bool:
    """``linear(..., norm=...)`` folds the norm into linear_v2 for a weight [N, Kw words] and M tokens: FUSE_NORM
    and a small matrix (at most half the small-weight rule's V2_SHRINK_WORDS: 6 MB), or M <= FUSE_NORM_MAX_M and
    at most FUSE_NORM_M_WORDS words (see FUSE_NORM); M None: the rule for any M (the small matrices)."""
    few = M is not None and M <= FUSE_NORM_MAX_M and N * Kw <= FUSE_NORM_M_WORDS
    return FUSE_NORM and (2 * N * Kw <= V2_SHRINK_WORDS or few)


def fuses_post(x, W, a_hl=None, norm=None, glu=None) -> bool:
    """``linear(x, W, y, post=...)`` writes the norm of y in its own launch (linear_v2's POST): at M <=
    POST_NORM_MAX_M tokens where linear_v2 takes W (float32 x, no tensor cores, no glu) and nobody wants the norm's
    hi / lo layout (see POST_NORM_MAX_M)."""
    M = x.shape[0]
    return (0 < M <= POST_NORM_MAX_M and a_hl is None and glu is None and np.dtype(x.dtype) == np.float32
            and VERSION == "2" and V2_MIN_M <= M <= V2_MAX_M and not uses_tc(M, W) and _v2_reads(W)
            and (norm is None or fuses_norm(*W.shape, M)))


def fuses_glu(N: int, Kw: int) -> bool:
    """``linear(..., glu=...)`` folds silu * up into linear_v2 for a weight [N, Kw]: FUSE_GLU and the small
    matrices of :func:`fuses_norm` (see FUSE_GLU)."""
    return FUSE_GLU and 2 * N * Kw <= V2_SHRINK_WORDS


def _v2_reads(W) -> bool:
    """linear_v2 reads W as one flat array with 32-bit offsets (else it runs v1)."""
    return W.is_c_contiguous() and W.size < 1 << 32


def linear_v1(x, W, y, accumulate: bool = False, stream=0) -> None:
    """:func:`linear` with the v1 kernels: skinny for ``M <= SKINNY_MAX_M``, else the tiled GEMM."""
    M, K, N = _check_args(x, W, y)
    if M == 0 or N == 0:
        return
    kind = _weight_kind(W)
    acc = 1 if accumulate else 0
    if M <= SKINNY_MAX_M:
        W, kind = _pair_words(W, kind, K)
        kern, rows_per_block, nt = _skinny_kernel(kind, *_skinny_config(M, N))
        kern[cdiv(N, rows_per_block), nt, stream](x, W, y, acc)
    else:
        kern, nt = _wide_kernel(kind)
        kern[(cdiv(N, WIDE_BN), cdiv(M, WIDE_BM)), nt, stream](x, W, y, acc)


def _v2_tm(M: int) -> int:
    """Tokens per tile: 1, 4, 8 or 16 (few variants: each costs ~15 s of compilation per process);
    above 16, 8 or 16, whichever pads less (16 issues ~20% fewer instructions per FMA: it wins
    near-ties)."""
    if M <= 16:
        return 1 if M == 1 else 4 if M <= 4 else 8 if M <= 8 else 16
    return 16 if cdiv(M, 16) * 16 <= 1.1 * cdiv(M, 8) * 8 else 8


def _v2_slots(nsm: int, TM: int, warps: int) -> int:
    """Blocks of one wave: resident blocks per SM for the tile (V2_BLOCKS_PER_SM is for 4-warp blocks)."""
    return max(nsm, nsm * V2_BLOCKS_PER_SM[TM] * 4 // warps)


@cache
def _v2_plan(M: int, N: int, Kw: int, nsm: int, tm: int | None = None, splits: int | None = None,
             warps: int | None = None):
    """(TM, NR, U, warps, S, ks): token tile, rows per warp, words per row per step, warps per block,
    K-splits and words per split.

    Without a split there are cdiv(M, TM) * cdiv(N, NR * warps) blocks; small N (576-row
    kv_a_proj_with_mqa: 18 row blocks) would leave most of the 132 SMs idle, so the K range is cut
    into S pieces (at least V2_MIN_STEPS steps per lane each), S chosen by a wave-quantisation model
    (V2_BLOCKS_PER_SM resident blocks per SM); for small matrices, smaller token tiles while they fit
    one wave and L2 (``V2_SHRINK_TM``). Host-known shapes only (CUDA-graph safe)."""
    if tm is None and V2_SHRINK_TM:  # the small-weight rule (see V2_SHRINK_TM)
        tm = _v2_tm(M)
        while tm > 4:
            TM, NR, _, w, S, _ = _v2_plan(M, N, Kw, nsm, tm // 2, splits, warps)
            if (cdiv(M, TM) * cdiv(N, NR * w) * S > _v2_slots(nsm, TM, w)
                    or cdiv(M, TM) * N * Kw > V2_SHRINK_WORDS):
                break
            tm //= 2
        return _v2_plan(M, N, Kw, nsm, tm, splits, warps)
    TM = tm or _v2_tm(M)
    NR, U, warps = V2_NR, V2_U[TM], warps or V2_WARPS
    STEP = WARP * U
    steps = cdiv(Kw, STEP)
    if splits is None:  # the S of least modelled time: waves * (steps per block + fixed) (+ reduce)
        base = cdiv(M, TM) * cdiv(N, NR * warps)
        slots = _v2_slots(nsm, TM, warps)
        smax = min(steps // V2_MIN_STEPS, V2_MAX_SPLITS) if base < 4 * slots else 1  # many waves: no split
        splits = min(range(1, max(1, smax) + 1),
                     key=lambda S: (cdiv(base * S, slots) * (cdiv(steps, S) + V2_SPLIT_FIXED)
                                    + (V2_SPLIT_REDUCE if S > 1 else 0), S))
    ks = cdiv(steps, splits) * STEP
    return TM, NR, U, warps, cdiv(Kw, ks), ks


_DEVICE_INFO: dict = {}  # device id -> SMs
_SCRATCH: dict = {}  # (device id, S, M, N, tiles) -> (partial sums [S, M, N] f32, tickets [tiles] i32)


def _device() -> tuple[int, int]:
    """(device id, number of SMs) of the current device (the simulator: id 0, 4 SMs)."""
    if IS_SIM:
        return 0, 4
    dev = cuda.get_current_device()
    nsm = _DEVICE_INFO.get(dev.id)
    if nsm is None:
        nsm = _DEVICE_INFO[dev.id] = int(dev.MULTIPROCESSOR_COUNT)
    return dev.id, nsm


def _scratch(dev: int, S: int, M: int, N: int, n_tiles: int):
    """(partial sums [S, M, N], tickets [n_tiles] int32 = 0) of the split-K for one shape, allocated on
    first use and kept for the process, so a CUDA graph captured after that first call keeps valid
    pointers (nothing is allocated during a captured forward); the kernel leaves the tickets at zero.
    Every call with this shape reuses them: callers on one stream (the engine)."""
    key = (dev, S, M, N, n_tiles)
    buf = _SCRATCH.get(key)
    if buf is None:
        buf = _SCRATCH[key] = (cuda.device_array((S, M, N), np.float32),
                               cuda.to_device(np.zeros(n_tiles, np.int32)))
    return buf


def linear_v2(x, W, y, accumulate: bool = False, stream=0, tm: int | None = None,
              splits: int | None = None, warps: int | None = None, norm=None, glu: bool = False,
              post=None) -> None:
    """:func:`linear` with the v2 kernel (any M); ``tm`` / ``splits`` / ``warps`` override the plan
    (tests, sweeps); ``norm = (gw, eps)``: y = rmsnorm(x; gw, eps) @ W^T in the same launch; ``glu``: x is
    [M, 2K] = [gate | up] and y = (silu(gate) * up) @ W^T in the same launch; ``post = (pw, eps, a)``: then
    a[M, N] = rmsnorm(y; pw[N] float32, eps) in the same launch (the bits of
    :func:`kdt.kernels.elementwise.rmsnorm`; see POST_NORM_MAX_M).

    With S > 1 K-splits, partial sums go to a cached scratch buffer and the last block of each output
    tile to finish (atomic ticket) adds them in split order (then ``y`` when ``accumulate``), in the
    same launch: results are identical run to run."""
    if norm is not None and glu:
        raise ValueError("linear: norm and glu cannot be combined")
    M, K, N = _check_args(x, W, y, glu)
    if norm is not None and (tuple(norm[0].shape) != (K,) or np.dtype(norm[0].dtype) != np.float32):
        raise ValueError(f"linear: the norm weight must be float32 [{K}], got {norm[0].dtype} {tuple(norm[0].shape)}")
    if post is not None and (tuple(post[0].shape) != (N,) or np.dtype(post[0].dtype) != np.float32
                             or tuple(post[2].shape) != (M, N) or np.dtype(post[2].dtype) != np.float32):
        raise ValueError(f"linear: post needs a float32 norm weight [{N}] and a float32 output [{M}, {N}], got "
                         f"{post[0].dtype} {tuple(post[0].shape)} and {post[2].dtype} {tuple(post[2].shape)}")
    if M == 0 or N == 0:
        return
    if not _v2_reads(W):
        if norm is not None or glu or post is not None:
            raise ValueError("linear_v2: a normalising or GLU launch needs W contiguous with < 2**32 elements")
        return linear_v1(x, W, y, accumulate, stream)
    W, kind = _pair_words(W, _weight_kind(W), K)
    Kw = W.shape[1]
    dev, nsm = _device()
    TM, NR, U, warps, S, ks = _v2_plan(M, N, Kw, nsm, tm, splits, warps)
    kern = _v2_kernel(kind, TM, NR, U, warps, norm is not None, glu, post is not None)
    acc = 1 if accumulate else 0
    grid = (cdiv(M, TM), cdiv(N, NR * warps), S)
    # tickets: one a tile (split-K), then (post) one a token tile
    n_tickets = grid[0] * grid[1] + grid[0] if post is not None else grid[0] * grid[1] if S > 1 else 1
    part, tickets = _scratch(dev, S, M, N, n_tickets) if S > 1 else _scratch(dev, 1, 1, 1, n_tickets)
    args = (x, W.reshape(N * Kw), Kw, y, part, tickets, ks, acc)
    if norm is not None:
        args += (norm[0], np.float32(norm[1]))
    if post is not None:
        args += (post[0], np.float32(post[1]), post[2])
    kern[grid, warps * WARP, stream](*args)


# ---- sm_90 compile check: both paths, every weight-word kind, every skinny tile config -----------------
def V2_SIG(wt, norm: bool = False, post: bool = False):  # noqa: N802 - the v2 kernel's signature for weight words wt
    """(The GLU variant takes the plain signature: its x [M, 2K] is C-contiguous like dense_mlp's gu, or h[:M]
    of a C-contiguous h, a row slice that keeps the C layout.)"""
    sig = (float32[:, ::1], wt[::1], int64, float32[:, ::1], float32[:, :, ::1], int32[::1], int64, int64)
    return sig + ((float32[::1], float32) if norm else ()) + ((float32[::1], float32, float32[:, ::1]) if post else ())


# The shapes the engine runs linear(..., glu=) at (dense_mlp's down projection, weight [N, K]): (M, N, K, kind)
# for fixtures/model_code.h5's target dense layer (hidden 256, intermediate 768, bf16 -> int32 words of two)
# at the M = 1 decode and M = 17 verify steps, its learned drafter's (intermediate 1024, float32) at M = 32,
# and fixtures/model_tiny.h5's (intermediate 512, float32 and bf16) at M = 1 and 8.
GLU_ENGINE_SHAPES = ((1, 256, 768, "bf16x2"), (17, 256, 768, "bf16x2"), (32, 256, 1024, "f32"),
                     (1, 256, 512, "f32"), (8, 256, 512, "f32"), (1, 256, 512, "bf16x2"), (8, 256, 512, "bf16x2"))


def glu_variants(nsm: int = 132) -> list[tuple[str, int, int, int, int]]:
    """(kind, TM, NR, U, warps) of the v2 kernels GLU_ENGINE_SHAPES plan on a GPU of nsm SMs (132: the H200)."""
    out = []
    for M, N, K, kind in GLU_ENGINE_SHAPES:
        TM, NR, U, warps, _, _ = _v2_plan(M, N, K // _KINDS[kind][1], nsm)
        if (kind, TM, NR, U, warps) not in out:
            out.append((kind, TM, NR, U, warps))
    return out


def _register() -> None:
    x2 = float32[:, ::1]
    for kind, (_, _, wt) in _KINDS.items():
        for M, N in ((1, 2048), (4, 2048), (SKINNY_MAX_M, 4096)):
            TM, NR, warps = _skinny_config(M, N)
            kern, _, _ = _skinny_kernel(kind, TM, NR, warps)
            register_ptx(kern, (x2, wt[:, ::1], x2, int64), name=f"linear_skinny_{kind}_{TM}x{NR}_w{warps}")
        if kind != "bf16x2":
            register_ptx(_wide_kernel(kind)[0], (x2, wt[:, ::1], x2, int64), name=f"linear_wide_{kind}")
        # v2: the token tiles _v2_tm picks (TM 2 and 8-warp blocks only when asked for: bf16x2 alone)
        for TM, warps in ((1, V2_WARPS), (4, V2_WARPS), (8, V2_WARPS), (16, V2_WARPS)) + (
                ((2, V2_WARPS), (16, 8)) if kind == "bf16x2" else ()):
            U = V2_U[TM]
            register_ptx(_v2_kernel(kind, TM, V2_NR, U, warps), V2_SIG(wt),
                         name=f"linear_v2_{kind}_{TM}x{V2_NR}_u{U}_w{warps}")
            # the normalising variant (one generator: its prologue and staging do not depend on TM or U), for
            # the engine's word kinds at both step shapes (U = 2 and 1); 30 s of the check, not 100
            if (kind, TM) in (("f32", 1), ("f32", 16), ("bf16x2", 1), ("bf16x2", 4)) and warps == V2_WARPS:
                register_ptx(_v2_kernel(kind, TM, V2_NR, U, warps, True), V2_SIG(wt, True),
                             name=f"linear_v2_norm_{kind}_{TM}x{V2_NR}_u{U}_w{warps}")
    # the post-norm variant where the engine may run it: o_proj at one token (POST_NORM_MAX_M)
    for kind in ("f32", "bf16x2"):
        register_ptx(_v2_kernel(kind, 1, V2_NR, V2_U[1], V2_WARPS, post=True), V2_SIG(_KINDS[kind][2], post=True),
                     name=f"linear_v2_post_{kind}_1x{V2_NR}_u{V2_U[1]}_w{V2_WARPS}")
    # the GLU variant (dense_mlp's down projection) only where the engine runs it: each costs 4-15 s of the check
    for kind, TM, NR, U, warps in glu_variants():
        register_ptx(_v2_kernel(kind, TM, NR, U, warps, glu=True), V2_SIG(_KINDS[kind][2]),
                     name=f"linear_v2_glu_{kind}_{TM}x{NR}_u{U}_w{warps}")
    # the tensor-core plans of tc_plan (kdt.kernels.tc registers the gemm's test plans)
    for rt, nt, u, nw, kw in sorted({tc_plan(M, N, 2048) for M in (16, 24, 64, 65) for N in (576, 3648, 163840)}):
        for xl, xt, fo in ((tc.XL_NATURAL, x2, False), (tc.XL_HILO, uint64[:, ::1], False),
                           (tc.XL_HILO, uint64[:, ::1], True)):  # (fo: the weights in fragment order, linear's fo)
            register_ptx(tc.gemm_kernel(rt, nt, u, nw, xl, kw, fo=fo), (xt, uint64[:, :, ::1], int64, x2, boolean))


_register()
