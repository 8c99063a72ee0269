"""MLA kernels, v1 against v2 (kdt.kernels.mla), GPU time only, one table per model.

    python scripts/bench_mla.py [--presets moonlight-16b-a3b,kimi-k2] [--dtype bf16] [--json PATH]
                                [--quick] [--kernels uv_project] [--split-keys 32,64] [--M 16,64,256] [--tc]

Rows: q_absorb and uv_project at M = 1, 16, 64 (uv_project v2 on tensor cores from 16, "v2 fma" beside it; q_absorb
with bf16 weights from mla.QABS_TC_MIN_M tokens also "v2 kv" / "v2 kv tc", the engine's launch with the latent write,
the absorb on FMA tiles / tensor cores, and "tc gemm PLAN", the tensor cores' GEMM alone by plan); mla
attention at M = 1, 16, 64 and L = 512, 8192 (--L) with
  - "S(L)": the splits each version picks for that L (what kdt.kernels.bench times), L on the device;
  - "S(max)": the splits the engine uses (``mla_num_splits(max_len, M)``, max_len = 8192 + 64; most
    of them empty at L = 512), L on the device as in its CUDA graphs (with ``--tc`` the engine's pre-split cache);
  - v2 "pf0"/"pf1" (S(max)): the other prefetch modes of the v2 attention tile loop (default pf2);
  - v2 "S(max)/2": half the splits (what KDT_MLA_BLOCKS_PER_SM=1 would pick);
  - v2 "S(max) kN" (``--split-keys``): at least N keys a split (what KDT_MLA_SPLIT_KEYS=N would pick);
  - v2 "ci S(max)" / "ci0 S(max)" (``--combine-in``): the FMA kernel with its combine in its own launch or in a
    launch of its own (kdt.kernels.mla.COMBINE_IN_MAX_M), where it takes the FMA kernel;
  - v2 "fma S(max)" and "tc S(max)" (``--tc``): version 2's FMA kernel and the one on tensor cores
    (kdt.kernels.attn_tc, the default from KDT_MLA_ATTN_TC_M tokens: "v2 S(max)" is one of the two), each with the
    engine's splits (tc: 2 m-tiles of 16 rows a block, 4 warps each); "tc hl" the same reading the pre-split cache
    (kdt.kernels.mla.kv_hl_np: its key tiles copied, not split); "tc nm1" one m-tile of 8 warps, "tc nm1 cap" the
    same capped at 128 registers (2 blocks an SM).
Timing: kdt.kernels.bench.time_us (a spin kernel holds the GPU while a batch is queued). "GB/s" and
"% copy" count the bytes that must move once (weights, q/o, the cache [0, L+M)) against the
device-to-device copy bandwidth measured in the same run; "x v1" is v1's time over this row's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from numba import cuda

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kdt.config import preset  # noqa: E402
from kdt.kernels import attn_tc, mla  # noqa: E402
from kdt.kernels.bench import copy_bandwidth, rand, time_us  # noqa: E402

MAX_LEN = 8192 + 64


def _attention_tc(q_abs, q_pe, c_kv, k_pe, L_dev, vis, scale, o_lat, scratch, S: int, BC: int, regs: int, NM: int,
                  NWK: int, kv_hl=None) -> None:
    """Version 2's attention on tensor cores (kdt.kernels.attn_tc): BC keys a tile, a register cap (0: none), NM
    m-tiles a block of NWK warps each, the pre-split cache ``kv_hl`` or the float32 caches."""
    BT = attn_tc.attention(q_abs, q_pe, c_kv, k_pe, L_dev, vis, scale, o_lat, scratch, S, BC=BC, regs=regs, NM=NM,
                           NWK=NWK, kv_hl=kv_hl)
    if S > 1:
        mla._mla_combine_v2(scratch, S, L_dev, o_lat, BT)


def rows(name: str, dtype: str, quick: bool, split_keys: tuple[int, ...] = (), Ls: tuple[int, ...] = (512, 8192),
         Ms: tuple[int, ...] = (1, 16, 64), tc: bool = False, combine_in: bool = False):
    """(kernel, shape, variant, callable, bytes) for one model."""
    cfg = preset(name)
    wdt = np.uint16 if dtype == "bf16" else np.float32
    wb = 2 if dtype == "bf16" else 4
    H, Rkv, dr, dn, dv = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim,
                          cfg.v_head_dim)
    kv_b = rand((H * (dn + dv), Rkv), wdt, 1 / np.sqrt(Rkv))
    c_kv, k_pe = rand((MAX_LEN, Rkv)), rand((MAX_LEN, dr))
    kv_hl = None
    if tc and attn_tc.supports(H, Rkv, dr) and attn_tc.supports_hl(Rkv, dr):
        kv_hl = cuda.to_device(mla.kv_hl_np(c_kv.copy_to_host(), k_pe.copy_to_host()))
    cos, sin = (cuda.to_device(t) for t in mla.rope_tables(cfg, MAX_LEN))
    scale = cfg.softmax_scale
    uk_t = mla.absorb_tc_weights(kv_b, H, dn)  # None: the absorb stays on FMA tiles
    c, gw, L0 = rand((max(Ms), Rkv + dr)), rand((Rkv,)), cuda.to_device(np.array([0], np.int64))
    for M in Ms:
        q, pos = rand((M, H * (dn + dr))), cuda.to_device(np.arange(M, dtype=np.int64))
        q_abs, q_pe, o_lat = rand((M, H, Rkv)), rand((M, H, dr)), cuda.device_array((M, H, Rkv), np.float32)
        nb = H * dn * Rkv * wb + 4 * M * H * (dn + dr + Rkv + dr)
        for v in (1, 2):
            yield ("q_absorb", f"M={M} H={H}", f"v{v}",
                   lambda i, v=v, q=q, pos=pos, a=q_abs, p=q_pe: mla.q_absorb(q, kv_b, pos, cos, sin, True, a, p,
                                                                          version=v), nb)
        if uk_t is not None and M >= mla.QABS_TC_MIN_M:  # the absorb on tensor cores (mla.absorb_uses_tc)
            tca = (uk_t, mla.absorb_tc_scratch(M, H, dn))
            for tag, t in (("", None), (" tc", tca)):  # as the engine launches it: with the latent write
                yield ("q_absorb", f"M={M} H={H}", f"v2 kv{tag}",
                       lambda i, q=q, pos=pos, a=q_abs, p=q_pe, t=t, cm=c[:M]: mla.latent_write_and_absorb(
                           cm, gw, 1e-6, L0, c_kv, k_pe, q, kv_b, pos, cos, sin, True, a, p, kv_hl=kv_hl, tc_abs=t), nb)
            for plan in ABSORB_PLANS:  # the tensor cores' GEMM alone, by plan
                yield ("q_absorb", f"M={M} H={H}", "tc gemm " + ",".join(map(str, plan(M))),
                       lambda i, a=q_abs, t=tca, pl=plan(M): mla._absorb_tc(t, a, plan=pl), nb)
        vis = cuda.to_device(np.tril(np.ones((M, M), np.uint8)))
        for L in Ls:
            T = L + M
            nb = 4 * (T * (Rkv + dr) + 2 * M * H * Rkv + M * H * dr)
            L_dev = cuda.to_device(np.array([L], np.int64))
            variants = []
            for v in (1, 2):
                variants.append((f"v{v} S(L)", v, mla.mla_num_splits(L, M, H, Rkv, dr, version=v), None))
                variants.append((f"v{v} S(max)", v, mla.mla_num_splits(MAX_LEN, M, H, Rkv, dr, version=v), None))
            if not quick:
                S = mla.mla_num_splits(MAX_LEN, M, H, Rkv, dr, version=2)
                for pf in (0, 1):
                    variants.append((f"v2 pf{pf} S(max)", 2, S, mla._attn2_params(H, Rkv, dr) + (pf,)))
                if S > 1:  # one block per SM (KDT_MLA_BLOCKS_PER_SM=1): half the partials to combine
                    variants.append(("v2 S(max)/2", 2, S // 2, None))
            S = mla.mla_num_splits(MAX_LEN, M, H, Rkv, dr, version=2)
            variants += [(f"v2 S(max) k{km}", 2, S, ("keys", km)) for km in split_keys]
            if combine_in and S > 1 and not attn_tc.uses_tc(M, H, Rkv, dr):
                variants += [(f"v2 ci{'' if on else '0'} S(max)", 2, S,
                              ("ci", on, cuda.to_device(np.zeros(mla.ATTN_SYNC_WORDS, np.int32)))) for on in (1, 0)]
            if tc and attn_tc.supports(H, Rkv, dr):  # on tensor cores, the engine's splits were it on
                S, S1 = attn_tc.num_splits(MAX_LEN, M, H), attn_tc.num_splits(MAX_LEN, M, H, NM=1)
                variants += [("v2 fma S(max)", 2, mla._fma_splits(MAX_LEN, M, H, Rkv, dr), ("fma",)),
                             ("v2 tc S(max)", 2, S, ("tc", 16, 0, 2, 4)),
                             ("v2 tc nm1 S(max)", 2, S1, ("tc", 16, 0, 1, 8)),
                             ("v2 tc nm1 cap S(max)", 2, S1, ("tc", 16, 128, 1, 8))]
                if kv_hl is not None:
                    variants.append(("v2 tc hl S(max)", 2, S, ("tc", 16, 0, 2, 4, kv_hl)))
            for label, v, S, prm in variants:
                scratch = cuda.device_array(max(1, mla.mla_scratch_size(M, H, Rkv, S)), np.float32)

                def fn(i, v=v, S=S, sc=scratch, Ld=L_dev, a=q_abs, p=q_pe, o=o_lat, vis=vis, prm=prm):
                    if prm is None:
                        mla.mla_attention(a, p, c_kv, k_pe, Ld, vis, scale, o, scratch=sc, n_splits=S, version=v,
                                          kv_hl=kv_hl)
                    elif prm[0] == "fma":  # version 2's FMA kernel where the default would take tensor cores
                        mla._mla_attention_v2(a, p, c_kv, k_pe, Ld, vis, scale, o, sc, S, 0, on_tc=False)
                    elif prm[0] == "tc":  # on tensor cores (BC, register cap)
                        _attention_tc(a, p, c_kv, k_pe, Ld, vis, scale, o, sc, S, *prm[1:])
                    elif prm[0] == "ci":  # the combine in the attention's launch, or not
                        mla._mla_attention_v2(a, p, c_kv, k_pe, Ld, vis, scale, o, sc, S, 0, sync=prm[2],
                                              combine_in=bool(prm[1]))
                    elif prm[0] == "keys":  # a floor on a split's keys
                        mla._mla_attention_v2(a, p, c_kv, k_pe, Ld, vis, scale, o, sc, S, 0, split_keys=prm[1])
                    else:  # a v2 geometry other than the default (the prefetch mode)
                        mla._mla_attention_v2(a, p, c_kv, k_pe, Ld, vis, scale, o, sc, S, 0, params=prm)

                yield "attention", f"M={M} H={H} L={L}", f"{label}={S}", fn, nb
        o = cuda.device_array((M, H * dv), np.float32)
        nb = H * dv * Rkv * wb + 4 * M * H * (Rkv + dv)
        for v in (1, 2):
            yield ("uv_project", f"M={M} H={H}", f"v{v}",
                   lambda i, v=v, ol=o_lat, o=o: mla.uv_project(ol, kv_b, o, version=v), nb)
        if mla.uv_uses_tc(M, kv_b, H, dv):  # v2 runs on tensor cores here: its FMA tiles beside it
            yield "uv_project", f"M={M} H={H}", "v2 fma", lambda i, ol=o_lat, o=o: _uv_fma(ol, kv_b, o), nb


# plans (rt, nt, u, nw, kw) of the absorb's GEMM on tensor cores timed (mla._absorb_tc_plan is one): 32 columns a
# block, its 4 warps splitting dn; 128 columns, a warp each and all of dn; 64, two warps each
ABSORB_PLANS = tuple((lambda M, u=u, kw=kw: (2, mla._absorb_tc_plan(M)[1], u, 4, kw))
                     for u, kw in ((2, 0), (4, 1), (4, 2)))


def _uv_fma(o_lat, kv_b, o) -> None:
    """uv_project version 2 on its FMA tiles where it would run on tensor cores (KDT_MLA_UV_TC_M=0)."""
    saved, mla.UV_TC_MIN_M = mla.UV_TC_MIN_M, 0
    try:
        mla.uv_project(o_lat, kv_b, o, version=2)
    finally:
        mla.UV_TC_MIN_M = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="moonlight-16b-a3b,kimi-k2")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "float32"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="skip the v2 prefetch-mode variants")
    ap.add_argument("--kernels", default=None, help="comma-separated kernels to time (q_absorb,attention,uv_project)")
    ap.add_argument("--split-keys", default="", help="comma-separated floors on a v2 split's keys to time beside the "
                    "default (KDT_MLA_SPLIT_KEYS)")
    ap.add_argument("--L", default="512,8192", help="comma-separated prefix lengths of the attention rows")
    ap.add_argument("--M", default="1,16,64", help="comma-separated token counts")
    ap.add_argument("--only", default=None, help="comma-separated variants to run (their labels before '=')")
    ap.add_argument("--ncu", action="store_true", help="no timing: each row once, then once in a profiled range "
                    "(ncu --profile-from-start off)")
    ap.add_argument("--tc", action="store_true", help="time the attention on tensor cores (kdt.kernels.attn_tc) "
                    "beside version 2's FMA kernel, with and without its register cap")
    ap.add_argument("--combine-in", action="store_true", help="time the FMA attention with its combine in its own "
                    "launch and in one of its own (kdt.kernels.mla.COMBINE_IN_MAX_M)")
    args = ap.parse_args(argv)
    split_keys = tuple(int(x) for x in args.split_keys.split(",") if x)
    only = args.kernels.split(",") if args.kernels else None
    bw = copy_bandwidth()
    print(f"device copy bandwidth: {bw / 1e9:.0f} GB/s (read + write); MLA_VERSION default = {mla.VERSION}")
    out = []
    for name in args.presets.split(","):
        print(f"-- {name} ({args.dtype} weights)")
        print(f"{'kernel':11s} {'shape':20s} {'variant':20s} {'us':>8s} {'GB/s':>7s} {'% copy':>7s} {'x v1':>6s}")
        base = {}
        for kernel, shape, variant, fn, nbytes in rows(name, args.dtype, args.quick, split_keys,
                                                       tuple(int(x) for x in args.L.split(",")),
                                                       tuple(int(x) for x in args.M.split(",")), args.tc,
                                                       args.combine_in):
            if (only and kernel not in only) or (args.only and variant.split("=")[0] not in args.only.split(",")):
                continue
            if args.ncu:
                for profiled in (False, True):
                    if profiled:
                        cuda.profile_start()
                    fn(0)
                    cuda.synchronize()
                    if profiled:
                        cuda.profile_stop()
                print(f"{kernel} {shape} {variant}: profiled", flush=True)
                continue
            us = time_us(fn)
            gbs = nbytes / us * 1e-3
            key = (kernel, shape, ("S(max)" if "S(max)" in variant else "S(L)") if kernel == "attention" else "")
            if variant.startswith("v1"):
                base[key] = us
            ref = base.get(key) or base.get((kernel, shape, "S(L)" if kernel == "attention" else ""))
            sp = f"{ref / us:5.1f}x" if ref else ""
            print(f"{kernel:11s} {shape:20s} {variant:20s} {us:8.1f} {gbs:7.0f} {100 * gbs * 1e9 / bw:6.1f}% {sp:>6s}",
                  flush=True)
            out.append(dict(preset=name, kernel=kernel, shape=shape, variant=variant, us=us, GBps=gbs,
                            pct_copy=100 * gbs * 1e9 / bw))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth_GBps": bw / 1e9, "dtype": args.dtype, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
