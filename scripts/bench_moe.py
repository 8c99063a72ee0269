"""MoE layer, version 1 (8 launches) vs version 2 (3 launches) (vs the small path for small layers), GPU time
only, on the H200.

    python scripts/bench_moe.py [--presets moonlight-16b-a3b,kimi-k2] [--M 1,16,64] [--dtype bf16]
                                [--sweep | --previous] [--only NAMES] [--parts] [--jobs N] [--json PATH]

Per preset and M: us per moe_forward, GB/s of the bytes that must move once (the distinct routed
experts the M random tokens select + the shared experts + the fp32 router gate; same model as
``python -m kdt.kernels.bench``), % of the device copy bandwidth measured in the same run, speed-up
over version 1, and the relative difference of each output to version 1's (a wrong kernel shows up
here as ~1e-1 or nan; the tests' bound against float64 is 1e-5). ``--sweep`` adds version-2 launch
shapes beside the default (``kdt.kernels.moe.V2Tiles``) so one run picks the best. ``--parts`` times
each version-2 variant's launches as growing prefixes of the forward, each launch's first role
(``moe.V2Launch.head``: A's router logits + routing tail without the shared gate_up, B's routed
gate_up without the shared down) before the whole launch: the increments say where the forward's
time goes. Version 2's forwards get b's hi / lo layout (``b_hl``) where the engine's norm would write it
(``moe.reads_b_hilo``) or a variant's name says ``b_hl``, unless it says ``no_b_hl``. Every new launch shape
compiles its kernels first (5-65 s each), outside the timed region;
``--jobs N`` compiles them first in N processes at once into kdt's disk cache (kdt.kernels.jit_cache), from
which the timing process then loads them (a sweep's compiles otherwise run one after another). ``--ncu`` times
nothing: each variant runs once to compile, then once between cuda.profile_start / profile_stop, for Nsight
Compute (``ncu --profile-from-start off ... python scripts/bench_moe.py ... --ncu``).
A ``--presets`` entry ending in ``.h5`` is a fixture: its MoE layer's shape, with random weights (e.g.
``--presets fixtures/model_code.h5 --M 1,17,65 --parts``: the learned DDTree step's MoE layers).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from numba import cuda  # noqa: E402

from kdt.config import preset  # noqa: E402
from kdt.fixture import read_config  # noqa: E402
from kdt.kernels import moe, tc  # noqa: E402
from kdt.kernels.bench import copy_bandwidth, moe_layer, rand, time_us  # noqa: E402


def default_tiles(M: int, k: int, E: int, D: int) -> moe.V2Tiles:
    """The launch shape moe_forward takes at M for a layer with its experts' fragment-ordered copy where moe.TC_FO
    keeps one (bf16 weights)."""
    return moe.v2_tiles(M, k, E, D, fo=moe.TC_FO != "0")


def previous_defaults(M: int, k: int, E: int, D: int) -> list[tuple[str, moe.V2Tiles]]:
    """The default launch shape with one of the recent changes undone (name, tiles): kernel A routing all M
    tokens in one block, kernel C's experts per block by M alone (session 10); kernel A's token tiles by M
    alone (session 11); kernels A and B as two launches (session 24); float32 x into the tensor cores, the shared GEMMs
    over all M tokens a block (session 28); the tensor cores' passes all of tc token tiles, x float32 below 4 (session
    35's tc_fit); the experts in their natural order (session 44's fragment order); the shared experts in natural order
    and b without its hi / lo copy (session 48: ``no_b_hl`` in a name: the forward gets no b_hl)."""
    t = default_tiles(M, k, E, D)
    r = dataclasses.replace
    old = [("A_one_router", r(t, rt=False))] if M > t.tt_s else []
    if t.ab:  # session 24: kernels A and B in one launch (and its register cap)
        old.append(("A_B_apart", r(t, ab=False)))
        old += [(f"AB_regs{n}", r(t, ab_regs=n)) for n in (0, 80, 96) if n != t.ab_regs]
    if t.tc:  # session 28: x hi / lo from its producers (4 token tiles), the shared GEMMs one pass a block
        old += [("tc_hilo" if not t.tc_hilo else "tc_f32_x", r(t, tc_hilo=not t.tc_hilo)),
                ("tc_all_tokens", r(t, tc_split=False)), ("tc_s27", r(t, tc_hilo=False, tc_split=False))]
    s34 = r(t, tc_fit=False, tc_hilo=moe.TC_HILO and t.tc == 4)  # session 35: short passes fitted, x hi / lo
    if t.tc and s34 != t:
        old.append(("tc_s34", s34))
    if t.tc:  # session 26: tensor cores at M >= TC_MIN_M; the FMA tiles as before
        saved, moe.TC_MIN_M = moe.TC_MIN_M, 0
        try:
            old.append(("fma", moe.v2_tiles(M, k, E, D)))
        finally:
            moe.TC_MIN_M = saved
    s43 = r(moe.v2_tiles(M, k, E, D), tc_fo=False)  # session 44: the experts in fragment order, tensor cores from 8
    if s43 != t and s43.tc:
        old.append(("tc_natural_order", s43))
    by_m = moe._v2_tiles_by_m(M, k)
    if by_m.jc != t.jc and not t.tc:
        old.append(("C_jc_by_M", r(t, jc=by_m.jc)))
    if (by_m.tt_s, by_m.cs_s) != (t.tt_s, t.cs_s) and not t.tc:  # session 11: kernel A's 2-token tiles (small
        # models; on tensor cores kernel A's tiles are A_TT's, swept as A_tiles8 / 4 / 2)
        old.append(("A_tiles_by_M", r(t, tt_s=by_m.tt_s, cs_s=by_m.cs_s)))
    s52 = r(t, c_regs=0, cmb=1, kc=0)  # session 53: kernel C capped (2 token tiles), its combine's loads in flight
    if s52 != t:
        old.append(("C_s52", s52))
    if t.s_fo:  # session 48: the shared experts in fragment order, b's hi / lo from the caller
        old += [("shared_natural", r(t, s_fo=False)), ("no_b_hl", t), ("s47_no_b_hl", r(t, s_fo=False))]
    elif t.tc_fo:  # ... where the defaults have them off (moe.SHARED_FO, moe.B_HILO)
        old += [("shared_fo_b_hl", r(t, s_fo=True)), ("shared_fo_no_b_hl", r(t, s_fo=True)), ("b_hl", t)]
    return old


def b_hl_for(vname: str, version: int, b, layer, scratch):
    """The b_hl a variant's forward gets (version 2): b's hi / lo layout where the engine's norm would write it
    (``moe.reads_b_hilo``), or as the name says (``no_b_hl``: none; ``b_hl``: given; moe_forward reads it only where
    its plan takes hi / lo x)."""
    M = b.shape[0]
    if version != 2 or "no_b_hl" in vname or not ("b_hl" in vname or moe.reads_b_hilo(M, layer, scratch)):
        return None
    return cuda.to_device(tc.hilo_np(b.copy_to_host()))


def sweep_variants(M: int, k: int, E: int, D: int) -> list[tuple[str, moe.V2Tiles]]:
    """Version-2 launch shapes tried beside the default with --sweep (name, tiles)."""
    t = default_tiles(M, k, E, D)
    seen, out = {t}, []
    for name, v in previous_defaults(M, k, E, D) + _other_variants(t, M, k):  # (the first name of a launch shape)
        if v not in seen:
            seen.add(v)
            out.append((name, v))
    return out


def _other_variants(t: moe.V2Tiles, M: int, k: int) -> list[tuple[str, moe.V2Tiles]]:
    r = dataclasses.replace
    if t.tc:  # tensor cores: token tiles a pass (hi / lo x or float32), words in flight, the down's row tiles
        return [(f"tc{n}", r(t, tc=n)) for n in (1, 2, 4) if n != t.tc] + [
            (f"tc{n}_{'f32_x' if t.tc_hilo else 'hilo'}", r(t, tc=n, tc_hilo=not t.tc_hilo)) for n in (2, 4)
            if n != t.tc] + [
            ("tc_words4", r(t, u=4, u_c=4)), ("tc_words1", r(t, u=1, u_c=1)), ("tc_rows1", r(t, tc_rt=1)),
            ("tc_rows4", r(t, tc_rt=4))] + [(f"tc_kw{kw}", r(t, tc_kw=kw)) for kw in (1, 2) if kw != t.tc_kw] + [
            (f"tc_st{st}", r(t, tc_hilo=True, tc_st=st)) for st in (2, 3, 4, 5) if st != t.tc_st] + [  # (hi / lo x)
            # kernel B's routed gate_up with 2 output tiles a warp (alone, with kernel C's down on 4 row tiles, staged)
            ("tc_ot2", r(t, tc_ot=2)), ("tc_ot2_hilo", r(t, tc_ot=2, tc_hilo=True)),
            ("tc_ot2_rows4", r(t, tc_ot=2, tc_rt=4)),
            ("tc_ot2_st3", r(t, tc_ot=2, tc_hilo=True, tc_st=3)),
            ("tc_nofit" if t.tc_fit else "tc_fit", r(t, tc_fit=not t.tc_fit)),  # short passes on fewer token tiles
            # kernel B's routed gate_up on the block-tiled GEMM (kdt.kernels.tc_tiled; x hi / lo), or not
            ("tc_untiled", r(t, tiled=False)) if t.tiled else ("tc_tiled", r(t, tc_hilo=True, tiled=True)),
            ("tc_nofo", r(t, tc_fo=False)) if t.tc_fo else ("tc_fo", r(t, tc_hilo=True, tc_fo=True)),  # (session 43)
            ("tc_regs128", r(t, tc_regs=128)),  # kernel B capped at 128 registers a thread (4 blocks an SM)
            # kernel A's token tiles of 8 / 4 / 2 tokens (its logits blocks and routers; 4 or fewer: one routing round)
            ("A_tiles8", moe.a_token_tiles(t, 8)), ("A_tiles4", moe.a_token_tiles(t, 4)),
            ("A_tiles2", moe.a_token_tiles(t, 2)),
            # kernel C uncapped / at 96 / 80 registers (4 / 5 / 6 blocks an SM); its combine's outputs 1 / 2 / 4 a
            # thread in flight, each one's top_k slots unrolled (kc) or not (session 53's s53a; 4 outputs spill at 80)
            ("C_uncapped", r(t, c_regs=0)), ("C_regs96", r(t, c_regs=96)), ("C_regs80", r(t, c_regs=80)),
            ("C_cmb1", r(t, cmb=1)), ("C_regs96_cmb4", r(t, c_regs=96, cmb=4)), ("C_no_kc", r(t, kc=0)),
            ("C_cmb4_no_kc", r(t, c_regs=0, cmb=4, kc=0)),
            # kernel C in blocks of 8 warps, 2 row groups of 4 (64 rows a block, a warp's share of K as now; kernel B's
            # 4 warps are then one group as before)
            ("C_8warps_kw4", r(t, nw_c=8, tc_kw=4)),
            ("C_fence1", r(t, c_fence1=True))]  # kernel C's ticket fenced by thread 0 alone (cooperative groups' way)
    tcv = r(t, tc=2, jc=1, tc_split=True)  # tensor cores below their first M (bf16; other weights: the FMA tiles)
    tcs = [("tc2", tcv), ("tc2_fit", r(tcv, tc_fit=True)), ("tc2_fit_hilo", r(tcv, tc_fit=True, tc_hilo=True))
           ] if 8 <= M < moe.TC_MIN_M else []
    # ... at any M below them with the experts in fragment order (kernels A and B apart: kernel AB has no tensor cores)
    tcs += [("tc_fo_small", r(tcv, tc_fit=True, tc_hilo=True, tc_fo=True, ab=False))] if M < moe.TC_MIN_M else []
    if M <= 1:
        return [("kernel_B_shared_last", r(t, sd_first=False)), ("rows8_words2", r(t, nr=8, u=2, nr_c=8, u_c=2)),
                ("words2", r(t, u=2, u_c=2)), ("words8", r(t, u=8, u_c=8)), ("C_8warps", r(t, nw_c=8))] + tcs
    if M <= 16:
        return [("tt2", r(t, tt=2, tt_c=2)), ("tt2_sd_first", r(t, tt=2, tt_c=2, sd_first=True)),
                ("sd_first", r(t, sd_first=True)), ("tt8_words2", r(t, tt=8, tt_c=8, u=2, u_c=2, sd_first=True))] + tcs
    return [("rows8_tt4", r(t, nr=8, tt=4, tt_s=4, nr_c=8, tt_c=4)), ("C_8experts", r(t, jc=8)),
            ("words1", r(t, u=1, u_c=1, u_l=1)), ("C_2warps", r(t, nw_c=2)),
            # small models (model_code M = 17 / 65): shorter token tiles, more blocks per launch
            ("tt4_words4", r(t, tt=4, tt_s=4, tt_c=4, u=4, u_l=4, u_c=4)), ("A_tiles2", r(t, tt_s=2)),
            ("tt2_words4", r(t, tt=2, tt_s=2, tt_c=2, u=4, u_l=4, u_c=4))] + tcs


def bench_parts(name: str, M: int, b, layer, scratch, out, us_whole: float, vname: str = "v2",
                tiles: moe.V2Tiles | None = None) -> list[dict]:
    """Version 2's launches (variant ``vname``, launch shape ``tiles``) timed as growing prefixes of the forward (A's
    head, A, A + B's head, A + B, A + B + C; the head of a launch is its first role alone, ``moe.V2Launch.head``).
    Prefixes, not launches alone: alone, a launch would re-read weights that the L2 (60 MB) still holds."""
    launches = moe.v2_launches(b, layer, scratch, out, M, accumulate=False, tiles=tiles,
                               b_hl=b_hl_for(vname, 2, b, layer, scratch))
    rows, prev = [], 0.0
    for n, ln in enumerate(launches):
        for part, grid in (("head", ln.head), ("whole", ln.grid)):
            if part == "head" and ln.head == ln.grid:
                continue

            def fn(i, n=n, g=grid):
                for x in launches[:n]:
                    x()
                launches[n](grid=g)

            us = time_us(fn)
            label = f"+ {ln.name} ({part}, {grid} blocks x {ln.threads})"
            rows.append(dict(preset=name, M=M, variant=f"{vname} prefix {label}", us=us, added_us=us - prev))
            print(f"{name:18s} {M:3d}   {label:52s} {us:8.1f} us  (+{us - prev:.1f})", flush=True)
            prev = us
    print(f"{name:18s} {M:3d}   (the whole forward through moe_forward: {us_whole:.1f} us)", flush=True)
    return rows


def variants_for(M: int, cfg, layer, scratch, sweep: str | None, only: list[str] | None):
    """The (name, version, tiles) timed at M: v1, v2 (and the small path where the layer is small), the sweep's
    or the previous defaults' v2 tiles, filtered by ``only``."""
    E, k, D = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size
    variants: list[tuple[str, int, moe.V2Tiles | None]] = [("v1", 1, None), ("v2", 2, None)]
    if moe._small_supported(layer, scratch, M):  # a small layer: the small path too
        variants.append(("v3 small", 3, None))
    if sweep:
        variants += [(f"v2 {n}", 2, t) for n, t in
                     (sweep_variants if sweep == "all" else previous_defaults)(M, k, E, D)]
    variants = [v for v in variants if v[0] in only] if only else variants
    if any(t is not None and t.tc_fo for _, _, t in variants):  # the layer's fragment-ordered copy (moe.TC_FO)
        layer.fragment_order()
    return variants


