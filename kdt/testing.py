"""Helpers shared by the tests and the kernel micro-benchmarks: error metric and output poisoning."""

from __future__ import annotations

import numpy as np


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; any non-finite element of ``out`` (e.g. an element left
    NaN-poisoned because the kernel never wrote it) gives inf, so it can never pass a bound."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: out {out.shape} vs ref {ref.shape}")
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300))


def poisoned(shape, dtype=np.float32) -> np.ndarray:
    """An output buffer filled with NaN (floats) or -7777 (ints), so unwritten elements are caught."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return np.full(shape, np.nan, dtype=dt)
    return np.full(shape, -7777, dtype=dt)
