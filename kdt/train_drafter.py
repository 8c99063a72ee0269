"""``kdt train-drafter``: train the block drafter (:mod:`kdt.reference.drafter`) for a kdt model.

Needs torch (the ``train`` extra; transformers too, for the target's greedy continuations). Steps:

1. **Data**: random prompt windows of a corpus (default: the standard library's training files,
   :mod:`kdt.corpus`), each continued greedily by the target itself (transformers'
   ``DeepseekV3ForCausalLM`` holding the file's weights, float32), so the drafter learns what the
   target will accept. One more target forward records the hidden states of the drafter's
   ``target_layers`` (forward hooks on those decoder layers: the residual stream after the layer,
   what kdt's engine hands the drafter during verify), kept on the training device as torch bf16
   (half of float32) in one preallocated tensor filled batch by batch: 49152 sequences x 256
   positions x 768 features are 19 GB, which an H200 holds; on CPU the host memory is the device.
2. **Training**: :class:`TorchDrafter`, the same equations as the NumPy reference in torch. A training
   row set per sequence is every context row (causal) plus ``anchors`` blocks ``[root, mask ...]``
   rooted at random positions of the generated part; block j sees the context before its root and its
   own rows. A step samples its sequences and roots on the device and builds the whole batch's
   positions and masks there (no host work that grows with the batch). Loss: cross-entropy of depths
   1..B-1 against the target's greedy tokens, weighted ``exp(-(d-1)/gamma)`` (the early depths matter
   most to a tree). AdamW, warmup then cosine decay over the ``--minutes`` budget (so the schedule
   follows elapsed time; ``--steps N --minutes 0`` makes a run repeatable for a seed and device).
3. **Storage**: the weights (float32) and config go under ``/drafter`` of the model file (atomic
   rewrite; the model's own weights are copied bit for bit), with the training summary in its meta.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

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


def bf16_tensor(bits: np.ndarray):
    """bf16 bit patterns (uint16 NumPy) -> a torch.bfloat16 tensor of the same values, sharing their memory."""
    torch = _torch()
    return torch.from_numpy(np.asarray(bits, np.uint16).view(np.int16)).view(torch.bfloat16)


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
    mask [N, R, R] (True = visible); positions and mask as tensors on the device (or NumPy arrays).
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
        inv_freq, self.rope_factor = ops.rope_inv_freq(self.cfg)
        self.inv_freq = self.tensor(inv_freq, torch.float64)  # [dr/2]

    def tensor(self, a, dtype=None):
        """A NumPy array (copied; uint16 = bf16 bit patterns) or a tensor (as is when it already fits) on this
        drafter's device, floating values in its dtype unless ``dtype``."""
        torch = _torch()
        if not isinstance(a, torch.Tensor):
            a = np.asarray(a)
            a = bf16_tensor(a) if a.dtype == np.uint16 else torch.tensor(a)
        return a.to(device=self.device, dtype=dtype or (self.dtype if a.is_floating_point() else None))

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

    def rope_tables(self, positions):
        """positions [N, R] -> cos, sin [N, R, dr/2] on the device, as kdt.reference.ops.rope_cos_sin (float64)."""
        torch = _torch()
        freqs = self.tensor(positions, torch.float64)[..., None] * self.inv_freq
        return ((torch.cos(freqs) * self.rope_factor).to(self.dtype),
                (torch.sin(freqs) * self.rope_factor).to(self.dtype))

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

    def stack(self, x, positions, mask):
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


def batch_layout(S: int, anchors, B: int):
    """anchors [N, J] (long tensor) -> (positions [N, R], mask [N, R, R]): :func:`row_layout` of each row of
    anchors, built at once on their device."""
    torch = _torch()
    r = torch.arange(S + anchors.shape[1] * B, device=anchors.device)
    blk = (r - S).div(B, rounding_mode="floor")  # each row's block (negative: a context row)
    ctx = r < S
    root = anchors[:, blk.clamp(min=0)]  # [N, R]: the root position of each row's block
    pos = torch.where(ctx, r, root + (r - S) % B)
    mask = torch.where(ctx[:, None], r <= r[:, None], (r < root[..., None]) | (blk == blk[:, None]))
    return pos, mask


