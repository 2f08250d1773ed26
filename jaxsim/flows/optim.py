"""The flow optimizers: optax.adam, and BERT's AdamWeightDecayOptimizer as BERT-flow runs it.

BERT-flow trains its flow with `optimization_bert_flow.AdamWeightDecayOptimizer` (lr 1e-3
constant, beta 0.9/0.999, eps 1e-6, weight decay 0.01) after `clip_by_global_norm(1.0)`.
That optimizer differs from optax.adamw in two ways, both reproduced here:
  - no bias correction: update = m / (sqrt(v) + eps), so the first steps are ~3x larger;
  - weight decay exempts params whose name matches "LayerNorm", "layer_norm" or "bias"; the
    flow's variables are named b, logs, W, so none is exempt (every one decays).
"""
from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from jaxsim.flows.config import FlowConfig


class ScaleByAdamNoBiasCorrectionState(NamedTuple):
    mu: Any
    nu: Any


def scale_by_adam_no_bias_correction(b1: float = 0.9, b2: float = 0.999,
                                     eps: float = 1e-6) -> optax.GradientTransformation:
    """Adam's moment estimates without bias correction: m / (sqrt(v) + eps).

    BERT's AdamWeightDecayOptimizer computes exactly this (its m and v start at 0 and are
    never rescaled by 1 - beta^t).
    """

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return ScaleByAdamNoBiasCorrectionState(mu=zeros, nu=jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params=None):
        del params
        mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * g * g, state.nu, grads)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
        return updates, ScaleByAdamNoBiasCorrectionState(mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


def decay_mask(params: Any, exclude: tuple[str, ...]) -> Any:
    """Boolean tree: True where weight decay applies (no regex of `exclude` matches the
    '/'-joined param path; BERT's `_do_use_weight_decay` uses re.search on the name)."""
    flat = traverse_util.flatten_dict(params, sep='/')
    return traverse_util.unflatten_dict(
        {k: not any(re.search(r, k) for r in exclude) for k in flat}, sep='/')


def make_optimizer(config: FlowConfig, mask: Any = None) -> optax.GradientTransformation:
    """The optimizer of `config`: [clip] -> adam (bias-corrected or not) -> [decay] -> -lr.

    Args:
      config: the flow config.
      mask: for params that are one flat vector, a boolean vector of the same length saying
        where weight decay applies (default: `decay_mask` of the params tree with
        `config.weight_decay_exclude`).
    """
    parts = []
    if config.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(config.clip_norm))
    adam = (scale_by_adam_no_bias_correction if config.optimizer == 'bert_adamw'
            else optax.scale_by_adam)
    parts.append(adam(eps=config.adam_eps))
    if config.weight_decay > 0:
        if mask is not None:  # elementwise rate: decay * 1 where it applies, * 0 elsewhere
            # NumPy, not jnp: building the optimizer must not run (and compile) device ops.
            parts.append(optax.add_decayed_weights(
                config.weight_decay * np.asarray(mask, np.float32)))
        else:
            parts.append(optax.add_decayed_weights(
                config.weight_decay, mask=lambda p: decay_mask(p, config.weight_decay_exclude)))
    parts.append(optax.scale(-config.learning_rate))
    return optax.chain(*parts)
