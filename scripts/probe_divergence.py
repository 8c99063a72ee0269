"""Where greedy DDTree leaves greedy AR on a preset's random weights, and why (run on a GPU; not a test).

    python scripts/probe_divergence.py --preset moonlight-16b-a3b --json out.json

1. As ``kdt bench`` decodes (one-program steps in CUDA graphs): AR, then the oracle drafter (AR's tokens) at the
   given budget; the first token where they differ.
2. The same two decodes with every forward launched directly and each MoE layer's router logits and top-k read back
   (``device_steps=False, keep_logits=True``). Every position both decodes computed with the same input (the same
   token at the same position after the same tokens) is compared layer by layer: the routing's top-k sets, the
   router logits' largest difference, and at the first layer whose sets differ the choice scores (sigmoid + bias)
   of the experts only one side took, beside AR's gap between its k-th and (k+1)-th choice. A top-k flip whose
   scores differ by float32 noise is a near-tie of the routing: the verify's rounding (another split of the keys,
   the tensor cores) is as exact as AR's, yet moves that token's experts, and its hidden state with them.
"""

import argparse
import json

import numpy as np
from numba import cuda

from kdt.bench import leaves_ar_at
from kdt.config import preset
from kdt.drafters import OracleDrafter
from kdt.engine import load_target
from kdt.kernels import moe
from kdt.reference.decode import ar_generate, generate
from kdt.reference.ops import choice_scores


class Recorder:
    """Each forward's rows (token, position) and, per MoE layer, the router logits [M, E] and top-k [M, k]."""

    def __init__(self, target):
        self.forwards, self.bias, self.on = [], {}, False
        self.target, self._moe, self._run = target, moe.moe_forward, target._run
        moe.moe_forward = self._moe_hook
        target._run = self._run_hook

    def start(self) -> None:
        """Record from here; the target launches directly (its expert count bypasses the graphs)."""
        self.on, self.target.record_experts = True, []

    def _run_hook(self, M: int) -> None:
        if self.on:  # the forward's staged inputs (a verify stages its tree on the device)
            b = self.target.buf
            self.forwards.append(dict(tokens=b.tokens[:M].copy_to_host(), positions=b.positions[:M].copy_to_host(),
                                      layers=[]))
        self._run(M)

    def _moe_hook(self, b, layer, scratch, out, M=None, **kw):
        self._moe(b, layer, scratch, out, M=M, **kw)
        if self.on:
            n = len(self.forwards[-1]["layers"])
            if n not in self.bias:
                self.bias[n] = layer.bias.copy_to_host()
            m = b.shape[0] if M is None else M
            self.forwards[-1]["layers"].append((scratch.logits[:m].copy_to_host(), scratch.topk_idx[:m].copy_to_host()))

    def take(self) -> list[dict]:
        out, self.forwards = self.forwards, []
        return out


def rows_by_input(forwards, prompt, tokens) -> dict[int, tuple[dict, int]]:
    """position p -> (forward, row) of the row that fed token seq[p] at position p (seq = prompt + tokens); a
    forward's rows with other tokens (rejected tree nodes) are skipped, the first match kept."""
    seq = np.concatenate([prompt, tokens])
    out = {}
    for f in forwards:
        for r, (t, p) in enumerate(zip(f["tokens"], f["positions"], strict=True)):
            if p < len(seq) and seq[p] == t and p not in out:
                out[int(p)] = (f, r)
    return out


def compare(cfg, ar_rows, dd_rows, bias, upto: int) -> dict:
    """Positions below ``upto`` that both decodes computed from the same input: how many have a layer whose top-k
    sets differ, and the largest router-logit difference before any flip."""
    flips, max_pre = [], 0.0
    for p in sorted(set(ar_rows) & set(dd_rows)):
        if p >= upto:
            continue
        (fa, ra), (fd, rd) = ar_rows[p], dd_rows[p]
        for i, ((la, ta), (ld, td)) in enumerate(zip(fa["layers"], fd["layers"], strict=True)):
            if set(ta[ra]) != set(td[rd]):
                flips.append(dict(position=p, layer=i, **flip_detail(cfg, la[ra], ld[rd], ta[ra], td[rd], bias[i])))
                break
            max_pre = max(max_pre, float(np.abs(la[ra] - ld[rd]).max()))
    return dict(flips=flips, max_router_logit_diff_unflipped=max_pre)


