"""Compile every registered kernel for the H200 (sm_90) without a GPU.

The CUDA simulator checks no types, so CI also runs ``python -m kdt.kernels.compile_check``: NVVM
(from ``nvidia-cuda-nvcc-cu12``) compiles each ``(kernel, signature)`` of ``PTX_REGISTRY`` to PTX.
Must run with the simulator off. Exit code 1 if any kernel fails.

``--shard I/N`` compiles every N-th entry from the I-th (1-based), so N processes share the work
(the test runs one per shard, spread over pytest-xdist's workers). Every kernel (not device function) must
call ``grid_dependency_wait()`` itself, and its PTX hold ``griddepcontrol.wait`` (kdt.kernels.common, PDL).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

MODULES = ("linear", "elementwise", "mla", "attn_tc", "moe", "ddtree", "randn", "tc", "tc_tiled")


def parse_shard(argv: list[str]) -> tuple[int, int]:
    """``["--shard", "I/N"]`` -> (I - 1, N); no argument -> (0, 1), the whole registry."""
    ap = argparse.ArgumentParser(prog="python -m kdt.kernels.compile_check", description=__doc__.splitlines()[0])
    ap.add_argument("--shard", default="1/1", metavar="I/N", help="compile every N-th kernel from the I-th (1-based)")
    shard = ap.parse_args(argv).shard
    try:
        i, n = (int(x) for x in shard.split("/"))
    except ValueError:
        ap.error(f"--shard {shard}: want I/N, e.g. 1/4")
    if not 1 <= i <= n:
        ap.error(f"--shard {shard}: want 1 <= I <= N")
    return i - 1, n


def registry_shard(shard: int, n_shards: int, prog: str) -> list[tuple[str, object, tuple, bool]] | None:
    """Every kernel module imported, the registry's entries of ``shard`` (0-based) of ``n_shards``; None, with a
    message for ``prog``, under the simulator (its kernels compile nothing)."""
    from numba import config

    if config.ENABLE_CUDASIM:
        print(f"{prog} needs the simulator off (unset NUMBA_ENABLE_CUDASIM)", file=sys.stderr)
        return None
    from kdt.kernels.common import PTX_REGISTRY

    for m in MODULES:
        importlib.import_module(f"kdt.kernels.{m}")
    return PTX_REGISTRY[shard::n_shards]


def main(argv: list[str] | None = None) -> int:
    shard, n_shards = parse_shard(sys.argv[1:] if argv is None else argv)
    entries = registry_shard(shard, n_shards, "compile_check")
    if entries is None:
        return 2
    from numba import cuda

    from kdt.kernels.common import PDL, PTX_REGISTRY, waits_for_grid
    failures = 0
    t_all = time.perf_counter()
    for name, fn, sig, device in entries:
        t0 = time.perf_counter()
        try:
            ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0), device=device)
            status = f"ok   {len(ptx):8d} B"
            if not device and not waits_for_grid(fn):  # PDL launches only kernels that wait (common.py)
                failures += 1
                status = "FAIL the kernel does not call grid_dependency_wait() itself"
            elif not device and PDL and "griddepcontrol.wait" not in ptx:
                failures += 1
                status = "FAIL no griddepcontrol.wait in the PTX"
        except Exception as e:  # noqa: BLE001 - report every failure, then fail
            failures += 1
            status = f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        print(f"{name:40s} {status}  {time.perf_counter() - t0:5.2f} s")
    print(f"{len(entries) - failures}/{len(entries)} kernels compiled for sm_90 in "
          f"{time.perf_counter() - t_all:.1f} s (shard {shard + 1}/{n_shards} of {len(PTX_REGISTRY)})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
