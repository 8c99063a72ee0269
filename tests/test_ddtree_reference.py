"""The NumPy reference DDTree (kdt.reference.ddtree) against brute force and hand-computed cases."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdt.reference.ddtree import (
    Tree,
    build_tree,
    compact_cache,
    follow_verified_tree,
    target_choice_greedy,
    target_choice_sample,
)

# ------------------------------------------------------------------------------------------------ helpers


def n_possible(D: int, K: int) -> int:
    """Number of rank paths of length 1..D: K + K^2 + .. + K^D."""
    return sum(K**d for d in range(1, D + 1))


def path_score(logp: np.ndarray, ranks) -> np.float32:
    """float32 score of a rank path, accumulated exactly like build_tree."""
    s = np.float32(0.0)
    for j, r in enumerate(ranks):
        s = np.float32(s + logp[j, r])
    return s


def rank_path(tree: Tree, i: int) -> tuple[int, ...]:
    out = []
    while i > 0:
        out.append(int(tree.rank[i]))
        i = int(tree.parent[i])
    return tuple(reversed(out))


def ancestors(tree: Tree, i: int) -> set[int]:
    out = {i}
    while tree.parent[i] >= 0:
        i = int(tree.parent[i])
        out.add(i)
    return out


@st.composite
def drafts(draw, max_d=3, max_k=3, distinct_tokens=False):
    """(root, draft_tokens [D, K], draft_logp [D, K] sorted descending per depth, <= 0, budget)."""
    D = draw(st.integers(1, max_d))
    K = draw(st.integers(1, max_k))
    vals = draw(st.lists(st.floats(-8.0, 0.0, width=32), min_size=D * K, max_size=D * K))
    logp = -np.sort(-np.asarray(vals, np.float32).reshape(D, K), axis=1)  # top-K lists are sorted
    seed = draw(st.integers(0, 2**32 - 1))
    r = np.random.default_rng(seed)
    if distinct_tokens:
        tokens = np.stack([r.permutation(50)[:K] for _ in range(D)]).astype(np.int64)
    else:
        tokens = r.integers(0, 50, size=(D, K)).astype(np.int64)
    budget = draw(st.integers(0, n_possible(D, K) + 2))
    return int(r.integers(0, 50)), tokens, logp, budget


# ------------------------------------------------------------------------------------------------ build_tree


@settings(max_examples=200, deadline=None)
@given(drafts())
def test_tree_structure(d):
    root, tokens, logp, budget = d
    D, K = tokens.shape
    t = build_tree(root, tokens, logp, budget)
    n = t.n
    assert n - 1 == min(budget, n_possible(D, K))
    assert t.tokens[0] == root and t.depth[0] == 0 and t.parent[0] == -1 and t.rank[0] == -1
    assert t.score[0] == 0
    for name in ("tokens", "depth", "parent", "first_child", "next_sibling", "rank", "score"):
        assert getattr(t, name).shape == (n,), name
    assert t.tokens.dtype == np.int64 and t.score.dtype == np.float32
    assert t.visibility.shape == (n, n) and t.visibility.dtype == bool
    np.testing.assert_array_equal(t.positions(7), 7 + t.depth.astype(np.int64))
    assert t.positions(7).dtype == np.int64
    for i in range(1, n):
        p = int(t.parent[i])
        assert 0 <= p < i, "parent precedes child"
        assert t.depth[i] == t.depth[p] + 1
        assert 1 <= t.depth[i] <= D and 0 <= t.rank[i] < K
        assert t.tokens[i] == tokens[t.depth[i] - 1, t.rank[i]]
        assert t.score[i] == np.float32(t.score[p] + logp[t.depth[i] - 1, t.rank[i]])
    # visibility rows are exactly the ancestor sets (self included)
    for i in range(n):
        assert set(np.flatnonzero(t.visibility[i]).tolist()) == ancestors(t, i)
    # first_child / next_sibling list each node's children, in pop (= rank) order
    for p in range(n):
        kids = [c for c in range(n) if t.parent[c] == p]
        assert t.children(p) == kids
        assert [int(t.rank[c]) for c in kids] == list(range(len(kids)))
    # rank paths are distinct and the pop order never increases the score
    assert len({rank_path(t, i) for i in range(1, n)}) == n - 1
    assert np.all(np.diff(t.score[1:]) <= 0)


@settings(max_examples=300, deadline=None)
@given(drafts())
def test_tree_is_top_budget_paths(d):
    """With per-depth sorted log-probs <= 0 the top-`budget` set of rank paths is prefix-closed, so the
    best-first tree is exactly that set: every tree path scores >= every path left out, and when the
    boundary is not tied the set equals the brute-force top `budget`."""
    root, tokens, logp, budget = d
    D, K = tokens.shape
    t = build_tree(root, tokens, logp, budget)
    paths = [p for d_ in range(1, D + 1) for p in itertools.product(range(K), repeat=d_)]
    scores = {p: path_score(logp, p) for p in paths}
    in_tree = {rank_path(t, i) for i in range(1, t.n)}
    for i in range(1, t.n):
        assert t.score[i] == scores[rank_path(t, i)]
    left_out = [scores[p] for p in paths if p not in in_tree]
    if in_tree and left_out:
        assert min(scores[p] for p in in_tree) >= max(left_out)
    ranked = sorted(paths, key=lambda p: -scores[p])
    b = min(budget, len(paths))
    if b == len(paths) or b == 0 or scores[ranked[b - 1]] > scores[ranked[b]]:
        assert in_tree == set(ranked[:b])


def test_tree_ties_hand_computed():
    """All log-probs equal: ties go to the earlier push (sibling pushed before child), which makes the
    depth-2 nodes come out rank-major: (p1,r0) (p2,r0) (p3,r0) (p1,r1) (p2,r1) (p3,r1)."""
    tokens = np.array([[10, 11, 12], [20, 21, 22]])
    logp = np.full((2, 3), -1.0, np.float32)
    t = build_tree(99, tokens, logp, budget=9)
    np.testing.assert_array_equal(t.parent, [-1, 0, 0, 0, 1, 2, 3, 1, 2, 3])
    np.testing.assert_array_equal(t.rank, [-1, 0, 1, 2, 0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(t.depth, [0, 1, 1, 1, 2, 2, 2, 2, 2, 2])
    np.testing.assert_array_equal(t.tokens, [99, 10, 11, 12, 20, 20, 20, 21, 21, 21])
    np.testing.assert_array_equal(t.first_child, [1, 4, 5, 6, -1, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(t.next_sibling, [-1, 2, 3, -1, 7, 8, 9, -1, -1, -1])
    np.testing.assert_array_equal(t.score, [0, -1, -1, -1, -2, -2, -2, -2, -2, -2])


def test_tree_budget_zero_and_chain():
    t = build_tree(5, [[1, 2]], [[-0.1, -0.2]], budget=0)
    assert t.n == 1 and t.tokens.tolist() == [5] and t.visibility.tolist() == [[True]]
    assert t.first_child.tolist() == [-1] and t.next_sibling.tolist() == [-1]
    # K = 1: a chain of min(budget, D) nodes
    t = build_tree(5, [[1], [2], [3]], [[-0.1], [-0.2], [-0.3]], budget=10)
    assert t.tokens.tolist() == [5, 1, 2, 3] and t.parent.tolist() == [-1, 0, 1, 2]
    assert np.array_equal(t.visibility, np.tril(np.ones((4, 4), bool)))


@pytest.mark.parametrize(
    "tokens, logp, budget, match",
    [
        ([[1, 2]], [[-1.0, -2.0]], -1, "budget"),
        ([[1, 2]], [[-1.0, -2.0]], 1.5, "budget"),
        ([1, 2], [-1.0, -2.0], 1, r"\[D, K\]"),
        ([[1, 2]], [[-1.0, -2.0, -3.0]], 1, "differ in shape"),
        (np.zeros((0, 2), int), np.zeros((0, 2)), 1, "D >= 1"),
        (np.zeros((2, 0), int), np.zeros((2, 0)), 1, "K >= 1"),
        ([[1.5, 2.0]], [[-1.0, -2.0]], 1, "integers"),
        ([[1, 2]], [[np.nan, -2.0]], 1, "NaN"),
    ],
)
def test_build_tree_validates(tokens, logp, budget, match):
    with pytest.raises(ValueError, match=match):
        build_tree(0, tokens, logp, budget)


# ------------------------------------------------------------------------------------------------ acceptance


def brute_force_accept(t: Tree, tc: np.ndarray) -> list[int]:
    """Longest root-to-node path whose every edge token is the target's choice at the edge's top."""
    best = [0]
    for v in range(t.n):
        path = sorted(ancestors(t, v))  # ancestors have smaller indices: this is the path
        if all(t.tokens[c] == tc[u] for u, c in zip(path[:-1], path[1:], strict=True)):
            if len(path) > len(best):
                best = path
    return best


def following_choices(t: Tree, rng: np.random.Generator, p_follow: float = 0.8) -> np.ndarray:
    """Target choices that pick a random child's token with probability p_follow, else a miss."""
    tc = rng.integers(100, 200, size=t.n).astype(np.int64)  # tokens >= 100 never appear in the tree
    for i in range(t.n):
        kids = t.children(i)
        if kids and rng.random() < p_follow:
            tc[i] = t.tokens[rng.choice(kids)]
    return tc


