"""Dense linear, v1 (skinny / tiled GEMM) against v2 (register-tiled, split-K): GPU-only time per shape.

    python scripts/bench_linear.py [--presets moonlight-16b-a3b,kimi-k2] [--M 1,4,8,16,32,64,128]
                                   [--big-M 512,2048] [--sweep] [--json PATH]
    python scripts/bench_linear.py --fixture fixtures/model_code.h5 [--M 1,16,17,32] [--json PATH]
    python scripts/bench_linear.py --presets moonlight-16b-a3b --M 16,64,256 --tc 64 [--jobs 14]   # tensor cores
    python scripts/bench_linear.py --presets moonlight-16b-a3b --M 64,65 --tc 65 --plans '2,4,2,8,8;2,3,2,8,8'
    python scripts/bench_linear.py --presets moonlight-16b-a3b --M 16,64,65,256 --tiled   # the block-tiled GEMM
    python scripts/bench_linear.py --presets moonlight-16b-a3b --M 65 --tiled --layers lm_head --tiled-plans '4,2,2,5,6'
    python scripts/bench_linear.py --presets moonlight-16b-a3b --M 1 --post   # o_proj, then the MoE's input norm

Times each kernel like ``python -m kdt.kernels.bench`` (kdt/kernels/bench.py: launches queued behind
a spin kernel, CUDA events around the batch; weights rotated over >= 128 MB of copies so each launch
reads its matrix from HBM, bf16 weights). Prints per shape and M: v1 and v2 microseconds, the speedup,
v2's GB/s and % of the measured copy bandwidth (bytes that must move once: weights + x + y), both
TFLOP/s, v2's plan (token tile TM, K-splits S) and the relative difference of the two outputs (a
sanity check; correctness is tests/test_kernels_linear.py's business). ``--big-M`` adds prefill-sized
M for the non-lm_head shapes (where v1 is the tiled GEMM). ``--sweep`` then times v2 over token tiles
(8, 16), warps per block (4, 8) and K-splits at M = 16 and 64 and prints the best plan beside the
default one (to retune kdt/kernels/linear.py's V2_* constants).

``--fixture`` instead times the projections of one converted model and its drafter as the DDTree step
runs them (the target in bf16, the drafter's float32 weights; one weight copy: a small model lives in
L2), the default plan against every token tile (1 .. 16), 2 / 4 / 8 warps and the K-split the model
picks for each, and prints the best plan per shape and M.

``--tc`` times v2 against the tensor-core kernel (its default plan, and at the ``--tc`` M every plan of TC_PLANS),
each also on x in the hi / lo layout (``hilo``: what it reads after a norm, kdt.kernels.linear.TC_HILO_X), and on
that x with the weights in fragment order (``fo``: linear's fo, kdt.engine.cuda_model.ATTN_FO; its bits checked
against hilo's);
``--jobs N`` first compiles the plans in N processes at once into kdt's disk cache (a plan compiles in seconds,
the sweep's ~30 one after another in minutes).

``--post`` times the engine's o_proj at --M (x += o_proj(o), then a = rmsnorm(x), ``linear(..., post=...)``) with
the norm's launch after it (POST_NORM_MAX_M = 0) against the norm in its launch (POST_NORM_MAX_M = M), each pair of
launches back to back as the graph runs them (without the graph's PDL), and checks that a has the same bits.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kdt.config import preset  # noqa: E402
from kdt.kernels import linear as lin  # noqa: E402
from kdt.kernels import tc  # noqa: E402
from kdt.kernels.bench import copy_bandwidth, rand, time_us  # noqa: E402
from kdt.kernels.common import cdiv  # noqa: E402


def shapes(name: str) -> list[tuple[str, int, int]]:
    """(layer, N, K) of one preset's dense projections."""
    return preset(name).dense_projections()


