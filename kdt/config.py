"""Model configuration: the Hugging Face DeepseekV3 config fields (SPEC section 1), validated.

The same dataclass describes DeepSeek-V3, Kimi K2 and Moonlight checkpoints and kdt's own random
fixtures. Field names are the Hugging Face ones, so a ``config.json`` maps onto it directly.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from kdt.errors import KdtError


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int  # D
    num_hidden_layers: int
    num_attention_heads: int  # H
    q_lora_rank: int | None  # Rq; None -> a single q_proj
    kv_lora_rank: int  # Rkv
    qk_nope_head_dim: int  # dn
    qk_rope_head_dim: int  # dr
    v_head_dim: int  # dv
    intermediate_size: int  # dense MLP width
    moe_intermediate_size: int  # routed / shared expert width
    n_routed_experts: int  # E
    n_shared_experts: int
    num_experts_per_tok: int  # k
    n_group: int
    topk_group: int
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # YaRN: {"type": "yarn", "factor", ...}
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived shapes -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def dense_projections(self) -> list[tuple[str, int, int]]:
        """(name, N, K) of each dense projection a forward runs through ``linear`` (y[M, N] = x[M, K] @ W^T):
        the fused [q_a | kv_a] (or [q | kv_a]), q_b, o_proj, the dense layers' MLP, lm_head."""
        D, H = self.hidden_size, self.num_attention_heads
        nq = self.q_lora_rank or H * self.qk_head_dim
        out = [("qkv_a", nq + self.kv_lora_rank + self.qk_rope_head_dim, D)]
        if self.q_lora_rank:
            out.append(("q_b_proj", H * self.qk_head_dim, self.q_lora_rank))
        out.append(("o_proj", D, H * self.v_head_dim))
        if self.first_k_dense_replace > 0:
            out += [("mlp_gate_up", 2 * self.intermediate_size, D), ("mlp_down", D, self.intermediate_size)]
        return out + [("lm_head", self.vocab_size, D)]

    @property
    def is_yarn(self) -> bool:
        rs = self.rope_scaling
        return bool(rs) and str(rs.get("rope_type", rs.get("type", ""))).lower() == "yarn"

    @property
    def softmax_scale(self) -> float:
        """(dn+dr)^-0.5, times mscale^2 under YaRN with mscale_all_dim (SPEC section 1)."""
        scale = self.qk_head_dim**-0.5
        if self.is_yarn:
            mad = float(self.rope_scaling.get("mscale_all_dim") or 0.0)
            factor = float(self.rope_scaling["factor"])
            if mad and factor > 1:
                m = 0.1 * mad * math.log(factor) + 1.0
                scale *= m * m
        return scale

    def n_params(self) -> int:
        D, H = self.hidden_size, self.num_attention_heads
        attn = (self.kv_lora_rank + self.qk_rope_head_dim) * D + self.kv_lora_rank
        attn += H * (self.qk_nope_head_dim + self.v_head_dim) * self.kv_lora_rank + D * H * self.v_head_dim
        if self.q_lora_rank:
            attn += self.q_lora_rank * D + self.q_lora_rank + H * self.qk_head_dim * self.q_lora_rank
        else:
            attn += H * self.qk_head_dim * D
        dense = 3 * D * self.intermediate_size
        moe = 3 * D * self.moe_intermediate_size * (self.n_routed_experts + self.n_shared_experts)
        moe += self.n_routed_experts * (D + 1)
        total = self.num_hidden_layers * (attn + 2 * D) + self.first_k_dense_replace * dense
        total += self.n_moe_layers * moe + D + self.vocab_size * D * (1 if self.tie_word_embeddings else 2)
        return total

    # ---- validation -----------------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise KdtError(f"invalid model config: {msg}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                     "moe_intermediate_size", "max_position_embeddings"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0,
                 f"{name} must be a positive integer (got {v!r})")
        need(self.q_lora_rank is None or (isinstance(self.q_lora_rank, int) and self.q_lora_rank > 0),
             f"q_lora_rank must be null or a positive integer (got {self.q_lora_rank!r})")
        need(self.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim must be even (got {self.qk_rope_head_dim})")
        need(0 <= self.first_k_dense_replace <= self.num_hidden_layers,
             f"first_k_dense_replace={self.first_k_dense_replace} outside [0, num_hidden_layers]")
        need(self.first_k_dense_replace == 0 or self.intermediate_size > 0,
             "intermediate_size must be positive when there are dense layers")
        need(self.n_shared_experts >= 0, "n_shared_experts must be >= 0")
        need(self.n_routed_experts % self.n_group == 0,
             f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}")
        need(self.topk_group <= self.n_group, f"topk_group={self.topk_group} > n_group={self.n_group}")
        per_group = self.n_routed_experts // self.n_group
        need(self.n_group == 1 or per_group >= 2,
             f"each of the n_group={self.n_group} groups needs >= 2 experts (group score = top-2 sum)")
        need(self.num_experts_per_tok <= self.topk_group * per_group,
             f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts in topk_group="
             f"{self.topk_group} groups ({self.topk_group * per_group})")
        need(self.rms_norm_eps > 0, "rms_norm_eps must be positive")
        need(self.rope_theta > 0, "rope_theta must be positive")
        need(self.routed_scaling_factor > 0, "routed_scaling_factor must be positive")
        if self.rope_scaling:
            kind = str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", ""))).lower()
            need(kind in ("yarn", "default", ""), f"rope_scaling type {kind!r} is not supported (yarn only)")
            if kind == "yarn":
                need(float(self.rope_scaling.get("factor", 0)) > 0, "rope_scaling.factor must be positive")
        for tok in ("bos_token_id", "eos_token_id"):
            v = getattr(self, tok)
            need(v is None or (isinstance(v, int) and 0 <= v < self.vocab_size),
                 f"{tok}={v!r} outside the vocabulary")

    # ---- (de)serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("extra")
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """From kdt's own dict or a Hugging Face config.json dict (unknown keys kept in ``extra``)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        d = dict(d)
        if d.get("rope_scaling") is None and isinstance(d.get("rope_parameters"), dict):
            rp = d["rope_parameters"]  # transformers >= 5 spelling
            if str(rp.get("rope_type", "default")).lower() == "yarn":
                d["rope_scaling"] = dict(rp)
            d.setdefault("rope_theta", rp.get("rope_theta", 10000.0))
        for tok in ("bos_token_id", "eos_token_id"):
            if isinstance(d.get(tok), list):
                d[tok] = d[tok][0] if d[tok] else None
        missing = [n for n in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                               "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")
                   if d.get(n) is None]
        if missing:
            raise KdtError(f"invalid model config: missing field(s) {', '.join(missing)}")
        kw = {k: v for k, v in d.items() if k in names}
        kw.setdefault("q_lora_rank", None)
        kw.setdefault("intermediate_size", 0)
        kw.setdefault("n_shared_experts", 0)
        kw.setdefault("n_group", 1)
        kw.setdefault("topk_group", 1)
        for k in ("n_group", "topk_group", "n_shared_experts", "intermediate_size"):
            if kw[k] is None:
                kw[k] = {"n_group": 1, "topk_group": 1}.get(k, 0)
        for k in ("routed_scaling_factor", "rms_norm_eps", "rope_theta"):
            if k in kw and kw[k] is not None:
                kw[k] = float(kw[k])
        extra = {k: v for k, v in d.items() if k not in names}
        try:
            return cls(**kw, extra=extra)
        except TypeError as e:
            raise KdtError(f"invalid model config: {e}") from None

    @classmethod
    def from_json(cls, s: str) -> ModelConfig:
        return cls.from_dict(json.loads(s))

    def replace(self, **kw: Any) -> ModelConfig:
        return dataclasses.replace(self, **kw)


# ---- presets -------------------------------------------------------------------------------------
PRESETS: dict[str, ModelConfig] = {
    # The fixture scale: small enough for the CI CPU and the simulator, every feature switched on.
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        intermediate_size=512, moe_intermediate_size=64, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                      "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 256},
        rope_interleave=True, tie_word_embeddings=False, max_position_embeddings=1024,
    ),
    # A micro config for running the CUDA path in the simulator (every feature, minimal dims).
    "micro": ModelConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
        first_k_dense_replace=1, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
        rope_interleave=True, tie_word_embeddings=False, max_position_embeddings=256,
    ),
    # moonshotai/Moonlight-16B-A3B
    "moonlight-16b-a3b": ModelConfig(
        vocab_size=163840, hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=11264, moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, n_group=1, topk_group=1, routed_scaling_factor=2.446, norm_topk_prob=True,
        first_k_dense_replace=1, rms_norm_eps=1e-5, rope_theta=50000.0, rope_scaling=None,
        rope_interleave=True, tie_word_embeddings=False, max_position_embeddings=8192,
        bos_token_id=163584, eos_token_id=163585,
    ),
    # moonshotai/Kimi-K2-Instruct
    "kimi-k2": ModelConfig(
        vocab_size=163840, hidden_size=7168, num_hidden_layers=61, num_attention_heads=64,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=384, n_shared_experts=1,
        num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True,
        first_k_dense_replace=1, rms_norm_eps=1e-6, rope_theta=50000.0,
        rope_scaling={"type": "yarn", "rope_type": "yarn", "factor": 32.0, "beta_fast": 1, "beta_slow": 1,
                      "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
        rope_interleave=True, tie_word_embeddings=False, max_position_embeddings=131072,
        bos_token_id=163584, eos_token_id=163585,
    ),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise KdtError(f"unknown preset {name!r} (choose from: {', '.join(PRESETS)})")
    cfg = PRESETS[name]
    return cfg.replace(**overrides) if overrides else cfg
