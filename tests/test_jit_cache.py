"""The on-disk kernel cache's key (kdt.kernels.jit_cache): stable across processes, distinct per kernel.

Loading and saving compiled kernels needs a GPU (checked on the H200: `kdt verify` twice with a fresh
KDT_CACHE_DIR); here the key, whose failure modes are a miss every run (an address in the key) or a
wrong hit (two kernels with one key), is checked on the real (not simulated) kernels.
"""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json
from kdt.kernels import common, ddtree, elementwise, linear, mla, moe, randn  # noqa: F401  (registers kernels)
from kdt.kernels.jit_cache import function_key, is_kdt_kernel
print(json.dumps({name: [function_key(fn), is_kdt_kernel(fn), id(fn)] for name, fn, _, _ in common.PTX_REGISTRY}))
"""


def kernel_keys(extra_env=None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(extra_env or {})
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def keys():
    return kernel_keys()


def test_keys_are_stable_across_processes(keys):
    again = kernel_keys({"PYTHONHASHSEED": "123"})
    assert {n: v[:2] for n, v in again.items()} == {n: v[:2] for n, v in keys.items()}
    assert len(keys) > 20


def test_keys_hold_no_addresses_and_differ_per_kernel(keys):
    for name, (key, is_kdt, _) in keys.items():
        assert is_kdt, name
        assert " at 0x" not in key, f"{name}: its key holds an address (a cache miss every run): {key[:300]}"
    functions = {fid: key for key, _, fid in keys.values()}  # a kernel may be registered twice (signatures)
    assert len(set(functions.values())) == len(functions), "two registered kernels share a cache key"


def test_sources_hash_follows_kdt_env(monkeypatch):
    from kdt.kernels.jit_cache import sources_hash

    h = sources_hash()
    monkeypatch.setenv("KDT_SOME_KERNEL_VERSION", "2")
    assert sources_hash() != h
