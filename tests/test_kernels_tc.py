"""kdt.kernels.tc (tensor cores: mma.sync m16n8k16 bf16, x as bf16 hi + lo) against float64.

The warp tile alone, through :func:`tc.gemm_kernel` (y = X W^T): natural, word-permuted and hi / lo X, 1-2 row tiles,
1-2 token tiles, several warps splitting K with the last groups partly or wholly past it, warps in row groups
(kw), the loads staged through shared memory (st), the weights in fragment order (fo: the same sums, bit for bit),
ragged M and N. Bound:
rel_err < 1e-5 against float64 on the bf16-rounded weights. A kernel that dropped the lo half of x (bf16 x) would
be at ~1e-3, one that misplaced a fragment or a k group at ~1 (the split's own check below).
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from kdt.kernels import tc
from kdt.kernels.common import IS_SIM, bf16_bits_to_f32, f32_to_bf16_bits
from kdt.testing import poisoned, rel_err

BOUND = 1e-5


def k_bound(K: int) -> float:
    """BOUND, or at long K the bias of the mma's float32 accumulation: it truncates at each k step of 16, about half
    an ulp (2^-24 relative) a step, so K / 16 steps drift by ~K * 2^-28 (seen on the H200, session 37: 1.8e-5 at
    K = 11264, one warp accumulating the whole K). A kernel that drops x's lo half is off by ~1e-3 at any K."""
    return max(BOUND, K * 2.0**-28)


