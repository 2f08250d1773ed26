"""Approximate top-k for large corpora on CPU, through faiss (the optional `ann` extra).

    build_index(model, corpus, method="ivf")     # inverted lists: k-means cells, probe a few
    build_index(model, corpus, method="hnsw")    # a navigable small-world graph

Both use inner product on the index's unit rows, so scores are cosines as in the exact search.
The structure is built from the stored rows on first search (and again after rows are added),
saved beside the vectors as `ann.faiss`, and loaded from there. Settings, recall and speed:
docs/search.md.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import numpy as np

from jaxsim.search.vectors import SearchError

METHODS = ("exact", "ivf", "hnsw")
# IVF k-means training rows per cell: faiss warns under 39; more buys little cell quality.
TRAIN_ROWS_PER_CELL = 64


@dataclasses.dataclass(frozen=True)
class AnnOptions:
    """Settings of an approximate index (None: chosen from the row count when built)."""

    nlist: Optional[int] = None
    nprobe: int = 16
    m: int = 32
    ef_construction: int = 80
    ef_search: int = 64

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise SearchError(f"ann option {field.name} must be a positive integer, got "
                                  f"{value!r}")

    @classmethod
    def from_dict(cls, values: Optional[dict]) -> "AnnOptions":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values or {}) - names)
        if unknown:
            raise SearchError(f"unknown ann option(s) {unknown}; known: {sorted(names)}")
        return cls(**(values or {}))


def check_method(method: str) -> None:
    if method not in METHODS:
        raise SearchError(f"method must be one of {', '.join(METHODS)}; got {method!r}")


def _faiss():
    try:
        import faiss  # optional: only approximate indexes need it
    except ImportError:
        raise SearchError("approximate search (method 'ivf' or 'hnsw') needs faiss: "
                          "pip install 'jaxsim[ann]' (faiss-cpu)") from None
    return faiss


def default_nlist(rows: int) -> int:
    """About 4 * sqrt(rows) cells, with at least 39 training rows per cell (faiss's minimum
    for a stable k-means), at least 1."""
    return max(1, min(int(4 * math.sqrt(rows)), rows // 39))


def build(method: str, vectors: np.ndarray, options: AnnOptions) -> Any:
    """A faiss index (ivf or hnsw) over `vectors` [n, dim] (unit rows), by inner product."""
    faiss = _faiss()
    dim = vectors.shape[1]
    data = np.ascontiguousarray(vectors, np.float32)
    if method == "ivf":
        nlist = options.nlist or default_nlist(len(data))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist,
                                   faiss.METRIC_INNER_PRODUCT)
        if nlist == 1:  # one cell holds every row: no k-means to warn about (a small corpus)
            index.cp.min_points_per_centroid = 1
        # k-means on a sample of TRAIN_ROWS_PER_CELL rows a cell: at 1M rows and 4000 cells,
        # faiss's own cap (256 a cell) would cost ~31 TFLOP of training, this ~8.
        cap = TRAIN_ROWS_PER_CELL * nlist
        sample = data if len(data) <= cap else data[
            np.sort(np.random.default_rng(0).choice(len(data), cap, replace=False))]
        index.train(sample)
    else:  # hnsw
        index = faiss.IndexHNSWFlat(dim, options.m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = options.ef_construction
    index.add(data)
    return index


def search(index: Any, method: str, options: AnnOptions, queries: np.ndarray,
           k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores [q, k] float32, rows [q, k] int64), best first; unfilled slots are row -1."""
    if method == "ivf":
        index.nprobe = min(options.nprobe, index.nlist)
    else:
        index.hnsw.efSearch = max(options.ef_search, k)
    scores, rows = index.search(np.ascontiguousarray(queries, np.float32), k)
    return scores.astype(np.float32), rows.astype(np.int64)


def to_bytes(index: Any) -> bytes:
    return _faiss().serialize_index(index).tobytes()


def from_bytes(data: bytes) -> Any:
    return _faiss().deserialize_index(np.frombuffer(data, np.uint8))
