"""MLA attention on tensor cores (kdt.kernels.mla's version 2 at many query rows; flash attention over ``mma.sync``).

In the absorb form every head of every token attends to the same latent keys: query row rho = m H + h of
Q[M H, F] = [q_abs | q_pe] * scale (F = Rkv + dr) scores against K[t] = [c_kv[t] | k_pe[t]] and averages
V[t] = c_kv[t], so M tokens' attention is one GEMM pair over M H rows (MQA with M H query heads):

    S[rho, t] = Q[rho] . K[t] (masked: t < L, or vis[m, t - L]);  O[rho] = softmax_t(S[rho]) @ V.

Block (NM = 2 m-tiles of 16 query rows, NWK = 4 warps an m-tile, key tiles of BC = 16 keys; kdt.kernels.tc's mma
and ldmatrix):

- K tile, bf16 hi and lo planes (x = hi + lo to ~2^-17, as tc's x), [BC, FP / 2 + 4] words each (features F .. FP
  zero; 16 bytes of row pad: conflict-free ldmatrix). From the engine's pre-split cache (``kv_hl``, written beside
  c_kv / k_pe by the latent write: kdt.kernels.mla.kv_hl_np's words) ``cp.async`` copies keys [t0, t0 + BC) straight
  into one of two plane buffers while the other serves the tile before (``HL``); without it (the drafter's stacks),
  it copies them as float32 into a raw tile that the block then splits once into the planes.
- scores: warp (mt, c) holds its m-tile's Q over the feature steps c KSW .. (c + 1) KSW - 1 in registers (hi / lo
  A fragments, loaded once) and adds Q K^T over them for all BC keys: three mma a product (hi hi, hi lo, lo hi:
  ~2^-17 of a product, where float32 FMAs have 2^-24); the NWK partial [16, BC] tiles meet in shared memory.
- softmax: TPR threads a row (2 keys each) sum the partials, mask, keep the row's running max and sum (fp32 online
  softmax, version 2's: kdt.kernels.mla.online_softmax) and write p as hi / lo planes [BR, BC / 2 + 4] and the
  row's rescale.
- P V: warp (mt, c) owns columns c Rkv / NWK .. of its m-tile's output, fp32 accumulators in registers; V's
  fragments are the K tile's own c_kv words, read by ldmatrix transposed.

Splits and partials as version 2: grid (cdiv(M H, BR), S); split sp takes keys [sp kps, (sp + 1) kps), kps =
cdiv(L + M, S) rounded up to BC; S = 1 writes o_lat, else part[(rho S + sp) (Rkv + 2) + ..] = (acc, max, sum) for
kdt.kernels.mla's version 2 combine (launched with BT = BC). A block's tiles stop after the last key its rows see
(``VISIBLE_TILES``: the last visible new key of its tokens' vis rows), half a causal prefill's; a split left with none
writes an empty partial (max -inf, sum 0).
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
from numba import cuda, float32, int32, int64, uint8, uint32, uint64

from kdt.kernels import tc
from kdt.kernels.common import IS_SIM, Src, allow_dynamic_shared, cdiv, jit_source, register_ptx
from kdt.kernels.mla import MAX_SPLITS_V2, _num_sms, _shfl_xor, _split_keys, online_softmax

NEG_INF = float32(-np.inf)
# the fewest tokens version 2's attention runs here at any prefix (0: never; env KDT_MLA_ATTN_TC_M), and from how many
# it runs here at prefixes of long_l(M) keys or more (TC_LONG_L from 64 tokens, twice that from 32, four times below),
# version 2's FMA kernel below (0: never; env KDT_MLA_ATTN_TC_LONG_M, KDT_MLA_ATTN_TC_LONG_L). Session 32's s32a
# (Moonlight, attention + combine, us, FMA / here): M = 16 at L = 512 / 8192 29.3 / 183.8 against 66.6 / 154.1;
# session 33's s33a / s33c (the engine's pre-split cache): M = 64 at L = 512 / 1024 / 8192 63.9 / 105.0 / 679.7
# against 82.4 / 99.4 / 349.4; M = 96 114.2 / 196.2 / 1344.3 against 93.6 / 121.5 / 519.4; M = 128 at 512 / 8192
# 122.2 / 1354.0 against 106.7 / 642.6. A CUDA graph fixes its kernels per token count, not per prefix: between the
# two counts it launches both, each returning at once outside its prefixes, the FMA kernel in its own splits
# (mla._mla_attention_v2). Session 33 kept that off after Moonlight's budget-64 oracle left AR's tokens with it on;
# session 34's scripts/probe_divergence.py found the same departure with it off: two near-ties of the routing
# (AR's k-th and (k+1)-th choice scores 7.9e-6 and 2.3e-4 apart) that the verify's rounding flips, not this kernel.
# Session 34's s34a (us, both launched / FMA alone / here): M = 64 at L = 512 / 2048 / 8192 67.1 / 139.7 / 356.5
# against 64.2 / 187.0 / 681.7 and 82.1 / 135.2 / 350.4 (s33c, the FMA kernel in the tensor cores' splits: 78.1 at
# 512); M = 32 at 1024 / 2048 / 8192 FMA 60.5 / 101.6 / 347.4, here 78.3 / 97.6 / 207.0; M = 16 at 2048 / 8192 FMA
# 60.1 / 183.8, here 77.9 / 134.0
TC_MIN_M = int(os.environ.get("KDT_MLA_ATTN_TC_M", "96"))
TC_LONG_M = int(os.environ.get("KDT_MLA_ATTN_TC_LONG_M", "16"))
TC_LONG_L = int(os.environ.get("KDT_MLA_ATTN_TC_LONG_L", "1024"))
# A block's key tiles stop after the last key its rows see (session 41, s41b: the Moonlight prefill of 2048 tokens'
# attention 72.3 -> 42.1 ms on the H200, the tiles of a causal prefill halved); env KDT_MLA_ATTN_TC_VISIBLE=0: every
# block over all the keys of its split, as before (for a same-run A/B).
VISIBLE_TILES = os.environ.get("KDT_MLA_ATTN_TC_VISIBLE", "1") != "0"
MIN_KEYS_PER_SPLIT = 128  # a split's keys at least (the block loads its Q once a split)
SPLIT_BLOCKS_PER_SM = 2  # the splits aim at this many blocks an SM (a tail of one wave in two)
# the default geometry (session 32, s32a, Moonlight attention + combine at M = 64 / 256, L = 8192: 437.8 / 1610.4 us
# with 2 m-tiles of 4 warps, 580-636 / 2251-2430 with one m-tile of 8 warps, 679 / 2704 on FMA): two m-tiles a block
# share each staged key tile, 4 warps an m-tile hold 9 of Moonlight's 36 feature steps (no zero steps)
NM_DEFAULT, NWK_DEFAULT, BC_DEFAULT = 2, 4, 16


def supports(H: int, Rkv: int, dr: int) -> bool:
    """Shapes the kernel takes: Rkv a multiple of 64 (each warp's columns whole pairs of 8), dr of 4 (16-byte
    copies)."""
    return Rkv % 64 == 0 and dr % 4 == 0 and H >= 1


def uses_tc(M: int, H: int, Rkv: int, dr: int) -> bool:
    """Whether version 2's attention of M tokens runs here at any prefix (``TC_MIN_M``)."""
    return TC_MIN_M > 0 and M >= TC_MIN_M and supports(H, Rkv, dr)


