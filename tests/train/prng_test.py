"""The dropout PRNG option: threefry keeps the step's numbers; rbg keys train and draw their
own masks; unknown implementations are refused."""
import jax
import numpy as np
import pytest

from jaxsim import sharding
from jaxsim.errors import ConfigError
from jaxsim.models.bert import BertConfig
from jaxsim.models.encoder import SentenceEncoder, init_params
from jaxsim.objectives import get_objective
from jaxsim.train.config import TrainConfig
from jaxsim.train.optim import make_optimizer
from jaxsim.train.state import create_state
from jaxsim.train.step import (
    CompileTarget,
    LossSpec,
    UpdateSpec,
    compiler_options,
    configure_jax,
    dropout_key,
    make_train_step,
)

configure_jax()


def _run(prng_impl: str, steps: int = 2):
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=24, max_position_embeddings=16,
                        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    encoder = SentenceEncoder(config, pooler='avg')
    cfg = TrainConfig(train_file='unused', learning_rate=1e-3, max_steps=steps,
                      prng_impl=prng_impl)
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    tx = make_optimizer(cfg, steps)
    key = dropout_key(jax.random.key(0), prng_impl)
    state, shardings = create_state(init_params(encoder, jax.random.key(1)), tx, key, mesh)
    objective = get_objective('unsup')
    step = make_train_step(
        loss=LossSpec(encoder=encoder, objective=objective.loss, views=objective.views),
        update=UpdateSpec(tx=tx),
        target=CompileTarget(mesh=mesh, state_shardings=shardings,
                             compiler_options=compiler_options(True), prng_impl=prng_impl))
    ids = np.random.default_rng(0).integers(3, 50, size=(6, 1, 9)).astype(np.int32)
    batch = {'input_ids': ids, 'attention_mask': np.ones_like(ids),
             'token_type_ids': np.zeros_like(ids)}
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics['loss']))
    return losses, state


def test_threefry_key_is_the_root_keys_dropout_use():
    root = jax.random.key(0)
    np.testing.assert_array_equal(jax.random.key_data(dropout_key(root)),
                                  jax.random.key_data(jax.random.fold_in(root, 2)))


def test_rbg_trains_with_its_own_masks():
    threefry, _ = _run('threefry2x32')
    rbg, state = _run('rbg')
    assert state.rng.shape == (4,) and int(state.step) == 2
    assert all(np.isfinite(rbg))
    assert rbg[0] != threefry[0]  # different dropout masks, same weights and batch
    assert rbg == _run('rbg')[0]  # reproducible on the same mesh


def test_unknown_prng_impl_is_refused():
    with pytest.raises(ConfigError, match='prng_impl must be one of'):
        TrainConfig(train_file='unused', prng_impl='philox')
    with pytest.raises(ValueError, match='unknown prng_impl'):
        dropout_key(jax.random.key(0), 'philox')
