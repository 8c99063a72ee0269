"""Parity tests of the MLA kernels (kdt.kernels.mla) against the NumPy reference (kdt.reference.ops).

Simulator shapes use the "micro" preset (H 2, Rkv 16, dr 4, dn = dv = 8) with YaRN switched on;
``gpu`` shapes use Kimi K2 / Moonlight dims (Rkv 512, dr 64, dn = dv = 128, H 64 / 16).
Bounds: float32 weights rel_err < 1e-5; bf16 weights < 1e-5 against the reference on the
bf16-rounded weights (float64 math) and < 1e-2 against the unrounded float32 weights.
Every kernel family is checked in both versions (``version`` 1 and 2, kdt.kernels.mla section 6).
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from kdt.config import preset
from kdt.kernels import mla, tc
from kdt.kernels.common import IS_SIM, bf16_bits_to_f32, f32_to_bf16_bits
from kdt.reference import ops
from kdt.reference.model import full_mask
from kdt.testing import poisoned, rel_err

F32_BOUND = 1e-5  # fp32 kernels vs the float64 reference on the same inputs
BF16_ROUNDED_BOUND = 1e-5  # bf16 weights vs the float64 reference on the bf16-rounded weights
BF16_UNROUNDED_BOUND = 1e-2  # bf16 weights vs the float64 reference on the unrounded weights

YARN = {"type": "yarn", "rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 64}


def micro_cfg(**kw):
    return preset("micro", rope_scaling=YARN, max_position_embeddings=256, **kw)


def real_cfg(H: int, **kw):
    return preset("kimi-k2", num_attention_heads=H, **kw)


# ---- helpers -------------------------------------------------------------------------------------
def tree_vis(rng, M: int) -> np.ndarray:
    """Random tree visibility [M, M] bool: node i > 0 has a random parent < i; row i = row parent + i."""
    vis = np.zeros((M, M), dtype=bool)
    depth = np.zeros(M, dtype=np.int64)
    for i in range(M):
        if i > 0:
            p = int(rng.integers(0, i))
            vis[i] = vis[p]
            depth[i] = depth[p] + 1
        vis[i, i] = True
    return vis, depth


def weights(rng, cfg, wdtype, sigma: float):
    """kv_b [H*(dn+dv), Rkv]: (device array in wdtype, float64 weights the kernel sees, unrounded f64)."""
    H, dn, dv, Rkv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    w = (rng.standard_normal((H * (dn + dv), Rkv)) * sigma).astype(np.float32)
    if wdtype == "bf16":
        bits = f32_to_bf16_bits(w)
        return cuda.to_device(bits), bf16_bits_to_f32(bits).astype(np.float64), w.astype(np.float64)
    return cuda.to_device(w), w.astype(np.float64), w.astype(np.float64)


def split_kv_b(kv_b: np.ndarray, cfg):
    H, dn, dv, Rkv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    v = kv_b.reshape(H, dn + dv, Rkv)
    return v[:, :dn], v[:, dn:]  # W_uk [H, dn, Rkv], W_uv [H, dv, Rkv]


def ref_o_lat(q_abs, q_pe, c_kv, k_pe, mask, scale):
    """float64 o_lat[M, H, Rkv] = softmax(mask(s)) @ c_kv (matmul form, fast at real shapes)."""
    M, H, R = q_abs.shape
    T = c_kv.shape[0]
    f = np.float64
    s = q_abs.reshape(M * H, R).astype(f) @ c_kv.T.astype(f)
    s += q_pe.reshape(M * H, -1).astype(f) @ k_pe.T.astype(f)
    s = np.where(np.repeat(mask, H, axis=0), s * scale, -np.inf)
    p = ops.softmax(s, axis=-1)
    return (p @ c_kv.astype(f)).reshape(M, H, R), p.reshape(M, H, T)


def attention_inputs(rng, cfg, L: int, M: int, extra: int = 3):
    """q_abs, q_pe with score std about 2; a cache of L+M+extra slots (beyond L+M poisoned NaN)."""
    H, Rkv, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    scale = cfg.softmax_scale
    sq = 2.0 / (np.sqrt(Rkv + dr) * scale)
    q_abs = (rng.standard_normal((M, H, Rkv)) * sq).astype(np.float32)
    q_pe = (rng.standard_normal((M, H, dr)) * sq).astype(np.float32)
    c_kv = np.full((L + M + extra, Rkv), np.nan, dtype=np.float32)
    k_pe = np.full((L + M + extra, dr), np.nan, dtype=np.float32)
    c_kv[:L + M] = rng.standard_normal((L + M, Rkv))
    k_pe[:L + M] = rng.standard_normal((L + M, dr))
    vis, _ = tree_vis(rng, M)
    return q_abs, q_pe, c_kv, k_pe, vis, scale


def run_attention(q_abs, q_pe, c_kv, k_pe, L, vis, scale, n_splits=None, scratch=None, version=None,
                  params=None, device_L=False, split_keys=None, on_tc=None, hl=False):
    """o_lat of mla_attention (``params``: a v2 geometry (G, A, NW, VPL, CG[, PF]) instead of the
    default one; ``device_L``: L passed as a device scalar, as in the engine's CUDA graphs; ``split_keys``: v2's
    floor on a split's keys instead of mla.SPLIT_KEYS; ``on_tc``: v2 on tensor cores (kdt.kernels.attn_tc) or not,
    whatever M; ``hl``: with the pre-split cache (mla.kv_hl_np of both caches), as the engine passes it)."""
    M, H, Rkv = q_abs.shape
    o_d = cuda.to_device(poisoned((M, H, Rkv)))
    args = (cuda.to_device(q_abs), cuda.to_device(q_pe), cuda.to_device(c_kv), cuda.to_device(k_pe),
            cuda.to_device(np.array([L], np.int64)) if device_L else L, cuda.to_device(vis.astype(np.uint8)),
            scale, o_d)
    if params is not None or split_keys is not None or on_tc is not None or hl:
        if scratch is None and n_splits is not None and n_splits > 1:  # NaN: a split read unwritten fails
            scratch = cuda.to_device(poisoned(mla.mla_scratch_size(M, H, Rkv, n_splits)))
        kv_hl = cuda.to_device(mla.kv_hl_np(c_kv, k_pe)) if hl else None
        mla._mla_attention_v2(*args, scratch, n_splits, 0, params=params, split_keys=split_keys, on_tc=on_tc,
                              kv_hl=kv_hl)
    else:
        mla.mla_attention(*args, scratch=scratch, n_splits=n_splits, version=version)
    return o_d.copy_to_host()


def on_tensor_cores(cfg, L, M, version=None, params=None, split_keys=None, on_tc=None) -> bool:
    """Whether the attention as :func:`run_attention` calls it computes on tensor cores (kdt.kernels.attn_tc): asked
    to, or version 2's dispatch at this M (and, shared by prefix, this L, on the host or the device)."""
    from kdt.kernels import attn_tc

    if on_tc is not None:
        return on_tc
    H, Rkv, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    km = mla.SPLIT_KEYS if split_keys is None else split_keys
    return (mla._version(version) == 2 and params is None and km == 0
            and (attn_tc.uses_tc(M, H, Rkv, dr) or attn_tc.shares_tc(M, H, Rkv, dr, L)))


