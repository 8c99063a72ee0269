"""The HDF5 fixture format (kdt/fixture.py, docs/FORMAT.md) and the golden generator (kdt/genref.py)."""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest

from kdt.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from kdt.config import preset
from kdt.errors import KdtError
from kdt.fixture import (
    FORMAT_VERSION,
    Fixture,
    FixtureError,
    FixtureWriter,
    Golden,
    open_weights,
    read_config,
    read_fixture,
    write_fixture,
)
from kdt.genref import generate_reference, logit_margins, summary_rows
from kdt.reference.model import weight_names
from kdt.weights import random_weights

CFG = preset("micro")
EMB = "model.embed_tokens.weight"
KVB = "model.layers.0.self_attn.kv_b_proj.weight"
TOKENIZER_JSON = json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}})


def _golden(name: str, rng: np.random.Generator, P: int = 3, N: int = 4) -> Golden:
    V = CFG.vocab_size
    logits = rng.standard_normal((N, V)).astype(np.float32)
    return Golden(name, rng.integers(0, V, P), logits.argmax(axis=1), logits, logit_margins(logits),
                  attrs={"note": "synthetic"})


def _fixture(seed: int = 0, weight_dtype: str = "float32") -> Fixture:
    rng = np.random.default_rng(seed)
    return Fixture(config=CFG, weights=random_weights(CFG, seed), weight_dtype=weight_dtype,
                   tokenizer={"kind": "tokenizers", "json": TOKENIZER_JSON},
                   golden=[_golden("zeta", rng), _golden("alpha", rng, P=1, N=2)],
                   meta={"seed": seed, "what": "test"})


@pytest.fixture
def valid(tmp_path):
    """A valid float32 fixture file and its in-memory source."""
    fx = _fixture()
    path = tmp_path / "model.h5"
    write_fixture(path, fx)
    return path, fx


def _err(path, match: list[str], fn=read_fixture) -> str:
    with pytest.raises(FixtureError) as ei:
        fn(path)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    for m in match:
        assert m in msg, (m, msg)
    return msg


def _leftovers(d) -> list[str]:
    return [n for n in os.listdir(d) if ".tmp" in n]


# ---- round trip -----------------------------------------------------------------------------------
@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16"])
def test_round_trip(tmp_path, weight_dtype):
    fx = _fixture(weight_dtype=weight_dtype)
    path = tmp_path / "m.h5"
    calls = []
    write_fixture(path, fx, progress=lambda i, n, name: calls.append((i, n, name)))
    assert len(calls) == len(weight_names(CFG)) and calls[-1][0] == calls[-1][1]
    back = read_fixture(path)
    assert back.config == fx.config
    assert back.weight_dtype == weight_dtype
    assert set(back.weights) == set(weight_names(CFG))
    for name, w in fx.weights.items():  # random_weights are bf16-exact: bit-exact either way
        assert back.weights[name].dtype == np.float32
        np.testing.assert_array_equal(back.weights[name].view(np.uint32), w.view(np.uint32))
    assert back.tokenizer == fx.tokenizer
    assert back.meta == fx.meta
    assert [g.name for g in back.golden] == ["zeta", "alpha"]  # insertion order kept
    for a, b in zip(fx.golden, back.golden, strict=True):
        assert b.prompt.dtype == np.int64 and b.output.dtype == np.int64
        assert b.logits.dtype == np.float32 and b.margin.dtype == np.float64
        for k in ("prompt", "output", "logits", "margin"):
            np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
        assert b.attrs == a.attrs
    assert read_config(path) == fx.config
    with h5py.File(path, "r") as f:
        assert int(f.attrs["kdt_format_version"]) == FORMAT_VERSION
        assert f"weights/{KVB}" in f  # the full HF name is one dataset name, no nesting
        assert list(f["weights"].keys()) == list(weight_names(CFG))


def test_byte_tokenizer_and_no_golden(tmp_path):
    fx = Fixture(CFG, random_weights(CFG, 1), tokenizer={"kind": "byte"})
    write_fixture(tmp_path / "b.h5", fx)
    back = read_fixture(tmp_path / "b.h5")
    assert back.tokenizer == {"kind": "byte"} and back.golden == [] and back.meta == {}


