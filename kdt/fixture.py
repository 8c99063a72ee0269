"""The kdt HDF5 fixture / checkpoint format, version 1 (docs/FORMAT.md).

One file holds a model config, every weight under its Hugging Face name, an optional tokenizer and
optional golden greedy continuations::

    /                      attrs kdt_format_version=1, kdt_version, config (JSON), weight_dtype, meta (JSON)
    /weights/<HF name>     one dataset per weight: float32, or bf16 as uint16 bits (attr dtype)
    /tokenizer             optional: attr kind ("byte" | "tokenizers"), dataset json (tokenizer.json)
    /golden/<name>/        prompt [P] int64, output [N] int64, logits [N, V] float32, margin [N] float64
    /drafter/...           reserved for a learned drafter (ignored by version-1 readers)

Writes are atomic (a temp file in the target's directory, then ``os.replace``); reads validate
everything and raise :class:`FixtureError` with one line naming the file and the problem.

Public API: :data:`FORMAT_VERSION`, :class:`FixtureError`, :class:`Golden`, :class:`Fixture`,
:func:`write_fixture`, :class:`FixtureWriter`, :func:`read_fixture`, :func:`read_config`,
:func:`open_weights` (:class:`WeightsReader`).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

import kdt
from kdt.bf16 import bf16_all_finite, bf16_bits_to_f32, f32_to_bf16_bits
from kdt.config import ModelConfig
from kdt.errors import KdtError
from kdt.reference.drafter import DrafterConfig, drafter_weight_names
from kdt.reference.model import weight_names

FORMAT_VERSION = 1
WEIGHT_DTYPES = ("float32", "bfloat16")
TOKENIZER_KINDS = ("byte", "tokenizers")

_CORRUPT = "not a readable kdt HDF5 file (truncated or corrupt?)"
# What h5py raises when the file underneath is damaged (truncated, overwritten bytes).
_H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError)

Progress = Callable[[int, int, str], None]


class FixtureError(KdtError):
    """A fixture file that is missing, unreadable or invalid; the message is one line."""


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def _fail(msg: str) -> FixtureError:
    return FixtureError(_one_line(msg))


# ---- in-memory objects -----------------------------------------------------------------------------
@dataclass(eq=False)
class Golden:
    """A greedy continuation of ``prompt`` by the float64 reference.

    ``logits[i]`` chose ``output[i]``: row 0 is the last prompt position, row i the position after
    ``output[i-1]``; ``margin[i]`` = top1 - top2 of that row (of the float64 logits).
    """

    name: str
    prompt: np.ndarray  # [P] int64
    output: np.ndarray  # [N] int64
    logits: np.ndarray  # [N, V] float32
    margin: np.ndarray  # [N] float64
    attrs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prompt = np.asarray(self.prompt, dtype=np.int64)
        self.output = np.asarray(self.output, dtype=np.int64)
        self.logits = np.asarray(self.logits, dtype=np.float32)
        self.margin = np.asarray(self.margin, dtype=np.float64)


@dataclass(eq=False)
class Drafter:
    """The learned block drafter stored beside the model (/drafter): config and float32 weights."""

    config: DrafterConfig
    weights: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)  # training summary


@dataclass(eq=False)
class Fixture:
    """A whole fixture in memory. ``weights`` are float32 (bf16-stored weights widened exactly);
    ``weight_dtype`` says how they are (or will be) stored: "float32" or "bfloat16"."""

    config: ModelConfig
    weights: dict[str, np.ndarray]
    weight_dtype: str = "float32"
    tokenizer: dict[str, Any] | None = None  # {"kind": "byte"} or {"kind": "tokenizers", "json": text}
    golden: list[Golden] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    drafter: Drafter | None = None  # the learned block drafter, when the file carries one

    def golden_by_name(self, name: str) -> Golden:
        for g in self.golden:
            if g.name == name:
                return g
        have = ", ".join(g.name for g in self.golden)
        raise KdtError(f"no golden continuation named {name!r} (have: {have})")


# ---- shared validation rules (writer and reader) ------------------------------------------------
def _check_weight_dtype(weight_dtype: str) -> str:
    if weight_dtype not in WEIGHT_DTYPES:
        raise _fail(f"weight dtype {weight_dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    return weight_dtype


def _fmt_shape(shape: Iterable[int]) -> str:
    s = tuple(int(x) for x in shape)
    return "(" + ", ".join(map(str, s)) + ("," if len(s) == 1 else "") + ")"


def _name_list(names: list[str], prefix: str, limit: int = 5) -> str:
    shown = ", ".join(prefix + n for n in names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def _check_golden(name: str, prompt: np.ndarray, output: np.ndarray, logits: np.ndarray,
                  margin: np.ndarray, vocab: int) -> str | None:
    """The golden rules; returns the problem (without the file name) or None."""
    at = f"/golden/{name}"
    if not name or "/" in name:
        return f"invalid golden name {name!r}"
    for what, arr in (("prompt", prompt), ("output", output)):
        if arr.dtype.kind not in "iu" or arr.ndim != 1 or arr.size == 0:
            return (f"dataset {at}/{what} must be a non-empty 1-D integer array "
                    f"(got {arr.dtype} {_fmt_shape(arr.shape)})")
    N = output.shape[0]
    for what, arr in (("prompt", prompt), ("output", output)):
        if arr.min() < 0 or arr.max() >= vocab:
            return f"dataset {at}/{what} has token ids outside [0, {vocab})"
    if logits.dtype != np.float32:
        return f"dataset {at}/logits has dtype {logits.dtype}, expected float32"
    if logits.shape != (N, vocab):
        return f"dataset {at}/logits has shape {_fmt_shape(logits.shape)}, expected {_fmt_shape((N, vocab))}"
    if margin.dtype.kind != "f":
        return f"dataset {at}/margin has dtype {margin.dtype}, expected float64"
    if margin.shape != (N,):
        return f"dataset {at}/margin has shape {_fmt_shape(margin.shape)}, expected {_fmt_shape((N,))}"
    if not (np.all(np.isfinite(logits)) and np.all(np.isfinite(margin))):
        return f"golden {at} contains non-finite values"
    if np.any(margin < 0):
        return f"dataset {at}/margin has negative values"
    chosen = logits[np.arange(N), output]
    if np.any(chosen < logits.max(axis=1)):
        i = int(np.nonzero(chosen < logits.max(axis=1))[0][0])
        return f"golden {at}: output[{i}] is not the argmax of logits[{i}]"
    return None


# ---- writing -----------------------------------------------------------------------------------
class FixtureWriter:
    """Streaming, atomic writer (for converters of checkpoints larger than RAM)::

        with FixtureWriter("model.h5", cfg, "bfloat16") as w:
            for name, array in tensors:
                w.add_weight(name, array)
            w.set_tokenizer("tokenizers", tokenizer_json_text)
            w.add_golden(golden)

    Everything goes to a temp file next to ``path``; a clean ``__exit__`` checks that every weight
    of the config was added and moves it onto ``path`` with ``os.replace``; an exception (or
    KeyboardInterrupt) removes the temp file and leaves ``path`` untouched.

    ``add_weight`` takes float arrays (float32/float64; rounded to nearest-even bf16 when stored as
    bf16), uint16 arrays (bf16 bit patterns) or ml_dtypes bfloat16 arrays. ``dtype`` overrides the
    file's ``weight_dtype`` for one weight (e.g. keep a router bias in float32).
    """

    def __init__(self, path: str | os.PathLike, config: ModelConfig, weight_dtype: str = "float32",
                 meta: dict[str, Any] | None = None, progress: Progress | None = None):
        self.path = os.fspath(path)
        self.config = config
        self.weight_dtype = _check_weight_dtype(weight_dtype)
        self.meta = dict(meta or {})
        self.progress = progress
        self._expected = weight_names(config)
        self._written: set[str] = set()
        self._golden: set[str] = set()
        self._tmp: str | None = None
        self._f: h5py.File | None = None

    # -- lifecycle
    def __enter__(self) -> FixtureWriter:
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
        return False

    def open(self) -> None:
        d = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(d):
            raise _fail(f"cannot write {self.path}: directory {d} does not exist")
        fd, self._tmp = tempfile.mkstemp(prefix=os.path.basename(self.path) + ".tmp.", dir=d)
        os.close(fd)
        try:
            try:  # mkstemp makes the file 0600: give it the mode open() would (or the old file's)
                mode = os.stat(self.path).st_mode & 0o777 if os.path.exists(self.path) else 0o666 & ~_umask()
                os.chmod(self._tmp, mode)
            except OSError:
                pass
            self._f = h5py.File(self._tmp, "w")
            f = self._f
            f.attrs["kdt_format_version"] = np.int64(FORMAT_VERSION)
            f.attrs["kdt_version"] = kdt.__version__
            f.attrs["config"] = self.config.to_json()
            f.attrs["weight_dtype"] = self.weight_dtype
            f.attrs["meta"] = json.dumps(self.meta, sort_keys=True, default=_json_default)
            f.create_group("weights", track_order=True)
        except BaseException:
            self.abort()
            raise

    def _file(self) -> h5py.File:
        if self._f is None:
            raise RuntimeError("FixtureWriter is not open (use it as a context manager)")
        return self._f

    def commit(self) -> None:
        """Check completeness, flush, fsync and move the temp file onto the target."""
        try:
            f = self._file()
            missing = [n for n in self._expected if n not in self._written]
            if missing:
                raise _fail(f"cannot write {self.path}: missing weight(s) {_name_list(missing, '')}")
            f.attrs["meta"] = json.dumps(self.meta, sort_keys=True, default=_json_default)
            f.close()
            self._f = None
            fd = os.open(self._tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(self._tmp, self.path)
            self._tmp = None
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Close and delete the temp file (idempotent)."""
        if self._f is not None:
            try:
                self._f.close()
            except Exception:  # noqa: BLE001 - the temp file is going away anyway
                pass
            self._f = None
        if self._tmp is not None:
            try:
                os.unlink(self._tmp)
            except FileNotFoundError:
                pass
            self._tmp = None

    # -- content
    def add_weight(self, name: str, array, dtype: str | None = None) -> None:
        f = self._file()
        dtype = _check_weight_dtype(dtype or self.weight_dtype)
        if name not in self._expected:
            raise _fail(f"unknown weight {name!r}: not a weight of this config")
        if name in self._written:
            raise _fail(f"weight {name!r} added twice")
        a = np.asarray(array)
        if a.dtype.name == "bfloat16":  # ml_dtypes / torch-exported bf16
            a = a.view(np.uint16)
        if tuple(a.shape) != self._expected[name]:
            want = _fmt_shape(self._expected[name])
            raise _fail(f"weight {name} has shape {_fmt_shape(a.shape)}, expected {want}")
        if a.dtype == np.uint16:  # bf16 bits
            bits = a
            data = bits if dtype == "bfloat16" else bf16_bits_to_f32(bits)
        elif a.dtype.kind == "f":
            with np.errstate(over="ignore"):
                a32 = np.asarray(a, dtype=np.float32)
            data = f32_to_bf16_bits(a32) if dtype == "bfloat16" else a32
        else:
            raise _fail(f"weight {name} has dtype {a.dtype}: expected a float array or bf16 bits (uint16)")
        finite = bf16_all_finite(data) if dtype == "bfloat16" else bool(np.all(np.isfinite(data)))
        if not finite:
            raise _fail(f"weight {name} contains non-finite values")
        ds = f["weights"].create_dataset(name, data=np.ascontiguousarray(data))
        ds.attrs["dtype"] = dtype
        self._written.add(name)
        if self.progress is not None:
            self.progress(len(self._written), len(self._expected), name)

    def set_tokenizer(self, kind: str, json_text: str | None = None) -> None:
        f = self._file()
        if kind not in TOKENIZER_KINDS:
            raise _fail(f"tokenizer kind {kind!r} is not one of {', '.join(TOKENIZER_KINDS)}")
        if kind == "tokenizers" and not json_text:
            raise _fail("a 'tokenizers' tokenizer needs its tokenizer.json text")
        if "tokenizer" in f:
            del f["tokenizer"]
        g = f.create_group("tokenizer")
        g.attrs["kind"] = kind
        if json_text is not None:
            g.create_dataset("json", data=json_text, dtype=h5py.string_dtype("utf-8"))

    def add_golden(self, g: Golden) -> None:
        f = self._file()
        if g.name in self._golden:
            raise _fail(f"golden {g.name!r} added twice")
        problem = _check_golden(g.name, g.prompt, g.output, g.logits, g.margin, self.config.vocab_size)
        if problem:
            raise _fail(f"cannot write {self.path}: {problem}")
        if "golden" not in f:
            f.create_group("golden", track_order=True)
        grp = f["golden"].create_group(g.name)
        grp.create_dataset("prompt", data=g.prompt.astype(np.int64))
        grp.create_dataset("output", data=g.output.astype(np.int64))
        grp.create_dataset("logits", data=g.logits.astype(np.float32))
        grp.create_dataset("margin", data=g.margin.astype(np.float64))
        grp.attrs["prompt_len"] = np.int64(g.prompt.shape[0])
        grp.attrs["n_new"] = np.int64(g.output.shape[0])
        grp.attrs["min_margin"] = float(g.margin.min())
        for k, v in g.attrs.items():
            if k not in ("prompt_len", "n_new", "min_margin"):
                grp.attrs[k] = v
        self._golden.add(g.name)

    def add_drafter(self, d: Drafter) -> None:
        """Store the learned drafter under /drafter (weights float32; every weight of its config)."""
        f = self._file()
        d.config.validate(self.config)
        expected = drafter_weight_names(d.config, self.config)
        missing = sorted(set(expected) - set(d.weights))
        unknown = sorted(set(d.weights) - set(expected))
        if missing or unknown:
            raise _fail(f"cannot write {self.path}: drafter weights missing {_name_list(missing, '')}, "
                        f"unknown {_name_list(unknown, '')}")
        if "drafter" in f:
            del f["drafter"]
        g = f.create_group("drafter")
        g.attrs["config"] = d.config.to_json()
        g.attrs["meta"] = json.dumps(d.meta, sort_keys=True, default=_json_default)
        w = g.create_group("weights", track_order=True)
        for name, shape in expected.items():
            a = np.asarray(d.weights[name], dtype=np.float32)
            if tuple(a.shape) != shape:
                raise _fail(f"drafter weight {name} has shape {_fmt_shape(a.shape)}, expected {_fmt_shape(shape)}")
            if not np.all(np.isfinite(a)):
                raise _fail(f"drafter weight {name} contains non-finite values")
            w.create_dataset(name, data=np.ascontiguousarray(a))


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def write_fixture(path: str | os.PathLike, fixture: Fixture, weight_dtype: str | None = None,
                  progress: Progress | None = None) -> None:
    """Write ``fixture`` atomically (through :class:`FixtureWriter`). ``weight_dtype`` overrides
    ``fixture.weight_dtype``; ``progress(done, total, name)`` is called after each weight."""
    wd = weight_dtype or fixture.weight_dtype
    expected = weight_names(fixture.config)
    unknown = sorted(set(fixture.weights) - set(expected))
    if unknown:
        raise _fail(f"cannot write {os.fspath(path)}: unknown weight(s) {_name_list(unknown, '')}")
    with FixtureWriter(path, fixture.config, wd, meta=fixture.meta, progress=progress) as w:
        for name in expected:
            if name not in fixture.weights:
                continue  # reported as missing by commit()
            w.add_weight(name, fixture.weights[name])
        if fixture.tokenizer is not None:
            w.set_tokenizer(str(fixture.tokenizer.get("kind")), fixture.tokenizer.get("json"))
        for g in fixture.golden:
            w.add_golden(g)
        if fixture.drafter is not None:
            w.add_drafter(fixture.drafter)