def flip_detail(cfg, la, ld, ta, td, bias) -> dict:
    ca, cd = (choice_scores(x.astype(np.float64), bias)[1] for x in (la, ld))  # (in float64, as the reference)
    only_ar, only_dd = sorted(set(ta) - set(td)), sorted(set(td) - set(ta))
    k = cfg.num_experts_per_tok
    order = np.sort(ca)[::-1]
    return dict(only_ar=[int(e) for e in only_ar], only_dd=[int(e) for e in only_dd],
                scores_ar_dd={int(e): [float(ca[e]), float(cd[e])] for e in only_ar + only_dd},
                ar_gap_k=float(order[k - 1] - order[k]), router_logit_diff=float(np.abs(la - ld).max()),
                router_logit_scale=float(np.abs(la).max()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="moonlight-16b-a3b")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    cfg = preset(a.preset)
    V = cfg.vocab_size
    target = load_target(cfg, None, "cuda", a.dtype, a.max_len, max_tokens=max(a.budget + 1, a.prompt_len))
    rng = np.random.default_rng(a.seed)
    prompt = rng.integers(0, V, a.prompt_len)
    ar = ar_generate(target, prompt, a.tokens)
    seq = np.concatenate([prompt, ar.tokens, rng.integers(0, V, 64)])
    kw = dict(budget=a.budget, block_size=a.block_size)
    dd = generate(target, prompt, a.tokens, drafter=OracleDrafter(seq, V), **kw)
    out = dict(preset=a.preset, dtype=a.dtype, tokens=a.tokens, budget=a.budget,
               graphs=dict(first_diff=leaves_ar_at(dd.tokens, ar.tokens), avg_accept=dd.avg_accept))
    print("step programs:", out["graphs"], flush=True)

    rec = Recorder(target)
    rec.start()
    ar2 = ar_generate(target, prompt, a.tokens, device_steps=False, keep_logits=True)
    fa = rec.take()
    dd2 = generate(target, prompt, a.tokens, drafter=OracleDrafter(seq, V), device_steps=False, keep_logits=True,
                   **kw)
    fd = rec.take()
    cuda.synchronize()
    d = leaves_ar_at(dd2.tokens, ar2.tokens)  # None: none
    res = dict(first_diff=d, avg_accept=dd2.avg_accept, ar_same_as_graphs=ar2.tokens == ar.tokens,
               dd_same_as_graphs=dd2.tokens == dd.tokens)
    ar_rows, dd_rows = rows_by_input(fa, prompt, np.array(ar2.tokens)), rows_by_input(fd, prompt, np.array(ar2.tokens))
    upto = a.prompt_len + (a.tokens if d is None else d)
    res.update(compare(cfg, ar_rows, dd_rows, rec.bias, upto))
    if d is not None:
        la, ld = np.asarray(ar2.logits[d], np.float64), np.asarray(dd2.logits[d], np.float64)
        top = np.sort(la)[::-1]
        p = a.prompt_len + d - 1  # the input row that chose token d
        res["at_diff"] = dict(token=d, position=p, ar_margin=float(top[0] - top[1]), logits_std=float(la.std()),
                              logits_max_diff=float(np.abs(la - ld).max()), ar=int(ar2.tokens[d]),
                              dd=int(dd2.tokens[d]), flip=[f for f in res["flips"] if f["position"] == p])
        if p in ar_rows and p in dd_rows:  # that row's router logits layer by layer
            (f1, r1), (f2, r2) = ar_rows[p], dd_rows[p]
            pairs = zip(f1["layers"], f2["layers"], strict=True)
            res["at_diff"]["router_logit_diff_by_layer"] = [float(np.abs(x[r1] - y[r2]).max())
                                                            for (x, _), (y, _) in pairs]
    out["recorded"] = res
    print(json.dumps(out, indent=1), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
