"""Faster numba compiles of kdt's kernels: five changes to numba-cuda's front end, the same PTX.

kdt's kernels inline big device functions (``inline=True``, inlined in numba's IR before typing), nested up to ~11
calls deep in the tensor-core kernels. numba-cuda 0.30.4's front end grows faster than linearly with that, in five
places; :func:`install` changes each (on this machine's CPU, sm_90 PTX):

1. **Copying a callee.** ``InlineWorker.inline_ir`` copies the callee's IR twice, each time block by block:
   ``{label: copy.deepcopy(block)}``, a fresh memo every block. Every variable holds the function's scope, and the
   scope holds every variable, so each block copies the whole scope again: blocks x variables objects, twice (the MoE
   route kernel's body, 340 blocks and 3480 variables, took 5 of its 10 s compile there). The wrapper lets the blocks
   of one scope share one memo during a call: what one deepcopy of the whole block map would return.
2. **Bottom-up inlining.** ``InlineWorker.inline_function`` runs the callee's untyped passes, whose own inlining pass
   has inlined the callee's callees, and then copies that whole IR into the caller. A statement d calls deep is
   copied 2d times, and every level post-processes everything below it. Here the callee's untyped passes leave out
   their inlining pass; the caller's inlining pass, which puts the blocks it inlined back on its work list, inlines
   the callee's calls next, into the caller. The typed path (``arg_typs``) and overload inlining keep numba's order.
3. **Liveness.** ``compute_live_map`` (every post-processing of the IR, and dead-code removal) sweeps all blocks in
   their dict order until no set grows. Inlined blocks are numbered after the caller's, so the order runs against
   the control flow and takes many sweeps of set unions over thousands of variables. :func:`live_map` finds the same
   least fixed points with a work list in reverse post-order (reaching definitions, forward) and post-order
   (liveness, backward).
4. **SSA.** ``reconstruct_ssa`` takes the variables assigned more than once one at a time, and for each walks every
   statement of the function twice (new names for its definitions, then each use to the definition that reaches
   it): variables x statements (~200 x 10,000 in the attention kernels). Both walks change only the statements that
   name the variable (and find a use's definition among those), so here they walk only those and each block's last
   statement, in numba's order (so the new names come out the same); each block is rebuilt fresh with the rest in
   place, as numba's walk rebuilds it.
5. **Registers for locals.** Lowering's ``_find_singly_assigned_variable`` scans a variable's whole block for its
   assignments once for each variable assigned there; here each block's assignments are counted once.

The PTX is the same but for numba's per-compile names: ``python -m kdt.kernels.fast_compile`` compiles registered
kernels both ways and compares them (:func:`normalized_ptx`), and checks each live map against numba's.
``KDT_FAST_COMPILE=0`` turns all five off; a numba-cuda without these internals compiles as before.
"""

from __future__ import annotations

import collections
import copy
import functools
import heapq
import os
import re
import sys
import time

_installed = False
enabled = True  # read at each call (the check below compiles both ways in one process)
shared_calls = 0  # inline_ir calls that ran with the shared memo
top_down_calls = 0  # inline_function calls that left the callee's own inlining to the caller
live_maps = 0  # live maps found by the work list
check_live = False  # also run numba's compute_live_map and count the maps that differ (the check below)
live_maps_differ = 0
check_seconds = 0.0  # time in numba's compute_live_map for that check (left out of the check's "on" times)
ssa_statements_skipped = 0  # statements the SSA walks of a variable left out (they do not name it)
# during one SSA reconstruction: id(statement) -> (statement, the names it holds); block label -> the names its
# statements held at the start
_ssa_names: dict | None = None
_ssa_block_names: dict | None = None


class _SharedBlockMemo:
    """Stands for the ``copy`` module in numba-cuda's inline_closurecall during one ``inline_ir`` call: a block
    deep-copied without a memo takes its scope's memo (one per scope object, so the call's second copy, of the
    first copy's blocks, is a copy of its own)."""

    def __init__(self, block_type):
        self.block_type = block_type
        self.memos: dict[int, dict] = {}

    def deepcopy(self, x, memo=None):
        if memo is None and isinstance(x, self.block_type):
            memo = self.memos.setdefault(id(x.scope), {})
        return copy.deepcopy(x, memo)

    def __getattr__(self, name):  # copy.copy and the rest: the module's own
        return getattr(copy, name)


