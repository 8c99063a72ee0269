"""DDTree on the GPU: tree build, tree acceptance and KV-cache compaction (SPEC sections 2-3).

Reference: :mod:`kdt.reference.ddtree`. Every output matches it exactly (same float32 scores, same
tie-break: higher score first, then the smaller push id; the sibling is pushed before the child).

- ``tree_build``: one block per request. A chain is written without a search; for a tree the sequential
  best-first search runs in warp 0's registers for budgets <= 31 (:func:`_warp_search`: each pop a warp
  arg-max) and on thread 0's binary heap in shared memory otherwise (log-probs staged in shared memory
  too, so the sequential loop never waits on global memory); the other warps zero the visibility
  matrix meanwhile; then every thread writes whole nodes: the outputs and the visibility row (by
  walking that node's ancestors, so rows are independent), and marks the unused slots.
- ``tree_accept``: one block per request stages the tree's rows in shared memory, then thread 0 walks
  ``first_child`` / ``next_sibling`` along the target's choices.
- ``kv_compact``: one thread per (layer, column) of the caches (c_kv, k_pe and the pre-split kv_hl) moves the
  accepted rows in increasing order (race-free, see :func:`_move_column`).

Output conventions: the node capacity ``NMAX`` is the outputs' second dimension (``budget + 1``
suffices); slots ``>= n_nodes`` hold -1 (tokens, depth, parent, links, positions); visibility is
written on ``[0, budget + 1)^2`` only (0 outside the tree's ``[n, n]`` block) and left as it was beyond,
which nothing reads (``stage_tree`` takes the ``[n, n]`` block). Zeroing the whole ``[NMAX, NMAX]``
matrix (NMAX = 257: 66 KB of byte stores) made every step's tree_build ~35-40 us even at budget 0
(``scripts/profile_kernels.py``, H200, 2026-11-30: 40 us per tiny autoregressive step, 44 us per
Moonlight chain step).
``accepted`` is padded with -1 and ``n_accepted = 1 + a`` counts the root.

Measured on the H200 (ncu, one request, D=15, K=32): tree_build 95 / 444 / 962 us at budget
64 / 256 / 512, bound by the latency of thread 0's heap loop (~1.9 us per pop; static shared memory
48,180 bytes, just under the 48 KiB limit); tree_accept 5-7 us; kv_compact 12 us for 61 layers x 16
rows x (512 + 64) columns. The warp search (2026-12-01, ``scripts/bench_tree.py``, D = 15): K = 16
budget 16 / 31 12.2 / 19.6 us against the heap's 16.0 / 28.9; 9.7 / 15.0 us since 2026-12-02 (comparisons
without branches). A chain (K = 1, or a budget <= 1) needs no search since then: every thread writes its
nodes (budget 15: 5.5 us, the heap 8.1).
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int16, int32, int64, uint8, uint16, uint32

from kdt.kernels.common import IS_SIM, WARP, cdiv, device_scalar, grid_dependency_wait, register_ptx, weight_loader

MAX_BUDGET = 512  # largest tree (drafted nodes) tree_build can hold in shared memory
_CAND_CAP = 2 * MAX_BUDGET + 2  # pushes: 1 + at most 2 per pop
_HEAP_CAP = MAX_BUDGET + 2  # live heap entries: at most 1 + pops
_NODE_CAP = MAX_BUDGET + 1
_LOGP_CAP = 15 * MAX_BUDGET  # staged log-probs: D = 15 (block size 16) at K = MAX_BUDGET
assert _CAND_CAP < 2**15  # push ids and node indices are stored as int16
# Trees (K >= 2) of budgets up to WARP_SEARCH_MAX run the search in one warp's registers (lane n holds
# node n and one live candidate: at most 1 + pops <= 32 of each); larger budgets on thread 0's heap (chains
# need no search). Env KDT_TREE_WARP_MAX=0 keeps every tree on the heap (A/B).
WARP_SEARCH_MAX = min(WARP - 1, int(os.environ.get("KDT_TREE_WARP_MAX", str(WARP - 1))))
_XCH = WARP if IS_SIM else 1  # the simulator's lane-exchange buffers (shuffles on the GPU)
NEG_INF_F32 = float32(-np.inf)


# --------------------------------------------------------------------------------------------------
# tree_build
# --------------------------------------------------------------------------------------------------


@cuda.jit(device=True, inline="always")
def _before(sa, ia, sb, ib):
    """Candidate (score sa, push id ia) pops before (sb, ib): higher score, then smaller push id. Bitwise
    operators, not ``or`` / ``and``: no short-circuit branches on the search's dependent chain."""
    return (sa > sb) | ((sa == sb) & (ia < ib))


@cuda.jit(device=True, inline="always")
def _heap_push(heap_score, heap_id, size, s, cid):
    """Insert candidate (s, cid) into the binary heap ``heap_*[:size]``; returns the new size."""
    pos = size
    while pos > 0:
        up = (pos - 1) // 2
        if not _before(s, cid, heap_score[up], heap_id[up]):
            break
        heap_score[pos] = heap_score[up]
        heap_id[pos] = heap_id[up]
        pos = up
    heap_score[pos] = s
    heap_id[pos] = cid
    return size + 1


@cuda.jit(device=True, inline="always")
def _heap_pop(heap_score, heap_id, size):
    """Drop the top of ``heap_*[:size]`` (size > 0; read ``heap_*[0]`` first); returns the new size."""
    size -= 1
    ls = heap_score[size]
    li = heap_id[size]
    pos = 0
    while True:
        c = 2 * pos + 1
        if c >= size:
            break
        cs = heap_score[c]
        ci = heap_id[c]
        if c + 1 < size and _before(heap_score[c + 1], heap_id[c + 1], cs, ci):
            c += 1
            cs = heap_score[c]
            ci = heap_id[c]
        if not _before(cs, ci, ls, li):
            break
        heap_score[pos] = cs
        heap_id[pos] = ci
        pos = c
    heap_score[pos] = ls
    heap_id[pos] = li
    return size


@cuda.jit(device=True, inline="always")
def _logp(s_logp, staged, ks, draft_logp, r, d, k):
    """draft_logp[r, d, k], from the shared copy ``s_logp[d * ks + k]`` when it was staged."""
    if staged:
        return s_logp[d * ks + k]
    return draft_logp[r, d, k]