def _gemm(rng, M, N, K, rt, nt, u, nw, xl, E=1, e=0, accumulate=False, kw=0, st=0, fo=False, out=None):
    """Run the tile on fresh inputs (y poisoned); returns (rel_err, rel_err with bf16 x). ``fo``: the weights in
    fragment order (``tc.to_fo``); ``out``: a list that gets y."""
    W = (rng.standard_normal((E, N, K)) / np.sqrt(K)).astype(np.float32)
    bits = f32_to_bf16_bits(W)
    Wseen = bf16_bits_to_f32(bits[e]).astype(np.float64)
    X = rng.standard_normal((M, K)).astype(np.float32)
    Xd = {tc.XL_NATURAL: X, tc.XL_PERM: X.reshape(M, K // 4, 4).transpose(0, 2, 1).reshape(M, K).copy(),
          tc.XL_HILO: tc.hilo_np(X)}[xl]
    y0 = rng.standard_normal((M, N)).astype(np.float32) if accumulate else poisoned((M, N))
    y = cuda.to_device(y0)
    k = tc.gemm_kernel(rt, nt, u, nw, xl, kw, st=st, fo=fo)
    grid = (-(-M // (8 * nt)), -(-N // (16 * rt * (nw // (kw or nw)))))
    Wd = cuda.to_device(bits.view(np.uint64))
    k[grid, nw * 32](cuda.to_device(Xd), tc.to_fo(Wd) if fo else Wd, e, y, accumulate)
    got = y.copy_to_host()
    if out is not None:
        out.append(got)
    ref = X.astype(np.float64) @ Wseen.T + (y0 if accumulate else 0.0)
    x_bf16 = bf16_bits_to_f32(f32_to_bf16_bits(X)).astype(np.float64)
    return rel_err(got, ref), rel_err(x_bf16 @ Wseen.T, ref)


NAT, PERM, HILO = tc.XL_NATURAL, tc.XL_PERM, tc.XL_HILO
SIM_CASES = [  # M, N, K, rt, nt, u, nw, xl, kw, st
    (5, 20, 40, 1, 1, 1, 1, NAT, 0, 0),  # one warp, K = 10 words: a partial group
    (9, 40, 72, 2, 2, 2, 2, PERM, 0, 0),  # 2 x 2 tiles, permuted x, the second warp's groups partly past K
    (17, 33, 24, 1, 2, 3, 3, NAT, 0, 0),  # 3 warps over 2 groups: the last warp's group wholly past K
    (9, 70, 40, 1, 2, 1, 4, PERM, 2, 0),  # 2 row groups of 2 warps splitting K, the last block's rows partly past N
    (7, 40, 24, 1, 1, 2, 3, NAT, 1, 0),  # 3 row groups of one warp (no K split), the third wholly past N
    (9, 40, 72, 2, 2, 2, 2, HILO, 0, 0),  # hi / lo x: 2 x 2 tiles, 2 groups a step, the second warp's partly past K
    (11, 36, 40, 1, 2, 3, 1, HILO, 0, 0),  # hi / lo x, one warp: a full step of 3 groups, then 1 masked group
    # staged through shared memory (st stages; K a multiple of 8)
    (9, 40, 72, 2, 2, 2, 2, HILO, 0, 2),  # 2 x 2 tiles, 2 groups a step, the second warp's step partly past K
    (7, 24, 200, 1, 1, 1, 2, HILO, 0, 3),  # 7 steps a warp: the ring of 3 wraps twice; the last group partly past K
    (11, 36, 40, 1, 2, 3, 1, NAT, 0, 3),  # float32 x, one step of 3 groups, its last 2 words past K
    (17, 33, 24, 1, 2, 1, 3, HILO, 0, 4),  # the third warp wholly past K; fewer steps than the ring's 3 ahead
    (9, 70, 40, 1, 2, 1, 4, NAT, 2, 2),  # 2 row groups of 2 warps, float32 x, the last block's rows partly past N
]


@pytest.mark.kernels
@pytest.mark.parametrize("M,N,K,rt,nt,u,nw,xl,kw,st", SIM_CASES)
def test_tc_gemm(rng, M, N, K, rt, nt, u, nw, xl, kw, st):
    if not IS_SIM:
        pytest.skip("simulator shapes (the GPU's are in test_tc_gemm_gpu)")
    err, err_bf16_x = _gemm(rng, M, N, K, rt, nt, u, nw, xl, E=2, e=1, accumulate=xl == PERM, kw=kw, st=st)
    assert err < BOUND, f"rel_err {err:.3g}"
    assert err_bf16_x > 10 * BOUND  # the bound tells a kernel without the lo half of x


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,rt,nt,u,nw,xl,kw,st", [
    (64, 2816, 2048, 2, 1, 4, 4, PERM, 0, 0),  # Moonlight's shared gate_up rows, 64 tokens
    (6, 2048, 1408, 2, 1, 2, 4, PERM, 0, 0),  # a routed down: ~6 tokens an expert
    (256, 576, 2048, 1, 2, 2, 4, NAT, 0, 0),  # kv_a's rows, 256 tokens
    (33, 1000, 1004, 2, 2, 4, 3, NAT, 0, 0),  # ragged everything
    (64, 3000, 2048, 2, 4, 2, 4, NAT, 1, 0),  # four row groups of one warp, the last block partly past N
    (33, 1000, 1004, 2, 2, 4, 3, HILO, 0, 0),  # hi / lo x, ragged everything
    (64, 2816, 2048, 2, 4, 2, 4, HILO, 0, 0),  # hi / lo x, the lm_head's plan at 64 tokens
    (16, 2816, 2048, 2, 2, 1, 4, HILO, 0, 4),  # staged: a routed gate_up's plan at 2 token tiles, 4 stages
    (6, 2048, 1408, 2, 2, 1, 4, HILO, 0, 3),  # staged: a routed down, 3 stages
    (33, 1000, 1008, 2, 2, 2, 3, NAT, 0, 3),  # staged, float32 x, ragged M and N
])
def test_tc_gemm_gpu(rng, M, N, K, rt, nt, u, nw, xl, kw, st):
    err, _ = _gemm(rng, M, N, K, rt, nt, u, nw, xl, accumulate=M == 33, kw=kw, st=st)
    assert err < BOUND, f"rel_err {err:.3g}"


def test_token_tiles(monkeypatch):
    """Blocks of token tiles that pad M least: 65 tokens (a budget-64 verify) in blocks of 3 tiles (72 computed), not 4
    (96); all tiles where they fit; ties to the most tiles; never fewer than just over half of ``most``; the plans of
    linear_tc, uv_project and the absorb on it; KDT_TC_TILES_FIT=0 gives ``most``."""
    from kdt.kernels import linear as lin
    from kdt.kernels import mla

    cases = {(1, 4): 1, (17, 4): 3, (32, 4): 4, (64, 4): 4, (65, 4): 3, (96, 4): 4, (100, 4): 3, (129, 4): 3,
             (256, 4): 4, (65, 2): 2, (65, 8): 5, (300, 8): 8}  # (65, 8): 9 tiles, 5 x 2 = 10 beats 8 x 2 = 16
    assert {k: tc.token_tiles(*k) for k in cases} == cases
    assert lin.tc_plan(65, 3648, 2048)[1] == mla._uv_tc_plan(65)[1] == mla._absorb_tc_plan(65)[1] == 3
    assert lin.tc_plan(64, 3648, 2048)[1] == 4 and mla._uv_tc_plan(64)[1] == 2
    monkeypatch.setattr(tc, "TILES_FIT", False)
    assert tc.token_tiles(65, 4) == 4 and tc.token_tiles(17, 4) == 3


def test_tc_plans_warps(monkeypatch):
    """The warps of linear_tc's plan: 8 on K where N <= 4096, 4 where that grid would pass TC_WIDE_BLOCKS blocks (qkv_a
    at 65 tokens: 114 x 3) with K <= 4096; KDT_TC_WIDE_BLOCKS=0 gives 8. The tiled GEMM's plan: 8 warps side by side
    on 256 rows, four stages, up to WIDE_MAX_M tokens (the lm_head at 65); 4 x 2 warps on 128 rows past it or with
    KDT_TILED_WIDE_M=0."""
    from kdt.kernels import linear as lin
    from kdt.kernels import tc_tiled

    warps = {(64, 3648, 2048): 8, (65, 3648, 2048): 4, (65, 2048, 2048): 8, (65, 2048, 11264): 8,
             (16, 3648, 2048): 8, (65, 22528, 2048): 4}
    assert {k: lin.tc_plan(*k)[3] for k in warps} == warps
    assert all(lin.tc_plan(*k)[3] == lin.tc_plan(*k)[4] for k in warps)
    monkeypatch.setattr(lin, "TC_WIDE_BLOCKS", 0)
    assert lin.tc_plan(65, 3648, 2048)[3] == 8
    monkeypatch.setattr(tc_tiled, "IS_SIM", False)
    plans = {65: (8, 1, 2, 9, 4), 72: (8, 1, 2, 9, 4), 16: (8, 1, 2, 2, 4), 73: (4, 2, 2, 5, 3), 128: (4, 2, 2, 8, 3)}
    assert {M: tc_tiled.plan(M) for M in plans} == plans
    monkeypatch.setattr(tc_tiled, "WIDE_MAX_M", 0)
    assert tc_tiled.plan(65) == (4, 2, 2, 5, 3)


FO_SIM_CASES = [  # M, N, K, rt, nt, u, nw, kw: x hi / lo, N % 16 == 0, K % 16 == 0
    (9, 32, 64, 2, 2, 2, 2, 0),  # 2 x 2 tiles, 2 warps splitting K, one full step each
    (11, 48, 80, 1, 2, 3, 1, 0),  # one warp: a full step of 3 groups, then 2 masked ones; 3 blocks of rows
    (9, 64, 48, 1, 2, 1, 4, 2),  # 2 row groups of 2 warps splitting K (the second warp's group past K)
    (7, 32, 32, 1, 1, 2, 3, 1),  # 3 row groups of one warp, the third's tile wholly past N (its clamped rows)
]


@pytest.mark.kernels
@pytest.mark.parametrize("M,N,K,rt,nt,u,nw,kw", FO_SIM_CASES)
def test_tc_gemm_fragment_order(rng, M, N, K, rt, nt, u, nw, kw):
    if not IS_SIM:
        pytest.skip("simulator shapes (the GPU's are in test_tc_gemm_fragment_order_gpu)")
    seed = int(rng.integers(1 << 30))
    ys: list = []
    err, _ = _gemm(np.random.default_rng(seed), M, N, K, rt, nt, u, nw, HILO, E=2, e=1, kw=kw, fo=True, out=ys)
    assert err < BOUND, f"rel_err {err:.3g}"
    _gemm(np.random.default_rng(seed), M, N, K, rt, nt, u, nw, HILO, E=2, e=1, kw=kw, out=ys)  # natural order
    assert np.array_equal(ys[0], ys[1])  # the same fragments: the same sums


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,rt,nt,u,nw,kw", [
    (64, 2816, 2048, 2, 4, 2, 4, 0),  # Moonlight's routed gate_up rows of one expert, 64 tokens
    (6, 2048, 1408, 2, 1, 2, 4, 0),  # a routed down: ~6 tokens an expert
    (40, 2048, 1408, 2, 2, 4, 4, 2),  # 2 row groups of 2 warps, 4 groups a step
    (33, 1008, 1040, 2, 2, 3, 3, 0),  # 65 groups over 3 warps of 22: 7 steps of 3, then one group at the addresses
    # (the last warp's past K: its loads skipped)
])
def test_tc_gemm_fragment_order_gpu(rng, M, N, K, rt, nt, u, nw, kw):
    seed = int(rng.integers(1 << 30))
    ys: list = []
    err, _ = _gemm(np.random.default_rng(seed), M, N, K, rt, nt, u, nw, HILO, kw=kw, fo=True, out=ys)
    assert err < k_bound(K), f"rel_err {err:.3g}"
    _gemm(np.random.default_rng(seed), M, N, K, rt, nt, u, nw, HILO, kw=kw, out=ys)
    assert np.array_equal(ys[0], ys[1])


