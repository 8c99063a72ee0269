"""kdt convert (kdt/convert.py, ``kdt convert``): Hugging Face checkpoints in, exactly what transformers
computes out.

Every variant builds a tiny ``transformers.DeepseekV3ForCausalLM`` with random weights, saves it the way
checkpoints come (``save_pretrained``; transformers-5's fused expert layout in shards; bf16; a Kimi-K2
``config.json``), converts it, and checks that

- every converted weight equals transformers' parameter bit for bit,
- the float64 ``RefModel`` forward gives transformers' logits (float32, eager) within 1e-5 relative,
- 32 greedy tokens of kdt (``ar_generate`` over RefModel float64 and over the CPU engine, or the CUDA
  engine with ``-m gpu``) equal
  ``generate(do_sample=False)``, compared up to the first step whose transformers top-1/top-2 margin is
  below 1e-4 (an argmax that float32 noise may flip), and the per-step logits agree within 1e-5.

Dimensions and weights are fresh random draws (the ``rng`` fixture prints its seed; replay with
``KDT_TEST_SEED``); the feature switches of each variant are fixed so that every one is covered.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st_torch = pytest.importorskip("safetensors.torch")

from kdt.config import ModelConfig  # noqa: E402
from kdt.convert import (  # noqa: E402
    convert_checkpoint,
    dequantize_fp8_blocks,
    fp8_to_f32,
    read_safetensors_header,
)
from kdt.engine import load_target  # noqa: E402
from kdt.errors import KdtError  # noqa: E402
from kdt.fixture import read_fixture  # noqa: E402
from kdt.reference.decode import ar_generate  # noqa: E402
from kdt.reference.model import RefModel, causal_block, weight_names  # noqa: E402
from kdt.testing import rel_err, run_kdt  # noqa: E402
from kdt.tokenizer import load_tokenizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")

N_NEW = 32
MARGIN = 1e-4
PROMPT_DRAWS = 5  # prompts drawn at most for 8 greedy steps above MARGIN
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 64}
FP8_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": [128, 128]}


@pytest.fixture(scope="module", autouse=True)
def _torch_one_thread():
    """Tiny matrices: threads only add contention (10x slower on a loaded 2-core runner)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- building transformers models ---------------------------------------------------------------
def hf_config(rng: np.random.Generator, *, q_lora: bool, n_group: int, topk_group: int, yarn: dict | None,
              interleave: bool, first_k_dense: int, n_shared: int, tied: bool, layers: int = 2,
              norm_topk_prob: bool = True, **over):
    """A DeepseekV3Config with the given switches and random tiny dimensions."""
    H = int(rng.integers(2, 5))
    E = n_group * int(rng.integers(2, 8 // n_group + 1)) if n_group > 1 else int(rng.integers(4, 9))
    kw = dict(
        vocab_size=int(rng.integers(90, 129)), hidden_size=int(rng.choice([32, 48, 64])),
        intermediate_size=int(rng.choice([48, 64, 80])), moe_intermediate_size=int(rng.choice([16, 24, 32])),
        num_hidden_layers=max(layers, first_k_dense + 1), num_attention_heads=H, num_key_value_heads=H,
        q_lora_rank=int(rng.choice([16, 24, 32])) if q_lora else None, kv_lora_rank=int(rng.choice([16, 24])),
        qk_nope_head_dim=int(rng.choice([8, 16])), qk_rope_head_dim=int(rng.choice([4, 8])),
        v_head_dim=int(rng.choice([8, 12, 16])), n_routed_experts=E, n_shared_experts=n_shared,
        num_experts_per_tok=2, n_group=n_group, topk_group=topk_group, first_k_dense_replace=first_k_dense,
        routed_scaling_factor=float(rng.uniform(1.0, 2.5)), norm_topk_prob=norm_topk_prob,
        rms_norm_eps=1e-6, max_position_embeddings=256, rope_interleave=interleave,
        tie_word_embeddings=tied, bos_token_id=0, eos_token_id=None,
        rope_parameters=dict(yarn or {"rope_type": "default"}, rope_theta=10000.0),
    )
    kw.update(over)
    return transformers.DeepseekV3Config(**kw)


def hf_model(cfg, rng: np.random.Generator):
    """DeepseekV3ForCausalLM (float32, eval, eager attention) with well-conditioned random weights:
    linear N(0, 1/in), embeddings N(0, 1), norms 1 + 0.1 N(0, 1), router x2, and a non-trivial
    e_score_correction_bias.

    The bias is small and positive, so every s_choice = sigmoid + bias is positive. Older transformers
    (4.x) filled the excluded groups' scores with 0.0 before the top-k (masked_fill(..., 0.0)), which
    agrees with SPEC's -inf only while the scores are positive; the installed transformers-5
    DeepseekV3TopkRouter.forward uses masked_fill(..., float("-inf")) like SPEC.
    """
    cfg._attn_implementation = "eager"
    torch.manual_seed(int(rng.integers(1 << 31)))
    m = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.numel() == 0:
                continue  # zero-width shared experts (n_shared_experts == 0)
            if n.endswith("norm.weight"):
                v = 1.0 + 0.1 * rng.standard_normal(p.shape)
            elif n.endswith("embed_tokens.weight"):
                v = rng.standard_normal(p.shape)
            else:
                v = rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])
                if n.endswith("mlp.gate.weight"):
                    v *= 2.0
            p.copy_(torch.from_numpy(v))
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.from_numpy(rng.uniform(0.0, 0.1, b.shape)))
    return m


