"""The optimizer's global-norm clipping: optax's arithmetic, with the norm passed in or not."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxsim.train.config import TrainConfig
from jaxsim.train.optim import clip_by_global_norm, make_optimizer


def _tree(scale):
    key = jax.random.key(0)
    a, b = jax.random.normal(key, (7, 5)), jax.random.normal(jax.random.fold_in(key, 1), (5,))
    return {'dense': {'kernel': a * scale, 'bias': b * scale}}


@pytest.mark.parametrize('scale', [0.01, 10.0])  # below and above the threshold
def test_clip_equals_optax_with_and_without_the_norm(scale):
    grads = _tree(scale)
    reference, ref_state = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    ours = clip_by_global_norm(1.0)
    state = ours.init(grads)
    assert state == ref_state
    norm = optax.tree.norm(grads)
    for out, _ in (ours.update(grads, state), ours.update(grads, state, grad_norm=norm)):
        for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(reference)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    clipped = optax.tree.norm(ours.update(grads, state, grad_norm=norm)[0])
    assert float(clipped) == pytest.approx(min(float(norm), 1.0), rel=1e-6)


def test_adamw_update_is_the_same_given_the_norm():
    cfg = TrainConfig(train_file='x', max_grad_norm=1.0, weight_decay=0.01)
    tx = make_optimizer(cfg, 10)
    params, grads = _tree(1.0), _tree(3.0)
    state = tx.init(params)
    plain = tx.update(grads, state, params)
    given = tx.update(grads, state, params, grad_norm=optax.tree.norm(grads))
    for got, want in zip(jax.tree.leaves(given), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # A different norm changes the moments: the argument is used, not ignored (Adam's first
    # update itself hardly depends on a uniform scale of the gradients).
    other = tx.update(grads, state, params, grad_norm=jnp.float32(100.0))
    moments = lambda s: [x for x in jax.tree.leaves(s) if np.ndim(x) == 2]
    assert not np.allclose(moments(other[1])[0], moments(plain[1])[0])
