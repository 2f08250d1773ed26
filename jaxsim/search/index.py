"""A searchable set of sentence vectors: build, add, exact top-k cosine search, save and load.

The features of the official SimCSE tool's `build_index` / `search` (docs/search.md), on a
row-sharded JAX corpus (`jaxsim.search.topk`); `corpus_dtype="bfloat16"` scores a bf16 copy
first (`jaxsim.search.bf16`), `method="ivf"|"hnsw"` searches through faiss
(`jaxsim.search.ann`). An index remembers the model that built it and refuses any other
(`jaxsim.search.model_check`); `save` / `load` use the folder of `jaxsim.search.storage`.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence, Union

import numpy as np
from jax.sharding import Mesh

from jaxsim.cpu import warn_if_bf16_emulated
from jaxsim.data.readers import read_sentences
from jaxsim.search import ann
from jaxsim.search.bf16 import bf16_corpus, bf16_top_k_search
from jaxsim.search.model_check import PROBE_SENTENCE, encode_checked
from jaxsim.search.storage import IndexFileError, read_ann, read_index, write_index
from jaxsim.search.topk import (
    DEFAULT_BLOCK_ROWS,
    DEFAULT_QUERY_BATCH,
    Layout,
    place_corpus,
    plan_layout,
    top_k_search,
)
from jaxsim.search.vectors import (
    SearchError,
    as_matrix,
    check_top_k,
    embed,
    model_ref,
    normalize_rows,
    sentence_list,
)
from jaxsim.sharding import make_mesh


@dataclasses.dataclass(frozen=True)
class IndexInfo:
    """What an index holds and which model made it (None fields: built from bare vectors)."""

    dim: int
    normalize: bool = True
    model: Optional[str] = None
    pooler: Optional[str] = None
    probe: Optional[tuple[float, ...]] = None
    method: str = "exact"  # or "ivf" / "hnsw": approximate, through faiss
    ann: Optional[dict] = None  # AnnOptions fields given at build time


CORPUS_DTYPES = ("float32", "bfloat16")


class TopK(NamedTuple):
    """Search results: scores [q, k] float32, best first; rows [q, k] int64 row numbers."""

    scores: np.ndarray
    rows: np.ndarray


class SearchIndex:
    """Unit vectors (plus their sentences) searched exactly by cosine on a device mesh.

    Rows live on the host (the source of truth, grown by `add`) and, from the first search on,
    as a row-sharded copy on the mesh, refreshed lazily after adds.
    """

    def __init__(self, info: IndexInfo, *, with_sentences: bool = True,
                 mesh: Optional[Mesh] = None, block_rows: int = DEFAULT_BLOCK_ROWS,
                 query_batch: int = DEFAULT_QUERY_BATCH, corpus_dtype: str = "float32"):
        """An empty index.

        Args:
          info: dimension, normalization and the model behind the vectors.
          with_sentences: every row carries its sentence (False: bare vectors).
          mesh: devices to shard the rows over (default: every device, one 'data' axis).
          block_rows: rows scored per scan step on each device.
          query_batch: queries per jitted call.
          corpus_dtype: "float32", or "bfloat16": the exact search scores a bf16 copy of the
            rows first and rescores the few candidates in float32, with the float32 result.
        """
        if corpus_dtype not in CORPUS_DTYPES:
            raise SearchError(f"corpus_dtype must be one of {', '.join(CORPUS_DTYPES)}; got "
                              f"{corpus_dtype!r}")
        if info.dim < 1:
            raise SearchError(f"index dimension must be positive, got {info.dim}")
        if block_rows < 1 or query_batch < 1:
            raise SearchError(f"block_rows and query_batch must be positive, got {block_rows}, "
                              f"{query_batch}")
        self.info = info
        self.mesh = make_mesh() if mesh is None else mesh
        self.block_rows, self.query_batch = block_rows, query_batch
        self.corpus_dtype = corpus_dtype
        warn_if_bf16_emulated(corpus_dtype, {d.platform for d in self.mesh.devices.flat})
        self.last_search_stats: dict = {}  # e.g. queries the bf16 pass sent back to float32
        self._buffer = np.empty((0, info.dim), np.float32)  # [capacity, dim], rows [:size] used
        self._size = 0
        self._sentences: Optional[list[str]] = [] if with_sentences else None
        self._placed = None  # (layout, corpus on the mesh) for the current rows
        ann.check_method(info.method)
        self._ann_options = ann.AnnOptions.from_dict(info.ann)
        self._ann = None  # the faiss structure over the current rows (approximate methods)

    @classmethod
    def from_vectors(cls, vectors: Any, sentences: Optional[Sequence[str]] = None, *,
                     normalize: bool = True, method: str = "exact",
                     ann_options: Optional[dict] = None, **options) -> "SearchIndex":
        """An index over precomputed vectors [n, dim] (with one sentence per row, or none)."""
        arr = as_matrix(vectors, "vectors")
        index = cls(IndexInfo(dim=arr.shape[1], normalize=normalize, method=method,
                              ann=ann_options),
                    with_sentences=sentences is not None, **options)
        index.add_vectors(arr, sentences)
        return index

    def __len__(self) -> int:
        return self._size

    @property
    def dim(self) -> int:
        return self.info.dim

    @property
    def vectors(self) -> np.ndarray:
        """The stored rows [n, dim] (unit norm when the index normalizes), read-only."""
        view = self._buffer[: self._size]
        view.flags.writeable = False
        return view

    @property
    def sentences(self) -> Optional[list[str]]:
        """The sentence of each row (a copy), or None for an index of bare vectors."""
        return None if self._sentences is None else list(self._sentences)

    def add_vectors(self, vectors: Any, sentences: Optional[Sequence[str]] = None) -> None:
        """Appends rows [m, dim] (normalized here when the index normalizes).

        Raises:
          VectorError: NaN/inf rows or another dimension (both named).
          SearchError: sentences missing, extra, or of another count than the rows.
        """
        arr = as_matrix(vectors, "vectors", self.dim)
        if (sentences is None) != (self._sentences is None):
            raise SearchError("this index stores one sentence per vector: pass sentences"
                              if sentences is None else
                              "this index stores bare vectors (built without sentences)")
        if sentences is not None:
            sentences = sentence_list(sentences, "sentences")
            if len(sentences) != len(arr):
                raise SearchError(f"{len(arr)} vectors but {len(sentences)} sentences")
        need = self._size + len(arr)
        self._reserve(need)
        rows = self._buffer[self._size: need]
        if self.info.normalize:
            normalize_rows(arr, out=rows)
        else:
            rows[:] = arr
        self._size = need
        if sentences is not None:
            self._sentences.extend(sentences)
        self._placed = self._ann = None

    def _layout(self, rows: int) -> Layout:
        return plan_layout(rows, self.dim, self.mesh.size, self.block_rows)

    def _reserve(self, rows: int) -> None:
        """Grows the host buffer to hold `rows` rows plus the padding of their mesh layout.

        The padding lives in the buffer itself, so placing the corpus on the mesh copies views
        of it and never builds a padded temporary. Growth at least doubles: adds in small
        pieces stay linear.
        """
        capacity = self._layout(rows).capacity
        if capacity > len(self._buffer):
            grown = np.empty((max(capacity, 2 * len(self._buffer)), self.dim), np.float32)
            grown[: self._size] = self._buffer[: self._size]
            self._buffer = grown

    def add(self, model: Any, sentences: Sequence[str], *, pooler: Optional[str] = None,
            batch_size: int = 64) -> None:
        """Encodes and appends sentences; refuses a model other than the index's."""
        items = sentence_list(sentences, "sentences")
        self.add_vectors(self.encode_checked(model, items, pooler=pooler,
                                             batch_size=batch_size), items)

    def encode_checked(self, model: Any, sentences: Sequence[str], *,
                       pooler: Optional[str] = None, batch_size: int = 64) -> np.ndarray:
        """Encodes sentences with `model`, first checking it is the model that built the index
        (`jaxsim.search.model_check.encode_checked`)."""
        return encode_checked(self.info, model, sentences, pooler=pooler, batch_size=batch_size)

    def search_vectors(self, queries: Any, top_k: int = 5, *,
                       approx_recall: Optional[float] = None) -> TopK:
        """Top-k rows by cosine (inner product if the index does not normalize).

        Args:
          queries: [q, dim] or [dim] vectors.
          top_k: results per query; fewer when the index holds fewer rows.
          approx_recall: None for the exact search; else `lax.approx_max_k`'s recall target
            (results it could not fill come back as row -1, score -inf).

        Returns:
          TopK with [q, min(top_k, len(index))] scores and rows, best first, ties lowest row
          first.
        """
        q = as_matrix(queries, "query vectors", self.dim)
        k = min(check_top_k(top_k), self._size)
        if approx_recall is not None and not 0.0 < approx_recall <= 1.0:
            raise SearchError(f"approx_recall must be in (0, 1] or None, got {approx_recall}")
        if approx_recall is not None and self.info.method != "exact":
            raise SearchError(f"approx_recall applies to the exact method's device search; "
                              f"this index searches by {self.info.method}")
        if k == 0 or len(q) == 0:
            return TopK(np.zeros((len(q), k), np.float32), np.zeros((len(q), k), np.int64))
        if self.info.normalize:
            q = normalize_rows(q)
        if self.info.method != "exact":
            scores, rows = ann.search(self._ann_structure(), self.info.method,
                                      self._ann_options, q, k)
        else:
            scores, rows = self._exact_top_k(q, k, approx_recall)
        invalid = (rows < 0) | (rows >= self._size)  # only an approximate search leaves these
        scores[invalid], rows[invalid] = -np.inf, -1
        return TopK(scores, rows)

    def tune(self, **search_options) -> None:
        """Sets an approximate index's search-time options (nprobe for ivf, ef_search for
        hnsw) without rebuilding it; saved with the index."""
        unknown = sorted(set(search_options) - {"nprobe", "ef_search"})
        if self.info.method == "exact" or unknown:
            raise SearchError(f"tune takes nprobe / ef_search of an approximate index; got "
                              f"{unknown or sorted(search_options)} for method {self.info.method}")
        options = {**(self.info.ann or {}), **search_options}
        self._ann_options = ann.AnnOptions.from_dict(options)
        self.info = dataclasses.replace(self.info, ann=options)

    def _ann_structure(self):
        if self._ann is None:
            self._ann = ann.build(self.info.method, self.vectors, self._ann_options)
        return self._ann

    def _exact_top_k(self, q: np.ndarray, k: int, recall: Optional[float]):
        if self._placed is None:
            layout = self._layout(self._size)
            self._reserve(self._size)
            rows = self._buffer[: layout.capacity]
            rows[self._size:] = 0.0  # padding rows: finite, masked
            bits, norms = None, None
            if self.corpus_dtype == "bfloat16":
                low, norms = bf16_corpus(rows)
                bits = place_corpus(low, self.mesh, layout)
            self._placed = (layout, place_corpus(rows, self.mesh, layout), bits, norms)
        layout, corpus, bits, norms = self._placed
        self.last_search_stats = {}
        if bits is not None and recall is None:
            return bf16_top_k_search(corpus, bits, norms, layout, self.mesh, self._size, q, k,
                                     query_batch=self.query_batch, stats=self.last_search_stats)
        return top_k_search(corpus, layout, self.mesh, self._size, q, k,
                            query_batch=self.query_batch, recall_target=recall)

    def search(self, model: Any, queries: Union[str, Sequence[str]], *,
               threshold: Optional[float] = 0.6, top_k: int = 5, pooler: Optional[str] = None,
               batch_size: int = 64, approx_recall: Optional[float] = None):
        """Sentences most similar to each query, like the official SimCSE tool's `search`.

        Args:
          model: the model that built the index (checked).
          queries: a sentence or a list of sentences.
          threshold: keep results with cosine >= threshold; None keeps all.
          top_k: at most this many results per query.
          pooler: pooler (default: the index's; another one is refused).
          batch_size: sentences per encoding batch.
          approx_recall: see `search_vectors`.

        Returns:
          For a single sentence, a list of (sentence, score), best first (ties: earlier row
          first); for a list of queries, one such list per query.
        """
        single = isinstance(queries, str)
        items = sentence_list([queries] if single else queries, "queries", allow_blank=False)
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(
                threshold, (int, float, np.integer, np.floating)) or not np.isfinite(threshold)):
            raise SearchError(f"threshold must be a finite number or None, got {threshold!r}")
        check_top_k(top_k)
        if self._sentences is None:
            raise SearchError("this index stores bare vectors, no sentences: use search_vectors")
        if not items:
            return []
        hits = self.search_vectors(
            self.encode_checked(model, items, pooler=pooler, batch_size=batch_size), top_k,
            approx_recall=approx_recall)
        results = [[(self._sentences[r], float(s)) for s, r in zip(scores, rows)
                    if r >= 0 and (threshold is None or s >= threshold)]
                   for scores, rows in zip(hits.scores, hits.rows)]
        return results[0] if single else results

    def save(self, folder: Union[str, os.PathLike], overwrite: bool = False,
             what: str = "index folder") -> Path:
        """Writes the index into `folder` (`jaxsim.search.storage`); an existing index there is
        replaced only with `overwrite`, any other non-empty folder never."""
        meta = {"count": self._size, "has_sentences": self._sentences is not None,
                **dataclasses.asdict(self.info)}
        structure = (ann.to_bytes(self._ann_structure())
                     if self.info.method != "exact" and self._size else None)
        return write_index(folder, meta, self._buffer[: self._size], self._sentences,
                           overwrite=overwrite, what=what, ann=structure)

    @classmethod
    def load(cls, folder: Union[str, os.PathLike], **options) -> "SearchIndex":
        """Reads an index written by `save` (options as for the constructor).

        Raises:
          IndexFileError: a missing or inconsistent file, named with the line at fault.
        """
        meta, vectors, sentences = read_index(folder)
        info = IndexInfo(**{f.name: meta[f.name] for f in dataclasses.fields(IndexInfo)})
        if info.probe is not None:
            info = dataclasses.replace(info, probe=tuple(info.probe))
        index = cls(info, with_sentences=sentences is not None, **options)
        index._reserve(len(vectors))
        index._buffer[: len(vectors)] = vectors
        index._size, index._sentences = len(vectors), sentences
        structure = read_ann(folder) if info.method != "exact" else None
        if structure is not None:
            index._ann = ann.from_bytes(structure)
            if index._ann.ntotal != len(vectors) or index._ann.d != info.dim:
                raise IndexFileError(f"{folder}/ann.faiss: holds {index._ann.ntotal} rows of "
                                     f"dimension {index._ann.d}, index.json says {len(vectors)} "
                                     f"of dimension {info.dim}")
        return index


