"""The `kdt` command end to end on the bundled fixture (CPU backend): verify passes, generate runs,
bad inputs give one clear line and exit code 2."""

import json
from pathlib import Path

import numpy as np
import pytest

from kdt.testing import run_kdt as kdt

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "model_tiny.h5"


def one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_verify_bundled_fixture_passes_on_cpu():
    r = kdt("verify", FIXTURE, "--backend", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "backend: cpu" in r.stdout
    assert "avg_accept=8.00 (block 8)" in r.stdout  # the oracle accepts the whole block
    assert "FAIL" not in r.stdout and "PASS" in r.stdout


def test_generate_runs_end_to_end_json():
    r = kdt("generate", "--prompt", "def f(x):", "--max-new-tokens", "12", "--backend", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert len(d["tokens"]) == 12 and d["steps"] >= 1 and isinstance(d["text"], str)
    r2 = kdt("generate", "--prompt-ids", ",".join(map(str, d["prompt_ids"])), "--max-new-tokens", "12",
             "--backend", "cpu", "--drafter", "none", "--json")
    assert json.loads(r2.stdout)["tokens"] == d["tokens"]  # DDTree (suffix drafter) == AR


def test_generate_streams_text():
    r = kdt("generate", "--prompt", "hello", "-n", "8", "--backend", "cpu")
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stderr and "backend: cpu" in r.stderr


@pytest.mark.parametrize("args, needles", [
    (("generate", "--model", "nope.h5", "--prompt", "x"), ["nope.h5", "no such file"]),
    (("verify", "nope.h5"), ["no such file"]),
    (("generate", "--prompt", "x" * 2000, "--backend", "cpu"), ["context"]),
    (("generate", "--prompt", "x", "--budget", "5000", "--backend", "cpu"), ["budget"]),
    (("generate", "--prompt", "x", "--budget", "-2", "--backend", "cpu"), ["--budget"]),
    (("generate", "--prompt-ids", "1,99999", "--backend", "cpu"), ["vocabulary"]),
    (("generate", "--backend", "cpu"), ["--prompt"]),
    (("generate", "--prompt", "x", "--backend", "tpu"), ["backend"]),
])
def test_bad_input_one_line_exit_2(args, needles):
    one_line_error(kdt(*args), *needles)


def test_verify_corrupt_file_exit_2(tmp_path):
    bad = tmp_path / "bad.h5"
    bad.write_bytes(FIXTURE.read_bytes()[: 4096])
    one_line_error(kdt("verify", bad), "bad.h5")


@pytest.mark.parametrize("damage, needles", [
    ("delete", ["missing dataset", "/weights/model.layers.1.self_attn.o_proj.weight"]),
    ("reshape", ["/weights/model.norm.weight", "shape"]),
])
def test_verify_damaged_fixture_exit_2(tmp_path, damage, needles):
    import shutil

    import h5py

    bad = tmp_path / "damaged.h5"
    shutil.copy(FIXTURE, bad)
    with h5py.File(bad, "r+") as f:
        if damage == "delete":
            del f["weights/model.layers.1.self_attn.o_proj.weight"]
        else:
            attrs = dict(f["weights/model.norm.weight"].attrs)
            del f["weights/model.norm.weight"]
            f.create_dataset("weights/model.norm.weight", data=np.ones(7, np.float32))
            f["weights/model.norm.weight"].attrs.update(attrs)
    one_line_error(kdt("verify", bad), *needles)
