"""Parity tests of kdt.kernels.moe against kdt.reference.ops.moe_route and kdt.reference.model.MoE.

Simulator tests use tiny shapes (D 32-36, I 16-20, E 3-16 for the layer; the router also at Kimi /
DeepSeek expert counts). ``gpu`` tests run the Moonlight and Kimi K2 shapes on a real GPU.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from kdt.config import preset
from kdt.kernels import moe, tc
from kdt.kernels.common import bf16_bits_to_f32, f32_to_bf16_bits
from kdt.reference import ops
from kdt.reference.model import Mlp, MoE
from kdt.testing import poisoned, rel_err

PREFIX = "model.layers.1.mlp."
BF16 = np.uint16

# Bounds (fp32 accumulation everywhere):
ROUTE_W_BOUND = 1e-6  # routing weights vs ops.moe_route on the same fp32 logits
LOGITS_BOUND = 1e-5  # router logits vs float64
FP32_BOUND = 1e-5  # layer output, fp32 weights, vs the float64 reference
BF16_BOUND = 1e-5  # layer output, bf16 weights, vs the float64 reference on the bf16-rounded weights
BF16_VS_FP32_BOUND = 1e-2  # ... and vs the reference on the unrounded fp32 weights
ROUTE_MARGIN = 1e-4  # inputs are redrawn until no routing decision is closer than this (float noise)


# ---- helpers --------------------------------------------------------------------------------------
def _cfg(**kw):
    return preset("micro").replace(**kw)


def _bf16_round(a: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(f32_to_bf16_bits(a))


def _mlp_weights(rng, D: int, inter: int):
    g = (rng.standard_normal((inter, D)) / np.sqrt(D)).astype(np.float32)
    u = (rng.standard_normal((inter, D)) / np.sqrt(D)).astype(np.float32)
    d = (rng.standard_normal((D, inter)) / np.sqrt(inter)).astype(np.float32)
    return g, u, d


def _layer_weights(rng, cfg, prefix: str = PREFIX) -> dict[str, np.ndarray]:
    """HF-named random weights of one MoE layer (fp32)."""
    D, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    w = {prefix + "gate.weight": (rng.standard_normal((E, D)) / np.sqrt(D) * 2).astype(np.float32),
         prefix + "gate.e_score_correction_bias": (0.3 * rng.standard_normal(E)).astype(np.float32)}
    mlps = [(f"{prefix}experts.{e}.", I) for e in range(E)]
    if cfg.n_shared_experts:
        mlps.append((prefix + "shared_experts.", I * cfg.n_shared_experts))
    for p, inter in mlps:
        for n, a in zip(("gate", "up", "down"), _mlp_weights(rng, D, inter), strict=True):
            w[f"{p}{n}_proj.weight"] = a
    return w


def _rounded(w: dict[str, np.ndarray], prefix: str = PREFIX) -> dict[str, np.ndarray]:
    """The expert weights bf16-rounded (router gate and bias stay fp32, as on the GPU)."""
    return {n: (a if n.startswith(prefix + "gate.") else _bf16_round(a)) for n, a in w.items()}


def _route_margin(logits: np.ndarray, bias: np.ndarray, cfg) -> float:
    """Smallest gap (float64) at a routing decision: the topk_group-th vs next group score and the
    k-th vs next expert among the kept groups; a float32 rounding difference smaller than this
    cannot change which experts are chosen."""
    s = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    c = s + bias.astype(np.float64)
    M, E = c.shape
    k, G, tg = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
    margin = np.inf
    if G > 1:
        gs = np.sort(c.reshape(M, G, E // G), axis=-1)[..., ::-1][..., :2].sum(-1)
        srt = -np.sort(-gs, axis=-1)
        if tg < G:
            margin = min(margin, float((srt[:, tg - 1] - srt[:, tg]).min()))
        keep = np.argsort(-gs, axis=-1, kind="stable")[:, :tg]
        mask = np.zeros((M, G), dtype=bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        c = np.where(np.repeat(mask, E // G, axis=-1), c, -np.inf)
    srt = -np.sort(-c, axis=-1)
    if k < E:
        gap = srt[:, k - 1] - srt[:, k]
        margin = min(margin, float(gap.min()))
    return margin


def _draw_b(rng, cfg, w, M: int, prefix: str = PREFIX) -> np.ndarray:
    """Activations b[M, D] whose routing has no near-ties (so fp32 vs float64 logits agree)."""
    gate = w[prefix + "gate.weight"].astype(np.float64)
    bias = w[prefix + "gate.e_score_correction_bias"]
    for _ in range(200):
        b = rng.standard_normal((M, cfg.hidden_size)).astype(np.float32)
        if _route_margin(b.astype(np.float64) @ gate.T, bias, cfg) > ROUTE_MARGIN:
            return b
    raise RuntimeError("could not draw inputs with a safe routing margin")


def _group_reference(topk_idx: np.ndarray, E: int):
    """Counting sort by expert, stable in flat (token-major) order."""
    M, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=E)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    pos_of = np.empty(M * k, dtype=np.int64)
    pos_of[order] = np.arange(M * k)
    return counts, offsets, order // k, order % k, pos_of.reshape(M, k), np.nonzero(counts)[0]


def poison_scratch(scratch):
    """The scratch's outputs (logits, routing, the small path's h_all) poisoned; the tickets stay zero."""
    for name in ("logits", "topk_idx", "topk_w", "h_all"):
        a = getattr(scratch, name)
        if a is not None:
            a.copy_to_device(poisoned(a.shape, a.dtype))
    return scratch


def _run_forward(cfg, w, b, dtype, M_max, accumulate, x0=None, version=None, tiles=None, layer=None):
    layer = layer or moe.MoEWeights.from_hf(cfg, w, PREFIX, dtype)
    scratch = poison_scratch(moe.MoEScratch.allocate(cfg, M_max))
    M = b.shape[0]
    out_h = poisoned((M_max, cfg.hidden_size))
    if accumulate:
        out_h[:M] = x0
    d_b = cuda.to_device(np.concatenate([b, np.full((M_max - M, b.shape[1]), np.nan, np.float32)]))
    out = cuda.to_device(out_h)
    moe.moe_forward(d_b, layer, scratch, out, M=M, accumulate=accumulate, version=version, tiles=tiles)
    res = out.copy_to_host()
    assert np.all(np.isnan(res[M:])), "rows past M must not be written"
    return res[:M], scratch


# ---- router ---------------------------------------------------------------------------------------
ROUTER_CASES = [
    # E, k, n_group, topk_group, norm, scale
    (8, 2, 4, 2, True, 2.5),
    (16, 3, 1, 1, False, 1.0),
    (16, 4, 4, 1, True, 1.5),
    (384, 8, 1, 1, True, 2.827),  # Kimi K2
    (256, 8, 8, 4, True, 2.5),  # DeepSeek-V3
]


def _router_check(logits, bias, cfg, M_max=None):
    M, E = logits.shape
    k = cfg.num_experts_per_tok
    M_max = M_max or M
    lg = np.full((M_max, E), np.nan, np.float32)
    lg[:M] = logits
    idx = cuda.to_device(poisoned((M_max, k), np.int32))
    wts = cuda.to_device(poisoned((M_max, k)))
    moe.moe_router(cuda.to_device(lg), cuda.to_device(bias), cfg.n_group, cfg.topk_group, k,
                   cfg.norm_topk_prob, cfg.routed_scaling_factor, idx, wts, M=M)
    ref_idx, ref_w = ops.moe_route(logits, bias, cfg)
    got_idx, got_w = idx.copy_to_host(), wts.copy_to_host()
    np.testing.assert_array_equal(got_idx[:M], ref_idx)
    assert rel_err(got_w[:M], ref_w) < ROUTE_W_BOUND
    assert np.all(got_idx[M:] == -7777) and np.all(np.isnan(got_w[M:])), "rows past M written"


@pytest.mark.kernels
@pytest.mark.parametrize("E,k,n_group,topk_group,norm,scale", ROUTER_CASES)
def test_moe_router_matches_reference(rng, E, k, n_group, topk_group, norm, scale):
    cfg = _cfg(n_routed_experts=E, num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
               norm_topk_prob=norm, routed_scaling_factor=scale)
    M = 5
    logits = (2 * rng.standard_normal((M, E))).astype(np.float32)
    bias = (0.3 * rng.standard_normal(E)).astype(np.float32)
    _router_check(logits, bias, cfg, M_max=7)


@pytest.mark.kernels
@pytest.mark.parametrize("n_group,topk_group", [(4, 2), (1, 1)])
def test_moe_router_ties_follow_stable_order(rng, n_group, topk_group):
    """Exact ties in scores and group scores: lower group / lower expert index first."""
    E, k = 16, 4
    cfg = _cfg(n_routed_experts=E, num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
               norm_topk_prob=True, routed_scaling_factor=1.0)
    logits = rng.integers(-1, 2, size=(6, E)).astype(np.float32)
    logits[0] = 0.0  # all tied
    bias = np.zeros(E, np.float32)
    _router_check(logits, bias, cfg)


@pytest.mark.kernels
@pytest.mark.parametrize("E", [7, 16])
def test_router_logits(rng, E):
    M, D = 5, 32
    b = rng.standard_normal((M, D)).astype(np.float32)
    gate = rng.standard_normal((E, D)).astype(np.float32)
    out = cuda.to_device(poisoned((M, E)))
    moe.router_logits(cuda.to_device(b), cuda.to_device(gate), out)
    ref = ops.linear(b.astype(np.float64), gate.astype(np.float64))
    assert rel_err(out.copy_to_host(), ref) < LOGITS_BOUND


# ---- grouping -------------------------------------------------------------------------------------
def _check_group(topk_idx: np.ndarray, E: int, M_max: int):
    M, k = topk_idx.shape
    P_max = M_max * k
    ti = np.full((M_max, k), -1, np.int32)
    ti[:M] = topk_idx
    bufs = dict(counts=poisoned(E, np.int32), offsets=poisoned(E + 1, np.int32),
                sorted_rows=poisoned(P_max, np.int32), sorted_slot=poisoned(P_max, np.int32),
                pos_of=poisoned((M_max, k), np.int32), active=poisoned(E, np.int32),
                n_active=poisoned(1, np.int32))
    d = {n: cuda.to_device(a) for n, a in bufs.items()}
    moe.moe_group(cuda.to_device(ti), E, d["counts"], d["offsets"], d["sorted_rows"], d["sorted_slot"],
                  d["pos_of"], d["active"], d["n_active"], M=M)
    got = {n: a.copy_to_host() for n, a in d.items()}
    counts, offsets, rows, slots, pos_of, active = _group_reference(topk_idx, E)
    P = M * k
    np.testing.assert_array_equal(got["counts"], counts)
    np.testing.assert_array_equal(got["offsets"], offsets)
    np.testing.assert_array_equal(got["sorted_rows"][:P], rows)
    np.testing.assert_array_equal(got["sorted_slot"][:P], slots)
    np.testing.assert_array_equal(got["pos_of"][:M], pos_of)
    assert got["n_active"][0] == len(active)
    np.testing.assert_array_equal(got["active"][: len(active)], active)
    assert np.all(got["sorted_rows"][P:] == -7777) and np.all(got["pos_of"][M:] == -7777)


@pytest.mark.kernels
@pytest.mark.parametrize("M,M_max,E,k,skew",
                         [(6, 8, 8, 3, False), (5, 5, 4, 2, True), (150, 150, 384, 8, False)])
def test_moe_group(rng, M, M_max, E, k, skew):
    if skew:  # every token picks from the first k+1 experts: empty experts, long runs
        topk_idx = np.stack([rng.permutation(k + 1)[:k] for _ in range(M)])
    else:
        topk_idx = np.stack([rng.permutation(E)[:k] for _ in range(M)])
    _check_group(topk_idx.astype(np.int32), E, M_max)


# ---- expert GEMMs ---------------------------------------------------------------------------------
@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_expert_gemms_multi_tile(rng, dtype):
    """One expert with more tokens than a register tile, row counts that leave partial warps/blocks,
    plus the dense (shared-expert) path with M > tile, accumulating."""
    M, D, I, E, k = 12, 36, 20, 3, 2
    experts = [_mlp_weights(rng, D, I) for _ in range(E)]
    if dtype == BF16:
        experts = [tuple(_bf16_round(a) for a in ex) for ex in experts]
    topk_idx = np.stack([np.ones(M, np.int32), rng.choice([0, 2], size=M).astype(np.int32)], axis=1)
    counts, offsets, rows, slots, pos_of, active = _group_reference(topk_idx, E)
    P = M * k
    x = rng.standard_normal((M, D)).astype(np.float32)
    gu, dn = moe.pack_experts(experts, dtype)
    h = cuda.to_device(poisoned((P, I)))
    y = cuda.to_device(poisoned((P, D)))
    act = np.zeros(E, np.int32)
    act[: len(active)] = active
    args = dict(active=cuda.to_device(act), n_active=cuda.to_device(np.array([len(active)], np.int32)),
                offsets=cuda.to_device(offsets.astype(np.int32)))
    moe.expert_gate_up(cuda.to_device(x), cuda.to_device(gu), h,
                       sorted_rows=cuda.to_device(rows.astype(np.int32)), n_rows=P, **args)
    moe.expert_down(h, cuda.to_device(dn), y, n_rows=P, **args)
    e_of = topk_idx.reshape(-1)[np.argsort(topk_idx.reshape(-1), kind="stable")]
    x64 = x.astype(np.float64)
    h_ref = np.stack([ops.silu(x64[r] @ experts[e][0].T.astype(np.float64)) * (x64[r] @ experts[e][1].T)
                      for r, e in zip(rows, e_of, strict=True)])
    h_got = h.copy_to_host()
    assert rel_err(h_got, h_ref) < FP32_BOUND
    y_ref = np.stack([h_got[p].astype(np.float64) @ experts[e][2].T for p, e in enumerate(e_of)])
    assert rel_err(y.copy_to_host(), y_ref) < FP32_BOUND
    # dense path: shared expert of width 20 over all 12 tokens, accumulated onto x0
    x0 = rng.standard_normal((M, D)).astype(np.float32)
    for version in (1, 2):  # the grouped-GEMM kernels in dense mode; linear + silu_mul + linear (or linear(glu=))
        _check_dense_mlp(x, x0, experts[0], dtype, version)


@pytest.mark.kernels
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("fused", [True, False])
def test_dense_mlp_norm_in_place(rng, monkeypatch, version, fused):
    """dense_mlp(x, .., out=x, norm=(gw, eps, a)): x += mlp(rmsnorm(x; gw, eps)), in place as the engine's
    dense layers run it; the norm fused into gate_up's linear (KDT_LINEAR_FUSE_NORM) and silu * up into down's
    (KDT_LINEAR_FUSE_GLU: 2 launches), or both written to scratch first (4 launches)."""
    from kdt.kernels import linear as lin

    monkeypatch.setattr(lin, "FUSE_NORM", fused)
    monkeypatch.setattr(lin, "FUSE_GLU", fused)
    M, D, I = 5, 36, 20
    weights = _mlp_weights(rng, D, I)
    x = (rng.standard_normal((M, D)) * 3).astype(np.float32)
    gw = (1 + 0.2 * rng.standard_normal(D)).astype(np.float32)
    gu, dn = moe.pack_experts([weights], np.float32)
    d_x, h = cuda.to_device(x), cuda.to_device(poisoned((M, moe.dense_mlp_scratch_cols(I))))
    moe.dense_mlp(d_x, cuda.to_device(gu), cuda.to_device(dn), h, d_x, accumulate=True, version=version,
                  norm=(cuda.to_device(gw), 1e-6, cuda.to_device(poisoned((M, D)))))
    x64 = x.astype(np.float64)
    ref = x64 + ops.mlp(ops.rmsnorm(x64, gw, 1e-6), *(w.astype(np.float64) for w in weights))
    assert rel_err(d_x.copy_to_host(), ref) < FP32_BOUND


def _check_dense_mlp(x, x0, weights, dtype, version):
    """moe.dense_mlp(x) of one MLP (gate, up, down: already rounded to dtype's precision) accumulated onto
    x0, scratch poisoned, against the float64 reference on the same weights."""
    g = weights[0]
    sgu, sdn = moe.pack_experts([weights], dtype)
    out = cuda.to_device(x0)
    moe.dense_mlp(cuda.to_device(x), cuda.to_device(sgu), cuda.to_device(sdn),
                  cuda.to_device(poisoned((x.shape[0], moe.dense_mlp_scratch_cols(g.shape[0])))), out,
                  accumulate=True, version=version)
    ref = x0 + ops.mlp(x.astype(np.float64), *(w.astype(np.float64) for w in weights))
    assert rel_err(out.copy_to_host(), ref) < FP32_BOUND, f"dense_mlp version {version}"


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("D,I", [(256, 768), (256, 1024), (2048, 11264)])
@pytest.mark.parametrize("M", [1, 17, 32])
def test_dense_mlp_gpu(rng, M, D, I, version):
    """The dense MLP at the engine's shapes (fixtures/model_code.h5's layer 0 and its drafter's MLP, a
    Moonlight-sized dense layer), bf16 weights, both versions, accumulating onto the residual."""
    weights = tuple(_bf16_round(a) for a in _mlp_weights(rng, D, I))
    x = rng.standard_normal((M, D)).astype(np.float32)
    x0 = rng.standard_normal((M, D)).astype(np.float32)
    _check_dense_mlp(x, x0, weights, BF16, version)


# ---- the whole layer ------------------------------------------------------------------------------
FORWARD_CASES = [
    # cfg overrides, dtype, M, accumulate
    ({}, np.float32, 1, False),
    ({}, np.float32, 5, True),
    ({}, BF16, 1, True),
    ({}, BF16, 5, False),
    (dict(n_routed_experts=8, n_group=1, topk_group=1, n_shared_experts=2, norm_topk_prob=False,
          routed_scaling_factor=1.0), np.float32, 5, True),
    (dict(n_routed_experts=8, n_group=4, topk_group=2, n_shared_experts=0), BF16, 5, True),
]


@pytest.mark.kernels
@pytest.mark.parametrize("version", [1, 2, 3])
@pytest.mark.parametrize("overrides,dtype,M,accumulate", FORWARD_CASES)
def test_moe_forward_matches_reference(rng, overrides, dtype, M, accumulate, version):
    cfg = _cfg(**overrides)
    w = _layer_weights(rng, cfg)
    b = _draw_b(rng, cfg, w, M)
    x0 = rng.standard_normal((M, cfg.hidden_size)).astype(np.float32) if accumulate else None
    got, scratch = _run_forward(cfg, w, b, dtype, M_max=M + 1, accumulate=accumulate, x0=x0, version=version)
    if version == 3:
        _check_small_state(cfg, b, w if dtype == np.float32 else _rounded(w), scratch, M)
    b64 = b.astype(np.float64)
    base = x0.astype(np.float64) if accumulate else 0.0
    if dtype == np.float32:
        assert rel_err(got, base + MoE(cfg, w, PREFIX, np.float64)(b64)) < FP32_BOUND
    else:
        assert rel_err(got, base + MoE(cfg, _rounded(w), PREFIX, np.float64)(b64)) < BF16_BOUND
        assert rel_err(got, base + MoE(cfg, w, PREFIX, np.float64)(b64)) < BF16_VS_FP32_BOUND


TEE_CASES = [
    # cfg overrides, M, accumulate
    ({}, 1, False),
    (dict(n_shared_experts=0), 1, True),
    ({}, 5, True),
    (dict(n_shared_experts=0), 5, False),
]


@pytest.mark.kernels
@pytest.mark.parametrize("version", ["1", "2", "2-fallback", "3"])
@pytest.mark.parametrize("overrides,M,accumulate", TEE_CASES)
def test_moe_forward_tee(rng, monkeypatch, overrides, M, accumulate, version):
    """moe_forward(..., tee=) leaves tee[:M] == out[:M] bit for bit (version 2: kernel C's combine;
    version 1 and version 2's fallback past V2_MAX_PAIRS: a copy launch; the small path: S2's stores),
    tee's rows past M untouched (NaN), and out bit-identical to the same call without tee."""
    if version == "2-fallback":
        monkeypatch.setattr(moe, "V2_MAX_PAIRS", 0)
    cfg = _cfg(**overrides)
    w = _layer_weights(rng, cfg)
    D, M_max = cfg.hidden_size, M + 2
    layer = moe.MoEWeights.from_hf(cfg, w, PREFIX, BF16)
    d_b = cuda.to_device(np.concatenate([_draw_b(rng, cfg, w, M), poisoned((M_max - M, D))]))
    x0 = rng.standard_normal((M, D)).astype(np.float32)

    def run(tee):  # -> out[M_max, D] on the host
        out_h = poisoned((M_max, D))
        if accumulate:
            out_h[:M] = x0
        out = cuda.to_device(out_h)
        moe.moe_forward(d_b, layer, moe.MoEScratch.allocate(cfg, M_max), out, M=M, accumulate=accumulate,
                        version=int(version[0]), tee=tee)
        return out.copy_to_host()

    want = run(None)
    d_tee = cuda.to_device(poisoned((M_max, D)))
    got = run(d_tee)
    tee = d_tee.copy_to_host()
    assert not np.isnan(got[:M]).any() and np.all(np.isnan(got[M:]))
    assert np.array_equal(got[:M], want[:M]), "out must not change with a tee"
    assert np.array_equal(tee[:M], got[:M]), "tee[:M] must be out[:M] bit for bit"
    assert np.all(np.isnan(tee[M:])), "tee rows past M must not be written"


