"""Sentences or vectors in, checked unit vectors out; cosine similarity between two sets
(`similarity`, the official SimCSE tool's `.similarity`)."""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Union

import numpy as np

from jaxsim.encode import encode
from jaxsim.errors import JaxsimError

TextsOrVectors = Union[str, Sequence[str], np.ndarray]


# Row chunk for host-side passes over big matrices: bounded temporaries, not [n, dim] ones.
_CHUNK_ROWS = 16384


class SearchError(JaxsimError):
    """A search request that cannot be served; the message says what and where."""


class VectorError(SearchError):
    """Vectors of the wrong shape or with NaN/inf values."""


class ModelRef(NamedTuple):
    """What identifies the encoder behind a set of vectors."""

    path: str
    pooler: str


def model_ref(model: Any, pooler: Optional[str] = None) -> ModelRef:
    """The model's path and the pooler `encode` will use: the one place that reads them."""
    return ModelRef(str(model.path), pooler or model.pooler)


def embed(model: Any, sentences: Sequence[str], *, pooler: Optional[str] = None,
          batch_size: int = 64) -> np.ndarray:
    """[len(sentences), hidden] float32 vectors (not normalized) with the model's pooler."""
    return encode(model, list(sentences), pooler=model_ref(model, pooler).pooler,
                  batch_size=batch_size)


def as_matrix(x: Any, what: str, dim: Optional[int] = None) -> np.ndarray:
    """`x` as a finite [n, dim] float32 matrix (a 1-D vector becomes one row).

    Raises:
      VectorError: not 1-D/2-D, a dimension other than the index's `dim` (both named), or
        NaN/inf (the first bad row named).
    """
    try:
        arr = np.asarray(x, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise VectorError(f"{what}: not a numeric array ({e})") from None
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise VectorError(f"{what}: expected a [n, dim] matrix or a [dim] vector, "
                          f"got shape {tuple(arr.shape)}")
    if dim is not None and arr.shape[1] != dim:
        raise VectorError(f"{what} have dimension {arr.shape[1]} but the index has "
                          f"dimension {dim}")
    for start in range(0, len(arr), _CHUNK_ROWS):
        finite = np.isfinite(arr[start: start + _CHUNK_ROWS]).all(axis=1)
        if not finite.all():
            bad = start + int(np.argmin(finite))
            raise VectorError(f"{what}: row {bad} holds NaN or inf (of {len(arr)} rows)")
    return arr


def normalize_rows(x: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Rows scaled to unit L2 norm (into `out` if given); an all-zero row stays zero."""
    out = np.empty(x.shape, np.float32) if out is None else out
    for start in range(0, len(x), _CHUNK_ROWS):
        part = x[start: start + _CHUNK_ROWS]
        norms = np.sqrt(np.einsum("ij,ij->i", part, part))[:, None]
        np.divide(part, np.maximum(norms, 1e-12), out=out[start: start + _CHUNK_ROWS])
    return out


def text_problem(s: str, allow_blank: bool = True) -> Optional[str]:
    """Why `s` cannot be encoded as a sentence, or None.

    A lone surrogate (e.g. a shell argument holding bytes that are not UTF-8, or a JSON
    "\\ud800") makes the tokenizer fail deep inside `encode`, and the index file could not
    store it; a blank query has no words to search by.
    """
    if not allow_blank and not s.strip():
        return "blank"
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"not valid Unicode text ({e.reason}, character {e.start}: {s[e.start]!r})"
    return None


def sentence_list(x: Any, what: str, allow_blank: bool = True) -> list[str]:
    """`x` as a list of encodable strings; `allow_blank=False` refuses blank ones (queries).

    Raises:
      SearchError: not a list of strings, or an item `text_problem` refuses (named by index).
    """
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        raise SearchError(f"{what} must be a list of strings, got {type(x).__name__}")
    for i, s in enumerate(x):
        if not isinstance(s, str):
            raise SearchError(f"{what}[{i}] is a {type(s).__name__}, not a string: {s!r:.60}")
        problem = text_problem(s, allow_blank)
        if problem is not None:
            raise SearchError(f"{what}[{i}] is {problem}")
    return list(x)


def check_top_k(top_k: Any) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
        raise SearchError(f"top_k must be a positive integer, got {top_k!r}")
    return int(top_k)


def _is_single(x: Any) -> bool:
    return isinstance(x, str) or (not isinstance(x, (list, tuple)) and np.ndim(x) == 1)


def _texts(x: Any, what: str) -> Optional[list[str]]:
    """The sentences `x` holds (checked by `sentence_list`), or None when it holds vectors."""
    if isinstance(x, str):
        return sentence_list([x], what)
    if isinstance(x, (list, tuple)) and all(isinstance(s, str) for s in x):
        return sentence_list(x, what)
    return None


def similarity(model: Any, queries: TextsOrVectors, keys: TextsOrVectors, *,
               pooler: Optional[str] = None, batch_size: int = 64) -> Union[float, np.ndarray]:
    """Cosine similarity between queries and keys.

    Args:
      model: a loaded encoder (`jaxsim.load_pretrained`); may be None when both sides are
        vectors.
      queries: a sentence, a list of sentences, or vectors ([dim] or [n, dim]).
      keys: the same kinds as `queries`.
      pooler: pooler for the sentences; default: the model's own.
      batch_size: sentences per encoding batch.

    Returns:
      float32 [n, m] cosines; [m] when `queries` is single; a float when both are single.

    Raises:
      VectorError: NaN vectors, or query and key dimensions that differ (both named).
      SearchError: sentences given without a model.
    """
    q_text, k_text = _texts(queries, "queries"), _texts(keys, "keys")
    if q_text is not None or k_text is not None:
        if model is None:
            raise SearchError("similarity of sentences needs a model (got model=None)")
        encoded = embed(model, (q_text or []) + (k_text or []), pooler=pooler,
                        batch_size=batch_size)
    q = as_matrix(queries, "query vectors") if q_text is None else encoded[:len(q_text)]
    k = as_matrix(keys, "key vectors") if k_text is None else encoded[len(q_text or []):]
    if q.shape[1] != k.shape[1]:
        raise VectorError(f"query vectors have dimension {q.shape[1]} but key vectors have "
                          f"dimension {k.shape[1]}")
    sims = normalize_rows(q) @ normalize_rows(k).T  # [n, m]
    if _is_single(queries):
        sims = sims[0]
        if _is_single(keys):
            return float(sims[0])
    return sims
