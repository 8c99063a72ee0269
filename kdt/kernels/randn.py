"""Counter-based normal random numbers on the device, for benchmark weights too large to draw on the host.

``randn_fill(out, seed, scale, offset)``: out.flat[i] = scale * N(0, 1) from splitmix64(seed, i) and
Box-Muller (one normal per counter), written as float32 or bf16 bits (uint16, round to nearest even).
:func:`randn_reference` computes the same numbers with NumPy.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, uint16, uint64

from kdt.kernels.common import cdiv, f32_to_bf16, grid_dependency_wait, register_ptx

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_TWO_PI = 2.0 * math.pi


@cuda.jit(device=True, inline="always")
def _splitmix64(z):
    z = (z ^ (z >> uint64(30))) * uint64(_M1)
    z = (z ^ (z >> uint64(27))) * uint64(_M2)
    return z ^ (z >> uint64(31))


@cuda.jit(device=True, inline="always")
def _normal(seed, i):
    z = _splitmix64(uint64(seed) * uint64(_GOLDEN) + uint64(i) * uint64(2) + uint64(1))
    u1 = (float64(z >> uint64(11)) + 0.5) * (1.0 / 9007199254740992.0)  # (0, 1)
    z2 = _splitmix64(z + uint64(_GOLDEN))
    u2 = float64(z2 >> uint64(11)) * (1.0 / 9007199254740992.0)
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(_TWO_PI * u2)


@cuda.jit
def _randn_f32(out, seed, scale, offset):
    """out[n] f32 = offset + scale * normal(seed, i)."""
    grid_dependency_wait()
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = float32(offset + scale * _normal(seed, i))


@cuda.jit
def _randn_bf16(out, seed, scale, offset):
    """out[n] uint16 = bf16 bits (round to nearest even) of offset + scale * normal(seed, i)."""
    grid_dependency_wait()
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = f32_to_bf16(float32(offset + scale * _normal(seed, i)))


def randn_fill(out, seed: int, scale: float = 1.0, offset: float = 0.0, stream=0) -> None:
    """Fill a contiguous device array (float32, or uint16 = bf16 bits) of any shape."""
    flat = out.reshape(out.size)
    kern = _randn_bf16 if np.dtype(out.dtype) == np.uint16 else _randn_f32
    threads = 256
    kern[cdiv(out.size, threads), threads, stream](flat, np.uint64(seed), np.float64(scale), np.float64(offset))


def randn_reference(n: int, seed: int, scale: float = 1.0, offset: float = 0.0) -> np.ndarray:
    """float64 NumPy twin of the device generator (before the float32 / bf16 rounding)."""
    with np.errstate(over="ignore"):
        def mix(z):
            z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
            return z ^ (z >> np.uint64(31))

        i = np.arange(n, dtype=np.uint64)
        z = mix(np.uint64(seed) * np.uint64(_GOLDEN) + i * np.uint64(2) + np.uint64(1))
        u1 = ((z >> np.uint64(11)).astype(np.float64) + 0.5) / 9007199254740992.0
        u2 = (mix(z + np.uint64(_GOLDEN)) >> np.uint64(11)).astype(np.float64) / 9007199254740992.0
    return offset + scale * np.sqrt(-2.0 * np.log(u1)) * np.cos(_TWO_PI * u2)


register_ptx(_randn_f32, (float32[::1], uint64, float64, float64))
register_ptx(_randn_bf16, (uint16[::1], uint64, float64, float64))