def install() -> bool:
    """Wrap numba-cuda's ``InlineWorker.inline_ir`` and ``inline_function``, its SSA reconstruction's block walks and
    lowering's ``_find_singly_assigned_variable``, and replace its ``compute_live_map`` (see the module docstring).
    Returns whether it is on."""
    global _installed
    if _installed:
        return True
    if os.environ.get("KDT_FAST_COMPILE", "1") == "0":
        return False
    try:
        from numba.cuda import lowering
        from numba.cuda.core import analysis, ir, ir_utils, ssa
        from numba.cuda.core import inline_closurecall as icc
        from numba.cuda.core.untyped_passes import InlineInlinables  # noqa: F401  (used by the pipeline below)
    except ImportError:
        return False
    worker = icc.InlineWorker
    if (getattr(icc, "copy", None) is not copy or not all(hasattr(worker, f) for f in ("inline_ir", "inline_function"))
            or not all(hasattr(m, "compute_live_map") for m in (analysis, ir_utils))
            or not all(hasattr(ssa, f) for f in ("_run_ssa", "_run_block_rewrite"))
            or not hasattr(lowering.Lower, "_find_singly_assigned_variable")):
        return False  # not the code this was written for
    inner = icc.InlineWorker.inline_ir

    @functools.wraps(inner)
    def inline_ir(self, *args, **kwargs):
        global shared_calls
        if not enabled:
            return inner(self, *args, **kwargs)
        shared_calls += 1
        saved = icc.copy
        icc.copy = _SharedBlockMemo(ir.Block)
        try:
            return inner(self, *args, **kwargs)
        finally:
            icc.copy = saved

    inline_function = icc.InlineWorker.inline_function

    @functools.wraps(inline_function)
    def inline_function_top_down(self, *args, **kwargs):
        global top_down_calls
        if not enabled or kwargs.get("arg_typs", args[4] if len(args) > 4 else None) is not None:
            return inline_function(self, *args, **kwargs)
        top_down_calls += 1
        saved = self._compiler_pipeline
        self._compiler_pipeline = _untyped_pipeline_without_inlining
        try:
            return inline_function(self, *args, **kwargs)
        finally:
            self._compiler_pipeline = saved

    numba_live_map = analysis.compute_live_map

    @functools.wraps(numba_live_map)
    def compute_live_map(*args):
        global live_maps_differ, check_seconds
        if not enabled:
            return numba_live_map(*args)
        mine = live_map(*args)
        if check_live:
            t0 = time.perf_counter()
            live_maps_differ += mine != numba_live_map(*args)
            check_seconds += time.perf_counter() - t0
        return mine

    numba_run_ssa, numba_block_rewrite = ssa._run_ssa, ssa._run_block_rewrite

    @functools.wraps(numba_run_ssa)
    def run_ssa(blocks):
        global _ssa_names, _ssa_block_names
        if not enabled:
            return numba_run_ssa(blocks)
        saved = _ssa_names, _ssa_block_names
        _ssa_names = {}
        _ssa_block_names = {label: {n for stmt in block.body for n in _statement_names(stmt)}
                            for label, block in blocks.items()}
        try:
            return numba_run_ssa(blocks)
        finally:
            _ssa_names, _ssa_block_names = saved

    @functools.wraps(numba_block_rewrite)
    def block_rewrite(blocks, states, handler):
        global ssa_statements_skipped
        name = states.get("varname")
        if _ssa_names is None or name is None:
            return numba_block_rewrite(blocks, states, handler)
        picked, parts = {}, {}  # label -> the statements the walk takes (and their places)
        for label, block in blocks.items():
            defs = {id(d) for d in states["defmap"].get(label, ())}  # (.get: the walk counts defmap's keys)
            if not defs and name not in _ssa_block_names.get(label, (name,)):
                continue
            at = [i for i, stmt in enumerate(block.body) if id(stmt) in defs or name in _statement_names(stmt)]
            if at:
                if at[-1] != len(block.body) - 1:  # the last statement too: numba's _stmt_index never finds the
                    at.append(len(block.body) - 1)  # last one (range(n)[:-1]), so a walk must end on the same one
                parts[label] = at
                picked[label] = ir.Block(scope=block.scope, loc=block.loc)
                picked[label].body = [block.body[i] for i in at]
        walked = numba_block_rewrite(picked, states, handler)
        out = {}
        for label, block in blocks.items():  # numba's order; a fresh block each, as numba's walk makes
            out[label] = ir.Block(scope=block.scope, loc=block.loc)
            out[label].body = body = list(block.body)
            for i, stmt in zip(parts.get(label, ()), walked[label].body if label in walked else (), strict=True):
                body[i] = stmt
            ssa_statements_skipped += len(body) - len(parts.get(label, ()))
        return out

    numba_singly_assigned = lowering.Lower._find_singly_assigned_variable

    @functools.wraps(numba_singly_assigned)
    def find_singly_assigned_variable(self):
        if not enabled:
            return numba_singly_assigned(self)
        _singly_assigned(self)

    worker.inline_ir = inline_ir
    worker.inline_function = inline_function_top_down
    analysis.compute_live_map = ir_utils.compute_live_map = compute_live_map  # (ir_utils imported it by name)
    ssa._run_ssa, ssa._run_block_rewrite = run_ssa, block_rewrite
    lowering.Lower._find_singly_assigned_variable = find_singly_assigned_variable
    _installed = True
    return True


