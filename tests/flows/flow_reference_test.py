"""BERT-flow as its code executes it, re-derived in NumPy from bohanli/BERT-flow
(flow/glow_ops_1x1.py, flow/glow_1x1.py, optimization_bert_flow.py) and compared with ours:
the whole Glow forward pass and bits/dim objective, the coupling network, the sigmoid affine
coupling, and the optimizer (clip_by_global_norm + AdamWeightDecayOptimizer)."""
from __future__ import annotations

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from jaxsim.flows import FlowConfig, couplings, layer, load_config_file, make_flow
from jaxsim.flows.optim import decay_mask, make_optimizer

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _config_file(name: str) -> FlowConfig:
    return load_config_file(_ROOT / 'configs' / f'{name}.py')


def _np_actnorm(x, p):
    # glow_ops.actnorm forward: actnorm_center (x + b), then actnorm_scale x * exp(3 logs).
    return (x + p['b']) * np.exp(3.0 * p['logs']), np.sum(3.0 * p['logs'])


def _np_conv_stack(x, p, hidden=2):
    # conv_block: [1x1 conv (no bias) -> actnorm -> relu] x 2; then conv "zeros" with bias and
    # exp(logs * 3) (apply_actnorm=False branch of glow_ops.conv).
    h = x
    for i in range(hidden):
        h = np.maximum((h @ p[f'W_{i}'] + p[f'b_{i}']) * np.exp(3.0 * p[f'logs_{i}']), 0.0)
    return (h @ p['W_out'] + p['b_out']) * np.exp(3.0 * p['logs_out'])


def _np_bert_flow(x, params, levels, depth):
    """glow_ops.encoder_decoder(reverse=False) + Glow.objective_tower, on [N, C] rows."""
    objective = np.zeros(x.shape[0])
    eps = []
    for level in range(levels):
        stack = params[f'l{level}']  # the level's steps, stacked on the leading axis
        for s in range(depth):  # revnet_step: actnorm, invertible (permutation), additive
            step = jax.tree.map(lambda a: a[s], stack)
            x, ld = _np_actnorm(x, step['layers_0_actnorm'])
            objective += ld
            c = x.shape[1]
            w = np.zeros((c, c))
            w[np.arange(c), c - 1 - np.arange(c)] = 1.0  # np_w[i][channels-1-i] = 1
            x = x @ w
            x1, x2 = np.split(x, 2, axis=-1)
            net = step['layers_2_additive_coupling']['shift_net']
            x = np.concatenate([x1, x2 + _np_conv_stack(x1, net)], axis=-1)
        if level < levels - 1:  # split: x2 ~ N(0, 1), eps = x2
            x1, x2 = np.split(x, 2, axis=-1)
            objective += np.sum(-0.5 * (x2 ** 2 + np.log(2 * np.pi)), axis=-1)
            eps.append(x2)
            x = x1
    objective += np.sum(-0.5 * (x ** 2 + np.log(2 * np.pi)), axis=-1)  # top_prior 'normal'
    channels = sum(e.shape[1] for e in eps) + x.shape[1]
    bpd = -objective / (np.log(2) * channels)  # bits per "pixel" of the 1x1xC input
    return np.concatenate(eps + [x], axis=-1), bpd


def _perturb_out(v, scale: float):
    """Moves the zero-initialised output layers so the couplings do something."""
    rng = np.random.default_rng(0)
    return jax.tree_util.tree_map_with_path(
        lambda path, a: a + scale * rng.standard_normal(a.shape).astype(np.float32)
        if str(path[-1].key).endswith('_out') else a, v)


@pytest.fixture(scope='module')
def bert_flow_params():
    cfg = _config_file('flow_bert_flow')
    dim = 32
    module = make_flow(cfg, dim)
    x = np.random.default_rng(0).standard_normal((6, dim)).astype(np.float32)
    v = jax.jit(lambda x: module.init(jax.random.key(3), x, method='forward'))(x)
    return cfg, dim, module, _perturb_out(v, 0.1), x


def test_bert_flow_forward_matches_the_reference_computation(bert_flow_params):
    cfg, dim, module, v, x = bert_flow_params
    z, logdet = jax.jit(lambda v, x: module.apply(v, x, method='forward'))(v, x)
    params = jax.tree.map(lambda a: np.asarray(a, np.float64), v['params'])
    z_ref, bpd_ref = _np_bert_flow(x.astype(np.float64), params, cfg.levels, cfg.depth)
    np.testing.assert_allclose(np.asarray(z), z_ref, rtol=1e-4, atol=1e-4)
    nll = -(-0.5 * np.sum(np.asarray(z, np.float64) ** 2 + np.log(2 * np.pi), -1)
            + np.asarray(logdet))
    np.testing.assert_allclose(nll / (dim * math.log(2)), bpd_ref, rtol=1e-4)
    # The reversal has no parameters; every other variable is one the reference creates.
    assert set(v['params']) == {'l0', 'l1', 'l2'}
    assert set(v['params']['l0']) == {'layers_0_actnorm', 'layers_2_additive_coupling'}
    assert v['params']['l1']['layers_0_actnorm']['b'].shape == (3, 16)  # [depth, channels]