def copy_with_drafter(src: str | os.PathLike, dest: str | os.PathLike, drafter: Drafter | None) -> None:
    """Copy the fixture ``src`` to ``dest`` (atomically; ``dest`` may be ``src``): every weight bit for
    bit in its stored dtype, the tokenizer, golden traces and meta; and ``drafter`` (None: none)."""
    fx = read_fixture(src, load_weights=False)
    with open_weights(src) as r, FixtureWriter(dest, r.config, r.weight_dtype, meta=fx.meta) as w:
        for name in r.names:
            raw, dt = r.read_raw(name)
            w.add_weight(name, raw, dtype=dt)
        if fx.tokenizer is not None:
            w.set_tokenizer(str(fx.tokenizer.get("kind")), fx.tokenizer.get("json"))
        for g in fx.golden:
            w.add_golden(g)
        if drafter is not None:
            w.add_drafter(drafter)


# ---- reading -----------------------------------------------------------------------------------
@contextmanager
def _guard(path: str, where: str = "") -> Iterator[None]:
    """Turn an h5py failure (damaged file) into a one-line FixtureError."""
    try:
        yield
    except FixtureError:
        raise
    except _H5_ERRORS as e:
        if "unable to lock" in str(e).lower():  # HDF5's "unable to lock file, errno = 11"
            raise _fail(f"{path}: cannot open, the file is locked by another process ({e})") from e
        loc = f" (reading {where})" if where else ""
        raise _fail(f"{path}: {_CORRUPT}{loc}") from e


