"""What each launch of a DDTree step costs inside a CUDA graph (run on a GPU; not a test, not a benchmark).

    python scripts/profile_graphs.py [--model fixtures/model_code.h5] [--budget 16] [--prompt-len 128] [--json F]
    python scripts/profile_graphs.py --model fixtures/model_tiny.h5 --dtype float32 --budget 7   # the oracle chain
    python scripts/profile_graphs.py --preset moonlight-16b-a3b --budget 7   # random weights drawn on the device

The engine replays a greedy step from one CUDA graph, where a launch costs its kernel plus the graph's gap
to the next node; eager profiles (scripts/profile_kernels.py) see neither. This script times:

1. whole programs, each captured alone and replayed: the AR step, the DDTree step at ``--budget`` (the fixture's
   learned drafter, or an oracle drafter: the greedy continuation, drafted on the host), the target's forward of
   1 and budget + 1 tokens, the learned drafter's forward and its top-k, the tree build;
2. every launch of the AR step and of the DDTree step, each captured ``--reps`` times in a graph of its own:
   its in-graph time per launch, and their sum by phase (drafter forward, top-k, tree, target forward, rest);
3. an empty kernel ``--reps`` times: the least a launch costs in a graph.

``--pdl-ab``: every whole program is also timed captured without programmatic dependent launch (the same kernels;
kdt.kernels.common's PDL section). ``--combine-in-ab``: also with the one-token attention's combine in its launch
switched (kdt.kernels.mla.COMBINE_IN_MAX_M: on if the environment left it off, else off). ``--absorb-tc-ab``: also
with q_absorb's absorb on its FMA kernel where it runs on tensor cores (kdt.kernels.mla.QABS_TC_MIN_M = 0).
``--moe-fo-ab``: every MoE layer keeps its experts' fragment-ordered copy (kdt.kernels.moe.MoEWeights.fragment_order),
and each whole program is also timed with kdt.kernels.moe.TC_FO switched: where it is on (the default) with the
natural order and the tensor cores from TC_MIN_M tokens (session 43's kernels), where it is off with the copy.
``--attn-fo-ab``: every layer keeps qkv_a's and o_proj's fragment-ordered copies (kdt.engine.cuda_model.LayerWeights.
fragment_order), and each whole program is also timed with kdt.engine.cuda_model.ATTN_FO switched.
``--tiles-ab``: also with the tensor-core GEMMs' token tiles a block switched (kdt.kernels.tc.TILES_FIT: off, up to
4 tiles a block past 32 tokens, or on, 3 where they pad less: 65 tokens in blocks of 24). ``--ab
kdt.kernels.linear.TC_WIDE_BLOCKS=0[,MODULE.NAME=VALUE..]`` (repeatable: a column each): also with those module
constants set to those values (ints, or text) together. A switched program's kernels first run once outside a
graph (they compile there, not while a graph is captured).

Replays would change the state: each step commits tokens, so L would grow by thousands over the replays and
the attention would be timed at a prefix far longer than the run's (session 19's profiles: the budget-31 verify's
attention read 11.6 us at M = 32 with L in the thousands). So every timed graph starts with one small launch that
puts the step's device scalars (the target's L, the drafter's context length and pending rows) back to their values
after the warm-up: about prompt + 50 (``--prompt-len``); that launch's own time (a second restore's) is measured
and taken off. The tokens decoded are garbage after the first replay, which does not change what the launches cost.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections import defaultdict

import numpy as np
from numba import cuda
from numba.cuda import dispatcher as nd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from profile_kernels import PhaseTags, _noop  # noqa: E402  (scripts/, this script's folder, is on sys.path)

from kdt.config import preset  # noqa: E402
from kdt.drafters import OracleDrafter, learned_drafter  # noqa: E402
from kdt.engine import cuda_model as cmod  # noqa: E402
from kdt.engine import load_target  # noqa: E402
from kdt.engine.cuda_model import ForwardGraphs  # noqa: E402
from kdt.fixture import read_fixture  # noqa: E402
from kdt.kernels import ddtree as kd  # noqa: E402
from kdt.kernels import mla, moe, tc  # noqa: E402
from kdt.kernels.common import pdl_launches, set_pdl_launch  # noqa: E402
from kdt.reference.decode import generate  # noqa: E402


@cuda.jit
def _pin(L, L0, L_ctx, L_ctx0, n_ctx, n_ctx0, dL, dL0):
    """The step's device scalars back to their saved values (one thread)."""
    L[0] = L0[0]
    L_ctx[0] = L_ctx0[0]
    n_ctx[0] = n_ctx0[0]
    dL[0] = dL0[0]


