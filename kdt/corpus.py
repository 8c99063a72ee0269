"""The demo corpus: the Python standard library's own source files (every machine has them).

Files are sorted by relative path; every ``HOLDOUT_EVERY``-th file (index % 20 == 0) is held out for
evaluation. A stream is the files' bytes joined by NUL (``SEP``, never found in source: the byte-level
models' end-of-file token). Used by scripts/train_target.py and ``kdt train-drafter``.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

HOLDOUT_EVERY = 20
SEP = 0  # NUL: file separator / end-of-file token


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py")
             if p.is_file() and not ({"site-packages", "dist-packages"} & set(p.relative_to(root).parts))]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    return root, files


def split(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files)."""
    return ([f for i, f in enumerate(files) if i % HOLDOUT_EVERY != 0],
            [f for i, f in enumerate(files) if i % HOLDOUT_EVERY == 0])


def build_stream(files: list[Path]) -> tuple[np.ndarray, list[int]]:
    """Concatenation ``SEP f0 SEP f1 SEP ...`` (uint8) and the start offset of each file's bytes."""
    parts, starts, pos = [], [], 0
    for f in files:
        b = f.read_bytes().replace(bytes([SEP]), b"")  # keep the separator unique
        parts.append(bytes([SEP]))
        pos += 1
        starts.append(pos)
        parts.append(b)
        pos += len(b)
    parts.append(bytes([SEP]))
    return np.frombuffer(b"".join(parts), dtype=np.uint8).copy(), starts
