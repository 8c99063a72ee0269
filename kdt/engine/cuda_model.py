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
from kdt.errors import KdtError
from kdt.kernels import ddtree as kd
from kdt.kernels import elementwise as ew
from kdt.kernels import mla, moe
from kdt.kernels.common import IS_SIM, f32_to_bf16_bits
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
        # the per-forward inputs [tokens | positions | L] in one array, so one copy uploads them
        self.stage = cuda.device_array(2 * M_max + 1, dtype=np.int64)
        self.stage_host = cuda.pinned_array(2 * M_max + 1, dtype=np.int64)
        self.tokens, self.positions = self.stage[:M_max], self.stage[M_max: 2 * M_max]
        self.L = self.stage[2 * M_max:]  # the prefix length of the running forward
        self.vis = cuda.device_array(M_max * M_max, dtype=np.uint8)  # [M, M] block, contiguous per M
        self.vis_host: bytes | None = None  # what b.vis holds, when it came from the host
        self.acc = cuda.device_array(M_max, dtype=np.int32)  # accepted node indices, for compaction
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
        # flash-decoding splits per token count, fixed for every L (splits past L+M stay empty), so
        # the launches of a forward depend on M alone and a CUDA graph can replay them
        self.attn_splits = [0] + [mla.mla_num_splits(max_len, m, H, Rkv, dr) for m in range(1, M_max + 1)]
        attn = max(mla.mla_scratch_size(m, H, Rkv, self.attn_splits[m]) for m in range(1, M_max + 1))
        self.attn_scratch = cuda.device_array(max(1, attn), np.float32)
        self.moe = moe.MoEScratch.allocate(cfg, M_max) if cfg.n_moe_layers else None


