"""tree_build's searches side by side on the GPU: the default rule (one warp in registers for trees, K >= 2, of
budgets <= 31; thread 0's heap elsewhere) and the heap everywhere (``warp_max=-1``). Same random drafts for
both; checks that every output is equal, then times each (GPU time per launch, one request:
``kdt.kernels.bench.time_us``, launches queued behind a spin kernel so that the events see the kernels, not
Python's ~130 us per launch).

    python scripts/bench_tree.py [--budgets 1,7,16,31] [--shapes 7x1,15x1,15x16,15x32] [--json F]

``--logits DxVxK`` (e.g. 15x256x16) times the learned step's launches from drafter logits instead: draft_topk,
tree_build on its output, and both back to back, at each budget.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from numba import cuda

from kdt.bench import environment
from kdt.kernels import ddtree as kd
from kdt.kernels.bench import time_us


def from_logits(spec: str, budgets: list[int], rng) -> list[dict]:
    """spec "DxVxK": GPU time of draft_topk over random logits [D, V] (K candidates), of tree_build on its
    output and of both back to back, at each budget (one row each)."""
    D, V, K = (int(x) for x in spec.split("x"))
    logits = cuda.to_device(rng.standard_normal((D, V)).astype(np.float32) * 3)
    tok, lp = cuda.device_array((1, D, K), np.int64), cuda.device_array((1, D, K), np.float32)
    root, L = cuda.to_device(np.array([3], np.int64)), cuda.to_device(np.array([100], np.int64))
    rows = []
    for budget in budgets:
        out = kd.alloc_tree(1, budget + 1)
        us = dict(
            topk=time_us(lambda i: kd.topk_gpu(logits, tok, lp)),
            tree=time_us(lambda i, b=budget, o=out: kd.build_tree_gpu(root, tok, lp, b, L, out=o)),
            both=time_us(lambda i, b=budget, o=out: (kd.topk_gpu(logits, tok, lp),
                                                     kd.build_tree_gpu(root, tok, lp, b, L, out=o))))
        rows.append(dict(D=D, V=V, K=K, budget=budget, **{f"{k}_us": round(v, 2) for k, v in us.items()}))
        print(f"D={D} V={V} K={K} budget={budget:4d}: " + "  ".join(f"{k} {v:6.2f} us" for k, v in us.items()),
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="1,7,16,31")
    ap.add_argument("--shapes", default="7x1,15x1,15x16,15x32", help="D x K of the drafts")
    ap.add_argument("--json", default=None)
    ap.add_argument("--logits", default=None, help="DxVxK: time draft_topk and tree_build from logits")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    if a.logits:
        rows = from_logits(a.logits, [int(b) for b in a.budgets.split(",")], rng)
    for shape in [] if a.logits else a.shapes.split(","):
        D, K = (int(x) for x in shape.split("x"))
        for budget in (int(b) for b in a.budgets.split(",")):
            logp = -np.sort(rng.exponential(1.0, size=(1, D, K)), axis=-1).astype(np.float32)
            ins = (cuda.to_device(np.array([3], np.int64)), cuda.to_device(rng.integers(0, 256, (1, D, K))),
                   cuda.to_device(logp), budget, cuda.to_device(np.array([100], np.int64)))
            res, us = {}, {}
            for name, wm in (("default", None), ("heap", -1)):
                out = kd.alloc_tree(1, budget + 1)
                us[name] = time_us(lambda i, ins=ins, out=out, wm=wm: kd.build_tree_gpu(*ins, out=out, warp_max=wm))
                res[name] = [x.copy_to_host() for x in out]
            same = all(np.array_equal(x, y) for x, y in zip(res["default"], res["heap"], strict=True))
            row = dict(D=D, K=K, budget=budget, default_us=round(us["default"], 2), heap_us=round(us["heap"], 2),
                       same_tree=bool(same), warp_search=budget <= kd.WARP_SEARCH_MAX and min(K, budget) >= 2)
            rows.append(row)
            print(f"D={D:3d} K={K:3d} budget={budget:4d}: default {us['default']:7.2f} us  heap {us['heap']:7.2f} us "
                  f"({us['heap'] / us['default']:.2f}x)  same tree: {same}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"environment": environment("cuda"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
