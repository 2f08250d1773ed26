"""jaxsim's BERT-flow against bohanli/BERT-flow's TensorFlow flow, executed.

tests/golden/bert_flow_golden.npz holds what the reference's own code computed (see
make_bert_flow_golden.py): its initial variables, and over 5 optimizer steps on 64-dim rows
the latent z, per-row bits/dim, the flow loss, and its variables after the first and the last
step. jaxsim's flow (configs/flow_bert_flow.py), loaded with the reference's initial variables
and trained by its own fit step, must reproduce all of it within float32 tolerance. Nothing
here reads jaxsim's parameter tree to build the expectation: the names map one to one onto
the reference's variables, and every value compared is one TensorFlow produced.
"""
from __future__ import annotations

import json
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import traverse_util

from jaxsim import sharding
from jaxsim.flows import load_config_file, make_flow
from jaxsim.flows.prior import bits_per_dim
from jaxsim.flows.training import compiled

_ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = pathlib.Path(__file__).with_name('bert_flow_golden.npz')
DIM = 64

# Reference variable (under bert/flow/revnet_<level>/revnet_step_<step>/) -> jaxsim leaf of
# the level's stacked steps.
_STEP_VARIABLES = {
    'actnorm/actnorm_center/b': 'layers_0_actnorm/b',
    'actnorm/actnorm_scale/logs': 'layers_0_actnorm/logs',
}
for _i, _block in enumerate(('1_1', '1_2')):
    _STEP_VARIABLES.update({
        f'additive/nn/conv_block/{_block}/W': f'layers_2_additive_coupling/shift_net/W_{_i}',
        f'additive/nn/conv_block/{_block}/actnorm/actnorm_center/b':
            f'layers_2_additive_coupling/shift_net/b_{_i}',
        f'additive/nn/conv_block/{_block}/actnorm/actnorm_scale/logs':
            f'layers_2_additive_coupling/shift_net/logs_{_i}',
    })
for _name in ('W', 'b', 'logs'):
    _STEP_VARIABLES[f'additive/nn/zeros/{_name}'] = (
        f'layers_2_additive_coupling/shift_net/{_name}_out')
_NAME = re.compile(r'revnet_(\d+)/revnet_step_(\d+)/(.+)')


@pytest.fixture(scope='module')
def golden():
    with np.load(GOLDEN) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope='module')
def config():
    return load_config_file(_ROOT / 'configs' / 'flow_bert_flow.py')


def reference_params(golden: dict, tag: str, config) -> dict:
    """The reference's variables `tag/...` as jaxsim's params tree ([depth, ...] stacks)."""
    leaves: dict[str, dict[int, np.ndarray]] = {}
    for key, value in golden.items():
        if not key.startswith(tag + '/'):
            continue
        level, step, name = _NAME.fullmatch(key[len(tag) + 1:]).groups()
        # TF keeps 1x1-conv kernels as [1, 1, in, out] and per-channel vectors as [1, (1, 1,) C].
        array = value.reshape(value.shape[-2:]) if name.endswith('/W') else value.reshape(-1)
        leaves.setdefault(f'l{level}/{_STEP_VARIABLES[name]}', {})[int(step)] = array
    assert leaves, f'no {tag}/ variables in the golden file'
    return traverse_util.unflatten_dict(
        {path: np.stack([steps[s] for s in range(config.depth)])
         for path, steps in leaves.items()}, sep='/')


def _flat(tree) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(tree, sep='/').items()}


def test_golden_was_made_with_the_shipped_config(golden, config):
    reference = json.loads(str(golden['config_json']))
    assert str(golden['bert_flow_commit']) == '7fa8f6d4a1a73e2c2f8549799d9bafc9d6048d67'
    assert (config.levels, config.depth) == (reference['n_levels'], reference['depth'])
    assert reference['coupling'] == 'additive' and reference['permutation'] is True
    assert reference['coupling_dropout'] == 0.0 and reference['top_prior'] == 'normal'
    assert [s.layer for s in config.step] == ['actnorm', 'reverse', 'additive_coupling']
    assert config.step[2].kwargs()['width'] == reference['coupling_width']


def test_every_reference_variable_is_one_jaxsim_parameter(golden, config):
    model = make_flow(config, DIM)
    abstract = jax.eval_shape(lambda: model.init(
        jax.random.key(0), jnp.zeros((1, DIM), jnp.float32), method='forward'))['params']
    want = {k: v.shape for k, v in traverse_util.flatten_dict(abstract, sep='/').items()}
    for tag in ('init', 'step1', 'final'):
        got = {k: v.shape for k, v in _flat(reference_params(golden, tag, config)).items()}
        assert got == want
    # 11 variables per step, 9 steps: nothing of the reference is left unmapped.
    assert sum(k.startswith('init/') for k in golden) == 99


