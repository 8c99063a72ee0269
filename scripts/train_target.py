"""Train kdt's demo target: a small DeepSeek-V3-architecture model (MLA + MoE) on Python source.

    .venv/bin/python scripts/train_target.py --minutes 22 --out build/train_target
    # needs the `train` extra: pip install -e '.[train]'  (torch, transformers >= 5, safetensors)

What it does, deterministically for a given ``--seed`` and step count:

- data: every ``*.py`` under the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``, without ``site-packages`` / ``dist-packages``), sorted by
  relative path; every 20th file (index % 20 == 0) is held out for evaluation, the rest is the
  training set. Files are concatenated with a NUL byte (``\\x00``, never found in source) between them:
  it is the model's end-of-file token (``bos_token_id = eos_token_id = 0``, so ``kdt generate`` stops
  there). Vocabulary: the 256 byte values, nothing else (kdt's ByteTokenizer: token id = byte).
- model: transformers' ``DeepseekV3ForCausalLM`` (MLA with q/kv LoRA, interleaved RoPE, one dense layer
  then MoE layers of 8 routed experts in 2 groups, 2 per token, plus a shared expert; sigmoid
  ``noaux_tc`` routing). The router's ``e_score_correction_bias`` is not a trained parameter: it gets
  DeepSeek-V3's auxiliary-loss-free update after every step (``bias += gamma * sign(mean_load - load)``
  per layer, from the experts the batch actually routed to).
- training: fp32 on ``--device`` (auto: the GPU when torch sees one, TF32 matmuls there; else the CPU with
  ``torch.set_num_threads(os.cpu_count())``), random 257-byte windows of the
  training stream (numpy ``default_rng(seed)``), AdamW (weight decay on matrices only), linear warmup then
  cosine decay to 10 %, gradient clipping at 1. The train loss is printed every ``--log-every`` steps and
  the held-out loss (a fixed set of evenly spaced windows of the held-out stream) every
  ``--eval-every`` steps; losses are nats per byte, bits per byte = nats / ln 2.
- ``--minutes`` is a wall-clock budget for the training loop: the step time is measured during warmup
  (steps 10..warmup) and the total step count fixed from it, so the learning-rate schedule is a pure
  function of the step index afterwards; the log records that count, and ``--steps N --minutes 0``
  repeats the run exactly. (A run that still overruns 1.25x the budget stops early and says so.)
- at the end: ``save_pretrained(OUT/hf)`` (safetensors), ``kdt.convert.convert_checkpoint`` to bf16,
  then the fixture is rewritten (atomically, through kdt.fixture's FixtureWriter, every weight copied bit
  for bit with its stored dtype) with tokenizer ``{"kind": "byte"}``, the training summary in its meta
  and golden greedy traces of the float64 reference (``kdt.genref.greedy_reference`` /
  ``logit_margins``) for three held-out prompts, so that ``kdt verify`` works on it. A prompt is kept
  only if every golden step's top1 - top2 margin is >= ``--min-margin``; otherwise its window moves on.
- ``OUT/train_log.json``: arguments, model config, parameter counts, data statistics, the loss curve,
  final train / held-out loss, timings, golden prompts and the fixture's size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kdt.corpus import HOLDOUT_EVERY, SEP, build_stream, stdlib_files  # noqa: E402

LN2 = math.log(2.0)

# The model (Hugging Face DeepseekV3Config field names).
MODEL_CONFIG = dict(
    vocab_size=256, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
    first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    rms_norm_eps=1e-6, max_position_embeddings=1024, rope_interleave=True, tie_word_embeddings=False,
    bos_token_id=SEP, eos_token_id=SEP, pad_token_id=None, initializer_range=0.02,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


# ---- data ----------------------------------------------------------------------------------------
def eval_windows(stream: np.ndarray, n: int, ctx: int) -> np.ndarray:
    """``n`` evenly spaced windows of ``ctx + 1`` bytes of ``stream`` (int64 [n, ctx + 1])."""
    starts = np.linspace(0, len(stream) - ctx - 1, n).astype(np.int64)
    return np.stack([stream[s:s + ctx + 1] for s in starts]).astype(np.int64)


# ---- schedule ------------------------------------------------------------------------------------
def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1.0 - final_frac) * 0.5 * (1.0 + math.cos(math.pi * t)))


# ---- training ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4000, help="most optimizer steps (0: only --minutes limits)")
    ap.add_argument("--minutes", type=float, default=20.0, help="wall-clock budget of the training loop (0: none)")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "train_target", help="work/log directory")
    ap.add_argument("--fixture", type=Path, default=ROOT / "fixtures" / "model_code.h5", help="kdt model written")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256, help="training context (tokens)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--final-lr-frac", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--bias-update", type=float, default=1e-3, help="aux-free router bias step (0: off)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-windows", type=int, default=128, help="held-out windows for periodic evals")
    ap.add_argument("--final-eval-windows", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="torch device (auto: cuda when torch sees a GPU)")
    ap.add_argument("--golden-new", type=int, default=25, help="greedy tokens per golden trace")
    ap.add_argument("--golden-lengths", default="8,24,64", help="golden prompt lengths (bytes)")
    ap.add_argument("--min-margin", type=float, default=0.05)
    args = ap.parse_args(argv)

    import torch
    import transformers

    from kdt.errors import KdtError
    from kdt.train_drafter import torch_device

    try:
        dev = torch_device(args.device)
    except KdtError as e:
        ap.error(str(e))

    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    torch.set_num_threads(max(1, args.threads))
    if dev == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 tensor cores for the fp32 matmuls
    args.out.mkdir(parents=True, exist_ok=True)

    # -- data
    root, files = stdlib_files()
    if not files:
        print(f"no *.py files under {root}", file=sys.stderr)
        return 2
    held = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY == 0]
    train = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY != 0]
    train_stream, _ = build_stream(train)
    held_stream, held_starts = build_stream(held)
    print(f"data: {root} ({platform.python_version()}): {len(files)} files; train {len(train)} files "
          f"{len(train_stream) / 1e6:.2f} MB, held-out {len(held)} files {len(held_stream) / 1e6:.2f} MB", flush=True)
    ev_small = torch.from_numpy(eval_windows(held_stream, args.eval_windows, args.ctx))
    ev_final = torch.from_numpy(eval_windows(held_stream, args.final_eval_windows, args.ctx))
    train_t = torch.from_numpy(train_stream.astype(np.int64))

    # -- model
    hc = transformers.DeepseekV3Config(**MODEL_CONFIG)
    hc._attn_implementation = "sdpa"
    model = transformers.DeepseekV3ForCausalLM(hc).to(dev)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    D, I = hc.hidden_size, hc.moe_intermediate_size  # noqa: E741
    expert = 3 * D * I
    n_active = n_params - hc.n_routed_experts * expert * (hc.num_hidden_layers - hc.first_k_dense_replace) \
        + hc.num_experts_per_tok * expert * (hc.num_hidden_layers - hc.first_k_dense_replace)
    print(f"model: DeepseekV3ForCausalLM {n_params / 1e6:.3f} M parameters ({n_active / 1e6:.3f} M active "
          f"per token); torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name() if dev == 'cuda' else f'CPU, {torch.get_num_threads()} threads'}",
          flush=True)

    # aux-loss-free balancing: remember which experts each MoE layer routed to in this step
    routed: dict[str, list] = {}
    gates = {n: m for n, m in model.named_modules() if isinstance(m, transformers.models.deepseek_v3.
                                                                    modeling_deepseek_v3.DeepseekV3TopkRouter)}

    def hook(name):
        def fn(_m, _inp, out):
            if _m.training:
                routed.setdefault(name, []).append(out[2].detach().reshape(-1))
        return fn

    for n, m in gates.items():
        m.register_forward_hook(hook(n))

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    V = hc.vocab_size

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        x = x.to(dev)
        logits = model(input_ids=x[:, :-1], use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1))

    @torch.no_grad()
    def evaluate(windows: torch.Tensor) -> float:
        model.eval()
        tot = 0.0
        for i in range(0, len(windows), args.batch):
            xb = windows[i:i + args.batch]
            tot += float(loss_of(xb)) * len(xb)
        model.train()
        return tot / len(windows)

    total = args.steps if args.steps > 0 else 10**9
    budget_s = args.minutes * 60.0
    calibrated = budget_s <= 0
    curve: list[dict] = []
    evals: list[dict] = []
    run_loss, run_n, step = 0.0, 0, 0
    stopped_by_clock = False
    t_loop = time.perf_counter()
    t_cal = None
    load_stats: dict[str, list[int]] = {}
    print(f"training: batch {args.batch} x {args.ctx} tokens, lr {args.lr} (warmup {args.warmup}, cosine to "
          f"{args.final_lr_frac:g}x), budget {args.minutes:g} min / {args.steps} steps", flush=True)
    while step < total:
        if step == 10:
            t_cal = time.perf_counter()
        if not calibrated and step == max(args.warmup, 20):
            per_step = (time.perf_counter() - t_cal) / (step - 10)
            remaining = budget_s - (time.perf_counter() - t_loop)
            # a held-out eval is eval_windows / batch forwards, a forward about a third of a training step
            per_step_evals = per_step * (1.0 + args.eval_windows / args.batch / 3.0 / args.eval_every)
            fit = step + int(max(0.0, remaining) / per_step_evals)
            total = max(step + 1, min(total, fit))
            calibrated = True
            print(f"calibrated: {per_step:.2f} s/step -> {total} steps in the {args.minutes:g}-minute budget",
                  flush=True)
        lr = lr_at(step, total if calibrated else 10**9, args.lr, args.warmup, args.final_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = rng.integers(0, len(train_t) - args.ctx - 1, size=args.batch)
        xb = torch.stack([train_t[s:s + args.ctx + 1] for s in starts])
        routed.clear()
        loss = loss_of(xb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        if args.bias_update > 0:
            with torch.no_grad():
                for n, m in gates.items():
                    idx = torch.cat(routed.get(n, []))
                    load = torch.bincount(idx, minlength=m.num_experts).float()
                    m.e_score_correction_bias += args.bias_update * torch.sign(load.mean() - load)
                    load_stats[n] = load.long().tolist()
        step += 1
        run_loss += loss.item()
        run_n += 1
        elapsed = time.perf_counter() - t_loop
        if step % args.log_every == 0 or step == total:
            tl = run_loss / run_n
            curve.append({"step": step, "train_loss": round(tl, 5), "lr": lr, "grad_norm": round(gnorm, 4),
                          "elapsed_s": round(elapsed, 1)})
            tok_s = step * args.batch * args.ctx / elapsed
            print(f"step {step:5d}/{total if calibrated else '?'} train {tl:.4f} ({tl / LN2:.3f} bpb) lr {lr:.2e} "
                  f"gnorm {gnorm:.2f} {tok_s:,.0f} tok/s {elapsed:6.0f} s", flush=True)
            run_loss, run_n = 0.0, 0
        if step % args.eval_every == 0 and step < total:
            el = evaluate(ev_small)
            evals.append({"step": step, "heldout_loss": round(el, 5), "elapsed_s": round(elapsed, 1)})
            imb = [max(v) / (sum(v) / len(v)) for v in load_stats.values()] if load_stats else [0]
            print(f"  eval step {step}: held-out {el:.4f} ({el / LN2:.3f} bpb); expert load max/mean "
                  f"{max(imb):.2f}", flush=True)
        if budget_s > 0 and elapsed > 1.25 * budget_s and step < total:
            stopped_by_clock = True
            print(f"stopping at step {step}: the loop ran past 1.25x the {args.minutes:g}-minute budget", flush=True)
            break
    train_s = time.perf_counter() - t_loop

    # -- final evaluation: held-out (fixed windows) and a same-size sample of training windows
    final_held = evaluate(ev_final)
    tr_starts = np.random.default_rng([args.seed, 1]).integers(0, len(train_t) - args.ctx - 1,
                                                                size=args.final_eval_windows)
    final_train = evaluate(torch.stack([train_t[s:s + args.ctx + 1] for s in tr_starts]))
    evals.append({"step": step, "heldout_loss": round(final_held, 5), "final": True})
    print(f"final (step {step}, {train_s / 60:.1f} min): train {final_train:.4f} nats/byte "
          f"({final_train / LN2:.3f} bpb), held-out {final_held:.4f} nats/byte ({final_held / LN2:.3f} bpb) "
          f"on {args.final_eval_windows} x {args.ctx} held-out bytes", flush=True)

    # -- save, convert, golden traces, fixture
    model.eval()
    hf_dir = args.out / "hf"
    model.save_pretrained(hf_dir, safe_serialization=True)
    summary = {
        "trainer": "scripts/train_target.py", "data": f"Python {platform.python_version()} stdlib *.py "
        f"(held out: every {HOLDOUT_EVERY}th file)", "seed": args.seed, "steps": step, "train_minutes":
        round(train_s / 60, 2), "tokens_seen": step * args.batch * args.ctx,
        "final_train_loss": round(final_train, 5), "final_heldout_loss": round(final_held, 5),
        "final_heldout_bits_per_byte": round(final_held / LN2, 5),
        "final_train_bits_per_byte": round(final_train / LN2, 5), "loss_unit": "nats per byte",
        "params": n_params, "active_params": n_active,
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
    }
    golden_info = write_fixture_from_hf(hf_dir, args.fixture, args.out, summary, held, held_stream, held_starts,
                                        root, args)
    size = args.fixture.stat().st_size
    print(f"wrote {args.fixture} ({size / 1e6:.2f} MB)", flush=True)

    log = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model_config": MODEL_CONFIG, "params": n_params, "active_params": n_active,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "data": {"stdlib": str(root), "files": len(files), "train_files": len(train), "heldout_files": len(held),
                 "train_bytes": int(len(train_stream)), "heldout_bytes": int(len(held_stream))},
        "total_steps_planned": total, "steps": step, "stopped_by_clock": stopped_by_clock,
        "train_seconds": round(train_s, 1), "wall_seconds": round(time.perf_counter() - t_start, 1),
        "curve": curve, "evals": evals, "expert_load_last_step": load_stats,
        "router_bias": {n: [round(float(b), 4) for b in m.e_score_correction_bias] for n, m in gates.items()},
        "final": summary, "golden": golden_info, "fixture": str(args.fixture), "fixture_bytes": size,
        "reproduce": f"--steps {step} --minutes 0 --seed {args.seed}" if not stopped_by_clock else None,
    }
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1))
    print(f"log: {args.out / 'train_log.json'}; total wall time {(time.perf_counter() - t_start) / 60:.1f} min",
          flush=True)
    return 0


def write_fixture_from_hf(hf_dir: Path, fixture: Path, work: Path, summary: dict, held: list[Path],
                          held_stream: np.ndarray, held_starts: list[int], root: Path, args) -> list[dict]:
    """convert (bf16) -> golden traces of the float64 reference -> the final fixture, atomically."""
    from kdt.convert import convert_checkpoint
    from kdt.fixture import FixtureWriter, Golden, open_weights, read_fixture
    from kdt.genref import greedy_reference, logit_margins
    from kdt.reference.model import RefModel

    tmp = work / "converted_bf16.h5"
    conv = convert_checkpoint(hf_dir, tmp, dtype="bf16")
    fx = read_fixture(tmp)  # weights widened exactly from the stored bf16 (what every backend computes with)
    cfg = fx.config
    assert cfg.vocab_size == 256 and cfg.eos_token_id == SEP, (cfg.vocab_size, cfg.eos_token_id)

    n_new = args.golden_new
    lengths = [int(x) for x in args.golden_lengths.split(",") if x.strip()]
    golden: list[Golden] = []
    info: list[dict] = []
    used: set[int] = set()
    t0 = time.perf_counter()
    for plen in lengths:
        found = None
        attempts = 0
        for fi, f in enumerate(held):  # held-out files in order; the window moves 16 bytes per retry
            if fi in used:
                continue
            start = held_starts[fi]
            end = held_starts[fi + 1] - 1 if fi + 1 < len(held_starts) else len(held_stream) - 1
            if end - start < plen + n_new + 64:
                continue
            for shift in range(0, 8 * 16, 16):
                prompt = held_stream[start + shift:start + shift + plen].astype(np.int64)
                model = RefModel(cfg, fx.weights, dtype=np.float64, max_len=plen + n_new)
                output, logits = greedy_reference(model, prompt, n_new)
                margin = logit_margins(logits)
                attempts += 1
                if margin.min() >= args.min_margin:
                    found = (fi, f, shift, prompt, output, logits, margin)
                    break
            if found:
                break
        if found is None:
            raise SystemExit(f"no held-out prompt of {plen} bytes with every margin >= {args.min_margin}")
        fi, f, shift, prompt, output, logits, margin = found
        used.add(fi)
        rel = f.relative_to(root).as_posix()
        name = f"p{plen}"
        golden.append(Golden(name, prompt, output, logits, margin,
                             attrs={"source": rel, "offset": int(shift), "attempts": attempts}))
        text = bytes(prompt.tolist()).decode("utf-8", "replace")
        cont = bytes([t for t in output.tolist() if t < 256]).decode("utf-8", "replace")
        print(f"golden {name}: {rel} +{shift} (attempt {attempts}) min margin {margin.min():.3f}: "
              f"{text!r} -> {cont!r}", flush=True)
        info.append({"name": name, "source": rel, "offset": int(shift), "attempts": attempts,
                     "min_margin": round(float(margin.min()), 4), "prompt": text, "output": cont})
    golden_s = time.perf_counter() - t0

    meta = dict(fx.meta)
    meta["converted_from"] = "save_pretrained of scripts/train_target.py (OUT/hf)"
    meta.update({"training": summary, "tokenizer": "bytes (token id = byte value; 0 = end of file)",
                 "golden": {"generator": "scripts/train_target.py (kdt.genref.greedy_reference, float64 "
                            "RefModel on the stored bf16 weights)", "n_new": n_new,
                            "min_margin": args.min_margin, "prompts": "held-out stdlib files"}})
    # Copy every weight bit for bit with the dtype convert stored it in (bf16 matrices; fp32 router and
    # norms), add the tokenizer and the golden traces: one atomic write through FixtureWriter.
    fixture.parent.mkdir(parents=True, exist_ok=True)
    with open_weights(tmp) as src, FixtureWriter(fixture, cfg, src.weight_dtype, meta=meta) as w:
        for name in src.names:
            raw, dt = src.read_raw(name)
            w.add_weight(name, raw, dtype=dt)
        w.set_tokenizer("byte")
        for g in golden:
            w.add_golden(g)
    tmp.unlink()
    print(f"converted: {conv['params'] / 1e6:.3f} M parameters, {conv['weight_dtype']}; golden traces in "
          f"{golden_s:.1f} s", flush=True)
    return info


if __name__ == "__main__":
    sys.exit(main())