def test_bert_flow_config_is_the_default_and_reads_as_the_reference():
    cfg = _config_file('flow_bert_flow')
    assert cfg == FlowConfig()
    assert (cfg.levels, cfg.depth, cfg.batch_size, cfg.max_epochs, cfg.val_fraction) == (
        3, 3, 64, 1, 0.0)
    assert (cfg.optimizer, cfg.learning_rate, cfg.weight_decay, cfg.adam_eps,
            cfg.clip_norm) == ('bert_adamw', 1e-3, 0.01, 1e-6, 1.0)
    assert not cfg.data_init and cfg.objective == 'bits_per_dim' and cfg.loss_scale == 2.0
    assert [s.layer for s in cfg.step] == ['actnorm', 'reverse', 'additive_coupling']
    assert FlowConfig.from_dict(json.loads(cfg.to_json())) == cfg
    glow = _config_file('flow_glow')
    assert glow.name == 'glow' and glow.data_init and glow.val_fraction == 0.1


def test_sigmoid_affine_coupling_matches_glow_ops_affine_coupling():
    module = couplings.AffineCoupling(6, width=8, scale='sigmoid', net='glow')
    x = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
    v = _perturb_out(module.init(jax.random.key(0), x, method='forward'), 0.5)
    z, logdet = module.apply(v, x, method='forward')
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), v['params']['scale_shift_net'])
    x1, x2 = np.split(x.astype(np.float64), 2, axis=-1)
    h = _np_conv_stack(x1, p)
    shift, scale = h[:, 0::2], 1 / (1 + np.exp(-(h[:, 1::2] + 2.0)))
    np.testing.assert_allclose(np.asarray(z), np.concatenate([x1, (x2 + shift) * scale], -1),
                               rtol=1e-5, atol=1e-6)
    assert np.abs(np.log(scale).sum(-1)).min() > 0.1  # scales far from 1: a real check
    np.testing.assert_allclose(np.asarray(logdet), np.log(scale).sum(-1), rtol=1e-5)


def _np_bert_adamw(params, grads_seq, lr=1e-3, wd=0.01, eps=1e-6, clip=1.0, exclude=()):
    """tf.clip_by_global_norm + optimization_bert_flow.AdamWeightDecayOptimizer, in NumPy."""
    import re

    p = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    s = {k: np.zeros_like(v) for k, v in p.items()}
    for grads in grads_seq:
        norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
        scale = clip / max(norm, clip)
        for k in p:
            g = grads[k].astype(np.float64) * scale
            m[k] = 0.9 * m[k] + 0.1 * g
            s[k] = 0.999 * s[k] + 0.001 * g * g
            update = m[k] / (np.sqrt(s[k]) + eps)
            if not any(re.search(r, k) for r in exclude):
                update = update + wd * p[k]
            p[k] = p[k] - lr * update
    return p


@pytest.mark.parametrize('exclude', [(), ('bias', 'LayerNorm')])
def test_bert_adamw_matches_adam_weight_decay_optimizer(exclude):
    rng = np.random.default_rng(0)
    params = {'a/b': rng.standard_normal(3).astype(np.float32),
              'a/W': rng.standard_normal((3, 2)).astype(np.float32),
              'c/bias': rng.standard_normal(2).astype(np.float32)}
    # Large gradients (clipped) then small ones (not clipped).
    grads_seq = [{k: (rng.standard_normal(v.shape) * scale).astype(np.float32)
                  for k, v in params.items()} for scale in (5.0, 3.0, 0.01, 0.02, 0.1)]
    tx = make_optimizer(FlowConfig(weight_decay_exclude=exclude))

    def nest(d):
        return traverse_util.unflatten_dict({k: jnp.asarray(v) for k, v in d.items()}, sep='/')

    tree = nest(params)
    state = tx.init(tree)
    for g in grads_seq:
        updates, state = tx.update(nest(g), state, tree)
        tree = optax.apply_updates(tree, updates)
    ref = _np_bert_adamw(params, grads_seq, exclude=exclude)
    for k, v in traverse_util.flatten_dict(tree, sep='/').items():
        np.testing.assert_allclose(np.asarray(v), ref[k], rtol=2e-5, atol=1e-7)
    # No bias correction: the first step moves each param by ~lr * 3.16 (not lr).
    first = _np_bert_adamw(params, grads_seq[:1], wd=0.0)
    step = np.abs(first['a/W'] - params['a/W'])
    assert np.all(step > 3e-3) and np.all(step < 3.2e-3)


def test_weight_decay_mask_uses_re_search_on_param_paths():
    params = {'flow': {'actnorm': {'b': 1, 'logs': 2}, 'LayerNorm': {'scale': 3}},
              'dense': {'bias': 4}}
    mask = decay_mask(params, ('LayerNorm', 'layer_norm', 'bias'))
    assert mask == {'flow': {'actnorm': {'b': True, 'logs': True}, 'LayerNorm': {'scale': False}},
                    'dense': {'bias': False}}


def test_glow_net_starts_with_zero_output_and_tf_default_actnorms():
    module = couplings.AdditiveCoupling(64, width=32, net='glow')
    x = np.random.default_rng(2).standard_normal((5, 64)).astype(np.float32)
    v = module.init(jax.random.key(0), x, method='forward')['params']['shift_net']
    assert v['W_0'].shape == (32, 32) and 'bias' not in v  # the convs have no bias
    assert abs(float(np.std(v['W_0'])) - 0.05) < 0.01  # N(0, 0.05)
    limit = math.sqrt(6.0 / 33)  # actnorm (1, 1, 1, width) glorot-uniform
    assert float(np.max(np.abs(v['logs_0']))) <= limit
    for name in ('W_out', 'b_out', 'logs_out'):
        np.testing.assert_array_equal(np.asarray(v[name]), 0.0)
    z, _ = module.apply({'params': {'shift_net': v}}, x, method='forward')
    np.testing.assert_array_equal(np.asarray(z), x)  # a fresh additive coupling: identity
    assert layer('reverse').layer == 'reverse'
