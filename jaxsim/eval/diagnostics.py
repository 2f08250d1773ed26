"""Geometry diagnostics of an embedding space.

- alignment and uniformity (Wang & Isola 2020) as SimCSE computes them (`align_loss`,
  `uniform_loss` on L2-normalized vectors; positives = STS-B pairs with gold > 4, uniformity
  over the STS-B sentences);
- anisotropy: the expected cosine between two distinct random sentences (Ethayarajh 2019),
  computed exactly over all pairs;
- the singular-value spectrum of the embedding matrix (a dominant first direction is the
  anisotropy that whitening and flows remove).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from jaxsim.calibrate import blas_single_thread


def _unit(x, pairs_for: str = '') -> np.ndarray:
    """x as unit vectors; at least 2 of them when `pairs_for` names the metric."""
    x = np.asarray(x, np.float64)
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    if (norms == 0).any():
        raise ValueError('diagnostics: a vector is all zeros; its direction is undefined')
    if pairs_for and x.shape[0] < 2:
        raise ValueError(f'{pairs_for}: need at least 2 vectors')
    return x / norms


def alignment(x, y, alpha: float = 2.0) -> float:
    """E ||f(x) - f(x+)||^alpha over positive pairs (rows of x, y), on unit vectors."""
    x, y = _unit(x), _unit(y)
    if x.shape != y.shape or x.shape[0] == 0:
        raise ValueError(
            f'alignment: need two equal non-empty [N, D] arrays, got {x.shape}, {y.shape}')
    return float((np.linalg.norm(x - y, axis=1) ** alpha).mean())


def uniformity(x, t: float = 2.0, chunk: int = 2048) -> float:
    """log E exp(-t ||f(x) - f(y)||^2) over distinct pairs i < j (torch.pdist), unit vectors.

    The mean over i < j equals the mean over all i != j (the kernel is symmetric), and the
    N diagonal terms are exp(0) = 1, so the sum over the full matrix minus N gives it without
    masking. Terms lie in [exp(-4t), 1]: no underflow for the usual t = 2.
    """
    u = _unit(x, 'uniformity')
    n = u.shape[0]
    total = 0.0
    with blas_single_thread():
        for start in range(0, n, chunk):
            sq = np.maximum(2.0 - 2.0 * (u[start: start + chunk] @ u.T), 0.0)  # [c, N]
            total += float(np.exp(-t * sq).sum())
    return float(np.log((total - n) / (n * (n - 1))))


def mean_random_cosine(x) -> float:
    """Mean cosine over all pairs of distinct rows: (||sum u||^2 - N) / (N (N - 1))."""
    u = _unit(x, 'mean_random_cosine')
    n = u.shape[0]
    s = u.sum(axis=0)
    return float((s @ s - n) / (n * (n - 1)))


def singular_values(x) -> np.ndarray:
    """Singular values of the [N, D] embedding matrix, descending (float64)."""
    x = np.asarray(x, np.float64)
    # Via the [D, D] Gram matrix: much cheaper than an SVD of [N, D] for N >> D, and the
    # precision lost on tiny singular values (below ~1e-8 of the largest) does not matter here.
    with blas_single_thread():
        if x.shape[0] > x.shape[1]:
            return np.sqrt(np.maximum(np.linalg.eigvalsh(x.T @ x)[::-1], 0.0))
        return np.linalg.svd(x, compute_uv=False)


def diagnostics(x, pos1: Optional[np.ndarray] = None, pos2: Optional[np.ndarray] = None,
                uniform_x: Optional[np.ndarray] = None) -> dict:
    """All diagnostics as a JSON-ready dict.

    Args:
      x: [N, D] unique evaluated sentence vectors (anisotropy, spectrum).
      pos1, pos2: [P, D] positive pairs (STS-B gold > 4) for alignment, or None.
      uniform_x: [M, D] vectors for uniformity (STS-B sentences), or None.
    """
    s = singular_values(x)
    out = {
        'mean_random_cosine': mean_random_cosine(x),
        'singular_values': [float(v) for v in s],
        # Share of the squared spectrum in the top direction: ~1 for a cone-shaped space.
        'top1_energy': float(s[0] ** 2 / (s**2).sum()),
        'num_sentences': int(x.shape[0]),
    }
    if pos1 is not None and len(pos1):
        out['alignment'] = alignment(pos1, pos2)
        out['num_positive_pairs'] = int(len(pos1))
    if uniform_x is not None:
        out['uniformity'] = uniformity(uniform_x)
    return out
