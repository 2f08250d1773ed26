"""Sharding: golden PartitionSpecs, batch-size refusal, and 1 device vs 8-device meshes.

The equivalence check runs in a subprocess with 8 fake CPU devices. A mesh changes only where
the float32 sums of a step are split and in which order the partial sums are combined, so the
results may differ from one device by rounding, never by more. The bounds are those of
reordered float32 summation: a sum of n terms computed in two orders differs by at most about
2 (n - 1) u sum|terms|, u = 2^-24. The longest sums a mesh splits are the weight gradients'
sums over the tokens of the global batch (n = rows x views x length), and the terms' scale is
that of the gradient entries, so every gradient entry must agree within 2 n u max|g| and
every loss within 2 n u |loss| (the loss is a mean over the batch). SGD steps keep these
bounds (an update is lr x gradient); Adam would not: it divides by sqrt(v), which turns the
rounding noise of a near-zero gradient into a full-size update of either sign.
"""
import json
import textwrap
from pathlib import Path

import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jaxsim import sharding
from jaxsim.errors import ConfigError
from jaxsim.models.architectures import known_architecture
from jaxsim.train import build
from jaxsim.train.config import TrainConfig
from tests.conftest import run_on_cpu_devices

REPO = Path(__file__).resolve().parents[2]
U = 2.0 ** -24  # float32 unit roundoff


def _mesh(data, fsdp, tensor):
    return AbstractMesh((data, fsdp, tensor), sharding.MESH_AXES)


class _S:  # a shape-only leaf
    def __init__(self, *shape):
        self.shape = shape


def _params():
    dense = lambda i, o: {'kernel': _S(i, o), 'bias': _S(o)}  # noqa: E731
    norm = {'scale': _S(32), 'bias': _S(32)}
    layer = {'attention': {'self': {n: dense(32, 32) for n in ('query', 'key', 'value')},
                           'output': {'dense': dense(32, 32), 'LayerNorm': norm}},
             'intermediate': {'dense': dense(32, 48)},
             'output': {'dense': dense(48, 32), 'LayerNorm': norm}}
    return {'bert': {'embeddings': {'word_embeddings': {'embedding': _S(30522, 32)},
                                    'position_embeddings': {'embedding': _S(64, 32)}},
                     'encoder': {'layer_0': layer}},
            'pooler': {'dense': dense(32, 32)}}


def test_golden_partition_specs_fsdp():
    specs = sharding.param_specs(_params(), _mesh(4, 2, 1))
    emb, lay = specs['bert']['embeddings'], specs['bert']['encoder']['layer_0']
    assert emb['word_embeddings']['embedding'] == P(None, 'fsdp')
    assert emb['position_embeddings']['embedding'] == P(None, 'fsdp')
    assert lay['attention']['self']['query']['kernel'] == P('fsdp')
    assert lay['attention']['output']['dense']['kernel'] == P(None, 'fsdp')
    assert lay['intermediate']['dense']['kernel'] == P('fsdp')
    assert lay['output']['dense']['kernel'] == P(None, 'fsdp')
    assert lay['output']['LayerNorm']['scale'] == P()
    assert specs['pooler']['dense']['kernel'] == P('fsdp')  # the SimCSE head
    assert specs['pooler']['dense']['bias'] == P()


def test_golden_partition_specs_tensor_and_replicated():
    specs = sharding.param_specs(_params(), _mesh(2, 1, 4))
    lay = specs['bert']['encoder']['layer_0']
    # vocab 30522 is not divisible by 4: that dimension falls back to replicated.
    assert specs['bert']['embeddings']['word_embeddings']['embedding'] == P()
    assert lay['attention']['self']['query']['kernel'] == P(None, 'tensor')
    assert lay['intermediate']['dense']['kernel'] == P(None, 'tensor')
    assert lay['output']['dense']['kernel'] == P('tensor')
    flat = sharding.param_specs(_params(), _mesh(8, 1, 1))
    assert all(s == P() for s in _leaves(flat))  # pure data parallel: all replicated


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    else:
        yield tree


def test_global_batch_must_split_over_mesh():
    mesh = _mesh(4, 2, 1)
    assert sharding.check_global_batch(64, mesh) == 8
    assert sharding.check_global_batch(64, mesh, grad_accum_steps=2) == 4
    with pytest.raises(ValueError, match='cannot be split over 8 batch shards'):
        sharding.check_global_batch(60, mesh)
    with pytest.raises(ValueError, match='not divisible by grad_accum_steps'):
        sharding.check_global_batch(64, mesh, grad_accum_steps=3)