if IS_SIM:  # no shuffles in the simulator: exchange through shared memory (the block is the one warp)

    @cuda.jit(device=True, inline="always")
    def _lane(buf, lane, v, src):
        """v of lane ``src`` (every lane of the warp calls it; ``buf``: a shared array of v's type)."""
        cuda.syncthreads()
        buf[lane] = v
        cuda.syncthreads()
        return buf[src]

else:

    @cuda.jit(device=True, inline="always")
    def _lane(buf, lane, v, src):
        """v of lane ``src`` (every lane of the warp calls it; ``buf`` and ``lane`` unused)."""
        return cuda.shfl_sync(0xFFFFFFFF, v, src)


# The warp search's candidate slot packs its parent node (5 bits), depth (5), rank (5), previously popped
# sibling + 1 (6) and push id (6) into one int32 word, the push id in the top bits: of two packed words the
# smaller is the smaller push id (ids are unique), so the heap's order is (score, word). An empty slot holds
# the word _P_EMPTY (id 63 > every push id of <= 31 pops: 1 + 2 x 31 = 63 pushes, ids 0 .. 62).
_P_DEP, _P_RANK, _P_PREV, _P_ID = 5, 10, 15, 21
_P_EMPTY = 63 << _P_ID


@cuda.jit(device=True, inline="always")
def _warp_search(lane, nb, ds, ks, s_logp, xf, xi, cand_depth, cand_rank, node_cand, node_parent, node_first,
                 node_next):
    """The best-first search of ``tree_build`` for nb <= WARP_SEARCH_MAX in one warp's registers (all 32
    lanes call it; log-probs staged in ``s_logp[d * ks + k]``). Lane n holds node n (parent, first child,
    next sibling, depth, rank) and one candidate slot (score, packed word, the parent's score). A pop is
    a warp arg-max over the slots by the heap's order (higher score, then smaller push id): five
    butterfly rounds of three shuffles, after which every lane holds the winner. The popped slot takes the
    sibling push, a new slot the child (slots in use <= 1 + pops <= 32), so the pops, the push ids and the
    tree are the heap's. Leaves the nodes where the heap search leaves them (node n's depth and rank in
    cand_depth[n], cand_rank[n], node_cand[n] = n). Returns the node count."""
    npar = -1  # node `lane` (node 0: the root, depth 0)
    nfirst = -1
    nnext = -1
    ndep = 0
    nrank = 0
    cs = NEG_INF_F32  # candidate slot `lane`
    cw = _P_EMPTY
    cps = float32(0.0)
    size = 0
    npush = 0
    nslots = 0
    count = 0
    if nb > 0:  # push id 0: rank 0 at depth 1, child of the root (score 0)
        if lane == 0:
            cs = s_logp[0]
            cw = 1 << _P_DEP
        size = 1
        npush = 1
        nslots = 1
    while count < nb and size > 0:
        bs = cs
        bw = int32(cw)
        bps = cps
        j = 16
        while j >= 1:
            os_ = _lane(xf, lane, bs, lane ^ j)
            ow = _lane(xi, lane, bw, lane ^ j)
            ops = _lane(xf, lane, bps, lane ^ j)
            if _before(os_, ow, bs, bw):
                bs = os_
                bw = ow
                bps = ops
            j //= 2
        win = cw == bw  # this lane's slot is popped
        p = bw & 31
        d = (bw >> _P_DEP) & 31
        rk = (bw >> _P_RANK) & 31
        prev = ((bw >> _P_PREV) & 63) - 1
        size -= 1
        count += 1
        node = count
        if lane == node:
            npar = p
            ndep = d
            nrank = rk
        if prev < 0:
            if lane == p:
                nfirst = node
        elif lane == prev:
            nnext = node
        sib = rk + 1 < ks  # bounded by ks / ds like the heap search (see there)
        chi = d < ds
        if sib:  # next sibling first (into the popped slot) ...
            sc = bps + s_logp[(d - 1) * ks + rk + 1]
            if win:
                cs = sc
                cw = p | (d << _P_DEP) | ((rk + 1) << _P_RANK) | ((node + 1) << _P_PREV) | (npush << _P_ID)
            npush += 1
            size += 1
        if chi:  # ... then first child (into the popped slot when it is free, else a new one)
            sc = bs + s_logp[d * ks]
            if (lane == nslots) if sib else win:
                cs = sc
                cw = node | ((d + 1) << _P_DEP) | (npush << _P_ID)
                cps = bs
            if sib:
                nslots += 1
            npush += 1
            size += 1
        if not sib and not chi and win:
            cs = NEG_INF_F32
            cw = _P_EMPTY
    if lane <= count:
        node_parent[lane] = npar
        node_first[lane] = nfirst
        node_next[lane] = nnext
        node_cand[lane] = lane
        cand_depth[lane] = ndep
        cand_rank[lane] = nrank
    return count + 1