def fixture_shapes(path: str) -> list[tuple[str, int, int, type]]:
    """(layer, N, K, weight dtype) of the dense projections of a fixture's target (bf16) and drafter (f32)."""
    from kdt.fixture import read_fixture

    fx = read_fixture(path)
    out = [(name, N, K, np.uint16) for name, N, K in fx.config.dense_projections()]
    if fx.drafter is not None:  # its stack (the target's lm_head is shared), float32 weights
        dc = fx.drafter.config
        out.append(("drafter fc", fx.config.hidden_size, len(dc.target_layers) * fx.config.hidden_size, np.float32))
        out += [(f"drafter {name}", N, K, np.float32) for name, N, K in dc.stack_config(fx.config).dense_projections()
                if name != "lm_head"]
    return out


def sweep_fixture(path: str, Ms: list[int]) -> list[dict]:
    """Time linear_v2 at every plan variant on a fixture's shapes (one weight copy, L2-resident)."""
    rows = []
    print(f"-- {path}: linear_v2 us per launch (back to back); * = default plan; TM,S,warps")
    nsm = lin._device()[1]
    for layer, N, K, wdt in fixture_shapes(path):
        W = rand((N, K), wdt, 1 / np.sqrt(K))
        Kw = K // 2 if (wdt == np.uint16 and K % 2 == 0) else K
        for M in Ms:
            x, y = rand((M, K)), cuda.device_array((M, N), np.float32)
            dflt = lin._v2_plan(M, N, Kw, nsm)
            res = {}
            for tm, w in itertools.product((1, 2, 4, 8, 16), (2, 4, 8)):
                if tm > 1 and tm > 2 * M or (w != 4 and tm not in (4, 8)):
                    continue
                TM, _, _, ww, S, _ = lin._v2_plan(M, N, Kw, nsm, tm, None, w)
                res[(TM, S, ww)] = time_us(rotating(lin.linear_v2, [W], x, y, tm=tm, warps=w), batch=64)
            best = min(res, key=res.get)
            d = (dflt[0], dflt[4], dflt[3])
            us_d = res.get(d) or time_us(rotating(lin.linear_v2, [W], x, y), batch=64)
            line = " ".join(f"{t},{s},{w}:{us:.1f}{'*' if (t, s, w) == d else ''}"
                            for (t, s, w), us in sorted(res.items()))
            print(f"{layer:18s} N={N:5d} K={K:5d} M={M:3d}: default {d} {us_d:5.1f} | best {best} {res[best]:5.1f}"
                  f" | {line}", flush=True)
            rows.append(dict(layer=layer, N=N, K=K, M=M, wdtype=np.dtype(wdt).name, default=d, us_default=us_d,
                             best=best, us_best=res[best], us={f"{t},{s},{w}": us for (t, s, w), us in res.items()}))
    return rows


