"""Affine calibrations `z = (x - mu) @ W`, fitted on unlabeled sentences:

- none: the identity (the raw embeddings), so every row of a report goes through one path.
- whitening[:K] (Su et al. 2021, bojone/BERT-whitening `compute_kernel_bias`):
  `U, s, _ = svd(cov(x))`, `W = U diag(s^-1/2)`, bias `-mu`; keeping the first K columns of
  W keeps the top-K principal directions (dimension reduction).
- sn, standard normalization (BERT-flow paper, Table 3): per-dimension `(x - mu) / std`.
- natsv:K, nulling away the top-K singular vectors (BERT-flow paper, after Mu & Viswanath's
  "all-but-the-top"): center, then project out the top-K principal directions.

Fitting runs in float64 NumPy (an eigendecomposition of a [D, D] covariance), so the identity
covariance holds to ~1e-10 and no JAX tracing happens on bad input. A degenerate covariance
(fewer sentences than dims, constant columns) is handled with a note, or regularized when
`eps > 0` is passed; never NaN. all-MiniLM-L6-v2 really has 3 dead dims (std < 1e-8), so by
default whitening drops null directions (pseudo-inverse) instead of amplifying float noise by
1/sqrt(0); an explicit K above the rank is rejected.
"""
from __future__ import annotations

from typing import Any, Optional

import flax.struct
import numpy as np

from jaxsim.calibrate import base
from jaxsim.calibrate.base import (
    CALIBRATIONS,
    Calibration,
    CalibrationError,
    blas_single_thread,
    check_dim,
    check_embeddings,
)

# Singular values below RANK_RTOL * largest count as zero: float64 SVD of an exactly
# rank-deficient covariance leaves ~1e-16 relative residue, real embeddings sit far above.
RANK_RTOL = 1e-9


class AffineCalibration(Calibration, flax.struct.PyTreeNode):
    """A fitted affine map `z = (x - mu) @ W`; a pytree (mu, W are its leaves).

    Attributes:
      mu: [D] mean subtracted first.
      W: [D, K] projection (K <= D).
      spec: the spec it was fitted from (static).
      note: non-empty when the fit dropped degenerate directions (static).
    """

    mu: np.ndarray
    W: np.ndarray
    spec: str = flax.struct.field(pytree_node=False, default='')
    note: str = flax.struct.field(pytree_node=False, default='')

    linear = True

    def __init_subclass__(cls, **kwargs):
        # Keep the one-line repr of Calibration: no generated repr dumping mu and W.
        kwargs.setdefault('repr', False)
        super().__init_subclass__(**kwargs)

    def __repr__(self) -> str:
        return Calibration.__repr__(self)

    @property
    def dim_in(self) -> int:
        return int(self.W.shape[0])

    @property
    def dim_out(self) -> int:
        return int(self.W.shape[1])

    def __call__(self, x):
        """(x - mu) @ W for NumPy or JAX x [..., D] (jit-able; the result has x's dtype)."""
        return (x - self.mu.astype(x.dtype)) @ self.W.astype(x.dtype)

    def apply(self, x: Any) -> np.ndarray:
        """x [N, D] -> [N, K] float64 numpy."""
        arr = check_embeddings(x, f'{self.spec or "calibration"} input', min_rows=0)
        check_dim(arr, self.dim_in, self.spec or type(self).__name__)
        return (arr - np.asarray(self.mu, np.float64)) @ np.asarray(self.W, np.float64)

    def affine(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.mu, np.float64), np.asarray(self.W, np.float64)

    def describe(self) -> str:
        return f'{self.spec or type(self).__name__}: affine, {self.dim_in} -> {self.dim_out} dims'

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        return ({'dim_in': self.dim_in, 'dim_out': self.dim_out},
                {'mu': np.asarray(self.mu, np.float64), 'W': np.asarray(self.W, np.float64)})

    @classmethod
    def from_state(cls, meta, arrays) -> 'AffineCalibration':
        mu, w = np.asarray(arrays['mu']), np.asarray(arrays['W'])
        if mu.ndim != 1 or w.ndim != 2 or w.shape[0] != mu.shape[0]:
            raise ValueError(f'mu {mu.shape} and W {w.shape} do not form an affine map')
        return cls(mu=mu, W=w)


base.affine_fallback = AffineCalibration


def _check_matrix(x, what: str, eps: float = 0.0) -> np.ndarray:
    """The fit embeddings as float64, and a check of the regularizer `eps`."""
    x = check_embeddings(x, what, np.float64, min_rows=2)
    if not 0 <= eps < np.inf:  # NaN would pass `eps < 0` and poison every vector
        raise CalibrationError(f'{what}: eps must be a finite number >= 0, got {eps}')
    return x


def _constant(std: np.ndarray) -> np.ndarray:
    """Which columns of standard deviations `std` [D] are (near-)constant."""
    return std <= np.sqrt(RANK_RTOL) * max(std.max(), np.finfo(np.float64).tiny)


