"""Parity of kdt.kernels.linear (v1: skinny and tiled-GEMM paths; v2: register-tiled split-K kernel;
float32 and bf16 weights, accumulate) against kdt.reference.ops.linear computed in float64.

Bounds: float32 weights -> rel_err < 1e-5 against the float64 reference (fp32 accumulation over
K <= 16384 lands near 1e-7 .. 1e-6). bf16 weights -> rel_err < 1e-5 against the float64 reference on
the bf16-rounded weights (the kernel's only error is fp32 accumulation), and < 1e-2 against the
unrounded float32 weights (bf16 rounding: ~3e-3 relative per weight).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from kdt.kernels import elementwise as ew
from kdt.kernels import linear as lin
from kdt.kernels.common import bf16_bits_to_f32, f32_to_bf16_bits
from kdt.reference.ops import linear as linear_ref
from kdt.reference.ops import rmsnorm as rmsnorm_ref
from kdt.reference.ops import silu as silu_ref
from kdt.testing import poisoned, rel_err

FP32_BOUND = 1e-5
BF16_VS_ROUNDED = 1e-5
BF16_VS_FP32 = 1e-2


def _weights(rng, N, K, wdtype):
    """(device-side weight array, float64 weights the kernel sees, float64 unrounded weights)."""
    W = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
    if wdtype == "bf16":
        bits = f32_to_bf16_bits(W)
        return bits, bf16_bits_to_f32(bits).astype(np.float64), W.astype(np.float64)
    return W, W.astype(np.float64), W.astype(np.float64)


def _check(rng, M, W_store, W_seen, W_fp32, accumulate, d_W=None, fn=None):
    """Run ``fn`` (default :func:`lin.linear`) on fresh x (and y when accumulating; else NaN-poisoned y)
    and check it against the float64 reference; returns (rel_err, output)."""
    N, K = W_seen.shape
    x = rng.standard_normal((M, K)).astype(np.float32)
    y0 = rng.standard_normal((M, N)).astype(np.float32) if accumulate else poisoned((M, N))
    d_y = cuda.to_device(y0)
    d_W = d_W if d_W is not None else cuda.to_device(W_store)
    (fn or lin.linear)(cuda.to_device(x), d_W, d_y, accumulate=accumulate)
    out = d_y.copy_to_host()
    base = y0.astype(np.float64) if accumulate else 0.0
    ref = linear_ref(x.astype(np.float64), W_seen) + base
    err = rel_err(out, ref)
    tag = f"M={M} N={N} K={K} {W_store.dtype} acc={accumulate}"
    if W_store.dtype == np.float32:
        assert err < FP32_BOUND, f"{tag}: rel_err {err:.3g}"
    else:
        assert err < BF16_VS_ROUNDED, f"{tag}: rel_err vs bf16-rounded weights {err:.3g}"
        err32 = rel_err(out, linear_ref(x.astype(np.float64), W_fp32) + base)
        assert err32 < BF16_VS_FP32, f"{tag}: rel_err vs fp32 weights {err32:.3g}"
    return err, out


@pytest.fixture(params=["1", "2"])
def version(request, monkeypatch):
    """Run the test with linear() dispatching to v1 (skinny / wide) and to v2 (tensor cores off: their own tests)."""
    monkeypatch.setattr(lin, "VERSION", request.param)
    monkeypatch.setattr(lin, "TC_MIN_M", 0)
    return request.param


# ---- simulator: tiny shapes, N and K off every tile / vector width -----------------------------------
@pytest.mark.kernels
@pytest.mark.parametrize(
    "M,N,K,wdtype,accumulate",
    [
        (1, 37, 70, "f32", False),  # skinny TM=1
        (1, 37, 70, "bf16", True),  # bf16 pairs (int32 words), K % 64 != 0
        (3, 37, 70, "f32", True),  # skinny TM=4, partial token tile
        (3, 37, 70, "bf16", False),
        (17, 37, 70, "f32", False),  # skinny TM=8, 3 token tiles, partial last one
        (17, 37, 71, "bf16", True),  # odd K: bf16 read one uint16 at a time
        (17, 20, 300, "bf16", False),  # several K-chunks of the staged x (small XS_FLOATS in the simulator)
        (70, 37, 70, "f32", True),  # wide (tiled GEMM): partial M, N and K tiles
        (70, 37, 70, "bf16", False),
    ],
)
def test_linear_sim(rng, version, M, N, K, wdtype, accumulate):
    if M <= lin.SKINNY_MAX_M:
        assert lin._skinny_config(M, N)[0] == (1 if M == 1 else 4 if M <= 4 else 8)
    assert (M > lin.SKINNY_MAX_M) == (M == 70), "the wide case must take the tiled GEMM path"
    W_store, W_seen, W_fp32 = _weights(rng, N, K, wdtype)
    _check(rng, M, W_store, W_seen, W_fp32, accumulate)


@pytest.mark.kernels
def test_linear_noncontiguous_bf16_weight(rng, version):
    """A bf16 weight that is a column slice (not C-contiguous) falls back to uint16 loads."""
    N, K, M = 21, 40, 2
    W_store, W_seen, W_fp32 = _weights(rng, N, K + 6, "bf16")
    d_W = cuda.to_device(W_store)[:, :K]
    assert not d_W.is_c_contiguous()
    _check(rng, M, W_store[:, :K], W_seen[:, :K], W_fp32[:, :K], True, d_W=d_W)


# ---- v2 (simulator): every token tile, K-splits, partial / full staged chunks ----------------------------
# XS chunk in the simulator: V2_KCW = 64 words (2 warps stage 64 words per pass), so K = 300 (bf16: 150
# words) spans two full chunks and a partial one; K odd -> uint16 words (PACK 1), K even -> bf16 pairs.
V2_SIM_CASES = [  # (M, N, K, wdtype, accumulate, tm, splits)
    (1, 37, 300, "bf16", False, 1, 1),
    (1, 37, 300, "f32", True, 1, 3),
    (2, 21, 130, "bf16", True, 2, 2),  # TM 2 (only when asked for), one full chunk + a partial one
    (3, 37, 70, "f32", False, None, None),  # default plan: TM 4
    (3, 37, 301, "bf16", True, 4, 3),  # odd K: uint16 words, three splits of unequal length
    (7, 40, 300, "bf16", False, 8, 2),
    (8, 17, 200, "f32", True, 8, 1),
    (17, 37, 300, "bf16", True, 16, 3),  # two token tiles, the second one partial
    (20, 33, 128, "f32", False, 16, 2),  # each split exactly one full chunk (fast staging only)
    (33, 20, 71, "bf16", False, None, None),  # default plan (the small-weight rule: TM 4, 9 tiles)
]


@pytest.mark.kernels
@pytest.mark.parametrize("M,N,K,wdtype,accumulate,tm,splits", V2_SIM_CASES)
def test_linear_v2_sim(rng, M, N, K, wdtype, accumulate, tm, splits):
    W_store, W_seen, W_fp32 = _weights(rng, N, K, wdtype)
    Kw = K // 2 if (wdtype == "bf16" and K % 2 == 0) else K
    TM, NR, U, warps, S, ks = lin._v2_plan(M, N, Kw, lin._device()[1], tm, splits)
    if splits is not None:
        assert S == splits, f"the case must really run {splits} K-splits (got {S}, {ks} words each)"
    _check(rng, M, W_store, W_seen, W_fp32, accumulate, fn=functools.partial(lin.linear_v2, tm=tm, splits=splits))


# (M, N, K, wdtype, accumulate, tm, splits): full + partial chunks, K-splits (each normalises whole rows),
# a partial token tile, uint16 words (odd K)
V2_NORM_CASES = [(1, 37, 300, "bf16", False, 1, 1), (3, 21, 130, "f32", True, 4, 2),
                 (17, 37, 300, "bf16", True, 16, 3), (5, 33, 71, "bf16", False, None, None)]


# the GPU: Moonlight's [q | kv_a] and o_proj at M = 1 (the engine folds the norm there), f32 and a 16-token tile
V2_NORM_GPU_CASES = [(1, 3648, 2048, "bf16", False, None, None), (1, 2048, 2048, "bf16", True, None, None),
                     (1, 1000, 2048, "f32", False, 1, 4), (16, 600, 2048, "f32", True, 16, 2),
                     (4, 3648, 2048, "bf16", False, 4, None)]


@pytest.mark.kernels
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("M,N,K,wdtype,accumulate,tm,splits", V2_NORM_CASES)
def test_linear_norm_sim(rng, monkeypatch, fused, M, N, K, wdtype, accumulate, tm, splits):
    """``norm``: y = rmsnorm(x; gw, eps) @ W^T (+ y) against float64, fused into linear_v2's staging (FUSE_NORM,
    the plan forced by tm / splits) or through elementwise.rmsnorm into a (then a is checked too); x unchanged."""
    _check_linear_norm(rng, monkeypatch, fused, M, N, K, wdtype, accumulate, tm, splits)


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,wdtype,accumulate,tm,splits", V2_NORM_GPU_CASES)
def test_linear_norm_gpu(rng, monkeypatch, M, N, K, wdtype, accumulate, tm, splits):
    """The fused norm on the H200 at the engine's shapes (the block-wide squares prologue)."""
    _check_linear_norm(rng, monkeypatch, True, M, N, K, wdtype, accumulate, tm, splits)


