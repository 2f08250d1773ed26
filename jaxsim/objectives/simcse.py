"""SimCSE objectives ('unsup', 'sup') and the alignment/uniformity diagnostics.

All functions are pure and run in float32. Under `jax.jit` with a batch sharded over the mesh
the [N, N] similarity matrix is built from the GLOBAL batch: XLA inserts the all-gather, so the
in-batch negatives come from every device (the reference needs a manual `dist.all_gather`).

Reference: princeton-nlp/SimCSE `simcse/models.py` (`cl_forward`).
"""
from __future__ import annotations

import math

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


def _cross_entropy_diag(logits: jax.Array) -> jax.Array:
    """Mean cross-entropy of [N, M] logits where row i's target is column i (M >= N)."""
    logp = jax.nn.log_softmax(logits, axis=-1)  # [N, M]
    n = logits.shape[0]
    return -jnp.mean(logp[jnp.arange(n), jnp.arange(n)])


def unsup_simcse_loss(z1: jax.Array, z2: jax.Array, temp: float = 0.05) -> jax.Array:
    """InfoNCE with in-batch negatives: row i of `z2` is the positive of row i of `z1`.

    Args:
      z1: [N, D] first view of each sentence.
      z2: [N, D] second view (same sentences, independent dropout) or a paired sentence.
      temp: softmax temperature (0.05 in the paper).

    Returns:
      Scalar float32: cross-entropy of `cos(z1, z2) / temp` with the diagonal as target.
    """
    return _cross_entropy_diag(cosine_matrix(z1, z2) / temp)  # logits [N, N]


def sup_simcse_loss(z1: jax.Array, z2: jax.Array, z3: jax.Array, temp: float = 0.05,
                    hard_negative_weight: float = 0.0) -> jax.Array:
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

    Returns:
      Scalar float32 loss.
    """
    n = z1.shape[0]
    pos = cosine_matrix(z1, z2) / temp  # [N, N]
    neg = cosine_matrix(z1, z3) / temp + hard_negative_weight * jnp.eye(n, dtype=jnp.float32)
    return _cross_entropy_diag(jnp.concatenate([pos, neg], axis=1))  # logits [N, 2N]


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


@register_objective('unsup', views=2, from_single=True)
def unsup(z: jax.Array, temp: float = 0.05):
    """Unsupervised SimCSE: z [B, 2, H], the two views of each sentence (two dropout masks),
    or a sentence and its paired positive. Returns (loss, {'align', 'uniform'})."""
    _check_temp(temp)
    return unsup_simcse_loss(z[:, 0], z[:, 1], temp), _diagnostics(z)


@register_objective('sup', views=3)
def sup(z: jax.Array, temp: float = 0.05, hard_negative_weight: float = 0.0):
    """Supervised SimCSE: z [B, 3, H] = (premise, entailment, contradiction).
    Returns (loss, {'align', 'uniform'})."""
    _check_temp(temp)
    loss = sup_simcse_loss(z[:, 0], z[:, 1], z[:, 2], temp, hard_negative_weight)
    return loss, _diagnostics(z)