@settings(max_examples=200, deadline=None)
@given(drafts(max_d=4, max_k=3, distinct_tokens=True), st.integers(0, 2**32 - 1))
def test_accept_is_longest_matching_path(d, seed):
    root, tokens, logp, budget = d
    t = build_tree(root, tokens, logp, budget)
    tc = following_choices(t, np.random.default_rng(seed))
    accepted, bonus = follow_verified_tree(t, tc)
    assert accepted.dtype == np.int64 and accepted[0] == 0
    assert accepted.tolist() == brute_force_accept(t, tc)
    assert bonus == tc[accepted[-1]]


def test_accept_first_child_in_order_wins():
    """Two children of the root carry token 5: the first (rank 0) is taken even though the second
    would lead further."""
    t = build_tree(0, [[5, 5], [7, 8]], [[-1.0, -1.5], [-1.0, -3.0]], budget=6)
    kids = t.children(0)
    assert [int(t.tokens[c]) for c in kids] == [5, 5]
    tc = np.full(t.n, 123, np.int64)
    tc[0] = 5
    second = kids[1]
    tc[second] = t.tokens[t.children(second)[0]]  # only the second child's subtree continues
    accepted, bonus = follow_verified_tree(t, tc)
    assert accepted.tolist() == [0, kids[0]] and bonus == 123