# ---- the small-layer path (two launches) --------------------------------------------------------------
def _check_small_state(cfg, b, w, scratch, M):
    """Routing left in the scratch by a small-path forward (``_check_routing``); every expert's gate_up rows
    h_all[e * Mh + m] vs float64 on the weights ``w`` as the kernel holds them (bf16-rounded for bf16). The
    caller poisoned the scratch (``poison_scratch``)."""
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    _check_routing(cfg, b, w, scratch, M)
    Mh = scratch.h_all.shape[0] // E
    h = scratch.h_all.copy_to_host().reshape(E, Mh, I)[:, :M]
    for e in range(E):
        g, u = (w[f"{PREFIX}experts.{e}.{n}_proj.weight"].astype(np.float64) for n in ("gate", "up"))
        gb, ub = b.astype(np.float64) @ g.T, b.astype(np.float64) @ u.T
        assert rel_err(h[e], gb / (1 + np.exp(-gb)) * ub) < FP32_BOUND


@pytest.mark.kernels
@pytest.mark.parametrize("overrides", [
    dict(hidden_size=72, n_routed_experts=8, n_group=2, topk_group=1),  # P = 4: the 8-wide loop twice, then a tail
    dict(hidden_size=40, n_routed_experts=48, n_group=1, topk_group=1),  # P = 1: two passes over the experts
])
def test_small_route_logits(rng, overrides):
    """S1's route warps sum all E logits in one pass over D (P lanes per expert, 8 products in flight):
    shapes where that loop runs whole, leaves a tail, and needs two passes; the layer vs float64 and the
    routing and gate_up rows left in a poisoned scratch."""
    cfg = _cfg(**overrides)
    w = _layer_weights(rng, cfg)
    b = _draw_b(rng, cfg, w, 3)
    got, scratch = _run_forward(cfg, w, b, np.float32, M_max=4, accumulate=False, version=3)
    _check_small_state(cfg, b, w, scratch, 3)
    assert rel_err(got, MoE(cfg, w, PREFIX, np.float64)(b.astype(np.float64))) < FP32_BOUND


