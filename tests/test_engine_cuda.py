"""The CUDA engine: forward parity with the reference and the greedy invariant (SPEC section 3).

In CI this runs in the CUDA simulator on the `micro` config (a few layers, tiny dims), so the GPU
orchestration itself (buffers, cache writes, tree kernels, compaction) is exercised without a GPU.
On the H200 (`-m gpu`) it runs the tiny fixture: `kdt verify` on CUDA and >= 200 random
(prompt, drafter) invariant trials.
"""

from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from kdt.config import preset
from kdt.drafters import OracleDrafter, SuffixDrafter, UselessDrafter
from kdt.kernels.common import IS_SIM
from kdt.reference.decode import ar_generate, generate
from kdt.reference.model import RefModel, causal_block, lm_head_weight
from kdt.testing import rel_err
from kdt.weights import random_weights

pytestmark = pytest.mark.kernels
# The `micro` config's attention shapes (kv_lora_rank 16) are below what the GPU kernels take (a multiple of
# 32): its tests run in the simulator only; a real GPU runs the `gpu` tests below at real shapes.
sim_only = pytest.mark.skipif(not IS_SIM, reason="micro config: simulator only (run -m gpu on a GPU)")
FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "model_tiny.h5"
CODE = FIXTURE.parent / "model_code.h5"
MICRO = preset("micro")


def safe_len(logits, tol=1e-3) -> int:
    """Leading greedy steps whose top-1/top-2 logit margin exceeds ``tol``: beyond a near-tie, a
    different batch composition may legitimately round the other way (SPEC section 3)."""
    top2 = np.sort(np.asarray(logits), axis=-1)[:, -2:]
    small = np.nonzero(top2[:, 1] - top2[:, 0] < tol)[0]
    return int(small[0]) if small.size else len(top2)


def cuda_model(cfg, w, dtype="float32", max_len=40, max_tokens=8):
    from kdt.engine.cuda_model import CudaModel

    return CudaModel(cfg, w, dtype=dtype, max_len=max_len, max_tokens=max_tokens)


@pytest.fixture
def fused(request, monkeypatch):
    """The optional fused launches for one test, all on (param True) or off: KDT_LINEAR_FUSE_NORM (RMSNorm folded
    into linear_v2's staging of x), KDT_MLA_FUSE_KV (the latent write in q_absorb's launch) and
    KDT_MLA_COMBINE_IN_M (the attention's combine in its launch, at one token)."""
    from kdt.kernels import linear as lin
    from kdt.kernels import mla

    monkeypatch.setattr(lin, "FUSE_NORM", request.param)
    monkeypatch.setattr(mla, "FUSE_KV", request.param)
    monkeypatch.setattr(mla, "COMBINE_IN_MAX_M", int(request.param))
    return request.param


@sim_only
@pytest.mark.parametrize("dtype, fused", [("float32", False), ("bf16", False), ("float32", True)],
                         indirect=["fused"])
def test_forward_prefill_chunks_and_tree_verify_match_reference(dtype, fused, rng):
    """Chunked prefill, a tree verify, compaction and an AR step against the reference; with every norm
    unfused, and with the optional fused launches all on (``fused``: each layer's input norm, the dense layer's
    post-attention norm and the final norm in linear_v2; the latent write in q_absorb's launch)."""
    w = random_weights(MICRO, int(rng.integers(1 << 30)))  # bf16-exact weights: both dtypes use them as is
    P = 11  # > max_tokens: prefill runs in two chunks
    prompt = rng.integers(0, MICRO.vocab_size, P)
    cm, ref = cuda_model(MICRO, w, dtype), RefModel(MICRO, w, max_len=40)
    out = np.asarray(cm.forward(prompt, np.arange(P), 0, causal_block(P)))
    exp = ref.forward(prompt, np.arange(P), 0, causal_block(P))
    assert rel_err(out, exp) < 1e-5
    # a tree: root -> 1 -> 2, root -> 3 (positions L + depth)
    vis = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], bool)
    toks, pos = rng.integers(0, MICRO.vocab_size, 4), P + np.array([0, 1, 2, 1])
    out = np.asarray(cm.forward(toks, pos, P, vis))
    exp = ref.forward(toks, pos, P, vis)
    assert rel_err(out, exp) < 1e-5
    if dtype == "bf16":
        return  # (simulator time) the cache steps below do not depend on the weight dtype
    # compaction of the accepted path [0, 3] then one AR step sees the compacted cache
    cm.compact(P, [0, 3])
    ref.compact(P, [0, 3])
    nxt = rng.integers(0, MICRO.vocab_size, 1)
    out = np.asarray(cm.forward(nxt, [P + 2], P + 2, np.ones((1, 1), bool)))
    exp = ref.forward(nxt, [P + 2], P + 2, np.ones((1, 1), bool))
    assert rel_err(out, exp) < 1e-5


@sim_only
def test_forward_last_only_matches_reference(rng):
    """A prefill's forward with ``last_only`` (the lm_head of the last row alone, kdt.reference.decode.prefill's):
    the reference's last row, in one forward and in chunks (P > max_tokens), into poisoned logits; its cache as a
    whole forward's (the next AR step against the reference); the reference's last_only is its whole product's
    last row, bit for bit."""
    w = random_weights(MICRO, int(rng.integers(1 << 30)))
    for P in (5, 11):  # one forward; two chunks of at most 8
        prompt = rng.integers(0, MICRO.vocab_size, P)
        cm, ref = cuda_model(MICRO, w), RefModel(MICRO, w, max_len=40)
        cm.buf.logits.copy_to_device(np.full(cm.buf.logits.shape, np.nan, np.float32))
        out = np.asarray(cm.forward(prompt, np.arange(P), 0, causal_block(P), last_only=True))
        exp = ref.forward(prompt, np.arange(P), 0, causal_block(P))
        assert out.shape == (1, MICRO.vocab_size), (P, out.shape)
        assert rel_err(out, exp[-1:]) < 1e-5, (P, rel_err(out, exp[-1:]))
        ref2 = RefModel(MICRO, w, max_len=40)
        np.testing.assert_array_equal(ref2.forward(prompt, np.arange(P), 0, causal_block(P), last_only=True),
                                      exp[-1:])
        nxt = rng.integers(0, MICRO.vocab_size, 1)
        out = np.asarray(cm.forward(nxt, [P], P, np.ones((1, 1), bool)))
        assert rel_err(out, ref.forward(nxt, [P], P, np.ones((1, 1), bool))) < 1e-5, P


