"""DDTree kernels (kdt.kernels.ddtree) against the NumPy reference: exact equality of every output.

Simulator runs (``kernels``) are small: R <= 2, budgets <= 17, 32 threads per block. The ``gpu`` tests
sweep real sizes (budgets up to 256, D up to 15, K up to 16, several requests at once).
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from kdt.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from kdt.kernels.ddtree import (
    _LOGP_CAP,
    _NODE_CAP,
    MAX_BUDGET,
    TOPK_MAX_V,
    AcceptBuffers,
    TreeBuffers,
    accept_gpu,
    build_tree_gpu,
    compact_gpu,
    gather_accepted,
    oracle_draft_gpu,
    stage_draft,
    stage_tree,
    step_commit,
    topk_gpu,
)
from kdt.reference.ddtree import Tree, build_tree, compact_cache, follow_verified_tree
from kdt.testing import poisoned

# ------------------------------------------------------------------------------------------------ helpers


def random_drafts(rng, R: int, D: int, K: int, ties: bool):
    """root [R], tokens [R, D, K] (small vocabulary: duplicate tokens happen), logp [R, D, K], L [R].
    ``ties``: log-probs drawn from {-1, -2, -3}, so equal scores are common."""
    root = rng.integers(0, 8, size=R).astype(np.int64)
    tokens = rng.integers(0, 8, size=(R, D, K)).astype(np.int64)
    if ties:
        logp = rng.choice(np.array([-1.0, -2.0, -3.0], np.float32), size=(R, D, K))
    else:
        logp = -np.sort(rng.exponential(2.0, size=(R, D, K)), axis=-1)  # descending per depth
    L = rng.integers(0, 1000, size=R).astype(np.int64)
    return root, tokens, logp.astype(np.float32), L


def padded_reference(tree: Tree, L: int, nmax: int, budget: int) -> dict[str, np.ndarray]:
    """The kernel's per-request outputs for a reference tree: slots >= n hold -1; visibility is 0 outside
    the tree's [n, n] block up to budget + 1 and untouched beyond (the poison of poisoned_tree_buffers)."""
    n = tree.n

    def pad(a, dtype):
        out = np.full(nmax, -1, dtype)
        out[:n] = a
        return out

    vis = poison((nmax, nmax), np.uint8)
    vis[: budget + 1, : budget + 1] = 0
    vis[:n, :n] = tree.visibility
    return dict(
        tokens=pad(tree.tokens, np.int64),
        depth=pad(tree.depth, np.int32),
        parent=pad(tree.parent, np.int32),
        first_child=pad(tree.first_child, np.int32),
        next_sibling=pad(tree.next_sibling, np.int32),
        positions=pad(tree.positions(L), np.int64),
        visibility=vis,
        n_nodes=np.int32(n),
    )


def poison(shape, dtype) -> np.ndarray:
    """kdt.testing.poisoned, plus 0xAB for uint8 (poisoned's -7777 does not fit)."""
    if np.dtype(dtype) == np.uint8:
        return np.full(shape, 0xAB, np.uint8)
    return poisoned(shape, dtype)


def poisoned_tree_buffers(R: int, nmax: int) -> TreeBuffers:
    shapes = dict(visibility=(R, nmax, nmax), n_nodes=(R,))
    dtypes = dict(tokens=np.int64, positions=np.int64, visibility=np.uint8)
    return TreeBuffers(
        *(
            cuda.to_device(poison(shapes.get(f, (R, nmax)), dtypes.get(f, np.int32)))
            for f in TreeBuffers._fields
        )
    )


def following_choices(tree: Tree, rng, nmax: int, p_follow: float = 0.8) -> np.ndarray:
    """[nmax] target choices: a random child's token with probability p_follow, else a random token."""
    tc = rng.integers(0, 8, size=nmax).astype(np.int64)
    for i in range(tree.n):
        kids = tree.children(i)
        if kids and rng.random() < p_follow:
            tc[i] = tree.tokens[rng.choice(kids)]
    return tc


