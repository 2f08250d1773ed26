"""Export parity: PyTorch `transformers.AutoModel` and `SentenceTransformer` load jaxsim's exports
and reproduce jaxsim's hidden states / sentence vectors (within 1e-4); import(export) is exact."""
from __future__ import annotations

import json
import shutil

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from sentence_transformers import SentenceTransformer

import jaxsim
from jaxsim import export as export_lib
from jaxsim.calibration import apply_whitening, fit_whitening
from jaxsim.checkpoint import CheckpointOptions, Checkpointer
from jaxsim.data.tokenize import tokenize
from jaxsim.models.bert import BertModel
from jaxsim.pretrained import bundled_model_path
from jaxsim.train_state import TrainState

SENTENCES = [
    "A man is playing a guitar.",
    "hello",
    "The quick brown fox jumps over the lazy dog near the river bank today.",
    "Two dogs run through a snowy field while a child watches from the fence.",
    "",
]
_WORDS = ("cat dog man woman child plays runs sings eats reads a the red big small green "
          "quickly slowly in on park street river house book song").split()


def _corpus(n: int, seed: int = 0) -> list[str]:
    """n synthetic sentences (enough rows to fit a full-rank whitening)."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(_WORDS, rng.integers(3, 12))) for _ in range(n)]


def _torch_hidden(folder, sentences, max_length=64):
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModel.from_pretrained(str(folder)).eval()
    enc = tok(sentences, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
    hidden = [h.numpy() for h in out.hidden_states]
    pooled = None if out.pooler_output is None else out.pooler_output.numpy()
    return enc, hidden, pooled


def _jax_hidden(model, enc):
    ids = jnp.asarray(enc["input_ids"].numpy(), jnp.int32)
    mask = jnp.asarray(enc["attention_mask"].numpy(), jnp.int32)
    types = enc.get("token_type_ids")
    types = None if types is None else jnp.asarray(types.numpy(), jnp.int32)
    return model.module.apply({"params": model.params}, ids, mask, types, deterministic=True)


def _assert_hidden_parity(jax_model, folder, sentences, mask_pad=True):
    enc, hidden, pooled = _torch_hidden(folder, sentences)
    out = _jax_hidden(jax_model, enc)
    mask = enc["attention_mask"].numpy()[:, :, None].astype(bool)
    assert len(hidden) == len(out.hidden_states) == jax_model.config.num_hidden_layers + 1
    worst = 0.0
    for h_torch, h_jax in zip(hidden, out.hidden_states):
        diff = np.abs(h_torch - np.asarray(h_jax))
        worst = max(worst, float(np.max(np.where(mask, diff, 0.0) if mask_pad else diff)))
    assert worst < 1e-4, worst
    if pooled is not None:
        np.testing.assert_allclose(pooled, np.asarray(out.pooler_output), atol=1e-4)
    return worst


def _assert_params_identical(a, b):
    fa, fb = flax.traverse_util.flatten_dict(a), flax.traverse_util.flatten_dict(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg=str(k))


# ---------------------------------------------------------------------------- bundled model
def test_bundled_hf_export_matches_automodel_and_round_trips(bundled, tmp_path):
    out = tmp_path / "hf"
    assert export_lib.main(["--checkpoint", str(bundled_model_path()), "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    _assert_hidden_parity(bundled, out, SENTENCES)
    # import(export(params)) == params, bit for bit.
    _assert_params_identical(jaxsim.load_pretrained(out).params, bundled.params)


def test_bundled_sentence_transformers_export(bundled, tmp_path):
    plain = tmp_path / "st"
    assert export_lib.main(["--checkpoint", str(bundled_model_path()), "--out", str(plain),
                            "--format", "sentence-transformers"]) == 0
    record = json.loads((plain / "jaxsim_export.json").read_text())
    assert record["pooler"] == "avg" and record["normalize"] is True  # as the source ST folder
    got = SentenceTransformer(str(plain), device="cpu").encode(SENTENCES)
    want = jaxsim.encode(bundled, SENTENCES, pooler="avg", normalize=True)
    np.testing.assert_allclose(got, want, atol=1e-4)


# ---------------------------------------------------------------------------- tiny models
@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Tiny random BERT and RoBERTa folders (built once for this file) and their jaxsim loads."""
    from tests.conftest import write_tiny_model

    out = {}
    for model_type in ("bert", "roberta"):
        folder = tmp_path_factory.mktemp(f"tiny-{model_type}")
        write_tiny_model(folder, model_type)
        out[model_type] = (folder, jaxsim.load_pretrained(folder))
    return out


@pytest.mark.parametrize("model_type,poolers", [("bert", ("cls", "avg_top2", "cls_before_pooler")),
                                                ("roberta", ("avg_first_last", "avg_embed_last"))])
