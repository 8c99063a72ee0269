"""Faster compiles of kernels that inline big device functions: one copy of a callee's scope, not one a block.

numba-cuda's ``InlineWorker.inline_ir`` (``inline=True`` device functions, inlined in numba's IR before typing)
copies the callee's IR twice, each time block by block: ``{label: copy.deepcopy(block)}``, a fresh memo every
block. Every variable holds the function's scope, and the scope holds every variable, so each block copies the
whole scope again: blocks x variables objects, twice. The MoE route kernel's body (340 blocks, 3480 variables) took
5 of its 10 s compile there (numba-cuda 0.30.4, sm_90 PTX on this machine's CPU).

:func:`install` wraps ``inline_ir`` so that, during one call, the blocks of one scope share one memo: what a single
deepcopy of the whole block map would return, each object copied once and shared where the original shares it.
The PTX is the same but for numba's per-compile names (``python -m kdt.kernels.inline_copy``: every registered
kernel both ways, :func:`normalized_ptx`). ``KDT_INLINE_MEMO=0`` turns it off; a numba-cuda without these internals
compiles as before.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import sys
import time

_installed = False
enabled = True  # read at each inline_ir call (the check below compiles both ways in one process)
shared_calls = 0  # inline_ir calls that ran with the shared memo


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
    """Wrap numba-cuda's ``InlineWorker.inline_ir`` (see the module docstring). Returns whether it is on."""
    global _installed
    if _installed:
        return True
    if os.environ.get("KDT_INLINE_MEMO", "1") == "0":
        return False
    try:
        from numba.cuda.core import inline_closurecall as icc
        from numba.cuda.core import ir
    except ImportError:
        return False
    if getattr(icc, "copy", None) is not copy or not hasattr(icc.InlineWorker, "inline_ir"):
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

    icc.InlineWorker.inline_ir = inline_ir
    _installed = True
    return True


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
    of these names) for sm_90 with the shared memo off, then on; exit 1 if any PTX differs, or if the shared memo
    does not copy a function's scope once (:func:`scope_copies`)."""
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
    registry = registry_shard(shard, n_shards, "python -m kdt.kernels.inline_copy")
    if registry is None:
        return 2
    from numba import cuda

    global enabled
    if not install():
        print("the shared memo cannot be installed here (KDT_INLINE_MEMO=0, or another numba-cuda)", file=sys.stderr)
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
            enabled = on
            t0 = time.perf_counter()
            ptx.append(normalized_ptx(cuda.compile_ptx(fn, sig, cc=(9, 0), device=device)[0]))
            secs.append(time.perf_counter() - t0)
        total = [a + b for a, b in zip(total, secs, strict=True)]
        same = ptx[0] == ptx[1]
        bad += not same
        print(f"{name:48s} {'same' if same else 'DIFFERS'}  off {secs[0]:6.2f} s  on {secs[1]:6.2f} s", flush=True)
    enabled = True
    print(f"{len(entries) - bad}/{len(entries)} kernels: the same PTX; compile off {total[0]:.1f} s, "
          f"on {total[1]:.1f} s ({shared_calls} inlined calls with the shared memo)")
    return 1 if bad else 0


if __name__ == "__main__":  # (the imported module's main: its ``enabled`` is the one its wrapper reads)
    from kdt.kernels import inline_copy

    sys.exit(inline_copy.main())