def sample_anchors(n: int, J: int, lo: int, hi: int, gen):
    """[n, J] roots, each row J distinct positions of [lo, hi] in ascending order (the J largest of uniform
    keys), drawn on ``gen``'s device."""
    keys = _torch().rand(n, hi - lo + 1, generator=gen, device=gen.device)
    return keys.topk(J, dim=1).indices.sort(dim=1).values + lo


def depth_weights(B: int, gamma: float, device="cpu"):
    """[B-1] float64 tensor: the loss weight exp(-(d-1)/gamma) of depths d = 1..B-1."""
    torch = _torch()
    return torch.exp(-torch.arange(B - 1, dtype=torch.float64, device=device) / gamma)


def batch_loss(model: TorchDrafter, tokens, feats, anchors, gamma: float):
    """tokens [N, S] int, feats [N, S, n_feat*D] (float, torch bf16, or bf16 bits as uint16 NumPy), anchors
    [N, J]: NumPy arrays or tensors (device tensors: nothing crosses from the host) -> (weighted loss,
    per-depth top-1 hits [B-1] as a detached tensor, count)."""
    torch = _torch()
    tok, roots = model.tensor(tokens, torch.long), model.tensor(anchors, torch.long)
    N, S = tok.shape
    J, B = roots.shape[1], model.dcfg.block_size
    pos, mask = batch_layout(S, roots, B)
    ctx = model.context(model.tensor(feats))
    blocks = model.block_inputs(tok.gather(1, roots))  # [N, J, B, D]
    x = torch.cat([ctx, blocks.reshape(N, J * B, -1)], dim=1)
    h = model.stack(x, pos, mask)[:, S:].reshape(N, J, B, -1)[:, :, 1:]  # depths 1..B-1
    logits = model.logits(h)  # [N, J, B-1, V]
    tgt_idx = roots[..., None] + torch.arange(1, B, device=roots.device)  # [N, J, B-1]
    target = tok.gather(1, tgt_idx.reshape(N, -1)).reshape(N, J, B - 1)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                           reduction="none").reshape(N, J, B - 1)
    w = depth_weights(B, gamma, ce.device).to(ce.dtype)
    loss = (ce * w).sum(-1).mean() / w.sum()
    hits = (logits.argmax(-1) == target).float().sum(dim=(0, 1))
    return loss, hits.detach(), N * J


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


def hidden_features(model, tokens, layers: tuple[int, ...], batch: int = 32, device: str | None = None):
    """tokens [n, S] -> the hidden states after ``layers`` concatenated, [n, S, len(layers) * D] in bf16,
    written batch by batch into one preallocated array (no second copy): a torch.bfloat16 tensor on
    ``device``, or (``device`` None) NumPy bf16 bit patterns (uint16)."""
    torch = _torch()
    got: dict[int, object] = {}

    def hook(i):
        def fn(_m, _inp, out):
            got[i] = out[0] if isinstance(out, tuple) else out

        return fn

    handles = [model.model.layers[i].register_forward_hook(hook(i)) for i in layers]
    feats = bits = None
    try:
        with torch.no_grad():
            for s in range(0, len(tokens), batch):
                model.model(torch.as_tensor(tokens[s:s + batch], device=model.device))  # no lm_head
                f = torch.cat([got[i] for i in layers], dim=-1).to(torch.bfloat16)  # round to nearest even
                if feats is None:
                    shape = (len(tokens), *f.shape[1:])
                    if device is None:
                        bits = np.empty(shape, np.uint16)
                        feats = bf16_tensor(bits)  # a view: filling it fills bits
                    else:
                        feats = torch.empty(shape, dtype=torch.bfloat16, device=device)
                feats[s:s + len(f)] = f
    finally:
        for h in handles:
            h.remove()
    return feats if device is not None else bits


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
    gen_batch: int | None = None  # prompts per greedy generate() call (None: 4096 on cuda, 64 on cpu)
    feature_batch: int | None = None  # sequences per feature forward (None: 512 on cuda, 32 on cpu)
    lr: float = 2e-3
    warmup: int = 20
    minutes: float = 10.0
    steps: int = 0
    gamma: float = 7.0
    seed: int = 0
    device: str = "cpu"  # torch device of the data generation and the training