class Pin:
    """The device scalars a step advances, saved now; ``launch(s)`` enqueues their restore."""

    def __init__(self, target, drafter):
        dm = getattr(drafter, "model", None)
        pairs = [target.buf.L, dm.L_ctx, dm.n_ctx, dm.buf.L] if dm is not None else [target.buf.L] + [
            cuda.to_device(np.zeros(1, np.int64)) for _ in range(3)]
        self.args = [a for d in pairs for a in (d, cuda.to_device(d.copy_to_host()))]
        self.L = int(target.buf.L.copy_to_host()[0])
        self.pin_us = 0.0

    def launch(self, s) -> None:
        _pin[1, 1, s](*self.args)


PIN: Pin | None = None  # set by main(); graph_us puts the state back before every replay


def graph_us(launch, n: int = 50) -> float:
    """Microseconds of GPU time a replay of the graph of ``launch(stream)`` takes (median of 3 runs of n), the
    graph led by PIN's restore when set (its own cost, ``PIN.pin_us``, taken off)."""

    def program(key, stream=0):
        if PIN is not None:
            PIN.launch(stream)
        launch(stream)

    g = ForwardGraphs(program)
    g.run(0)  # direct (compiles)
    g.run(0)  # captured, replayed
    cuda.synchronize()
    runs = []
    for _ in range(3):
        e0, e1 = cuda.event(timing=True), cuda.event(timing=True)
        e0.record()
        for _ in range(n):
            g.run(0)
        e1.record()
        e1.synchronize()
        runs.append(cuda.event_elapsed_time(e0, e1) * 1e3 / n)
    return float(np.median(runs)) - (PIN.pin_us if PIN is not None else 0.0)


class Recorder:
    """During :meth:`record`, every kernel launch is recorded (dispatcher, grid, block, shared memory, args, phase)
    and run; the phase comes from profile_kernels.PhaseTags (the step phase the launch belongs to)."""

    def __init__(self):
        self.launches: list[tuple] = []
        self.phase = "rest"

    def record(self, fn, target, drafter) -> None:
        """Run ``fn()`` with its launches recorded, tagged by the phases of ``target`` and ``drafter``."""
        orig = nd._LaunchConfiguration.__call__

        def call(lc, *args):
            self.launches.append((lc.dispatcher, lc.griddim, lc.blockdim, lc.sharedmem, args, self.phase))
            return orig(lc, *args)

        tags = PhaseTags(self, target, drafter)
        nd._LaunchConfiguration.__call__ = call
        try:
            fn()
            cuda.synchronize()
        finally:
            nd._LaunchConfiguration.__call__ = orig
            tags.remove()


