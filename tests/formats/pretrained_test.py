"""Loading models: the HF name map both ways, the SentenceModel API, and clear errors for bad
model folders, workdirs and hub ids."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxsim
from jaxsim.errors import ConfigError
from jaxsim.formats.checkpoint import CheckpointError
from jaxsim.formats.hf import (
    CheckpointMismatchError,
    encoder_params_to_hf,
    hf_to_encoder_params,
    hf_to_params,
    params_to_hf,
)
from jaxsim.formats.hf_folder import ModelLoadError
from jaxsim.formats.workdir import WorkdirError
from jaxsim.models.bert import BertConfig
from jaxsim.models.poolers import PoolerError
from tests.conftest import HANG_GUARD_S, write_tiny_workdir

REPO = Path(__file__).resolve().parents[2]


def test_bundled_model_found_and_reported(bundled):
    assert (jaxsim.bundled_model_path() / "model.safetensors").is_file()
    assert bundled.config.num_hidden_layers == 6 and bundled.config.hidden_size == 384
    assert bundled.has_pooler_weights and bundled.ignored == ("embeddings.position_ids",)
    assert bundled.pooler == "avg"  # its sentence-transformers Pooling module: mean
    assert bundled.max_seq_length == 256 and bundled.max_length() == 256


def test_import_export_round_trip(bundled):
    tensors = load_file(str(jaxsim.bundled_model_path() / "model.safetensors"))
    exported = encoder_params_to_hf(bundled.params, bundled.config)
    assert set(exported) == set(tensors) - {"embeddings.position_ids"}
    for name, value in exported.items():
        np.testing.assert_array_equal(value, tensors[name])
    again, _ = hf_to_encoder_params(exported, bundled.config)
    assert jaxsim_tree_equal(again, bundled.params)
    # Without BERT's pooler layer (poolers other than 'cls' do not use it).
    bare = encoder_params_to_hf(bundled.params, bundled.config, include_pooler=False)
    assert set(exported) - set(bare) == {"pooler.dense.weight", "pooler.dense.bias"}


def jaxsim_tree_equal(a, b):
    import jax
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(x, y), a, b)))


def test_prefixed_task_checkpoint_loads(bundled):
    tensors = encoder_params_to_hf(bundled.params, bundled.config)
    prefixed = {f"bert.{k}": v for k, v in tensors.items()}
    prefixed["cls.predictions.bias"] = np.zeros(3, np.float32)
    params, report = hf_to_params(prefixed, bundled.config)
    assert report.ignored == ("cls.predictions.bias",)
    assert jaxsim_tree_equal(params_to_hf(params, bundled.config), tensors)


@pytest.fixture
def tiny_folder(tiny_model_dir):
    folder, _ = tiny_model_dir("bert")
    return folder


def test_missing_tensor_is_named(tiny_folder):
    tensors = load_file(str(tiny_folder / "model.safetensors"))
    del tensors["encoder.layer.1.attention.self.key.weight"]
    save_file(tensors, str(tiny_folder / "model.safetensors"))
    with pytest.raises(CheckpointMismatchError,
                       match=r"missing tensor 'encoder.layer.1.attention.self.key.weight'"):
        jaxsim.load_pretrained(tiny_folder)


def test_misshaped_and_unexpected_tensors_are_named(tiny_folder):
    tensors = load_file(str(tiny_folder / "model.safetensors"))
    tensors["encoder.layer.0.intermediate.dense.weight"] = np.zeros((36, 36), np.float32)
    tensors["encoder.layer.7.output.dense.weight"] = np.zeros((36, 36), np.float32)
    save_file(tensors, str(tiny_folder / "model.safetensors"))
    with pytest.raises(CheckpointMismatchError) as err:
        jaxsim.load_pretrained(tiny_folder)
    msg = str(err.value)
    assert ("'encoder.layer.0.intermediate.dense.weight' has shape (36, 36), expected (37, 36)"
            in msg)
    assert "unexpected tensor 'encoder.layer.7.output.dense.weight'" in msg
    assert "model.safetensors" in msg


def test_unknown_model_type(tiny_folder):
    cfg = json.loads((tiny_folder / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tiny_folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config.json: unknown model_type 'gpt2'"):
        jaxsim.load_pretrained(tiny_folder)


def test_malformed_config_and_missing_weights(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert",\n "vocab_size": }')
    with pytest.raises(ConfigError, match=r"config.json:2: malformed JSON"):
        jaxsim.load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 10}))
    with pytest.raises(ModelLoadError, match="no weights found"):
        jaxsim.load_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="no such model folder"):
        jaxsim.load_pretrained(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="the model path is empty"):  # not the cwd
        jaxsim.load_pretrained("")


@pytest.mark.parametrize("key, value, message", [
    ("hidden_size", "36", "hidden_size: expected int >= 1, got '36'"),
    ("num_attention_heads", 0, "num_attention_heads: expected int >= 1, got 0"),
    ("vocab_size", None, "vocab_size: expected int >= 1, got None"),
    ("num_hidden_layers", -1, "num_hidden_layers: expected int >= 1, got -1"),
    ("layer_norm_eps", "small", "layer_norm_eps: expected float >= 0, got 'small'"),
])
def test_wrongly_typed_config_values_are_named(tiny_folder, key, value, message):
    # A hand-edited config.json: one line naming the file and key, not a flax shape error,
    # a ZeroDivisionError or Python's string formatting complaint.
    cfg = json.loads((tiny_folder / "config.json").read_text())
    cfg[key] = value
    (tiny_folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        jaxsim.load_pretrained(tiny_folder)
    assert str(err.value) == f"{tiny_folder / 'config.json'}: {message}"


def test_hub_id_fails_clearly_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="(?s)hub failed.*Offline, pass the path"):
        jaxsim.load_pretrained("someone/not-cached-model")


def test_missing_relative_model_folder_is_not_a_hub_request(tmp_path, monkeypatch):
    """`--model runs/sup` next to an existing runs/ is a missing folder, not a hub id."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(ModelLoadError, match="^runs/sup: no such model folder$"):
        jaxsim.load_pretrained("runs/sup")
    with pytest.raises(ModelLoadError, match="no such model folder"):
        jaxsim.load_pretrained("./sup")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    (tmp_path / "in.txt").write_text("hello\n")
    proc = subprocess.run([sys.executable, "-m", "jaxsim", "encode", "--model", "runs/sup",
                           "--input", "in.txt", "--output", "out.npy"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 1 and proc.stderr == "error: runs/sup: no such model folder\n"


def test_corrupt_safetensors_is_named(tiny_folder):
    weights = tiny_folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=f"{weights}: unreadable safetensors file"):
        jaxsim.load_pretrained(tiny_folder)
    weights.write_bytes(b"\x00" * 7)
    with pytest.raises(ModelLoadError, match="unreadable safetensors file"):
        jaxsim.load_pretrained(tiny_folder)


def test_pytorch_bin_checkpoint(tiny_model_dir):
    import torch
    folder, torch_model = tiny_model_dir("roberta")
    (folder / "model.safetensors").unlink()
    torch.save(torch_model.state_dict(), folder / "pytorch_model.bin")
    model = jaxsim.load_pretrained(folder)
    assert model.config.model_type == "roberta" and model.config.pad_token_id == 1
    # The weights are the .bin's: vectors equal the PyTorch model's masked mean.
    import transformers
    sentences = ["a man plays a guitar .", "two dogs run across a wide green field together"]
    batch = transformers.AutoTokenizer.from_pretrained(str(folder))(
        sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = torch_model(input_ids=batch["input_ids"],
                             attention_mask=batch["attention_mask"]).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    want = ((hidden * mask).sum(1) / mask.sum(1)).numpy()
    got = jaxsim.encode(model, sentences, pooler="avg")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_config_round_trip():
    cfg = BertConfig(vocab_size=99, hidden_size=36, num_attention_heads=3, model_type="roberta",
                     pad_token_id=1)
    assert BertConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert cfg.max_length == cfg.max_position_embeddings - 2
    with pytest.raises(ConfigError, match="not divisible"):
        BertConfig(vocab_size=9, hidden_size=10, num_attention_heads=3)


def test_declared_pooler_of_an_export(tiny_folder):
    (tiny_folder / "jaxsim_export.json").write_text(json.dumps({"pooler": "avg_first_last"}))
    assert jaxsim.load_pretrained(tiny_folder).pooler == "avg_first_last"
    (tiny_folder / "jaxsim_export.json").write_text(
        json.dumps({"pooler": "cls", "post": {"kind": "whitening"}}))
    # What follows the pooler is applied from modules.json (tests/formats/st_folder_test.py); a
    # folder without one has nothing after the pooler.
    assert jaxsim.load_pretrained(tiny_folder).head == ()
    (tiny_folder / "jaxsim_export.json").write_text(
        json.dumps({"pooler": "cls", "mlp_only_train": True}))
    model = jaxsim.load_pretrained(tiny_folder)
    assert model.pooler == "cls" and model.encoder.mlp_only_train
    assert not jaxsim.load_pretrained(tiny_folder, pooler="avg").encoder.mlp_only_train


# ------------------------------------------------------------------ SentenceModel, workdirs
@pytest.fixture(scope="module")
def workdir(tmp_path_factory, bundled):
    """A tiny workdir with checkpoints at steps 3, 7 (best on dev) and 9, written once for the
    module: tests only read it (one that changes files works on its own copy)."""
    folder = tmp_path_factory.mktemp("workdir") / "run"
    saved = write_tiny_workdir(folder, bundled.tokenizer, pooler="cls", mlp_only_train=True,
                               steps=((3, 0.2), (7, 0.8), (9, 0.1)))
    return folder, saved


def test_workdir_loads_its_checkpoints(workdir):
    folder, saved = workdir
    model = jaxsim.load_pretrained(folder)
    assert model.pooler == "cls" and model.encoder.mlp_only_train and model.max_seq_length == 64
    assert jaxsim_tree_equal(model.params, saved[7])  # best by the dev metric
    assert jaxsim_tree_equal(jaxsim.load_pretrained(folder, which="latest").params, saved[9])
    assert jaxsim_tree_equal(jaxsim.load_pretrained(folder, which=3).params, saved[3])
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 4 \(have \[3, 7, 9\]\)"):
        jaxsim.load_pretrained(folder, which=4)


def test_with_pooler(workdir, tiny_model_dir):
    folder, _ = workdir
    model = jaxsim.load_pretrained(folder)
    ids = model.tokenizer(["a red house", "two dogs"], padding=True, return_tensors="np")
    raw = model.encoder.apply({"params": model.params}, ids["input_ids"],
                              ids["attention_mask"])
    same = model.with_pooler("cls")
    assert same is model  # its own pooler: unchanged, mlp_only_train kept
    before = model.with_pooler("cls_before_pooler")
    np.testing.assert_allclose(
        before.encoder.apply({"params": before.params}, ids["input_ids"], ids["attention_mask"]),
        raw, atol=1e-6)  # mlp_only_train: evaluation uses the raw [CLS]
    # Another pooler: mlp_only_train concerns the training pooler only, so 'cls' via a
    # detour applies the head; the head's weights ride along under 'pooler'.
    head = model.with_pooler("avg").with_pooler("cls")
    assert not head.encoder.mlp_only_train and "pooler" in head.params
    dense = model.params["pooler"]["dense"]
    np.testing.assert_allclose(
        head.encoder.apply({"params": head.params}, ids["input_ids"], ids["attention_mask"]),
        np.tanh(np.asarray(raw) @ np.asarray(dense["kernel"]) + np.asarray(dense["bias"])),
        atol=1e-5)
    with pytest.raises(PoolerError, match="unknown pooler 'max'"):
        model.with_pooler("max")
    # A model shipped without BERT's pooler layer has no 'cls' head to use.
    bare_folder, _ = tiny_model_dir("bert", add_pooler=False)
    bare = jaxsim.load_pretrained(bare_folder)
    assert not bare.has_pooler_weights
    with pytest.raises(PoolerError, match="needs parameters this model does not have"):
        bare.with_pooler("cls")
    assert bare.with_pooler("cls_before_pooler").pooler == "cls_before_pooler"


def test_workdir_errors_name_the_file(workdir, tmp_path):
    folder = shutil.copytree(workdir[0], tmp_path / "run")  # the files below are broken
    (folder / "model.json").write_text('{"format": "jaxsim-sentence-encoder",\n "config": }')
    with pytest.raises(WorkdirError, match=r"model.json:2: malformed JSON"):
        jaxsim.load_pretrained(folder)
    (folder / "model.json").unlink()
    with pytest.raises(WorkdirError, match=r"model.json: model record not found"):
        jaxsim.load_pretrained(folder)


@pytest.mark.parametrize("edit, message", [
    (lambda r: r["config"].update(hidden_size="36"), "hidden_size: expected int >= 1, got '36'"),
    (lambda r: r.update(max_seq_length="x"), "max_seq_length: expected int >= 2, got 'x'"),
    (lambda r: r.update(pooler="nope"), "unknown pooler 'nope'"),
])
def test_workdir_model_record_values_name_the_file(workdir, tmp_path, edit, message):
    folder = shutil.copytree(workdir[0], tmp_path / "run")
    record = json.loads((folder / "model.json").read_text())
    edit(record)
    (folder / "model.json").write_text(json.dumps(record))
    with pytest.raises(WorkdirError) as err:
        jaxsim.load_pretrained(folder)
    assert str(err.value).startswith(f"{folder / 'model.json'}: {message}")


def test_workdir_without_checkpoints_says_so(workdir, tmp_path):
    # A run with checkpoint=False (or stopped before its first save): its config.json is the
    # train config, not a Hugging Face one, so the HF reader's complaint would mislead.
    folder = shutil.copytree(workdir[0], tmp_path / "run")
    shutil.copy(folder / "model.json", folder / "config.json")  # any non-HF JSON
    shutil.rmtree(folder / "checkpoints")
    with pytest.raises(WorkdirError, match=r"run/checkpoints: not found: this train workdir "
                                           r"holds no checkpoint"):
        jaxsim.load_pretrained(folder)
