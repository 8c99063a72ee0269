"""bf16 on the host: kdt stores bf16 as uint16 bit patterns (the top half of a float32).

NumPy has no bfloat16; these are the conversions the format, the converter, the weight generators and
the kernels' host side share (numba-free, so reading a fixture stays a light import). The device twins
are ``kdt.kernels.common.bf16_to_f32`` / ``f32_to_bf16``.
"""

from __future__ import annotations

import numpy as np


def f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit pattern (uint16), round to nearest even."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    """bf16 bit pattern (uint16) -> float32, exact."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def bf16_all_finite(bits: np.ndarray) -> bool:
    """No inf / NaN among bf16 bit patterns (exponent bits all ones)."""
    return not np.any((np.asarray(bits, dtype=np.uint16) & 0x7F80) == 0x7F80)


def round_to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bf16-representable value (still float32)."""
    return bf16_bits_to_f32(f32_to_bf16_bits(a))