def test_bf16_storage_exact(tmp_path):
    rng = np.random.default_rng(3)
    fx = _fixture()
    # not bf16-representable: stored rounded to nearest even, read back widened exactly
    fx.weights[EMB] = rng.standard_normal(fx.weights[EMB].shape).astype(np.float32)
    write_fixture(tmp_path / "b.h5", fx, weight_dtype="bfloat16")
    with h5py.File(tmp_path / "b.h5", "r") as f:
        ds = f["weights"][EMB]
        assert ds.dtype == np.uint16 and ds.attrs["dtype"] == "bfloat16"
        np.testing.assert_array_equal(ds[...], f32_to_bf16_bits(fx.weights[EMB]))
    back = read_fixture(tmp_path / "b.h5")
    np.testing.assert_array_equal(back.weights[EMB], bf16_bits_to_f32(f32_to_bf16_bits(fx.weights[EMB])))
    assert np.max(np.abs(back.weights[EMB] - fx.weights[EMB]) / np.abs(fx.weights[EMB])) <= 2.0**-8
    with open_weights(tmp_path / "b.h5") as w:
        raw, dt = w.read_raw(EMB)
        assert dt == "bfloat16" and raw.dtype == np.uint16
        np.testing.assert_array_equal(bf16_bits_to_f32(raw), w.read(EMB))
    # float32 storage keeps arbitrary float32 values bit-exactly
    write_fixture(tmp_path / "f.h5", fx, weight_dtype="float32")
    np.testing.assert_array_equal(read_fixture(tmp_path / "f.h5").weights[EMB], fx.weights[EMB])


def test_bf16_rounding_is_nearest_even():
    # 1 + 2^-8 lies halfway between bf16 1.0 and 1 + 2^-7: ties go to the even mantissa (1.0);
    # 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: it goes to 1 + 2^-6 (even).
    a = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -2.5, 0.0, -0.0], np.float32)
    exp = np.array([1.0, 1 + 2**-6, 1 + 2**-7, -2.5, 0.0, -0.0], np.float32)
    got = bf16_bits_to_f32(f32_to_bf16_bits(a))
    np.testing.assert_array_equal(got.view(np.uint32), exp.view(np.uint32))


def test_writer_accepts_bf16_bits_and_per_weight_dtype(tmp_path):
    w32 = random_weights(CFG, 2)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    with FixtureWriter(tmp_path / "s.h5", CFG, "bfloat16", meta={"src": "stream"}) as w:
        for name, a in w32.items():
            if name == bias:
                w.add_weight(name, a.astype(np.float64) + 1e-5, dtype="float32")  # keep f32 precision
            else:
                w.add_weight(name, f32_to_bf16_bits(a))  # raw bf16 bits
        w.set_tokenizer("byte")
    back = read_fixture(tmp_path / "s.h5")
    assert back.weight_dtype == "bfloat16" and back.meta == {"src": "stream"}
    assert back.tokenizer == {"kind": "byte"}
    np.testing.assert_array_equal(back.weights[EMB], w32[EMB])
    want = (w32[bias].astype(np.float64) + 1e-5).astype(np.float32)
    np.testing.assert_array_equal(back.weights[bias], want)
    with open_weights(tmp_path / "s.h5") as r:
        assert r.dtype(bias) == "float32" and r.dtype(EMB) == "bfloat16"


# ---- lazy reads -----------------------------------------------------------------------------------
def test_open_weights_lazy(valid):
    path, fx = valid
    with open_weights(path) as w:
        assert w.names == list(weight_names(CFG)) and w.config == CFG and len(w) == len(w.names)
        assert w.shape(KVB) == weight_names(CFG)[KVB] and KVB in w
        np.testing.assert_array_equal(w.read(KVB), fx.weights[KVB])
        raw, dt = w.read_raw(KVB)
        assert dt == "float32" and raw.dtype == np.float32
        with pytest.raises(FixtureError, match="no weight named"):
            w.read("model.layers.9.nope.weight")
    sub = read_fixture(path, weights=[EMB, KVB])
    assert set(sub.weights) == {EMB, KVB}
    none = read_fixture(path, load_weights=False)
    assert none.weights == {} and len(none.golden) == 2