def _setup(name: str, dtype: str, M_max: int):
    cfg = read_config(name) if name.endswith(".h5") else preset(name)
    layer = moe_layer(cfg, np.uint16 if dtype == "bf16" else np.float32)
    return cfg, layer, moe.MoEScratch.allocate(cfg, M_max)


def _compile_worker(job) -> str:
    """One process of ``--jobs``: compile (run once) the variants of ``job`` into the disk cache (kdt.kernels.common
    installs it at import)."""
    name, dtype, M, sweep, only, names = job
    cfg, layer, scratch = _setup(name, dtype, M)
    b, out = rand((M, cfg.hidden_size)), cuda.device_array((M, cfg.hidden_size), np.float32)
    for vname, version, tiles in variants_for(M, cfg, layer, scratch, sweep, only):
        if vname in names:
            moe.moe_forward(b, layer, scratch, out, M=M, accumulate=False, version=version, tiles=tiles,
                            b_hl=b_hl_for(vname, version, b, layer, scratch))
    cuda.synchronize()
    return f"{name} M={M} {','.join(names)}"


def precompile(names: list[str], Ms: list[int], dtype: str, sweep: str | None, only: list[str] | None,
               jobs: int) -> None:
    """Compile every variant of every preset and M in ``jobs`` processes (spawned: each its own CUDA context)."""
    jobs_list = []
    for name in names:
        cfg, layer, scratch = _setup(name, dtype, max(Ms))
        for M in Ms:
            jobs_list += [(name, dtype, M, sweep, only, [v[0]])
                          for v in variants_for(M, cfg, layer, scratch, sweep, only)]
        del layer, scratch
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(jobs, len(jobs_list))) as pool:
        for done in pool.imap_unordered(_compile_worker, jobs_list):
            print(f"  compiled {done} ({time.perf_counter() - t0:.0f} s)", flush=True)


