"""Kernel micro-benchmarks (not tests): each kernel at the Moonlight-16B-A3B and Kimi-K2 shapes.

    python -m kdt.kernels.bench [--presets moonlight-16b-a3b,kimi-k2] [--dtype bf16] [--json PATH]

Times every kernel on the GPU alone: a spin kernel holds the GPU while Python queues a batch of
launches, so CUDA events around the batch see the kernels back to back and not the ~20-50 us of host
time each launch costs (the engine replays CUDA graphs, where that cost is gone too). The linear
kernels rotate over enough weight copies (>= 128 MB) that every launch streams its matrix from HBM,
not from the 50 MB L2. Prints achieved GB/s (bytes that must move once: weights, activations, cache)
and GFLOP/s beside the device-to-device copy bandwidth measured in the same run. Correctness is the
tests' business (tests/test_kernels_*.py); this only times.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import numpy as np
from numba import cuda

from kdt.config import preset
from kdt.kernels import ddtree as kd
from kdt.kernels import elementwise as ew
from kdt.kernels import mla, moe
from kdt.kernels.common import grid_dependency_wait
from kdt.kernels.linear import linear
from kdt.kernels.randn import randn_fill


@cuda.jit
def _spin(n):
    """Keep the GPU busy for about n microseconds."""
    grid_dependency_wait()
    for _ in range(n):
        cuda.nanosleep(1000)


def time_us(fn, batch: int = 16, groups: int = 3, spin_us: int = 20000) -> float:
    """GPU time of one ``fn(i)`` (the median over ``groups`` of the mean over a batch of ``batch``
    calls queued behind a spin kernel, i = 0 .. batch-1)."""
    for i in range(2):
        fn(i)
    cuda.synchronize()
    times = []
    for _ in range(groups):
        e0, e1 = cuda.event(), cuda.event()
        _spin[1, 1](spin_us)
        e0.record()
        for i in range(batch):
            fn(i)
        e1.record()
        e1.synchronize()
        times.append(cuda.event_elapsed_time(e0, e1) * 1e3 / batch)
    return statistics.median(times)


_seeds = itertools.count(1)


def rand(shape, dtype=np.float32, scale=1.0):
    """Fresh device normal numbers (never zeros: they hide unwritten outputs and run faster)."""
    a = cuda.device_array(shape, dtype=dtype)
    randn_fill(a, next(_seeds), scale)
    return a


def moe_layer(cfg, wdt) -> moe.MoEWeights:
    """One MoE layer of ``cfg``'s shape with random weights (``wdt``: np.float32 or np.uint16 = bf16)."""
    E, k, D, I = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    Is = I * cfg.n_shared_experts
    return moe.MoEWeights(
        gate_w=rand((E, D), np.float32, 2 / np.sqrt(D)), bias=rand((E,), np.float32, 0.05),
        w_gate_up=rand((E, 2 * I, D), wdt, 1 / np.sqrt(D)), w_down=rand((E, D, I), wdt, 1 / np.sqrt(I)),
        shared_gate_up=rand((1, 2 * Is, D), wdt, 1 / np.sqrt(D)) if Is else None,
        shared_down=rand((1, D, Is), wdt, 1 / np.sqrt(Is)) if Is else None, n_group=cfg.n_group,
        topk_group=cfg.topk_group, top_k=k, norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    n = nbytes // 4
    a, b = cuda.device_array(n, np.float32), cuda.device_array(n, np.float32)
    return 2 * nbytes / (time_us(lambda i: b.copy_to_device(a), batch=4) * 1e-6)


def cases(name: str, dtype: str):
    """(kernel, shape description, callable, bytes, flops) for one model's shapes."""
    cfg = preset(name)
    wdt = np.uint16 if dtype == "bf16" else np.float32
    wb = 2 if dtype == "bf16" else 4
    D, H, V = cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size
    Rkv, dr, dn, dv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    q_in = cfg.q_lora_rank or D
    linears = {"q_proj" if not cfg.q_lora_rank else "q_b_proj": (H * (dn + dr), q_in),
               "kv_a_proj_with_mqa": (Rkv + dr, D), "o_proj": (D, H * dv), "lm_head": (V, D)}
    if cfg.q_lora_rank:
        linears["q_a_proj"] = (cfg.q_lora_rank, D)
    for lname, (N, K) in linears.items():
        Ws = [rand((N, K), wdt, 1 / np.sqrt(K)) for _ in range(min(16, -(-(128 << 20) // (N * K * wb))))]
        for M in (1, 4, 16, 64) if lname != "lm_head" else (1, 16):
            x, y = rand((M, K)), cuda.device_array((M, N), np.float32)
            yield (f"linear {lname}", f"M={M} N={N} K={K}",
                   lambda i, x=x, Ws=Ws, y=y: linear(x, Ws[i % len(Ws)], y),
                   N * K * wb + 4 * M * (K + N), 2 * M * N * K)
    kv_b = rand((H * (dn + dv), Rkv), wdt, 1 / np.sqrt(Rkv))
    max_len = 8192 + 64
    c_kv, k_pe = rand((max_len, Rkv)), rand((max_len, dr))
    cos, sin = (cuda.to_device(t) for t in mla.rope_tables(cfg, max_len))
    for M in (1, 16, 64):
        q, pos = rand((M, H * (dn + dr))), cuda.to_device(np.arange(M, dtype=np.int64))
        q_abs, q_pe, o_lat = rand((M, H, Rkv)), rand((M, H, dr)), cuda.device_array((M, H, Rkv), np.float32)
        yield ("mla q_absorb", f"M={M} H={H}",
               lambda i, q=q, pos=pos, a=q_abs, p=q_pe: mla.q_absorb(q, kv_b, pos, cos, sin, True, a, p),
               H * dn * Rkv * wb + 4 * M * H * (dn + dr + Rkv + dr), 2 * M * H * dn * Rkv)
        for L in (512, 8192):
            vis = cuda.to_device(np.tril(np.ones((M, M), np.uint8)))
            S = mla.mla_num_splits(L, M, H, Rkv, dr)
            scratch = cuda.device_array(max(1, mla.mla_scratch_size(M, H, Rkv, S)), np.float32)
            L_dev = cuda.to_device(np.array([L], np.int64))  # a host L would copy (and wait) per launch
            T = L + M
            yield ("mla attention", f"M={M} H={H} L={L}",
                   lambda i, a=q_abs, p=q_pe, Ld=L_dev, S=S, v=vis, o=o_lat, s=scratch:
                   mla.mla_attention(a, p, c_kv, k_pe, Ld, v, cfg.softmax_scale, o, scratch=s, n_splits=S),
                   4 * (T * (Rkv + dr) + 2 * M * H * Rkv + M * H * dr), 2 * M * H * T * (2 * Rkv + dr))
        o = cuda.device_array((M, H * dv), np.float32)
        yield ("mla uv_project", f"M={M} H={H}", lambda i, ol=o_lat, o=o: mla.uv_project(ol, kv_b, o),
               H * dv * Rkv * wb + 4 * M * H * (Rkv + dv), 2 * M * H * dv * Rkv)
    E, k, I = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    Is = I * cfg.n_shared_experts
    layer = moe_layer(cfg, wdt)
    scratch = moe.MoEScratch.allocate(cfg, 64)
    for M in (1, 16, 64):
        b, out = rand((M, D)), rand((M, D))
        sel = E * (1 - (1 - k / E) ** M)  # expected distinct experts (the router's inputs are random)
        yield ("moe_forward", f"M={M} E={E} k={k}",
               lambda i, b=b, out=out, M=M: moe.moe_forward(b, layer, scratch, out, M=M),
               (sel + cfg.n_shared_experts) * 3 * D * I * wb + 4 * E * D, 2 * M * 3 * D * (k * I + Is))
    for M in (1, 64):
        x, y = rand((M, D)), cuda.device_array((M, D), np.float32)
        w = rand((D,), np.float32, 0.1)
        yield ("rmsnorm", f"M={M} D={D}", lambda i, x=x, y=y, w=w: ew.rmsnorm(x, w, 1e-6, y),
               8 * M * D + 4 * D, 3 * M * D)
        logits, am = rand((M, V)), cuda.device_array(M, np.int64)
        yield "argmax_rows", f"M={M} V={V}", lambda i, lg=logits, am=am: ew.argmax_rows(lg, am), 4 * M * V, M * V
    Dd, K, B = 15, 32, 256
    root = cuda.to_device(np.zeros(1, np.int64))
    dt = cuda.to_device(np.random.default_rng(0).integers(0, V, (1, Dd, K)).astype(np.int64))
    dl = cuda.to_device(-np.sort(np.random.default_rng(1).random((1, Dd, K)), axis=-1).astype(np.float32))
    Lr = cuda.to_device(np.array([100], np.int64))
    tb = kd.alloc_tree(1, B + 1)
    yield "tree_build", f"budget={B} D={Dd} K={K}", lambda i: kd.build_tree_gpu(root, dt, dl, B, Lr, out=tb), \
        12 * Dd * K + (B + 1) ** 2, 0
    n_layers = cfg.num_hidden_layers
    ckv, kpe = rand((n_layers, 1024, Rkv)), rand((n_layers, 1024, dr))
    khl = cuda.device_array((n_layers, 1024, Rkv + dr), np.uint32)  # the engine's pre-split cache (any words)
    acc = cuda.to_device(np.arange(0, 32, 2, dtype=np.int32))
    L_c, n_c = cuda.to_device(np.array([100], np.int64)), cuda.to_device(np.array([16], np.int32))
    yield "kv_compact", f"layers={n_layers} n_acc=16 +kv_hl", \
        lambda i: kd.compact_gpu(ckv, kpe, L_c, acc, n_c, kv_hl=khl), 2 * 16 * n_layers * (Rkv + dr) * 8, 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="moonlight-16b-a3b,kimi-k2")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "float32"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    bw = copy_bandwidth()
    print(f"device copy bandwidth: {bw / 1e9:.0f} GB/s (read + write)")
    rows = []
    print(f"{'kernel':22s} {'shape':30s} {'us':>9s} {'GB/s':>8s} {'% copy':>7s} {'GFLOP/s':>9s}")
    for name in args.presets.split(","):
        print(f"-- {name} ({args.dtype} weights)")
        for kernel, shape, fn, nbytes, flops in cases(name, args.dtype):
            us = time_us(fn)
            gbs, gfs = nbytes / us * 1e-3, flops / us * 1e-3
            rows.append(dict(preset=name, kernel=kernel, shape=shape, us=us, GBps=gbs, GFLOPps=gfs,
                             pct_copy=100 * gbs * 1e9 / bw))
            print(f"{kernel:22s} {shape:30s} {us:9.1f} {gbs:8.0f} {100 * gbs * 1e9 / bw:6.0f}% {gfs:9.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth_GBps": bw / 1e9, "dtype": args.dtype, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