# ---- atomic writes --------------------------------------------------------------------------------
class _Boom:
    """An array-like whose conversion fails mid-write."""

    def __init__(self, exc):
        self.exc = exc

    def __array__(self, dtype=None, copy=None):
        raise self.exc


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_atomic_write_new_target(tmp_path, exc):
    fx = _fixture()
    names = list(weight_names(CFG))
    fx.weights[names[len(names) // 2]] = _Boom(exc)
    with pytest.raises(type(exc)):
        write_fixture(tmp_path / "m.h5", fx)
    assert not (tmp_path / "m.h5").exists()
    assert _leftovers(tmp_path) == []


def test_atomic_write_keeps_old_target(valid, monkeypatch):
    path, fx = valid
    before = path.read_bytes()
    n = {"i": 0}
    orig = FixtureWriter.add_weight

    def flaky(self, name, array, dtype=None):
        n["i"] += 1
        if n["i"] == 5:
            raise OSError("simulated write failure")
        return orig(self, name, array, dtype)

    monkeypatch.setattr(FixtureWriter, "add_weight", flaky)
    with pytest.raises(OSError, match="simulated"):
        write_fixture(path, _fixture(seed=7))
    assert path.read_bytes() == before
    assert _leftovers(path.parent) == []


def test_write_rejects_incomplete_or_unknown(tmp_path):
    fx = _fixture()
    del fx.weights[KVB]
    with pytest.raises(FixtureError, match=KVB):
        write_fixture(tmp_path / "m.h5", fx)
    fx = _fixture()
    fx.weights["model.layers.0.extra.weight"] = np.zeros(3, np.float32)
    with pytest.raises(FixtureError, match="model.layers.0.extra.weight"):
        write_fixture(tmp_path / "m.h5", fx)
    fx = _fixture()
    fx.weights[EMB] = fx.weights[EMB].copy()
    fx.weights[EMB][0, 0] = np.nan
    with pytest.raises(FixtureError, match="non-finite"):
        write_fixture(tmp_path / "m.h5", fx)
    with pytest.raises(FixtureError, match="does not exist"):
        write_fixture(tmp_path / "no" / "such" / "m.h5", _fixture())
    assert not (tmp_path / "m.h5").exists() and _leftovers(tmp_path) == []


# ---- validation on read ---------------------------------------------------------------------------
def test_missing_file(tmp_path):
    _err(tmp_path / "nope.h5", ["not found", "nope.h5"])
    _err(tmp_path / "nope.h5", ["not found"], fn=read_config)
    _err(tmp_path / "nope.h5", ["not found"], fn=open_weights)


def test_not_hdf5(tmp_path):
    p = tmp_path / "junk.h5"
    p.write_text("this is not an HDF5 file\n" * 100)
    _err(p, ["junk.h5", "not a readable kdt HDF5 file"])
    _err(p, ["not a readable kdt HDF5 file"], fn=read_config)


@pytest.mark.parametrize("frac", [0.02, 0.3, 0.6, 0.95, 0.999])
def test_truncated(valid, frac):
    path, _ = valid
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * frac)])
    _err(path, [str(path), "not a readable kdt HDF5 file (truncated or corrupt?)"])


def test_dataset_read_failure_becomes_fixture_error(valid, monkeypatch):
    path, _ = valid

    def broken(self, args, new_dtype=None):
        raise OSError("Can't read data (addr overflow)")

    monkeypatch.setattr(h5py.Dataset, "__getitem__", broken)
    _err(path, ["not a readable kdt HDF5 file", "/weights/"])


def _edit(path, fn):
    with h5py.File(path, "r+") as f:
        fn(f)


def test_missing_dataset(valid):
    path, _ = valid
    _edit(path, lambda f: f["weights"].__delitem__(KVB))
    _err(path, [f"missing dataset /weights/{KVB}"])
    _err(path, [f"missing dataset /weights/{KVB}"], fn=open_weights)


def test_wrong_shape(valid):
    path, fx = valid

    def fn(f):
        del f["weights"][KVB]
        f["weights"].create_dataset(KVB, data=np.zeros((3, 5), np.float32)).attrs["dtype"] = "float32"

    _edit(path, fn)
    shape = weight_names(CFG)[KVB]
    _err(path, [f"dataset /weights/{KVB} has shape (3, 5), expected ({shape[0]}, {shape[1]})"])


@pytest.mark.parametrize("bad", ["float64", "uint16-no-attr", "int32", "tag-mismatch"])
def test_wrong_dtype(valid, bad):
    path, fx = valid
    w = fx.weights[KVB]

    def fn(f):
        del f["weights"][KVB]
        if bad == "float64":
            f["weights"].create_dataset(KVB, data=w.astype(np.float64)).attrs["dtype"] = "float64"
        elif bad == "uint16-no-attr":
            f["weights"].create_dataset(KVB, data=f32_to_bf16_bits(w))
        elif bad == "int32":
            f["weights"].create_dataset(KVB, data=w.astype(np.int32))
        else:
            f["weights"].create_dataset(KVB, data=w).attrs["dtype"] = "bfloat16"

    _edit(path, fn)
    _err(path, [f"dataset /weights/{KVB}"] + (["bfloat16"] if bad != "uint16-no-attr" else ["uint16"]))


@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_weight(tmp_path, weight_dtype, value):
    path = tmp_path / "m.h5"
    write_fixture(path, _fixture(), weight_dtype=weight_dtype)

    def fn(f):
        ds = f["weights"][KVB]
        a = ds[...]
        a[1, 2] = f32_to_bf16_bits(np.array([value], np.float32))[0] if weight_dtype == "bfloat16" else value
        ds[...] = a

    _edit(path, fn)
    _err(path, [f"dataset /weights/{KVB} contains non-finite values"])
    read_fixture(path, load_weights=False)  # metadata-only read does not look at values
    with open_weights(path) as w, pytest.raises(FixtureError, match="non-finite"):
        w.read(KVB)


