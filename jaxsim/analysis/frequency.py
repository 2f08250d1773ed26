"""BERT-flow's word-frequency analysis of static token embeddings (Li et al. 2020, Table 1).

The observation that motivates BERT-flow: in BERT's word-piece embedding table, frequent
tokens lie near the origin and close together, rare tokens far from it and sparsely spread, so
the space is anisotropic and sentence vectors inherit the bias. The analysis:

  1. count word pieces on a corpus with the model's tokenizer (special tokens left out);
  2. rank the tokens seen by count (most frequent = rank 0; ties: lower token id first);
  3. per rank bucket (the paper's: 0-100, 100-500, 500-5K, 5K-1000K), the mean L2 norm of the
     tokens' static embeddings, and the mean L2 distance of each token to its k nearest
     neighbours (k = 3) among all ranked tokens.

`analyze` returns the table as plain data for JSON; `plot_frequency` draws it. The k-NN pass is
exact, in row chunks ([chunk, tokens] distances, never [tokens, tokens]).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
from typing import Any, Sequence

import numpy as np

from jaxsim.calibrate import blas_single_thread

# Rank buckets [lo, hi) of the BERT-flow paper.
PAPER_BUCKETS = (0, 100, 500, 5000, 1_000_000)
# Rows of the k-NN distance pass at a time: [chunk, tokens] float32 temporaries.
_CHUNK = 1024


def count_tokens(tokenizer: Any, sentences: Sequence[str], batch: int = 4096) -> np.ndarray:
    """Word-piece counts [len(tokenizer)] over the sentences, special tokens excluded."""
    counts = np.zeros(len(tokenizer), np.int64)
    for start in range(0, len(sentences), batch):
        ids = tokenizer(list(sentences[start: start + batch]), add_special_tokens=False,
                        truncation=False)["input_ids"]
        flat = np.fromiter((i for row in ids for i in row), np.int64)
        counts += np.bincount(flat, minlength=len(counts))[: len(counts)]
    counts[list(tokenizer.all_special_ids)] = 0
    return counts


def rank_tokens(counts: np.ndarray) -> np.ndarray:
    """Ids of the tokens seen (count > 0), most frequent first, ties lower id first."""
    seen = np.flatnonzero(counts > 0)
    return seen[np.lexsort((seen, -counts[seen]))]


def knn_distances(vectors: np.ndarray, k: int) -> np.ndarray:
    """[n] mean L2 distance of each row to its k nearest other rows (exact)."""
    x = np.asarray(vectors, np.float32)
    n = len(x)
    if not 1 <= k < n:
        raise ValueError(f"k must be in [1, {n - 1}] for {n} tokens, got {k}")
    sq = np.einsum("ij,ij->i", x, x)
    out = np.empty(n, np.float64)
    with blas_single_thread():
        for start in range(0, n, _CHUNK):
            part = x[start: start + _CHUNK]
            d2 = sq[start: start + _CHUNK, None] + sq[None, :] - 2.0 * (part @ x.T)
            d2[np.arange(len(part)), np.arange(start, start + len(part))] = np.inf  # self
            nearest = np.partition(d2, k - 1, axis=1)[:, :k]
            out[start: start + len(part)] = np.sqrt(np.maximum(nearest, 0.0)).mean(axis=1)
    return out


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One rank bucket [lo, hi): how many tokens, their mean norm and mean k-NN distance."""

    lo: int
    hi: int
    tokens: int
    mean_norm: float
    mean_knn_distance: float


def frequency_table(embeddings: np.ndarray, ranked: np.ndarray,
                    buckets: Sequence[int] = PAPER_BUCKETS, k: int = 3) -> list[Bucket]:
    """The per-bucket statistics of the rows `ranked` (token ids, most frequent first) of the
    [vocab, dim] `embeddings`: bucket i is ranks [buckets[i], buckets[i+1]); `k` neighbours
    per token, searched among all ranked tokens."""
    if list(buckets) != sorted(set(buckets)) or len(buckets) < 2:
        raise ValueError(f"buckets must be at least two increasing ranks, got {list(buckets)}")
    table = np.asarray(embeddings, np.float32)[ranked]  # [tokens, dim], rank order
    norms = np.linalg.norm(table.astype(np.float64), axis=1)
    knn = knn_distances(table, k)
    rows = []
    for lo, hi in zip(buckets[:-1], buckets[1:]):
        count = len(norms[lo:hi])
        rows.append(Bucket(lo, hi, count, float(norms[lo:hi].mean()) if count else float("nan"),
                           float(knn[lo:hi].mean()) if count else float("nan")))
    return rows


def token_embeddings(model: Any) -> np.ndarray:
    """The word-piece embedding table [vocab, dim] of a loaded SentenceModel."""
    return np.asarray(model.params["bert"]["embeddings"]["word_embeddings"]["embedding"])


def analyze(model: Any, sentences: Sequence[str], *, buckets: Sequence[int] = PAPER_BUCKETS,
            k: int = 3) -> dict:
    """The frequency analysis of `model`'s token embeddings on `sentences`, as plain data."""
    counts = count_tokens(model.tokenizer, sentences)
    ranked = rank_tokens(counts)
    table = frequency_table(token_embeddings(model), ranked, buckets, k)
    return {"model": str(model.path), "sentences": len(sentences),
            "tokens_counted": int(counts.sum()), "tokens_ranked": int(len(ranked)), "k": k,
            "buckets": [dataclasses.asdict(b) for b in table],
            "most_frequent": model.tokenizer.convert_ids_to_tokens(ranked[:20].tolist())}


def plot_frequency(result: dict, path: str | os.PathLike) -> pathlib.Path:
    """Mean norm and mean k-NN distance per rank bucket, side by side: one row for the raw
    table and one per calibration in `result['calibrations']` (each its own scale)."""
    states = [("raw", result)] + [(c["post"], c) for c in result.get("calibrations", [])]
    with saved_figure(path, len(states), 2, figsize=(9, 3.2 * len(states)),
                      squeeze=False) as (fig, axes):
        for (name, state), row in zip(states, axes):
            buckets = [b for b in state["buckets"] if b["tokens"]]
            labels = [f"{_short(b['lo'])}-{_short(b['hi'])}" for b in buckets]
            for ax, key, title in ((row[0], "mean_norm", "mean L2 norm"),
                                   (row[1], "mean_knn_distance",
                                    f"mean distance to {result['k']}-NN")):
                ax.bar(labels, [b[key] for b in buckets], color="#4a7ab5")
                ax.set_xlabel("frequency rank")
                ax.set_title(f"{title} ({name})")
        fig.suptitle(f"Token embeddings by frequency: {pathlib.Path(result['model']).name}")
    return pathlib.Path(path)


@contextlib.contextmanager
def saved_figure(path: str | os.PathLike, *args, **kwargs):
    """`plt.subplots(*args, **kwargs)`, saved to `path` and closed when the block ends."""
    import matplotlib
    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*args, **kwargs)
    yield fig, axes
    fig.tight_layout()
    fig.savefig(pathlib.Path(path), dpi=120)
    plt.close(fig)


def _short(n: int) -> str:
    return f"{n // 1000}K" if n >= 1000 and n % 1000 == 0 else str(n)
