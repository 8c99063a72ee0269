"""``kdt train-drafter``: train the block drafter (:mod:`kdt.reference.drafter`) for a kdt model.

Needs torch (the ``train`` extra; transformers too, for the target's greedy continuations). Steps:

1. **Data**: random prompt windows of a corpus (default: the standard library's training files,
   :mod:`kdt.corpus`), each continued greedily by the target itself (transformers'
   ``DeepseekV3ForCausalLM`` holding the file's weights, float32), so the drafter learns what the
   target will accept. One more target forward records the hidden states of the drafter's
   ``target_layers`` (forward hooks on those decoder layers: the residual stream after the layer,
   what kdt's engine hands the drafter during verify), kept on the host as bf16 (half of float32:
   50k sequences x 256 positions x 768 features are 20 GB).
2. **Training**: :class:`TorchDrafter`, the same equations as the NumPy reference in torch. A training
   row set per sequence is every context row (causal) plus ``anchors`` blocks ``[root, mask ...]``
   rooted at random positions of the generated part; block j sees the context before its root and its
   own rows. Loss: cross-entropy of depths 1..B-1 against the target's greedy tokens, weighted
   ``exp(-(d-1)/gamma)`` (the early depths matter most to a tree). AdamW, warmup then cosine decay
   over the ``--minutes`` budget (so the schedule follows elapsed time; ``--steps N --minutes 0``
   makes a run repeatable for a seed).
3. **Storage**: the weights (float32) and config go under ``/drafter`` of the model file (atomic
   rewrite; the model's own weights are copied bit for bit), with the training summary in its meta.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kdt.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from kdt.config import ModelConfig
from kdt.reference import ops
from kdt.reference.drafter import DrafterConfig, random_drafter_weights
from kdt.reference.model import lm_head_weight


def default_target_layers(n_layers: int, n_feat: int = 3) -> tuple[int, ...]:
    """Up to ``n_feat`` target layers spread from layer 1 to the last (DFlash reads several depths)."""
    if n_layers <= 1:
        return (0,)
    return tuple(sorted({int(round(x)) for x in np.linspace(1, n_layers - 1, min(n_feat, n_layers - 1))}))


# ---- the drafter in torch ---------------------------------------------------------------------------
def _torch():
    import torch

    return torch


def torch_device(name: str = "auto") -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; ``cpu`` / ``cuda`` as given."""
    from kdt.errors import KdtError

    if name not in ("auto", "cpu", "cuda"):
        raise KdtError(f"--device must be auto, cpu or cuda (got {name!r})")
    cuda = _torch().cuda.is_available()
    if name == "cuda" and not cuda:
        raise KdtError("--device cuda: torch sees no CUDA GPU")
    return "cuda" if name == "cuda" or (name == "auto" and cuda) else "cpu"


