"""What a step graph's launch costs the host, by what the GPU is doing (run on a GPU; not a test, not a benchmark).

    python scripts/probe_graph_launch.py [--nodes 300,700] [--gpu-us 3000] [--steps 64]

A device step is one CUDA graph (kdt.engine.cuda_model.ForwardGraphs) of a few hundred launches, and kdt launches
a device-drafted step while the one before it still runs (cuda_step.STEP_AHEAD). In session 39's `kdt bench`
(Moonlight, H200) such a step's launch() took the host 52 us against 21 us for the same step launched onto an idle
GPU (a host draft). This times ``ForwardGraphs.run`` + the event record behind it, as ``StepGraph.launch`` does, for
a graph of ``nodes`` empty kernels led by one that keeps the GPU busy ``gpu_us``:

- idle: each launch onto an idle GPU (the host waits for the step before);
- ahead, one graph: step k + 1's launch of the same graph while step k runs (then the host waits for step k);
- ahead, two graphs: the same, with two captures of the program used in turn (even and odd steps).

Each wait is the engine's (``cuda_step.wait_for``: polling the event unless KDT_STEP_WAIT=block). Session 39 (H200,
GPU busy 3 ms a step, the waits then blocking): 9.7-13.3 us a launch in every mode for 100 to 700 kernels, so neither
launching ahead nor the graph's size explains the 52 us.
"""

import argparse
import time

import numpy as np
from numba import cuda

from kdt.engine.cuda_model import ForwardGraphs
from kdt.engine.cuda_step import wait_for


@cuda.jit
def _busy(ns):
    """One block that sleeps ~ns nanoseconds: the GPU busy as a step's forward keeps it."""
    for _ in range(ns // 1000):
        cuda.nanosleep(1000)


@cuda.jit
def _noop():
    pass


def launch_us(nodes: int, gpu_us: int, steps: int, mode: str) -> tuple[float, float]:
    """Host microseconds of one launch (run + event record) over ``steps`` steps in ``mode``: median, mean (the
    engine's host work is a mean: a rare stall counts)."""

    def program(key, stream=0):
        _busy[1, 32, stream](np.int64(gpu_us * 1000))
        for _ in range(nodes - 1):
            _noop[1, 32, stream]()

    g = ForwardGraphs(program)
    keys = (0, 1) if mode == "ahead, two graphs" else (0, 0)
    for k in keys * 2:  # each key: direct (compiles), then captured and replayed
        g.run(k)
    cuda.synchronize()
    done = [cuda.event(timing=False) for _ in range(2)]
    times = []
    for i in range(steps + 1):
        if mode == "idle" and i:
            wait_for(done[(i - 1) & 1])
        t0 = time.perf_counter()
        g.run(keys[i & 1])
        done[i & 1].record()
        times.append(time.perf_counter() - t0)
        if mode != "idle" and i:  # step k's tokens read after step k + 1 went in, waited for as the engine does
            wait_for(done[(i - 1) & 1])
    cuda.synchronize()
    return float(np.median(times[1:])) * 1e6, float(np.mean(times[1:])) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="300,700", help="kernels a graph, comma-separated")
    ap.add_argument("--gpu-us", type=int, default=3000, help="GPU time of a step (us)")
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    modes = ("idle", "ahead, one graph", "ahead, two graphs")
    print(f"host us a launch (ForwardGraphs.run + event record), median / mean of {args.steps}; "
          f"GPU busy {args.gpu_us} us a step")
    print(f"{'nodes':>6s} " + " ".join(f"{m:>18s}" for m in modes))
    for n in (int(v) for v in args.nodes.split(",")):
        cells = (launch_us(n, args.gpu_us, args.steps, m) for m in modes)
        print(f"{n:6d} " + " ".join(f"{md:9.1f} /{mn:7.1f}" for md, mn in cells))


if __name__ == "__main__":
    main()
