"""Merges requests that arrive within a few milliseconds into one encode and one top-k
(docs/serve.md, "Batching").

Why: one encode of 32 sentences costs far less than 32 encodes of one (per-call dispatch, small
matrix products that leave cores idle), so throughput under concurrent load grows with the
batch while a lone request waits only `window_s` more. The queue is bounded (`BatcherBusy`),
and `close` fails the requests still waiting (`BatcherClosed`), so no caller waits forever.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
import threading
import time
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

from jaxsim.encode import EncodeFn
from jaxsim.errors import JaxsimError

# search(vectors [q, dim], k) -> (scores, rows) [q, k].
SearchFn = Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]


class BatcherBusy(JaxsimError):
    """The request queue is full: the caller should retry later."""


class BatcherClosed(JaxsimError):
    """The batcher is shut down (or not started): no more requests are served."""


class Result(NamedTuple):
    """One request's share of a batch: vectors [n, dim]; scores/rows [n, top_k] or None."""

    vectors: np.ndarray
    scores: Optional[np.ndarray] = None
    rows: Optional[np.ndarray] = None


@dataclasses.dataclass
class _Request:
    sentences: list[str]
    top_k: int  # 0: encode only
    future: concurrent.futures.Future


@dataclasses.dataclass
class BatcherStats:
    """Counts since start: requests served, device calls made, largest batch (sentences)."""

    requests: int = 0
    batches: int = 0
    largest_batch: int = 0


class Batcher:
    """A worker thread that serves encode/search requests in merged batches (see module doc)."""

    def __init__(self, encode: EncodeFn, search: SearchFn, *, window_s: float = 0.005,
                 max_batch: int = 256, max_queue: int = 1024, enabled: bool = True):
        """Args:
          encode: sentences -> vectors, called from the worker thread only.
          search: (vectors, k) -> (scores, rows), called from the worker thread only.
          window_s: how long the worker keeps collecting after the first waiting request.
          max_batch: most sentences in one batch (a larger single request runs alone).
          max_queue: most requests waiting; more are refused with BatcherBusy.
          enabled: False serves one request per device call (for comparison).
        """
        # `not 0 <= w < inf` also refuses NaN: a window that never ends would keep the worker
        # waiting for ever after a lone request.
        if not 0 <= window_s < math.inf or max_batch < 1 or max_queue < 1:
            raise ValueError(f"window_s must be a finite number >= 0 and max_batch, max_queue "
                             f"positive; got {window_s}, {max_batch}, {max_queue}")
        self._encode, self._search = encode, search
        self.window_s, self.max_batch, self.max_queue = window_s, max_batch, max_queue
        self.enabled = enabled
        self.stats = BatcherStats()
        self._queue: collections.deque[_Request] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    # --------------------------------------------------------------------------- lifecycle
    def start(self) -> "Batcher":
        with self._cond:
            if self._closed:
                raise BatcherClosed("the batcher was closed; make a new one")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="jaxsim-batcher",
                                                daemon=True)
                self._thread.start()
        return self

    def close(self, timeout: Optional[float] = None) -> None:
        """Stops taking requests, fails those still queued, waits for the batch in flight."""
        with self._cond:
            self._closed = True
            waiting = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for request in waiting:
            if request.future.set_running_or_notify_cancel():  # False: its caller gave up
                request.future.set_exception(BatcherClosed("the server is shutting down"))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> "Batcher":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------ submit
    def submit(self, sentences: Sequence[str], top_k: int = 0) -> concurrent.futures.Future:
        """Queues a request; its future resolves to a `Result`.

        Raises:
          BatcherBusy: `max_queue` requests are already waiting.
          BatcherClosed: the batcher is closed.
        """
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        request = _Request(list(sentences), int(top_k), concurrent.futures.Future())
        with self._cond:
            if self._closed:
                raise BatcherClosed("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise BatcherBusy(f"server busy: {len(self._queue)} requests are waiting "
                                  f"(the queue limit); retry later")
            self._queue.append(request)
            self._cond.notify()
        return request.future

    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    # ------------------------------------------------------------------------------ worker
    def _take_batch(self) -> list[_Request]:
        """Blocks for the next batch: the oldest request plus those that join within the
        window, up to max_batch sentences (never splitting a request). Empty when closed."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return []
            batch = [self._queue.popleft()]
            if not self.enabled:
                return batch
            size = len(batch[0].sentences)
            deadline = time.monotonic() + self.window_s
            while size < self.max_batch:
                if not self._queue:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._closed:
                        break
                    self._cond.wait(left)
                    continue
                if size + len(self._queue[0].sentences) > self.max_batch:
                    break
                request = self._queue.popleft()
                batch.append(request)
                size += len(request.sentences)
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take_batch()
            if not batch:
                return
            # A caller may have cancelled while waiting; its rows are simply not computed.
            batch = [r for r in batch if r.future.set_running_or_notify_cancel()]
            if not batch:
                continue
            try:
                results = self._serve(batch)
            except Exception as e:  # noqa: BLE001 - every waiting caller must hear of it
                for request in batch:
                    request.future.set_exception(e)
                continue
            for request, result in zip(batch, results):
                request.future.set_result(result)

    def _serve(self, batch: list[_Request]) -> list[Result]:
        """One encode over every sentence of the batch, one top-k over the searching rows."""
        sentences = [s for r in batch for s in r.sentences]
        parts = np.split(self._encode(sentences), np.cumsum([len(r.sentences) for r in batch])[:-1])
        searching = [i for i, r in enumerate(batch) if r.top_k > 0]
        results = [Result(p) for p in parts]
        if searching:
            k = max(batch[i].top_k for i in searching)
            scores, rows = self._search(np.concatenate([parts[i] for i in searching]), k)
            cuts = np.cumsum([len(parts[i]) for i in searching])[:-1]
            for i, s, r in zip(searching, np.split(scores, cuts), np.split(rows, cuts)):
                results[i] = Result(parts[i], s[:, :batch[i].top_k], r[:, :batch[i].top_k])
        self.stats.requests += len(batch)
        self.stats.batches += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(sentences))
        return results
