"""The CUDA backend: the single forward of SPEC section 2 as Numba CUDA kernels, and the DDTree steps
(tree build, greedy target choice, accept, KV compaction) on the GPU.

``CudaModel`` is a drop-in target for :func:`kdt.reference.decode.generate`: ``forward(tokens,
positions, L, block_mask)`` runs every layer on the device and returns :class:`DeviceLogits` (copied to
the host only when someone reads them), replayed from a CUDA graph per token count; with
``hidden_layers`` it also hands back those layers' hidden states (a learned drafter's features);
``compact(L, accepted)`` moves the accepted latents of all layers in one kernel; ``tree_ops`` builds,
stages and accepts trees with the kernels of kdt.kernels.ddtree, the tree never leaving the device.
``CudaDraftModel`` runs the learned block drafter on the same layer code (:class:`DecoderStack`).

Device state: weights (float32 or bf16 bits for every matrix; norms, router and bias in float32), the
latent caches ``c_kv[n_layers, max_len, Rkv]`` and ``k_pe[n_layers, max_len, dr]`` (and, where the tensor-core
attention can run, their pre-split copy ``kv_hl[n_layers, max_len, Rkv + dr]``: :func:`uses_kv_hl`), RoPE tables
``[max_len, dr/2]`` computed once, and activation buffers for up to ``max_tokens`` tokens per forward
(longer causal prompts are prefilled in chunks of that size).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from numba import cuda

from kdt.config import ModelConfig
from kdt.errors import KdtError
from kdt.kernels import attn_tc, mla, moe
from kdt.kernels import ddtree as kd
from kdt.kernels import elementwise as ew
from kdt.kernels.common import IS_SIM, f32_to_bf16_bits, pdl_capture
from kdt.kernels.linear import fragment_order, linear, uses_tc
from kdt.reference.model import layer_prefix

# uv_project writes the attention's output o in the hi / lo layout that o_proj's tensor cores read (the split
# each o_proj block made of float32 o as it loaded it, made once in uv_project's epilogue: the same bits), where
# both run on tensor cores (16+ tokens). Measured (s47a, H100, `scripts/bench_linear.py --tc`): o_proj (2048 x 2048)
# at 65 tokens 24.8 us on float32 x, 17.3 on hi / lo; at 64 19.9 / 15.2. The budget-64 oracle step (s47b, H200,
# `scripts/profile_graphs.py --ab kdt.engine.cuda_model.O_HILO=1`): 13475 -> 13283 us. Env KDT_O_HILO=0: off.
O_HILO = os.environ.get("KDT_O_HILO", "1") != "0"

# The attention's projections qkv_a and o_proj on a fragment-ordered copy of their weights (kdt.kernels.tc's module
# docstring; ``LayerWeights.fragment_order``, +23 MB a Moonlight layer) where the tensor cores take their hi / lo x:
# a group's A fragments in one 16-byte load a lane. sm_90 SASS (scripts/sass_loops.py tc_gemm, session 48): the warp
# tile's loop 119 instructions for 16 HMMA in natural order, 97 for 32 in fragment order; qkv_a and o_proj took ~24
# and ~17 us a layer at 65 tokens (H100). The same fragments, so the same bits. Measured (session 49, H100): the
# projections (`scripts/bench_linear.py --presets moonlight-16b-a3b --M 16,65,128,256 --tc 0 --layers qkv_a,o_proj`,
# hi / lo x, us, natural / fragment order) qkv_a 11.9 / 12.7, 23.6 / 22.4, 35.4 / 23.9, 61.0 / 42.7 at 16 / 65 / 128 /
# 256 tokens, o_proj 10.5 / 11.9, 17.2 / 13.7, 21.1 / 15.0, 35.2 / 24.2 (below 33 tokens linear_tc keeps the natural
# order: kdt.kernels.linear.FO_MIN_M); the budget-64 oracle step (s49b, `scripts/profile_graphs.py --attn-fo-ab`)
# 14913.8 -> 14832.7 us. On by default; env KDT_ATTN_FO=0: no copies.
ATTN_FO = os.environ.get("KDT_ATTN_FO", "1") != "0"


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
    qkv_a: object  # [Nq + Rkv+dr, D]: q_a_proj (or q_proj) rows, then kv_a_proj_with_mqa rows (one GEMM)
    q_a_proj: object | None  # [Rq, D] = qkv_a[:Rq]
    q_a_layernorm: object | None  # [Rq] f32
    q_b_proj: object | None  # [H*(dn+dr), Rq]
    q_proj: object | None  # [H*(dn+dr), D] = qkv_a[:H*(dn+dr)]
    kv_a_proj_with_mqa: object  # [Rkv+dr, D] = qkv_a[Nq:]
    kv_a_layernorm: object  # [Rkv] f32
    kv_b_proj: object  # [H*(dn+dv), Rkv]
    o_proj: object  # [D, H*dv]
    moe: moe.MoEWeights | None  # MoE layers
    mlp_gate_up: object | None  # dense layers: [1, 2I, D]
    mlp_down: object | None  # dense layers: [1, D, I]
    qkv_a_fo: object | None = None  # qkv_a in fragment order, uint64 [1, N, D / 4] (ATTN_FO; linear's fo)
    o_proj_fo: object | None = None  # o_proj in fragment order, uint64 [1, D, H*dv / 4]

    def fragment_order(self, stream=0) -> bool:
        """Keep fragment-ordered copies of qkv_a and o_proj (kdt.kernels.linear.fragment_order) where they are bf16
        and their shapes take the order; True if the layer has both."""
        if self.qkv_a_fo is None:
            self.qkv_a_fo = fragment_order(self.qkv_a, stream)
        if self.o_proj_fo is None:
            self.o_proj_fo = fragment_order(self.o_proj, stream)
        return self.qkv_a_fo is not None and self.o_proj_fo is not None


def stack_rows(*mats):
    """One device matrix [sum N_i, K] holding the rows of each [N_i, K] in turn (inputs freed after)."""
    out = cuda.device_array((sum(m.shape[0] for m in mats), mats[0].shape[1]), dtype=mats[0].dtype)
    r = 0
    for m in mats:
        out[r: r + m.shape[0]].copy_to_device(m)
        r += m.shape[0]
    return out


def load_layer(cfg: ModelConfig, src, i: int) -> LayerWeights:
    """One layer's device weights from a source (:class:`HostWeights` or :class:`RandomWeights`; the
    order of the draws fixes the random model of a seed: keep it). q_a_proj (or q_proj) and
    kv_a_proj_with_mqa read the same normed input: they are stored stacked (``qkv_a``), one GEMM."""
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
    w = dict(input_layernorm=src.vector(p + "input_layernorm.weight"),
             post_attention_layernorm=src.vector(p + "post_attention_layernorm.weight"))
    if q_lora:
        q_w = src.matrix(a + "q_a_proj.weight")
        w.update(q_a_layernorm=src.vector(a + "q_a_layernorm.weight"), q_b_proj=src.matrix(a + "q_b_proj.weight"))
    else:
        q_w = src.matrix(a + "q_proj.weight")
        w.update(q_a_layernorm=None, q_b_proj=None)
    Nq = q_w.shape[0]
    qkv_a = stack_rows(q_w, src.matrix(a + "kv_a_proj_with_mqa.weight"))
    lw = LayerWeights(
        **w, qkv_a=qkv_a, q_a_proj=qkv_a[:Nq] if q_lora else None, q_proj=None if q_lora else qkv_a[:Nq],
        kv_a_proj_with_mqa=qkv_a[Nq:], kv_a_layernorm=src.vector(a + "kv_a_layernorm.weight"),
        kv_b_proj=src.matrix(a + "kv_b_proj.weight"), o_proj=src.matrix(a + "o_proj.weight"),
        moe=moe_w, mlp_gate_up=gu, mlp_down=dn,
    )
    if ATTN_FO:
        lw.fragment_order()
    return lw


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
        self.Nq = cfg.q_lora_rank or H * (dn + dr)
        self.qkv = f32(M_max, self.Nq + Rkv + dr)  # [q_a (or q) | c = kv_a_proj_with_mqa output]
        self.q_abs = f32(M_max, H, Rkv)
        self.q_pe = f32(M_max, H, dr)
        self.o_lat = f32(M_max, H, Rkv)
        self.o = f32(M_max, H * dv)
        self.o_hl = self.o.view(np.uint64) if H * dv % 4 == 0 else None  # o as hi / lo (O_HILO), the same bytes
        self.h = f32(M_max, moe.dense_mlp_scratch_cols(cfg.intermediate_size)) if cfg.first_k_dense_replace else None
        self.logits = f32(M_max, V)
        self.choice = cuda.device_array(M_max, dtype=np.int64)
        self.argmax = ew.ArgmaxScratch(M_max, V)  # a long row's argmax split over blocks (one block: V <= 4096)
        # flash-decoding splits per token count, fixed for every L (splits past L+M stay empty), so
        # the launches of a forward depend on M alone and a CUDA graph can replay them
        self.attn_splits = [0] + [mla.mla_num_splits(max_len, m, H, Rkv, dr) for m in range(1, M_max + 1)]
        attn = max(mla.mla_scratch_size(m, H, Rkv, self.attn_splits[m]) for m in range(1, M_max + 1))
        self.attn_scratch = cuda.device_array(max(1, attn), np.float32)
        self.attn_sync = cuda.to_device(np.zeros(mla.ATTN_SYNC_WORDS, np.int32))  # the combine in the launch's
        self.moe = moe.MoEScratch.allocate(cfg, M_max) if cfg.n_moe_layers else None
        # the MoE's input also in the hi / lo layout (its norm writes both; moe.reads_b_hilo), uint16 and uint64 views
        hl = cfg.n_moe_layers and D % 4 == 0
        self.a_hl = cuda.device_array((M_max, 2 * D), dtype=np.uint16) if hl else None
        self.a_hl64 = self.a_hl.view(np.uint64) if hl else None


class ForwardGraphs:
    """CUDA graphs of the forward, one per token count M (SPEC section 5: a forward is hundreds of
    launches; from Python each costs ~20 us of host time, replayed from a graph ~1 us). ``launch(M,
    stream)`` issues the launches; M is any int key (the drafter uses 0 for its block program).

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
        with pdl_capture():  # KDT_PDL=1: kernels scheduled during their predecessor's tail (kdt.kernels.common)
            self.launch(M, gb)
        return gb.end_building().complete()


