"""The optimizer update split over the 'data' axis (`shard_optimizer_state`, ZeRO-1): the same
state as the whole update on every device, with 1/data of Adam's moments on each.

Runs in a subprocess with 8 fake CPU devices. The update is elementwise and every device
computes its slice with the same arithmetic on the same gradients (the split happens after
the step's gradient reduction), so on data and fsdp meshes the states must be EQUAL.
"""
import json
import textwrap
from pathlib import Path

from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jaxsim import sharding
from tests.conftest import run_on_cpu_devices

REPO = Path(__file__).resolve().parents[2]
ULP = 2.0 ** -23  # float32 spacing at 1


class _S:  # a shape-only leaf
    def __init__(self, *shape):
        self.shape = shape


def test_update_specs_add_the_data_axis_on_the_first_free_dimension_but_the_last():
    mesh = AbstractMesh((4, 2, 1), sharding.MESH_AXES)
    params = {'kernel': _S(32, 48), 'fsdp_kernel': _S(32, 16, 48), 'split': _S(32, 48),
              'vocab': _S(30, 12), 'bias': _S(48), 'scalar': _S(), 'ruled': _S(32, 16, 48)}
    specs = {'kernel': P(), 'fsdp_kernel': P('fsdp'), 'split': P('fsdp'), 'vocab': P(),
             'bias': P(), 'scalar': P(), 'ruled': P(None, ('fsdp', 'data'))}
    out = sharding.update_specs(specs, params, mesh)
    assert out['kernel'] == P('data')
    assert out['fsdp_kernel'] == P('fsdp', 'data')  # dim 0 is fsdp's already
    assert out['split'] == P('fsdp')  # no free dimension but the last: updated whole
    assert out['vocab'] == P()  # 30 rows do not split 4 ways, and the last dim never splits
    assert out['bias'] == P() and out['scalar'] == P()
    # The rules already split it over 'data' (an axis splits one dimension): as the rules say.
    assert out['ruled'] == P(None, ('fsdp', 'data'))


