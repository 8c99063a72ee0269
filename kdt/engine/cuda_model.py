"""The CUDA backend: the single forward of SPEC section 2 as Numba CUDA kernels, and the DDTree steps
(tree build, greedy target choice, accept, KV compaction) on the GPU.

``CudaModel`` is a drop-in target for :func:`kdt.reference.decode.generate`: ``forward(tokens,
positions, L, block_mask)`` runs every layer on the device and returns :class:`DeviceLogits` (copied to
the host only when someone reads them); ``compact(L, accepted)`` moves the accepted latents of all
layers in one kernel; ``tree_ops`` builds and accepts trees with the kernels of kdt.kernels.ddtree.

Device state: weights (float32 or bf16 bits for every matrix; norms, router and bias in float32), the
latent caches ``c_kv[n_layers, max_len, Rkv]`` and ``k_pe[n_layers, max_len, dr]``, RoPE tables
``[max_len, dr/2]`` computed once, and activation buffers for up to ``max_tokens`` tokens per forward
(longer causal prompts are prefilled in chunks of that size).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda

from kdt.config import ModelConfig
from kdt.kernels import ddtree as kd
from kdt.kernels import elementwise as ew
from kdt.kernels import mla, moe
from kdt.kernels.common import f32_to_bf16_bits
from kdt.kernels.linear import linear
from kdt.reference.decode import TreeOps
from kdt.reference.model import layer_prefix


class HostWeights:
    """Weights from a host dict (HF names) uploaded as float32 or bf16 bits (``wdt`` = np.uint16)."""

    def __init__(self, weights: dict[str, np.ndarray], wdt):
        self.w, self.wdt = weights, np.dtype(wdt)

    def matrix(self, name: str):
        a = np.asarray(self.w[name], dtype=np.float32)
        return cuda.to_device(f32_to_bf16_bits(a) if self.wdt == np.uint16 else np.ascontiguousarray(a))

    def vector(self, name: str):
        """Norm weights, router and bias: always float32."""
        return cuda.to_device(np.ascontiguousarray(self.w[name], dtype=np.float32))

    def mlps(self, prefixes: list[str]):
        """Stacked MLPs: gate_up [n, 2I, D], down [n, D, I] (see kdt.kernels.moe.pack_experts)."""
        mats = [tuple(self.w[f"{p}{n}_proj.weight"] for n in ("gate", "up", "down")) for p in prefixes]
        return tuple(cuda.to_device(a) for a in moe.pack_experts(mats, self.wdt))


class RandomWeights:
    """Seeded random weights drawn on the device (benchmarks of real shapes: no host copy), scaled
    like :func:`kdt.weights.random_weights` (linear ~ N(0, 1/in), norms ~ 1 + 0.1 N, bias ~ 0.05 N)."""

    def __init__(self, cfg: ModelConfig, wdt, seed: int = 0):
        from kdt.reference.model import weight_names

        self.shapes, self.wdt, self.seed = weight_names(cfg), np.dtype(wdt), seed
        self._n = 0

    def _fill(self, shape, dtype, scale, offset=0.0):
        from kdt.kernels.randn import randn_fill

        self._n += 1
        a = cuda.device_array(shape, dtype=dtype)
        randn_fill(a, self.seed * 100003 + self._n, scale, offset)
        return a

    def matrix(self, name: str):
        shape = self.shapes[name]
        gain = 2.0 if name.endswith("gate.weight") else 1.0
        return self._fill(shape, self.wdt, gain / np.sqrt(shape[1]))

    def vector(self, name: str):
        shape = self.shapes[name]
        if name.endswith("e_score_correction_bias"):
            return self._fill(shape, np.float32, 0.05)
        if len(shape) == 2:  # the router matrix is kept in float32
            return self._fill(shape, np.float32, 2.0 / np.sqrt(shape[1]))
        return self._fill(shape, np.float32, 0.1, 1.0)

    def mlps(self, prefixes: list[str]):
        I, D = self.shapes[prefixes[0] + "gate_proj.weight"]
        n = len(prefixes)
        return (self._fill((n, 2 * I, D), self.wdt, 1 / np.sqrt(D)), self._fill((n, D, I), self.wdt, 1 / np.sqrt(I)))


@dataclass
class LayerWeights:
    """Device weights of one decoder layer (HF shapes, W[out, in])."""

    input_layernorm: object  # [D] f32
    post_attention_layernorm: object  # [D] f32
    q_a_proj: object | None  # [Rq, D]
    q_a_layernorm: object | None  # [Rq] f32
    q_b_proj: object | None  # [H*(dn+dr), Rq]
    q_proj: object | None  # [H*(dn+dr), D]
    kv_a_proj_with_mqa: object  # [Rkv+dr, D]
    kv_a_layernorm: object  # [Rkv] f32
    kv_b_proj: object  # [H*(dn+dv), Rkv]
    o_proj: object  # [D, H*dv]
    moe: moe.MoEWeights | None  # MoE layers
    mlp_gate_up: object | None  # dense layers: [1, 2I, D]
    mlp_down: object | None  # dense layers: [1, D, I]


def load_layer(cfg: ModelConfig, src, i: int) -> LayerWeights:
    """One layer's device weights from a source (:class:`HostWeights` or :class:`RandomWeights`)."""
    p = layer_prefix(i)
    a = p + "self_attn."
    q_lora = bool(cfg.q_lora_rank)
    moe_w = gu = dn = None
    if cfg.is_moe_layer(i):
        m = p + "mlp."
        gate_up, down = src.mlps([f"{m}experts.{e}." for e in range(cfg.n_routed_experts)])
        sgu, sdn = src.mlps([m + "shared_experts."]) if cfg.n_shared_experts else (None, None)
        moe_w = moe.MoEWeights(
            gate_w=src.vector(m + "gate.weight"), bias=src.vector(m + "gate.e_score_correction_bias"),
            w_gate_up=gate_up, w_down=down, shared_gate_up=sgu, shared_down=sdn, n_group=cfg.n_group,
            topk_group=cfg.topk_group, top_k=cfg.num_experts_per_tok, norm_topk_prob=bool(cfg.norm_topk_prob),
            routed_scaling_factor=float(cfg.routed_scaling_factor))
    else:
        gu, dn = src.mlps([p + "mlp."])
    return LayerWeights(
        input_layernorm=src.vector(p + "input_layernorm.weight"),
        post_attention_layernorm=src.vector(p + "post_attention_layernorm.weight"),
        q_a_proj=src.matrix(a + "q_a_proj.weight") if q_lora else None,
        q_a_layernorm=src.vector(a + "q_a_layernorm.weight") if q_lora else None,
        q_b_proj=src.matrix(a + "q_b_proj.weight") if q_lora else None,
        q_proj=None if q_lora else src.matrix(a + "q_proj.weight"),
        kv_a_proj_with_mqa=src.matrix(a + "kv_a_proj_with_mqa.weight"),
        kv_a_layernorm=src.vector(a + "kv_a_layernorm.weight"),
        kv_b_proj=src.matrix(a + "kv_b_proj.weight"),
        o_proj=src.matrix(a + "o_proj.weight"),
        moe=moe_w, mlp_gate_up=gu, mlp_down=dn,
    )