def check_attention(rng, cfg, L, M, n_splits=None, general_vis=False, version=None, params=None,
                    device_L=False, split_keys=None, on_tc=None, bound=None, hl=False):
    """The attention's o_lat (:func:`run_attention`'s options) against the float64 reference within ``bound``
    (default F32_BOUND, TC_BOUND where it runs on tensor cores: :func:`on_tensor_cores`); with ``hl`` also without
    the pre-split cache, bit for bit the same."""
    if bound is None:
        bound = TC_BOUND if on_tensor_cores(cfg, L, M, version, params, split_keys, on_tc) else F32_BOUND
    q_abs, q_pe, c_kv, k_pe, vis, scale = attention_inputs(rng, cfg, L, M)
    if general_vis:  # any pattern with a visible diagonal, e.g. rows that do not see slot L
        vis = rng.random((M, M)) < 0.5
        vis[np.arange(M), np.arange(M)] = True
        vis[1:, 0] = False
    o, *other = (run_attention(q_abs, q_pe, c_kv, k_pe, L, vis, scale, n_splits=n_splits, version=version,
                               params=params, device_L=device_L, split_keys=split_keys, on_tc=on_tc, hl=h)
                 for h in ((True, False) if hl else (False,)))
    for o2 in other:  # the key tiles' words are the same whether copied pre-split or split in shared memory
        np.testing.assert_array_equal(o, o2)
    ref, _ = ref_o_lat(q_abs, q_pe, c_kv[:L + M], k_pe[:L + M], full_mask(L, vis), scale)
    err = rel_err(o, ref)
    assert err < bound, (L, M, n_splits, version, params, on_tc, err)
    return err


def run_chain(rng, cfg, L, M, wdtype, interleave, extra=2, version=None):
    """kv_latent_write -> q_absorb -> mla_attention -> uv_project against ops.mla_attention_absorbed."""
    H, dn, dr, dv, Rkv = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                          cfg.kv_lora_rank)
    scale = cfg.softmax_scale
    vis, depth = tree_vis(rng, M)
    positions = (L + depth).astype(np.int64)
    cos_tab, sin_tab = mla.rope_tables(cfg, L + M + 1)
    sigma = 2.0 / (np.sqrt(dn * Rkv) * scale)  # score std about 2
    kv_b_d, kv_b, kv_b_raw = weights(rng, cfg, wdtype, sigma)
    norm_w = (1.0 + 0.1 * rng.standard_normal(Rkv)).astype(np.float32)
    q = rng.standard_normal((M, H * (dn + dr))).astype(np.float32)
    c = rng.standard_normal((M, Rkv + dr)).astype(np.float32)
    c_kv = np.full((L + M + extra, Rkv), np.nan, dtype=np.float32)
    k_pe = np.full((L + M + extra, dr), np.nan, dtype=np.float32)
    c_kv[:L] = rng.standard_normal((L, Rkv))
    k_pe[:L] = rng.standard_normal((L, dr))

    d = cuda.to_device
    c_kv_d, k_pe_d, pos_d, cos_d, sin_d = d(c_kv), d(k_pe), d(positions), d(cos_tab), d(sin_tab)
    mla.kv_latent_write(d(c), d(norm_w), cfg.rms_norm_eps, pos_d, cos_d, sin_d, L, c_kv_d, k_pe_d, interleave)
    q_abs_d, q_pe_d = d(poisoned((M, H, Rkv))), d(poisoned((M, H, dr)))
    mla.q_absorb(d(q), kv_b_d, pos_d, cos_d, sin_d, interleave, q_abs_d, q_pe_d, version=version)
    o_lat_d = d(poisoned((M, H, Rkv)))
    mla.mla_attention(q_abs_d, q_pe_d, c_kv_d, k_pe_d, L, d(vis.astype(np.uint8)), scale, o_lat_d, version=version)
    o_d = d(poisoned((M, H * dv)))
    mla.uv_project(o_lat_d, kv_b_d, o_d, version=version)
    o = o_d.copy_to_host()

    f = np.float64
    cos, sin = ops.rope_cos_sin(cfg, positions, f)
    qr = q.astype(f).reshape(M, H, dn + dr)
    q_nope, q_pe = qr[..., :dn], ops.apply_rope(qr[..., dn:], cos, sin, interleave)
    c_all = np.concatenate([c_kv[:L].astype(f), ops.rmsnorm(c[:, :Rkv].astype(f), norm_w.astype(f),
                                                            cfg.rms_norm_eps)])
    k_all = np.concatenate([k_pe[:L].astype(f), ops.apply_rope(c[:, Rkv:].astype(f), cos, sin, interleave)])
    mask = full_mask(L, vis)
    refs = {}
    for name, w in (("kernel_weights", kv_b), ("unrounded", kv_b_raw)):
        W_uk, W_uv = split_kv_b(w, cfg)
        refs[name] = ops.mla_attention_absorbed(q_nope, q_pe, c_all, k_all, W_uk, W_uv, mask,
                                                scale).reshape(M, H * dv)
    W_uk, W_uv = split_kv_b(kv_b, cfg)
    return o, refs, (q_nope, q_pe, c_all, k_all, W_uk, W_uv, mask, scale)


# ---- 1. kv_latent_write -------------------------------------------------------------------------------
HL_POISON = 0xDEADBEEF  # words of the pre-split cache kv_hl never written


def hl_stack(max_len: int, F: int):
    """A poisoned stacked pre-split cache [2, max_len, F] uint32 on the device (the kernels get its layer view [1])."""
    return cuda.to_device(np.full((2, max_len, F), HL_POISON, np.uint32))


def check_kv_hl_run(plain, with_hl, L: int, M: int) -> None:
    """A latent write with the pre-split cache (host copies c_kv [max_len, Rkv], k_pe [max_len, dr], the stack
    kv_hl [2, max_len, Rkv + dr] whose layer 1 the kernel got) against one without (c_kv, k_pe): the same c_kv /
    k_pe bits, kv_hl[1, L:L+M] = kv_hl_np of those rows bit for bit, every other word of the stack still poisoned."""
    c_kv, k_pe, hl = with_hl
    for want, got in zip(plain, (c_kv, k_pe), strict=True):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(hl[1, L:L + M], mla.kv_hl_np(c_kv[L:L + M], k_pe[L:L + M]))
    hl[1, L:L + M] = HL_POISON
    assert (hl == HL_POISON).all(), "kv_hl written outside layer 1's rows [L, L+M)"


def check_kv_latent_write(rng, cfg, L, M, interleave, norm_dtype):
    Rkv, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    vis, depth = tree_vis(rng, M)
    positions = (L + depth).astype(np.int64)
    cos_tab, sin_tab = mla.rope_tables(cfg, L + M + 1)
    c = rng.standard_normal((M, Rkv + dr)).astype(np.float32) * 3
    w = (1.0 + 0.1 * rng.standard_normal(Rkv)).astype(np.float32)
    if norm_dtype == "bf16":
        bits = f32_to_bf16_bits(w)
        w_dev, w_ref = cuda.to_device(bits), bf16_bits_to_f32(bits)
    else:
        w_dev, w_ref = cuda.to_device(w), w
    max_len = L + M + 4
    d = cuda.to_device
    runs = []
    for hl in (None, hl_stack(max_len, Rkv + dr)):  # without, then with the pre-split cache
        c_kv_d, k_pe_d = d(poisoned((max_len, Rkv))), d(poisoned((max_len, dr)))
        mla.kv_latent_write(d(c), w_dev, cfg.rms_norm_eps, d(positions), d(cos_tab), d(sin_tab), L, c_kv_d,
                            k_pe_d, interleave, kv_hl=None if hl is None else hl[1])
        runs.append([a.copy_to_host() for a in (c_kv_d, k_pe_d) + (() if hl is None else (hl,))])
    check_kv_hl_run(*runs, L, M)
    c_kv, k_pe = runs[0]
    f = np.float64
    cos, sin = ops.rope_cos_sin(cfg, positions, f)
    ref_c = ops.rmsnorm(c[:, :Rkv].astype(f), w_ref.astype(f), cfg.rms_norm_eps)
    ref_k = ops.apply_rope(c[:, Rkv:].astype(f), cos, sin, interleave)
    assert rel_err(c_kv[L:L + M], ref_c) < F32_BOUND
    assert rel_err(k_pe[L:L + M], ref_k) < F32_BOUND
    outside = np.r_[0:L, L + M:max_len]
    assert np.isnan(c_kv[outside]).all() and np.isnan(k_pe[outside]).all(), "slots outside [L, L+M) written"


