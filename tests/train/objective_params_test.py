"""Parameters an objective owns: SimCSE's learnable temperature (`learn_temperature=True`).

It is trained by the run's optimizer (its gradient is the loss's, through the one-pass and the
cached-gradient steps), checkpointed and restored bit for bit on resume, and no part of the
model a workdir loads as or of any export. A run whose objective owns nothing keeps the
encoder's tree exactly.
"""
import functools
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import jaxsim
from jaxsim import sharding
from jaxsim.export import export_model
from jaxsim.formats.checkpoint import Checkpointer
from jaxsim.models.bert import BertConfig
from jaxsim.models.encoder import SentenceEncoder, init_params
from jaxsim.objectives import ObjectiveError, check_kwargs, get_objective, owned
from jaxsim.train import loop
from jaxsim.train.config import TrainConfig
from jaxsim.train.grad_cache import make_cached_grad_fn
from jaxsim.train.step import configure_jax, encode_views, make_loss_fn
from tests.conftest import tiny_run_config, write_snli_corpus

configure_jax()

CONFIG = BertConfig(vocab_size=80, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=24, max_position_embeddings=24, hidden_dropout_prob=0.1,
                    attention_probs_dropout_prob=0.1)


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp('data') / 'corpus.txt'
    write_snli_corpus(path, 64)
    return path


def _cfg(corpus, **kw) -> TrainConfig:
    return tiny_run_config(corpus, **{'max_steps': 4, 'checkpoint_every': 2,
                                      'learning_rate': 1e-2, **kw})


def _rows(workdir: Path) -> list[dict]:
    return [json.loads(x) for x in (workdir / 'metrics.jsonl').read_text().splitlines()]


def _state(workdir: Path, step: int):
    with Checkpointer(workdir / 'checkpoints', read_only=True) as ck:
        return jax.tree.map(np.asarray, ck.restore(step).state)


def _batch(sentences: int, batch: int = 8, length: int = 10) -> dict:
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, length + 1, (batch, sentences))
    mask = (np.arange(length) < lengths[..., None]).astype(np.int32)
    ids = rng.integers(5, 80, (batch, sentences, length)).astype(np.int32) * mask
    return {'input_ids': ids, 'attention_mask': mask, 'token_type_ids': np.zeros_like(ids)}


@pytest.mark.parametrize('name', ['unsup', 'sup'])
def test_the_temperature_gradient_is_the_loss_gradient(name):
    objective = get_objective(name)
    kwargs = check_kwargs(objective, {'temp': 0.07, 'learn_temperature': True})
    mine = owned.init_owned(objective, kwargs, jax.random.key(0))
    assert set(mine) == {'log_temp'} and float(mine['log_temp']) == pytest.approx(np.log(0.07))
    encoder = SentenceEncoder(CONFIG, pooler='cls')
    params = owned.join(init_params(encoder, jax.random.key(0)), mine)
    loss = functools.partial(objective.loss, **kwargs)
    loss_fn = make_loss_fn(encoder, loss, objective.views)
    batch, key = _batch(1 if name == 'unsup' else 3), jax.random.key(3)
    (value, aux), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch, key)
    assert float(aux['temp']) == pytest.approx(0.07, rel=1e-6)
    g = float(grads[owned.KEY]['log_temp'])

    # jax.grad of the objective alone, on the same vectors, with respect to the log-temperature.
    z = encode_views(encoder, owned.encoder_params(params), batch, key, objective.views)
    direct = jax.grad(lambda t: loss(z, ids=batch['input_ids'],
                                     params={'log_temp': t})[0])(mine['log_temp'])
    assert g == pytest.approx(float(direct), rel=1e-5)
    # ... and a central difference of the whole loss (float64 on the vectors' side is not
    # needed: the loss is smooth in the temperature, a step of 1e-2 has error ~1e-4 relative).
    def at(t):
        return float(loss_fn(owned.join(owned.encoder_params(params), {'log_temp': t}),
                             batch, key)[0])
    eps = 1e-2
    numeric = (at(mine['log_temp'] + eps) - at(mine['log_temp'] - eps)) / (2 * eps)
    assert g == pytest.approx(numeric, rel=2e-3) and abs(g) > 1e-3

    # The cached-gradient step (micro-batches of 2) gives the same gradient, temperature
    # included.
    mesh = sharding.make_mesh(1, 1, 1)
    cached = jax.jit(make_cached_grad_fn(encoder, loss, views=objective.views, micro_batch_size=2,
                                         mesh=mesh, encode_views=encode_views))
    (value2, aux2), grads2 = cached(params, batch, key)
    assert float(value2) == pytest.approx(float(value), rel=1e-5)
    assert set(grads2) == set(grads)
    assert float(grads2[owned.KEY]['log_temp']) == pytest.approx(g, rel=1e-4)