def test_unknown_weight(valid):
    path, _ = valid
    extra = "model.layers.7.mystery.weight"
    _edit(path, lambda f: f["weights"].create_dataset(extra, data=np.zeros(2, np.float32)))
    _err(path, ["unknown dataset /weights/model.layers.7.mystery.weight"])


def test_header_errors(valid):
    path, _ = valid
    _edit(path, lambda f: f.attrs.__setitem__("kdt_format_version", FORMAT_VERSION + 1))
    _err(path, ["format version 2 is newer", "upgrade kdt"])
    _err(path, ["newer"], fn=read_config)
    _edit(path, lambda f: f.attrs.__delitem__("kdt_format_version"))
    _err(path, ["not a kdt fixture", "kdt_format_version"])
    _edit(path, lambda f: f.attrs.__setitem__("kdt_format_version", FORMAT_VERSION))
    good = read_config(path).to_dict()
    _edit(path, lambda f: f.attrs.__setitem__("config", json.dumps({**good, "topk_group": 9})))
    _err(path, ["/config", "invalid model config", "topk_group"])
    _edit(path, lambda f: f.attrs.__setitem__("config", "{not json"))
    _err(path, ["/config is not a valid config JSON"])
    _edit(path, lambda f: f.attrs.__delitem__("config"))
    _err(path, ["missing /config"])


def test_golden_errors(valid):
    path, _ = valid
    with h5py.File(path, "r+") as f:
        g = f["golden"]["alpha"]
        out = g["output"][...]
        out[0] = CFG.vocab_size + 3
        g["output"][...] = out
    _err(path, ["/golden/alpha/output", "outside [0, 64)"])
    with h5py.File(path, "r+") as f:
        g = f["golden"]["zeta"]
        del g["logits"]
        g.create_dataset("logits", data=np.zeros((2, CFG.vocab_size), np.float32))
    _err(path, ["/golden/zeta/logits has shape (2, 64), expected (4, 64)"])
    with h5py.File(path, "r+") as f:
        del f["golden"]["zeta"]["margin"]
    _err(path, ["missing dataset /golden/zeta/margin"])


def test_tokenizer_errors(valid):
    path, _ = valid
    _edit(path, lambda f: f["tokenizer"].__delitem__("json"))
    _err(path, ["missing dataset /tokenizer/json"])
    _edit(path, lambda f: f["tokenizer"].attrs.__setitem__("kind", "sentencepiece"))
    _err(path, ["/tokenizer has kind 'sentencepiece'"])


def test_fixture_error_is_kdt_error():
    assert issubclass(FixtureError, KdtError)


# ---- golden generation ----------------------------------------------------------------------------
def test_generate_reference_deterministic(tmp_path):
    kw = dict(preset_name="micro", seed=3, prompt_lengths=(1, 4), n_new=5, min_margin=0.05)
    a, b = generate_reference(**kw), generate_reference(**kw)
    assert [g.name for g in a.golden] == ["p1", "p4"]
    assert a.meta == b.meta and a.meta["seed"] == 3 and a.meta["preset"] == "micro"
    assert set(a.meta["redraws"]) == {"p1", "p4"}
    for n in a.weights:
        np.testing.assert_array_equal(a.weights[n], b.weights[n])
    for ga, gb in zip(a.golden, b.golden, strict=True):
        assert ga.prompt.shape == (int(ga.name[1:]),) and ga.output.shape == (5,)
        for k in ("prompt", "output", "logits", "margin"):
            np.testing.assert_array_equal(getattr(ga, k), getattr(gb, k))
        assert np.all(ga.margin >= 0.05)
        np.testing.assert_array_equal(ga.margin, logit_margins(ga.logits))
        np.testing.assert_array_equal(ga.output, ga.logits.argmax(axis=1))
    write_fixture(tmp_path / "g.h5", a)
    back = read_fixture(tmp_path / "g.h5")
    assert back.weight_dtype == "bfloat16" and back.meta == a.meta
    rows = summary_rows(back)
    assert [r["name"] for r in rows] == ["p1", "p4"] and all(r["min_margin"] >= 0.05 for r in rows)


def test_generate_reference_gives_up(tmp_path):
    with pytest.raises(KdtError, match="no prompt of length"):
        generate_reference("micro", seed=0, prompt_lengths=(2,), n_new=4, min_margin=1e9, max_redraws=1)


def test_written_file_mode_follows_umask(tmp_path):
    mask = os.umask(0o022)
    os.umask(mask)
    write_fixture(tmp_path / "m.h5", _fixture())
    assert (tmp_path / "m.h5").stat().st_mode & 0o777 == 0o666 & ~mask
