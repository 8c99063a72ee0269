"""NumPy reference of the target model: the single forward of SPEC section 2 with its latent cache.

``RefModel(cfg, weights).forward(tokens, positions, L, mask)`` computes logits for M query tokens,
writes their latents into cache slots [L, L+M) and attends over slots [0, L+M). float64 by default
(the golden reference); ``dtype=np.float32`` is kdt's CPU backend. Weights use Hugging Face names.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kdt.config import ModelConfig
from kdt.reference import ops


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def weight_names(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of the model, Hugging Face name -> shape (the fixture format's weight list)."""
    D, H, V = cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size
    Rkv, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D)}
    for i in range(cfg.num_hidden_layers):
        p = layer_prefix(i)
        shapes[p + "input_layernorm.weight"] = (D,)
        shapes[p + "post_attention_layernorm.weight"] = (D,)
        a = p + "self_attn."
        if cfg.q_lora_rank:
            shapes[a + "q_a_proj.weight"] = (cfg.q_lora_rank, D)
            shapes[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            shapes[a + "q_b_proj.weight"] = (H * cfg.qk_head_dim, cfg.q_lora_rank)
        else:
            shapes[a + "q_proj.weight"] = (H * cfg.qk_head_dim, D)
        shapes[a + "kv_a_proj_with_mqa.weight"] = (Rkv + dr, D)
        shapes[a + "kv_a_layernorm.weight"] = (Rkv,)
        shapes[a + "kv_b_proj.weight"] = (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), Rkv)
        shapes[a + "o_proj.weight"] = (D, H * cfg.v_head_dim)
        m = p + "mlp."
        if not cfg.is_moe_layer(i):
            shapes.update(_mlp_shapes(m, D, cfg.intermediate_size))
            continue
        shapes[m + "gate.weight"] = (cfg.n_routed_experts, D)
        shapes[m + "gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
        for e in range(cfg.n_routed_experts):
            shapes.update(_mlp_shapes(f"{m}experts.{e}.", D, cfg.moe_intermediate_size))
        if cfg.n_shared_experts:
            shapes.update(_mlp_shapes(m + "shared_experts.", D, cfg.moe_intermediate_size * cfg.n_shared_experts))
    shapes["model.norm.weight"] = (D,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


def lm_head_weight(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> np.ndarray:
    """The output projection [V, D]: ``lm_head.weight``, or the embedding when the two are tied."""
    return weights["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]


def _mlp_shapes(prefix: str, D: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, D), prefix + "up_proj.weight": (inter, D),
            prefix + "down_proj.weight": (D, inter)}


@dataclass
class Mlp:
    gate_proj: np.ndarray  # [I, D]
    up_proj: np.ndarray  # [I, D]
    down_proj: np.ndarray  # [D, I]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return ops.mlp(x, self.gate_proj, self.up_proj, self.down_proj)

    @classmethod
    def load(cls, w: dict[str, np.ndarray], prefix: str, dtype) -> Mlp:
        return cls(*(w[f"{prefix}{n}.weight"].astype(dtype) for n in ("gate_proj", "up_proj", "down_proj")))


class MLA:
    """Multi-head latent attention of one layer, absorb form.

    q: q_a_proj [Rq, D] -> q_a_layernorm -> q_b_proj [H*(dn+dr), Rq]  (or q_proj [H*(dn+dr), D]);
    kv_a_proj_with_mqa [Rkv+dr, D]; kv_a_layernorm [Rkv]; kv_b_proj [H*(dn+dv), Rkv] split into
    W_uk [H, dn, Rkv] and W_uv [H, dv, Rkv]; o_proj [D, H*dv].
    Cache: c_kv [max_len, Rkv], k_pe [max_len, dr] (post-RoPE).
    """

    def __init__(self, cfg: ModelConfig, w: dict[str, np.ndarray], prefix: str, dtype, max_len: int, absorb=True):
        self.cfg, self.absorb = cfg, absorb
        g = lambda n: w[prefix + n].astype(dtype)  # noqa: E731
        H, dn, dv, Rkv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            self.q_a_proj, self.q_a_layernorm, self.q_b_proj = g("q_a_proj.weight"), g("q_a_layernorm.weight"), g(
                "q_b_proj.weight")
        else:
            self.q_proj = g("q_proj.weight")
        self.kv_a_proj_with_mqa, self.kv_a_layernorm = g("kv_a_proj_with_mqa.weight"), g("kv_a_layernorm.weight")
        kv_b = g("kv_b_proj.weight").reshape(H, dn + dv, Rkv)
        self.W_uk, self.W_uv = kv_b[:, :dn], kv_b[:, dn:]  # [H, dn, Rkv], [H, dv, Rkv]
        self.o_proj = g("o_proj.weight")
        self.c_kv = np.zeros((max_len, Rkv), dtype=dtype)
        self.k_pe = np.zeros((max_len, cfg.qk_rope_head_dim), dtype=dtype)

    def __call__(self, a: np.ndarray, cos: np.ndarray, sin: np.ndarray, L: int, mask: np.ndarray) -> np.ndarray:
        """a[M, D] (normed input), cos/sin[M, dr/2], mask[M, L+M] -> attention output [M, D]."""
        cfg = self.cfg
        M, H, dn, Rkv = a.shape[0], cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            q = ops.linear(ops.rmsnorm(ops.linear(a, self.q_a_proj), self.q_a_layernorm, cfg.rms_norm_eps),
                           self.q_b_proj)
        else:
            q = ops.linear(a, self.q_proj)
        q = q.reshape(M, H, cfg.qk_head_dim)
        q_nope, q_pe = q[..., :dn], ops.apply_rope(q[..., dn:], cos, sin, cfg.rope_interleave)
        c = ops.linear(a, self.kv_a_proj_with_mqa)  # [M, Rkv+dr]
        self.c_kv[L:L + M] = ops.rmsnorm(c[:, :Rkv], self.kv_a_layernorm, cfg.rms_norm_eps)
        self.k_pe[L:L + M] = ops.apply_rope(c[:, Rkv:], cos, sin, cfg.rope_interleave)
        attend = ops.mla_attention_absorbed if self.absorb else ops.mla_attention_naive
        o = attend(q_nope, q_pe, self.c_kv[:L + M], self.k_pe[:L + M], self.W_uk, self.W_uv, mask,
                   cfg.softmax_scale)
        return ops.linear(o.reshape(M, -1), self.o_proj)


class MoE:
    """Routed experts (E of width moe_intermediate_size) + shared experts; router gate.weight [E, D]
    and e_score_correction_bias [E]; routing of :func:`kdt.reference.ops.moe_route`."""

    def __init__(self, cfg: ModelConfig, w: dict[str, np.ndarray], prefix: str, dtype):
        self.cfg = cfg
        self.gate = w[prefix + "gate.weight"].astype(dtype)
        self.bias = w[prefix + "gate.e_score_correction_bias"].astype(dtype)
        self.experts = [Mlp.load(w, f"{prefix}experts.{e}.", dtype) for e in range(cfg.n_routed_experts)]
        self.shared = Mlp.load(w, prefix + "shared_experts.", dtype) if cfg.n_shared_experts else None

    def __call__(self, b: np.ndarray) -> np.ndarray:
        """b[M, D] -> [M, D]."""
        idx, wts = ops.moe_route(ops.linear(b, self.gate), self.bias, self.cfg)
        out = self.shared(b) if self.shared is not None else np.zeros_like(b)
        for e in np.unique(idx):
            rows, slot = np.nonzero(idx == e)
            out[rows] += wts[rows, slot][:, None] * self.experts[e](b[rows])
        return out


class Block:
    """One decoder layer: x + MLA(rmsnorm(x)), then + MLP or MoE of rmsnorm(x)."""

    def __init__(self, cfg: ModelConfig, w: dict[str, np.ndarray], i: int, dtype, max_len: int, absorb=True):
        p = layer_prefix(i)
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = w[p + "input_layernorm.weight"].astype(dtype)
        self.post_attention_layernorm = w[p + "post_attention_layernorm.weight"].astype(dtype)
        self.self_attn = MLA(cfg, w, p + "self_attn.", dtype, max_len, absorb)
        self.mlp = MoE(cfg, w, p + "mlp.", dtype) if cfg.is_moe_layer(i) else Mlp.load(w, p + "mlp.", dtype)

    def __call__(self, x, cos, sin, L, mask):
        x = x + self.self_attn(ops.rmsnorm(x, self.input_layernorm, self.eps), cos, sin, L, mask)
        return x + self.mlp(ops.rmsnorm(x, self.post_attention_layernorm, self.eps))


def full_mask(L: int, block: np.ndarray) -> np.ndarray:
    """[M, L+M] mask: the committed prefix [0, L) visible, then the M x M block."""
    block = np.asarray(block, dtype=bool)
    return np.concatenate([np.ones((block.shape[0], L), dtype=bool), block], axis=1)


def causal_block(M: int) -> np.ndarray:
    return np.tril(np.ones((M, M), dtype=bool))


class RefModel:
    """The whole model with its per-layer latent cache.

    forward(tokens[M], positions[M], L, mask) -> logits[M, V]; mask is [M, L+M] (SPEC) or just the
    M x M block (the prefix [0, L) is then visible). ``hidden_layers`` asks for the output hidden
    state [M, D] of those layers as well.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray], dtype=np.float64,
                 max_len: int | None = None, absorb: bool = True):
        self.cfg, self.dtype = cfg, np.dtype(dtype)
        self.max_len = int(max_len or cfg.max_position_embeddings)
        self.embed_tokens = weights["model.embed_tokens.weight"].astype(dtype)
        self.layers = [Block(cfg, weights, i, dtype, self.max_len, absorb) for i in range(cfg.num_hidden_layers)]
        self.norm = weights["model.norm.weight"].astype(dtype)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else weights["lm_head.weight"].astype(dtype)

    def caches(self) -> list[np.ndarray]:
        return [a for layer in self.layers for a in (layer.self_attn.c_kv, layer.self_attn.k_pe)]

    def forward(self, tokens, positions, L: int, mask, hidden_layers=(), last_only: bool = False):
        """tokens[M], positions[M], mask [M, M] or [M, L + M] -> logits [M, V] (``last_only``: the last row's, [1,
        V], taken from the whole product so that its bits do not change); with ``hidden_layers``, (logits, {layer:
        hidden states [M, D]})."""
        tokens = np.asarray(tokens, dtype=np.int64)
        M = tokens.shape[0]
        if L + M > self.max_len:
            raise ValueError(f"forward of {M} tokens at L={L} exceeds the cache ({self.max_len} slots)")
        mask = np.asarray(mask, dtype=bool)
        if mask.shape == (M, M):
            mask = full_mask(L, mask)
        assert mask.shape == (M, L + M), mask.shape
        cos, sin = ops.rope_cos_sin(self.cfg, positions, self.dtype)
        x = self.embed_tokens[tokens]
        hidden = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, L, mask)
            if i in hidden_layers:
                hidden[i] = x.copy()
        logits = ops.linear(ops.rmsnorm(x, self.norm, self.cfg.rms_norm_eps), self.lm_head)
        logits = logits[-1:] if last_only else logits
        return (logits, hidden) if hidden_layers else logits

    def compact(self, L: int, accepted) -> None:
        """Move the latents of the accepted tree nodes, slots L+accepted[i] -> L+i, in every layer."""
        from kdt.reference.ddtree import compact_cache

        compact_cache(self.caches(), L, np.asarray(accepted))
