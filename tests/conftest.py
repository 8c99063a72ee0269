"""Test conventions.

- Kernel tests run in the CUDA simulator in CI (``NUMBA_ENABLE_CUDASIM=1`` at small shapes) and on a
  real GPU with ``-m gpu`` at real shapes. Tests marked ``gpu`` are skipped without a real GPU.
- Inputs are fresh random draws every run: the ``rng`` fixture seeds from the OS and prints its seed,
  so a failure can be replayed with ``KDT_TEST_SEED=<seed>``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kdt.kernels.common import IS_SIM, gpu_available

HAS_GPU = gpu_available()
CAN_RUN_KERNELS = IS_SIM or HAS_GPU


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a real CUDA GPU (run with -m gpu on the H200)")
    skip_kern = pytest.mark.skip(reason="no GPU and not in the CUDA simulator (set NUMBA_ENABLE_CUDASIM=1)")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        elif "kernels" in item.keywords and not CAN_RUN_KERNELS:
            item.add_marker(skip_kern)


def pytest_configure(config):
    config.addinivalue_line("markers", "kernels: runs CUDA kernels (GPU or simulator)")


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("KDT_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"[{request.node.name}] KDT_TEST_SEED={seed}")
    return np.random.default_rng(seed)

