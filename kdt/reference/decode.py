"""The decode loops of SPEC sections 2-3: prefill, autoregressive and DDTree, over any target.

One loop serves every backend. A *target* supplies the model forward and cache compaction
(:class:`Target`); the tree steps (build, target choice, accept) default to the NumPy reference and a
backend may override them with kernels (the CUDA engine does). Autoregressive decoding is the DDTree
step with budget 0: verify ``[root]``, accept it, the bonus is the next token.

Cache semantics (SPEC section 2): after prefill of P tokens ``L = P`` and the root (argmax of the last
prompt logits) is committed but not cached. A step verifies ``[root, node_1..node_B]`` at positions
``L + depth``, moves the accepted latents to slots ``[L, L + 1 + a)``, sets ``L += 1 + a``, and the
bonus becomes the next root. Every emitted token is the target's own choice, so greedy DDTree output
equals greedy AR output for any drafter (the invariant).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kdt.config import ModelConfig
from kdt.reference.ddtree import (
    Tree,
    build_tree,
    follow_verified_tree,
    target_choice_greedy,
    target_choice_sample,
)
from kdt.reference.model import causal_block


class Target(Protocol):
    """What the decode loop needs of a model: the single forward and cache compaction."""

    cfg: ModelConfig
    max_len: int

    def forward(self, tokens, positions, L: int, mask, last_only: bool = False) -> np.ndarray:
        """tokens[M], positions[M], block mask [M, M] (prefix [0, L) visible) -> logits [M, V] (``last_only``: the
        last row's alone, [1, V])."""

    def compact(self, L: int, accepted) -> None:
        """Move cache slots L+accepted[i] -> L+i in every layer."""


class Drafter(Protocol):
    """Proposes, for depths 1..depth after the root, the top-k tokens and their log-probabilities
    (normalised over the full vocabulary; rows sorted by descending log-probability, distinct tokens).

    A drafter that reads target features (the learned block drafter) also has ``feature_layers`` (the
    target layers it reads) and ``observe(hidden, start)``: the loop hands it those layers' hidden
    states ``{layer: [T, D]}`` for positions [start, start + T) as they are committed (prefill, then
    the accepted nodes of every verify)."""

    name: str

    def draft(self, context: np.ndarray, depth: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """context: all committed tokens, prompt first, the root last -> (tokens[depth, k], logp[depth, k])."""


class TreeOps:
    """The tree steps of a DDTree iteration; the NumPy reference by default, kernels in the engine."""

    def build(self, root: int, draft_tokens, draft_logp, budget: int, L: int) -> Tree:
        return build_tree(root, draft_tokens, draft_logp, budget)

    def verify(self, target: Target, tree: Tree, L: int, hidden_layers=()):
        """The target's logits [n, V] for the tree's nodes at positions L + depth (one forward); with
        ``hidden_layers``, (logits, {layer: hidden states [n, D]}) for a feature-reading drafter."""
        if hidden_layers:
            return target.forward(tree.tokens, tree.positions(L), L, tree.visibility, hidden_layers=hidden_layers)
        return target.forward(tree.tokens, tree.positions(L), L, tree.visibility)

    def choose(self, logits: np.ndarray, temperature: float, rng: np.random.Generator) -> np.ndarray:
        if temperature > 0:
            return target_choice_sample(logits, temperature, rng)
        return target_choice_greedy(logits)

    def accept(self, tree: Tree, choice: np.ndarray) -> tuple[np.ndarray, int]:
        return follow_verified_tree(tree, choice)


@dataclass
class GenResult:
    tokens: list[int]  # generated tokens (the prefill's root first)
    logits: list[np.ndarray] | None = None  # the logits row that chose each generated token
    steps: int = 0  # verify forwards after prefill
    accept_lengths: list[int] = field(default_factory=list)  # 1 + a per step (root included)
    finish_reason: str = "length"  # length | stop | context
    prefill_s: float = 0.0
    decode_s: float = 0.0
    host_s: float | None = None  # device-program steps: decode_s less the wait for the GPU (drafting included)
    # ... and its parts in seconds: "draft" (a host drafter's), "launch" (the step programs' launches and host draft
    # uploads), "gc" (Python's garbage collections during the decode, wherever they fell); the rest is bookkeeping
    host_parts: dict[str, float] | None = None

    @property
    def avg_accept(self) -> float:
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s > 0 else float("nan")


def prefill(target: Target, prompt: Sequence[int], drafter=None) -> tuple[int, np.ndarray]:
    """Causal forward over the prompt into slots [0, P). Returns (L = P, logits of the last position).
    A drafter with ``feature_layers`` observes the prompt's hidden states of those layers."""
    prompt = np.asarray(prompt, dtype=np.int64)
    P = prompt.shape[0]
    args = (prompt, np.arange(P, dtype=np.int64), 0, causal_block(P))
    if getattr(drafter, "feature_layers", None):
        logits, hidden = target.forward(*args, hidden_layers=drafter.feature_layers, last_only=True)
        drafter.observe(hidden, 0)
    else:
        logits = target.forward(*args, last_only=True)
    return P, np.asarray(logits[-1])


def generate(
    target: Target,
    prompt: Sequence[int],
    max_new: int,
    drafter: Drafter | None = None,
    budget: int = 0,
    block_size: int = 8,
    temperature: float = 0.0,
    seed: int = 0,
    stop_tokens: Sequence[int] = (),
    keep_logits: bool = False,
    on_tokens: Callable[[list[int]], None] | None = None,
    ops: TreeOps | None = None,
    device_steps: bool = True,
) -> GenResult:
    """Prefill then DDTree steps (``budget`` nodes, depth ``block_size - 1``); ``budget == 0`` or no
    drafter is plain autoregressive decoding through the very same step.

    ``device_steps``: when the tree ops offer ``device_step`` (the CUDA engine) and decoding is greedy
    without ``keep_logits``, each step runs as one device program that hands back only the committed
    tokens (a learned drafter on the same GPU drafts inside it); else the step's stages are separate
    calls (build, verify, choose, accept, compact)."""
    ops = ops or getattr(target, "tree_ops", None) or TreeOps()
    prompt = np.asarray(prompt, dtype=np.int64)
    P = prompt.shape[0]
    if P < 1:
        raise ValueError("the prompt must hold at least one token")
    if P >= target.max_len:
        raise ValueError(f"prompt of {P} tokens leaves no room in the {target.max_len}-token context")
    if drafter is None:
        budget = 0
    depth = max(block_size - 1, 1)
    rng = np.random.default_rng(seed)
    stops = set(int(t) for t in stop_tokens)
    res = GenResult(tokens=[], logits=[] if keep_logits else None)
    # prompt + generated tokens, grown in place: a host drafter's context is a view of its first P + len(tokens)
    seq = np.empty(P + max(max_new, 0), np.int64)
    seq[:P] = prompt

    def emit(tokens: list[int], rows: np.ndarray | None) -> bool:
        """Append up to max_new tokens, stopping after a stop token; True when generation is over."""
        room = max_new - len(res.tokens)
        out = tokens[:room]
        for j, t in enumerate(out):
            if t in stops:
                out, res.finish_reason = out[: j + 1], "stop"
                break
        n = P + len(res.tokens)
        seq[n: n + len(out)] = out
        res.tokens.extend(out)
        if keep_logits:
            res.logits.extend(np.asarray(rows[: len(out)], dtype=np.float32))
        if on_tokens and out:
            on_tokens(out)
        return res.finish_reason == "stop" or len(res.tokens) >= max_new

    features = tuple(getattr(drafter, "feature_layers", None) or ()) if budget > 0 else ()
    t0 = time.perf_counter()
    L, last = prefill(target, prompt, drafter if features else None)
    root = int(ops.choose(last[None, :], temperature, rng)[0])
    res.prefill_s = time.perf_counter() - t0
    fused = None
    if device_steps and temperature == 0 and not keep_logits and hasattr(ops, "device_step"):
        fused = ops.device_step(drafter if budget > 0 else None)
    if fused is not None:
        fused.start(L, root)
        wait0, launch0 = fused.wait_s, fused.launch_s
        draft_s, gc0 = 0.0, _GC.seconds
    t0 = time.perf_counter()
    done = max_new <= 0 or emit([root], last[None, :])
    while not done:
        room = target.max_len - L  # cache slots left for this step's tree
        if room < 1:
            res.finish_reason = "context"
            break
        step_budget = min(budget, room - 1)
        if fused is not None:  # the whole step on the device; back come the committed tokens
            k = min(step_budget, target.cfg.vocab_size)
            if not fused.in_flight:
                draft = None
                if step_budget > 0 and not fused.drafts_on_device:
                    t1 = time.perf_counter()
                    draft = drafter.draft(seq[: P + len(res.tokens)], depth, k)
                    draft_s += time.perf_counter() - t1
                fused.launch(step_budget, depth, k, draft)
            # the next step goes in before this one's tokens are read (it needs nothing from the host), unless
            # this step may end the generation (max_new) or bring the next one's budget down (the context)
            most = 1 + (min(step_budget, depth) if step_budget > 0 else 0)  # tokens this step may commit
            if fused.pipelines(step_budget) and max_new - len(res.tokens) > most and room - most > step_budget:
                fused.launch(step_budget, depth, k)
            out = fused.result()
            L += len(out)
            res.steps += 1
            res.accept_lengths.append(len(out))
            root = out[-1]
            done = emit(out, None)
            continue
        if step_budget > 0:
            context = seq[: P + len(res.tokens)]
            k = min(step_budget, target.cfg.vocab_size)
            draft_tokens, draft_logp = drafter.draft(context, depth, k)
            tree = ops.build(root, draft_tokens, draft_logp, step_budget, L)
        else:  # autoregressive: the root alone (nothing to build on any backend)
            tree = build_tree(root, np.zeros((1, 1), np.int64), np.zeros((1, 1), np.float32), 0)
        if features:  # the drafter's context grows by the accepted nodes' features (no extra forward)
            logits, hidden = ops.verify(target, tree, L, hidden_layers=features)
        else:
            logits = ops.verify(target, tree, L)
        choice = ops.choose(logits, temperature, rng)
        accepted, bonus = ops.accept(tree, choice)
        target.compact(L, accepted)
        if features:
            drafter.observe({i: np.asarray(h)[accepted] for i, h in hidden.items()}, L)
        L += len(accepted)
        res.steps += 1
        res.accept_lengths.append(len(accepted))
        root = int(bonus)
        done = emit([int(t) for t in choice[accepted]], np.asarray(logits)[accepted] if keep_logits else None)
    if fused is not None:
        fused.discard(L, root)  # a step launched ahead of the one that read a stop token
    res.decode_s = time.perf_counter() - t0
    if fused is not None:  # everything but the GPU's own time: drafting, launches, copies, bookkeeping
        res.host_s = res.decode_s - (fused.wait_s - wait0)
        res.host_parts = {"draft": draft_s, "launch": fused.launch_s - launch0, "gc": _GC.seconds - gc0}
        fused.finish(L)
    return res


class _GcClock:
    """``seconds``: the time this process has spent in Python's garbage collections since the import (one
    gc.callbacks entry; the decode's host work counts the collections that fell inside it)."""

    def __init__(self):
        self.seconds, self._t = 0.0, 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t


_GC = _GcClock()


def ar_generate(target: Target, prompt: Sequence[int], max_new: int, **kw) -> GenResult:
    """Greedy (or sampled) autoregressive decoding: the DDTree step with budget 0."""
    return generate(target, prompt, max_new, drafter=None, **kw)
