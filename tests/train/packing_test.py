"""Sequence packing: the layout holds every token once, a packed encoder gives the padded
encoder's vectors, loss and gradients, and a run with pack_length trains and refuses what it
cannot do."""
import functools
import shutil

import jax
import numpy as np
import pytest

from jaxsim import sharding
from jaxsim.data.packing import PACK_INDEX, UNPACK_INDEX, first_fit, pack_batch, pack_layout
from jaxsim.errors import ConfigError
from jaxsim.models.bert import BertConfig
from jaxsim.models.encoder import SentenceEncoder, init_params
from jaxsim.objectives import get_objective
from jaxsim.train import build, loop
from jaxsim.train.config import TrainConfig
from jaxsim.train.optim import make_optimizer
from jaxsim.train.state import create_state
from jaxsim.train.step import (
    BatchSplit,
    CompileTarget,
    LossSpec,
    UpdateSpec,
    compiler_options,
    configure_jax,
    make_loss_fn,
    make_train_step,
)
from tests.conftest import run_on_cpu_devices, tiny_run_config, write_snli_corpus

configure_jax()
O0 = compiler_options(True)
L = 12


def _sentences(n, seed=0, pad_id=0, vocab=50):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, L + 1, n)
    mask = (np.arange(L)[None] < lengths[:, None]).astype(np.int32)
    ids = np.where(mask, rng.integers(3, vocab, (n, L)), pad_id).astype(np.int32)
    types = (mask * rng.integers(0, 2, (n, L))).astype(np.int32)
    return ids, mask, types


def test_layout_holds_every_token_once_within_rows():
    lengths = np.random.default_rng(1).integers(1, 33, 200)
    pack, unpack = pack_layout(lengths, 32, 64, row_multiple=8)
    assert pack.shape[1] == 64 and pack.shape[0] % 8 == 0
    real = pack[pack < 200 * 32]
    assert len(real) == lengths.sum() == len(np.unique(real))
    # Unpacking a packed slot lands on the padded slot it came from.
    flat = pack.reshape(-1)
    for s in range(200):
        k = lengths[s]
        np.testing.assert_array_equal(flat[unpack[s, :k]], s * 32 + np.arange(k))
        rows = unpack[s, :k] // 64
        assert (rows == rows[0]).all()  # one sentence never spans two rows
        np.testing.assert_array_equal(np.diff(unpack[s, :k]), 1)
    # First fit leaves at most one row half full or less (two would have been merged).
    fill = (pack < 200 * 32).sum(1)
    fill = fill[fill > 0]
    assert len(fill) == len(first_fit(lengths, 64)) and (fill <= 32).sum() <= 1
    with pytest.raises(ValueError, match='33 tokens does not fit a packed row of 32'):
        pack_layout(np.array([5, 33]), 40, 32)


@pytest.mark.parametrize('model_type', ['bert', 'roberta'])
@pytest.mark.parametrize('pooler', ['avg', 'cls', 'avg_first_last'])
def test_packed_encoder_gives_the_padded_vectors(model_type, pooler):
    pad = 1 if model_type == 'roberta' else 0
    cfg = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=L + 4,
                     model_type=model_type, pad_token_id=pad, type_vocab_size=2)
    ids, mask, types = _sentences(11, pad_id=pad)
    enc = SentenceEncoder(cfg, pooler=pooler)
    params = enc.init(jax.random.key(0), ids, mask, types)['params']
    apply = jax.jit(enc.apply, compiler_options=O0)
    padded = np.asarray(apply({'params': params}, ids, mask, types))
    pack, unpack = pack_layout(mask.sum(-1), L, 2 * L, row_multiple=4)
    assert pack.size < ids.size  # the packed rows are fewer tokens than the padded ones
    packed = np.asarray(apply({'params': params}, ids, mask, types,
                              packing=(pack[None], unpack)))
    np.testing.assert_allclose(packed, padded, atol=2e-6, rtol=1e-5)


def _encoder(dropout=0.0):
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=24, max_position_embeddings=L + 4,
                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return SentenceEncoder(cfg, pooler='cls')


