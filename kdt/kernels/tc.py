"""Tensor cores from Numba: PTX's warp-wide ``mma.sync`` (m16n8k16, bf16 inputs, fp32 accumulation) as an
inline-assembly intrinsic, and the skinny-GEMM warp tile that kdt's MoE kernels build on it.

Numba has no tensor-core API, but llvmlite's ``InlineAsm`` emits any PTX instruction (as ``griddepcontrol`` in
:mod:`kdt.kernels.common`), and ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`` is one instruction:
D[16 x 8] = A[16 x 16] B[16 x 8] + C, each of the warp's 32 lanes holding a fixed piece of every matrix. With
lane = 4 g + t (g = 0..7, t = 0..3; PTX ISA, "matrix fragments for mma.m16n8k16 with floating point type"):

- A (row-major, two bf16 a 32-bit register, the lower column in the low half): a0 = A[g, 2t:2t+2],
  a1 = A[g+8, 2t:2t+2], a2 = A[g, 2t+8:2t+10], a3 = A[g+8, 2t+8:2t+10];
- B (column-major): b0 = B[2t:2t+2, g], b1 = B[2t+8:2t+10, g];
- C and D (fp32): c0, c1 = C[g, 2t], C[g, 2t+1]; c2, c3 = C[g+8, 2t], C[g+8, 2t+1].

kdt puts the weights in A (16 output rows) and the tokens in B (8 token columns): a warp computes
y^T[16 rows, 8 tokens] += W[rows, k] x[tokens, k]^T per instruction, for the skinny shapes of a DDTree verify
(an expert sees ~6 of 64 tokens). The k order inside one mma is free (a product's sum does not depend on which
k is called which, as long as A and B agree), so lane (g, t) takes the 8-byte weight word w = kb + t (bf16
elements 4w .. 4w+3) of rows g and g+8: its low half (4w, 4w+1) is a0 / a1, its high half (4w+2, 4w+3) a2 / a3,
and token g's x elements of the same word are b0 = x[4w, 4w+1], b1 = x[4w+2, 4w+3]. One mma consumes the words
kb .. kb+3 of 16 rows (32 bytes a row, one sector), with plain 8-byte loads and no shuffles.

Precision: x is float32; it enters as two bf16, hi = bf16(x) and lo = bf16(x - hi) (x - hi is exact in
float32), one mma each into the same accumulators. x is so carried to ~2^-17 of itself, a bf16 weight's
products are exact and the sums fp32: about the error of float32 FMAs (bf16 x alone would add ~2^-9 a term).

X layouts (``xl``): ``XL_NATURAL`` float32 [rows, K]; ``XL_PERM`` float32 word-permuted (element 4 w + i at
column i Kw + w, kdt.kernels.moe's FMA layout); ``XL_HILO`` x already split into hi and lo by its producer
(:func:`put_hilo`): uint64 [rows, 2 Kw], word 2 w the hi bf16 of elements 4 w .. 4 w + 3 (element 4 w + i in
bits 16 i), word 2 w + 1 their lo: the same bytes as float32, and the warp tile loads a token tile's two b
fragments of a group as two words instead of four floats and ~50 integer instructions of splitting.

Fragment order (``fo``; :func:`fo_np`, :func:`to_fo`): the same uint64 [E, N, Kw] array, N % 16 == 0 and
Kw % 4 == 0, its 16 rows x 4 words of a row tile and group rearranged so that lane (g, t) finds its four A
registers (a0, a1, a2, a3) = (lo, lo, hi, hi halves of word 4 grp + t of rows g, g + 8) as 16 contiguous bytes:
word 2 lane (+ 1) of the group's 64, the tile's groups one after another over the bytes of its 16 rows. A warp
then reads a group as one 16-byte load a lane, 512 contiguous bytes, where the natural order takes two 8-byte loads
and ~6 register moves an A fragment (the mma wants a0 .. a3 in four consecutive registers; a natural word holds
a0 and a2). The same fragments, so the same sums.

Under the simulator the mma is emulated for the whole warp through shared memory (``frag``, int64
[warps, 32, 6]; a (1, 1, 1) array, unused, on the GPU) and ``cuda.syncthreads``: every warp of a block must
issue the same number of mma (the warp tile below keeps its trip counts uniform).
"""

from __future__ import annotations

import os

import numpy as np
from numba import cuda, float32, int64, uint32, uint64

from kdt.kernels.common import (
    IS_SIM,
    bf16_bits_to_f32,
    bf16_to_f32,
    f32_bits,
    f32_from_bits,
    f32_to_bf16,
    f32_to_bf16_bits,
    grid_dependency_wait,
    ldcs3,
)

MMA_ROWS = 16  # weight rows (A's rows) of one mma; its 8 token columns (B's) and 4 weight words a row are literals
XL_NATURAL, XL_PERM, XL_HILO = 0, 1, 2  # X layouts of the warp tile (module docstring)
XL_NAMES = {XL_NATURAL: "", XL_PERM: "_perm", XL_HILO: "_hilo"}


def frag_shape(nw: int) -> tuple[int, int, int]:
    """Shape of a kernel's ``frag`` shared array (int64) for nw warps: the simulator's mma exchange."""
    return (nw, 32, 6) if IS_SIM else (1, 1, 1)


if IS_SIM:
    _LANES = np.arange(32)
    _G, _T = _LANES // 4, _LANES % 4

    def _bf16_np(u):
        """uint bf16 bit patterns (any shape) -> float64."""
        return (np.asarray(u, dtype=np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)

    @cuda.jit(device=True)
    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, frag, warp, lane):
        """(d0, d1, d2, d3): this lane's part of D = A B + C over the warp (simulator: the warp's fragments
        through ``frag``, the product in float64, each output rounded once to float32)."""
        cuda.syncthreads()
        f = frag[warp, lane]
        f[0], f[1], f[2], f[3], f[4], f[5] = a0, a1, a2, a3, b0, b1
        cuda.syncthreads()
        F = frag[warp].astype(np.uint32)
        lo, hi = _bf16_np(F & np.uint32(0xFFFF)), _bf16_np(F >> np.uint32(16))
        A = np.zeros((16, 16))
        B = np.zeros((16, 8))
        for reg, dr, dc in ((0, 0, 0), (1, 8, 0), (2, 0, 8), (3, 8, 8)):
            A[_G + dr, 2 * _T + dc] = lo[:, reg]
            A[_G + dr, 2 * _T + dc + 1] = hi[:, reg]
        for reg, dk in ((4, 0), (5, 8)):
            B[2 * _T + dk, _G] = lo[:, reg]
            B[2 * _T + dk + 1, _G] = hi[:, reg]
        D = A @ B
        g, t = lane // 4, lane % 4
        d = (np.float32(c0 + D[g, 2 * t]), np.float32(c1 + D[g, 2 * t + 1]),
             np.float32(c2 + D[g + 8, 2 * t]), np.float32(c3 + D[g + 8, 2 * t + 1]))
        cuda.syncthreads()
        return d

else:
    from llvmlite import ir as _ir
    from numba import types as _types
    from numba.cuda.extending import intrinsic as _intrinsic

    _MMA = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{$10, $11, $12, $13};")

    @_intrinsic
    def _mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sig = _types.UniTuple(_types.float32, 4)(*([_types.uint32] * 6 + [_types.float32] * 4))

        def codegen(context, builder, sig, args):
            f32, i32 = _ir.FloatType(), _ir.IntType(32)
            fty = _ir.FunctionType(_ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
            asm = _ir.InlineAsm(fty, _MMA, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            ret = builder.call(asm, args)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(ret, i) for i in range(4)])

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, frag, warp, lane):
        """(d0, d1, d2, d3): this lane's part of D = A B + C over the warp (one ``mma.sync``; ``frag``,
        ``warp`` and ``lane`` are the simulator's)."""
        return _mma(uint32(a0), uint32(a1), uint32(a2), uint32(a3), uint32(b0), uint32(b1),
                    float32(c0), float32(c1), float32(c2), float32(c3))


