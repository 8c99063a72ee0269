"""NumPy reference DDTree (SPEC section 3) and KV-cache compaction (SPEC section 2).

The drafter gives, for depths ``d = 1..D``, the top-``K`` tokens ``draft_tokens[d-1, :]`` and their
log-probabilities ``draft_logp[d-1, :]``. :func:`build_tree` grows the ``budget``-node tree that
maximises the surrogate expected acceptance by best-first search over rank paths ``(r_1..r_d)``.

Scores are float32 and accumulated along the path exactly as a GPU kernel does it::

    score(child) = np.float32(score(parent) + np.float32(draft_logp[depth - 1, rank]))   # root: 0

so the kernel (``kdt.kernels.ddtree.tree_build``) reproduces every score bit for bit.

Tie-break rule (shared with the kernel, so trees compare exactly):
    every candidate gets a push id from a global counter that starts at 0 and is incremented once
    per push; when a node is popped its next sibling is pushed before its first child. The heap pops
    the candidate with the **highest score**; among equal scores the **smallest push id** (the one
    pushed earlier) wins, i.e. the heap key is ``(-score, push_id)``.
    Example: with all log-probs equal, nodes come out rank-major per depth (all rank-0 children of
    the depth-1 nodes in parent order, then all rank-1 children, ...), not parent-major.

Node order is pop order (root = node 0), so a parent always precedes its children; the children of a
node are linked (``first_child`` / ``next_sibling``) in pop order, which is also rank order, because
a sibling is only pushed once its predecessor has been popped.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass
class Tree:
    """A draft tree of ``n = 1 + pops`` nodes; node 0 is the root (the committed, uncached token)."""

    tokens: np.ndarray  # [n] int64, root token first
    depth: np.ndarray  # [n] int32, root 0
    parent: np.ndarray  # [n] int32, -1 for the root
    first_child: np.ndarray  # [n] int32, -1 = none
    next_sibling: np.ndarray  # [n] int32, -1 = none
    rank: np.ndarray  # [n] int32, rank of the token in its depth's draft list, -1 for the root
    score: np.ndarray  # [n] float32, sum of the path's log-probs, root 0
    visibility: np.ndarray  # [n, n] bool, row i = row parent(i) | {i}

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])

    def positions(self, L: int) -> np.ndarray:
        """Sequence positions of the nodes when ``L`` tokens are committed: ``L + depth`` [n] int64."""
        return np.int64(L) + self.depth.astype(np.int64)

    def children(self, node: int) -> list[int]:
        """Children of ``node`` in link order (pop order)."""
        out, c = [], int(self.first_child[node])
        while c >= 0:
            out.append(c)
            c = int(self.next_sibling[c])
        return out


def _check_draft(draft_tokens, draft_logp, budget) -> tuple[np.ndarray, np.ndarray]:
    if int(budget) != budget or budget < 0:
        raise ValueError(f"budget must be an integer >= 0, got {budget!r}")
    tok = np.asarray(draft_tokens)
    logp = np.asarray(draft_logp)
    if tok.ndim != 2 or logp.ndim != 2:
        raise ValueError(f"draft_tokens and draft_logp must be [D, K], got {tok.shape} and {logp.shape}")
    if tok.shape != logp.shape:
        raise ValueError(f"draft_tokens {tok.shape} and draft_logp {logp.shape} differ in shape")
    if tok.shape[0] < 1 or tok.shape[1] < 1:
        raise ValueError(f"need D >= 1 depths and K >= 1 tokens per depth, got [D, K] = {tok.shape}")
    if not np.issubdtype(tok.dtype, np.integer):
        raise ValueError(f"draft_tokens must be integers, got {tok.dtype}")
    logp = logp.astype(np.float32)
    if np.isnan(logp).any():
        raise ValueError("draft_logp contains NaN")
    return tok.astype(np.int64), logp


def build_tree(root_token: int, draft_tokens, draft_logp, budget: int) -> Tree:
    """Best-first DDTree of at most ``budget`` drafted nodes below ``root_token``.

    draft_tokens: [D, K] int, draft_logp: [D, K] float (cast to float32). Returns a :class:`Tree`
    with ``1 + min(budget, K + K^2 + .. + K^D)`` nodes. Ties: see the module docstring.
    """
    tok, logp = _check_draft(draft_tokens, draft_logp, budget)
    D, K = tok.shape
    tokens, depth, parent, rank = [int(root_token)], [0], [-1], [-1]
    score = [np.float32(0.0)]
    children: list[list[int]] = [[]]

    heap: list[tuple] = []  # entries (-score, push_id, depth, rank, parent, score)
    push_id = 0

    def push(d: int, r: int, p: int) -> None:
        nonlocal push_id
        s = np.float32(score[p] + logp[d - 1, r])
        heapq.heappush(heap, (-s, push_id, d, r, p, s))
        push_id += 1

    push(1, 0, 0)
    while len(tokens) - 1 < budget and heap:
        _, _, d, r, p, s = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(int(tok[d - 1, r]))
        depth.append(d)
        parent.append(p)
        rank.append(r)
        score.append(s)
        children.append([])
        children[p].append(node)
        if r + 1 < K:
            push(d, r + 1, p)  # next sibling first ...
        if d < D:
            push(d + 1, 0, node)  # ... then first child

    n = len(tokens)
    first_child = np.full(n, -1, np.int32)
    next_sibling = np.full(n, -1, np.int32)
    for p, kids in enumerate(children):
        if kids:
            first_child[p] = kids[0]
        for a, b in zip(kids[:-1], kids[1:], strict=True):
            next_sibling[a] = b

    parent_arr = np.asarray(parent, np.int32)
    return Tree(
        tokens=np.asarray(tokens, np.int64),
        depth=np.asarray(depth, np.int32),
        parent=parent_arr,
        first_child=first_child,
        next_sibling=next_sibling,
        rank=np.asarray(rank, np.int32),
        score=np.asarray(score, np.float32),
        visibility=visibility_matrix(parent_arr),
    )


def visibility_matrix(parent: np.ndarray) -> np.ndarray:
    """[n, n] bool: row i = row parent(i) plus i itself (needs parent[i] < i, root parent -1)."""
    n = len(parent)
    vis = np.zeros((n, n), dtype=bool)
    for i in range(n):
        if parent[i] >= 0:
            vis[i] = vis[parent[i]]
        vis[i, i] = True
    return vis


def follow_verified_tree(tree: Tree, target_choice) -> tuple[np.ndarray, int]:
    """Walk the tree along the target's choices (SPEC section 3, acceptance).

    target_choice: [n] int, the target's token after each node. Returns ``accepted`` ([1 + a] int64
    node indices, starting with 0, increasing) and the bonus token ``target_choice[accepted[-1]]``.
    When several children of a node carry the token, the first in child order wins.
    """
    tc = np.asarray(target_choice)
    if tc.shape != (tree.n,):
        raise ValueError(f"target_choice must be [{tree.n}], got {tc.shape}")
    accepted = [0]
    cur, t = 0, int(tc[0])
    while True:
        nxt = next((c for c in tree.children(cur) if tree.tokens[c] == t), -1)
        if nxt < 0:
            break
        cur = nxt
        accepted.append(cur)
        t = int(tc[cur])
    return np.asarray(accepted, np.int64), t


def target_choice_greedy(logits) -> np.ndarray:
    """[n, V] logits -> [n] int64 argmax per row (first index on ties, like np.argmax)."""
    return np.argmax(np.asarray(logits), axis=-1).astype(np.int64)


def target_choice_sample(logits, temperature: float, rng: np.random.Generator) -> np.ndarray:
    """[n, V] logits -> [n] int64, one independent draw per node from softmax(logits / temperature).

    ``temperature <= 0`` means greedy. Sampling is Gumbel-max in float64 (exact for the softmax).
    """
    logits = np.asarray(logits, dtype=np.float64)
    if temperature <= 0:
        return target_choice_greedy(logits)
    g = rng.gumbel(size=logits.shape)
    return np.argmax(logits / temperature + g, axis=-1).astype(np.int64)


def compact_cache(cache_arrays, L: int, accepted) -> None:
    """Move the accepted nodes' cache slots ``L + accepted[i] -> L + i``, in place, for each array.

    cache_arrays: list of arrays shaped [max_len, ...] (e.g. ``c_kv[max_len, Rkv]``, ``k_pe[max_len,
    dr]``). accepted: [1 + a] increasing node indices starting with 0.

    The race (SPEC section 2): moving the rows in place and in parallel reads slot ``L + accepted[i]``
    while another move may already have written it; e.g. accepted ``[0, 2, 5]`` reads slot ``L+2``
    for ``i = 1`` and writes it for ``i = 2``. Here the rows are gathered first (fancy indexing makes
    a copy) and then scattered, which is race-free. (A sequential move in increasing ``i`` is also
    correct, since ``accepted[i] >= i``; the kernel does that per column.)
    """
    acc = np.asarray(accepted, dtype=np.int64)
    if acc.ndim != 1 or acc.size < 1 or acc[0] != 0 or np.any(np.diff(acc) <= 0):
        raise ValueError(f"accepted must be increasing node indices starting with 0, got {acc}")
    for arr in cache_arrays:
        if L + acc[-1] >= arr.shape[0]:
            raise ValueError(f"slot L + {acc[-1]} = {L + acc[-1]} is outside a cache of {arr.shape[0]} slots")
        rows = arr[L + acc]  # gather (a copy) ...
        arr[L : L + acc.size] = rows  # ... then scatter
