"""Sentence vectors for an evaluation: each distinct sentence encoded once, looked up by text.

Encoding is the expensive part of an evaluation: sentences are de-duplicated across tasks,
fit sets and calibrations, encoded once, and every calibration (a row-wise map) is applied
to the matrix of unique sentences.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from jaxsim.encode import EncodeFn
from jaxsim.errors import JaxsimError


class EncodeError(JaxsimError):
    """An encode function returned vectors that cannot be scored."""


class CachedEncoder:
    """Wraps an `encode_fn` (list of N sentences -> [N, D]) so each distinct text is encoded
    once.

    One instance belongs to one (model, pooler, max_length, dtype): the cache key is the text.
    `seconds` accumulates the time spent inside `encode_fn`.
    """

    def __init__(self, encode_fn: EncodeFn):
        self._encode_fn = encode_fn
        self._cache: dict[str, np.ndarray] = {}
        self.seconds = 0.0
        self.num_encoded = 0

    def __call__(self, sentences: Sequence[str]) -> np.ndarray:
        sentences = list(sentences)
        todo = list(dict.fromkeys(s for s in sentences if s not in self._cache))
        if todo:
            t0 = time.perf_counter()
            out = np.asarray(self._encode_fn(todo), np.float32)
            self.seconds += time.perf_counter() - t0
            if out.ndim != 2 or out.shape[0] != len(todo):
                raise EncodeError(f'encode_fn returned shape {out.shape} for {len(todo)} sentences')
            if not np.isfinite(out).all():
                bad = int(np.flatnonzero(~np.isfinite(out).all(axis=1))[0])
                raise EncodeError(f'encode_fn returned NaN/inf for sentence {todo[bad]!r:.80}')
            self._cache.update(zip(todo, out))
            self.num_encoded += len(todo)
        if not sentences:
            return np.zeros((0, 0), np.float32)
        return np.stack([self._cache[s] for s in sentences])


@dataclasses.dataclass(frozen=True)
class EmbeddingTable:
    """Unique sentences and their vectors [U, D]: `matrix[index[text]]`."""

    index: dict[str, int]
    matrix: np.ndarray

    @classmethod
    def build(cls, encoder: EncodeFn, sentences: Sequence[str]) -> 'EmbeddingTable':
        unique = list(dict.fromkeys(sentences))
        return cls({s: i for i, s in enumerate(unique)}, np.asarray(encoder(unique)))

    def lookup(self, sentences: Sequence[str]) -> np.ndarray:
        """[N, D] vectors of N sentences (each must be in the table)."""
        return self.matrix[np.asarray([self.index[s] for s in sentences], np.int64)]

    def subset(self, sentences: Sequence[str]) -> 'EmbeddingTable':
        """The table restricted to the distinct `sentences`."""
        return EmbeddingTable.build(self.lookup, sentences)

    def replace(self, matrix: np.ndarray) -> 'EmbeddingTable':
        """The same sentences with new vectors (e.g. calibrated), row for row."""
        matrix = np.asarray(matrix)
        if matrix.shape[0] != self.matrix.shape[0]:
            raise EncodeError(f'{matrix.shape[0]} rows for a table of {self.matrix.shape[0]}')
        return EmbeddingTable(self.index, matrix)