_SCRIPT = textwrap.dedent('''
    import functools, json, sys
    import jax, jax.numpy as jnp, numpy as np
    sys.path.insert(0, sys.argv[1])
    from jaxsim import sharding
    from jaxsim.models.bert import BertConfig
    from jaxsim.models.encoder import SentenceEncoder, init_params
    from jaxsim.objectives import get_objective
    from jaxsim.train.config import TrainConfig
    from jaxsim.train.optim import make_optimizer
    from jaxsim.train.state import create_state, param_shardings
    from jaxsim.train.step import (BatchSplit, CompileTarget, LossSpec, UpdateSpec,
                                   compiler_options, configure_jax, make_loss_fn,
                                   make_train_step)
    configure_jax()
    assert jax.device_count() == 8, jax.devices()
    O0 = compiler_options(True)
    config = BertConfig(vocab_size=2000, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=4, intermediate_size=48, max_position_embeddings=64,
                        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    encoder = SentenceEncoder(config, pooler='cls', mlp_only_train=True)
    cfg = TrainConfig(train_file='x', optimizer='sgd', learning_rate=0.1, max_grad_norm=0.0)
    flat = lambda tree: [np.asarray(x) for x in jax.tree.leaves(tree)]  # noqa: E731
    out = {}
    for objective, views, accum in (('unsup', 1, 1), ('sup', 3, 2)):
        rng = np.random.default_rng(0)
        ids = rng.integers(1000, 2000, size=(3, 16, views, 12)).astype(np.int32)
        mask = (np.arange(12) < rng.integers(4, 13, (3, 16, views, 1))).astype(np.int32)
        batches = [{'input_ids': ids[i] * mask[i], 'attention_mask': mask[i],
                    'token_type_ids': np.zeros_like(ids[i])} for i in range(3)]
        meshes = {'single': sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]),
                  'data8': sharding.make_mesh(8, 1, 1),
                  'data4_fsdp2': sharding.make_mesh(4, 2, 1),
                  'data2_tensor4': sharding.make_mesh(2, 1, 4)}
        if objective == 'sup':  # sup with gradient accumulation on two meshes
            meshes = {k: meshes[k] for k in ('single', 'data4_fsdp2')}
        loss = get_objective(objective).loss
        res = {}
        for name, mesh in meshes.items():
            params = init_params(encoder, jax.random.key(0), param_shardings(encoder, mesh))
            init = flat(params)
            grad_fn = jax.jit(jax.value_and_grad(make_loss_fn(encoder, loss, 2 if views == 1
                                                             else views), has_aux=True),
                              compiler_options=O0)
            (l0, _), g0 = grad_fn(params, sharding.assemble_batch(batches[0], mesh),
                                  jax.random.key(7))
            tx = make_optimizer(cfg, 3)
            state, sh = create_state(params, tx, jax.random.key(1), mesh, O0)
            split = (BatchSplit(mode='accumulate', grad_accum_steps=accum) if accum > 1
                     else BatchSplit())
            step = make_train_step(
                loss=LossSpec(encoder=encoder, objective=loss, views=2 if views == 1 else views),
                update=UpdateSpec(tx=tx),
                target=CompileTarget(mesh=mesh, state_shardings=sh, compiler_options=O0),
                split=split)
            losses = []
            for b in batches:
                state, m = step(state, sharding.assemble_batch(b, mesh))
                losses.append(float(m['loss']))
            spec = state.params['bert']['encoder']['layer_0']['intermediate']['dense'][
                'kernel'].sharding.spec
            res[name] = dict(init=init, loss0=float(l0), grads=flat(g0), losses=losses,
                             params=flat(state.params), spec=str(spec))
        ref = res['single']
        gmax = max(float(np.abs(g).max()) for g in ref['grads'])
        pmax = max(float(np.abs(p).max()) for p in ref['params'])
        out[objective] = {'tokens': 16 * max(views, 2) * 12, 'grad_max': gmax, 'param_max': pmax,
                          'loss0': ref['loss0'], 'losses': ref['losses'], 'meshes': {}}
        for name, r in res.items():
            out[objective]['meshes'][name] = dict(
                spec=r['spec'],
                init_equal=all(np.array_equal(a, b) for a, b in zip(r['init'], ref['init'])),
                loss0_diff=abs(r['loss0'] - ref['loss0']),
                loss_diffs=[abs(a - b) for a, b in zip(r['losses'], ref['losses'])],
                grad_diff=max(float(np.abs(a - b).max()) for a, b in zip(r['grads'],
                                                                         ref['grads'])),
                param_diff=max(float(np.abs(a - b).max()) for a, b in zip(r['params'],
                                                                          ref['params'])),
                param_change=max(float(np.abs(a - b).max()) for a, b in zip(r['params'],
                                                                            ref['init'])))
    print('RESULT' + json.dumps(out), flush=True)
''')