class TorchDrafter:
    """The drafter's equations in torch (naive MLA: explicit per-head keys and values), for training.

    ``params``: name -> trainable tensor (the names of :func:`drafter_weight_names`); the target's
    ``embed_tokens`` and ``lm_head`` are frozen tensors. Shapes: rows x [N, R, D], positions [N, R],
    mask [N, R, R] (True = visible).
    """

    def __init__(self, dcfg: DrafterConfig, target: ModelConfig, embed_tokens: np.ndarray, lm_head: np.ndarray,
                 weights: dict[str, np.ndarray] | None = None, dtype=None, seed: int = 0, device: str = "cpu"):
        torch = _torch()
        self.dtype, self.device = dtype or torch.float32, device
        self.dcfg, self.cfg = dcfg, dcfg.stack_config(target)
        w = weights or random_drafter_weights(dcfg, target, seed)
        self.params = {n: self.tensor(a).requires_grad_() for n, a in w.items()}
        self.embed_tokens = self.tensor(embed_tokens)
        self.lm_head = self.tensor(lm_head)

    def tensor(self, a, dtype=None):
        """A NumPy array on this drafter's device (floating arrays in its dtype unless ``dtype``)."""
        a = np.asarray(a)
        dt = dtype or (self.dtype if a.dtype.kind == "f" else None)
        return _torch().tensor(a, dtype=dt, device=self.device)

    def export(self) -> dict[str, np.ndarray]:
        return {n: p.detach().to(_torch().float32).cpu().numpy().copy() for n, p in self.params.items()}

    def _rms(self, x, w):
        torch = _torch()
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.cfg.rms_norm_eps) * w

    def _rope(self, x, cos, sin):
        """x [N, R, ..., dr] rotated like kdt.reference.ops.apply_rope; cos/sin [N, R, dr/2]."""
        torch = _torch()
        if self.cfg.rope_interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], -1)
        half = x.shape[-1] // 2
        shape = tuple(cos.shape[:2]) + (1,) * (x.dim() - 3) + (half,)
        c, s = cos.reshape(shape), sin.reshape(shape)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    def rope_tables(self, positions: np.ndarray):
        cos, sin = ops.rope_cos_sin(self.cfg, np.asarray(positions).reshape(-1), np.float64)
        shape = tuple(np.shape(positions)) + (cos.shape[-1],)
        return self.tensor(cos.reshape(shape)), self.tensor(sin.reshape(shape))

    def context(self, features):
        """features [N, T, n_feat*D] -> context rows [N, T, D]."""
        P = self.params
        return self._rms(features @ P["fc.weight"].T, P["hidden_norm.weight"])

    def block_inputs(self, roots):
        """roots [N, J] (long) -> block rows [N, J, B, D]: embedding of the root, then the mask vector."""
        torch = _torch()
        B = self.dcfg.block_size
        root = self.embed_tokens[roots]  # [N, J, D]
        mask = self.params["mask_embedding"].expand(*roots.shape, B - 1, root.shape[-1])
        return torch.cat([root[..., None, :], mask], dim=-2)

    def _mla(self, i: int, a, cos, sin, mask):
        torch = _torch()
        cfg, P = self.cfg, self.params
        p = f"model.layers.{i}.self_attn."
        N, R, _ = a.shape
        H, dn, dr, dv, Rkv = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                              cfg.kv_lora_rank)
        if cfg.q_lora_rank:
            q = self._rms(a @ P[p + "q_a_proj.weight"].T, P[p + "q_a_layernorm.weight"]) @ P[p + "q_b_proj.weight"].T
        else:
            q = a @ P[p + "q_proj.weight"].T
        q = q.reshape(N, R, H, dn + dr)
        q_nope, q_pe = q[..., :dn], self._rope(q[..., dn:], cos, sin)
        c = a @ P[p + "kv_a_proj_with_mqa.weight"].T
        c_kv = self._rms(c[..., :Rkv], P[p + "kv_a_layernorm.weight"])
        k_pe = self._rope(c[..., Rkv:], cos, sin)  # [N, R, dr]
        kv = (c_kv @ P[p + "kv_b_proj.weight"].T).reshape(N, R, H, dn + dv)
        k_nope, v = kv[..., :dn], kv[..., dn:]
        s = (torch.einsum("nmhd,nthd->nhmt", q_nope, k_nope) + torch.einsum("nmhd,ntd->nhmt", q_pe, k_pe))
        s = (s * cfg.softmax_scale).masked_fill(~mask[:, None], float("-inf"))
        o = torch.einsum("nhmt,nthv->nmhv", torch.softmax(s, dim=-1), v).reshape(N, R, H * dv)
        return o @ P[p + "o_proj.weight"].T

    def stack(self, x, positions: np.ndarray, mask):
        """Rows x [N, R, D] through every layer -> [N, R, D] (before the final norm)."""
        torch = _torch()
        P = self.params
        cos, sin = self.rope_tables(positions)
        for i in range(self.dcfg.num_hidden_layers):
            p = f"model.layers.{i}."
            x = x + self._mla(i, self._rms(x, P[p + "input_layernorm.weight"]), cos, sin, mask)
            h = self._rms(x, P[p + "post_attention_layernorm.weight"])
            g, u = h @ P[p + "mlp.gate_proj.weight"].T, h @ P[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(g) * u) @ P[p + "mlp.down_proj.weight"].T
        return x

    def logits(self, h):
        return self._rms(h, self.params["model.norm.weight"]) @ self.lm_head.T


