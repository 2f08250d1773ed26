"""jaxsim.functional: the pure pieces equal what the commands use (encode's head, train.py's
keys, optimizer and config)."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsim
from jaxsim import functional as F
from jaxsim.errors import ConfigError
from jaxsim.formats.hf_folder import bundled_model_path, load_tokenizer
from jaxsim.models import st_head
from jaxsim.models.bert import BertConfig
from jaxsim.models.encoder import SentenceEncoder, init_params
from jaxsim.models.st_head import ACTIVATIONS, Dense, HeadError, Normalize
from jaxsim.objectives import get_objective
from jaxsim.sharding import make_mesh
from jaxsim.train import build, optim
from tests.conftest import TINY_CONFIG

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / 'configs' / 'tiny_unsup_simcse.py'
SENTENCES = ['a man plays a guitar .', 'a dog runs in the park .', 'two women talk .']


@pytest.fixture(scope='module')
def tokenizer():
    return load_tokenizer(bundled_model_path())


def _model(tokenizer, head=(), pooler='avg'):
    config = BertConfig(vocab_size=len(tokenizer), **TINY_CONFIG)
    encoder = SentenceEncoder(config, pooler=pooler)
    return jaxsim.SentenceModel(encoder=encoder, params=init_params(encoder, jax.random.key(3)),
                                tokenizer=tokenizer, max_seq_length=32, head=tuple(head))


def test_jax_activations_equal_the_numpy_head():
    x = np.linspace(-4, 4, 41, dtype=np.float32).reshape(1, -1)
    for name, numpy_fn in ACTIVATIONS.items():
        np.testing.assert_allclose(np.asarray(st_head.jax_activation(name)(jnp.asarray(x))),
                                   numpy_fn(x), rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize('activation', ['torch.nn.modules.activation.Tanh',
                                        'torch.nn.modules.activation.GELU'])
def test_embed_fn_applies_the_sentence_transformers_head_as_encode_does(tokenizer, activation):
    rng = np.random.default_rng(0)
    head = (Dense(rng.normal(size=(20, 36)).astype(np.float32),
                  rng.normal(size=20).astype(np.float32), activation),
            Dense(rng.normal(size=(12, 20)).astype(np.float32), None,
                  'torch.nn.modules.linear.Identity'),
            Normalize())
    model = _model(tokenizer, head)
    apply, params = F.embed_fn(model)
    batch = F.tokenize(model.tokenizer, SENTENCES, max_length=32)
    got = jax.jit(apply)(params, batch.input_ids, batch.attention_mask, batch.token_type_ids)
    want = jaxsim.encode(model, SENTENCES)
    assert got.shape == want.shape == (3, 12)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)
    np.testing.assert_allclose(np.linalg.norm(np.asarray(got), axis=1), 1.0, rtol=1e-6)


def test_embed_fn_without_a_head_is_the_encoder_and_its_params(tokenizer):
    model = _model(tokenizer)
    apply, params = F.embed_fn(model)
    assert jax.tree.structure(params) == jax.tree.structure(model.params)
    batch = F.tokenize(model.tokenizer, SENTENCES, max_length=32)
    np.testing.assert_allclose(np.asarray(apply(params, batch.input_ids, batch.attention_mask)),
                               jaxsim.encode(model, SENTENCES), atol=2e-6)


def test_embed_fn_params_are_differentiable_head_included_and_key_turns_dropout_on(tokenizer):
    head = (Dense(np.eye(36, dtype=np.float32)[:8], np.zeros(8, np.float32),
                  'torch.nn.modules.activation.Tanh'),)
    apply, params = F.embed_fn(_model(tokenizer, head))
    batch = F.tokenize(tokenizer, SENTENCES, max_length=32)
    args = (batch.input_ids, batch.attention_mask, batch.token_type_ids)
    grads = jax.grad(lambda p: jnp.sum(apply(p, *args) ** 2))(params)
    assert float(jnp.abs(grads[F.HEAD_KEY]['0']['weight']).sum()) > 0
    assert float(jnp.abs(grads['bert']['embeddings']['word_embeddings']['embedding']).sum()) > 0
    a, b = (apply(params, *args, key=jax.random.key(k)) for k in (0, 1))
    assert not np.allclose(a, b)  # two dropout masks
    np.testing.assert_array_equal(apply(params, *args), apply(params, *args))


def test_embed_fn_refuses_a_head_module_it_cannot_express(tokenizer):
    with pytest.raises(HeadError, match='no JAX form'):
        F.embed_fn(_model(tokenizer, (lambda x: x,)))


def test_keys_and_objective_are_the_train_programs():
    cfg = F.load_config(TINY, train_file='unused.txt', seed=7)
    encoder = SentenceEncoder(build.architecture(cfg), pooler=cfg.pooler)
    program = build.train_program(cfg, encoder, get_objective(cfg.objective),
                                  dict(cfg.objective_kwargs), make_mesh(), 20)
    for mine, theirs in ((F.init_key(7), program.init_key),
                         (F.dropout_key(7), program.dropout_key)):
        np.testing.assert_array_equal(jax.random.key_data(mine), jax.random.key_data(theirs))
    assert not np.array_equal(jax.random.key_data(F.dropout_key(8)),
                              jax.random.key_data(program.dropout_key))
    loss, views = F.objective_loss(cfg)
    assert views == 2 and loss.keywords == {'temp': 0.05}


def test_load_config_applies_overrides_and_refuses_unknown_keys():
    cfg = F.load_config(TINY, train_file='x.txt', learning_rate=0.5)
    assert (cfg.learning_rate, cfg.train_file, cfg.max_len) == (0.5, 'x.txt', 16)
    with pytest.raises(ConfigError, match='learning_rate'):
        F.load_config(TINY, learnign_rate=1.0)


@pytest.mark.parametrize('fields', [
    dict(),
    dict(optimizer='adamw', learning_rate=1e-2, warmup_steps=3, weight_decay=0.1,
         max_grad_norm=0.5, adam_b1=0.8, adam_b2=0.99, adam_eps=1e-6),
    dict(optimizer='sgd', learning_rate=0.1, weight_decay=0.01, max_grad_norm=0.0),
])
def test_make_optimizer_from_keywords_is_the_configs_optimizer(fields):
    cfg = F.load_config(TINY, train_file='x.txt', **fields)
    params = {'dense': {'kernel': jnp.ones((3, 2)), 'bias': jnp.ones(2)},
              'LayerNorm': {'scale': jnp.ones(2)}}
    grads = jax.tree.map(lambda p: jnp.linspace(-2.0, 3.0, p.size).reshape(p.shape), params)

    def run(tx):
        state, p, out = tx.init(params), params, []
        for _ in range(5):
            updates, state = tx.update(grads, state, p)
            p = optax.apply_updates(p, updates)
            out.append(p)
        return out

    mine = run(F.make_optimizer(total_steps=10, **F.optimizer_hyperparameters(cfg)))
    theirs = run(optim.make_optimizer(cfg, 10))
    for a, b in zip(mine, theirs):
        jax.tree.map(np.testing.assert_array_equal, a, b)
    # The keywords take effect: another learning rate moves the parameters elsewhere.
    other = run(F.make_optimizer(total_steps=10, **{**F.optimizer_hyperparameters(cfg),
                                                    'learning_rate': cfg.learning_rate / 2}))
    assert not np.allclose(other[-1]['dense']['kernel'], theirs[-1]['dense']['kernel'])


def test_make_optimizer_refuses_unknown_keywords():
    with pytest.raises(TypeError, match='learnig_rate'):
        F.make_optimizer(total_steps=10, learnig_rate=1e-3)
    with pytest.raises(ValueError, match='adamw'):
        F.make_optimizer(total_steps=10, optimizer='lamb')


def test_the_package_exports_the_functional_layer():
    assert jaxsim.functional is F
    for name in F.__all__:
        assert hasattr(F, name), name


def test_the_api_pages_python_blocks_run_in_page_order(tmp_path, monkeypatch):
    """docs/api.md is read top to bottom: each block runs with what the blocks above it made
    (a block once used names that only a later block defined)."""
    from tests.conftest import write_snli_corpus
    from tests.docs_test import code_blocks

    write_snli_corpus(tmp_path / 'corpus.txt', 64)
    (tmp_path / 'configs').symlink_to(REPO / 'configs')
    monkeypatch.chdir(tmp_path)  # the page's relative paths: configs/ and corpus.txt
    blocks = [body for lang, body in code_blocks((REPO / 'docs' / 'api.md').read_text())
              if lang == 'python']
    assert len(blocks) >= 10
    namespace: dict = {}
    for i, body in enumerate(blocks):
        try:
            exec(compile(body, f'docs/api.md python block {i + 1}', 'exec'), namespace)
        except Exception as e:
            raise AssertionError(f'docs/api.md python block {i + 1}:\n{body}') from e
    assert namespace['grads']['objective']['log_temp'].shape == ()
    assert np.isfinite(float(namespace['metrics']['loss']))