def check_build_and_accept(rng, R, D, K, budget, ties, nmax=None, threads=32, warp_max=None):
    """Build + accept on the device with poisoned outputs; every output equals the reference.
    ``warp_max``: tree_build's warp-search bound (None: the default, -1: the heap search at every budget)."""
    nmax = budget + 1 if nmax is None else nmax
    root, tokens, logp, L = random_drafts(rng, R, D, K, ties)
    out = poisoned_tree_buffers(R, nmax)
    got = build_tree_gpu(root, tokens, logp, budget, L, out=out, threads=threads,
                         warp_max=warp_max)  # numpy in -> numpy out
    trees = [build_tree(root[r], tokens[r], logp[r], budget) for r in range(R)]
    for r, tree in enumerate(trees):
        ref = padded_reference(tree, L[r], nmax, budget)
        for name, want in ref.items():
            have = getattr(got, name)[r]
            assert have.dtype == np.asarray(want).dtype, name
            np.testing.assert_array_equal(have, want, err_msg=f"{name} r={r} budget={budget} D={D} K={K}")

    tc = np.stack([following_choices(t, rng, nmax) for t in trees])
    acc_out = AcceptBuffers(
        cuda.to_device(poisoned((R, nmax), np.int32)),
        cuda.to_device(poisoned(R, np.int32)),
        cuda.to_device(poisoned(R, np.int64)),
    )
    acc = accept_gpu(
        got.first_child, got.next_sibling, got.tokens, tc, got.n_nodes, out=acc_out, threads=threads
    )
    for r, tree in enumerate(trees):
        accepted, bonus = follow_verified_tree(tree, tc[r, : tree.n])
        want = np.full(nmax, -1, np.int32)
        want[: accepted.size] = accepted
        np.testing.assert_array_equal(acc.accepted[r], want)
        assert acc.n_accepted[r] == accepted.size and acc.bonus[r] == bonus
    return trees, acc


# ------------------------------------------------------------------------------------------------ simulator


@pytest.mark.kernels
@pytest.mark.parametrize("warp_max", [None, -1], ids=["warp", "heap"])
@pytest.mark.parametrize("budget", [0, 1, 2, 5, 17])
@pytest.mark.parametrize("D", [1, 2, 5])
def test_tree_build_accept_parity(rng, budget, D, warp_max):
    for ties in (True, True, False):
        K = int(rng.integers(1, 5))
        check_build_and_accept(rng, R=2, D=D, K=K, budget=budget, ties=ties, warp_max=warp_max)


@pytest.mark.kernels
@pytest.mark.parametrize("budget", [0, 1, 3, 9])
def test_tree_build_chain(rng, budget):
    """K = 1 (and budget 1 at K = 3): a chain, written without a search; budget 9 > D = 5 stops at depth D."""
    check_build_and_accept(rng, R=2, D=5, K=1, budget=budget, ties=False)
    check_build_and_accept(rng, R=1, D=5, K=3, budget=min(budget, 1), ties=True)


@pytest.mark.kernels
def test_tree_build_warp_search_full_warp(rng):
    """The warp search at its largest budget (31 pops: every lane holds a node, up to 32 live candidate
    slots), wide and deep drafts, ties common; and budget 32 just above it (the heap)."""
    from kdt.kernels.ddtree import WARP_SEARCH_MAX

    assert WARP_SEARCH_MAX == 31
    for budget in (31, 32):
        for ties in (True, False):
            check_build_and_accept(rng, R=1, D=31, K=31, budget=budget, ties=ties)


