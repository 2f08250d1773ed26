"""sentence-transformers folders load as they encode: `jaxsim.load_pretrained(folder)` applies
the folder's Pooling, Dense and Normalize modules, so `jaxsim.encode` equals
`SentenceTransformer(folder).encode` within 1e-5 (jaxsim's own exports with every pooler and a
whitening Dense, a folder sentence-transformers wrote itself, and the bundled model)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as st_models

import jaxsim
from jaxsim import calibrate
from jaxsim.io import export as export_lib
from jaxsim.io.hf_folder import ModelLoadError
from jaxsim.models import st_head
from jaxsim.models.poolers import BUILTIN_POOLERS
from tests.conftest import write_tiny_model
from tests.io.export_test import SENTENCES, _corpus

ATOL = 1e-5


def st_encode(folder, sentences=SENTENCES):
    return SentenceTransformer(str(folder), device="cpu").encode(sentences)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    models = {}
    for model_type in ("bert", "roberta"):
        folder = tmp_path_factory.mktemp(f"tiny-{model_type}")
        write_tiny_model(folder, model_type)
        models[model_type] = jaxsim.load_pretrained(folder)
    return models


def test_bundled_model_encodes_as_sentence_transformers(bundled):
    assert isinstance(bundled.head[-1], st_head.Normalize)  # its modules.json ends so
    got = jaxsim.encode(bundled, SENTENCES)
    np.testing.assert_allclose(got, st_encode(jaxsim.bundled_model_path()), atol=ATOL)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


@pytest.mark.parametrize("pooler", BUILTIN_POOLERS)
def test_jaxsim_exports_load_as_they_encode(tiny, tmp_path, pooler):
    """Every pooler, plain and with a whitening Dense + Normalize: the loaded export gives
    sentence-transformers' vectors, and re-exporting it keeps them."""
    index = BUILTIN_POOLERS.index(pooler)
    model = tiny["bert" if index % 2 == 0 else "roberta"].with_pooler(pooler)
    plain = export_lib.export_model(model, tmp_path / "plain", "sentence-transformers",
                                    max_length=64)
    loaded = jaxsim.load_pretrained(plain)
    assert loaded.pooler == pooler and loaded.head == ()
    np.testing.assert_allclose(jaxsim.encode(loaded, SENTENCES), st_encode(plain), atol=ATOL)

    whitening = calibrate.fit("whitening:20", jaxsim.encode(model, _corpus(80), max_length=64))
    white = export_lib.export_model(model, tmp_path / "white", "sentence-transformers",
                                    calibration=whitening, normalize=True, max_length=64)
    loaded = jaxsim.load_pretrained(white)
    assert [type(m).__name__ for m in loaded.head] == ["Dense", "Normalize"]
    got = jaxsim.encode(loaded, SENTENCES)
    assert got.shape == (len(SENTENCES), 20)
    np.testing.assert_allclose(got, st_encode(white), atol=ATOL, err_msg=pooler)
    # Exported again, the head goes along (no second Normalize).
    again = export_lib.export_model(loaded, tmp_path / "again", "sentence-transformers")
    kinds = [m["type"].rsplit(".", 1)[-1]
             for m in json.loads((again / "modules.json").read_text())]
    assert kinds[-2:] == ["Dense", "Normalize"] and kinds.count("Normalize") == 1
    np.testing.assert_allclose(st_encode(again), got, atol=ATOL)
    with pytest.raises(export_lib.ExportError, match="Dense module after pooling"):
        export_lib.export_model(loaded, tmp_path / "hf", "hf")


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