def test_learn_temperature_is_checked_before_the_run():
    with pytest.raises(ObjectiveError, match='learn_temperature must be true or false'):
        check_kwargs(get_objective('unsup'), {'learn_temperature': 1})
    # Without learn_temperature the objective owns nothing.
    assert owned.init_owned(get_objective('sup'), {'temp': 0.05}, jax.random.key(0)) == {}


def test_learned_temperature_trains_resumes_exactly_and_stays_out_of_exports(corpus, tmp_path):
    a = tmp_path / 'a'
    cfg = _cfg(corpus, objective_kwargs={'temp': 0.05, 'learn_temperature': True})
    r = loop.train_and_evaluate(cfg, a, progress=False)
    assert r.steps == 4
    rows = [m for m in _rows(a) if 'loss' in m]
    temps = [m['temp'] for m in rows]  # the temperature each step's loss used
    assert temps[0] == pytest.approx(0.05, rel=1e-6)
    assert all(abs(t - 0.05) > 1e-4 for t in temps[1:]) and len(set(temps)) == 4
    state = _state(a, 4)
    log_temp = state['params'][owned.KEY]['log_temp']
    assert float(np.exp(log_temp)) != pytest.approx(temps[-1], rel=1e-7)  # updated after it
    # Adam's moments cover it: the optimizer trains it with the encoder.
    mu = jax.tree_util.tree_flatten_with_path(state['opt_state'])[0]
    assert any('log_temp' in jax.tree_util.keystr(path) for path, _ in mu)

    # Exact resume: from the checkpoint of step 2, the same metrics and the same bits.
    b = tmp_path / 'b'
    shutil.copytree(a, b)
    shutil.rmtree(b / 'checkpoints' / '4')
    (b / 'result.json').unlink()
    loop.train_and_evaluate(cfg, b, progress=False)
    assert (b / 'metrics.jsonl').read_text() == (a / 'metrics.jsonl').read_text()
    resumed = _state(b, 4)
    assert resumed['params'][owned.KEY]['log_temp'].tobytes() == log_temp.tobytes()
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(x, y)

    # The workdir as a model, and its exports: the encoder only.
    model = jaxsim.load_pretrained(a)
    assert owned.KEY not in model.params
    assert set(model.params) == set(state['params']) - {owned.KEY}
    for fmt in ('hf', 'sentence-transformers'):
        folder = export_model(model, tmp_path / f'export-{fmt}', fmt)
        names = [k for f in folder.rglob('*.safetensors') for k in load_file(str(f))]
        assert names and not any('temp' in k or owned.KEY in k for k in names)
        text = ' '.join(p.read_text() for p in folder.rglob('*.json'))
        assert 'log_temp' not in text
        np.testing.assert_allclose(jaxsim.encode(jaxsim.load_pretrained(folder), ['a cat']),
                                   jaxsim.encode(model, ['a cat']), atol=1e-5)


def test_a_run_whose_objective_owns_nothing_keeps_the_encoder_tree(corpus, tmp_path):
    cfg = _cfg(corpus, max_steps=2, objective_kwargs={'temp': 0.05})
    loop.train_and_evaluate(cfg, tmp_path / 'w', progress=False)
    state = _state(tmp_path / 'w', 2)
    assert owned.KEY not in state['params']
    assert 'temp' not in _rows(tmp_path / 'w')[-1]
    # learn_temperature starts from the same temperature: the same first loss, to rounding
    # (exp(log(0.05)) is 0.05 to float32 rounding).
    learned = _cfg(corpus, max_steps=1, checkpoint=False,
                   objective_kwargs={'temp': 0.05, 'learn_temperature': True})
    loop.train_and_evaluate(learned, tmp_path / 'l', progress=False)
    assert _rows(tmp_path / 'l')[0]['loss'] == pytest.approx(_rows(tmp_path / 'w')[0]['loss'],
                                                             rel=1e-5)