@pytest.mark.kernels
@pytest.mark.parametrize("warp_max", [None, -1], ids=["warp", "heap"])
def test_tree_build_ties_hand_computed(warp_max):
    """All-equal log-probs: the kernel breaks ties by push order, like the reference (rank-major)."""
    tokens = np.array([[[10, 11, 12], [20, 21, 22]]], np.int64)
    logp = np.full((1, 2, 3), -1.0, np.float32)
    got = build_tree_gpu(np.array([99]), tokens, logp, 9, np.array([4]), threads=32, warp_max=warp_max)
    np.testing.assert_array_equal(got.parent[0], [-1, 0, 0, 0, 1, 2, 3, 1, 2, 3])
    np.testing.assert_array_equal(got.tokens[0], [99, 10, 11, 12, 20, 20, 20, 21, 21, 21])
    np.testing.assert_array_equal(got.positions[0], [4, 5, 5, 5, 6, 6, 6, 6, 6, 6])


@pytest.mark.kernels
def test_tree_build_spare_capacity(rng):
    """NMAX larger than budget + 1 (and a budget larger than the possible tree): extra slots are -1,
    visibility 0 up to budget + 1 and untouched beyond."""
    check_build_and_accept(rng, R=1, D=2, K=2, budget=5, ties=True, nmax=9)


@pytest.mark.kernels
def test_tree_build_unstaged_logp(rng):
    """min(D, budget) * min(K, budget) > _LOGP_CAP: log-probs are read from global memory instead."""
    assert 90 * 90 > _LOGP_CAP
    check_build_and_accept(rng, R=1, D=90, K=90, budget=90, ties=True)


@pytest.mark.kernels
def test_tree_accept_unstaged(rng):
    """A tree larger than tree_accept's shared-memory rows (a 600-node chain): read from global memory."""
    n = 600
    assert n > _NODE_CAP
    tree = build_tree(0, rng.integers(0, 3, size=(n - 1, 1)), np.full((n - 1, 1), -1.0), n - 1)
    tc = following_choices(tree, rng, n, p_follow=0.995)
    rows = [a[None].copy() for a in (tree.first_child, tree.next_sibling, tree.tokens, tc)]  # [1, n]
    acc = accept_gpu(*rows, np.array([n], np.int32), threads=32)
    accepted, bonus = follow_verified_tree(tree, tc)
    assert acc.n_accepted[0] == accepted.size and acc.bonus[0] == bonus
    np.testing.assert_array_equal(acc.accepted[0, : accepted.size], accepted)
    assert np.all(acc.accepted[0, accepted.size :] == -1)