@cuda.jit
def tree_build(
    root_token,  # [R] int64
    draft_tokens,  # [R, D, K] int64
    draft_logp,  # [R, D, K] float32
    budget,  # int32 scalar, clamped to NMAX - 1 and MAX_BUDGET
    warp_max,  # int32 scalar: budgets <= warp_max (<= 31) search in one warp (needs >= 32 threads)
    L,  # [R] int64, committed tokens per request
    tokens,  # out [R, NMAX] int64
    depth,  # out [R, NMAX] int32
    parent,  # out [R, NMAX] int32
    first_child,  # out [R, NMAX] int32
    next_sibling,  # out [R, NMAX] int32
    positions,  # out [R, NMAX] int64 = L + depth
    visibility,  # out [R, NMAX, NMAX] uint8
    n_nodes,  # out [R] int32
):
    """Best-first DDTree per request; grid = R blocks, any block size (128 is a good default).

    1. all threads stage the reachable log-probs ``[min(D, nb), min(K, nb)]`` in shared memory;
    2. a chain is written by all threads at once; a tree is searched by warp 0 (nb <= warp_max:
       :func:`_warp_search`, in registers) or thread 0 (a binary heap in shared memory), while other
       warps zero ``visibility`` on ``[0, nb + 1)^2`` (every node index of this budget is below nb + 1);
    3. every thread writes whole nodes: outputs from shared memory, visibility row by ancestor walk.
    """
    grid_dependency_wait()
    # candidates, indexed by push id: parent node, depth, rank, previously popped sibling (-1: none)
    cand_parent = cuda.shared.array(_CAND_CAP, int16)
    cand_depth = cuda.shared.array(_CAND_CAP, int16)
    cand_rank = cuda.shared.array(_CAND_CAP, int16)
    cand_prev = cuda.shared.array(_CAND_CAP, int16)
    heap_score = cuda.shared.array(_HEAP_CAP, float32)  # binary heap of (score, push id)
    heap_id = cuda.shared.array(_HEAP_CAP, int16)
    node_score = cuda.shared.array(_NODE_CAP, float32)  # per node, in pop order
    node_cand = cuda.shared.array(_NODE_CAP, int16)
    node_parent = cuda.shared.array(_NODE_CAP, int16)
    node_first = cuda.shared.array(_NODE_CAP, int16)
    node_next = cuda.shared.array(_NODE_CAP, int16)
    s_logp = cuda.shared.array(_LOGP_CAP, float32)
    n_sh = cuda.shared.array(1, int32)
    xf = cuda.shared.array(_XCH, float32)  # lane exchange of the warp search (simulator only)
    xi = cuda.shared.array(_XCH, int32)

    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    nmax = tokens.shape[1]
    D = draft_tokens.shape[1]
    K = draft_tokens.shape[2]
    nb = min(max(budget, 0), nmax - 1, MAX_BUDGET)
    # nb pops reach depth <= nb and rank <= nb - 1: only these log-probs can matter
    ds = min(D, nb)
    ks = min(K, nb)
    staged = ds * ks <= _LOGP_CAP
    if staged:
        for idx in range(tid, ds * ks, nt):
            d = idx // ks
            s_logp[idx] = draft_logp[r, d, idx - d * ks]
    cuda.syncthreads()

    # a chain (ks <= 1: K = 1, or a budget <= 1) needs no search: node i sits at depth i, rank 0. Trees
    # (ks >= 2) search in warp 0's registers up to warp_max (<= 31; its log-probs are always staged), else
    # on thread 0's heap
    in_warp = nb <= min(warp_max, WARP - 1) and ks >= 2 and (nt == WARP if IS_SIM else nt >= WARP)
    if ks <= 1:
        n = ds + 1
        for i in range(tid, n, nt):
            node_parent[i] = i - 1
            node_first[i] = i + 1 if i + 1 < n else -1
            node_next[i] = -1
            node_cand[i] = i
            cand_depth[i] = i
            cand_rank[i] = 0
        if tid == 0:
            n_sh[0] = n
            n_nodes[r] = n
    elif in_warp:
        if tid < WARP:
            n = _warp_search(tid, nb, ds, ks, s_logp, xf, xi, cand_depth, cand_rank, node_cand, node_parent,
                             node_first, node_next)
            if tid == 0:
                n_sh[0] = n
                n_nodes[r] = n
    elif tid == 0:
        node_score[0] = 0.0
        node_parent[0] = -1
        node_first[0] = -1
        node_next[0] = -1
        size = 0
        npush = 0
        count = 0
        if nb > 0:  # push id 0: rank 0 at depth 1
            cand_parent[0] = 0
            cand_depth[0] = 1
            cand_rank[0] = 0
            cand_prev[0] = -1
            size = _heap_push(
                heap_score, heap_id, 0, node_score[0] + _logp(s_logp, staged, ks, draft_logp, r, 0, 0), 0
            )
            npush = 1
        while count < nb and size > 0:
            s = heap_score[0]
            c = heap_id[0]
            size = _heap_pop(heap_score, heap_id, size)
            count += 1
            node = count
            p = cand_parent[c]
            d = cand_depth[c]
            rk = cand_rank[c]
            prev = cand_prev[c]
            node_score[node] = s
            node_cand[node] = c
            node_parent[node] = p
            node_first[node] = -1
            node_next[node] = -1
            if prev < 0:
                node_first[p] = node
            else:
                node_next[prev] = node
            # Pushes bounded by ks / ds instead of K / D: a rank >= nb or a depth > nb can never be
            # popped within nb pops, and skipping never-popped pushes keeps the relative order of all
            # other push ids, so the tree is the reference's. It also keeps reads inside s_logp.
            if rk + 1 < ks:  # next sibling first ...
                cand_parent[npush] = p
                cand_depth[npush] = d
                cand_rank[npush] = rk + 1
                cand_prev[npush] = node
                sc = node_score[p] + _logp(s_logp, staged, ks, draft_logp, r, d - 1, rk + 1)
                size = _heap_push(heap_score, heap_id, size, sc, npush)
                npush += 1
            if d < ds:  # ... then first child
                cand_parent[npush] = node
                cand_depth[npush] = d + 1
                cand_rank[npush] = 0
                cand_prev[npush] = -1
                sc = s + _logp(s_logp, staged, ks, draft_logp, r, d, 0)
                size = _heap_push(heap_score, heap_id, size, sc, npush)
                npush += 1
        n_sh[0] = count + 1
        n_nodes[r] = count + 1

    # Zero visibility[:nb + 1, :nb + 1] while thread 0 builds, coalesced (consecutive threads,
    # consecutive columns). Warp 0 takes no part when there are other warps: its idle lanes would share
    # its issue slots with thread 0 (measured: 20% longer at budget 512).
    z0 = WARP if nt > WARP else 0
    nb1 = nb + 1
    if tid >= z0:
        for i in range(nb1):
            j = tid - z0
            while j < nb1:
                visibility[r, i, j] = 0
                j += nt - z0
    cuda.syncthreads()

    n = n_sh[0]
    Lr = L[r]
    for i in range(tid, nmax, nt):
        if i < n:
            if i == 0:
                tok = root_token[r]
                d = 0
            else:
                c = node_cand[i]
                d = cand_depth[c]
                tok = draft_tokens[r, d - 1, cand_rank[c]]
            tokens[r, i] = tok
            depth[r, i] = d
            parent[r, i] = node_parent[i]
            first_child[r, i] = node_first[i]
            next_sibling[r, i] = node_next[i]
            positions[r, i] = Lr + d
            a = i  # row i = {i} + ancestors of i
            while a >= 0:
                visibility[r, i, a] = 1
                a = node_parent[a]
        else:
            tokens[r, i] = -1
            depth[r, i] = -1
            parent[r, i] = -1
            first_child[r, i] = -1
            next_sibling[r, i] = -1
            positions[r, i] = -1