# ---- training rows ------------------------------------------------------------------------------------
@dataclass
class RowLayout:
    """One training example: S context rows then J blocks of B rows (R = S + J*B)."""

    positions: np.ndarray  # [R] int64
    mask: np.ndarray  # [R, R] bool
    roots: np.ndarray  # [J] int64 positions of the roots


def row_layout(S: int, anchors: np.ndarray, B: int) -> RowLayout:
    """Context rows causal; block j (root at position a_j) sees context [0, a_j) and its own B rows."""
    J = len(anchors)
    R = S + J * B
    mask = np.zeros((R, R), bool)
    mask[:S, :S] = np.tril(np.ones((S, S), bool))
    pos = np.empty(R, np.int64)
    pos[:S] = np.arange(S)
    for j, a in enumerate(anchors):
        r0 = S + j * B
        mask[r0:r0 + B, :a] = True
        mask[r0:r0 + B, r0:r0 + B] = True
        pos[r0:r0 + B] = a + np.arange(B)
    return RowLayout(pos, mask, np.asarray(anchors, np.int64))


def depth_weights(B: int, gamma: float) -> np.ndarray:
    return np.exp(-np.arange(B - 1) / gamma)


def batch_loss(model: TorchDrafter, tokens: np.ndarray, feats: np.ndarray, anchors: np.ndarray, gamma: float):
    """tokens [N, S] int64, feats [N, S, n_feat*D] (float, or bf16 bits as uint16), anchors [N, J] ->
    (weighted loss, per-depth top-1 hits [B-1], count)."""
    torch = _torch()
    N, S = tokens.shape
    B = model.dcfg.block_size
    lay = [row_layout(S, a, B) for a in anchors]
    pos = np.stack([x.positions for x in lay])
    mask = model.tensor(np.stack([x.mask for x in lay]))
    tok = model.tensor(tokens)
    roots = model.tensor(anchors)
    ctx = model.context(model.tensor(bf16_bits_to_f32(feats) if feats.dtype == np.uint16 else feats))
    blocks = model.block_inputs(tok.gather(1, roots))  # [N, J, B, D]
    J = anchors.shape[1]
    x = torch.cat([ctx, blocks.reshape(N, J * B, -1)], dim=1)
    h = model.stack(x, pos, mask)[:, S:].reshape(N, J, B, -1)[:, :, 1:]  # depths 1..B-1
    logits = model.logits(h)  # [N, J, B-1, V]
    tgt_idx = roots[..., None] + torch.arange(1, B, device=roots.device)  # [N, J, B-1]
    target = tok.gather(1, tgt_idx.reshape(N, -1)).reshape(N, J, B - 1)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                           reduction="none").reshape(N, J, B - 1)
    w = model.tensor(depth_weights(B, gamma), dtype=ce.dtype)
    loss = (ce * w).sum(-1).mean() / w.sum()
    hits = (logits.argmax(-1) == target).float().sum(dim=(0, 1))
    return loss, hits.detach().cpu().numpy(), N * J


# ---- data from the target ------------------------------------------------------------------------------
def target_model(cfg: ModelConfig, weights: dict[str, np.ndarray], device: str = "cpu"):
    """transformers' DeepseekV3ForCausalLM (float32, on ``device``) holding the kdt weights."""
    from kdt.peer import TransformersPeer

    return TransformersPeer(cfg, host_weights=weights, dtype="float32").model.to(device)