def test_small_path_dispatch(rng):
    """The default runs the small path for a small layer at M <= SMALL_MAX_M (its scratch holds h_all; the
    grouping buffers stay untouched), version 2 past it (the scratch's h_all holds SMALL_MAX_M tokens);
    KDT_MOE_SMALL's switch (moe.SMALL) turns it off."""
    cfg = _cfg()
    assert moe.small_layer(cfg) and not moe.small_layer(preset("moonlight-16b-a3b"))
    w = _layer_weights(rng, cfg)
    b = _draw_b(rng, cfg, w, 3)
    layer = moe.MoEWeights.from_hf(cfg, w, PREFIX, BF16)
    for small in (True, False):
        scratch = moe.MoEScratch.allocate(cfg, 4)
        scratch.sorted_rows.copy_to_device(poisoned(scratch.sorted_rows.shape[0], np.int32))
        old, moe.SMALL = moe.SMALL, small
        try:
            moe.moe_forward(cuda.to_device(b), layer, scratch, cuda.to_device(np.zeros((3, cfg.hidden_size),
                                                                                      np.float32)), accumulate=False)
        finally:
            moe.SMALL = old
        rows = scratch.sorted_rows.copy_to_host()[: 3 * cfg.num_experts_per_tok]
        assert (rows == -7777).all() if small else (rows >= 0).all()
    big = moe.MoEScratch.allocate(cfg, 64)
    assert big.h_all.shape == (cfg.n_routed_experts * moe.SMALL_MAX_M, cfg.moe_intermediate_size)
    n = moe.SMALL_MAX_M
    assert moe._small_supported(layer, big, n) and not moe._small_supported(layer, big, n + 1)


# ---- version 2 (three launches) --------------------------------------------------------------------
def _check_routing(cfg, b, w, scratch, M) -> np.ndarray:
    """Routing left in the scratch vs the references: logits vs float64, topk vs ops.moe_route on the
    kernel's own fp32 logits. Returns topk_idx[:M]."""
    logits = scratch.logits.copy_to_host()[:M]
    gate = w[PREFIX + "gate.weight"].astype(np.float64)
    assert rel_err(logits, b.astype(np.float64) @ gate.T) < LOGITS_BOUND
    ref_idx, ref_w = ops.moe_route(logits, w[PREFIX + "gate.e_score_correction_bias"], cfg)
    idx = scratch.topk_idx.copy_to_host()[:M]
    np.testing.assert_array_equal(idx, ref_idx)
    assert rel_err(scratch.topk_w.copy_to_host()[:M], ref_w) < ROUTE_W_BOUND
    return idx


