"""Tokenizers load as AutoTokenizer loads them, without importing torch for BERT/RoBERTa."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from jaxsim.errors import Interrupted
from jaxsim.formats.hf_folder import ModelLoadError, bundled_model_path, load_tokenizer

TEXTS = ["Hello world, this is a Test!", "naïve café déjà vu", "a " * 60, ""]
ROOT = Path(__file__).resolve().parents[2]


def _same_as_auto(folder: Path):
    ours = load_tokenizer(folder)
    auto = AutoTokenizer.from_pretrained(str(folder), use_fast=True)
    assert type(ours) is type(auto)
    for kw in ({}, {"max_length": 16, "truncation": True, "padding": "max_length"},
               {"text_pair": TEXTS[::-1], "max_length": 24, "truncation": True}):
        assert ours(TEXTS, **kw) == auto(TEXTS, **kw), kw
    assert (ours.pad_token_id, ours.mask_token_id, ours.all_special_ids, len(ours),
            ours.model_input_names, ours.model_max_length) == (
        auto.pad_token_id, auto.mask_token_id, auto.all_special_ids, len(auto),
        auto.model_input_names, auto.model_max_length)
    return ours


def test_declared_class_loads_as_auto_tokenizer_does(tiny_model_dir, tmp_path):
    _same_as_auto(bundled_model_path())
    roberta, _ = tiny_model_dir("roberta")  # RoBERTa config, BERT tokenizer files
    _same_as_auto(roberta)
    saved = tmp_path / "saved"  # as a train workdir keeps it
    load_tokenizer(bundled_model_path()).save_pretrained(str(saved))
    _same_as_auto(saved)


def test_undeclared_class_is_left_to_auto_tokenizer(tmp_path):
    folder = tmp_path / "plain"
    shutil.copytree(bundled_model_path(), folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["tokenizer_class"]
    config_file.write_text(json.dumps(config))
    _same_as_auto(folder)


def test_a_folder_without_vocabulary_is_an_error(tmp_path):
    # transformers would build a 5-token tokenizer (everything [UNK]) from the config alone.
    folder = tmp_path / "novocab"
    shutil.copytree(bundled_model_path(), folder)
    for name in ("tokenizer.json", "vocab.txt"):
        (folder / name).unlink()
    with pytest.raises(ModelLoadError, match=r"novocab: no tokenizer vocabulary \(looked for "
                                             r"tokenizer.json, vocab.txt, vocab.json\)"):
        load_tokenizer(folder)


def test_an_interrupt_while_loading_is_not_a_load_error(monkeypatch):
    # A SIGTERM during start-up arrives while the tokenizer loads: wrapped as a load error it
    # would exit 1 with "cannot load a tokenizer" instead of 143.
    def interrupted(*args, **kwargs):
        raise Interrupted(signal.SIGTERM)

    for cls in ("BertTokenizer", "BertTokenizerFast"):
        monkeypatch.setattr(f"transformers.{cls}.from_pretrained", interrupted)
    with pytest.raises(Interrupted) as caught:
        load_tokenizer(bundled_model_path())
    assert caught.value.exit_code == 143


def test_loading_the_bundled_model_does_not_import_torch():
    code = ("import sys, jaxsim; jaxsim.load_pretrained('bundled'); "
            "print(sorted(m for m in ('torch', 'tensorflow') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, cwd=ROOT).stdout
    assert out.strip().splitlines()[-1] == "[]", out
