"""The NumPy reference model: absorb form vs naive MLA, incremental decode vs one causal forward,
routing rules, RoPE variants, config validation."""

import numpy as np
import pytest

from kdt.config import PRESETS, ModelConfig, preset
from kdt.errors import KdtError
from kdt.reference import ops
from kdt.reference.model import RefModel, causal_block
from kdt.weights import random_weights

VARIANTS = {
    "tiny": {},
    "no-q-lora/neox/no-yarn": dict(q_lora_rank=None, rope_interleave=False, rope_scaling=None),
    "one-group/tied/no-dense": dict(n_group=1, topk_group=1, tie_word_embeddings=True, first_k_dense_replace=0,
                                    n_shared_experts=0, norm_topk_prob=False),
    "two-dense/two-shared": dict(first_k_dense_replace=2, n_shared_experts=2),
}


def small(**kw) -> ModelConfig:
    """The tiny preset shrunk (fewer layers, narrower) so float64 tests stay fast."""
    base = dict(hidden_size=64, num_hidden_layers=3, intermediate_size=96, vocab_size=128)
    base.update(kw)
    return preset("tiny", **base)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_absorbed_equals_naive_mla(name, rng):
    cfg = small(**VARIANTS[name])
    w = random_weights(cfg, int(rng.integers(1 << 30)))
    toks = rng.integers(0, cfg.vocab_size, 13)
    a = RefModel(cfg, w, max_len=32).forward(toks, np.arange(13), 0, causal_block(13))
    b = RefModel(cfg, w, max_len=32, absorb=False).forward(toks, np.arange(13), 0, causal_block(13))
    assert np.max(np.abs(a - b)) / np.max(np.abs(b)) < 1e-10


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_then_ar_equals_one_causal_forward(name, rng):
    cfg = small(**VARIANTS[name])
    w = random_weights(cfg, int(rng.integers(1 << 30)))
    T, P = 20, int(rng.integers(1, 12))
    toks = rng.integers(0, cfg.vocab_size, T)
    full = RefModel(cfg, w, max_len=T).forward(toks, np.arange(T), 0, causal_block(T))
    m = RefModel(cfg, w, max_len=T)
    rows = [m.forward(toks[:P], np.arange(P), 0, causal_block(P))]
    for i in range(P, T):
        rows.append(m.forward(toks[i:i + 1], [i], i, np.ones((1, 1), bool)))
    inc = np.concatenate(rows)
    assert np.max(np.abs(inc - full)) / np.max(np.abs(full)) < 1e-10


def test_tree_forward_equals_per_branch_causal(rng):
    """A tree verify (visibility mask, positions L + depth) gives each node the logits of the plain
    causal forward of its own branch."""
    cfg = small()
    w = random_weights(cfg, 3)
    prefix = rng.integers(0, cfg.vocab_size, 6)
    # root(0) -> 1 -> 2 ; root -> 3
    parent = [-1, 0, 1, 0]
    depth = np.array([0, 1, 2, 1])
    tokens = rng.integers(0, cfg.vocab_size, 4)
    vis = np.zeros((4, 4), bool)
    for i, p in enumerate(parent):
        vis[i] = (vis[p] if p >= 0 else False) | (np.arange(4) == i)
    m = RefModel(cfg, w, max_len=16)
    m.forward(prefix, np.arange(6), 0, causal_block(6))
    tree_logits = m.forward(tokens, 6 + depth, 6, vis)
    for leaf, path in ((2, [0, 1, 2]), (3, [0, 3])):
        seq = np.concatenate([prefix, tokens[path]])
        ref = RefModel(cfg, w, max_len=16).forward(seq, np.arange(len(seq)), 0, causal_block(len(seq)))
        assert np.max(np.abs(tree_logits[leaf] - ref[-1])) < 1e-10


