"""The SimCSE authors' own tool (`simcse==0.4`, `from simcse import SimCSE`) loads a jaxsim
SimCSE run exported with `--format hf` and gives jaxsim's vectors (within 1e-4).

Two tiny runs of 2 training steps each (unsupervised SimCSE, 'cls' pooler):
  - the head kept at evaluation: the tool's pooler="cls" (BERT's pooler_output) reads it;
  - mlp_only_train (the paper's unsupervised recipe): the tool's pooler="cls_before_pooler".
"""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest

import jaxsim
from jaxsim.cli.main import main as cli_main
from jaxsim.train import loop
from jaxsim.train.step import configure_jax
from tests.conftest import tiny_run_config, write_snli_corpus

SENTENCES = ["A man is playing a guitar.", "hello", "Two dogs run through a snowy field.",
             "The quick brown fox jumps over the lazy dog near the river bank today.", ""]
MAX_LENGTH = 32  # the runs' token limit (eval_max_len)


@pytest.fixture(scope="module")
def simcse_tool():
    """The tool's class. Its module calls logging.basicConfig(level=INFO) on import: the root
    logger is put back as it was."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    from simcse import SimCSE
    root.setLevel(level)
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
    return SimCSE


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    write_snli_corpus(path, 64)
    return path


def _train(corpus, workdir, mlp_only_train: bool):
    configure_jax()
    cfg = tiny_run_config(corpus, max_steps=2, checkpoint_every=2,
                          mlp_only_train=mlp_only_train, eval_max_len=MAX_LENGTH)
    result = loop.train_and_evaluate(cfg, workdir, progress=False)
    assert result.steps == 2
    return jaxsim.load_pretrained(workdir)


@pytest.mark.parametrize("mlp_only_train,tool_pooler", [(False, "cls"),
                                                        (True, "cls_before_pooler")])
def test_official_simcse_tool_loads_the_export(simcse_tool, corpus, tmp_path, mlp_only_train,
                                               tool_pooler):
    model = _train(corpus, tmp_path / "run", mlp_only_train)
    assert model.pooler == "cls" and model.encoder.mlp_only_train == mlp_only_train
    want = jaxsim.encode(model, SENTENCES, max_length=MAX_LENGTH)

    out = tmp_path / "export"
    assert cli_main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out),
                     "--format", "hf"]) == 0
    record = json.loads((out / "jaxsim_export.json").read_text())
    assert record["pooler"] == "cls" and record["mlp_only_train"] == mlp_only_train

    tool = simcse_tool(str(out), device="cpu", pooler=tool_pooler)
    got = tool.encode(SENTENCES, return_numpy=True, normalize_to_unit=False,
                      max_length=MAX_LENGTH)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-4)
    # Its default (unit vectors) is jaxsim's normalize=True.
    unit = tool.encode(SENTENCES[:2], return_numpy=True, max_length=MAX_LENGTH)
    np.testing.assert_allclose(unit, jaxsim.encode(model, SENTENCES[:2], normalize=True,
                                                   max_length=MAX_LENGTH), atol=1e-4)
    # The other pooler of the tool really is different: the test can tell them apart.
    other = simcse_tool(str(out), device="cpu",
                        pooler="cls" if tool_pooler != "cls" else "cls_before_pooler")
    assert np.abs(other.encode(SENTENCES, return_numpy=True, normalize_to_unit=False,
                               max_length=MAX_LENGTH) - want).max() > 1e-2
    # jaxsim reads the export back as the same model (the record keeps mlp_only_train).
    again = jaxsim.load_pretrained(out)
    assert again.encoder.mlp_only_train == mlp_only_train
    np.testing.assert_allclose(jaxsim.encode(again, SENTENCES, max_length=MAX_LENGTH), want,
                               atol=1e-6)

    # The same run as a sentence-transformers folder: the head is a Dense(Tanh) module only
    # when evaluation applies it.
    from sentence_transformers import SentenceTransformer
    st = tmp_path / "st"
    assert cli_main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(st),
                     "--format", "sentence-transformers"]) == 0
    modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((st / "modules.json").read_text())]
    assert modules == ["Transformer", "Pooling"] + ["Dense"] * (not mlp_only_train)
    np.testing.assert_allclose(SentenceTransformer(str(st), device="cpu").encode(SENTENCES),
                               want, atol=1e-4)