def _check_v2_state(cfg, b, w, scratch, M):
    """Routing (``_check_routing``) and grouping left in the scratch by a version-2 forward: the grouping vs
    _group_reference, and the tickets back to 0."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    idx = _check_routing(cfg, b, w, scratch, M)
    counts, offsets, rows, slots, pos_of, active = _group_reference(idx, E)
    P = M * k
    np.testing.assert_array_equal(scratch.counts.copy_to_host(), counts)
    np.testing.assert_array_equal(scratch.offsets.copy_to_host(), offsets)
    np.testing.assert_array_equal(scratch.sorted_rows.copy_to_host()[:P], rows)
    np.testing.assert_array_equal(scratch.sorted_slot.copy_to_host()[:P], slots)
    np.testing.assert_array_equal(scratch.pos_of.copy_to_host()[:M], pos_of)
    assert scratch.n_active.copy_to_host()[0] == len(active)
    np.testing.assert_array_equal(scratch.active.copy_to_host()[: len(active)], active)
    assert not scratch.counter.copy_to_host().any() and not scratch.tickets.copy_to_host().any()
    assert not scratch.sync.copy_to_host().any(), "kernel AB must leave its tickets and flags at zero"


# simulator launch shapes beside the default one: odd tiles (1-warp blocks, 1-2 rows per warp, 3-token
# tiles, 3 words in flight, 5 experts per down block, no streaming hint) so that every partial-tile
# and partial-word path runs, a wide one (4-warp blocks, 8 rows per warp), one with kernel B's blocks reordered
V2_SIM_TILES = {
    "default": None,
    "odd": moe.V2Tiles(nw=1, nr=2, u=1, tt=1, tt_s=3, u_l=1, nw_c=1, nr_c=2, tt_c=3, u_c=3, jc=1, cs=False,
                       cs_s=False),
    "wide": moe.V2Tiles(nw=4, nr=8, u=3, tt=3, tt_s=1, u_l=3, nw_c=3, nr_c=1, tt_c=1, u_c=1, jc=5, cs=True,
                        cs_s=True),
    # kernel B's shared-down blocks first in its grid
    "sdf": moe.V2Tiles(nw=2, nr=2, u=3, tt=2, tt_s=3, u_l=1, nw_c=1, nr_c=2, tt_c=3, u_c=3, jc=2, cs=False,
                       cs_s=True, sd_first=True),
    # kernel A's last logits block routes all M tokens (no token tiles)
    "one_router": moe.V2Tiles(nw=2, nr=4, u=2, tt=2, tt_s=2, u_l=2, nw_c=2, nr_c=2, tt_c=2, u_c=2, jc=2, cs_s=False,
                              rt=False),
    # kernels A and B in one launch (kernel AB) at M > 1: B's shared-down role blocks first / last
    "ab_sdf": moe.V2Tiles(nw=2, nr=2, u=3, tt=2, tt_s=3, u_l=1, nw_c=1, nr_c=2, tt_c=3, u_c=3, jc=2, cs=False,
                          cs_s=True, sd_first=True, ab=True),
    "ab_shared_last": moe.V2Tiles(nw=2, nr=4, u=2, tt=2, tt_s=2, u_l=2, nw_c=2, nr_c=2, tt_c=2, u_c=2, jc=2,
                                  cs_s=False, ab=True),
    # tensor cores (bf16): kernel A's shared gate_up, kernel B and kernel C on the mma tiles, one / two 8-token
    # tiles a pass, kernel C 2 / 3 warps splitting the input dimension (the last warps' groups partly or all past
    # it), 2 / 1 row tiles in the down projections
    "tc": moe.V2Tiles(nw=2, nr=4, u=2, tt=2, tt_s=2, u_l=2, nw_c=2, nr_c=2, tt_c=2, u_c=2, jc=2, tc=1, tc_rt=2),
    "tc2": moe.V2Tiles(nw=2, nr=2, u=1, tt=2, tt_s=3, u_l=1, nw_c=3, nr_c=2, tt_c=3, u_c=3, jc=1, cs=False, tc=2,
                       tc_rt=1),
    # ... with the shared experts' GEMMs one 8-token pass a block (the last pass partial)
    "tc_split": moe.V2Tiles(nw=2, nr=4, u=2, tt=2, tt_s=2, u_l=2, nw_c=2, nr_c=2, tt_c=2, u_c=2, jc=2, tc=1,
                            tc_rt=1, tc_split=True),
}
# ... with the GEMM inputs in the hi / lo layout (kernel A writes b_perm and h_shared, B writes h: tc_hilo)
V2_SIM_TILES.update({f"{name}_hilo": replace(V2_SIM_TILES[name], tc_hilo=True) for name in ("tc", "tc2", "tc_split")})
# ... with the routed GEMMs' warps in row groups (tc_kw): each warp its own rows over all of K (kernel B: 2 groups of 16
# outputs, past I = 12 in part and wholly; kernel C: 2 / 3 groups)
V2_SIM_TILES.update(tc_kw1=replace(V2_SIM_TILES["tc"], tc_kw=1), tc2_kw1=replace(V2_SIM_TILES["tc2"], tc_kw=1),
                    tc2_kw1_hilo=replace(V2_SIM_TILES["tc2"], tc_kw=1, tc_hilo=True))
# ... with the routed GEMMs' loads staged through shared memory (tc_st; their x hi / lo, D and I multiples of 8)
V2_SIM_TILES.update(tc_st2=replace(V2_SIM_TILES["tc_hilo"], tc_st=2),
                    tc2_st3=replace(V2_SIM_TILES["tc2_hilo"], tc_st=3))
# ... with kernel B's routed gate_up on 2 output tiles a warp (tc_ot): the second tile past I = 12 wholly; in row
# groups (I = 40: the second group's second tile past I); staged
V2_SIM_TILES.update(tc_ot2=replace(V2_SIM_TILES["tc"], tc_ot=2),
                    tc2_ot2_kw1_hilo=replace(V2_SIM_TILES["tc2"], tc_ot=2, tc_kw=1, tc_hilo=True),
                    tc_ot2_st2=replace(V2_SIM_TILES["tc_hilo"], tc_ot=2, tc_st=2))
# ... with a short pass on fewer token tiles (tc_fit): 2 tiles a pass, and 4 with the shared GEMMs one pass a block
V2_SIM_TILES.update(tc2_fit=replace(V2_SIM_TILES["tc2"], tc_fit=True),
                    tc4_split_fit=replace(V2_SIM_TILES["tc_split"], tc=4, tc_rt=2, tc_fit=True))
# ... with kernel C's combine keeping 3 outputs a thread in flight, a token's 4 slots compiled in (kc; D = 20 < R = 32:
# rows past D clamped; 17 x 32 outputs over 64 threads x 3: the last group partly past them); 2 outputs a thread with
# the loop over the slots, on the FMA tiles (17 x 4 outputs over 64 threads x 2) and on tensor cores (11 x 16 over 96
# x 2, the last row tile partly past D = 36)
# (and kernel C's ticket fenced by thread 0 alone, c_fence1)
V2_SIM_TILES.update(tc_cmb3_kc=replace(V2_SIM_TILES["tc"], cmb=3, kc=4, c_fence1=True),
                    tc2_cmb2=replace(V2_SIM_TILES["tc2"], cmb=2),
                    cmb2=moe.V2Tiles(nw=2, nr=4, u=2, tt=2, tt_s=2, u_l=2, nw_c=2, nr_c=2, tt_c=2, u_c=2, jc=2,
                                     cs_s=False, cmb=2))
_V2_GROUPED = dict(n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                   moe_intermediate_size=12, hidden_size=20)
_V2_SKEW = dict(n_routed_experts=7, num_experts_per_tok=3, n_group=1, topk_group=1, n_shared_experts=2,
                norm_topk_prob=False, routed_scaling_factor=1.0, moe_intermediate_size=12, hidden_size=20)
_V2_DECODE = dict(n_routed_experts=16, num_experts_per_tok=6, n_group=1, topk_group=1, n_shared_experts=0)
V2_CASES = [
    # cfg overrides, dtype, M, accumulate, skew (bias pushes every token onto experts 0..k), tiles.
    # M * k > threads of the routing block (64 default, 32 odd): the grouping runs several chunks.
    (_V2_GROUPED, BF16, 17, True, False, "default"),
    (_V2_SKEW, np.float32, 11, False, True, "default"),
    (_V2_SKEW, np.float32, 11, False, True, "odd"),
    (_V2_DECODE, BF16, 1, True, False, "default"),
    (_V2_DECODE, BF16, 1, True, False, "wide"),
    (_V2_GROUPED, np.float32, 2, False, False, "wide"),
    (_V2_SKEW, np.float32, 11, True, True, "sdf"),
    (_V2_GROUPED, BF16, 9, False, False, "one_router"),
    # kernel AB: the default at M = 1 (with a shared expert; _V2_DECODE above has none), and at M > 1 with
    # several token tiles (the grouping block is the last tile's router) and B's shared-down blocks either side
    (_V2_GROUPED, BF16, 1, True, False, "default"),
    (_V2_SKEW, np.float32, 11, True, True, "ab_sdf"),
    (_V2_GROUPED, BF16, 5, False, False, "ab_shared_last"),
    # tensor cores: experts with more tokens than a pass (skew), E 7 / 8, D 20 (5 weight words: partial groups)
    (_V2_GROUPED, BF16, 17, True, False, "tc"),
    (dict(_V2_SKEW, hidden_size=36), BF16, 11, False, True, "tc2"),
    (dict(_V2_SKEW, hidden_size=36), BF16, 17, True, False, "tc_split"),  # 2 shared experts: Is = 24, 3 passes
    (_V2_GROUPED, BF16, 17, True, False, "tc_hilo"),
    (dict(_V2_SKEW, hidden_size=36), BF16, 11, False, True, "tc2_hilo"),
    (dict(_V2_SKEW, hidden_size=36), BF16, 17, True, False, "tc_split_hilo"),
    (_V2_GROUPED, BF16, 17, True, False, "tc_kw1"),
    (dict(_V2_SKEW, hidden_size=36), BF16, 11, False, True, "tc2_kw1"),
    (dict(_V2_SKEW, hidden_size=36), BF16, 11, False, True, "tc2_kw1_hilo"),
    # staged loads: D = 40, I = 24 / 16 (10, 6 / 4 words: kernel C's third warp wholly past I); D = 36: dropped
    (dict(_V2_GROUPED, hidden_size=40, moe_intermediate_size=24), BF16, 17, True, False, "tc_st2"),
    (dict(_V2_SKEW, hidden_size=40, moe_intermediate_size=16), BF16, 11, False, True, "tc2_st3"),
    (dict(_V2_SKEW, hidden_size=36), BF16, 11, False, True, "tc2_st3"),
    (_V2_GROUPED, BF16, 17, True, False, "tc_ot2"),
    (dict(_V2_SKEW, hidden_size=36, moe_intermediate_size=40), BF16, 11, False, True, "tc2_ot2_kw1_hilo"),
    (dict(_V2_GROUPED, hidden_size=40, moe_intermediate_size=24), BF16, 17, True, False, "tc_ot2_st2"),
    (_V2_GROUPED, BF16, 17, True, False, "tc_cmb3_kc"),
    (_V2_GROUPED, np.float32, 17, True, False, "cmb2"),
    (dict(_V2_SKEW, hidden_size=36), BF16, 11, False, True, "tc2_cmb2"),
]


@pytest.mark.kernels
@pytest.mark.parametrize("overrides,dtype,M,accumulate,skew,tiles", V2_CASES)
def test_moe_forward_v2(rng, overrides, dtype, M, accumulate, skew, tiles):
    """Version 2 against the float64 layer, its routing / grouping state against the references
    (more pairs than threads of the routing block, experts with more tokens than a tile when skewed,
    odd E, D and I with partial tiles). With the default tiles a second forward on the same scratch
    must give a bit-identical output (tickets reset, nothing order-dependent)."""
    cfg = _cfg(**overrides)
    w = _layer_weights(rng, cfg)
    if skew:
        w[PREFIX + "gate.e_score_correction_bias"][: cfg.num_experts_per_tok + 1] += 3.0
    b = _draw_b(rng, cfg, w, M)
    x0 = rng.standard_normal((M, cfg.hidden_size)).astype(np.float32) if accumulate else None
    layer = moe.MoEWeights.from_hf(cfg, w, PREFIX, dtype)
    run = dict(M_max=M + 2, accumulate=accumulate, x0=x0, version=2, tiles=V2_SIM_TILES[tiles], layer=layer)
    got, scratch = _run_forward(cfg, w, b, dtype, **run)
    base = x0.astype(np.float64) if accumulate else 0.0
    ref_w = w if dtype == np.float32 else _rounded(w)
    bound = FP32_BOUND if dtype == np.float32 else BF16_BOUND
    assert rel_err(got, base + MoE(cfg, ref_w, PREFIX, np.float64)(b.astype(np.float64))) < bound
    _check_v2_state(cfg, b, w, scratch, M)
    if skew:
        assert scratch.counts.copy_to_host().max() > 2 * max(2, (V2_SIM_TILES[tiles] or moe.v2_tiles(M, 3)).tt)
    if tiles == "default":
        again, _ = _run_forward(cfg, w, b, dtype, **run)
        np.testing.assert_array_equal(again, got)


def _same_bits_switched(cfg, w, b, M, layer, tiles, switch: str, tag: str):
    """Kernels B and C of ``tiles`` (bf16, tensor cores) take the switch (``tag`` in their names), the layer with the
    V2Tiles field ``switch`` on gives the bits of it off, and is within BF16_BOUND of float64; returns the scratch."""
    scratch = moe.MoEScratch.allocate(cfg, M)
    names = [ln.kernel.py_func.__name__ for ln in moe.v2_launches(None, layer, scratch, None, M, False, tiles)]
    assert tag in names[1] and tag in names[2], names
    outs = []
    for t in (tiles, replace(tiles, **{switch: False})):
        got, scratch = _run_forward(cfg, w, b, BF16, M_max=M, accumulate=False, tiles=t, layer=layer, version=2)
        outs.append(got)
    np.testing.assert_array_equal(outs[0], outs[1])
    assert rel_err(outs[0], MoE(cfg, _rounded(w), PREFIX, np.float64)(b.astype(np.float64))) < BF16_BOUND
    return scratch


@pytest.mark.kernels
@pytest.mark.parametrize("M,k,tiles", [(11, 3, "tc2_fit"), (41, 2, "tc4_split_fit")])
def test_moe_forward_fit_same_bits(rng, M, k, tiles):
    """tc_fit: kernel B's and C's passes of at most 8 (16) tokens on 1 (2) token tiles give the bits of the full
    passes (a token column's sums are its own), and the layer against float64. Every token takes expert 0 (its
    bias), so passes of each size run: 2 tiles, M = 11: expert 0's 11 tokens on both tiles, the other k - 1 picks
    of a token over 6 experts leave one with <= 8 (on one); 4 tiles, M = 41: expert 0 and the shared GEMMs in a
    pass of 32 (4 tiles) and one of 9 (2), the other pick of a token over 6 experts leaves one with <= 6 (1)."""
    cfg = _cfg(**dict(_V2_SKEW, hidden_size=36, num_experts_per_tok=k))
    w = _layer_weights(rng, cfg)
    w[PREFIX + "gate.e_score_correction_bias"][0] += 3.0
    b = _draw_b(rng, cfg, w, M)
    layer = moe.MoEWeights.from_hf(cfg, w, PREFIX, BF16)
    scratch = _same_bits_switched(cfg, w, b, M, layer, V2_SIM_TILES[tiles], "tc_fit", "_fit")
    counts = scratch.counts.copy_to_host()
    assert counts[0] == M and 0 < counts[counts > 0].min() <= 8, counts


@pytest.mark.kernels
@pytest.mark.parametrize("M,D,I,tiles", [(17, 32, 16, "tc_hilo"), (11, 48, 16, "tc2_kw1_hilo"),
                                         (41, 32, 32, "tc4_split_fit"), (1, 32, 16, "tc2_fit")])
def test_moe_forward_fragment_order_same_bits(rng, M, D, I, tiles):
    """tc_fo: kernels B's routed gate_up and C's routed down read the layer's fragment-ordered copy of the experts
    (kdt.kernels.tc.to_fo) and give the bits of the natural order, and the layer against float64. Every token takes
    expert 0 (its bias): passes of every size run; one token (s43a's tensor cores at the FMA tiles' M).
    tc2_kw1_hilo: kernel B's second row group of 16 outputs wholly past I = 16, kernel C's third past D = 48 (their
    clamped rows read a real tile). I = 12: no copy, the launches drop tc_fo."""
    cfg = _cfg(**dict(_V2_SKEW, hidden_size=D, moe_intermediate_size=I, num_experts_per_tok=2))
    w = _layer_weights(rng, cfg)
    w[PREFIX + "gate.e_score_correction_bias"][0] += 3.0
    b = _draw_b(rng, cfg, w, M)
    layer = moe.MoEWeights.from_hf(cfg, w, PREFIX, BF16)
    assert layer.fragment_order()
    fo = replace(V2_SIM_TILES[tiles], tc_fo=True, tc_hilo=True)
    scratch = _same_bits_switched(cfg, w, b, M, layer, fo, "tc_fo", "_fo")
    assert scratch.counts.copy_to_host()[0] == M
    small = _cfg(**dict(_V2_SKEW, hidden_size=D, moe_intermediate_size=12))
    layer = moe.MoEWeights.from_hf(small, _layer_weights(rng, small), PREFIX, BF16)
    assert not layer.fragment_order()
    launches = moe.v2_launches(None, layer, moe.MoEScratch.allocate(small, M), None, M, False, fo)
    assert not any("fo" in ln.kernel.py_func.__name__.split("_") for ln in launches)


@pytest.mark.kernels
@pytest.mark.parametrize("M,tiles", [(17, "tc_split_hilo"), (11, "tc2_kw1_hilo")])
def test_moe_forward_shared_fo_b_hl_same_bits(rng, M, tiles):
    """The shared experts in fragment order (V2Tiles.s_fo: kernel B's shared down; kernel A's shared gate_up where b
    arrives as hi / lo too, moe_forward(..., b_hl), V2Tiles.xh): the kernels that take them, the layer's bits those of
    the natural order with float32 b, and against float64. With b_hl kernel A writes no b_perm (left as poisoned),
    and kernel B reads b_hl: a b_hl of the wrong bits moves the output. reads_b_hilo: where the plan is hi / lo."""
    cfg = _cfg(**dict(_V2_SKEW, hidden_size=32, moe_intermediate_size=16))  # Is = 32: two tiles of 16
    w = _layer_weights(rng, cfg)
    w[PREFIX + "gate.e_score_correction_bias"][0] += 3.0
    b = _draw_b(rng, cfg, w, M)
    layer = moe.MoEWeights.from_hf(cfg, w, PREFIX, BF16)
    assert layer.fragment_order() and layer._sgu_fo is not None
    fo = replace(V2_SIM_TILES[tiles], tc_fo=True, tc_hilo=True, s_fo=True)
    d_hl = cuda.to_device(tc.hilo_np(b))
    scratch = moe.MoEScratch.allocate(cfg, M)
    names = [ln.kernel.py_func.__name__ for ln in moe.v2_launches(None, layer, scratch, None, M, False, fo, b_hl=d_hl)]
    assert names[0].endswith("_xh_sfo") and names[1].endswith("_sfo"), names
    names = [ln.kernel.py_func.__name__ for ln in moe.v2_launches(None, layer, scratch, None, M, False, fo)]
    assert "_xh" not in names[0] and "_sfo" not in names[0] and names[1].endswith("_sfo"), names

    def run(t, b_hl=None):
        scratch = poison_scratch(moe.MoEScratch.allocate(cfg, M))
        bp = scratch.view("b_perm", np.uint16)
        bp.copy_to_device(np.full(bp.shape, 0xFFFF, np.uint16))
        out = cuda.to_device(poisoned((M, cfg.hidden_size)))
        moe.moe_forward(cuda.to_device(b), layer, scratch, out, M=M, accumulate=False, version=2, tiles=t, b_hl=b_hl)
        return out.copy_to_host(), bp.copy_to_host()

    natural = replace(fo, tc_fo=False, s_fo=False)
    want, bp = run(natural)
    assert not (bp[:M] == 0xFFFF).all()  # (kernel A wrote b_perm)
    for t, b_hl in ((fo, d_hl), (fo, None)):
        got, bp = run(t, b_hl)
        np.testing.assert_array_equal(got, want)
        assert (bp == 0xFFFF).all() == (b_hl is not None), (t.s_fo, b_hl is not None)
    assert rel_err(want, MoE(cfg, _rounded(w), PREFIX, np.float64)(b.astype(np.float64))) < BF16_BOUND
    wrong = tc.hilo_np(b * np.float32(1.5))
    got, _ = run(fo, cuda.to_device(wrong))
    assert rel_err(got, want) > 0.1
    with pytest.raises(ValueError, match="b_hl"):
        moe.v2_launches(None, layer, scratch, None, M, False, fo, b_hl=cuda.to_device(wrong[:, :4].copy()))
    assert not moe.reads_b_hilo(M, layer, scratch)  # (the simulator's default tiles: FMA, no hi / lo)


@pytest.mark.kernels
@pytest.mark.parametrize("M,shared", [(21, 2), (41, 0)])
def test_moe_forward_tiled_gate_up(rng, M, shared):
    """V2Tiles.tiled: kernel B's routed gate_up on the block-tiled GEMM (kdt.kernels.tc_tiled.tiled_gate_up_kernel, a
    launch of its own; B keeps the shared down, or is not launched without shared experts), against float64 and within
    the bound of the warp tile's layer. Every token takes expert 0 (its bias): 21 tokens in one pass of the
    simulator's 32, 41 in two; the other picks leave experts with a few; I = 40: three output blocks of 16, the last
    partial."""
    cfg = _cfg(**dict(_V2_SKEW, hidden_size=64, moe_intermediate_size=40, n_shared_experts=shared))
    w = _layer_weights(rng, cfg)
    w[PREFIX + "gate.e_score_correction_bias"][0] += 3.0
    b = _draw_b(rng, cfg, w, M)
    layer = moe.MoEWeights.from_hf(cfg, w, PREFIX, BF16)
    tiled = replace(V2_SIM_TILES["tc_hilo"], tiled=True)
    scratch = moe.MoEScratch.allocate(cfg, M)
    names = [ln.name for ln in moe.v2_launches(None, layer, scratch, None, M, False, tiled)]
    assert [n[0] for n in names] == (["A", "G", "B", "C"] if shared else ["A", "G", "C"]), names
    got, scratch = _run_forward(cfg, w, b, BF16, M_max=M, accumulate=False, tiles=tiled, layer=layer, version=2)
    warp_tile, _ = _run_forward(cfg, w, b, BF16, M_max=M, accumulate=False, tiles=V2_SIM_TILES["tc_hilo"],
                                layer=layer, version=2)
    ref = MoE(cfg, _rounded(w), PREFIX, np.float64)(b.astype(np.float64))
    assert rel_err(got, ref) < BF16_BOUND and rel_err(got, warp_tile) < BF16_BOUND
    counts = scratch.counts.copy_to_host()
    assert counts[0] == M, counts


@pytest.mark.kernels
def test_moe_forward_ab_reruns(rng):
    """Kernel AB (kernels A and B in one launch, the default at M = 1) three times on one scratch with new
    tokens each time, each against the float64 layer and bit-identical to kernels A and B apart: the launch
    must leave its tickets and flags at zero (left set, the next launch's blocks take the wrong roles or pass
    their waits before A has written)."""
    cfg = _cfg(**_V2_GROUPED)
    w = _layer_weights(rng, cfg)
    layer = moe.MoEWeights.from_hf(cfg, w, PREFIX, BF16)
    scratch = moe.MoEScratch.allocate(cfg, 2)
    assert moe.v2_tiles(1, cfg.num_experts_per_tok).ab
    assert [ln.name[:2] for ln in moe.v2_launches(None, layer, scratch, None, 1, False)] == ["AB", "C "]
    apart = replace(moe.v2_tiles(1, cfg.num_experts_per_tok), ab=False)
    for _ in range(3):
        b = _draw_b(rng, cfg, w, 1)
        d_b = cuda.to_device(b)
        outs = []
        for tiles in (None, apart):
            out = cuda.to_device(poisoned((1, cfg.hidden_size)))
            moe.moe_forward(d_b, layer, scratch, out, M=1, accumulate=False, version=2, tiles=tiles)
            outs.append(out.copy_to_host())
            _check_v2_state(cfg, b, w, scratch, 1)
        assert rel_err(outs[0], MoE(cfg, _rounded(w), PREFIX, np.float64)(b.astype(np.float64))) < BF16_BOUND
        np.testing.assert_array_equal(outs[0], outs[1])


def test_v2_tiles_and_fallback():
    """Launch shapes depend on M alone (CUDA graphs); M * k above V2_MAX_PAIRS runs version 1."""
    for M in (1, 2, 5, 16, 17, 64, 256):
        assert moe.v2_tiles(M, 8) == moe.v2_tiles(M, 8)
    cfg = _cfg()
    layer = moe.MoEWeights.from_hf(cfg, _layer_weights(np.random.default_rng(0), cfg), PREFIX, BF16)
    big = moe.V2_MAX_PAIRS // cfg.num_experts_per_tok + 1
    scratch = moe.MoEScratch.allocate(cfg, big)
    assert moe._v2_supported(layer, scratch, big - 1) and not moe._v2_supported(layer, scratch, big)


def test_v2_tiles_kernel_a_token_tile(monkeypatch):
    """moe.A_TT (env KDT_MOE_A_TT) sets kernel A's token tile where the plan runs on tensor cores, and only there."""
    monkeypatch.setattr(moe, "IS_SIM", False)  # (the real plans: the simulator's leave the tensor cores to the tests)
    monkeypatch.setattr(moe, "A_TT", 0)
    base65, base8 = moe.v2_tiles(65, 6, 64, 2048), moe.v2_tiles(8, 6, 64, 2048)
    monkeypatch.setattr(moe, "A_TT", 4)
    assert base65.tc and base65.tt_s == 8 and not base8.tc
    assert moe.v2_tiles(65, 6, 64, 2048) == replace(base65, tt_s=4, u_l=4)
    assert moe.v2_tiles(8, 6, 64, 2048) == base8


