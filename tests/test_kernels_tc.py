"""kdt.kernels.tc (tensor cores: mma.sync m16n8k16 bf16, x as bf16 hi + lo) against float64.

The warp tile alone, through :func:`tc.gemm_kernel` (y = X W^T): natural and word-permuted X, 1-2 row tiles,
1-2 token tiles, several warps splitting K with the last groups partly or wholly past it, warps in row groups
(kw), ragged M and N. Bound:
rel_err < 1e-5 against float64 on the bf16-rounded weights. A kernel that dropped the lo half of x (bf16 x) would
be at ~1e-3, one that misplaced a fragment or a k group at ~1 (the split's own check below).
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from kdt.kernels import tc
from kdt.kernels.common import IS_SIM, bf16_bits_to_f32, f32_to_bf16_bits
from kdt.testing import poisoned, rel_err

BOUND = 1e-5


def _gemm(rng, M, N, K, rt, nt, u, nw, perm, E=1, e=0, accumulate=False, kw=0):
    """Run the tile on fresh inputs (y poisoned); returns (rel_err, rel_err with bf16 x)."""
    W = (rng.standard_normal((E, N, K)) / np.sqrt(K)).astype(np.float32)
    bits = f32_to_bf16_bits(W)
    Wseen = bf16_bits_to_f32(bits[e]).astype(np.float64)
    X = rng.standard_normal((M, K)).astype(np.float32)
    Xd = X.reshape(M, K // 4, 4).transpose(0, 2, 1).reshape(M, K).copy() if perm else X
    y0 = rng.standard_normal((M, N)).astype(np.float32) if accumulate else poisoned((M, N))
    y = cuda.to_device(y0)
    k = tc.gemm_kernel(rt, nt, u, nw, perm, kw)
    grid = (-(-M // (8 * nt)), -(-N // (16 * rt * (nw // (kw or nw)))))
    k[grid, nw * 32](cuda.to_device(Xd), cuda.to_device(bits.view(np.uint64)), e, y, accumulate)
    got = y.copy_to_host()
    ref = X.astype(np.float64) @ Wseen.T + (y0 if accumulate else 0.0)
    x_bf16 = bf16_bits_to_f32(f32_to_bf16_bits(X)).astype(np.float64)
    return rel_err(got, ref), rel_err(x_bf16 @ Wseen.T, ref)


SIM_CASES = [  # M, N, K, rt, nt, u, nw, perm, kw
    (5, 20, 40, 1, 1, 1, 1, False, 0),  # one warp, K = 10 words: a partial group
    (9, 40, 72, 2, 2, 2, 2, True, 0),  # 2 x 2 tiles, permuted x, the second warp's groups partly past K
    (17, 33, 24, 1, 2, 3, 3, False, 0),  # 3 warps over 2 groups: the last warp's group wholly past K
    (9, 70, 40, 1, 2, 1, 4, True, 2),  # 2 row groups of 2 warps splitting K, the last block's rows partly past N
    (7, 40, 24, 1, 1, 2, 3, False, 1),  # 3 row groups of one warp (no K split), the third wholly past N
]


@pytest.mark.kernels
@pytest.mark.parametrize("M,N,K,rt,nt,u,nw,perm,kw", SIM_CASES)
def test_tc_gemm(rng, M, N, K, rt, nt, u, nw, perm, kw):
    if not IS_SIM:
        pytest.skip("simulator shapes (the GPU's are in test_tc_gemm_gpu)")
    err, err_bf16_x = _gemm(rng, M, N, K, rt, nt, u, nw, perm, E=2, e=1, accumulate=perm, kw=kw)
    assert err < BOUND, f"rel_err {err:.3g}"
    assert err_bf16_x > 10 * BOUND  # the bound tells a kernel without the lo half of x


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,rt,nt,u,nw,perm,kw", [
    (64, 2816, 2048, 2, 1, 4, 4, True, 0),  # Moonlight's shared gate_up rows, 64 tokens
    (6, 2048, 1408, 2, 1, 2, 4, True, 0),  # a routed down: ~6 tokens an expert
    (256, 576, 2048, 1, 2, 2, 4, False, 0),  # kv_a's rows, 256 tokens
    (33, 1000, 1004, 2, 2, 4, 3, False, 0),  # ragged everything
    (64, 3000, 2048, 2, 4, 2, 4, False, 1),  # four row groups of one warp, the last block partly past N
])
def test_tc_gemm_gpu(rng, M, N, K, rt, nt, u, nw, perm, kw):
    err, _ = _gemm(rng, M, N, K, rt, nt, u, nw, perm, accumulate=M == 33, kw=kw)
    assert err < BOUND, f"rel_err {err:.3g}"


@cuda.jit
def _split_kernel(x, hi, lo):
    i = cuda.grid(1)
    if 2 * i + 1 < x.shape[0]:
        hi[i], lo[i] = tc.split_bf16x2(x[2 * i], x[2 * i + 1])


@pytest.mark.kernels
def test_split_bf16x2(rng):
    """hi + lo carries x to ~2^-17 (x - hi is exact, lo its rounding); hi is x rounded to nearest even, the first
    element of each pair in the low halves."""
    x = (rng.standard_normal(512) * np.exp(rng.uniform(-20, 20, 512))).astype(np.float32)
    hi, lo = cuda.to_device(np.zeros(256, np.uint32)), cuda.to_device(np.zeros(256, np.uint32))
    _split_kernel[2, 128](cuda.to_device(x), hi, lo)
    h, lw = hi.copy_to_host(), lo.copy_to_host()
    pairs = np.stack([h & 0xFFFF, h >> 16], axis=1).reshape(-1).astype(np.uint16)
    np.testing.assert_array_equal(pairs, f32_to_bf16_bits(x))
    lo_f = bf16_bits_to_f32(np.stack([lw & 0xFFFF, lw >> 16], axis=1).reshape(-1).astype(np.uint16))
    total = bf16_bits_to_f32(pairs).astype(np.float64) + lo_f.astype(np.float64)
    assert np.all(np.abs(total - x) <= 2.0 ** -16 * np.abs(x))