def _open(path: str | os.PathLike) -> tuple[str, h5py.File]:
    p = os.fspath(path)
    if not os.path.exists(p):
        raise _fail(f"fixture file not found: {p}")
    if os.path.isdir(p):
        raise _fail(f"{p}: is a directory, not a kdt HDF5 file")
    with _guard(p):
        f = h5py.File(p, "r")
    return p, f


def _attr_str(v) -> str:
    if isinstance(v, bytes):
        return v.decode("utf-8")
    if isinstance(v, np.ndarray) and v.shape == ():
        return _attr_str(v[()])
    return str(v)


def _read_header(p: str, f: h5py.File) -> ModelConfig:
    with _guard(p, "/ attributes"):
        attrs = dict(f.attrs)
    if "kdt_format_version" not in attrs:
        raise _fail(f"{p}: not a kdt fixture (no kdt_format_version attribute)")
    try:
        version = int(np.asarray(attrs["kdt_format_version"]).reshape(()))
    except (TypeError, ValueError):
        raise _fail(f"{p}: invalid kdt_format_version attribute {attrs['kdt_format_version']!r}") from None
    if version > FORMAT_VERSION:
        raise _fail(f"{p}: kdt format version {version} is newer than this kdt supports "
                    f"({FORMAT_VERSION}); upgrade kdt")
    if version < 1:
        raise _fail(f"{p}: invalid kdt format version {version}")
    if "config" not in attrs:
        raise _fail(f"{p}: missing /config attribute (the model config JSON)")
    try:
        return ModelConfig.from_json(_attr_str(attrs["config"]))
    except KdtError as e:
        raise _fail(f"{p}: /config: {e}") from None
    except (ValueError, TypeError, AttributeError) as e:
        raise _fail(f"{p}: /config is not a valid config JSON object ({e})") from None


