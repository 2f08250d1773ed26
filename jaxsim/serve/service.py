"""What the server serves, without HTTP: a loaded index and its model behind a `Batcher`.

`open_service` loads the index and its model and checks, once, that it is the model that built
the index; `search`, `encode` and `similarity` are coroutines that wait on the batcher's future
without blocking the event loop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import os
from typing import Any, Optional, Union

import numpy as np

from jaxsim.data.tokenize import bucket_length
from jaxsim.formats.hf_folder import ModelLoadError
from jaxsim.formats.pretrained import load_pretrained
from jaxsim.search.index import SearchIndex, load_index
from jaxsim.search.vectors import SearchError, embed, normalize_rows
from jaxsim.serve.batcher import Batcher


@dataclasses.dataclass(frozen=True)
class ServeLimits:
    """What one request may ask, and how requests are batched.

    Attributes:
      max_sentences: sentences (queries, or queries + keys) in one request.
      max_chars: characters in one sentence (the model truncates tokens anyway; this bounds
        tokenization work).
      max_top_k: results per query.
      max_body_bytes: size of a request body.
      max_batch: sentences in one merged encode.
      max_queue: requests waiting for the device; more get 503.
      window_ms: how long a batch keeps collecting after its first request.
    """

    max_sentences: int = 64
    max_chars: int = 2000
    max_top_k: int = 100
    max_body_bytes: int = 1_000_000
    max_batch: int = 256
    max_queue: int = 1024
    window_ms: float = 5.0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            # NaN passes every comparison, and a NaN or infinite window keeps the batcher
            # waiting for ever: no request would be answered.
            if not math.isfinite(value):
                raise ValueError(f"{field.name} must be a finite number, got {value}")
            if value < (0 if field.name == "window_ms" else 1):
                raise ValueError(f"{field.name} must be positive, got {value}")
        if self.max_sentences > self.max_batch:
            raise ValueError(f"max_sentences ({self.max_sentences}) must not exceed max_batch "
                             f"({self.max_batch}): a request is never split across batches")


# Encode batches are padded to one of these row counts; more sentences go through `encode` in
# length-sorted batches of the largest. Top-k widths are padded to a power of two >= 16. So a
# few shapes compile, once each (`warm_up`). Why 8 rows at most: each batch pads to its longest
# sentence, and on CPU batches of 8 encoded the most sentences a second (docs/performance.md,
# "Figures the code relies on").
ROW_BUCKETS = (1, 2, 4, 8)
MIN_K_BUCKET = 16


def _rows_bucket(n: int) -> int:
    return next((b for b in ROW_BUCKETS if b >= n), ROW_BUCKETS[-1])


def _k_bucket(k: int, rows: int) -> int:
    return min(rows, max(MIN_K_BUCKET, 1 << (k - 1).bit_length()))


class SearchService:
    """An index and its model, served through a batcher. Start with `start`, end with `close`."""

    def __init__(self, index: SearchIndex, model: Any, *, limits: ServeLimits = ServeLimits(),
                 batching: bool = True):
        self.index, self.model, self.limits = index, model, limits
        self.pooler = index.info.pooler
        self._sentences = index.sentences  # one copy; the served index never grows
        self.batcher = Batcher(self._encode, self._search, window_s=limits.window_ms / 1000,
                               max_batch=limits.max_batch, max_queue=limits.max_queue,
                               enabled=batching)

    # Called on the batcher's thread only.
    def _encode(self, sentences: list[str]) -> np.ndarray:
        rows = _rows_bucket(len(sentences))
        return embed(self.model, sentences, pooler=self.pooler, batch_size=rows)

    def _search(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        # Columns past k are extra; the batcher hands each request its own top_k.
        return self.index.search_vectors(vectors, _k_bucket(k, len(self.index)))

    def warm_up(self, max_tokens: int = 64) -> None:
        """Compiles, before any request waits for it, the encode shapes of every row bucket for
        sentences of up to `max_tokens` tokens (0: the one-query shape only) and the top-k
        shapes of up to 64 queries (cached on disk by JAX's compilation cache)."""
        if not len(self.index):
            return
        longest = min(max_tokens, self.model.max_length())
        lengths = sorted({bucket_length(n, longest) for n in range(8, longest + 1)}) or [2]
        for rows in ROW_BUCKETS:
            for tokens in lengths:  # "a" is one word piece: [CLS] + a * (n - 2) + [SEP]
                vectors = self._encode([" ".join(["a"] * (tokens - 2))] * rows)
                if not max_tokens:
                    self._search(vectors, 1)
                    return
        for queries in (8, 16, 32, 64):
            self._search(np.repeat(vectors[:1], queries, axis=0), 1)

    def start(self) -> "SearchService":
        """Starts the batcher (requests are served from now on)."""
        self.batcher.start()
        return self

    def close(self) -> None:
        self.batcher.close()

    def describe(self) -> dict:
        """What /health reports: model, pooler, rows, limits, and requests/batches served."""
        return {"model": self.index.info.model or str(self.model.path), "pooler": self.pooler,
                "rows": len(self.index), "dim": self.index.dim, "batching": self.batcher.enabled,
                "queued": self.batcher.queued(), "served": dataclasses.asdict(self.batcher.stats),
                "limits": dataclasses.asdict(self.limits)}

    async def _submit(self, sentences: list[str], top_k: int = 0):
        return await asyncio.wrap_future(self.batcher.submit(sentences, top_k))

    async def search(self, queries: list[str], top_k: int,
                     threshold: Optional[float]) -> list[list[dict]]:
        """Per query, {'sentence', 'score', 'row'} dicts best first with score >= threshold."""
        if not len(self.index):
            return [[] for _ in queries]
        result = await self._submit(queries, min(top_k, len(self.index)))
        return [[{"sentence": self._sentences[r], "score": float(s), "row": int(r)}
                 for s, r in zip(scores, rows)
                 if r >= 0 and (threshold is None or s >= threshold)]
                for scores, rows in zip(result.scores, result.rows)]

    async def encode(self, sentences: list[str], normalize: bool) -> np.ndarray:
        vectors = (await self._submit(sentences)).vectors
        return normalize_rows(vectors) if normalize else vectors

    async def similarity(self, queries: list[str], keys: list[str]) -> np.ndarray:
        """Cosines [len(queries), len(keys)]; both sides share one encode."""
        vectors = normalize_rows((await self._submit(queries + keys)).vectors)
        return vectors[: len(queries)] @ vectors[len(queries):].T


def open_service(index_dir: Union[str, os.PathLike], model: Optional[str] = None, *,
                 limits: ServeLimits = ServeLimits(), batching: bool = True) -> SearchService:
    """Loads an index and its model (default: the one the index records) and checks them.

    Raises:
      IndexFileError: the folder is not a readable index.
      SearchError: the index holds bare vectors or no sentences, and no model can encode.
      ModelMismatchError: `model` is not the model that built the index.
    """
    index = load_index(index_dir)
    if index.info.pooler is None or index.sentences is None:
        raise SearchError(f"{index_dir}: the index was built from bare vectors; serve an index "
                          f"built with `python -m jaxsim index`")
    try:
        encoder = load_pretrained(model or index.info.model, pooler=index.info.pooler)
    except ModelLoadError as e:
        if model is not None:
            raise
        # A model folder moved or deleted since indexing: say where the path came from.
        raise ModelLoadError(f"{e} (the model {index_dir} records; pass --model to serve "
                             f"with that model from elsewhere)") from None
    index.encode_checked(encoder, [])  # encodes the probe: refuses another model now
    return SearchService(index, encoder, limits=limits, batching=batching)
