"""Learning-rate schedule and optimizer, as the HF Trainer that SimCSE uses builds them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from jaxsim.objectives import owned
from jaxsim.train.config import DEFAULTS, TrainConfig

# The TrainConfig fields the optimizer is built from.
OPTIMIZER_KEYS = ('optimizer', 'learning_rate', 'warmup_steps', 'weight_decay', 'max_grad_norm',
                  'adam_b1', 'adam_b2', 'adam_eps')


def hyperparameters(cfg: TrainConfig) -> dict:
    """The config's optimizer fields (`OPTIMIZER_KEYS`), the keywords of `build_optimizer`."""
    return {k: getattr(cfg, k) for k in OPTIMIZER_KEYS}


def linear_schedule(learning_rate: float, total_steps: int,
                    warmup_steps: int = DEFAULTS['warmup_steps']) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then linear decay to 0 at `total_steps`.

    Update k (0-based) uses schedule(k), as HF's `get_linear_schedule_with_warmup` stepped after
    each optimizer step: the first update uses the full rate when there is no warmup.
    """
    warmup = min(warmup_steps, total_steps)
    decay = optax.linear_schedule(learning_rate, 0.0, max(total_steps - warmup, 1))
    if warmup == 0:
        return decay
    return optax.join_schedules(
        [optax.linear_schedule(0.0, learning_rate, warmup), decay], [warmup])


def make_schedule(cfg: TrainConfig, total_steps: int) -> optax.Schedule:
    """`linear_schedule` of a config."""
    return linear_schedule(cfg.learning_rate, total_steps, cfg.warmup_steps)


def decay_mask(params):
    """True where weight decay applies: not on biases or LayerNorm (HF Trainer's rule), nor on
    the parameters an objective owns (a learned temperature is not pulled towards 1)."""
    flat = traverse_util.flatten_dict(params, sep='/')
    return traverse_util.unflatten_dict(
        {k: not (k.endswith('bias') or 'LayerNorm' in k or k.startswith(owned.KEY + '/'))
         for k in flat}, sep='/')


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """`optax.clip_by_global_norm`, same state and arithmetic, that takes the global norm as
    the extra argument `grad_norm` when the caller has it (the train step computes it for its
    metrics): one pass less over the gradients, which XLA does not merge with the step's own
    norm because the update runs inside a `lax.cond`."""

    def update(updates, state, params=None, *, grad_norm=None, **extra_args):
        del params, extra_args
        norm = optax.tree.norm(updates) if grad_norm is None else jnp.asarray(grad_norm)
        trigger = jnp.squeeze(norm < max_norm)

        def clip(t):
            return jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm)

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def fused_adamw(schedule: optax.Schedule, *, b1: float, b2: float, eps: float,
                weight_decay: float, mask=decay_mask,
                max_norm: float = 0.0) -> optax.GradientTransformationExtraArgs:
    """`chain(clip_by_global_norm(max_norm), optax.adamw(...))` (no clipping when max_norm is
    0) as one elementwise expression per leaf: same state (so checkpoints are interchangeable),
    same arithmetic up to float32 rounding. Its `update` takes the gradients' global norm as
    `grad_norm=` (optional). Why: clipping becomes a scalar factor that fuses into each consumer
    instead of a written-out clipped copy (fewer passes over memory, docs/performance.md).
    """
    parts = [clip_by_global_norm(max_norm)] if max_norm > 0 else []
    reference = optax.chain(*parts, optax.adamw(schedule, b1=b1, b2=b2, eps=eps,
                                                weight_decay=weight_decay, mask=mask))

    def update(grads, state, params=None, *, grad_norm=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError('fused_adamw needs the parameters (decoupled weight decay)')
        clip_state, (adam, masked, scheduled) = state[:-1], state[-1]
        if max_norm > 0:
            norm = optax.tree.norm(grads) if grad_norm is None else jnp.asarray(grad_norm)
            # optax scales by max_norm / norm where norm >= max_norm; a factor of exactly 1
            # otherwise leaves the gradients as they are.
            factor = jnp.where(jnp.squeeze(norm) < max_norm, 1.0, max_norm / norm)
        count = optax.safe_increment(adam.count)
        bias_1 = 1 - b1 ** count
        bias_2 = 1 - b2 ** count
        step_size = -schedule(scheduled.count)
        decayed = mask(params) if callable(mask) else mask

        def leaf(g, m, v, p, decay):
            if max_norm > 0:
                g = g * factor.astype(g.dtype)
            m = (1 - b1) * g + b1 * m
            v = (1 - b2) * g ** 2 + b2 * v
            u = (m / bias_1.astype(m.dtype)) / (jnp.sqrt(v / bias_2.astype(v.dtype)) + eps)
            if decay and weight_decay != 0.0:
                u = u + weight_decay * p
            return jnp.array(step_size, dtype=u.dtype) * u, m, v

        out = jax.tree.map(leaf, grads, adam.mu, adam.nu, params, decayed)
        treedef = jax.tree.structure(grads)
        updates, mu, nu = (jax.tree.unflatten(treedef, leaves)
                           for leaves in zip(*treedef.flatten_up_to(out)))
        new_adam = optax.ScaleByAdamState(count=count, mu=mu, nu=nu)
        new_scheduled = optax.ScaleByScheduleState(count=optax.safe_increment(scheduled.count))
        return updates, (*clip_state, (new_adam, masked, new_scheduled))

    return optax.GradientTransformationExtraArgs(reference.init, update)


def build_optimizer(*, total_steps: int, optimizer: str = DEFAULTS['optimizer'],
                    learning_rate: float = DEFAULTS['learning_rate'],
                    warmup_steps: int = DEFAULTS['warmup_steps'],
                    weight_decay: float = DEFAULTS['weight_decay'],
                    max_grad_norm: float = DEFAULTS['max_grad_norm'],
                    adam_b1: float = DEFAULTS['adam_b1'], adam_b2: float = DEFAULTS['adam_b2'],
                    adam_eps: float = DEFAULTS['adam_eps']) -> optax.GradientTransformation:
    """Global-norm clipping (when max_grad_norm > 0), then AdamW or plain SGD on
    `linear_schedule(learning_rate, total_steps, warmup_steps)`. Keywords and defaults are the
    TrainConfig's fields. Its `update` takes the gradients' global norm as `grad_norm=`
    (optional). AdamW matches `transformers.AdamW` (`fused_adamw`); SGD (no momentum) updates
    by a fixed multiple of the gradient, which makes cross-mesh comparisons exact up to
    gradient rounding.
    """
    if optimizer not in ('adamw', 'sgd'):
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
    schedule = linear_schedule(learning_rate, total_steps, warmup_steps)
    if optimizer != 'sgd':
        return fused_adamw(schedule, b1=adam_b1, b2=adam_b2, eps=adam_eps,
                           weight_decay=weight_decay, mask=decay_mask, max_norm=max_grad_norm)
    parts = [clip_by_global_norm(max_grad_norm)] if max_grad_norm > 0 else []
    if weight_decay > 0:
        parts.append(optax.add_decayed_weights(weight_decay, mask=decay_mask))
    return optax.chain(*parts, optax.sgd(schedule))


def make_optimizer(cfg: TrainConfig, total_steps: int) -> optax.GradientTransformation:
    """`build_optimizer` from a config's fields (`hyperparameters`)."""
    return build_optimizer(total_steps=total_steps, **hyperparameters(cfg))
