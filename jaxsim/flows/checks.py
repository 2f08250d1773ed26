"""Checks on a flow fit's input and progress: a readable error naming the bad row or the
diverged NLL, instead of a NaN deep inside the fit."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxsim.flows.config import FlowConfig, FlowError

# A flow whose NLL exceeds this many nats per dim has blown up (a unit Gaussian is ~1.4; an
# untrained flow on unnormalized vectors can sit in the thousands, diverged fits reach 1e25+).
_ABSURD_NATS_PER_DIM = 1e6


def check_matrix(x: Any, what: str = 'embeddings', min_rows: int = 1, dtype=np.float32,
                 error: type[Exception] = FlowError, rows: str = 'rows',
                 nonfinite: str = 'non-finite values') -> np.ndarray:
    """Validates a [N, D] embedding matrix (finite, non-empty); returns `dtype` numpy.

    Raises:
      error: not 2-D, too few `rows`, or non-finite (naming the first bad row and column).
    """
    try:
        arr = np.asarray(x, dtype=dtype)
    except (TypeError, ValueError) as e:
        raise error(f'{what}: cannot be read as a float array ({e})') from None
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise error(f'{what}: expected a [num_sentences, dim] matrix, got shape {arr.shape}')
    if arr.shape[0] < min_rows:
        raise error(f'{what}: need at least {min_rows} {rows}, got {arr.shape[0]}')
    bad = ~np.isfinite(arr)
    if bad.any():
        row, col = np.argwhere(bad)[0]
        raise error(f'{what}: {nonfinite} (NaN or inf) in {int(bad.any(axis=1).sum())} '
                    f'row(s); the first is row {row}, column {col}')
    return arr


def check_not_diverged(nll: float, init_nll: float, x: np.ndarray, config: FlowConfig,
                       when: str) -> None:
    """Raises FlowError when the NLL (nats per row) is non-finite or has blown up: above
    `_ABSURD_NATS_PER_DIM` per dim and 10x above where it started. An untrained flow on
    unnormalized vectors can start very high (BERT-flow's TF-default actnorm init on few
    channels), which is not divergence as long as training brings it down."""
    dim = x.shape[1]
    if math.isfinite(nll) and (nll / dim <= _ABSURD_NATS_PER_DIM
                               or nll <= 10 * max(init_nll, 1.0)):
        return
    spread = x.std(axis=0)
    constant = np.flatnonzero(spread <= 1e-6 * max(float(np.median(spread)), 1e-30))
    raise FlowError(
        f'flow fit diverged {when}: NLL {nll:.3g} nats ({nll / dim:.3g} per dim, '
        f'{init_nll:.3g} at initialisation) with config {config.describe()}'
        + (f'; the data has {constant.size} constant column(s) {constant[:8].tolist()}'
           if constant.size else '')
        + '. Try a lower learning_rate or clip_norm > 0.')