def long_l(M: int) -> int:
    """The prefix from which M tokens that share (:func:`shares_tc`) run here: the FMA kernel's time grows with M L,
    this kernel's from a higher fixed cost more slowly, so fewer tokens cross over at a longer prefix."""
    return TC_LONG_L * (1 if M >= 64 else 2 if M >= 32 else 4)


def shares_tc(M: int, H: int, Rkv: int, dr: int, L: int | None = None) -> bool:
    """Whether version 2's attention of M tokens runs here at prefixes from :func:`long_l` keys, the FMA kernel below
    (``TC_LONG_M`` <= M < ``TC_MIN_M``); ``L``: the longest prefix the launch may see (None: any), e.g. an engine's
    max_len: a cache that never reaches long_l(M) keys leaves M tokens to the FMA kernel."""
    below = TC_MIN_M <= 0 or M < TC_MIN_M
    return 0 < TC_LONG_M <= M and below and supports(H, Rkv, dr) and (L is None or L >= long_l(M))


def runs_tc(H: int, Rkv: int, dr: int, max_tokens: int, max_len: int) -> bool:
    """Whether some forward of at most max_tokens tokens over a cache of max_len slots may run here."""
    return any(uses_tc(M, H, Rkv, dr) or shares_tc(M, H, Rkv, dr, max_len) for M in range(1, max_tokens + 1))


def supports_hl(Rkv: int, dr: int) -> bool:
    """Shapes whose pre-split cache rows copy in whole 16-byte chunks of each plane (F / 2 words a multiple of 4)."""
    return (Rkv + dr) % 8 == 0


