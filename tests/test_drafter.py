"""The learned block drafter (kdt.reference.drafter, kdt.drafters.LearnedDrafter, kdt.train_drafter).

- The torch training model and the NumPy reference compute the same block logits (float64, < 1e-10),
  the reference adding its context rows incrementally in chunks, torch in one batched row set.
- The greedy-exact invariant with the learned drafter (random weights) on the CPU backend.
- /drafter storage round-trips through the fixture format; bad drafter data is refused in one line.
- The training data's target features are the hooked layers' outputs in bf16 (NumPy bits or a torch
  tensor on the training device); a batch's positions and masks, built at once in torch, are
  row_layout's for each sequence.
"""

from __future__ import annotations

import numpy as np
import pytest

from kdt.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from kdt.config import preset
from kdt.drafters import LearnedDrafter
from kdt.fixture import Drafter, read_fixture, write_fixture
from kdt.reference.decode import ar_generate, generate
from kdt.reference.drafter import DrafterConfig, DraftModel, drafter_weight_names, random_drafter_weights
from kdt.reference.model import RefModel, lm_head_weight
from kdt.testing import rel_err
from kdt.weights import random_weights

CFG = preset("micro")
DCFG = DrafterConfig(target_layers=(0, CFG.num_hidden_layers - 1), block_size=5, num_hidden_layers=2,
                     intermediate_size=24)


def lm_head(w):
    return lm_head_weight(CFG, w)


def test_torch_drafter_equals_reference(rng):
    torch = pytest.importorskip("torch")
    from kdt.train_drafter import TorchDrafter, batch_loss, bf16_tensor, row_layout

    w = random_weights(CFG, int(rng.integers(1 << 30)))
    dw = random_drafter_weights(DCFG, CFG, int(rng.integers(1 << 30)))
    D, nF, B = CFG.hidden_size, len(DCFG.target_layers), DCFG.block_size
    S = 13
    tokens = rng.integers(0, CFG.vocab_size, S)
    feats = rng.standard_normal((S, nF * D))
    ref = DraftModel(DCFG, CFG, dw, w["model.embed_tokens.weight"], lm_head(w), np.float64, max_len=64)
    anchors = np.array([4, 8])
    tm = TorchDrafter(DCFG, CFG, w["model.embed_tokens.weight"], lm_head(w), weights=dw, dtype=torch.float64)
    lay = row_layout(S, anchors, B)
    x = torch.cat([tm.context(torch.tensor(feats)[None]),
                   tm.block_inputs(torch.tensor(tokens[anchors])[None]).reshape(1, len(anchors) * B, D)], 1)
    h = tm.stack(x, lay.positions[None], torch.tensor(lay.mask)[None])
    for j, a in enumerate(anchors):
        ref.add_context(feats[:3], 0)  # context in two chunks: rows [0, 3) then [3, a)
        ref.add_context(feats[3:a], 3)
        want = ref.block_logits(tokens[a], a)
        got = tm.logits(h[0, S + j * B + 1: S + (j + 1) * B]).detach().numpy()
        assert want.shape == (B - 1, CFG.vocab_size)
        assert rel_err(got, want) < 1e-10, (a, rel_err(got, want))
    # the training loss runs end to end and gives finite gradients
    loss, hits, count = batch_loss(tm, tokens[None], feats[None], anchors[None], gamma=3.0)
    loss.backward()
    assert np.isfinite(float(loss.detach())) and count == 2 and hits.shape == (B - 1,)
    assert all(torch.isfinite(p.grad).all() for p in tm.params.values())
    # bf16 features (hidden_features: NumPy bits, or a torch bf16 tensor) give the loss of their float32 values
    bits = f32_to_bf16_bits(feats.astype(np.float32))
    as_torch = bf16_tensor(bits)
    assert as_torch.dtype == torch.bfloat16
    np.testing.assert_array_equal(as_torch.float().numpy(), bf16_bits_to_f32(bits))
    loss32, _, _ = batch_loss(tm, tokens[None], bf16_bits_to_f32(bits)[None], anchors[None], gamma=3.0)
    for f16 in (bits[None], as_torch[None]):
        assert float(batch_loss(tm, tokens[None], f16, anchors[None], gamma=3.0)[0].detach()) == float(loss32.detach())
    # a batch of sequences (device tensors) is the mean of their own losses
    toks = rng.integers(0, CFG.vocab_size, (3, S))
    fs = rng.standard_normal((3, S, nF * D))
    anc = np.array([[4, 8], [2, 6], [7, 8]])
    one = [float(batch_loss(tm, toks[i:i + 1], fs[i:i + 1], anc[i:i + 1], 3.0)[0].detach()) for i in range(3)]
    loss3, hits3, count3 = batch_loss(tm, torch.tensor(toks), torch.tensor(fs), torch.tensor(anc), 3.0)
    assert count3 == 6 and hits3.shape == (B - 1,)
    assert abs(float(loss3.detach()) - np.mean(one)) < 1e-12, (float(loss3.detach()), one)


