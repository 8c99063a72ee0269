"""The device normal generator equals its NumPy twin (float32 and bf16 outputs)."""

import numpy as np
import pytest
from numba import cuda

from kdt.kernels.common import bf16_bits_to_f32, f32_to_bf16_bits
from kdt.kernels.randn import randn_fill, randn_reference
from kdt.testing import poisoned, rel_err

pytestmark = [pytest.mark.kernels,
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]  # uint64 wrap in the simulator


@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
def test_randn_matches_reference(dtype, rng):
    seed, n = int(rng.integers(1 << 40)), 300
    scale, offset = float(rng.uniform(0.1, 2)), float(rng.uniform(-1, 1))
    host = poisoned((3, 100), np.float32) if dtype == np.float32 else np.full((3, 100), 0xFFFF, np.uint16)
    d = cuda.to_device(host)
    randn_fill(d, seed, scale, offset)
    out = d.copy_to_host().reshape(-1)
    ref = randn_reference(n, seed, scale, offset)
    if dtype == np.uint16:
        assert np.array_equal(out, f32_to_bf16_bits(ref.astype(np.float32)))
        out = bf16_bits_to_f32(out)
    assert rel_err(out, ref) < (1e-2 if dtype == np.uint16 else 1e-6)
    z = (ref - offset) / scale
    assert abs(z.mean()) < 0.3 and 0.7 < z.std() < 1.3