@sim_only
def test_forward_absorb_on_tensor_cores_matches_reference(monkeypatch, rng):
    """The absorb on tensor cores (kdt.kernels.mla.absorb_uses_tc; on by force: MICRO's W_uk is below its size rule):
    W_uk^T a layer, a prefill and a tree verify against the reference (bf16 weights)."""
    from kdt.kernels import mla

    monkeypatch.setattr(mla, "QABS_TC_MIN_M", 2)
    monkeypatch.setattr(mla, "UV_ROW_PER_WARP_ELEMS", 0)
    w = random_weights(MICRO, int(rng.integers(1 << 30)))
    cm, ref = cuda_model(MICRO, w, "bf16"), RefModel(MICRO, w, max_len=40)
    assert all(t is not None for t in cm.uk_t) and cm.q_hl is not None
    P = 5
    prompt = rng.integers(0, MICRO.vocab_size, P)
    out = np.asarray(cm.forward(prompt, np.arange(P), 0, causal_block(P)))
    assert rel_err(out, ref.forward(prompt, np.arange(P), 0, causal_block(P))) < 1e-5
    vis = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
    toks, pos = rng.integers(0, MICRO.vocab_size, 3), P + np.array([0, 1, 1])
    out = np.asarray(cm.forward(toks, pos, P, vis))
    assert rel_err(out, ref.forward(toks, pos, P, vis)) < 1e-5


def _same_logits_switched(rng, switch, cfg=MICRO) -> None:
    """cfg's (MICRO's) bf16 model built with ``switch(on)`` called first, for on = True and False: the logits of a
    prefill and of a tree verify the same bits both ways, and the reference's to the bound (bf16 weights). ``switch``
    also checks, after the forwards (``switch(on, cm)``), that the switched path ran."""
    w = random_weights(cfg, int(rng.integers(1 << 30)))
    P = 5
    prompt = rng.integers(0, cfg.vocab_size, P)
    vis = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
    toks, pos = rng.integers(0, cfg.vocab_size, 3), P + np.array([0, 1, 1])
    outs = {}
    for on in (True, False):
        switch(on)
        cm = cuda_model(cfg, w, "bf16")
        outs[on] = [np.array(cm.forward(prompt, np.arange(P), 0, causal_block(P))),
                    np.array(cm.forward(toks, pos, P, vis))]
        switch(on, cm)
    for a, b in zip(outs[True], outs[False], strict=True):
        assert np.array_equal(a, b)
    ref = RefModel(cfg, w, max_len=40)
    assert rel_err(outs[True][0], ref.forward(prompt, np.arange(P), 0, causal_block(P))) < 1e-5
    assert rel_err(outs[True][1], ref.forward(toks, pos, P, vis)) < 1e-5


@sim_only
def test_forward_o_hilo_keeps_the_bits(monkeypatch, rng):
    """uv_project writing o in the hi / lo layout for o_proj's tensor cores (kdt.engine.cuda_model.O_HILO; on by force
    at MICRO's size: uv_project and o_proj on tensor cores from one token): the hi / lo path taken, the logits of a
    prefill and a tree verify the same bits as with float32 o, and the reference's to the bound (bf16 weights)."""
    from kdt.engine import cuda_model as cmod
    from kdt.kernels import linear as lin
    from kdt.kernels import mla

    monkeypatch.setattr(mla, "UV_TC_MIN_M", 1)
    monkeypatch.setattr(mla, "UV_ROW_PER_WARP_ELEMS", 0)
    monkeypatch.setattr(lin, "TC_MIN_M", 1)
    monkeypatch.setattr(lin, "TC_MIN_WEIGHTS", 0)
    seen = []
    run = mla.uv_project
    monkeypatch.setattr(mla, "uv_project", lambda o_lat, kv_b, o, **k: seen.append(o.dtype) or run(o_lat, kv_b, o, **k))

    def switch(on, cm=None):
        if cm is None:
            monkeypatch.setattr(cmod, "O_HILO", on)
            return
        assert set(seen) == {np.dtype(np.uint64) if on else np.dtype(np.float32)}, on
        seen.clear()

    _same_logits_switched(rng, switch)


@sim_only
def test_forward_attn_fo_keeps_the_bits(monkeypatch, rng):
    """qkv_a and o_proj on their fragment-ordered copies (kdt.engine.cuda_model.ATTN_FO; on by force at a MICRO whose
    qkv_a has 32 rows (q_lora_rank 12), the tensor cores and the hi / lo norm and o from one token): every layer keeps
    both copies, linear_tc reads them for both projections, the logits of a prefill and a tree verify the same bits
    as on the natural order, and the reference's to the bound."""
    from dataclasses import replace

    from kdt.engine import cuda_model as cmod
    from kdt.kernels import linear as lin
    from kdt.kernels import mla

    monkeypatch.setattr(mla, "UV_TC_MIN_M", 1)
    monkeypatch.setattr(mla, "UV_ROW_PER_WARP_ELEMS", 0)
    monkeypatch.setattr(lin, "TC_MIN_M", 1)
    monkeypatch.setattr(lin, "TC_MIN_WEIGHTS", 0)
    monkeypatch.setattr(lin, "FUSE_NORM", False)
    monkeypatch.setattr(lin, "FO_MIN_M", 1)
    seen = []
    run = lin.linear_tc
    monkeypatch.setattr(lin, "linear_tc", lambda x, W, y, *a, fo=None, **k: seen.append(
        (tuple(W.shape), fo is not None)) or run(x, W, y, *a, fo=fo, **k))
    cfg = replace(MICRO, q_lora_rank=12)

    def switch(on, cm=None):
        if cm is None:
            monkeypatch.setattr(cmod, "ATTN_FO", on)
            return
        assert all((lw.qkv_a_fo is not None) == on and (lw.o_proj_fo is not None) == on for lw in cm.layers)
        D, n_qkv = cfg.hidden_size, cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim
        assert {s for s, f in seen if f} == ({(n_qkv, D), (D, cfg.num_attention_heads * cfg.v_head_dim)} if on
                                             else set()), (on, seen)
        seen.clear()

    _same_logits_switched(rng, switch, cfg)