def _check_linear_norm(rng, monkeypatch, fused, M, N, K, wdtype, accumulate, tm, splits):
    monkeypatch.setattr(lin, "FUSE_NORM", fused)
    W_store, W_seen, _ = _weights(rng, N, K, wdtype)
    x = (rng.standard_normal((M, K)) * 3).astype(np.float32)
    gw = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32)
    eps = 1e-6
    y0 = rng.standard_normal((M, N)).astype(np.float32) if accumulate else poisoned((M, N))
    d_x, d_gw, d_y, d_a = cuda.to_device(x), cuda.to_device(gw), cuda.to_device(y0), cuda.to_device(poisoned((M, K)))
    xn = rmsnorm_ref(x.astype(np.float64), gw, eps)
    if fused:
        lin.linear_v2(d_x, cuda.to_device(W_store), d_y, accumulate, tm=tm, splits=splits, norm=(d_gw, eps))
    else:
        lin.linear(d_x, cuda.to_device(W_store), d_y, accumulate, norm=(d_gw, eps, d_a))
        assert rel_err(d_a.copy_to_host(), xn) < 1e-6
    ref = linear_ref(xn, W_seen) + (y0.astype(np.float64) if accumulate else 0.0)
    assert rel_err(d_y.copy_to_host(), ref) < FP32_BOUND
    np.testing.assert_array_equal(d_x.copy_to_host(), x)


