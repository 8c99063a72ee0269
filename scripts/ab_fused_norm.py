"""RMSNorm folded into linear_v2 everywhere vs by the default rule, on the Moonlight shape (run on a GPU; an A/B
for docs/PERF.md, not a test).

    python scripts/ab_fused_norm.py all|rule

``all``: every projection that takes a norm folds it (``kdt.kernels.linear.fuses_norm`` ignores the weight
size); ``rule``: the default (small weights only: none of Moonlight's). Prints the GPU time of a verify
forward of n = 16 / 64 / 256 tokens at L = 512 (random bf16 weights drawn on the device). Run both modes
back to back on one machine; the kernels compile on the first run (~2-3 min cold).
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kdt.bench import Clock  # noqa: E402
from kdt.config import preset  # noqa: E402
from kdt.engine import load_target  # noqa: E402
from kdt.kernels import linear as lin  # noqa: E402
from kdt.reference.model import causal_block  # noqa: E402


def main(mode: str) -> int:
    if mode not in ("all", "rule"):
        print(__doc__, file=sys.stderr)
        return 2
    if mode == "all":
        lin.fuses_norm = lambda N, Kw, M=None: lin.FUSE_NORM
    cfg = preset("moonlight-16b-a3b")
    t = load_target(cfg, None, "cuda", "bf16", max_len=1024, max_tokens=256)
    clock, rng, L = Clock("cuda"), np.random.default_rng(0), 512
    t.forward(rng.integers(0, cfg.vocab_size, 256), np.arange(256), 0, causal_block(256))
    for n in (16, 64, 256):
        toks, pos, mask = rng.integers(0, cfg.vocab_size, n), L + np.arange(n), causal_block(n)
        ms = clock.time_ms(lambda a=toks, p=pos, m=mask: t.forward(a, p, L, m), repeats=7)
        print(f"{mode:5s} verify n={n:3d} L={L}: {ms:7.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
