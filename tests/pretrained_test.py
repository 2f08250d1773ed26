"""Checkpoint import: key mapping checks and clear errors for bad model folders."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxsim
from jaxsim.convert.hf_bert import CheckpointMismatchError, hf_to_params, params_to_hf
from jaxsim.models.bert import BertConfig, ConfigError
from jaxsim.pretrained import ModelLoadError


def test_bundled_model_found_and_reported(bundled):
    assert (jaxsim.bundled_model_path() / "model.safetensors").is_file()
    assert bundled.config.num_hidden_layers == 6 and bundled.config.hidden_size == 384
    assert bundled.report.has_pooler and bundled.report.ignored == ("embeddings.position_ids",)


def test_import_export_round_trip(bundled):
    tensors = load_file(str(jaxsim.bundled_model_path() / "model.safetensors"))
    exported = params_to_hf(bundled.params, bundled.config)
    assert set(exported) == set(tensors) - {"embeddings.position_ids"}
    for name, value in exported.items():
        np.testing.assert_array_equal(value, tensors[name])
    again, _ = hf_to_params(exported, bundled.config)
    assert jaxsim_tree_equal(again, bundled.params)


def jaxsim_tree_equal(a, b):
    import jax
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(x, y), a, b)))


def test_prefixed_task_checkpoint_loads(bundled):
    tensors = params_to_hf(bundled.params, bundled.config)
    prefixed = {f"bert.{k}": v for k, v in tensors.items()}
    prefixed["cls.predictions.bias"] = np.zeros(3, np.float32)
    params, report = hf_to_params(prefixed, bundled.config)
    assert report.ignored == ("cls.predictions.bias",)
    assert jaxsim_tree_equal(params, bundled.params)


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
    assert "'encoder.layer.0.intermediate.dense.weight' has shape (36, 36), expected (37, 36)" in msg
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


def test_hub_id_fails_clearly_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="(?s)hub failed.*Offline, pass the path"):
        jaxsim.load_pretrained("someone/not-cached-model")


def test_pytorch_bin_checkpoint(tiny_model_dir):
    import torch
    folder, torch_model = tiny_model_dir("roberta")
    (folder / "model.safetensors").unlink()
    torch.save(torch_model.state_dict(), folder / "pytorch_model.bin")
    model = jaxsim.load_pretrained(folder)
    assert model.config.model_type == "roberta" and model.config.pad_token_id == 1


def test_config_round_trip():
    cfg = BertConfig(vocab_size=99, hidden_size=36, num_attention_heads=3, model_type="roberta",
                     pad_token_id=1)
    assert BertConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert cfg.max_length == cfg.max_position_embeddings - 2
    with pytest.raises(ConfigError, match="not divisible"):
        BertConfig(vocab_size=9, hidden_size=10, num_attention_heads=3)


def test_declared_pooler_of_an_export(tiny_folder):
    (tiny_folder / "jaxsim_export.json").write_text(json.dumps({"pooler": "avg_first_last"}))
    assert jaxsim.load_pretrained(tiny_folder).default_pooler == "avg_first_last"
    (tiny_folder / "jaxsim_export.json").write_text(
        json.dumps({"pooler": "cls", "post": {"kind": "whitening"}}))
    with pytest.warns(UserWarning, match="whitening module after pooling"):
        assert jaxsim.load_pretrained(tiny_folder).default_pooler == "cls"