@sim_only
def test_forward_post_norm_keeps_the_bits(monkeypatch, rng):
    """The MoE's input norm in o_proj's launch (linear.POST_NORM_MAX_M; forced up to 8 tokens here, so a prefill of
    5, a tree of 3 and an AR step of 1 all take it): o_proj with ``post`` in every MoE layer and linear_v2 folding it
    in, the logits the same bits as with the separate norm, and the reference's to the bound (bf16 weights)."""
    from kdt.kernels import linear as lin

    assert MICRO.n_moe_layers > 0
    w = random_weights(MICRO, int(rng.integers(1 << 30)))
    P = 5
    prompt = rng.integers(0, MICRO.vocab_size, P)
    vis = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
    toks, pos = rng.integers(0, MICRO.vocab_size, 3), P + np.array([0, 1, 1])
    nxt = rng.integers(0, MICRO.vocab_size, 1)
    folded = []
    run = lin.linear_v2
    monkeypatch.setattr(lin, "linear_v2", lambda *a, post=None, **k: folded.append(post is not None) or run(
        *a, post=post, **k))
    outs = {}
    for on in (True, False):
        monkeypatch.setattr(lin, "POST_NORM_MAX_M", 8 if on else 0)
        folded.clear()
        cm = cuda_model(MICRO, w, "bf16")
        outs[on] = [np.array(cm.forward(prompt, np.arange(P), 0, causal_block(P))),
                    np.array(cm.forward(toks, pos, P, vis)), np.array(cm.forward(nxt, [P], P, np.ones((1, 1), bool)))]
        assert sum(folded) == (3 * MICRO.n_moe_layers if on else 0), (on, folded)
    for a, b in zip(outs[True], outs[False], strict=True):
        assert np.array_equal(a, b)
    ref = RefModel(MICRO, w, max_len=40)
    assert rel_err(outs[True][0], ref.forward(prompt, np.arange(P), 0, causal_block(P))) < 1e-5
    assert rel_err(outs[True][1], ref.forward(toks, pos, P, vis)) < 1e-5


@sim_only
def test_forward_moe_b_hilo_keeps_the_bits(monkeypatch, rng):
    """The MoE's norm writing its output in the hi / lo layout too (Buffers.a_hl, kdt.kernels.moe.B_HILO) for the
    layer's tensor cores, with the shared experts in fragment order (moe.SHARED_FO; both on by force at MICRO's size:
    version 2 on tensor-core tiles, every layer with its fragment-ordered copies): b_hl passed where the plan takes it,
    the logits of a prefill and a tree verify the same bits as without, and the reference's to the bound."""
    from dataclasses import replace

    from kdt.kernels import moe

    tiles = moe.V2Tiles(nw=2, nr=4, u=2, tt=2, tt_s=2, u_l=2, nw_c=2, nr_c=2, tt_c=2, u_c=2, jc=1, tc=1, tc_rt=1,
                        tc_split=True, tc_hilo=True, tc_fo=True)
    monkeypatch.setattr(moe, "SMALL", False)
    monkeypatch.setattr(moe, "TC_FO", "1")
    seen = []
    run = moe.moe_forward
    monkeypatch.setattr(moe, "moe_forward", lambda *a, **k: seen.append(k.get("b_hl") is not None) or run(*a, **k))

    def switch(on, cm=None):
        if cm is None:
            monkeypatch.setattr(moe, "B_HILO", on)
            monkeypatch.setattr(moe, "v2_tiles", lambda *a, **k: replace(tiles, s_fo=on))
            return
        assert all(lw.moe is None or lw.moe._sdn_fo is not None for lw in cm.layers)
        assert seen and set(seen) == {on}, (on, seen)
        seen.clear()

    _same_logits_switched(rng, switch)


@sim_only
def test_pre_split_cache_follows_the_latent_caches(monkeypatch, rng):
    """The pre-split latent cache kv_hl [n_layers, max_len, Rkv + dr] (on by force: MICRO's kv_lora_rank 16 is
    below the tensor-core attention's shapes, kdt.engine.cuda_model.uses_kv_hl) after a prefill, a tree verify and
    a compaction that moves a slot: kdt.kernels.mla.kv_hl_np of c_kv / k_pe on every committed slot of every layer,
    bit for bit (the latent writes as the engine runs them by default; simulator time: two forwards)."""
    from kdt.engine import cuda_model as cmod
    from kdt.kernels import mla

    monkeypatch.setattr(cmod, "uses_kv_hl", lambda *args: True)
    w = random_weights(MICRO, int(rng.integers(1 << 30)))
    P, max_len = 3, 12
    cm = cuda_model(MICRO, w, max_len=max_len)
    cm.forward(rng.integers(0, MICRO.vocab_size, P), np.arange(P), 0, causal_block(P))
    # a tree: root -> 1 -> 2, root -> 3 (positions L + depth); the accepted path [0, 3] moves slot P + 3 to P + 1
    vis = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], bool)
    cm.forward(rng.integers(0, MICRO.vocab_size, 4), P + np.array([0, 1, 2, 1]), P, vis)
    cm.compact(P, [0, 3])
    n = P + 2  # committed slots
    c_kv, k_pe, kv_hl = (a.copy_to_host() for a in (cm.c_kv, cm.k_pe, cm.kv_hl))
    assert kv_hl.shape == (MICRO.num_hidden_layers, max_len, MICRO.kv_lora_rank + MICRO.qk_rope_head_dim)
    np.testing.assert_array_equal(kv_hl[:, :n], mla.kv_hl_np(c_kv[:, :n], k_pe[:, :n]))