class DeviceLogits:
    """Rows [M, N] (logits, hidden states) left on the device; ``np.asarray`` (or indexing) copies
    them to the host once."""

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


def uses_kv_hl(cfg: ModelConfig, max_tokens: int, max_len: int) -> bool:
    """Whether a stack of this config keeps the pre-split latent cache ``kv_hl`` (uint32 [n_layers, max_len,
    Rkv + dr], kdt.kernels.mla.kv_hl_np's words) beside c_kv / k_pe: where version 2's attention can run on tensor
    cores (kdt.kernels.attn_tc, which reads it: attn_tc.runs_tc) and its rows are whole 16-byte copies
    (attn_tc.supports_hl)."""
    H, Rkv, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    return attn_tc.runs_tc(H, Rkv, dr, max_tokens, max_len) and attn_tc.supports_hl(Rkv, dr)


class DecoderStack:
    """Decoder layers on the GPU with their latent caches, RoPE tables and activation buffers: what the
    target (:class:`CudaModel`) and the learned drafter (:class:`CudaDraftModel`) share.
    ``_layers(M, stream)`` runs every layer over the residual rows ``buf.x[:M]`` with the staged
    positions, mask and L."""

    def __init__(self, cfg: ModelConfig, src, max_len: int, max_tokens: int):
        if cfg.kv_lora_rank % 32 and not IS_SIM:
            raise KdtError(f"the CUDA attention kernels need kv_lora_rank % 32 == 0 (this model has "
                           f"{cfg.kv_lora_rank}); use --backend cpu")
        self.cfg, self.max_len, self.M_max = cfg, int(max_len), int(max_tokens)
        self.layers = [load_layer(cfg, src, i) for i in range(cfg.num_hidden_layers)]
        n = cfg.num_hidden_layers
        # the absorb on tensor cores (kdt.kernels.mla.absorb_tc_weights): W_uk transposed a layer where its weights
        # qualify, and the hi / lo q_nope rows it reads
        H, dn = cfg.num_attention_heads, cfg.qk_nope_head_dim
        self.uk_t = [mla.absorb_tc_weights(lw.kv_b_proj, H, dn) if self.M_max >= mla.QABS_TC_MIN_M else None
                     for lw in self.layers]
        self.q_hl = mla.absorb_tc_scratch(self.M_max, H, dn) if any(w is not None for w in self.uk_t) else None
        self.c_kv = cuda.to_device(np.zeros((n, self.max_len, cfg.kv_lora_rank), np.float32))
        self.k_pe = cuda.to_device(np.zeros((n, self.max_len, cfg.qk_rope_head_dim), np.float32))
        F = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        hl = uses_kv_hl(cfg, self.M_max, self.max_len)
        self.kv_hl = cuda.to_device(np.zeros((n, self.max_len, F), np.uint32)) if hl else None
        cos, sin = mla.rope_tables(cfg, self.max_len)
        self.cos_tab, self.sin_tab = cuda.to_device(cos), cuda.to_device(sin)
        self.buf = Buffers(cfg, self.M_max, self.max_len)
        self.feature_layers: tuple[int, ...] = ()
        self.feat = None  # [len(feature_layers), M_max, D]: hidden states recorded by the forward
        self.record_experts: list[int] | None = None  # bench: distinct experts per MoE layer, when a list
        self.graphs: ForwardGraphs | None = None  # CUDA graphs of ``_program`` (set by the subclass)

    def _program(self, key: int, stream=0) -> None:
        """Launch program ``key`` (for the target: the forward of ``key`` tokens) on ``stream``."""
        raise NotImplementedError

    def _run(self, key: int) -> None:
        """Program ``key`` over the inputs staged in the buffers: replayed from a CUDA graph when one is
        captured for the key, else launched directly (the bench's expert count needs the direct path)."""
        if self.graphs is None or self.record_experts is not None:
            self._program(key)
        else:
            self.graphs.run(key)

    def _stage(self, positions, L: int, mask=None, tokens=None) -> None:
        """Upload one forward's inputs: [tokens | positions | L] in one copy; the mask (unless None: the
        program brings its own) when it changed."""
        b, M = self.buf, len(positions)
        h = b.stage_host
        if tokens is not None:
            h[:M] = tokens
        h[b.M_max: b.M_max + M], h[-1] = positions, L
        b.stage.copy_to_device(h)
        if mask is None:
            return
        vis = np.asarray(mask, dtype=bool).astype(np.uint8).reshape(-1)
        if b.vis_host != vis.tobytes():  # AR steps and prefill chunks repeat their mask
            b.vis[: M * M].copy_to_device(vis)
            b.vis_host = vis.tobytes()

    def _o(self, M: int, lw):
        """The attention's output buffer for M tokens: ``buf.o`` float32, or its hi / lo view where uv_project and
        o_proj both run on tensor cores (O_HILO)."""
        b, cfg = self.buf, self.cfg
        if O_HILO and b.o_hl is not None and uses_tc(M, lw.o_proj) \
                and mla.uv_writes_hilo(M, lw.kv_b_proj, cfg.num_attention_heads, cfg.v_head_dim):
            return b.o_hl[:M]
        return b.o[:M]

    def _layers(self, M: int, stream=0, vis=None) -> None:
        """Every layer over ``buf.x[:M]``; ``vis`` [M, M] defaults to the staged ``buf.vis`` block."""
        cfg, b = self.cfg, self.buf
        eps, s = cfg.rms_norm_eps, stream
        positions = b.positions[:M]
        x, a = b.x[:M], b.a[:M]
        vis = b.vis[: M * M].reshape(M, M) if vis is None else vis
        chunks = moe.token_chunks(M, cfg.num_experts_per_tok)  # past version 2's pairs: version 2 a chunk
        for i, lw in enumerate(self.layers):
            # a feature layer's output rows (the drafter's features) go to feat[j]: written by the MoE's
            # last launch (its tee), after a dense layer by a copy
            feat = self.feat[self.feature_layers.index(i), :M] if i in self.feature_layers else None
            linear(x, lw.qkv_a, b.qkv[:M], stream=s, norm=(lw.input_layernorm, eps, a),
                   fo=lw.qkv_a_fo if ATTN_FO else None)  # [q_a (or q) | c]
            qkv = b.qkv[:M]
            if lw.q_proj is None:
                ew.rmsnorm(qkv[:, : b.Nq], lw.q_a_layernorm, eps, b.qa[:M], stream=s)
                q = b.q[:M]
                linear(b.qa[:M], lw.q_b_proj, q, stream=s)
            else:
                q = qkv[:, : b.Nq]
            kv_hl = None if self.kv_hl is None else self.kv_hl[i]
            mla.latent_write_and_absorb(qkv[:, b.Nq:], lw.kv_a_layernorm, eps, b.L, self.c_kv[i], self.k_pe[i], q,
                                        lw.kv_b_proj, positions, self.cos_tab, self.sin_tab, cfg.rope_interleave,
                                        b.q_abs[:M], b.q_pe[:M], stream=s, kv_hl=kv_hl,
                                        tc_abs=None if self.uk_t[i] is None else (self.uk_t[i], self.q_hl))
            mla.mla_attention(b.q_abs[:M], b.q_pe[:M], self.c_kv[i], self.k_pe[i], b.L, vis, cfg.softmax_scale,
                              b.o_lat[:M], scratch=b.attn_scratch, n_splits=b.attn_splits[M], stream=s, kv_hl=kv_hl,
                              max_len=self.max_len, sync=b.attn_sync)
            o = self._o(M, lw)
            mla.uv_project(b.o_lat[:M], lw.kv_b_proj, o, stream=s)
            # x += o_proj(o); before a MoE, a = rmsnorm(x) (in o_proj's launch where linear.fuses_post)
            post = None
            if lw.moe is not None:
                hl = b.a_hl is not None and any(moe.reads_b_hilo(m, lw.moe, b.moe) for _, m in chunks)
                post = (lw.post_attention_layernorm, eps, a, b.a_hl[:M] if hl else None)
            linear(o, lw.o_proj, x, accumulate=True, stream=s, fo=lw.o_proj_fo if ATTN_FO else None, post=post)
            if lw.moe is not None:
                chosen = set()
                for j, m in chunks:
                    moe.moe_forward(a[j: j + m], lw.moe, b.moe, x[j: j + m], M=m, accumulate=True, stream=s,
                                    tee=None if feat is None else feat[j: j + m],
                                    b_hl=b.a_hl64[j: j + m] if hl else None)
                    if self.record_experts is not None:
                        # from the routing every MoE path writes (the small path groups nothing: no n_active)
                        chosen.update(np.unique(b.moe.topk_idx[:m].copy_to_host()).tolist())
                if self.record_experts is not None:
                    self.record_experts.append(len(chosen))
            else:
                moe.dense_mlp(x, lw.mlp_gate_up, lw.mlp_down, b.h, x, M=M, accumulate=True, stream=s,
                              norm=(lw.post_attention_layernorm, eps, a))
                if feat is not None:
                    ew.copy(x, feat, stream=s)