def per_launch(program, target, drafter, reps: int, title: str) -> dict:
    """Every launch of ``program()`` timed alone in a graph of ``reps`` copies; printed, and their sums by phase."""
    rec = Recorder()
    rec.record(program, target, drafter)
    print(f"== every launch of the {title}, {reps} copies a graph (in-graph us per launch)")
    rows, by_phase = [], defaultdict(lambda: [0, 0.0])
    for i, (disp, grid, block, shmem, kargs, phase) in enumerate(rec.launches):
        def launch(s, disp=disp, grid=grid, block=block, shmem=shmem, kargs=kargs):
            for _ in range(reps):
                disp[grid, block, s, shmem](*kargs)
        us = graph_us(launch, n=20) / reps
        name = disp.py_func.__name__
        rows.append({"i": i, "phase": phase, "kernel": name, "grid": list(grid), "block": list(block),
                     "us": round(us, 2)})
        by_phase[phase][0] += 1
        by_phase[phase][1] += us
        print(f"  {i:3d} {phase:16s} {name:28s} grid {str(tuple(grid)):14s} block {block[0]:4d}  {us:6.2f}")
    print(f"== {title} by phase (sum of the launches' in-graph times)")
    for p, (c, u) in by_phase.items():
        print(f"  {p:16s} {c:3d} launches {u:8.2f} us")
    print(f"  all              {len(rows):3d} launches {sum(r['us'] for r in rows):8.2f} us")
    return {"launches": rows, "by_phase": {p: {"launches": c, "us": round(u, 2)} for p, (c, u) in by_phase.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="fixtures/model_code.h5")
    ap.add_argument("--preset", default=None, help="instead of --model: a preset's shape with random weights "
                    "(moonlight-16b-a3b, kimi-k2 ...; the oracle drafter)")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--drafter", default="auto", help="auto (the fixture's learned drafter, else the oracle) | oracle")
    ap.add_argument("--block-size", type=int, default=8, help="the oracle's block (tree depth + 1)")
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--reps", type=int, default=16, help="copies of a launch in its graph")
    ap.add_argument("--prompt-len", type=int, default=128,
                    help="prompt tokens: every timed replay runs at the L the warm-up leaves, about prompt + 50 "
                    "(issue 8's table: L 64..256)")
    ap.add_argument("--launches", default="all", choices=("all", "ar", "step", "none"),
                    help="which steps to time launch by launch (all: the AR and the DDTree step; step: the DDTree "
                    "step alone)")
    ap.add_argument("--pdl-ab", action="store_true",
                    help="also time each whole program captured without PDL (kdt.kernels.common: the same kernels)")
    ap.add_argument("--combine-in-ab", action="store_true",
                    help="also time each whole program with the one-token attention's combine in its launch switched "
                    "(kdt.kernels.mla.COMBINE_IN_MAX_M)")
    ap.add_argument("--absorb-tc-ab", action="store_true",
                    help="also time each whole program with q_absorb's absorb on FMA tiles where it runs on tensor "
                    "cores (kdt.kernels.mla.QABS_TC_MIN_M = 0)")
    ap.add_argument("--moe-fo-ab", action="store_true",
                    help="also time each whole program with the MoE's routed GEMMs on the experts in fragment order "
                    "or, where the default already does, in the natural order (kdt.kernels.moe.TC_FO switched; each "
                    "layer keeps both orders)")
    ap.add_argument("--attn-fo-ab", action="store_true",
                    help="also time each whole program with the attention's qkv_a and o_proj on their fragment-ordered "
                    "copies switched (kdt.engine.cuda_model.ATTN_FO; each layer keeps both orders)")
    ap.add_argument("--tiles-ab", action="store_true",
                    help="also time each whole program with the tensor-core GEMMs' token tiles a block switched "
                    "(kdt.kernels.tc.TILES_FIT)")
    ap.add_argument("--ab", action="append", default=[], metavar="MODULE.NAME=VALUE[,..]",
                    help="also time each whole program with these module constants set (repeatable: a column each)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    if args.preset:
        fx, cfg, weights = None, preset(args.preset), None
        args.model = f"preset {args.preset}"
    else:
        fx = read_fixture(args.model)
        cfg, weights = fx.config, fx.weights
    learned = fx is not None and fx.drafter is not None and args.drafter != "oracle"
    B = fx.drafter.config.block_size if learned else args.block_size
    target = load_target(cfg, weights, "cuda", args.dtype, max_len=4096, max_tokens=256)
    if args.moe_fo_ab:  # (before the warm-up below captures the programs)
        kept = [lw.moe.fragment_order() for lw in target.layers if lw.moe is not None]
        print(f"fragment-ordered experts kept in {sum(kept)} of {len(kept)} MoE layers")
    if args.attn_fo_ab:
        kept = [lw.fragment_order() for lw in target.layers]
        print(f"fragment-ordered qkv_a and o_proj kept in {sum(kept)} of {len(kept)} layers")
    with open(__file__, "rb") as f:
        prompt = [b % cfg.vocab_size for b in f.read(args.prompt_len)]
    if learned:
        drafter = learned_drafter(fx, 4096, target)
    else:  # the oracle: the greedy continuation, drafted on the host into mapped memory
        cont = generate(target, prompt, 256, budget=0).tokens
        drafter = OracleDrafter(np.concatenate([prompt, cont]), cfg.vocab_size)
    for budget in (0, args.budget):  # compiles, captures every program, leaves a warm step behind
        generate(target, prompt, 48, drafter=drafter if budget else None, budget=budget, block_size=B)
    ops = target.tree_ops
    dm = drafter.model if learned else None
    step_ar, step = ops.device_step(None), ops.device_step(drafter)
    D, K = B - 1, min(args.budget, cfg.vocab_size)  # as generate() drafts: block_size - 1 depths, K = budget
    key = (args.budget, D, K, learned)
    n = min(args.budget, D * K) + 1
    d_tok, d_logp = ops.draft_buffers(D, K, mapped=not learned)
    t, b = ops.tree, target.buf
    kind = "learned" if learned else "oracle"
    global PIN
    PIN = Pin(target, drafter)
    out: dict = {"model": args.model, "dtype": args.dtype, "drafter": kind, "budget": args.budget,
                 "block_size": B, "reps": args.reps, "L": PIN.L}

    whole = {
        "AR step": lambda s: step_ar._program((0, 1, 1, False), s),
        f"{kind} step (budget {args.budget})": lambda s: step._program(key, s),
        "target forward M=1": lambda s: target._program(1, s),
        f"target forward M={n}": lambda s: target._program(n, s),
    }
    if learned:
        whole["drafter forward (2B rows)"] = lambda s: dm.step_program(s)
        whole["draft top-k"] = lambda s: kd.topk_gpu(dm.buf.logits[:D], d_tok, d_logp, stream=s)
    whole[f"tree build (budget {args.budget})"] = lambda s: kd.build_tree_gpu(ops.root, d_tok, d_logp, args.budget,
                                                                             b.L, out=t, stream=s)
    whole[f"empty kernel x{args.reps}"] = lambda s: [_noop[1, 32, s]() for _ in range(args.reps)]
    # the restore's own cost: a second restore's (a graph of the restore alone also holds the graph's fixed cost)
    PIN.pin_us = graph_us(PIN.launch) - graph_us(lambda s: None)  # (pin_us is 0 while it is measured)
    out["pin_us"] = round(PIN.pin_us, 2)
    out["programs_us"] = {}
    print(f"== whole programs, one graph each ({args.model}, {args.dtype}, {kind} drafter, block {B}, L = {PIN.L};"
          f" the state's restore, {PIN.pin_us:.2f} us, taken off)")
    pdl = pdl_launches()
    ci = mla.COMBINE_IN_MAX_M
    switches = []  # (key in out, column label, setter(on): the setting switched on / back)

    def compile_outside_capture(switch) -> None:
        """Run every whole program once with ``switch`` on: its kernels compile here, not while a graph is captured."""
        switch(True)
        for fn in whole.values():
            fn(0)
        cuda.synchronize()
        switch(False)

    if args.pdl_ab:
        switches.append(("programs_us_no_pdl", "no PDL", lambda on: set_pdl_launch(pdl and not on)))
    if args.combine_in_ab:
        switches.append((f"programs_us_combine_in_{int(not ci)}", f"ci {int(not ci)}",
                          lambda on: setattr(mla, "COMBINE_IN_MAX_M", int(not ci) if on else ci)))
    if args.absorb_tc_ab:
        qa = mla.QABS_TC_MIN_M
        switches.append(("programs_us_absorb_fma", "abs FMA",
                         lambda on: setattr(mla, "QABS_TC_MIN_M", 0 if on else qa)))
    if args.moe_fo_ab:
        fo, other = moe.TC_FO, "0" if moe.TC_FO != "0" else "1"
        switches.append((f"programs_us_moe_fo_{other}", f"fo {other}",
                         lambda on: setattr(moe, "TC_FO", other if on else fo)))
    if args.attn_fo_ab:
        afo = cmod.ATTN_FO
        switches.append((f"programs_us_attn_fo_{int(not afo)}", f"afo {int(not afo)}",
                         lambda on: setattr(cmod, "ATTN_FO", (not afo) if on else afo)))
        compile_outside_capture(switches[-1][2])
    if args.tiles_ab:
        fit = tc.TILES_FIT
        switches.append((f"programs_us_tiles_fit_{int(not fit)}", f"fit {int(not fit)}",
                         lambda on: setattr(tc, "TILES_FIT", (not fit) if on else fit)))
        compile_outside_capture(switches[-1][2])
    for spec in args.ab:  # one column: every MODULE.NAME=VALUE of the comma-separated spec set together
        sets = []
        for item in spec.split(","):
            name, _, value = item.partition("=")
            mod, _, attr = name.rpartition(".")
            module = importlib.import_module(mod)
            sets.append((module, attr, int(value) if value.lstrip("-").isdigit() else value, getattr(module, attr)))
        label = "+".join(f"{attr}={value!s}" for _, attr, value, _ in sets)
        switches.append((f"programs_us_{label}", label if len(sets) == 1 else f"set {len(switches) + 1}",
                         lambda on, sets=sets: [setattr(m, a, n if on else o) for m, a, n, o in sets]))
        compile_outside_capture(switches[-1][2])
    widths = [max(8, len(label)) for _, label, _ in switches]
    if switches:
        print(f"  {'':34s} {('PDL' if pdl else 'no PDL') + f', ci {int(bool(ci))}':>12s} "
              + " ".join(f"{label:>{w}s}" for (_, label, _), w in zip(switches, widths, strict=True)))
    for col, _, _ in switches:  # (not `key`: the step's lambda above reads that name when it runs)
        out[col] = {}
    for name, fn in whole.items():
        us = graph_us(fn)
        out["programs_us"][name] = round(us, 2)
        cols = []
        for col, _, switch in switches:
            switch(True)
            cols.append(out[col].setdefault(name, round(graph_us(fn), 2)))
            switch(False)
        print(f"  {name:34s} {us:12.2f} " + " ".join(f"{c:{w}.2f}" for c, w in zip(cols, widths, strict=True)) + " us")
    out["pdl"] = pdl
    out["combine_in_max_m"] = ci
    floor = out["programs_us"][f"empty kernel x{args.reps}"] / args.reps
    print(f"  an empty launch in a graph: {floor:.2f} us")

    steps = (("AR step", lambda: step_ar._program((0, 1, 1, False), 0)),
             (f"{kind} step (budget {args.budget})", lambda: step._program(key, 0)))
    for name, program in [steps[i] for i in {"all": (0, 1), "ar": (0,), "step": (1,), "none": ()}[args.launches]]:
        out[name] = per_launch(program, target, drafter, args.reps, name)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
