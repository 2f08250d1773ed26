"""Learning-rate schedule and optimizer, as the HF Trainer that SimCSE uses builds them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from jaxsim.train.config import TrainConfig


def make_schedule(cfg: TrainConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then linear decay to 0 at `total_steps`.

    Update k (0-based) uses schedule(k), as HF's `get_linear_schedule_with_warmup` stepped after
    each optimizer step: the first update uses the full rate when there is no warmup.
    """
    warmup = min(cfg.warmup_steps, total_steps)
    decay = optax.linear_schedule(cfg.learning_rate, 0.0, max(total_steps - warmup, 1))
    if warmup == 0:
        return decay
    return optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.learning_rate, warmup), decay], [warmup])


def decay_mask(params):
    """True where weight decay applies: not on biases or LayerNorm (HF Trainer's rule)."""
    flat = traverse_util.flatten_dict(params, sep='/')
    return traverse_util.unflatten_dict(
        {k: not (k.endswith('bias') or 'LayerNorm' in k) for k in flat}, sep='/')


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


def make_optimizer(cfg: TrainConfig, total_steps: int) -> optax.GradientTransformation:
    """Global-norm clipping (when max_grad_norm > 0), then AdamW or plain SGD on the schedule.
    Its `update` takes the gradients' global norm as `grad_norm=` (optional).

    AdamW matches `transformers.AdamW` (bias-corrected moments, decoupled weight decay scaled
    by the learning rate). SGD (no momentum) is the optimizer whose update is a fixed multiple
    of the gradient, which makes cross-mesh comparisons exact up to gradient rounding.
    """
    schedule = make_schedule(cfg, total_steps)
    parts = []
    if cfg.max_grad_norm > 0:
        parts.append(clip_by_global_norm(cfg.max_grad_norm))
    if cfg.optimizer == 'sgd':
        parts.append(optax.sgd(schedule))
        if cfg.weight_decay > 0:
            parts.insert(-1, optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask))
    else:
        parts.append(optax.adamw(schedule, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                                 weight_decay=cfg.weight_decay, mask=decay_mask))
    return optax.chain(*parts)
