"""Bijectors and whole flows: exact inverses, log-dets against slogdet(jacfwd), actnorm init,
the latent layout, the prior, bad dims and configs, and a user-registered layer."""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from jaxsim import compile_options
from jaxsim.flows import (
    FLOW_LAYERS,
    FlowConfig,
    FlowError,
    FlowOutput,
    couplings,
    layer,
    layers,
    make_flow,
    prior,
)

# The tiny programs here run once: XLA:CPU's cheapest compile (-O0, classic emitters).
_jit = functools.partial(jax.jit, compiler_options=compile_options.for_effort(
    jax.local_devices(), 'none'))

# Fixed after init by design (the LU permutation and diagonal signs).
_FROZEN = ('perm', 'sign_s')


def _data(dim: int, n: int = 5, seed: int = 0) -> jax.Array:
    # Shifted and scaled so that actnorm / couplings see non-trivial inputs.
    return jax.random.normal(jax.random.key(seed), (n, dim)) * 1.5 + 0.3


def _perturbed(variables, scale: float = 0.3, seed: int = 7):
    """Random-ish params: couplings start as the identity, which would test nothing."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(variables)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for (path, leaf), k in zip(leaves, keys):
        frozen = any(getattr(p, 'key', None) in _FROZEN for p in path)
        out.append(leaf if frozen else leaf + scale * jax.random.normal(k, leaf.shape))
    return jax.tree_util.tree_unflatten(treedef, out)


def _init(module, x, scale: float = 0.3):
    """Jitted init + perturbation (eager init would compile every primitive on its own)."""
    return _jit(lambda x: _perturbed(module.init(jax.random.key(1), x, method='forward'),
                                        scale))(x)


def _fwd(module, v, x):
    return _jit(lambda v, x: module.apply(v, x, method='forward'))(v, x)


def _check_bijector(module, variables, x, inv_atol=1e-5, ld_atol=1e-4):
    def run(v, x):
        z, logdet = module.apply(v, x, method='forward')
        x_back = module.apply(v, z, method='inverse')

        def row_logabsdet(r):
            jac = jax.jacfwd(lambda r: module.apply(v, r[None], method='forward').z[0])(r)
            return jnp.linalg.slogdet(jac)[1]

        return z, logdet, x_back, jax.vmap(row_logabsdet)(x)

    # One jitted program per check: op-by-op dispatch would compile every primitive separately.
    z, logdet, x_back, jac_logdet = _jit(run)(variables, x)
    assert z.shape == x.shape and logdet.shape == x.shape[:1]
    np.testing.assert_allclose(np.asarray(x_back), np.asarray(x), atol=inv_atol, rtol=0)
    np.testing.assert_allclose(np.asarray(logdet), np.asarray(jac_logdet), atol=ld_atol, rtol=0)
    # The transform must actually do something, else the checks above are vacuous.
    assert float(jnp.max(jnp.abs(z - x))) > 1e-2


# (name, module factory, dim): odd dims exercise uneven halves and the gather path of parity
# masks, even dims the reshape path.
LAYERS = [
    ('actnorm', lambda d: layers.ActNorm(d), 7),
    ('actnorm_tf_input_bias',
     lambda d: layers.ActNorm(d, initialization='tf_default', logscale_factor=3.0,
                              bias='input'), 7),
    ('reverse', lambda d: layers.Reverse(d), 6),
    ('linear', lambda d: layers.InvertibleLinear(d), 7),
    ('linear_lu', lambda d: layers.InvertibleLinearLU(d), 7),
    ('additive_half', lambda d: couplings.AdditiveCoupling(d, width=8), 7),
    ('additive_half_flip', lambda d: couplings.AdditiveCoupling(d, width=8, flip=True), 7),
    ('additive_parity', lambda d: couplings.AdditiveCoupling(d, width=8, mask='parity'), 6),
    ('additive_glow_net', lambda d: couplings.AdditiveCoupling(d, width=8, net='glow'), 6),
    ('affine_half', lambda d: couplings.AffineCoupling(d, width=8), 7),
    ('affine_parity_flip',
     lambda d: couplings.AffineCoupling(d, width=8, mask='parity', flip=True), 6),
    ('affine_parity_odd', lambda d: couplings.AffineCoupling(d, width=8, mask='parity'), 7),
    ('affine_sigmoid_glow',
     lambda d: couplings.AffineCoupling(d, width=8, scale='sigmoid', net='glow'), 6),
]


@pytest.mark.parametrize('name,make,dim', LAYERS, ids=[n for n, _, _ in LAYERS])
def test_layer_inverse_and_logdet(name, make, dim):
    module = make(dim)
    x = _data(dim)
    _check_bijector(module, _init(module, x), x)


def test_every_shipped_layer_is_registered():
    assert {'actnorm', 'reverse', 'linear', 'linear_lu', 'additive_coupling',
            'affine_coupling'} <= set(FLOW_LAYERS.names())
    assert FLOW_LAYERS.get('additive_coupling') is couplings.AdditiveCoupling


def test_reverse_is_the_anti_identity_without_params():
    x = _data(5)
    module = layers.Reverse(5)
    v = module.init(jax.random.key(0), x, method='forward')
    assert not jax.tree.leaves(v)
    z, logdet = module.apply(v, x, method='forward')
    anti = np.eye(5)[::-1]  # BERT-flow's kernel: w[i][C-1-i] = 1
    np.testing.assert_array_equal(np.asarray(z), np.asarray(x) @ anti)
    np.testing.assert_array_equal(np.asarray(logdet), 0.0)


def test_additive_coupling_is_volume_preserving_and_affine_is_not():
    x = _data(6)
    add = couplings.AdditiveCoupling(6, width=8)
    aff = couplings.AffineCoupling(6, width=8)
    _, ld_add = _fwd(add, _init(add, x), x)
    _, ld_aff = _fwd(aff, _init(aff, x), x)
    np.testing.assert_array_equal(np.asarray(ld_add), 0.0)
    assert float(jnp.max(jnp.abs(ld_aff))) > 1e-3


def test_coupling_leaves_conditioning_half_unchanged():
    x = _data(7)
    for mask, flip, kept in [('half', False, [0, 1, 2]), ('half', True, [3, 4, 5, 6]),
                             ('parity', False, [0, 2, 4, 6]), ('parity', True, [1, 3, 5])]:
        module = couplings.AffineCoupling(7, width=8, mask=mask, flip=flip)
        z, _ = _fwd(module, _init(module, x), x)
        same = np.where(np.all(np.asarray(z) == np.asarray(x), axis=0))[0]
        assert same.tolist() == kept, (mask, flip)


def test_lu_linear_matches_its_dense_weight_and_freezes_perm():
    module = layers.InvertibleLinearLU(5)
    x = _data(5)
    v = _init(module, x)
    w = module.apply(v, method=layers.InvertibleLinearLU.weight)
    z, logdet = module.apply(v, x, method='forward')
    np.testing.assert_allclose(np.asarray(z), np.asarray(x @ w), atol=1e-5)
    np.testing.assert_allclose(float(logdet[0]), float(jnp.linalg.slogdet(w)[1]), atol=1e-5)
    p = np.asarray(v['params']['lu']['perm'])
    np.testing.assert_array_equal(p @ p.T, np.eye(5))  # a true permutation
    grads = jax.grad(lambda v: jnp.sum(module.apply(v, x, method='forward').z ** 2))(v)
    np.testing.assert_array_equal(np.asarray(grads['params']['lu']['perm']), 0.0)
    np.testing.assert_array_equal(np.asarray(grads['params']['lu']['sign_s']), 0.0)
    assert float(jnp.max(jnp.abs(grads['params']['lu']['lower']))) > 0


def test_actnorm_init_from_batch_standardizes_and_is_explicit():
    x = jax.random.normal(jax.random.key(3), (256, 5)) * jnp.array([0.1, 1., 3., 10., 50.]) + 7.0
    for bias in ('output', 'input'):
        module = layers.ActNorm(5, bias=bias)
        v = module.init(jax.random.key(0), x, method='forward')
        # A plain forward call must NOT initialise from data: a fresh actnorm is the identity.
        np.testing.assert_allclose(np.asarray(module.apply(v, x, method='forward').z), x)
        out, new_v = module.apply(v, x, method='init_from_batch', mutable=['params'])
        np.testing.assert_allclose(np.asarray(out.z.mean(0)), 0.0, atol=1e-4)
        np.testing.assert_allclose(np.asarray(out.z.std(0)), 1.0, atol=1e-4)
        z1, logdet = module.apply(new_v, x, method='forward')
        np.testing.assert_allclose(np.asarray(z1), np.asarray(out.z), atol=1e-5)
        np.testing.assert_allclose(float(logdet[0]), -np.sum(np.log(np.asarray(x).std(0))),
                                   rtol=1e-5)


def test_actnorm_init_does_not_amplify_degenerate_channels():
    # A channel with no spread in the init batch is centered, gain 1: a floored-std gain
    # (1e3 per actnorm) compounds once training makes the channel move (RealNVP: NLL 1e30).
    x = np.asarray(_data(4, n=300)) * np.array([1.0, 2.0, 1.0, 3.0], np.float32)
    x[:, 1] = 0.25
    x[:, 2] = 0.5 + 1e-7 * np.random.default_rng(0).standard_normal(300)
    module = layers.ActNorm(4)
    v = module.init(jax.random.key(0), x, method='forward')
    out, new_v = module.apply(v, x, method='init_from_batch', mutable=['params'])
    logs = np.asarray(new_v['params']['logs'])
    np.testing.assert_array_equal(logs[[1, 2]], 0.0)
    np.testing.assert_allclose(np.asarray(out.z)[:, [0, 3]].std(0), 1.0, atol=1e-4)
    np.testing.assert_allclose(np.asarray(out.z)[:, [1, 2]], 0.0, atol=1e-6)


def test_tf_default_actnorm_init_is_glorot_uniform_of_a_1x1x1xC_variable():
    c = 384
    module = layers.ActNorm(c, initialization='tf_default', logscale_factor=3.0, bias='input')
    v = module.init(jax.random.key(0), jnp.zeros((1, c)), method='forward')['params']
    limit = math.sqrt(6.0 / (1 + c))  # fan_in 1, fan_out C
    for name in ('b', 'logs'):
        a = np.asarray(v[name])
        assert a.min() >= -limit and a.max() <= limit
        # A uniform draw fills its range: the extremes sit within a few percent of the limit.
        assert a.max() > 0.95 * limit and a.min() < -0.95 * limit
        assert scipy.stats.kstest(a / limit, 'uniform', args=(-1, 2)).pvalue > 1e-3
    x = np.asarray(_data(c, n=3))
    z, logdet = module.apply({'params': v}, x, method='forward')
    s = 3.0 * np.asarray(v['logs'])
    np.testing.assert_allclose(np.asarray(z), (x + np.asarray(v['b'])) * np.exp(s), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(logdet), s.sum(), rtol=1e-5)


FLOWS = [
    # Depth 1-2 keeps compile time low; the level/split plumbing is what is new here.
    ('bert_flow_l3', FlowConfig(depth=1, step=(
        layer('actnorm', initialization='tf_default', logscale_factor=3.0, bias='input'),
        layer('reverse'), layer('additive_coupling', width=8, net='glow'))), 8),
    ('glow_affine_lu', FlowConfig(levels=2, depth=1, step=(
        layer('actnorm'), layer('linear_lu'), layer('affine_coupling', width=8))), 8),
    ('realnvp_odd', FlowConfig(levels=1, depth=1, step=(
        layer('actnorm'), layer('affine_coupling', width=8, mask='parity'),
        layer('affine_coupling', width=8, mask='parity', flip=True))), 7),
]


@pytest.mark.parametrize('name,config,dim', FLOWS, ids=[f[0] for f in FLOWS])
def test_whole_flow_inverse_and_logdet(name, config, dim):
    module = make_flow(config, dim)
    x = _data(dim, n=4)
    v = _init(module, x, scale=0.1)
    _, v = _jit(lambda v, x: module.apply(v, x, method='init_from_batch',
                                         mutable=['params']))(v, x)
    _check_bijector(module, v, x)


def test_latent_layout_is_splits_then_top():
    # With only reversals, the layout is visible: BERT-flow returns concat(eps + [z]) with the
    # second half of each level factored out.
    cfg = FlowConfig(levels=3, depth=1, step=(layer('reverse'),))
    module = make_flow(cfg, 8)
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    v = module.init(jax.random.key(0), x, method='forward')
    assert not jax.tree.leaves(v)  # reversals have no parameters
    z, logdet = module.apply(v, x, method='forward')
    r0 = x[:, ::-1]  # level 0 (8 channels)
    r1 = r0[:, :4][:, ::-1]  # level 1 keeps the first half, reversed
    r2 = r1[:, :2][:, ::-1]  # level 2
    np.testing.assert_array_equal(np.asarray(z), np.concatenate([r0[:, 4:], r1[:, 2:], r2], 1))
    np.testing.assert_array_equal(np.asarray(module.apply(v, z, method='inverse')), x)
    np.testing.assert_array_equal(np.asarray(logdet), 0.0)


@pytest.mark.parametrize('levels,dim', [(2, 7), (3, 4), (2, 2), (1, 1)])
def test_dimension_that_cannot_be_split_is_rejected(levels, dim):
    with pytest.raises(FlowError, match='FlowConfig'):
        make_flow(FlowConfig(levels=levels), dim)


def test_bad_config_values_are_rejected():
    with pytest.raises(FlowError, match="unknown flow layer 'maf'"):
        FlowConfig(step=(layer('maf'),))
    with pytest.raises(FlowError, match='objective'):
        FlowConfig(objective='bpd')
    with pytest.raises(FlowError, match='val_fraction'):
        FlowConfig(val_fraction=1.0)
    with pytest.raises(FlowError, match='unknown'):
        FlowConfig.from_dict({'levels': 2, 'depht': 3})
    # Layer options are checked when the flow is built, before anything is compiled.
    with pytest.raises(FlowError, match="'affine_coupling'.*scale='exp'"):
        make_flow(FlowConfig(step=(layer('affine_coupling', scale='exp'),)), 8)
    with pytest.raises(FlowError, match="'actnorm'.*wdth"):
        make_flow(FlowConfig(step=(layer('actnorm', wdth=3),)), 8)


@FLOW_LAYERS.register('test_shift_scale', replace=True)
class ShiftScale(nn.Module):
    """A user-defined bijector: z = 2 x + 1 (logdet D log 2)."""

    features: int
    factor: float = 2.0

    def forward(self, x):
        return FlowOutput(self.factor * x + 1.0,
                          jnp.full(x.shape[:1], self.features * jnp.log(self.factor)))

    def inverse(self, z):
        return (z - 1.0) / self.factor


def test_user_registered_layer_is_usable_in_a_config():
    cfg = FlowConfig(levels=2, depth=1, step=(layer('test_shift_scale', factor=3.0),))
    assert FlowConfig.from_dict(cfg.to_dict()) == cfg  # configs name layers: JSON round trip
    module = make_flow(cfg, 4)
    x = np.asarray(_data(4, n=3))
    v = module.init(jax.random.key(0), x, method='forward')
    z, logdet = module.apply(v, x, method='forward')
    l0 = 3 * x + 1
    expected = np.concatenate([l0[:, 2:], 3 * l0[:, :2] + 1], axis=1)
    np.testing.assert_allclose(np.asarray(z), expected, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(logdet), 6 * math.log(3.0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(module.apply(v, z, method='inverse')), x, rtol=1e-5)


def test_prior_and_nll_units():
    z = np.array([[0.5, -1.0, 2.0], [0.0, 0.0, 0.0]], np.float32)
    logdet = np.array([0.25, -1.0], np.float32)
    expected_lp = scipy.stats.multivariate_normal(np.zeros(3), np.eye(3)).logpdf(z)
    np.testing.assert_allclose(np.asarray(prior.standard_normal_logprob(z)), expected_lp,
                               rtol=1e-6)
    nll = np.asarray(prior.nll_nats(z, logdet))
    np.testing.assert_allclose(nll, -(expected_lp + logdet), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(prior.bits_per_dim(z, logdet)),
                               nll / (3 * math.log(2)), rtol=1e-6)