@pytest.mark.kernels
def test_fragment_order_layout(rng):
    """``tc.fo_np`` puts lane (g, t)'s mma registers a0 .. a3 of a row tile's group (module docstring) at its 16
    bytes, and ``tc.to_fo`` (the device kernel) writes the same array."""
    E, N, Kw = 2, 32, 12
    W = rng.integers(0, np.iinfo(np.uint64).max, size=(E, N, Kw), dtype=np.uint64)
    F = tc.fo_np(W)
    w32, f32 = W.view(np.uint32).reshape(E, N, Kw, 2), F.view(np.uint32).reshape(E, N // 16, Kw // 4, 32, 4)
    for e, tile, grp, lane in [(0, 0, 0, 0), (1, 1, 2, 31), (0, 1, 1, 13), (1, 0, 2, 6)]:
        g, t = divmod(lane, 4)
        r, w = 16 * tile + g, 4 * grp + t
        want = [w32[e, r, w, 0], w32[e, r + 8, w, 0], w32[e, r, w, 1], w32[e, r + 8, w, 1]]  # a0, a1, a2, a3
        assert list(f32[e, tile, grp, lane]) == want
    assert np.array_equal(tc.to_fo(cuda.to_device(W)).copy_to_host(), F)
    assert np.array_equal(np.sort(F.view(np.uint32), axis=None), np.sort(W.view(np.uint32), axis=None))
    with pytest.raises(ValueError, match="fragment order"):
        tc.fo_np(W[:, :24])


def _tiled(rng, M, N, K, plan, xl, accumulate, plans=()):
    """kdt.kernels.tc_tiled on fresh inputs (y poisoned, or random and accumulated into); (rel_err, rel_err with bf16
    x) against float64 on the bf16 weights. ``plans``: also run at each of these, its y the bits of ``plan``'s."""
    from kdt.kernels import tc_tiled

    W = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
    bits = f32_to_bf16_bits(W)
    X = rng.standard_normal((M, K)).astype(np.float32)
    y0 = rng.standard_normal((M, N)).astype(np.float32) if accumulate else poisoned((M, N))
    x, w = cuda.to_device(tc.hilo_np(X) if xl == HILO else X), cuda.to_device(bits)
    outs = []
    for p in (plan, *plans):
        y = cuda.to_device(y0)
        tc_tiled.tiled_gemm(x, w, y, accumulate, plan_=p)
        outs.append(y.copy_to_host())
    for other in outs[1:]:
        np.testing.assert_array_equal(other, outs[0])
    Wseen = bf16_bits_to_f32(bits).astype(np.float64)
    ref = X.astype(np.float64) @ Wseen.T + (y0 if accumulate else 0.0)
    x_bf16 = bf16_bits_to_f32(f32_to_bf16_bits(X)).astype(np.float64)
    return rel_err(outs[0], ref), rel_err(x_bf16 @ Wseen.T, ref)


@pytest.mark.kernels
@pytest.mark.parametrize("M,N,K,plan,xl,accumulate", [
    (13, 40, 64, (1, 2, 1, 1, 2), HILO, False),  # 2 steps through a ring of 2; partial token tile, partial row block
    (21, 24, 128, (1, 2, 1, 2, 3), NAT, True),  # float32 x split as it is loaded; 4 steps through a ring of 3
    (20, 40, 96, (2, 1, 1, 1, 3), HILO, True),  # 2 row tiles' warps; 3 token blocks, the last of 4 tokens
    (9, 40, 160, (2, 1, 1, 2, 4), HILO, False),  # warps side by side on rows (plan's wide form), 5 steps, 4 stages
])
def test_tc_tiled_gemm(rng, M, N, K, plan, xl, accumulate):
    """The block-tiled GEMM (kdt.kernels.tc_tiled: weight and x tiles staged by cp.async in a ring of stages, warps
    on row tiles x token tiles of them) against float64, at the simulator's small plans (wn, wm, rt, tt, st)."""
    if not IS_SIM:
        pytest.skip("simulator shapes (the GPU's are in test_tc_tiled_gemm_gpu)")
    err, err_bf16_x = _tiled(rng, M, N, K, plan, xl, accumulate)
    assert err < BOUND, f"rel_err {err:.3g}"
    assert err_bf16_x > 10 * BOUND  # the bound tells a kernel without the lo half of x


@pytest.mark.kernels
@pytest.mark.parametrize("M,N,K,plan,xl", [
    (13, 40, 64, (1, 2, 1, 1, 2), HILO),  # as test_tc_tiled_gemm's first case
    (21, 24, 128, (1, 2, 1, 2, 3), NAT),  # float32 x: its source offsets move 32 words a step
    (11, 40, 96, (1, 3, 1, 1, 2), HILO),  # 96 threads for 64 weight copies: the last threads copy no weights
    (7, 56, 64, (3, 1, 1, 1, 3), NAT),  # 96 threads for 64 x copies; 48 rows a block past N = 56
])
def test_tc_tiled_gemm_pre_same_bits(rng, M, N, K, plan, xl):
    """kdt.kernels.tc_tiled.PRE: each thread's copy offsets computed before the k loop give the bits of the copies
    computed at every step (the same copies), and the float64 bound, at plans whose copies do not divide evenly over
    the block's threads."""
    if not IS_SIM:
        pytest.skip("simulator shapes (the GPU's are in test_tc_tiled_gemm_gpu)")
    err, _ = _tiled(rng, M, N, K, (*plan, 0), xl, False, plans=[(*plan, 1)])
    assert err < BOUND, f"rel_err {err:.3g}"


@pytest.mark.kernels
def test_linear_tc_takes_the_tiled_gemm_from_tiled_min_m(rng, monkeypatch):
    """linear_tc runs the block-tiled GEMM from kdt.kernels.linear.TILED_MIN_M tokens on a weight of TILED_MIN_N rows
    or more, where K % 32 == 0 and x is contiguous (a column slice of x, fewer tokens or fewer rows keep the warp
    tile), with the same result to the bound."""
    from kdt.kernels import linear as lin
    from kdt.kernels import tc_tiled

    if not IS_SIM:
        pytest.skip("simulator shapes")
    calls = []
    run = tc_tiled.tiled_gemm
    monkeypatch.setattr(tc_tiled, "tiled_gemm", lambda *a, **k: calls.append(1) or run(*a, **k))
    monkeypatch.setattr(lin, "TILED_MIN_M", 9)
    M, N, K = 11, 24, 64
    monkeypatch.setattr(lin, "TILED_MIN_N", N)
    W = f32_to_bf16_bits((rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32))
    X = rng.standard_normal((M, 2 * K)).astype(np.float32)
    ref = X[:, :K].astype(np.float64) @ bf16_bits_to_f32(W).astype(np.float64).T
    for x, tiled in ((cuda.to_device(np.ascontiguousarray(X[:, :K])), True), (cuda.to_device(X)[:, :K], False),
                     (cuda.to_device(np.ascontiguousarray(X[:8, :K])), False)):
        y = cuda.to_device(poisoned((x.shape[0], N)))
        n = len(calls)
        lin.linear_tc(x, cuda.to_device(W), y)
        assert (len(calls) > n) == tiled
        assert rel_err(y.copy_to_host(), ref[: x.shape[0]]) < BOUND
    monkeypatch.setattr(lin, "TILED_MIN_N", N + 1)  # a weight of fewer rows: the warp tile
    n = len(calls)
    lin.linear_tc(cuda.to_device(np.ascontiguousarray(X[:, :K])), cuda.to_device(W),
                  cuda.device_array((M, N), np.float32))
    assert len(calls) == n


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,xl", [
    (65, 163840, 2048, HILO),  # Moonlight's lm_head in a budget-64 verify
    (16, 3648, 2048, HILO),  # [q_a | kv_a], 16 tokens (one token tile a warp)
    (256, 22528, 2048, HILO),  # the dense gate_up's shape, a 256-token chunk: two token blocks of 128
    (100, 2048, 11264, NAT),  # the dense down: float32 x, long K (float32 x at 7-8 token tiles compiles in ~1-2 min)
    (37, 1000, 1024, HILO),  # ragged M and N
])
def test_tc_tiled_gemm_gpu(rng, M, N, K, xl):
    """The block-tiled GEMM at its default plans (kdt.kernels.tc_tiled.plan) against float64, y accumulated into; with
    each thread's copy offsets computed once (tc_tiled.PRE switched) the same bits."""
    from kdt.kernels import tc_tiled

    plan = tc_tiled.plan(M)
    err, _ = _tiled(rng, M, N, K, None, xl, accumulate=True, plans=[(*plan, not tc_tiled.PRE)])
    assert err < k_bound(K), f"rel_err {err:.3g}"