def _statement_names(stmt) -> set:
    """The variable names a statement holds (its ``list_vars``), once a statement during one SSA reconstruction."""
    got = _ssa_names.get(id(stmt))
    if got is None:
        got = _ssa_names[id(stmt)] = (stmt, {v.name for v in stmt.list_vars()})  # (kept: no id comes back)
    return got[1]


def _singly_assigned(lower) -> None:
    """numba-cuda's ``Lower._find_singly_assigned_variable`` (the variables assigned once, in one block, used only
    there: kept in registers), with each block's assignments counted once instead of scanned again for every
    variable (variables x block size)."""
    from numba.cuda import lowering
    from numba.cuda.core import ir

    blocks = lower.func_ir.blocks
    sav = set()
    if not lower.func_ir.func_id.is_generator:
        use_defs = lowering.compute_use_defs(blocks)
        alloca_vars = lowering.must_use_alloca(blocks)
        assigned_in = collections.defaultdict(set)
        for blk, names in use_defs.defmap.items():
            for var in names:
                assigned_in[var].add(blk)
        used_in = collections.defaultdict(set)
        for blk, names in use_defs.usemap.items():
            for var in names:
                used_in[var].add(blk)
        counts: dict = {}
        for var, where in assigned_in.items():
            if var not in alloca_vars and len(where) == 1 and not used_in[var]:
                [blk] = where
                if blk not in counts:
                    assigns = lower.blocks[blk].find_insts(ir.assign_types)
                    counts[blk] = collections.Counter(s.target.name for s in assigns)
                if counts[blk][var] == 1:
                    sav.add(var)
    lower._singly_assigned_vars = sav
    lower._blk_local_varmap = {}


def _untyped_pipeline_without_inlining(state, name="untyped"):
    """numba's untyped passes less their inlining pass (the caller's inlining pass takes the callee's calls)."""
    from numba.cuda.compiler import DefaultPassBuilder
    from numba.cuda.core.untyped_passes import InlineInlinables

    pm = DefaultPassBuilder.define_untyped_pipeline(state, name)
    pm.passes = [(p, d) for p, d in pm.passes if p is not InlineInlinables]
    pm._finalized = False
    return pm


def live_map(cfg, blocks, var_use_map, var_def_map) -> dict:
    """numba's ``compute_live_map``: the variables live at each block's entry; the same sets, by work lists.

    reach[b] = def[b] | use[b] | reach[p] for each predecessor p (the least fixed point, in reverse post-order);
    live[b] = use[b] | ((live[s] & reach[b]) - def[b]) for each successor s (the least fixed point, in post-order).
    """
    global live_maps
    live_maps += 1
    order = _reverse_post_order(cfg, blocks)
    reach: dict = collections.defaultdict(set)
    for b in var_def_map:
        reach[b] = var_def_map[b] | var_use_map[b]
    live = {b: set(var_use_map[b]) for b in blocks}

    def to_successor(b, s):
        grown = reach[s]
        n = len(grown)
        grown |= reach[b]
        return len(grown) != n

    def to_predecessor(s, p):
        grown = live[p]
        n = len(grown)
        grown |= (live[s] & reach[p]) - var_def_map[p]
        return len(grown) != n

    _fixed_point(order, lambda b: (s for s, _ in cfg.successors(b)), to_successor)
    _fixed_point(order[::-1], lambda s: (p for p, _ in cfg.predecessors(s)), to_predecessor)
    return live


def _reverse_post_order(cfg, blocks) -> list:
    """Every block in reverse post-order of depth-first walks: from the entry, then from each block not yet reached
    (only the order the work lists start in: any order reaches the same fixed points)."""
    seen: set = set()
    post: list = []
    for root in (cfg.entry_point(), *blocks):
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter([s for s, _ in cfg.successors(root)]))]
        while stack:
            node, successors = stack[-1]
            for s in successors:
                if s not in seen:
                    seen.add(s)
                    stack.append((s, iter([t for t, _ in cfg.successors(s)])))
                    break
            else:
                post.append(node)
                stack.pop()
    return post[::-1]


