"""`kdt bench`: throughput and latency against the physical floor (SPEC section 5) and a peer.

Every timed forward is reported beside its floor: the bytes it must read once (attention and dense
weights, the union of routed experts its tokens select plus the shared experts, the lm_head, the M
embedding rows, the KV cache [0, L) of every layer) over the copy bandwidth measured in the same run.
The peer is transformers' DeepseekV3ForCausalLM on the same weights and device, when importable.
Timings: CUDA events (or the host clock on the CPU backend) after warm-up, median of repeats.
"""

from __future__ import annotations

import multiprocessing
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from kdt.config import ModelConfig
from kdt.drafters import OracleDrafter, SuffixDrafter
from kdt.reference.ddtree import build_tree
from kdt.reference.decode import TreeOps, ar_generate, generate
from kdt.reference.model import causal_block


@dataclass
class Row:
    name: str  # e.g. "prefill P=512", "verify n=64 L=8192"
    kind: str  # prefill | decode | verify | stage | host | bandwidth
    value: float  # tokens/s for throughput rows, ms for latency rows
    unit: str
    time_ms: float = float("nan")  # median time of the measured unit (one forward / one step)
    floor_ms: float = float("nan")
    peer: float = float("nan")  # the peer's value in the same unit
    extra: dict = field(default_factory=dict)

    @property
    def x_floor(self) -> float:
        return self.time_ms / self.floor_ms if self.floor_ms == self.floor_ms and self.floor_ms > 0 else float("nan")

    @property
    def vs_peer(self) -> float:
        return self.value / self.peer if self.peer == self.peer and self.peer > 0 else float("nan")

    def to_dict(self) -> dict:
        return dict(asdict(self), x_floor=self.x_floor, vs_peer=self.vs_peer)


# ---- clocks and bandwidth --------------------------------------------------------------------------
class Clock:
    """Times a callable: CUDA events on the GPU backend, the host clock on the CPU backend."""

    def __init__(self, backend: str):
        self.gpu = backend == "cuda"

    def sync(self) -> None:
        if self.gpu:
            from numba import cuda

            cuda.synchronize()

    def time_ms(self, fn: Callable[[], object], repeats: int = 5, warmup: int = 2) -> float:
        """Median of ``repeats`` after ``warmup`` calls (two: the CUDA engine captures its graph on the
        second forward of a token count)."""
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(repeats):
            if self.gpu:
                from numba import cuda

                e0, e1 = cuda.event(), cuda.event()
                e0.record()
                fn()
                e1.record()
                e1.synchronize()
                times.append(cuda.event_elapsed_time(e0, e1))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def copy_bandwidth(clock: Clock, nbytes: int) -> float:
    """Bytes/s of a device-to-device (or host memcpy) copy, counting bytes read plus written."""
    n = nbytes // 4
    if clock.gpu:  # GPU time alone (copies queued behind a spin kernel), as the kernel bench measures it
        from numba import cuda

        from kdt.kernels.bench import time_us

        a, b = cuda.device_array(n, np.float32), cuda.device_array(n, np.float32)
        ms = time_us(lambda i: b.copy_to_device(a), batch=4) * 1e-3
    else:
        a, b = np.ones(n, np.float32), np.empty(n, np.float32)
        ms = clock.time_ms(lambda: np.copyto(b, a), repeats=5, warmup=1)
    return 2 * n * 4 / (ms * 1e-3)