def test_batch_layout_equals_row_layout(rng):
    """batch_layout (torch, the whole batch at once) gives each sequence's row_layout positions and mask."""
    torch = pytest.importorskip("torch")
    from kdt.train_drafter import batch_layout, row_layout, sample_anchors

    for S, J, B, N in [(13, 2, 5, 3), (40, 8, 4, 5), (24, 3, 16, 2), (9, 1, 2, 4)]:
        anchors = rng.integers(0, S - B + 1, (N, J))  # any roots, unsorted and repeated too
        anchors[0] = np.sort(rng.choice(S - B + 1, J, replace=False))
        pos, mask = batch_layout(S, torch.tensor(anchors), B)
        lay = [row_layout(S, a, B) for a in anchors]
        assert pos.shape == (N, S + J * B) and mask.shape == (N, S + J * B, S + J * B) and mask.dtype == torch.bool
        np.testing.assert_array_equal(pos.numpy(), np.stack([x.positions for x in lay]))
        np.testing.assert_array_equal(mask.numpy(), np.stack([x.mask for x in lay]))
    # sampled roots: distinct, ascending, within [lo, hi], the same for the same seed
    gen = torch.Generator().manual_seed(5)
    a = sample_anchors(64, 8, 10, 30, gen)
    assert a.shape == (64, 8) and a.dtype == torch.int64 and int(a.min()) >= 10 and int(a.max()) <= 30
    assert bool((a[:, 1:] > a[:, :-1]).all()) and len(set(a[:, 0].tolist())) > 1
    assert torch.equal(a, sample_anchors(64, 8, 10, 30, torch.Generator().manual_seed(5)))
    np.testing.assert_array_equal(sample_anchors(3, 21, 10, 30, gen).numpy(), np.tile(np.arange(10, 31), (3, 1)))


