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
    err = float("inf")
    if np.all(np.isfinite(out)):
        err = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300))
    _log_err(ref.shape, err)
    return err


def _log_err(shape, err: float) -> None:
    """With ``KDT_ERR_LOG=PATH`` every measured error is appended there as ``test<TAB>shape<TAB>err``
    (``scripts/err_table.py`` turns the file into the per-test table of an H200 run)."""
    import os

    path = os.environ.get("KDT_ERR_LOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a") as f:
            f.write(f"{test}\t{'x'.join(map(str, shape))}\t{err:.3e}\n")


def poisoned(shape, dtype=np.float32) -> np.ndarray:
    """An output buffer filled with NaN (floats) or -7777 (ints), so unwritten elements are caught."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return np.full(shape, np.nan, dtype=dt)
    return np.full(shape, -7777, dtype=dt)


REPO = __import__("pathlib").Path(__file__).resolve().parent.parent


def run_kdt(*args, timeout: float = 600):
    """Run ``python -m kdt.cli ARGS`` from the repository root, as a user would (without the CUDA
    simulator, whatever the test process runs under); returns the CompletedProcess (text output)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env.setdefault("COLUMNS", "200")
    return subprocess.run([sys.executable, "-m", "kdt.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)
