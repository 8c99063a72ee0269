"""The learned block drafter (SPEC section 4, DFlash-style): NumPy reference.

The drafter is a small stack of kdt's own decoder layers (MLA + dense SiLU MLP, the target's attention
dimensions) that shares the target's ``embed_tokens`` and ``lm_head``. It sees two kinds of rows:

- **context rows**, one per committed position t: ``c_t = rmsnorm(fc @ concat_l h_l[t], hidden_norm)``
  where ``h_l[t]`` is the target's hidden state after layer ``l`` for l in ``target_layers`` (the
  residual stream, before the final norm). Context rows run through the stack causally, once, when
  their position is committed; their latents stay in the drafter's own per-layer latent cache, exactly
  like a target prefill (the engine hands them over after each verify: no extra target forward).
- **a block** ``[root, mask x (B-1)]`` at positions ``L .. L+B-1``: row 0 is ``embed_tokens[root]``,
  rows 1.. are the learned ``mask_embedding``; attention is non-causal inside the block and every
  context row ``[0, L)`` is visible. Row d (1 <= d < B), through the drafter's final norm and the
  target's lm_head, is the distribution of the token at depth d after the root. One forward drafts the
  whole block; its latents are written at ``[L, L+B)`` and later overwritten by context rows.

Weights (Hugging Face style names; ``drafter_weight_names``): ``fc.weight [D, n_feat*D]``,
``hidden_norm.weight [D]``, ``mask_embedding [D]``, ``model.layers.{i}.*`` as a dense target layer,
``model.norm.weight [D]``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from kdt.config import ModelConfig
from kdt.errors import KdtError
from kdt.reference import ops
from kdt.reference.model import Block, causal_block, full_mask, weight_names


@dataclass(frozen=True)
class DrafterConfig:
    target_layers: tuple[int, ...]  # target layers whose output hidden states are the features
    block_size: int  # B: the root and B-1 drafted depths
    num_hidden_layers: int  # drafter decoder layers
    intermediate_size: int  # their dense MLP width

    def validate(self, target: ModelConfig) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise KdtError(f"invalid drafter config: {msg}")

        need(len(self.target_layers) > 0, "target_layers is empty")
        need(all(0 <= i < target.num_hidden_layers for i in self.target_layers),
             f"target_layers {list(self.target_layers)} outside [0, {target.num_hidden_layers})")
        need(self.block_size >= 2, f"block_size must be >= 2 (got {self.block_size})")
        need(self.num_hidden_layers >= 1, f"num_hidden_layers must be >= 1 (got {self.num_hidden_layers})")
        need(self.intermediate_size >= 1, f"intermediate_size must be >= 1 (got {self.intermediate_size})")

    def stack_config(self, target: ModelConfig) -> ModelConfig:
        """The drafter's decoder stack as a kdt model config: the target's attention, dense layers."""
        return target.replace(num_hidden_layers=self.num_hidden_layers, first_k_dense_replace=self.num_hidden_layers,
                              intermediate_size=self.intermediate_size, tie_word_embeddings=False)

    def to_json(self) -> str:
        return json.dumps(dict(asdict(self), target_layers=list(self.target_layers)), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DrafterConfig:
        try:
            d = json.loads(text)
            return cls(target_layers=tuple(int(i) for i in d["target_layers"]), block_size=int(d["block_size"]),
                       num_hidden_layers=int(d["num_hidden_layers"]), intermediate_size=int(d["intermediate_size"]))
        except (ValueError, KeyError, TypeError) as e:
            raise KdtError(f"invalid drafter config: {e}") from None


def drafter_weight_names(dcfg: DrafterConfig, target: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every drafter weight, name -> shape (the fixture format's /drafter/weights list)."""
    D = target.hidden_size
    stack = weight_names(dcfg.stack_config(target))
    del stack["model.embed_tokens.weight"], stack["lm_head.weight"]  # the target's own
    return {"fc.weight": (D, len(dcfg.target_layers) * D), "hidden_norm.weight": (D,), "mask_embedding": (D,),
            **stack}


def random_drafter_weights(dcfg: DrafterConfig, target: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random drafter weights (tests): linear ~ N(0, 1/in), norms ~ 1 + 0.1 N, mask ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in drafter_weight_names(dcfg, target).items():
        if len(shape) == 2:
            a = rng.standard_normal(shape) / np.sqrt(shape[1])
        elif name == "mask_embedding":
            a = rng.standard_normal(shape)
        else:
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        out[name] = a.astype(np.float32)
    return out


class DraftModel:
    """The drafter with its latent cache (see the module docstring).

    add_context(features[T, n_feat*D], start): context rows for positions [start, start+T).
    block_logits(root, L) -> logits [B-1, V] of depths 1..B-1 for a root at position L (context rows
    [0, L) must have been added).
    """

    def __init__(self, dcfg: DrafterConfig, target: ModelConfig, weights: dict[str, np.ndarray], embed_tokens,
                 lm_head, dtype=np.float64, max_len: int | None = None):
        dcfg.validate(target)
        self.dcfg, self.cfg, self.dtype = dcfg, dcfg.stack_config(target), np.dtype(dtype)
        self.max_len = int(max_len or target.max_position_embeddings) + dcfg.block_size
        g = lambda n: np.asarray(weights[n]).astype(dtype)  # noqa: E731
        self.fc, self.hidden_norm, self.mask_embedding, self.norm = (
            g("fc.weight"), g("hidden_norm.weight"), g("mask_embedding"), g("model.norm.weight"))
        self.layers = [Block(self.cfg, weights, i, dtype, self.max_len) for i in range(dcfg.num_hidden_layers)]
        self.embed_tokens = np.asarray(embed_tokens).astype(dtype)
        self.lm_head = np.asarray(lm_head).astype(dtype)

    def context(self, features: np.ndarray) -> np.ndarray:
        """features [T, n_feat*D] -> context rows c [T, D]."""
        return ops.rmsnorm(ops.linear(np.asarray(features, self.dtype), self.fc), self.hidden_norm,
                           self.cfg.rms_norm_eps)

    def _stack(self, x: np.ndarray, positions: np.ndarray, L: int, mask: np.ndarray) -> np.ndarray:
        """Rows x [M, D] at ``positions`` through every layer (latents written to slots [L, L+M))."""
        if L + x.shape[0] > self.max_len:
            raise ValueError(f"drafter forward of {x.shape[0]} rows at L={L} exceeds its cache ({self.max_len})")
        cos, sin = ops.rope_cos_sin(self.cfg, positions, self.dtype)
        mask = full_mask(L, mask)
        for layer in self.layers:
            x = layer(x, cos, sin, L, mask)
        return x

    def add_context(self, features: np.ndarray, start: int) -> None:
        T = features.shape[0]
        self._stack(self.context(features), np.arange(start, start + T), start, causal_block(T))

    def block_logits(self, root: int, L: int) -> np.ndarray:
        B = self.dcfg.block_size
        x = np.concatenate([self.embed_tokens[[int(root)]], np.broadcast_to(self.mask_embedding, (B - 1,) +
                                                                            self.mask_embedding.shape)])
        x = self._stack(x, np.arange(L, L + B), L, np.ones((B, B), bool))
        return ops.linear(ops.rmsnorm(x[1:], self.norm, self.cfg.rms_norm_eps), self.lm_head)
