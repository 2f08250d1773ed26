"""The streamed training input: source -> global order -> this process's rows -> tokenize.

Each process reads and tokenizes only its rows of each global batch, in background threads a
few batches ahead (grain's `MapDataset` over batch positions); see docs/training.md.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
from typing import Optional

import numpy as np

from jaxsim.data.batching import OrderedIterator, tokenize_examples
from jaxsim.data.readers import DataError, sha256_json

_NO_END = 2**62  # the batch positions run on across epochs until the loop stops


class _ThreadTokenizer:
    """Tokenizes on any thread: a `transformers` fast tokenizer sets its truncation state on
    every call, which is not safe to share between threads, so each thread gets its own copy."""

    def __init__(self, tokenizer, max_len: int, name: str):
        self.tokenizer, self.max_len, self.name = tokenizer, max_len, name
        self._local = threading.local()

    def __call__(self, rows) -> dict[str, np.ndarray]:
        tok = getattr(self._local, 'tokenizer', None)
        if tok is None:
            tok = self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return tokenize_examples(tok, rows, self.max_len, self.name, log_truncated=False)


class StreamIterator(OrderedIterator):
    """Yields this process's rows of each global batch, read and tokenized ahead of use.

    `source` is a random-access source (`jaxsim.data.sources`); `workers` threads read and
    tokenize `prefetch` batches ahead; the other arguments are `batching.OrderedIterator`'s.
    """

    def __init__(self, source, tokenizer, max_len: int, global_batch: int,
                 workers: Optional[int] = None, prefetch: int = 4, **kwargs):
        try:
            super().__init__(len(source), global_batch, **kwargs)
        except DataError as e:  # too few examples: say which data
            raise DataError(f'{source.name}: {e}') from None
        self.source = source
        self.tokenize = _ThreadTokenizer(tokenizer, max_len, source.name)
        self.workers = workers or min(4, os.cpu_count() or 1)
        self.prefetch = prefetch
        self._it = None

    def read(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """The examples at `indices`, tokenized: int32 [rows, views, max_len] per field."""
        indices = [int(i) for i in indices]
        getitems = getattr(self.source, 'getitems', None)  # one read for the batch
        return self.tokenize(getitems(indices) if getitems else
                             [self.source[i] for i in indices])

    def _next_batch(self) -> dict[str, np.ndarray]:
        if self._it is None:
            import grain  # by the first batch: not in the start-up of commands that read none
            start = self.state  # batch k is the k-th from here (`__next__` wrapped the epoch)
            batches = grain.MapDataset.range(0, _NO_END).map(
                lambda k: self.batch_at(*self.locate(start, k)))
            self._it = iter(batches.to_iter_dataset(grain.ReadOptions(
                num_threads=self.workers, prefetch_buffer_size=self.prefetch)))
        return next(self._it)

    def close(self) -> None:
        """Stops the background threads (the next batch restarts them at the position)."""
        it, self._it = self._it, None
        if it is not None and hasattr(it, 'close'):
            it.close()


def tokenizer_digest(tokenizer) -> str:
    """sha256 of what decides the token ids: the fast tokenizer's definition (without the
    per-call truncation/padding state), else its vocabulary and class."""
    backend = getattr(tokenizer, 'backend_tokenizer', None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop('truncation', None)
        spec.pop('padding', None)
    else:
        spec = {'class': type(tokenizer).__name__, 'vocab': sorted(tokenizer.get_vocab().items())}
    return sha256_json(spec)


def data_digest(source, tokenizer, max_len: int) -> str:
    """Identifies the training input: the source's content digest (computed once with its
    index), the tokenizer and the padded length. No sentence is tokenized for it."""
    text = json.dumps({'source': source.fingerprint(), 'tokenizer': tokenizer_digest(tokenizer),
                       'max_len': max_len, 'views': source.views}, sort_keys=True)
    return 'sha256:' + hashlib.sha256(text.encode()).hexdigest()