@pytest.mark.kernels
def test_device_pipeline(rng):
    """build -> accept -> compact on device arrays, no host round trip until the end."""
    R, D, K, budget = 1, 3, 2, 5
    root, tokens, logp, L = random_drafts(rng, R, D, K, ties=False)
    L[:] = 2
    d_tree = build_tree_gpu(*(cuda.to_device(a) for a in (root, tokens, logp)), budget, cuda.to_device(L))
    assert all(hasattr(a, "copy_to_host") for a in d_tree)
    tree = build_tree(root[0], tokens[0], logp[0], budget)
    # stage_tree: the tree as the forward reads it (tokens, positions, [n, n] mask), poisoned first
    n, M_max = tree.n, budget + 3
    s_tok, s_pos = cuda.to_device(poisoned(M_max, np.int64)), cuda.to_device(poisoned(M_max, np.int64))
    s_vis = cuda.to_device(poison(M_max * M_max, np.uint8))
    stage_tree[1, 64](d_tree.tokens, d_tree.positions, d_tree.visibility, d_tree.n_nodes, np.int32(0),
                      s_tok, s_pos, s_vis)
    np.testing.assert_array_equal(s_tok.copy_to_host()[:n], tree.tokens)
    np.testing.assert_array_equal(s_pos.copy_to_host()[:n], tree.positions(2))
    np.testing.assert_array_equal(s_vis.copy_to_host()[: n * n].reshape(n, n), tree.visibility.astype(np.uint8))
    assert (s_tok.copy_to_host()[n:] == -7777).all() and (s_vis.copy_to_host()[n * n:] == 0xAB).all()
    tc = following_choices(tree, rng, budget + 1, p_follow=1.0)[None]
    d_acc = accept_gpu(
        d_tree.first_child, d_tree.next_sibling, d_tree.tokens, cuda.to_device(tc), d_tree.n_nodes
    )
    assert all(hasattr(a, "copy_to_host") for a in d_acc)
    c_kv = rng.standard_normal((2, 12, 4)).astype(np.float32)
    k_pe = rng.standard_normal((2, 12, 3)).astype(np.float32)
    kv_hl = rng.integers(0, 1 << 32, (2, 12, 7), dtype=np.uint32)  # the pre-split cache (any words here)
    d_c, d_k, d_hl = cuda.to_device(c_kv), cuda.to_device(k_pe), cuda.to_device(kv_hl)
    L_dev = cuda.to_device(np.array([2], np.int64))
    compact_gpu(d_c, d_k, L_dev, d_acc.accepted[0], d_acc.n_accepted, kv_hl=d_hl)  # L and n_acc read on the device
    accepted, bonus = follow_verified_tree(tree, tc[0, : tree.n])
    # step_commit: record[seq & 1] = [1 + a, choice at each accepted node], seq += 1, L += 1 + a, root = bonus
    record, root_dev = cuda.to_device(poisoned((2, budget + 2), np.int64)), cuda.to_device(np.array([-1], np.int64))
    seq = cuda.to_device(np.array([6], np.int64))  # an even count: row 0
    choices = cuda.to_device(tc[0])
    step_commit[1, 32](d_acc.accepted, d_acc.n_accepted, d_acc.bonus, choices, L_dev, root_dev, record, seq)
    rec = record.copy_to_host()
    assert rec[0, 0] == accepted.size and (rec[0, 1: 1 + accepted.size] == tc[0, accepted]).all()
    assert (rec[0, 1 + accepted.size:] == -7777).all() and (rec[1] == -7777).all()
    assert L_dev.copy_to_host()[0] == 2 + accepted.size and root_dev.copy_to_host()[0] == bonus
    assert seq.copy_to_host()[0] == 7
    L_dev.copy_to_device(np.array([2], np.int64))  # again at an odd count: row 1, row 0 left as it was
    step_commit[1, 32](d_acc.accepted, d_acc.n_accepted, d_acc.bonus, choices, L_dev, root_dev, record, seq)
    rec2 = record.copy_to_host()
    np.testing.assert_array_equal(rec2[1], rec[0])
    np.testing.assert_array_equal(rec2[0], rec[0])
    assert seq.copy_to_host()[0] == 8 and L_dev.copy_to_host()[0] == 2 + accepted.size
    for layer in range(2):
        compact_cache([c_kv[layer], k_pe[layer], kv_hl[layer]], 2, accepted)
    np.testing.assert_array_equal(d_c.copy_to_host(), c_kv)
    np.testing.assert_array_equal(d_k.copy_to_host(), k_pe)
    np.testing.assert_array_equal(d_hl.copy_to_host(), kv_hl)


def run_compact_check(rng, n_layers, max_len, rkv, dr, L, accepted, nmax, threads=32):
    """kv_compact on numpy caches (copied in and back) equals the reference, every slot compared: c_kv / k_pe
    alone, then with the pre-split cache kv_hl [n_layers, max_len, rkv + dr] (random uint32 words)."""
    caches = [rng.standard_normal((n_layers, max_len, rkv)).astype(np.float32),
              rng.standard_normal((n_layers, max_len, dr)).astype(np.float32),
              rng.integers(0, 1 << 32, (n_layers, max_len, rkv + dr), dtype=np.uint32)]
    want = [a.copy() for a in caches]
    for layer in range(n_layers):
        compact_cache([a[layer] for a in want], L, accepted)
    acc = np.full(nmax, -1, np.int32)  # padded like tree_accept's output
    acc[: len(accepted)] = accepted
    for n in (2, 3):  # without, then with kv_hl
        got = [a.copy() for a in caches[:n]]
        compact_gpu(got[0], got[1], L, acc, len(accepted), threads=threads, kv_hl=got[2] if n == 3 else None)
        for g, w in zip(got, want[:n], strict=True):
            np.testing.assert_array_equal(g, w)