_I64_1 = int64[::1]
_I32_1 = int32[::1]
_I64_2 = int64[:, ::1]
_I32_2 = int32[:, ::1]
register_ptx(
    tree_build,
    (_I64_1, int64[:, :, ::1], float32[:, :, ::1], int32, int32, _I64_1,
     _I64_2, _I32_2, _I32_2, _I32_2, _I32_2, _I64_2, uint8[:, :, ::1], _I32_1),
)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# tree_accept
# --------------------------------------------------------------------------------------------------


@cuda.jit(device=True, inline="always")
def _row(s, g, r, i, staged):
    """``g[r, i]``, from its shared copy ``s[i]`` when the row was staged."""
    if staged:
        return s[i]
    return g[r, i]


@cuda.jit
def tree_accept(
    first_child,  # [R, NMAX] int32
    next_sibling,  # [R, NMAX] int32
    tokens,  # [R, NMAX] int64
    target_choice,  # [R, NMAX] int64, the target's token after each node
    n_nodes,  # [R] int32
    accepted,  # out [R, NMAX] int32, node indices, padded with -1
    n_accepted,  # out [R] int32, 1 + a (the root counts)
    bonus,  # out [R] int64, target_choice of the last accepted node
):
    """follow_verified_tree per request; grid = R blocks, any block size.

    The walk is a chain of dependent loads, so the block first stages the request's four rows in
    shared memory with coalesced loads (one memory round trip) and thread 0 walks them there.
    """
    grid_dependency_wait()
    s_first = cuda.shared.array(_NODE_CAP, int32)
    s_next = cuda.shared.array(_NODE_CAP, int32)
    s_tok = cuda.shared.array(_NODE_CAP, int64)
    s_tc = cuda.shared.array(_NODE_CAP, int64)
    cnt_sh = cuda.shared.array(1, int32)

    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    nmax = tokens.shape[1]
    n = min(n_nodes[r], nmax)
    staged = n <= _NODE_CAP
    if staged:
        for i in range(tid, n, nt):
            s_first[i] = first_child[r, i]
            s_next[i] = next_sibling[r, i]
            s_tok[i] = tokens[r, i]
            s_tc[i] = target_choice[r, i]
    cuda.syncthreads()

    if tid == 0:
        cur = 0
        t = _row(s_tc, target_choice, r, 0, staged)
        accepted[r, 0] = 0
        cnt = 1
        while cnt < n:  # a path has at most n nodes; also guards against malformed links
            c = _row(s_first, first_child, r, cur, staged)
            while c >= 0 and c < n and _row(s_tok, tokens, r, c, staged) != t:  # first match wins
                c = _row(s_next, next_sibling, r, c, staged)
            if c < 0 or c >= n:
                break
            cur = c
            accepted[r, cnt] = cur
            cnt += 1
            t = _row(s_tc, target_choice, r, cur, staged)
        cnt_sh[0] = cnt
        n_accepted[r] = cnt
        bonus[r] = t
    cuda.syncthreads()

    for j in range(cnt_sh[0] + tid, nmax, nt):
        accepted[r, j] = -1


register_ptx(tree_accept, (_I32_2, _I32_2, _I64_2, _I64_2, _I32_1, _I32_2, _I32_1, _I64_1))


# --------------------------------------------------------------------------------------------------
# kv_compact
# --------------------------------------------------------------------------------------------------


@cuda.jit(device=True, inline="always")
def _move_column(cache, layer, col, L, accepted, n_acc):
    """cache[layer, L + i, col] = cache[layer, L + accepted[i], col] for i = 0 .. n_acc-1, in order.

    Race-free without a gather buffer: this thread is the only one touching column ``col`` of this
    layer, and ``accepted`` is increasing from 0, so ``accepted[i] >= i``. Step ``i`` writes slot
    ``L + i``; every later step ``j > i`` reads slot ``L + accepted[j] >= L + j > L + i``, i.e. never
    a slot that an earlier step has overwritten.
    """
    for i in range(n_acc):
        src = accepted[i]
        if src != i:
            cache[layer, L + i, col] = cache[layer, L + src, col]


@cuda.jit
def kv_compact(
    c_kv,  # [n_layers, max_len, Rkv] in/out
    k_pe,  # [n_layers, max_len, dr] in/out
    kv_hl,  # [n_layers, max_len, F] uint32 in/out (the pre-split cache, F = Rkv + dr), or [1, 1, 0]: none
    L_dev,  # [1] int64, committed tokens before the step
    accepted,  # [>= n_acc] int32, increasing node indices starting with 0
    n_acc_dev,  # [1] int32, 1 + a
):
    """Compact the caches of every layer: one thread per (layer, column of c_kv ++ k_pe ++ kv_hl). L and n_acc
    are read on the device (a CUDA graph of the whole DDTree step replays this launch)."""
    grid_dependency_wait()
    t = cuda.grid(1)
    rkv = c_kv.shape[2]
    cw = rkv + k_pe.shape[2]
    w = cw + kv_hl.shape[2]
    if t >= c_kv.shape[0] * w:
        return
    L = L_dev[0]
    n_acc = n_acc_dev[0]
    layer = t // w
    col = t - layer * w
    if col < rkv:
        _move_column(c_kv, layer, col, L, accepted, n_acc)
    elif col < cw:
        _move_column(k_pe, layer, col - rkv, L, accepted, n_acc)
    else:
        _move_column(kv_hl, layer, col - cw, L, accepted, n_acc)


register_ptx(kv_compact, (float32[:, :, ::1], float32[:, :, ::1], uint32[:, :, ::1], _I64_1, _I32_1, _I32_1))


@functools.lru_cache(maxsize=1)
def _no_kv_hl():
    """kv_compact's kv_hl when there is none: [1, 1, 0] uint32 (no columns)."""
    return cuda.device_array((1, 1, 0), np.uint32)


