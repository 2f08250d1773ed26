"""Learning-rate schedule and optimizer, as the HF Trainer that SimCSE uses builds them."""
from __future__ import annotations

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


def make_optimizer(cfg: TrainConfig, total_steps: int) -> optax.GradientTransformation:
    """Global-norm clipping (when max_grad_norm > 0), then AdamW or plain SGD on the schedule.

    AdamW matches `transformers.AdamW` (bias-corrected moments, decoupled weight decay scaled
    by the learning rate). SGD (no momentum) is the optimizer whose update is a fixed multiple
    of the gradient, which makes cross-mesh comparisons exact up to gradient rounding.
    """
    schedule = make_schedule(cfg, total_steps)
    parts = []
    if cfg.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    if cfg.optimizer == 'sgd':
        parts.append(optax.sgd(schedule))
        if cfg.weight_decay > 0:
            parts.insert(-1, optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask))
    else:
        parts.append(optax.adamw(schedule, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                                 weight_decay=cfg.weight_decay, mask=decay_mask))
    return optax.chain(*parts)