@pytest.mark.kernels
@pytest.mark.parametrize("L,M", [(0, 1), (5, 3), (40, 3)])
@pytest.mark.parametrize("interleave", [True, False])
def test_kv_latent_write(rng, L, M, interleave):
    check_kv_latent_write(rng, micro_cfg(rope_interleave=interleave), L, M, interleave, "f32")


@pytest.mark.kernels
def test_kv_latent_write_bf16_norm(rng):
    check_kv_latent_write(rng, micro_cfg(), 5, 3, True, "bf16")


# ---- 2. q_absorb ------------------------------------------------------------------------------------
def absorb_tc_args(kv_b_d, cfg, M: int):
    """(W_uk^T, q_hl poisoned: every bf16 half NaN) for the absorb on tensor cores, which M tokens then take."""
    H, dn = cfg.num_attention_heads, cfg.qk_nope_head_dim
    tc_abs = (mla.absorb_tc_weights(kv_b_d, H, dn), cuda.to_device(np.full((M * H, dn // 2), ~np.uint64(0))))
    assert mla.absorb_uses_tc(M, tc_abs)
    return tc_abs


def check_q_absorb(rng, cfg, M, wdtype, interleave, version=None, tc_abs: bool = False):
    """q_absorb against float64; ``tc_abs``: with (W_uk^T, q_hl), the absorb on tensor cores (version 2)."""
    H, dn, dr, Rkv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    L = 7
    positions = (L + rng.integers(0, M + 1, size=M)).astype(np.int64)
    cos_tab, sin_tab = mla.rope_tables(cfg, L + M + 1)
    kv_b_d, kv_b, kv_b_raw = weights(rng, cfg, wdtype, 0.1)
    q = rng.standard_normal((M, H * (dn + dr))).astype(np.float32)
    q_abs_d, q_pe_d = cuda.to_device(poisoned((M, H, Rkv))), cuda.to_device(poisoned((M, H, dr)))
    d = cuda.to_device
    mla.q_absorb(d(q), kv_b_d, d(positions), d(cos_tab), d(sin_tab), interleave, q_abs_d, q_pe_d, version=version,
                 tc_abs=absorb_tc_args(kv_b_d, cfg, M) if tc_abs else None)
    q_abs, q_pe = q_abs_d.copy_to_host(), q_pe_d.copy_to_host()
    qr = q.astype(np.float64).reshape(M, H, dn + dr)
    cos, sin = ops.rope_cos_sin(cfg, positions, np.float64)
    assert rel_err(q_pe, ops.apply_rope(qr[..., dn:], cos, sin, interleave)) < F32_BOUND
    W_uk, _ = split_kv_b(kv_b, cfg)
    err = rel_err(q_abs, np.einsum("mhd,hdr->mhr", qr[..., :dn], W_uk))
    assert err < (F32_BOUND if wdtype == "f32" else BF16_ROUNDED_BOUND), err
    if wdtype == "bf16":
        W_uk_raw, _ = split_kv_b(kv_b_raw, cfg)
        assert rel_err(q_abs, np.einsum("mhd,hdr->mhr", qr[..., :dn], W_uk_raw)) < BF16_UNROUNDED_BOUND


@pytest.mark.kernels
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
@pytest.mark.parametrize("version", [1, 2])
def test_q_absorb(rng, M, wdtype, version):
    check_q_absorb(rng, micro_cfg(), M, wdtype, interleave=(M == 1), version=version)


def absorb_tc_cfg(monkeypatch):
    """The model shape for the absorb on tensor cores in the simulator (from one token, any W_uk size): 3 heads, dn = 24
    (6 weight words: the second group of 4 half past K), Rkv = 24 (the block's 32 latent columns: its second row tile
    half past them)."""
    monkeypatch.setattr(mla, "QABS_TC_MIN_M", 1)
    monkeypatch.setattr(mla, "UV_ROW_PER_WARP_ELEMS", 0)
    return micro_cfg(num_attention_heads=3, kv_lora_rank=24, qk_nope_head_dim=24)


@pytest.mark.kernels
@pytest.mark.parametrize("M, plan", [(3, None), (9, None), (9, (2, 2, 2, 4, 0)), (3, (2, 1, 4, 4, 1))])
def test_q_absorb_tc(rng, monkeypatch, M, plan):
    """The absorb on tensor cores (q_rope_hl's launch, then kdt.kernels.tc.gemm_kernel a head on W_uk^T) against
    float64 on the rounded weights; 8-token tiles (the second partial at M = 9), the default plan (2 row groups of 2
    warps) and 4 warps splitting dn / row groups of one warp. W_uk^T is built only for bf16 weights of more than
    UV_ROW_PER_WARP_ELEMS elements, and M >= QABS_TC_MIN_M takes it."""
    cfg = absorb_tc_cfg(monkeypatch)
    if plan is not None:
        monkeypatch.setattr(mla, "_absorb_tc_plan", lambda M: plan)
    check_q_absorb(rng, cfg, M, "bf16", interleave=True, version=2, tc_abs=True)
    kv_b = np.zeros((3 * (24 + cfg.v_head_dim), 24), np.uint16)
    assert mla.absorb_tc_weights(kv_b.astype(np.float32), 3, 24) is None
    monkeypatch.setattr(mla, "UV_ROW_PER_WARP_ELEMS", 3 * 24 * 24)
    assert mla.absorb_tc_weights(kv_b, 3, 24) is None
    monkeypatch.setattr(mla, "QABS_TC_MIN_M", M + 1)
    assert not mla.absorb_uses_tc(M, (cuda.to_device(kv_b), None))


def test_uk_transposed_np():
    """W_uk^T's rows: row h Rkv + r of head h is column r of W_uk[h] (the first dn of its dn + dv kv_b rows)."""
    H, dn, dv, Rkv = 3, 4, 2, 5
    kv_b = np.arange(H * (dn + dv) * Rkv).reshape(H * (dn + dv), Rkv)
    wt = mla.uk_transposed_np(kv_b, H, dn)
    assert wt.shape == (H * Rkv, dn) and wt.flags.c_contiguous
    for h in range(H):
        np.testing.assert_array_equal(wt[h * Rkv: (h + 1) * Rkv], kv_b[h * (dn + dv): h * (dn + dv) + dn].T)


def check_latent_write_and_absorb(rng, cfg, M, wdtype, tc_abs: bool = False):
    """The fused launch (KDT_MLA_FUSE_KV) writes exactly what kv_latent_write and q_absorb (v2) write apart,
    both tested against the reference above: q and c column slices of one stacked projection as in the
    engine, outputs poisoned, cache slots outside [L, L + M) left alone; fused with the pre-split cache too
    (its rows kv_hl_np of the latents, the other outputs' bits unchanged). ``tc_abs``: also fused with the
    absorb on tensor cores (q_rope_hl's launch with the latent write): q_pe and the caches bit for bit, q_abs
    within BF16_ROUNDED_BOUND of the FMA kernel's."""
    H, dn, dr, Rkv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    Nq, L, max_len = H * (dn + dr), 5, 5 + M + 3
    positions = (L + rng.integers(0, M + 1, size=M)).astype(np.int64)
    cos_d, sin_d = (cuda.to_device(t) for t in mla.rope_tables(cfg, max_len))
    kv_b_d, _, _ = weights(rng, cfg, wdtype, 0.1)
    qkv = cuda.to_device(rng.standard_normal((M, Nq + Rkv + dr)).astype(np.float32))
    gw = cuda.to_device((1.0 + 0.1 * rng.standard_normal(Rkv)).astype(np.float32))
    pos_d, L_d = cuda.to_device(positions), cuda.to_device(np.array([L], np.int64))
    got = []
    runs = [(False, None, None), (True, None, None), (True, hl_stack(max_len, Rkv + dr), None)]
    if tc_abs:
        runs.append((True, hl_stack(max_len, Rkv + dr), absorb_tc_args(kv_b_d, cfg, M)))
    for fuse, hl, tca in runs:
        out = [cuda.to_device(poisoned(sh)) for sh in ((M, H, Rkv), (M, H, dr), (max_len, Rkv), (max_len, dr))]
        mla.latent_write_and_absorb(qkv[:, Nq:], gw, cfg.rms_norm_eps, L_d, out[2], out[3], qkv[:, :Nq], kv_b_d,
                                    pos_d, cos_d, sin_d, cfg.rope_interleave, out[0], out[1], fuse=fuse,
                                    kv_hl=None if hl is None else hl[1], tc_abs=tca)
        got.append([o.copy_to_host() for o in out] + ([] if hl is None else [hl.copy_to_host()]))
    assert not np.isnan(got[0][0]).any() and not np.isnan(got[0][2][L:L + M]).any()
    for run in got[1:3]:
        for sep, fused in zip(got[0], run[:4], strict=True):  # NaN (never written) where the separate launches
            np.testing.assert_array_equal(fused.view(np.uint32), sep.view(np.uint32))  # left NaN, bit for bit
    if tc_abs:
        for fma, on_tc in zip(got[2][1:], got[3][1:], strict=True):  # q_pe, c_kv, k_pe, kv_hl
            np.testing.assert_array_equal(on_tc.view(np.uint32), fma.view(np.uint32))
        err = rel_err(got[3][0], got[0][0])
        assert err < BF16_ROUNDED_BOUND, err
    check_kv_hl_run(got[0][2:], got[2][2:], L, M)  # (it poisons the rows it checked)


def test_latent_write_block_matches_q_absorb2():
    """The separate latent write reduces over as many threads as q_absorb2's block (the fused path's), so
    the two paths write the same bits: real head dims (dn 128) and model_code's (dn 32)."""
    for dn in (128, 32):
        _, G, NWD = mla._q_absorb2_params(17, dn)
        assert mla._KV_NT == G * NWD, dn


@pytest.mark.kernels
@pytest.mark.parametrize("M, wdtype", [(1, "f32"), (5, "bf16"), (17, "f32")])  # 17: three latent-write slices
def test_latent_write_and_absorb_fused(rng, M, wdtype):
    check_latent_write_and_absorb(rng, micro_cfg(), M, wdtype)


@pytest.mark.kernels
def test_latent_write_and_absorb_fused_tc(rng, monkeypatch):
    """The engine's launch with the absorb on tensor cores: 5 tokens of 3 heads (the rope's grid x = 1, so the latent
    write takes cdiv(5, 1 x 3) = 2 z-slices where the FMA launch's grid x of 6 takes one)."""
    check_latent_write_and_absorb(rng, absorb_tc_cfg(monkeypatch), 5, "bf16", tc_abs=True)


# ---- 4. uv_project ----------------------------------------------------------------------------------
def check_uv_project(rng, cfg, M, wdtype, version=None):
    H, dv, Rkv = cfg.num_attention_heads, cfg.v_head_dim, cfg.kv_lora_rank
    kv_b_d, kv_b, kv_b_raw = weights(rng, cfg, wdtype, 0.1)
    o_lat = rng.standard_normal((M, H, Rkv)).astype(np.float32)
    o_d = cuda.to_device(poisoned((M, H * dv)))
    mla.uv_project(cuda.to_device(o_lat), kv_b_d, o_d, version=version)
    o = o_d.copy_to_host()
    _, W_uv = split_kv_b(kv_b, cfg)
    err = rel_err(o, np.einsum("mhr,hvr->mhv", o_lat.astype(np.float64), W_uv).reshape(M, H * dv))
    assert err < (F32_BOUND if wdtype == "f32" else BF16_ROUNDED_BOUND), err
    if wdtype == "bf16":
        _, W_uv_raw = split_kv_b(kv_b_raw, cfg)
        ref = np.einsum("mhr,hvr->mhv", o_lat.astype(np.float64), W_uv_raw).reshape(M, H * dv)
        assert rel_err(o, ref) < BF16_UNROUNDED_BOUND
    # o in the hi / lo layout (o_proj's tensor-core x): on the tensor-core path, the bits of o's split; else refused
    o_hl = cuda.to_device(poisoned((M, H * dv)).view(np.uint64))
    if (version or mla.VERSION) == 2 and mla.uv_writes_hilo(M, kv_b_d, H, dv):
        mla.uv_project(cuda.to_device(o_lat), kv_b_d, o_hl, version=version)
        assert np.array_equal(o_hl.copy_to_host(), tc.hilo_np(o))
    else:
        with pytest.raises(ValueError, match="hi / lo"):
            mla.uv_project(cuda.to_device(o_lat), kv_b_d, o_hl, version=version)


@pytest.mark.kernels
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
@pytest.mark.parametrize("version", [1, 2])
def test_uv_project(rng, M, wdtype, version):
    check_uv_project(rng, micro_cfg(), M, wdtype, version=version)


# ---- 3. mla_attention -------------------------------------------------------------------------------
@pytest.mark.kernels
@pytest.mark.parametrize("L,M", [(0, 1), (0, 3), (5, 1), (5, 3), (40, 1), (40, 3)])
@pytest.mark.parametrize("version", [1, 2])
def test_mla_attention(rng, L, M, version):
    check_attention(rng, micro_cfg(), L, M, version=version)


@pytest.mark.kernels
@pytest.mark.parametrize("L,M,n_splits", [(40, 1, 4), (40, 3, 3), (5, 3, 2), (0, 3, 2)])
@pytest.mark.parametrize("version", [1, 2])
def test_mla_attention_split(rng, L, M, n_splits, version):
    """Flash-decoding path: a small forced split size (BT-aligned chunks of the key range) + combine."""
    check_attention(rng, micro_cfg(), L, M, n_splits=n_splits, version=version)


@pytest.mark.kernels
@pytest.mark.parametrize("L,M,n_splits", [(0, 3, 1), (6, 3, 1), (6, 3, 2)])
@pytest.mark.parametrize("version", [1, 2])
def test_mla_attention_general_vis(rng, L, M, n_splits, version):
    """Non-tree visibility: slot L+j visible iff vis[m, j], whatever the pattern."""
    check_attention(rng, micro_cfg(), L, M, n_splits=n_splits, general_vis=True, version=version)


@pytest.mark.kernels
@pytest.mark.parametrize("version", [1, 2])
def test_mla_attention_split_scratch(rng, version):
    """Caller-provided scratch (the graph-capture path), and a too-small scratch is refused."""
    cfg = micro_cfg()
    L, M, S = 21, 2, 3
    H, Rkv = cfg.num_attention_heads, cfg.kv_lora_rank
    q_abs, q_pe, c_kv, k_pe, vis, scale = attention_inputs(rng, cfg, L, M)
    scratch = cuda.to_device(poisoned(mla.mla_scratch_size(M, H, Rkv, S)))
    o = run_attention(q_abs, q_pe, c_kv, k_pe, L, vis, scale, n_splits=S, scratch=scratch, version=version)
    ref, _ = ref_o_lat(q_abs, q_pe, c_kv[:L + M], k_pe[:L + M], full_mask(L, vis), scale)
    assert rel_err(o, ref) < F32_BOUND
    with pytest.raises(ValueError):
        run_attention(q_abs, q_pe, c_kv, k_pe, L, vis, scale, n_splits=S, version=version, scratch=cuda.to_device(
            np.zeros(mla.mla_scratch_size(M, H, Rkv, S) - 1, np.float32)))


@pytest.mark.kernels
@pytest.mark.parametrize("L,M,n_splits", [(2, 1, 9), (9, 3, 7), (40, 2, 6), (40, 1, 25)])
def test_mla_attention_v2_device_L_empty_splits(rng, L, M, n_splits):
    """v2 as the engine calls it: L on the device, more splits than the keys fill (splits past L+M
    never written, the scratch NaN-poisoned: the combine must derive and skip them), both loops of
    the combine (several splits per warp, a tail)."""
    check_attention(rng, micro_cfg(), L, M, n_splits=n_splits, version=2, device_L=True)
    check_attention(rng, micro_cfg(), L, M, n_splits=n_splits, general_vis=True, device_L=True,
                    params=mla._attn2_params(2, 16, 4) + (0,))


@pytest.mark.kernels
@pytest.mark.parametrize("L,M,n_splits,split_keys", [(40, 2, 9, 11), (40, 2, 9, 64), (2, 1, 9, 3), (40, 1, 25, 1)])
def test_mla_attention_v2_split_keys(rng, L, M, n_splits, split_keys):
    """v2 with a floor on a split's keys (mla.SPLIT_KEYS), as the engine calls it (L on the device, S splits from
    max_len): fewer splits than S are written (40 + 2 keys: 4 splits of 12; one of 64; 3 keys one split; a floor
    below a tile), and the combine must derive the same ones from the scratch, NaN-poisoned past them."""
    check_attention(rng, micro_cfg(), L, M, n_splits=n_splits, device_L=True, split_keys=split_keys)
    check_attention(rng, micro_cfg(), L, M, n_splits=n_splits, general_vis=True, device_L=True,
                    params=mla._attn2_params(2, 16, 4) + (0,), split_keys=split_keys)


def check_combine_in_launch(rng, cfg, L, M, n_splits, launches=2):
    """The combine in the attention's launch (mla.combine_in_launch) as the engine calls it (L on the device, S
    splits, the partials and o_lat NaN-poisoned before each launch), ``launches`` times on one sync array, which
    each launch must leave at zero (left set, the next launch's blocks take the wrong roles, or its workers pass
    their wait before the splits have written): within F32_BOUND of float64 and of the separate combine's o_lat, bit
    for bit where the workers sum in the separate combine's order (its warps and splits in flight: the
    simulator's)."""
    H, Rkv = cfg.num_attention_heads, cfg.kv_lora_rank
    q_abs, q_pe, c_kv, k_pe, vis, scale = attention_inputs(rng, cfg, L, M)
    args = [cuda.to_device(a) for a in (q_abs, q_pe, c_kv, k_pe, np.array([L], np.int64), vis.astype(np.uint8))]
    sync = cuda.to_device(np.zeros(mla.ATTN_SYNC_WORDS, np.int32))
    outs = []
    for ci in (False,) + (True,) * launches:
        o = cuda.to_device(poisoned((M, H, Rkv)))
        scratch = cuda.to_device(poisoned(mla.mla_scratch_size(M, H, Rkv, n_splits)))
        mla._mla_attention_v2(*args, scale, o, scratch, n_splits, 0, sync=sync, combine_in=ci)
        outs.append(o.copy_to_host())
        assert not sync.copy_to_host().any(), "the launch must leave its sync words at zero"
    ref, _ = ref_o_lat(q_abs, q_pe, c_kv[:L + M], k_pe[:L + M], full_mask(L, vis), scale)
    for o in outs[1:]:
        assert rel_err(o, ref) < F32_BOUND and rel_err(o, outs[0]) < F32_BOUND
        if IS_SIM:
            np.testing.assert_array_equal(o, outs[0])


@pytest.mark.kernels
@pytest.mark.parametrize("L,M,n_splits", [(2, 1, 9), (40, 1, 6), (40, 1, 25), (9, 3, 7)])
def test_mla_attention_v2_combine_in_launch(rng, L, M, n_splits):
    """The combine in the attention's launch (:func:`check_combine_in_launch`): most splits empty, every split
    written, several splits a warp and a tail, three tokens' workers."""
    check_combine_in_launch(rng, micro_cfg(), L, M, n_splits)


@pytest.mark.kernels
@pytest.mark.parametrize("params", [
    (4, 2, 2, 1, 2, 0), (4, 2, 2, 1, 2, 1), (4, 2, 2, 1, 2, 2),  # prefetch modes
    (4, 2, 2, 2, 1, 2),  # VPL = 2 scores per lane (BT = 4), one column group
    (4, 1, 2, 1, 2, 2),  # one head per warp (BT = 4, 4 lanes per row)
    (8, 2, 1, 1, 1, 2),  # G = 8: padded feature tile (F = 20 -> 24 columns), one warp
    (4, 1, 8, 1, 4, 2),  # 8 warps, 32 threads > Rkv: the general tile-staging path; 4 column groups
    (2, 2, 1, 1, 1, 2),  # BT = 1 key per tile, 2 lanes
])
def test_mla_attention_v2_geometries(rng, params):
    """Other v2 tilings than the default: prefetch modes, lanes per row, tile widths; H = 3 with 2 or
    4 heads per block (a partial last head group)."""
    cfg = micro_cfg(num_attention_heads=3)
    check_attention(rng, cfg, 9, 3, params=params)
    check_attention(rng, cfg, 9, 2, n_splits=3, params=params, device_L=True)


def test_mla_num_splits_v2():
    """v2's FMA splits: whole waves of the resident blocks per SM (BLOCKS_PER_SM_V2 4-warp blocks' worth: more
    of fewer warps), >= MIN_KEYS_PER_SPLIT_V2 keys each (mla_num_splits' where the tensor cores take no part)."""
    for H, M in ((16, 1), (16, 16), (16, 64), (64, 1), (64, 3), (128, 1), (4, 1), (4, 17), (4, 65)):
        S = mla._fma_splits(1 << 20, M, H, 512, 64)
        prm = mla._attn2_params(H, 512, 64)
        slots = mla._attn2_blocks_per_sm(prm[2]) * mla._num_sms()
        R = mla._attn2_geometry(512, 64, *prm)["R"]
        blocks = S * M * -(-H // R)
        assert 1 <= S <= mla.MAX_SPLITS_V2 and (blocks <= slots or S == 1), (H, M, S)
        assert S == 1 or (S + 1) * M * -(-H // R) > slots or S == mla.MAX_SPLITS_V2
    assert mla.mla_num_splits(0, 1, 16, version=2) == 1
    assert mla.mla_num_splits(40, 1, 16, version=2) == -(-41 // mla.MIN_KEYS_PER_SPLIT_V2)
    assert mla._attn2_blocks_per_sm(4) == mla.BLOCKS_PER_SM_V2
    assert mla._attn2_blocks_per_sm(1) == 4 * mla.BLOCKS_PER_SM_V2  # one-warp blocks (H <= 4 on the GPU)


@pytest.mark.kernels
def test_mla_attention_head_groups(rng, monkeypatch):
    """v1: several heads per lane group (A = 2) and a partial last head group (H = 3 with 2 heads/block);
    (v2's: test_mla_attention_v2_geometries)."""
    cfg = micro_cfg(num_attention_heads=3)
    G = mla._attn_params(3, cfg.kv_lora_rank, cfg.qk_rope_head_dim)[0]
    monkeypatch.setattr(mla, "_attn_params", lambda H, Rkv, dr: (G, 2, 1, 4))
    check_attention(rng, cfg, 9, 3, version=1)
    check_attention(rng, cfg, 9, 2, n_splits=2, version=1)


@pytest.mark.kernels
def test_mla_attention_wrong_kernel_is_caught(rng):
    """Sanity of the check itself: a visibility the kernel did not get changes the reference."""
    cfg = micro_cfg()
    L, M = 5, 3
    q_abs, q_pe, c_kv, k_pe, vis, scale = attention_inputs(rng, cfg, L, M)
    o = run_attention(q_abs, q_pe, c_kv, k_pe, L, vis, scale)
    full = np.ones_like(vis)
    ref, _ = ref_o_lat(q_abs, q_pe, c_kv[:L + M], k_pe[:L + M], full_mask(L, full), scale)
    assert rel_err(o, ref) > 1e-3


# ---- chain against ops.mla_attention_absorbed (and the naive form once) -------------------------------
@pytest.mark.kernels
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
@pytest.mark.parametrize("version", [1, 2])
def test_mla_chain(rng, interleave, wdtype, version):
    cfg = micro_cfg(rope_interleave=interleave)
    o, refs, _ = run_chain(rng, cfg, 13, 3, wdtype, interleave, version=version)
    assert rel_err(o, refs["kernel_weights"]) < (F32_BOUND if wdtype == "f32" else BF16_ROUNDED_BOUND)
    if wdtype == "bf16":
        assert rel_err(o, refs["unrounded"]) < BF16_UNROUNDED_BOUND


@pytest.mark.kernels
def test_mla_chain_vs_naive(rng):
    cfg = micro_cfg()
    o, refs, args = run_chain(rng, cfg, 6, 3, "f32", True)
    naive = ops.mla_attention_naive(*args).reshape(o.shape)
    assert rel_err(refs["kernel_weights"], naive) < 1e-12
    assert rel_err(o, naive) < F32_BOUND


def test_rope_tables_and_splits():
    cfg = micro_cfg()
    cos, sin = mla.rope_tables(cfg, 50)
    c64, s64 = ops.rope_cos_sin(cfg, np.arange(50), np.float64)
    assert cos.dtype == np.float32 and cos.shape == (50, cfg.qk_rope_head_dim // 2)
    assert rel_err(cos, c64) < 1e-7 and rel_err(sin, s64) < 1e-7
    assert mla.mla_num_splits(32768, 1, 64) > 1  # decode over a long prefix splits
    assert mla.mla_num_splits(0, 256, 64) == 1
    assert mla.mla_scratch_size(4, 2, 16, 1) == 0


# ---- real shapes (H200) -------------------------------------------------------------------------------
GPU_ATT = [(H, L, M) for H in (16, 64) for L in (0, 512, 8192) for M in (1, 16, 64, 256)] + [(16, 32768, 1)]


@pytest.mark.gpu
@pytest.mark.kernels
@pytest.mark.parametrize("H,L,M", GPU_ATT)
@pytest.mark.parametrize("version", [1, 2])
def test_mla_attention_gpu(rng, H, L, M, version):
    check_attention(rng, real_cfg(H), L, M, version=version)


@pytest.mark.gpu
@pytest.mark.kernels
@pytest.mark.parametrize("H,L,M,n_splits", [(64, 8192, 16, 1), (64, 512, 1, 2), (16, 8192, 64, 7)])
@pytest.mark.parametrize("version", [1, 2])
def test_mla_attention_gpu_forced_splits(rng, H, L, M, n_splits, version):
    check_attention(rng, real_cfg(H), L, M, n_splits=n_splits, version=version)


@pytest.mark.gpu
@pytest.mark.kernels
@pytest.mark.parametrize("H,L,M", [(16, 0, 1), (16, 512, 1), (16, 8192, 1), (64, 512, 3), (16, 512, 64),
                                   (4, 100, 2)])
def test_mla_attention_gpu_v2_engine_splits(rng, H, L, M):
    """v2 as the engine calls it: device L, splits from max_len = 8192 + 64 (most of them empty at
    small L), and the other prefetch modes at the default tiling; H = 4 (one warp per block)."""
    cfg = real_cfg(H)
    S = mla.mla_num_splits(8192 + 64, M, H, version=2)
    check_attention(rng, cfg, L, M, n_splits=S, version=2, device_L=True)
    for pf in (0, 1):
        check_attention(rng, cfg, L, M, n_splits=S, device_L=True, params=mla._attn2_params(H, 512, 64) + (pf,))


@pytest.mark.gpu
@pytest.mark.kernels
@pytest.mark.parametrize("H,L,M", [(16, 0, 1), (16, 176, 1), (16, 512, 1), (16, 4095, 1), (16, 8192, 1),
                                   (64, 512, 1), (16, 100, 3)])
def test_mla_attention_gpu_v2_combine_in_launch(rng, H, L, M):
    """The combine in the attention's launch at Moonlight's (H = 16) and Kimi K2's (H = 64) shapes as the engine
    calls it (device L, splits from max_len = 8192 + 64: most empty, and at L = 4095 / 8192 all or most written),
    three launches on one sync array (:func:`check_combine_in_launch`)."""
    check_combine_in_launch(rng, real_cfg(H), L, M, mla.mla_num_splits(8192 + 64, M, H, version=2), launches=3)


@pytest.mark.gpu
@pytest.mark.kernels
@pytest.mark.parametrize("split_keys", [32, 64, 128])
@pytest.mark.parametrize("H,L,M", [(16, 0, 1), (16, 176, 1), (16, 512, 1), (16, 8192, 1), (16, 512, 16)])
def test_mla_attention_gpu_v2_split_keys(rng, H, L, M, split_keys):
    """v2 as the engine calls it (device L, splits from max_len = 8192 + 64) with a floor on a split's keys."""
    S = mla.mla_num_splits(8192 + 64, M, H, version=2)
    check_attention(rng, real_cfg(H), L, M, n_splits=S, device_L=True, split_keys=split_keys)


@pytest.mark.gpu
@pytest.mark.parametrize("H, M, wdtype", [(16, 1, "bf16"), (16, 17, "bf16"), (4, 17, "f32"), (64, 65, "bf16")])
def test_latent_write_and_absorb_fused_gpu(rng, H, M, wdtype):
    check_latent_write_and_absorb(rng, real_cfg(H), M, wdtype, tc_abs=wdtype == "bf16" and M >= mla.QABS_TC_MIN_M)


@pytest.mark.gpu
@pytest.mark.kernels
@pytest.mark.parametrize("H, M", [(16, 32), (16, 65), (16, 256), (64, 65), (16, 2048)])
def test_q_absorb_tc_gpu(rng, H, M):
    """The absorb on tensor cores at Moonlight's (H = 16) and Kimi's (64) shapes, 32 .. 2048 tokens (every plan)."""
    check_q_absorb(rng, real_cfg(H), M, "bf16", interleave=True, version=2, tc_abs=True)


@pytest.mark.gpu
@pytest.mark.kernels
@pytest.mark.parametrize("L,M", [(0, 1), (8192, 16), (512, 256)])
def test_kv_latent_write_gpu(rng, L, M):
    check_kv_latent_write(rng, real_cfg(64), L, M, True, "f32")
    check_kv_latent_write(rng, real_cfg(64, rope_interleave=False), L, M, False, "bf16")


@pytest.mark.gpu
@pytest.mark.kernels
@pytest.mark.parametrize("H", [16, 64])
@pytest.mark.parametrize("M", [1, 2, 16, 65, 256])  # (65: a budget-64 verify; bf16 v2 takes blocks of 3 token tiles)
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
@pytest.mark.parametrize("version", [1, 2])
def test_q_absorb_uv_project_gpu(rng, H, M, wdtype, version):
    cfg = real_cfg(H)
    check_q_absorb(rng, cfg, M, wdtype, interleave=(M != 16), version=version)
    check_uv_project(rng, cfg, M, wdtype, version=version)


@pytest.mark.gpu
@pytest.mark.kernels
@pytest.mark.parametrize("H,L,M", [(16, 512, 16), (64, 0, 1), (64, 512, 16), (16, 8192, 1)])
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("version", [1, 2])
def test_mla_chain_gpu(rng, H, L, M, wdtype, interleave, version):
    cfg = real_cfg(H, rope_interleave=interleave)
    o, refs, _ = run_chain(rng, cfg, L, M, wdtype, interleave, version=version)
    assert rel_err(o, refs["kernel_weights"]) < (F32_BOUND if wdtype == "f32" else BF16_ROUNDED_BOUND)
    if wdtype == "bf16":
        assert rel_err(o, refs["unrounded"]) < BF16_UNROUNDED_BOUND


def code_cfg(**kw):
    """model_code's attention shape (H = 4, Rkv = 64, dr = 16, dn = dv = 32): one-warp attention blocks,
    the small-W_uv uv_project at every M."""
    return preset("micro", num_attention_heads=4, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
                  v_head_dim=32, max_position_embeddings=1024, **kw)


@pytest.mark.kernels
@pytest.mark.parametrize("M", [3, 9, 65])
def test_uv_project_tc(rng, monkeypatch, M):
    """W_uv on tensor cores (kdt.kernels.tc.gemm_kernel a head, uv_uses_tc), against float64 on the rounded weights: 3
    heads, dv = 20 (the block's second row tile partly past dv), Rkv = 24 (6 weight words: the last two of the 4 warps
    splitting them have none), 8-token tiles (the second partial at M = 9; 65: blocks of 3 tiles, the last partial)."""
    monkeypatch.setattr(mla, "UV_TC_MIN_M", 1)
    monkeypatch.setattr(mla, "UV_ROW_PER_WARP_ELEMS", 0)
    cfg = micro_cfg(num_attention_heads=3, kv_lora_rank=24, v_head_dim=20)
    kv_b = cuda.to_device(np.zeros((3 * (cfg.qk_nope_head_dim + 20), 24), np.uint16))
    assert mla.uv_uses_tc(M, kv_b, 3, 20) and not mla.uv_uses_tc(M, kv_b.copy_to_host().astype(np.float32), 3, 20)
    check_uv_project(rng, cfg, M, "bf16", version=2)


def test_uv_project_small_weight_rule():
    """One output row per warp, one token per block at any M for a small W_uv; v1's tiling above M = 2
    for Moonlight's (16 x 128 x 512)."""
    assert mla._uv2_params(64, 65, 4, 32)[2:] == (1, 1)
    assert mla._uv2_params(512, 2, 16, 128)[2:] == (1, 1)
    assert mla._uv2_params(512, 17, 16, 128)[2:] == mla._uv_params(512)[2:] + (mla._uv_tm(17),)


@pytest.mark.gpu
@pytest.mark.kernels
@pytest.mark.parametrize("L,M", [(0, 1), (200, 17), (300, 65)])
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
def test_mla_chain_gpu_code_shape(rng, L, M, wdtype):
    """The learned DDTree step's shapes: kv write, q_absorb, attention with the engine's splits (device L,
    max_len 420: one key tile per one-warp block), uv_project with one row per warp."""
    cfg = code_cfg()
    o, refs, _ = run_chain(rng, cfg, L, M, wdtype, True)
    assert rel_err(o, refs["kernel_weights"]) < (F32_BOUND if wdtype == "f32" else BF16_ROUNDED_BOUND)
    S = mla.mla_num_splits(420, M, 4, 64, 16, version=2)
    check_attention(rng, cfg, L, M, n_splits=S, version=2, device_L=True)


@pytest.mark.gpu
@pytest.mark.kernels
def test_mla_chain_gpu_vs_naive(rng):
    cfg = real_cfg(16)
    o, refs, args = run_chain(rng, cfg, 300, 16, "f32", True)
    assert rel_err(o, ops.mla_attention_naive(*args).reshape(o.shape)) < F32_BOUND


# ---- version 2 on tensor cores (kdt.kernels.attn_tc) ---------------------------------------------------------------
# products of float32 split into bf16 hi + lo, three mma a product (hi hi, hi lo, lo hi): ~2^-17 of a product where
# float32 FMAs have 2^-24; measured 3-7e-6 at the simulator's shapes, 2.7e-5 at Moonlight's L = 8192 (session 32,
# s32a). Without the lo terms a kernel is at bf16's ~2^-9, a hundred times past the bound
TC_BOUND = 5e-5


def check_attention_tc(rng, cfg, L, M, S, general_vis=False):
    """kdt.kernels.attn_tc against the float64 reference as the engine calls it (device L, the pre-split cache), S
    splits (S > 1: NaN-poisoned partials, the version 2 combine), within TC_BOUND; and from the float32 caches
    (key tiles split in shared memory: the drafter's path), bit for bit the same."""
    return check_attention(rng, cfg, L, M, n_splits=S, general_vis=general_vis, device_L=True, on_tc=True,
                           bound=TC_BOUND, hl=True)


@pytest.mark.kernels
@pytest.mark.parametrize("L,M,S", [(0, 3, 1), (21, 5, 1), (40, 5, 3), (7, 2, 4)])
def test_mla_attention_tc(rng, L, M, S):
    """model_code's attention shape (H = 4, Rkv = 64, dr = 16: 5 feature steps over 4 warps, 3 of them zero), 16-key
    tiles, blocks of 2 m-tiles: M H = 20 rows (the second m-tile partly past M H), a last tile partly past L + M,
    empty splits (L = 7, M = 2: one tile, 3 of 4 splits empty), 3 splits of one tile, an unsplit prefix of 26 keys."""
    check_attention_tc(rng, code_cfg(), L, M, S)


@pytest.mark.kernels
def test_mla_attention_tc_general_vis(rng):
    """Visibility that is no tree (a row may see a later slot, not see slot L) over 2 splits."""
    check_attention_tc(rng, code_cfg(), 9, 6, 2, general_vis=True)


@pytest.mark.kernels
@pytest.mark.parametrize("L,M,S,general,visible", [(0, 24, 1, False, True), (3, 24, 3, False, True),
                                                   (2, 24, 2, True, True), (3, 24, 3, False, False)])
def test_mla_attention_tc_visible_tiles(rng, monkeypatch, L, M, S, general, visible):
    """A block's key tiles stop after the last key its rows see (``t_end``): 24 tokens of model_code's 4 heads, 8
    tokens a block. A tree's node sees no later node, so block b stops at key L + 8 b + 7, inside a tile (the keys
    past it in that tile masked by t_end alone); with S = 3 the blocks of early tokens find no visible key in later
    splits and write empty partials. A general pattern (rows that see later slots) stops at the last key any of the
    block's rows sees: a kernel that took every mask for causal fails it. ``visible`` False: every block over its
    split's keys (``KDT_MLA_ATTN_TC_VISIBLE=0``)."""
    from kdt.kernels import attn_tc

    monkeypatch.setattr(attn_tc, "VISIBLE_TILES", visible)
    check_attention_tc(rng, code_cfg(), L, M, S, general_vis=general)


def check_shared_by_prefix(rng, cfg, M: int, S: int, LX: int) -> None:
    """Token counts that both kernels take by prefix (attn_tc.shares_tc: M tokens, the tensor cores from LX keys):
    with L on the device (a CUDA graph) both launch into the same NaN-poisoned partials, each returning at once
    outside its prefixes (the FMA kernel in fewer splits of its own than the launch's S: the combine must read the
    layout that L names), at L = LX the result is the tensor-core kernel's alone, bit for bit, at LX - 1 within
    F32_BOUND; an L on the host picks one kernel. Each kernel alone at a prefix that is not its own writes nothing
    (so below LX the result is the FMA kernel's)."""
    from kdt.kernels import attn_tc

    H, Rkv, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    assert attn_tc.shares_tc(M, H, Rkv, dr) and not attn_tc.uses_tc(M, H, Rkv, dr) and attn_tc.long_l(M) == LX
    assert mla.mla_num_splits(LX + 40, M, H, Rkv, dr) == attn_tc.num_splits(LX + 40, M, H)
    assert 1 < mla._fma_splits(LX, M, H, Rkv, dr) < S  # the FMA kernel's own splits, fewer than the launch's
    for L in (LX - 1, LX):  # (simulator time: the tensor-core kernel runs twice, the FMA kernel twice)
        q_abs, q_pe, c_kv, k_pe, vis, scale = attention_inputs(rng, cfg, L, M)
        ref, _ = ref_o_lat(q_abs, q_pe, c_kv[:L + M], k_pe[:L + M], full_mask(L, vis), scale)
        both = run_attention(q_abs, q_pe, c_kv, k_pe, L, vis, scale, n_splits=S, device_L=True, hl=True)
        other = run_attention(q_abs, q_pe, c_kv, k_pe, L, vis, scale, n_splits=S, device_L=L >= LX, hl=True,
                              on_tc=True if L >= LX else None)  # the tensor cores alone; the FMA kernel by host L
        assert rel_err(both, ref) < (TC_BOUND if L >= LX else F32_BOUND), (L, rel_err(both, ref))
        if L >= LX:
            np.testing.assert_array_equal(both, other)
        else:
            assert rel_err(other, ref) < F32_BOUND
    dev = cuda.to_device
    q_abs, q_pe, c_kv, k_pe, vis, scale = attention_inputs(rng, cfg, LX + 6, M)
    args = [dev(q_abs), dev(q_pe), dev(c_kv), dev(k_pe), None, dev(vis.astype(np.uint8)), np.float32(scale)]
    for L, launch in ((LX - 14, "tc"), (LX + 6, "fma")):  # each at the other's prefixes: its outputs stay poisoned
        args[4] = dev(np.array([L], np.int64))
        o, part = dev(poisoned((M, H, Rkv))), dev(poisoned(mla.mla_scratch_size(M, H, Rkv, S)))
        if launch == "tc":
            attn_tc.attention(*args, o, part, S, kv_hl=dev(mla.kv_hl_np(c_kv, k_pe)), LMIN=LX)
        else:
            k = mla._attention2_kernel(Rkv, dr, *mla._attn2_params(H, Rkv, dr), LMAX=LX, SOWN=S)
            k[(-(-H // k.geom["R"]), M, S), k.geom["NT"]](*args, o, part)
        assert np.isnan(o.copy_to_host()).all() and np.isnan(part.copy_to_host()).all(), launch


@pytest.mark.kernels
def test_mla_attention_shared_by_prefix(rng, monkeypatch):
    """check_shared_by_prefix at model_code's shape, M = 5 in the shared range, the tensor cores from 24 keys (four
    times TC_LONG_L below 32 tokens)."""
    from kdt.kernels import attn_tc

    monkeypatch.setattr(attn_tc, "TC_MIN_M", 100)
    monkeypatch.setattr(attn_tc, "TC_LONG_M", 4)
    monkeypatch.setattr(attn_tc, "TC_LONG_L", 6)
    check_shared_by_prefix(rng, code_cfg(), 5, 3, 24)


def test_mla_attention_tc_dispatch(monkeypatch):
    """KDT_MLA_ATTN_TC_M: version 2's splits (and so the engine's scratch) follow the tensor-core kernel from that M on,
    for shapes it takes; off (0) they are the FMA kernel's. KDT_MLA_ATTN_TC_LONG_M: from there up to TC_MIN_M both
    kernels share the token count by prefix from long_l(M) keys on, with the tensor cores' splits (the FMA kernel a
    count of its own), where the cache reaches that prefix."""
    from kdt.kernels import attn_tc

    monkeypatch.setattr(attn_tc, "TC_MIN_M", 96)
    monkeypatch.setattr(attn_tc, "TC_LONG_M", 16)
    monkeypatch.setattr(attn_tc, "TC_LONG_L", 1024)
    assert [attn_tc.shares_tc(M, 16, 512, 64) for M in (15, 16, 95, 96)] == [False, True, True, False]
    assert [attn_tc.long_l(M) for M in (16, 31, 32, 63, 64, 95)] == [4096, 4096, 2048, 2048, 1024, 1024]
    assert attn_tc.shares_tc(64, 16, 512, 64, 1024) and not attn_tc.shares_tc(63, 16, 512, 64, 1024)
    assert attn_tc.runs_tc(16, 512, 64, 64, 1024) and not attn_tc.runs_tc(16, 512, 64, 63, 2047)
    assert attn_tc.runs_tc(16, 512, 64, 96, 100) and not attn_tc.runs_tc(2, 16, 4, 256, 8192)  # any L; Rkv % 64
    assert mla.mla_num_splits(8192, 70, 16, version=2) == attn_tc.num_splits(8192, 70, 16)
    assert mla.mla_num_splits(1000, 70, 16, version=2) == mla._fma_splits(1000, 70, 16, 512, 64)  # never shared
    monkeypatch.setattr(attn_tc, "TC_LONG_M", 0)
    assert not attn_tc.shares_tc(64, 16, 512, 64) and not attn_tc.runs_tc(16, 512, 64, 95, 8192)
    monkeypatch.setattr(attn_tc, "TC_MIN_M", 16)
    assert mla.mla_num_splits(8192, 64, 16, version=2) == attn_tc.num_splits(8192, 64, 16)
    assert attn_tc.num_splits(8192, 64, 16) == 8  # 32 blocks of 32 rows, 2 blocks an SM on 132 SMs
    assert attn_tc.num_splits(8192, 256, 16) == 2
    assert attn_tc.num_splits(50, 64, 16) == 1 and attn_tc.num_splits(100, 64, 16) == 2  # 114, 164 keys: 128 a split
    assert not attn_tc.uses_tc(8, 16, 512, 64) and not attn_tc.uses_tc(64, 2, 16, 4)  # M < 16; Rkv % 64
    monkeypatch.setattr(attn_tc, "TC_MIN_M", 0)
    assert not attn_tc.uses_tc(64, 16, 512, 64)


@pytest.mark.gpu
@pytest.mark.kernels
@pytest.mark.parametrize("H,L,M", [(16, 0, 16), (16, 512, 16), (16, 8192, 64), (16, 512, 256), (16, 8192, 256),
                                   (16, 0, 256), (64, 512, 16), (64, 8192, 64), (4, 100, 17)])
def test_mla_attention_tc_gpu(rng, H, L, M):
    """On tensor cores at real shapes, as the engine calls it (device L, splits from max_len = 8192 + 256), and in
    one split; (16, 0, 256): a prefill's tree of 256 tokens, whose blocks stop at their last visible key after 1 to
    16 of the 16 tiles."""
    from kdt.kernels import attn_tc

    cfg = real_cfg(H)
    check_attention_tc(rng, cfg, L, M, attn_tc.num_splits(8192 + 256, M, H))
    check_attention_tc(rng, cfg, L, M, 1)


@pytest.mark.gpu
@pytest.mark.kernels
def test_mla_attention_shared_by_prefix_gpu(rng, monkeypatch):
    """check_shared_by_prefix at Moonlight's shape, 64 tokens shared (the tensor cores from TC_LONG_L keys), the
    engine's splits."""
    from kdt.kernels import attn_tc

    monkeypatch.setattr(attn_tc, "TC_MIN_M", 128)
    monkeypatch.setattr(attn_tc, "TC_LONG_M", 64)
    check_shared_by_prefix(rng, real_cfg(16), 64, attn_tc.num_splits(8192 + 256, 64, 16), attn_tc.TC_LONG_L)