def _dataset_dtype(p: str, name: str, ds: h5py.Dataset) -> str:
    """'float32' or 'bfloat16', or raise. ``name`` is the full dataset path."""
    with _guard(p, name):
        tag = ds.attrs.get("dtype")
        dt = ds.dtype
    tag = None if tag is None else _attr_str(tag)
    if dt == np.float32 and tag in (None, "float32"):
        return "float32"
    if dt == np.uint16 and tag == "bfloat16":
        return "bfloat16"
    if dt == np.uint16:
        raise _fail(f"{p}: dataset {name} is uint16 without attribute dtype='bfloat16'")
    raise _fail(f"{p}: dataset {name} has dtype {dt}{'' if tag is None else f' (attr dtype={tag!r})'}, "
                f"expected float32 or bfloat16 (uint16 with attr dtype='bfloat16')")


class WeightsReader:
    """Lazy, validated access to the weights of a fixture (see :func:`open_weights`).

    Opening checks the header, the config and every weight's presence, shape and dtype (metadata
    only); ``read`` loads one weight and checks it is finite.
    """

    def __init__(self, path: str | os.PathLike):
        self.path, self._f = _open(path)
        try:
            self.config = _read_header(self.path, self._f)
            self._expected = weight_names(self.config)
            self._dtypes = self._check_weights()
            with _guard(self.path, "/ attributes"):
                wd = self._f.attrs.get("weight_dtype")
            wd = None if wd is None else _attr_str(wd)
            if wd not in WEIGHT_DTYPES:
                vals = set(self._dtypes.values())
                wd = vals.pop() if len(vals) == 1 else "float32"
            self.weight_dtype = wd
        except BaseException:
            self.close()
            raise

    def _check_weights(self) -> dict[str, str]:
        p, f = self.path, self._f
        with _guard(p, "/weights"):
            if "weights" not in f or not isinstance(f["weights"], h5py.Group):
                raise _fail(f"{p}: missing group /weights")
            g = f["weights"]
            present = set(g.keys())
        missing = [n for n in self._expected if n not in present]
        if missing:
            raise _fail(f"{p}: missing dataset {_name_list(missing, '/weights/')}")
        unknown = sorted(set(present) - set(self._expected))
        if unknown:
            listed = _name_list(unknown, "/weights/")
            raise _fail(f"{p}: unknown dataset {listed} (not a weight of this config)")
        dtypes = {}
        for name, shape in self._expected.items():
            where = f"/weights/{name}"
            with _guard(p, where):
                ds = g[name]
                if not isinstance(ds, h5py.Dataset):
                    raise _fail(f"{p}: {where} is not a dataset")
                got = ds.shape
            if tuple(got) != tuple(shape):
                raise _fail(f"{p}: dataset {where} has shape {_fmt_shape(got)}, expected {_fmt_shape(shape)}")
            dtypes[name] = _dataset_dtype(p, where, ds)
        return dtypes

    # -- context manager
    def __enter__(self) -> WeightsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        f, self._f = getattr(self, "_f", None), None
        if f is not None:
            try:
                f.close()
            except Exception:  # noqa: BLE001
                pass

    # -- queries
    @property
    def names(self) -> list[str]:
        """Every weight name, in ``weight_names(config)`` order."""
        return list(self._expected)

    def __contains__(self, name: str) -> bool:
        return name in self._expected

    def __iter__(self) -> Iterator[str]:
        return iter(self._expected)

    def __len__(self) -> int:
        return len(self._expected)

    def _known(self, name: str) -> None:
        if name not in self._expected:
            raise _fail(f"{self.path}: no weight named {name!r}")

    def shape(self, name: str) -> tuple[int, ...]:
        self._known(name)
        return tuple(self._expected[name])

    def dtype(self, name: str) -> str:
        """How the weight is stored: 'float32' or 'bfloat16'."""
        self._known(name)
        return self._dtypes[name]

    def nbytes(self, name: str) -> int:
        return int(np.prod(self.shape(name))) * (2 if self.dtype(name) == "bfloat16" else 4)

    def read_raw(self, name: str) -> tuple[np.ndarray, str]:
        """(stored array, dtype): float32 data, or the uint16 bf16 bit patterns for 'bfloat16'."""
        self._known(name)
        if self._f is None:
            raise RuntimeError("WeightsReader is closed")
        where = f"/weights/{name}"
        with _guard(self.path, where):
            a = self._f["weights"][name][...]
        dt = self._dtypes[name]
        finite = bf16_all_finite(a) if dt == "bfloat16" else bool(np.all(np.isfinite(a)))
        if not finite:
            raise _fail(f"{self.path}: dataset {where} contains non-finite values")
        return a, dt

    def read(self, name: str) -> np.ndarray:
        """The weight as float32 (bf16 widened exactly)."""
        a, dt = self.read_raw(name)
        return bf16_bits_to_f32(a) if dt == "bfloat16" else np.ascontiguousarray(a, dtype=np.float32)