def profile_preset(name: str, Ms: list[int], dtype: str, sweep: str | None, only: list[str] | None) -> None:
    """``--ncu``: each variant once to compile, then once inside the profiled range."""
    cfg, layer, scratch = _setup(name, dtype, max(Ms))
    for M in Ms:
        b, out = rand((M, cfg.hidden_size)), cuda.device_array((M, cfg.hidden_size), np.float32)
        for vname, version, tiles in variants_for(M, cfg, layer, scratch, sweep, only):
            b_hl = b_hl_for(vname, version, b, layer, scratch)
            for profiled in (False, True):
                if profiled:
                    cuda.profile_start()
                moe.moe_forward(b, layer, scratch, out, M=M, accumulate=False, version=version, tiles=tiles,
                                b_hl=b_hl)
                cuda.synchronize()
                if profiled:
                    cuda.profile_stop()
            print(f"{name} M={M} {vname}: profiled", flush=True)


def bench_preset(name: str, Ms: list[int], dtype: str, sweep: str | None, bw: float, parts: bool = False,
                 only: list[str] | None = None) -> list[dict]:
    """``name``: a preset, or a fixture (``*.h5``) whose MoE layer shape is timed (random weights); ``only``: the
    variants (by name) to time, the first one the baseline of "vs v1"."""
    cfg, layer, scratch = _setup(name, dtype, max(Ms))
    wb = 2 if dtype == "bf16" else 4
    E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    rows = []
    for M in Ms:
        b, out = rand((M, D)), cuda.device_array((M, D), np.float32)
        ref = None
        us_v1 = None
        for vname, version, tiles in variants_for(M, cfg, layer, scratch, sweep, only):
            t0 = time.perf_counter()
            b_hl = b_hl_for(vname, version, b, layer, scratch)
            moe.moe_forward(b, layer, scratch, out, M=M, accumulate=False, version=version, tiles=tiles, b_hl=b_hl)
            got = out.copy_to_host()  # compiles (first use) and checks, untimed
            n_active = int(scratch.n_active.copy_to_host()[0])
            t_compile = time.perf_counter() - t0
            if ref is None:
                ref = got.astype(np.float64)
            diff = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
            us = time_us(lambda i, v=version, t=tiles, M=M, b=b, out=out, b_hl=b_hl:
                         moe.moe_forward(b, layer, scratch, out, M=M, version=v, tiles=t, b_hl=b_hl))
            us_v1 = us_v1 or us
            nbytes = (n_active + cfg.n_shared_experts) * 3 * D * I * wb + 4 * E * D
            gbs = nbytes / us * 1e-3
            row = dict(preset=name, M=M, variant=vname, us=us, GBps=gbs, pct_copy=100 * gbs * 1e9 / bw,
                       speedup_vs_v1=us_v1 / us, rel_diff_vs_v1=diff, n_active=n_active,
                       tiles=dataclasses.asdict(tiles or default_tiles(M, cfg.num_experts_per_tok, E, D))
                       if version == 2 else None)
            rows.append(row)
            print(f"{name:18s} {M:3d} {vname:16s} {us:8.1f} {gbs:7.0f} {row['pct_copy']:6.0f}% "
                  f"{us_v1 / us:5.2f}x {diff:11.1e}   ({n_active} experts, first call {t_compile:.0f} s)",
                  flush=True)
            if parts and version == 2:
                rows += bench_parts(name, M, b, layer, scratch, out, us, vname, tiles)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="moonlight-16b-a3b,kimi-k2")
    ap.add_argument("--M", default="1,16,64")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "float32"))
    ap.add_argument("--sweep", action="store_const", const="all", help="also time version-2 launch-shape variants")
    ap.add_argument("--previous", dest="sweep", action="store_const", const="previous",
                    help="also time the previous default launch shapes (see previous_defaults)")
    ap.add_argument("--parts", action="store_true",
                    help="also time each version-2 variant's launches as prefixes of the forward")
    ap.add_argument("--only", default=None, help="comma-separated variant names to time (e.g. 'v2,v2 fma')")
    ap.add_argument("--jobs", type=int, default=1, help="compile the variants first in this many processes")
    ap.add_argument("--ncu", action="store_true", help="no timing: each variant once in a profiled range (ncu)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    Ms, only = [int(m) for m in args.M.split(",")], args.only.split(",") if args.only else None
    if args.jobs > 1:
        precompile(args.presets.split(","), Ms, args.dtype, args.sweep, only, args.jobs)
    if args.ncu:
        for name in args.presets.split(","):
            profile_preset(name, Ms, args.dtype, args.sweep, only)
        return 0
    bw = copy_bandwidth()
    print(f"device copy bandwidth: {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    rows = []
    print(f"{'preset':18s} {'M':>3s} {'variant':16s} {'us':>8s} {'GB/s':>7s} {'% copy':>7s} {'vs v1':>6s} "
          f"{'rel diff v1':>11s}", flush=True)
    for name in args.presets.split(","):
        rows += bench_preset(name, Ms, args.dtype, args.sweep, bw, args.parts, only)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth_GBps": bw / 1e9, "dtype": args.dtype, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
