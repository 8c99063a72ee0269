"""The invariant of SPEC section 3 on the reference: greedy DDTree output == greedy AR output for
oracle, noisy and useless drafters, over many random prompts; oracle acceptance == block size."""

import numpy as np
import pytest

from kdt.config import preset
from kdt.drafters import OracleDrafter, SuffixDrafter, UselessDrafter
from kdt.reference.decode import ar_generate, generate
from kdt.reference.model import RefModel
from kdt.weights import random_weights

CFG = preset("tiny", hidden_size=64, num_hidden_layers=2, intermediate_size=96, vocab_size=96)
W = random_weights(CFG, 11)


def model(max_len=160, dtype=np.float64):
    return RefModel(CFG, W, dtype=dtype, max_len=max_len)


@pytest.mark.parametrize("trial", range(12))
def test_ddtree_equals_ar_for_any_drafter(trial, rng):
    P = int(rng.integers(1, 30))
    prompt = rng.integers(0, CFG.vocab_size, P)
    n = int(rng.integers(5, 40))
    ar = ar_generate(model(), prompt, n)
    seq = np.concatenate([prompt, ar.tokens, rng.integers(0, CFG.vocab_size, 16)])
    budget = int(rng.choice([1, 3, 8, 24, 64]))
    block = int(rng.choice([2, 4, 8, 16]))
    drafters = [OracleDrafter(seq, CFG.vocab_size, seed=trial),
                OracleDrafter(seq, CFG.vocab_size, noise=float(rng.uniform(0.1, 0.7)), seed=trial),
                UselessDrafter(CFG.vocab_size, seed=trial), SuffixDrafter(CFG.vocab_size)]
    for d in drafters:
        res = generate(model(), prompt, n, drafter=d, budget=budget, block_size=block)
        assert res.tokens == ar.tokens, (d.name, budget, block)


def test_oracle_accepts_the_whole_block(rng):
    prompt = rng.integers(0, CFG.vocab_size, 7)
    block = 8
    n = 1 + 4 * block
    ar = ar_generate(model(), prompt, n)
    seq = np.concatenate([prompt, ar.tokens])
    res = generate(model(), prompt, n, drafter=OracleDrafter(seq, CFG.vocab_size), budget=16, block_size=block)
    assert res.tokens == ar.tokens
    assert res.accept_lengths == [block] * 4 and res.steps == 4


@pytest.mark.parametrize("noise", [0.0, 0.5])
@pytest.mark.parametrize("k", [1, 2, 7, 96])
def test_oracle_draft_rows(noise, k, rng):
    """Each row: k distinct tokens, log-probabilities descending, the true token (when not noised away) in
    the top column; a noiseless draft puts it there on every row, with any context length (past the known
    sequence too) and call after call (its cached block is never handed out writable)."""
    seq = rng.integers(0, CFG.vocab_size, 40)
    d = OracleDrafter(seq, CFG.vocab_size, noise=noise, seed=3)
    hits = []
    for n in (1, 9, 17, 25, 33, 40, 45):
        toks, logp = d.draft(seq[:n], 7, k)
        assert toks.shape == logp.shape == (7, k) and toks.dtype == np.int64 and logp.dtype == np.float32
        assert ((0 <= toks) & (toks < CFG.vocab_size)).all()
        assert all(len(set(r.tolist())) == k for r in toks)
        assert (np.diff(logp, axis=1) <= 0).all()
        true = seq[n: n + 7]
        hits += (toks[: true.shape[0], 0] == true).tolist()
        toks[:] = -1  # the caller may write the tokens it got; the next draft is unaffected
        if noise == 0:
            with pytest.raises(ValueError):
                logp[0, 0] = 0.0
    assert all(hits) if noise == 0 else 0.2 < np.mean(hits) < 0.95


def _suffix_reference(ctx, depth, k, max_ngram=8):
    """The suffix drafter's candidates by its definition (the implementation before session 19, O(n * m) a
    length): per depth, the first k of [most recent, then by frequency] as [(token, log-probability)] in
    the drafter's order (by log-probability)."""
    from collections import Counter

    n, ends = len(ctx), []
    for m in range(min(max_ngram, n - 1), 0, -1):
        win = np.lib.stride_tricks.sliding_window_view(ctx[: n - 1], m)
        hits = np.nonzero((win == ctx[n - m:]).all(axis=1))[0]
        if hits.size:
            ends = [int(h) + m for h in hits[::-1]]
            break
    rows = []
    for d in range(depth):
        follow = [int(ctx[e + d]) for e in ends if e + d < n]
        counts = Counter(follow)
        cands = ([follow[0]] + [t for t, _ in counts.most_common() if t != follow[0]])[:k] if follow else []
        lp = [np.log(0.8 * (counts[t] + (t == follow[0])) / (len(follow) + 1.0)) for t in cands]
        order = np.argsort(-np.asarray(lp), kind="stable")
        rows.append([(cands[i], lp[i]) for i in order])
    return rows


