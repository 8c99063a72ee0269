"""`kdt bench --preset tiny --quick` on the CPU backend writes a complete JSON (structure only: no
timing assertions; benchmarks are not tests)."""

import json
import math

import numpy as np

from kdt.bench import forward_bytes
from kdt.config import preset
from kdt.testing import run_kdt


def test_bench_quick_cpu_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    r = run_kdt("bench", "--preset", "tiny", "--quick", "--backend", "cpu", "--json", out, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["kdt_bench_version"] == 1 and doc["environment"]["backend"] == "cpu"
    assert doc["config"]["hidden_size"] == 256 and doc["copy_bandwidth_GBps"] > 0
    rows = {row["name"]: row for row in doc["rows"]}
    for name in ("prefill P=16", "prefill P=64", "decode AR", "decode DDTree oracle",
                 "decode DDTree oracle, host draft", "decode DDTree noisy", "decode DDTree suffix", "verify n=1 L=16",
                 "verify n=16 L=64", "stage draft", "stage tree build", "stage verify", "stage accept",
                 "stage compaction", "stage host bookkeeping"):
        assert name in rows, name
    for name, row in rows.items():
        assert set(row) >= {"kind", "value", "unit", "time_ms", "floor_ms", "x_floor", "peer", "vs_peer"}, name
        if row["kind"] in ("prefill", "decode", "verify"):
            assert row["value"] > 0 and row["floor_ms"] > 0 and row["x_floor"] > 0, name
    assert rows["decode DDTree oracle"]["extra"]["avg_accept"] == 8.0  # block 8, full acceptance
    for name in ("oracle", "oracle, host draft", "oracle chain", "noisy", "suffix"):  # the invariant (SPEC 3)
        assert rows[f"decode DDTree {name}"]["extra"]["leaves_ar_at"] is None, name
    chain = rows["decode DDTree oracle chain"]["extra"]
    assert chain["budget"] == 7 and chain["avg_accept"] == 8.0  # the chain accepts the whole block too
    if "peer logits rel. difference" in rows:  # transformers installed: the peer computes the same model
        assert rows["peer logits rel. difference"]["value"] < 1e-4
        assert rows["decode AR"]["peer"] > 0 and rows["prefill P=64"]["peer"] > 0  # (its logits_to_keep taken)


def test_leaves_ar_at():
    from kdt.bench import leaves_ar_at

    assert leaves_ar_at([5, 6, 7], [5, 6, 7]) is None and leaves_ar_at([5, 6], [5, 6, 7]) is None
    assert leaves_ar_at([5, 9, 7], [5, 6, 7]) == 1 and leaves_ar_at([4], [5]) == 0


def test_floor_bytes_count_weights_experts_and_cache():
    cfg = preset("moonlight-16b-a3b")
    one = forward_bytes(cfg, 2, 1, 0, [6] * cfg.n_moe_layers)
    # Moonlight reads about 2.6B parameters per token in bf16 (the activated set incl. embeddings/lm_head)
    assert 2.2e9 * 2 < one < 3.2e9 * 2
    more_experts = forward_bytes(cfg, 2, 1, 0, [7] * cfg.n_moe_layers)
    assert more_experts - one == cfg.n_moe_layers * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    with_cache = forward_bytes(cfg, 2, 1, 1000, [6] * cfg.n_moe_layers)
    assert with_cache - one == cfg.num_hidden_layers * 1000 * (512 + 64) * 4
    # the uniform expectation of distinct experts lies between k and E
    est = forward_bytes(cfg, 2, 16, 0, None)
    assert forward_bytes(cfg, 2, 16, 0, [6] * 26) < est < forward_bytes(cfg, 2, 16, 0, [64] * 26)
    assert math.isfinite(float(np.float64(est)))


def test_median_run_takes_the_median_decode_and_host_work():
    """The decode rows time several runs: the run of median decode time, and the median host work per step
    (one host stall in one run must not move either)."""
    from types import SimpleNamespace

    from kdt.bench import _median_run

    runs = iter([SimpleNamespace(decode_s=d, host_s=h, steps=10, host_parts={"draft": h / 10, "gc": g})
                 for d, h, g in ((3.0, 0.5, 0.0), (1.0, 0.1, 0.0), (2.0, 0.2, 5.0), (9.0, 0.3, 0.0), (4.0, 0.4, 0.0))])
    med, host, parts = _median_run(lambda: next(runs), 5)
    assert med.decode_s == 3.0 and math.isclose(host, 0.03)
    assert math.isclose(parts["draft"], 0.003) and parts["gc"] == 0.0  # each part's median a step
    one, none, no_parts = _median_run(lambda: SimpleNamespace(decode_s=1.0, host_s=None, steps=4), 3)
    assert one.decode_s == 1.0 and none is None and no_parts == {}


def test_compile_parts_cover_the_bench_once():
    """`kdt bench --compile-jobs`: the compile jobs hold every prefill, the decode rows and every verify (n, L)
    exactly once, each timed once."""
    from kdt.bench import BenchConfig, compile_parts

    bc = BenchConfig()
    parts = compile_parts(bc)
    assert parts[0].decode_tokens > 0 and not parts[0].prefill_sizes and not parts[0].tree_sizes  # the decode rows
    assert sorted(p.prefill_sizes for p in parts if p.prefill_sizes) == [(P,) for P in sorted(bc.prefill_sizes)]
    verifies = [(p.tree_prefixes, p.tree_sizes) for p in parts if p.tree_sizes]
    assert sorted(verifies) == sorted(((L,), (n,)) for L in bc.tree_prefixes for n in bc.tree_sizes)
    assert all(p.decode_tokens == 0 for p in parts[1:])
    assert all(len(p.prefill_sizes) + len(p.tree_sizes) == 1 for p in parts[1:])  # one row a job
    assert all(p.repeats == 1 and p.budget == bc.budget and p.block_size == bc.block_size for p in parts)


def test_precompile_runs_every_part_in_worker_processes():
    """precompile's plumbing (spawned processes, the 2-layer model's config, run_bench without decode rows) on the
    CPU backend, where it compiles nothing: one message per compile job."""
    from kdt.bench import BenchConfig, compile_parts, precompile

    cfg, bc, msgs = preset("tiny"), BenchConfig.quick(), []
    precompile(cfg, "cpu", "float32", 400, 256, bc, jobs=2, log=msgs.append)
    assert len(msgs) == len(compile_parts(bc))
    assert sum(m.startswith("compiled decode") for m in msgs) == 1
    assert {m.split(" in ")[0] for m in msgs if m.startswith("compiled prefill")} == {
        f"compiled prefill P={P}" for P in bc.prefill_sizes}
    assert {m.split(" in ")[0] for m in msgs if m.startswith("compiled verify")} == {
        f"compiled verify n={n} L={L}" for L in bc.tree_prefixes for n in bc.tree_sizes}