# --------------------------------------------------------------------------------------------------
# stage_tree: a built tree into the forward's input buffers
# --------------------------------------------------------------------------------------------------


STAGE_THREADS = 256  # block of the staging kernels (stage_tree, stage_draft): one thread per mask element


@cuda.jit
def stage_tree(
    tokens,  # [R, NMAX] int64 (tree_build output)
    positions,  # [R, NMAX] int64
    visibility,  # [R, NMAX, NMAX] uint8
    n_nodes,  # [R] int32
    r,  # int32 scalar, the request to stage
    out_tokens,  # out [>= n] int64
    out_positions,  # out [>= n] int64
    out_vis,  # out [>= n*n] uint8, the [n, n] block row-major
):
    """Request r's tree as the forward reads it, without a host round trip: one thread per element of
    the [n, n] visibility block (grid covers NMAX * NMAX threads; n is read on the device)."""
    grid_dependency_wait()
    t = cuda.grid(1)
    n = n_nodes[r]
    if t < n * n:
        i = t // n
        out_vis[t] = visibility[r, i, t - i * n]
    if t < n:
        out_tokens[t] = tokens[r, t]
        out_positions[t] = positions[r, t]


register_ptx(stage_tree, (_I64_2, _I64_2, uint8[:, :, ::1], _I32_1, int32, _I64_1, _I64_1, uint8[::1]))


# --------------------------------------------------------------------------------------------------
# the rest of a DDTree step on the device: the drafter's top-k, staging, feature gather, commit
# --------------------------------------------------------------------------------------------------
TOPK_MAX_V = 4096  # draft_topk sorts a whole vocabulary row in shared memory (32 KiB)
_TOPK_NT = 64 if IS_SIM else 512


@cuda.jit(device=True, inline="always")
def _ranks_before(va, ia, vb, ib):
    """(value va, index ia) sorts before (vb, ib): the larger value, then the smaller index (branch-free, as
    :func:`_before`)."""
    return (va > vb) | ((va == vb) & (ia < ib))


@cuda.jit(device=True, inline="always")
def _partner_shared(sv, si, tid, v, idx, j):
    """(v, idx) of thread tid ^ j through shared memory (every thread of the block calls it)."""
    cuda.syncthreads()
    sv[tid] = v
    si[tid] = idx
    cuda.syncthreads()
    return sv[tid ^ j], si[tid ^ j]


if IS_SIM:
    _partner = _partner_shared  # no shuffles in the simulator

else:

    @cuda.jit(device=True, inline="always")
    def _partner(sv, si, tid, v, idx, j):
        """(v, idx) of thread tid ^ j: a shuffle within the warp (j < 32), else through shared memory
        (j is the same for the whole block: every thread takes the same branch)."""
        if j < WARP:
            return cuda.shfl_xor_sync(0xFFFFFFFF, v, j), cuda.shfl_xor_sync(0xFFFFFFFF, idx, j)
        return _partner_shared(sv, si, tid, v, idx, j)


@cuda.jit(device=True, inline="always")
def _bitonic_by_thread(logits, d, V, P, sv, si, tid):
    """Row d of logits sorted into sv / si[:P] (P <= threads: thread i holds element i; threads >= P
    sort a row of padding among themselves, partners tid ^ j stay on their side of P)."""
    v = logits[d, tid] if tid < V else float32(-np.inf)
    idx = int32(tid)
    k = 2
    while k <= P:
        j = k // 2
        while j > 0:
            pv, pi = _partner(sv, si, tid, v, idx, j)
            # the lower index of the pair keeps the element that sorts first when its k-run ascends
            want_first = ((tid & k) == 0) == ((tid & j) == 0)
            if _ranks_before(pv, pi, v, idx) == want_first:
                v = pv
                idx = pi
            j //= 2
        k *= 2
    cuda.syncthreads()
    sv[tid] = v
    si[tid] = idx
    cuda.syncthreads()


@cuda.jit(device=True, inline="always")
def _bitonic_shared(logits, d, V, P, sv, si, tid, nt):
    """Row d of logits sorted into sv / si[:P] in shared memory, the threads striding over it."""
    for i in range(tid, P, nt):
        sv[i] = logits[d, i] if i < V else float32(-np.inf)
        si[i] = i
    cuda.syncthreads()
    k = 2
    while k <= P:
        j = k // 2
        while j > 0:
            for i in range(tid, P, nt):
                partner = i ^ j
                if partner > i:
                    a_first = (i & k) == 0  # this k-run ends up in the requested order at i < partner
                    if _ranks_before(sv[partner], si[partner], sv[i], si[i]) == a_first:
                        tv = sv[i]
                        sv[i] = sv[partner]
                        sv[partner] = tv
                        ti = si[i]
                        si[i] = si[partner]
                        si[partner] = ti
            cuda.syncthreads()
            j //= 2
        k *= 2


@cuda.jit
def draft_topk(logits, out_tok, out_logp):
    """logits[D, V] f32 (V <= TOPK_MAX_V) -> per row d the K = out_tok.shape[2] most likely tokens,
    out_tok[0, d, :K] (int64, descending, ties to the smaller token id: the order of a stable argsort)
    and their log-probabilities out_logp[0, d, :K] = logit - logsumexp(row) (float32).

    grid = D blocks (one per row); a bitonic sort of the row (padded to a power of two P with -inf),
    then a block reduction of sum(exp(v - max)) (the maximum is the sorted row's head). P <= threads
    (e.g. V = 256): one element per thread, the compare-exchange stages with partners less than a warp
    apart through shuffles (30 of V = 256's 36 stages) and only the others through shared memory;
    larger rows: every stage in shared memory, the threads striding over the row."""
    grid_dependency_wait()
    sv = cuda.shared.array(TOPK_MAX_V, float32)
    si = cuda.shared.array(TOPK_MAX_V, int32)
    red = cuda.shared.array(_TOPK_NT, float32)
    d = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    V = logits.shape[1]
    K = out_tok.shape[2]
    P = 1
    while P < V:
        P *= 2
    if P <= nt:
        _bitonic_by_thread(logits, d, V, P, sv, si, tid)
    else:
        _bitonic_shared(logits, d, V, P, sv, si, tid, nt)
    top = sv[0]
    acc = float32(0.0)
    for i in range(tid, V, nt):
        acc += math.exp(sv[i] - top)
    red[tid] = acc
    cuda.syncthreads()
    w = nt // 2
    while w > 0:
        if tid < w:
            red[tid] += red[tid + w]
        cuda.syncthreads()
        w //= 2
    lse = top + math.log(red[0])
    for i in range(tid, K, nt):
        out_tok[0, d, i] = si[i]
        out_logp[0, d, i] = sv[i] - lse