class CudaModel(DecoderStack):
    """The target model on the GPU (see module docstring). dtype: "float32" | "bf16" weights."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray] | None, dtype: str = "float32",
                 max_len: int = 4096, max_tokens: int = 256, seed: int = 0, graphs: bool | None = None):
        """``weights`` None draws seeded random weights on the device (:class:`RandomWeights`).
        ``graphs``: replay each forward from a CUDA graph per token count (default: on a real GPU)."""
        self.dtype = dtype
        wdt = np.uint16 if dtype == "bf16" else np.float32
        src = HostWeights(weights, wdt) if weights is not None else RandomWeights(cfg, wdt, seed)
        self.embed_tokens = src.matrix("model.embed_tokens.weight")
        super().__init__(cfg, src, max_len, max_tokens)
        self.norm = src.vector("model.norm.weight")
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else src.matrix("lm_head.weight")
        from kdt.engine.cuda_step import CudaTreeOps

        self.tree_ops = CudaTreeOps(self)
        use = (not IS_SIM) if graphs is None else bool(graphs)
        self.graphs = ForwardGraphs(self._program) if use else None

    # ---- the single forward -----------------------------------------------------------------------
    def set_feature_layers(self, layers: tuple[int, ...]) -> None:
        """Record the output hidden states of ``layers`` in every forward (what a learned drafter reads):
        ``feat[j, :M]`` is layer ``layers[j]``'s. Changing the set recaptures the CUDA graphs."""
        layers = tuple(int(i) for i in layers)
        if layers == self.feature_layers:
            return
        self.feature_layers = layers
        self.feat = cuda.device_array((len(layers), self.M_max, self.cfg.hidden_size), np.float32) if layers else None
        if self.graphs is not None:
            self.graphs = ForwardGraphs(self._program)

    def hidden_rows(self, M: int) -> dict[int, DeviceLogits]:
        """{layer: its hidden states [M, D] of the last forward} (copied to the host when read)."""
        return {i: DeviceLogits(self.feat[j, :M]) for j, i in enumerate(self.feature_layers)}

    def forward(self, tokens, positions, L: int, mask, hidden_layers=(), last_only: bool = False):
        """tokens[M], positions[M], block mask [M, M] (the prefix [0, L) visible) -> logits [M, V]; ``last_only``:
        the last row's alone [1, V], the lm_head run on that row alone (a prefill's: at M = 2048 the lm_head of every
        row is 2048 x 163840 logits, ~18 ms on the H200); with ``hidden_layers``, (logits, {layer: hidden states
        [M, D]})."""
        if hidden_layers:
            self.set_feature_layers(tuple(hidden_layers))
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
            rows, hidden = [], {i: [] for i in hidden_layers}
            for s in range(0, M, C):
                e = min(M, s + C)
                out = self.forward(tokens[s:e], positions[s:e], L + s, mask[s:e, s:e], hidden_layers, last_only)
                if hidden_layers:
                    out, h = out
                    for i in hidden_layers:
                        hidden[i].append(np.asarray(h[i]))
                if not last_only:  # (last_only: the last chunk's row, on the device, is the answer)
                    rows.append(np.asarray(out))
            logits = out if last_only else np.concatenate(rows)
            return (logits, {i: np.concatenate(v) for i, v in hidden.items()}) if hidden_layers else logits
        b = self.buf
        self._stage(positions, L, mask, tokens)
        self._run((M, True) if last_only else M)
        logits = DeviceLogits(b.logits[: 1 if last_only else M])
        return (logits, self.hidden_rows(M)) if hidden_layers else logits

    def _program(self, key, stream=0) -> None:
        """Launch every kernel of the forward of M tokens (``key`` = M, or (M, True): the lm_head of the last row
        alone, into logits row 0) on ``stream`` (0, or a graph builder). Everything that changes from step to step
        (tokens, positions, mask, L) is read from the buffers, so the launches depend on the key alone."""
        M, last_only = key if isinstance(key, tuple) else (key, False)
        b = self.buf
        ew.embedding(b.tokens[:M], self.embed_tokens, b.x[:M], stream=stream)
        self._layers(M, stream)
        r = slice(M - 1 if last_only else 0, M)  # the rows whose logits are computed
        linear(b.x[r], self.lm_head, b.logits[: r.stop - r.start], stream=stream,
               norm=(self.norm, self.cfg.rms_norm_eps, b.a[r]))

    def compact(self, L: int, accepted) -> None:
        """Move cache slots L+accepted[i] -> L+i in every layer (one race-free kernel). ``L`` is the
        prefix of the verify forward just run, which ``buf.L`` still holds on the device."""
        acc = np.ascontiguousarray(accepted, dtype=np.int32)
        if np.array_equal(acc, np.arange(acc.shape[0])):
            return  # the accepted path already sits in slots [L, L + n): nothing moves (AR, chains)
        self.buf.acc[: acc.shape[0]].copy_to_device(acc)
        kd.compact_gpu(self.c_kv, self.k_pe, self.buf.L, self.buf.acc, int(acc.shape[0]), kv_hl=self.kv_hl)