# ---- cp.async: global -> shared copies that hold no registers while in flight ------------------------------------
# cp_async16(dst, doff, src, soff, n): the 16 bytes at element offset soff of src (from its first element; a
# C-contiguous array, 16-byte aligned there) to element offset doff of dst (a shared array), the last 16 - n of them
# zeros (n = 0 or 16: a masked copy reads nothing); cp_async_commit() closes this thread's group of copies;
# cp_async_wait(n) (a factory: n is a literal of the PTX) waits until at most its n newest groups are in flight. A
# copy is complete for the thread that issued it: other lanes see it after a warp barrier.
if IS_SIM:  # copies are synchronous; memory is coherent

    def cp_async16(dst, doff, src, soff, n):
        vals = np.zeros(16 // src.dtype.itemsize, dtype=src.dtype)
        if n:
            for i in range(vals.size):
                vals[i] = src[np.unravel_index(int(soff) + i, src.shape)]
        words = vals.view(dst.dtype)
        for i in range(words.size):
            dst[np.unravel_index(int(doff) + i, dst.shape)] = words[i]

    def cp_async_commit():
        pass

    def cp_async_wait(n: int):
        def wait():
            pass

        return wait

else:

    def _asm(builder, text: str, constraints: str, args=()):
        fty = _ir.FunctionType(_ir.VoidType(), [a.type for a in args])
        builder.call(_ir.InlineAsm(fty, text, constraints, side_effect=True), args)

    def _flat_ptr(context, builder, aryty, ary, offty, off):
        arr = context.make_array(aryty)(context, builder, value=ary)
        return builder.bitcast(builder.gep(arr.data, [context.cast(builder, off, offty, _types.intp)]),
                               _ir.IntType(8).as_pointer())

    @_intrinsic
    def _cp_async16(typingctx, dst, doff, src, soff, n):
        def codegen(context, builder, sig, args):
            dty, doty, sty, soty, nty = sig.args
            d = _flat_ptr(context, builder, dty, args[0], doty, args[1])
            s = _flat_ptr(context, builder, sty, args[2], soty, args[3])
            nb = context.cast(builder, args[4], nty, _types.uint32)
            _asm(builder, "{\n\t.reg .u64 kdt_sa;\n\tcvta.to.shared.u64 kdt_sa, $0;\n\t"
                 "cp.async.cg.shared.global [kdt_sa], [$1], 16, $2;\n\t}", "l,l,r,~{memory}", (d, s, nb))
            return context.get_dummy_value()

        return _types.none(dst, doff, src, soff, n), codegen

    @_intrinsic
    def _cp_async_commit(typingctx):
        def codegen(context, builder, sig, args):
            _asm(builder, "cp.async.commit_group;", "~{memory}")
            return context.get_dummy_value()

        return _types.none(), codegen

    def _cp_wait_intrinsic(n: int):
        @_intrinsic
        def _wait(typingctx):
            def codegen(context, builder, sig, args):
                _asm(builder, f"cp.async.wait_group {n};", "~{memory}")
                return context.get_dummy_value()

            return _types.none(), codegen

        return _wait

    @cuda.jit(device=True, inline=True)
    def cp_async16(dst, doff, src, soff, n):
        _cp_async16(dst, doff, src, soff, n)

    @cuda.jit(device=True, inline=True)
    def cp_async_commit():
        _cp_async_commit()

    _WAITS: dict = {}

    def cp_async_wait(n: int):
        if n not in _WAITS:
            w = _cp_wait_intrinsic(n)

            def wait():
                w()

            _WAITS[n] = cuda.jit(device=True, inline=True)(wait)
        return _WAITS[n]


# ---- ldmatrix: a warp's four 8 x 8 bf16 matrices from shared memory, as mma fragments --------------------------------
# On the GPU one instruction at a 32-bit shared address plus an immediate (smem_at("ldsm" | "ldsm_t", imm) below: the
# lane's address is that of row (lane & 7) + 8 ((lane >> 3) & 1) of the tile, column 8 (lane >> 4)); under the
# simulator ldsm_x4(P, r0, c0, lane) / ldsm_x4_t(..) (transposed): P a shared uint32 array [rows, words] of bf16 pairs
# (element 2 w in the low half of word w), the warp's 16 x 16 element tile at rows r0 .., element columns c0 ..
# (warp-uniform; c0 a multiple of 8, P's row a multiple of 16 bytes). Matrix i is rows r0 + 8 (i % 2) .., columns
# c0 + 8 (i // 2) ..; lane (g, t) gets word i = M_i[g, 2t : 2t + 2] (plain: the A fragment a0..a3 of the tile, or
# the B fragments (b0, b0', b1, b1') of two 8-row n-tiles of an [n, k] tile) or {M_i[2t, g], M_i[2t + 1, g]}
# (transposed: (b0, b1, b0', b1') of two 8-column n-tiles of a [k, n] tile, k along the rows).
if IS_SIM:

    def _ldsm_sim(P, r0, c0, lane, trans: bool):
        g, t = lane // 4, lane % 4
        out = []
        for i in range(4):
            rb, cb = int(r0) + 8 * (i % 2), int(c0) + 8 * (i // 2)
            if trans:
                e0 = (int(P[rb + 2 * t, (cb + g) // 2]) >> (16 * ((cb + g) % 2))) & 0xFFFF
                e1 = (int(P[rb + 2 * t + 1, (cb + g) // 2]) >> (16 * ((cb + g) % 2))) & 0xFFFF
                out.append(np.uint32(e0 | (e1 << 16)))
            else:
                out.append(np.uint32(P[rb + g, cb // 2 + t]))
        return out[0], out[1], out[2], out[3]

    @cuda.jit(device=True)
    def ldsm_x4(P, r0, c0, lane):
        """(r0, r1, r2, r3): this lane's words of the warp's four 8 x 8 matrices (simulator: read directly)."""
        return _ldsm_sim(P, r0, c0, lane, False)

    @cuda.jit(device=True)
    def ldsm_x4_t(P, r0, c0, lane):
        """ldsm_x4, each matrix transposed (simulator: read directly)."""
        return _ldsm_sim(P, r0, c0, lane, True)

else:
    # for generated kernels with many call sites (kdt.kernels.attn_tc): the intrinsic itself, no device function
    # around it (Numba inlines device functions into a kernel's IR, slowly)
    mma_intrinsic = _mma

    _IR = {_types.float32: _ir.FloatType(), _types.uint32: _ir.IntType(32), _types.uint64: _ir.IntType(64)}

    def _asm_intrinsic(text: str, constraints: str, out_types: tuple, in_types: tuple, side_effect: bool = False):
        """An intrinsic running the PTX ``text`` on its arguments (of ``in_types``): None, one value or a tuple of
        ``out_types``. ``side_effect``: kept in order and never merged (shared memory's loads and stores)."""

        def typer(*args):
            if not out_types:
                ret_t = _types.none
            elif len(out_types) == 1:
                ret_t = out_types[0]
            else:
                ret_t = _types.Tuple(out_types)

            def codegen(context, builder, sig, args):
                outs = [_IR[t] for t in out_types]
                rt = _ir.VoidType() if not outs else outs[0] if len(outs) == 1 else _ir.LiteralStructType(outs)
                fty = _ir.FunctionType(rt, [a.type for a in args])
                ret = builder.call(_ir.InlineAsm(fty, text, constraints, side_effect=side_effect), args)
                if not outs:
                    return context.get_dummy_value()
                if len(outs) == 1:
                    return ret
                return context.make_tuple(builder, sig.return_type, [builder.extract_value(ret, i)
                                                                     for i in range(len(outs))])

            return ret_t(*in_types), codegen

        def one(typingctx, a):
            return typer(a)

        def two(typingctx, a, b):
            return typer(a, b)

        return _intrinsic(one if len(in_types) == 1 else two)

    _U32T, _U64T, _F32T = _types.uint32, _types.uint64, _types.float32

    @_intrinsic
    def smem_base(typingctx, arr):
        """The 32-bit shared-memory address of a shared array's first element."""

        def codegen(context, builder, sig, args):
            p = _flat_ptr(context, builder, sig.args[0], args[0], _types.intp, _ir.Constant(_ir.IntType(64), 0))
            fty = _ir.FunctionType(_ir.IntType(32), [p.type])
            asm = _ir.InlineAsm(fty, "{\n\t.reg .u64 kdt_sb;\n\tcvta.to.shared.u64 kdt_sb, $1;\n\t"
                                "cvt.u32.u64 $0, kdt_sb;\n\t}", "=r,l")
            return builder.call(asm, [p])

        return _types.uint32(arr), codegen

    @_intrinsic
    def gmem_base(typingctx, arr):
        """The (generic) address of an array's first element, as a uint64."""

        def codegen(context, builder, sig, args):
            p = _flat_ptr(context, builder, sig.args[0], args[0], _types.intp, _ir.Constant(_ir.IntType(64), 0))
            return builder.ptrtoint(p, _ir.IntType(64))

        return _types.uint64(arr), codegen

    _AT: dict = {}

    def smem_at(op: str, imm: int):
        """Shared-memory access at a 32-bit address register plus the byte immediate ``imm`` (one instruction, no
        address arithmetic): op ``ldsm`` / ``ldsm_t`` (addr) -> 4 words of ldmatrix; ``ld_f32`` (addr) -> float32;
        ``ld_v2f32`` (addr) -> (float32, float32); ``st_f32`` / ``st_u32`` (addr, v); ``cp16`` (addr, src): a
        16-byte cp.async from the generic address src."""
        key = (op, int(imm))
        if key not in _AT:
            a = f"[$IN+{int(imm)}]"  # the address operand: $IN the register, after the outputs
            specs = {
                "ldsm": ("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, @ADDR;", "=r,=r,=r,=r,r",
                         (_U32T,) * 4, (_U32T,)),
                "ldsm_t": ("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, @ADDR;", "=r,=r,=r,=r,r",
                           (_U32T,) * 4, (_U32T,)),
                "ld_f32": ("ld.shared.f32 $0, @ADDR;", "=f,r", (_F32T,), (_U32T,)),
                "ld_v2f32": ("ld.shared.v2.f32 {$0, $1}, @ADDR;", "=f,=f,r", (_F32T, _F32T), (_U32T,)),
                "st_f32": ("st.shared.f32 @ADDR, $1;", "r,f", (), (_U32T, _F32T)),
                "st_u32": ("st.shared.u32 @ADDR, $1;", "r,r", (), (_U32T, _U32T)),
                "cp16": ("cp.async.cg.shared.global @ADDR, [$1], 16;", "r,l", (), (_U32T, _U64T)),
            }
            text, cons, outs, ins = specs[op]
            text = text.replace("@ADDR", a.replace("$IN", f"${len(outs)}"))
            _AT[key] = _asm_intrinsic(text, cons + ",~{memory}", outs, ins, side_effect=True)
        return _AT[key]

    # (hi, lo) of two float32 x0, x1 as bf16 pairs (x0 in the low halves), split_bf16x2's values in 8 instructions
    # (cvt.rn.bf16x2 rounds to nearest even, as f32_to_bf16; it puts its first operand in the high half)
    split_bf16x2_asm = _asm_intrinsic(
        "{\n\t.reg .b32 kt0, kt1;\n\t.reg .f32 kf0, kf1, kx0, kx1;\n\tmov.f32 kx0, $2;\n\tmov.f32 kx1, $3;\n\t"
        "cvt.rn.bf16x2.f32 $0, kx1, kx0;\n\tshl.b32 kt0, $0, 16;\n\tand.b32 kt1, $0, 0xFFFF0000;\n\t"
        "mov.b32 kf0, kt0;\n\tmov.b32 kf1, kt1;\n\tsub.f32 kf0, kx0, kf0;\n\tsub.f32 kf1, kx1, kf1;\n\t"
        "cvt.rn.bf16x2.f32 $1, kf1, kf0;\n\t}", "=r,=r,f,f", (_U32T, _U32T), (_F32T, _F32T))

    # global loads at a raw address (warp_mm's PTR steps: a lane's row address advanced a step, ptxas folds the
    # constant offsets of a step's groups into the instruction); volatile, so that none moves across a flag wait
    ld_u64 = _asm_intrinsic("ld.global.u64 $0, [$1];", "=l,l", (_U64T,), (_U64T,), side_effect=True)
    ld_cs_u64 = _asm_intrinsic("ld.global.cs.u64 $0, [$1];", "=l,l", (_U64T,), (_U64T,), side_effect=True)
    ld_v2_u64 = _asm_intrinsic("ld.global.v2.u64 {$0, $1}, [$2];", "=l,=l,l", (_U64T, _U64T), (_U64T,),
                               side_effect=True)
    # a lane's A fragment of fragment-ordered weights (``fo``): four 32-bit registers from 16 bytes
    ld_v4_u32 = _asm_intrinsic("ld.global.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", (_U32T,) * 4, (_U64T,),
                               side_effect=True)
    ld_cs_v4_u32 = _asm_intrinsic("ld.global.cs.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", (_U32T,) * 4,
                                  (_U64T,), side_effect=True)


@cuda.jit(device=True, inline=True)
def split_bf16x2(x0, x1):
    """(hi, lo): two float32 as bf16 pairs, x = hi + lo to ~2^-17 (x0 in the low halves)."""
    h0 = f32_to_bf16(x0)
    h1 = f32_to_bf16(x1)
    l0 = f32_to_bf16(x0 - bf16_to_f32(h0))
    l1 = f32_to_bf16(x1 - bf16_to_f32(h1))
    return uint32(h0) | (uint32(h1) << uint32(16)), uint32(l0) | (uint32(l1) << uint32(16))


def _device(fn):
    """Device function decorator (also under the simulator, where a device function called from another module's
    kernel needs the simulator's swap of its module globals, ``cuda`` included)."""
    return cuda.jit(device=True, inline=True)(fn)


_CACHE: dict = {}
# unsigned constants: Numba types a signed and an unsigned 64-bit integer together as float64
_U0, _U1, _U2, _U3, _U4, _U32 = uint64(0), uint64(1), uint64(2), uint64(3), uint64(4), uint64(32)
_U8, _U16 = uint64(8), uint64(16)


def tile_mma(rt: int, nt: int, fo: bool = False):
    """Device function ``tmma(acc, wf, w0, j, bh0, bh1, bl0, bl1, frag, warp, lane)``: token tile j's mma with each of
    the rt row tiles of a group (:func:`warp_mm`'s accumulators, nt token tiles): row tile r's weight words wf[w0 + 2 r]
    (rows g) and wf[w0 + 2 r + 1] (rows g + 8) as A (``fo``: its registers a0 .. a3 = wf[w0 + 4 r + c], uint32), then
    x's lo (bl0, bl1) and hi (bh0, bh1) fragments as B."""
    key = ("tile_mma", rt, nt, fo)
    if key in _CACHE:
        return _CACHE[key]
    RT, NT, FO = rt, nt, fo

    def tmma(acc, wf, w0, j, bh0, bh1, bl0, bl1, frag, warp, lane):
        for r in range(RT):
            if FO:
                a0, a1, a2, a3 = wf[w0 + 4 * r], wf[w0 + 4 * r + 1], wf[w0 + 4 * r + 2], wf[w0 + 4 * r + 3]
            else:
                wg, wg8 = wf[w0 + 2 * r], wf[w0 + 2 * r + 1]
                a0, a2 = uint32(wg & uint64(0xFFFFFFFF)), uint32(wg >> uint64(32))
                a1, a3 = uint32(wg8 & uint64(0xFFFFFFFF)), uint32(wg8 >> uint64(32))
            k = (r * NT + j) * 4
            d0, d1, d2, d3 = mma_bf16(a0, a1, a2, a3, bl0, bl1, acc[k], acc[k + 1], acc[k + 2], acc[k + 3], frag,
                                      warp, lane)
            acc[k], acc[k + 1], acc[k + 2], acc[k + 3] = mma_bf16(a0, a1, a2, a3, bh0, bh1, d0, d1, d2, d3, frag,
                                                                  warp, lane)

    _CACHE[key] = tmma = _device(tmma)
    return tmma


# Env KDT_TC_PTR=1: warp_mm's full steps with x hi / lo load through raw addresses (``PTR`` below; session 42, built,
# off until timed): the unstaged step of kernel B at 65 tokens spent ~30 of its ~90 SASS instructions a step of 8 mma on
# 64-bit offsets recomputed from (e, row, word) every group.
TC_PTR = os.environ.get("KDT_TC_PTR", "0") == "1"


def warp_mm(rt: int, nt: int, u: int, xl: int, cs: bool, fo: bool = False):
    """Device function ``mm(W, e, rows, X, xrows, g0, g1, acc, frag, warp, lane, ring)``: the warp's tile of rt x 16
    weight rows by nt x 8 tokens over the 4-word groups [g0, g1) of K (warp-uniform; words >= Kw count as 0):

    acc[(r * nt + j) * 4 + c] += sum over those k of W[e, row, k] X[xrow, k], row = rows[2 r + (c >= 2)] (this
    lane's rows g and g + 8 of row tile r, valid rows), token column 8 j + 2 t + (c & 1) (lane (g, t) passes
    xrows[j] = the X row of column 8 j + g, a valid row).

    W: uint64 [E, N, Kw] (4 bf16 a word); X in layout ``xl`` (module docstring: float32 natural [rows, 4 Kw] or
    word-permuted, or uint64 hi / lo [rows, 2 Kw]). u groups' weight words (and, hi / lo, their x words) are loaded
    before their first use (``cs``: the weights with the streaming hint). Every lane of the warp issues the same
    mma sequence: the last partial step is masked (loads skipped, zeros), not shortened. ``PTR`` (``TC_PTR``, x hi /
    lo, on the GPU): the full steps load at this lane's row addresses, computed once and advanced a step (a token's hi
    and lo words in one 16-byte load); the same loads and mma as the indexed steps, so the same sums. ``fo``: W in
    fragment order (module docstring; x hi / lo; N % 16 == 0, Kw % 4 == 0 and row tiles that start at multiples of
    16, so rows[2 r] // 16 is row tile r's tile): a group's A fragments in one 16-byte load a lane, at raw addresses
    as ``PTR`` on the GPU; the same fragments, so the same sums as W in natural order."""
    key = (rt, nt, u, xl, cs, TC_PTR, fo)
    if key in _CACHE:
        return _CACHE[key]
    NT, XL, CS, RT, FO = nt, xl, cs, rt, fo
    HILO = xl == XL_HILO
    if FO and not HILO:
        raise ValueError("fragment-ordered weights take x in the hi / lo layout (XL_HILO)")
    PTR = (TC_PTR or FO) and HILO and not IS_SIM
    NB = 2 * rt  # rows a lane loads a group
    NWQ = 4 * rt if FO else NB  # weight registers (fo: uint32) / words a lane loads a group
    NWB, WDT = NWQ * u, (uint32 if FO else uint64)
    NP = rt if FO else NB  # weight addresses a lane (PTR)
    NXB = 2 * nt * u if HILO else 1  # hi / lo x words a lane loads a step
    tmma = tile_mma(rt, nt, fo)

    def mma_hilo_fn(uu: int):
        UU = uu

        def mma_hilo(acc, wbuf, xbuf, frag, warp, lane):
            """The mma of a step's uu groups from their loaded weight and hi / lo x words."""
            for q in range(UU):
                for j in range(NT):
                    xh, xo = xbuf[(q * NT + j) * 2], xbuf[(q * NT + j) * 2 + 1]
                    bh0, bh1 = uint32(xh & uint64(0xFFFFFFFF)), uint32(xh >> uint64(32))
                    bl0, bl1 = uint32(xo & uint64(0xFFFFFFFF)), uint32(xo >> uint64(32))
                    tmma(acc, wbuf, q * NWQ, j, bh0, bh1, bl0, bl1, frag, warp, lane)

        return _device(mma_hilo)

    def step_fn(uu: int, checked: bool):
        UU, CHECKED = uu, checked
        mma_hilo = mma_hilo_fn(uu) if HILO else None

        def step(W, e, rows, X, xrows, kb, Kw, acc, wbuf, xbuf, frag, warp, lane):
            t = uint64(lane % 4)
            for q in range(UU):
                w = kb + uint64(4 * q) + t
                if FO:  # row tile r's group: words 2 lane, 2 lane + 1 of its 64, counted from the tile's first row
                    o = (kb + uint64(4 * q)) * _U16 + uint64(2 * lane)
                    for r in range(RT):
                        b = q * NWQ + 4 * r
                        if not CHECKED or w < Kw:
                            row = rows[2 * r] // _U16 * _U16 + o // Kw
                            c = o % Kw
                            v0 = ldcs3(W, e, row, c) if CS else W[e, row, c]
                            v1 = ldcs3(W, e, row, c + _U1) if CS else W[e, row, c + _U1]
                            wbuf[b], wbuf[b + 1] = uint32(v0 & uint64(0xFFFFFFFF)), uint32(v0 >> _U32)
                            wbuf[b + 2], wbuf[b + 3] = uint32(v1 & uint64(0xFFFFFFFF)), uint32(v1 >> _U32)
                        else:
                            wbuf[b] = wbuf[b + 1] = wbuf[b + 2] = wbuf[b + 3] = uint32(0)
                else:
                    for i in range(NB):
                        if not CHECKED or w < Kw:
                            wbuf[q * NB + i] = ldcs3(W, e, rows[i], w) if CS else W[e, rows[i], w]
                        else:
                            wbuf[q * NB + i] = uint64(0)
            if HILO:
                for q in range(UU):
                    w = kb + uint64(4 * q) + t
                    for j in range(NT):
                        xi = (q * NT + j) * 2
                        if not CHECKED or w < Kw:
                            xbuf[xi] = X[xrows[j], _U2 * w]
                            xbuf[xi + 1] = X[xrows[j], _U2 * w + _U1]
                        else:
                            xbuf[xi] = xbuf[xi + 1] = uint64(0)
                mma_hilo(acc, wbuf, xbuf, frag, warp, lane)
                return
            for q in range(UU):
                w = kb + uint64(4 * q) + t
                ok = not CHECKED or w < Kw
                for j in range(NT):
                    xr = xrows[j]
                    x0 = x1 = x2 = x3 = float32(0.0)
                    if ok:
                        if XL == XL_PERM:
                            x0, x1, x2, x3 = X[xr, w], X[xr, Kw + w], X[xr, _U2 * Kw + w], X[xr, _U3 * Kw + w]
                        else:
                            c = _U4 * w
                            x0, x1, x2, x3 = X[xr, c], X[xr, c + _U1], X[xr, c + _U2], X[xr, c + _U3]
                    bh0, bl0 = split_bf16x2(x0, x1)
                    bh1, bl1 = split_bf16x2(x2, x3)
                    tmma(acc, wbuf, q * NB, j, bh0, bh1, bl0, bl1, frag, warp, lane)

        return _device(step)

    U = u
    WSTEP = (512 if FO else 32) * U  # bytes a weight address advances a step (fo: a group is 64 words of the tile)
    full, one = step_fn(u, False), step_fn(1, True)

    if PTR:
        mma_full = mma_hilo_fn(u)
        ldw = ld_cs_u64 if CS else ld_u64
        ldw4 = ld_cs_v4_u32 if CS else ld_v4_u32

        def pstep(pw, px, acc, wbuf, xbuf, frag, warp, lane):
            """A full step at the lane's addresses pw (its weight rows at word kb + t; fo: its row tiles' group kb / 4
            at its 16 bytes) and px (its x rows at word kb + t, hi then lo)."""
            for q in range(U):
                for i in range(NP):
                    if FO:  # (group kb / 4 + q)
                        b = q * NWQ + 4 * i
                        wbuf[b], wbuf[b + 1], wbuf[b + 2], wbuf[b + 3] = ldw4(pw[i] + uint64(512 * q))
                    else:
                        wbuf[q * NB + i] = ldw(pw[i] + uint64(32 * q))  # (word kb + 4 q + t)
            for q in range(U):
                for j in range(NT):
                    xi = (q * NT + j) * 2
                    xbuf[xi], xbuf[xi + 1] = ld_v2_u64(px[j] + uint64(64 * q))
            mma_full(acc, wbuf, xbuf, frag, warp, lane)

        mma_one = mma_hilo_fn(1)

        def pone(pw, px, ok, acc, wbuf, xbuf, frag, warp, lane):
            """fo: one group at the lane's addresses, its loads skipped (zeros) unless ``ok`` (the group is below Kw:
            Kw % 4 == 0, so all its words or none)."""
            for i in range(NP):
                if ok:
                    wbuf[4 * i], wbuf[4 * i + 1], wbuf[4 * i + 2], wbuf[4 * i + 3] = ldw4(pw[i])
                else:
                    wbuf[4 * i] = wbuf[4 * i + 1] = wbuf[4 * i + 2] = wbuf[4 * i + 3] = uint32(0)
            for j in range(NT):
                if ok:
                    xbuf[2 * j], xbuf[2 * j + 1] = ld_v2_u64(px[j])
                else:
                    xbuf[2 * j] = xbuf[2 * j + 1] = uint64(0)
            mma_one(acc, wbuf, xbuf, frag, warp, lane)

        pstep, pone = _device(pstep), _device(pone)
    else:
        pstep = pone = None  # (never called: the branches below are pruned)

    def mm(W, e, rows, X, xrows, g0, g1, acc, frag, warp, lane, ring):  # (ring: warp_mm_staged's, unused)
        Kw = uint64(W.shape[2])
        ue = uint64(e)
        ur = cuda.local.array(NB, uint64)
        ux = cuda.local.array(NT, uint64)
        wbuf = cuda.local.array(NWB, WDT)
        xbuf = cuda.local.array(NXB, uint64)
        for i in range(NB):
            ur[i] = uint64(rows[i])
        for j in range(NT):
            ux[j] = uint64(xrows[j])
        kb = uint64(4 * g0)
        kend = uint64(4 * g1)
        if PTR:  # byte addresses of this lane's weights at word kb (+ t) and of its x rows' hi / lo pairs
            t = uint64(lane % 4)
            pw = cuda.local.array(NP, uint64)
            px = cuda.local.array(NT, uint64)
            wb, xb = gmem_base(W) + ue * uint64(W.strides[0]), gmem_base(X)  # (strides in bytes; words contiguous)
            for i in range(NP):
                if FO:  # row tile i's first row, then group kb / 4 (512 bytes a group), then the lane's 16 bytes
                    r0 = ur[2 * i] // _U16 * _U16
                    pw[i] = wb + r0 * uint64(W.strides[1]) + uint64(128) * kb + _U16 * uint64(lane)
                else:
                    pw[i] = wb + ur[i] * uint64(W.strides[1]) + _U8 * (kb + t)
            for j in range(NT):
                px[j] = xb + ux[j] * uint64(X.strides[0]) + _U16 * (kb + t)
            while kb + uint64(4 * U) <= kend and kb + uint64(4 * U) <= Kw:
                pstep(pw, px, acc, wbuf, xbuf, frag, warp, lane)
                for i in range(NP):
                    pw[i] += uint64(WSTEP)
                for j in range(NT):
                    px[j] += uint64(64 * U)
                kb += uint64(4 * U)
            if FO:  # the rest at the same addresses, a group at a time (none is left for the loop below)
                while kb < kend:
                    pone(pw, px, kb < Kw, acc, wbuf, xbuf, frag, warp, lane)
                    for i in range(NP):
                        pw[i] += uint64(512)
                    for j in range(NT):
                        px[j] += uint64(64)
                    kb += uint64(4)
        else:
            while kb + uint64(4 * U) <= kend and kb + uint64(4 * U) <= Kw:  # every word of the U groups in range
                full(W, ue, ur, X, ux, kb, Kw, acc, wbuf, xbuf, frag, warp, lane)
                kb += uint64(4 * U)
        if not (PTR and FO):
            while kb < kend:  # the rest, a group at a time, masked
                one(W, ue, ur, X, ux, kb, Kw, acc, wbuf, xbuf, frag, warp, lane)
                kb += uint64(4)

    mm = _device(mm)
    _CACHE[key] = mm
    return mm


if IS_SIM:  # no syncwarp: a block barrier (warp_mm_staged's barriers are uniform over the block)

    def _lanes_sync():
        cuda.syncthreads()

else:

    def _lanes_sync():
        cuda.syncwarp()


lanes_sync = _device(_lanes_sync)


def warp_mm_staged(rt: int, nt: int, u: int, xl: int, st: int):
    """:func:`warp_mm` (the same contract) with its loads staged through shared memory by ``cp.async``: ``mm(W, e,
    rows, X, xrows, g0, g1, acc, frag, warp, lane, ring)``. Each step's u 4-word groups of the weights (rt row tiles x
    16 rows x 32 bytes a group) and of x (nt token tiles x 8 tokens x 4 words x 16 bytes: hi / lo word pairs,
    ``XL_HILO``, or 4 float32, ``XL_NATURAL``) go to the warp's ring of st stages (ring[warp]: uint64 [*, *, 32]
    shared, word w of the ring at [warp, w // 32, w % 32], 64 u (rt + nt) words a stage; :func:`sm_shape`), issued
    st - 1 steps ahead of their mma. The loads in flight then hold no registers: a warp keeps (st - 1) x 512 u (rt +
    nt) bytes in flight where :func:`warp_mm` keeps its u groups' words in registers for one step at a time.

    Lane (g, t) copies 16 bytes of weight row g (t < 2) or g + 8 (t >= 2), words 2 (t % 2) .. + 1 of each group, and
    its own x fragment (token column g, word t: the 16 bytes it reads); a warp barrier a step makes the weight words
    of the other lanes visible. Every step has u groups (trip counts uniform across the block's warps, which the
    simulator's barriers need); groups past [g0, g1) or Kw copy zeros. Needs Kw even (16-byte aligned copies: K a
    multiple of 8), W and X C-contiguous with 16-byte aligned rows. ``cs`` does not apply (cp.async.cg: the weights
    pass through L2 only). Each lane's copy addresses are element offsets computed once a call and advanced by a
    step's words: the first version indexed the arrays per copy (int64 indices), 212 PTX instructions a step of 8 mma
    against 110 now (session 30's Nsight Compute had it issue-bound, 71% of issue slots)."""
    if xl not in (XL_NATURAL, XL_HILO) or st < 2:
        raise ValueError(f"staged warp tile: x layout {xl} (natural or hi / lo) and {st} stages (>= 2)")
    key = ("staged", rt, nt, u, xl, st)
    if key in _CACHE:
        return _CACHE[key]
    RT, NT, U, ST, HILO = rt, nt, u, st, xl == XL_HILO
    WS = 64 * u * rt  # weight words of a stage (the x words follow)
    SW = 64 * u * (rt + nt)  # words of a stage
    NWF = 2 * rt
    XC = 2 if HILO else 4  # X columns a word of K (a hi / lo uint64 pair; 4 float32)
    wait = cp_async_wait(st - 2)  # the oldest stage in flight has landed
    tmma = tile_mma(rt, nt)

    def issue(ring, W, X, wro, xro, dw, dx, kb, kend, t):
        """Stage at ring offsets dw (this lane's weight words) / dx (its x words), K words from kb."""
        for q in range(U):
            kq = kb + uint64(4 * q)
            w = kq + uint64(2 * (t % 2))  # this lane's two words of its weight row
            nb = 16 if w < kend else 0
            for r in range(RT):
                cp_async16(ring, dw + uint64((q * RT + r) * 64), W, wro[r] + (kq if nb else _U0), nb)
            nx = 16 if kq + uint64(t) < kend else 0  # its x word
            for j in range(NT):
                cp_async16(ring, dx + uint64((q * NT + j) * 64), X, xro[j] + (uint64(XC) * kq if nx else _U0), nx)

    def compute(ring, slot, acc, frag, uw, warp, lane):
        g, t = lane // 4, lane % 4
        wrow = uint64(slot * (SW // 32))  # the stage's first row of 32 words
        wcol, xcol = uint64(4 * g + t), uint64((2 * lane) % 32)
        wfr = cuda.local.array(NWF, uint64)
        for q in range(U):
            for r in range(RT):
                wi = wrow + uint64((q * RT + r) * 2)  # (rows g and g + 8 of the tile: 32 words apart)
                wfr[2 * r] = ring[uw, wi, wcol]
                wfr[2 * r + 1] = ring[uw, wi + _U1, wcol]
            for j in range(NT):
                xi = wrow + uint64(WS // 32 + (q * NT + j) * 2 + lane // 16)
                x0, x1 = ring[uw, xi, xcol], ring[uw, xi, xcol + _U1]
                if HILO:
                    bh0, bh1 = uint32(x0 & uint64(0xFFFFFFFF)), uint32(x0 >> uint64(32))
                    bl0, bl1 = uint32(x1 & uint64(0xFFFFFFFF)), uint32(x1 >> uint64(32))
                else:
                    bh0, bl0 = split_bf16x2(f32_from_bits(x0 & uint64(0xFFFFFFFF)), f32_from_bits(x0 >> uint64(32)))
                    bh1, bl1 = split_bf16x2(f32_from_bits(x1 & uint64(0xFFFFFFFF)), f32_from_bits(x1 >> uint64(32)))
                tmma(acc, wfr, 0, j, bh0, bh1, bl0, bl1, frag, warp, lane)

    issue, compute = _device(issue), _device(compute)

    def mm(W, e, rows, X, xrows, g0, g1, acc, frag, warp, lane, ring):
        g, t = lane // 4, lane % 4
        Kw = uint64(W.shape[2])
        kend = min(uint64(4 * g1), Kw)  # words past kend copy zeros
        ns = (g1 - g0 + U - 1) // U  # steps of U groups
        # element offsets, once: this lane's weight rows (+ its half of a group) and x rows (+ its word), its ring
        wro = cuda.local.array(RT, uint64)
        xro = cuda.local.array(NT, uint64)
        for r in range(RT):
            row = rows[2 * r + 1] if t >= 2 else rows[2 * r]
            wro[r] = (uint64(e) * uint64(W.shape[1]) + uint64(row)) * Kw + uint64(2 * (t % 2))
        for j in range(NT):
            xro[j] = uint64(xrows[j]) * uint64(X.shape[1]) + uint64(XC * t)
        uw = uint64(warp)
        rb = uw * uint64(ring.shape[1]) * _U32  # the warp's ring: its first element
        dw = rb + uint64(4 * (g + 8 * (t // 2)) + 2 * (t % 2))
        dx = rb + uint64(WS + 2 * lane)
        for s in range(ST - 1):  # the pipeline's first st - 1 stages
            if s < ns:
                issue(ring, W, X, wro, xro, dw + uint64(s * SW), dx + uint64(s * SW), uint64(4 * (g0 + U * s)), kend,
                      t)
            cp_async_commit()
        for i in range(ns):
            wait()
            lanes_sync()  # every lane's copies of stage i have landed; every lane is done with stage i - 1
            compute(ring, i % ST, acc, frag, uw, warp, lane)
            n = i + ST - 1
            if n < ns:  # into the slot of stage i - 1
                o = uint64((n % ST) * SW)
                issue(ring, W, X, wro, xro, dw + o, dx + o, uint64(4 * (g0 + U * n)), kend, t)
            cp_async_commit()

    mm = _device(mm)
    _CACHE[key] = mm
    return mm


def sm_shape(nw: int, rt: int, nt: int, st: int = 0, u: int = 1) -> tuple[int, int, int]:
    """Shape of a block's shared array ``sm`` for :func:`block_mm` (dtype :func:`sm_dtype`): the nw warps' sums,
    float32 [nw, 4 rt nt, 32]; staged (st >= 2, u groups a stage), uint64 [nw, rows, 32], row 0.. of warp w its ring of
    st stages (:func:`warp_mm_staged`), then the same rows its sums as float32 bits."""
    na = 4 * rt * nt
    return (nw, max(na, 2 * st * u * (rt + nt)), 32) if st else (nw, na, 32)


def sm_dtype(st: int):
    """dtype of ``sm`` (:func:`sm_shape`): float32, staged uint64."""
    return uint64 if st else float32


@_device
def put_hilo(Xs, r, k, v):
    """Element k of row r of a hi / lo X (``XL_HILO``) from the float32 v: Xs is the layout's uint16 view
    [rows, 8 Kw] (bf16 hi at 8 (k // 4) + k % 4, lo 4 further)."""
    h = f32_to_bf16(v)
    c = 8 * (k // 4) + k % 4
    Xs[r, c] = h
    Xs[r, c + 4] = f32_to_bf16(v - bf16_to_f32(h))


def split_np(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo) bf16 bits (uint16, X's shape) of float32 X on the host: hi = bf16(X), lo = bf16(X - hi), as
    :func:`split_bf16x2` splits on the device."""
    X = np.ascontiguousarray(X, dtype=np.float32)
    hi = f32_to_bf16_bits(X)
    return hi, f32_to_bf16_bits(X - bf16_bits_to_f32(hi))


def hilo_np(X: np.ndarray) -> np.ndarray:
    """The hi / lo layout (``XL_HILO``) of float32 X [rows, K] (K % 4 == 0) on the host: uint64 [rows, K / 2]."""
    hi, lo = split_np(X)
    rows, K = hi.shape
    out = np.stack([hi.reshape(rows, K // 4, 4), lo.reshape(rows, K // 4, 4)], axis=2)  # [rows, Kw, 2, 4]
    return out.reshape(rows, 2 * K).view(np.uint64)


def fits_fo(N: int, Kw: int) -> bool:
    """Whether weights of N rows of Kw words can take the fragment order (module docstring)."""
    return N % MMA_ROWS == 0 and Kw % 4 == 0


def _need_fo(N: int, Kw: int) -> None:
    """Raise ValueError unless :func:`fits_fo`."""
    if not fits_fo(N, Kw):
        raise ValueError(f"fragment order needs N % 16 == 0 and Kw % 4 == 0, not N = {N}, Kw = {Kw}")


def fo_np(W: np.ndarray) -> np.ndarray:
    """W (uint64 [E, N, Kw], bf16 words) in fragment order on the host (module docstring): the reference of
    :func:`to_fo`."""
    E, N, Kw = W.shape
    _need_fo(N, Kw)
    # [e, tile, h, g, grp, t, lo / hi half] -> [e, tile, grp, g, t, half, h]: lane 4 g + t's registers a0 .. a3 =
    # (lo, row g), (lo, g + 8), (hi, g), (hi, g + 8)
    w32 = np.ascontiguousarray(W).view(np.uint32).reshape(E, N // 16, 2, 8, Kw // 4, 4, 2)
    return np.ascontiguousarray(w32.transpose(0, 1, 4, 3, 5, 6, 2)).reshape(E, N, 2 * Kw).view(np.uint64)


@cuda.jit
def fo_kernel(src, dst):
    """dst = src in fragment order (:func:`fo_np`), uint64 [E, N, Kw] both; a thread a word of dst."""
    grid_dependency_wait()
    E, N, Kw = src.shape
    i = cuda.grid(1)
    if i >= E * N * Kw:
        return
    e, o = i // (N * Kw), i % (N * Kw)  # o: the word's place in its expert
    tile, r = o // (MMA_ROWS * Kw), o % (MMA_ROWS * Kw)
    lane, half = (r % 64) // 2, r % 2  # (group r // 64 of the tile)
    w = 4 * (r // 64) + lane % 4
    row = MMA_ROWS * tile + lane // 4
    sh = uint64(32 * half)
    lo = (src[e, row, w] >> sh) & uint64(0xFFFFFFFF)
    hi = (src[e, row + 8, w] >> sh) & uint64(0xFFFFFFFF)
    dst[e, o // Kw, o % Kw] = lo | (hi << _U32)


def to_fo(W, stream=0):
    """A new device array: device W (uint64 [E, N, Kw]) in fragment order (:func:`fo_np`), on ``stream``."""
    E, N, Kw = W.shape
    _need_fo(N, Kw)
    out = cuda.device_array_like(W, stream=stream)
    n = E * N * Kw
    fo_kernel[(n + 255) // 256, 256, stream](W, out)
    return out


@_device
def k_groups(Kw, nw):
    """4-word groups of K (Kw words) per warp when nw warps split K (the last ones masked past Kw)."""
    return ((Kw + 3) // 4 + nw - 1) // nw


@_device
def tile_rows(rows, r0, n, g, rt):
    """rows[2 r], rows[2 r + 1] = lane group g's rows of row tile r (r < rt) of the block's rows from r0: r0 + 16 r
    + g and + 8, clamped to the n rows (``warp_mm``'s rows)."""
    for r in range(rt):
        rows[2 * r] = min(r0 + MMA_ROWS * r + g, n - 1)
        rows[2 * r + 1] = min(r0 + MMA_ROWS * r + g + 8, n - 1)


@_device
def acc_row(i, nt, g):
    """The row (from the block's first) of accumulator i of ``warp_mm`` with nt token tiles, lane group g."""
    return MMA_ROWS * (i // (nt * 4)) + g + 8 * ((i % 4) >> 1)


@_device
def acc_col(i, nt, t):
    """The token column (from the pass's first) of accumulator i of ``warp_mm`` with nt token tiles, lane t."""
    return 8 * ((i // 4) % nt) + 2 * t + (i & 1)


TILES_FIT = os.environ.get("KDT_TC_TILES_FIT", "1") != "0"  # token_tiles' fit (A/B)


def token_tiles(M: int, most: int) -> int:
    """Token tiles of 8 a block of :func:`gemm_kernel` for M tokens, at most ``most``: all of M's where they fit,
    else the count from ``most`` down to just over half of it that computes the fewest padded tokens (ties: the
    most tiles, the fewest blocks; fewer tiles a block re-read the weights more). 65 tokens (a budget-64 DDTree
    verify) at most 4: blocks of 3 tiles, 72 tokens computed, not blocks of 4 with 31 of the third's 32 idle (96):
    the warp tile's time goes with the tokens it computes (session 39: [q_a | kv_a] 21.1 us at 64 tokens, 32.1 at
    65). Env KDT_TC_TILES_FIT=0: ``most`` past them (session 45's plans)."""
    tiles = -(-M // 8)
    if tiles <= most:
        return max(tiles, 1)
    if not TILES_FIT:
        return most
    return min(range(most, most // 2, -1), key=lambda nt: -(-tiles // nt) * nt)


def row_groups(nw: int, kw: int) -> tuple[int, int, int]:
    """(kw, KW, groups) of a block of nw warps in row groups of kw warps splitting K: kw as a cache key (0 for one
    group: kw = 0 and kw = nw are the same plan), the warps a group KW and the nw / KW groups."""
    KW = kw or nw
    if nw % KW:
        raise ValueError(f"row groups of {kw} warps do not divide a block's {nw} warps")
    return (0 if KW == nw else KW), KW, nw // KW


def _put_sums(sm, acc, warp, lane):
    """sm[warp, i, lane] = acc[i] (float32 ``sm``)."""
    for i in range(acc.shape[0]):
        sm[warp, i, lane] = acc[i]


def _put_sums_bits(sm, acc, warp, lane):
    """The same into a staged block's uint64 ``sm`` as float32 bits, after a warp barrier: the warp's lanes are done
    reading its ring, which the sums overwrite."""
    lanes_sync()
    for i in range(acc.shape[0]):
        sm[warp, i, lane] = uint64(f32_bits(acc[i]))


_put_sums, _put_sums_bits = _device(_put_sums), _device(_put_sums_bits)


def block_mm(rt: int, nt: int, u: int, xl: int, cs: bool, nw: int, kw: int = 0, st: int = 0, fo: bool = False):
    """Device function ``bmm(W, e, rows, X, xrows, acc, sm, frag, warp, lane)``: the block's pass of
    :func:`warp_mm` (same rows, xrows, acc) over all of K, its nw warps in nw / kw row groups (each warp passes its
    group's rows) of kw warps splitting K (``k_groups``; kw = 0: one group of nw): each warp's acc, from zero, into
    sm[warp, :, lane] (float32 [nw, 4 rt nt, 32] shared), then a ``cuda.syncthreads()`` (:func:`block_total` then
    sums a position over a group's warps). Row groups share the token tile's x through L1, a K split adds warps
    where a grid has few blocks. st >= 2: the warp tile's loads staged through shared memory, st stages of u groups
    (:func:`warp_mm_staged`, its rings in ``sm``: :func:`sm_shape`; the sums then as float32 bits,
    :func:`block_total_fn`). ``fo``: W in fragment order (:func:`warp_mm`; not staged)."""
    kw, KW, _ = row_groups(nw, kw)
    if fo and st:
        raise ValueError("fragment-ordered weights are not staged (st = 0)")
    key = ("block", rt, nt, u, xl, cs, nw, kw, st, TC_PTR, fo)
    if key in _CACHE:
        return _CACHE[key]
    NA = 4 * rt * nt
    mm = warp_mm_staged(rt, nt, u, xl, st) if st else warp_mm(rt, nt, u, xl, cs, fo)
    put_sums = _put_sums_bits if st else _put_sums  # (staged: after the warp's last reads of its ring)

    def bmm(W, e, rows, X, xrows, acc, sm, frag, warp, lane):
        for i in range(NA):
            acc[i] = float32(0.0)
        gpw = k_groups(W.shape[2], KW)
        kq = warp % KW
        mm(W, e, rows, X, xrows, kq * gpw, (kq + 1) * gpw, acc, frag, warp, lane, sm)
        put_sums(sm, acc, warp, lane)
        cuda.syncthreads()

    bmm = _device(bmm)
    _CACHE[key] = bmm
    return bmm


def block_total(sm, i, lane, w0, kw):
    """Sum over warps w0 .. w0 + kw - 1 (a row group, in warp order) of accumulator i of lane ``lane``, from ``sm``
    (float32 [nw, n_acc, 32] shared, written by every warp, then a ``cuda.syncthreads()``)."""
    v = sm[w0, i, lane]
    for q in range(1, kw):
        v += sm[w0 + q, i, lane]
    return v


def block_total_bits(sm, i, lane, w0, kw):
    """:func:`block_total` of a staged block's ``sm`` (uint64: the sums as float32 bits, :func:`sm_shape`)."""
    v = f32_from_bits(sm[w0, i, lane])
    for q in range(1, kw):
        v += f32_from_bits(sm[w0 + q, i, lane])
    return v


block_total, block_total_bits = _device(block_total), _device(block_total_bits)


def block_total_fn(st: int):
    """The ``block_total`` of a block_mm with st stages (``sm``'s dtype)."""
    return block_total_bits if st else block_total


def gemm_kernel(rt: int, nt: int, u: int, nw: int, xl: int = XL_NATURAL, kw: int = 0, heads: bool = False,
                st: int = 0, fo: bool = False, yl: int = XL_NATURAL):
    """``y[M, N] (+)= X[M, K] W[e, N, K]^T`` (kdt.kernels.linear's tensor-core path; the warp tile's test). Block
    (bx, by): tokens [8 nt bx, 8 nt (bx + 1)) x rows [R by, R (by + 1)), R = 16 rt nw / kw (the token tiles of a
    row tile are neighbours in the grid, so they meet its weights in L2); its nw warps in row groups of kw warps
    that split K (:func:`block_mm`; kw = 0: kw = nw, one group), their sums added in warp order through shared
    memory. Signature: (X [M, K] in layout ``xl``, W u64 [E, N, Kw], e, y f32 [M, N], accumulate).

    ``heads``: one such GEMM a head h = blockIdx.z of H = gridDim.z, on the last N of each head's W.shape[1] / H
    rows (kdt.kernels.mla.uv_project: W_uv[h], the last dv of kv_b's dn + dv rows of head h), X row m H + h (o_lat
    [M, H, K] flattened) and y columns [h N, (h + 1) N) of y [M, H N]; e and accumulate are not read (W [1, ...]).
    st >= 2: the loads staged through shared memory (:func:`warp_mm_staged`). ``fo``: W in fragment order
    (:func:`to_fo`; N % 16 == 0, K % 16 == 0, x hi / lo; not with heads). ``yl`` XL_HILO (with heads): y is the
    uint16 view [M, 2 H N] of a hi / lo layout (:func:`put_hilo`), what the next linear_tc reads without splitting
    (kdt.kernels.mla.uv_project for o_proj)."""
    kw, KW, NRG = row_groups(nw, kw)
    if fo and heads:
        raise ValueError("fragment-ordered weights: one GEMM, not one a head")
    if yl not in (XL_NATURAL, XL_HILO) or (yl == XL_HILO and not heads):
        raise ValueError("gemm_kernel: y in the hi / lo layout with heads only")
    key = ("gemm", rt, nt, u, nw, xl, kw, heads, st, TC_PTR, fo, yl)
    if key in _CACHE:
        return _CACHE[key]
    RT, NT, NW, NA, NB, HEADS, YHL = rt, nt, nw, rt * nt * 4, 2 * rt, heads, yl == XL_HILO
    FRAG, SM, SMT = frag_shape(nw), sm_shape(nw, rt, nt, st, u), sm_dtype(st)
    bmm = block_mm(rt, nt, u, xl, False, nw, kw, st, fo)
    total = block_total_fn(st)

    def tc_gemm(X, W, e, y, accumulate):
        grid_dependency_wait()
        lane = cuda.threadIdx.x % 32
        warp = cuda.threadIdx.x // 32
        g, t = lane // 4, lane % 4
        sm = cuda.shared.array(SM, SMT)
        frag = cuda.shared.array(FRAG, int64)
        acc = cuda.local.array(NA, float32)
        rows = cuda.local.array(NB, int64)
        xrows = cuda.local.array(NT, int64)
        H = cuda.gridDim.z if HEADS else 1
        h = cuda.blockIdx.z if HEADS else 0
        M, N = X.shape[0] // H, y.shape[1] // (2 * H if YHL else H)
        m0 = cuda.blockIdx.x * 8 * NT
        r0 = cuda.blockIdx.y * MMA_ROWS * RT * NRG
        tile_rows(rows, r0 + (warp // KW) * MMA_ROWS * RT, N, g, RT)
        if HEADS:  # head h's rows of W
            for i in range(NB):
                rows[i] += (h + 1) * (W.shape[1] // H) - N
        for j in range(NT):
            xrows[j] = min(m0 + 8 * j + g, M - 1) * H + h
        bmm(W, 0 if HEADS else e, rows, X, xrows, acc, sm, frag, warp, lane)
        for ix in range(warp, NA * NRG, NW):
            q, i = ix // NA, ix % NA
            row = r0 + q * MMA_ROWS * RT + acc_row(i, NT, g)
            m = m0 + acc_col(i, NT, t)
            if row < N and m < M:
                v = total(sm, i, lane, q * KW, KW)
                c = h * N + row
                if YHL:
                    put_hilo(y, m, c, v)
                else:
                    y[m, c] = y[m, c] + v if accumulate and not HEADS else v

    tc_gemm.__name__ = (f"tc_gemm_rt{rt}_nt{nt}_u{u}_nw{nw}{XL_NAMES[xl]}{f'_kw{kw}' if kw else ''}"
                        f"{'_heads' if heads else ''}{f'_st{st}' if st else ''}{'_fo' if fo else ''}"
                        f"{'_yhilo' if yl == XL_HILO else ''}")
    k = cuda.jit(tc_gemm)
    _CACHE[key] = k
    return k


__all__ = ["mma_bf16", "split_bf16x2", "warp_mm", "warp_mm_staged", "cp_async16", "cp_async_commit", "cp_async_wait",
           "lanes_sync", "row_groups", "block_mm", "block_total", "block_total_bits", "block_total_fn", "sm_shape",
           "sm_dtype", "tile_rows", "acc_row",
           "acc_col", "gemm_kernel", "frag_shape", "put_hilo", "hilo_np", "fits_fo", "fo_np", "to_fo", "XL_NATURAL",
           "XL_PERM", "XL_HILO"]


def _register() -> None:
    from numba import boolean
    from numba import float32 as f32
    from numba import int64 as i64
    from numba import uint64 as u64

    from kdt.kernels.common import register_ptx

    for shape in ((2, 1, 4, 4, XL_PERM), (1, 2, 2, 4, XL_NATURAL), (2, 4, 2, 4, XL_NATURAL, 1), (2, 4, 2, 4, XL_HILO),
                  (2, 2, 1, 4, XL_HILO, 0, False, 3), (1, 2, 1, 4, XL_NATURAL, 0, False, 2)):  # (+ staged loads)
        x = u64[:, ::1] if shape[4] == XL_HILO else f32[:, ::1]
        register_ptx(gemm_kernel(*shape), (x, u64[:, :, ::1], i64, f32[:, ::1], boolean))
    register_ptx(gemm_kernel(2, 4, 2, 4, XL_HILO, fo=True), (u64[:, ::1], u64[:, :, ::1], i64, f32[:, ::1], boolean))
    register_ptx(fo_kernel, (u64[:, :, ::1], u64[:, :, ::1]))
    global TC_PTR
    saved, TC_PTR = TC_PTR, not TC_PTR  # the warp tile's other step (KDT_TC_PTR), under its own cache keys
    try:
        register_ptx(gemm_kernel(2, 4, 2, 4, XL_HILO), (u64[:, ::1], u64[:, :, ::1], i64, f32[:, ::1], boolean),
                     name=f"tc_gemm_rt2_nt4_u2_nw4_hilo[ptr={int(TC_PTR)}]")
    finally:
        TC_PTR = saved


_register()