def timed(fn, est_us: float) -> float:
    """time_us with a batch of about 30 ms of GPU work (at least 2 launches, at most 16)."""
    return time_us(fn, batch=int(max(2, min(16, 30000 // max(est_us, 1.0)))))


def estimate_us(fn) -> float:
    """One launch, synchronised (after a warm-up call that compiles), for sizing the batch."""
    fn(0)
    cuda.synchronize()
    t0 = time.perf_counter()
    fn(1)
    cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6


def rotating(fn, Ws, x, y, Fs=None, **kw):
    """fn(i) launching ``fn(x, W, y)`` on weight copy i % len(Ws) (and, with ``Fs``, its fragment order as ``fo``)."""
    if Fs is None:
        return lambda i: fn(x, Ws[i % len(Ws)], y, **kw)
    return lambda i: fn(x, Ws[i % len(Ws)], y, fo=Fs[i % len(Ws)], **kw)


def plan_of(M: int, N: int, K: int, tm=None, splits=None, warps=None) -> tuple[int, int, int]:
    """(TM, S, warps) of linear_v2's plan for bf16 weights."""
    TM, _, _, w, S, _ = lin._v2_plan(M, N, K // 2, lin._device()[1], tm, splits, warps)
    return TM, S, w


TC_PLANS = ([(rt, nt, u, nw, nw) for rt in (1, 2, 4) for nt in (1, 2, 4) for u, nw in ((2, 4), (2, 8))
             if rt * nt <= 8]  # warps splitting K
            + [(rt, nt, 2, nw, kw) for rt, nt in ((1, 4), (2, 4), (2, 8), (1, 8))
               for nw, kw in ((4, 1), (8, 1), (8, 2))])  # row groups of kw warps


def _compile_plan(plan) -> tuple:
    """One process of ``--jobs``: compile the tensor-core kernel of ``plan`` (tiny operands: the kernel depends on
    the plan and the argument types only) into the disk cache."""
    x, W, y = rand((8, 64)), rand((16, 64), np.uint16), cuda.device_array((8, 16), np.float32)
    lin.linear_tc(x, W, y, plan=plan)
    lin.linear_tc(cuda.device_array((8, 32), np.uint64), W, y, plan=plan)  # x hi / lo
    lin.linear_tc(cuda.device_array((8, 32), np.uint64), W, y, plan=plan, fo=lin.fragment_order(W))  # W in fo
    cuda.synchronize()
    return plan


def precompile(worker, todo: list, jobs: int, what: str) -> None:
    """``worker(job)`` for every job of ``todo`` in ``jobs`` processes at once (each compiles into kdt's disk cache)."""
    t0 = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(min(jobs, len(todo))) as pool:
        done = list(pool.imap_unordered(worker, todo))
    print(f"compiled {len(done)} {what} in {time.perf_counter() - t0:.0f} s", flush=True)


def bench_tc(presets: list[str], Ms: list[int], sweep_Ms: list[int], layers=None) -> list[dict]:
    """v2 (FMA) against the tensor-core kernel (its default plan) per shape and M; at ``sweep_Ms`` every plan of
    TC_PLANS too (rt, nt, u, nw, kw: row tiles of 16 a warp, token tiles of 8 a block, words in flight, warps,
    warps splitting K in a row group); ``layers``: those layers alone."""
    rows = []
    print(f"{'shape':34s} {'M':>5s} {'v2 us':>9s} {'tc us':>9s} {'hilo us':>9s} {'fo us':>9s} {'v2/tc':>6s} "
          f"{'tc TF/s':>8s} {'plan':>12s} {'best us':>8s} {'best plan':>12s} {'best hilo':>9s} {'hilo plan':>12s} "
          f"{'best fo':>8s} {'fo plan':>12s} {'rel diff':>9s}")
    for name in presets:
        for layer, N, K in shapes(name):
            if layers and layer not in layers:
                continue
            Ws = [rand((N, K), np.uint16, 1 / np.sqrt(K)) for _ in range(min(16, cdiv(128 << 20, N * K * 2)))]
            Fs = [lin.fragment_order(W) for W in Ws]  # linear's fo (None where the shape does not take the order)
            for M in Ms:
                x = rand((M, K))
                y1, y2 = cuda.device_array((M, N), np.float32), cuda.device_array((M, N), np.float32)
                xh = cuda.to_device(tc.hilo_np(x.copy_to_host()))  # x as a norm leaves it for the tensor cores
                y3, y4 = cuda.device_array((M, N), np.float32), cuda.device_array((M, N), np.float32)
                f1, f2 = rotating(lin.linear_v2, Ws, x, y1), rotating(lin.linear_tc, Ws, x, y2)
                f3, f4 = rotating(lin.linear_tc, Ws, xh, y3), rotating(lin.linear_tc, Ws, xh, y4, Fs)
                us1, us2, us3 = timed(f1, estimate_us(f1)), timed(f2, estimate_us(f2)), timed(f3, estimate_us(f3))
                fo = Fs[0] is not None
                us4 = timed(f4, estimate_us(f4)) if fo else float("nan")
                lin.linear_v2(x, Ws[0], y1)
                lin.linear_tc(x, Ws[0], y2)
                lin.linear_tc(xh, Ws[0], y3)
                f4(0)
                a = y1.copy_to_host().astype(np.float64)
                diff = max(float(np.linalg.norm(a - y.copy_to_host()) / max(np.linalg.norm(a), 1e-30))
                           for y in (y2, y3))
                same_fo = bool(np.array_equal(y3.copy_to_host(), y4.copy_to_host())) if fo else None
                plan = lin.tc_plan(M, N, K)
                res, res_h, res_f = {plan: us2}, {plan: us3}, ({plan: us4} if fo else {})
                if M in sweep_Ms:
                    for p in TC_PLANS:
                        if p != plan:
                            for r, xx in ((res, x), (res_h, xh)):
                                f = rotating(lin.linear_tc, Ws, xx, y2, plan=p)
                                r[p] = timed(f, estimate_us(f))
                            if fo:
                                f = rotating(lin.linear_tc, Ws, xh, y2, Fs, plan=p)
                                res_f[p] = timed(f, estimate_us(f))
                best, best_h = min(res, key=res.get), min(res_h, key=res_h.get)
                best_f = min(res_f, key=res_f.get) if fo else None
                row = dict(preset=name, layer=layer, M=M, N=N, K=K, us_v2=us1, us_tc=us2, us_hilo=us3, plan=plan,
                           best=best, us_best=res[best], best_hilo=best_h, us_best_hilo=res_h[best_h], rel_diff=diff,
                           TFLOPps_tc=2 * M * N * K / us2 * 1e-6, us_fo=us4 if fo else None, fo_same_bits=same_fo,
                           best_fo=best_f, us_best_fo=res_f[best_f] if fo else None,
                           sweep={",".join(map(str, p)): u for p, u in res.items()},
                           sweep_hilo={",".join(map(str, p)): u for p, u in res_h.items()},
                           sweep_fo={",".join(map(str, p)): u for p, u in res_f.items()})
                rows.append(row)
                print(f"{layer + f' N={N} K={K}':34s} {M:5d} {us1:9.1f} {us2:9.1f} {us3:9.1f} {us4:9.1f} "
                      f"{us1 / us2:6.2f} {row['TFLOPps_tc']:8.1f} {str(plan):>12s} {res[best]:8.1f} {str(best):>12s} "
                      f"{res_h[best_h]:9.1f} {str(best_h):>12s} {res_f[best_f] if fo else float('nan'):8.1f} "
                      f"{str(best_f):>12s} {diff:9.1e}{'' if same_fo in (None, True) else ' FO BITS DIFFER'}",
                      flush=True)
    return rows


def _compile_tiled(job) -> tuple:
    """One process of ``--tiled --jobs``: compile the tiled GEMM of plan ``job[0]`` on hi / lo (``job[1]``) or float32
    x into the disk cache (tiny operands: the kernel depends on the plan and the argument types only)."""
    from kdt.kernels import tc_tiled

    plan, hilo = job
    x = cuda.device_array((8, 16), np.uint64) if hilo else rand((8, 32))
    tc_tiled.tiled_gemm(x, rand((16, 32), np.uint16), cuda.device_array((8, 16), np.float32), plan_=plan)
    cuda.synchronize()
    return job


def bench_tiled(presets: list[str], Ms: list[int], plans=(), layers=None) -> list[dict]:
    """The tensor-core warp tile (``linear_tc``'s plan ``tc_plan``) against the block-tiled GEMM (kdt.kernels.tc_tiled,
    its default plan) per shape and M, each on float32 x and on hi / lo x; their outputs' relative difference;
    ``plans`` (wn, wm, rt, tt, st): the tiled GEMM on hi / lo x with each of these too (``sweep_hilo``); ``layers``:
    these layers only."""
    from kdt.kernels import tc_tiled

    bw = copy_bandwidth()
    rows = []
    print(f"device copy bandwidth: {bw / 1e9:.0f} GB/s")
    print(f"{'shape':34s} {'M':>5s} {'tc us':>9s} {'tiled us':>9s} {'tc hilo':>9s} {'tiled hilo':>10s} "
          f"{'bytes us':>8s} {'tiled TF/s':>10s} {'plan':>18s} {'rel diff':>9s}")
    for name in presets:
        for layer, N, K in shapes(name):
            if K % tc_tiled.BK or (layers and layer not in layers):
                continue
            Ws = [rand((N, K), np.uint16, 1 / np.sqrt(K)) for _ in range(min(16, cdiv(128 << 20, N * K * 2)))]
            for M in Ms:
                x = rand((M, K))
                xh = cuda.to_device(tc.hilo_np(x.copy_to_host()))
                ys = [cuda.device_array((M, N), np.float32) for _ in range(4)]
                warp = lin.tc_plan(M, N, K)  # the warp tile's plan (linear_tc's default takes the tiled GEMM from
                # linear.TILED_MIN_M tokens on TILED_MIN_N rows)
                fns = [rotating(lin.linear_tc, Ws, x, ys[0], plan=warp), rotating(tc_tiled.tiled_gemm, Ws, x, ys[1]),
                       rotating(lin.linear_tc, Ws, xh, ys[2], plan=warp), rotating(tc_tiled.tiled_gemm, Ws, xh, ys[3])]
                us = [timed(f, estimate_us(f)) for f in fns]
                for f in fns:
                    f(0)
                a = ys[0].copy_to_host().astype(np.float64)
                diff = max(float(np.linalg.norm(a - y.copy_to_host()) / max(np.linalg.norm(a), 1e-30)) for y in ys[1:])
                floor_us = N * K * 2 / bw * 1e6
                row = dict(preset=name, layer=layer, M=M, N=N, K=K, us_tc=us[0], us_tiled=us[1], us_tc_hilo=us[2],
                           us_tiled_hilo=us[3], bytes_us=floor_us, plan=tc_tiled.plan(M), rel_diff=diff,
                           TFLOPps_tiled=2 * M * N * K / min(us[1], us[3]) * 1e-6, sweep_hilo={})
                rows.append(row)
                print(f"{layer + f' N={N} K={K}':34s} {M:5d} {us[0]:9.1f} {us[1]:9.1f} {us[2]:9.1f} {us[3]:10.1f} "
                      f"{floor_us:8.1f} {row['TFLOPps_tiled']:10.1f} {str(row['plan']):>18s} {diff:9.1e}", flush=True)
                for p in plans:  # each plan's output against the warp tile's too (a plan that drops a tile fails)
                    f = rotating(tc_tiled.tiled_gemm, Ws, xh, ys[3], plan_=p)
                    ys[3].copy_to_device(np.full((M, N), np.nan, np.float32))  # poisoned
                    f(0)
                    d = float(np.linalg.norm(a - ys[3].copy_to_host()) / max(np.linalg.norm(a), 1e-30))
                    row.setdefault("sweep_rel_diff", {})[",".join(map(str, p))] = d
                    row["sweep_hilo"][",".join(map(str, p))] = u = timed(f, estimate_us(f))
                    print(f"{'':34s} {M:5d} tiled hilo plan {str(p):>18s} {u:9.1f} us  rel diff {d:9.1e}", flush=True)
    return rows


def bench_post(presets: list[str], Ms: list[int]) -> list[dict]:
    """o_proj with the MoE's input norm after it: the norm's own launch against linear_v2's POST (``--post``)."""
    rows = []
    for name in presets:
        cfg = preset(name)
        D, K = cfg.hidden_size, cfg.num_attention_heads * cfg.v_head_dim
        Ws = [rand((D, K), np.uint16) for _ in range(max(2, cdiv(128 << 20, 2 * D * K)))]
        pw = rand((D,))
        for M in Ms:
            o, x = rand((M, K)), rand((M, D))
            a = {n: cuda.device_array((M, D), np.float32) for n in (0, M)}
            us = {}
            for n in (0, M):
                lin.POST_NORM_MAX_M = n
                fn = rotating(lin.linear, Ws, o, x, accumulate=True, post=(pw, cfg.rms_norm_eps, a[n], None))
                us[n] = timed(fn, estimate_us(fn))
            x0 = x.copy_to_host()  # the same x, both ways: a the same bits
            for n in (0, M):
                lin.POST_NORM_MAX_M = n
                x.copy_to_device(x0)
                lin.linear(o, Ws[0], x, accumulate=True, post=(pw, cfg.rms_norm_eps, a[n], None))
            same = bool(np.array_equal(a[0].copy_to_host(), a[M].copy_to_host()))
            print(f"{name:18s} M={M:3d} o_proj {D}x{K} + norm: its own launch {us[0]:7.2f} us, in o_proj's "
                  f"{us[M]:7.2f} us ({us[M] - us[0]:+.2f}); a the same bits: {same}", flush=True)
            rows.append(dict(preset=name, M=M, separate_us=us[0], post_us=us[M], same_bits=same))
    lin.POST_NORM_MAX_M = 0
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="moonlight-16b-a3b,kimi-k2")
    ap.add_argument("--M", default="1,4,8,16,32,64,128")
    ap.add_argument("--big-M", default="512,2048")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--fixture", default=None, help="time this fixture's shapes (target + drafter) instead")
    ap.add_argument("--jobs", type=int, default=1, help="--tc / --tiled: compile the plans first in this many "
                    "processes")
    ap.add_argument("--tc", default=None, metavar="M,..", help="instead: v2 against the tensor-core kernel at "
                    "--M, with a sweep of its plans at these M")
    ap.add_argument("--plans", default=None, metavar="RT,NT,U,NW,KW;..", help="--tc: sweep these plans instead of "
                    "TC_PLANS (e.g. the token tiles a block at 65 tokens: '2,4,2,8,8;2,3,2,8,8')")
    ap.add_argument("--tiled", action="store_true", help="instead: the tensor-core warp tile against the block-tiled "
                    "GEMM (kdt.kernels.tc_tiled) at --M")
    ap.add_argument("--tiled-plans", default="", metavar="WN,WM,RT,TT,ST[,PRE];..", help="--tiled: also time the tiled "
                    "GEMM (hi / lo x) with each of these plans (PRE 1: the copies' offsets once, tc_tiled.PRE)")
    ap.add_argument("--layers", default="", metavar="NAME,..", help="--tiled / --tc: these layers only (e.g. lm_head)")
    ap.add_argument("--post", action="store_true", help="instead: o_proj with the MoE's input norm in its own launch "
                    "against in o_proj's (linear's post)")
    args = ap.parse_args(argv)
    if args.post:
        rows = bench_post(args.presets.split(","), [int(m) for m in args.M.split(",") if m])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"post": rows}, f, indent=1)
        return 0
    if args.tiled:
        tplans = [tuple(int(v) for v in p.split(",")) for p in args.tiled_plans.split(";") if p]
        if args.jobs > 1:  # the plans at --M and the gpu tests' 37 / 100 tokens, both x layouts (float32 x at 8
            # token tiles alone compiles for ~2 min)
            from kdt.kernels import tc_tiled

            Ms = {int(m) for m in args.M.split(",") if m} | {37, 100}
            precompile(_compile_tiled, sorted({(tc_tiled.plan(M), hilo) for M in Ms for hilo in (True, False)}
                                              | {(p, True) for p in tplans}), args.jobs, "tiled GEMM plans")
        rows = bench_tiled(args.presets.split(","), [int(m) for m in args.M.split(",") if m], tplans,
                           {name for name in args.layers.split(",") if name})
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"tiled": rows}, f, indent=1)
        return 0
    if args.tc is not None:
        if args.plans:
            global TC_PLANS
            TC_PLANS = [tuple(int(v) for v in p.split(",")) for p in args.plans.split(";") if p]
        if args.jobs > 1:
            Ms = [int(m) for m in args.M.split(",") if m]
            default = {lin.tc_plan(M, N, K) for M in Ms for name in args.presets.split(",") for _, N, K in shapes(name)}
            precompile(_compile_plan, sorted(default | (set(TC_PLANS) if args.tc else set())), args.jobs,
                       "tensor-core plans")
        rows = bench_tc(args.presets.split(","), [int(m) for m in args.M.split(",") if m],
                        [int(m) for m in args.tc.split(",") if m], {name for name in args.layers.split(",") if name})
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"tc": rows}, f, indent=1)
        return 0
    if args.fixture:
        rows = sweep_fixture(args.fixture, [int(m) for m in args.M.split(",") if m])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"fixture": args.fixture, "rows": rows}, f, indent=1)
        return 0
    Ms = [int(m) for m in args.M.split(",") if m]
    big = [int(m) for m in args.big_M.split(",") if m]
    bw = copy_bandwidth()
    print(f"device copy bandwidth: {bw / 1e9:.0f} GB/s (read + write); bf16 weights; "
          f"V2_MIN_M={lin.V2_MIN_M} (linear() runs v2 for M >= that)")
    hdr = (f"{'shape':34s} {'M':>5s} {'v1 us':>9s} {'v2 us':>9s} {'v1/v2':>6s} {'v2 GB/s':>8s} {'%copy':>6s} "
           f"{'v1 TF/s':>7s} {'v2 TF/s':>7s} {'TM,S':>6s} {'rel diff':>9s}")
    rows = []
    for name in args.presets.split(","):
        print(f"-- {name}")
        print(hdr)
        for layer, N, K in shapes(name):
            nbytes_w = N * K * 2
            Ws = [rand((N, K), np.uint16, 1 / np.sqrt(K)) for _ in range(min(16, cdiv(128 << 20, nbytes_w)))]
            for M in Ms + ([] if layer == "lm_head" else big):
                x = rand((M, K))
                y1, y2 = cuda.device_array((M, N), np.float32), cuda.device_array((M, N), np.float32)
                f1, f2 = rotating(lin.linear_v1, Ws, x, y1), rotating(lin.linear_v2, Ws, x, y2)
                us1 = timed(f1, estimate_us(f1))
                us2 = timed(f2, estimate_us(f2))
                lin.linear_v1(x, Ws[0], y1)
                lin.linear_v2(x, Ws[0], y2)
                a, b = y1.copy_to_host().astype(np.float64), y2.copy_to_host().astype(np.float64)
                diff = float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))
                nbytes = nbytes_w + 4 * M * (K + N)
                flops = 2 * M * N * K
                TM, S, _ = plan_of(M, N, K)
                row = dict(preset=name, layer=layer, M=M, N=N, K=K, us_v1=us1, us_v2=us2, speedup=us1 / us2,
                           GBps_v2=nbytes / us2 * 1e-3, pct_copy_v2=100 * nbytes / (us2 * 1e-6) / bw,
                           TFLOPps_v1=flops / us1 * 1e-6, TFLOPps_v2=flops / us2 * 1e-6, TM=TM, S=S, rel_diff=diff)
                rows.append(row)
                print(f"{layer + f' N={N} K={K}':34s} {M:5d} {us1:9.1f} {us2:9.1f} {us1 / us2:6.2f} "
                      f"{row['GBps_v2']:8.0f} {row['pct_copy_v2']:5.0f}% {row['TFLOPps_v1']:7.2f} "
                      f"{row['TFLOPps_v2']:7.2f} {f'{TM},{S}':>6s} {diff:9.1e}", flush=True)
    sweep = []
    if args.sweep:
        print("-- sweep of v2 plans (us); * = the default plan")
        for name in args.presets.split(","):
            for layer, N, K in shapes(name):
                if layer == "lm_head":
                    continue
                Ws = [rand((N, K), np.uint16, 1 / np.sqrt(K)) for _ in range(min(16, cdiv(128 << 20, N * K * 2)))]
                for M in (16, 64):
                    x, y = rand((M, K)), cuda.device_array((M, N), np.float32)
                    steps_max = K // 2 // 32
                    res = {plan_of(M, N, K): time_us(rotating(lin.linear_v2, Ws, x, y))}
                    for tm, w, S in itertools.product((8, 16), (4, 8), (1, 2, 3, 4, 6, 8, 12, 16)):
                        if S > 1 and steps_max // S < 2:
                            continue
                        f = rotating(lin.linear_v2, Ws, x, y, tm=tm, splits=S, warps=w)
                        res[plan_of(M, N, K, tm, S, w)] = time_us(f)
                    best = min(res, key=res.get)
                    dflt = plan_of(M, N, K)
                    line = " ".join(f"{t},{s},{w}:{us:.1f}{'*' if (t, s, w) == dflt else ''}"
                                    for (t, s, w), us in sorted(res.items()))
                    print(f"{name} {layer} N={N} K={K} M={M}: best TM,S,warps={best} {res[best]:.1f} us; "
                          f"default {dflt} {res.get(dflt, float('nan')):.1f} us | {line}", flush=True)
                    sweep.append(dict(preset=name, layer=layer, N=N, K=K, M=M, best=best, default=dflt,
                                      us={f"{t},{s},{w}": us for (t, s, w), us in res.items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth_GBps": bw / 1e9, "rows": rows, "sweep": sweep}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
