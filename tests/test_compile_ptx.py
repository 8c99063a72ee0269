"""Every kernel compiles for the H200 (sm_90) with its registered signature; runs NVVM in a
subprocess with the simulator off (the simulator checks no types). The registry is split into
SHARDS processes so pytest-xdist's workers share the compile time."""

import os
import re
import subprocess
import sys

import pytest

SHARDS = 4


@pytest.mark.parametrize("shard", range(1, SHARDS + 1))
def test_every_kernel_compiles_for_sm90(shard):
    pytest.importorskip("nvidia.cuda_nvcc", reason="needs NVVM (pip install 'numba-cuda[cu12]')")
    # KDT_PDL=1: the kernels as compiled with programmatic dependent launch on (off by default, where the wait
    # compiles to nothing), so the compile check also sees griddepcontrol in every kernel (kdt.kernels.common)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"} | {"KDT_PDL": "1"}
    r = subprocess.run([sys.executable, "-m", "kdt.kernels.compile_check", "--shard", f"{shard}/{SHARDS}"],
                       env=env, capture_output=True, text=True, timeout=1800)
    print(r.stdout[-5000:], r.stderr[-3000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    done = re.search(r"(\d+)/(\d+) kernels compiled for sm_90 .*of (\d+)\)", r.stdout)
    assert done and done[1] == done[2], r.stdout[-3000:]
    # the shards cover the registry: this one holds its share (every SHARDS-th entry from shard - 1)
    assert int(done[2]) == len(range(shard - 1, int(done[3]), SHARDS)) > 0


def test_shard_argument():
    from kdt.kernels.compile_check import parse_shard

    assert parse_shard([]) == (0, 1) and parse_shard(["--shard", "2/4"]) == (1, 4)
    for bad in (["--shard", "0/4"], ["--shard", "5/4"], ["--shard", "1-4"], ["--shard"], ["-x", "1/2"]):
        with pytest.raises(SystemExit):
            parse_shard(bad)
