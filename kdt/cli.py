"""The `kdt` command line: a thin layer over the library.

Exit codes: 0 success, 1 a check failed (verify), 2 bad input (one line on stderr, never a traceback).
"""

from __future__ import annotations

import json
import os
import sys

# Decode-time matrices are small: one BLAS thread beats a contended pool by ~10x (set before numpy loads).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kdt.errors import KdtError

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "fixtures" / "model_tiny.h5"

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="kdt: DeepSeek-V3 / Kimi-K2 (MLA + MoE) inference with DDTree speculative decoding.\n\n"
    "The CUDA backend compiles its kernels on their first use (under a minute at the bundled fixtures' "
    "shapes, several minutes at a full model's) and keeps them on disk "
    "(~/.cache/kdt/kernels or $KDT_CACHE_DIR): later runs start in seconds.",
)
out = Console() if sys.stdout.isatty() else Console(width=160)
err = Console(stderr=True)


def fail(msg: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {msg}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _load(path: Path, load_weights: bool = True):
    from kdt.fixture import read_fixture

    if not path.exists():
        fail(f"{path}: no such file")
    return read_fixture(str(path), load_weights=load_weights)


@app.command("gen-ref")
def gen_ref(
    out_path: Path = typer.Option(Path("fixtures/model_tiny.h5"), "--out", "-o", help="HDF5 file to write."),
    preset: str = typer.Option("tiny", help="Model preset (tiny, micro)."),
    seed: int = typer.Option(0, help="Seed of the weights and the prompts."),
    n_new: int = typer.Option(25, help="Greedy tokens per golden prompt (>= 24)."),
    prompt_lengths: str = typer.Option("1,5,40", help="Comma-separated prompt lengths."),
):
    """Build a small random model and its golden traces (float64 NumPy reference) into an HDF5 fixture."""
    from rich.progress import Progress

    from kdt.fixture import write_fixture
    from kdt.genref import generate_reference, summary_rows

    try:
        lengths = tuple(int(x) for x in prompt_lengths.split(",") if x.strip())
    except ValueError:
        fail(f"--prompt-lengths must be comma-separated integers (got {prompt_lengths!r})")
    t0 = time.perf_counter()
    with Progress(console=err, transient=True) as prog:
        task = prog.add_task("golden traces", total=None)
        fx = generate_reference(preset, seed=seed, prompt_lengths=lengths, n_new=n_new,
                                progress=lambda msg: prog.update(task, description=str(msg)))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_fixture(str(out_path), fx)
    table = Table(title=f"{out_path} ({out_path.stat().st_size / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s)")
    rows = summary_rows(fx)
    for col in rows[0]:
        table.add_column(str(col), no_wrap=col != "output_head")
    for r in rows:
        table.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()))
    out.print(table)


@app.command()
def verify(
    fixture: Path = typer.Argument(DEFAULT_MODEL, help="Fixture with golden traces."),
    backend: str = typer.Option("auto", help="auto | cpu | cuda"),
    dtype: str = typer.Option("float32", help="Weights on the GPU: float32 | bf16."),
    budget: int = typer.Option(16, help="DDTree node budget."),
    block_size: int = typer.Option(8, help="Drafter block size (tree depth + 1)."),
    atol: float = typer.Option(1e-3, help="Largest allowed |logit - golden| for AR."),
):
    """Golden checks: AR and DDTree (oracle, noisy, useless drafters) must reproduce the golden tokens."""
    from kdt.engine import describe_backend, load_target, resolve_backend
    from kdt.verify import run_verify

    fx = _load(fixture)
    if not fx.golden:
        fail(f"{fixture}: holds no golden traces (/golden)")
    be = resolve_backend(backend)
    out.print(f"backend: {describe_backend(be, dtype)}")
    max_len = max(len(g.prompt) + len(g.output) for g in fx.golden) + budget + 2
    table = Table(title=f"kdt verify {fixture}")
    for col in ("prompt", "mode", "tokens", "max |dlogit|", "stats", "result"):
        table.add_column(col, no_wrap=col != "result")

    with err.status("running (first CUDA use compiles kernels)...") if be == "cuda" else _null():
        checks = run_verify(fx, lambda: load_target(fx.config, fx.weights, be, dtype, max_len), budget=budget,
                            block_size=block_size, atol=atol)
    for c in checks:
        table.add_row(c.prompt, c.mode, f"{c.n_match}/{c.n_golden}",
                      "" if c.max_logit_diff != c.max_logit_diff else f"{c.max_logit_diff:.2e}",
                      c.stats() if c.mode != "ar" else f"steps={c.steps}",
                      "[green]PASS[/]" if c.ok else f"[red]FAIL[/] {c.note}")
    out.print(table)
    n_fail = sum(not c.ok for c in checks)
    out.print(f"[bold]{'PASS' if n_fail == 0 else 'FAIL'}[/]: {len(checks) - n_fail}/{len(checks)} checks passed")
    raise typer.Exit(1 if n_fail else 0)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@app.command()
