"""The peer of `kdt bench`: transformers' DeepseekV3ForCausalLM on the same weights and device.

On the CUDA backend the peer's big matrices are zero-copy views of kdt's own device arrays (through
``__cuda_array_interface__``), so both engines read the very same bytes; small tensors (norms, router)
are converted to the peer's dtype. On the CPU backend the peer is built from the host weights.
"""

from __future__ import annotations

import time

import numpy as np

from kdt.config import ModelConfig


def available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except Exception:  # noqa: BLE001 - any import problem means no peer
        return False
    return True


def hf_config(cfg: ModelConfig, torch_dtype: str):
    """A transformers DeepseekV3Config with kdt's config fields."""
    from transformers import DeepseekV3Config

    d = cfg.to_dict()
    rope = d.pop("rope_scaling")
    theta = d.pop("rope_theta")
    params = dict(rope or {"rope_type": "default"}, rope_theta=theta)
    params.setdefault("rope_type", params.get("type", "default"))
    hc = DeepseekV3Config(**d, rope_parameters=params, torch_dtype=torch_dtype)
    hc.pad_token_id = None
    hc.num_key_value_heads = cfg.num_attention_heads  # the default (128) breaks eager attention otherwise
    return hc


def _cuda_state(model):
    """(HF name, torch tensor) of a kdt CudaModel, zero-copy for the weight matrices."""
    import torch

    def t(a):
        x = torch.as_tensor(a, device="cuda")
        return x.view(torch.bfloat16) if x.dtype == torch.uint16 else x  # bf16 bits: the same bytes

    cfg = model.cfg
    yield "model.embed_tokens.weight", t(model.embed_tokens)
    yield "model.norm.weight", t(model.norm)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", t(model.lm_head)
    for i, lw in enumerate(model.layers):
        p = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm"):
            yield f"{p}{name}.weight", t(getattr(lw, name))
        for name in ("q_a_proj", "q_a_layernorm", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                     "kv_b_proj", "o_proj"):
            if getattr(lw, name) is not None:
                yield f"{p}self_attn.{name}.weight", t(getattr(lw, name))
        if lw.moe is None:
            I = lw.mlp_gate_up.shape[1] // 2
            gu, dn = t(lw.mlp_gate_up)[0], t(lw.mlp_down)[0]
            yield p + "mlp.gate_proj.weight", gu[:I]
            yield p + "mlp.up_proj.weight", gu[I:]
            yield p + "mlp.down_proj.weight", dn
            continue
        m = lw.moe
        yield p + "mlp.gate.weight", t(m.gate_w)
        yield p + "mlp.gate.e_score_correction_bias", t(m.bias)
        yield p + "mlp.experts.gate_up_proj", t(m.w_gate_up)
        yield p + "mlp.experts.down_proj", t(m.w_down)
        if m.shared_gate_up is not None:
            Is = m.shared_gate_up.shape[1] // 2
            gu, dn = t(m.shared_gate_up)[0], t(m.shared_down)[0]
            yield p + "mlp.shared_experts.gate_proj.weight", gu[:Is]
            yield p + "mlp.shared_experts.up_proj.weight", gu[Is:]
            yield p + "mlp.shared_experts.down_proj.weight", dn


def _host_state(cfg: ModelConfig, weights: dict[str, np.ndarray]):
    """(HF name, torch tensor) from host weights, experts fused as transformers 5 stores them."""
    import torch

    from kdt.kernels.moe import pack_experts

    done = set()
    for name, a in weights.items():
        if ".mlp.experts." not in name:
            yield name, torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
            continue
        prefix = name.split("experts.")[0]
        if prefix in done:
            continue
        done.add(prefix)
        mats = [tuple(weights[f"{prefix}experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down"))
                for e in range(cfg.n_routed_experts)]
        gu, dn = pack_experts(mats, np.float32)
        yield prefix + "experts.gate_up_proj", torch.from_numpy(gu)
        yield prefix + "experts.down_proj", torch.from_numpy(dn)


class TransformersPeer:
    """DeepseekV3ForCausalLM (eager attention) holding kdt's weights; greedy decode and prefill speed."""

    def __init__(self, cfg: ModelConfig, target=None, host_weights: dict | None = None, dtype: str = "bf16"):
        import torch
        from transformers import DeepseekV3ForCausalLM
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

        self.cuda = host_weights is None
        self.device = "cuda" if self.cuda else "cpu"
        tdt = torch.bfloat16 if (dtype == "bf16" and self.cuda) else torch.float32
        hc = hf_config(cfg, "bfloat16" if tdt == torch.bfloat16 else "float32")
        hc._attn_implementation = "eager"
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(hc)
        state = dict(_cuda_state(target) if self.cuda else _host_state(cfg, host_weights))
        modules = dict(model.named_modules())
        for name, _ in list(model.named_parameters()) + list(model.named_buffers()):
            mod_name, _, attr = name.rpartition(".")
            mod = modules[mod_name]
            if name not in state:
                if "rotary_emb" in name:
                    continue
                raise KeyError(f"peer: no kdt tensor for {name}")
            val = state[name].to(self.device)
            val = val.to(torch.float32) if name.endswith("e_score_correction_bias") else val.to(tdt)
            if attr in mod._parameters:
                mod._parameters[attr] = torch.nn.Parameter(val, requires_grad=False)
            else:
                mod._buffers[attr] = val
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.model.rotary_emb = DeepseekV3RotaryEmbedding(hc).to(self.device)
        self.model = model.eval()
        self.torch = torch

    def _sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def logits(self, tokens) -> np.ndarray:
        with self.torch.no_grad():
            ids = self.torch.as_tensor(np.asarray(tokens)[None], device=self.device)
            return self.model(ids).logits[0].float().cpu().numpy()

    def prefill_tokens_per_s(self, tokens, repeats: int = 3) -> float:
        """Prompt tokens a second of one forward that keeps the last row's logits (``logits_to_keep=1``, as
        transformers' generate prefills and kdt's prefill computes)."""
        ids = self.torch.as_tensor(np.asarray(tokens)[None], device=self.device)
        times = []
        with self.torch.no_grad():
            self.model(ids, logits_to_keep=1)
            for _ in range(repeats):
                self._sync()
                t0 = time.perf_counter()
                self.model(ids, logits_to_keep=1)
                self._sync()
                times.append(time.perf_counter() - t0)
        return len(tokens) / float(np.median(times))

    def greedy(self, prompt, n: int) -> list[int]:
        ids = self.torch.as_tensor(np.asarray(prompt)[None], device=self.device)
        with self.torch.no_grad():
            out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=n,
                                      min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    def decode_tokens_per_s(self, prompt, n: int) -> float:
        """Greedy decode speed: (time of n + 1 new tokens - time of 1) / n, so prefill is excluded."""
        self.greedy(prompt, 2)  # warm-up
        self._sync()
        t0 = time.perf_counter()
        self.greedy(prompt, 1)
        self._sync()
        t1 = time.perf_counter()
        self.greedy(prompt, n + 1)
        self._sync()
        t2 = time.perf_counter()
        return n / max((t2 - t1) - (t1 - t0), 1e-9)