def test_v2_staged_loads_need_k_multiple_of_8():
    """tc_st stages kernels B's and C's routed GEMMs where their x is hi / lo and D and I are multiples of 8 (the
    16-byte copies), else the launches drop it."""
    staged = replace(V2_SIM_TILES["tc_hilo"], tc_st=2)
    for D, I, st in ((40, 24, True), (36, 24, False), (40, 20, False)):
        cfg = _cfg(**dict(_V2_GROUPED, hidden_size=D, moe_intermediate_size=I))
        layer = moe.MoEWeights.from_hf(cfg, _layer_weights(np.random.default_rng(0), cfg), PREFIX, BF16)
        scratch = moe.MoEScratch.allocate(cfg, 17)
        for tiles, want in ((staged, st), (replace(staged, tc_hilo=False), False)):
            names = [ln.kernel.py_func.__name__ for ln in moe.v2_launches(None, layer, scratch, None, 17, False, tiles)]
            assert [n.endswith("_st2") for n in names] == [False, want, want], (D, I, names)


def test_v2_kernel_b_register_cap():
    """tc_regs caps kernel B's registers on tensor cores (its name says so); the FMA tiles ignore it."""
    cfg = _cfg(**_V2_GROUPED)
    layer = moe.MoEWeights.from_hf(cfg, _layer_weights(np.random.default_rng(0), cfg), PREFIX, BF16)
    scratch = moe.MoEScratch.allocate(cfg, 17)
    for tiles, want in ((replace(V2_SIM_TILES["tc_hilo"], tc_regs=128), True), (V2_SIM_TILES["tc_hilo"], False),
                        (replace(moe.v2_tiles(17, cfg.num_experts_per_tok), tc_regs=128), False)):
        names = [ln.kernel.py_func.__name__ for ln in moe.v2_launches(None, layer, scratch, None, 17, False, tiles)]
        assert [n.endswith("_r128") for n in names] == [False, want, False], names