@cuda.jit
def _split_kernel(x, hi, lo):
    i = cuda.grid(1)
    if 2 * i + 1 < x.shape[0]:
        hi[i], lo[i] = tc.split_bf16x2(x[2 * i], x[2 * i + 1])


@pytest.mark.kernels
def test_split_bf16x2(rng):
    """hi + lo carries x to ~2^-17 (x - hi is exact, lo its rounding); hi is x rounded to nearest even, the first
    element of each pair in the low halves."""
    x = (rng.standard_normal(512) * np.exp(rng.uniform(-20, 20, 512))).astype(np.float32)
    hi, lo = cuda.to_device(np.zeros(256, np.uint32)), cuda.to_device(np.zeros(256, np.uint32))
    _split_kernel[2, 128](cuda.to_device(x), hi, lo)
    h, lw = hi.copy_to_host(), lo.copy_to_host()
    pairs = np.stack([h & 0xFFFF, h >> 16], axis=1).reshape(-1).astype(np.uint16)
    np.testing.assert_array_equal(pairs, f32_to_bf16_bits(x))
    lo_f = bf16_bits_to_f32(np.stack([lw & 0xFFFF, lw >> 16], axis=1).reshape(-1).astype(np.uint16))
    total = bf16_bits_to_f32(pairs).astype(np.float64) + lo_f.astype(np.float64)
    assert np.all(np.abs(total - x) <= 2.0 ** -16 * np.abs(x))