class ForwardGraphs:
    """CUDA graphs of the forward, one per token count M (SPEC section 5: a forward is hundreds of
    launches; from Python each costs ~20 us of host time, replayed from a graph ~1 us).

    The first forward of a given M runs directly (it compiles its kernels and allocates any lazy
    scratch); the second captures the launches with a ``cuda.core`` graph builder, and every later one
    replays the graph on the legacy default stream, in order with Numba's copies on stream 0. The graph
    keeps its launch arguments, which is why the forward reads every per-step value from device buffers.
    """

    def __init__(self, launch, max_graphs: int = 64):
        from cuda.core import LEGACY_DEFAULT_STREAM, Device

        self.launch, self.max_graphs = launch, max_graphs
        self.device = Device()
        self.device.set_current()
        self.stream = LEGACY_DEFAULT_STREAM
        self.graphs: dict[int, object] = {}
        self.seen: set[int] = set()

    def run(self, M: int) -> None:
        g = self.graphs.get(M)
        if g is None and M in self.seen and len(self.graphs) < self.max_graphs:
            g = self.graphs[M] = self._capture(M)
        if g is None:
            self.seen.add(M)
            self.launch(M)
        else:
            g.launch(self.stream)

    def _capture(self, M: int):
        cuda.synchronize()  # the capture stream must not overtake work queued on stream 0
        gb = self.device.create_graph_builder()
        gb.begin_building()
        self.launch(M, gb)
        return gb.end_building().complete()


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
                 max_len: int = 4096, max_tokens: int = 256, seed: int = 0, graphs: bool | None = None):
        """``weights`` None draws seeded random weights on the device (:class:`RandomWeights`).
        ``graphs``: replay each forward from a CUDA graph per token count (default: on a real GPU)."""
        if cfg.kv_lora_rank % 32 and not IS_SIM:
            raise KdtError(f"the CUDA attention kernels need kv_lora_rank % 32 == 0 (this model has "
                           f"{cfg.kv_lora_rank}); use --backend cpu")
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
        use = (not IS_SIM) if graphs is None else bool(graphs)
        self.graphs = ForwardGraphs(self._forward_device) if use else None
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
        h = b.stage_host
        h[:M], h[b.M_max: b.M_max + M], h[-1] = tokens, positions, L
        b.stage.copy_to_device(h)
        vis = mask.astype(np.uint8).reshape(-1)
        if b.vis_host != vis.tobytes():  # AR steps and prefill chunks repeat their mask
            b.vis[: M * M].copy_to_device(vis)
            b.vis_host = vis.tobytes()
        self._run(M)
        return DeviceLogits(b.logits[:M])

    def _run(self, M: int) -> None:
        """The forward of the M tokens staged in the buffers: replayed from a CUDA graph when one is
        captured for M, else launched directly (the bench's expert count needs the direct path)."""
        if self.graphs is None or self.record_experts is not None:
            self._forward_device(M)
        else:
            self.graphs.run(M)

    def _forward_device(self, M: int, stream=0) -> None:
        """Launch every kernel of the forward of M tokens on ``stream`` (0, or a graph builder).
        Everything that changes from step to step (tokens, positions, mask, L) is read from the
        buffers, so the launches depend on M alone."""
        cfg, b = self.cfg, self.buf
        eps, s = cfg.rms_norm_eps, stream
        tokens, positions = b.tokens[:M], b.positions[:M]
        x, a = b.x[:M], b.a[:M]
        ew.embedding(tokens, self.embed_tokens, x, stream=s)
        vis = b.vis[: M * M].reshape(M, M)
        for i, lw in enumerate(self.layers):
            ew.rmsnorm(x, lw.input_layernorm, eps, a, stream=s)
            q = b.q[:M]
            if lw.q_proj is None:
                linear(a, lw.q_a_proj, b.qa[:M], stream=s)
                ew.rmsnorm(b.qa[:M], lw.q_a_layernorm, eps, b.qa[:M], stream=s)
                linear(b.qa[:M], lw.q_b_proj, q, stream=s)
            else:
                linear(a, lw.q_proj, q, stream=s)
            linear(a, lw.kv_a_proj_with_mqa, b.c[:M], stream=s)
            mla.kv_latent_write(b.c[:M], lw.kv_a_layernorm, eps, positions, self.cos_tab, self.sin_tab, b.L,
                                self.c_kv[i], self.k_pe[i], cfg.rope_interleave, stream=s)
            mla.q_absorb(q, lw.kv_b_proj, positions, self.cos_tab, self.sin_tab, cfg.rope_interleave,
                         b.q_abs[:M], b.q_pe[:M], stream=s)
            mla.mla_attention(b.q_abs[:M], b.q_pe[:M], self.c_kv[i], self.k_pe[i], b.L, vis, cfg.softmax_scale,
                              b.o_lat[:M], scratch=b.attn_scratch, n_splits=b.attn_splits[M], stream=s)
            mla.uv_project(b.o_lat[:M], lw.kv_b_proj, b.o[:M], stream=s)
            linear(b.o[:M], lw.o_proj, x, accumulate=True, stream=s)  # x += o_proj(o)
            ew.rmsnorm(x, lw.post_attention_layernorm, eps, a, stream=s)
            if lw.moe is not None:
                moe.moe_forward(a, lw.moe, b.moe, x, M=M, accumulate=True, stream=s)
                if self.record_experts is not None:
                    self.record_experts.append(int(b.moe.n_active.copy_to_host()[0]))
            else:
                moe.dense_mlp(a, lw.mlp_gate_up, lw.mlp_down, b.h, x, M=M, accumulate=True, stream=s)
        ew.rmsnorm(x, self.norm, eps, a, stream=s)
        linear(a, self.lm_head, b.logits[:M], stream=s)

    def compact(self, L: int, accepted) -> None:
        """Move cache slots L+accepted[i] -> L+i in every layer (one race-free kernel)."""
        acc = np.ascontiguousarray(accepted, dtype=np.int32)
        if np.array_equal(acc, np.arange(acc.shape[0])):
            return  # the accepted path already sits in slots [L, L + n): nothing moves (AR, chains)
        self.buf.acc[: acc.shape[0]].copy_to_device(acc)
        kd.compact_gpu(self.c_kv, self.k_pe, int(L), self.buf.acc, int(acc.shape[0]))