def test_v2_kernel_c_register_cap_and_combine():
    """c_regs caps kernel C's registers on tensor cores in fragment order and one row group, cmb / kc shape its combine
    and c_fence1 its ticket (its name says so); natural order, row groups and the FMA tiles drop c_regs; a kc other than
    the layer's top_k is dropped (the combine's loop over pos_of's slots)."""
    cfg = _cfg(**dict(_V2_GROUPED, hidden_size=32, moe_intermediate_size=16))
    layer = moe.MoEWeights.from_hf(cfg, _layer_weights(np.random.default_rng(0), cfg), PREFIX, BF16)
    assert layer.fragment_order()
    scratch = moe.MoEScratch.allocate(cfg, 17)
    k = cfg.num_experts_per_tok
    tc_t, fma_t = V2_SIM_TILES["tc_hilo"], moe.v2_tiles(17, k)
    fo_t = replace(tc_t, tc_fo=True)
    for tiles, want in ((replace(fo_t, c_regs=80, cmb=2, kc=k), f"_fo_r80_cmb2_k{k}"),
                        (replace(tc_t, kc=k + 1), "_hilo"), (replace(tc_t, c_regs=80), "_hilo"),
                        (replace(fo_t, c_regs=80, tc_kw=1), "_kw1_fo"),
                        (replace(fma_t, c_regs=80, cmb=4, kc=k), f"_cs_cmb4_k{k}"), (tc_t, "_hilo"),
                        (replace(tc_t, c_fence1=True), "_hilo_f1")):
        names = [ln.kernel.py_func.__name__ for ln in moe.v2_launches(None, layer, scratch, None, 17, False, tiles)]
        assert names[2].endswith(want) and "_r80" not in names[1], names
    t = moe.v2_tiles(17, k)
    assert (t.cmb, t.kc) == (moe.C_CMB, k if moe.C_KC else 0)