def test_meshes_compute_the_single_device_step_up_to_float32_rounding():
    out = run_on_cpu_devices(_SCRIPT, str(REPO))
    print(json.dumps(out, indent=1))
    lr, steps = 0.1, 3
    for objective, res in out.items():
        n = res['tokens']  # the longest sum a mesh splits: over the batch's tokens
        grad_tol = 2 * n * U * res['grad_max']
        assert all(map(lambda v: v == v, res['losses'])) and res['losses'][0] != res['losses'][-1]
        for name, r in res['meshes'].items():
            where = f'{objective} {name}'
            assert r['init_equal'], where  # params are created identically on every mesh
            assert r['loss0_diff'] <= 2 * n * U * abs(res['loss0']), where
            assert max(r['loss_diffs']) <= 2 * n * U * max(map(abs, res['losses'])), where
            assert r['grad_diff'] <= grad_tol, (where, r['grad_diff'], grad_tol)
            # SGD: each step moves a parameter by lr x gradient, rounded to the parameter.
            param_tol = steps * (lr * grad_tol + 2 * U * res['param_max'])
            assert r['param_diff'] <= param_tol, (where, r['param_diff'], param_tol)
            assert r['param_change'] > 100 * param_tol, where  # the steps really moved params
        meshes = res['meshes']
        assert meshes['data4_fsdp2']['spec'] == str(P('fsdp'))
        if 'data2_tensor4' in meshes:
            assert meshes['data2_tensor4']['spec'] == str(P(None, 'tensor'))


def test_mesh_from_topology_on_one_slice():
    import jax
    mesh = sharding.make_mesh()  # every device of this process on the data axis
    assert dict(mesh.shape) == {'data': jax.device_count(), 'fsdp': 1, 'tensor': 1}
    assert list(mesh.devices.flat) == jax.devices()
    # One process holds every batch shard, so it feeds every row of each batch.
    assert sharding.process_batch_rows(mesh, 32).tolist() == list(range(32))
    more = jax.device_count() + 1
    with pytest.raises(sharding.MeshError, match=rf'needs {more} devices, have \d+ \(on a CPU, '
                                                 rf'XLA_FLAGS=--xla_force_host_platform_device_'
                                                 rf'count={more} gives {more}\)$'):
        sharding.make_mesh(more)


def test_the_cpu_hint_counts_devices_a_process():
    """XLA's device-count flag splits each process's CPU: 2 processes of 4 need 8 each."""
    from types import SimpleNamespace
    devices = [SimpleNamespace(platform='cpu', process_index=i // 4) for i in range(8)]
    with pytest.raises(sharding.MeshError, match=r'needs 16 devices, have 8 \(on a CPU, '
                                                 r'XLA_FLAGS=--xla_force_host_platform_device_'
                                                 r'count=8 gives 8 a process\)$'):
        sharding.make_mesh(16, devices=devices)


def test_slices_across_the_network_must_match_the_processes():
    # CPU devices have no slice_index: each process is a slice.
    with pytest.raises(sharding.MeshError, match='mesh_dcn_data x mesh_dcn_fsdp x mesh_dcn_tensor'
                                                 ' = 2 must equal the number of processes, 1'):
        sharding.make_mesh(dcn_data=2)
    with pytest.raises(sharding.MeshError, match='= 4 must equal'):
        sharding.make_mesh(dcn_fsdp=2, dcn_tensor=2)


def test_micro_batch_must_split_over_the_batch_shards():
    mesh = _mesh(4, 2, 1)
    assert sharding.check_global_batch(64, mesh, micro_batch_size=16) == 8
    with pytest.raises(ValueError, match='micro_batch_size 12 cannot be split over 8 batch'):
        sharding.check_global_batch(96, mesh, micro_batch_size=12)


@pytest.mark.parametrize('model, batch, mesh, slices, hint', [
    # The papers' batch on a pod; BERT's 30,522-row vocabulary does not split 4 ways.
    ('bert-base-uncased', 64, (256, 1, 1), 1,
     '--config.mesh_data=64 --config.mesh_tensor=4 --config.replicate_indivisible=True'),
    ('bert-base-uncased', 64, (128, 1, 1), 1, '--config.mesh_data=64 --config.mesh_tensor=2'),
    ('bert-base-uncased', 100, (16, 1, 1), 1,
     '--config.mesh_data=4 --config.mesh_tensor=4 --config.replicate_indivisible=True'),
    ('bert-base-uncased', 64, (512, 1, 1), 1, None),  # tensor 8 does not divide 12 heads
    # Two slices of 256 chips: 32 rows a slice, BERT-large's 16 heads split 8 ways; the
    # per-slice mesh_data is what the flag takes (the slices stay mesh_dcn_data).
    ('bert-large-uncased', 64, (512, 1, 1), 2,
     '--config.mesh_data=32 --config.mesh_tensor=8 --config.replicate_indivisible=True'),
    ('bert-base-uncased', 64, (512, 1, 1), 2, None),
    ('bert-large-uncased', 2, (8, 1, 1), 4, None),  # fewer rows than slices
])
def test_a_batch_the_mesh_cannot_split_names_the_mesh_that_takes_it(model, batch, mesh, slices,
                                                                   hint):
    """The batch split as far as it goes, the model over the devices left, where its heads and
    widths divide by that; one line either way."""
    cfg = TrainConfig(train_file='x', batch_size=batch, mesh_dcn_data=slices)
    config = known_architecture(model)
    with pytest.raises(ConfigError) as e:
        build.check_batch_split(cfg, _mesh(*mesh), config)
    message = str(e.value)
    assert '\n' not in message and f'cannot be split over {mesh[0]} batch shards' in message
    if hint:
        assert message.endswith(hint)
    else:
        assert 'mesh_tensor' not in message