class Buffers:
    """Activation buffers for up to M_max tokens; a forward of M tokens uses their [:M] slices."""

    def __init__(self, cfg: ModelConfig, M_max: int, max_len: int):
        D, H, V = cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size
        Rkv, dr, dn, dv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        f32 = lambda *s: cuda.device_array(s, dtype=np.float32)  # noqa: E731
        self.M_max = M_max
        self.tokens = cuda.device_array(M_max, dtype=np.int64)
        self.positions = cuda.device_array(M_max, dtype=np.int64)
        self.vis = cuda.device_array(M_max * M_max, dtype=np.uint8)  # [M, M] block, contiguous per M
        self.x = f32(M_max, D)  # residual stream
        self.a = f32(M_max, D)  # normed input of attention / MLP
        self.qa = f32(M_max, cfg.q_lora_rank) if cfg.q_lora_rank else None
        self.q = f32(M_max, H * (dn + dr))
        self.c = f32(M_max, Rkv + dr)
        self.q_abs = f32(M_max, H, Rkv)
        self.q_pe = f32(M_max, H, dr)
        self.o_lat = f32(M_max, H, Rkv)
        self.o = f32(M_max, H * dv)
        self.h = f32(M_max, cfg.intermediate_size) if cfg.first_k_dense_replace else None
        self.logits = f32(M_max, V)
        self.choice = cuda.device_array(M_max, dtype=np.int64)
        # flash-decoding partials: the most any M <= M_max needs at the longest prefix
        attn = max(mla.mla_scratch_size(m, H, Rkv, mla.mla_num_splits(max_len, m, H, Rkv, dr))
                   for m in range(1, M_max + 1))
        self.attn_scratch = cuda.device_array(max(1, attn), np.float32)
        self.moe = moe.MoEScratch.allocate(cfg, M_max) if cfg.n_moe_layers else None