# ---- the floor of SPEC section 5 -------------------------------------------------------------------
def forward_bytes(cfg: ModelConfig, wbytes: int, M: int, L: int, experts_per_layer: list[int] | None) -> int:
    """Bytes one forward of M tokens at prefix L must read once. ``experts_per_layer``: the number of
    distinct routed experts the M tokens select in each MoE layer (None: the uniform expectation)."""
    D, H, V, E = cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size, cfg.n_routed_experts
    Rkv, dr, dn, dv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    attn = (Rkv + dr) * D + H * (dn + dv) * Rkv + D * H * dv
    attn += (cfg.q_lora_rank * D + H * (dn + dr) * cfg.q_lora_rank) if cfg.q_lora_rank else H * (dn + dr) * D
    total = cfg.num_hidden_layers * (attn * wbytes + 4 * (2 * D + Rkv + (cfg.q_lora_rank or 0)))
    total += cfg.first_k_dense_replace * 3 * D * cfg.intermediate_size * wbytes
    expert = 3 * D * cfg.moe_intermediate_size * wbytes
    k = cfg.num_experts_per_tok
    for j in range(cfg.n_moe_layers):
        sel = experts_per_layer[j] if experts_per_layer else E * (1 - (1 - k / E) ** M)
        total += sel * expert + cfg.n_shared_experts * expert + 4 * E * (D + 1)
    total += V * D * wbytes + M * D * wbytes + 4 * D  # lm_head, embedding rows, final norm
    total += cfg.num_hidden_layers * L * (Rkv + dr) * 4  # the latent cache
    return int(total)


# ---- stage timing of a DDTree step -----------------------------------------------------------------
class StageTimer:
    """Wraps a target, its tree ops and a drafter so that each stage's time is accumulated (the GPU is
    synchronised at each stage boundary, so this run is slower than an untimed one)."""

    STAGES = ("draft", "tree build", "verify", "target choice", "accept", "compaction")

    def __init__(self, clock: Clock):
        self.clock, self.t = clock, dict.fromkeys(self.STAGES, 0.0)

    def wrap(self, stage: str, fn):
        def timed(*a, **kw):
            self.clock.sync()
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            self.clock.sync()
            self.t[stage] += time.perf_counter() - t0
            return out

        return timed

    def instrument(self, target, drafter):
        ops = getattr(target, "tree_ops", None) or TreeOps()
        timed_ops = type("TimedOps", (), {})()
        timed_ops.build = self.wrap("tree build", ops.build)
        timed_ops.verify = self.wrap("verify", ops.verify)
        timed_ops.choose = self.wrap("target choice", ops.choose)
        timed_ops.accept = self.wrap("accept", ops.accept)
        target.compact = self.wrap("compaction", target.compact)
        drafter.draft = self.wrap("draft", drafter.draft)
        return timed_ops


# ---- the benchmark ---------------------------------------------------------------------------------
@dataclass
class BenchConfig:
    prefill_sizes: tuple[int, ...] = (128, 512, 2048)
    decode_tokens: int = 256  # per decode row (AR, each DDTree drafter): 32 oracle chain steps of block 8
    prompt_len: int = 64
    tree_sizes: tuple[int, ...] = (1, 4, 16, 64, 128, 256)
    tree_prefixes: tuple[int, ...] = (512, 8192)
    budget: int = 64
    block_size: int = 8
    repeats: int = 5
    bandwidth_bytes: int = 1 << 30

    @classmethod
    def quick(cls) -> BenchConfig:
        return cls(prefill_sizes=(16, 64), decode_tokens=16, prompt_len=8, tree_sizes=(1, 4, 16),
                   tree_prefixes=(16, 64), budget=16, repeats=2, bandwidth_bytes=1 << 26)


def _experts_selected(target, tokens, positions, L, mask) -> list[int] | None:
    """Distinct experts per MoE layer for this forward (CUDA: read back from the router; CPU: None)."""
    if not hasattr(target, "record_experts"):
        return None
    target.record_experts = []
    target.forward(tokens, positions, L, mask)
    rec, target.record_experts = target.record_experts, None
    return rec


def leaves_ar_at(tokens, ar_tokens) -> int | None:
    """The first token where a greedy DDTree decode differs from AR's (None: none within both). The invariant holds
    in exact arithmetic; in float32 a verify rounds otherwise than AR's one-token forward, and where AR's choice is a
    near-tie (its top-2 logits, or its routing's k-th and (k+1)-th expert: scripts/probe_divergence.py) the two
    decodes part, every later oracle draft then rejected."""
    n = min(len(tokens), len(ar_tokens))
    return next((i for i in range(n) if tokens[i] != ar_tokens[i]), None)