def open_weights(path: str | os.PathLike) -> WeightsReader:
    """Open a fixture for lazy weight reads: ``with open_weights(p) as w: w.read(w.names[0])``."""
    return WeightsReader(path)


def read_config(path: str | os.PathLike) -> ModelConfig:
    """Only the (validated) model config of a fixture."""
    p, f = _open(path)
    try:
        return _read_header(p, f)
    finally:
        f.close()


def _read_tokenizer(p: str, f: h5py.File) -> dict[str, Any] | None:
    with _guard(p, "/tokenizer"):
        if "tokenizer" not in f:
            return None
        g = f["tokenizer"]
        if not isinstance(g, h5py.Group):
            raise _fail(f"{p}: /tokenizer is not a group")
        kind = g.attrs.get("kind")
        kind = None if kind is None else _attr_str(kind)
        if kind not in TOKENIZER_KINDS:
            raise _fail(f"{p}: /tokenizer has kind {kind!r}, expected one of {', '.join(TOKENIZER_KINDS)}")
        text = None
        if "json" in g:
            ds = g["json"]
            if not isinstance(ds, h5py.Dataset) or ds.dtype.kind not in "OS" or ds.shape != ():
                raise _fail(f"{p}: dataset /tokenizer/json must be a scalar string")
            v = ds[()]
            text = v.decode("utf-8") if isinstance(v, bytes) else str(v)
    if kind == "tokenizers" and not text:
        raise _fail(f"{p}: missing dataset /tokenizer/json (needed for kind 'tokenizers')")
    tok: dict[str, Any] = {"kind": kind}
    if text is not None:
        tok["json"] = text
    return tok