def hf_state(m, fused: bool) -> dict:
    """The tensors a checkpoint of ``m`` holds: per-expert names (as save_pretrained writes them) or the
    fused in-memory layout; no lm_head when tied; contiguous copies (safetensors refuses shared memory)."""
    sd = {k: v.detach().clone().contiguous() for k, v in m.state_dict().items()}
    if m.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    if fused:
        return sd
    out = {}
    I = m.config.moe_intermediate_size  # noqa: E741
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            p = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                out[f"{p}{e}.gate_proj.weight"] = v[e, :I].clone()
                out[f"{p}{e}.up_proj.weight"] = v[e, I:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            p = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = v[e].clone()
        else:
            out[k] = v
    return out


def write_checkpoint(d: Path, cfg, tensors: dict, n_shards: int = 1, config_edit=None) -> Path:
    """config.json + model.safetensors, or n shards and model.safetensors.index.json."""
    d.mkdir(parents=True, exist_ok=True)
    cj = cfg.to_dict()
    if config_edit:
        config_edit(cj)
    (d / "config.json").write_text(json.dumps(cj, indent=1))
    names = list(tensors)
    if n_shards == 1:
        st_torch.save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        return d
    weight_map = {}
    for i in range(n_shards):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[i::n_shards]}
        st_torch.save_file(part, str(d / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def kdt_names_of(m) -> dict[str, np.ndarray]:
    """transformers' parameters under kdt's names (float32), to compare with the converted file."""
    names = weight_names(ModelConfig.from_dict(m.config.to_dict()))
    return {k: v.float().numpy() for k, v in hf_state(m, fused=False).items() if k in names}


def write_tokenizer(path: Path, V: int) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path.read_text(encoding="utf-8")


# ---- the variants ------------------------------------------------------------------------------
def _kimi(cj: dict) -> None:
    """A Kimi-K2-style config.json: model_type kimi_k2, legacy rope_scaling {"type": "yarn"} + rope_theta."""
    rp = dict(cj.pop("rope_parameters"))
    cj["model_type"] = "kimi_k2"
    cj["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    cj["rope_scaling"] = rp
    cj["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}


VARIANTS = {
    # q_lora, n_group 4 / topk 2, YaRN (mscale_all_dim), interleaved, 1 dense layer, 1 shared, untied;
    # save_pretrained (per-expert tensors) with a tokenizer.json
    "v3-yarn-groups": dict(cfg=dict(q_lora=True, n_group=4, topk_group=2, yarn=YARN, interleave=True,
                                    first_k_dense=1, n_shared=1, tied=False),
                           save="pretrained", tokenizer=True),
    # no q_lora, one group, plain RoPE, NeoX halves, all MoE, 2 shared, tied; fused experts in 2 shards,
    # plus a multi-token-prediction layer (model.layers.{n}.*) that must be skipped
    "fused-sharded-tied": dict(cfg=dict(q_lora=False, n_group=1, topk_group=1, yarn=None, interleave=False,
                                        first_k_dense=0, n_shared=2, tied=True),
                               save="fused", shards=2, mtp=True),
    # q_lora, n_group 2 / topk 1, YaRN without mscale_all_dim, NeoX, 2 dense layers of 3, no shared expert
    # (transformers builds a zero-width shared MLP and saves [0, D] tensors: skipped), untied
    "no-shared-2dense": dict(cfg=dict(q_lora=True, n_group=2, topk_group=1,
                                      yarn={k: v for k, v in YARN.items() if k != "mscale_all_dim"},
                                      interleave=False, first_k_dense=2, n_shared=0, tied=False, layers=3),
                             save="pretrained"),
    # no q_lora, n_group 4 / topk 3, YaRN, interleaved, all MoE, 1 shared, tied; a bf16 checkpoint (router
    # in fp32 as in DeepSeek's) converted to bf16: bits copied
    "bf16-tied": dict(cfg=dict(q_lora=False, n_group=4, topk_group=3, yarn=YARN, interleave=True,
                               first_k_dense=0, n_shared=1, tied=True), save="bf16", dtype="bf16"),
    # Kimi K2 config.json (model_type kimi_k2, rope_scaling spelling): q_lora, one group, YaRN, 1 dense
    "kimi-k2": dict(cfg=dict(q_lora=True, n_group=1, topk_group=1, yarn=YARN, interleave=True,
                             first_k_dense=1, n_shared=1, tied=False), save="pretrained", config_edit=_kimi),
    # no q_lora, n_group 2 / topk 1, plain RoPE, interleaved, 2 dense of 3, 2 shared, untied,
    # norm_topk_prob false; fused experts in one file
    "fused-unnormed": dict(cfg=dict(q_lora=False, n_group=2, topk_group=1, yarn=None, interleave=True,
                                    first_k_dense=2, n_shared=2, tied=False, layers=3, norm_topk_prob=False),
                           save="fused"),
}


def _save_variant(spec: dict, m, d: Path) -> Path:
    save = spec["save"]
    if save == "pretrained":
        m.save_pretrained(str(d))
        if spec.get("config_edit"):
            cj = json.loads((d / "config.json").read_text())
            spec["config_edit"](cj)
            (d / "config.json").write_text(json.dumps(cj))
        return d
    tensors = hf_state(m, fused=True)
    if save == "bf16":
        tensors = {k: v if (k.endswith("mlp.gate.weight") or k.endswith("e_score_correction_bias"))
                   else v.to(torch.bfloat16) for k, v in tensors.items()}
    if spec.get("mtp"):
        n = m.config.num_hidden_layers
        for k in [k for k in tensors if k.startswith("model.layers.0.")]:
            tensors[k.replace("model.layers.0.", f"model.layers.{n}.")] = tensors[k].clone()
        D = m.config.hidden_size
        tensors[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(D, 2 * D)
        tensors[f"model.layers.{n}.enorm.weight"] = torch.ones(D)

    def edit(cj):
        if spec.get("mtp"):
            cj["num_nextn_predict_layers"] = 1
        if spec.get("config_edit"):
            spec["config_edit"](cj)

    return write_checkpoint(d, m.config, tensors, spec.get("shards", 1), edit)


def _round_bf16_(m) -> None:
    """Make every parameter bf16-representable (the bf16 checkpoint then holds the model exactly)."""
    with torch.no_grad():
        for n, p in m.named_parameters():
            if not n.endswith("mlp.gate.weight"):  # the router stays fp32 in the checkpoint
                p.copy_(p.to(torch.bfloat16).float())


@pytest.mark.parametrize("engine", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_convert_matches_transformers(variant, engine, tmp_path, rng):
    """``engine``: the kdt backend that must reproduce transformers' greedy tokens besides the float64
    reference (cpu in CI; cuda, float32 weights, on a GPU with ``-m gpu``)."""
    spec = VARIANTS[variant]
    hcfg = hf_config(rng, **spec["cfg"], **({"kv_lora_rank": 32} if engine == "cuda" else {}))  # GPU lanes
    m = hf_model(hcfg, rng)
    if spec["save"] == "bf16":
        _round_bf16_(m)
    src = _save_variant(spec, m, tmp_path / "ckpt")
    tok_text = write_tokenizer(src / "tokenizer.json", hcfg.vocab_size) if spec.get("tokenizer") else None
    out = tmp_path / "model.h5"
    calls = []
    summary = convert_checkpoint(src, out, dtype=spec.get("dtype", "fp32"),
                                 progress=lambda *a: calls.append(a))

    # summary and progress
    assert summary["model_type"] == ("kimi_k2" if variant == "kimi-k2" else "deepseek_v3")
    assert summary["ignored"] == []
    assert summary["expert_layout"] == ("fused" if spec["save"] in ("fused", "bf16") else "per-expert")
    n_layer0 = sum(1 for k in hf_state(m, fused=True) if k.startswith("model.layers.0."))
    assert summary["skipped"].get("mtp", 0) == (n_layer0 + 2 if spec.get("mtp") else 0)
    if hcfg.n_shared_experts == 0:
        assert summary["skipped"]["empty"] == 3 * (hcfg.num_hidden_layers - hcfg.first_k_dense_replace)
    done = [c[0] for c in calls]
    assert done == sorted(done) and done[-1] == calls[-1][1] == summary["bytes_read"] > 0

    fx = read_fixture(out)
    cfg = fx.config
    assert cfg.tie_word_embeddings == hcfg.tie_word_embeddings and cfg.q_lora_rank == hcfg.q_lora_rank
    assert cfg.rope_interleave == hcfg.rope_interleave and cfg.is_yarn == (spec["cfg"]["yarn"] is not None)
    assert fx.weight_dtype == ("bfloat16" if spec.get("dtype") == "bf16" else "float32")
    if tok_text is not None:
        assert fx.tokenizer == {"kind": "tokenizers", "json": tok_text}
        assert load_tokenizer(fx.tokenizer).encode("t3 t5 t7") == [3, 5, 7]
    else:
        assert fx.tokenizer is None

    # weights: bit for bit
    want = kdt_names_of(m)
    assert set(fx.weights) == set(weight_names(cfg)) == set(want)
    for k, v in want.items():
        np.testing.assert_array_equal(fx.weights[k], v, err_msg=k)

    # one prefill (float64 reference vs transformers float32), then 32 greedy tokens of transformers; a prompt whose
    # greedy tokens meet a razor-thin margin within 8 steps is drawn again (a random model's margins can be that thin:
    # KDT_TEST_SEED=1453934424 at step 3), so that at least 8 tokens are compared
    for _ in range(PROMPT_DRAWS):
        P = int(rng.integers(6, 13))
        prompt = rng.integers(0, hcfg.vocab_size, P)
        ref = RefModel(cfg, fx.weights, max_len=P + N_NEW + 2)
        ours = ref.forward(prompt, np.arange(P), 0, causal_block(P))
        with torch.no_grad():
            theirs = m(torch.from_numpy(prompt)[None]).logits[0].double().numpy()
        assert rel_err(ours, theirs) < 1e-5, rel_err(ours, theirs)
        with torch.no_grad():
            ids = torch.from_numpy(prompt)[None]
            # an explicit all-ones mask: otherwise generate() takes prompt tokens equal to pad_token_id
            # for padding (and shifts the positions)
            g = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N_NEW,
                           output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        hf_tokens = g.sequences[0, P:].tolist()
        hf_logits = torch.stack(g.logits)[:, 0].double().numpy()  # [N_NEW, V]
        assert len(hf_tokens) == N_NEW
        top2 = np.sort(hf_logits, axis=1)[:, -2:]
        thin = np.nonzero(top2[:, 1] - top2[:, 0] < MARGIN)[0]
        k = int(thin[0]) if thin.size else N_NEW  # the tokens chosen before the first razor-thin margin
        if k >= 8:
            break
    assert k >= 8, f"transformers' greedy margin is razor thin at step {k} for {PROMPT_DRAWS} prompts"
    for name, target in (("ref-f64", RefModel(cfg, fx.weights, max_len=P + N_NEW + 2)),
                         (f"{engine}-engine", load_target(cfg, fx.weights, backend=engine, max_len=P + N_NEW + 2))):
        res = ar_generate(target, prompt, N_NEW, keep_logits=True)
        assert res.tokens[:k] == hf_tokens[:k], (name, res.tokens, hf_tokens)
        got = np.asarray(res.logits[:k], dtype=np.float64)
        assert rel_err(got, hf_logits[:k]) < 1e-5, (name, rel_err(got, hf_logits[:k]))
        print(f"{variant} {name}: {k}/{N_NEW} tokens equal, logits rel err {rel_err(got, hf_logits[:k]):.1e}")


# ---- FP8 block quantisation ------------------------------------------------------------------------
def quantize_fp8(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style: per block scale = amax / 448, weight = fp8_e4m3(w / scale); edge blocks partial."""
    R, C = w.shape
    scale = torch.empty(math.ceil(R / block), math.ceil(C / block), dtype=torch.float32)
    q = torch.empty(R, C, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = blk.abs().max() / 448.0
            s = s if s > 0 else torch.tensor(1.0)
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def numpy_dequant(q: np.ndarray, s: np.ndarray, block: int = 128) -> np.ndarray:
    """Independent of kdt.convert: broadcast each scale over its (possibly partial) block."""
    R, C = q.shape
    full = np.kron(s.astype(np.float32), np.ones((block, block), np.float32))[:R, :C]
    return q.astype(np.float32) * full


def _quantised(name: str, t: torch.Tensor) -> bool:
    """What DeepSeek-V3 quantises: the decoder's linear layers (not embeddings, lm_head, router, norms)."""
    return (name.startswith("model.layers.") and t.ndim >= 2 and not name.endswith("mlp.gate.weight")
            and t.numel() > 0)


def _fp8_model(rng, moe_intermediate: int):
    # dimensions that are not multiples of 128, several of them above it: q_b_proj 4*(24+16)=160 rows,
    # dense MLP 200, experts moe_intermediate (136: 128 + 8)
    hcfg = hf_config(rng, q_lora=True, n_group=2, topk_group=1, yarn=YARN, interleave=True, first_k_dense=1,
                     n_shared=1, tied=False, hidden_size=48, num_attention_heads=4, num_key_value_heads=4,
                     qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=16, q_lora_rank=40,
                     intermediate_size=200, moe_intermediate_size=moe_intermediate, n_routed_experts=4)
    return hcfg, hf_model(hcfg, rng)


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_fp8_block_quantised_dequantises_exactly(layout, tmp_path, rng):
    hcfg, m = _fp8_model(rng, 136 if layout == "per-expert" else 128)
    tensors = hf_state(m, fused=layout == "fused")
    stored, expect = {}, {}
    for k, v in tensors.items():
        if not _quantised(k, v):
            stored[k] = v
            continue
        if v.ndim == 3:  # fused [E, out, in]: quantised expert by expert
            qs, ss = zip(*(quantize_fp8(v[e]) for e in range(v.shape[0])), strict=True)
            q, s = torch.stack(qs), torch.stack(ss)
        else:
            q, s = quantize_fp8(v)
        stored[k], stored[k + "_scale_inv"] = q, s
        expect[k] = (q.float().numpy(), s.numpy())
    assert any(s.shape[-1] > 1 or s.shape[-2] > 1 for _, s in expect.values())  # several blocks somewhere
    src = write_checkpoint(tmp_path / "fp8", hcfg, stored, n_shards=2,
                           config_edit=lambda cj: cj.update(quantization_config=FP8_QC))
    summary = convert_checkpoint(src, tmp_path / "fp8.h5")
    assert summary["quantization"].startswith("fp8 128x128") and summary["ignored"] == []
    assert summary["source_dtypes"]["F8_E4M3"] > 0
    fx = read_fixture(tmp_path / "fp8.h5")
    I = hcfg.moe_intermediate_size  # noqa: E741
    n_checked = 0
    for k, (q, s) in expect.items():
        if q.ndim == 3:
            p = k[: -len("gate_up_proj")] if k.endswith("gate_up_proj") else k[: -len("down_proj")]
            for e in range(q.shape[0]):
                w = numpy_dequant(q[e], s[e])
                if k.endswith("gate_up_proj"):
                    np.testing.assert_array_equal(fx.weights[f"{p}{e}.gate_proj.weight"], w[:I])
                    np.testing.assert_array_equal(fx.weights[f"{p}{e}.up_proj.weight"], w[I:])
                else:
                    np.testing.assert_array_equal(fx.weights[f"{p}{e}.down_proj.weight"], w)
                n_checked += 1
        else:
            np.testing.assert_array_equal(fx.weights[k], numpy_dequant(q, s), err_msg=k)
            n_checked += 1
    assert n_checked > 10
    for k, v in stored.items():  # unquantised tensors pass through unchanged
        if k in fx.weights and k not in expect:
            np.testing.assert_array_equal(fx.weights[k], v.float().numpy(), err_msg=k)


def test_dequantize_partial_blocks():
    q = np.arange(1, 1 + 130 * 257, dtype=np.float32).reshape(130, 257) % 7 - 3
    s = np.array([[1.0, 2.0, 4.0], [0.5, 0.25, 8.0]], np.float32)
    w = dequantize_fp8_blocks(q, s)
    assert w[127, 127] == q[127, 127] and w[128, 255] == q[128, 255] * 0.25 and w[129, 256] == q[129, 256] * 8
    np.testing.assert_array_equal(w, numpy_dequant(q, s))
    with pytest.raises(ValueError):
        dequantize_fp8_blocks(q, s[:, :2])


def test_raw_safetensors_reader_matches_torch(tmp_path):
    """kdt reads safetensors without torch: bf16 bits, all 256 float8 patterns, f16, f32, slices."""
    g = torch.Generator().manual_seed(0)
    t = {
        "e4m3": torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "e5m2": torch.arange(256, dtype=torch.uint8).view(torch.float8_e5m2),
        "bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "f16": torch.randn(3, 2, generator=g).to(torch.float16),
        "f32": torch.randn(4, 3, 2, generator=g),
    }
    st_torch.save_file(t, str(tmp_path / "t.safetensors"))
    hdr = read_safetensors_header(tmp_path / "t.safetensors")
    assert {k: (v.dtype, v.shape) for k, v in hdr.items()} == {
        "e4m3": ("F8_E4M3", (256,)), "e5m2": ("F8_E5M2", (256,)), "bf16": ("BF16", (5, 7)),
        "f16": ("F16", (3, 2)), "f32": ("F32", (4, 3, 2))}
    from kdt.convert import _Reader

    r = _Reader()
    try:
        for k, v in t.items():
            np.testing.assert_array_equal(r.f32(hdr[k]), v.float().numpy(), err_msg=k)
        np.testing.assert_array_equal(r.f32(hdr["f32"], 2), t["f32"][2].numpy())
    finally:
        r.close()
    np.testing.assert_array_equal(fp8_to_f32(np.arange(256)), t["e4m3"].float().numpy())


# ---- refusals -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A small valid checkpoint (per-expert, one file) and a sharded fused one, to break in various ways."""
    rng = np.random.default_rng(0)
    hcfg = hf_config(rng, q_lora=True, n_group=2, topk_group=1, yarn=None, interleave=True, first_k_dense=1,
                     n_shared=1, tied=False)
    m = hf_model(hcfg, rng)
    root = tmp_path_factory.mktemp("base")
    single = write_checkpoint(root / "single", hcfg, hf_state(m, fused=False))
    sharded = write_checkpoint(root / "sharded", hcfg, hf_state(m, fused=True), n_shards=3)
    return {"cfg": hcfg, "model": m, "single": single, "sharded": sharded}


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(d: Path, **kv) -> None:
    cj = json.loads((d / "config.json").read_text())
    cj.update(kv)
    (d / "config.json").write_text(json.dumps(cj))


def _retensor(d: Path, fn) -> None:
    path = d / "model.safetensors"
    t = st_torch.load_file(str(path))
    fn(t)
    st_torch.save_file(t, str(path))


def _case_unknown_model_type(b, d):
    _copy(b["single"], d)
    _edit_config(d, model_type="llama", architectures=["LlamaForCausalLM"])
    return r"model_type 'llama' .*not supported"


def _case_missing_config(b, d):
    _copy(b["single"], d)
    (d / "config.json").unlink()
    return r"no config\.json"


def _case_missing_shard(b, d):
    _copy(b["sharded"], d)
    (d / "model-00002-of-00003.safetensors").unlink()
    return r"missing shard\(s\) model-00002-of-00003\.safetensors"


def _case_missing_tensor(b, d):
    _copy(b["single"], d)
    _retensor(d, lambda t: t.pop("model.layers.1.self_attn.kv_b_proj.weight"))
    return r"lacks tensor\(s\) model\.layers\.1\.self_attn\.kv_b_proj\.weight"


def _case_wrong_shape(b, d):
    _copy(b["single"], d)
    _retensor(d, lambda t: t.__setitem__("model.norm.weight", torch.ones(b["cfg"].hidden_size + 1)))
    return r"model\.norm\.weight has shape \(\d+,\), expected"


def _case_unsupported_quant(b, d):
    _copy(b["single"], d)
    _edit_config(d, quantization_config={"quant_method": "gptq", "bits": 4})
    return r"quantization method 'gptq' is not supported"


def _case_fp8_static_activations(b, d):
    _copy(b["single"], d)
    _edit_config(d, quantization_config=dict(FP8_QC, activation_scheme="static"))
    return r"activation_scheme 'static' is not supported"


def _case_linear_rope(b, d):
    _copy(b["single"], d)
    _edit_config(d, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    return r"rope_parameters type 'linear' .*not supported"


def _case_fp8_without_config(b, d):
    _copy(b["single"], d)
    name = "model.layers.0.self_attn.o_proj.weight"
    _retensor(d, lambda t: t.__setitem__(name, t[name].to(torch.float8_e4m3fn)))
    return r"is F8_E4M3 but config\.json has no FP8 quantization_config"


def _case_non_finite(b, d):  # found only while writing: the temp file must go
    _copy(b["single"], d)
    name = "model.layers.1.mlp.experts.1.up_proj.weight"

    def poison(t):
        t[name][0, 0] = float("nan")
    _retensor(d, poison)
    return r"non-finite"


CASES = {f.__name__[len("_case_"):]: f for f in (_case_unknown_model_type, _case_missing_config,
                                                 _case_missing_shard, _case_missing_tensor, _case_wrong_shape,
                                                 _case_unsupported_quant, _case_fp8_static_activations,
                                                 _case_linear_rope, _case_fp8_without_config,
                                                 _case_non_finite)}


@pytest.mark.parametrize("case", list(CASES))
def test_refusals_api(case, base, tmp_path):
    pattern = CASES[case](base, tmp_path / "ckpt")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "old.h5").write_bytes(b"keep me")
    with pytest.raises(KdtError, match=pattern) as ei:
        convert_checkpoint(tmp_path / "ckpt", out_dir / "old.h5")
    assert "\n" not in str(ei.value)
    assert os.listdir(out_dir) == ["old.h5"] and (out_dir / "old.h5").read_bytes() == b"keep me"


def _cli(*args: str):
    return run_kdt("convert", *args, timeout=120)


@pytest.mark.parametrize("case", ["unknown_model_type", "missing_config", "missing_shard", "missing_tensor",
                                  "wrong_shape", "unsupported_quant", "non_finite"])
def test_refusals_cli(case, base, tmp_path):
    pattern = CASES[case](base, tmp_path / "ckpt")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    p = _cli(str(tmp_path / "ckpt"), str(out_dir / "OUT.h5"))
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in p.stderr
    assert os.listdir(out_dir) == []


def test_cli_converts_with_summary(base, tmp_path):
    out = tmp_path / "OUT.h5"
    p = _cli(str(base["sharded"]), str(out), "--dtype", "bf16")
    assert p.returncode == 0, p.stderr
    assert out.exists() and [f.name for f in tmp_path.iterdir()] == ["OUT.h5"]
    for word in ("deepseek_v3", "3 shard(s)", "fused", "bfloat16"):
        assert word in p.stdout, p.stdout
    fx = read_fixture(out)
    assert fx.weight_dtype == "bfloat16"
    # bf16 storage rounds the matrices; the router and the norms stay float32 (exact)
    want = kdt_names_of(base["model"])
    for k in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
              "model.norm.weight"):
        np.testing.assert_array_equal(fx.weights[k], want[k])
    k = "model.layers.1.self_attn.kv_b_proj.weight"
    assert 0 < rel_err(fx.weights[k], want[k]) < 2**-8
    bad = _cli(str(base["single"]), str(tmp_path / "x.h5"), "--dtype", "fp16")
    assert bad.returncode == 2 and "--dtype" in bad.stderr


def test_fused_fp8_with_ragged_blocks_is_refused(tmp_path, rng):
    hcfg, m = _fp8_model(rng, 136)
    stored = {}
    for k, v in hf_state(m, fused=True).items():
        if _quantised(k, v) and v.ndim == 3:
            qs, ss = zip(*(quantize_fp8(v[e]) for e in range(v.shape[0])), strict=True)
            stored[k], stored[k + "_scale_inv"] = torch.stack(qs), torch.stack(ss)
        else:
            stored[k] = v
    src = write_checkpoint(tmp_path / "c", hcfg, stored,
                           config_edit=lambda cj: cj.update(quantization_config=FP8_QC))
    with pytest.raises(KdtError, match="scale grid is ambiguous"):
        convert_checkpoint(src, tmp_path / "x.h5")
    assert not (tmp_path / "x.h5").exists()
