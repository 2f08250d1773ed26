"""The train step: views from one sentence, the head in training, gradient accumulation with
any aux, the data-parallel gradient divisor, the non-finite guard, the lr schedule."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxsim import sharding
from jaxsim.errors import ConfigError
from jaxsim.models.bert import BertConfig
from jaxsim.models.encoder import SentenceEncoder, init_params
from jaxsim.objectives import get_objective, register_objective
from jaxsim.objectives.mlm import MlmSettings
from jaxsim.train.build import batch_split
from jaxsim.train.config import TrainConfig
from jaxsim.train.optim import make_optimizer, make_schedule
from jaxsim.train.state import create_state
from jaxsim.train.step import (
    BatchSplit,
    CompileTarget,
    LossSpec,
    UpdateSpec,
    compiler_options,
    configure_jax,
    encode_views,
    make_loss_fn,
    make_train_step,
)

configure_jax()
O0 = compiler_options(True)


def _jit(f):
    return jax.jit(f, compiler_options=O0)


def _encoder(dropout, pooler='cls', mlp_only_train=True):
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=24, max_position_embeddings=16,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return SentenceEncoder(config, pooler=pooler, mlp_only_train=mlp_only_train)


def _batch(b=6, views=1, seed=0):
    ids = np.random.default_rng(seed).integers(3, 50, size=(b, views, 9)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[..., 7:] = 0
    return {'input_ids': ids, 'attention_mask': mask, 'token_type_ids': np.zeros_like(ids)}


def test_one_sentence_gives_two_dropout_views_and_the_head_in_training():
    enc0 = _encoder(0.0)
    params = init_params(enc0, jax.random.key(0))
    views = _jit(functools.partial(encode_views, enc0, views=2))
    z = np.asarray(views(params, _batch(), jax.random.key(3)))
    assert z.shape == (6, 2, 16)
    np.testing.assert_allclose(z[:, 0], z[:, 1], atol=1e-6)  # dropout off: identical views
    # Training applies the cls pooler's dense + tanh even with mlp_only_train.
    b = {k: v[:, 0] for k, v in _batch().items()}
    raw = np.asarray(_jit(enc0.apply)({'params': params}, b['input_ids'], b['attention_mask']))
    dense = params['pooler']['dense']
    np.testing.assert_allclose(z[:, 0], np.tanh(raw @ np.asarray(dense['kernel'])
                                                + np.asarray(dense['bias'])), atol=1e-5)
    enc1 = _encoder(0.1)
    z = np.asarray(_jit(functools.partial(encode_views, enc1, views=2))(
        params, _batch(), jax.random.key(3)))
    assert np.abs(z[:, 0] - z[:, 1]).max() > 1e-3  # dropout on: two masks
    loss, aux = _jit(make_loss_fn(enc1, get_objective('unsup').loss, 2))(
        params, _batch(), jax.random.key(3))
    want, _ = get_objective('unsup').loss(jnp.asarray(z))
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    assert set(aux) == {'align', 'uniform'}


def _setup(encoder, cfg, mesh=None, loss=None, views=2, accum=1, divisor=1.0):
    mesh = mesh or sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    tx = make_optimizer(cfg, 10)
    params = init_params(encoder, jax.random.key(0))
    state, shardings = create_state(params, tx, jax.random.key(1), mesh, O0)
    split = BatchSplit(mode='accumulate', grad_accum_steps=accum) if accum > 1 else BatchSplit()
    step = make_train_step(
        loss=LossSpec(encoder=encoder, objective=loss or get_objective('unsup').loss,
                      views=views),
        update=UpdateSpec(tx=tx, grad_divisor=divisor, schedule=make_schedule(cfg, 10)),
        target=CompileTarget(mesh=mesh, state_shardings=shardings, compiler_options=O0),
        split=split)
    return state, step


def _sgd(**kw):
    return TrainConfig(train_file='x', optimizer='sgd', max_grad_norm=0.0, learning_rate=0.5,
                       **kw)


def test_grad_accumulation_averages_any_aux_the_objective_returns():
    @register_objective('test_aux', views=2, from_single=True, replace=True)
    def with_aux(z, temp=0.05, offset=0.0):
        loss, _ = get_objective('unsup').loss(z, temp=temp)
        return loss + offset, {'first_row_norm': jnp.linalg.norm(z[0, 0]), 'rows': z.shape[0]
                               * jnp.ones(())}

    enc = _encoder(0.0, pooler='avg')
    loss = functools.partial(get_objective('test_aux').loss, offset=1.0)
    state, step = _setup(enc, _sgd(), loss=loss, accum=2)
    _, metrics = step(state, _batch(8))
    assert set(metrics) == {'loss', 'grad_norm', 'lr', 'first_row_norm', 'rows'}
    assert float(metrics['rows']) == 4.0  # the mean over 2 micro-batches of 4 rows
    # The loss is the mean of the micro-batch losses (rows i::2), offset included.
    fn = make_loss_fn(enc, loss, 2)
    params = init_params(enc, jax.random.key(0))
    key = jax.random.fold_in(jax.random.key(1), 0)
    micro = [float(fn(params, {k: v[i::2] for k, v in _batch(8).items()},
                      jax.random.fold_in(key, i))[0]) for i in range(2)]
    np.testing.assert_allclose(float(metrics['loss']), np.mean(micro), rtol=1e-5)


def test_replica_mean_divides_the_gradient_before_the_update():
    enc = _encoder(0.0, pooler='avg')
    state, step = _setup(enc, _sgd())
    p0 = jax.tree.map(np.asarray, state.params)
    new, m1 = step(state, _batch())
    state4, step4 = _setup(enc, _sgd(), divisor=4.0)
    new4, m4 = step4(state4, _batch())
    np.testing.assert_allclose(float(m4['grad_norm']), float(m1['grad_norm']) / 4, rtol=1e-6)
    d1 = jax.tree.leaves(jax.tree.map(lambda a, b: np.asarray(a) - b, new.params, p0))
    d4 = jax.tree.leaves(jax.tree.map(lambda a, b: np.asarray(a) - b, new4.params, p0))
    for a, b in zip(d1, d4):  # SGD: the update is lr x gradient
        np.testing.assert_allclose(b, a / 4, rtol=1e-4, atol=1e-7)


def test_non_finite_loss_leaves_the_state_unchanged():
    @register_objective('test_nan', views=2, from_single=True, replace=True)
    def nan_loss(z):
        return jnp.nan * jnp.sum(z), {}

    state, step = _setup(_encoder(0.0, pooler='avg'), _sgd(), loss=get_objective('test_nan').loss)
    before = jax.tree.map(np.asarray, state)
    new, metrics = step(state, _batch())
    assert not np.isfinite(float(metrics['loss']))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(new)):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_views_must_match_the_data():
    state, step = _setup(_encoder(0.0, pooler='avg'), _sgd(), loss=get_objective('sup').loss,
                         views=3)
    with pytest.raises(ValueError, match='batch has 2 sentences per example, the objective '
                                         'takes 3'):
        step(state, _batch(views=2))


def test_schedule_is_hf_linear_with_warmup():
    cfg = TrainConfig(train_file='x', learning_rate=1e-3, warmup_steps=2)
    s = make_schedule(cfg, 10)
    # HF get_linear_schedule_with_warmup: lr * k / w for k < w, then lr * (T - k) / (T - w).
    want = [1e-3 * k / 2 if k < 2 else 1e-3 * (10 - k) / 8 for k in range(11)]
    np.testing.assert_allclose([float(s(k)) for k in range(11)], want, rtol=1e-6, atol=1e-12)
    flat = make_schedule(TrainConfig(train_file='x', learning_rate=1e-3), 4)
    np.testing.assert_allclose([float(flat(k)) for k in range(4)], [1e-3, 7.5e-4, 5e-4, 2.5e-4])
    assert isinstance(make_optimizer(cfg, 10), optax.GradientTransformation)


def test_an_objective_naming_ids_step_and_key_gets_them_in_every_path():
    @register_objective('test_context', views=2, from_single=True, replace=True)
    def with_context(z, temp=0.05, *, ids, step, key):
        loss, _ = get_objective('unsup').loss(z, temp=temp)
        return loss, {'step_seen': step.astype(jnp.float32),
                      'ids_sum': jnp.sum(ids).astype(jnp.float32),
                      'ids_rows': ids.shape[0] * jnp.ones(()),
                      'key_draw': jax.random.uniform(key)}

    enc = _encoder(0.0, pooler='avg')
    batch = _batch(8)
    root = jax.random.key(1)
    for accum in (1, 2):
        state, step = _setup(enc, _sgd(), loss=get_objective('test_context').loss, accum=accum)
        for k in range(2):
            state, m = step(state, batch)
            assert float(m['step_seen']) == k  # the optimizer step, not a constant
            key = jax.random.fold_in(root, k)
            if accum == 1:
                assert float(m['ids_sum']) == float(batch['input_ids'].sum())
                assert float(m['ids_rows']) == 8.0
                want = float(jax.random.uniform(jax.random.fold_in(key, 2)))
            else:  # each micro-batch (rows i::2) sees its own ids and its own key
                np.testing.assert_allclose(float(m['ids_sum']),
                                           float(batch['input_ids'].sum()) / 2, rtol=1e-6)
                assert float(m['ids_rows']) == 4.0
                want = np.mean([float(jax.random.uniform(jax.random.fold_in(
                    jax.random.fold_in(key, i), 2))) for i in range(2)])
            np.testing.assert_allclose(float(m['key_draw']), want, rtol=1e-6)
    # The same objective through make_loss_fn: the step is the caller's.
    fn = _jit(make_loss_fn(enc, get_objective('test_context').loss, 2))
    _, aux = fn(init_params(enc, jax.random.key(0)), batch, jax.random.key(3), jnp.int32(5))
    assert float(aux['step_seen']) == 5.0


def test_mask_duplicates_reaches_the_objective_through_the_loss_fn():
    enc = _encoder(0.1, pooler='avg')
    params = init_params(enc, jax.random.key(0))
    batch = _batch(6)
    batch['input_ids'][4] = batch['input_ids'][1]  # the same sentence twice
    key = jax.random.key(3)
    z = _jit(functools.partial(encode_views, enc, views=2))(params, batch, key)
    got = {}
    for mask in (False, True):
        loss = functools.partial(get_objective('unsup').loss, mask_duplicates=mask)
        got[mask] = float(_jit(make_loss_fn(enc, loss, 2))(params, batch, key)[0])
        want = get_objective('unsup').loss(z, mask_duplicates=mask,
                                           ids=jnp.asarray(batch['input_ids']))[0]
        np.testing.assert_allclose(got[mask], float(want), rtol=1e-5)
    assert abs(got[True] - got[False]) > 1e-3


def test_a_batch_split_has_one_mode_and_refuses_contradictions_in_one_line():
    contradictions = [
        (dict(mode='micro'), "unknown mode 'micro'"),
        (dict(mode='whole', grad_accum_steps=2), "'whole' takes grad_accum_steps 1 and "),
        (dict(mode='packed', micro_batch_size=4), "'packed' takes grad_accum_steps 1 and "),
        (dict(mode='accumulate'), "'accumulate' takes grad_accum_steps >= 2"),
        (dict(mode='accumulate', grad_accum_steps=2, micro_batch_size=4), "'accumulate' takes"),
        (dict(mode='cached'), "'cached' takes grad_accum_steps 1 and micro_batch_size >= 1"),
        (dict(mode='cached', grad_accum_steps=2, micro_batch_size=4), "'cached' takes"),
        (dict(mode='whole', grad_accum_steps=0), "'whole' takes"),
    ]
    for fields, message in contradictions:
        with pytest.raises(ConfigError, match=message) as e:
            BatchSplit(**fields)
        assert '\n' not in str(e.value)
    # A config's split: the one of its settings that is on.
    def split(**kw):
        return batch_split(TrainConfig(train_file='x', batch_size=8, max_len=8, **kw))

    assert split() == BatchSplit()
    assert split(grad_accum_steps=2) == BatchSplit(mode='accumulate', grad_accum_steps=2)
    assert split(micro_batch_size=4) == BatchSplit(mode='cached', micro_batch_size=4)
    assert split(pack_length=16) == BatchSplit(mode='packed')
    # Cached micro-batches have no masked-LM term.
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    mlm = MlmSettings(weight=0.1, probability=0.15, special_ids=(0,), mask_id=1, vocab_size=50)
    with pytest.raises(ConfigError, match='does not combine with the masked-LM term'):
        make_train_step(loss=LossSpec(encoder=_encoder(0.0), objective=get_objective('unsup').loss,
                                      views=2, mlm=mlm),
                        update=UpdateSpec(tx=optax.sgd(0.1)),
                        target=CompileTarget(mesh=mesh, state_shardings=None),
                        split=BatchSplit(mode='cached', micro_batch_size=2))
