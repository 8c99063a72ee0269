"""Parity of kdt.kernels.linear (skinny and tiled-GEMM paths, float32 and bf16 weights, accumulate)
against kdt.reference.ops.linear computed in float64.

Bounds: float32 weights -> rel_err < 1e-5 against the float64 reference (fp32 accumulation over
K <= 16384 lands near 1e-7 .. 1e-6). bf16 weights -> rel_err < 1e-5 against the float64 reference on
the bf16-rounded weights (the kernel's only error is fp32 accumulation), and < 1e-2 against the
unrounded float32 weights (bf16 rounding: ~3e-3 relative per weight).
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from kdt.kernels import linear as lin
from kdt.kernels.common import bf16_bits_to_f32, f32_to_bf16_bits
from kdt.reference.ops import linear as linear_ref
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


def _check(rng, M, W_store, W_seen, W_fp32, accumulate, d_W=None):
    N, K = W_seen.shape
    x = rng.standard_normal((M, K)).astype(np.float32)
    y0 = rng.standard_normal((M, N)).astype(np.float32) if accumulate else poisoned((M, N))
    d_y = cuda.to_device(y0)
    d_W = d_W if d_W is not None else cuda.to_device(W_store)
    lin.linear(cuda.to_device(x), d_W, d_y, accumulate=accumulate)
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
    return err


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
def test_linear_sim(rng, M, N, K, wdtype, accumulate):
    if M <= lin.SKINNY_MAX_M:
        assert lin._skinny_config(M, N)[0] == (1 if M == 1 else 4 if M <= 4 else 8)
    assert (M > lin.SKINNY_MAX_M) == (M == 70), "the wide case must take the tiled GEMM path"
    W_store, W_seen, W_fp32 = _weights(rng, N, K, wdtype)
    _check(rng, M, W_store, W_seen, W_fp32, accumulate)


@pytest.mark.kernels
def test_linear_noncontiguous_bf16_weight(rng):
    """A bf16 weight that is a column slice (not C-contiguous) falls back to uint16 loads."""
    N, K, M = 21, 40, 2
    W_store, W_seen, W_fp32 = _weights(rng, N, K + 6, "bf16")
    d_W = cuda.to_device(W_store)[:, :K]
    assert not d_W.is_c_contiguous()
    _check(rng, M, W_store[:, :K], W_seen[:, :K], W_fp32[:, :K], True, d_W=d_W)


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
def test_linear_gpu(rng, N, K, wdtype):
    W_store, W_seen, W_fp32 = _weights(rng, N, K, wdtype)
    d_W = cuda.to_device(W_store)
    for i, M in enumerate(GPU_M):
        _check(rng, M, W_store, W_seen, W_fp32, accumulate=bool(i % 2), d_W=d_W)


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
def test_linear_gpu_lm_head(rng, wdtype):
    N, K = 163840, 2048  # lm_head: vocab x D (Moonlight / Kimi vocab)
    W_store, W_seen, W_fp32 = _weights(rng, N, K, wdtype)
    d_W = cuda.to_device(W_store)
    for M in (1, 16):
        _check(rng, M, W_store, W_seen, W_fp32, accumulate=False, d_W=d_W)