@dataclass
class GpuTree:
    """A tree built on the GPU, left there: its arrays are request 0 of ``bufs`` (kernel outputs); the
    host knows only the node count. Node 0 is the root."""

    bufs: kd.TreeBuffers
    n: int

    def host(self, field: str) -> np.ndarray:
        """One field (tokens, depth, parent, ...) of this tree on the host, for tests and debugging."""
        a = getattr(self.bufs, field).copy_to_host()[0]
        return a[: self.n, : self.n] if field == "visibility" else a[: self.n]


class CudaTreeOps(TreeOps):
    """DDTree steps with the GPU kernels, the tree never leaving the device: tree_build into persistent
    buffers, stage_tree into the forward's inputs, argmax, tree_accept on the device choice. Per step
    the host uploads the draft (two copies) and reads back the node count, the choices and the
    accepted path."""

    def __init__(self, model: CudaModel):
        self.model = model
        b = model.buf
        self.nmax = min(b.M_max, kd.MAX_BUDGET + 1)
        self.tree = kd.alloc_tree(1, self.nmax)
        self.root = cuda.device_array(1, np.int64)
        self.acc = kd.AcceptBuffers(cuda.device_array((1, self.nmax), np.int32), cuda.device_array(1, np.int32),
                                    cuda.device_array(1, np.int64))
        self._draft: dict[tuple[int, int], tuple] = {}  # (D, K) -> device draft_tokens, draft_logp

    def build(self, root, draft_tokens, draft_logp, budget, L):
        if budget + 1 > self.nmax:
            raise ValueError(f"a tree of budget {budget} needs {budget + 1} nodes; this model verifies at most "
                             f"{self.nmax} tokens per forward (max_tokens)")
        dt = np.ascontiguousarray(draft_tokens, np.int64)[None]
        dl = np.ascontiguousarray(draft_logp, np.float32)[None]
        key = dt.shape[1:]
        if key not in self._draft:
            self._draft[key] = (cuda.device_array(dt.shape, np.int64), cuda.device_array(dl.shape, np.float32))
        d_tok, d_logp = self._draft[key]
        d_tok.copy_to_device(dt)
        d_logp.copy_to_device(dl)
        self.root.copy_to_device(np.array([root], np.int64))
        b = self.model.buf
        b.L.copy_to_device(np.array([L], np.int64))
        kd.build_tree_gpu(self.root, d_tok, d_logp, int(budget), b.L, out=self.tree)
        return GpuTree(self.tree, int(self.tree.n_nodes.copy_to_host()[0]))

    def verify(self, target, tree, L):
        if not isinstance(tree, GpuTree):
            return super().verify(target, tree, L)
        m, t, n = self.model, self.tree, tree.n
        b = m.buf
        threads = 256
        kd.stage_tree[max(1, -(-n * n // threads)), threads](t.tokens, t.positions, t.visibility, t.n_nodes,
                                                             np.int32(0), b.tokens, b.positions, b.vis)
        b.vis_host = None  # b.vis now holds the tree's mask
        m._run(n)
        return DeviceLogits(b.logits[:n])

    def choose(self, logits, temperature, rng):
        if temperature > 0 or not isinstance(logits, DeviceLogits):
            return super().choose(np.asarray(logits), temperature, rng)
        M = logits.shape[0]
        out = self.model.buf.choice[:M]
        ew.argmax_rows(logits.device, out)
        return out.copy_to_host()

    def accept(self, tree, choice):
        if not isinstance(tree, GpuTree):
            return super().accept(tree, choice)
        t, n = self.tree, tree.n
        if n > 1:  # the device choice of the last verify (``choice`` is its host copy)
            ch = self.model.buf.choice[: self.nmax].reshape(1, self.nmax)
            kd.accept_gpu(t.first_child, t.next_sibling, t.tokens, ch, t.n_nodes, out=self.acc)
            row = self.acc.accepted[0].copy_to_host()  # the path, padded with -1: one copy
            accepted = row[row >= 0].astype(np.int64)
        else:
            accepted = np.zeros(1, np.int64)
        return accepted, int(np.asarray(choice)[accepted[-1]])