def test_tiny_sentence_transformers_parity(tiny_models, tmp_path, model_type, poolers):
    _, model = tiny_models[model_type]
    for i, pooler in enumerate(poolers):
        out = tmp_path / pooler
        export_lib.export_model(model, out, format="sentence-transformers", pooler=pooler,
                                normalize=True, max_length=64)
        if i == 0:  # same weights for every pooler: check layers and the round trip once
            _assert_hidden_parity(model, out, SENTENCES)
            _assert_params_identical(jaxsim.load_pretrained(out).params, model.params)
        got = SentenceTransformer(str(out), device="cpu").encode(SENTENCES)
        want = jaxsim.encode(model, SENTENCES, pooler=pooler, normalize=True, max_length=64)
        np.testing.assert_allclose(got, want, atol=1e-4, err_msg=pooler)


@pytest.mark.parametrize("model_type,pooler,post,normalize", [
    ("bert", "cls", "whitening:20", False), ("roberta", "avg", "whitening:24", True)])
def test_tiny_whitening_dense_matches_jaxsim(tiny_models, tmp_path, model_type, pooler, post,
                                             normalize):
    folder, model = tiny_models[model_type]
    corpus = _corpus(80)
    fit = tmp_path / "fit.txt"
    fit.write_text("\n".join(corpus) + "\n")
    out = tmp_path / "st-white"
    argv = ["--checkpoint", str(folder), "--out", str(out), "--format", "sentence-transformers",
            "--pooler", pooler, "--post", post, "--fit-data", str(fit), "--max-length", "64"]
    assert export_lib.main(argv + (["--normalize"] if normalize else [])) == 0
    modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((out / "modules.json").read_text())]
    expected = ["Transformer", "Pooling"] + ["Dense"] * (1 + (pooler == "cls"))
    assert modules == expected + ["Normalize"] * normalize
    k = int(post.split(":")[1])
    w = fit_whitening(jaxsim.encode(model, corpus, pooler=pooler, max_length=64), k)
    want = apply_whitening(w, jaxsim.encode(model, SENTENCES, pooler=pooler, max_length=64))
    if normalize:
        want = want / np.linalg.norm(want, axis=1, keepdims=True)
    got = SentenceTransformer(str(out), device="cpu").encode(SENTENCES)
    assert got.shape == (len(SENTENCES), k)
    # Whitened coordinates are O(1)-O(10): compare at 1e-4 of that scale.
    np.testing.assert_allclose(got, want, atol=1e-4 * max(1.0, float(np.abs(want).max())))


def test_layer_weights_pick_the_two_layers():
    start, w = export_lib.layer_weights("avg_first_last", 4)
    assert start == 1 and w.tolist() == [1, 0, 0, 1]
    start, w = export_lib.layer_weights("avg_top2", 4)
    assert start == 3 and w.tolist() == [1, 1]
    start, w = export_lib.layer_weights("avg_embed_last", 2)
    assert start == 0 and w.tolist() == [1, 0, 1]
    start, w = export_lib.layer_weights("avg_first_last", 1)  # first == last layer
    assert start == 1 and w.tolist() == [2]


def _simcse_workdir(tmp_path, base_folder, base_params, pooler="cls", seed=0, bad_shape=False):
    """A train workdir as train.py writes it: config.json + orbax checkpoints of SimCSE params."""
    hidden = base_params["embeddings"]["word_embeddings"]["embedding"].shape[1]
    k1, k2 = jax.random.split(jax.random.key(seed))
    encoder = {k: v for k, v in base_params.items() if k != "pooler"}
    # Move the encoder away from the base so the test sees the trained weights, not the base's.
    encoder = jax.tree.map(lambda x: x + 0.01, encoder)
    mlp = {"kernel": jax.random.normal(k1, (hidden, hidden)) * 0.2,
           "bias": jax.random.normal(k2, (hidden,)) * 0.1}
    if bad_shape:
        mlp["kernel"] = jnp.zeros((hidden, hidden + 1))
    params = {"encoder": encoder, "mlp": mlp}
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    (workdir / "config.json").write_text(json.dumps({"model": str(base_folder), "pooler": pooler}))
    state = TrainState(step=jnp.int32(5), params=params, opt_state={},
                       rng=jax.random.key_data(jax.random.key(0)))
    with Checkpointer(workdir / "checkpoints", CheckpointOptions(best_metric="dev")) as ckpt:
        ckpt.save(5, state, metrics={"dev": 1.0})
        ckpt.save(6, state.replace(params=jax.tree.map(lambda x: x * 0, params)),
                  metrics={"dev": 0.0})
    return workdir, params


