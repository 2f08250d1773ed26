"""The optimizer's global-norm clipping: optax's arithmetic, with the norm passed in or not."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxsim.train.config import TrainConfig
from jaxsim.train.optim import (
    clip_by_global_norm,
    decay_mask,
    fused_adamw,
    make_optimizer,
    make_schedule,
)


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

    def moments(s):
        return [x for x in jax.tree.leaves(s) if np.ndim(x) == 2]

    assert not np.allclose(moments(other[1])[0], moments(plain[1])[0])


def _optax_adamw(max_norm, weight_decay, schedule):
    parts = [optax.clip_by_global_norm(max_norm)] if max_norm > 0 else []
    return optax.chain(*parts, optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8,
                                           weight_decay=weight_decay, mask=decay_mask))


@pytest.mark.parametrize('max_norm', [0.0, 1.0, 50.0])  # none / every step / later steps
@pytest.mark.parametrize('weight_decay', [0.0, 0.1])
def test_fused_adamw_follows_optax_over_steps(max_norm, weight_decay):
    """Five updates from the same start: same state layout, parameters and moments equal to
    optax's chain up to float32 rounding, with masked decay and the norm passed in or not."""
    schedule = optax.linear_schedule(1e-2, 0.0, 10)
    ours = fused_adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay,
                       mask=decay_mask, max_norm=max_norm)
    reference = _optax_adamw(max_norm, weight_decay, schedule)
    params = _tree(1.0)
    state, ref_state = ours.init(params), reference.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)
    ref_params = params
    update = jax.jit(ours.update)
    for step in range(5):
        grads = _tree(3.0 * (step + 1) if max_norm else 0.5 / (step + 1))
        grads = jax.tree.map(lambda g, s=step: g * (-1.0) ** s, grads)
        norm = optax.tree.norm(grads) if step % 2 else None  # both call forms
        updates, state = update(grads, state, params, grad_norm=norm)
        params = optax.apply_updates(params, updates)
        ref_updates, ref_state = reference.update(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, ref_updates)
        for got, want in zip(jax.tree.leaves((params, state)),
                             jax.tree.leaves((ref_params, ref_state))):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-7)
    # Decay only where the mask says: the bias moved by Adam alone, the kernel also decayed.
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), params, _tree(1.0))
    assert moved['dense']['kernel'] > 0 and moved['dense']['bias'] > 0


def test_fused_adamw_clips_by_the_given_norm():
    """A clipped first step divides the gradient by the norm; Adam's first update is nearly
    scale-free, so the second moment (scaled by the norm squared) shows the factor."""
    schedule = optax.constant_schedule(1e-3)
    tx = fused_adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, max_norm=1.0)
    params, grads = _tree(1.0), _tree(10.0)
    state = tx.init(params)
    _, plain = tx.update(grads, state, params)
    _, halved = tx.update(grads, state, params, grad_norm=2.0 * optax.tree.norm(grads))

    def nu(s):
        return s[-1][0].nu['dense']['kernel']

    np.testing.assert_allclose(np.asarray(nu(halved)), np.asarray(nu(plain)) / 4.0, rtol=1e-6)
    unclipped = tx.update(grads, state, params, grad_norm=jnp.float32(0.5))[1]
    np.testing.assert_allclose(np.asarray(nu(unclipped)),
                               0.001 * np.asarray(grads['dense']['kernel']) ** 2, rtol=1e-6)


def test_make_optimizer_is_the_fused_adamw_with_optax_state():
    cfg = TrainConfig(train_file='x', max_grad_norm=1.0, weight_decay=0.01)
    params = _tree(1.0)
    state = make_optimizer(cfg, 10).init(params)
    reference = _optax_adamw(1.0, 0.01, make_schedule(cfg, 10)).init(params)
    assert jax.tree.structure(state) == jax.tree.structure(reference)
