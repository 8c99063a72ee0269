"""Hugging Face checkpoint -> kdt HDF5 (``kdt convert``).

Takes a DeepSeek-V3-architecture checkpoint directory as published (``config.json`` with model_type
``deepseek_v3`` or ``kimi_k2``; ``model.safetensors`` or shards listed in
``model.safetensors.index.json``; optional ``tokenizer.json``) and writes kdt's HDF5 format through
:class:`kdt.fixture.FixtureWriter` (atomic: a temp file, moved onto the target only on success).

What it understands:

- tensor names: kdt keeps the Hugging Face names (:func:`kdt.reference.model.weight_names`);
  routed experts are read either per expert (``mlp.experts.E.gate_proj.weight``, what checkpoints
  and ``save_pretrained`` hold) or in transformers-5's fused in-memory layout
  (``mlp.experts.gate_up_proj [E, 2I, D]``: rows ``[0, I)`` gate, ``[I, 2I)`` up, as
  ``DeepseekV3Experts.forward`` chunks them; ``mlp.experts.down_proj [E, D, I]``), split expert by
  expert as they are read;
- FP8 block quantisation (``quantization_config.quant_method == "fp8"``): every float8 weight is
  dequantised as ``W = float32(fp8) * weight_scale_inv`` broadcast over ``weight_block_size`` blocks
  (128x128), the partial blocks at the right / bottom edges using their own scale (DeepSeek's
  ``weight_dequant``); the product is one float32 multiplication per element;
- ``q_lora_rank`` null, YaRN ``rope_scaling`` / ``rope_parameters``, ``rope_interleave``, tied
  embeddings (no ``lm_head.weight``), the multi-token-prediction layers
  (``model.layers.{n >= num_hidden_layers}.*``, skipped), zero-width shared-expert tensors that
  transformers saves when ``n_shared_experts == 0`` (skipped);
- keys missing from ``config.json`` take the defaults of transformers' ``DeepseekV3Config``
  (what transformers would compute with), except the model's dimensions, which must be present.

Storage dtype: ``float32`` or ``bf16`` for the weight matrices; the router (``mlp.gate.weight``,
``e_score_correction_bias``; transformers keeps them in fp32) and every 1-D weight (norms) stay
float32. bf16 source tensors are copied bit for bit when stored as bf16.

Memory: one tensor (or one expert of a fused tensor) at a time; the file is read with plain
seeks, never memory-mapped as a whole. Everything that can be checked from the headers (config,
shards, names, shapes, dtypes, scales) is checked before the output file is opened.

The safetensors files are parsed directly (8-byte little-endian header length, JSON header,
raw little-endian data): this reads bf16 and float8 without torch and slices fused tensors per
expert without loading them.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from kdt.config import ModelConfig
from kdt.errors import KdtError
from kdt.fixture import FixtureWriter, bf16_bits_to_f32
from kdt.reference.model import weight_names

__all__ = ["SUPPORTED_MODEL_TYPES", "ConvertProgress", "convert_checkpoint", "dequantize_fp8_blocks",
           "fp8_to_f32", "read_safetensors_header", "TensorInfo"]

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
OUT_DTYPES = {"float32": "float32", "fp32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}

ConvertProgress = Callable[[int, int, str], None]  # (bytes done, bytes total, current tensor)

# transformers' DeepseekV3Config defaults (configuration_deepseek_v3.py) for the keys that change what
# the model computes; a config.json that omits one means this value to transformers. The model's
# dimensions (vocab, hidden, layers, heads, ranks, head dims, experts) are never defaulted.
_HF_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 18432, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "q_lora_rank": 1536,
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "rope_interleave": True,
    "attention_bias": False,
}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size",
             "n_routed_experts")

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def _fail(msg: str) -> KdtError:
    return KdtError(" ".join(str(msg).split()))


def _fmt_shape(shape) -> str:
    s = tuple(int(x) for x in shape)
    return "(" + ", ".join(map(str, s)) + ("," if len(s) == 1 else "") + ")"


def _some(names, limit: int = 3) -> str:
    names = list(names)
    return ", ".join(names[:limit]) + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


# ---- float8 -------------------------------------------------------------------------------------
def _fp8_table(exp_bits: int, man_bits: int, bias: int, fn: bool) -> np.ndarray:
    """float32 value of each of the 256 bit patterns (exact: every float8 value is a float32)."""
    b = np.arange(256, dtype=np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> man_bits) & ((1 << exp_bits) - 1)
    m = (b & ((1 << man_bits) - 1)).astype(np.float64)
    val = np.where(e == 0, m / 2**man_bits * 2.0 ** (1 - bias), (1.0 + m / 2**man_bits) * 2.0 ** (e - bias))
    emax, mmax = (1 << exp_bits) - 1, (1 << man_bits) - 1
    if fn:  # e4m3fn: no infinities, S.1111.111 is NaN
        val = np.where((e == emax) & (m == mmax), np.nan, val)
    else:  # e5m2: IEEE-like
        val = np.where((e == emax) & (m == 0), np.inf, np.where(e == emax, np.nan, val))
    return (sign * val).astype(np.float32)


_FP8_TABLES = {"F8_E4M3": _fp8_table(4, 3, 7, fn=True), "F8_E5M2": _fp8_table(5, 2, 15, fn=False)}


def fp8_to_f32(bits: np.ndarray, dtype: str = "F8_E4M3") -> np.ndarray:
    """float8 bit patterns (uint8) -> float32, exactly (``F8_E4M3`` = torch.float8_e4m3fn)."""
    return _FP8_TABLES[dtype][np.asarray(bits, dtype=np.uint8)]


def dequantize_fp8_blocks(q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128),
                          out: np.ndarray | None = None) -> np.ndarray:
    """``W[i, j] = q[i, j] * scale_inv[i // bm, j // bn]`` in float32 (q already widened to float32).
    ``scale_inv`` must be ``[ceil(rows / bm), ceil(cols / bn)]``: the edge blocks may be partial.
    ``out`` may be ``q`` itself (in place)."""
    q = np.asarray(q, dtype=np.float32)
    s = np.asarray(scale_inv, dtype=np.float32)
    bm, bn = block
    R, C = q.shape
    if s.shape != (-(-R // bm), -(-C // bn)):
        raise ValueError(f"scale shape {s.shape} does not tile {q.shape} in {bm}x{bn} blocks")
    out = np.empty_like(q) if out is None else out
    for i in range(s.shape[0]):
        rows = slice(i * bm, min((i + 1) * bm, R))
        np.multiply(q[rows], np.repeat(s[i], bn)[None, :C], out=out[rows])
    return out


# ---- safetensors headers -----------------------------------------------------------------------
_ST_DTYPES: dict[str, tuple[str, int]] = {  # safetensors dtype -> (numpy storage dtype, bytes)
    "F64": ("<f8", 8), "F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2),
    "F8_E4M3": ("u1", 1), "F8_E5M2": ("u1", 1), "F8_E8M0": ("u1", 1), "U8": ("u1", 1),
}
_FLOAT8 = ("F8_E4M3", "F8_E5M2")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: where its little-endian bytes are."""

    name: str
    file: Path
    dtype: str  # safetensors spelling: F32, BF16, F8_E4M3, ...
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Parse and validate the header of one ``.safetensors`` file (reads no tensor data)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _fail(f"{p}: not a safetensors file (shorter than 8 bytes)")
            n = int.from_bytes(head, "little")
            if n <= 0 or n > min(size - 8, 1 << 30):
                raise _fail(f"{p}: not a safetensors file (header length {n} in a {size}-byte file)")
            raw = f.read(n)
    except OSError as e:
        raise _fail(f"cannot read {p}: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _fail(f"{p}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise _fail(f"{p}: not a safetensors file (header is not a JSON object)")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, ent in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = str(ent["dtype"]), tuple(int(x) for x in ent["shape"]), ent["data_offsets"]
            b, e = int(b), int(e)
        except (KeyError, TypeError, ValueError):
            raise _fail(f"{p}: invalid safetensors header entry for tensor {name!r}") from None
        if any(x < 0 for x in shape) or not 0 <= b <= e or base + e > size:
            raise _fail(f"{p}: tensor {name} lies outside the file (truncated download?)")
        if dtype in _ST_DTYPES and e - b != math.prod(shape) * _ST_DTYPES[dtype][1]:
            raise _fail(f"{p}: tensor {name} has {e - b} bytes for {dtype} {_fmt_shape(shape)}")
        out[name] = TensorInfo(name, p, dtype, shape, base + b, e - b)
    return out


class _Reader:
    """Reads tensors, or one leading-index slice of them, from a set of files kept open."""

    def __init__(self):
        self._files: dict[Path, BinaryIO] = {}

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def raw(self, t: TensorInfo, index: int | None = None) -> np.ndarray:
        """Storage-dtype array of the tensor, or of ``tensor[index]``."""
        np_dtype, item = _ST_DTYPES[t.dtype]
        shape, start = t.shape, t.start
        if index is not None:
            shape = t.shape[1:]
            start += index * math.prod(shape) * item
        arr = np.empty(shape, dtype=np.dtype(np_dtype))
        if arr.nbytes:
            f = self._files.get(t.file)
            if f is None:
                try:
                    f = self._files[t.file] = open(t.file, "rb")  # noqa: SIM115 - closed by close()
                except OSError as e:
                    raise _fail(f"cannot read {t.file}: {e.strerror or e}") from None
            f.seek(start)
            got = f.readinto(memoryview(arr.reshape(-1)).cast("B"))
            if got != arr.nbytes:
                raise _fail(f"{t.file}: truncated while reading tensor {t.name}")
        return arr

    def f32(self, t: TensorInfo, index: int | None = None) -> np.ndarray:
        a = self.raw(t, index)
        if t.dtype == "BF16":
            return bf16_bits_to_f32(a)
        if t.dtype in _FLOAT8:
            return fp8_to_f32(a, t.dtype)
        if t.dtype in ("F8_E8M0", "U8"):  # power-of-two scales (UE8M0): 2^(b - 127), 255 = NaN
            return np.where(a == 255, np.nan, np.ldexp(1.0, a.astype(np.int32) - 127)).astype(np.float32)
        return a.astype(np.float32, copy=False)


# ---- the conversion plan -------------------------------------------------------------------------
@dataclass
class _Job:
    """One read of the source (a tensor or one expert slice) producing one or more kdt weights."""

    label: str
    tensor: TensorInfo
    index: int | None
    scale: TensorInfo | None
    # (kdt name, rows of the read slice, rows of its scale): the gate / up halves of a fused gate_up_proj
    # are quantised as two matrices, so each half has its own block grid (transformers concatenates the
    # per-expert weights and scales to fuse them)
    outputs: list[tuple[str, slice | None, slice | None]]
    nbytes: int = 0


@dataclass
class _Plan:
    jobs: list[_Job] = field(default_factory=list)
    used: set[str] = field(default_factory=set)
    layouts: set[str] = field(default_factory=set)


def _load_config(src: Path) -> tuple[dict[str, Any], ModelConfig, tuple[int, int] | None]:
    path = src / "config.json"
    if not path.is_file():
        raise _fail(f"{src}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _fail(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(raw, dict):
        raise _fail(f"{path}: not a JSON object")
    mt = raw.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        arch = ", ".join(raw.get("architectures") or []) or "?"
        raise _fail(f"{path}: model_type {mt!r} (architectures: {arch}) is not supported; kdt converts "
                    f"{' / '.join(SUPPORTED_MODEL_TYPES)} (DeepSeek-V3 / Kimi K2 / Moonlight) checkpoints")
    d = dict(raw)
    missing = [k for k in _REQUIRED if d.get(k) is None]
    if missing:
        raise _fail(f"{path}: missing field(s) {', '.join(missing)}")
    for k, v in _HF_DEFAULTS.items():
        d.setdefault(k, v)

    def refuse(what: str) -> KdtError:
        return _fail(f"{path}: {what} is not supported by kdt")

    if str(d.get("hidden_act", "silu")).lower() != "silu":
        raise refuse(f"hidden_act={d['hidden_act']!r}")
    if d.get("attention_bias"):
        raise refuse("attention_bias=true")
    if d.get("scoring_func") not in (None, "sigmoid"):
        raise refuse(f"scoring_func={d['scoring_func']!r} (sigmoid routing only)")
    if d.get("topk_method") not in (None, "noaux_tc"):
        raise refuse(f"topk_method={d['topk_method']!r} (noaux_tc routing only)")
    if d.get("moe_layer_freq") not in (None, 1):
        raise refuse(f"moe_layer_freq={d['moe_layer_freq']!r}")
    for key in ("rope_parameters", "rope_scaling"):  # transformers >= 5 / legacy spelling
        rope = d.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise _fail(f"{path}: {key} is not a JSON object")
        kind = str(rope.get("rope_type", rope.get("type", "default"))).lower()
        if kind not in ("default", "yarn"):
            raise refuse(f"{key} type {kind!r} (default or yarn only)")
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise refuse(f"partial_rotary_factor={rope['partial_rotary_factor']}")
        if kind == "default" and key == "rope_scaling":
            d["rope_scaling"] = None
    if float(d.get("partial_rotary_factor") or 1.0) != 1.0:
        raise refuse(f"partial_rotary_factor={d['partial_rotary_factor']}")

    block = None
    qc = d.get("quantization_config")
    if qc is not None:
        if not isinstance(qc, dict):
            raise _fail(f"{path}: quantization_config is not a JSON object")
        method = qc.get("quant_method")
        if method != "fp8":
            raise _fail(f"{path}: quantization method {method!r} is not supported; kdt converts unquantised "
                        "checkpoints and FP8 block-quantised ones (quant_method 'fp8')")
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise _fail(f"{path}: FP8 format {fmt!r} is not supported (e4m3 only)")
        if str(qc.get("activation_scheme", "dynamic")).lower() != "dynamic":
            raise _fail(f"{path}: FP8 activation_scheme {qc.get('activation_scheme')!r} is not supported "
                        "(dynamic only)")
        bs = qc.get("weight_block_size", [128, 128])
        if (not isinstance(bs, list | tuple) or len(bs) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in bs)):
            raise _fail(f"{path}: FP8 weight_block_size {bs!r} is not two positive integers "
                        "(per-tensor FP8 is not supported)")
        block = (int(bs[0]), int(bs[1]))
    try:
        cfg = ModelConfig.from_dict(d)
    except KdtError as e:
        raise _fail(f"{path}: {e}") from None
    return raw, cfg, block


def _index_tensors(src: Path) -> tuple[dict[str, TensorInfo], list[str]]:
    """Every tensor of the checkpoint by name, and the shard file names."""
    index = src / _INDEX_FILE
    if index.is_file():
        try:
            wm = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(wm, dict):
                raise TypeError
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
            raise _fail(f"{index}: not a valid safetensors index (no weight_map object)") from None
        shards = sorted(set(map(str, wm.values())))
        for s in shards:
            if Path(s).name != s:
                raise _fail(f"{index}: shard name {s!r} is not a file name in the checkpoint directory")
        absent = [s for s in shards if not (src / s).is_file()]
        if absent:
            raise _fail(f"{src}: missing shard(s) {_some(absent)} listed in {_INDEX_FILE}")
        tensors: dict[str, TensorInfo] = {}
        for s in shards:
            for name, t in read_safetensors_header(src / s).items():
                if wm.get(name, s) == s:
                    tensors[name] = t
        lost = [n for n, s in wm.items() if n not in tensors]
        if lost:
            raise _fail(f"{src}: tensor(s) {_some(lost)} listed in {_INDEX_FILE} are not in their shard "
                        f"({wm[lost[0]]})")
        return tensors, shards
    single = src / _SINGLE_FILE
    if single.is_file():
        return read_safetensors_header(single), [_SINGLE_FILE]
    raise _fail(f"{src}: no {_SINGLE_FILE} or {_INDEX_FILE} (kdt converts safetensors checkpoints)")


def _plan(cfg: ModelConfig, tensors: dict[str, TensorInfo], block: tuple[int, int] | None) -> _Plan:
    expected = weight_names(cfg)
    plan = _Plan()
    missing: list[str] = []
    I = cfg.moe_intermediate_size  # noqa: E741
    E, D = cfg.n_routed_experts, cfg.hidden_size

    def scale_for(t: TensorInfo, name: str, want_rows: int | None = None) -> TensorInfo | None:
        """The block scale of a float8 weight (checked), or None for an unquantised tensor."""
        if t.dtype not in _FLOAT8:
            if t.dtype not in _ST_DTYPES or t.dtype in ("F8_E8M0", "U8"):
                raise _fail(f"{t.file.name}: tensor {name} has dtype {t.dtype}, not a float weight")
            return None
        if block is None:
            raise _fail(f"{t.file.name}: tensor {name} is {t.dtype} but config.json has no FP8 "
                        "quantization_config")
        sname = name + "_scale_inv"
        s = tensors.get(sname)
        if s is None:
            missing.append(sname)
            return None
        shape = t.shape
        rows = -(-shape[-2] // block[0]) if want_rows is None else want_rows
        want = shape[:-2] + (rows, -(-shape[-1] // block[1]))
        if s.shape != want:
            raise _fail(f"{s.file.name}: tensor {sname} has shape {_fmt_shape(s.shape)}, expected "
                        f"{_fmt_shape(want)} ({block[0]}x{block[1]} blocks of {name} {_fmt_shape(shape)})")
        if s.dtype not in ("F32", "BF16", "F16", "F64", "F8_E8M0", "U8"):
            raise _fail(f"{s.file.name}: tensor {sname} has dtype {s.dtype}, not a scale")
        plan.used.add(sname)
        return s

    def add(job: _Job) -> None:
        job.nbytes = job.tensor.nbytes if job.index is None else job.tensor.nbytes // job.tensor.shape[0]
        if job.scale is not None:
            job.nbytes += job.scale.nbytes if job.index is None else job.scale.nbytes // job.scale.shape[0]
        plan.jobs.append(job)

    fused_done: set[tuple[str, int, str]] = set()
    for name, shape in expected.items():
        t = tensors.get(name)
        if t is not None:
            if t.shape != shape:
                raise _fail(f"{t.file.name}: tensor {name} has shape {_fmt_shape(t.shape)}, expected "
                            f"{_fmt_shape(shape)} from config.json")
            s = scale_for(t, name)
            plan.used.add(name)
            if _EXPERT_RE.match(name):
                plan.layouts.add("per-expert")
            add(_Job(name, t, None, s, [(name, None, None)]))
            continue
        m = _EXPERT_RE.match(name)
        if m is None:
            missing.append(name)
            continue
        prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
        fused_name = prefix + ("down_proj" if proj == "down_proj" else "gate_up_proj")
        ft = tensors.get(fused_name)
        if ft is None:
            missing.append(name)
            continue
        key = (prefix, e, "down" if proj == "down_proj" else "gate_up")
        if key in fused_done:
            continue
        fused_done.add(key)
        want = (E, D, I) if proj == "down_proj" else (E, 2 * I, D)
        if ft.shape != want:
            raise _fail(f"{ft.file.name}: fused tensor {fused_name} has shape {_fmt_shape(ft.shape)}, "
                        f"expected {_fmt_shape(want)} from config.json (layout [experts, out, in])")
        if block and ft.dtype in _FLOAT8 and proj != "down_proj" and I % block[0]:
            # transformers sizes the fused scale grid ceil(2I / bm) (finegrained_fp8._alloc_expert_proj),
            # concatenating the per-expert grids gives 2 ceil(I / bm): which blocks are meant is ambiguous
            raise _fail(f"{ft.file.name}: fused FP8 tensor {fused_name} with moe_intermediate_size={I} not "
                        f"a multiple of the {block[0]}-row block: its scale grid is ambiguous (store the "
                        "experts one by one)")
        half = I // block[0] if block else 0  # scale rows of each of the gate / up halves
        s = scale_for(ft, fused_name, None if proj == "down_proj" else 2 * half)
        plan.used.add(fused_name)
        plan.layouts.add("fused")
        if proj == "down_proj":
            outs = [(f"{prefix}{e}.down_proj.weight", None, None)]
        else:
            outs = [(f"{prefix}{e}.gate_proj.weight", slice(0, I), slice(0, half)),
                    (f"{prefix}{e}.up_proj.weight", slice(I, 2 * I), slice(half, 2 * half))]
        add(_Job(f"{fused_name}[{e}]", ft, e, s, outs))
    if missing:
        raise _fail(f"checkpoint lacks tensor(s) {_some(missing)} needed by config.json")
    return plan


def _skipped(cfg: ModelConfig, name: str, t: TensorInfo) -> str | None:
    """Why a checkpoint tensor that kdt does not use is expected (None: it is unexpected)."""
    m = _LAYER_RE.match(name)
    if m and int(m.group(1)) >= cfg.num_hidden_layers:
        return "mtp"  # multi-token-prediction module(s) after the last decoder layer
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return "tied"  # transformers ties lm_head to the embedding
    if t.numel == 0:
        return "empty"  # e.g. zero-width shared experts saved by transformers when n_shared_experts == 0
    if name.endswith("rotary_emb.inv_freq"):
        return "buffer"
    return None


def convert_checkpoint(src_dir: str | os.PathLike, out_path: str | os.PathLike, dtype: str = "float32",
                       progress: ConvertProgress | None = None) -> dict[str, Any]:
    """Convert the Hugging Face checkpoint in ``src_dir`` into the kdt HDF5 file ``out_path``.

    ``dtype``: "float32" / "fp32" or "bf16" / "bfloat16" for the stored weight matrices.
    ``progress(bytes_done, bytes_total, tensor)`` is called after each tensor (or expert slice) read.
    Returns a summary dict. Raises :class:`KdtError` (one line) on anything it cannot convert
    exactly; ``out_path`` is then left untouched.
    """
    t0 = time.perf_counter()
    if dtype not in OUT_DTYPES:
        raise _fail(f"unknown dtype {dtype!r} (choose fp32 or bf16)")
    weight_dtype = OUT_DTYPES[dtype]
    src = Path(src_dir)
    if not src.is_dir():
        raise _fail(f"{src}: no such checkpoint directory")
    out = Path(out_path)
    if out.is_dir():
        raise _fail(f"{out}: is a directory")
    raw, cfg, block = _load_config(src)
    tensors, shards = _index_tensors(src)
    plan = _plan(cfg, tensors, block)

    skipped: dict[str, int] = {}
    ignored: list[str] = []
    for name, t in tensors.items():
        if name in plan.used:
            continue
        why = _skipped(cfg, name, t)
        if why is None:
            ignored.append(name)
        else:
            skipped[why] = skipped.get(why, 0) + 1

    tok_text = None
    tok_path = src / "tokenizer.json"
    if tok_path.is_file():
        try:
            tok_text = tok_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise _fail(f"{tok_path}: cannot read ({e})") from None
        try:
            from tokenizers import Tokenizer
        except ImportError:
            Tokenizer = None  # noqa: N806 - carried unchecked; kdt generate will need 'tokenizers'
        if Tokenizer is not None:
            try:
                Tokenizer.from_str(tok_text)
            except Exception as e:  # noqa: BLE001 - any parse failure of a user file
                why = (str(e).splitlines() or [type(e).__name__])[0][:120]
                raise _fail(f"{tok_path}: not a valid tokenizers file ({why})") from None

    src_dtypes: dict[str, int] = {}
    for j in plan.jobs:
        src_dtypes[j.tensor.dtype] = src_dtypes.get(j.tensor.dtype, 0) + 1
    total = sum(j.nbytes for j in plan.jobs)
    quant = f"fp8 {block[0]}x{block[1]} blocks (dequantised)" if block else None
    meta = {"converted_from": str(src.resolve()), "model_type": raw.get("model_type"),
            "architectures": raw.get("architectures"), "quantization": quant,
            "source_dtypes": src_dtypes, "converter": "kdt convert"}
    if progress:
        progress(0, total, "")
    reader = _Reader()
    done = n_written = 0
    try:
        with FixtureWriter(out, cfg, weight_dtype, meta=meta) as w:
            for job in plan.jobs:
                if job.scale is None and job.tensor.dtype == "BF16" and weight_dtype == "bfloat16":
                    bits = reader.raw(job.tensor, job.index)
                    for name, rows, _ in job.outputs:
                        a = bits if rows is None else bits[rows]
                        if _keep_f32(name, a):
                            w.add_weight(name, bf16_bits_to_f32(a), dtype="float32")
                        else:
                            w.add_weight(name, a)  # the checkpoint's bf16 bits, unchanged
                        n_written += 1
                else:
                    a = reader.f32(job.tensor, job.index)
                    s = None if job.scale is None else reader.f32(job.scale, job.index)
                    for name, rows, srows in job.outputs:
                        part = a if rows is None else a[rows]
                        if s is not None:
                            part = dequantize_fp8_blocks(part, s if srows is None else s[srows], block,
                                                         out=part)  # in place: the widened fp8 copy
                        w.add_weight(name, part, dtype="float32" if _keep_f32(name, part) else None)
                        n_written += 1
                done += job.nbytes
                if progress:
                    progress(done, total, job.label)
            if tok_text is not None:
                w.set_tokenizer("tokenizers", tok_text)
    finally:
        reader.close()

    return {
        "source": str(src), "output": str(out), "model_type": raw.get("model_type"),
        "weight_dtype": weight_dtype, "layers": cfg.num_hidden_layers,
        "moe_layers": cfg.n_moe_layers, "experts": cfg.n_routed_experts, "params": cfg.n_params(),
        "tensors_written": n_written, "shards": len(shards), "source_dtypes": src_dtypes,
        "quantization": quant, "expert_layout": "+".join(sorted(plan.layouts)) or "none",
        "tied_embeddings": cfg.tie_word_embeddings, "skipped": skipped, "ignored": ignored,
        "tokenizer": "tokenizers" if tok_text is not None else None,
        "bytes_read": total, "bytes_written": out.stat().st_size, "seconds": time.perf_counter() - t0,
    }


def _keep_f32(name: str, a: np.ndarray) -> bool:
    """Router weights (transformers keeps them in fp32) and 1-D weights (norms) are stored float32."""
    return a.ndim == 1 or name.endswith(".mlp.gate.weight")
