"""The engine: a target model on a backend, driven by the decode loops of kdt.reference.decode.

- ``cpu``: the NumPy model in float32 (:class:`kdt.reference.model.RefModel`), any machine.
- ``cuda``: every layer and the DDTree steps as Numba CUDA kernels (:mod:`kdt.engine.cuda_model`).
"""

from __future__ import annotations

import numpy as np

from kdt.config import ModelConfig
from kdt.errors import KdtError
from kdt.kernels.common import IS_SIM, gpu_available

BACKENDS = ("auto", "cpu", "cuda")
DTYPES = ("float32", "bf16")


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise KdtError(f"unknown backend {backend!r} (choose from: {', '.join(BACKENDS)})")
    if backend == "auto":
        return "cuda" if gpu_available() else "cpu"
    if backend == "cuda" and not (gpu_available() or IS_SIM):
        raise KdtError("backend 'cuda' asked for, but no CUDA GPU is available (use --backend cpu)")
    return backend


def describe_backend(backend: str, dtype: str) -> str:
    if backend == "cpu":
        return "cpu (NumPy float32)"
    where = "CUDA simulator" if IS_SIM else "CUDA"
    return f"cuda ({where}, {dtype} weights, fp32 activations)"


def load_target(cfg: ModelConfig, weights: dict[str, np.ndarray] | None, backend: str = "auto",
                dtype: str = "float32", max_len: int | None = None, max_tokens: int = 256):
    """A target for the decode loop: ``forward``, ``compact``, ``max_len``, ``cfg`` (and on CUDA,
    ``tree_ops`` running the DDTree steps on the GPU). ``max_tokens``: the largest forward the CUDA
    backend holds buffers for (trees of up to that many nodes; longer prompts prefill in chunks).
    ``weights`` None: seeded random weights drawn on the device (CUDA only)."""
    if dtype not in DTYPES:
        raise KdtError(f"unknown dtype {dtype!r} (choose from: {', '.join(DTYPES)})")
    backend = resolve_backend(backend)
    max_len = int(max_len or min(cfg.max_position_embeddings, 4096))
    if backend == "cpu":
        from kdt.reference.model import RefModel

        if weights is None:
            raise KdtError("the CPU backend needs weights (random weights are drawn on the GPU only)")
        model = RefModel(cfg, weights, dtype=np.float32, max_len=max_len)
    else:
        from kdt.engine.cuda_model import CudaModel

        model = CudaModel(cfg, weights, dtype=dtype, max_len=max_len, max_tokens=max_tokens)
    model.backend = backend
    return model