def _median_run(run: Callable[[], object], n: int) -> tuple[object, float | None, dict[str, float]]:
    """``run()`` (a decode, deterministic: the same tokens every time) n times: the run of median decode time, the
    median host work per step in seconds (None without a host count) and the median of each of its parts a step
    (``GenResult.host_parts``; empty without). One run of 32 steps is at the mercy of one host stall: a 1 ms pause
    spread over 32 steps reads as 31 us more host work a step."""
    runs = sorted((run() for _ in range(max(1, n))), key=lambda r: r.decode_s)
    timed = [r for r in runs if r.host_s is not None]
    host = float(np.median([r.host_s / max(r.steps, 1) for r in timed])) if timed else None
    with_parts = [r for r in timed if getattr(r, "host_parts", None)]
    parts = {k: float(np.median([r.host_parts[k] / max(r.steps, 1) for r in with_parts]))
             for k in (with_parts[0].host_parts if with_parts else {})}
    return runs[(len(runs) - 1) // 2], host, parts


def _decode_rows(target, V: int, bc: BenchConfig, rng, floor_ms, log, peer) -> tuple[list[Row], np.ndarray, np.ndarray]:
    """The decode rows (AR, DDTree with each drafter) and the host work a step; also the prompt and the oracle's
    sequence (the stage breakdown decodes them again)."""
    rows: list[Row] = []
    prompt = rng.integers(0, V, bc.prompt_len)
    ar_generate(target, prompt, 4)  # warm-up (JIT)
    ar, ar_host, ar_parts = _median_run(lambda: ar_generate(target, prompt, bc.decode_tokens), bc.repeats)
    L = bc.prompt_len + bc.decode_tokens // 2
    one = np.ones((1, 1), bool)
    step_ms = ar.decode_s / max(ar.steps, 1) * 1e3
    r = Row("decode AR", "decode", len(ar.tokens) / ar.decode_s, "tok/s", step_ms,
            floor_ms(1, L, prompt[:1], [L], one), extra={"steps": ar.steps})
    if peer is not None:
        r.peer = peer.decode_tokens_per_s(prompt, bc.decode_tokens)
    rows.append(r)
    log(f"{r.name}: {r.value:.1f} tok/s")

    seq = np.concatenate([prompt, ar.tokens, rng.integers(0, V, 64)])
    # warm-up: compiles the tree kernels and every token-count bucket the timed runs will meet
    generate(target, prompt, bc.decode_tokens, drafter=OracleDrafter(seq, V, noise=0.3, seed=2), budget=bc.budget,
             block_size=bc.block_size)
    host_work = {"AR": (ar_host, ar_parts)}  # median host seconds a step, and of its parts
    chain = bc.block_size - 1  # the oracle's best tree is its chain: the whole block, fewest nodes
    # the oracle drafts inside the step program where the engine can (CUDA), so its steps pipeline as a learned
    # drafter's do; "oracle, host draft" is the same drafter on the host (its draft uploaded before each launch)
    for name, drafter, budget in (("oracle", OracleDrafter(seq, V, on_device=True), bc.budget),
                                  ("oracle, host draft", OracleDrafter(seq, V), bc.budget),
                                  ("oracle chain", OracleDrafter(seq, V, on_device=True), chain),
                                  ("noisy", OracleDrafter(seq, V, noise=0.3, seed=1), bc.budget),
                                  ("suffix", SuffixDrafter(V), bc.budget)):
        if budget == chain:  # warm-up of this tree size (JIT, CUDA graph capture)
            generate(target, prompt, 2 * bc.block_size, drafter=OracleDrafter(seq, V), budget=budget,
                     block_size=bc.block_size)
        res, host, parts = _median_run(lambda d=drafter, b=budget: generate(target, prompt, bc.decode_tokens, drafter=d,
                                                                    budget=b, block_size=bc.block_size), bc.repeats)
        per_step = res.decode_s / max(res.steps, 1) * 1e3
        parted = leaves_ar_at(res.tokens, ar.tokens)
        n = budget + 1
        tree_floor = floor_ms(n, L, rng.integers(0, V, n), L + np.arange(n) % bc.block_size, np.eye(n, dtype=bool))
        # the peer column holds the peer's AR decode: DDTree is compared with plain decoding
        rows.append(Row(f"decode DDTree {name}", "decode", len(res.tokens) / res.decode_s, "tok/s", per_step,
                        tree_floor, peer=r.peer,
                        extra={"avg_accept": res.avg_accept, "steps": res.steps, "budget": budget,
                               "block_size": bc.block_size, "vs_kdt_ar": len(res.tokens) / res.decode_s / r.value,
                               "leaves_ar_at": parted}))
        log(f"{rows[-1].name}: {rows[-1].value:.1f} tok/s, avg_accept {res.avg_accept:.2f}"
            + ("" if parted is None else f", leaves AR's tokens at token {parted} (rounding at a near-tie)"))
        if name.startswith("oracle") and budget == bc.budget:
            host_work[f"DDTree {name}"] = (host, parts)
    for name, (host, parts) in host_work.items():  # the host's share of a step: drafting, launch, bookkeeping
        if host is not None:  # (the decode's wall time less the wait for the GPU: one-program steps only)
            rows.append(Row(f"host work per step, {name}", "host", host * 1e3, "ms/step",
                            extra={f"{k}_ms": v * 1e3 for k, v in parts.items()}))
            split = ", ".join(f"{k} {v * 1e6:.0f}" for k, v in parts.items())  # gc: anywhere in the decode
            log(f"{rows[-1].name}: {rows[-1].value * 1e3:.0f} us" + (f" ({split} us)" if split else ""))
    return rows, prompt, seq


def _stage_rows(target, V: int, bc: BenchConfig, clock, prompt, seq) -> list[Row]:
    """The DDTree step's time by stage (the oracle drafter, budget bc.budget), per step."""
    rows: list[Row] = []
    st = StageTimer(clock)
    drafter = OracleDrafter(seq, V)
    target_forward, target_compact = target.forward, target.compact
    ops = st.instrument(target, drafter)
    t0 = time.perf_counter()
    res = generate(target, prompt, bc.decode_tokens, drafter=drafter, budget=bc.budget, block_size=bc.block_size,
                   ops=ops)
    total = time.perf_counter() - t0
    target.forward, target.compact = target_forward, target_compact
    steps = max(res.steps, 1)
    staged = sum(st.t.values())  # the prefill runs through target.forward, outside every stage
    for stage, secs in st.t.items():
        rows.append(Row(f"stage {stage}", "stage", secs / steps * 1e3, "ms/step"))
    host = max(total - res.prefill_s - staged, 0.0)
    rows.append(Row("stage host bookkeeping", "stage", host / steps * 1e3, "ms/step"))
    return rows


def run_bench(target, backend: str, cfg: ModelConfig, wbytes: int, bc: BenchConfig,
              log: Callable[[str], None] = print, peer=None) -> tuple[list[Row], float]:
    """All measurements of one target. Returns the rows and the measured copy bandwidth (bytes/s)."""
    clock = Clock(backend)
    rng = np.random.default_rng(0)
    V = cfg.vocab_size
    bw = copy_bandwidth(clock, bc.bandwidth_bytes)
    rows = [Row("copy bandwidth", "bandwidth", bw / 1e9, "GB/s")]
    log(f"copy bandwidth {bw / 1e9:.1f} GB/s")

    def floor_ms(M, L, tokens, positions, mask):
        sel = _experts_selected(target, tokens, positions, L, mask)
        return forward_bytes(cfg, wbytes, M, L, sel) / bw * 1e3

    if peer is not None:  # the peer must compute the same model: compare logits once
        toks = rng.integers(0, V, 8)
        mine = np.asarray(target.forward(toks, np.arange(8), 0, causal_block(8)), dtype=np.float64)
        theirs = peer.logits(toks).astype(np.float64)
        err_rel = float(np.linalg.norm(mine - theirs) / np.linalg.norm(mine))
        top1 = float(np.mean(mine.argmax(-1) == theirs.argmax(-1)))
        # a bf16 peer computes in bf16 activations (kdt: fp32), so its logits drift from ours by its
        # rounding; a float32 peer must agree to ~1e-6 (tests/test_convert.py proves the same model)
        rows.append(Row("peer logits rel. difference", "check", err_rel, "rel", extra={"top1_agreement": top1}))
        log(f"peer logits vs kdt: relative difference {err_rel:.2e}, top-1 agreement {top1:.2f}")

    for P in bc.prefill_sizes:
        if P > target.max_len:
            continue
        toks, pos, mask = rng.integers(0, V, P), np.arange(P), causal_block(P)
        # a prefill's forward: the logits of the last row alone (kdt.reference.decode.prefill), as the peer's
        ms = clock.time_ms(lambda t=toks, p=pos, m=mask: target.forward(t, p, 0, m, last_only=True), bc.repeats)
        r = Row(f"prefill P={P}", "prefill", P / ms * 1e3, "tok/s", ms, floor_ms(P, 0, toks, pos, mask))
        if peer is not None:
            r.peer = peer.prefill_tokens_per_s(toks)
        rows.append(r)
        log(f"{r.name}: {r.value:.1f} tok/s ({ms:.2f} ms)")

    if bc.decode_tokens:  # (0: no decode rows, e.g. a compile job of precompile)
        decode, prompt, seq = _decode_rows(target, V, bc, rng, floor_ms, log, peer)
        rows += decode

    for Lp in bc.tree_prefixes:
        for n in bc.tree_sizes:
            if Lp + n > target.max_len:
                continue
            D = max(1, min(bc.block_size - 1, n))
            logp = np.log(rng.dirichlet(np.ones(max(n, 2)), size=D)[:, : max(n - 1, 1)]).astype(np.float32)
            tree = build_tree(0, rng.integers(0, V, logp.shape), -np.sort(-logp, axis=1), n - 1)
            toks, pos = tree.tokens, tree.positions(Lp)
            ms = clock.time_ms(lambda t=toks, p=pos, L0=Lp, v=tree.visibility: target.forward(t, p, L0, v),
                               bc.repeats)
            rows.append(Row(f"verify n={tree.n} L={Lp}", "verify", ms, "ms", ms,
                            floor_ms(tree.n, Lp, toks, pos, tree.visibility)))
            log(f"{rows[-1].name}: {ms:.3f} ms (floor {rows[-1].floor_ms:.3f})")

    if bc.decode_tokens:
        rows += _stage_rows(target, V, bc, clock, prompt, seq)
    return rows, bw


def compile_parts(bc: BenchConfig) -> list[BenchConfig]:
    """The bench cut into compile jobs for :func:`precompile`: the decode rows (short decodes), each prefill size and
    each verify (n, L) in its own (s28b, Moonlight: the prefills and decode as one job took 195 s of the 199); one
    repeat each."""
    fast = dict(repeats=1, bandwidth_bytes=1 << 20)
    no_trees = dict(tree_sizes=(), tree_prefixes=(), **fast)
    parts = [replace(bc, prefill_sizes=(), decode_tokens=2 * bc.block_size, **no_trees)]
    parts += [replace(bc, prefill_sizes=(P,), decode_tokens=0, **no_trees) for P in bc.prefill_sizes]
    return parts + [replace(bc, prefill_sizes=(), decode_tokens=0, tree_prefixes=(Lp,), tree_sizes=(n,), **fast)
                    for Lp in bc.tree_prefixes for n in bc.tree_sizes]


_JOB_TARGET: dict = {}  # a compile job process's model, kept for its next job


def _compile_job(job) -> str:
    """One job of :func:`precompile` (in a spawned process): ``run_bench`` on the small model, rows discarded."""
    cfg_d, backend, dtype, max_len, max_tokens, part = job
    from kdt.engine import load_target

    key = (repr(sorted(cfg_d.items())), backend, dtype, max_len, max_tokens)
    if key not in _JOB_TARGET:
        cfg = ModelConfig.from_dict(cfg_d)
        weights = None
        if backend == "cpu":
            from kdt.weights import random_weights

            weights = random_weights(cfg, 0)
        _JOB_TARGET.clear()
        _JOB_TARGET[key] = cfg, load_target(cfg, weights, backend, dtype, max_len, max_tokens=max_tokens)
    cfg, target = _JOB_TARGET[key]
    bc = BenchConfig(**part)
    t0 = time.perf_counter()
    run_bench(target, backend, cfg, 2 if dtype == "bf16" else 4, bc, log=lambda m: None)
    what = (f"verify n={bc.tree_sizes[0]} L={bc.tree_prefixes[0]}" if bc.tree_sizes else
            f"prefill P={bc.prefill_sizes[0]}" if bc.prefill_sizes else "decode")
    return f"{what} in {time.perf_counter() - t0:.0f} s"


def precompile(cfg: ModelConfig, backend: str, dtype: str, max_len: int, max_tokens: int, bc: BenchConfig,
               jobs: int, log: Callable[[str], None] = print) -> None:
    """Compile the bench's kernels in ``jobs`` processes at once before the timed run, which then loads them from
    kdt's kernel cache (kdt.kernels.jit_cache) instead of compiling one after another (Moonlight on the H200: more
    than 9 minutes). Each process runs :func:`compile_parts` on a model of cfg's shapes with its first dense and
    first MoE layer only (every kernel the whole model runs, a fraction of its memory: Moonlight ~3 GB a process,
    Kimi-K2 ~40 GB) and random weights."""
    small = cfg.replace(num_hidden_layers=min(cfg.num_hidden_layers, cfg.first_k_dense_replace + 1))
    todo = [(small.to_dict(), backend, dtype, max_len, max_tokens, asdict(p)) for p in compile_parts(bc)]
    t0 = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(min(jobs, len(todo))) as pool:
        for msg in pool.imap_unordered(_compile_job, todo):
            log(f"compiled {msg} ({time.perf_counter() - t0:.0f} s)")


def environment(backend: str) -> dict:
    import numba

    env = {"python": platform.python_version(), "numpy": np.__version__, "numba": numba.__version__,
           "backend": backend, "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        from importlib.metadata import version

        env["numba_cuda"] = version("numba-cuda")
    except Exception:  # noqa: BLE001
        pass
    if backend == "cuda":
        from numba import cuda

        dev = cuda.get_current_device()
        env["device"] = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        env["compute_capability"] = list(dev.compute_capability)
    else:
        env["device"] = platform.processor() or platform.machine()
    return env


def plot(rows: list[Row], path) -> None:
    """Verify cost curve (latency and floor vs tree size, per prefix) and the DDTree stage breakdown."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from kdt.errors import KdtError

        raise KdtError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    curves: dict[str, list[tuple[int, float, float]]] = {}
    for r in rows:
        if r.kind == "verify":
            n, L = (int(p.split("=")[1]) for p in r.name.split()[1:])
            curves.setdefault(f"L={L}", []).append((n, r.time_ms, r.floor_ms))
    for label, pts in curves.items():
        pts.sort()
        a.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"kdt {label}")
        a.plot([p[0] for p in pts], [p[2] for p in pts], "--", label=f"floor {label}")
    a.set(xscale="log", xlabel="tree nodes", ylabel="forward ms", title="verify cost")
    a.legend()
    stages = [r for r in rows if r.kind == "stage"]
    b.barh([r.name.removeprefix("stage ") for r in stages], [r.value for r in stages])
    b.set(xlabel="ms per DDTree step", title="stage breakdown")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