def _read_drafter(p: str, f: h5py.File, cfg: ModelConfig) -> Drafter | None:
    with _guard(p, "/drafter"):
        if "drafter" not in f:
            return None
        g = f["drafter"]
        if not isinstance(g, h5py.Group) or "weights" not in g or "config" not in g.attrs:
            raise _fail(f"{p}: /drafter needs a config attribute and a weights group")
        try:
            dcfg = DrafterConfig.from_json(_attr_str(g.attrs["config"]))
            dcfg.validate(cfg)
        except KdtError as e:
            raise _fail(f"{p}: /drafter: {e}") from None
        try:
            meta = json.loads(_attr_str(g.attrs.get("meta", "{}")))
        except ValueError:
            raise _fail(f"{p}: /drafter meta is not valid JSON") from None
        weights = {}
        for name, shape in drafter_weight_names(dcfg, cfg).items():
            if name not in g["weights"]:
                raise _fail(f"{p}: missing dataset /drafter/weights/{name}")
            ds = g["weights"][name]
            if tuple(ds.shape) != shape or ds.dtype != np.float32:
                raise _fail(f"{p}: /drafter/weights/{name} is {ds.dtype} {_fmt_shape(ds.shape)}, "
                            f"expected float32 {_fmt_shape(shape)}")
            a = ds[()]
            if not np.all(np.isfinite(a)):
                raise _fail(f"{p}: /drafter/weights/{name} contains non-finite values")
            weights[name] = a
    return Drafter(dcfg, weights, meta if isinstance(meta, dict) else {})


