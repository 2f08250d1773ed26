"""Label-free post-hoc calibrations of sentence embeddings, as pure functions.

All three are affine maps `z = (x - mu) @ W`, fitted on unlabeled sentences (BERT-flow's
"target" setting, or a corpus):

- BERT-whitening (Su et al. 2021, bojone/BERT-whitening `compute_kernel_bias`):
  `U, s, _ = svd(cov(x))`, `W = U diag(s^-1/2)`, bias `-mu`; keeping the first K columns of
  W keeps the top-K principal directions (dimension reduction).
- SN, standard normalization (BERT-flow paper, Table 3): per-dimension `(x - mu) / std`.
- NATSV, nulling away the top-K singular vectors (BERT-flow paper, after Mu & Viswanath's
  "all-but-the-top"): center, then project out the top-K principal directions.

Fitting runs in float64 NumPy (an SVD of a [D, D] covariance: milliseconds), so the identity
covariance holds to ~1e-10 and no JAX tracing happens on bad input. A degenerate covariance
(fewer sentences than dims, constant columns) is rejected with a message, or regularized
when `eps > 0` is passed; never NaN. all-MiniLM-L6-v2 really has 3 dead dims (std < 1e-8),
so by default whitening drops null directions (pseudo-inverse) with a note instead of
amplifying float noise by 1/sqrt(0); an explicit K above the rank is rejected.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import flax.struct
import numpy as np

# Singular values below RANK_RTOL * largest count as zero: float64 SVD of an exactly
# rank-deficient covariance leaves ~1e-16 relative residue, real embeddings sit far above.
RANK_RTOL = 1e-9


class CalibrationError(ValueError):
    """The embeddings cannot be calibrated as asked (degenerate, non-finite, bad K)."""


class Whitening(flax.struct.PyTreeNode):
    """An affine calibration `z = (x - mu) @ W`.

    Attributes:
      mu: [D] mean subtracted first.
      W: [D, K] projection (K <= D).
      kind: 'whitening', 'sn' or 'natsv' (static; for reports).
      note: non-empty when the fit had to drop degenerate directions (static).
    """

    mu: np.ndarray
    W: np.ndarray
    kind: str = flax.struct.field(pytree_node=False, default='whitening')
    note: str = flax.struct.field(pytree_node=False, default='')

    @property
    def dim_in(self) -> int:
        return int(self.W.shape[0])

    @property
    def dim_out(self) -> int:
        return int(self.W.shape[1])

    def __call__(self, x):
        return apply_whitening(self, x)


def apply_whitening(w: Whitening, x):
    """Applies a fitted calibration: `(x - mu) @ W`.

    Args:
      w: a fitted `Whitening`.
      x: [N, D] embeddings (NumPy or JAX; the result has x's array type).

    Returns:
      [N, K] calibrated embeddings.
    """
    if x.shape[-1] != w.dim_in:
        raise CalibrationError(
            f'{w.kind}: fitted on {w.dim_in}-dim embeddings, got {x.shape[-1]}-dim input')
    return (x - w.mu.astype(x.dtype)) @ w.W.astype(x.dtype)


def check_embeddings(x, what: str = 'embeddings', dtype=np.float32, min_rows: int = 1,
                     error: type = ValueError) -> np.ndarray:
    """Validates a [N, D] embedding matrix before any fitting; returns it as `dtype` numpy.

    Raises:
      `error`: not 2-D, too few rows, or holding NaN/inf (naming the first bad row and column).
    """
    try:
        arr = np.asarray(x, dtype=dtype)
    except (TypeError, ValueError) as e:
        raise error(f'{what}: cannot be read as a float array ({e})') from None
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise error(f'{what}: expected a [num_sentences, dim] matrix, got shape {arr.shape}')
    if arr.shape[0] < min_rows:
        raise error(f'{what}: need at least {min_rows} sentences to fit, got {arr.shape[0]}')
    bad = ~np.isfinite(arr)
    if bad.any():
        row, col = np.argwhere(bad)[0]
        raise error(f'{what}: embeddings contain non-finite values (NaN or inf) in '
                    f'{int(bad.any(axis=1).sum())} row(s); the first is row {row}, column {col}')
    return arr


def _check_matrix(x, what: str) -> np.ndarray:
    return check_embeddings(x, what, np.float64, min_rows=2, error=CalibrationError)


def blas_single_thread():
    """Context limiting BLAS/LAPACK to one thread (when threadpoolctl is installed).

    Why: a [384, 384] eigh takes ~0.05 s on one thread but ~5 s when OpenBLAS's threads spin
    against other busy processes on a small shared CPU; these matrices are too small to gain
    from threads anyway.
    """
    try:
        import threadpoolctl
    except ImportError:
        return contextlib.nullcontext()
    return threadpoolctl.threadpool_limits(1, user_api='blas')


def _eigh_desc(sym: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues (descending, >= 0) and eigenvectors (columns) of a symmetric PSD matrix."""
    with blas_single_thread():
        s, u = np.linalg.eigh(sym)
    return np.maximum(s[::-1], 0.0), u[:, ::-1]


def _check_k(k: Optional[int], d: int, what: str) -> int:
    if k is None:
        return d
    if not 1 <= int(k) <= d:
        raise CalibrationError(f'{what}: k must be in [1, {d}], got {k}')
    return int(k)


def _degeneracy(x: np.ndarray) -> str:
    """Why the covariance of x [N, D] is singular, for error messages and notes."""
    n, d = x.shape
    std = x.std(axis=0)
    const = np.flatnonzero(std <= np.sqrt(RANK_RTOL) * max(std.max(), np.finfo(np.float64).tiny))
    why = []
    if n <= d:
        why.append(f'only {n} sentences for {d} dims')
    if const.size:
        why.append(f'{const.size} (near-)constant columns {const[:8].tolist()}')
    return '; '.join(why) or 'collinear dims'


def fit_whitening(x, k: Optional[int] = None, eps: float = 0.0) -> Whitening:
    """Fits BERT-whitening on unlabeled embeddings.

    Args:
      x: [N, D] embeddings.
      k: keep the top-k principal directions (output [N, k]). Default: all directions of
        non-zero variance, i.e. D, or the covariance rank when it is singular (fewer
        sentences than dims, constant columns): null directions are dropped, with a note,
        rather than amplified by 1/sqrt(0). A k above the rank is rejected.
      eps: added to the covariance eigenvalues before the inverse square root (Tikhonov
        regularization); with eps > 0 nothing is dropped or rejected.

    Returns:
      `Whitening(mu [D], W [D, K])` such that `cov(apply_whitening(w, x)) = I_K` (eps=0).
    """
    x = _check_matrix(x, 'whitening')
    n, d = x.shape
    if eps < 0:
        raise CalibrationError(f'whitening: eps must be >= 0, got {eps}')
    k_req = _check_k(k, d, 'whitening')
    mu = x.mean(axis=0)
    cov = np.cov(x, rowvar=False)  # [D, D], ddof=1 as in BERT-whitening
    # The covariance is symmetric PSD: its SVD is its eigendecomposition. eigh is ~4x faster
    # than svd here; flip to descending order and clip rounding negatives to 0.
    s, u = _eigh_desc(cov)
    note = ''
    if eps == 0:
        rank = int((s > RANK_RTOL * max(s[0], np.finfo(np.float64).tiny)).sum())
        if rank == 0:
            raise CalibrationError(f'whitening: all {n} fit embeddings are identical')
        if rank < k_req:
            if k is not None:
                raise CalibrationError(
                    f'whitening: the covariance of the {n}x{d} fit embeddings has rank {rank} '
                    f'({_degeneracy(x)}): cannot keep k={k} directions; pass k<={rank}, fit on '
                    'more sentences, or regularize with eps>0')
            note = (f'whitening: the covariance of the {n}x{d} fit embeddings is singular '
                    f'({_degeneracy(x)}); dropped its {d - rank} null directions, output has '
                    f'{rank} dims')
            k_req = rank
    w = u[:, :k_req] / np.sqrt(s[:k_req] + eps)  # [D, K] = U diag(s^-1/2), top-K columns
    return Whitening(mu=mu, W=w, kind='whitening', note=note)


def fit_sn(x, eps: float = 0.0) -> Whitening:
    """Fits standard normalization: per-dim `(x - mean) / std` (population std).

    Constant columns (zero std) are dropped with a note unless eps > 0 regularizes them.
    """
    x = _check_matrix(x, 'sn')
    d = x.shape[1]
    mu = x.mean(axis=0)
    std = x.std(axis=0)
    w = np.diag(1.0 / np.sqrt(std**2 + eps)) if eps > 0 else None
    note = ''
    if eps == 0:
        keep = std > np.sqrt(RANK_RTOL) * max(std.max(), np.finfo(np.float64).tiny)
        if not keep.any():
            raise CalibrationError(f'sn: all {x.shape[0]} fit embeddings are identical')
        w = np.zeros((d, d))
        w[np.arange(d), np.arange(d)] = np.where(keep, 1.0 / np.where(keep, std, 1.0), 0.0)
        w = w[:, keep]
        if not keep.all():
            drop = np.flatnonzero(~keep)
            note = (f'sn: {drop.size} (near-)constant columns {drop[:8].tolist()} have zero std; '
                    f'dropped, output has {int(keep.sum())} dims')
    return Whitening(mu=mu, W=w, kind='sn', note=note)


def fit_natsv(x, k: int) -> Whitening:
    """Fits NATSV: center, then null the top-k principal (right singular) directions.

    Args:
      x: [N, D] embeddings.
      k: number of top singular directions to remove (1 <= k < D).

    Returns:
      `Whitening(mu, W = I - V_k V_k^T)` ([D, D]).
    """
    x = _check_matrix(x, 'natsv')
    n, d = x.shape
    # k = D would null everything (all-zero vectors, undefined cosine).
    if k is None or not 1 <= int(k) <= min(n - 1, d - 1):
        raise CalibrationError(f'natsv: k must be in [1, {min(n - 1, d - 1)}], got {k}')
    mu = x.mean(axis=0)
    xc = x - mu
    # The right singular vectors of the centered X are the eigenvectors of X^T X.
    _, v = _eigh_desc(xc.T @ xc)
    vk = v[:, : int(k)]  # [D, k]
    return Whitening(mu=mu, W=np.eye(d) - vk @ vk.T, kind='natsv')


def parse_post(spec: str) -> tuple[str, Optional[int]]:
    """Parses a `--post` value: none | whitening[:K] | sn | natsv:K | flow.

    Returns:
      (kind, k) where k is None when not given.
    """
    kind, _, arg = spec.strip().partition(':')
    kind = kind.lower()
    if kind not in ('none', 'whitening', 'sn', 'natsv', 'flow'):
        raise ValueError(
            f'unknown --post {spec!r}; expected none, whitening[:K], sn, natsv:K, flow')
    k = None
    if arg:
        if kind not in ('whitening', 'natsv'):
            raise ValueError(f'--post {kind} takes no ":K" argument (got {spec!r})')
        try:
            k = int(arg)
        except ValueError:
            raise ValueError(f'--post {spec!r}: K must be an integer') from None
        if k < 1:
            raise ValueError(f'--post {spec!r}: K must be positive')
    if kind == 'natsv' and k is None:
        raise ValueError('--post natsv needs K, e.g. natsv:5')
    return kind, k


def post_label(spec: str) -> str:
    """Row label of a `--post` value: 'whitening:256' -> 'whitening-256'."""
    kind, k = parse_post(spec)
    return kind if k is None else f'{kind}-{k}'


def fit_post(spec: str, x, eps: float = 0.0) -> Optional[Whitening]:
    """Fits the affine calibration named by a `--post` value; None for 'none'.

    'flow' is not affine and is handled by the caller (jaxsim.flows.calibration).
    """
    kind, k = parse_post(spec)
    if kind == 'none':
        return None
    if kind == 'whitening':
        return fit_whitening(x, k, eps=eps)
    if kind == 'sn':
        return fit_sn(x, eps=eps)
    if kind == 'natsv':
        return fit_natsv(x, k)
    raise ValueError(f'fit_post: {spec!r} is not an affine calibration')
