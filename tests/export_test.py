"""Export parity: PyTorch `transformers.AutoModel` and `SentenceTransformer` load jaxsim's exports
and reproduce jaxsim's hidden states / sentence vectors (within 1e-4); import(export) is exact."""
from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import flax.traverse_util
import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file
from sentence_transformers import SentenceTransformer

import jaxsim
from jaxsim import calibrate
from jaxsim import export as export_lib
from jaxsim.cli.main import main as cli_main
from jaxsim.formats.pretrained import bundled_model_path
from jaxsim.models.bert import BertModel
from jaxsim.models.poolers import BUILTIN_POOLERS, get_pooler
from tests.conftest import HANG_GUARD_S, write_tiny_model, write_tiny_workdir

REPO = Path(__file__).resolve().parents[1]
BUILT_IN_POOLERS = BUILTIN_POOLERS
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


def _torch_outputs(folder, sentences, max_length=64):
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModel.from_pretrained(str(folder)).eval()
    enc = tok(sentences, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
    pooled = None if out.pooler_output is None else out.pooler_output.numpy()
    return enc, [h.numpy() for h in out.hidden_states], pooled


def assert_hidden_parity(model, folder, sentences=SENTENCES):
    """AutoModel(folder)'s hidden states equal jaxsim's on real tokens; returns the torch
    pooler_output."""
    enc, hidden, pooled = _torch_outputs(folder, sentences)
    ids, mask = enc["input_ids"].numpy(), enc["attention_mask"].numpy()
    types = enc.get("token_type_ids")
    out = BertModel(model.config, add_pooler=False).apply(
        {"params": model.params["bert"]}, ids, mask, None if types is None else types.numpy())
    assert len(hidden) == len(out.hidden_states) == model.config.num_hidden_layers + 1
    real = mask[:, :, None].astype(bool)
    worst = max(float(np.max(np.where(real, np.abs(t - np.asarray(j)), 0.0)))
                for t, j in zip(hidden, out.hidden_states))
    assert worst < 1e-4, worst
    return pooled


def assert_params_identical(a, b):
    fa, fb = flax.traverse_util.flatten_dict(a), flax.traverse_util.flatten_dict(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg=str(k))


LOAD_ATOL = 1e-5  # a loaded sentence-transformers folder against sentence-transformers


def st_encode(folder, sentences=SENTENCES):
    return SentenceTransformer(str(folder), device="cpu").encode(sentences)


def assert_modes(folder: Path):
    """Under umask 022: folders 0755, files 0644 (what any program the user runs creates)."""
    for path in [folder, *folder.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o755 if path.is_dir() else 0o644), (path, oct(mode))


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


# ---------------------------------------------------------------------------- bundled model
def test_bundled_hf_export_matches_automodel_and_round_trips(bundled, tmp_path, umask_022):
    out = tmp_path / "hf"
    assert cli_main(["export", "--checkpoint", str(bundled_model_path()), "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "jaxsim_export.json"} <= {
        p.name for p in out.iterdir()}
    assert not list(tmp_path.glob(".hf.*"))  # no temporary folder left behind
    assert_modes(out)
    # 'avg' does not use BERT's pooler layer, but it is the checkpoint's: the export keeps it.
    assert_source_pooler_kept(out)
    assert load_report(out, "transformers.AutoModel.from_pretrained") == ""
    assert_hidden_parity(bundled, out)
    again = jaxsim.load_pretrained(out)
    assert again.pooler == "avg"
    assert_params_identical(again.params["bert"], bundled.params["bert"])  # bit for bit


def test_bundled_sentence_transformers_export(bundled, tmp_path):
    out = tmp_path / "st"
    assert cli_main(["export", "--checkpoint", str(bundled_model_path()), "--out", str(out),
                     "--format", "sentence-transformers"]) == 0
    record = json.loads((out / "jaxsim_export.json").read_text())
    assert record["pooler"] == "avg" and record["normalize"] is True  # as the source ST folder
    config = json.loads((out / "config_sentence_transformers.json").read_text())
    assert config["__version__"]["jaxsim"] == record["jaxsim_version"]  # the format's key
    want = jaxsim.encode(bundled, SENTENCES, normalize=True)
    np.testing.assert_allclose(st_encode(out), want, atol=1e-4)
    # BERT's pooler layer goes along, so sentence-transformers loads it without a report.
    assert_source_pooler_kept(out)
    assert load_report(out, "sentence_transformers.SentenceTransformer") == ""


def assert_source_pooler_kept(out):
    """The export's model.safetensors holds the bundled checkpoint's pooler.dense, bit for bit."""
    source = load_file(str(bundled_model_path() / "model.safetensors"))
    exported = load_file(str(out / "model.safetensors"))
    for name in ("pooler.dense.weight", "pooler.dense.bias"):
        assert name in exported, name
        np.testing.assert_array_equal(exported[name], source[name], err_msg=name)


_LOADERS = {
    "transformers.AutoModel.from_pretrained":
        "import sys, transformers; transformers.AutoModel.from_pretrained(sys.argv[1])",
    "sentence_transformers.SentenceTransformer":
        "import sys, sentence_transformers as st; st.SentenceTransformer(sys.argv[1], "
        "device='cpu')",
}


def load_report(folder, loader: str) -> str:
    """The LOAD REPORT lines transformers prints when `loader(folder)` runs in a new process
    (as a user's script would; the report is a warning of a logger that does not propagate)."""
    proc = subprocess.run([sys.executable, "-c", _LOADERS[loader], str(folder)],
                          capture_output=True,
                          text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr
    # The report starts with '<model class> LOAD REPORT' and lists keys with their status.
    return "\n".join(line for line in proc.stderr.splitlines()
                     if "LOAD REPORT" in line or "MISSING" in line or "UNEXPECTED" in line)


# ---------------------------------------------------------------------------- tiny models
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny random BERT and RoBERTa folders (odd dims) and their jaxsim loads, built once."""
    models = {}
    for model_type in ("bert", "roberta"):
        folder = tmp_path_factory.mktemp(f"tiny-{model_type}")
        write_tiny_model(folder, model_type)
        models[model_type] = jaxsim.load_pretrained(folder)
    return models


def test_hf_export_of_cls_pooler_writes_bert_pooler_and_round_trips(tiny, tmp_path):
    model = tiny["bert"].with_pooler("cls")
    out = export_lib.export_model(model, tmp_path / "hf")
    assert "pooler.dense.weight" in load_file(str(out / "model.safetensors"))
    pooled = assert_hidden_parity(model, out)
    np.testing.assert_allclose(pooled, jaxsim.encode(model, SENTENCES, max_length=64),
                               atol=1e-4)
    again = jaxsim.load_pretrained(out)
    assert again.pooler == "cls"
    assert_params_identical(again.params, model.params)


@pytest.mark.parametrize("pooler", BUILT_IN_POOLERS)
def test_every_pooler_sentence_transformers_parity(tiny, tmp_path, pooler):
    """Plain export, and export with a whitening Dense + Normalize, for each built-in pooler:
    sentence-transformers reproduces jaxsim's vectors, and the export loads back as it encodes
    (`jaxsim.load_pretrained` applies its Pooling, Dense and Normalize modules, within 1e-5 of
    sentence-transformers); exported again, the head goes along."""
    index = BUILT_IN_POOLERS.index(pooler)
    model = tiny["bert" if index % 2 == 0 else "roberta"].with_pooler(pooler)
    plain = export_lib.export_model(model, tmp_path / "plain", "sentence-transformers",
                                    max_length=64)
    want = jaxsim.encode(model, SENTENCES, max_length=64)
    st_plain = st_encode(plain)
    np.testing.assert_allclose(st_plain, want, atol=1e-4, err_msg=pooler)
    loaded_plain = jaxsim.load_pretrained(plain)
    assert loaded_plain.pooler == pooler and loaded_plain.head == ()
    np.testing.assert_allclose(jaxsim.encode(loaded_plain, SENTENCES), st_plain, atol=LOAD_ATOL)

    whitening = calibrate.fit("whitening:20", jaxsim.encode(model, _corpus(80), max_length=64))
    white = export_lib.export_model(model, tmp_path / "white", "sentence-transformers",
                                    calibration=whitening, normalize=True, max_length=64)
    modules = [m["type"].rsplit(".", 1)[-1]
               for m in json.loads((white / "modules.json").read_text())]
    assert modules[0] == "Transformer" and modules[-2:] == ["Dense", "Normalize"]
    z = whitening.apply(want)
    z = z / np.linalg.norm(z, axis=1, keepdims=True)
    got = st_encode(white)
    assert got.shape == (len(SENTENCES), 20)
    np.testing.assert_allclose(got, z, atol=1e-4, err_msg=pooler)

    loaded = jaxsim.load_pretrained(white)
    assert [type(m).__name__ for m in loaded.head] == ["Dense", "Normalize"]
    got_loaded = jaxsim.encode(loaded, SENTENCES)
    assert got_loaded.shape == (len(SENTENCES), 20)
    # Whitening scales the encoders' float32 rounding by up to its largest singular value,
    # and the normalization divides by the whitened vector's length: the same rounding seen
    # through the head (first order), twice for margin. A head applied wrongly is off by O(1).
    rounding = np.max(np.abs(np.asarray(jaxsim.encode(loaded_plain, SENTENCES)) - st_plain),
                      axis=1)
    w = np.asarray(whitening.W, np.float64)
    lengths = np.linalg.norm(whitening.apply(want), axis=1)
    head_atol = np.maximum(2 * np.sqrt(w.shape[0]) * rounding * np.linalg.norm(w, 2) / lengths,
                           LOAD_ATOL)
    assert np.all(np.abs(got_loaded - got).max(axis=1) <= head_atol), pooler
    again = export_lib.export_model(loaded, tmp_path / "again", "sentence-transformers")
    kinds = [m["type"].rsplit(".", 1)[-1]
             for m in json.loads((again / "modules.json").read_text())]
    assert kinds[-2:] == ["Dense", "Normalize"] and kinds.count("Normalize") == 1
    assert np.all(np.abs(st_encode(again) - got_loaded).max(axis=1) <= head_atol), pooler
    with pytest.raises(export_lib.ExportError, match="Dense module after pooling"):
        export_lib.export_model(loaded, tmp_path / "hf", "hf")


def test_whitening_fitted_by_the_command_line(tiny, tmp_path):
    """--post whitening:K --fit-data: the fit set is encoded by jaxsim and baked in."""
    model = tiny["roberta"]
    fit = tmp_path / "fit.txt"
    corpus = _corpus(80)
    fit.write_text("\n".join(corpus) + "\n\n")  # a trailing blank line is skipped
    out = tmp_path / "st"
    assert cli_main(["export", "--checkpoint", model.path, "--out", str(out), "--format",
                     "sentence-transformers", "--pooler", "avg", "--post", "whitening:24",
                     "--fit-data", str(fit), "--max-length", "64"]) == 0
    model = model.with_pooler("avg")
    w = calibrate.fit("whitening:24", jaxsim.encode(model, corpus, max_length=64))
    want = w.apply(jaxsim.encode(model, SENTENCES, max_length=64))
    got = st_encode(out)
    # Whitened coordinates are O(1)-O(10): compare at 1e-4 of that scale.
    np.testing.assert_allclose(got, want, atol=1e-4 * max(1.0, float(np.abs(want).max())))
    record = json.loads((out / "jaxsim_export.json").read_text())
    assert record["post"]["spec"] == "whitening:24" and record["post"]["dim_out"] == 24
    assert record["normalize"] is False
    # The same calibration saved by jaxsim.calibrate and baked in with --calibration.
    w.save(tmp_path / "cal")
    again = tmp_path / "st-saved"
    assert cli_main(["export", "--checkpoint", model.path, "--out", str(again), "--format",
                     "sentence-transformers", "--pooler", "avg", "--calibration",
                     str(tmp_path / "cal"), "--max-length", "64"]) == 0
    np.testing.assert_allclose(st_encode(again), got, atol=1e-5)


def test_a_singular_whitening_fit_is_said_and_recorded(tiny, tmp_path, capsys):
    """Fewer fit sentences than dimensions: whitening keeps the covariance's rank (the null
    directions dropped); the export says so and records it, as eval.py notes it."""
    model = tiny["bert"]
    fit = tmp_path / "few.txt"
    fit.write_text("\n".join(_corpus(5)) + "\n")
    out = tmp_path / "st"
    assert cli_main(["export", "--checkpoint", model.path, "--out", str(out), "--format",
                     "sentence-transformers", "--pooler", "avg", "--post", "whitening",
                     "--fit-data", str(fit)]) == 0
    err = capsys.readouterr().err
    assert f"note: --fit-data {fit}: whitening: the covariance of the 5x" in err
    record = json.loads((out / "jaxsim_export.json").read_text())
    assert record["post"]["dim_out"] == 4  # 5 centred rows span 4 directions
    assert "dropped its" in record["post"]["note"]
    assert st_encode(out).shape == (len(SENTENCES), 4)


def test_pooler_without_export_rule_is_refused(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(export_lib, "get_pooler",
                        lambda name: dataclasses.replace(get_pooler(name), export=None))
    with pytest.raises(export_lib.ExportError, match="'avg' has no sentence-transformers export"):
        export_lib.export_model(tiny["bert"].with_pooler("avg"), tmp_path / "st",
                                "sentence-transformers")
    assert not (tmp_path / "st").exists() and not list(tmp_path.iterdir())


# ------------------------------------------------------------------------ trained workdirs
@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny):
    """A trained 'cls' workdir: step 1 is best by the dev metric, step 2 is the latest."""
    folder = tmp_path_factory.mktemp("workdir")
    saved = write_tiny_workdir(folder, tiny["bert"].tokenizer, pooler="cls",
                               steps=((1, 0.9), (2, 0.5)))
    return folder, saved


def test_workdir_exports_with_no_translation(workdir, tmp_path, caplog):
    folder, saved = workdir
    with caplog.at_level("WARNING"):
        model = jaxsim.load_pretrained(folder)
    assert not [r for r in caplog.records if "read only" in r.getMessage()]
    assert_params_identical(jax.tree.map(np.asarray, model.params), saved[1])  # best = step 1
    want = jaxsim.encode(model, SENTENCES, max_length=64)

    st = tmp_path / "st"
    assert cli_main(["export", "--checkpoint", str(folder), "--out", str(st),
                     "--format", "sentence-transformers"]) == 0
    np.testing.assert_allclose(st_encode(st), want, atol=1e-4)
    hf = tmp_path / "hf"
    assert cli_main(["export", "--checkpoint", str(folder), "--out", str(hf)]) == 0
    pooled = assert_hidden_parity(model, hf)
    np.testing.assert_allclose(pooled, want, atol=1e-4)  # the head is BERT's pooler layer
    assert_params_identical(jaxsim.load_pretrained(hf).params, saved[1])
    # --step picks another checkpoint.
    latest = tmp_path / "latest"
    assert cli_main(["export", "--checkpoint", str(folder), "--out", str(latest),
                     "--step", "latest"]) == 0
    assert_params_identical(jaxsim.load_pretrained(latest).params, saved[2])


def _fails(capsys, argv, message):
    capsys.readouterr()
    assert cli_main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    return err


def test_bad_requests_are_one_line_errors(workdir, tiny, tmp_path, capsys):
    folder, _ = workdir
    src, out = str(folder), str(tmp_path / "out")
    _fails(capsys, ["export", "--checkpoint", src, "--out", out, "--pooler", "avg"],
           "trained and evaluated with pooler 'cls'")
    _fails(capsys, ["export", "--checkpoint", src, "--out", out, "--post", "whitening"],
           "--post needs --format sentence-transformers")
    # A flow is exported as a PyTorch module (tests/formats/st_flow_test.py); it is fitted too.
    _fails(capsys, ["export", "--checkpoint", src, "--out", out, "--format",
                    "sentence-transformers", "--post", "flow"], "--post flow needs --fit-data")
    _fails(capsys, ["export", "--checkpoint", src, "--out", out, "--format",
                    "sentence-transformers", "--post", "whitening:4"], "needs --fit-data")
    _fails(capsys, ["export", "--checkpoint", src, "--out", out, "--normalize"],
           "--normalize needs --format sentence-transformers")
    _fails(capsys, ["export", "--checkpoint", src, "--out", out, "--max-length", "16"],
           "--max-length needs --format sentence-transformers")
    _fails(capsys, ["export", "--checkpoint", src, "--out", out, "--format",
                    "sentence-transformers", "--fit-data", src], "has no effect without --post")
    _fails(capsys, ["export", "--checkpoint", src, "--out", out, "--format", "onnx"],
           "invalid choice: 'onnx'")
    _fails(capsys, ["export", "--checkpoint", tiny["bert"].path, "--out", out, "--step", "3"],
           "is not a train workdir")
    _fails(capsys, ["export", "--checkpoint", src, "--out", src, "--overwrite"],
           "would overwrite the model")
    _fails(capsys, ["export", "--checkpoint", src, "--out", str(folder.parent), "--overwrite"],
           "would overwrite the model")
    _fails(capsys, ["export", "--checkpoint", str(tmp_path / "nope" / "x"), "--out", out],
           "no such model folder")
    # A non-empty folder is never replaced without --overwrite, nor ever when it is not an
    # export; a previous export is replaced with it.
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    _fails(capsys, ["export", "--checkpoint", src, "--out", out], "exists; pass --overwrite")
    _fails(capsys, ["export", "--checkpoint", src, "--out", out, "--overwrite"],
           "holds no jaxsim_export.json")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    (tmp_path / "out" / "keep.txt").unlink()
    assert cli_main(["export", "--checkpoint", src, "--out", out]) == 0
    (tmp_path / "out" / "extra.txt").write_text("old")
    assert cli_main(["export", "--checkpoint", src, "--out", out, "--overwrite"]) == 0
    assert not (tmp_path / "out" / "extra.txt").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    # A workdir without its model record.
    broken = tmp_path / "broken"
    (broken / "checkpoints").mkdir(parents=True)
    _fails(capsys, ["export", "--checkpoint", str(broken), "--out", str(tmp_path / "o2")],
           "model.json: model record not found")
    # A workdir whose parameters do not fit its model record.
    record = json.loads((folder / "model.json").read_text())
    mismatched = tmp_path / "mismatched"
    mismatched.mkdir()
    (mismatched / "checkpoints").symlink_to(folder / "checkpoints")
    (mismatched / "tokenizer").symlink_to(folder / "tokenizer")
    record["config"]["intermediate_size"] = 40
    (mismatched / "model.json").write_text(json.dumps(record))
    _fails(capsys, ["export", "--checkpoint", str(mismatched), "--out", str(tmp_path / "o3")],
           "intermediate/dense/kernel has shape (36, 37), expected (36, 40)")
    assert not (tmp_path / "o3").exists()


def test_export_prints_and_records_its_checkpoint(workdir, tiny, tmp_path, capsys):
    folder, _ = workdir
    out = tmp_path / "best"
    capsys.readouterr()
    assert cli_main(["export", "--checkpoint", str(folder), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err == f"exported {folder} step 1 (best stsb_dev 0.90) -> {out} (hf)\n"
    record = json.loads((out / "jaxsim_export.json").read_text())
    assert record["provenance"] == {
        "source": str(folder), "workdir": str(folder.absolute()), "step": 1,
        "selected_by": "best", "metric": "stsb_dev", "value": 0.9}
    # The best checkpoint is the untrained model: said so, in one warning line.
    untrained = tmp_path / "untrained"
    write_tiny_workdir(untrained, tiny["bert"].tokenizer, pooler="cls",
                       steps=((0, 0.7), (5, 0.2)))
    assert cli_main(["export", "--checkpoint", str(untrained), "--out",
                     str(tmp_path / "u")]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == (f"warning: {untrained} step 0 (best stsb_dev 0.70): the selected "
                        f"checkpoint is step 0, the model before any training")
    assert lines[1].startswith(f"exported {untrained} step 0 (best stsb_dev 0.70) -> ")
    # A folder source records just where it came from.
    assert cli_main(["export", "--checkpoint", tiny["bert"].path, "--out",
                     str(tmp_path / "f")]) == 0
    record = json.loads((tmp_path / "f" / "jaxsim_export.json").read_text())
    assert record["provenance"] == {"source": tiny["bert"].path}


def test_corrupt_checkpoint_is_one_line(workdir, tmp_path):
    """A damaged checkpoint: one `error:` line, no orbax/tensorstore noise, exit 1."""
    import shutil
    folder = shutil.copytree(workdir[0], tmp_path / "corrupt", symlinks=True)
    for step in ("1", "2"):
        for chunk in (folder / "checkpoints" / step / "state").rglob("d/*"):
            chunk.write_bytes(chunk.read_bytes()[:50])
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # The orbax reads left in flight print (by chance) at interpreter teardown; the command
    # must leave before it. An exit handler that would print stands for that teardown.
    leave_via_teardown = ("import atexit, runpy, sys; "
                          "atexit.register(print, 'teardown ran', file=sys.stderr); "
                          "runpy.run_module('jaxsim', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", leave_via_teardown, "export", "--checkpoint",
                           str(folder), "--out", str(tmp_path / "out")], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=HANG_GUARD_S)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {folder}/checkpoints/1: "), (
        "\n".join(lines[:60]))  # whole lines: a chance failure's noise must be readable
    assert "corrupt" in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
