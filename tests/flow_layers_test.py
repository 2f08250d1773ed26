"""Bijector tests: exact inverses, log-dets against jacfwd, actnorm init, prior, bad dims."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from jaxsim.flows import layers, models, prior
from jaxsim.flows.config import FlowConfig

# Fixed after init by design (the LU permutation and diagonal signs); perturbing them would
# make the "permutation" not a permutation.
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
        names = [getattr(p, 'key', None) for p in path]
        frozen = any(n in _FROZEN for n in names)
        out.append(leaf if frozen else leaf + scale * jax.random.normal(k, leaf.shape))
    return jax.tree_util.tree_unflatten(treedef, out)


def _init(module, x, scale: float = 0.3):
    """Jitted init + perturbation (eager init would compile every primitive on its own)."""
    return jax.jit(lambda x: _perturbed(module.init(jax.random.key(1), x, method='forward'),
                                        scale))(x)


def _fwd(module, v, x):
    return jax.jit(lambda v, x: module.apply(v, x, method='forward'))(v, x)


def _check_bijector(module, variables, x, inv_atol=1e-5, ld_atol=1e-4):
    def run(v, x):
        z, logdet = module.apply(v, x, method='forward')
        x_back = module.apply(v, z, method='inverse')

        def row_logabsdet(r):
            jac = jax.jacfwd(lambda r: module.apply(v, r[None], method='forward').z[0])(r)
            return jnp.linalg.slogdet(jac)[1]

        return z, logdet, x_back, jax.vmap(row_logabsdet)(x)

    # One jitted program per check: op-by-op dispatch would compile every primitive separately.
    z, logdet, x_back, jac_logdet = jax.jit(run)(variables, x)
    assert z.shape == x.shape and logdet.shape == x.shape[:1]
    np.testing.assert_allclose(np.asarray(x_back), np.asarray(x), atol=inv_atol, rtol=0)
    # log|det J| from autodiff, row by row.
    np.testing.assert_allclose(np.asarray(logdet), np.asarray(jac_logdet), atol=ld_atol, rtol=0)
    # The transform must actually do something, else the checks above are vacuous.
    assert float(jnp.max(jnp.abs(z - x))) > 1e-2


# (name, module factory, dim): odd dims exercise uneven halves and the gather path of parity
# masks, even dims the reshape path.
LAYERS = [
    ('actnorm', lambda d: layers.ActNorm(d), 7),
    ('linear', lambda d: layers.InvertibleLinear(d), 7),
    ('linear_lu', lambda d: layers.InvertibleLinearLU(d), 7),
    ('additive_half', lambda d: layers.AdditiveCoupling(d, width=8), 7),
    ('additive_half_flip', lambda d: layers.AdditiveCoupling(d, width=8, flip=True), 7),
    ('additive_parity', lambda d: layers.AdditiveCoupling(d, width=8, mask='parity'), 6),
    ('affine_half', lambda d: layers.AffineCoupling(d, width=8), 7),
    ('affine_parity_flip',
     lambda d: layers.AffineCoupling(d, width=8, mask='parity', flip=True), 6),
    ('affine_parity_odd', lambda d: layers.AffineCoupling(d, width=8, mask='parity'), 7),
]


@pytest.mark.parametrize('name,make,dim', LAYERS, ids=[n for n, _, _ in LAYERS])
def test_layer_inverse_and_logdet(name, make, dim):
    module = make(dim)
    x = _data(dim)
    _check_bijector(module, _init(module, x), x)


def test_additive_coupling_is_volume_preserving_and_affine_is_not():
    x = _data(6)
    add = layers.AdditiveCoupling(6, width=8)
    aff = layers.AffineCoupling(6, width=8)
    _, ld_add = _fwd(add, _init(add, x), x)
    _, ld_aff = _fwd(aff, _init(aff, x), x)
    np.testing.assert_array_equal(np.asarray(ld_add), 0.0)
    assert float(jnp.max(jnp.abs(ld_aff))) > 1e-3


def test_coupling_leaves_conditioning_half_unchanged():
    x = _data(7)
    for mask, flip, kept in [('half', False, [0, 1, 2]), ('half', True, [3, 4, 5, 6]),
                             ('parity', False, [0, 2, 4, 6]), ('parity', True, [1, 3, 5])]:
        module = layers.AffineCoupling(7, width=8, mask=mask, flip=flip)
        z, _ = _fwd(module, _init(module, x), x)
        same = np.where(np.all(np.asarray(z) == np.asarray(x), axis=0))[0]
        assert same.tolist() == kept, (mask, flip)


def test_lu_linear_matches_its_dense_weight():
    module = layers.InvertibleLinearLU(5)
    x = _data(5)
    v = _init(module, x)
    w = module.apply(v, method=layers.InvertibleLinearLU.weight)
    z, logdet = module.apply(v, x, method='forward')
    np.testing.assert_allclose(np.asarray(z), np.asarray(x @ w), atol=1e-5)
    np.testing.assert_allclose(float(logdet[0]), float(jnp.linalg.slogdet(w)[1]), atol=1e-5)
    p = np.asarray(v['params']['lu']['perm'])
    np.testing.assert_array_equal(p @ p.T, np.eye(5))  # a true permutation


def test_lu_perm_and_signs_get_no_gradient():
    module = layers.InvertibleLinearLU(4)
    x = _data(4)
    v = _init(module, x)
    grads = jax.grad(lambda v: jnp.sum(module.apply(v, x, method='forward').z ** 2))(v)
    lu = grads['params']['lu']
    np.testing.assert_array_equal(np.asarray(lu['perm']), 0.0)
    np.testing.assert_array_equal(np.asarray(lu['sign_s']), 0.0)
    assert float(jnp.max(jnp.abs(lu['lower']))) > 0


def test_actnorm_init_from_batch_standardizes_and_is_explicit():
    x = jax.random.normal(jax.random.key(3), (256, 5)) * jnp.array([0.1, 1., 3., 10., 50.]) + 7.0
    module = layers.ActNorm(5)
    v = module.init(jax.random.key(0), x, method='forward')
    # A plain forward call must NOT initialise from data: default actnorm is the identity.
    z0, _ = module.apply(v, x, method='forward')
    np.testing.assert_allclose(np.asarray(z0), np.asarray(x))
    out, new_v = module.apply(v, x, method='init_from_batch', mutable=['params'])
    np.testing.assert_allclose(np.asarray(out.z.mean(0)), 0.0, atol=1e-4)
    np.testing.assert_allclose(np.asarray(out.z.std(0)), 1.0, atol=1e-4)
    z1, logdet = module.apply(new_v, x, method='forward')
    np.testing.assert_allclose(np.asarray(z1), np.asarray(out.z), atol=1e-6)
    expected_ld = -np.sum(np.log(np.asarray(x).std(0)))
    np.testing.assert_allclose(float(logdet[0]), expected_ld, rtol=1e-5)


FLOWS = [
    # Depth 1-2 keeps compile time low; the level/split plumbing is what is new here.
    ('glow_additive_lu', FlowConfig(depth=2, width=8), 8),
    ('glow_affine_dense_l3', FlowConfig(levels=3, depth=1, coupling='affine', lu=False, width=8),
     8),
    ('realnvp_affine_odd', FlowConfig(arch='realnvp', coupling='affine', num_couplings=3,
                                      width=8), 7),
]


@pytest.mark.parametrize('name,config,dim', FLOWS, ids=[f[0] for f in FLOWS])
def test_whole_flow_inverse_and_logdet(name, config, dim):
    module = models.make_flow(config, dim)
    x = _data(dim, n=4)
    v = _init(module, x, scale=0.1)
    _, v = jax.jit(lambda v, x: module.apply(v, x, method='init_from_batch',
                                             mutable=['params']))(v, x)
    _check_bijector(module, v, x)


def test_glow_init_from_batch_standardizes_first_actnorm():
    module = models.make_flow(FlowConfig(width=8, depth=1), 8)
    x = jax.random.normal(jax.random.key(4), (512, 8)) * 20.0 - 5.0

    @jax.jit
    def init(x):
        v = module.init(jax.random.key(0), x, method='forward')
        return module.apply(v, x, method='init_from_batch', mutable=['params'])[1]

    v = init(x)
    first = v['params']['levels_0_0']
    z = x * jnp.exp(first['logscale']) + first['bias']
    np.testing.assert_allclose(np.asarray(z.mean(0)), 0.0, atol=1e-3)
    np.testing.assert_allclose(np.asarray(z.std(0)), 1.0, atol=1e-3)
    # Later actnorms were also initialised (they see the upstream outputs, not x).
    assert float(jnp.max(jnp.abs(v['params']['levels_1_0']['logscale']))) > 0


def test_glow_latent_keeps_dimension_and_norm_at_init():
    module = models.make_flow(FlowConfig(width=8, levels=3, depth=1), 8)
    x = _data(8)
    z, _ = _fwd(module, _init(module, x, scale=0.0), x)
    # At init couplings are identities and the linears rotations: norms are preserved.
    np.testing.assert_allclose(np.linalg.norm(np.asarray(z), axis=1),
                               np.linalg.norm(np.asarray(x), axis=1), rtol=1e-5)


@pytest.mark.parametrize('config,dim', [(FlowConfig(levels=2), 7), (FlowConfig(levels=3), 4),
                                        (FlowConfig(levels=2), 2),
                                        (FlowConfig(arch='realnvp'), 1)])
def test_dimension_that_cannot_be_split_is_rejected(config, dim):
    with pytest.raises(ValueError, match='FlowConfig'):
        models.make_flow(config, dim)


def test_bad_config_values_are_rejected():
    with pytest.raises(ValueError, match='arch'):
        FlowConfig(arch='maf')
    with pytest.raises(ValueError, match='coupling'):
        FlowConfig(coupling='spline')
    with pytest.raises(ValueError, match='val_fraction'):
        FlowConfig(val_fraction=1.0)
    with pytest.raises(ValueError, match='unknown'):
        FlowConfig.from_dict({'levels': 2, 'depht': 3})


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
