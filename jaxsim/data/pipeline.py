"""The streamed training input: source -> global order -> this process's rows -> tokenize.

Each process reads and tokenizes only the examples of its own rows of each global batch
(`batching.EpochOrder` decides the global batches; `batching.process_rows` the rows), in
background threads that work a few batches ahead (grain's `MapDataset` over batch positions,
prefetched by `to_iter_dataset`). Memory and start-up do not grow with the corpus: nothing is
read or tokenized before it is needed. The position (epoch, examples taken) is what a
checkpoint saves; resuming rebuilds the pipeline at that position, so a resumed run sees
exactly the batches of an uninterrupted one (and, with another batch size, goes on from the
same example).
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
from jaxsim.data.readers import DataError

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

    Args:
      source: a random-access source (`jaxsim.data.sources`): len() and example i as a tuple
        of sentences; `name` for messages.
      tokenizer: a `transformers` tokenizer.
      max_len: tokens per sentence (fixed padded length).
      global_batch, seed, process_index, process_count, shuffle, last_batch, granularity,
        rows_fn: as `batching.OrderedIterator`.
      workers: threads that read and tokenize.
      prefetch: batches prepared ahead.
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
            import grain  # by the first batch: ~0.2 s of the start-up of commands that read none
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
    text = json.dumps(spec, sort_keys=True, separators=(',', ':'), ensure_ascii=False)
    return 'sha256:' + hashlib.sha256(text.encode()).hexdigest()


def data_digest(source, tokenizer, max_len: int) -> str:
    """Identifies the training input: the source's content digest (computed once with its
    index), the tokenizer and the padded length. No sentence is tokenized for it."""
    text = json.dumps({'source': source.fingerprint(), 'tokenizer': tokenizer_digest(tokenizer),
                       'max_len': max_len, 'views': source.views}, sort_keys=True)
    return 'sha256:' + hashlib.sha256(text.encode()).hexdigest()