register_ptx(draft_topk, (float32[:, ::1], int64[:, :, ::1], float32[:, :, ::1]))

@functools.cache
def _stage_rows_fn(dtype):
    load = weight_loader(dtype)

    @cuda.jit(device=True, inline="always")
    def stage_rows(t, nth, Lc, nc, Lt, r, B, with_block, tokens, positions, L_out, vis, embed, mask_rows, x):
        """The learned drafter's rows in a device DDTree step, by thread t of nth (nth >= 2B). B context rows
        (nc of them valid, the rest padding) at positions Lc + i; with ``with_block``, then the block [root r,
        mask x (B-1)] at positions Lt + j (Lt: the root's position). Writes positions[:B or 2B], L_out[0] = Lc
        (the rows' cache slots follow it), tokens[B] = r, and with the block the [2B, 2B] mask vis (context
        rows causal among themselves; block rows see the valid context rows and the whole block) and the
        block's input rows x[B:2B, :D] = [embed[r], mask_rows[0..B-2]] (embed [V, D] f32 or bf16, mask_rows
        [B-1, D] f32, x f32)."""
        M = 2 * B if with_block else B
        if t < M:
            positions[t] = Lc + t if t < B else Lt + (t - B)
        if t == 0:
            L_out[0] = Lc
            if with_block:
                tokens[B] = r
        if with_block:
            for e in range(t, M * M, nth):
                i = e // M
                j = e - i * M
                see = j <= i if i < B else (j < nc or j >= B)
                vis[e] = 1 if see else 0
            D = x.shape[1]
            for e in range(t, B * D, nth):
                i = e // D
                c = e - i * D
                x[B + i, c] = load(embed[r, c]) if i == 0 else mask_rows[i - 1, c]

    return stage_rows


@functools.cache
def _stage_draft_kernel(dtype):
    stage_rows = _stage_rows_fn(dtype)

    @cuda.jit
    def stage_draft(L_ctx, n_ctx, L_target, root, B, with_block, tokens, positions, L_out, vis, embed, mask_rows, x):
        """The drafter's rows (``_stage_rows_fn``) from the device state: context rows n_ctx[0] valid from
        L_ctx[0], the block of root[0] at L_target[0]."""
        grid_dependency_wait()
        stage_rows(cuda.grid(1), cuda.gridsize(1), L_ctx[0], n_ctx[0], L_target[0], root[0], B, with_block != 0,
                   tokens, positions, L_out, vis, embed, mask_rows, x)

    return stage_draft


def stage_draft(L_ctx, n_ctx, L_target, root, B: int, with_block: bool, tokens, positions, L_out, vis, embed,
                mask_rows, x, stream=0) -> None:
    """:func:`_stage_draft_kernel`'s kernel over max(4 B^2, B) threads: a step program's first block
    (later blocks are staged by :func:`gather_accepted`), and the last context rows after the last step."""
    n = 4 * B * B if with_block else B
    _stage_draft_kernel(np.dtype(embed.dtype))[cdiv(n, STAGE_THREADS), STAGE_THREADS, stream](
        L_ctx, n_ctx, L_target, root, np.int32(B), np.int32(1 if with_block else 0), tokens, positions, L_out, vis,
        embed, mask_rows, x)


@functools.cache
def _gather_accepted_kernel(dtype):
    stage_rows = _stage_rows_fn(dtype)

    @cuda.jit
    def gather_accepted(feat, accepted, n_acc_dev, L_target, bonus, out, n_ctx, L_ctx, tokens, positions, L_out, vis,
                        embed, mask_rows, x):
        """out[i, f*D + c] = feat[f, accepted[0, i], c] for the accepted rows i < n_acc, 0 for the rest:
        the target features [F, M, D] of the accepted nodes as the drafter's next context rows [B, F*D];
        n_ctx[0] = n_acc and L_ctx[0] = L (their first position; run before the commit moves L). Then the
        next step's drafter rows as :func:`stage_draft` would stage them after the commit (the context
        from L, n_acc valid; the block of the bonus token at L + n_acc), so the next step starts with its
        drafter's forward: one launch less a step. grid = B blocks (one per output row)."""
        grid_dependency_wait()
        i = cuda.blockIdx.x
        D = feat.shape[2]
        n = n_acc_dev[0]
        Lt = L_target[0]
        ok = i < n
        src = accepted[0, i] if ok else 0
        for c in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
            f = c // D
            out[i, c] = feat[f, src, c - f * D] if ok else float32(0.0)
        if i == 0 and cuda.threadIdx.x == 0:
            n_ctx[0] = n
            L_ctx[0] = Lt
        stage_rows(cuda.grid(1), cuda.gridsize(1), Lt, n, Lt + n, bonus[0], out.shape[0], True, tokens, positions,
                   L_out, vis, embed, mask_rows, x)

    return gather_accepted


def gather_accepted(feat, accepted, n_acc, L_target, bonus, out, n_ctx, L_ctx, tokens, positions, L_out, vis, embed,
                    mask_rows, x, threads: int = 128, stream=0) -> None:
    """:func:`_gather_accepted_kernel`'s kernel over B = out.shape[0] blocks (B * threads >= 2B)."""
    _gather_accepted_kernel(np.dtype(embed.dtype))[out.shape[0], threads, stream](
        feat, accepted, n_acc, L_target, bonus, out, n_ctx, L_ctx, tokens, positions, L_out, vis, embed, mask_rows, x)


for _dt, _emb in (("float32", float32[:, ::1]), ("uint16", uint16[:, ::1])):
    _stage = (_I64_1, _I64_1, _I64_1, uint8[::1], _emb, float32[:, ::1], float32[:, ::1])
    register_ptx(_stage_draft_kernel(_dt), (_I64_1, _I32_1, _I64_1, _I64_1, int32, int32) + _stage,
                 name=f"stage_draft[{_dt}]")
    register_ptx(_gather_accepted_kernel(_dt),
                 (float32[:, :, ::1], _I32_2, _I32_1, _I64_1, _I64_1, float32[:, ::1], _I32_1, _I64_1) + _stage,
                 name=f"gather_accepted[{_dt}]")