def _attr_value(v):
    if isinstance(v, bytes):
        return v.decode("utf-8")
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


def _read_golden(p: str, f: h5py.File, vocab: int) -> list[Golden]:
    out: list[Golden] = []
    with _guard(p, "/golden"):
        if "golden" not in f:
            return out
        root = f["golden"]
        if not isinstance(root, h5py.Group):
            raise _fail(f"{p}: /golden is not a group")
        names = list(root.keys())
    for name in names:
        at = f"/golden/{name}"
        arrays = {}
        with _guard(p, at):
            g = root[name]
            if not isinstance(g, h5py.Group):
                raise _fail(f"{p}: {at} is not a group")
            for k in ("prompt", "output", "logits", "margin"):
                if k not in g or not isinstance(g[k], h5py.Dataset):
                    raise _fail(f"{p}: missing dataset {at}/{k}")
                arrays[k] = g[k][...]
            attrs = {k: _attr_value(v) for k, v in g.attrs.items()}
        parts = [arrays[k] for k in ("prompt", "output", "logits", "margin")]
        problem = _check_golden(name, *parts, vocab)
        if problem:
            raise _fail(f"{p}: {problem}")
        for k in ("prompt_len", "n_new", "min_margin"):
            attrs.pop(k, None)
        out.append(Golden(name, *parts, attrs))
    return out


def read_fixture(path: str | os.PathLike, load_weights: bool = True,
                 weights: Iterable[str] | None = None) -> Fixture:
    """Read and validate a fixture. ``load_weights=False`` validates the weights' presence, shapes
    and dtypes but loads none; ``weights`` loads only those names (float32, checked finite)."""
    with open_weights(path) as w:
        p, f = w.path, w._f
        if weights is not None:
            wanted = list(weights)
            for n in wanted:
                w._known(n)
        else:
            wanted = w.names if load_weights else []
        loaded = {n: w.read(n) for n in wanted}
        tokenizer = _read_tokenizer(p, f)
        golden = _read_golden(p, f, w.config.vocab_size)
        with _guard(p, "/ attributes"):
            raw_meta = f.attrs.get("meta")
        meta: dict[str, Any] = {}
        if raw_meta is not None:
            try:
                meta = json.loads(_attr_str(raw_meta))
            except ValueError:
                raise _fail(f"{p}: attribute meta is not valid JSON") from None
            if not isinstance(meta, dict):
                raise _fail(f"{p}: attribute meta is not a JSON object")
        drafter = _read_drafter(p, f, w.config)
        return Fixture(config=w.config, weights=loaded, weight_dtype=w.weight_dtype, tokenizer=tokenizer,
                       golden=golden, meta=meta, drafter=drafter)