def test_linear_norm_fuses_small_weights_or_few_tokens(monkeypatch):
    """The norm folds into linear_v2 for every projection of fixtures/model_code.h5 (target and drafter, at
    most 1 M weight words) at any M, and for Moonlight's or Kimi-K2's only at M <= FUSE_NORM_MAX_M (at more
    tokens it would re-read x per block), the matrices over FUSE_NORM_M_WORDS excepted (lm_head; Kimi-K2's dense
    gate_up too: thousands of blocks would each pay the squares)."""
    from kdt.config import preset
    from kdt.fixture import read_config

    monkeypatch.setattr(lin, "FUSE_NORM", True)
    monkeypatch.setattr(lin, "FUSE_NORM_MAX_M", 1)
    code = read_config(str(Path(__file__).resolve().parent.parent / "fixtures" / "model_code.h5"))
    for M in (None, 1, 17, 256):
        assert all(lin.fuses_norm(N, K // 2, M) for _, N, K in code.dense_projections())
        assert lin.fuses_norm(2048, 256, M) and lin.fuses_norm(256, 1024, M)  # the drafter's f32 gate_up / down
    for name in ("moonlight-16b-a3b", "kimi-k2"):
        big = preset(name).dense_projections()
        assert [p for p, N, K in big if not lin.fuses_norm(N, K // 2, 1)] == (
            ["lm_head"] if name == "moonlight-16b-a3b" else ["mlp_gate_up", "lm_head"]), name
        for M in (None, 2, 16, 256):
            assert not any(lin.fuses_norm(N, K // 2, M) for _, N, K in big), (name, M)
    monkeypatch.setattr(lin, "FUSE_NORM_MAX_M", 0)
    assert not lin.fuses_norm(2048, 1024, 1) and lin.fuses_norm(4, 4, 1)
    monkeypatch.setattr(lin, "FUSE_NORM", False)
    assert not lin.fuses_norm(4, 4) and not lin.fuses_norm(4, 4, 1)


@pytest.mark.kernels
def test_linear_norm_rejects_bad_weights():
    x, y = cuda.to_device(np.zeros((2, 8), np.float32)), cuda.to_device(np.zeros((2, 4), np.float32))
    W = cuda.to_device(np.zeros((4, 8), np.float32))
    with pytest.raises(ValueError, match="norm weight"):
        lin.linear_v2(x, W, y, norm=(cuda.to_device(np.ones(7, np.float32)), 1e-6))


# ---- the norm after the projection: linear(..., post=(pw, eps, a, a_hl)), linear_v2's POST ---------------------
# (M, N, K, wdtype, accumulate, tm, splits, warps). In the simulator rmsnorm's block is 32 threads: N = 300 takes
# its 4-load loop twice, then the leftover loop; 3 K-splits (the row ticket after the split-K's); a partial token
# tile of 4 (M = 3); two token tiles (M = 5) of blocks of 3 warps; N = 20 under the norm's block (one pass, lanes idle)
V2_POST_CASES = [(1, 300, 64, "f32", True, 1, 1, None), (1, 70, 130, "bf16", True, 1, 3, None),
                 (3, 37, 40, "f32", False, 4, 2, None), (5, 40, 64, "bf16", True, 4, 1, 3),
                 (1, 20, 48, "f32", False, 1, 2, None)]
# the GPU: Moonlight's o_proj at one token as the engine runs it (the plan's K-splits), the tiny fixture's (f32),
# and a forced single split
V2_POST_GPU_CASES = [(1, 2048, 2048, "bf16", True, None, None, None), (1, 256, 256, "f32", True, None, None, None),
                     (1, 2048, 2048, "bf16", True, 1, 1, None), (1, 7168, 7168, "bf16", True, None, None, None)]


def _check_post(rng, M, N, K, wdtype, accumulate, tm, splits, warps, runs=2):
    """linear_v2(..., post=(pw, eps, a)): y against float64, a against float64's norm of the reference y, and a
    bit for bit against elementwise.rmsnorm of the kernel's own y; ``runs`` launches on one scratch with fresh x
    (the tickets back at zero), y and a poisoned before each."""
    W_store, W_seen, _ = _weights(rng, N, K, wdtype)
    d_W = cuda.to_device(W_store)
    pw = (1 + 0.2 * rng.standard_normal(N)).astype(np.float32)
    d_pw, eps = cuda.to_device(pw), 1e-6
    for _ in range(runs):
        x = rng.standard_normal((M, K)).astype(np.float32)
        y0 = (rng.standard_normal((M, N)) * 2).astype(np.float32) if accumulate else poisoned((M, N))
        d_y, d_a = cuda.to_device(y0), cuda.to_device(poisoned((M, N)))
        lin.linear_v2(cuda.to_device(x), d_W, d_y, accumulate, tm=tm, splits=splits, warps=warps,
                      post=(d_pw, eps, d_a))
        ref = linear_ref(x.astype(np.float64), W_seen) + (y0.astype(np.float64) if accumulate else 0.0)
        y = d_y.copy_to_host()
        assert rel_err(y, ref) < FP32_BOUND
        a = d_a.copy_to_host()
        assert rel_err(a, rmsnorm_ref(ref, pw, eps)) < 2e-6
        d_a2 = cuda.to_device(poisoned((M, N)))
        ew.rmsnorm(cuda.to_device(y), d_pw, eps, d_a2)
        np.testing.assert_array_equal(a, d_a2.copy_to_host())


@pytest.mark.kernels
@pytest.mark.parametrize("M,N,K,wdtype,accumulate,tm,splits,warps", V2_POST_CASES)
def test_linear_post_norm_sim(rng, M, N, K, wdtype, accumulate, tm, splits, warps):
    """The norm after the projection in its launch: the block that finishes a token tile's last output tile
    normalises its rows, the separate norm's bits."""
    _check_post(rng, M, N, K, wdtype, accumulate, tm, splits, warps)


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,wdtype,accumulate,tm,splits,warps", V2_POST_GPU_CASES)
def test_linear_post_norm_gpu(rng, M, N, K, wdtype, accumulate, tm, splits, warps):
    """The same on the GPU at the engine's shapes (rmsnorm's 512 threads stood in for by 128: its shuffles)."""
    _check_post(rng, M, N, K, wdtype, accumulate, tm, splits, warps, runs=3)


@pytest.mark.kernels
@pytest.mark.parametrize("fused", [True, False])
def test_linear_post_norm_dispatch(rng, monkeypatch, fused):
    """linear(..., post=...) folds the norm into linear_v2 where fuses_post (POST_NORM_MAX_M), else launches
    elementwise.rmsnorm after the projection (with a_hl, always: the fold writes no hi / lo); a is the same
    either way."""
    monkeypatch.setattr(lin, "POST_NORM_MAX_M", 1 if fused else 0)
    M, N, K = 1, 40, 64
    W_store, W_seen, _ = _weights(rng, N, K, "f32")
    x = rng.standard_normal((M, K)).astype(np.float32)
    pw = (1 + 0.2 * rng.standard_normal(N)).astype(np.float32)
    d_x, d_W, d_pw = cuda.to_device(x), cuda.to_device(W_store), cuda.to_device(pw)
    assert lin.fuses_post(d_x, d_W) == fused
    assert not lin.fuses_post(d_x, d_W, a_hl=cuda.to_device(np.zeros((M, 2 * N), np.uint16)))
    assert not lin.fuses_post(cuda.to_device(np.zeros((2, K), np.float32)), d_W)
    d_y, d_a = cuda.to_device(poisoned((M, N))), cuda.to_device(poisoned((M, N)))
    d_hl = cuda.to_device(np.zeros((M, 2 * N), np.uint16))
    lin.linear(d_x, d_W, d_y, post=(d_pw, 1e-6, d_a, None))
    a = d_a.copy_to_host()
    ref = linear_ref(x.astype(np.float64), W_seen)
    assert rel_err(a, rmsnorm_ref(ref, pw, 1e-6)) < 2e-6
    d_a2 = cuda.to_device(poisoned((M, N)))
    lin.linear(d_x, d_W, d_y, post=(d_pw, 1e-6, d_a2, d_hl))  # (the hi / lo too: the separate norm)
    np.testing.assert_array_equal(a, d_a2.copy_to_host())
    assert d_hl.copy_to_host().any()
    with pytest.raises(ValueError, match="post needs"):
        lin.linear_v2(d_x, d_W, d_y, post=(cuda.to_device(np.ones(N + 1, np.float32)), 1e-6, d_a))


# ---- GLU prologue: y = (silu(gate) * up) @ W^T for x = [gate | up] (dense_mlp's down projection) ------------
# (M, N, K, wdtype, accumulate, tm, splits, warps). In the simulator a K-chunk is V2_KCW = 64 words: K = 300
# f32 is 4 full chunks + a partial one; bf16 K = 130 (65 words) in 2 splits is one full chunk, then one word;
# 3 warps (96 threads) do not divide a chunk: the generic runtime-loop staging. Odd K: uint16 words (PACK 1).
V2_GLU_CASES = [(1, 21, 300, "f32", False, 1, 1, None), (3, 21, 130, "bf16", True, 4, 2, None),
                (17, 21, 300, "bf16", True, 16, 1, None), (5, 20, 71, "bf16", False, 8, 1, 3),
                (2, 21, 200, "f32", True, 2, 2, 3)]


def _glu_branches(M, N, K, wdtype, tm, splits, warps) -> set[str]:
    """The staging branches of linear_v2 a GLU case runs: "full" / "partial" chunks, or "generic"."""
    kind = "bf16x2" if (wdtype == "bf16" and K % 2 == 0) else wdtype
    Kw = K // lin._KINDS[kind][1]
    TM, NR, U, w, S, ks = lin._v2_plan(M, N, Kw, lin._device()[1], tm, splits, warps)
    assert splits is None or S == splits, f"the case must really run {splits} K-splits (got {S})"
    prm = lin._v2_params(kind, TM, NR, U, w)
    if prm["KCE"] % prm["NT"]:
        return {"generic"}
    lens = [min(ks, Kw - z * ks) for z in range(S)]  # each split's words, staged in chunks of KCW
    return {"full" for n in lens if n >= prm["KCW"]} | {"partial" for n in lens if n % prm["KCW"]}


def test_linear_v2_glu_cases_reach_every_staging_branch():
    assert set().union(*(_glu_branches(*c[:4], *c[5:]) for c in V2_GLU_CASES)) == {"full", "partial", "generic"}


def _glu_inputs(rng, M, K, accumulate, N):
    """(x [M, 2K] = [gate | up] float32, y0 [M, N]: random when accumulating, else NaN-poisoned)."""
    x = (rng.standard_normal((M, 2 * K)) * 2).astype(np.float32)
    y0 = rng.standard_normal((M, N)).astype(np.float32) if accumulate else poisoned((M, N))
    return x, y0


def _glu_ref(x, W_seen, y0, accumulate):
    K = W_seen.shape[1]
    x64 = x.astype(np.float64)
    return linear_ref(silu_ref(x64[:, :K]) * x64[:, K:], W_seen) + (y0.astype(np.float64) if accumulate else 0.0)


def _rows_of_taller(x):
    """x on the device as the first rows of a taller NaN-poisoned array (a row slice, as dense_mlp's h[:M])."""
    d = cuda.to_device(np.concatenate([x, poisoned((3, x.shape[1]))]))
    return d[: x.shape[0]]


@pytest.mark.kernels
@pytest.mark.parametrize("M,N,K,wdtype,accumulate,tm,splits,warps", V2_GLU_CASES)
def test_linear_v2_glu_sim(rng, M, N, K, wdtype, accumulate, tm, splits, warps):
    """linear_v2(glu=True) against float64 (bound 1e-5: dropping the silu or reading the gate as up is off by
    O(1)), and bitwise equal to silu_mul into a then linear_v2 on a, with the same plan; x unchanged."""
    W_store, W_seen, _ = _weights(rng, N, K, wdtype)
    x, y0 = _glu_inputs(rng, M, K, accumulate, N)
    d_x, d_W, d_y = _rows_of_taller(x), cuda.to_device(W_store), cuda.to_device(y0)
    plan = dict(tm=tm, splits=splits, warps=warps)
    lin.linear_v2(d_x, d_W, d_y, accumulate, glu=True, **plan)
    out = d_y.copy_to_host()
    err = rel_err(out, _glu_ref(x, W_seen, y0, accumulate))
    assert err < FP32_BOUND, f"rel_err {err:.3g}"
    np.testing.assert_array_equal(d_x.copy_to_host(), x)
    d_a, d_y2 = cuda.to_device(poisoned((M, K))), cuda.to_device(y0)
    ew.silu_mul(d_x[:, :K], d_x[:, K:], d_a)
    lin.linear_v2(d_a, d_W, d_y2, accumulate, **plan)
    np.testing.assert_array_equal(out, d_y2.copy_to_host())


@pytest.mark.kernels
@pytest.mark.parametrize("version,fused", [("2", True), ("2", False), ("1", True)])
def test_linear_glu_sim(rng, monkeypatch, version, fused):
    """``linear(..., glu=a)``: fused into linear_v2 (a untouched) or, with KDT_LINEAR_FUSE_GLU off or under v1,
    silu_mul into a then the plain launch on a; the same bits either way."""
    monkeypatch.setattr(lin, "VERSION", version)
    M, N, K = 3, 21, 130
    W_store, W_seen, _ = _weights(rng, N, K, "bf16")
    x, y0 = _glu_inputs(rng, M, K, True, N)
    d_x, d_W = _rows_of_taller(x), cuda.to_device(W_store)
    outs = []
    for fuse in (fused, False):
        monkeypatch.setattr(lin, "FUSE_GLU", fuse)
        d_y, d_a = cuda.to_device(y0), cuda.to_device(poisoned((M, K)))
        lin.linear(d_x, d_W, d_y, accumulate=True, glu=d_a)
        outs.append(d_y.copy_to_host())
        a = d_a.copy_to_host()
        if fuse and version == "2":
            assert np.isnan(a).all(), "the fused launch writes no scratch"
        else:
            x64 = x.astype(np.float64)
            assert rel_err(a, silu_ref(x64[:, :K]) * x64[:, K:]) < 1e-6
    assert rel_err(outs[0], _glu_ref(x, W_seen, y0, True)) < FP32_BOUND
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.kernels
def test_linear_glu_rejects_bad_args():
    M, N, K = 2, 4, 8
    x, y = cuda.to_device(np.zeros((M, 2 * K), np.float32)), cuda.to_device(np.zeros((M, N), np.float32))
    W, a = cuda.to_device(np.zeros((N, K), np.float32)), cuda.to_device(np.zeros((M, K), np.float32))
    with pytest.raises(ValueError, match="norm and glu"):
        lin.linear(x, W, y, norm=(cuda.to_device(np.ones(2 * K, np.float32)), 1e-6, a), glu=a)
    with pytest.raises(ValueError, match="norm and glu"):
        lin.linear_v2(x, W, y, norm=(cuda.to_device(np.ones(K, np.float32)), 1e-6), glu=True)
    with pytest.raises(ValueError, match=f"2K = {2 * K} columns"):
        lin.linear(x[:, :K], W, y, glu=a)
    with pytest.raises(ValueError, match=f"2K = {2 * K} columns"):
        lin.linear_v2(x[:, : K + 1], W, y, glu=True)
    for bad in (np.zeros((M, K + 1), np.float32), np.zeros((M + 1, K), np.float32), np.zeros((M, K), np.float64)):
        with pytest.raises(ValueError, match="glu scratch"):
            lin.linear(x, W, y, glu=cuda.to_device(bad))


def test_linear_glu_engine_variants(monkeypatch):
    """fuses_glu holds for every down projection the engine runs through dense_mlp (fixtures/model_code.h5's
    target and drafter, model_tiny.h5's) and for no Moonlight or Kimi-K2 one; GLU_ENGINE_SHAPES (what the sm_90
    check registers) are those shapes, and on the H200 (4 warps, 132 SMs) they plan 4 variants."""
    import json

    import h5py

    from kdt.config import preset
    from kdt.fixture import read_config

    fixtures = Path(__file__).resolve().parent.parent / "fixtures"
    code, tiny = (read_config(str(fixtures / f"model_{n}.h5")) for n in ("code", "tiny"))
    with h5py.File(fixtures / "model_code.h5") as f:
        drafter_i = json.loads(f["drafter"].attrs["config"])["intermediate_size"]
    downs = {(code.hidden_size, code.intermediate_size), (code.hidden_size, drafter_i),
             (tiny.hidden_size, tiny.intermediate_size)}
    assert downs == {(N, K) for _, N, K, _ in lin.GLU_ENGINE_SHAPES}
    monkeypatch.setattr(lin, "FUSE_GLU", True)
    assert all(lin.fuses_glu(N, K) for N, K in downs)
    for name in ("moonlight-16b-a3b", "kimi-k2"):
        (N, K), = ((N, K) for p, N, K in preset(name).dense_projections() if p == "mlp_down")
        assert not lin.fuses_glu(N, K), name
    monkeypatch.setattr(lin, "FUSE_GLU", False)
    assert not lin.fuses_glu(4, 4)
    monkeypatch.setattr(lin, "V2_WARPS", 4)
    monkeypatch.setattr(lin, "_v2_plan", functools.cache(lin._v2_plan.__wrapped__))
    assert sorted(lin.glu_variants(132)) == [("bf16x2", 1, 8, 2, 4), ("bf16x2", 4, 8, 2, 4), ("f32", 1, 8, 2, 4),
                                             ("f32", 4, 8, 2, 4)]

@pytest.mark.kernels
def test_linear_v2_split_deterministic_and_scratch_reused(rng):
    """K-split partial sums are reduced in a fixed order (by the last block of each tile, same launch):
    two runs give identical bits; the second call of a shape allocates no new scratch (what CUDA-graph
    capture needs) and finds every tile's ticket back at zero."""
    M, N, K = 5, 24, 300
    W_store, W_seen, W_fp32 = _weights(rng, N, K, "bf16")
    d_W = cuda.to_device(W_store)
    x = cuda.to_device(rng.standard_normal((M, K)).astype(np.float32))
    outs = []
    for _ in range(2):
        d_y = cuda.to_device(poisoned((M, N)))
        lin.linear_v2(x, d_W, d_y, splits=3)
        outs.append(d_y.copy_to_host())
        n_scratch = len(lin._SCRATCH)
    assert len(lin._SCRATCH) == n_scratch
    assert np.array_equal(outs[0], outs[1])
    # the tile that reduced its splits handed its ticket back: every counter is zero for the next launch
    for _, tickets in lin._SCRATCH.values():
        assert not tickets.copy_to_host().any()
    assert rel_err(outs[0], linear_ref(x.copy_to_host().astype(np.float64), W_seen)) < BF16_VS_ROUNDED


@pytest.mark.kernels
@pytest.mark.parametrize("M,N,K,accumulate,plan", [
    (17, 37, 72, False, None),  # the default plan: 3 token tiles, 8 warps over 5 groups of K (some past it)
    (40, 50, 136, True, None),  # 2 blocks of 3 token tiles (tc.token_tiles: 48 tokens computed, not 64), accumulate
    (16, 37, 40, True, (1, 1, 1, 3, 3)),  # one row tile, one token tile a block, 3 warps
    (16, 70, 40, False, (1, 1, 1, 4, 2)),  # 2 row groups of 2 warps splitting K, the last block partly past N
])
def test_linear_tc_sim(rng, monkeypatch, M, N, K, accumulate, plan):
    """bf16 weights at M >= TC_MIN_M (the small-matrix bound lowered for the simulator's shapes) go to the
    tensor-core kernel through linear(); against float64 on the rounded weights, the bf16 bounds."""
    monkeypatch.setattr(lin, "TC_MIN_WEIGHTS", 0)
    monkeypatch.setattr(lin, "TC_MIN_M", 16)
    W_store, W_seen, W_fp32 = _weights(rng, N, K, "bf16")
    calls = []
    tc_fn = lin.linear_tc
    monkeypatch.setattr(lin, "linear_tc", lambda *a, **kw: (calls.append(1), tc_fn(*a, **kw, plan=plan)))
    _check(rng, M, W_store, W_seen, W_fp32, accumulate)
    assert calls == [1]


def _check_norm_tc(rng, monkeypatch, M, N, K, hilo, accumulate):
    """linear(..., norm=(gw, eps, a)) on tensor cores: the norm writes a as hi / lo (TC_HILO_X; a's bytes then hold
    bf16 hi / lo pairs) or float32; y against float64 on the rounded weights, a's value (hi + lo) against the
    normalised rows, x unchanged."""
    monkeypatch.setattr(lin, "TC_HILO_X", hilo)
    W_store, W_seen, _ = _weights(rng, N, K, "bf16")
    x = (rng.standard_normal((M, K)) * 3).astype(np.float32)
    gw = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32)
    y0 = rng.standard_normal((M, N)).astype(np.float32) if accumulate else poisoned((M, N))
    d_x, d_y, d_a = cuda.to_device(x), cuda.to_device(y0), cuda.to_device(poisoned((M, K)))
    seen = []
    tc_fn = lin.linear_tc
    monkeypatch.setattr(lin, "linear_tc", lambda x, *a, **kw: (seen.append(np.dtype(x.dtype)), tc_fn(x, *a, **kw)))
    lin.linear(d_x, cuda.to_device(W_store), d_y, accumulate, norm=(cuda.to_device(gw), 1e-6, d_a))
    assert seen == [np.dtype(np.uint64) if hilo else np.dtype(np.float32)]
    xn = rmsnorm_ref(x.astype(np.float64), gw, 1e-6)
    a = d_a.copy_to_host()
    if hilo:
        halves = a.view(np.uint16).reshape(M, K // 4, 2, 4).astype(np.uint16)
        a = (bf16_bits_to_f32(halves[:, :, 0]).astype(np.float64)
             + bf16_bits_to_f32(halves[:, :, 1]).astype(np.float64)).reshape(M, K)
    assert rel_err(a, xn) < (1e-5 if hilo else 1e-6)  # hi + lo: x to ~2^-17 an element
    ref = linear_ref(xn, W_seen) + (y0.astype(np.float64) if accumulate else 0.0)
    assert rel_err(d_y.copy_to_host(), ref) < BF16_VS_ROUNDED
    np.testing.assert_array_equal(d_x.copy_to_host(), x)


@pytest.mark.kernels
@pytest.mark.parametrize("hilo", [True, False])
@pytest.mark.parametrize("M,N,K,accumulate", [(17, 37, 72, False), (16, 20, 40, True)])
def test_linear_norm_tc_sim(rng, monkeypatch, hilo, M, N, K, accumulate):
    """The norm before a tensor-core linear (the lm_head's, [q_a | kv_a]'s) writes x as hi / lo for it (see
    _check_norm_tc), or float32 with KDT_LINEAR_HILO_X=0."""
    monkeypatch.setattr(lin, "TC_MIN_WEIGHTS", 0)
    monkeypatch.setattr(lin, "TC_MIN_M", 16)
    monkeypatch.setattr(lin, "FUSE_NORM", False)
    _check_norm_tc(rng, monkeypatch, M, N, K, hilo, accumulate)


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(64, 163840, 2048), (65, 163840, 2048), (16, 3648, 2048), (65, 3648, 2048),
                                   (33, 1000, 1004)])
def test_linear_norm_tc_gpu(rng, monkeypatch, M, N, K):
    """The hi / lo norm and the tensor cores at the lm_head (M = 64; 65: the tiled GEMM's wide plan), [q_a | kv_a]
    (M = 16; 65: 4 warps a block) and a ragged shape."""
    monkeypatch.setattr(lin, "TC_MIN_WEIGHTS", 0)  # the ragged one's 1000 x 1004 weights: tensor cores, and the
    monkeypatch.setattr(lin, "FUSE_NORM", False)  # norm not folded into v2 as for other small matrices
    _check_norm_tc(rng, monkeypatch, M, N, K, True, M == 33)


def _check_fo(rng, monkeypatch, M, N, K, plan=None):
    """linear(..., fo=fragment_order(W)) where the tensor cores take hi / lo x, directly (o_proj's call) and after the
    norm (qkv_a's): y the same bits as with W alone (NaN-poisoned before each run) and the float64 reference's to the
    bf16 bound; a fragment order of other weights moves y (the copy is what the kernel reads); float32 x ignores fo,
    and so does linear_tc below FO_MIN_M tokens (lowered to 1 here, then raised past M)."""
    from kdt.kernels import tc

    monkeypatch.setattr(lin, "FO_MIN_M", 1)

    W_store, W_seen, _ = _weights(rng, N, K, "bf16")
    d_W = cuda.to_device(W_store)
    fo = lin.fragment_order(d_W)
    assert fo is not None and tuple(fo.shape) == (1, N, K // 4)
    np.testing.assert_array_equal(fo.copy_to_host(), tc.fo_np(W_store.view(np.uint64).reshape(1, N, K // 4)))
    if plan is not None:
        tc_fn = lin.linear_tc
        monkeypatch.setattr(lin, "linear_tc", lambda *a, **kw: tc_fn(*a, **kw, plan=plan))
    x = (rng.standard_normal((M, K)) * 2).astype(np.float32)
    gw = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32)
    d_xh, d_x, d_gw = cuda.to_device(tc.hilo_np(x)), cuda.to_device(x), cuda.to_device(gw)

    def run(w_fo, hilo=True, norm=False):
        d_y = cuda.to_device(poisoned((M, N)))
        if norm:
            lin.linear(d_x, d_W, d_y, norm=(d_gw, 1e-6, cuda.to_device(poisoned((M, K)))), fo=w_fo)
        else:
            lin.linear(d_xh if hilo else d_x, d_W, d_y, fo=w_fo)
        return d_y.copy_to_host()

    for norm in (False, True):
        y_fo, y_w = run(fo, norm=norm), run(None, norm=norm)
        np.testing.assert_array_equal(y_fo, y_w)
        xr = rmsnorm_ref(x.astype(np.float64), gw, 1e-6) if norm else x.astype(np.float64)
        assert rel_err(y_fo, linear_ref(xr, W_seen)) < BF16_VS_ROUNDED
    other = lin.fragment_order(cuda.to_device(_weights(rng, N, K, "bf16")[0]))
    y_w = run(None)  # (hi / lo x, no norm: what run(other) computes)
    assert rel_err(run(other), y_w) > 0.1
    np.testing.assert_array_equal(run(other, hilo=False), run(None, hilo=False))  # float32 x: W, not fo
    if plan is None:  # below FO_MIN_M tokens linear_tc reads W
        monkeypatch.setattr(lin, "FO_MIN_M", M + 1)
        np.testing.assert_array_equal(run(other), y_w)


@pytest.mark.kernels
@pytest.mark.parametrize("M,N,K,plan", [
    (17, 32, 64, None),  # the default plan: 3 token tiles, 8 warps splitting K (some past it)
    (16, 48, 48, (2, 2, 2, 4, 2)),  # 2 row groups, the last row tile past N; Kw = 12 words: the masked group
    (16, 16, 32, (1, 1, 1, 2, 2)),
])
def test_linear_fo_same_bits_sim(rng, monkeypatch, M, N, K, plan):
    """linear's ``fo`` (the attention's qkv_a / o_proj in fragment order, kdt.engine.cuda_model.ATTN_FO) at the
    simulator's shapes: see _check_fo."""
    monkeypatch.setattr(lin, "TC_MIN_WEIGHTS", 0)
    monkeypatch.setattr(lin, "TC_MIN_M", 16)
    monkeypatch.setattr(lin, "FUSE_NORM", False)
    _check_fo(rng, monkeypatch, M, N, K, plan)


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(16, 3648, 2048), (65, 3648, 2048), (65, 2048, 2048), (256, 3648, 2048),
                                   (33, 1008, 1008)])
def test_linear_fo_same_bits_gpu(rng, monkeypatch, M, N, K):
    """linear's ``fo`` at Moonlight's qkv_a and o_proj (16 / 65 / 256 tokens) and a ragged shape: see _check_fo."""
    monkeypatch.setattr(lin, "TC_MIN_WEIGHTS", 0)
    monkeypatch.setattr(lin, "FUSE_NORM", False)
    _check_fo(rng, monkeypatch, M, N, K)


@pytest.mark.kernels
def test_linear_fo_rejects_and_declines():
    """fragment_order declines float32 weights and shapes off the order (N % 16, K % 16); linear_tc rejects an fo
    of the wrong shape."""
    assert lin.fragment_order(cuda.to_device(np.zeros((32, 64), np.float32))) is None
    assert lin.fragment_order(cuda.to_device(np.zeros((36, 64), np.uint16))) is None
    assert lin.fragment_order(cuda.to_device(np.zeros((32, 56), np.uint16))) is None
    W = cuda.to_device(np.zeros((32, 64), np.uint16))
    bad = lin.fragment_order(cuda.to_device(np.zeros((16, 64), np.uint16)))
    x, y = cuda.to_device(np.zeros((16, 32), np.uint64)), cuda.device_array((16, 32), np.float32)
    with pytest.raises(ValueError, match="fragment order"):
        lin.linear_tc(x, W, y, fo=bad)


@pytest.mark.kernels
def test_linear_tc_rules(monkeypatch):
    """Tensor cores for bf16, contiguous, K % 4 == 0, M >= TC_MIN_M and large enough matrices only."""
    bf = cuda.to_device(np.zeros((64, 40), np.uint16))
    monkeypatch.setattr(lin, "TC_MIN_WEIGHTS", 64 * 40)
    monkeypatch.setattr(lin, "TC_MIN_M", 16)
    assert lin.uses_tc(16, bf) and not lin.uses_tc(15, bf)
    assert not lin.uses_tc(16, cuda.to_device(np.zeros((64, 40), np.float32)))
    assert not lin.uses_tc(16, cuda.to_device(np.zeros((64, 42), np.uint16)))  # K % 4
    assert not lin.uses_tc(16, cuda.to_device(np.zeros((64, 48), np.uint16))[:, :40])  # a column slice
    assert not lin.uses_tc(16, cuda.to_device(np.zeros((63, 40), np.uint16)))  # below TC_MIN_WEIGHTS
    long_k = cuda.to_device(np.zeros((16, 4 * 16 + 4), np.uint16))  # K > TC_LONG_K N: v2 below M = 32
    monkeypatch.setattr(lin, "TC_MIN_WEIGHTS", 0)
    assert not lin.uses_tc(31, long_k) and lin.uses_tc(32, long_k) and lin.uses_tc(16, bf)
    monkeypatch.setattr(lin, "TC_MIN_M", 0)
    assert not lin.uses_tc(64, bf)


def test_linear_dispatch(monkeypatch):
    """VERSION picks the kernel family; v2 only for V2_MIN_M <= M <= V2_MAX_M."""
    monkeypatch.setattr(lin, "TC_MIN_M", 0)
    calls = []
    monkeypatch.setattr(lin, "linear_v1", lambda x, *a: calls.append(("v1", x.shape[0])))
    monkeypatch.setattr(lin, "linear_v2", lambda x, *a: calls.append(("v2", x.shape[0])))
    monkeypatch.setattr(lin, "V2_MIN_M", 2)
    monkeypatch.setattr(lin, "V2_MAX_M", 64)
    xs = {M: np.zeros((M, 4), np.float32) for M in (1, 2, 64, 65)}
    for v in ("1", "2"):
        monkeypatch.setattr(lin, "VERSION", v)
        for x in xs.values():
            lin.linear(x, None, None)
    assert calls == [("v1", 1), ("v1", 2), ("v1", 64), ("v1", 65), ("v1", 1), ("v2", 2), ("v2", 64), ("v1", 65)]


def test_linear_v2_plan_fills_the_gpu(monkeypatch):
    """On a 132-SM H200 (4 warps per block, as there) the plan splits K for the 576-row projection (18
    row blocks) and for M <= 16 on 2048-wide ones, not for the lm_head; every split has whole steps and
    the splits cover K."""
    monkeypatch.setattr(lin, "V2_WARPS", 4)
    # the plan is cached by shape and reads the module's constants: a fresh cache for this test
    monkeypatch.setattr(lin, "_v2_plan", functools.cache(lin._v2_plan.__wrapped__))
    for N, Kw, M, want_split in ((576, 1024, 16, True), (576, 1024, 64, True), (3072, 1024, 16, True),
                                 (163840, 1024, 16, False), (576, 3584, 4, True)):
        TM, NR, U, warps, S, ks = lin._v2_plan(M, N, Kw, 132)
        assert (S > 1) == want_split, (N, Kw, M, S)
        assert ks % (32 * U) == 0 and (S - 1) * ks < Kw <= S * ks
        assert ks // (32 * U) >= lin.V2_MIN_STEPS or S == 1


def test_linear_v2_plan_small_weight_rule(monkeypatch):
    """Small matrices (fixtures/model_code.h5's) take the smallest token tile (4 at least) whose plan fits
    one wave of resident blocks and whose tiles together read at most V2_SHRINK_WORDS weight words: TM 4
    at M = 16 / 17 / 32 of the DDTree step, 8 for the drafter's 2048 x 256 float32 gate_up at M = 32 (as
    the H200 sweep found best); M <= 4 keeps its tile. No Moonlight or Kimi-K2 projection changes plan,
    at any M; with the rule off every shape keeps _v2_tm's tile."""
    from kdt.config import preset

    monkeypatch.setattr(lin, "V2_WARPS", 4)
    monkeypatch.setattr(lin, "V2_SHRINK_TM", True)
    fresh = functools.cache(lin._v2_plan.__wrapped__)
    monkeypatch.setattr(lin, "_v2_plan", fresh)
    # (N, Kw, M) -> TM: model_code's target (bf16 pairs) and drafter (float32 words) projections
    small = {(176, 128, 17): 4, (192, 48, 16): 4, (256, 64, 32): 4, (1536, 128, 17): 4, (256, 384, 32): 4,
             (256, 768, 16): 4, (2048, 256, 32): 8, (2048, 256, 17): 4, (256, 1024, 32): 4, (256, 128, 1): 1,
             (256, 128, 3): 4}
    for (N, Kw, M), want in small.items():
        assert fresh(M, N, Kw, 132)[0] == want, (N, Kw, M)
    big = [(N, K // 2, M) for name in ("moonlight-16b-a3b", "kimi-k2") for _, N, K in preset(name).dense_projections()
           for M in (1, 8, 16, 17, 32, 64, 256)]
    assert all(2 * N * Kw > lin.V2_SHRINK_WORDS for N, Kw, _ in big)
    with_rule = {c: fresh(c[2], c[0], c[1], 132) for c in big}
    monkeypatch.setattr(lin, "V2_SHRINK_TM", False)
    off = functools.cache(lin._v2_plan.__wrapped__)
    monkeypatch.setattr(lin, "_v2_plan", off)
    assert all(with_rule[c] == off(c[2], c[0], c[1], 132) for c in big)
    for N, Kw, M in small:
        assert off(M, N, Kw, 132)[0] == lin._v2_tm(M), (N, Kw, M)


@pytest.mark.kernels
def test_linear_rejects_bad_shapes():
    x, y = cuda.to_device(np.zeros((2, 8), np.float32)), cuda.to_device(np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError):
        lin.linear(x, cuda.to_device(np.zeros((4, 9), np.float32)), y)
    with pytest.raises(TypeError):
        lin.linear(x, cuda.to_device(np.zeros((4, 8), np.float64)), y)


# ---- real GPU: real model shapes -----------------------------------------------------------------------
GPU_M = (1, 4, 16, 64, 128, 300, 2048)
GPU_SHAPES = [  # (N, K)
    (3072, 2048),  # Moonlight q_proj: H * (dn + dr) = 16 * 192, D = 2048
    (576, 2048),  # Moonlight kv_a_proj_with_mqa: Rkv + dr = 512 + 64
    (2048, 2048),  # Moonlight o_proj (H * dv = 16 * 128 -> D)
    (1536, 7168),  # DeepSeek-V3 / Kimi q_a_proj: D 7168 -> Rq 1536
    (24576, 1536),  # Kimi q_b_proj: Rq 1536 -> H * (dn + dr) = 128 * 192
    (7168, 8192),  # Kimi o_proj: H * dv = 64 * 128 -> D 7168
]


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
@pytest.mark.parametrize("N,K", GPU_SHAPES)
def test_linear_gpu(rng, version, N, K, wdtype):
    W_store, W_seen, W_fp32 = _weights(rng, N, K, wdtype)
    d_W = cuda.to_device(W_store)
    for i, M in enumerate(GPU_M):
        _check(rng, M, W_store, W_seen, W_fp32, accumulate=bool(i % 2), d_W=d_W)


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("N,K", GPU_SHAPES)
def test_linear_tc_gpu(rng, monkeypatch, N, K):
    """The tensor-core kernel (the default from M = 16, KDT_LINEAR_TC_M) through linear() at real shapes, bf16."""
    monkeypatch.setattr(lin, "TC_MIN_M", 16)
    W_store, W_seen, W_fp32 = _weights(rng, N, K, "bf16")
    d_W = cuda.to_device(W_store)
    for i, M in enumerate(m for m in GPU_M if m >= 16):
        assert lin.uses_tc(M, d_W) == (M >= 32 or K <= lin.TC_LONG_K * N)  # (Kimi's q_a at M = 16: v2)
        _check(rng, M, W_store, W_seen, W_fp32, accumulate=bool(i % 2), d_W=d_W)


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(576, 2048), (3072, 2048), (576, 7168)])
def test_linear_v2_gpu_splits_deterministic(rng, N, K):
    """v2 with forced token tiles and K-splits at real shapes; a split run repeated gives identical bits."""
    W_store, W_seen, W_fp32 = _weights(rng, N, K, "bf16")
    d_W = cuda.to_device(W_store)
    for M, tm, splits in ((16, 16, 8), (64, 16, 3), (64, 8, 1), (4, 4, 4), (1, 1, 2), (48, None, None)):
        fn = functools.partial(lin.linear_v2, tm=tm, splits=splits)
        _check(rng, M, W_store, W_seen, W_fp32, accumulate=splits == 3, d_W=d_W, fn=fn)
        x = cuda.to_device(rng.standard_normal((M, K)).astype(np.float32))
        outs = []
        for _ in range(2):
            d_y = cuda.device_array((M, N), np.float32)
            fn(x, d_W, d_y)
            outs.append(d_y.copy_to_host())
        assert np.array_equal(outs[0], outs[1]), f"M={M} tm={tm} splits={splits}: not deterministic"


@pytest.mark.kernels
@pytest.mark.gpu
def test_linear_tc_gpu_lm_head(rng):
    """The lm_head (vocab x D) on tensor cores, the default from M = 16, bf16."""
    N, K = 163840, 2048
    W_store, W_seen, W_fp32 = _weights(rng, N, K, "bf16")
    d_W = cuda.to_device(W_store)
    for M in (16, 64):
        assert lin.uses_tc(M, d_W)
        _check(rng, M, W_store, W_seen, W_fp32, accumulate=False, d_W=d_W)


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
def test_linear_gpu_lm_head(rng, version, wdtype):
    N, K = 163840, 2048  # lm_head: vocab x D (Moonlight / Kimi vocab)
    W_store, W_seen, W_fp32 = _weights(rng, N, K, wdtype)
    d_W = cuda.to_device(W_store)
    for M in (1, 16):
        _check(rng, M, W_store, W_seen, W_fp32, accumulate=False, d_W=d_W)


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
@pytest.mark.parametrize("K", [768, 1024])
def test_linear_glu_gpu(rng, monkeypatch, K, wdtype):
    """``linear(..., glu=a)`` at the engine's down projections (N = 256; K = 768 / 1024) and step sizes: against
    float64, and bitwise equal to the unfused launches (KDT_LINEAR_FUSE_GLU off: silu_mul, then linear on a)."""
    N = 256
    W_store, W_seen, _ = _weights(rng, N, K, wdtype)
    d_W = cuda.to_device(W_store)
    for M in (1, 17, 32):
        x, y0 = _glu_inputs(rng, M, K, M == 17, N)
        d_x, outs = _rows_of_taller(x), []
        for fuse in (True, False):
            monkeypatch.setattr(lin, "FUSE_GLU", fuse)
            d_y = cuda.to_device(y0)
            lin.linear(d_x, d_W, d_y, accumulate=M == 17, glu=cuda.device_array((M, K), np.float32))
            outs.append(d_y.copy_to_host())
        err = rel_err(outs[0], _glu_ref(x, W_seen, y0, M == 17))
        assert err < FP32_BOUND, f"M={M} K={K} {wdtype}: rel_err {err:.3g}"
        np.testing.assert_array_equal(outs[0], outs[1], err_msg=f"M={M} K={K} {wdtype}: fused != unfused")