def test_token_chunks_cover_m_with_the_fewest_near_equal_chunks():
    from kdt.kernels import moe

    per = moe.V2_MAX_PAIRS // 6
    assert moe.token_chunks(per, 6) == [(0, per)]
    assert moe.token_chunks(512, 6) == [(0, 256), (256, 256)]
    for M, k in ((2048, 6), (per + 1, 6), (1, 8), (4097, 1), (10, 2048)):
        ch = moe.token_chunks(M, k)
        assert [j for j, _ in ch] == list(np.cumsum([0] + [m for _, m in ch[:-1]]))
        assert sum(m for _, m in ch) == M and all(m * k <= max(moe.V2_MAX_PAIRS, k) for _, m in ch)
        assert len(ch) == -(-M // max(1, moe.V2_MAX_PAIRS // k)) and max(m for _, m in ch) - min(m for _, m in ch) <= 1


def check_moe_chunks(cfg, w, monkeypatch, small: bool, P: int, per: int, max_len: int = 40) -> None:
    """A forward of P tokens with version 2 grouping ``per`` tokens a call (so the MoE runs in chunks) against the
    reference, the drafter's features too, and the experts the bench counts equal to those of one call (the union
    over the chunks)."""
    from kdt.kernels import moe

    monkeypatch.setattr(moe, "SMALL", small)
    k = cfg.num_experts_per_tok
    layers = (0, cfg.num_hidden_layers - 1)
    prompt = np.random.default_rng(P).integers(0, cfg.vocab_size, P)

    def run():  # logits, features, distinct experts a MoE layer
        cm = cuda_model(cfg, w, max_len=max_len, max_tokens=P)
        cm.record_experts = []
        out, hidden = cm.forward(prompt, np.arange(P), 0, causal_block(P), hidden_layers=layers)
        return np.asarray(out), {i: np.asarray(h) for i, h in hidden.items()}, cm.record_experts

    _, _, whole = run()  # one chunk
    monkeypatch.setattr(moe, "V2_MAX_PAIRS", per * k)
    assert len(moe.token_chunks(P, k)) == -(-P // per) > 1
    out, hidden, chunked = run()
    exp, ref_hidden = RefModel(cfg, w, max_len=max_len).forward(prompt, np.arange(P), 0, causal_block(P),
                                                                 hidden_layers=layers)
    assert rel_err(out, exp) < 1e-5
    for i in layers:
        assert rel_err(hidden[i], ref_hidden[i]) < 1e-5
    assert chunked == whole and len(whole) > 0  # the union over the chunks, not the last chunk's


@sim_only
@pytest.mark.parametrize("small", [False, True])
def test_forward_past_the_moe_pairs_runs_it_in_chunks(small, monkeypatch, rng):
    """More tokens than version 2 groups (here 3 a call: 8 tokens as 3 + 3 + 2): the MoE a chunk at a time, each
    chunk's rows of the residual and of the drafter's features its own (the small path too, where it applies)."""
    check_moe_chunks(MICRO, random_weights(MICRO, int(rng.integers(1 << 30))), monkeypatch, small, P=8, per=3)


@pytest.mark.gpu
def test_forward_past_the_moe_pairs_runs_it_in_chunks_gpu(monkeypatch):
    """The same on the tiny fixture: 40 tokens as 14 + 13 + 13 through version 2."""
    from kdt.fixture import read_fixture

    fx = read_fixture(str(FIXTURE))
    check_moe_chunks(fx.config, fx.weights, monkeypatch, False, P=40, per=16, max_len=64)


@sim_only
def test_forward_without_q_lora_matches_reference(rng):
    """Models without q LoRA (Moonlight: one q_proj) run q_proj and kv_a_proj_with_mqa as one stacked
    GEMM whose q columns feed q_absorb as a strided view: prefill and a tree verify against the reference."""
    import dataclasses

    cfg = dataclasses.replace(MICRO, q_lora_rank=None, num_hidden_layers=2)
    w = random_weights(cfg, int(rng.integers(1 << 30)))
    P = 6
    prompt = rng.integers(0, cfg.vocab_size, P)
    cm, ref = cuda_model(cfg, w), RefModel(cfg, w, max_len=40)
    assert cm.layers[0].q_proj is not None and cm.layers[0].q_a_proj is None
    out = np.asarray(cm.forward(prompt, np.arange(P), 0, causal_block(P)))
    assert rel_err(out, ref.forward(prompt, np.arange(P), 0, causal_block(P))) < 1e-5
    vis = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
    toks, pos = rng.integers(0, cfg.vocab_size, 3), P + np.array([0, 1, 1])
    assert rel_err(np.asarray(cm.forward(toks, pos, P, vis)), ref.forward(toks, pos, P, vis)) < 1e-5


@sim_only
@pytest.mark.parametrize("drafter", ["oracle", "noisy", "useless"])
def test_cuda_ddtree_equals_ar_for_any_drafter(drafter, rng):
    """The invariant on the CUDA path (kernels for every layer, tree build, accept, compaction), one drafter a
    test (simulator time: they run on separate workers). AR comes from the reference, whose logits bound the
    steps compared (``safe_len``); the CUDA forward's logits equal the reference's in the forward tests above
    (prefill, tree verify, compaction, an AR step)."""
    w = random_weights(MICRO, int(rng.integers(1 << 30)))
    prompt = rng.integers(0, MICRO.vocab_size, int(rng.integers(1, 5)))
    n = 5
    ar = ar_generate(RefModel(MICRO, w, max_len=40), prompt, n, keep_logits=True)
    k = safe_len(ar.logits)
    seq = np.concatenate([prompt, ar.tokens, np.zeros(8, np.int64)])
    V = MICRO.vocab_size
    d = {"oracle": lambda: OracleDrafter(seq, V), "noisy": lambda: OracleDrafter(seq, V, noise=0.5, seed=2),
         "useless": lambda: UselessDrafter(V)}[drafter]()
    res = generate(cuda_model(MICRO, w), prompt, n, drafter=d, budget=4, block_size=4)
    assert res.tokens[:k] == ar.tokens[:k], d.name
    assert len(res.tokens) == n


@sim_only
def test_cuda_target_feeds_the_learned_drafter(rng):
    """The CUDA forward records the hidden states a learned drafter reads (prefill, verify of trees,
    compaction in between): DDTree with a random learned drafter equals AR, and the drafter's features
    equal the reference target's."""
    from kdt.drafters import LearnedDrafter
    from kdt.reference.drafter import DrafterConfig, DraftModel, random_drafter_weights

    w = random_weights(MICRO, int(rng.integers(1 << 30)))
    dcfg = DrafterConfig(target_layers=(0, MICRO.num_hidden_layers - 1), block_size=4, num_hidden_layers=1,
                         intermediate_size=16)
    dw = random_drafter_weights(dcfg, MICRO, 5)
    head = lm_head_weight(MICRO, w)
    prompt = rng.integers(0, MICRO.vocab_size, 3)
    cm = cuda_model(MICRO, w)
    logits, hidden = cm.forward(prompt, np.arange(3), 0, causal_block(3), hidden_layers=dcfg.target_layers)
    _, ref_hidden = RefModel(MICRO, w, max_len=40).forward(prompt, np.arange(3), 0, causal_block(3),
                                                           hidden_layers=dcfg.target_layers)
    for i in dcfg.target_layers:
        assert rel_err(np.asarray(hidden[i]), ref_hidden[i]) < 1e-5
    n = 5
    ar = ar_generate(RefModel(MICRO, w, max_len=40), prompt, n, keep_logits=True)  # (simulator time: the reference)
    k = safe_len(ar.logits)
    d = LearnedDrafter(DraftModel(dcfg, MICRO, dw, w["model.embed_tokens.weight"], head, np.float32, max_len=40))
    res = generate(cuda_model(MICRO, w), prompt, n, drafter=d, budget=3, block_size=4)
    assert res.tokens[:k] == ar.tokens[:k]
    assert d.committed == len(prompt) + sum(res.accept_lengths)


@sim_only
def test_device_step_program_equals_separate_steps(rng):
    """The one-program greedy step (StepGraph: draft -> build -> verify -> argmax -> accept -> compact ->
    commit on the device, one copy back) == the step as separate calls, token for token and step for
    step: AR and the learned drafter drafting inside the program (its block, top-k and context rows from
    the accepted nodes' features, all on the device). Each step is launched before its predecessor's
    tokens are read (StepGraph.launch / result) while that one cannot end the run; a stop token read with
    a step in flight drops it (StepGraph.discard) and leaves the target's L and the drafter's context as
    the separate calls do. Host drafters run the program in the invariant test above."""
    from kdt.drafters import LearnedDrafter
    from kdt.engine.cuda_model import CudaDraftModel
    from kdt.reference.drafter import DrafterConfig, random_drafter_weights

    w = random_weights(MICRO, int(rng.integers(1 << 30)))
    prompt = rng.integers(0, MICRO.vocab_size, 3)
    n = 7
    cm = cuda_model(MICRO, w, max_len=32, max_tokens=8)
    ar = ar_generate(cm, prompt, 4, keep_logits=True)  # keep_logits: the separate-calls path
    fused = ar_generate(cm, prompt, 4)
    step = cm.tree_ops.device_step(None)
    assert fused.tokens == ar.tokens and fused.host_s is not None and ar.host_s is None
    parts = fused.host_parts  # the host work's parts: within the decode's time, launches counted
    assert set(parts) == {"draft", "launch", "gc"} and parts["draft"] == 0.0 and 0 < parts["launch"] < fused.decode_s
    assert step.launched == 3 and step.dropped == 0  # steps since start(): 1 and 2 had the next in flight
    k = safe_len(ar.logits)
    dcfg = DrafterConfig(target_layers=(0, MICRO.num_hidden_layers - 1), block_size=3, num_hidden_layers=1,
                         intermediate_size=16)
    learned = LearnedDrafter(CudaDraftModel(dcfg, cm, random_drafter_weights(dcfg, MICRO, 5), max_len=32))
    assert cm.tree_ops.device_step(learned).drafts_on_device
    # a stop token that the first or second step commits (tokens 1 and 2 of AR's), read with the next step in
    # flight (a step commits at most 3 here, and 7 - 2 > 3): a drop, unless the tokens repeat
    stop = next((ar.tokens[i] for i in (2, 1) if ar.tokens[i] not in ar.tokens[:i]), None)
    stops = [] if stop is None else [stop]
    runs, after, L = [], [], []
    for dev in (False, True):
        runs.append(generate(cm, prompt, n, drafter=learned, budget=3, block_size=3, device_steps=dev,
                             stop_tokens=stops))
        # the drafter's context and the target's L after the run: the drafter's next block
        after.append(learned.model.block_logits(runs[-1].tokens[-1], learned.committed))
        L.append(int(cm.buf.L.copy_to_host()[0]) if dev else len(prompt) + sum(runs[-1].accept_lengths))
    step = cm.tree_ops.device_step(learned)
    assert runs[1].tokens == runs[0].tokens and runs[1].accept_lengths == runs[0].accept_lengths
    assert runs[1].tokens[:k] == ar.tokens[: len(runs[1].tokens[:k])]
    assert learned.committed == L[0] == L[1] and not step.in_flight
    assert rel_err(after[1], after[0]) < 1e-5
    assert step.dropped == len(stops) and (not stops or runs[1].finish_reason == "stop")


@sim_only
def test_device_steps_end_by_the_record_flag(rng, monkeypatch):
    """KDT_STEP_END=flag: the host learns a step's end from the record row's count (zeroed before the launch,
    step_commit writes it last), no event: AR and the device oracle through the step program give the reference
    AR's tokens, steps launched ahead, and a stop token read with a step in flight drops it (discard)."""
    from kdt.engine import cuda_step

    monkeypatch.setattr(cuda_step, "FLAG_WAIT", True)
    w = random_weights(MICRO, int(rng.integers(1 << 30)))
    V, n = MICRO.vocab_size, 7
    prompt = rng.integers(0, V, 3)
    ar = ar_generate(RefModel(MICRO, w, max_len=40), prompt, n, keep_logits=True)
    k = safe_len(ar.logits)
    cm = cuda_model(MICRO, w, max_len=32, max_tokens=8)
    seq = np.concatenate([prompt, ar.tokens, rng.integers(0, V, 16)])
    res = generate(cm, prompt, n, drafter=OracleDrafter(seq, V, on_device=True), budget=4, block_size=3)
    assert res.tokens[:k] == ar.tokens[:k] and res.host_s is not None
    step = cm.tree_ops.device_step(OracleDrafter(seq, V, on_device=True))
    assert step.launched == res.steps >= 2 and not step.in_flight
    if k < 2 or ar.tokens[1] == ar.tokens[0]:
        return  # (no stop token that the first step reads)
    stop = ar.tokens[1]  # read in the first step's tokens, with the second step in flight: dropped
    res = generate(cm, prompt, n, drafter=OracleDrafter(seq, V, on_device=True), budget=4, block_size=3,
                   stop_tokens=[stop])
    assert res.tokens == ar.tokens[:2] and res.finish_reason == "stop" and step.dropped == 1
    assert int(cm.buf.L.copy_to_host()[0]) == len(prompt) + sum(res.accept_lengths)


@sim_only
def test_device_oracle_steps(rng):
    """The oracle drafting inside the step program (OracleDrafter(on_device=True): kdt.kernels.ddtree.oracle_draft,
    whose drafts equal the host oracle's in test_ddtree_kernels): the reference AR's tokens, every step accepting
    the whole block, the second step launched before the first is read, no host drafting; a drafter of another
    sequence reloads the program's sequence and tables at start (simulator time: one generate, ~75 s)."""
    w = random_weights(MICRO, int(rng.integers(1 << 30)))
    V, n = MICRO.vocab_size, 7
    prompt = rng.integers(0, V, 3)
    ar = ar_generate(RefModel(MICRO, w, max_len=40), prompt, n, keep_logits=True)
    k = safe_len(ar.logits)
    cm = cuda_model(MICRO, w)
    seq = np.concatenate([prompt, ar.tokens])
    step = cm.tree_ops.device_step(OracleDrafter(seq, V, on_device=True))
    assert step.oracle is not None and step.drafts_on_device and step.pipelines(3)
    in_flight, result = [], step.result
    step.result = lambda: (in_flight.append(len(step.in_flight)), result())[1]
    res = generate(cm, prompt, n, drafter=OracleDrafter(seq, V, on_device=True), budget=3, block_size=3)
    assert res.tokens[:k] == ar.tokens[:k] and len(res.tokens) == n
    assert k < n or res.accept_lengths == [3, 3]
    assert in_flight == [2, 1] and res.host_parts["draft"] == 0.0
    other = OracleDrafter(rng.integers(0, V, 30), V, seed=1, on_device=True)
    assert cm.tree_ops.device_step(other) is step
    step.start(3, 0)
    assert (step.oracle.sequence.copy_to_host()[:30] == other.sequence).all()
    for (D, K), bufs in step.oracle.tables.items():
        for got, want in zip(bufs, other.tables(D, K), strict=True):
            np.testing.assert_array_equal(got.copy_to_host(), want)
    with pytest.raises(ValueError, match="without noise"):
        OracleDrafter(seq, V, noise=0.2, on_device=True)


def check_draft_model(cfg, rng, n_ctx: int, max_tokens: int, block: int, layers: int, dtype="float32") -> None:
    """CudaDraftModel (the drafter on the target's kernels) == the NumPy DraftModel: context rows added
    in two chunks (the second longer than its buffers: chunked again), then a block's logits. ``dtype``:
    the drafter's matrices on the device (bf16: the weights are rounded to bf16 first, for both models)."""
    from kdt.bf16 import round_to_bf16
    from kdt.engine.cuda_model import CudaDraftModel
    from kdt.reference.drafter import DrafterConfig, DraftModel, random_drafter_weights

    w = random_weights(cfg, int(rng.integers(1 << 30)))
    dcfg = DrafterConfig(target_layers=(0,), block_size=block, num_hidden_layers=layers, intermediate_size=16)
    dw = random_drafter_weights(dcfg, cfg, int(rng.integers(1 << 30)))
    if dtype == "bf16":
        dw = {k: round_to_bf16(np.asarray(v, np.float32)) for k, v in dw.items()}
    head = lm_head_weight(cfg, w)
    max_len = n_ctx + block + 8
    ref = DraftModel(dcfg, cfg, dw, w["model.embed_tokens.weight"], head, np.float64, max_len=max_len)
    gpu = CudaDraftModel(dcfg, cuda_model(cfg, w, max_len=max_len), dw, max_len=max_len, max_tokens=max_tokens,
                         dtype=dtype)
    if dtype == "bf16":  # the matrices really are bf16 bits on the device
        assert np.dtype(gpu.fc.dtype) == np.uint16 and np.dtype(gpu.layers[0].o_proj.dtype) == np.uint16
    feats = rng.standard_normal((n_ctx, cfg.hidden_size)).astype(np.float32)
    for m in (ref, gpu):
        m.add_context(feats[:2], 0)
        m.add_context(feats[2:], 2)
    root = int(rng.integers(cfg.vocab_size))
    for _ in range(2):  # twice: on a GPU the second block replays a captured graph
        want = ref.block_logits(root, n_ctx)
        got = gpu.block_logits(root, n_ctx)
        assert got.shape == want.shape == (block - 1, cfg.vocab_size)
        assert rel_err(got, want) < 1e-5, rel_err(got, want)


@sim_only
@pytest.mark.parametrize("dtype, fused", [("float32", False), ("float32", True), ("bf16", True)], indirect=["fused"])
def test_cuda_draft_model_matches_reference(dtype, fused, rng):
    check_draft_model(MICRO, rng, n_ctx=7, max_tokens=4, block=3, layers=1, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bf16"])
def test_cuda_draft_model_matches_reference_gpu(dtype, rng):
    check_draft_model(preset("tiny"), rng, n_ctx=300, max_tokens=64, block=16, layers=2, dtype=dtype)


@pytest.mark.gpu
def test_learned_drafter_on_cuda_model_code(rng):
    """The committed demo model and its learned drafter on the GPU: DDTree equals AR on held-out text."""
    from kdt.drafters import learned_drafter
    from kdt.engine import load_target
    from kdt.fixture import read_fixture

    fx = read_fixture(str(CODE))
    if fx.drafter is None:
        pytest.skip("fixtures/model_code.h5 carries no drafter")
    target = load_target(fx.config, fx.weights, "cuda", "bf16", 512)
    text = b"import os\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(\n"
    prompt = np.frombuffer(text, np.uint8).astype(np.int64)
    ar = ar_generate(target, prompt, 96, keep_logits=True)
    k = safe_len(ar.logits)
    for budget in (15, 64):
        res = generate(target, prompt, 96, drafter=learned_drafter(fx, 512, target), budget=budget,
                       block_size=fx.drafter.config.block_size)
        assert res.tokens[:k] == ar.tokens[:k], budget
        assert res.avg_accept > 1.5, (budget, res.avg_accept)  # it learned something


@pytest.mark.gpu
def test_stop_token_drops_the_step_in_flight_gpu():
    """model_code and its learned drafter on the GPU, budget 31: a stop token read while the next step is in
    flight (StepGraph.discard) gives AR's tokens up to the stop, leaves the target's L and the drafter's
    context at the last step read, and the next run equals AR."""
    from kdt.drafters import learned_drafter
    from kdt.engine import load_target
    from kdt.fixture import read_fixture

    fx = read_fixture(str(CODE))
    if fx.drafter is None:
        pytest.skip("fixtures/model_code.h5 carries no drafter")
    B, n = fx.drafter.config.block_size, 120
    target = load_target(fx.config, fx.weights, "cuda", "bf16", 512, max_tokens=64)
    drafter = learned_drafter(fx, 512, target)
    prompt = np.frombuffer(b"import os\nimport sys\n\ndef main(argv):\n    ", np.uint8).astype(np.int64)
    ar = ar_generate(target, prompt, n, keep_logits=True)
    k = safe_len(ar.logits)
    stops = [t for i, t in enumerate(ar.tokens[:k]) if i >= 3 and t not in ar.tokens[:i]][:6]
    assert stops, "no stop token in AR's safe prefix"

    def dropped() -> int:
        return sum(s.dropped for s in target.tree_ops._steps.values())

    for stop in stops:
        d0 = dropped()
        res = generate(target, prompt, n, drafter=drafter, budget=31, block_size=B, stop_tokens=[stop])
        assert res.tokens == ar.tokens[: ar.tokens.index(stop) + 1] and res.finish_reason == "stop"
        L = int(target.buf.L.copy_to_host()[0])
        assert L == len(prompt) + sum(res.accept_lengths) == drafter.committed
        before = 1 + sum(res.accept_lengths[:-1])  # tokens out before the last step; a step commits <= B
        assert dropped() - d0 == int(n - before > B), (stop, before)
    res = generate(target, prompt, n, drafter=drafter, budget=31, block_size=B)
    assert res.tokens[:k] == ar.tokens[:k]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bf16"])
def test_verify_fixture_on_cuda(dtype):
    from kdt.engine import load_target
    from kdt.fixture import read_fixture
    from kdt.verify import run_verify

    fx = read_fixture(str(FIXTURE))
    checks = run_verify(fx, lambda: load_target(fx.config, fx.weights, "cuda", dtype, 128))
    bad = [c for c in checks if not c.ok]
    assert not bad, bad


@pytest.mark.gpu
def test_cuda_invariant_200_random_trials(rng):
    from kdt.engine import load_target
    from kdt.fixture import read_fixture

    fx = read_fixture(str(FIXTURE))
    cfg, V = fx.config, fx.config.vocab_size
    target = load_target(cfg, fx.weights, "cuda", "float32", 256)
    trials = 0
    for _ in range(50):
        prompt = rng.integers(0, V, int(rng.integers(1, 60)))
        n = int(rng.integers(8, 40))
        ar = ar_generate(target, prompt, n, keep_logits=True)  # the target is reused: prefill overwrites
        k = safe_len(ar.logits)
        seq = np.concatenate([prompt, ar.tokens, rng.integers(0, V, 32)])
        budget, block = int(rng.choice([1, 4, 16, 64, 128])), int(rng.choice([2, 4, 8, 16]))
        for d in (OracleDrafter(seq, V, seed=trials), OracleDrafter(seq, V, seed=trials, on_device=True),
                  OracleDrafter(seq, V, noise=0.4, seed=trials), UselessDrafter(V, seed=trials), SuffixDrafter(V)):
            res = generate(target, prompt, n, drafter=d, budget=budget, block_size=block)
            assert res.tokens[:k] == ar.tokens[:k], (d.name, budget, block, prompt.tolist())
            trials += 1
    assert trials >= 250


@pytest.mark.gpu
@pytest.mark.parametrize("option", ["graphs2", "flag"])
def test_step_options_gpu(option, rng, monkeypatch):
    """The step program's options: KDT_STEP_GRAPHS=2 (the steps replay two captures of their program in turn, so a
    step launched ahead never relaunches the graph the step before it runs: both captures of each key made and
    replayed) and KDT_STEP_END=flag (the host polls the record's count, no event): AR's tokens for AR and for the
    oracle drafting on the device, whose steps are launched ahead."""
    from kdt.engine import cuda_step, load_target
    from kdt.fixture import read_fixture

    graphs = 2 if option == "graphs2" else 1
    monkeypatch.setattr(cuda_step, "STEP_GRAPHS", graphs)
    monkeypatch.setattr(cuda_step, "FLAG_WAIT", option == "flag")
    fx = read_fixture(str(FIXTURE))
    V = fx.config.vocab_size
    target = load_target(fx.config, fx.weights, "cuda", "float32", 256)
    prompt = rng.integers(0, V, 20)
    ar = ar_generate(target, prompt, 48, keep_logits=True)  # the separate calls: no step program
    k = safe_len(ar.logits)
    seq = np.concatenate([prompt, ar.tokens, rng.integers(0, V, 32)])
    for budget in (0, 16):
        d = OracleDrafter(seq, V, on_device=True) if budget else None
        res = generate(target, prompt, 48, drafter=d, budget=budget, block_size=4)  # 48 / 12 steps
        assert res.tokens[:k] == ar.tokens[:k], budget
        step = target.tree_ops.device_step(d)
        assert {key[-1] for key in step.graphs.graphs} == set(range(graphs)), (budget, set(step.graphs.graphs))
        assert step.launched == res.steps and step.dropped == 0


@pytest.mark.gpu
def test_cuda_graph_replay_equals_direct_launches(rng):
    """Forwards replayed from CUDA graphs (one per token count) give the very logits of direct
    launches, across a chunked prefill, AR steps, repeated tree verifies at moving L and a compaction;
    and the graphs were really used (captured on a count's second forward, replayed after), their kernels
    launched with PDL (programmatic dependent launch: kdt.kernels.common) unless KDT_PDL=0."""
    from kdt.engine.cuda_model import CudaModel
    from kdt.fixture import read_fixture
    from kdt.kernels import common

    fx = read_fixture(str(FIXTURE))
    cfg, V = fx.config, fx.config.vocab_size
    g, d = (CudaModel(cfg, fx.weights, max_len=256, max_tokens=16, graphs=flag) for flag in (True, False))
    ref = RefModel(cfg, fx.weights, max_len=256)
    P = int(rng.integers(20, 40))
    steps = [(rng.integers(0, V, P), np.arange(P), 0, causal_block(P))]
    L = P
    for _ in range(3):  # AR steps: M = 1 runs direct, then captured, then replayed
        steps.append((rng.integers(0, V, 1), np.array([L]), L, np.ones((1, 1), bool)))
        L += 1
    vis = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], bool)
    for _ in range(3):  # the same tree shape at a new L each time
        steps.append((rng.integers(0, V, 4), L + np.array([0, 1, 2, 1]), L, vis))
        L += 2
    for i, (toks, pos, L0, mask) in enumerate(steps):
        out_g = np.asarray(g.forward(toks, pos, L0, mask))
        out_d = np.asarray(d.forward(toks, pos, L0, mask))
        exp = ref.forward(toks, pos, L0, mask)
        np.testing.assert_array_equal(out_g, out_d, err_msg=f"step {i}")
        assert rel_err(out_g, exp) < 1e-5, (i, rel_err(out_g, exp))
        if mask.shape[0] == 4:  # accept root -> 1 of the tree: compact, as the decode loop does
            for m in (g, d, ref):
                m.compact(L0, [0, 1])
    # captured for the repeated counts (AR 1, the tree 4; a prompt of >= 32 tokens also repeats the
    # prefill chunk of 16), replayed after
    assert {1, 4} <= set(g.graphs.graphs) <= {1, 4, 16}
    assert common.pdl_launches() == common.PDL


@sim_only
def test_cuda_tree_ops_accept_follows_sampled_choices(rng):
    """With temperature > 0 the target's choices are sampled on the host: the device accept must walk
    those (uploaded), not the argmax a previous greedy step left in the device buffer."""
    from kdt.engine.cuda_model import DeviceLogits
    from kdt.reference.ddtree import build_tree, follow_verified_tree

    cm = cuda_model(MICRO, random_weights(MICRO, 1), max_len=40, max_tokens=8)
    ops, V = cm.tree_ops, MICRO.vocab_size
    draft_t = np.stack([rng.choice(V, 3, replace=False) for _ in range(3)]).astype(np.int64)
    draft_lp = -np.sort(rng.exponential(1.0, (3, 3)), axis=1).astype(np.float32)
    root = int(rng.integers(V))
    tree = ops.build(root, draft_t, draft_lp, 6, 5)
    ref = build_tree(root, draft_t, draft_lp, 6)
    assert tree.n == ref.n
    ops.choose(DeviceLogits(cuda.to_device(rng.standard_normal((tree.n, V)).astype(np.float32))), 0.0, rng)
    logits = np.full((tree.n, V), -30.0, np.float32)  # a sampler that must pick the first child's token
    for i in range(ref.n):
        kids = ref.children(i)
        logits[i, ref.tokens[kids[0]] if kids else 0] = 30.0
    choice = ops.choose(logits, 1.0, np.random.default_rng(0))
    accepted, bonus = ops.accept(tree, choice)
    want, want_bonus = follow_verified_tree(ref, choice)
    assert accepted.tolist() == list(want) and bonus == want_bonus and len(accepted) > 1


def test_wait_for_polls_or_blocks():
    """The host's wait for a step (kdt.engine.cuda_step.wait_for): with spin, queries until the event is done and
    never blocks; without, one blocking synchronize; an event without query (the simulator's) blocks."""
    from kdt.engine.cuda_step import wait_for

    class Event:
        def __init__(self, busy):
            self.busy, self.queries, self.syncs = busy, 0, 0

        def query(self):
            self.queries += 1
            return self.queries > self.busy

        def synchronize(self):
            self.syncs += 1

    e = Event(busy=3)
    wait_for(e, spin=True)
    assert (e.queries, e.syncs) == (4, 0)
    e = Event(busy=3)
    wait_for(e, spin=False)
    assert (e.queries, e.syncs) == (0, 1)

    class NoQuery:
        syncs = 0

        def synchronize(self):
            self.syncs += 1

    n = NoQuery()
    wait_for(n, spin=True)
    assert n.syncs == 1


def test_event_query_without_exceptions(monkeypatch):
    """wait_for's poll: cuEventQuery's result code straight from the CUDA binding where the event holds a CUevent;
    any code but "not ready" that is not success goes to numba's query (which raises it); other events: their own
    query."""
    from types import SimpleNamespace

    from kdt.engine import cuda_step

    asked = []
    plain = SimpleNamespace(handle=None, query=lambda: asked.append("plain") or True)
    assert cuda_step._query(plain)() and asked == ["plain"]
    cu = pytest.importorskip("cuda.bindings.driver")
    codes = iter([cu.CUresult.CUDA_SUCCESS,  # (the probe when the query is made)
                  cu.CUresult.CUDA_ERROR_NOT_READY, cu.CUresult.CUDA_SUCCESS, cu.CUresult.CUDA_ERROR_INVALID_HANDLE])
    monkeypatch.setattr(cuda_step, "_cu", SimpleNamespace(CUevent=cu.CUevent, CUresult=cu.CUresult,
                                                          cuEventQuery=lambda h: (next(codes),)))
    q = cuda_step._query(SimpleNamespace(handle=cu.CUevent(), query=lambda: asked.append("numba") or True))
    assert q() is False and q() is True and asked == ["plain"]
    assert q() is True and asked == ["plain", "numba"]

    def refuses(h):
        raise TypeError("not a handle of this binding")

    monkeypatch.setattr(cuda_step._cu, "cuEventQuery", refuses)
    numba_query = SimpleNamespace(handle=cu.CUevent(), query=lambda: True).query
    assert cuda_step._query(SimpleNamespace(handle=cu.CUevent(), query=numba_query)) is numba_query