def test_v2_tiles_down_one_expert_rule(monkeypatch):
    """Kernel C takes one expert per block where its grid then fits _C_ONE_WAVE blocks, kernel A 2-token
    tiles: model_code's MoE (E = 8, D = 256, k = 2) at the DDTree step's M; no Moonlight or Kimi-K2 launch
    shape changes."""
    from kdt.config import preset

    monkeypatch.setattr(moe, "IS_SIM", False)  # the GPU launch shapes
    for M in (5, 9, 17, 33, 65, 257):
        assert moe._v2_tiles_by_m(M, 2).jc > 1 and moe.v2_tiles(M, 2, 8, 256).jc == 1, M
    for M in (1, 2, 3, 8, 16, 17, 32, 33, 65):  # kernel A's 2-token tiles (small models, 2 < M <= 32)
        t = moe.v2_tiles(M, 2, 8, 256)
        by_m = moe._v2_tiles_by_m(M, 2)
        assert (t.tt_s, t.cs_s) == ((2, False) if 2 < M <= 32 else (by_m.tt_s, by_m.cs_s)), M
    # tensor cores from 16 tokens (the default) and 1.5 tokens an expert (Moonlight: 64 experts, top-6, from 16;
    # Kimi-K2: 384 experts, top-8, from 72), off with KDT_MOE_TC_M=0; 2 token tiles a pass to 96 tokens, then 4;
    # x hi / lo and short passes fitted (tc_fit), or with KDT_MOE_TC_FIT=0 session 34's: hi / lo at 4 tiles only. A
    # layer with its experts in fragment order (fo, the routed GEMMs then read it: tc_fo): from 8 tokens and 0.75 an
    # expert (Moonlight from 8, Kimi-K2 from 36); KDT_MOE_TC_FO=0: as without the copy. With tc_fo the shared experts'
    # GEMMs read theirs too (s_fo, ``SHARED_FO``; off with KDT_MOE_SHARED_FO=0). Kernel C's combine at every M, and its
    # register cap at 2 token tiles (C_CMB, C_KC, C_REGS)
    cases = (("moonlight-16b-a3b", 16, 16, True, False, "auto"), ("kimi-k2", 16, 72, True, False, "auto"),
             ("moonlight-16b-a3b", 0, None, True, False, "auto"), ("moonlight-16b-a3b", 32, 32, False, False, "auto"),
             ("moonlight-16b-a3b", 16, 8, True, True, "auto"), ("kimi-k2", 16, 36, True, True, "1"),
             ("moonlight-16b-a3b", 0, None, True, True, "auto"), ("moonlight-16b-a3b", 16, 16, True, False, "0"))
    monkeypatch.setattr(moe, "A_TT", 0)  # (kernel A's token tile by M: test_v2_tiles_kernel_a_token_tile sets it)
    for name, tc_min, first, fit, fo, mode in cases:
        monkeypatch.setattr(moe, "TC_MIN_M", tc_min)
        monkeypatch.setattr(moe, "TC_FIT", fit)
        monkeypatch.setattr(moe, "TC_FO", mode)
        c = preset(name)
        for M in (1, 7, 8, 15, 16, 17, 31, 32, 35, 36, 64, 71, 72, 96, 97, 143, 144, 256):
            k = c.num_experts_per_tok
            want = replace(moe._v2_tiles_by_m(M, k), ab=M <= moe.AB_MAX_M, cmb=moe.C_CMB, kc=k if moe.C_KC else 0)
            if first is not None and M >= first:  # tensor cores, kernel C one expert a block (capped at 2 tiles)
                hilo = moe.TC_HILO and (fit or M > 96)
                want = replace(want, tc=2 if M <= 96 else 4, jc=1, tc_hilo=hilo, tc_split=moe.TC_SPLIT, tc_fit=fit,
                               tc_fo=hilo and mode != "0", s_fo=moe.SHARED_FO and hilo and mode != "0",
                               c_regs=moe.C_REGS if M <= 96 else 0)
            assert moe.v2_tiles(M, k, c.n_routed_experts, c.hidden_size, fo) == want, (name, M, fo)
            assert moe.v2_tiles(M, 2, 8, 256, fo).tc == 0  # small models (model_code): the FMA tiles


def test_fragment_order_kept_where_it_fits():
    """KDT_MOE_TC_FO=auto keeps a layer's fragment-ordered copy where FO_RESERVE of the device's memory stays free
    after it (a 2 GiB copy on an 80 GiB H100 and a 141 GiB H200; Moonlight's layer: 1.1 GB)."""
    gib = 2**30
    assert moe.fo_fits(2 * gib, 40 * gib, 80 * gib) and not moe.fo_fits(2 * gib, 21 * gib, 80 * gib)
    assert moe.fo_fits(2 * gib, 2 * gib + int(0.25 * 141 * gib), 141 * gib)
    assert not moe.fo_fits(2 * gib, 2 * gib + int(0.25 * 141 * gib) - 1, 141 * gib)


def test_pack_experts_layout(rng):
    experts = [_mlp_weights(rng, 8, 4) for _ in range(3)]
    gu, dn = moe.pack_experts(experts, np.float32)
    assert gu.shape == (3, 8, 8) and dn.shape == (3, 8, 4)
    for e, (g, u, d) in enumerate(experts):
        np.testing.assert_array_equal(gu[e, :4], g)
        np.testing.assert_array_equal(gu[e, 4:], u)
        np.testing.assert_array_equal(dn[e], d)
    gu16, _ = moe.pack_experts(experts, BF16)
    assert gu16.dtype == np.uint16
    np.testing.assert_array_equal(gu16[1, 4:], f32_to_bf16_bits(experts[1][1]))


# ---- real shapes (H200) ---------------------------------------------------------------------------
def _time_forward(layer, scratch, d_b, out, M, reps=5, version=None):
    moe.moe_forward(d_b, layer, scratch, out, M=M, accumulate=False, version=version)
    cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        moe.moe_forward(d_b, layer, scratch, out, M=M, accumulate=False, version=version)
    cuda.synchronize()
    return (time.perf_counter() - t) / reps


@pytest.fixture(scope="module")
def moonlight():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"[moonlight weights] seed={seed}")
    rng = np.random.default_rng(seed)
    cfg = preset("moonlight-16b-a3b")
    w = _layer_weights(rng, cfg)
    return cfg, w, {}


def _moonlight_layer(moonlight, dtype):
    """(device weights, float64 reference, scratch for 256 tokens) of the moonlight fixture's layer, once per dtype
    (bf16 also keeps the float32 weights' reference as cache["fp32_ref"])."""
    cfg, w, cache = moonlight
    if dtype not in cache:
        ref_w = w if dtype == np.float32 else _rounded(w)
        cache[dtype] = (moe.MoEWeights.from_hf(cfg, w, PREFIX, dtype), MoE(cfg, ref_w, PREFIX, np.float64),
                        moe.MoEScratch.allocate(cfg, 256))
        if dtype == BF16:
            cache["fp32_ref"] = MoE(cfg, w, PREFIX, np.float64)
    return cache[dtype]


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [1, 8, 16, 64, 128, 256])
def test_moe_forward_moonlight(rng, moonlight, dtype, M, version):
    """The Moonlight layer against float64 in its default tiles. In bf16 it keeps its experts' fragment-ordered copy
    (KDT_MOE_TC_FO=auto: it fits an H100 or H200), which the routed GEMMs read where they run on tensor cores, and
    the shared experts' beside it: where the plan takes hi / lo x, the forward with the shared experts in fragment
    order and b_hl (V2Tiles.s_fo, xh; moe.SHARED_FO, B_HILO) gives the bits of the default's."""
    cfg, w, cache = moonlight
    layer, ref, scratch = _moonlight_layer(moonlight, dtype)
    if version == 2 and dtype == BF16 and moe.TC_FO != "0":
        t = moe.v2_tiles(M, cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.hidden_size, fo=True)
        names = [ln.kernel.py_func.__name__ for ln in moe.v2_launches(None, layer, scratch, None, M, False)]
        # (kernel C's name: ..._fo, then its register cap, combine and slot suffixes, e.g. _fo_r80_cmb2_k6)
        assert layer._gu_fo is not None and ("fo" in names[-1].split("_")) == (bool(t.tc) and not t.ab), names
    b = _draw_b(rng, cfg, w, M)
    out = cuda.to_device(poisoned((M, cfg.hidden_size)))
    d_b = cuda.to_device(b)
    moe.moe_forward(d_b, layer, scratch, out, M=M, accumulate=False, version=version)
    got = out.copy_to_host()
    want = ref(b.astype(np.float64))
    bound = FP32_BOUND if dtype == np.float32 else BF16_BOUND
    err = rel_err(got, want)
    if version == 2 and M * cfg.num_experts_per_tok <= moe.V2_MAX_PAIRS:
        _check_v2_state(cfg, b, w, scratch, M)
    plan = moe._v2_plan(layer, scratch, M) if version == 2 else None
    if plan is not None and plan.hilo() and plan.tc_fo:  # the shared experts in fragment order and b_hl, on by force
        on = replace(plan, s_fo=True)
        d_hl = cuda.to_device(tc.hilo_np(b))
        launches = moe.v2_launches(None, layer, scratch, None, M, False, on, b_hl=d_hl)
        names = [ln.kernel.py_func.__name__ for ln in launches]
        assert layer._sgu_fo is not None and names[0].endswith("_xh_sfo") and "_sfo" in names[1], names
        out_hl = cuda.to_device(poisoned((M, cfg.hidden_size)))
        moe.moe_forward(d_b, layer, scratch, out_hl, M=M, accumulate=False, version=2, tiles=on, b_hl=d_hl)
        np.testing.assert_array_equal(out_hl.copy_to_host(), got)
        assert moe.reads_b_hilo(M, layer, scratch) == moe.B_HILO
    dt = _time_forward(layer, scratch, d_b, out, M, version=version)
    print(f"moonlight {np.dtype(dtype).name} M={M} v{version}: rel_err {err:.2e}, {dt * 1e6:.0f} us/forward")
    assert err < bound
    if dtype == BF16:
        assert rel_err(got, cache["fp32_ref"](b.astype(np.float64))) < BF16_VS_FP32_BOUND


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("M,tiles", [
    (32, dict(tc_hilo=True, tc_st=3)), (65, dict(tc_hilo=True, tc_st=4)), (65, dict(tc_hilo=True, tc_st=5)),
    (65, dict(tc_ot=2)), (65, dict(tc_ot=2, tc_rt=4)), (32, dict(tc_ot=2, tc_hilo=True, tc_st=3)),
    (65, dict(tc_fit=False)), (128, dict(tc_fit=False)), (32, dict(tc_fit=False, tc_hilo=False)),
    (65, dict(tiled=True)), (256, dict(tiled=True)), (256, dict(tc_regs=128)), (65, dict(c_regs=0, cmb=1, kc=0)),
    (65, dict(c_regs=96, cmb=4)), (128, dict(cmb=4, kc=0))],
    ids=lambda p: "-".join(f"{k}{int(v)}" for k, v in p.items()) if isinstance(p, dict) else str(p))
