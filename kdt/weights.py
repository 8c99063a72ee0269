"""Seeded random weights for a config: well-conditioned activations, non-degenerate routing.

Every weight is rounded to bf16-representable values (stored in float32 in memory), so the float32
and bf16 engines run on exactly the same numbers as the float64 reference.
"""

from __future__ import annotations

import numpy as np

from kdt.bf16 import round_to_bf16
from kdt.config import ModelConfig
from kdt.reference.model import weight_names


def random_weights(cfg: ModelConfig, seed: int, lm_head_gain: float = 2.0) -> dict[str, np.ndarray]:
    """name -> float32 array. Linear weights ~ N(0, 1/in); norm weights ~ 1 + 0.1 N(0, 1);
    router correction bias ~ 0.1 U(-1, 1); embeddings ~ N(0, 1); lm_head scaled for logit spread."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in weight_names(cfg).items():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("e_score_correction_bias"):
            a = 0.1 * rng.uniform(-1.0, 1.0, shape)
        elif name == "model.embed_tokens.weight":
            a = rng.standard_normal(shape)
        else:
            a = rng.standard_normal(shape) / np.sqrt(shape[1])
            if name == "lm_head.weight":
                a *= lm_head_gain
            elif name.endswith("gate.weight"):
                a *= 2.0  # router logits of O(1): sigmoid scores that differ between experts
        out[name] = round_to_bf16(a)
    return out
