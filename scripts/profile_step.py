"""Where the host time of a one-program DDTree step goes (run on a GPU; not a test, not a benchmark).

    python scripts/profile_step.py [fixtures/model_tiny.h5]   # a fixture, float32
    python scripts/profile_step.py moonlight-16b-a3b           # a preset: random bf16 weights drawn on the device
    python scripts/profile_step.py moonlight-16b-a3b 256       # 256 tokens a run (default 64): one-time costs spread

Wraps the pieces of ``StepGraph.step`` (draft upload, graph launch, the event behind it and the wait for
the GPU) and the drafter's ``draft`` with timers and prints microseconds per step for AR, the oracle at
budget 64 and the oracle chain, each with the engine's wait for the GPU (``kdt.engine.cuda_step.wait_for``: a loop of
event queries, or with KDT_STEP_WAIT=block the blocking synchronize); then the budget-64 oracle with the other wait.
"""

import sys
import time
from collections import defaultdict

import numpy as np

from kdt.config import preset
from kdt.drafters import OracleDrafter
from kdt.engine import load_target
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
    for name, budget, spin in (("AR", 0, eng), ("oracle b64", 64, eng), ("oracle chain", 7, eng),
                               (f"oracle b64, {'blocking' if eng else 'spin'} wait", 64, not eng)):
        d = OracleDrafter(seq, V) if budget else None
        generate(target, prompt, n_new, drafter=d, budget=budget, block_size=8)  # warm-up: graphs captured
        d = OracleDrafter(seq, V) if budget else None
        step = target.tree_ops.device_step(d)
        acc = defaultdict(float)
        ops = target.tree_ops
        saved = ops.upload_draft, step.graphs.run, step.done
        ops.upload_draft = timed(acc, "upload draft", ops.upload_draft)
        step.graphs.run = timed(acc, "graph launch", step.graphs.run)
        step.done = [TimedEvent(e, acc, spin) for e in step.done]
        if d is not None:
            d.draft = timed(acc, "drafter.draft (host)", d.draft)
        t0 = time.perf_counter()
        res = generate(target, prompt, n_new, drafter=d, budget=budget, block_size=8)
        wall = time.perf_counter() - t0
        ops.upload_draft, step.graphs.run, step.done = saved
        n = res.steps
        rest = res.host_s - sum(v for k, v in acc.items() if k != "wait for the GPU")
        parts = ", ".join(f"{k} {v / n * 1e6:.0f}" for k, v in acc.items()) + f", the rest {rest / n * 1e6:.0f}"
        print(f"{name}: {n} steps, {wall / n * 1e6:.0f} us/step wall, host_s {res.host_s / n * 1e6:.0f} us; {parts}")


if __name__ == "__main__":
    main(*sys.argv[1:])