def build_index(model: Any, sentences_or_file: Union[str, os.PathLike, Sequence[str]], *,
                pooler: Optional[str] = None, batch_size: int = 64, normalize: bool = True,
                method: str = "exact", ann_options: Optional[dict] = None,
                **options) -> SearchIndex:
    """Encodes sentences (a list, or a file path with one sentence a line) into an index.

    Like the official SimCSE tool, a string is a file path. `method`: "exact" (the sharded
    device search), or "ivf" / "hnsw" (approximate, through faiss; `ann_options` are
    `jaxsim.search.ann.AnnOptions` fields). `options` go to `SearchIndex` (mesh, block_rows,
    query_batch).
    """
    ann.check_method(method)
    ann.AnnOptions.from_dict(ann_options)  # bad options fail before the encoding
    if isinstance(sentences_or_file, (str, os.PathLike)):
        sentences = read_sentences(sentences_or_file)
    else:
        sentences = sentence_list(sentences_or_file, "sentences")
    ref = model_ref(model, pooler)
    vecs = embed(model, [PROBE_SENTENCE, *sentences], pooler=ref.pooler, batch_size=batch_size)
    # A local folder is recorded absolute, so a command line run elsewhere can reload it.
    path = os.path.abspath(ref.path) if os.path.exists(ref.path) else ref.path
    info = IndexInfo(dim=vecs.shape[1], normalize=normalize, model=path, pooler=ref.pooler,
                     probe=tuple(float(f"{x:.7g}") for x in vecs[0]), method=method,
                     ann=ann_options)
    index = SearchIndex(info, **options)
    index.add_vectors(vecs[1:], sentences)
    return index


def load_index(folder: Union[str, os.PathLike], **options) -> SearchIndex:
    """`SearchIndex.load`."""
    return SearchIndex.load(folder, **options)
