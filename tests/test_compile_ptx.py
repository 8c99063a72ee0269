"""Every kernel compiles for the H200 (sm_90) with its registered signature; runs NVVM in a
subprocess with the simulator off (the simulator checks no types)."""

import os
import subprocess
import sys

import pytest


def test_every_kernel_compiles_for_sm90():
    pytest.importorskip("nvidia.cuda_nvcc", reason="needs NVVM (pip install 'numba-cuda[cu12]')")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    r = subprocess.run([sys.executable, "-m", "kdt.kernels.compile_check"], env=env, capture_output=True,
                       text=True, timeout=1800)
    print(r.stdout[-5000:], r.stderr[-3000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "kernels compiled for sm_90" in r.stdout
