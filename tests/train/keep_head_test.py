"""Training from a sentence-transformers folder keeps its head (Dense, Normalize): applied in
training (Dense trained), in the checkpoints, in `load_pretrained(workdir)` and in exports;
`keep_head=False` drops it."""
import json

import jax
import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as st_models

import jaxsim
from jaxsim.export import export_model
from jaxsim.formats.checkpoint import Checkpointer
from jaxsim.models import st_head
from jaxsim.train import loop
from jaxsim.train.config import TrainConfig, base_config
from jaxsim.train.step import configure_jax
from tests.conftest import write_snli_corpus, write_tiny_model

configure_jax()
SENTENCES = ["A man is playing a guitar.", "hello", "Two dogs run through a snowy field."]


@pytest.fixture(scope='module')
def st_folder(tmp_path_factory):
    """Transformer -> Pooling(mean) -> Dense(36 -> 12, tanh) -> Normalize, saved by
    sentence-transformers itself."""
    root = tmp_path_factory.mktemp('st')
    write_tiny_model(root / 'base', 'bert')
    torch.manual_seed(1)
    word = st_models.Transformer(str(root / 'base'), max_seq_length=32)
    dim = word.get_embedding_dimension()
    dense = st_models.Dense(dim, 12, activation_function=torch.nn.Tanh())
    SentenceTransformer(modules=[word, st_models.Pooling(dim, 'mean'), dense,
                                 st_models.Normalize()], device='cpu').save(str(root / 'model'))
    return root / 'model'


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp('data') / 'corpus.txt'
    write_snli_corpus(path, 32)
    return path


def _cfg(st_folder, corpus, **kw) -> TrainConfig:
    fields = base_config().to_dict()
    fields.update({'model': str(st_folder), 'pooler': 'avg', 'mlp_only_train': False,
                   'dropout': 0.1, 'objective': 'unsup', 'objective_kwargs': {'temp': 0.05},
                   'train_file': str(corpus), 'data_format': 'text', 'max_len': 16,
                   'batch_size': 8, 'max_steps': 2, 'learning_rate': 1e-2, 'senteval_root': '',
                   'eval_every': 0, 'log_every': 1, 'fast_compile': True, **kw})
    return TrainConfig.from_dict(fields)


def test_the_head_is_trained_checkpointed_loaded_and_exported(st_folder, corpus, tmp_path):
    base = jaxsim.load_pretrained(st_folder)
    assert [type(m).__name__ for m in base.head] == ['Dense', 'Normalize']
    w = tmp_path / 'run'
    loop.train_and_evaluate(_cfg(st_folder, corpus), w, progress=False)
    assert json.loads((w / 'model.json').read_text())['head'] == [
        {'type': 'Dense', 'in_features': 36, 'out_features': 12, 'bias': True,
         'activation': 'torch.nn.modules.activation.Tanh'}, {'type': 'Normalize'}]
    with Checkpointer(w / 'checkpoints', read_only=True) as ck:
        saved = jax.tree.map(np.asarray, ck.restore(2).state['params'])
    trained = saved[st_head.HEAD_KEY]['0']
    assert trained['weight'].shape == (12, 36)
    assert not np.allclose(trained['weight'], base.head[0].weight)  # trained with the encoder

    model = jaxsim.load_pretrained(w)
    assert st_head.HEAD_KEY not in model.params
    assert [type(m).__name__ for m in model.head] == ['Dense', 'Normalize']
    np.testing.assert_array_equal(model.head[0].weight, trained['weight'])
    got = jaxsim.encode(model, SENTENCES)
    assert got.shape == (3, 12)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)

    folder = export_model(model, tmp_path / 'export', 'sentence-transformers')
    kinds = [m['type'] for m in json.loads((folder / 'modules.json').read_text())]
    assert kinds[-2:] == ['sentence_transformers.models.Dense',
                          'sentence_transformers.models.Normalize']
    ours = SentenceTransformer(str(folder), device='cpu').encode(SENTENCES)
    np.testing.assert_allclose(ours, got, atol=1e-5)
    np.testing.assert_allclose(jaxsim.encode(jaxsim.load_pretrained(folder), SENTENCES), got,
                               atol=1e-5)


def test_keep_head_false_trains_the_encoder_alone(st_folder, corpus, tmp_path):
    w = tmp_path / 'run'
    loop.train_and_evaluate(_cfg(st_folder, corpus, keep_head=False), w, progress=False)
    assert 'head' not in json.loads((w / 'model.json').read_text())
    model = jaxsim.load_pretrained(w)
    assert model.head == ()
    got = jaxsim.encode(model, SENTENCES)
    assert got.shape == (3, 36)
    assert not np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-3)
