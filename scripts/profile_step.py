"""Where the host time of a one-program DDTree step goes (run on a GPU; not a test, not a benchmark).

    python scripts/profile_step.py [fixtures/model_tiny.h5]   # a fixture, float32
    python scripts/profile_step.py moonlight-16b-a3b           # a preset: random bf16 weights drawn on the device
    python scripts/profile_step.py moonlight-16b-a3b 256       # 256 tokens a run (default 64): one-time costs spread

Wraps the pieces of ``StepGraph.step`` (draft upload, graph launch, the event behind it and the wait for
the GPU) and the host drafter's ``draft`` with timers and prints microseconds per step for AR, the oracle at
budget 64 drafting on the host and on the device (its steps launched ahead, as ``kdt bench`` runs it) and the oracle
chain, each with the engine's wait for the GPU (``kdt.engine.cuda_step.wait_for``: a loop of event queries, or with
KDT_STEP_WAIT=block the blocking synchronize); then the device's budget-64 oracle with the other wait, and with the
other count of captures replayed in turn (``cuda_step.STEP_GRAPHS``).
"""

import sys
import time
from collections import defaultdict

import numpy as np

from kdt.config import preset
from kdt.drafters import OracleDrafter
from kdt.engine import cuda_step, load_target
from kdt.engine.cuda_step import SPIN_WAIT, wait_for
from kdt.fixture import read_fixture
from kdt.reference.decode import ar_generate, generate


def timed(acc, name, fn):
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        acc[name] += time.perf_counter() - t0
        return out
    return wrapper


class TimedEvent:
    """An event behind a step's program (a step graph has two, used in turn): the record call and the wait
    (synchronize: the engine's ``wait_for``, polling with ``spin``) timed."""

    def __init__(self, event, acc, spin=False):
        self.event, self.acc, self.spin = event, acc, spin

    def record(self):
        t0 = time.perf_counter()
        self.event.record()
        self.acc["event record"] += time.perf_counter() - t0

    def synchronize(self):
        t0 = time.perf_counter()
        wait_for(self.event, self.spin)
        self.acc["wait for the GPU"] += time.perf_counter() - t0


def main(source="fixtures/model_tiny.h5", tokens="64"):
    if source.endswith(".h5"):
        fx = read_fixture(source)
        cfg, weights, dtype = fx.config, fx.weights, "float32"
    else:
        cfg, weights, dtype = preset(source), None, "bf16"
    V = cfg.vocab_size
    target = load_target(cfg, weights, "cuda", dtype, 512, max_tokens=256)
    n_new = int(tokens)
    prompt = np.arange(64) % V
    ar = ar_generate(target, prompt, n_new)
    seq = np.concatenate([prompt, ar.tokens, np.zeros(64, np.int64)])
    eng = SPIN_WAIT  # the engine's wait (kdt.engine.cuda_step.wait_for), then the other one
    two = 3 - cuda_step.STEP_GRAPHS  # the other count of captures a step key (KDT_STEP_GRAPHS: 1 or 2)
    for name, budget, on_device, spin, graphs in (
            ("AR", 0, False, eng, None), ("oracle b64, host draft", 64, False, eng, None),
            ("oracle b64, on device", 64, True, eng, None), ("oracle chain, on device", 7, True, eng, None),
            (f"oracle b64 on device, {'blocking' if eng else 'spin'} wait", 64, True, not eng, None),
            (f"oracle b64 on device, {two} graph(s) in turn", 64, True, eng, two)):
        saved_graphs = cuda_step.STEP_GRAPHS
        cuda_step.STEP_GRAPHS = graphs or saved_graphs
        d = OracleDrafter(seq, V, on_device=on_device) if budget else None
        generate(target, prompt, n_new, drafter=d, budget=budget, block_size=8)  # warm-up: graphs captured
        d = OracleDrafter(seq, V, on_device=on_device) if budget else None
        step = target.tree_ops.device_step(d)
        acc = defaultdict(float)
        ops = target.tree_ops
        saved = ops.upload_draft, step.graphs.run, step.done, cuda_step.wait_for, step.launch, step.result
        ops.upload_draft = timed(acc, "upload draft", ops.upload_draft)
        step.graphs.run = timed(acc, "graph launch", step.graphs.run)
        step.launch = timed(acc, "launch()", step.launch)  # (all of it: its Python, upload, graph launch, record)
        step.result = timed(acc, "result()", step.result)  # (all of it: the wait, the record's read)
        step.done = [TimedEvent(e, acc, spin) for e in step.done]
        # the step's wait (StepGraph.result: wait_for with the event's poll) with ``spin``, timed
        cuda_step.wait_for = lambda event, query=None: event.synchronize()
        if d is not None and not on_device:
            d.draft = timed(acc, "drafter.draft (host)", d.draft)
        t0 = time.perf_counter()
        res = generate(target, prompt, n_new, drafter=d, budget=budget, block_size=8)
        wall = time.perf_counter() - t0
        ops.upload_draft, step.graphs.run, step.done, cuda_step.wait_for, step.launch, step.result = saved
        cuda_step.STEP_GRAPHS = saved_graphs
        n = res.steps
        wait = res.decode_s - res.host_s  # the engine's own count of the wait (any KDT_STEP_END)
        # launch() and result() less their timed parts, and the decode loop's own share (the rest)
        inner = {"launch() Python": acc.pop("launch()") - sum(acc.get(k, 0.0) for k in
                                                               ("upload draft", "graph launch", "event record")),
                 "result() after the wait": acc.pop("result()") - wait}
        acc.update(inner)
        rest = res.host_s - sum(v for k, v in acc.items() if k != "wait for the GPU")
        parts = ", ".join(f"{k} {v / n * 1e6:.0f}" for k, v in acc.items()) + f", the rest {rest / n * 1e6:.0f}"
        print(f"{name}: {n} steps, {wall / n * 1e6:.0f} us/step wall, host_s {res.host_s / n * 1e6:.0f} us; {parts}")


if __name__ == "__main__":
    main(*sys.argv[1:])
