"""Compile every registered kernel for the H200 (sm_90) without a GPU.

The CUDA simulator checks no types, so CI also runs ``python -m kdt.kernels.compile_check``: NVVM
(from ``nvidia-cuda-nvcc-cu12``) compiles each ``(kernel, signature)`` of ``PTX_REGISTRY`` to PTX.
Must run with the simulator off. Exit code 1 if any kernel fails.
"""

from __future__ import annotations

import importlib
import sys
import time

MODULES = ("linear", "elementwise", "mla", "moe", "ddtree", "randn")


def main() -> int:
    from numba import config

    if config.ENABLE_CUDASIM:
        print("compile_check needs the simulator off (unset NUMBA_ENABLE_CUDASIM)", file=sys.stderr)
        return 2
    from numba import cuda

    from kdt.kernels.common import PTX_REGISTRY

    for m in MODULES:
        importlib.import_module(f"kdt.kernels.{m}")
    failures = 0
    t_all = time.perf_counter()
    for name, fn, sig, device in PTX_REGISTRY:
        t0 = time.perf_counter()
        try:
            ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0), device=device)
            status = f"ok   {len(ptx):8d} B"
        except Exception as e:  # noqa: BLE001 - report every failure, then fail
            failures += 1
            status = f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        print(f"{name:40s} {status}  {time.perf_counter() - t0:5.2f} s")
    print(f"{len(PTX_REGISTRY) - failures}/{len(PTX_REGISTRY)} kernels compiled for sm_90 in "
          f"{time.perf_counter() - t_all:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