def test_moe_forward_moonlight_tiles(rng, moonlight, M, tiles):
    """Version 2 at Moonlight's shape, bf16, in tensor-core tiles the default does not take, against float64: the
    routed GEMMs' loads staged through shared memory (tc_st, hi / lo x), kernel B's routed gate_up on 2 output tiles
    a warp (tc_ot; with kernel C's down on 4 row tiles; staged), session 34's full passes (tc_fit off; the default's
    bits, short passes fitted, are then checked against them) with x as it had it (float32 at 2 token tiles), kernel
    B's routed gate_up on the block-tiled GEMM (tiled: a launch of its own before B), kernel B capped at 128 registers
    (tc_regs: ptxas spills there), kernel C as before session 53 (uncapped, its combine an output a thread with the
    loop over the slots) and in other forms of its cap and combine (c_regs, cmb, kc)."""
    cfg, w, _ = moonlight
    layer, ref, scratch = _moonlight_layer(moonlight, BF16)
    t = replace(moe.v2_tiles(M, cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.hidden_size), **tiles)
    names = [ln.kernel.py_func.__name__ for ln in moe.v2_launches(None, layer, scratch, None, M, False, t)]
    if t.tiled:  # (then kernels B and C as below)
        assert names[1] == "tiled_gate_up", names
        names = names[:1] + names[2:]
    assert not t.tc_st or f"_st{t.tc_st}" in names[1] and f"_st{t.tc_st}" in names[2], names  # (kernels B and C)
    assert t.tc_ot == 1 or f"_ot{t.tc_ot}" in names[1], names
    assert not t.tc_regs or f"_r{t.tc_regs}" in names[1], names  # (then _sfo: s48's shared experts in fragment order)
    assert not t.c_regs or f"_r{t.c_regs}_" in names[-1], names
    assert (t.cmb == 1 or f"_cmb{t.cmb}" in names[-1]) and (not t.kc or names[-1].endswith(f"_k{t.kc}")), names
    assert (t.tc_fit and not t.tc_st) == ("_fit" in names[1]) == ("_fit" in names[2]), names  # (staged: never fit)
    b = _draw_b(rng, cfg, w, M)
    out = cuda.to_device(poisoned((M, cfg.hidden_size)))
    moe.moe_forward(cuda.to_device(b), layer, scratch, out, M=M, accumulate=False, version=2, tiles=t)
    got = out.copy_to_host()
    err = rel_err(got, ref(b.astype(np.float64)))
    print(f"moonlight {tiles} M={M}: rel_err {err:.2e}")
    assert err < BF16_BOUND
    _check_v2_state(cfg, b, w, scratch, M)
    fit = replace(t, tc_fit=True)
    if not t.tc_fit and not t.tc_st and fit.hilo() == t.hilo():  # short passes fitted: the same bits
        out = cuda.to_device(poisoned((M, cfg.hidden_size)))
        moe.moe_forward(cuda.to_device(b), layer, scratch, out, M=M, accumulate=False, version=2, tiles=fit)
        np.testing.assert_array_equal(out.copy_to_host(), got)


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("M,tensor_cores", [(32, True), (64, False), (256, False)])
def test_moe_forward_moonlight_tc(rng, moonlight, monkeypatch, M, tensor_cores):
    """Version 2 at Moonlight's shape, bf16, against float64, where the default (test_moe_forward_moonlight) does
    not take these tiles: tensor cores at M = 32 (their first M), the FMA tiles at M = 64 / 256 (KDT_MOE_TC_M=0)."""
    monkeypatch.setattr(moe, "TC_MIN_M", 32 if tensor_cores else 0)
    cfg = moonlight[0]
    assert bool(moe.v2_tiles(M, cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.hidden_size).tc) == tensor_cores
    test_moe_forward_moonlight(rng, moonlight, BF16, M, 2)


@pytest.mark.kernels
@pytest.mark.gpu
def test_moe_ab_repeated_moonlight_gpu(rng, moonlight):
    """Kernel AB (kernels A and B in one launch, Moonlight's M = 1 default) 64 times on one scratch, new tokens
    each time: each output bit-identical to kernels A and B apart (a block that passed its wait before A had
    written, or a launch that left its flags up, reads stale rows), the scratch's tickets and flags at zero."""
    cfg, w, cache = moonlight
    layer = cache[BF16][0] if BF16 in cache else moe.MoEWeights.from_hf(cfg, w, PREFIX, BF16)
    scratch = moe.MoEScratch.allocate(cfg, 1)
    k = cfg.num_experts_per_tok
    apart = replace(moe.v2_tiles(1, k, cfg.n_routed_experts, cfg.hidden_size), ab=False)
    out_ab, out_apart = (cuda.to_device(poisoned((1, cfg.hidden_size))) for _ in range(2))
    for i in range(64):
        d_b = cuda.to_device(_draw_b(rng, cfg, w, 1))
        moe.moe_forward(d_b, layer, scratch, out_ab, M=1, accumulate=False, version=2)
        moe.moe_forward(d_b, layer, scratch, out_apart, M=1, accumulate=False, version=2, tiles=apart)
        np.testing.assert_array_equal(out_ab.copy_to_host(), out_apart.copy_to_host(), err_msg=f"forward {i}")
    assert not scratch.sync.copy_to_host().any()


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("M", [1, 16, 17, 32, 65])
def test_moe_forward_code_shape_gpu(rng, M, version):
    """model_code's MoE layer (D 256, I 128, E 8, k 2, 1 shared), bf16, at the DDTree steps' M: version 2's
    small-model launch shapes (kernel C one expert per block, kernel A's 2-token tiles) and the small path
    (version 3; past SMALL_MAX_M it runs version 2) against float64, with a tee (out's rows bit for bit)."""
    from kdt.fixture import read_config

    cfg = read_config(str(Path(__file__).resolve().parent.parent / "fixtures" / "model_code.h5"))
    w = _layer_weights(rng, cfg)
    layer, scratch = moe.MoEWeights.from_hf(cfg, w, PREFIX, BF16), poison_scratch(moe.MoEScratch.allocate(cfg, 65))
    b = _draw_b(rng, cfg, w, M)
    out = cuda.to_device(poisoned((M, cfg.hidden_size)))
    tee = cuda.to_device(poisoned((M + 1, cfg.hidden_size)))  # the engine's feature copy, in kernel C
    moe.moe_forward(cuda.to_device(b), layer, scratch, out, M=M, accumulate=False, tee=tee, version=version)
    got = out.copy_to_host()
    assert rel_err(got, MoE(cfg, _rounded(w), PREFIX, np.float64)(b.astype(np.float64))) < BF16_BOUND
    if version == 3 and M <= moe.SMALL_MAX_M:
        _check_small_state(cfg, b, _rounded(w), scratch, M)
    else:
        _check_v2_state(cfg, b, w, scratch, M)
    t = tee.copy_to_host()
    assert np.array_equal(t[:M], got) and np.all(np.isnan(t[M:]))


class _LazyExperts:
    """experts[e] for the reference MoE, built on use from N_DISTINCT random weight sets (float64)."""

    def __init__(self, sets):
        self.sets = sets

    def __getitem__(self, e):
        return self.sets[e % len(self.sets)]


@pytest.mark.kernels
@pytest.mark.gpu
def test_moe_forward_kimi_k2_bf16(rng):
    """Kimi K2 (D 7168, I 2048, E 384, k 8, 1 shared), bf16, M in {1, 16, 64}. All 384 experts are
    present on the device; their weights repeat 8 distinct random sets (expert e uses set e % 8) to
    bound host time and memory. The float64 reference is kdt.reference.model.MoE's own forward with
    its expert list built lazily from those sets (a full float64 copy would be ~135 GB)."""
    cfg = preset("kimi-k2")
    D, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    n_sets = 8
    sets = [tuple(_bf16_round(a) for a in _mlp_weights(rng, D, I)) for _ in range(n_sets)]
    shared = tuple(_bf16_round(a) for a in _mlp_weights(rng, D, I * cfg.n_shared_experts))
    gate = (rng.standard_normal((E, D)) / np.sqrt(D) * 2).astype(np.float32)
    bias = (0.3 * rng.standard_normal(E)).astype(np.float32)
    w_gu = cuda.device_array((E, 2 * I, D), dtype=np.uint16)
    w_dn = cuda.device_array((E, D, I), dtype=np.uint16)
    gu_s, dn_s = moe.pack_experts(sets, BF16)
    w_gu[:n_sets].copy_to_device(gu_s)
    w_dn[:n_sets].copy_to_device(dn_s)
    for e in range(n_sets, E):  # device-to-device
        w_gu[e].copy_to_device(w_gu[e % n_sets])
        w_dn[e].copy_to_device(w_dn[e % n_sets])
    sgu, sdn = moe.pack_experts([shared], BF16)
    layer = moe.MoEWeights(gate_w=cuda.to_device(gate), bias=cuda.to_device(bias),
                           w_gate_up=w_gu, w_down=w_dn,
                           shared_gate_up=cuda.to_device(sgu), shared_down=cuda.to_device(sdn),
                           n_group=cfg.n_group, topk_group=cfg.topk_group, top_k=cfg.num_experts_per_tok,
                           norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor)
    ref = MoE.__new__(MoE)
    ref.cfg, ref.gate, ref.bias = cfg, gate.astype(np.float64), bias.astype(np.float64)
    ref.experts = _LazyExperts([Mlp(*(a.astype(np.float64) for a in s)) for s in sets])
    ref.shared = Mlp(*(a.astype(np.float64) for a in shared))
    scratch = moe.MoEScratch.allocate(cfg, 64)
    w_route = {PREFIX + "gate.weight": gate, PREFIX + "gate.e_score_correction_bias": bias}
    for M in (1, 16, 64):
        b = _draw_b(rng, cfg, w_route, M)
        d_b = cuda.to_device(b)
        want = ref(b.astype(np.float64))
        for version in (1, 2):  # both versions on the same device weights (34 GB, built once)
            out = cuda.to_device(poisoned((M, D)))
            moe.moe_forward(d_b, layer, scratch, out, M=M, accumulate=False, version=version)
            err = rel_err(out.copy_to_host(), want)
            dt = _time_forward(layer, scratch, d_b, out, M, version=version)
            print(f"kimi-k2 bf16 M={M} v{version}: rel_err {err:.2e}, {dt * 1e6:.0f} us/forward")
            assert err < BF16_BOUND
