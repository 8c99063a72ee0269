"""NumPy reference of every operation in SPEC section 1, one small function each.

These functions are the ground truth for the CUDA kernels (each kernel test calls them) and the
building blocks of :mod:`kdt.reference.model`. They compute in the dtype of their inputs (float64 for
the golden reference, float32 for the CPU backend). Weight matrices are ``W[out, in]`` as in
checkpoints, so ``linear(x, W) = x @ W.T``.
"""

from __future__ import annotations

import math

import numpy as np

from kdt.config import ModelConfig


def linear(x: np.ndarray, W: np.ndarray) -> np.ndarray:
    """y[M, N] = x[M, K] @ W[N, K]^T."""
    return x @ W.T.astype(x.dtype, copy=False)


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x[..., n] / sqrt(mean(x^2) + eps) * weight[n]."""
    var = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(var + eps) * weight.astype(x.dtype, copy=False)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def mlp(x: np.ndarray, gate_proj: np.ndarray, up_proj: np.ndarray, down_proj: np.ndarray) -> np.ndarray:
    """down_proj(silu(gate_proj(x)) * up_proj(x)): x[M, D] -> [M, D]."""
    return linear(silu(linear(x, gate_proj)) * linear(x, up_proj), down_proj)


def softmax(s: np.ndarray, axis: int = -1) -> np.ndarray:
    """Max-subtracted softmax; rows that are all -inf would be NaN (never happens: a token sees itself)."""
    m = np.max(s, axis=axis, keepdims=True)
    e = np.exp(s - m)
    return e / np.sum(e, axis=axis, keepdims=True)


# ---- RoPE -----------------------------------------------------------------------------------------
def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dr/2] and the cos/sin attention factor, as transformers'
    ``_compute_default_rope_parameters`` / ``_compute_yarn_parameters`` (dim = qk_rope_head_dim)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if not cfg.is_yarn:
        return 1.0 / pos_freqs, 1.0
    rs = cfg.rope_scaling
    factor = float(rs["factor"])
    attention_factor = rs.get("attention_factor")
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_get_mscale(factor, mscale) / _yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_get_mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1
    orig_max = rs.get("original_max_position_embeddings") or cfg.max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation_factor = 1.0 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)


def rope_cos_sin(cfg: ModelConfig, positions: np.ndarray, dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [M, dr/2] for integer positions[M], already multiplied by the attention factor."""
    inv_freq, attn_factor = rope_inv_freq(cfg)
    freqs = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return (np.cos(freqs) * attn_factor).astype(dtype), (np.sin(freqs) * attn_factor).astype(dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleave: bool) -> np.ndarray:
    """Rotate x[M, ..., dr] by cos/sin[M, dr/2].

    NeoX pairs (i, i + dr/2). With ``interleave`` the pairs are adjacent (2i, 2i+1) and, like
    transformers, the result comes out de-interleaved: [rotated evens | rotated odds]. q and k get the
    same permutation, so their dot products are those of the interleaved rotation.
    """
    if interleave:
        x = np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    half = x.shape[-1] // 2
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (half,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


# ---- MoE routing ----------------------------------------------------------------------------------
def choice_scores(logits: np.ndarray, bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(s, s_choice) of router logits[M, E]: the sigmoid scores (the routing weights' source) and, with
    ``e_score_correction_bias`` added, the scores the top-k picks by."""
    s = 1.0 / (1.0 + np.exp(-logits))
    return s, s + bias.astype(s.dtype, copy=False)


def moe_route(logits: np.ndarray, bias: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Sigmoid, noaux_tc group-limited top-k routing of router logits[M, E].

    Returns (topk_idx[M, k] int64, topk_weight[M, k]) with experts in descending order of
    ``s_choice`` (:func:`choice_scores`); ties go to the lower expert index (stable sort). Excluded groups are -inf.
    """
    M, E = logits.shape
    s, s_choice = choice_scores(logits, bias)
    if cfg.n_group > 1:
        grouped = s_choice.reshape(M, cfg.n_group, E // cfg.n_group)
        top2 = -np.sort(-grouped, axis=-1)[..., :2]
        group_score = top2.sum(-1)  # [M, n_group]
        keep = np.argsort(-group_score, axis=-1, kind="stable")[:, : cfg.topk_group]
        group_mask = np.zeros((M, cfg.n_group), dtype=bool)
        np.put_along_axis(group_mask, keep, True, axis=-1)
        s_choice = np.where(np.repeat(group_mask, E // cfg.n_group, axis=-1), s_choice, -np.inf)
    idx = np.argsort(-s_choice, axis=-1, kind="stable")[:, : cfg.num_experts_per_tok]
    w = np.take_along_axis(s, idx, axis=-1)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return idx.astype(np.int64), w * cfg.routed_scaling_factor


# ---- MLA attention over the latent cache ----------------------------------------------------------
def mla_attention_absorbed(q_nope, q_pe, c_kv, k_pe, W_uk, W_uv, mask, scale):
    """Absorbed MLA (SPEC section 1).

    q_nope[M, H, dn], q_pe[M, H, dr]; c_kv[T, Rkv], k_pe[T, dr] (T = L + M cached tokens);
    W_uk[H, dn, Rkv], W_uv[H, dv, Rkv]; mask[M, T] bool (True = visible) -> o[M, H, dv].
    """
    q_abs = np.einsum("mhd,hdr->mhr", q_nope, W_uk)  # [M, H, Rkv]
    s = (np.einsum("mhr,tr->mht", q_abs, c_kv) + np.einsum("mhd,td->mht", q_pe, k_pe)) * scale
    s = np.where(mask[:, None, :], s, -np.inf)
    p = softmax(s, axis=-1)  # [M, H, T]
    o_lat = np.einsum("mht,tr->mhr", p, c_kv)  # [M, H, Rkv]
    return np.einsum("mhr,hvr->mhv", o_lat, W_uv)  # [M, H, dv]


def mla_attention_naive(q_nope, q_pe, c_kv, k_pe, W_uk, W_uv, mask, scale):
    """The same attention with explicit per-head keys and values (no absorb): the test oracle."""
    k_nope = np.einsum("hdr,tr->thd", W_uk, c_kv)  # [T, H, dn]
    v = np.einsum("hvr,tr->thv", W_uv, c_kv)  # [T, H, dv]
    H = W_uk.shape[0]
    k = np.concatenate([k_nope, np.broadcast_to(k_pe[:, None, :], (k_pe.shape[0], H, k_pe.shape[1]))], -1)
    q = np.concatenate([q_nope, q_pe], axis=-1)  # [M, H, dn+dr]
    s = np.einsum("mhd,thd->mht", q, k) * scale
    s = np.where(mask[:, None, :], s, -np.inf)
    return np.einsum("mht,thv->mhv", softmax(s, axis=-1), v)
