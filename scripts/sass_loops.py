"""sm_90 SASS of registered kernels, on a machine without a GPU: registers (ptxas -v) and, for each loop that holds
tensor-core instructions, its instructions / HMMA (what the warp tiles' issue cost comes down to).

    python scripts/sass_loops.py NAME_REGEX [--nvdisasm PATH]

Kernels are those of kdt's sm_90 compile check (``kdt.kernels.common.PTX_REGISTRY``) whose names match NAME_REGEX.
Needs ptxas (``nvidia-cuda-nvcc-cu12``, which ``numba-cuda[cu12]`` brings) and nvdisasm (pip's ``nvidia-cuda-nvdisasm``,
or --nvdisasm / env NVDISASM). A loop is a backward branch and the instructions from its target to it. Not a timing:
the device decides; this says what the kernel asks of the issue slots. Session 48: kernel A's shared gate_up with
b in hi / lo and the shared experts in fragment order (docs/PERF.md).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)  # (the real compiler: before numba is imported)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from numba import cuda  # noqa: E402

from kdt.kernels.compile_check import registry_shard  # noqa: E402

_INS = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"\s*\.L_x_(\d+):")
_BRA_TARGET = re.compile(r"BRA\s+`\(\.L_x_(\d+)\)")


def tool(name: str, given: str | None) -> str:
    """Path of ptxas / nvdisasm: given, on PATH, or in an installed nvidia wheel (the GPU's driver compiles the PTX
    with its own: pick the ptxas of its CUDA version where there is a choice, --ptxas)."""
    if given:
        return given
    found = shutil.which(name)
    if found:
        return found
    import nvidia

    for root in nvidia.__path__:
        hits = sorted(Path(root).glob(f"*/bin/{name}"))
        if hits:
            return str(hits[0])
    raise SystemExit(f"sass_loops: no {name} (pip install nvidia-cuda-nvcc-cu12 / nvidia-cuda-nvdisasm, or --{name})")


def hmma_loops(sass: str) -> list[tuple[int, int]]:
    """(instructions, HMMA) of each loop of the disassembly that holds HMMA, by first address."""
    ins, labels, pending = [], {}, []
    for line in sass.splitlines():
        lab = _LABEL.match(line)
        if lab:
            pending.append(int(lab[1]))
        m = _INS.match(line)
        if m:
            ins.append((int(m[1], 16), m[2]))
            labels.update((p, int(m[1], 16)) for p in pending)
            pending = []
    at = {a: i for i, (a, _) in enumerate(ins)}
    loops = set()
    for i, (a, text) in enumerate(ins):
        m = _BRA_TARGET.search(text)
        target = labels.get(int(m[1])) if m else None
        if target is not None and target < a:
            body = [t for _, t in ins[at[target]: i + 1]]
            n_mma = sum("HMMA" in t for t in body)
            if n_mma:
                loops.add((at[target], len(body), n_mma))
    return [(n, h) for _, n, h in sorted(loops)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pattern", help="regular expression on the registered kernel names")
    ap.add_argument("--nvdisasm", default=os.environ.get("NVDISASM"))
    ap.add_argument("--ptxas", default=None)
    args = ap.parse_args(argv)
    ptxas, nvdisasm = tool("ptxas", args.ptxas), tool("nvdisasm", args.nvdisasm)
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    print(f"ptxas {ptxas}: {version[-1] if version else '?'}", flush=True)
    pat = re.compile(args.pattern)
    chosen = [e for e in registry_shard(0, 1, "sass_loops") or [] if pat.search(e[0])]
    if not chosen:
        print(f"sass_loops: no registered kernel matches {args.pattern!r}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        for name, fn, sig, device in chosen:
            ptx, _ = cuda.compile_ptx(fn, sig, device=device, cc=(9, 0))
            ptx_path.write_text(ptx)
            r = subprocess.run([ptxas, "-arch=sm_90", "-v", str(ptx_path), "-o", str(cubin)], capture_output=True,
                               text=True, check=True)
            regs = re.search(r"Used (\d+) registers", r.stderr)
            spill = re.search(r"(\d+) bytes spill stores", r.stderr)
            sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
            loops = ", ".join(f"{n} / {h}" for n, h in hmma_loops(sass)) or "none"
            print(f"{name}: {regs[1] if regs else '?'} registers, {spill[1] if spill else '?'} bytes spilled; "
                  f"loops with HMMA (instructions / HMMA): {loops}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
