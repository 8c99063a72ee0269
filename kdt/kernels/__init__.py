"""Numba CUDA kernels, one module per family. Every kernel has a NumPy reference in kdt.reference
and a parity test in tests/kernels; `kdt.kernels.common.PTX_REGISTRY` lists (kernel, signature)
pairs that CI compiles for the H200 (sm_90) without a GPU (tests/test_compile_ptx.py)."""