def test_hidden_features_are_bf16_of_the_layer_outputs(rng):
    """hidden_features: the decoder layers' outputs (forward hooks) concatenated, as bf16 bits."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kdt.train_drafter import hidden_features, target_model

    w = random_weights(CFG, int(rng.integers(1 << 30)))
    model = target_model(CFG, w)
    tokens = rng.integers(0, CFG.vocab_size, (5, 9))
    got = hidden_features(model, tokens, (0, 0), batch=2)  # 3 batches, the last partial
    assert got.dtype == np.uint16 and got.shape == (5, 9, 2 * CFG.hidden_size)
    with torch.no_grad():  # hidden_states[1]: layer 0's output (the last entry would be after the final norm)
        h0 = model(torch.tensor(tokens), output_hidden_states=True).hidden_states[1].float().numpy()
    np.testing.assert_array_equal(got, f32_to_bf16_bits(np.concatenate([h0, h0], axis=-1)))
    # on a device: a torch bf16 tensor of the same bits
    on_dev = hidden_features(model, torch.tensor(tokens), (0, 0), batch=2, device="cpu")
    assert on_dev.dtype == torch.bfloat16 and on_dev.shape == got.shape
    np.testing.assert_array_equal(on_dev.view(torch.int16).numpy().view(np.uint16), got)


def test_learned_drafter_keeps_the_invariant(rng):
    w = random_weights(CFG, int(rng.integers(1 << 30)))
    dw = random_drafter_weights(DCFG, CFG, int(rng.integers(1 << 30)))
    for trial in range(4):
        prompt = rng.integers(0, CFG.vocab_size, int(rng.integers(1, 12)))
        n = int(rng.integers(6, 16))
        ar = ar_generate(RefModel(CFG, w, max_len=64), prompt, n)
        draft = DraftModel(DCFG, CFG, dw, w["model.embed_tokens.weight"], lm_head(w), np.float64, max_len=64)
        d = LearnedDrafter(draft)
        budget = int(rng.choice([1, 4, 12]))
        res = generate(RefModel(CFG, w, max_len=64), prompt, n, drafter=d, budget=budget,
                       block_size=DCFG.block_size)
        assert res.tokens == ar.tokens, (trial, budget)
        assert d.committed == len(prompt) + sum(res.accept_lengths)  # every committed position observed


def test_learned_drafter_refuses_an_unobserved_context(rng):
    """draft() needs context rows for every committed position and at most block_size - 1 depths."""
    w = random_weights(CFG, int(rng.integers(1 << 30)))
    d = LearnedDrafter(DraftModel(DCFG, CFG, random_drafter_weights(DCFG, CFG), w["model.embed_tokens.weight"],
                                  lm_head(w), np.float32, max_len=32))
    with pytest.raises(ValueError, match="context rows"):
        d.draft(np.array([1, 2, 3]), 2, 4)
    with pytest.raises(ValueError, match="depths"):
        d.draft(np.array([1]), DCFG.block_size, 4)


def test_fixture_round_trip_and_refusals(tmp_path, rng):
    fx = read_fixture("fixtures/model_tiny.h5")
    dcfg = DrafterConfig(target_layers=(0, 1), block_size=4, num_hidden_layers=1, intermediate_size=16)
    dw = random_drafter_weights(dcfg, fx.config, 3)
    fx.drafter = Drafter(dcfg, dw, {"note": "test"})
    out = tmp_path / "with_drafter.h5"
    write_fixture(out, fx)
    back = read_fixture(out)
    assert back.drafter.config == dcfg and back.drafter.meta == {"note": "test"}
    for k, v in dw.items():
        np.testing.assert_array_equal(back.drafter.weights[k], v)
    for k, v in fx.weights.items():  # the model itself is untouched
        np.testing.assert_array_equal(back.weights[k], v)
    assert set(back.drafter.weights) == set(drafter_weight_names(dcfg, fx.config))
    import h5py

    from kdt.errors import KdtError

    with h5py.File(out, "r+") as f:
        del f["drafter/weights/fc.weight"]
    with pytest.raises(KdtError, match="fc.weight"):
        read_fixture(out)
    bad = DrafterConfig(target_layers=(7,), block_size=4, num_hidden_layers=1, intermediate_size=16)
    fx.drafter = Drafter(bad, dw)
    with pytest.raises(KdtError, match="target_layers"):
        write_fixture(tmp_path / "bad.h5", fx)
    assert not (tmp_path / "bad.h5").exists()


def test_copy_with_drafter_keeps_every_weight_bit_for_bit(tmp_path):
    """model_code.h5 mixes bf16 matrices and float32 norms/router: the copy keeps each stored dtype."""
    from kdt.fixture import copy_with_drafter, open_weights

    src = "fixtures/model_code.h5"
    fx = read_fixture(src, load_weights=False)
    dcfg = DrafterConfig(target_layers=(1, 3), block_size=4, num_hidden_layers=1, intermediate_size=8)
    out = tmp_path / "copy.h5"
    copy_with_drafter(src, out, Drafter(dcfg, random_drafter_weights(dcfg, fx.config, 1)))
    with open_weights(src) as a, open_weights(out) as b:
        assert a.names == b.names
        for n in a.names:
            ra, da = a.read_raw(n)
            rb, db = b.read_raw(n)
            assert da == db and ra.dtype == rb.dtype, n
            np.testing.assert_array_equal(ra, rb, err_msg=n)
    back = read_fixture(out, load_weights=False)
    assert back.drafter.config == dcfg and back.tokenizer == fx.tokenizer
    assert [g.name for g in back.golden] == [g.name for g in fx.golden] and back.meta == fx.meta


def test_train_drafter_cli_smoke(tmp_path):
    """`kdt train-drafter` end to end on the tiny fixture (two steps), then `kdt generate` picks the
    learned drafter by default and `kdt verify` checks it."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import json

    from kdt.testing import run_kdt

    out = tmp_path / "tiny_drafter.h5"
    r = run_kdt("train-drafter", "fixtures/model_tiny.h5", "--out", out, "--minutes", "0", "--steps", "2",
                "--sequences", "4", "--eval-sequences", "2", "--gen-len", "32", "--eval-prompts", "1",
                "--block-size", "4", "--layers", "1", "--intermediate", "16")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "acceptance" in r.stderr and "learned" in r.stderr
    fx = read_fixture(out)
    assert fx.drafter.config.block_size == 4 and fx.drafter.meta["steps"] == 2
    assert len(fx.drafter.meta["acceptance"]) == 7  # ar, chain, 4 budgets (16, 31, 64, 256), suffix
    r = run_kdt("generate", "--model", out, "--prompt", "def ", "-n", "8", "--backend", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["drafter"] == "learned" and doc["block_size"] == 4 and len(doc["tokens"]) == 8
    r = run_kdt("verify", out, "--backend", "cpu")
    assert r.returncode == 0 and "learned" in r.stdout, r.stdout[-2000:]
    r = run_kdt("train-drafter", out, "--eval-only", "--eval-prompts", "1", "--budgets", "4,16", "--json",
                tmp_path / "acc.json", "--repeats", "2",
                "--out", tmp_path / "evaluated.h5")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "round 2 of 2" in r.stderr
    doc = json.loads((tmp_path / "acc.json").read_text())
    assert [(row["drafter"], row["budget"]) for row in doc["acceptance"]][:4] == [
        ("ar", 0), ("learned chain", 3), ("learned", 4), ("learned", 16)]
    for row in doc["acceptance"]:  # --repeats 2: both runs kept, the median reported, the ratio to AR's median
        runs = row["tokens_per_s_runs"]
        assert len(runs) == 2 and row["tokens_per_s"] == pytest.approx(np.median(runs), rel=1e-3)
        assert row["vs_ar"] == pytest.approx(row["tokens_per_s"] / doc["acceptance"][0]["tokens_per_s"], rel=1e-2)
    assert doc["training"]["steps"] == 2
    # --eval-only --out: a copy whose drafter meta records this table (the drafter itself unchanged)
    ev = read_fixture(tmp_path / "evaluated.h5")
    assert ev.drafter.meta["acceptance"] == doc["acceptance"]
    assert ev.drafter.meta["acceptance_run"] == {"backend": "cpu", "dtype": "float32", "prompts": 1, "repeats": 2}
    assert all(np.array_equal(ev.drafter.weights[n], fx.drafter.weights[n]) for n in fx.drafter.weights)
    # --resume: the drafter's shape (not the defaults' 2 layers, block 16), its weights as the start
    r = run_kdt("train-drafter", out, "--resume", "--out", tmp_path / "resumed.h5", "--minutes", "0", "--steps", "1",
                "--sequences", "4", "--eval-sequences", "2", "--gen-len", "32", "--eval-prompts", "0", "--lr", "0.001")
    assert r.returncode == 0 and "resuming from" in r.stderr, r.stderr[-2000:]
    rs = read_fixture(tmp_path / "resumed.h5")
    assert rs.drafter.config == fx.drafter.config and rs.drafter.meta["resumed_from"]["steps"] == 2
    assert rs.drafter.meta["args"]["lr"] == 0.001
    assert any(not np.array_equal(rs.drafter.weights[n], fx.drafter.weights[n]) for n in fx.drafter.weights)


def test_truncated_drafter_keeps_the_first_layers_bit_for_bit(rng):
    """truncated_drafter (the start of `kdt train-drafter --resume --layers N`): the first N layers, fc, norms
    and mask embedding unchanged, the config's layer count N, a drafter the reference runs."""
    from kdt.train_drafter import truncated_drafter

    cfg = CFG
    dcfg = DrafterConfig(target_layers=(0,), block_size=3, num_hidden_layers=3, intermediate_size=8)
    full = Drafter(dcfg, random_drafter_weights(dcfg, cfg, 3), {"steps": 7})
    two = truncated_drafter(full, 2)
    assert two.config.num_hidden_layers == 2 and two.meta == {"steps": 7, "truncated_from_layers": 3}
    assert set(two.weights) == set(drafter_weight_names(two.config, cfg))
    assert all(np.array_equal(two.weights[n], full.weights[n]) for n in two.weights)
    emb = rng.standard_normal((cfg.vocab_size, cfg.hidden_size))
    DraftModel(two.config, cfg, two.weights, emb, emb, max_len=16).block_logits(1, 0)
    with pytest.raises(ValueError):
        truncated_drafter(full, 4)


def test_train_drafter_resume_layers_refused(tmp_path):
    """--resume --layers more than the drafter has: one line, exit 2, nothing written."""
    pytest.importorskip("torch")
    from kdt.fixture import copy_with_drafter
    from kdt.testing import run_kdt

    cfg = read_fixture("fixtures/model_tiny.h5", load_weights=False).config
    dcfg = DrafterConfig(target_layers=(0,), block_size=4, num_hidden_layers=1, intermediate_size=8)
    src = tmp_path / "d1.h5"
    copy_with_drafter("fixtures/model_tiny.h5", src, Drafter(dcfg, random_drafter_weights(dcfg, cfg, 1), {}))
    r = run_kdt("train-drafter", src, "--resume", "--layers", "2", "--out", tmp_path / "x.h5", "--sequences", "2")
    assert r.returncode == 2 and "--layers must be in [1, 1]" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.h5").exists()


@pytest.mark.parametrize("args, msg", [
    (("--target-layers", "9"), "target_layers"),
    (("--target-layers", "x"), "--target-layers"),
    (("--minutes", "0"), "--minutes"),
    (("--device", "gpu"), "--device"),
    (("--anchors", "0"), "--anchors"),
    (("--anchors", "178"), "--anchors"),  # the default gen-len 192 and block 16 leave 177 roots
    (("--resume",), "no learned drafter"),
    (("--lr", "0"), "--lr"),
    (("--budgets", "16,x"), "--budgets"),
    (("--budgets", "0,16"), "--budgets"),
])
def test_train_drafter_refusals(tmp_path, args, msg):
    from kdt.testing import run_kdt

    r = run_kdt("train-drafter", "fixtures/model_tiny.h5", "--out", tmp_path / "x.h5", "--sequences", "2", *args)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.h5").exists()
