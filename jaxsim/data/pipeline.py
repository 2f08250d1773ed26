"""The streamed training input: source -> global order -> this process's rows -> tokenize.

Each process reads and tokenizes only the examples of its own rows of each global batch
(`batching.EpochOrder` decides the global batches; `batching.process_rows` the rows), in
background threads that work a few batches ahead (grain's `MapDataset` over batch positions,
prefetched by `to_iter_dataset`). Memory and start-up do not grow with the corpus: nothing is
read or tokenized before it is needed. The position (epoch, step) is what a checkpoint saves;
resuming rebuilds the pipeline at that position, so a resumed run sees exactly the batches of
an uninterrupted one.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import threading
from typing import Any, Callable, Mapping, Optional

import grain
import numpy as np

from jaxsim.data.batching import EpochOrder, IteratorState, process_rows, tokenize_examples

# Rows of a global batch of a given size that this process feeds.
RowsFn = Callable[[int], np.ndarray]
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


class StreamIterator:
    """Yields this process's rows of each global batch, read and tokenized ahead of use.

    Args:
      source: a random-access source (`jaxsim.data.sources`): len() and example i as a tuple
        of sentences; `name` for messages.
      tokenizer: a `transformers` tokenizer.
      max_len: tokens per sentence (fixed padded length).
      global_batch, seed, shuffle, last_batch, granularity: as `batching.EpochOrder`.
      process_index / process_count: this process's rows (its block of each global batch),
        unless `rows_fn` says which rows of a global batch of a given size it feeds (then
        `granularity` alone decides how a kept last batch is rounded).
      workers: threads that read and tokenize.
      prefetch: batches prepared ahead.
    """

    def __init__(self, source, tokenizer, max_len: int, global_batch: int, seed: int = 0,
                 process_index: int = 0, process_count: int = 1, shuffle: bool = True,
                 last_batch: str = 'drop', granularity: int = 1,
                 rows_fn: Optional[RowsFn] = None, workers: Optional[int] = None,
                 prefetch: int = 4):
        self.source = source
        # Rows from `rows_fn` follow the mesh, whose batch shards `granularity` already counts
        # (processes that differ only along a tensor axis feed the same rows).
        self.order = EpochOrder(len(source), global_batch, seed, shuffle, last_batch,
                                granularity, process_count if rows_fn is None else 1)
        self.rows_fn = rows_fn or (lambda size: process_rows(size, process_index, process_count))
        self.tokenize = _ThreadTokenizer(tokenizer, max_len, source.name)
        self.workers = workers or min(4, os.cpu_count() or 1)
        self.prefetch = prefetch
        self.state = IteratorState()
        self._it = None

    @property
    def num_examples(self) -> int:
        return self.order.num_examples

    @property
    def steps_per_epoch(self) -> int:
        return self.order.steps_per_epoch

    @property
    def dropped_per_epoch(self) -> int:
        return self.order.dropped_per_epoch

    def batch(self, epoch: int, step: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch `step` of `epoch`, tokenized:
        int32 [rows, views, max_len] per field."""
        rows = self.rows_fn(self.order.batch_size(step))
        indices = [int(i) for i in self.order.examples(epoch, step, rows)]
        getitems = getattr(self.source, 'getitems', None)  # one read for the batch
        return self.tokenize(getitems(indices) if getitems else
                             [self.source[i] for i in indices])

    def _batch_at(self, position: int) -> dict[str, np.ndarray]:
        return self.batch(*divmod(position, self.steps_per_epoch))

    def get_state(self) -> dict[str, int]:
        return dataclasses.asdict(self.state)

    def set_state(self, state: Mapping[str, Any]) -> None:
        self.close()
        self.state = IteratorState(epoch=int(state['epoch']), step=int(state['step']))

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.state.step >= self.steps_per_epoch:
            self.state = IteratorState(self.state.epoch + 1, 0)
        if self._it is None:
            start = self.state.epoch * self.steps_per_epoch + self.state.step
            batches = grain.MapDataset.range(start, _NO_END).map(self._batch_at)
            self._it = iter(batches.to_iter_dataset(grain.ReadOptions(
                num_threads=self.workers, prefetch_buffer_size=self.prefetch)))
        out = next(self._it)
        self.state = IteratorState(self.state.epoch, self.state.step + 1)
        return out

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