def greedy_sequences(model, prompts: np.ndarray, gen_len: int, batch: int = 64,
                     log: Callable[[str], None] = print) -> np.ndarray:
    """prompts [n, P] -> [n, P + gen_len]: each prompt and the target's greedy continuation."""
    torch = _torch()
    out = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i:i + batch], device=model.device)
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len,
                               min_new_tokens=gen_len, do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(g.cpu().numpy())
            log(f"  greedy continuations: {min(i + batch, len(prompts))}/{len(prompts)} "
                f"({time.perf_counter() - t0:.0f} s)")
    return np.concatenate(out).astype(np.int64)


def hidden_features(model, tokens: np.ndarray, layers: tuple[int, ...], batch: int = 32) -> np.ndarray:
    """tokens [n, S] -> the hidden states after ``layers`` concatenated, [n, S, len(layers) * D] as bf16
    bit patterns (uint16), written into one preallocated array (no second copy at the end)."""
    torch = _torch()
    got: dict[int, object] = {}

    def hook(i):
        def fn(_m, _inp, out):
            got[i] = out[0] if isinstance(out, tuple) else out

        return fn

    handles = [model.model.layers[i].register_forward_hook(hook(i)) for i in layers]
    feats = None
    try:
        with torch.no_grad():
            for s in range(0, len(tokens), batch):
                model(torch.tensor(tokens[s:s + batch], device=model.device))
                f = torch.cat([got[i] for i in layers], dim=-1).float().cpu().numpy()
                if feats is None:
                    feats = np.empty((len(tokens), *f.shape[1:]), np.uint16)
                feats[s:s + len(f)] = f32_to_bf16_bits(f)
    finally:
        for h in handles:
            h.remove()
    return feats


def random_windows(stream: np.ndarray, n: int, length: int, rng: np.random.Generator) -> np.ndarray:
    starts = rng.integers(0, len(stream) - length, n)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int64)


# ---- the training loop ------------------------------------------------------------------------------------
@dataclass
class TrainArgs:
    block_size: int = 16
    layers: int = 2
    intermediate_size: int = 512
    target_layers: tuple[int, ...] | None = None
    sequences: int = 384
    eval_sequences: int = 32
    prompt_len: int = 64
    gen_len: int = 192
    anchors: int = 8
    batch: int = 8
    lr: float = 2e-3
    warmup: int = 20
    minutes: float = 10.0
    steps: int = 0
    gamma: float = 7.0
    seed: int = 0
    device: str = "cpu"  # torch device of the data generation and the training


