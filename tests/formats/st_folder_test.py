"""sentence-transformers folders load as they encode: `jaxsim.load_pretrained(folder)` applies
the folder's Pooling, Dense and Normalize modules, so `jaxsim.encode` equals
`SentenceTransformer(folder).encode` within 1e-5 (a folder sentence-transformers wrote itself,
and the bundled model; jaxsim's own exports with every pooler and a whitening Dense are loaded
back in export_test's parity test, which writes them)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as st_models

import jaxsim
from jaxsim.export import export_model
from jaxsim.formats.hf_folder import ModelLoadError
from jaxsim.models import st_head
from tests.conftest import write_tiny_model
from tests.export_test import SENTENCES, st_encode

ATOL = 1e-5


def test_bundled_model_encodes_as_sentence_transformers(bundled):
    assert isinstance(bundled.head[-1], st_head.Normalize)  # its modules.json ends so
    got = jaxsim.encode(bundled, SENTENCES)
    np.testing.assert_allclose(got, st_encode(jaxsim.bundled_model_path()), atol=ATOL)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


@pytest.mark.parametrize("activation", ["Tanh", "Identity", "ReLU"])
def test_folder_written_by_sentence_transformers(tmp_path, activation):
    """Transformer -> Pooling(mean) -> Dense(activation) -> Normalize, saved by
    sentence-transformers itself."""
    write_tiny_model(tmp_path / "base", "bert")
    torch.manual_seed(1)
    word = st_models.Transformer(str(tmp_path / "base"), max_seq_length=64)
    pooling = st_models.Pooling(word.get_embedding_dimension(), "mean")
    act = getattr(torch.nn, activation)()
    dense = st_models.Dense(word.get_embedding_dimension(), 12, activation_function=act)
    SentenceTransformer(modules=[word, pooling, dense, st_models.Normalize()],
                        device="cpu").save(str(tmp_path / "st"))
    model = jaxsim.load_pretrained(tmp_path / "st")
    assert model.pooler == "avg" and [type(m).__name__ for m in model.head] == [
        "Dense", "Normalize"]
    got = jaxsim.encode(model, SENTENCES)
    assert got.shape == (len(SENTENCES), 12)
    np.testing.assert_allclose(got, st_encode(tmp_path / "st"), atol=ATOL)
    # normalize=True after a head normalizes the head's output (idempotent here).
    np.testing.assert_allclose(jaxsim.encode(model, SENTENCES, normalize=True), got, atol=1e-6)


def test_modules_jaxsim_cannot_reproduce_are_refused(tmp_path):
    write_tiny_model(tmp_path / "base", "bert")
    word = st_models.Transformer(str(tmp_path / "base"), max_seq_length=64)
    dim = word.get_embedding_dimension()
    SentenceTransformer(modules=[word, st_models.Pooling(dim, "max")],
                        device="cpu").save(str(tmp_path / "max"))
    with pytest.raises(ModelLoadError, match="pooling mode max has no jaxsim pooler"):
        jaxsim.load_pretrained(tmp_path / "max")
    assert jaxsim.load_pretrained(tmp_path / "max", pooler="avg").pooler == "avg"
    SentenceTransformer(modules=[word, st_models.Pooling(dim, "mean"),
                                 st_models.LayerNorm(dim)],
                        device="cpu").save(str(tmp_path / "ln"))
    with pytest.raises(st_head.HeadError, match="LayerNorm after pooling is not supported"):
        jaxsim.load_pretrained(tmp_path / "ln")


def test_a_dense_module_prints_its_shape_not_its_weights():
    dense = st_head.Dense(np.full((12, 384), 0.5, np.float32), np.zeros(12, np.float32),
                          "torch.nn.modules.activation.Tanh")
    assert repr(dense) == ("Dense(384 -> 12, bias, activation="
                           "'torch.nn.modules.activation.Tanh')")
    assert str(st_head.Dense(np.eye(3), None, "torch.nn.modules.linear.Identity")) == \
        "Dense(3 -> 3, activation='torch.nn.modules.linear.Identity')"


def _resave(folder, insert_at, module):
    """Loads a folder in sentence-transformers, inserts a module and saves it in place (the
    stale jaxsim_export.json stays)."""
    modules = list(SentenceTransformer(str(folder), device="cpu"))
    modules.insert(insert_at, module)
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))


def test_a_resaved_export_follows_its_modules_json(tmp_path):
    """An export that sentence-transformers re-saves with a Dense added before its Normalize
    gives sentence-transformers' vectors (not the export's, which the record describes);
    modules jaxsim cannot apply, or a changed pooler, are refused naming the folder."""
    write_tiny_model(tmp_path / "base", "bert")
    model = jaxsim.load_pretrained(tmp_path / "base")
    export = tmp_path / "st"
    export_model(model, export, "sentence-transformers", normalize=True)
    torch.manual_seed(2)
    _resave(export, 2, st_models.Dense(model.hidden_size, 8))
    loaded = jaxsim.load_pretrained(export)
    assert [type(m).__name__ for m in loaded.head] == ["Dense", "Normalize"]
    got = jaxsim.encode(loaded, SENTENCES)
    assert got.shape == (len(SENTENCES), 8)
    np.testing.assert_allclose(got, st_encode(export), atol=ATOL)

    lstm = tmp_path / "lstm"
    export_model(model, lstm, "sentence-transformers")
    _resave(lstm, 1, st_models.LSTM(model.hidden_size, 6))
    with pytest.raises(st_head.HeadError, match=f"^{lstm}/modules.json: modules Transformer, "
                                                f"LSTM, Pooling do not begin with"):
        jaxsim.load_pretrained(lstm)

    after = tmp_path / "after"
    export_model(model, after, "sentence-transformers")
    _resave(after, 2, st_models.LayerNorm(model.hidden_size))
    with pytest.raises(st_head.HeadError, match=f"^{after}/modules.json: module .*LayerNorm "
                                                f"after pooling is not supported"):
        jaxsim.load_pretrained(after)

    hf = tmp_path / "hf"
    export_model(model.with_pooler("cls"), hf, "hf")
    SentenceTransformer(str(hf), device="cpu").save(str(hf))  # mean pooling, not cls
    with pytest.raises(st_head.HeadError, match=f"^{hf}/modules.json: written after jaxsim's "
                                                f"hf export"):
        jaxsim.load_pretrained(hf)