@cuda.jit
def _put_hilo_kernel(x, xs):
    r, k = cuda.grid(2)
    if r < x.shape[0] and k < x.shape[1]:
        tc.put_hilo(xs, r, k, x[r, k])


@pytest.mark.kernels
def test_put_hilo(rng):
    """The device's hi / lo layout (put_hilo, each element from its own thread) is the host's (hilo_np), bit for
    bit; hi + lo carries x to ~2^-17 and a gemm on it keeps the bound (test_tc_gemm's hi / lo cases)."""
    x = (rng.standard_normal((3, 24)) * np.exp(rng.uniform(-20, 20, (3, 24)))).astype(np.float32)
    xs = cuda.to_device(np.full((3, 12), 0x7FC07FC07FC07FC0, np.uint64))  # poisoned: NaN bf16s
    _put_hilo_kernel[(1, 1), (4, 24)](cuda.to_device(x), xs.view(np.uint16))
    got = xs.copy_to_host()
    np.testing.assert_array_equal(got, tc.hilo_np(x))
    halves = got.view(np.uint16).reshape(3, 6, 2, 4)
    total = (bf16_bits_to_f32(halves[:, :, 0]).astype(np.float64)
             + bf16_bits_to_f32(halves[:, :, 1]).astype(np.float64)).reshape(3, 24)
    assert np.all(np.abs(total - x) <= 2.0 ** -16 * np.abs(x))