@pytest.mark.kernels
def test_kv_compact_spec_example(rng):
    run_compact_check(rng, n_layers=2, max_len=12, rkv=16, dr=8, L=3, accepted=[0, 2, 5], nmax=6)


@pytest.mark.kernels
def test_kv_compact_random(rng):
    n = 7
    a = int(rng.integers(0, n))
    accepted = [0, *np.sort(rng.choice(np.arange(1, n), size=a, replace=False)).tolist()]
    L = int(rng.integers(0, 4))
    run_compact_check(rng, n_layers=2, max_len=L + n + 2, rkv=8, dr=4, L=L, accepted=accepted, nmax=n)


def test_wrappers_validate():
    z = np.zeros
    with pytest.raises(ValueError, match="budget"):
        build_tree_gpu(z(1, np.int64), z((1, 2, 2), np.int64), z((1, 2, 2), np.float32), MAX_BUDGET + 1, z(1))
    with pytest.raises(ValueError, match="D, K"):
        build_tree_gpu(z(1, np.int64), z((1, 0, 2), np.int64), z((1, 0, 2), np.float32), 3, z(1))
    with pytest.raises(ValueError, match=r"\[R, D, K\]"):
        build_tree_gpu(z(1, np.int64), z((1, 2, 2), np.int64), z((1, 2, 3), np.float32), 3, z(1))
    with pytest.raises(ValueError, match="n_acc"):
        compact_gpu(z((1, 4, 2), np.float32), z((1, 4, 2), np.float32), 2, z(4, np.int32), 3)