def generate(
    prompt: str = typer.Option(None, "--prompt", "-p", help="Prompt text."),
    prompt_ids: str = typer.Option(None, "--prompt-ids", help="Prompt as comma-separated token ids."),
    model: Path = typer.Option(DEFAULT_MODEL, "--model", "-m", help="HDF5 model file."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="Tokens to generate."),
    drafter: str = typer.Option("auto", help="auto (the file's learned drafter if it has one, else suffix) | "
                                "learned | suffix | useless | none (plain autoregressive)."),
    budget: int = typer.Option(-1, help="DDTree node budget per step (-1: 31 on CUDA, 16 on the CPU, the fastest "
                               "measured with the learned drafter of fixtures/model_code.h5; see docs/PERF.md)."),
    block_size: int = typer.Option(0, help="Drafter block size, tree depth + 1 (0: the learned drafter's, "
                                   "else 8)."),
    temperature: float = typer.Option(0.0, help="0 = greedy; > 0 samples (lossless)."),
    seed: int = typer.Option(0, help="Sampling seed."),
    backend: str = typer.Option("auto", help="auto | cpu | cuda"),
    dtype: str = typer.Option("float32", help="Weights on the GPU: float32 | bf16."),
    max_len: int = typer.Option(0, help="Context length (0 = prompt + max new tokens + budget)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (tokens, text, statistics)."),
):
    """Generate text with DDTree speculative decoding, streaming tokens as they are committed."""
    from kdt.drafters import make_drafter
    from kdt.engine import describe_backend, load_target, resolve_backend
    from kdt.reference.decode import generate as run
    from kdt.tokenizer import load_tokenizer

    if (prompt is None) == (prompt_ids is None):
        fail("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    if max_new_tokens < 1:
        fail("--max-new-tokens must be >= 1")
    if budget < -1 or block_size < 0 or block_size == 1:
        fail("--budget must be >= 0 (or -1: by backend) and --block-size >= 2")
    if drafter not in ("auto", "learned", "suffix", "useless", "none"):
        fail(f"unknown drafter {drafter!r} (auto, learned, suffix, useless, none)")
    from kdt.kernels.ddtree import MAX_BUDGET

    be = resolve_backend(backend)
    if budget == -1:  # 31: the largest tree whose verify (32 rows) stays on the small-M kernels (docs/PERF.md)
        budget = 31 if be == "cuda" else 16

    if budget > MAX_BUDGET:
        fail(f"--budget {budget} is above the largest tree kdt builds ({MAX_BUDGET} nodes)")
    fx = _load(model)
    cfg = fx.config
    tok = load_tokenizer(fx.tokenizer)
    if prompt_ids is not None:
        try:
            ids = [int(x) for x in prompt_ids.split(",") if x.strip()]
        except ValueError:
            fail(f"--prompt-ids must be comma-separated integers (got {prompt_ids!r})")
        bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
        if bad:
            fail(f"--prompt-ids: token {bad[0]} outside the vocabulary [0, {cfg.vocab_size})")
    else:
        ids = tok.encode(prompt)
    if not ids:
        fail("the prompt is empty")
    use_budget = 0 if drafter == "none" else budget
    ctx = cfg.max_position_embeddings
    need = len(ids) + max_new_tokens + use_budget + 1
    if len(ids) >= ctx:
        fail(f"prompt of {len(ids)} tokens does not fit the model's {ctx}-token context")
    if max_len and need > max_len:
        fail(f"prompt ({len(ids)}) + max new tokens ({max_new_tokens}) + budget ({use_budget}) exceeds "
             f"--max-len {max_len}")
    if use_budget + len(ids) + 1 > min(max_len or ctx, ctx):
        fail(f"budget {use_budget} larger than the cache allows after a {len(ids)}-token prompt")
    max_len = min(max_len or need, ctx)
    if drafter == "learned" and fx.drafter is None:
        fail(f"{model} carries no learned drafter (train one with: kdt train-drafter {model})")
    if drafter == "auto":
        drafter = "learned" if fx.drafter is not None else "suffix"
    if drafter == "learned":
        block_size = block_size or fx.drafter.config.block_size
        if block_size > fx.drafter.config.block_size:
            fail(f"--block-size {block_size} exceeds the learned drafter's block ({fx.drafter.config.block_size})")
    block_size = block_size or 8
    if not as_json:
        err.print(f"backend: {describe_backend(be, dtype)}; drafter: {drafter}; budget {use_budget}",
                  highlight=False)
    with err.status("loading model (first CUDA use compiles kernels)...") if be == "cuda" else _null():
        target = load_target(cfg, fx.weights, be, dtype, max_len, max_tokens=max(256, use_budget + 1))
    if drafter == "learned":
        from kdt.drafters import learned_drafter

        d = learned_drafter(fx, max_len, target)
    else:
        d = None if drafter == "none" else make_drafter(drafter, cfg.vocab_size, seed=seed)
    stream = tok.stream()

    def on_tokens(new):
        if not as_json:
            sys.stdout.write(stream.feed(new))
            sys.stdout.flush()

    stops = [cfg.eos_token_id] if cfg.eos_token_id is not None else []
    res = run(target, ids, max_new_tokens, drafter=d, budget=use_budget, block_size=block_size,
              temperature=temperature, seed=seed, stop_tokens=stops, on_tokens=on_tokens)
    stats = {"steps": res.steps, "n_tokens": len(res.tokens), "avg_accept": round(res.avg_accept, 3),
             "tokens_per_s": round(res.tokens_per_s, 2), "prefill_s": round(res.prefill_s, 4),
             "decode_s": round(res.decode_s, 4), "finish_reason": res.finish_reason, "backend": be,
             "drafter": drafter, "budget": use_budget, "block_size": block_size}
    if as_json:
        print(json.dumps({"prompt_ids": ids, "tokens": res.tokens, "text": tok.decode(res.tokens), **stats}))
    else:
        sys.stdout.write("\n")
        err.print(f"{len(res.tokens)} tokens in {res.decode_s:.3f} s ({res.tokens_per_s:.1f} tokens/s), "
                  f"steps={res.steps} avg_accept={res.avg_accept:.2f}, finish={res.finish_reason}",
                  highlight=False)


@app.command("train-drafter")
def train_drafter(
    model: Path = typer.Argument(..., help="kdt HDF5 model file (its drafter is added or replaced)."),
    out: Path = typer.Option(None, "--out", "-o", help="Write model + drafter here (default: rewrite MODEL)."),
    minutes: float = typer.Option(10.0, help="Wall-clock budget of the training loop (0: --steps only)."),
    steps: int = typer.Option(0, help="Optimizer steps (0: as many as --minutes allows)."),
    block_size: int = typer.Option(16, help="Block size B: the root and B-1 drafted depths."),
    layers: int = typer.Option(None, help="Drafter decoder layers (default 2; with --resume the drafter's own, and "
                               "fewer keep its first layers)."),
    intermediate: int = typer.Option(512, help="Drafter MLP width."),
    target_layers: str = typer.Option("auto", help="Target layers read as features, e.g. 1,2,3 (auto: up to 3 "
                                      "spread from layer 1 to the last)."),
    sequences: int = typer.Option(384, help="Training prompts, each continued greedily by the target."),
    gen_len: int = typer.Option(192, help="Greedy tokens generated after each 64-token prompt."),
    eval_sequences: int = typer.Option(32, help="Held-out prompts for the loss / top-1 evaluations."),
    corpus: Path = typer.Option(None, help="Directory of training text (default: the Python standard library)."),
    pattern: str = typer.Option("*.py", help="File pattern under --corpus."),
    eval_prompts: int = typer.Option(8, help="Held-out prompts for the final acceptance table (0: skip)."),
    repeats: int = typer.Option(1, help="Time every row of the acceptance table this many times, in rounds over "
                                "all rows, and report each row's median tokens/s (its ratio to AR's too)."),
    budgets: str = typer.Option("16,31,64,256", help="DDTree budgets of the acceptance table, comma-separated (the "
                                "suffix drafter runs at the largest)."),
    seed: int = typer.Option(0, help="Seed of data sampling and initialisation."),
    batch: int = typer.Option(8, help="Sequences per optimizer step (each with --anchors blocks)."),
    anchors: int = typer.Option(8, help="Blocks per training sequence, rooted at distinct generated positions."),
    lr: float = typer.Option(2e-3, help="Peak learning rate (AdamW; linear warmup, cosine decay to a tenth)."),
    device: str = typer.Option("auto", help="torch device of the data generation and training: auto | cpu | "
                               "cuda (auto: cuda when torch sees a GPU)."),
    eval_only: bool = typer.Option(False, "--eval-only", help="Skip training: the acceptance table of MODEL's "
                                   "drafter (with --out: a copy of MODEL whose drafter meta records it)."),
    backend: str = typer.Option("cpu", help="Backend of the acceptance table: cpu | cuda."),
    dtype: str = typer.Option("float32", help="Target weights on the GPU for the table: float32 | bf16."),
    json_out: Path = typer.Option(None, "--json", help="Write the acceptance table (and training summary) here."),
    resume: bool = typer.Option(False, "--resume", help="Start from MODEL's drafter: its weights and its shape "
                                "(--block-size, --intermediate, --target-layers are taken from it; --layers "
                                "fewer than its own keeps its first layers); a fresh optimizer and schedule over "
                                "--minutes / --steps."),
):
    """Train a DFlash-style block drafter for MODEL with torch (the `train` extra) against the target's own
    greedy continuations, store it under /drafter, and print its acceptance on held-out text. On a
    2-core CPU the default run takes ~15 minutes (data ~2, training --minutes, evaluation ~2); with a GPU
    (--device auto picks it) data and batches stay on the GPU: e.g. --layers 3 --intermediate 1024 --sequences
    65536 --batch 256 --anchors 16 --minutes 4.5 (an H200: data ~1 minute; the first of the runs behind the
    drafter committed in fixtures/model_code.h5, whose whole recipe is `make train-demo`)."""
    from kdt.engine import resolve_backend
    from kdt.fixture import Drafter, copy_with_drafter
    from kdt.tokenizer import load_tokenizer
    from kdt.train_drafter import TrainArgs, acceptance_table, corpus_streams, torch_device, train, truncated_drafter

    try:
        table_budgets = tuple(sorted({int(b) for b in budgets.split(",")}))
    except ValueError:
        fail(f"--budgets must be comma-separated integers (got {budgets!r})")
    if not 1 <= table_budgets[0] <= table_budgets[-1] <= 512:
        fail(f"--budgets must lie in [1, 512] (got {budgets!r})")
    if repeats < 1:
        fail(f"--repeats must be >= 1 (got {repeats})")
    fx = _load(model)
    be = resolve_backend(backend)
    log = lambda m: err.print(m, highlight=False, soft_wrap=True)  # noqa: E731  (table rows: one line each)

    def table(eval_stream) -> list[dict]:
        log(f"acceptance on {eval_prompts} held-out prompts ({be} backend, greedy; every run equals AR):")
        rows = acceptance_table(fx, eval_stream, budgets=table_budgets, prompts=eval_prompts, seed=seed, backend=be,
                                dtype=dtype, log=log, repeats=repeats)
        if json_out is not None:
            json_out.write_text(json.dumps({"model": str(model), "backend": be, "dtype": dtype,
                                            "drafter_config": json.loads(fx.drafter.config.to_json()),
                                            "acceptance": rows, "training": fx.drafter.meta}, indent=1))
            log(f"wrote {json_out}")
        return rows

    def record(rows: list[dict]) -> None:  # the table and how it was measured, into the drafter's meta
        run = {"backend": be, "dtype": dtype, "prompts": eval_prompts} | ({"repeats": repeats} if repeats > 1 else {})
        fx.drafter.meta.update(acceptance=rows, acceptance_run=run)

    if eval_only:
        if fx.drafter is None:
            fail(f"{model} carries no learned drafter")
        if eval_prompts < 1:
            fail("--eval-only needs --eval-prompts >= 1")
        rows = table(corpus_streams(load_tokenizer(fx.tokenizer), corpus and str(corpus), pattern)[1])
        if out is not None:
            record(rows)
            copy_with_drafter(model, out, fx.drafter)
            log(f"wrote {out} (its drafter meta records this table)")
        return
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        fail("kdt train-drafter needs torch and transformers: pip install -e '.[train]'")
    if resume and fx.drafter is None:
        fail(f"--resume: {model} carries no learned drafter")
    init = None
    if resume:  # the drafter's own shape, or its first --layers layers
        block_size, own = fx.drafter.config.block_size, fx.drafter.config.num_hidden_layers
        layers = own if layers is None else layers
        if not 1 <= layers <= own:
            fail(f"--resume --layers must be in [1, {own}] (the drafter's layers), got {layers}")
        init = fx.drafter if layers == own else truncated_drafter(fx.drafter, layers)
    layers = 2 if layers is None else layers
    if fx.drafter is not None:
        err.print(f"{model} already carries a drafter: it will be "
                  + ("trained further (--resume)" if resume else "replaced"), highlight=False)
    try:
        tl = None if target_layers == "auto" else tuple(int(x) for x in target_layers.split(","))
    except ValueError:
        fail(f"--target-layers must be 'auto' or comma-separated layer numbers (got {target_layers!r})")
    if corpus is not None and not corpus.is_dir():
        fail(f"--corpus {corpus} is not a directory")
    if minutes <= 0 and steps <= 0:
        fail("give --minutes > 0 or --steps > 0")
    if not lr > 0:
        fail(f"--lr must be > 0 (got {lr})")
    if min(sequences, eval_sequences, layers, intermediate, batch) < 1 or block_size < 2 or gen_len < block_size + 8:
        fail("--sequences, --eval-sequences, --layers, --intermediate, --batch must be >= 1, --block-size >= 2 and "
             "--gen-len >= block size + 8")
    if not 1 <= anchors <= gen_len - block_size + 1:
        fail(f"--anchors must be in [1, gen-len - block size + 1 = {gen_len - block_size + 1}] (got {anchors})")
    dev = torch_device(device)
    args = TrainArgs(block_size=block_size, layers=layers, intermediate_size=intermediate, target_layers=tl,
                     sequences=sequences, eval_sequences=eval_sequences, gen_len=gen_len, minutes=minutes,
                     steps=steps, seed=seed, batch=batch, anchors=anchors, lr=lr, device=dev)
    train_stream, eval_stream = corpus_streams(load_tokenizer(fx.tokenizer), corpus and str(corpus), pattern)
    need = args.prompt_len + args.gen_len
    if min(len(train_stream), len(eval_stream)) <= need:
        fail(f"the corpus is too small: need more than {need} tokens in both its training and held-out files")
    dcfg, weights, summary = train(fx.config, fx.weights, train_stream, eval_stream, args, log=log, init=init)
    fx.drafter = Drafter(dcfg, weights, summary)
    dest = out or model
    copy_with_drafter(model, dest, fx.drafter)  # saved before the evaluation: nothing trained is lost
    log(f"wrote {dest} with its drafter ({sum(a.size for a in weights.values()) / 1e6:.2f}M parameters)")
    if eval_prompts > 0:
        record(table(eval_stream))
        copy_with_drafter(dest, dest, fx.drafter)  # again, with the acceptance table in its meta


@app.command()
def convert(
    src_dir: Path = typer.Argument(..., help="Hugging Face checkpoint directory (config.json, safetensors)."),
    out_file: Path = typer.Argument(..., help="kdt HDF5 file to write (atomically)."),
    dtype: str = typer.Option("fp32", "--dtype", help="Stored weight matrices: fp32 | bf16."),
):
    """Convert a Hugging Face DeepSeek-V3 / Kimi-K2 / Moonlight checkpoint (fp32, bf16 or FP8
    block-quantised safetensors) into kdt's HDF5 format."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from kdt.convert import OUT_DTYPES, convert_checkpoint

    if dtype not in OUT_DTYPES:
        fail(f"--dtype must be fp32 or bf16 (got {dtype!r})")
    columns = (TextColumn("converting"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn(), TextColumn("{task.fields[tensor]}"))
    with Progress(*columns, console=err, transient=True) as prog:
        task = prog.add_task("convert", total=None, tensor="")

        def on_progress(done: int, total: int, name: str) -> None:
            prog.update(task, completed=done, total=total, tensor=name)

        s = convert_checkpoint(src_dir, out_file, dtype=dtype, progress=on_progress)
    table = Table(title=f"kdt convert: {out_file} ({s['bytes_written'] / 1e6:.1f} MB, {s['seconds']:.1f} s)",
                  show_header=False)
    table.add_column("")
    table.add_column("")
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(s["skipped"].items())) or "none"
    ignored = f"{len(s['ignored'])}: {', '.join(s['ignored'][:3])}" if s["ignored"] else "none"
    kept = " (router and norms float32)" if s["weight_dtype"] == "bfloat16" else ""
    rows = [
        ("source", f"{s['source']} ({s['model_type']}, {s['shards']} shard(s))"),
        ("source dtypes", ", ".join(f"{k} x{v}" for k, v in sorted(s["source_dtypes"].items()))),
        ("quantization", s["quantization"] or "none"),
        ("model", f"{s['layers']} layers ({s['moe_layers']} MoE, {s['experts']} experts), "
                  f"{s['params']:,} params, embeddings {'tied' if s['tied_embeddings'] else 'untied'}"),
        ("expert layout", s["expert_layout"]),
        ("written", f"{s['tensors_written']} tensors as {s['weight_dtype']}{kept}"),
        ("skipped tensors", skipped),
        ("ignored tensors", ignored),
        ("tokenizer", s["tokenizer"] or "none (no tokenizer.json)"),
        ("read", f"{s['bytes_read'] / 1e6:.1f} MB"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    out.print(table)


@app.command()
def bench(
    model: Path = typer.Option(None, "--model", "-m", help="HDF5 model (default: the bundled fixture)."),
    preset: str = typer.Option(None, help="Instead of a file: tiny | moonlight-16b-a3b | kimi-k2 with random "
                               "weights drawn on the device (CUDA) or the host (CPU)."),
    layers: int = typer.Option(0, help="Keep only the first N layers of a preset (to fit one GPU)."),
    dtype: str = typer.Option("bf16", help="Weights on the GPU: float32 | bf16."),
    backend: str = typer.Option("auto", help="auto | cpu | cuda"),
    quick: bool = typer.Option(False, help="Small sizes and few repeats (CI smoke run)."),
    budget: int = typer.Option(0, help="DDTree budget (0: 64, or 16 with --quick)."),
    block_size: int = typer.Option(8, help="Drafter block size."),
    peer: bool = typer.Option(True, help="Also time transformers' DeepseekV3ForCausalLM when importable."),
    json_path: Path = typer.Option(None, "--json", help="Write every number (and device, versions, config) here."),
    plot: Path = typer.Option(None, help="PNG of the verify cost curve and the DDTree stage breakdown."),
    compile_jobs: int = typer.Option(0, help="CUDA: first compile the kernels in this many processes at once, each "
                                     "on a 2-layer model of the same shapes (0: compile as the bench goes)."),
):
    """Throughput and latency against the physical floor (bytes / measured copy bandwidth) and a peer."""
    import dataclasses

    from kdt import bench as B
    from kdt import peer as P
    from kdt.config import preset as get_preset
    from kdt.engine import describe_backend, load_target, resolve_backend

    if model is not None and preset is not None:
        fail("give --model or --preset, not both")
    if compile_jobs < 0:
        fail("--compile-jobs must be >= 0")
    be = resolve_backend(backend)
    bc = B.BenchConfig.quick() if quick else B.BenchConfig()
    if budget:
        bc.budget = budget
    bc.block_size = block_size
    weights = None
    if preset is not None:
        cfg = get_preset(preset)
        if layers:
            if not 0 < layers <= cfg.num_hidden_layers:
                fail(f"--layers must be in [1, {cfg.num_hidden_layers}]")
            cfg = cfg.replace(num_hidden_layers=layers, first_k_dense_replace=min(cfg.first_k_dense_replace, layers))
        if be == "cpu":
            if cfg.n_params() > 2e8:
                fail(f"preset {preset} has {cfg.n_params() / 1e9:.1f}B parameters: too large for the CPU backend")
            from kdt.weights import random_weights

            weights = random_weights(cfg, 0)
        source = f"preset {preset}" + (f" ({layers} layers)" if layers else "")
    else:
        fx = _load(model or DEFAULT_MODEL)
        cfg, weights, source = fx.config, fx.weights, str(model or DEFAULT_MODEL)
    # room for the longest verify prefix + tree (positions past the trained context are fine for timing)
    max_len = max(max(bc.tree_prefixes) + 300, max(bc.prefill_sizes),
                  bc.prompt_len + 2 * bc.decode_tokens + bc.budget + 64)
    err.print(f"backend: {describe_backend(be, dtype)}; {source}; max_len {max_len}", highlight=False)
    max_tokens = max(256, max(bc.prefill_sizes), bc.budget + 1)  # the largest prefill: no chunking while timed
    if compile_jobs > 1 and be == "cuda":
        with err.status(f"compiling the kernels in {compile_jobs} processes..."):
            B.precompile(cfg, be, dtype, max_len, max_tokens, bc, compile_jobs,
                         log=lambda m: err.print(m, highlight=False))
    with err.status("loading weights (first CUDA use compiles kernels)..."):
        target = load_target(cfg, weights, be, dtype, max_len, max_tokens=max_tokens)
    peer_obj, peer_note = None, "not requested"
    if peer:
        if not P.available():
            peer_note = "torch/transformers not importable"
        else:
            try:
                peer_obj = P.TransformersPeer(cfg, target=target if be == "cuda" else None,
                                              host_weights=weights if be == "cpu" else None, dtype=dtype)
                peer_note = "transformers DeepseekV3ForCausalLM (eager)"
            except Exception as e:  # noqa: BLE001 - the bench goes on without a peer, and says why
                peer_note = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    err.print(f"peer: {peer_note}", highlight=False)
    wbytes = 2 if (dtype == "bf16" and be == "cuda") else 4
    rows, bw = B.run_bench(target, be, cfg, wbytes, bc, log=lambda m: err.print(m, highlight=False),
                           peer=peer_obj)
    table = Table(title=f"kdt bench: {source}, {describe_backend(be, dtype)}")
    for col in ("measurement", "value", "unit", "time ms", "floor ms", "x floor", "peer", "kdt/peer"):
        table.add_column(col, justify="left" if col == "measurement" else "right", no_wrap=True)
    f = lambda v, p=".2f": "" if v != v else format(v, p)  # noqa: E731
    for r in rows:
        table.add_row(r.name, f(r.value, ".3g"), r.unit, f(r.time_ms, ".3f"), f(r.floor_ms, ".3f"), f(r.x_floor),
                      f(r.peer, ".3g"), f(r.vs_peer))
    out.print(table)
    if json_path is not None:
        doc = {"kdt_bench_version": 1, "environment": B.environment(be), "source": source, "dtype": dtype,
               "config": cfg.to_dict(), "bench": dataclasses.asdict(bc), "peer": peer_note,
               "copy_bandwidth_GBps": bw / 1e9, "rows": [r.to_dict() for r in rows]}
        json_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = json_path.with_suffix(json_path.suffix + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=float))
        os.replace(tmp, json_path)
        err.print(f"wrote {json_path}")
    if plot is not None:
        B.plot(rows, plot)
        err.print(f"wrote {plot}")


def main() -> None:
    try:
        app()
    except KdtError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
