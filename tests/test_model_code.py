"""The committed demo target fixtures/model_code.h5 (a DeepseekV3-architecture model trained on the Python
standard library by scripts/train_target.py), end to end through the `kdt` command on the CPU backend:
it generates Python-looking text, DDTree with the suffix drafter equals plain autoregressive decoding
token for token, and its golden traces verify."""

import json
from pathlib import Path

import pytest

from kdt.testing import run_kdt as kdt

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "fixtures" / "model_code.h5"


def generate_json(*args):
    r = kdt("generate", "--model", MODEL, "--backend", "cpu", "--json", *args)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def test_fixture_is_a_byte_level_deepseek_v3_with_golden_traces():
    from kdt.fixture import read_fixture

    fx = read_fixture(MODEL, load_weights=False)
    cfg = fx.config
    assert fx.tokenizer == {"kind": "byte"} and cfg.vocab_size == 256
    assert cfg.q_lora_rank and cfg.n_moe_layers >= 1 and cfg.num_experts_per_tok >= 2 and cfg.n_shared_experts >= 1
    assert len(fx.golden) >= 3 and all(g.margin.min() >= 0.05 for g in fx.golden)
    assert fx.meta["training"]["final_heldout_loss"] > 0


def test_generate_def_is_printable_python_text():
    d = generate_json("--prompt", "def ", "-n", "40")
    assert d["n_tokens"] >= 1 and all(0 <= t < 256 for t in d["tokens"])
    text = d["text"]
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in text)
    assert printable >= 0.9 * len(text), repr(text)
    assert sum(ch.isascii() for ch in text) >= 0.9 * len(text), repr(text)
    assert any(ch.isalpha() for ch in text), repr(text)


@pytest.mark.parametrize("prompt", ["def ", "import os\nimport sys\n\n\nclass "])
def test_ddtree_suffix_drafter_equals_autoregressive(prompt):
    dd = generate_json("--prompt", prompt, "-n", "48", "--drafter", "suffix", "--budget", "32")
    ar = generate_json("--prompt", prompt, "-n", "48", "--drafter", "none")
    assert dd["drafter"] == "suffix" and ar["budget"] == 0
    assert dd["tokens"] == ar["tokens"]
    assert dd["steps"] <= ar["steps"]


def test_verify_golden_traces_pass_on_cpu():
    r = kdt("verify", MODEL, "--backend", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL" not in r.stdout and "PASS" in r.stdout


def test_learned_drafter_is_the_default_and_equals_autoregressive():
    """The committed drafter: its recorded held-out acceptance table (kdt train-drafter --eval-only, every
    run equal to AR) has the learned drafter ahead of the suffix drafter by more than a token per step at
    every budget and a tree ahead of the chain; it is the default of `kdt generate`, and its output equals
    plain greedy decoding. (The >= 6 target of issue 8 is a measurement, in docs/PERF.md, not a test.)"""
    from kdt.fixture import read_fixture

    fx = read_fixture(MODEL, load_weights=False)
    assert fx.drafter is not None and fx.drafter.config.block_size == 16
    table = fx.drafter.meta["acceptance"]
    learned = {r["budget"]: r["avg_accept"] for r in table if r["drafter"].startswith("learned")}
    suffix = max(r["avg_accept"] for r in table if r["drafter"] == "suffix")
    assert {15, 16, 31, 64, 256} <= set(learned) and min(learned.values()) > suffix + 1.0, table
    assert learned[256] > learned[64] > learned[31] > learned[16] >= learned[15], table
    prompt = "import os\n\n\ndef "
    dd = generate_json("--prompt", prompt, "-n", "64")
    ar = generate_json("--prompt", prompt, "-n", "64", "--drafter", "none")
    assert dd["drafter"] == "learned" and dd["block_size"] == 16
    assert dd["budget"] == 16  # --budget -1 (the default) on the CPU; 31 on CUDA
    assert dd["tokens"] == ar["tokens"]
    assert dd["avg_accept"] > 2.0, dd["avg_accept"]