def test_routing_rules():
    cfg = preset("tiny").replace(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                                 routed_scaling_factor=2.0, norm_topk_prob=True)
    # sigmoid scores chosen by hand: group 0 = {0,1}, 1 = {2,3}, 2 = {4,5}, 3 = {6,7}
    s = np.array([[0.9, 0.1, 0.6, 0.55, 0.7, 0.2, 0.3, 0.3]])
    bias = np.zeros(8)
    bias[5] = 0.6  # expert 5 looks best through the bias, but its weight is the unbiased score
    logits = np.log(s / (1 - s))
    idx, wts = ops.moe_route(logits, bias, cfg)
    # group scores: g0 1.0, g1 1.15, g2 0.7+0.8=1.5, g3 0.6 -> keep g2, g1; top-2 by s_choice: 5 (0.8), 4 (0.7)
    assert idx.tolist() == [[5, 4]]
    np.testing.assert_allclose(wts, [[0.2 / 0.9 * 2.0, 0.7 / 0.9 * 2.0]], rtol=1e-12)


def test_yarn_scale_and_inv_freq():
    cfg = preset("tiny")
    inv, attn = ops.rope_inv_freq(cfg)
    assert inv.shape == (cfg.qk_rope_head_dim // 2,)
    assert np.all(np.diff(inv) < 0) and attn == 1.0  # mscale == mscale_all_dim -> factor 1
    m = 0.1 * 1.0 * np.log(4.0) + 1.0
    assert cfg.softmax_scale == pytest.approx(cfg.qk_head_dim ** -0.5 * m * m)
    plain = cfg.replace(rope_scaling=None)
    np.testing.assert_allclose(ops.rope_inv_freq(plain)[0],
                               1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16))


def test_rope_interleave_is_a_permutation_of_neox(rng):
    """Interleaved RoPE = NeoX RoPE on the de-interleaved vector (same dot products for q and k)."""
    x = rng.standard_normal((3, 2, 8))
    cos, sin = ops.rope_cos_sin(preset("micro", qk_rope_head_dim=8), np.array([0, 5, 9]))
    a = ops.apply_rope(x, cos, sin, interleave=True)
    b = ops.apply_rope(np.concatenate([x[..., 0::2], x[..., 1::2]], -1), cos, sin, interleave=False)
    np.testing.assert_allclose(a, b)
    # position 0 leaves the vector unrotated (up to the permutation)
    np.testing.assert_allclose(a[0], np.concatenate([x[0, :, 0::2], x[0, :, 1::2]], -1))


@pytest.mark.parametrize("bad, msg", [
    (dict(n_routed_experts=6, n_group=4), "divisible"),
    (dict(topk_group=5), "topk_group"),
    (dict(qk_rope_head_dim=15), "even"),
    (dict(num_experts_per_tok=5, topk_group=1), "num_experts_per_tok"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(first_k_dense_replace=9), "first_k_dense_replace"),
    (dict(q_lora_rank=-3), "q_lora_rank"),
])
def test_config_validation(bad, msg):
    with pytest.raises(KdtError, match=msg):
        preset("tiny", **bad)


def test_config_round_trip_and_hf_dict():
    for cfg in PRESETS.values():
        assert ModelConfig.from_json(cfg.to_json()) == cfg
    hf = dict(PRESETS["moonlight-16b-a3b"].to_dict(), model_type="deepseek_v3", torch_dtype="bfloat16")
    cfg = ModelConfig.from_dict(hf)
    assert cfg == PRESETS["moonlight-16b-a3b"] and cfg.extra["model_type"] == "deepseek_v3"
    with pytest.raises(KdtError, match="missing"):
        ModelConfig.from_dict({"hidden_size": 8})


def test_tiny_fixture_weights_route_to_many_experts(monkeypatch):
    """gen-ref's weights keep routing non-degenerate: over a 40-token prompt every MoE layer spreads its
    tokens over most experts, none taking the bulk."""
    from pathlib import Path

    from kdt.fixture import read_fixture

    fx = read_fixture(Path(__file__).resolve().parent.parent / "fixtures" / "model_tiny.h5")
    seen = []
    real = ops.moe_route

    def spy(logits, bias, cfg):
        idx, w = real(logits, bias, cfg)
        seen.append(idx)
        return idx, w

    monkeypatch.setattr(ops, "moe_route", spy)
    g = fx.golden_by_name("p40")
    RefModel(fx.config, fx.weights, max_len=64).forward(g.prompt, np.arange(40), 0, causal_block(40))
    assert len(seen) == fx.config.n_moe_layers
    for idx in seen:
        counts = np.bincount(idx.reshape(-1), minlength=fx.config.n_routed_experts)
        assert np.count_nonzero(counts) >= 6, counts
        assert counts.max() <= 0.5 * idx.size, counts