_SCRIPT = textwrap.dedent('''
    import json, sys
    import jax, numpy as np
    sys.path.insert(0, sys.argv[1])
    from jaxsim import sharding
    from jaxsim.models.bert import BertConfig
    from jaxsim.models.encoder import SentenceEncoder, init_params
    import jax.numpy as jnp
    from jaxsim.objectives import get_objective, register_objective
    from jaxsim.train.config import TrainConfig
    from jaxsim.train.optim import make_optimizer
    from jaxsim.train import state as state_lib
    from jaxsim.train.step import (CompileTarget, LossSpec, UpdateSpec, compiler_options,
                                   configure_jax, make_train_step)
    configure_jax()
    assert jax.device_count() == 8, jax.devices()
    O0 = compiler_options(True)
    config = BertConfig(vocab_size=2000, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=4, intermediate_size=48, max_position_embeddings=64)
    encoder = SentenceEncoder(config, pooler='cls', mlp_only_train=True)
    # AdamW with clipping at a norm the gradients exceed: every part of the update runs.
    cfg = TrainConfig(train_file='x', learning_rate=1e-3, weight_decay=0.01, max_grad_norm=0.1)
    loss = get_objective('unsup').loss

    @register_objective('test_nan', views=2, from_single=True, replace=True)
    def nan_loss(z):
        return jnp.nan * jnp.sum(z), {}

    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 2000, size=(3, 16, 1, 12)).astype(np.int32)
    mask = (np.arange(12) < rng.integers(4, 13, (3, 16, 1, 1))).astype(np.int32)
    batches = [{'input_ids': ids[i] * mask[i], 'attention_mask': mask[i],
                'token_type_ids': np.zeros_like(ids[i])} for i in range(3)]
    flat = lambda tree: [np.asarray(x) for x in jax.tree.leaves(tree)]  # noqa: E731
    out = {}
    for name, axes in (('data8', (8, 1, 1)), ('data4_fsdp2', (4, 2, 1)),
                       ('data2_tensor4', (2, 1, 4))):
        mesh = sharding.make_mesh(*axes)
        res = {}
        for split in (False, True):
            tx = make_optimizer(cfg, 3)
            params = init_params(encoder, jax.random.key(0),
                                 state_lib.param_shardings(encoder, mesh))
            shape = jax.eval_shape(state_lib._init_fn(tx, jax.random.key(1)), params)
            sh = state_lib.state_shardings(shape, mesh, shard_optimizer_state=split)
            state, sh = state_lib.create_state(params, tx, jax.random.key(1), mesh, O0, sh)
            update_at = state_lib.update_shardings(shape, sh, mesh) if split else None
            step = make_train_step(
                loss=LossSpec(encoder=encoder, objective=loss, views=2),
                update=UpdateSpec(tx=tx),
                target=CompileTarget(mesh=mesh, state_shardings=sh, compiler_options=O0,
                                     update_shardings=update_at))
            norms = []
            for b in batches:
                state, m = step(state, sharding.assemble_batch(b, mesh))
                norms.append(float(m['grad_norm']))
            if split:  # a non-finite loss: the split update is skipped, the state kept
                before = flat(state)
                bad = make_train_step(
                    loss=LossSpec(encoder=encoder, objective=get_objective('test_nan').loss,
                                  views=2),
                    update=UpdateSpec(tx=tx),
                    target=CompileTarget(mesh=mesh, state_shardings=sh, compiler_options=O0,
                                         update_shardings=update_at))
                state, m = bad(state, sharding.assemble_batch(batches[0], mesh))
                res['nan_kept'] = (not np.isfinite(float(m['loss'])) and all(
                    np.array_equal(a, b) for a, b in zip(before, flat(state))))
            mu = state.opt_state[-1][0].mu['bert']['encoder']['layer_0']
            kernels = {'output': mu['output']['dense']['kernel'],
                       'intermediate': mu['intermediate']['dense']['kernel']}
            res[split] = dict(
                params=flat(state.params), opt=flat(state.opt_state), norms=norms,
                step=int(state.step),
                mu={k: [str(v.sharding.spec), list(v.addressable_shards[0].data.shape)]
                    for k, v in kernels.items()})
        whole, split = res[False], res[True]
        out[name] = dict(
            params_equal=all(np.array_equal(a, b) for a, b in zip(whole['params'],
                                                                   split['params'])),
            opt_equal=all(np.array_equal(a, b) for a, b in zip(whole['opt'], split['opt'])),
            param_diff=max(float(np.abs(a - b).max()) for a, b in zip(whole['params'],
                                                                      split['params'])),
            opt_diff=max(float(np.abs(a - b).max()) for a, b in zip(whole['opt'],
                                                                    split['opt'])),
            param_max=max(float(np.abs(a).max()) for a in whole['params']),
            opt_max=max(float(np.abs(a).max()) for a in whole['opt']
                        if np.issubdtype(a.dtype, np.floating)),  # the moments, not counts
            moved=max(float(np.abs(a - b).max()) for a, b in zip(
                whole['params'], flat(init_params(encoder, jax.random.key(0))))),
            clipped=min(whole['norms']) > 0.1, steps=[whole['step'], split['step']],
            mu=split['mu'], whole_mu=whole['mu'], nan_kept=res['nan_kept'])
    print('RESULT' + json.dumps(out), flush=True)
''')


def test_the_split_update_gives_the_state_of_the_whole_update_on_every_mesh():
    out = run_on_cpu_devices(_SCRIPT, str(REPO))
    print(json.dumps(out, indent=1))
    # The moments' spec and per-device block: the output kernel [48, 32] and the intermediate
    # kernel [32, 48], whole (as the parameters) without the split.
    expected = {
        'data8': {'output': ["P('data',)", [6, 32]], 'intermediate': ["P('data',)", [4, 48]]},
        'data4_fsdp2': {'output': ["P('data', 'fsdp')", [12, 16]],
                        'intermediate': ["P('fsdp',)", [16, 48]]},
        'data2_tensor4': {'output': ["P('tensor',)", [12, 32]],
                          'intermediate': ["P('data', 'tensor')", [16, 12]]},
    }
    whole = {'data8': ["P()", "P()"], 'data4_fsdp2': ["P(None, 'fsdp')", "P('fsdp',)"],
             'data2_tensor4': ["P('tensor',)", "P(None, 'tensor')"]}
    for name, r in out.items():
        assert r['steps'] == [3, 3] and r['clipped'] and r['moved'] > 0, (name, r)
        assert r['nan_kept'], (name, r)
        if name == 'data2_tensor4':
            # The tensor split's gradient sums may be planned in another order when the update
            # that follows them changes: rounding, at most 2 ulps of the largest value a step.
            assert r['param_diff'] <= 3 * 2 * ULP * r['param_max'], (name, r)
            assert r['opt_diff'] <= 3 * 2 * ULP * r['opt_max'], (name, r)
        else:
            assert r['params_equal'] and r['opt_equal'], (name, r)
        assert r['mu'] == expected[name], (name, r)
        assert [r['whole_mu'][k][0] for k in ('output', 'intermediate')] == whole[name], r
