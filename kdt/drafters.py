"""Drafters: per-depth top-K tokens and log-probabilities for the next block (SPEC section 4).

All follow :class:`kdt.reference.decode.Drafter`: ``draft(context, depth, k) -> (tokens[depth, k],
logp[depth, k])`` with distinct tokens per row, sorted by descending log-probability, normalised over
the full vocabulary (each row's probabilities sum to at most 1).

- :class:`OracleDrafter` knows the true continuation (verification only); with ``noise > 0`` it
  demotes or drops the true token at random depths (partial acceptance, branch following, compaction).
- :class:`UselessDrafter` proposes random tokens: nothing is accepted, the output must still be exact.
- :class:`SuffixDrafter` is model-free: it matches the longest suffix of the context against the
  prompt and the output so far and proposes what followed (n-gram / suffix matching).
- :class:`LearnedDrafter` runs the trained block drafter (:mod:`kdt.reference.drafter`). It reads
  target features: it names the target layers it needs (``feature_layers``) and the decode loop hands
  over their hidden states at every committed position (``observe``), gathered during the verify.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

_PERMUTE_MAX_V = 4096  # distractors of a vocabulary up to this (or up to 4x the tokens needed): a permutation


def _distractors(taken: np.ndarray, n: int, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """n distinct random tokens of [0, vocab), none in ``taken`` (n + len(taken) <= vocab). A small vocabulary
    is permuted; a large one sampled with replacement and deduplicated (microseconds for a 160k vocabulary,
    where a permutation costs ~1 ms)."""
    need = n + len(taken)
    if vocab <= max(_PERMUTE_MAX_V, 4 * need):
        pool = rng.permutation(vocab)
        return pool[~np.isin(pool, taken)][:n]
    while True:  # a collision-free draw of 2 * need is all but certain when vocab > 4 * need
        draw = rng.integers(0, vocab, 2 * need)
        _, first = np.unique(draw, return_index=True)
        pool = draw[np.sort(first)]
        pool = pool[~np.isin(pool, taken)]
        if pool.shape[0] >= n:
            return pool[:n]


def _distractor_rows(toks: np.ndarray, ncand: np.ndarray, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """[depth, k]: row d's columns ncand[d].. hold distinct random tokens that are not among its candidates
    toks[d, :ncand[d]] (the other columns are don't-care). All rows at once: a permutation per row for a small
    vocabulary; for a large one sampled rows, a row that drew a collision drawn again (:func:`_distractors`)."""
    (D, k), V = toks.shape, vocab
    col, rows = np.arange(k), np.arange(D)[:, None]
    cand = col[None, :] < ncand[:, None]
    if V <= max(_PERMUTE_MAX_V, 4 * k):  # a permutation per row, the row's candidates moved out of the way
        perm = rng.permuted(np.broadcast_to(np.arange(V), (D, V)), axis=1)
        taken = np.zeros((D, V), bool)
        taken[np.nonzero(cand)[0], toks[cand]] = True
        pool = perm[rows, np.argsort(taken[rows, perm], axis=1, kind="stable")[:, :k]]  # free tokens first
        return pool[rows, np.maximum(col[None, :] - ncand[:, None], 0)]
    out = rng.integers(0, V, (D, k))  # collisions are rare
    srt = np.sort(np.where(cand, toks, out), axis=1)
    for d in np.nonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))[0]:
        c = int(ncand[d])
        out[d, c:] = _distractors(toks[d, :c], k - c, V, rng)
    return out


def _pad_rows(toks: np.ndarray, lp: np.ndarray, ncand: np.ndarray, vocab: int, rng: np.random.Generator,
              rest_mass: float) -> tuple[np.ndarray, np.ndarray]:
    """Rows [depth, k] of k distinct tokens: row d's ncand[d] candidates toks[d, :ncand[d]] with log-probabilities
    lp[d, :ncand[d]], then random distractors sharing ``rest_mass`` with geometrically decreasing probability
    (the i-th of e: rest_mass * 2^-(i+1) / (1 - 2^-e)); each row sorted by descending log-probability (stable).
    Returns (tokens int64, log-probabilities float32)."""
    depth, k = toks.shape
    extra = np.arange(k)[None, :] - ncand[:, None]  # index among the row's distractors (< 0: a candidate)
    fill = extra >= 0
    n_extra = np.maximum(k - ncand, 1)[:, None]
    rest = math.log(rest_mass) - (extra + 1) * math.log(2.0) - np.log1p(-(0.5 ** n_extra))
    lp = np.where(fill, rest, lp)
    toks = np.where(fill, _distractor_rows(toks, ncand, vocab, rng), toks)
    rows = np.arange(depth)[:, None]
    order = np.argsort(-lp, axis=1, kind="stable")
    return toks[rows, order], lp[rows, order].astype(np.float32)


class OracleDrafter:
    """Knows ``sequence`` (prompt + true continuation). Puts the true next token at rank 0 with
    probability ``p_true``; with probability ``noise`` per depth the true token is demoted to a random
    lower rank (half the time) or dropped.

    ``on_device`` (noiseless only): the CUDA engine drafts it inside its one-program step
    (:func:`kdt.kernels.ddtree.oracle_draft` on :meth:`padded` and :meth:`tables`), so the step needs nothing
    from the host and goes in before its predecessor's tokens are read, as a learned drafter's does; the same
    draft as :meth:`draft` within the known sequence. Elsewhere it drafts on the host."""

    def __init__(self, sequence: Sequence[int], vocab_size: int, noise: float = 0.0, p_true: float = 0.9,
                 seed: int = 0, on_device: bool = False):
        if on_device and noise > 0:
            raise ValueError("the oracle drafts on the device only without noise")
        self.sequence = np.asarray(sequence, dtype=np.int64)
        self.vocab, self.noise, self.p_true, self.on_device = vocab_size, noise, p_true, on_device
        self.rng = np.random.default_rng(seed)
        self._pad_rng = np.random.default_rng((seed, 1))  # padded()'s own: drafts stay those of a host oracle
        self.name = "oracle" if noise == 0 else f"noisy-oracle({noise:g})"
        self._rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._blocks: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def _row_logp(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(column order, sorted log-probabilities [k]) of a row: ``p_true`` for the true token, then
        geometrically decreasing shares of the rest (cached per k)."""
        row = self._rows.get(k)
        if row is None:
            w = 0.5 ** np.arange(1, k)
            lp = np.log(np.concatenate([[max(self.p_true, 1e-300)], (1.0 - self.p_true) * w / max(w.sum(), 1e-300)]))
            order = np.argsort(-lp, kind="stable")
            row = self._rows[k] = (order, lp[order].astype(np.float32))
        return row

    def _block(self, depth: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(column offsets [depth, k], log-probabilities [depth, k]) of a noiseless draft (cached; read-only):
        the true token's column offset 0, its distractors 1 + off_d + j for an offset off_d drawn once per
        depth, columns ordered by :meth:`_row_logp`."""
        blk = self._blocks.get((depth, k))
        if blk is None:
            order, lp = self._row_logp(k)
            off = self.rng.integers(0, max(self.vocab - k, 1), depth)
            cols = np.concatenate([np.zeros((depth, 1), np.int64), 1 + off[:, None] + np.arange(k - 1)], axis=1)
            blk = self._blocks[depth, k] = (cols[:, order], np.broadcast_to(lp, (depth, k)).copy())
            for a in blk:
                a.flags.writeable = False
        return blk

    def tables(self, depth: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(column offsets int64, log-probabilities float32), both [depth, min(k, V)]: a noiseless draft is
        ``((sequence[n + d] + cols[d]) % V, logp)`` at context length n."""
        return self._block(depth, min(k, self.vocab))

    def padded(self, length: int) -> np.ndarray:
        """The sequence cut or padded to ``length`` with random tokens (the device oracle's true tokens: past the
        known sequence :meth:`draft` draws random ones too)."""
        s = self.sequence[:length]
        return np.concatenate([s, self._pad_rng.integers(0, self.vocab, length - s.shape[0])])

    def draft(self, context, depth: int, k: int):
        """Vectorised over depths (a step's drafting costs microseconds of host time, so the bench
        measures the engine, not the oracle): row d holds the true token (a random one past the known
        sequence) and k-1 distractors, consecutive token ids after an offset (distinct, never the true
        token; noiseless: an offset per depth drawn once, :meth:`_block`; noisy: drawn per draft),
        ordered by :meth:`_row_logp`."""
        n, V = len(context), self.vocab
        k = min(k, V)
        true = self.sequence[n: n + depth]
        if true.shape[0] < depth:
            true = np.concatenate([true, self.rng.integers(0, V, depth - true.shape[0])])
        if self.noise == 0:  # a few microseconds: one add and one modulo over the cached block
            cols, logp = self._block(depth, k)
            return (true[:, None] + cols) % V, logp
        order, lp = self._row_logp(k)
        logp = np.broadcast_to(lp, (depth, k)).copy()
        # distractors: true + 1 + off + j (mod V), j < k; column k-1 is the spare that "drop" uses
        off = self.rng.integers(0, max(V - k, 1), depth)
        cand = (true[:, None] + 1 + off[:, None] + np.arange(k)) % V
        toks = np.concatenate([true[:, None], cand[:, : k - 1]], axis=1)[:, order]
        if self.noise > 0:
            hit = self.rng.random(depth) < self.noise
            demote = hit & (self.rng.random(depth) < 0.5) & (k > 1)
            drop = hit & ~demote
            rows = np.nonzero(demote)[0]
            r = self.rng.integers(1, max(k, 2), rows.shape[0])
            toks[rows, 0], toks[rows, r] = toks[rows, r], toks[rows, 0]
            toks[drop, 0] = cand[drop, k - 1]  # a token no column holds
        return toks, logp


class UselessDrafter:
    """Random distinct tokens with a flat-ish distribution: the target rejects nearly everything."""

    name = "useless"

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab = vocab_size
        self.rng = np.random.default_rng(seed)

    def draft(self, context, depth: int, k: int):
        k = min(k, self.vocab)
        none = np.zeros(depth, np.int64)
        return _pad_rows(np.zeros((depth, k), np.int64), np.zeros((depth, k)), none, self.vocab, self.rng, 1.0)


class SuffixDrafter:
    """Model-free n-gram drafter: finds the longest suffix (up to ``max_ngram`` tokens) of the context
    that occurred before, and proposes, per depth, the tokens that followed its occurrences (most
    frequent first; the most recent occurrence's chain at rank 0). Unknown depths get padding."""

    name = "suffix"

    def __init__(self, vocab_size: int, max_ngram: int = 8, min_ngram: int = 1, seed: int = 0):
        self.vocab, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram
        self.rng = np.random.default_rng(seed)

    def _occurrences(self, ctx: np.ndarray) -> np.ndarray:
        """End indices (exclusive) of the earlier occurrences of the longest suffix of ``ctx`` (min_ngram to
        max_ngram tokens) that occurred before, most recent first (empty: none). The ends of a one-token
        match, narrowed one token back at a time: O(len(ctx)) once, then O(matches) per length."""
        n = ctx.shape[0]
        best = np.empty(0, np.int64)
        if n < 2:
            return best
        ends = np.flatnonzero(ctx[: n - 1] == ctx[n - 1]) + 1  # ctx[e - 1] == ctx[n - 1], e <= n - 1
        for m in range(1, min(self.max_ngram, n - 1) + 1):
            if m > 1:
                ends = ends[ends >= m]
                ends = ends[ctx[ends - m] == ctx[n - m]]
            if ends.shape[0] == 0:
                break
            if m >= self.min_ngram:
                best = ends
        return best[::-1]

    def draft(self, context, depth: int, k: int):
        """Vectorised over depths (tens of microseconds a draft: it is host work of every DDTree step)."""
        ctx = np.asarray(context, dtype=np.int64)
        n, V = ctx.shape[0], self.vocab
        k = min(k, V)
        ends = self._occurrences(ctx)
        toks = np.zeros((depth, k), np.int64)
        lp = np.zeros((depth, k), np.float64)
        ncand = np.zeros(depth, np.int64)
        if ends.shape[0]:
            idx = ends[:, None] + np.arange(depth)  # [occurrences, depth]: what followed each, d tokens on
            follow_all = ctx[np.minimum(idx, n - 1)].T.tolist()
            past = (idx >= n).sum(axis=0).tolist()  # ends run down: the first past[d] run past the context
            for d in range(depth):
                follow = follow_all[d][past[d]:]  # most recent occurrence first
                if not follow:
                    break  # fewer ends reach d tokens on as d grows: every later depth is empty too
                counts = Counter(follow)  # ties of most_common: in order of first appearance
                cands = ([follow[0]] + [t for t, _ in counts.most_common() if t != follow[0]])[:k]
                total = len(follow) + 1.0
                c = ncand[d] = len(cands)
                toks[d, :c] = cands
                lp[d, :c] = [math.log(0.8 * (counts[t] + (t == follow[0])) / total) for t in cands]
        return _pad_rows(toks, lp, ncand, V, self.rng, 1e-6)  # the rest: distractors sharing 1e-6


class LearnedDrafter:
    """The trained block drafter: every depth's distribution from one drafter forward (SPEC section 4).

    ``model``: a :class:`kdt.reference.drafter.DraftModel` (NumPy) or a
    :class:`kdt.engine.cuda_model.CudaDraftModel` (the same equations on the target's kernels).
    ``observe(hidden, start)`` adds context rows for positions [start, start + T) from the target's
    hidden states ``hidden[layer] [T, D]``; ``draft`` then drafts the block of the root (the last
    context token) at position ``len(context) - 1``.
    """

    name = "learned"

    def __init__(self, model):
        self.model = model
        self.feature_layers = tuple(model.dcfg.target_layers)
        self.block_size = model.dcfg.block_size
        self.committed = 0  # context rows added so far: positions [0, committed)

    def observe(self, hidden: dict[int, np.ndarray], start: int) -> None:
        feats = np.concatenate([np.asarray(hidden[i]) for i in self.feature_layers], axis=1)
        self.model.add_context(feats, start)
        self.committed = start + feats.shape[0]

    def draft(self, context, depth: int, k: int):
        L = len(context) - 1  # the root sits at position L; the target has committed [0, L)
        if depth > self.block_size - 1:
            raise ValueError(f"the learned drafter drafts {self.block_size - 1} depths (block size "
                             f"{self.block_size}), {depth} asked")
        if self.committed != L:
            raise ValueError(f"the learned drafter has context rows for [0, {self.committed}), the root is at {L}")
        logits = np.asarray(self.model.block_logits(int(context[-1]), L)[:depth], dtype=np.float64)
        logp = logits - logits.max(axis=1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
        k = min(k, logp.shape[1])
        top = np.argsort(-logp, axis=1, kind="stable")[:, :k]
        return top.astype(np.int64), np.take_along_axis(logp, top, axis=1).astype(np.float32)


def learned_drafter(fixture, max_len: int, target=None, dtype=np.float32) -> LearnedDrafter:
    """The learned drafter a fixture carries (``fixture.drafter``), for a context of ``max_len``: on
    the GPU beside a CUDA ``target`` (sharing its embedding and lm_head), else the NumPy reference."""
    if getattr(target, "backend", None) == "cuda":
        from kdt.engine.cuda_model import CudaDraftModel

        return LearnedDrafter(CudaDraftModel(fixture.drafter.config, target, fixture.drafter.weights, max_len))
    from kdt.reference.drafter import DraftModel
    from kdt.reference.model import lm_head_weight

    cfg, w = fixture.config, fixture.weights
    return LearnedDrafter(DraftModel(fixture.drafter.config, cfg, fixture.drafter.weights,
                                     w["model.embed_tokens.weight"], lm_head_weight(cfg, w), dtype, max_len=max_len))


def make_drafter(name: str, vocab_size: int, sequence: Sequence[int] | None = None, seed: int = 0):
    """By name: ``oracle``, ``noisy`` (noise 0.3), ``useless``, ``suffix``."""
    if name in ("oracle", "noisy"):
        if sequence is None:
            raise ValueError(f"the {name} drafter needs the true continuation")
        return OracleDrafter(sequence, vocab_size, noise=0.3 if name == "noisy" else 0.0, seed=seed)
    if name == "useless":
        return UselessDrafter(vocab_size, seed)
    if name == "suffix":
        return SuffixDrafter(vocab_size, seed=seed)
    raise ValueError(f"unknown drafter {name!r} (oracle, noisy, useless, suffix)")