# The learned drafter's matrices on the device: "float32" (as stored) or "bf16" (env KDT_DRAFTER_DTYPE).
DRAFTER_DTYPE = os.environ.get("KDT_DRAFTER_DTYPE", "float32")


class CudaDraftModel(DecoderStack):
    """The learned block drafter (:mod:`kdt.reference.drafter`) on the GPU, on the target's kernels:
    its decoder stack is a :class:`DecoderStack` of dense layers, and it shares the target's
    ``embed_tokens`` and ``lm_head`` device arrays. Same interface as the reference ``DraftModel``:
    ``add_context(features, start)``, ``block_logits(root, L) -> [B-1, V]`` (host copy).
    ``dtype`` (default :data:`DRAFTER_DTYPE`): its matrices as "float32" or "bf16" bits (norms and the mask
    embedding stay float32); the drafts may differ, the committed tokens never do (SPEC section 3)."""

    def __init__(self, dcfg, target: CudaModel, weights: dict[str, np.ndarray], max_len: int | None = None,
                 max_tokens: int = 64, dtype: str | None = None):
        dcfg.validate(target.cfg)
        self.dcfg, B, D = dcfg, dcfg.block_size, target.cfg.hidden_size
        self.dtype = DRAFTER_DTYPE if dtype is None else dtype
        if self.dtype not in ("float32", "bf16"):
            raise KdtError(f"the drafter's dtype must be float32 or bf16, got {self.dtype!r}")
        src = HostWeights(weights, np.uint16 if self.dtype == "bf16" else np.float32)  # stored float32
        super().__init__(dcfg.stack_config(target.cfg), src, int(max_len or target.max_len) + 2 * B,
                         max(2 * B, max_tokens))
        self.fc, self.hidden_norm = src.matrix("fc.weight"), src.vector("hidden_norm.weight")
        self.norm = src.vector("model.norm.weight")
        mask = np.asarray(weights["mask_embedding"], np.float32)
        self.mask_rows = cuda.to_device(np.ascontiguousarray(np.broadcast_to(mask, (B - 1, D))))
        self.embed_tokens, self.lm_head = target.embed_tokens, target.lm_head
        # zeros, not uninitialised memory: the first device step runs B pending context rows with none
        # valid yet (n_ctx = 0; masked), and garbage there overflowed rmsnorm (simulator warning)
        self.feat_in = cuda.to_device(np.zeros((self.M_max, len(dcfg.target_layers) * D), np.float32))
        # the block attends to the whole block (non-causal); B padded context rows attend causally
        self.vis_block = cuda.to_device(np.ones((B, B), np.uint8))
        self.vis_causal = cuda.to_device(np.tril(np.ones((B, B), np.uint8)))
        # the device DDTree step (kdt.engine.cuda_step): pending context rows feat_in[:B] (n_ctx valid,
        # from position L_ctx) go through the stack in one forward with the next block, mask vis_step
        self.n_ctx = cuda.to_device(np.zeros(1, np.int32))
        self.L_ctx = cuda.to_device(np.zeros(1, np.int64))
        self.vis_step = cuda.device_array(4 * B * B, np.uint8)
        self.graphs = ForwardGraphs(self._program) if not IS_SIM else None

    def add_context(self, features: np.ndarray, start: int) -> None:
        """Context rows for positions [start, start + T) from target features [T, n_feat*D]."""
        feats = np.ascontiguousarray(features, np.float32)
        for s0 in range(0, feats.shape[0], self.M_max):
            m = min(self.M_max, feats.shape[0] - s0)
            self.feat_in[:m].copy_to_device(feats[s0:s0 + m])
            self._stage(np.arange(start + s0, start + s0 + m), start + s0, np.tril(np.ones((m, m), bool)))
            self._run(m)

    def block_logits(self, root: int, L: int) -> np.ndarray:
        B, b = self.dcfg.block_size, self.buf
        self._stage(np.arange(L, L + B), L, tokens=np.full(B, int(root)))
        self._run(0)
        return b.logits[: B - 1].copy_to_host()

    def _program(self, key: int, stream=0) -> None:
        """Program ``key``: 0 = the block, m > 0 = m context rows (each captured in its own graph)."""
        if key > 0:
            self.context_program(key, self.buf.vis[: key * key].reshape(key, key), stream)
        else:
            self.block_program(stream)

    def context_program(self, m: int, vis, stream=0) -> None:
        """m context rows: rmsnorm(fc @ feat_in[:m]) through the stack into cache slots [L, L + m)."""
        b, eps, s = self.buf, self.cfg.rms_norm_eps, stream
        linear(self.feat_in[:m], self.fc, b.x[:m], stream=s)
        ew.rmsnorm(b.x[:m], self.hidden_norm, eps, b.x[:m], stream=s)
        self._layers(m, s, vis)

    def step_program(self, stream=0) -> None:
        """2B rows in one forward: B pending context rows (slots [L, L + B), causal), then the block
        (slots [L + B, L + 2B), positions from the root's) -> logits[:B-1] of depths 1..B-1. Inputs
        staged on the device by :func:`kdt.kernels.ddtree.stage_draft` (a first step) or the previous step's
        :func:`kdt.kernels.ddtree.gather_accepted`: positions, the mask ``vis_step`` and the block's rows
        x[B:2B] (the root's embedding, the mask rows)."""
        b, eps, s, B = self.buf, self.cfg.rms_norm_eps, stream, self.dcfg.block_size
        linear(self.feat_in[:B], self.fc, b.x[:B], stream=s)
        ew.rmsnorm(b.x[:B], self.hidden_norm, eps, b.x[:B], stream=s)
        self._layers(2 * B, s, self.vis_step.reshape(2 * B, 2 * B))
        linear(b.x[B + 1: 2 * B], self.lm_head, b.logits[: B - 1], stream=s, norm=(self.norm, eps, b.a[B + 1: 2 * B]))

    def block_program(self, stream=0) -> None:
        """The block [embed(root), mask x (B-1)] at positions [L, L + B) -> logits[:B-1] of depths 1..B-1."""
        b, eps, s, B = self.buf, self.cfg.rms_norm_eps, stream, self.dcfg.block_size
        ew.embedding(b.tokens[:1], self.embed_tokens, b.x[:1], stream=s)
        ew.copy(self.mask_rows, b.x[1:B], stream=s)
        self._layers(B, s, self.vis_block)
        linear(b.x[1:B], self.lm_head, b.logits[: B - 1], stream=s, norm=(self.norm, eps, b.a[1:B]))
