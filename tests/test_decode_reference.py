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