def params(Rkv: int, dr: int, NM: int = NM_DEFAULT, BC: int = BC_DEFAULT, NWK: int = NWK_DEFAULT,
           HL: bool = False) -> dict:
    """Compile-time geometry: NM m-tiles a block, BC keys a tile, NWK warps an m-tile (the split of Q K^T's feature
    steps and of P V's columns); ``HL``: key tiles copied from the pre-split cache (two plane buffers), else from
    the float32 caches and split in shared memory."""
    TPR = min(2 * NWK, BC // 2)  # softmax threads a row (2 keys each)
    if BC % 16 or Rkv % (16 * NWK) or (HL and not supports_hl(Rkv, dr)):
        raise ValueError(f"bad attention tile BC={BC}, NWK={NWK}, HL={HL} for Rkv={Rkv}, dr={dr}")
    F = Rkv + dr
    KSW = cdiv(cdiv(F, 16), NWK)  # feature steps of 16 a warp
    FP = 16 * NWK * KSW
    return dict(Rkv=Rkv, dr=dr, F=F, NM=NM, BC=BC, NWK=NWK, TPR=TPR, BR=16 * NM, NT=32 * NWK * NM, KSW=KSW, FP=FP,
                SKW=FP // 2 + 4, SPW=BC // 2 + 4, KPT=BC // TPR, CP=Rkv // (16 * NWK), CWW=Rkv // NWK,
                F2=F // 2, ZW=(FP - F) // 2, RAW=0 if HL else BC * F, C4=Rkv // 4, CPR=F // 4, HL=HL, Q4=F // 8)


def num_splits(L: int, M: int, H: int, NM: int = NM_DEFAULT) -> int:
    """Splits of [0, L + M): about SPLIT_BLOCKS_PER_SM blocks an SM over the row tiles, MIN_KEYS_PER_SPLIT keys a
    split at least (the engine passes max_len as L: splits past the device's L stay empty)."""
    tiles = cdiv(M * H, 16 * NM)
    want = SPLIT_BLOCKS_PER_SM * _num_sms() // max(1, tiles)
    return int(max(1, min(want, cdiv(L + M, MIN_KEYS_PER_SPLIT), MAX_SPLITS_V2)))


def layout(BC, NM, NWK, BR, SKW, SPW, RAW, HL=False, **_) -> dict:
    """Word offsets of the GPU kernel's one dynamic shared array: the raw float32 key tile [BC, F] (without HL),
    the key tile's hi and lo planes [BC, SKW] (with HL twice: BUFW words a buffer), the warps' partial scores [NM,
    NWK, 16, BC + 1], p's hi and lo planes [BR, SPW], the rows' rescales [BR]; WORDS in all."""
    d = dict(RAW0=0, KHI=RAW, KLO=RAW + BC * SKW, SSW=BC + 1, BUFW=2 * BC * SKW)
    d["SS0"] = d["KLO"] + BC * SKW + (d["BUFW"] if HL else 0)
    d["PH0"] = d["SS0"] + NM * NWK * 16 * d["SSW"]
    d["PL0"] = d["PH0"] + BR * SPW
    d["AL0"] = d["PL0"] + BR * SPW
    d["WORDS"] = d["AL0"] + BR
    return d


def _source(Rkv, dr, F, NM, BC, NWK, TPR, BR, NT, KSW, FP, SKW, SPW, KPT, CP, CWW, F2, ZW, RAW, C4, CPR, HL, Q4,
            ops: set | None = None, LMIN: int = 0, VIS: bool = True, **_) -> str:
    """Python source of the kernel (module docstring), loops over registers written out. Two spellings of its shared
    memory: under the simulator Numba arrays and kdt.kernels.tc's emulations; on the GPU one dynamic array addressed
    by 32-bit registers plus immediates (``tc.smem_at``; the (op, immediate) pairs used go to ``ops``), intrinsics
    and builtins only: Numba's 64-bit index arithmetic and its inlined device functions cost more instructions than
    the mma themselves. ``VIS``: a block's tiles stop after its rows' last visible key (``VISIBLE_TILES``), else at
    its split's end."""
    s = Src()
    NP = BC // 16  # key pairs of n-tiles
    lay = layout(BC, NM, NWK, BR, SKW, SPW, RAW, HL)
    KHI, KLO, SS0, SSW, PH0, PL0, AL0, BUFW = (lay[k] for k in ("KHI", "KLO", "SS0", "SSW", "PH0", "PL0", "AL0",
                                                                 "BUFW"))
    ops = set() if ops is None else ops

    def at(op: str, imm: int, *args: str) -> str:  # GPU: one shared-memory instruction at args[0] + imm bytes
        ops.add((op, imm))
        return f"{op}_{imm}({', '.join(args)})"

    def mma(a: str, b0: str, b1: str, acc: str) -> None:
        s(f"{acc} = mma({a}, {b0}, {b1}, {acc}" + (", frag, warp, lane)" if IS_SIM else ")"))

    def shfl(v: str, off: int) -> str:
        return f"shfl(xbuf, tid, {v}, {off})" if IS_SIM else f"cuda.shfl_xor_sync(0xFFFFFFFF, {v}, {off})"

    def issue(tn: str) -> None:  # cp.async of keys [tn, tn + BC) (rows past t_end: the last key's) into raw
        if IS_SIM:
            with s.block(f"for e in range(tid, {BC * CPR}, {NT}):"):
                s(f"kk = e // {CPR}")
                s(f"ch = e - kk * {CPR}")
                s(f"tr = min({tn} + kk, t_end - 1)")
                with s.block(f"if ch < {C4}:"):
                    s(f"cp_async16(raw, kk * {F} + 4 * ch, c_kv, tr * {Rkv} + 4 * ch, 16)")
                with s.block("else:"):
                    s(f"cp_async16(raw, kk * {F} + 4 * ch, k_pe, tr * {dr} + 4 * (ch - {C4}), 16)")
        else:  # chunk e = tid + NT j: raw bytes 16 e (the tile's rows are contiguous there)
            for j in tile_chunks(tn):
                s(f"src = (cb + uint64(4 * (tr * {Rkv} + 4 * ch))) if ch < {C4} else "
                  f"(pb + uint64(4 * (tr * {dr} + 4 * (ch - {C4}))))")
                s(at("cp16", 16 * NT * j, "rd", "src"))
        s("cp_async_commit()")

    def tile_chunks(tn: str):  # this thread's 16-byte chunks e = tid + NT j (yields j) of keys [tn, tn + BC): key kk
        # (its row tr: rows past t_end the last key's), its chunk ch
        for j in range(cdiv(BC * CPR, NT)):
            with s.block(f"if tid + {NT * j} < {BC * CPR}:" if (j + 1) * NT > BC * CPR else "if True:"):
                s(f"e = tid + {NT * j}")
                s(f"kk = e // {CPR}")
                s(f"ch = e - kk * {CPR}")
                s(f"tr = min({tn} + kk, t_end - 1)")
                yield j

    def issue_hl(tn: str, buf: str) -> None:  # cp.async of pre-split keys [tn, tn + BC) into plane buffer buf
        for _ in tile_chunks(tn):  # key kk's words 4 ch .. (hi planes for ch < Q4, then lo)
            s(f"dw = kk * {SKW} + 4 * ch + ({BC * SKW - 4 * Q4} if ch >= {Q4} else 0)  # plane word")
            if IS_SIM:
                s(f"cp_async16(sKp, {buf} * {2 * BC * SKW} + dw, kv_hl, tr * {F} + 4 * ch, 16)")
            else:
                s(f"da = uint32({buf} + 4 * dw)")
                s(f"src = hb + uint64(4 * (tr * {F} + 4 * ch))")
                s(at("cp16", 4 * KHI, "da", "src"))
        s("cp_async_commit()")

    args = "kv_hl" if HL else "c_kv, k_pe"
    with s.block(f"def mla_attention_tc(q_abs, q_pe, {args}, L_dev, vis, scale, o_lat, part):"):
        s(f'"""kdt.kernels.attn_tc: grid (cdiv(M H, BR), S), block (NT,); {"kv_hl" if HL else "c_kv / k_pe"} '
          'C-contiguous."""')
        s("grid_dependency_wait()  # first (kdt.kernels.common, PDL)")
        s("tid = cuda.threadIdx.x")
        s("warp = tid // 32")
        s("lane = tid - warp * 32")
        s("g = lane // 4")
        s("t4 = lane - g * 4")
        s(f"mt = warp // {NWK}  # this warp's m-tile")
        s(f"c = warp - mt * {NWK}  # its share: feature steps of Q K^T, columns of P V")
        s("M = q_abs.shape[0]")
        s("H = q_abs.shape[1]")
        s("MH = M * H")
        s("sp = cuda.blockIdx.y")
        s("S = cuda.gridDim.y")
        s("L = L_dev[0]")
        if LMIN:  # shorter prefixes are version 2's FMA kernel's (shares_tc)
            with s.block(f"if L < {LMIN}:"):
                s("return")
        s("T = L + M")
        _split_keys(s, 0, str(BC))  # version 2's rule: its combine reads these splits
        s("t_lo = sp * kps")
        with s.block("if t_lo >= T:"):
            s("return")
        s("t_hi = min(t_lo + kps, T)")
        s(f"row0 = cuda.blockIdx.x * {BR}")
        if not VIS:
            s("t_end = t_hi")
        else:
            s("# the block's last visible new key jv (its tokens' vis rows): keys from L + jv + 1 on are masked")
            s("# for every row, so the tiles stop at t_end (a causal prefill or a tree, whose nodes see no later")
            s("# node: tokens m_a .. m_b see keys below L + m_b + 1, about half a prefill's tiles)")
            s("m_a = row0 // H")
            s(f"m_b = min(row0 + {BR - 1}, MH - 1) // H")
            s("jv = int32(-1)")
            with s.block("for mv in range(m_a, m_b + 1):"):
                with s.block(f"for jj in range(tid, M, {NT}):"):
                    with s.block("if vis[mv, jj] != 0:"):
                        s("jv = max(jv, int32(jj))")
            s("sJv = cuda.shared.array(1, int32)")
            with s.block("if tid == 0:"):
                s("sJv[0] = -1")
            s("cuda.syncthreads()")
            if IS_SIM:  # (no warp shuffles: every thread's atomic)
                s("cuda.atomic.max(sJv, 0, jv)")
            else:  # a warp's max by shuffles, then one atomic a warp (one a thread cost ~2% at L = 8192, s42a)
                for off in (16, 8, 4, 2, 1):
                    s(f"jv = max(jv, cuda.shfl_xor_sync(0xFFFFFFFF, jv, {off}))")
                with s.block("if tid % 32 == 0:"):
                    s("cuda.atomic.max(sJv, 0, jv)")
            s("cuda.syncthreads()")
            s("t_end = min(t_hi, L + sJv[0] + 1)")
        s(f"sMl = cuda.shared.array((2, {BR}), float32)  # a row's final max and sum")
        s(f"# softmax role: row sr of the block ({TPR} threads a row), keys sub * KPT .. (threads past BR rows: the")
        s("# last row again, never written)")
        s(f"sr = min(tid // {TPR}, {BR - 1})")
        s(f"sub = tid - (tid // {TPR}) * {TPR}")
        s(f"sw = tid < {BR * TPR}  # this thread writes its row's values")
        s("smt = sr // 16")
        s("srr = sr - smt * 16")
        s(f"col0 = c * {CWW}  # this warp's output columns")
        if IS_SIM and HL:
            s(f"sKp = cuda.shared.array((2, 2, {BC}, {SKW}), uint32)  # [buffer, hi / lo, key, word]: key tiles")
        elif IS_SIM:
            s(f"raw = cuda.shared.array(({BC}, {F}), float32)  # the key tile as copied, float32")
            s(f"sKh = cuda.shared.array(({BC}, {SKW}), uint32)  # .. as bf16 hi of feature pairs")
            s(f"sKl = cuda.shared.array(({BC}, {SKW}), uint32)  # .. and lo")
        if IS_SIM:
            s(f"sS = cuda.shared.array(({NM}, {NWK}, 16, {SSW}), float32)  # the warps' partial scores")
            s(f"sPh = cuda.shared.array(({BR}, {SPW}), uint32)  # p hi / lo of key pairs")
            s(f"sPl = cuda.shared.array(({BR}, {SPW}), uint32)")
            s(f"sAl = cuda.shared.array({BR}, float32)  # a row's rescale this tile")
            s(f"xbuf = cuda.shared.array({NT}, float32)  # the simulator's shuffles")
            s("frag = cuda.shared.array(FRAG, int64)  # the simulator's mma")
        else:  # kdt.kernels.attn_tc.layout; per-lane addresses, bytes
            s("sm = cuda.shared.array(0, uint32)")
            s("sb = smem_base(sm)")
            s("lrow = (lane & 7) + ((lane >> 3) & 1) * 8  # the row this lane addresses in an ldmatrix")
            s("lcol = (lane >> 4) * 4")
            s(f"laS = uint32(sb + 4 * (lrow * {SKW} + lcol) + {32 * KSW} * c)  # K planes at this warp's features")
            s(f"laV = uint32(sb + 4 * (lrow * {SKW} + lcol) + 2 * col0)  # .. at its columns")
            s(f"laP = uint32(sb + 4 * ({PH0} + (mt * 16 + lrow) * {SPW} + lcol))  # p planes at its m-tile")
            s(f"sSa = uint32(sb + 4 * ({SS0} + ((mt * {NWK} + c) * 16 + g) * {SSW} + 2 * t4))  # its partial scores")
            s(f"sSr = uint32(sb + 4 * ({SS0} + (smt * {NWK * 16} + srr) * {SSW} + sub * {KPT}))  # row sr's")
            s(f"sPa = uint32(sb + 4 * ({PH0} + sr * {SPW} + sub * {KPT // 2}))  # row sr's p words")
            s(f"sAa = uint32(sb + 4 * ({AL0} + sr))")
            s(f"sAr = uint32(sb + 4 * ({AL0} + mt * 16 + g))")
            if HL:
                s("hb = gmem_base(kv_hl)")
            else:
                s("rd = uint32(sb + 16 * tid)  # this thread's first raw chunk")
                s("rs = uint32(sb + 8 * tid)  # .. and pair")
                s("cb = gmem_base(c_kv)")
                s("pb = gmem_base(k_pe)")
        if ZW:
            with s.block(f"for e in range(tid, {BC * ZW}, {NT}):  # features F .. FP: zeros, once"):
                s(f"kz = e // {ZW}")
                s(f"w = {F2} + e - kz * {ZW}")
                for b in range(2 if HL else 1):
                    if IS_SIM and HL:
                        s(f"sKp[{b}, 0, kz, w] = uint32(0)")
                        s(f"sKp[{b}, 1, kz, w] = uint32(0)")
                    elif IS_SIM:
                        s("sKh[kz, w] = uint32(0)")
                        s("sKl[kz, w] = uint32(0)")
                    else:
                        s(f"za = uint32(sb + 4 * (kz * {SKW} + w))")
                        s(at("st_u32", 4 * (KHI + b * BUFW), "za", "uint32(0)"))
                        s(at("st_u32", 4 * (KLO + b * BUFW), "za", "uint32(0)"))
        s("# ---- Q's A fragments of this warp's feature steps, hi / lo, scaled (rows past M H: zeros)")
        s("ra = row0 + mt * 16 + g")
        s("rb = ra + 8")
        for row in ("ra", "rb"):
            s(f"m_{row} = min({row}, MH - 1) // H")
            s(f"h_{row} = min({row}, MH - 1) - m_{row} * H")
        for i in range(KSW):
            for r, (row, df) in enumerate((("ra", 0), ("rb", 0), ("ra", 8), ("rb", 8))):
                s(f"f = (c * {KSW} + {i}) * 16 + 2 * t4 + {df}")
                s("x0 = x1 = float32(0.0)")
                with s.block(f"if {row} < MH and f < {F}:"):
                    with s.block(f"if f < {Rkv}:"):
                        s(f"x0 = q_abs[m_{row}, h_{row}, f] * scale")
                        s(f"x1 = q_abs[m_{row}, h_{row}, f + 1] * scale")
                    with s.block("else:"):
                        s(f"x0 = q_pe[m_{row}, h_{row}, f - {Rkv}] * scale")
                        s(f"x1 = q_pe[m_{row}, h_{row}, f - {Rkv - 1}] * scale")
                s(f"qh_{i}_{r}, ql_{i}_{r} = split(x0, x1)")
        s("m_me = min(row0 + sr, MH - 1) // H  # the row's token (rows past M H: the last, never stored)")
        s("m_run = NEG_INF")
        s("l_run = float32(0.0)")
        for q in range(CP):
            for n in range(2):
                s(" = ".join(f"o_{q}_{n}_{j}" for j in range(4)) + " = float32(0.0)")
        if HL:  # the plane buffer of this tile (simulator: its index; GPU: its byte offset) and of the next
            s("bk = 0" if IS_SIM else "bk = uint32(0)")
        with s.block("if t_lo < t_end:  # (else no tile: this split's partials stay empty, max NEG_INF, sum 0)"):
            if HL:
                issue_hl("t_lo", "bk" if IS_SIM else "sb")
            else:
                issue("t_lo")
        with s.block(f"for t0 in range(t_lo, t_end, {BC}):"):
            s("cp_async_wait()")
            s("cuda.syncthreads()  # the tile's copies landed; everyone is done with the previous tile")
            if HL:
                s("bn = 1 - bk" if IS_SIM else f"bn = uint32({4 * BUFW}) - bk")
                with s.block(f"if t0 + {BC} < t_end:  # the next tile's copies, in flight during this one"):
                    issue_hl(f"t0 + {BC}", "bn" if IS_SIM else "(sb + bn)")
                if IS_SIM:
                    s("sKh = sKp[bk, 0]")
                    s("sKl = sKp[bk, 1]")
                else:
                    s("laSb = laS + bk")
                    s("laVb = laV + bk")
            elif IS_SIM:
                with s.block(f"for e in range(tid, {BC * F2}, {NT}):  # raw -> hi / lo planes"):
                    s(f"kk = e // {F2}")
                    s(f"w = e - kk * {F2}")
                    s("sKh[kk, w], sKl[kk, w] = split(raw[kk, 2 * w], raw[kk, 2 * w + 1])")
            else:  # pair e = tid + NT j = kk F2 + w: raw bytes 8 e, plane word kk SKW + w
                for j in range(cdiv(BC * F2, NT)):
                    with s.block(f"if tid + {NT * j} < {BC * F2}:" if (j + 1) * NT > BC * F2 else "if True:"):
                        s(f"x0, x1 = {at('ld_v2f32', 8 * NT * j, 'rs')}")
                        s("hw, lw = split(x0, x1)")
                        s(f"e = tid + {NT * j}")
                        s(f"pa = uint32(sb + 4 * (e + {SKW - F2} * (e // {F2})))  # word kk SKW + w")
                        s(at("st_u32", 4 * KHI, "pa", "hw"))
                        s(at("st_u32", 4 * KLO, "pa", "lw"))
            if not HL:
                s("cuda.syncthreads()")
                with s.block(f"if t0 + {BC} < t_end:  # the next tile's copies, in flight during this one"):
                    issue(f"t0 + {BC}")
            s("# ---- this warp's part of S = Q K^T over its feature steps, all BC keys")
            for p in range(NP):
                for n in range(2):
                    s(" = ".join(f"s_{p}_{n}_{j}" for j in range(4)) + " = float32(0.0)")
            for i in range(KSW):
                qh = ", ".join(f"qh_{i}_{r}" for r in range(4))
                ql = ", ".join(f"ql_{i}_{r}" for r in range(4))
                for p in range(NP):
                    for hl, base in (("h", KHI), ("l", KLO)):
                        if IS_SIM:
                            s(f"b{hl}0, b{hl}1, b{hl}2, b{hl}3 = ldsm(sK{hl}, {16 * p}, (c * {KSW} + {i}) * 16, lane)")
                        else:
                            imm = 4 * (base + 16 * p * SKW) + 32 * i
                            s(f"b{hl}0, b{hl}1, b{hl}2, b{hl}3 = " + at("ldsm", imm, "laSb" if HL else "laS"))
                    for n in range(2):
                        acc = ", ".join(f"s_{p}_{n}_{j}" for j in range(4))
                        for a, b0, b1 in ((qh, f"bh{n}", f"bh{n + 2}"), (qh, f"bl{n}", f"bl{n + 2}"),
                                          (ql, f"bh{n}", f"bh{n + 2}")):
                            mma(a, b0, b1, acc)
            for p in range(NP):
                for n in range(2):
                    for j, (dg, dk) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
                        k = 16 * p + 8 * n + dk
                        if IS_SIM:
                            s(f"sS[mt, c, g + {dg}, {k} + 2 * t4] = s_{p}_{n}_{j}")
                        else:
                            s(at("st_f32", 4 * (k + dg * SSW), "sSa", f"s_{p}_{n}_{j}"))
            s("cuda.syncthreads()")
            s("# ---- online softmax of row sr over its keys sub * KPT ..")
            for k in range(KPT):
                s(f"tk = t0 + sub * {KPT} + {k}")
                if IS_SIM:
                    s(f"v_{k} = " + " + ".join(f"sS[smt, {w}, srr, sub * {KPT} + {k}]" for w in range(NWK)))
                else:
                    s(f"v_{k} = " + " + ".join(at("ld_f32", 4 * (w * 16 * SSW + k), "sSr") for w in range(NWK)))
                s(f"v_{k} = v_{k} if (tk < t_end and (tk < L or vis[m_me, tk - L] != 0)) else NEG_INF")
            online_softmax(s, [f"v_{k}" for k in range(KPT)], TPR, shfl)
            with s.block("if sw:"):
                for k in range(0, KPT, 2):
                    s(f"ph, pl = split(p_{k}, p_{k + 1})")
                    if IS_SIM:
                        s(f"sPh[sr, sub * {KPT // 2} + {k // 2}] = ph")
                        s(f"sPl[sr, sub * {KPT // 2} + {k // 2}] = pl")
                    else:
                        s(at("st_u32", 2 * k, "sPa", "ph"))
                        s(at("st_u32", 2 * k + 4 * (PL0 - PH0), "sPa", "pl"))
                with s.block("if sub == 0:"):
                    s("sAl[sr] = alpha" if IS_SIM else at("st_f32", 0, "sAa", "alpha"))
            s("cuda.syncthreads()")
            s("# ---- O = O * alpha + P V over this warp's columns")
            if IS_SIM:
                s("al0 = sAl[mt * 16 + g]")
                s("al1 = sAl[mt * 16 + g + 8]")
            else:
                s(f"al0 = {at('ld_f32', 0, 'sAr')}")
                s(f"al1 = {at('ld_f32', 32, 'sAr')}")
            for q in range(CP):
                for n in range(2):
                    for j, al in enumerate(("al0", "al0", "al1", "al1")):
                        s(f"o_{q}_{n}_{j} *= {al}")
            for kk in range(NP):
                if IS_SIM:
                    s(f"ah0, ah1, ah2, ah3 = ldsm(sPh, mt * 16, {16 * kk}, lane)")
                    s(f"aq0, aq1, aq2, aq3 = ldsm(sPl, mt * 16, {16 * kk}, lane)")
                else:
                    s("ah0, ah1, ah2, ah3 = " + at("ldsm", 32 * kk, "laP"))
                    s("aq0, aq1, aq2, aq3 = " + at("ldsm", 32 * kk + 4 * (PL0 - PH0), "laP"))
                for q in range(CP):
                    for hl, base in (("h", KHI), ("l", KLO)):
                        if IS_SIM:
                            s(f"v{hl}0, v{hl}1, v{hl}2, v{hl}3 = ldsm_t(sK{hl}, {16 * kk}, col0 + {16 * q}, lane)")
                        else:
                            s(f"v{hl}0, v{hl}1, v{hl}2, v{hl}3 = "
                              + at("ldsm_t", 4 * (base + 16 * kk * SKW) + 32 * q, "laVb" if HL else "laV"))
                    for n in range(2):
                        acc = ", ".join(f"o_{q}_{n}_{j}" for j in range(4))
                        for a, b0, b1 in (("ah0, ah1, ah2, ah3", f"vh{2 * n}", f"vh{2 * n + 1}"),
                                          ("ah0, ah1, ah2, ah3", f"vl{2 * n}", f"vl{2 * n + 1}"),
                                          ("aq0, aq1, aq2, aq3", f"vh{2 * n}", f"vh{2 * n + 1}")):
                            mma(a, b0, b1, acc)
            if HL:
                s("bk = bn")
        with s.block("if sub == 0 and sw:"):
            s("sMl[0, sr] = m_run")
            s("sMl[1, sr] = l_run")
            s("rho = row0 + sr")
            with s.block("if S > 1 and rho < MH:"):
                s(f"base = (rho * S + sp) * {Rkv + 2}")
                s(f"part[base + {Rkv}] = m_run")
                s(f"part[base + {Rkv + 1}] = l_run")
        s("cuda.syncthreads()")
        s("# ---- this lane's rows ra, rb: o_lat (one split) or the partials")
        for half, row, lrow in ((0, "ra", "mt * 16 + g"), (1, "rb", "mt * 16 + g + 8")):
            with s.block(f"if {row} < MH:"):
                s(f"mo = {row} // H")
                s(f"ho = {row} - mo * H")
                s(f"inv = float32(1.0) / sMl[1, {lrow}] if S == 1 else float32(1.0)")
                s(f"base = ({row} * S + sp) * {Rkv + 2}")
                for q in range(CP):
                    for n in range(2):
                        for j in range(2):
                            col = f"col0 + {16 * q + 8 * n + j} + 2 * t4"
                            v = f"o_{q}_{n}_{2 * half + j}"
                            with s.block("if S == 1:"):
                                s(f"o_lat[mo, ho, {col}] = {v} * inv")
                            with s.block("else:"):
                                s(f"part[base + {col}] = {v}")
    return s.text()


@functools.cache
def kernel(Rkv: int, dr: int, NM: int = NM_DEFAULT, BC: int = BC_DEFAULT, NWK: int = NWK_DEFAULT, regs: int = 0,
           HL: bool = False, LMIN: int = 0, VIS: bool = True):
    """The kernel for one geometry (cached); ``.geom`` holds its constants. ``regs``: ptxas's register cap (0: none;
    the default geometry takes 255, one block an SM); ``HL``: it reads the pre-split cache (:func:`params`); LMIN >
    0: it returns at once for prefixes L < LMIN (:func:`shares_tc`); ``VIS``: a block's key tiles stop after the
    last key its rows see (:data:`VISIBLE_TILES`)."""
    g = params(Rkv, dr, NM, BC, NWK, HL)
    ns = dict(cuda=cuda, float32=float32, uint32=uint32, uint64=uint64, int32=int32, int64=int64, math=math,
              NEG_INF=NEG_INF, FRAG=tc.frag_shape(g["NWK"] * NM), cp_async_commit=tc.cp_async_commit,
              cp_async_wait=tc.cp_async_wait(0))
    ops: set = set()
    src = _source(**g, ops=ops, LMIN=LMIN, VIS=VIS)
    if IS_SIM:
        ns.update(mma=tc.mma_bf16, ldsm=tc.ldsm_x4, ldsm_t=tc.ldsm_x4_t, split=tc.split_bf16x2, shfl=_shfl_xor,
                  cp_async16=tc.cp_async16)
    else:
        ns.update(mma=tc.mma_intrinsic, split=tc.split_bf16x2_asm, smem_base=tc.smem_base, gmem_base=tc.gmem_base)
        ns.update({f"{op}_{imm}": tc.smem_at(op, imm) for op, imm in ops})
    opts = {"max_registers": regs} if regs and not IS_SIM else {}
    k = jit_source(src, "mla_attention_tc", ns, __name__, **opts)
    k.geom = g
    k.dyn_shared = 0 if IS_SIM else 4 * layout(**g)["WORDS"]
    return k


def attention(q_abs, q_pe, c_kv_cache, k_pe_cache, L_dev, vis, scale, o_lat, part, S: int, stream=0,
              NM: int = NM_DEFAULT, BC: int = BC_DEFAULT, regs: int = 0, NWK: int = NWK_DEFAULT, kv_hl=None,
              LMIN: int = 0) -> int:
    """Launch the kernel (S splits; S > 1: ``part`` holds the partials for kdt.kernels.mla's version 2 combine with
    BT = BC, returned). The caches as float32 [max_len, Rkv] / [max_len, dr] C-contiguous device arrays; with
    ``kv_hl`` (uint32 [max_len, Rkv + dr], their pre-split copy: kdt.kernels.mla.kv_hl_np) the kernel reads that
    instead. LMIN > 0: nothing for prefixes L < LMIN (the FMA kernel's, launched beside it)."""
    M, H, Rkv = q_abs.shape
    dr = q_pe.shape[2]
    HL = kv_hl is not None
    k = kernel(Rkv, dr, NM, BC, NWK, regs, HL, LMIN, VISIBLE_TILES)
    g = k.geom
    caches = (kv_hl,) if HL else (c_kv_cache, k_pe_cache)
    args = (q_abs, q_pe, *caches, L_dev, vis, np.float32(scale), o_lat, part)
    allow_dynamic_shared(k, args, k.dyn_shared)
    k[(cdiv(M * H, g["BR"]), S), g["NT"], stream, k.dyn_shared](*args)
    return BC


def _register() -> None:
    f32_1, f32_2, f32_3 = float32[::1], float32[:, ::1], float32[:, :, ::1]
    rest = (int64[::1], uint8[:, ::1], float32, f32_3, f32_1)
    for Rkv, dr, NM, NWK, HL, LMIN, VIS in ((512, 64, 2, 4, True, 0, True), (512, 64, 2, 4, True, 1024, True),
                                            (512, 64, 2, 4, False, 0, True), (512, 64, 1, 8, False, 0, True),
                                            (64, 16, 2, 4, True, 0, True), (512, 64, 2, 4, True, 0, False)):
        sig = (f32_3, f32_3) + ((uint32[:, ::1],) if HL else (f32_2, f32_2)) + rest
        register_ptx(kernel(Rkv, dr, NM, BC_DEFAULT, NWK, HL=HL, LMIN=LMIN, VIS=VIS), sig,
                     name=f"mla_attention_tc[Rkv={Rkv},NM={NM},NWK={NWK},HL={int(HL)},LMIN={LMIN}"
                          + ("" if VIS else ",VIS=0") + "]")


_register()