def _fixed_point(order: list, edges, flow) -> None:
    """Visit blocks in ``order`` (a heap of positions): ``flow(b, t)`` for each t of ``edges(b)``, and t again
    (at its position) when that grew its set."""
    position = {b: i for i, b in enumerate(order)}
    heap = list(range(len(order)))
    queued = set(heap)
    while heap:
        i = heapq.heappop(heap)
        queued.discard(i)
        b = order[i]
        for t in edges(b):
            if flow(b, t) and position[t] not in queued:
                heapq.heappush(heap, position[t])
                queued.add(position[t])


def normalized_ptx(ptx: str) -> str:
    """PTX with numba's per-compile names (mangled symbols, which carry a unique suffix, and the numbered shared
    arrays) renamed in order of first appearance: two compiles of one kernel give the same text."""
    ids: dict[str, str] = {}
    return re.sub(r"_Z[A-Za-z0-9_]+|_cudapy_smem_\d+", lambda m: ids.setdefault(m[0], f"ID{len(ids)}"), ptx)


def _sample(n):  # a function of several blocks for scope_copies
    s = 0
    for i in range(n):
        if i % 3:
            s += i
        else:
            s -= i
    return s


def scope_copies(fn=_sample) -> tuple[int, int, int]:
    """(blocks of ``fn``'s numba IR, scope objects that copying them block by block makes with numba's own copy,
    the same with the shared memo). Needs the simulator off."""
    from numba.cuda.core import ir
    from numba.cuda.core.ir_utils import get_ir_of_code

    blocks = list(get_ir_of_code(fn.__globals__, fn.__code__).blocks.values())
    shared = _SharedBlockMemo(ir.Block)
    plain_copies = [copy.deepcopy(b) for b in blocks]  # (kept alive: ids of freed objects come back)
    shared_copies = [shared.deepcopy(b) for b in blocks]
    return len(blocks), len({id(b.scope) for b in plain_copies}), len({id(b.scope) for b in shared_copies})


def main(argv: list[str] | None = None) -> int:
    """Compile registered kernels (``--shard I/N`` as kdt.kernels.compile_check; ``--only NAME``, repeated: those
    of these names) for sm_90 with the changes off, then on; exit 1 if any PTX differs, if the shared memo does not
    copy a function's scope once (:func:`scope_copies`) or if a live map differs from numba's."""
    from kdt.kernels.compile_check import parse_shard, registry_shard

    argv = sys.argv[1:] if argv is None else list(argv)
    only = []
    while "--only" in argv:
        i = argv.index("--only")
        if i + 1 == len(argv):
            print("--only needs a kernel's name", file=sys.stderr)
            return 2
        only.append(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    shard, n_shards = parse_shard(argv)
    registry = registry_shard(shard, n_shards, "python -m kdt.kernels.fast_compile")
    if registry is None:
        return 2
    from numba import cuda

    global enabled, check_live
    if not install():
        print("the changes cannot be installed here (KDT_FAST_COMPILE=0, or another numba-cuda)", file=sys.stderr)
        return 2
    n, plain, shared = scope_copies()
    print(f"a function of {n} blocks: {plain} scope copies block by block, {shared} with the shared memo")
    if shared != 1:
        return 1
    entries = [e for e in registry if not only or e[0] in only]
    if only and len(entries) < len(only):
        missing = sorted(set(only) - {e[0] for e in entries})
        print(f"not in the registry (or not in this shard): {', '.join(missing)}", file=sys.stderr)
        return 2
    bad, total = 0, [0.0, 0.0]
    for name, fn, sig, device in entries:
        ptx, secs = [], []
        for on in (False, True):
            enabled = check_live = on
            t0, c0 = time.perf_counter(), check_seconds
            ptx.append(normalized_ptx(cuda.compile_ptx(fn, sig, cc=(9, 0), device=device)[0]))
            secs.append(time.perf_counter() - t0 - (check_seconds - c0))
        total = [a + b for a, b in zip(total, secs, strict=True)]
        same = ptx[0] == ptx[1]
        bad += not same
        print(f"{name:48s} {'same' if same else 'DIFFERS'}  off {secs[0]:6.2f} s  on {secs[1]:6.2f} s", flush=True)
    enabled, check_live = True, False
    print(f"{len(entries) - bad}/{len(entries)} kernels: the same PTX; compile off {total[0]:.1f} s, "
          f"on {total[1]:.1f} s ({shared_calls} inlined calls with the shared memo, {top_down_calls} top-down)")
    print(f"{live_maps} live maps by the work list, {live_maps_differ} differ from numba's; "
          f"{ssa_statements_skipped} statements left out of SSA walks")
    return 1 if bad or live_maps_differ or not live_maps else 0


if __name__ == "__main__":  # (the imported module's main: its ``enabled`` is the one its wrapper reads)
    from kdt.kernels import fast_compile

    sys.exit(fast_compile.main())