def test_accept_root_only():
    t = build_tree(3, [[1, 2]], [[-1.0, -2.0]], budget=0)
    accepted, bonus = follow_verified_tree(t, np.array([42]))
    assert accepted.tolist() == [0] and bonus == 42
    with pytest.raises(ValueError, match="target_choice"):
        follow_verified_tree(t, np.array([1, 2]))


# ---------------------------------------------------------------------------------------------- target choice


def test_target_choice_greedy_and_sample(rng):
    logits = rng.standard_normal((6, 11)).astype(np.float32)
    g = target_choice_greedy(logits)
    assert g.dtype == np.int64 and g.tolist() == np.argmax(logits, axis=1).tolist()
    for temp in (0.0, -1.0):
        assert target_choice_sample(logits, temp, rng).tolist() == g.tolist()
    a = target_choice_sample(logits, 0.7, np.random.default_rng(5))
    b = target_choice_sample(logits, 0.7, np.random.default_rng(5))
    assert a.dtype == np.int64 and a.shape == (6,) and np.array_equal(a, b)


def test_target_choice_sample_distribution(rng):
    """One independent draw per node from softmax(logits / T): frequencies over many identical nodes."""
    row = np.array([2.0, 1.0, 0.0, -1.0])
    T = 1.5
    p = np.exp(row / T) / np.exp(row / T).sum()
    n = 40000
    draws = target_choice_sample(np.tile(row, (n, 1)), T, rng)
    freq = np.bincount(draws, minlength=4) / n
    assert np.all(np.abs(freq - p) < 5 * np.sqrt(p * (1 - p) / n) + 1e-3)


# ------------------------------------------------------------------------------------------------ compaction


def naive_sequential_move(arr: np.ndarray, L: int, accepted, order) -> None:
    for i in order:
        arr[L + i] = arr[L + accepted[i]]


def test_compact_spec_example():
    """SPEC section 2: accepted [0, 2, 5]; slot L+2 is read for i=1 and written for i=2."""
    L, acc = 3, [0, 2, 5]
    c_kv = np.arange(12 * 4, dtype=np.float32).reshape(12, 4)
    k_pe = -np.arange(12 * 2, dtype=np.float32).reshape(12, 2)
    before = [c_kv.copy(), k_pe.copy()]
    compact_cache([c_kv, k_pe], L, acc)
    for new, old in zip((c_kv, k_pe), before, strict=True):
        expect = old.copy()
        expect[L : L + 3] = old[[L + 0, L + 2, L + 5]]
        np.testing.assert_array_equal(new, expect)
        forward = old.copy()
        naive_sequential_move(forward, L, acc, order=range(3))
        np.testing.assert_array_equal(new, forward)
        # the race, made visible: moving in decreasing i reads slot L+2 after it was overwritten
        backward = old.copy()
        naive_sequential_move(backward, L, acc, order=reversed(range(3)))
        assert not np.array_equal(backward, expect)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_compact_matches_sequential_move(seed):
    r = np.random.default_rng(seed)
    n = int(r.integers(1, 12))
    a = int(r.integers(0, n))
    acc = np.concatenate([[0], np.sort(r.choice(np.arange(1, n), size=a, replace=False))]).astype(int)
    max_len = int(r.integers(n, 30))
    L = int(r.integers(0, max_len - n + 1))
    caches = [r.standard_normal((max_len, 3)), r.standard_normal((max_len, 2, 2)).astype(np.float32)]
    expect = [c.copy() for c in caches]
    for c in expect:
        naive_sequential_move(c, L, acc, order=range(len(acc)))
    compact_cache(caches, L, acc)
    for c, e in zip(caches, expect, strict=True):
        np.testing.assert_array_equal(c, e)


def test_compact_validates():
    c = np.zeros((8, 2))
    for bad in ([1, 2], [0, 2, 2], [0, 3, 1], []):
        with pytest.raises(ValueError, match="accepted"):
            compact_cache([c], 0, bad)
    with pytest.raises(ValueError, match="outside"):
        compact_cache([c], 5, [0, 3])
