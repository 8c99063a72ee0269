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

from collections import Counter
from collections.abc import Sequence

import numpy as np

FLOOR_LOGP = -30.0  # log-probability of padding candidates (effectively never chosen first)


def _fill_row(first: Sequence[int], probs: Sequence[float], k: int, vocab: int, rng: np.random.Generator,
              rest_mass: float) -> tuple[np.ndarray, np.ndarray]:
    """A row of k distinct tokens: ``first`` with ``probs``, then random distractors sharing
    ``rest_mass`` with geometrically decreasing probability."""
    toks = [int(t) for t in first][:k]
    lp = [float(np.log(max(p, 1e-300))) for p in probs][: len(toks)]
    taken = set(toks)
    n_extra = k - len(toks)
    if n_extra > 0:
        pool = rng.choice(vocab, size=min(vocab, n_extra + len(taken)), replace=False)
        extra = [int(t) for t in pool if int(t) not in taken][:n_extra]
        w = 0.5 ** np.arange(1, n_extra + 1)
        lp += list(np.log(rest_mass * w / w.sum()))
        toks += extra
    order = np.argsort(-np.asarray(lp), kind="stable")
    return np.asarray(toks, dtype=np.int64)[order], np.asarray(lp, dtype=np.float32)[order]


class OracleDrafter:
    """Knows ``sequence`` (prompt + true continuation). Puts the true next token at rank 0 with
    probability ``p_true``; with probability ``noise`` per depth the true token is demoted to a random
    lower rank (half the time) or dropped."""

    def __init__(self, sequence: Sequence[int], vocab_size: int, noise: float = 0.0, p_true: float = 0.9,
                 seed: int = 0):
        self.sequence = np.asarray(sequence, dtype=np.int64)
        self.vocab, self.noise, self.p_true = vocab_size, noise, p_true
        self.rng = np.random.default_rng(seed)
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
        rows = [_fill_row([], [], k, self.vocab, self.rng, 1.0) for _ in range(depth)]
        return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


class SuffixDrafter:
    """Model-free n-gram drafter: finds the longest suffix (up to ``max_ngram`` tokens) of the context
    that occurred before, and proposes, per depth, the tokens that followed its occurrences (most
    frequent first; the most recent occurrence's chain at rank 0). Unknown depths get padding."""

    name = "suffix"

    def __init__(self, vocab_size: int, max_ngram: int = 8, min_ngram: int = 1, seed: int = 0):
        self.vocab, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram
        self.rng = np.random.default_rng(seed)

    def _occurrences(self, ctx: np.ndarray) -> list[int]:
        """End indices (exclusive) of earlier occurrences of the longest matching suffix."""
        n = len(ctx)
        for m in range(min(self.max_ngram, n - 1), self.min_ngram - 1, -1):
            suffix = ctx[n - m:]
            windows = np.lib.stride_tricks.sliding_window_view(ctx[: n - 1], m)
            hits = np.nonzero((windows == suffix).all(axis=1))[0]
            if hits.size:
                return [int(h) + m for h in hits[::-1]]  # most recent first
        return []

    def draft(self, context, depth: int, k: int):
        ctx = np.asarray(context, dtype=np.int64)
        ends = self._occurrences(ctx)
        toks = np.empty((depth, k), np.int64)
        logp = np.empty((depth, k), np.float32)
        for d in range(depth):
            follow = [int(ctx[e + d]) for e in ends if e + d < len(ctx)]
            counts = Counter(follow)
            if follow:  # most recent occurrence first, then by frequency
                cands = [follow[0]] + [t for t, _ in counts.most_common() if t != follow[0]]
                total = len(follow) + 1.0
                probs = [0.8 * (counts[t] + (1 if t == follow[0] else 0)) / total for t in cands]
                row = _fill_row(cands, probs, k, self.vocab, self.rng, 1e-6)
            else:
                row = _fill_row([], [], k, self.vocab, self.rng, 1e-6)
            toks[d], logp[d] = row
        return toks, logp


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