@pytest.mark.parametrize('objective,views', [('unsup', 1), ('sup', 3)])
def test_packed_loss_and_gradients_equal_padded(objective, views):
    enc = _encoder()
    params = init_params(enc, jax.random.key(0))
    ids, mask, types = (x.reshape(6, views, L) for x in _sentences(6 * views, seed=2))
    batch = {'input_ids': ids, 'attention_mask': mask, 'token_type_ids': types}
    obj = get_objective(objective)
    grad = jax.jit(jax.value_and_grad(make_loss_fn(enc, obj.loss, obj.views), has_aux=True),
                   compiler_options=O0)
    (loss, _), g = grad(params, batch, jax.random.key(1))
    packed_batch = pack_batch(batch, obj.views, 2 * L, row_multiple=2)
    assert packed_batch[UNPACK_INDEX].shape == (6, obj.views, L)
    (loss_p, _), g_p = grad(params, packed_batch, jax.random.key(1))
    np.testing.assert_allclose(loss_p, loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_p), jax.tree.leaves(g)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=2e-4)


def test_packed_train_step_learns_with_dropout():
    enc = _encoder(dropout=0.1)
    mesh = sharding.make_mesh(data=1)
    cfg = TrainConfig(train_file='x', max_steps=20, learning_rate=3e-3)
    tx = make_optimizer(cfg, 20)
    state, shardings = create_state(init_params(enc, jax.random.key(0)), tx,
                                    jax.random.key(1), mesh, O0)
    step = make_train_step(
        loss=LossSpec(encoder=enc, objective=functools.partial(get_objective('unsup').loss,
                                                               temp=0.05), views=2),
        update=UpdateSpec(tx=tx),
        target=CompileTarget(mesh=mesh, state_shardings=shardings, compiler_options=O0),
        split=BatchSplit(mode='packed'))
    ids, mask, types = (x[:, None] for x in _sentences(8, seed=3))
    batch = pack_batch({'input_ids': ids, 'attention_mask': mask, 'token_type_ids': types},
                       2, 2 * L)
    assert batch[PACK_INDEX].shape[1] < 16  # 16 padded rows (8 sentences x 2 views)
    losses = []
    for _ in range(20):
        state, metrics = step(state, batch)
        losses.append(float(metrics['loss']))
    assert np.isfinite(losses).all() and int(state.step) == 20
    assert losses[-1] < 0.5 * losses[0]


def test_pack_length_is_checked():
    with pytest.raises(ConfigError, match='pack_length 16 is below max_len 32'):
        TrainConfig(train_file='x', max_len=32, pack_length=16)
    with pytest.raises(ConfigError, match='pack_length does not combine'):
        TrainConfig(train_file='x', max_len=32, pack_length=64, micro_batch_size=8, batch_size=64)
    batch = {'input_ids': np.zeros((2, 1, 32), np.int32),
             'attention_mask': np.ones((2, 1, 32), np.int32),
             'token_type_ids': np.zeros((2, 1, 32), np.int32)}
    mesh = sharding.make_mesh(data=1)
    cfg = TrainConfig(train_file='x', max_len=32, pack_length=64)
    out = build.batch_preparer(cfg, get_objective('unsup'), mesh)(batch)
    assert out[PACK_INDEX].shape == (1, 8, 64) and out[UNPACK_INDEX].shape == (2, 2, 32)
    assert build.batch_preparer(TrainConfig(train_file='x'), get_objective('unsup'),
                                mesh)(batch) is batch


def test_shards_are_packed_each_in_its_own_rows():
    ids, mask, types = (x.reshape(8, 1, L) for x in _sentences(8, seed=4))
    out = pack_batch({'input_ids': ids, 'attention_mask': mask, 'token_type_ids': types},
                     2, 2 * L, shards=4, row_multiple=1, agree=lambda r: r + 1)
    pack, unpack = out[PACK_INDEX], out[UNPACK_INDEX]
    assert pack.shape[0] == 4 and unpack.shape == (8, 2, L)
    lengths = np.repeat(mask.sum(-1), 2, axis=1).reshape(4, 4)  # 4 sentences per shard
    assert pack.shape[1] == max(len(first_fit(x, 2 * L)) for x in lengths) + 1  # agreed
    for s in range(4):  # indices local to the shard: its 4 sentences, its own rows
        real = pack[s][pack[s] < 4 * L]
        assert len(real) == lengths[s].sum()
        assert unpack[2 * s: 2 * s + 2].max() < pack.shape[1] * 2 * L