class DeviceLogits:
    """Logits [M, V] left on the device; ``np.asarray`` (or indexing) copies them to the host once."""

    def __init__(self, device_array):
        self.device = device_array
        self.shape = tuple(device_array.shape)
        self._host = None

    def __array__(self, dtype=None, copy=None):
        if self._host is None:
            self._host = self.device.copy_to_host()
        return self._host if dtype is None else self._host.astype(dtype)

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)) and self._host is None:  # one row: copy just that row
            return self.device[int(idx) % self.shape[0]].copy_to_host()
        return np.asarray(self)[idx]

    def __len__(self):
        return self.shape[0]


class CudaModel:
    """The target model on the GPU (see module docstring). dtype: "float32" | "bf16" weights."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray] | None, dtype: str = "float32",
                 max_len: int = 4096, max_tokens: int = 256, seed: int = 0):
        """``weights`` None draws seeded random weights on the device (:class:`RandomWeights`)."""
        self.cfg, self.max_len = cfg, int(max_len)
        self.dtype = dtype
        wdt = np.uint16 if dtype == "bf16" else np.float32
        src = HostWeights(weights, wdt) if weights is not None else RandomWeights(cfg, wdt, seed)
        self.embed_tokens = src.matrix("model.embed_tokens.weight")
        self.layers = [load_layer(cfg, src, i) for i in range(cfg.num_hidden_layers)]
        self.norm = src.vector("model.norm.weight")
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else src.matrix("lm_head.weight")
        n = cfg.num_hidden_layers
        self.c_kv = cuda.to_device(np.zeros((n, self.max_len, cfg.kv_lora_rank), np.float32))
        self.k_pe = cuda.to_device(np.zeros((n, self.max_len, cfg.qk_rope_head_dim), np.float32))
        cos, sin = mla.rope_tables(cfg, self.max_len)
        self.cos_tab, self.sin_tab = cuda.to_device(cos), cuda.to_device(sin)
        self.M_max = int(max_tokens)
        self.buf = Buffers(cfg, self.M_max, self.max_len)
        self.tree_ops = CudaTreeOps(self)
        self.record_experts: list[int] | None = None  # bench: distinct experts per MoE layer, when a list

    # ---- the single forward -----------------------------------------------------------------------
    def forward(self, tokens, positions, L: int, mask) -> DeviceLogits:
        """tokens[M], positions[M], block mask [M, M] (the prefix [0, L) visible) -> logits [M, V]."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        mask = np.asarray(mask, dtype=bool)
        M = tokens.shape[0]
        if mask.shape != (M, M):
            raise ValueError(f"CudaModel.forward takes the [M, M] block mask, got {mask.shape} for M={M}")
        if L + M > self.max_len:
            raise ValueError(f"forward of {M} tokens at L={L} exceeds the cache ({self.max_len} slots)")
        if M > self.M_max:  # causal prefill in chunks of M_max (a chunk never sees a later chunk)
            C = self.M_max
            if not np.array_equal(mask, np.tril(np.ones((M, M), bool))):
                raise ValueError(f"a forward of M={M} > {C} tokens must be causal (it runs in chunks of {C})")
            rows = []
            for s in range(0, M, C):
                e = min(M, s + C)
                rows.append(np.asarray(self.forward(tokens[s:e], positions[s:e], L + s, mask[s:e, s:e])))
            return np.concatenate(rows)
        b = self.buf
        b.tokens[:M].copy_to_device(tokens)
        b.positions[:M].copy_to_device(positions)
        b.vis[: M * M].copy_to_device(mask.astype(np.uint8).reshape(-1))
        self._forward_device(M, int(L))
        return DeviceLogits(b.logits[:M])

    def _forward_device(self, M: int, L: int) -> None:
        cfg, b = self.cfg, self.buf
        eps = cfg.rms_norm_eps
        tokens, positions = b.tokens[:M], b.positions[:M]
        x, a = b.x[:M], b.a[:M]
        ew.embedding(tokens, self.embed_tokens, x)
        vis = b.vis[: M * M].reshape(M, M)
        for i, lw in enumerate(self.layers):
            ew.rmsnorm(x, lw.input_layernorm, eps, a)
            q = b.q[:M]
            if lw.q_proj is None:
                linear(a, lw.q_a_proj, b.qa[:M])
                ew.rmsnorm(b.qa[:M], lw.q_a_layernorm, eps, b.qa[:M])
                linear(b.qa[:M], lw.q_b_proj, q)
            else:
                linear(a, lw.q_proj, q)
            linear(a, lw.kv_a_proj_with_mqa, b.c[:M])
            mla.kv_latent_write(b.c[:M], lw.kv_a_layernorm, eps, positions, self.cos_tab, self.sin_tab, L,
                                self.c_kv[i], self.k_pe[i], cfg.rope_interleave)
            mla.q_absorb(q, lw.kv_b_proj, positions, self.cos_tab, self.sin_tab, cfg.rope_interleave,
                         b.q_abs[:M], b.q_pe[:M])
            mla.mla_attention(b.q_abs[:M], b.q_pe[:M], self.c_kv[i], self.k_pe[i], L, vis, cfg.softmax_scale,
                              b.o_lat[:M], scratch=b.attn_scratch)
            mla.uv_project(b.o_lat[:M], lw.kv_b_proj, b.o[:M])
            linear(b.o[:M], lw.o_proj, x, accumulate=True)  # x += o_proj(o)
            ew.rmsnorm(x, lw.post_attention_layernorm, eps, a)
            if lw.moe is not None:
                moe.moe_forward(a, lw.moe, b.moe, x, M=M, accumulate=True)
                if self.record_experts is not None:
                    self.record_experts.append(int(b.moe.n_active.copy_to_host()[0]))
            else:
                moe.dense_mlp(a, lw.mlp_gate_up, lw.mlp_down, b.h, x, M=M, accumulate=True)
        ew.rmsnorm(x, self.norm, eps, a)
        linear(a, self.lm_head, b.logits[:M])

    def compact(self, L: int, accepted) -> None:
        """Move cache slots L+accepted[i] -> L+i in every layer (one race-free kernel)."""
        acc = np.ascontiguousarray(accepted, dtype=np.int32)
        kd.compact_gpu(self.c_kv, self.k_pe, int(L), acc, int(acc.shape[0]))


