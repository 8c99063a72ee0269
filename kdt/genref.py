"""Golden reference fixtures: seeded random weights plus greedy continuations of the float64 reference.

``generate_reference("tiny", seed=0)`` builds :func:`kdt.weights.random_weights` for the preset, draws
one random prompt per requested length and decodes it greedily with the float64
:class:`~kdt.reference.model.RefModel` (through :func:`kdt.reference.decode.ar_generate`). A prompt is
kept only when every generated step's top1 - top2 logit margin is at least ``min_margin``; otherwise
the next prompt of the seeded sequence is drawn. With margins of 0.05 on logits of O(5), the float32
and bf16-weight engines (relative accumulation noise around 1e-4, i.e. ~5e-4 absolute) cannot flip an
argmax, so every backend must reproduce the golden tokens exactly (SPEC section 3).

Prompt ``p{len}`` of attempt ``a`` is drawn from ``np.random.default_rng([seed, len, a])``: uniform
token ids in ``[0, vocab_size)``. Everything is a pure function of (preset, seed, lengths, n_new,
min_margin), so two runs give bit-identical fixtures' arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kdt.config import preset
from kdt.errors import KdtError
from kdt.fixture import Fixture, Golden
from kdt.reference.decode import ar_generate
from kdt.reference.model import RefModel
from kdt.weights import random_weights

DEFAULT_MIN_MARGIN = 0.05


def logit_margins(logits: np.ndarray) -> np.ndarray:
    """top1 - top2 of each row of ``logits[N, V]``, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    top2 = np.partition(x, -2, axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0]


def draw_prompt(seed: int, length: int, attempt: int, vocab_size: int) -> np.ndarray:
    """The deterministic random prompt of ``length`` tokens for (seed, attempt)."""
    rng = np.random.default_rng([int(seed), int(length), int(attempt)])
    return rng.integers(0, vocab_size, size=length, dtype=np.int64)


def greedy_reference(model: RefModel, prompt: np.ndarray, n_new: int) -> tuple[np.ndarray, np.ndarray]:
    """(output[n_new] int64, logits[n_new, V] float32) of greedy AR decoding with the reference."""
    res = ar_generate(model, prompt, n_new, keep_logits=True)
    out = np.asarray(res.tokens, dtype=np.int64)
    logits = np.stack([np.asarray(r, dtype=np.float32) for r in res.logits])
    if out.shape != (n_new,) or logits.shape != (n_new, model.cfg.vocab_size):
        raise RuntimeError(f"ar_generate returned {out.shape} tokens / {logits.shape} logits "
                           f"for n_new={n_new}")
    return out, logits


def generate_reference(
    preset_name: str = "tiny",
    seed: int = 0,
    prompt_lengths: Sequence[int] = (1, 5, 40),
    n_new: int = 24,
    min_margin: float = DEFAULT_MIN_MARGIN,
    max_redraws: int = 200,
    progress: Callable[[str], None] | None = None,
) -> Fixture:
    """A fixture of ``preset_name`` with random weights of ``seed`` and one golden continuation
    ``p{len}`` per prompt length, each with every margin >= ``min_margin``.

    Raises KdtError when a length finds no such prompt in ``max_redraws`` draws.
    ``progress(message)`` is called once per prompt attempt.
    """
    cfg = preset(preset_name)
    lengths = [int(n) for n in prompt_lengths]
    if not lengths or min(lengths) < 1:
        raise KdtError(f"prompt lengths must be positive (got {list(prompt_lengths)})")
    if len(set(lengths)) != len(lengths):
        raise KdtError(f"prompt lengths must be distinct (got {lengths})")
    if n_new < 1:
        raise KdtError(f"n_new must be positive (got {n_new})")
    max_len = max(lengths) + n_new
    if max_len > cfg.max_position_embeddings:
        raise KdtError(f"prompt {max(lengths)} + n_new {n_new} exceeds max_position_embeddings "
                       f"{cfg.max_position_embeddings} of preset {preset_name!r}")
    weights = random_weights(cfg, seed)
    golden: list[Golden] = []
    redraws: dict[str, int] = {}
    for plen in lengths:
        name = f"p{plen}"
        for attempt in range(max_redraws + 1):
            prompt = draw_prompt(seed, plen, attempt, cfg.vocab_size)
            model = RefModel(cfg, weights, dtype=np.float64, max_len=plen + n_new)
            output, logits = greedy_reference(model, prompt, n_new)
            margin = logit_margins(logits)
            ok = bool(margin.min() >= min_margin)
            if progress is not None:
                progress(f"{name} attempt {attempt}: min margin {margin.min():.4f} "
                         f"({'kept' if ok else 'redraw'})")
            if ok:
                break
        else:
            raise KdtError(f"preset {preset_name!r} seed {seed}: no prompt of length {plen} with every "
                           f"margin >= {min_margin} in {max_redraws + 1} draws; lower min_margin or n_new")
        redraws[name] = attempt
        golden.append(Golden(name, prompt, output, logits, margin,
                             attrs={"attempt": attempt, "seed": int(seed)}))
    meta: dict[str, Any] = {
        "generator": "kdt.genref.generate_reference",
        "reference": "float64 RefModel, greedy autoregressive",
        "preset": preset_name,
        "seed": int(seed),
        "prompt_lengths": lengths,
        "n_new": int(n_new),
        "min_margin": float(min_margin),
        "max_redraws": int(max_redraws),
        "redraws": redraws,
        "weights": "kdt.weights.random_weights (bf16-exact)",
    }
    tokenizer = {"kind": "byte"} if cfg.vocab_size >= 256 else None
    return Fixture(config=cfg, weights=weights, weight_dtype="bfloat16", tokenizer=tokenizer,
                   golden=golden, meta=meta)


def summary_rows(fixture: Fixture) -> list[dict[str, Any]]:
    """One row per golden continuation, for a table: name, prompt_len, n_new, min/median margin,
    redraws and the first output tokens."""
    rows = []
    redraws = fixture.meta.get("redraws", {}) if isinstance(fixture.meta, dict) else {}
    for g in fixture.golden:
        rows.append({
            "name": g.name,
            "prompt_len": int(g.prompt.shape[0]),
            "n_new": int(g.output.shape[0]),
            "min_margin": float(g.margin.min()),
            "median_margin": float(np.median(g.margin)),
            "redraws": int(redraws.get(g.name, g.attrs.get("attempt", 0))),
            "output_head": " ".join(str(int(t)) for t in g.output[:8])
            + (" ..." if g.output.shape[0] > 8 else ""),
        })
    return rows