@pytest.mark.parametrize('tag,step', [('init', 0), ('step1', 1)])
def test_forward_matches_the_reference(golden, config, tag, step):
    model = make_flow(config, DIM)
    params = reference_params(golden, tag, config)
    z, logdet = jax.jit(lambda p, x: model.apply({'params': p}, x, method='forward'))(
        params, golden['x'][step])
    np.testing.assert_allclose(z, golden['z'][step], rtol=1e-4, atol=1e-4)
    # The objective is thousands of nats per row: float32 resolves it to ~1e-7 relative.
    np.testing.assert_allclose(bits_per_dim(z, logdet), golden['bits_per_dim'][step],
                               rtol=1e-5)
    objective_nats = np.abs(golden['bits_per_dim'][step]).max() * DIM * math.log(2)
    np.testing.assert_allclose(logdet, golden['logdet'][step], rtol=0,
                               atol=4e-7 * objective_nats)


@pytest.fixture(scope='module')
def trajectory(golden, config):
    """jaxsim's own fit step (training.compiled) run from the reference's initial variables on
    the reference's batches: (mean NLL per step, params after step 1, params at the end)."""
    mesh = sharding.make_mesh(data=1, devices=jax.devices()[:1])
    programs = compiled(config, DIM, mesh)
    x = golden['x']
    _, opt_state = programs.init(jax.random.key(0), x[0])  # zero moments; params replaced
    params = reference_params(golden, 'init', config)
    nlls, after_first = [], None
    for k in range(x.shape[0]):
        params, opt_state, nll = programs.step(params, opt_state, x[k])
        nlls.append(float(nll))
        if k == 0:
            after_first = jax.device_get(params)
    return np.array(nlls), after_first, jax.device_get(params)


def test_flow_loss_matches_the_reference_at_every_step(golden, config, trajectory):
    nlls, _, _ = trajectory
    # BERT-flow's loss: the means over both sides of the pairs added, in bits/dim.
    loss = config.loss_scale * nlls / (DIM * math.log(2))
    np.testing.assert_allclose(loss, golden['flow_loss'], rtol=1e-5)


@pytest.mark.parametrize('tag', ['step1', 'final'])
def test_optimizer_steps_match_the_reference(golden, config, trajectory, tag):
    """Clipping, AdamWeightDecayOptimizer (no bias correction, decay on every variable):
    each tensor within 1e-3 of its own update since init (its largest element)."""
    _, after_first, final = trajectory
    got = _flat(after_first if tag == 'step1' else final)
    want = _flat(reference_params(golden, tag, config))
    init = _flat(reference_params(golden, 'init', config))
    for path in sorted(want):
        update = np.abs(want[path] - init[path]).max()
        # Every variable has moved by the end; after one step the zero conv's logs has not
        # (its gradient is 0 while the conv's output is 0), and then neither may ours.
        assert update > 0 or (tag == 'step1' and path.endswith('logs_out')), path
        error = np.abs(got[path] - want[path]).max()
        assert error <= 1e-3 * update, (
            f'{path}: |jaxsim - reference| {error:.3g}, update {update:.3g}')


def test_top_level_actnorm_starts_in_the_references_range(golden, config):
    """The reference never runs its data-dependent init: b and logs keep TF's default
    glorot-uniform draw, U(-l, l) with l = sqrt(6 / (1 + C)). jaxsim's own init draws from the
    same law (two-sample KS test against the reference's draw, level by level)."""
    model = make_flow(config, DIM)
    ours = _flat(jax.jit(lambda: model.init(
        jax.random.key(1), jnp.zeros((1, DIM), jnp.float32), method='forward'))()['params'])
    reference = _flat(reference_params(golden, 'init', config))
    for level, channels in enumerate(config.level_dims(DIM)):
        limit = math.sqrt(6.0 / (1 + channels))
        for name in ('b', 'logs'):
            path = f'l{level}/layers_0_actnorm/{name}'
            for draw in (reference[path], ours[path]):
                assert np.abs(draw).max() <= limit
                assert np.abs(draw).max() >= 0.9 * limit  # spans the range, not near zero
            assert scipy.stats.ks_2samp(reference[path].ravel(), ours[path].ravel()).pvalue > 1e-3