@pytest.mark.parametrize("V", [7, 96, 5000, 163840])
def test_suffix_drafter_rows(V, rng):
    """Candidates equal the definition's (what followed the longest earlier suffix match, most recent
    first, then by frequency), in the definition's order; the rest of each row distinct random
    distractors below them; for every vocabulary path (permuted rows; sampled rows with a redraw)."""
    d = SuffixDrafter(V, seed=1)
    for _ in range(6):
        ctx = rng.integers(0, min(V, int(rng.choice([3, 6, 40]))), int(rng.integers(1, 120)))
        depth, k = int(rng.integers(1, 9)), min(V, int(rng.choice([1, 4, 31])))
        toks, logp = d.draft(ctx, depth, k)
        assert toks.shape == logp.shape == (depth, k) and logp.dtype == np.float32
        for row_t, row_lp, ref in zip(toks, logp, _suffix_reference(ctx, depth, k), strict=True):
            assert len(set(row_t.tolist())) == k and ((0 <= row_t) & (row_t < V)).all()
            assert (np.diff(row_lp) <= 0).all() and np.exp(row_lp.astype(np.float64)).sum() <= 1.0 + 1e-5
            c = min(len(ref), k)
            assert row_t[:c].tolist() == [t for t, _ in ref[:c]]
            assert row_lp[:c] == pytest.approx([x for _, x in ref[:c]], rel=1e-6)
            assert (row_lp[c:] < np.log(1e-6) + 1e-3).all()


@pytest.mark.parametrize("V", [96, 163840])
def test_useless_drafter_rows(V):
    """k distinct random tokens a row (a permutation per row; sampled rows), probabilities halving down the
    row and summing to 1."""
    toks, logp = UselessDrafter(V, seed=2).draft(np.arange(5), 6, 31)
    assert toks.shape == logp.shape == (6, 31) and logp.dtype == np.float32
    assert all(len(set(r.tolist())) == 31 for r in toks) and ((0 <= toks) & (toks < V)).all()
    assert np.allclose(np.diff(logp, axis=1), -np.log(2.0), atol=1e-4)
    assert np.allclose(np.exp(logp.astype(np.float64)).sum(axis=1), 1.0, atol=1e-5)
    assert len({tuple(r) for r in toks.tolist()}) == 6  # rows drawn independently


def test_suffix_drafter_redraws_colliding_rows():
    """A large vocabulary's distractors are sampled with replacement; a row that drew a collision (here:
    every first draw is token 0, a candidate) is drawn again without one."""

    class ZerosFirst:
        def __init__(self):
            self.rng, self.first = np.random.default_rng(0), True

        def integers(self, lo, hi, size):
            if self.first:
                self.first = False
                return np.zeros(size, np.int64)
            return self.rng.integers(lo, hi, size)

    d = SuffixDrafter(163840)
    d.rng = ZerosFirst()
    ctx = np.array([0, 5, 0, 5, 0])
    toks, logp = d.draft(ctx, 3, 31)
    assert toks[0, 0] == 5 and toks[1, 0] == 0  # 0 5 | 0 5 0 -> then 5, then 0
    assert all(len(set(r.tolist())) == 31 for r in toks)


def test_noisy_oracle_accepts_partially(rng):
    prompt = rng.integers(0, CFG.vocab_size, 5)
    ar = ar_generate(model(), prompt, 40)
    seq = np.concatenate([prompt, ar.tokens, np.zeros(16, np.int64)])
    res = generate(model(), prompt, 40, drafter=OracleDrafter(seq, CFG.vocab_size, noise=0.4, seed=1),
                   budget=32, block_size=8)
    assert res.tokens == ar.tokens
    assert 1 < res.avg_accept < 8  # partial acceptance, branch following and compaction exercised


def test_float32_cpu_backend_matches_float64_tokens(rng):
    prompt = rng.integers(0, CFG.vocab_size, 9)
    a = ar_generate(model(), prompt, 20, keep_logits=True)
    b = ar_generate(model(dtype=np.float32), prompt, 20, keep_logits=True)
    assert a.tokens == b.tokens or np.min(np.abs(np.diff(np.sort(np.asarray(a.logits), -1)[:, -2:]))) < 1e-4
    assert np.max(np.abs(np.asarray(a.logits) - np.asarray(b.logits))) < 1e-3


def test_stop_token_and_context_limit(rng):
    prompt = rng.integers(0, CFG.vocab_size, 4)
    ar = ar_generate(model(), prompt, 12)
    stop = ar.tokens[5]
    res = ar_generate(model(), prompt, 12, stop_tokens=[stop])
    assert res.tokens == ar.tokens[: ar.tokens.index(stop) + 1] and res.finish_reason == "stop"
    res = generate(model(max_len=10), prompt, 50, drafter=UselessDrafter(CFG.vocab_size), budget=4)
    assert res.finish_reason == "context" and res.tokens == ar_generate(model(), prompt, len(res.tokens)).tokens


def test_sampling_is_seeded_and_lossless_structure(rng):
    prompt = rng.integers(0, CFG.vocab_size, 4)
    a = ar_generate(model(), prompt, 10, temperature=1.0, seed=3)
    b = ar_generate(model(), prompt, 10, temperature=1.0, seed=3)
    assert a.tokens == b.tokens
    seq = np.concatenate([prompt, a.tokens])
    c = generate(model(), prompt, 10, drafter=OracleDrafter(seq, CFG.vocab_size), budget=8, temperature=1.0, seed=3)
    assert len(c.tokens) == 10