def test_simcse_workdir_exports_head_as_pooler(tiny_models, tmp_path):
    folder, base = tiny_models["bert"]
    workdir, params = _simcse_workdir(tmp_path, folder, base.params)
    out = tmp_path / "st"
    assert export_lib.main(["--checkpoint", str(workdir), "--out", str(out),
                            "--format", "sentence-transformers"]) == 0
    # Reference: CLS of the trained encoder -> dense -> tanh (the SimCSE 'cls' eval path).
    batch = tokenize(base.tokenizer, SENTENCES, max_length=64)
    enc_out = BertModel(base.config, add_pooler=False).apply(
        {"params": params["encoder"]}, batch.input_ids, batch.attention_mask, batch.token_type_ids)
    cls = np.asarray(enc_out.hidden_states[-1][:, 0])
    want = np.tanh(cls @ np.asarray(params["mlp"]["kernel"]) + np.asarray(params["mlp"]["bias"]))
    got = SentenceTransformer(str(out), device="cpu").encode(SENTENCES)
    np.testing.assert_allclose(got, want, atol=1e-4)
    # transformers users get the same vector as pooler_output ('best' = step 5, not 6).
    _, _, pooled = _torch_hidden(out, SENTENCES)
    np.testing.assert_allclose(pooled, want, atol=1e-4)
    assert json.loads((out / "jaxsim_export.json").read_text())["pooler"] == "cls"
    # jaxsim itself loads the workdir the same way (eval.py --model WORKDIR).
    trained = jaxsim.load_pretrained(workdir)
    assert trained.default_pooler == "cls"
    np.testing.assert_allclose(jaxsim.encode(trained, SENTENCES, max_length=64), want, atol=1e-5)


def test_bad_inputs_are_clear_errors(tiny_models, tmp_path, capsys):
    folder, base = tiny_models["bert"]
    workdir, _ = _simcse_workdir(tmp_path, folder, base.params)

    def fails(argv, message):
        capsys.readouterr()
        assert export_lib.main(argv) == 2
        err = capsys.readouterr().err
        assert message in err, err

    out = str(tmp_path / "out")
    fails(["--checkpoint", str(workdir), "--out", out, "--pooler", "avg"],
          "trained and evaluated with pooler 'cls'")
    fails(["--checkpoint", str(workdir), "--out", out, "--post", "whitening"],
          "--post needs --format sentence-transformers")
    fails(["--checkpoint", str(workdir), "--out", out, "--format", "sentence-transformers",
           "--post", "flow"], "not affine")
    fails(["--checkpoint", str(workdir), "--out", out, "--format", "sentence-transformers",
           "--post", "whitening:4"], "needs --fit-data")
    fails(["--checkpoint", str(folder), "--out", out, "--format", "sentence-transformers"],
          "records no pooler; pass --pooler")
    fails(["--checkpoint", str(workdir), "--out", str(workdir), "--overwrite"],
          "would overwrite the model")
    fails(["--checkpoint", str(workdir), "--out", str(tmp_path), "--overwrite"],
          "would overwrite the model")
    # A non-empty folder is never overwritten without --overwrite, and is left untouched.
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    fails(["--checkpoint", str(workdir), "--out", out], "not empty; pass --overwrite")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    assert export_lib.main(["--checkpoint", str(workdir), "--out", out, "--overwrite"]) == 0
    assert not (tmp_path / "out" / "keep.txt").exists()
    # Missing train config.
    (workdir / "config.json").unlink()
    fails(["--checkpoint", str(workdir), "--out", str(tmp_path / "o2")],
          f"{workdir / 'config.json'}: train config not found")
    # Tensors that do not match the architecture.
    bad_tmp = tmp_path / "bad"
    bad_tmp.mkdir()
    bad_workdir, _ = _simcse_workdir(bad_tmp, folder, base.params, bad_shape=True)
    fails(["--checkpoint", str(bad_workdir), "--out", str(tmp_path / "o3")],
          "pooler/dense/kernel has shape (36, 37), expected (36, 36)")
    assert not (tmp_path / "o3").exists()
    # An HF folder whose safetensors do not fit its config.
    folder = shutil.copytree(folder, tmp_path / "bad-hf")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 40
    (folder / "config.json").write_text(json.dumps(cfg))
    fails(["--checkpoint", str(folder), "--out", str(tmp_path / "o4")],
          "encoder.layer.0.intermediate.dense.weight")


def test_cli_entry_point_reports_errors_in_one_line(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "jaxsim", "export", "--checkpoint",
                           str(tmp_path / "missing"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, cwd=repo, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"jaxsim export: error: --checkpoint {tmp_path / 'missing'}: " \
                                  "no such folder"
    assert not (tmp_path / "out").exists()