def _eigh_desc(sym: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues (descending, >= 0) and eigenvectors (columns) of a symmetric PSD matrix."""
    with blas_single_thread():
        s, u = np.linalg.eigh(sym)
    return np.maximum(s[::-1], 0.0), u[:, ::-1]


def _degeneracy(x: np.ndarray) -> str:
    """Why the covariance of x [N, D] is singular, for error messages and notes."""
    n, d = x.shape
    const = np.flatnonzero(_constant(x.std(axis=0)))
    why = []
    if n <= d:
        why.append(f'only {n} sentences for {d} dims')
    if const.size:
        why.append(f'{const.size} (near-)constant columns {const[:8].tolist()}')
    return '; '.join(why) or 'collinear dims'


@CALIBRATIONS.register('none')
class Identity(AffineCalibration):
    """The raw embeddings: mu = 0, W = I."""

    @classmethod
    def fit(cls, x, arg: None = None) -> 'Identity':
        d = _check_matrix(x, 'none').shape[1]
        return cls(mu=np.zeros(d), W=np.eye(d))

    def apply(self, x: Any) -> np.ndarray:
        arr = check_embeddings(x, 'none input', min_rows=0)
        check_dim(arr, self.dim_in, 'none')
        return arr


@CALIBRATIONS.register('whitening')
class Whitening(AffineCalibration):
    """BERT-whitening; 'whitening:K' keeps the top-K principal directions."""

    arg = 'optional'

    @classmethod
    def fit(cls, x, arg: Optional[int] = None, eps: float = 0.0) -> 'Whitening':
        """Fits on x [N, D].

        Args:
          arg: K, keep the top-K principal directions (output [N, K]). Default: all
            directions of non-zero variance, i.e. D, or the covariance rank when it is
            singular (fewer sentences than dims, constant columns): null directions are
            dropped, with a note. A K above the rank is rejected.
          eps: added to the covariance eigenvalues before the inverse square root (Tikhonov
            regularization); with eps > 0 nothing is dropped or rejected.

        Returns:
          W, mu with `cov(apply(x)) = I_K` (eps=0).
        """
        x = _check_matrix(x, 'whitening', eps)
        n, d = x.shape
        if arg is not None and not 1 <= int(arg) <= d:
            raise CalibrationError(f'whitening: k must be in [1, {d}], got {arg}')
        k = d if arg is None else int(arg)
        mu = x.mean(axis=0)
        cov = np.cov(x, rowvar=False)  # [D, D], ddof=1 as in BERT-whitening
        # The covariance is symmetric PSD: its SVD is its eigendecomposition, and eigh is
        # faster than svd (docs/performance.md); flip to descending order, clip negatives to 0.
        s, u = _eigh_desc(cov)
        note = ''
        if eps == 0:
            rank = int((s > RANK_RTOL * max(s[0], np.finfo(np.float64).tiny)).sum())
            if rank == 0:
                raise CalibrationError(f'whitening: all {n} fit embeddings are identical')
            if rank < k:
                if arg is not None:
                    raise CalibrationError(
                        f'whitening: the covariance of the {n}x{d} fit embeddings has rank '
                        f'{rank} ({_degeneracy(x)}): cannot keep k={arg} directions; pass '
                        f'k<={rank}, fit on more sentences, or regularize with eps>0')
                note = (f'whitening: the covariance of the {n}x{d} fit embeddings is singular '
                        f'({_degeneracy(x)}); dropped its {d - rank} null directions, output '
                        f'has {rank} dims')
                k = rank
        w = u[:, :k] / np.sqrt(s[:k] + eps)  # [D, K] = U diag(s^-1/2), top-K columns
        return cls(mu=mu, W=w, note=note)


@CALIBRATIONS.register('sn')
class StandardNormalization(AffineCalibration):
    """Per-dimension `(x - mean) / std` (population std)."""

    @classmethod
    def fit(cls, x, arg: None = None, eps: float = 0.0) -> 'StandardNormalization':
        """Constant columns (zero std) are dropped with a note unless eps > 0 regularizes."""
        x = _check_matrix(x, 'sn', eps)
        mu = x.mean(axis=0)
        std = x.std(axis=0)
        if eps > 0:
            return cls(mu=mu, W=np.diag(1.0 / np.sqrt(std**2 + eps)))
        keep = ~_constant(std)
        if not keep.any():
            raise CalibrationError(f'sn: all {x.shape[0]} fit embeddings are identical')
        w = np.diag(np.where(keep, 1.0 / np.where(keep, std, 1.0), 0.0))[:, keep]
        note = ''
        if not keep.all():
            drop = np.flatnonzero(~keep)
            note = (f'sn: {drop.size} (near-)constant columns {drop[:8].tolist()} have zero '
                    f'std; dropped, output has {int(keep.sum())} dims')
        return cls(mu=mu, W=w, note=note)


@CALIBRATIONS.register('natsv')
class Natsv(AffineCalibration):
    """'natsv:K': center, then null the top-K principal (right singular) directions."""

    arg = 'required'

    @classmethod
    def fit(cls, x, arg: int) -> 'Natsv':
        """Returns mu, W = I - V_k V_k^T ([D, D]); needs 1 <= K < min(N, D)."""
        x = _check_matrix(x, 'natsv')
        n, d = x.shape
        # k = D would null everything (all-zero vectors, undefined cosine).
        if arg is None or not 1 <= int(arg) <= min(n - 1, d - 1):
            raise CalibrationError(f'natsv: k must be in [1, {min(n - 1, d - 1)}], got {arg}')
        mu = x.mean(axis=0)
        xc = x - mu
        # The right singular vectors of the centered X are the eigenvectors of X^T X.
        _, v = _eigh_desc(xc.T @ xc)
        vk = v[:, : int(arg)]  # [D, k]
        return cls(mu=mu, W=np.eye(d) - vk @ vk.T)