def train(cfg: ModelConfig, weights: dict[str, np.ndarray], train_stream: np.ndarray, eval_stream: np.ndarray,
          a: TrainArgs, log: Callable[[str], None] = print) -> tuple[DrafterConfig, dict[str, np.ndarray], dict]:
    """Train a drafter for the model (``weights``: its float32 weights). Returns (config, weights, summary)."""
    torch = _torch()
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    layers = tuple(a.target_layers or default_target_layers(cfg.num_hidden_layers))
    dcfg = DrafterConfig(target_layers=layers, block_size=a.block_size, num_hidden_layers=a.layers,
                         intermediate_size=a.intermediate_size)
    dcfg.validate(cfg)
    t0 = time.perf_counter()
    target = target_model(cfg, weights, a.device)
    gen_batch = 1024 if a.device == "cuda" else 64  # prompts per greedy generate() call
    log(f"data: {a.sequences} + {a.eval_sequences} prompts of {a.prompt_len} tokens, {a.gen_len} greedy tokens each "
        f"(torch on {a.device})")
    tr_tok = greedy_sequences(target, random_windows(train_stream, a.sequences, a.prompt_len, rng), a.gen_len,
                              batch=gen_batch, log=log)
    ev_tok = greedy_sequences(target, random_windows(eval_stream, a.eval_sequences, a.prompt_len, rng), a.gen_len,
                              batch=gen_batch, log=log)
    tr_feat = hidden_features(target, tr_tok, layers)
    ev_feat = hidden_features(target, ev_tok, layers)
    data_s = time.perf_counter() - t0
    log(f"data ready in {data_s:.0f} s: features of layers {list(layers)} ({tr_feat.shape[-1]} per position)")

    del target
    model = TorchDrafter(dcfg, cfg, weights["model.embed_tokens.weight"], lm_head_weight(cfg, weights), seed=a.seed,
                         device=a.device)
    params = list(model.params.values())
    n_params = int(sum(p.numel() for p in params))
    decay = [p for p in params if p.dim() == 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": [p for p in params if p.dim() != 2], "weight_decay": 0.0}], lr=a.lr)
    S, B = tr_tok.shape[1], a.block_size
    lo, hi = a.prompt_len, S - B  # roots in the generated part, with room for a whole block

    def anchors(n):
        return np.stack([np.sort(rng.choice(np.arange(lo, hi + 1), a.anchors, replace=False)) for _ in range(n)])

    ev_anchors = anchors(len(ev_tok))

    def evaluate() -> tuple[float, list[float]]:
        with torch.no_grad():
            loss, hits, count = batch_loss(model, ev_tok, ev_feat, ev_anchors, a.gamma)
        return float(loss), [round(float(h) / count, 4) for h in hits]

    total = a.steps or 10**9
    budget_s = a.minutes * 60 if a.minutes > 0 else float("inf")
    curve, step, t_train = [], 0, time.perf_counter()
    log(f"drafter: {a.layers} layers, block {B}, {n_params / 1e6:.2f}M trainable parameters")
    while step < total and time.perf_counter() - t_train < budget_s:
        frac = min(1.0, (time.perf_counter() - t_train) / budget_s) if a.steps == 0 else step / total
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = rng.choice(len(tr_tok), min(a.batch, len(tr_tok)), replace=False)
        loss, hits, count = batch_loss(model, tr_tok[idx], tr_feat[idx], anchors(len(idx)), a.gamma)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 10 == 0 or step == 1:
            rec = {"step": step, "loss": round(float(loss.detach()), 4), "lr": float(f"{lr:.3g}"),
                   "elapsed_s": round(time.perf_counter() - t_train, 1)}
            if step % 50 == 0:
                ev_loss, rec["eval_top1_by_depth"] = evaluate()
                rec["eval_loss"] = round(ev_loss, 4)
            curve.append(rec)
            log("  " + " ".join(f"{k}={v}" for k, v in rec.items() if k != "eval_top1_by_depth")
                + (f" top1[d1..]={rec['eval_top1_by_depth'][:4]}" if "eval_top1_by_depth" in rec else ""))
    ev_loss, ev_top1 = evaluate()
    log(f"final: held-out loss {ev_loss:.4f}, top-1 by depth {ev_top1}")
    summary = {"steps": step, "train_s": round(time.perf_counter() - t_train, 1), "data_s": round(data_s, 1),
               "trainable_parameters": n_params, "final_eval_loss": round(ev_loss, 5),
               "final_eval_top1_by_depth": ev_top1, "args": {k: (list(v) if isinstance(v, tuple) else v)
                                                            for k, v in vars(a).items()},
               "curve": curve}
    return dcfg, model.export(), summary



# ---- corpus and acceptance ------------------------------------------------------------------------
def corpus_streams(tokenizer, corpus: str | None = None, pattern: str = "*.py") -> tuple[np.ndarray, np.ndarray]:
    """(training stream, held-out stream) of token ids: the standard library's files by default, else
    the files matching ``pattern`` under ``corpus`` (every 20th file held out, as kdt.corpus does)."""
    from pathlib import Path

    from kdt.corpus import build_stream, split, stdlib_files
    from kdt.errors import KdtError

    files = stdlib_files()[1] if corpus is None else sorted(p for p in Path(corpus).rglob(pattern) if p.is_file())
    if len(files) < 2:
        raise KdtError(f"the corpus {corpus or 'stdlib'} has {len(files)} file(s) matching {pattern!r}: need >= 2")
    train_files, held_files = split(files)
    if getattr(tokenizer, "kind", "byte") == "byte":
        return build_stream(train_files)[0].astype(np.int64), build_stream(held_files)[0].astype(np.int64)

    def stream(fs):
        return np.asarray([t for f in fs for t in tokenizer.encode(f.read_text(errors="replace"))], np.int64)

    return stream(train_files), stream(held_files)


def acceptance_table(fixture, eval_stream: np.ndarray, budgets=(16, 64, 256), prompts: int = 8,
                     prompt_len: int = 64, new_tokens: int = 96, seed: int = 0, backend: str = "cpu",
                     dtype: str = "float32", log: Callable[[str], None] = print) -> list[dict]:
    """Greedy decoding of held-out prompts with the fixture's learned drafter at ``budgets``, the same
    drafter as a chain (budget = block - 1), the suffix drafter and AR, on ``backend``. Every run's
    tokens are checked equal to AR's (the invariant). Rows: drafter, budget, mean acceptance per step
    (root included), steps, tokens/s (wall clock of this backend)."""
    from kdt.drafters import SuffixDrafter, learned_drafter
    from kdt.engine import load_target
    from kdt.errors import KdtError
    from kdt.reference.decode import generate

    cfg, B = fixture.config, fixture.drafter.config.block_size
    max_len = prompt_len + new_tokens + max(budgets) + 2
    rng = np.random.default_rng(seed)
    windows = random_windows(eval_stream, prompts, prompt_len, rng)
    runs = [("ar", None, 0), ("learned chain", "learned", B - 1)] + [("learned", "learned", b) for b in budgets]
    runs.append(("suffix", "suffix", max(budgets)))
    target = load_target(cfg, fixture.weights, backend, dtype, max_len, max_tokens=max(256, max(budgets) + 1))
    learned = learned_drafter(fixture, max_len, target)  # one drafter for every run: a prefill resets it

    def drafter(kind):
        return learned if kind == "learned" else SuffixDrafter(cfg.vocab_size) if kind == "suffix" else None

    rows = []
    ar_tokens = []
    for name, kind, budget in runs:
        # warm-up of this configuration (JIT compilation, CUDA graph capture): not part of the timings
        generate(target, windows[0], 2 * B, drafter=drafter(kind), budget=budget, block_size=B)
        acc, steps, n_tok, secs, host = [], 0, 0, 0.0, 0.0
        for i, prompt in enumerate(windows):
            res = generate(target, prompt, new_tokens, drafter=drafter(kind), budget=budget, block_size=B)
            if kind is None:
                ar_tokens.append(res.tokens)
            elif res.tokens != ar_tokens[i]:
                raise KdtError(f"invariant broken: {name} budget {budget} differs from AR on prompt {i}")
            acc += res.accept_lengths
            steps += res.steps
            n_tok += len(res.tokens)
            secs += res.decode_s
            host += res.host_s or 0.0
        row = {"drafter": name, "budget": budget, "block_size": B, "avg_accept": round(float(np.mean(acc)), 3),
               "steps": steps, "tokens": n_tok, "tokens_per_s": round(n_tok / secs, 2),
               # host time of the one-program device steps (None: the host runs the steps itself, CPU)
               "host_us_per_step": round(host / steps * 1e6, 1) if host else None}
        rows.append(row)
        log(f"  {name:14s} budget {budget:4d}: acceptance {row['avg_accept']:.2f} per step, "
            f"{row['tokens_per_s']:.1f} tokens/s" + (f", host {row['host_us_per_step']:.0f} us/step" if host else ""))
    return rows