_SHARDED = """
import functools, json, sys
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxsim import sharding
from jaxsim.data.packing import pack_batch
from jaxsim.objectives import get_objective
from jaxsim.train.step import batch_shardings, configure_jax, make_loss_fn
from tests.train.packing_test import _encoder, _sentences, L
from jaxsim.models.encoder import init_params
configure_jax()
enc = _encoder()
params = init_params(enc, jax.random.key(0))
ids, mask, types = (x.reshape(16, 1, L) for x in _sentences(16, seed=5))
batch = {'input_ids': ids, 'attention_mask': mask, 'token_type_ids': types}
grad = jax.value_and_grad(make_loss_fn(enc, get_objective('unsup').loss, 2), has_aux=True)
(loss, _), g = jax.jit(grad)(params, batch, jax.random.key(1))
mesh = sharding.make_mesh(data=4, fsdp=2)
out = {'loss': float(loss)}
for name, b in (('padded', batch), ('packed', pack_batch(batch, 2, 2 * L, shards=8))):
    shardings = batch_shardings(mesh, packed=name == 'packed')
    step = jax.jit(grad, in_shardings=(NamedSharding(mesh, P()), shardings, None))
    placed = {k: jax.device_put(v, shardings[k]) for k, v in b.items()}
    hlo = step.lower(params, placed, jax.random.key(1)).compile().as_text()
    (l, _), gs = step(params, placed, jax.random.key(1))
    out[name] = {'loss': float(l), 'all_gathers': hlo.count(' all-gather('),
                 'grad_diff': max(float(np.abs(np.asarray(a) - np.asarray(c)).max())
                                  for a, c in zip(jax.tree.leaves(gs), jax.tree.leaves(g)))}
print('RESULT' + json.dumps(out))
"""


def test_packed_on_8_shards_equals_one_device_and_gathers_nothing_more():
    # Fast compile: the same programs at XLA -O0 (the partitioner, which places the gathers,
    # runs as at full effort), every side of the comparison compiled alike.
    out = run_on_cpu_devices(_SHARDED)
    assert out['packed']['loss'] == pytest.approx(out['loss'], rel=1e-5)
    assert out['packed']['grad_diff'] < 1e-5 and out['padded']['grad_diff'] < 1e-5
    # The packing gathers stay on each device: no collective beyond the padded step's.
    assert out['packed']['all_gathers'] <= out['padded']['all_gathers']


def test_a_run_with_pack_length_trains_and_resumes_the_same(tmp_path):
    corpus = tmp_path / 'corpus.txt'
    write_snli_corpus(corpus, 64)
    cfg = tiny_run_config(corpus, pack_length=32, max_steps=4, checkpoint_every=2,
                          mesh_data=1)
    whole = loop.train_and_evaluate(cfg, tmp_path / 'whole', progress=False)
    assert whole.steps == 4 and np.isfinite(whole.final_loss)
    # Drop the last checkpoint and the result: the rerun resumes at step 2 and lands on the
    # same losses, the packed layout being a function of the batch alone.
    shutil.copytree(tmp_path / 'whole', tmp_path / 'resumed')
    shutil.rmtree(tmp_path / 'resumed' / 'checkpoints' / '4')
    (tmp_path / 'resumed' / 'result.json').unlink()
    resumed = loop.train_and_evaluate(cfg, tmp_path / 'resumed', progress=False)
    assert ((tmp_path / 'resumed' / 'metrics.jsonl').read_text()
            == (tmp_path / 'whole' / 'metrics.jsonl').read_text())
    assert resumed.final_loss == whole.final_loss