# ------------------------------------------------------------------------------------------------ real GPU


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [1, 2, 3, 7, 16, 31, 32, 64, 128, 255, 256])
@pytest.mark.parametrize("D", [1, 2, 5, 15])
@pytest.mark.parametrize("K", [1, 4, 16])
def test_tree_build_accept_parity_gpu(rng, budget, D, K):
    for ties in (True, False):
        check_build_and_accept(rng, R=6, D=D, K=K, budget=budget, ties=ties, threads=128)
        if budget <= 31:  # the heap search at the warp search's budgets too
            check_build_and_accept(rng, R=6, D=D, K=K, budget=budget, ties=ties, threads=128, warp_max=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("D, K", [(15, 64), (15, MAX_BUDGET), (40, 300)])  # the last is not staged
def test_tree_build_max_budget_gpu(rng, D, K):
    for ties in (True, False):
        check_build_and_accept(rng, R=3, D=D, K=K, budget=MAX_BUDGET, ties=ties, threads=256)


@pytest.mark.gpu
@pytest.mark.parametrize("n_layers, rkv, dr", [(1, 512, 64), (61, 512, 64)])
def test_kv_compact_gpu(rng, n_layers, rkv, dr):
    n = 257
    accepted = [0, *np.sort(rng.choice(np.arange(1, n), size=15, replace=False)).tolist()]
    run_compact_check(
        rng, n_layers, max_len=1024, rkv=rkv, dr=dr, L=700, accepted=accepted, nmax=n, threads=256
    )


# ------------------------------------------------------------------------------- the device step's kernels


def check_topk(rng, D: int, V: int, K: int, ties: bool) -> None:
    """draft_topk == a stable argsort of the float64 log-softmax (tokens exactly, log-probs to 2e-6) on random
    logits (odd rows shifted below 0; ``ties``: rounded, so equal values, -0.0 beside 0.0 too, are common)."""
    logits = rng.standard_normal((D, V)).astype(np.float32) * 3
    logits[1::2] -= logits[1::2].max(1, keepdims=True) + 1  # every other row all negative
    if ties:  # repeated values: the smaller token id must come first
        logits = np.round(logits).astype(np.float32)
    x = logits.astype(np.float64)
    logp = x - x.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    top = np.argsort(-logp, axis=1, kind="stable")[:, :K]
    tok, lp = cuda.to_device(poisoned((1, D, K), np.int64)), cuda.to_device(poisoned((1, D, K)))
    topk_gpu(cuda.to_device(logits), tok, lp)
    np.testing.assert_array_equal(tok.copy_to_host()[0], top)
    np.testing.assert_allclose(lp.copy_to_host()[0], np.take_along_axis(logp, top, 1), rtol=0, atol=2e-6)


@pytest.mark.kernels
@pytest.mark.parametrize("D, V, K", [(1, 5, 5), (3, 37, 8), (2, 64, 1), (2, 100, 10)])  # V = 100: rows longer
# than the block (64 threads in the simulator) take the shared-memory sort; the others one element a thread
def test_draft_topk(rng, D, V, K):
    for ties in (False, True):
        check_topk(rng, D, V, K, ties)


@pytest.mark.gpu
@pytest.mark.parametrize("D, V, K", [(15, 256, 256), (15, 256, 16), (15, 256, 32), (7, 300, 9), (4, 512, 32),
                                     (7, 1000, 64), (15, TOPK_MAX_V, 512)])
def test_draft_topk_gpu(rng, D, V, K):
    for ties in (False, True):
        check_topk(rng, D, V, K, ties)


@pytest.mark.kernels
@pytest.mark.parametrize("D, K, V", [(1, 1, 50), (7, 8, 50), (3, 40, 1000)])
def test_oracle_draft_equals_the_host_oracle(rng, D, K, V):
    """oracle_draft (the device oracle's draft) == OracleDrafter.draft at the same context length, the sequence
    random (tokens near V, so the modulo wraps), L at random within the known sequence; outputs poisoned."""
    from kdt.drafters import OracleDrafter

    n_seq = 30
    d = OracleDrafter(rng.integers(V - 20, V, n_seq), V, seed=int(rng.integers(1 << 30)), on_device=True)
    max_len = n_seq + 2
    seq = cuda.to_device(d.padded(max_len + 64))
    cols, logp = (cuda.to_device(a) for a in d.tables(D, K))
    for L in (0, int(rng.integers(1, n_seq - D - 1)), n_seq - D - 1):
        tok, lp = cuda.to_device(poisoned((1, D, K), np.int64)), cuda.to_device(poisoned((1, D, K)))
        oracle_draft_gpu(seq, cuda.to_device(np.array([L], np.int64)), cols, logp, tok, lp, V)
        want_tok, want_lp = d.draft(np.zeros(L + 1, np.int64), D, K)
        np.testing.assert_array_equal(tok.copy_to_host()[0], want_tok)
        np.testing.assert_array_equal(lp.copy_to_host()[0], want_lp)
        assert want_tok[0, 0] == d.sequence[L + 1] and len(set(want_tok[-1].tolist())) == K


def test_topk_validates():
    z = np.zeros
    with pytest.raises(ValueError, match="draft_topk"):
        topk_gpu(z((2, TOPK_MAX_V + 1), np.float32), z((1, 2, 4), np.int64), z((1, 2, 4), np.float32))


@pytest.mark.kernels
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
def test_stage_draft_and_gather_accepted(rng, wdtype):
    """stage_draft: B context rows (n_ctx valid) at L_ctx + i, then the block at L + j, the [2B, 2B]
    mask (context causal, the block sees the valid context and itself) and the block's input rows (the
    root's embedding, the mask rows; the context rows' x untouched); without the block, the context
    rows only. gather_accepted: the accepted rows of every feature layer side by side, zeros after
    n_acc, the next context's count and first position, and the next step's rows as stage_draft stages
    them (this test checks stage_draft against explicit values first)."""
    B, L_ctx, n_ctx, L, root, V, Dx = 4, 9, 2, 11, 42, 50, 40
    dev = cuda.to_device
    embed32 = rng.standard_normal((V, Dx)).astype(np.float32)
    embed = f32_to_bf16_bits(embed32) if wdtype == "bf16" else embed32
    embed_row = bf16_bits_to_f32(embed[root]) if wdtype == "bf16" else embed32[root]
    mask_rows = rng.standard_normal((B - 1, Dx)).astype(np.float32)
    for with_block in (True, False):
        M = 2 * B if with_block else B
        tokens, positions, L_out = (dev(poisoned(n, np.int64)) for n in (2 * B, 2 * B, 1))
        vis = dev(np.full(4 * B * B, 0xAB, np.uint8))
        x = dev(poisoned((2 * B + 1, Dx)))
        stage_draft(dev(np.array([L_ctx], np.int64)), dev(np.array([n_ctx], np.int32)), dev(np.array([L], np.int64)),
                    dev(np.array([root], np.int64)), B, with_block, tokens, positions, L_out, vis, dev(embed),
                    dev(mask_rows), x)
        want_pos = np.concatenate([L_ctx + np.arange(B), L + np.arange(B)])[:M]
        np.testing.assert_array_equal(positions.copy_to_host()[:M], want_pos)
        assert (positions.copy_to_host()[M:] == -7777).all() and L_out.copy_to_host()[0] == L_ctx
        xh = x.copy_to_host()
        assert np.isnan(xh[:B]).all() and np.isnan(xh[2 * B:]).all()  # only the block's rows are written
        if with_block:
            assert tokens.copy_to_host()[B] == root
            want = np.zeros((M, M), np.uint8)
            want[:B, :B] = np.tril(np.ones((B, B), np.uint8))
            want[B:, :n_ctx] = 1
            want[B:, B:] = 1
            np.testing.assert_array_equal(vis.copy_to_host().reshape(M, M), want)
            np.testing.assert_array_equal(xh[B: 2 * B], np.concatenate([embed_row[None], mask_rows]))
        else:
            assert (tokens.copy_to_host() == -7777).all() and (vis.copy_to_host() == 0xAB).all()
            assert np.isnan(xh[B: 2 * B]).all()
    F, Mx, D = 3, 9, 6
    feat = rng.standard_normal((F, Mx, D)).astype(np.float32)
    accepted = np.array([[0, 2, 5, -1, -1, -1]], np.int32)
    out, n_out, L_out = dev(poisoned((B, F * D))), dev(poisoned(1, np.int32)), dev(poisoned(1, np.int64))
    # ... and the next step's drafter rows, as stage_draft stages them after the commit (L += 3, root = bonus)
    def poisoned_rows():  # tokens, positions, L_out, vis, x
        return [dev(poisoned(n, np.int64)) for n in (2 * B, 2 * B, 1)] + [
            dev(np.full(4 * B * B, 0xAB, np.uint8)), dev(poisoned((2 * B + 1, Dx)))]

    *staged, x = poisoned_rows()
    bonus = root + 1
    gather_accepted(dev(feat), dev(accepted), dev(np.array([3], np.int32)), dev(np.array([L], np.int64)),
                    dev(np.array([bonus], np.int64)), out, n_out, L_out, *staged, dev(embed), dev(mask_rows), x,
                    threads=8)
    want = np.zeros((B, F * D), np.float32)
    want[:3] = np.concatenate([feat[f][[0, 2, 5]] for f in range(F)], axis=1)
    np.testing.assert_array_equal(out.copy_to_host(), want)
    assert n_out.copy_to_host()[0] == 3 and L_out.copy_to_host()[0] == L
    *ref, x_ref = poisoned_rows()
    stage_draft(dev(np.array([L], np.int64)), dev(np.array([3], np.int32)), dev(np.array([L + 3], np.int64)),
                dev(np.array([bonus], np.int64)), B, True, *ref, dev(embed), dev(mask_rows), x_ref)
    for got, exp in zip(staged + [x], ref + [x_ref], strict=True):
        np.testing.assert_array_equal(got.copy_to_host(), exp.copy_to_host())
    assert staged[0].copy_to_host()[B] == bonus and staged[1].copy_to_host()[B] == L + 3
