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
    # KDT_PDL=2 (the default): the kernels as compiled with programmatic dependent launch on, so the compile check
    # also sees griddepcontrol in every kernel (kdt.kernels.common)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"} | {"KDT_PDL": "2"}
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


def test_fast_compile_keeps_the_ptx():
    """kdt.kernels.fast_compile (numba's inlining top-down, a callee's scope copied once, liveness by work lists, SSA
    walks of the statements that name a variable, lowering's locals counted once a block) copies a function's scope
    once, finds every live map as numba's own does, and leaves the sm_90 PTX as numba makes it: the kernel with the
    biggest inlined body (the MoE route kernel: 340 blocks, 3480 variables) and the attention with the combine in its
    launch (a shared array in an inlined device function)."""
    pytest.importorskip("nvidia.cuda_nvcc", reason="needs NVVM (pip install 'numba-cuda[cu12]')")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    names = ["moe2_route_nw4_b2_s2_nr4_tt1_u4_ul4_cs_rt", "mla_attention2[Rkv=64,NW=1,PF=2,CI]"]
    only = [a for n in names for a in ("--only", n)]
    r = subprocess.run([sys.executable, "-m", "kdt.kernels.fast_compile", *only], env=env, capture_output=True,
                       text=True, timeout=1800)
    print(r.stdout[-3000:], r.stderr[-3000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    scopes = re.search(r"of (\d+) blocks: (\d+) scope copies block by block, (\d+) with the shared memo", r.stdout)
    assert scopes and int(scopes[1]) == int(scopes[2]) > 1 and scopes[3] == "1", r.stdout
    done = re.search(r"2/2 kernels: the same PTX.*\((\d+) inlined calls with the shared memo, (\d+) top-down\)",
                     r.stdout)
    assert done and int(done[1]) > 0 and int(done[2]) > 0, r.stdout
    live = re.search(r"(\d+) live maps by the work list, (\d+) differ from numba's; (\d+) statements left out of SSA",
                     r.stdout)
    assert live and int(live[1]) > 0 and live[2] == "0" and int(live[3]) > 0, r.stdout