@dataclass
class GpuTree:
    """A tree built on the GPU, as the decode loop needs it (host copies; node 0 is the root)."""

    tokens: np.ndarray  # [n] int64
    depth: np.ndarray  # [n] int32
    parent: np.ndarray  # [n] int32
    first_child: np.ndarray  # [n] int32
    next_sibling: np.ndarray  # [n] int32
    visibility: np.ndarray  # [n, n] bool

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])

    def positions(self, L: int) -> np.ndarray:
        return np.int64(L) + self.depth.astype(np.int64)


class CudaTreeOps(TreeOps):
    """DDTree steps with the GPU kernels: tree build, greedy target choice (argmax), accept."""

    def __init__(self, model: CudaModel):
        self.model = model

    def build(self, root, draft_tokens, draft_logp, budget, L):
        tb = kd.build_tree_gpu(np.array([root], np.int64), np.asarray(draft_tokens, np.int64)[None],
                               np.asarray(draft_logp, np.float32)[None], int(budget), np.array([L], np.int64))
        n = int(tb.n_nodes[0])
        return GpuTree(tb.tokens[0, :n], tb.depth[0, :n], tb.parent[0, :n], tb.first_child[0, :n],
                       tb.next_sibling[0, :n], tb.visibility[0, :n, :n].astype(bool))

    def choose(self, logits, temperature, rng):
        if temperature > 0 or not isinstance(logits, DeviceLogits):
            return super().choose(np.asarray(logits), temperature, rng)
        M = logits.shape[0]
        out = self.model.buf.choice[:M]
        ew.argmax_rows(logits.device, out)
        return out.copy_to_host()

    def accept(self, tree, choice):
        n = tree.n
        ab = kd.accept_gpu(tree.first_child[None], tree.next_sibling[None], tree.tokens[None],
                           np.asarray(choice, np.int64)[None], np.array([n], np.int32))
        k = int(ab.n_accepted[0])
        return ab.accepted[0, :k].astype(np.int64), int(ab.bonus[0])