def truncated_drafter(drafter, n_layers: int):
    """A :class:`kdt.fixture.Drafter` of the first ``n_layers`` decoder layers of ``drafter`` (with its fc,
    norms and mask embedding): a start for training a shallower drafter (``kdt train-drafter --resume
    --layers N``). Its meta records where it came from."""
    from kdt.fixture import Drafter

    c = drafter.config
    if not 1 <= n_layers <= c.num_hidden_layers:
        raise ValueError(f"keep 1..{c.num_hidden_layers} layers, not {n_layers}")
    keep = {k: v for k, v in drafter.weights.items() if not k.startswith("model.layers.")
            or int(k.split(".")[2]) < n_layers}
    meta = dict(drafter.meta or {}, truncated_from_layers=c.num_hidden_layers)
    return Drafter(replace(c, num_hidden_layers=n_layers), keep, meta)


def train(cfg: ModelConfig, weights: dict[str, np.ndarray], train_stream: np.ndarray, eval_stream: np.ndarray,
          a: TrainArgs, log: Callable[[str], None] = print,
          init=None) -> tuple[DrafterConfig, dict[str, np.ndarray], dict]:
    """Train a drafter for the model (``weights``: its float32 weights). Returns (config, weights, summary).
    ``init`` (a :class:`kdt.fixture.Drafter`): start from its weights and take its shape (block size, layers,
    width, target layers) instead of ``a``'s; the optimizer and the schedule start afresh."""
    torch = _torch()
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    if init is not None:  # its shape replaces a's (the config below is rebuilt from a, and a is recorded)
        c = init.config
        a = replace(a, block_size=c.block_size, layers=c.num_hidden_layers, intermediate_size=c.intermediate_size,
                    target_layers=tuple(c.target_layers))
    layers = tuple(a.target_layers or default_target_layers(cfg.num_hidden_layers))
    dcfg = DrafterConfig(target_layers=layers, block_size=a.block_size, num_hidden_layers=a.layers,
                         intermediate_size=a.intermediate_size)
    dcfg.validate(cfg)
    t0 = time.perf_counter()
    dev, cuda = a.device, a.device == "cuda"
    target = target_model(cfg, weights, dev)
    gen_batch = a.gen_batch or (4096 if cuda else 64)
    feature_batch = a.feature_batch or (512 if cuda else 32)
    log(f"data: {a.sequences} + {a.eval_sequences} prompts of {a.prompt_len} tokens, {a.gen_len} greedy tokens each "
        f"(torch on {dev})")

    def data(target, stream, n):  # tokens [n, S] and features [n, S, n_feat*D] (bf16), both on the device
        tok = greedy_sequences(target, random_windows(stream, n, a.prompt_len, rng), a.gen_len, gen_batch, log)
        tok = torch.as_tensor(tok, device=dev)
        return tok, hidden_features(target, tok, layers, feature_batch, device=dev)

    tr_tok, tr_feat = data(target, train_stream, a.sequences)
    ev_tok, ev_feat = data(target, eval_stream, a.eval_sequences)
    data_s = time.perf_counter() - t0
    log(f"data ready in {data_s:.0f} s: features of layers {list(layers)} ({tr_feat.shape[-1]} per position)")

    del target
    model = TorchDrafter(dcfg, cfg, weights["model.embed_tokens.weight"], lm_head_weight(cfg, weights),
                         weights=None if init is None else init.weights, seed=a.seed, device=a.device)
    if init is not None:
        prev = init.meta or {}
        log(f"resuming from the drafter's weights ({prev.get('steps', '?')} steps, {prev.get('train_s', '?')} s "
            f"of training before)")
    params = list(model.params.values())
    n_params = int(sum(p.numel() for p in params))
    decay = [p for p in params if p.dim() == 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": [p for p in params if p.dim() != 2], "weight_decay": 0.0}], lr=a.lr)
    S, B = tr_tok.shape[1], a.block_size
    lo, hi = a.prompt_len, S - B  # roots in the generated part, with room for a whole block
    gen = torch.Generator(device=dev).manual_seed(a.seed)  # batches and roots, drawn on the device
    ev_anchors = sample_anchors(len(ev_tok), a.anchors, lo, hi, gen)

    def evaluate() -> tuple[float, list[float]]:
        with torch.no_grad():
            loss, hits, count = batch_loss(model, ev_tok, ev_feat, ev_anchors, a.gamma)
        return float(loss), [round(h / count, 4) for h in hits.tolist()]

    total = a.steps or 10**9
    budget_s = a.minutes * 60 if a.minutes > 0 else float("inf")
    curve, step, t_train = [], 0, time.perf_counter()
    log(f"drafter: {a.layers} layers, block {B}, {n_params / 1e6:.2f}M trainable parameters")
    while step < total and time.perf_counter() - t_train < budget_s:
        frac = min(1.0, (time.perf_counter() - t_train) / budget_s) if a.steps == 0 else step / total
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randperm(len(tr_tok), generator=gen, device=dev)[:a.batch]
        loss, _, _ = batch_loss(model, tr_tok[idx], tr_feat[idx], sample_anchors(len(idx), a.anchors, lo, hi, gen),
                                a.gamma)
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
    if init is not None:  # what the run started from (its own summary, less its curve)
        summary["resumed_from"] = {k: v for k, v in (init.meta or {}).items() if k not in ("curve", "acceptance")}
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
                     dtype: str = "float32", log: Callable[[str], None] = print, repeats: int = 1) -> list[dict]:
    """Greedy decoding of held-out prompts with the fixture's learned drafter at ``budgets``, the same
    drafter as a chain (budget = block - 1), the suffix drafter and AR, on ``backend``. Every run's
    tokens are checked equal to AR's (the invariant). Rows: drafter, budget, mean acceptance per step
    (root included), steps, tokens/s (wall clock of this backend) and its ratio to AR's.

    ``repeats`` > 1 times every row that many times, in rounds over all rows (so that a drift of the
    machine's speed meets every row alike), and reports each row's median tokens/s (the runs in
    ``tokens_per_s_runs``); the decoding is deterministic, so acceptance is that of any round."""
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

    for _, kind, budget in runs:  # warm-up (JIT compilation, CUDA graph capture): not part of the timings
        generate(target, windows[0], 2 * B, drafter=drafter(kind), budget=budget, block_size=B)
    ar_tokens: list[list[int]] = []
    rates: list[list[float]] = [[] for _ in runs]  # tokens/s of each row, one per round
    hosts: list[list[float]] = [[] for _ in runs]  # host us per step of each row, one per round
    rows: list[dict] = []
    n_rounds = max(1, int(repeats))
    for rnd in range(n_rounds):
        if n_rounds > 1:
            log(f"  round {rnd + 1} of {n_rounds}")
        for j, (name, kind, budget) in enumerate(runs):
            acc, steps, n_tok, secs, host = [], 0, 0, 0.0, 0.0
            for i, prompt in enumerate(windows):
                res = generate(target, prompt, new_tokens, drafter=drafter(kind), budget=budget, block_size=B)
                if kind is None and rnd == 0:
                    ar_tokens.append(res.tokens)
                elif res.tokens != ar_tokens[i]:
                    raise KdtError(f"invariant broken: {name} budget {budget} differs from AR on prompt {i}")
                acc += res.accept_lengths
                steps += res.steps
                n_tok += len(res.tokens)
                secs += res.decode_s
                host += res.host_s or 0.0
            rates[j].append(n_tok / secs)
            hosts[j].append(host / steps * 1e6)
            if rnd == 0:
                rows.append({"drafter": name, "budget": budget, "block_size": B,
                             "avg_accept": round(float(np.mean(acc)), 3), "steps": steps, "tokens": n_tok})
            if rnd == n_rounds - 1:  # this row's runs are all in: its median, against AR's (row 0)
                row, r = rows[j], rates[j]
                # host time of the one-program device steps, the median round (None: the host runs the steps, CPU)
                row["host_us_per_step"] = round(float(np.median(hosts[j])), 1) if any(hosts[j]) else None
                row["tokens_per_s"] = round(float(np.median(r)), 2)
                row["vs_ar"] = round(float(np.median(r) / np.median(rates[0])), 3)
                if n_rounds > 1:
                    row["tokens_per_s_runs"] = [round(x, 2) for x in r]
                spread = f" (runs {min(r):.0f}-{max(r):.0f})" if n_rounds > 1 else ""
                log(f"  {name:14s} budget {budget:4d}: acceptance {row['avg_accept']:.2f} per step, "
                    f"{row['tokens_per_s']:.1f} tokens/s{spread}, {row['vs_ar']:.2f}x AR"
                    + (f", host {row['host_us_per_step']:.0f} us/step" if row["host_us_per_step"] else ""))
    return rows