@cuda.jit
def step_commit(accepted, n_accepted, bonus, choice, L, root, record, seq):
    """End of a DDTree step on the device: record[seq & 1] = [n, choice[accepted[0, 0..n-1]]] (the tokens
    this step commits, which the host reads), seq += 1, L += n, root = bonus (the next step's root). The
    two record rows alternate, so that a step launched before the host has read its predecessor's row
    writes the other one. One block."""
    grid_dependency_wait()
    n = n_accepted[0]
    r = seq[0] & 1
    for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        record[r, 1 + i] = choice[accepted[0, i]]
    cuda.threadfence_system()  # this thread's tokens reach the host before the count (KDT_STEP_END=flag polls it)
    cuda.syncthreads()  # every thread has read seq and fenced before thread 0 moves it on
    if cuda.threadIdx.x == 0:
        record[r, 0] = n
        root[0] = bonus[0]
        L[0] = L[0] + n
        seq[0] = seq[0] + 1


register_ptx(step_commit, (_I32_2, _I32_1, _I64_1, _I64_1, _I64_1, _I64_1, _I64_2, _I64_1))


ORACLE_PAD = 64  # the device oracle's sequence runs this far past the context's end (depths D <= ORACLE_PAD)
_ORACLE_NT = 256


@cuda.jit
def oracle_draft(sequence, L, cols, logp, V, out_tok, out_logp):
    """The noiseless oracle's draft inside the step program (:class:`kdt.drafters.OracleDrafter`, ``on_device``):
    out_tok[0, d, j] = (sequence[L + 1 + d] + cols[d, j]) % V, out_logp[0, d, j] = logp[d, j].
    sequence [max_len + ORACLE_PAD] int64 (prompt, true continuation, then random tokens); L [1] int64, the
    cached prefix (the context is it and the root: L + 1 tokens); cols / logp [D, K] (int64 / float32): the
    drafter's column offsets and log-probabilities; out [1, D, K]. A grid-stride loop over the D K entries."""
    grid_dependency_wait()
    D, K = cols.shape
    n = L[0] + 1
    for i in range(cuda.grid(1), D * K, cuda.gridsize(1)):
        d = i // K
        j = i - d * K
        out_tok[0, d, j] = (sequence[n + d] + cols[d, j]) % V
        out_logp[0, d, j] = logp[d, j]


register_ptx(oracle_draft, (_I64_1, _I64_1, _I64_2, float32[:, ::1], int64, int64[:, :, ::1], float32[:, :, ::1]))


def oracle_draft_gpu(sequence, L, cols, logp, out_tok, out_logp, vocab_size: int, stream=0) -> None:
    """:func:`oracle_draft` (device arrays): cols / logp [D, K] -> out_tok / out_logp [1, D, K]."""
    D, K = cols.shape
    if tuple(logp.shape) != (D, K) or tuple(out_tok.shape) != (1, D, K) or tuple(out_logp.shape) != (1, D, K):
        raise ValueError(f"oracle_draft: cols {tuple(cols.shape)}, logp {tuple(logp.shape)}, "
                         f"out {tuple(out_tok.shape)} / {tuple(out_logp.shape)}: need [D, K] and [1, D, K]")
    if D > ORACLE_PAD:
        raise ValueError(f"oracle_draft: depth {D} > {ORACLE_PAD}")
    oracle_draft[min(cdiv(D * K, _ORACLE_NT), 64), _ORACLE_NT, stream](sequence, L, cols, logp, np.int64(vocab_size),
                                                                     out_tok, out_logp)


def topk_gpu(logits, out_tok, out_logp, stream=0) -> None:
    """:func:`draft_topk`: logits [D, V] (V <= TOPK_MAX_V) -> out_tok / out_logp [1, D, K]."""
    D, V = logits.shape
    if V > TOPK_MAX_V or tuple(out_tok.shape[:2]) != (1, D) or out_tok.shape[2] > V:
        raise ValueError(f"draft_topk: logits {tuple(logits.shape)} (V <= {TOPK_MAX_V}), out {tuple(out_tok.shape)}")
    draft_topk[D, _TOPK_NT, stream](logits, out_tok, out_logp)


# --------------------------------------------------------------------------------------------------
# Python wrappers
# --------------------------------------------------------------------------------------------------


class TreeBuffers(NamedTuple):
    """Outputs of :func:`build_tree_gpu` (device arrays, or numpy arrays for numpy inputs)."""

    tokens: object  # [R, NMAX] int64
    depth: object  # [R, NMAX] int32
    parent: object  # [R, NMAX] int32
    first_child: object  # [R, NMAX] int32
    next_sibling: object  # [R, NMAX] int32
    positions: object  # [R, NMAX] int64
    visibility: object  # [R, NMAX, NMAX] uint8
    n_nodes: object  # [R] int32


class AcceptBuffers(NamedTuple):
    """Outputs of :func:`accept_gpu`."""

    accepted: object  # [R, NMAX] int32, padded with -1
    n_accepted: object  # [R] int32, 1 + a
    bonus: object  # [R] int64


def _is_device(a) -> bool:
    return hasattr(a, "copy_to_host")


def _dev(a, dtype):
    """A device array of ``dtype``: device arrays pass through (dtype checked), host arrays are copied."""
    if _is_device(a):
        if np.dtype(a.dtype) != np.dtype(dtype):
            raise TypeError(f"device array has dtype {a.dtype}, expected {np.dtype(dtype)}")
        return a
    return cuda.to_device(np.ascontiguousarray(a, dtype=dtype))


def _host(bufs):
    return type(bufs)(*(b.copy_to_host() for b in bufs))


def alloc_tree(R: int, nmax: int) -> TreeBuffers:
    """Uninitialised device outputs for :func:`build_tree_gpu`."""
    i64, i32 = np.int64, np.int32
    e = cuda.device_array
    return TreeBuffers(
        e((R, nmax), i64), e((R, nmax), i32), e((R, nmax), i32), e((R, nmax), i32),
        e((R, nmax), i32), e((R, nmax), i64), e((R, nmax, nmax), np.uint8), e(R, i32),
    )  # fmt: skip


