"""`kdt verify`: the golden checks of a fixture on a backend.

For every golden prompt: autoregressive decoding must reproduce the golden tokens exactly with logits
within tolerance, and DDTree with the oracle, noisy-oracle and useless drafters must reproduce them
too (the invariant of SPEC section 3); the oracle's acceptance per step must equal the block size.
A fixture that carries a learned drafter is also checked with it (mode ``learned``, its own block
size); both backends hand it the target's hidden states.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kdt.drafters import OracleDrafter, UselessDrafter, learned_drafter
from kdt.fixture import Fixture
from kdt.reference.decode import GenResult, generate

MODES = ("ar", "oracle", "noisy", "useless")


@dataclass
class Check:
    prompt: str
    mode: str
    ok: bool
    tokens_ok: bool
    n_match: int  # leading tokens equal to the golden ones
    n_golden: int
    max_logit_diff: float  # AR only (nan otherwise)
    steps: int
    committed: int
    avg_accept: float
    block: int
    tokens_per_s: float
    note: str = ""

    def stats(self) -> str:
        return (f"steps={self.steps} committed={self.committed} avg_accept={self.avg_accept:.2f} "
                f"(block {self.block})")


def _leading_match(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if int(x) != int(y):
            break
        n += 1
    return n


def _drafter(mode: str, fx: Fixture, sequence, seed: int, target):
    V = fx.config.vocab_size
    if mode == "ar":
        return None
    if mode in ("oracle", "noisy"):
        return OracleDrafter(sequence, V, noise=0.3 if mode == "noisy" else 0.0, seed=seed)
    if mode == "useless":
        return UselessDrafter(V, seed=seed)
    return learned_drafter(fx, target.max_len, target)


def run_verify(fx: Fixture, make_target: Callable[[], object], budget: int = 16, block_size: int = 8,
               atol: float = 1e-3, seed: int = 0, modes=None, on_check: Callable[[Check], None] | None = None
               ) -> list[Check]:
    """``make_target()`` gives a fresh target (empty cache) for each run. ``modes`` default: MODES, and
    ``learned`` when the fixture carries a drafter."""
    checks = []
    if modes is None:
        modes = MODES + (("learned",) if fx.drafter is not None else ())
    for g in fx.golden:
        golden = [int(t) for t in g.output]
        sequence = np.concatenate([g.prompt, g.output])
        for mode in modes:
            target = make_target()
            block = fx.drafter.config.block_size if mode == "learned" else block_size
            drafter = _drafter(mode, fx, sequence, seed, target)
            res: GenResult = generate(target, g.prompt, len(golden), drafter=drafter,
                                      budget=0 if drafter is None else budget, block_size=block,
                                      keep_logits=(mode == "ar"))
            n_match = _leading_match(res.tokens, golden)
            tokens_ok = n_match == len(golden) == len(res.tokens)
            diff, note = float("nan"), ""
            ok = tokens_ok
            if mode == "ar":
                diff = float(np.max(np.abs(np.asarray(res.logits) - g.logits))) if tokens_ok else float("inf")
                ok = ok and diff <= atol
                if tokens_ok and not ok:
                    note = f"logits differ by {diff:.2e} > {atol:.0e}"
            if mode == "oracle" and tokens_ok:
                # Every step but a truncated last one must accept the whole block.
                full = res.accept_lengths[:-1] if len(res.accept_lengths) > 1 else res.accept_lengths
                if budget >= block_size - 1 and any(a != block_size for a in full):
                    ok, note = False, f"oracle acceptance {res.accept_lengths} below the block {block_size}"
            if not tokens_ok:
                note = f"token {n_match} differs from golden"
            c = Check(g.name, mode, ok, tokens_ok, n_match, len(golden), diff, res.steps, len(res.tokens),
                      res.avg_accept, block, res.tokens_per_s, note)
            checks.append(c)
            if on_check:
                on_check(c)
    return checks
