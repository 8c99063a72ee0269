"""Parity of kdt.kernels.elementwise against NumPy / kdt.reference.ops.

Bounds: gathers, adds and argmax are exact (array_equal; argmax must equal np.argmax, ties -> lowest
index, planted). RMSNorm and SiLU-mul compute in float32 against a float64 reference: rel_err < 1e-5
per row (float32 rounding lands near 1e-7).
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from kdt.kernels import elementwise as ew
from kdt.kernels import tc
from kdt.kernels.common import bf16_bits_to_f32, f32_to_bf16_bits
from kdt.reference import ops
from kdt.testing import poisoned, rel_err

FP32_BOUND = 1e-5
EPS = 1e-6


def _table(rng, shape, wdtype):
    """(stored array, float64 values the kernel sees)."""
    a = rng.standard_normal(shape, dtype=np.float32)
    if wdtype == "bf16":
        bits = f32_to_bf16_bits(a)
        return bits, bf16_bits_to_f32(bits).astype(np.float64)
    return a, a.astype(np.float64)


# ---- embedding ----------------------------------------------------------------------------------------
def _check_embedding(rng, V, D, M, wdtype):
    E, E_seen = _table(rng, (V, D), wdtype)
    tokens = rng.integers(0, V, size=M).astype(np.int64)
    tokens[:3] = [0, V - 1, 0][: min(3, M)]  # both ends of the table and a repeat
    d_x = cuda.to_device(poisoned((M, D)))
    ew.embedding(cuda.to_device(tokens), cuda.to_device(E), d_x)
    assert np.array_equal(d_x.copy_to_host(), E_seen[tokens].astype(np.float32))


@pytest.mark.kernels
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
def test_embedding_sim(rng, wdtype):
    _check_embedding(rng, V=50, D=70, M=5, wdtype=wdtype)


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
@pytest.mark.parametrize("D", [2048, 7168])
def test_embedding_gpu(rng, D, wdtype):
    _check_embedding(rng, V=163840, D=D, M=256, wdtype=wdtype)


# ---- rmsnorm ------------------------------------------------------------------------------------------
def _rms_rows(rng, M, width):
    x = rng.standard_normal((M, width), dtype=np.float32)
    x[0] *= 1e-4  # mean(x^2) ~ 1e-8 << eps = 1e-6: a wrong or missing eps fails this row
    if M > 2:
        x[2] *= 300.0
    return x


def _check_rmsnorm_rows(out, x, w64, ncols):
    ref = ops.rmsnorm(x[:, :ncols].astype(np.float64), w64, EPS)
    for m in range(x.shape[0]):
        err = rel_err(out[m, :ncols], ref[m])
        assert err < FP32_BOUND, f"row {m}: rel_err {err:.3g}"


def _check_rmsnorm(rng, M, N, wdtype, extra=0):
    """Normalise the first N columns of an [M, N + extra] buffer into a separate [M, N + extra] one."""
    x = _rms_rows(rng, M, N + extra)
    w, w64 = _table(rng, (N,), wdtype)
    d_y = cuda.to_device(poisoned((M, N + extra)))
    ew.rmsnorm(cuda.to_device(x), cuda.to_device(w), EPS, d_y, ncols=N if extra else None)
    out = d_y.copy_to_host()
    _check_rmsnorm_rows(out, x, w64, N)
    assert np.isnan(out[:, N:]).all(), "columns >= ncols must be left untouched"


@pytest.mark.kernels
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
@pytest.mark.parametrize("N,extra", [(150, 0), (37, 0), (300, 13)])
def test_rmsnorm_sim(rng, N, extra, wdtype):
    _check_rmsnorm(rng, M=3, N=N, wdtype=wdtype, extra=extra)


@pytest.mark.kernels
def test_rmsnorm_sliced_views_and_in_place(rng):
    """c_kv = rmsnorm(c[:, :Rkv]) through non-contiguous device views, then in place (y is x)."""
    M, Rkv, dr = 3, 100, 16
    c = _rms_rows(rng, M, Rkv + dr)
    w, w64 = _table(rng, (Rkv,), "f32")
    d_c, d_y = cuda.to_device(c), cuda.to_device(poisoned((M, Rkv + dr)))
    ew.rmsnorm(d_c[:, :Rkv], cuda.to_device(w), EPS, d_y[:, :Rkv])
    out = d_y.copy_to_host()
    _check_rmsnorm_rows(out, c, w64, Rkv)
    assert np.isnan(out[:, Rkv:]).all()
    ew.rmsnorm(d_c, cuda.to_device(w), EPS, d_c, ncols=Rkv)  # in place on the first Rkv columns
    out = d_c.copy_to_host()
    _check_rmsnorm_rows(out, c, w64, Rkv)
    assert np.array_equal(out[:, Rkv:], c[:, Rkv:])


def _check_rmsnorm_both(rng, M, N, wdtype):
    """rmsnorm(..., y_hl=): y the bits of the plain norm's, y_hl exactly y's hi / lo layout (kdt.kernels.tc.hilo_np),
    both poisoned first; a y_hl of the wrong shape or beside hilo=True is refused."""
    x = _rms_rows(rng, M, N)
    w, w64 = _table(rng, (N,), wdtype)
    d_x, d_w = cuda.to_device(x), cuda.to_device(w)
    d_plain, d_y = cuda.to_device(poisoned((M, N))), cuda.to_device(poisoned((M, N)))
    d_hl = cuda.to_device(np.full((M, 2 * N), 0xFFFF, np.uint16))
    ew.rmsnorm(d_x, d_w, EPS, d_plain)
    ew.rmsnorm(d_x, d_w, EPS, d_y, y_hl=d_hl)
    y = d_y.copy_to_host()
    _check_rmsnorm_rows(y, x, w64, N)
    assert np.array_equal(y, d_plain.copy_to_host())
    assert np.array_equal(d_hl.copy_to_host().view(np.uint64), tc.hilo_np(y))
    for y_out, bad in ((d_y, dict(y_hl=cuda.to_device(np.zeros((M, N), np.uint16)))),
                       (cuda.to_device(np.zeros((M, 2 * N), np.uint16)), dict(y_hl=d_hl, hilo=True))):
        with pytest.raises(ValueError, match="y_hl"):
            ew.rmsnorm(d_x, d_w, EPS, y_out, **bad)


@pytest.mark.kernels
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
def test_rmsnorm_both_sim(rng, wdtype):
    _check_rmsnorm_both(rng, 3, 40, wdtype)


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
@pytest.mark.parametrize("N,extra", [(2048, 0), (7168, 0), (16384, 0), (1536, 0), (512, 64)])
@pytest.mark.parametrize("M", [1, 256])
def test_rmsnorm_gpu(rng, M, N, extra, wdtype):
    _check_rmsnorm(rng, M=M, N=N, wdtype=wdtype, extra=extra)
    if not extra:
        _check_rmsnorm_both(rng, M, N, wdtype)


# ---- silu_mul -----------------------------------------------------------------------------------------
def _check_silu_mul(rng, M, I, halves=False):
    g = rng.standard_normal((M, I), dtype=np.float32) * 6.0  # reaches the saturated tails of silu
    u = rng.standard_normal((M, I), dtype=np.float32)
    d_out = cuda.to_device(poisoned((M, I)))
    if halves:  # gate and up as the two column halves of one [M, 2I] buffer (dense_mlp version 2)
        gu = cuda.to_device(np.concatenate([g, u], axis=1))
        ew.silu_mul(gu[:, :I], gu[:, I:], d_out)
    else:
        ew.silu_mul(cuda.to_device(g), cuda.to_device(u), d_out)
    out = d_out.copy_to_host()
    ref = ops.silu(g.astype(np.float64)) * u
    for m in range(M):
        err = rel_err(out[m], ref[m])
        assert err < FP32_BOUND, f"row {m}: rel_err {err:.3g}"


@pytest.mark.kernels
@pytest.mark.parametrize("halves", [False, True])
def test_silu_mul_sim(rng, halves):
    _check_silu_mul(rng, M=3, I=70, halves=halves)


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("I", [1408, 2048, 18432])
@pytest.mark.parametrize("M", [1, 256])
def test_silu_mul_gpu(rng, M, I):
    _check_silu_mul(rng, M, I)
    _check_silu_mul(rng, M, I, halves=True)


# ---- add ----------------------------------------------------------------------------------------------
def _check_add(rng, M, N):
    x = rng.standard_normal((M, N), dtype=np.float32)
    y = rng.standard_normal((M, N), dtype=np.float32)
    d_out = cuda.to_device(poisoned((M, N)))
    ew.add(cuda.to_device(x), cuda.to_device(y), d_out)
    assert np.array_equal(d_out.copy_to_host(), x + y)
    d_x = cuda.to_device(x)
    ew.add(d_x, cuda.to_device(y), d_x)  # in-place residual add
    assert np.array_equal(d_x.copy_to_host(), x + y)


@pytest.mark.kernels
def test_add_sim(rng):
    _check_add(rng, M=3, N=70)
    x, y = rng.standard_normal(45, dtype=np.float32), rng.standard_normal(45, dtype=np.float32)
    d_out = cuda.to_device(poisoned(45))
    ew.add(cuda.to_device(x), cuda.to_device(y), d_out)  # 1-D
    assert np.array_equal(d_out.copy_to_host(), x + y)


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("D", [2048, 7168])
@pytest.mark.parametrize("M", [1, 256])
def test_add_gpu(rng, M, D):
    _check_add(rng, M, D)


@pytest.mark.kernels
def test_copy_sim(rng):
    """copy of a row block into a strided destination view (the engine's feature buffer [layers, M, D])."""
    x = rng.standard_normal((3, 70)).astype(np.float32)
    buf = cuda.to_device(poisoned((2, 5, 70)))
    ew.copy(cuda.to_device(x), buf[1, :3])
    got = buf.copy_to_host()
    assert np.array_equal(got[1, :3], x) and np.isnan(got[0]).all() and np.isnan(got[1, 3:]).all()


# ---- argmax_rows ---------------------------------------------------------------------------------------
def _plant_ties(rng, row, positions):
    """Make row's maximum occur at every index in positions."""
    row[list(positions)] = row.max() + 1.0 + rng.random()


def _check_argmax(logits, scratch=None, reps=1):
    """argmax_rows (split over blocks with ``scratch``) equals np.argmax on every row, ``reps`` launches in a
    row (the split kernel's tickets must be back to 0 after each)."""
    M = logits.shape[0]
    ref = np.argmax(logits, axis=-1)
    d_logits = cuda.to_device(logits)
    for _ in range(reps):
        d_out = cuda.to_device(poisoned(M, np.int64))
        ew.argmax_rows(d_logits, d_out, scratch=scratch)
        out = d_out.copy_to_host()
        bad = out != ref
        assert not bad.any(), f"rows {np.nonzero(bad)[0]}: got {out[bad]}, want {ref[bad]}"


def _argmax_cases(rng, nt, V, chunk):
    """Rows with planted ties (one thread, one warp, the tail, across groups, threads and chunks), all equal,
    all -inf, NaN (the first wins), the maximum at the ends."""
    L = rng.standard_normal((11, V), dtype=np.float32)
    _plant_ties(rng, L[0], [5, 5 + nt])  # one thread, two loads of a group
    _plant_ties(rng, L[1], [40, 3])  # two lanes of one warp
    _plant_ties(rng, L[2], [V - 1, V - 2 - nt])  # in the tail
    _plant_ties(rng, L[3], [2 * nt + 1, ew.ARGMAX_UNROLL * nt + 1])  # across groups and threads
    L[4] = 1.0  # all equal -> 0
    L[5] = -np.inf  # all -inf -> 0
    L[6, [V - 3, 200]] = np.nan  # NaN wins, first NaN
    _plant_ties(rng, L[7], [V - 1])  # maximum at the very end
    _plant_ties(rng, L[8], [0, V - 1])  # at both ends
    _plant_ties(rng, L[9], [chunk + 7, chunk - 1, 3 * chunk])  # across chunks: the lowest index wins
    L[10, [V - 1, chunk + 2]] = np.nan  # NaNs in two chunks
    return L


@pytest.mark.kernels
def test_argmax_rows_sim(rng):
    nt = ew.ARGMAX_THREADS
    V = 2 * ew.ARGMAX_UNROLL * nt + 76  # two unrolled groups per thread plus a tail
    _check_argmax(_argmax_cases(rng, nt, V, V // 4))


@pytest.mark.kernels
def test_argmax_rows_split_sim(rng):
    """The split kernel: rows of 5 chunks (the last one short) of two unrolled groups each, launched twice."""
    nt = ew.ARGMAX_SPLIT_THREADS
    chunk = 2 * ew.ARGMAX_UNROLL * nt
    V = 4 * chunk + 3 * nt + 5
    scratch = ew.ArgmaxScratch(12, V, chunk=chunk)
    assert scratch.S == 5 and scratch.chunk == chunk
    _check_argmax(_argmax_cases(rng, nt, V, chunk), scratch, reps=2)
    # a row too long for ARGMAX_SPLIT_THREADS chunks takes longer chunks; a scratch for another V is refused
    assert ew.ArgmaxScratch(1, 3 * nt * chunk, chunk=chunk).S <= nt
    with pytest.raises(ValueError, match="scratch"):
        ew.argmax_rows(cuda.to_device(np.zeros((2, V + 1), np.float32)), cuda.device_array(2, np.int64),
                       scratch=scratch)


@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("M", [1, 7, 256])
def test_argmax_rows_gpu(rng, M, split):
    V = 163840
    L = rng.standard_normal((M, V), dtype=np.float32)
    for m in range(M):
        if m % 2 == 0:  # ties at random places (several per row) on every other row
            _plant_ties(rng, L[m], rng.choice(V, size=1 + m % 5, replace=False))
    if M > 4:
        L[1] = 0.5
        L[2, :] = -np.inf
        L[3, [V - 7, 99_999]] = np.nan
    if M > 6:
        _plant_ties(rng, L[5], [ew.ARGMAX_CHUNK + 1, ew.ARGMAX_CHUNK - 1])  # across two chunks
        L[6, [V - 1, 2 * ew.ARGMAX_CHUNK]] = np.nan
    _check_argmax(L, ew.ArgmaxScratch(M, V) if split else None, reps=2)