def build_tree_gpu(
    root_token, draft_tokens, draft_logp, budget: int, L, out: TreeBuffers | None = None, threads: int | None = None,
    stream=0, warp_max: int | None = None,
) -> TreeBuffers:
    """Launch ``tree_build`` for R requests.

    root_token [R] int64, draft_tokens [R, D, K] int64, draft_logp [R, D, K] float32, L [R] int64,
    budget <= MAX_BUDGET. ``out`` (device arrays, NMAX >= budget + 1) defaults to NMAX = budget + 1.
    ``threads`` per block (default 128; the simulator runs the warp search only with exactly 32, as the
    kernel tests ask: there it is ~25x slower than the heap, 5 s for a budget-16 tree);
    trees (K >= 2) of budgets <= ``warp_max`` (default :data:`WARP_SEARCH_MAX`; -1: none) search in one warp.
    Returns device arrays if every input is a device array, else numpy arrays (after a sync).
    """
    ins = (root_token, draft_tokens, draft_logp, L)
    host = not all(_is_device(a) for a in ins)
    if not 0 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget must be in [0, {MAX_BUDGET}], got {budget}")
    if len(draft_tokens.shape) != 3 or tuple(draft_tokens.shape) != tuple(draft_logp.shape):
        raise ValueError(f"draft_tokens {draft_tokens.shape} / draft_logp {draft_logp.shape}: need [R, D, K]")
    R, D, K = draft_tokens.shape
    if D < 1 or K < 1 or tuple(root_token.shape) != (R,) or tuple(L.shape) != (R,):
        raise ValueError(f"need D, K >= 1 and root_token, L of shape [{R}], got D={D} K={K}")
    if out is None:
        out = alloc_tree(R, budget + 1)
    nmax = out.tokens.shape[1]
    if nmax < budget + 1 or tuple(out.tokens.shape) != (R, nmax):
        raise ValueError(
            f"outputs [{R}, NMAX] need NMAX >= budget + 1 = {budget + 1}, got {out.tokens.shape}"
        )
    threads = threads or 128
    tree_build[R, threads, stream](
        _dev(root_token, np.int64), _dev(draft_tokens, np.int64), _dev(draft_logp, np.float32),
        np.int32(budget), np.int32(WARP_SEARCH_MAX if warp_max is None else warp_max), _dev(L, np.int64), *out,
    )  # fmt: skip
    return _host(out) if host else out


def accept_gpu(
    first_child,
    next_sibling,
    tokens,
    target_choice,
    n_nodes,
    out: AcceptBuffers | None = None,
    threads: int = 128,
    stream=0,
) -> AcceptBuffers:
    """Launch ``tree_accept``: first_child / next_sibling [R, NMAX] int32, tokens / target_choice
    [R, NMAX] int64, n_nodes [R] int32. Device outputs for device inputs, else numpy."""
    ins = (first_child, next_sibling, tokens, target_choice, n_nodes)
    host = not all(_is_device(a) for a in ins)
    R, nmax = tokens.shape
    for a in ins[:-1]:
        if tuple(a.shape) != (R, nmax):
            raise ValueError(f"tree arrays must all be [{R}, {nmax}], got {a.shape}")
    if out is None:
        out = AcceptBuffers(
            cuda.device_array((R, nmax), np.int32), cuda.device_array(R, np.int32),
            cuda.device_array(R, np.int64),
        )  # fmt: skip
    tree_accept[R, threads, stream](
        _dev(first_child, np.int32), _dev(next_sibling, np.int32), _dev(tokens, np.int64),
        _dev(target_choice, np.int64), _dev(n_nodes, np.int32), *out,
    )  # fmt: skip
    return _host(out) if host else out


def compact_gpu(c_kv, k_pe, L, accepted, n_acc, threads: int = 256, stream=0, kv_hl=None) -> None:
    """Compact ``c_kv [n_layers, max_len, Rkv]``, ``k_pe [n_layers, max_len, dr]`` and, unless None, the pre-split
    ``kv_hl [n_layers, max_len, Rkv + dr]`` (uint32, kdt.kernels.mla.kv_hl_np's words) in place:
    slot ``L + accepted[i]`` -> ``L + i`` for ``i < n_acc``. ``L`` (int64) and ``n_acc`` (int32) are
    ints or one-element device arrays (then the launch never depends on them: a CUDA graph can replay
    it). Device caches are updated on the device (no sync); numpy caches are copied in and back."""
    n_layers, max_len, rkv = c_kv.shape
    if k_pe.shape[:2] != (n_layers, max_len):
        raise ValueError(f"c_kv {c_kv.shape} and k_pe {k_pe.shape} differ in layers / slots")
    if kv_hl is not None and tuple(kv_hl.shape) != (n_layers, max_len, rkv + k_pe.shape[2]):
        raise ValueError(f"kv_hl {tuple(kv_hl.shape)}: need [{n_layers}, {max_len}, {rkv + k_pe.shape[2]}]")
    if isinstance(L, (int, np.integer)) and isinstance(n_acc, (int, np.integer)):
        if not 1 <= n_acc <= accepted.shape[0] or L + n_acc > max_len:
            raise ValueError(f"n_acc={n_acc} must be in [1, {accepted.shape[0]}] and L + n_acc <= {max_len}")
    caches = (c_kv, k_pe) + (() if kv_hl is None else (kv_hl,))
    dev = [_dev(c_kv, c_kv.dtype), _dev(k_pe, k_pe.dtype)] + ([] if kv_hl is None else [_dev(kv_hl, np.uint32)])
    d_hl = dev[2] if kv_hl is not None else _no_kv_hl()
    total = n_layers * (rkv + k_pe.shape[2] + d_hl.shape[2])
    kv_compact[cdiv(total, threads), threads, stream](
        dev[0], dev[1], d_hl, device_scalar(L, np.int64), _dev(accepted, np.int32), device_scalar(n_acc, np.int32)
    )
    for a, d in zip(caches, dev, strict=True):
        if not _is_device(a):
            d.copy_to_host(a)
