"""SimCSE objectives ('unsup', 'sup') and the alignment/uniformity diagnostics.

All functions are pure and run in float32. Under `jax.jit` with a batch sharded over the mesh
the [N, N] similarity matrix is built from the GLOBAL batch: XLA inserts the all-gather, so the
in-batch negatives come from every device (the reference needs a manual `dist.all_gather`).

Reference: princeton-nlp/SimCSE `simcse/models.py` (`cl_forward`).
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from jaxsim.objectives.base import ObjectiveError, register_objective

_EPS = 1e-8  # torch.nn.CosineSimilarity's eps.


def _normalize(x: jax.Array) -> jax.Array:
    """L2-normalizes rows in float32. x: [N, D] -> [N, D]."""
    x = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
    return x / jnp.maximum(norm, _EPS)


def cosine_matrix(a: jax.Array, b: jax.Array) -> jax.Array:
    """Cosine similarity of every row of `a` [N, D] with every row of `b` [M, D] -> [N, M]."""
    return jnp.einsum('nd,md->nm', _normalize(a), _normalize(b),
                      precision=jax.lax.Precision.HIGHEST)


def _cross_entropy_diag(logits: jax.Array, masked: Optional[jax.Array] = None) -> jax.Array:
    """Mean cross-entropy of [N, M] logits where row i's target is column i (M >= N); columns
    where `masked` [N, M] is True are left out of the softmax (never a row's target)."""
    if masked is not None:
        logits = jnp.where(masked, -jnp.inf, logits)
    logp = jax.nn.log_softmax(logits, axis=-1)  # [N, M]
    n = logits.shape[0]
    return -jnp.mean(logp[jnp.arange(n), jnp.arange(n)])


def _same_text(a: jax.Array, b: jax.Array) -> jax.Array:
    """[N, L] and [M, L] token ids -> [N, M]: row i of `a` holds the same ids as row j of `b`."""
    return jnp.all(a[:, None, :] == b[None, :, :], axis=-1)


def duplicate_negatives(ids: jax.Array, hard_negatives: bool = False) -> jax.Array:
    """Which in-batch negatives are the anchor's own text (false negatives), from token ids.

    Column j of row i (example j's positive) is masked when that sentence equals row i's anchor
    or positive, or when example j's anchor equals row i's anchor (its positive is then a
    positive of row i too: SNLI repeats premises). With `hard_negatives`, N more columns
    (example j's hard negative) are masked when that sentence equals row i's anchor or
    positive. A row's own positive (the diagonal) is never masked.

    Args:
      ids: [N, D, L] token ids; sentence 0 is the anchor, 1 the positive (D = 1: the sentence
        is its own positive), 2 the hard negative.
      hard_negatives: add the hard-negative columns (supervised SimCSE).

    Returns:
      [N, N] bool, or [N, 2N] with `hard_negatives`.
    """
    anchor, positive = ids[:, 0], ids[:, min(1, ids.shape[1] - 1)]
    own = _same_text(anchor, positive) | _same_text(positive, positive)  # [N, N]
    masked = own | _same_text(anchor, anchor)
    masked = masked & ~jnp.eye(ids.shape[0], dtype=bool)
    if hard_negatives:
        hard = ids[:, 2]
        masked = jnp.concatenate([masked, _same_text(anchor, hard) | _same_text(positive, hard)],
                                 axis=1)
    return masked


def unsup_simcse_loss(z1: jax.Array, z2: jax.Array, temp: float = 0.05,
                      masked: Optional[jax.Array] = None) -> jax.Array:
    """InfoNCE with in-batch negatives: row i of `z2` is the positive of row i of `z1`.

    Args:
      z1: [N, D] first view of each sentence.
      z2: [N, D] second view (same sentences, independent dropout) or a paired sentence.
      temp: softmax temperature (0.05 in the paper).
      masked: [N, N] bool, negatives left out of the softmax (`duplicate_negatives`).

    Returns:
      Scalar float32: cross-entropy of `cos(z1, z2) / temp` with the diagonal as target.
    """
    return _cross_entropy_diag(cosine_matrix(z1, z2) / temp, masked)  # logits [N, N]


def sup_simcse_loss(z1: jax.Array, z2: jax.Array, z3: jax.Array, temp: float = 0.05,
                    hard_negative_weight: float = 0.0,
                    masked: Optional[jax.Array] = None) -> jax.Array:
    """Supervised SimCSE over (premise, entailment, contradiction) triplets.

    Each premise is scored against all entailments and all contradictions of the batch. As in
    the reference, `hard_negative_weight` is ADDED to the logit of a premise's own hard negative
    (after dividing by the temperature); 0 gives the plain objective.

    Args:
      z1: [N, D] premises (anchors).
      z2: [N, D] entailment hypotheses (positives, target = same row).
      z3: [N, D] contradiction hypotheses (hard negatives).
      temp: softmax temperature.
      hard_negative_weight: additive logit bonus for the matching hard negative.
      masked: [N, 2N] bool, negatives left out of the softmax (`duplicate_negatives`).

    Returns:
      Scalar float32 loss.
    """
    n = z1.shape[0]
    pos = cosine_matrix(z1, z2) / temp  # [N, N]
    neg = cosine_matrix(z1, z3) / temp + hard_negative_weight * jnp.eye(n, dtype=jnp.float32)
    return _cross_entropy_diag(jnp.concatenate([pos, neg], axis=1), masked)  # logits [N, 2N]


def alignment(x: jax.Array, y: jax.Array, alpha: float = 2.0) -> jax.Array:
    """Alignment of positive pairs (Wang & Isola 2020): E ||f(x) - f(y)||^alpha, normalized.

    Args:
      x: [N, D] embeddings; y: [N, D] their positives.
      alpha: exponent.

    Returns:
      Scalar float32 (lower is better).
    """
    d = jnp.linalg.norm(_normalize(x) - _normalize(y), axis=-1)  # [N]
    return jnp.mean(d ** alpha)


def uniformity(x: jax.Array, t: float = 2.0) -> jax.Array:
    """Uniformity (Wang & Isola 2020): log E_{i<j} exp(-t ||f(x_i) - f(x_j)||^2), normalized.

    Args:
      x: [N, D] embeddings, N >= 2.
      t: temperature of the Gaussian potential.

    Returns:
      Scalar float32 (lower is better).
    """
    u = _normalize(x)
    # ||a - b||^2 = 2 - 2 cos for unit vectors; clip tiny negatives from rounding.
    sq = jnp.maximum(2.0 - 2.0 * jnp.einsum('nd,md->nm', u, u,
                                            precision=jax.lax.Precision.HIGHEST), 0.0)
    n = x.shape[0]
    upper = jnp.triu(jnp.ones((n, n), dtype=bool), k=1)  # pdist's i < j pairs
    logits = jnp.where(upper, -t * sq, -jnp.inf)
    return jax.nn.logsumexp(logits) - jnp.log(n * (n - 1) / 2)


def _check_temp(temp) -> None:
    # Checked when traced with a Python number (from the config), where a bad value is input.
    if isinstance(temp, (int, float)) and not (math.isfinite(temp) and temp > 0):
        raise ObjectiveError(f'temp must be a positive number, got {temp}')


def _diagnostics(z: jax.Array) -> dict[str, jax.Array]:
    """Alignment of the first two views and uniformity of the first, without gradients."""
    z = jax.lax.stop_gradient(z)
    return {'align': alignment(z[:, 0], z[:, 1]), 'uniform': uniformity(z[:, 0])}


def _duplicates(mask_duplicates, ids, hard_negatives: bool) -> Optional[jax.Array]:
    if not isinstance(mask_duplicates, bool):
        raise ObjectiveError(f'mask_duplicates must be true or false, got {mask_duplicates!r}')
    if not mask_duplicates:
        return None
    if ids is None:
        raise ObjectiveError('mask_duplicates needs the batch token ids (the loss\'s ids=)')
    return duplicate_negatives(ids, hard_negatives)


def init_temperature(key, temp: float = 0.05, learn_temperature: bool = False) -> dict:
    """The parameters the SimCSE objectives own: with `learn_temperature`, the log of the
    temperature, starting at the configured `temp` (the log keeps it positive); else none."""
    del key  # deterministic: the configured value
    if not isinstance(learn_temperature, bool):
        raise ObjectiveError(f'learn_temperature must be true or false, got '
                             f'{learn_temperature!r}')
    if not learn_temperature:
        return {}
    _check_temp(temp)
    return {'log_temp': jnp.log(jnp.asarray(temp, jnp.float32))}


def _temperature(temp, learn_temperature: bool, params) -> tuple:
    """(the temperature the loss divides by, aux entries): the learned one (reported as
    'temp') with `learn_temperature`, else the configured number."""
    _check_temp(temp)
    if not learn_temperature:
        return temp, {}
    if params is None or 'log_temp' not in params:
        raise ObjectiveError('learn_temperature needs the objective\'s parameters (the loss\'s '
                             'params=, from init_params)')
    learned = jnp.exp(params['log_temp'].astype(jnp.float32))
    return learned, {'temp': jax.lax.stop_gradient(learned)}


@register_objective('unsup', views=2, from_single=True, init_params=init_temperature,
                    min_batch=2)
def unsup(z: jax.Array, temp: float = 0.05, mask_duplicates: bool = False,
          learn_temperature: bool = False, *, ids=None, params=None):
    """Unsupervised SimCSE: z [B, 2, H], the two views of each sentence (two dropout masks),
    or a sentence and its paired positive. `mask_duplicates` leaves in-batch negatives with
    the anchor's text out of the softmax (`duplicate_negatives`; needs `ids` [B, D, L]).
    `learn_temperature` trains the temperature (from `temp`; `params['log_temp']`).
    Returns (loss, {'align', 'uniform'} and, learned, 'temp')."""
    t, extra = _temperature(temp, learn_temperature, params)
    masked = _duplicates(mask_duplicates, ids, hard_negatives=False)
    return unsup_simcse_loss(z[:, 0], z[:, 1], t, masked), {**_diagnostics(z), **extra}


@register_objective('sup', views=3, init_params=init_temperature)
def sup(z: jax.Array, temp: float = 0.05, hard_negative_weight: float = 0.0,
        mask_duplicates: bool = False, learn_temperature: bool = False, *, ids=None,
        params=None):
    """Supervised SimCSE: z [B, 3, H] = (premise, entailment, contradiction); mask_duplicates
    and learn_temperature as in `unsup` (ids [B, 3, L]). Returns (loss, {'align', 'uniform'}
    and, learned, 'temp')."""
    t, extra = _temperature(temp, learn_temperature, params)
    masked = _duplicates(mask_duplicates, ids, hard_negatives=True)
    loss = sup_simcse_loss(z[:, 0], z[:, 1], z[:, 2], t, hard_negative_weight, masked)
    return loss, {**_diagnostics(z), **extra}
