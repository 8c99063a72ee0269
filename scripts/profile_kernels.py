"""Where the GPU time of a decode step goes, kernel by kernel (run on a GPU; not a test, not a benchmark).

    python scripts/profile_kernels.py [--cases tiny,code,moonlight] [--steps 24] [--top 14]

For each case (model, drafter, budget) it runs greedy ``generate`` twice:
  1. with CUDA graphs (as kdt runs): wall microseconds per step;
  2. without graphs, every kernel launch queued behind a spin kernel and bracketed by CUDA events:
     each kernel's GPU time alone (the spin outlasts the launch's host cost, so the events see the
     kernel, not Python).
``--prefill 2048[,512] [--preset NAME]``: instead, the Moonlight shape's (or the preset's) prefill forward of P
tokens (as ``kdt bench``'s prefill rows time it: one forward, the lm_head of its last row) kernel by kernel, eager,
each launch bracketed as above.

It prints, per case, the kernels per step, their summed GPU time, the graph's wall time per step
and the difference (what launch gaps and the host cost), and the kernels that take the most time;
then the same GPU time by phase of the step (the learned drafter's forward, its top-k, the tree
build, the target's forward, the rest: staging, argmax, accept, compaction, commit), each kernel
charged to the outermost phase that launched it.
Each bracket also times the GPU's own start of a launch (~4-5 us on the H200: the first run's sums
exceeded the graph's wall time); an empty kernel's bracketed time is measured first and subtracted
from every kernel's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import numpy as np
from numba import cuda
from numba.cuda import dispatcher as nd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kdt.config import preset  # noqa: E402
from kdt.drafters import OracleDrafter, learned_drafter  # noqa: E402
from kdt.engine import load_target  # noqa: E402
from kdt.fixture import read_fixture  # noqa: E402
from kdt.kernels.bench import _spin  # noqa: E402
from kdt.reference.decode import generate  # noqa: E402

# longer than the host time of one launch: e0, the kernel and e1 run back to back. 300 us until session 15, whose
# s15b run read the target's q_absorb2 at 243 us a launch (15.5 at M = 1; s15a: 2.7 and 7.0): either a host side
# longer than the spin or a GPU stall; 1000 us tells them apart (each eager launch then costs 1 ms of wall time)
SPIN_US = 1000


@cuda.jit
def _noop():
    """Nothing: its bracketed time is the bracket's own cost (subtracted from every kernel's)."""
    pass


class KernelTimer:
    """Brackets every eager kernel launch with CUDA events (installed while ``on``), each behind a
    spin kernel: without it the events would time the launch's host cost (~50-100 us), not the
    kernel (the first H200 run of this script did exactly that)."""

    def __init__(self):
        self.events: list[tuple[str, str, object, object]] = []
        self.on = False
        self.phase = "rest"  # the step phase the next launches belong to (see PhaseTags)
        self.overhead_us = 0.0
        timer = self
        if not hasattr(nd, "_LaunchConfiguration"):  # the simulator: nothing to time (a dry run)
            return
        self._orig = nd._LaunchConfiguration.__call__

        def call(lc, *args):
            if not timer.on:
                return timer._orig(lc, *args)
            e0, e1 = cuda.event(timing=True), cuda.event(timing=True)
            timer._orig(_spin[1, 1], SPIN_US)  # holds the GPU while this launch is queued
            e0.record()
            out = timer._orig(lc, *args)
            e1.record()
            timer.events.append((lc.dispatcher.py_func.__qualname__.split(".<locals>")[0], timer.phase, e0, e1))
            return out

        nd._LaunchConfiguration.__call__ = call

    def calibrate(self, n: int = 50) -> float:
        """The median bracketed time of an empty kernel (us), subtracted by ``table`` from then on."""
        _noop[1, 1]()  # compiled outside the measurement
        self.on = True
        for _ in range(n):
            _noop[1, 1]()
        self.on = False
        times = self.table().get("_noop", [0.0])
        self.overhead_us = float(np.median(times))
        return self.overhead_us

    def table(self, by_phase: bool = False) -> dict[str, list[float]]:
        """{kernel name: its bracketed times (us)}, or keyed "phase: kernel" with ``by_phase``."""
        cuda.synchronize()
        out: dict[str, list[float]] = defaultdict(list)
        for name, phase, e0, e1 in self.events:
            out[f"{phase}: {name}" if by_phase else name].append(
                max(0.0, cuda.event_elapsed_time(e0, e1) * 1e3 - self.overhead_us))
        self.events.clear()
        return out


class PhaseTags:
    """While installed, every launch is charged to the outermost of the wrapped step phases running:
    the learned drafter's forward (``step_program``), its top-k, the tree build, the target's forward
    (``_program``); anything else is "rest"."""

    def __init__(self, timer: KernelTimer, target, drafter):
        from kdt.kernels import ddtree as kd

        self.timer, self.saved = timer, []
        dm = getattr(drafter, "model", None)
        for obj, attr, phase in ((kd, "topk_gpu", "draft top-k"), (kd, "build_tree_gpu", "tree build"),
                                 (target, "_program", "target forward"),
                                 (dm, "step_program", "drafter forward"), (dm, "_program", "drafter forward")):
            if obj is not None:
                self.saved.append((obj, attr, obj.__dict__.get(attr)))
                setattr(obj, attr, self._wrap(getattr(obj, attr), phase))

    def _wrap(self, fn, phase):
        def tagged(*args, **kw):
            outer = self.timer.phase
            if outer == "rest":
                self.timer.phase = phase
            try:
                return fn(*args, **kw)
            finally:
                self.timer.phase = outer
        return tagged

    def remove(self) -> None:
        for obj, attr, old in reversed(self.saved):
            if old is None:
                delattr(obj, attr)  # it was the class's method
            else:
                setattr(obj, attr, old)


def set_graphs(target, step, drafter, on: bool, saved: dict):
    """Switch the CUDA graphs of the target, its step program and a learned drafter off (or back)."""
    objs = [target, step] + ([drafter.model] if hasattr(drafter, "model") else [])
    for o in objs:
        if on:
            o.graphs = saved.get(id(o), o.graphs)
        else:
            saved[id(o)] = o.graphs
            o.graphs = None


def run_case(name, target, prompt, drafter_fn, budget, block, steps, timer, top):
    V = target.cfg.vocab_size
    n_tok = steps * (block if budget else 1)
    generate(target, prompt, n_tok, drafter=drafter_fn(), budget=budget, block_size=block)  # warm-up
    generate(target, prompt, n_tok, drafter=drafter_fn(), budget=budget, block_size=block)  # graphs captured
    d = drafter_fn()
    cuda.synchronize()
    t0 = time.perf_counter()
    res = generate(target, prompt, n_tok, drafter=d, budget=budget, block_size=block)
    wall = (time.perf_counter() - t0) / res.steps * 1e6
    d = drafter_fn()
    step = target.tree_ops.device_step(d)
    saved: dict = {}
    set_graphs(target, step, d, False, saved)
    # an eager run first, untimed: session 10's tables each had one kernel family inflated by a one-off stall
    # (826 us of attention per step in one run, 1328 us of linear_v2 in another) in the first eager run
    generate(target, prompt, n_tok, drafter=drafter_fn(), budget=budget, block_size=block)
    tags = PhaseTags(timer, target, d)
    try:
        timer.on = True
        res2 = generate(target, prompt, n_tok, drafter=d, budget=budget, block_size=block)
        timer.on = False
        tab = timer.table(by_phase=True)
        n = res2.steps  # the run includes the prefill's kernels: measured alone below and subtracted
        timer.on = True
        # the prefill alone (max_new = 1: the root, no step), eager like the run above (the graphs are still
        # off: session 7's table ran it with them on, so nothing was subtracted), with the same drafter: a
        # learned drafter's prefill of its context rows is part of it
        generate(target, prompt, 1, drafter=d, budget=budget, block_size=block)
    finally:
        timer.on = False
        tags.remove()
    set_graphs(target, step, d, True, saved)
    pre = timer.table(by_phase=True)
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # kernel -> [launches, GPU us] per step
    by_phase: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # phase -> the same
    per_pk: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # "phase: kernel" -> the same
    for k, v in tab.items():
        phase, kern = k.split(": ", 1)
        pv = pre.get(k, [])
        cnt, tot = (len(v) - len(pv)) / n, (sum(v) - sum(pv)) / n
        for row in (per[kern], by_phase[phase], per_pk[k]):
            row[0] += cnt
            row[1] += tot
    launches = sum(c for c, _ in per.values())
    gpu = sum(t for _, t in per.values())
    print(f"\n== {name}: V={V} budget={budget} block={block}: {res.steps} steps, "
          f"accept {len(res.tokens) / res.steps:.2f}/step")
    print(f"   graph wall {wall:.0f} us/step; eager: {launches:.1f} kernels/step, GPU sum {gpu:.0f} us/step "
          f"-> gaps+host {wall - gpu:.0f} us ({(wall - gpu) / max(launches, 1):.2f} us per kernel)")
    print(f"   {'kernel':34s} {'n/step':>7s} {'us/step':>8s} {'us each':>8s}")
    for k, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
        if c > 0:
            print(f"   {k:34s} {c:7.1f} {t:8.1f} {t / c:8.2f}")
    print(f"   {'phase':34s} {'n/step':>7s} {'us/step':>8s}")
    for ph, (c, t) in sorted(by_phase.items(), key=lambda kv: -kv[1][1]):
        if c > 0.05:
            print(f"   {ph:34s} {c:7.1f} {t:8.1f}")
    print(f"   {'phase: kernel':48s} {'n/step':>7s} {'us/step':>8s} {'us each':>8s}")
    for k, (c, t) in sorted(per_pk.items(), key=lambda kv: -kv[1][1])[:2 * top]:
        if c > 0.05:
            print(f"   {k:48s} {c:7.1f} {t:8.1f} {t / c:8.2f}")
    return {"name": name, "wall_us": wall, "kernels": launches, "gpu_us": gpu,
            "per_kernel": {k: [c, t] for k, (c, t) in per.items()},
            "per_phase": dict(by_phase), "per_phase_kernel": dict(per_pk)}


def prefill_case(P: int, timer, top: int, name: str = "moonlight-16b-a3b") -> dict:
    """Preset ``name``'s prefill of P tokens kernel by kernel: {kernel: [launches, GPU us]} of one forward."""
    from kdt.reference.model import causal_block

    cfg = preset(name)
    t = load_target(cfg, None, "cuda", "bf16", max(1024, P), max_tokens=P)
    t.graphs = None  # eager: every launch bracketed
    toks, pos, mask = np.random.default_rng(0).integers(0, cfg.vocab_size, P), np.arange(P), causal_block(P)
    for _ in range(2):  # compiles, then one untimed eager run (session 10: a one-off stall in the first)
        t.forward(toks, pos, 0, mask, last_only=True)
    cuda.synchronize()
    t0 = time.perf_counter()
    t.forward(toks, pos, 0, mask, last_only=True)
    cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e6
    timer.on = True
    t.forward(toks, pos, 0, mask, last_only=True)
    timer.on = False
    per = {k: [len(v), sum(v)] for k, v in timer.table().items()}
    gpu = sum(us for _, us in per.values())
    print(f"\n== {name} bf16 prefill P={P}: eager wall {wall / 1e3:.2f} ms, "
          f"{sum(c for c, _ in per.values())} kernels, GPU sum {gpu / 1e3:.2f} ms")
    print(f"   {'kernel':34s} {'n':>5s} {'ms':>8s} {'us each':>9s} {'share':>6s}")
    for k, (c, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"   {k:34s} {c:5d} {us / 1e3:8.2f} {us / c:9.1f} {us / gpu:6.1%}")
    return {"name": f"{name} bf16 prefill P={P}", "wall_us": wall, "gpu_us": gpu, "per_kernel": per}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="tiny,code,moonlight")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--prefill", help="token counts P (comma-separated): the prefill alone, no --cases")
    ap.add_argument("--preset", default="moonlight-16b-a3b", help="the prefill's model shape (random weights)")
    ap.add_argument("--json")
    a = ap.parse_args()
    timer = KernelTimer()
    print(f"bracket overhead (an empty kernel): {timer.calibrate():.2f} us, subtracted from every kernel")
    out = []
    if a.prefill:
        out = [prefill_case(int(P), timer, a.top, a.preset) for P in a.prefill.split(",")]
        a.cases = ""
    cases = a.cases.split(",")
    if "tiny" in cases:
        fx = read_fixture("fixtures/model_tiny.h5")
        t = load_target(fx.config, fx.weights, "cuda", "float32", 1024, max_tokens=256)
        V = fx.config.vocab_size
        prompt = np.arange(16) % V
        seq = np.concatenate([prompt, generate(t, prompt, 8 * a.steps + 16).tokens, np.zeros(64, np.int64)])
        out.append(run_case("tiny fp32 AR", t, prompt, lambda: None, 0, 8, a.steps, timer, a.top))
        out.append(run_case("tiny fp32 oracle chain", t, prompt, lambda: OracleDrafter(seq, V), 7, 8, a.steps,
                            timer, a.top))
    if "code" in cases:
        fx = read_fixture("fixtures/model_code.h5")
        t = load_target(fx.config, fx.weights, "cuda", "bf16", 1024, max_tokens=256)
        prompt = np.frombuffer(b"import os\nimport sys\n\n\ndef main(argv):\n    ", np.uint8).astype(np.int64)
        drafter = learned_drafter(fx, 1024, target=t)
        B = fx.drafter.config.block_size
        out.append(run_case("code bf16 AR", t, prompt, lambda: None, 0, B, a.steps, timer, a.top))
        out.append(run_case("code bf16 learned b16", t, prompt, lambda: drafter, 16, B, a.steps, timer, a.top))
    if "moonlight" in cases:
        cfg = preset("moonlight-16b-a3b")
        t = load_target(cfg, None, "cuda", "bf16", 1024, max_tokens=256)
        V = cfg.vocab_size
        prompt = np.random.default_rng(0).integers(0, V, 128)
        seq = np.concatenate([prompt, generate(t, prompt, 8 * 12 + 16).tokens, np.zeros(64, np.int64)])
        out.append(run_case("moonlight bf16 AR", t, prompt, lambda: None, 0, 8, 12, timer, a.top))
        out.append(run_case("moonlight bf16 oracle chain", t, prompt, lambda: OracleDrafter(seq, V), 7, 8, 12,
                            timer, a.top))
    if a.json:
        import json

        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
